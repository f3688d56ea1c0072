"""Sensitive fields (issue 23): a tool's registry entry marks argument and receipt fields
sensitive. A full run — a retried call, an UNKNOWN resolved by a status check whose answer echoes
the args, dead letters, a compensation, the CLI — leaves none of the values anywhere but at the
tool: not in any column of any table, any topic, any process's log or any CLI output (the test
greps them all). The tool receives them byte-identical on every attempt. `tally forget` leaves the
audit trail as it was and the sealed values unreadable."""

import base64
import hashlib
import json
import os
import tempfile
import uuid

from dispatchcase import DispatchCase, main, run_id
from tallytest import SOURCE_DIR, TOPICS, wait_for

CARD = "4111111111111111"
CVC = "737"
SSN = "078-05-1120"
SECRETS = (CARD, SSN, "4111 1111", "078051120")
MASTER = "m1:" + base64.b64encode(b"k" * 32).decode()
SIG_KEY = "sens-sig-secret"


def registry():
    """demo.json with charge_card's card and ssn sensitive, signed (so that the fake keeps
    every request's body for the test to compare)."""
    with open(os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")) as f:
        doc = json.load(f)
    for tool in doc["tools"]:
        if tool["name"] == "charge_card":
            conn = tool["connector"]
            conn.pop("secret_env", None)
            conn["signing"] = {"scheme": "rfc9421", "key_id": "k1", "secret_env": "SENS_SIG"}
            conn["timeout_ms"] = 1000
            tool["settle_ms"] = 200
            # the fake's record echoes the request body: /body/card is declared, the ssn in
            # /body/ssn is not, and must be scrubbed all the same
            # /amount is a number the tool echoes as a number (body.amount), undeclared there
            tool["sensitive"] = {"args": ["/card", "/ssn", "/amount"], "receipt": ["/body/card"]}
    path = os.path.join(tempfile.mkdtemp(prefix="tally-sens-tools-"), "tools.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def canonical(v):
    return json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class SensitiveTest(DispatchCase):

    def setUp(self):
        self.tools_file = registry()
        super().setUp()
        self.fake_url = self.start_fake("--rfc9421-key", "k1=FAKE_K1", FAKE_K1=SIG_KEY)
        self.cli_outputs = []

    def env(self, **extra):
        env = super().env(**extra)
        for k, v in {"TALLY_MASTER_KEY": MASTER, "SENS_SIG": SIG_KEY}.items():
            if k not in extra:
                env[k] = v
        return env

    def worker(self, name, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "TALLY_POLL_MS": 200,
                "TALLY_SWEEP_MS": 200, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start(name, **base)

    def run_cli(self, *args):
        out = self.cli(*args)
        self.cli_outputs.append((args, out.stdout + out.stderr))
        return out

    def args(self, run, step):
        return {"tenant_id": "acme", "payment_id": f"{run}-{step}", "amount": 1200,
                "card": {"number": CARD, "cvc": CVC}, "ssn": SSN}

    def signed_bodies(self, key):
        reqs = self.fake_get("/_control/signed")["requests"]
        return [base64.b64decode(r.get("body_b64", "")) for r in reqs
                if r["headers"].get("Idempotency-Key") == key and r["method"] == "POST"
                and r["uri"] == "/charges"]

    # --- the whole-run grep ------------------------------------------------------------

    def assert_nowhere(self, where, text):
        for s in SECRETS:
            self.assertNotIn(s, text, f"{s!r} found in {where}")

    def topic_text(self, logical):
        c = self.reader(logical)
        got, idle = [], 0
        while idle < 10:
            m = c.poll(0.2)
            if m is None:
                idle += 1
            elif not m.error():
                idle = 0
                got.append(m.value().decode("utf-8", "replace"))
        return "\n".join(got)

    def grep_everything(self):
        # the grep sees what it looks for: the agents' own topic holds the values
        self.assertIn(SSN, self.topic_text("intents"))
        tables = [r[0] for r in self.query(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        self.assertIn("effects", tables)
        for t in tables:
            rows = self.query(f'SELECT t::text FROM "{t}" t')
            self.assert_nowhere(f"table {t}", "\n".join(r[0] for r in rows))
        # every topic tally writes (the intents topic is the agents': the values come from there)
        extra = [self.replies[len(self.prefix):]] if getattr(self, "replies", None) else []
        for logical in [t for t in TOPICS if t != "intents"] + extra:
            text = self.topic_text(logical)
            if logical == "outcomes" or logical in extra:
                self.assertIn("[redacted hmac-sha256:", text)
            self.assert_nowhere(f"topic {logical}", text)
        for p in self.procs:
            if p.name != "tally-fake-tool":
                self.assert_nowhere(f"the log of {p.name}", p.log())
        for args, text in self.cli_outputs:
            self.assert_nowhere(f"`tally {' '.join(args)}`", text)

    # --- tests -------------------------------------------------------------------------

    def test_a_full_run_keeps_the_values_at_the_tool_only(self):
        self.worker("tally-dispatcher")
        self.worker("tally-reconciler")
        self.worker("tally-compensator")
        run = run_id()
        k1, k2 = f"charge_card:acme:{run}-1", f"charge_card:acme:{run}-2"
        # step 1 is refused once (a retry, from the sealed copy); step 2 is applied and its
        # answer never comes (UNKNOWN: the reconciler's status answer echoes the args)
        self.fault("refuse_503", key=k1, collection="charges", times=1)
        self.fault("apply_then_hang", key=k2, collection="charges", times=1, delay_ms=3000)
        # the answers go to a reply topic too (docs/agent-protocol.md): grepped as well
        self.replies = self.topic("replies.") + uuid.uuid4().hex[:10]
        wait_for(lambda: len(self.producer().list_topics(topic=self.replies, timeout=10)
                             .topics[self.replies].partitions) > 0, timeout=20, what="replies")
        for step in (1, 2):
            ce = self.intent(run, step, "charge_card", self.args(run, step), tenant="acme")
            ce["replytopic"] = self.replies
            self.publish(ce)
        self.wait_status("charge_card", k1, "CONFIRMED")
        self.wait_status("charge_card", k2, "CONFIRMED", timeout=90)

        # the tool got the real values, the same bytes on every attempt
        for step, key in ((1, k1), (2, k2)):
            bodies = self.signed_bodies(key)
            self.assertGreaterEqual(len(bodies), 2 if step == 1 else 1, key)
            self.assertEqual(len(set(bodies)), 1, f"{key}: bodies differ between attempts")
            self.assertEqual(json.loads(bodies[0]), self.args(run, step))
        recs = {r["idempotency_key"]: r for r in self.records("charges")}
        self.assertEqual(recs[k1]["body"]["card"]["number"], CARD)

        # the ledger keeps markers; equal values give equal markers
        a1, a2 = (json.loads(self.scalar("SELECT args_canonical FROM effects"
                                         " WHERE operation_key = %s", (k,))) for k in (k1, k2))
        self.assertTrue(a1["ssn"].startswith("[redacted hmac-sha256:"), a1)
        self.assertEqual(a1["ssn"], a2["ssn"])
        self.assertEqual(a1["card"], a2["card"])
        self.assertEqual(a1["amount"], a2["amount"])
        self.assertTrue(a1["amount"].startswith("[redacted hmac-sha256:"), a1)
        self.assertEqual(a1["payment_id"], f"{run}-1")
        # the receipt stays the tool's JSON, its ref kept; the echoed amount is its marker
        for k in (k1, k2):
            e = self.effect("charge_card", k)
            receipt = e["receipt"] if isinstance(e["receipt"], dict) else json.loads(e["receipt"])
            self.assertEqual(e["external_ref"], receipt["id"])
            self.assertTrue(e["external_ref"].startswith("charges_"), e)
            self.assertEqual(receipt["body"]["amount"], a1["amount"])
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE seal_key IS NOT NULL"
                                     " AND args_sealed IS NOT NULL AND receipt_sealed IS NOT NULL"
                                     " AND operation_key IN (%s, %s)", (k1, k2)), 2)
        self.assertEqual(self.scalar("SELECT count(*) FROM tenant_keys WHERE tenant = 'acme'"), 1)
        # the receipt is stored once, on the effect: step 1's refused attempt keeps its
        # (scrubbed) answer in its event; the applied one keeps the SHA-256 of the redacted
        # receipt and of the sealed bytes, as the effect stores them
        [(eid1, stored, sealed)] = self.query(
            "SELECT effect_id::text, receipt::text, receipt_sealed FROM effects"
            " WHERE operation_key = %s", (k1,))
        calls = [d for (d,) in self.query(
            "SELECT data FROM events WHERE effect_id = %s AND kind = 'connector_call'"
            " ORDER BY seq", (eid1,))]
        self.assertEqual([c["verdict"] for c in calls], ["retry", "confirmed"])
        self.assertIn("response", calls[0])
        self.assertNotIn("response", calls[1])
        self.assertEqual(calls[1]["receipt"], {
            "on": "effect", "sha256": hashlib.sha256(stored.encode()).hexdigest(),
            "sealed_sha256": hashlib.sha256(bytes(sealed)).hexdigest()})

        # dead letters: a sensitive tool's intent refused after parsing, and bytes that are
        # not JSON at all
        bad = self.intent(run, 3, "charge_card", {"tenant_id": "acme", "ssn": SSN,
                                                  "card": {"number": CARD}}, tenant="acme")
        self.publish(bad)
        self.produce("intents", f"not json {SSN} {CARD}".encode(), key=run)
        # a hostile answer: the record echoing the args, in bytes that are not UTF-8 (kept as a
        # base64 excerpt): scrubbed as bytes before it is encoded
        run5 = run_id()  # a run of its own: its reversal has no ref to go by, and pages
        k5 = f"charge_card:acme:{run5}-5"
        self.fault("receipt_not_utf8", key=k5, collection="charges", times=1)
        self.publish(self.intent(run5, 5, "charge_card", self.args(run5, 5), tenant="acme"))
        e5 = self.wait_status("charge_card", k5, "CONFIRMED")
        receipt = e5["receipt"] if isinstance(e5["receipt"], dict) else json.loads(e5["receipt"])
        raw = base64.b64decode(receipt["excerpt"]["base64"])
        self.assertIn(b"\xff\xfe", raw)
        self.assertIn(b"[redacted hmac-sha256:", raw)
        for secret in SECRETS:
            self.assertNotIn(secret.encode(), raw)
        events = " ".join(r[0] for r in self.query(
            "SELECT data::text FROM events WHERE effect_id = %s", (e5["effect_id"],)))
        for b64 in [w for w in events.replace('"', " ").split() if len(w) > 40]:
            try:
                decoded = base64.b64decode(b64, validate=True)
            except ValueError:
                continue
            for secret in SECRETS:
                self.assertNotIn(secret.encode(), decoded)

        # a refused message may name any tenant: a junk one gets no key of its own
        junk = self.intent(run, 4, "charge_card", {"ssn": SSN}, tenant="j\u0001" + "y" * 300)
        self.publish(junk)
        dlq = self.read_until("dlq", lambda got: len(got) >= 3, timeout=60)
        redacted = [d["data"] for d in dlq if d["data"].get("original_redacted")]
        withheld = [d["data"] for d in dlq if d["data"].get("original_withheld")]
        self.assertEqual(len(redacted), 2, dlq)
        self.assertEqual(self.scalar("SELECT count(*) FROM tenant_keys WHERE tenant <> 'acme'"
                                     " AND tenant <> ''"), 0)
        self.assertEqual(len(withheld), 1, dlq)
        bad_args = [json.loads(r["original"])["data"]["args"] for r in redacted]
        self.assertIn(a1["ssn"], [a["ssn"] for a in bad_args])  # same tenant, same marker
        self.assertTrue(all(a["ssn"].startswith("[redacted hmac-sha256:") for a in bad_args))

        # undo the run: the reverse calls carry the real values to the tool
        out = self.run_cli("compensate", "--run", run, "--reason", "test")
        self.assertEqual(out.returncode, 0, out.stderr)
        wait_for(lambda: self.scalar("SELECT count(*) FROM obligations WHERE run_id = %s"
                                     " AND status = 'RESOLVED'", (run,)) == 2,
                 timeout=90, what="both reversals")
        # the hostile answer's run undone too: no ref to reverse by, so it pages (the alert
        # is grepped with the rest)
        out = self.run_cli("compensate", "--run", run5, "--reason", "test")
        self.assertEqual(out.returncode, 0, out.stderr)
        wait_for(lambda: self.scalar("SELECT count(*) FROM alerts WHERE run_id = %s", (run5,)),
                 timeout=60, what="the page of the hostile answer's reversal")
        rev = [r for r in self.fake_get("/_control/signed")["requests"]
               if r["uri"].startswith("/charges/reverse")
               and r["headers"].get("Tally-Run-Id") == run]
        self.assertTrue(rev)
        for r in rev:
            body = json.loads(base64.b64decode(r["body_b64"]))
            self.assertEqual(body["args"]["ssn"], SSN)
            self.assertEqual(body["receipt"]["body"]["card"]["number"], CARD)

        for verb in (("status",), ("doctor", "--run", run), ("summary", "--run", run),
                     ("doctor", "--run", run, "--json")):
            out = self.run_cli(*verb)
            self.assertIn(out.returncode, (0, 1, 2), out.stderr)  # 2: the page is STUCK
            self.assertTrue(out.stdout, verb)
        self.assertIn("[redacted hmac-sha256:", self.cli_outputs[-1][1])
        self.grep_everything()

    def test_forget_shreds_the_tenant_and_keeps_the_audit_trail(self):
        self.worker("tally-dispatcher")
        run = run_id()
        key = f"charge_card:acme:{run}-1"
        self.publish(self.intent(run, 1, "charge_card", self.args(run, 1), tenant="acme"))
        self.wait_status("charge_card", key, "CONFIRMED")
        events = self.query("SELECT seq, md5(e::text) FROM events e ORDER BY seq")

        out = self.run_cli("forget", "--tenant", "acme", "--reason", "erasure request 42")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(self.scalar("SELECT count(*) FROM tenant_keys WHERE tenant = 'acme'"
                                     " AND wrapped IS NOT NULL"), 0)
        after = self.query("SELECT seq, md5(e::text) FROM events e ORDER BY seq")
        self.assertEqual(after[:len(events)], events, "the audit trail changed")
        self.assertEqual(len(after), len(events) + 1)

        # nothing can open the sealed args any more: an effect sent again fails, and the tool
        # receives nothing
        eid = self.effect("charge_card", key)["effect_id"]
        before = len(self.signed_bodies(key))
        self.force("UPDATE effects SET status = 'PLANNED', receipt = NULL, receipt_sealed = NULL,"
                   " external_ref = NULL WHERE effect_id = %s", (eid,))
        self.query("INSERT INTO events (event_id, run_id, effect_id, kind, actor, reason, data)"
                   " VALUES (gen_random_uuid(), %s, %s, 'test_reset', 'test', 'reset by the test',"
                   " '{\"from\": \"CONFIRMED\", \"to\": \"PLANNED\"}')", (run, eid))
        self.force("INSERT INTO outbox (effect_id, tool) VALUES (%s, 'charge_card')", (eid,))
        self.query("SELECT pg_notify('tally_outbox', '')")
        e = self.wait_status("charge_card", key, "FAILED")
        self.assertEqual(e["error_code"], "sealed_unreadable")
        self.assertIn("forgotten", e["error_message"])
        self.assertEqual(len(self.signed_bodies(key)), before)
        self.grep_everything()

    def test_a_new_tenant_key_per_tenant_and_the_worker_refuses_without_a_master_key(self):
        p = self.start("tally-dispatcher", wait_ready=False, **{"TALLY_MASTER_KEY": ""})
        self.assertEqual(p.popen.wait(30), 2)
        self.assertIn("declares sensitive fields", p.log())
        self.procs.remove(p)
        p.close()

        self.worker("tally-dispatcher")
        runs = [run_id() for _ in range(3)]
        for r, tenant in zip(runs, ("t-a", "t-b", None)):
            extra = {"tenant": tenant} if tenant else {}
            self.publish(self.intent(r, 1, "charge_card", self.args(r, 1), **extra))
        for r in runs:
            self.wait_status("charge_card", f"charge_card:acme:{r}-1", "CONFIRMED")
        self.assertEqual(sorted(r[0] for r in self.query("SELECT tenant FROM tenant_keys")),
                         ["", "t-a", "t-b"])
        # equal values under different tenants: unlinkable markers
        marks = {r[0] for r in self.query("SELECT args_canonical::jsonb ->> 'ssn' FROM effects")}
        self.assertEqual(len(marks), 3)
        self.grep_everything()


if __name__ == "__main__":
    main()
