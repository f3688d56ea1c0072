"""RFC 9421 request signatures (issue 23, "Signatures over the whole request"): a tool
configured with `connector.signing` gets every request signed over its method, target URI,
Content-Digest, idempotency key and tally ids; tally-fake-tool's verifier (written from the
RFCs, sharing no code with tally) accepts them and refuses a captured request replayed with
another Idempotency-Key, path or method; keys rotate with two ids valid at once; and an
independent implementation, the npm package `http-message-signatures`, verifies what tally
sent."""

import base64
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import urllib.parse
import uuid

from dispatchcase import DispatchCase, main, run_id
from tallytest import SOURCE_DIR, wait_for

K1, K2 = "sig-k1-secret-\u00e9t\u00e9", "sig-k2-secret"
NODE_VERIFIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "signatures",
                             "verify.js")


def registry(key_id, legacy=False):
    """demo.json with charge_card signed by RFC 9421 key `key_id` (its secret in
    $BILLING_SIG_<key_id>); the legacy secret_env only when `legacy`."""
    with open(os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")) as f:
        doc = json.load(f)
    for tool in doc["tools"]:
        if tool["name"] == "charge_card":
            conn = tool["connector"]
            if not legacy:
                conn.pop("secret_env", None)
            conn["signing"] = {"scheme": "rfc9421", "key_id": key_id,
                               "secret_env": "BILLING_SIG_" + key_id.upper().replace("-", "_")}
            conn["timeout_ms"] = 1000
            tool["settle_ms"] = 200
    path = os.path.join(tempfile.mkdtemp(prefix="tally-sig-tools-"), f"tools-{key_id}.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


_node_dir = None


def node_verifier_dir():
    """A temp dir with http-message-signatures installed from the npm registry (once)."""
    global _node_dir
    if _node_dir is None:
        d = tempfile.mkdtemp(prefix="tally-sig-node-")
        out = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--no-save",
                              "http-message-signatures@1.0.6"], cwd=d, capture_output=True,
                             text=True, timeout=300)
        if out.returncode != 0:
            raise AssertionError(f"npm install failed:\n{out.stdout}\n{out.stderr}")
        shutil.copy(NODE_VERIFIER, d)
        _node_dir = d
    return _node_dir


def docs_python_verifier(keys):
    """The Python recipe of docs/connectors.md, run as printed, with `keys` for KEYS."""
    with open(os.path.join(SOURCE_DIR, "docs", "connectors.md")) as f:
        text = f.read()
    code = text.split("**Python**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    ns = {}
    exec(compile(code, "docs/connectors.md (Python recipe)", "exec"), ns)
    ns["KEYS"].clear()
    ns["KEYS"].update({k: v.encode() for k, v in keys.items()})
    return ns["tally_request_ok"]


class SignaturesTest(DispatchCase):

    def setUp(self):
        self.tools_file = registry("k1")
        super().setUp()
        self.fake_url = self.start_fake("--rfc9421-key", "k1=FAKE_K1", "--rfc9421-key",
                                        "k2=FAKE_K2", FAKE_K1=K1, FAKE_K2=K2)
        self.port = int(urllib.parse.urlsplit(self.fake_url).port)

    def signed(self):
        return self.fake_get("/_control/signed")["requests"]

    def send(self, method, uri, headers, body):
        """Send a request as captured (headers exactly as they came) to the fake."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            c.putrequest(method, uri, skip_host=True, skip_accept_encoding=True)
            for k, v in headers.items():
                if k.lower() not in ("content-length",):
                    c.putheader(k, v)
            c.putheader("Content-Length", str(len(body)))
            c.endheaders(body)
            r = c.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            c.close()

    def node_verify(self, reqs, keys):
        d = node_verifier_dir()
        doc = {"keys": keys, "requests": [
            {"method": r["method"], "url": "http://" + r["headers"]["Host"] + r["uri"],
             "headers": r["headers"], "body_b64": r.get("body_b64", "")} for r in reqs]}
        out = subprocess.run(["node", "verify.js"], cwd=d, input=json.dumps(doc),
                             capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        return json.loads(out.stdout)

    def charge(self, run):
        key = f"charge_card:t1:{run}-p"
        self.publish(self.intent(run, 1, "charge_card",
                                 {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 7}))
        return key

    def test_signed_requests_are_accepted_and_altered_replays_refused(self):
        self.dispatcher(BILLING_SIG_K1=K1)
        run = run_id()
        key = self.charge(run)
        row = self.wait_status("charge_card", key, "CONFIRMED")
        self.assertEqual(row["attempts"], 1)
        [logged] = self.requests(key)
        self.assertTrue(logged["signature_ok"])
        self.assertEqual(logged["status"], 201)
        [cap] = [r for r in self.signed() if r["headers"].get("Idempotency-Key") == key]
        self.assertIsNone(cap["refused"])
        h = cap["headers"]
        self.assertNotIn("Tally-Signature", h)  # rfc9421 alone: no legacy header
        body = base64.b64decode(cap["body_b64"])
        self.assertEqual(json.loads(body)["payment_id"], f"{run}-p")
        self.assertRegex(h["Content-Digest"], r"^sha-256=:[A-Za-z0-9+/]{43}=:$")
        self.assertRegex(
            h["Signature-Input"],
            r'^tally=\("@method" "@target-uri" "content-digest" "idempotency-key" '
            r'"tally-run-id" "tally-effect-id"\);created=(\d+);expires=(\d+);keyid="k1";'
            r'alg="hmac-sha256"$')
        created, expires = map(int, h["Signature-Input"].split(";created=")[1]
                               .split(";keyid")[0].split(";expires="))
        self.assertEqual(expires - created, 300)
        self.assertRegex(h["Signature"], r"^tally=:[A-Za-z0-9+/]{43}=:$")

        # A faithful copy verifies (and the key's record is replayed, not duplicated).
        status, _ = self.send("POST", cap["uri"], h, body)
        self.assertEqual(status, 200)
        # Altered copies are refused by the verifier, each for its reason.
        other_key = dict(h, **{"Idempotency-Key": key + "-again"})
        status, err = self.send("POST", cap["uri"], other_key, body)
        self.assertEqual(status, 401, err)
        status, err = self.send("POST", "/refunds", h, body)
        self.assertEqual(status, 401, err)
        status, err = self.send("POST", "/charges/reverse", h, body)
        self.assertEqual(status, 401, err)
        status, err = self.send("GET", cap["uri"] + "?idempotency_key=" +
                                urllib.parse.quote(key, safe=""), h, b"")
        self.assertEqual(status, 401, err)
        tampered = body.replace(b'"amount":7', b'"amount":9')
        status, err = self.send("POST", cap["uri"], h, tampered)
        self.assertEqual(status, 401, err)
        self.assertIn("Content-Digest", err["error"])
        unknown = dict(h, **{"Signature-Input": h["Signature-Input"].replace('"k1"', '"k9"')})
        status, err = self.send("POST", cap["uri"], unknown, body)
        self.assertEqual(status, 401, err)
        self.assertIn("unknown key id", err["error"])
        stripped = {k: v for k, v in h.items() if k not in ("Signature", "Signature-Input")}
        status, err = self.send("POST", cap["uri"], stripped, body)
        self.assertEqual(status, 401, err)
        # Nothing new was created upstream.
        self.assertEqual(len([r for r in self.records("charges")]), 1)
        self.assertEqual(len(self.records("refunds")), 0)
        reasons = [r["refused"] for r in self.signed() if r["refused"]]
        self.assertEqual(len(reasons), 7, reasons)
        for r in reasons[:4]:
            self.assertIn("signature does not match", r)

        # The independent oracle agrees: tally's request verifies, the altered ones do not.
        caps = self.signed()
        verdicts = self.node_verify(caps, {"k1": K1, "k2": K2})
        self.assertEqual([v["ok"] for v in verdicts],
                         [c["refused"] is None for c in caps], verdicts)
        self.assertTrue(verdicts[0]["ok"], verdicts[0])
        # And so does the Python recipe the tool owners' page gives.
        ok = docs_python_verifier({"k1": K1, "k2": K2})
        self.assertEqual(
            [ok(c["method"], "http://" + c["headers"]["Host"] + c["uri"],
                {k.lower(): v for k, v in c["headers"].items()},
                base64.b64decode(c["body_b64"])) for c in caps],
            [c["refused"] is None for c in caps])
        self.invariants()

    def test_status_get_is_signed_without_a_body(self):
        self.dispatcher(BILLING_SIG_K1=K1)
        self.start("tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url, BILLING_SIG_K1=K1,
                   TALLY_POLL_MS=200, TALLY_SWEEP_MS=300, TALLY_SHUTDOWN_GRACE_MS=5000)
        run = run_id()
        key = f"charge_card:t1:{run}-p"
        self.fault("fail_after_apply", key=key)
        self.charge(run)
        self.wait_status("charge_card", key, "CONFIRMED", timeout=90)
        gets = [r for r in self.signed() if r["method"] == "GET"]
        self.assertTrue(gets, self.signed())
        g = gets[0]
        self.assertIsNone(g["refused"])
        self.assertEqual(g["uri"], "/charges?idempotency_key=" + urllib.parse.quote(key, safe=""))
        self.assertNotIn("Content-Digest", g["headers"])
        self.assertTrue(g["headers"]["Signature-Input"].startswith(
            'tally=("@method" "@target-uri" "idempotency-key" "tally-run-id" '
            '"tally-effect-id");created='))
        # The key queried is covered (in @target-uri): another key in the query is refused.
        status, err = self.send("GET", "/charges?idempotency_key=other", g["headers"], b"")
        self.assertEqual(status, 401, err)
        [v] = self.node_verify([g], {"k1": K1})
        self.assertTrue(v["ok"], v)
        ok = docs_python_verifier({"k1": K1})
        self.assertTrue(ok("GET", "http://" + g["headers"]["Host"] + g["uri"],
                           {k.lower(): v for k, v in g["headers"].items()}, b""))

    def test_reverse_call_is_signed_with_if_match_covered(self):
        self.dispatcher(BILLING_SIG_K1=K1)
        run = run_id()
        key = self.charge(run)
        self.wait_status("charge_card", key, "CONFIRMED")
        self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url, BILLING_SIG_K1=K1,
                   TALLY_POLL_MS=200, TALLY_SWEEP_MS=200, TALLY_SHUTDOWN_GRACE_MS=5000)
        self.publish({"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/agent",
                      "type": "tally.compensate_run.v1", "datacontenttype": "application/json",
                      "data": {"run_id": run, "reason": "signature test"}})

        def reverse():
            return [r for r in self.signed() if r["uri"] == "/charges/reverse"]
        [rev] = wait_for(reverse, timeout=60, what="the signed reverse call")
        self.assertIsNone(rev["refused"])
        h = rev["headers"]
        self.assertTrue(h["Idempotency-Key"].startswith("reverse:"))
        self.assertEqual(h["If-Match"], "1")
        self.assertTrue(h["Signature-Input"].startswith(
            'tally=("@method" "@target-uri" "content-digest" "idempotency-key" "tally-run-id" '
            '"tally-effect-id" "if-match");created='), h["Signature-Input"])
        self.assertEqual(len(self.fake_get("/_control/records")["reversals"]), 1)
        # A capture replayed with another If-Match (to overwrite a changed record) is refused.
        status, err = self.send("POST", rev["uri"], dict(h, **{"If-Match": "*"}),
                                base64.b64decode(rev["body_b64"]))
        self.assertEqual(status, 401, err)
        [v] = self.node_verify([rev], {"k1": K1})
        self.assertTrue(v["ok"], v)

    def test_key_rotation_two_ids_valid_at_once(self):
        d = self.dispatcher(BILLING_SIG_K1=K1)
        run1 = run_id()
        key1 = self.charge(run1)
        self.wait_status("charge_card", key1, "CONFIRMED")
        d.terminate()
        # The registry moves to k2; the receiver accepts both while the workers restart.
        self.tools_file = registry("k2")
        self.dispatcher(BILLING_SIG_K2=K2)
        run2 = run_id()
        key2 = self.charge(run2)
        self.wait_status("charge_card", key2, "CONFIRMED")
        by_key = {r["headers"].get("Idempotency-Key"): r for r in self.signed()}
        self.assertIn('keyid="k1"', by_key[key1]["headers"]["Signature-Input"])
        self.assertIn('keyid="k2"', by_key[key2]["headers"]["Signature-Input"])
        self.assertIsNone(by_key[key1]["refused"])
        self.assertIsNone(by_key[key2]["refused"])
        verdicts = self.node_verify([by_key[key1], by_key[key2]], {"k1": K1, "k2": K2})
        self.assertEqual([v["ok"] for v in verdicts], [True, True], verdicts)
        # A receiver that has dropped k1 refuses k1's requests.
        only_k2 = self.node_verify([by_key[key1]], {"k2": K2})
        self.assertFalse(only_k2[0]["ok"])
        self.invariants()

    def test_legacy_and_rfc9421_headers_together(self):
        # A receiver migrating from Tally-Signature: with secret_env and signing both set, both
        # headers are sent and both verify (the fake checks both).
        self.tools_file = registry("k1", legacy=True)
        self.fake_url = self.start_fake("--rfc9421-key", "k1=FAKE_K1", "--secret-env",
                                        "BILLING_HMAC_SECRET", FAKE_K1=K1,
                                        BILLING_HMAC_SECRET="whsec_dispatch_tests")
        self.dispatcher(BILLING_SIG_K1=K1)
        run = run_id()
        key = self.charge(run)
        self.wait_status("charge_card", key, "CONFIRMED")
        [cap] = [r for r in self.signed() if r["headers"].get("Idempotency-Key") == key]
        self.assertIsNone(cap["refused"])
        self.assertRegex(cap["headers"]["Tally-Signature"], r"^t=\d+,v1=[0-9a-f]{64}$")
        [logged] = self.requests(key)
        self.assertTrue(logged["signature_ok"])


if __name__ == "__main__":
    main()
