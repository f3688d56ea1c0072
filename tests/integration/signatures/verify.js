// An independent RFC 9421 verifier for tally's requests: the npm package
// `http-message-signatures` (httpbis.verifyMessage, its hmac-sha256 verifier) checks the
// signature, Node's crypto checks the RFC 9530 Content-Digest. Reads
// {"keys": {"<key id>": "<secret>"}, "requests": [{"method", "url", "headers", "body_b64"}]}
// on stdin and prints one {"ok": bool, "error": str|null} per request on stdout.
"use strict";
const crypto = require("node:crypto");
const { httpbis, createVerifier } = require("http-message-signatures");

const REQUIRED = ["@method", "@target-uri", "idempotency-key", "tally-run-id", "tally-effect-id"];

async function verifyOne(keys, r) {
  const headers = {};
  for (const [k, v] of Object.entries(r.headers)) headers[k.toLowerCase()] = v;
  const body = Buffer.from(r.body_b64 || "", "base64");
  const required = REQUIRED.filter((f) => f.startsWith("@") || f in headers);
  if (body.length > 0) {
    required.push("content-digest");
    const want = "sha-256=:" + crypto.createHash("sha256").update(body).digest("base64") + ":";
    if (headers["content-digest"] !== want) return { ok: false, error: "content-digest mismatch" };
  }
  const ok = await httpbis.verifyMessage(
    {
      keyLookup: async (params) => {
        if (!(params.keyid in keys)) return null;
        return {
          id: params.keyid,
          algs: ["hmac-sha256"],
          verify: createVerifier(Buffer.from(keys[params.keyid]), "hmac-sha256"),
        };
      },
      requiredParams: ["created", "expires", "keyid"],
      requiredFields: required,
      maxAge: 300,
      tolerance: 5,
    },
    { method: r.method, url: r.url, headers },
  );
  return { ok: ok === true, error: ok === true ? null : `verifyMessage returned ${ok}` };
}

async function main() {
  let input = "";
  for await (const chunk of process.stdin) input += chunk;
  const { keys, requests } = JSON.parse(input);
  const out = [];
  for (const r of requests) {
    try {
      out.push(await verifyOne(keys, r));
    } catch (e) {
      out.push({ ok: false, error: `${e.name}: ${e.message}` });
    }
  }
  process.stdout.write(JSON.stringify(out) + "\n");
}

main().catch((e) => {
  process.stderr.write(String(e && e.stack) + "\n");
  process.exit(2);
});
