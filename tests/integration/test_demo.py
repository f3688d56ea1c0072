"""The demo's story (scripts/demo.sh), end to end: the example agent (examples/agent/agent.py,
on the tally_client library of clients/python) against the three workers and the fake tool
service, then what a user would check — the answers the agent printed (a refusal for an
unknown tool, the run completed, a late intent refused), each run's effects and obligations in
the ledger, the tool's own records, the alert resolved by the operator, and the ledger's
invariants.

scripts/demo.sh does the same on a stack of its own (`tally dev`); here the stack is the test
fixture's (its own database and topic prefix), so this runs beside the other tests.
"""

import json
import os
import subprocess
import sys
import urllib.request
import uuid

import tallytest
from invariants import check_invariants
from tallytest import SOURCE_DIR, TallyCase, binary, wait_for

AGENT = os.path.join(SOURCE_DIR, "examples", "agent", "agent.py")
SECRET = "whsec_demo_test"
# Debian's interpreter sees python3-confluent-kafka; the test itself may run under another.
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


class DemoStoryTest(TallyCase):

    def start_fake(self):
        port_file = os.path.join(self.tmp, "fake.port")
        # No --secret-env: the fake would then demand signatures on every collection, and
        # the demo registry signs only charge_card (the workers still need the secret).
        self.fake = self.start("tally-fake-tool", "--listen", "127.0.0.1:0", "--port-file",
                               port_file)

        def port():
            try:
                with open(port_file) as f:
                    return f.read().strip()
            except OSError:
                return None
        wait_for(lambda: port() or not self.fake.alive(), timeout=20, what="the fake's port")
        self.assertTrue(self.fake.alive(), self.fake.log())
        return "http://127.0.0.1:" + port()

    def fake_records(self, url, collection):
        with urllib.request.urlopen(f"{url}/_control/records?collection={collection}",
                                    timeout=10) as r:
            return json.loads(r.read())["records"]

    def effects(self, run_id):
        """{step: (status, tool, external_ref, has receipt)} of one run."""
        rows = self.query("SELECT step, status, tool, external_ref, receipt IS NOT NULL"
                          " FROM effects WHERE run_id = %s", (run_id,))
        return {r[0]: r[1:] for r in rows}

    def obligations(self, run_id):
        """[(tool, step, obligation status, reason, obligation external_ref)] of one run."""
        return self.query(
            "SELECT e.tool, e.step, o.status, o.reason, o.external_ref FROM obligations o"
            " JOIN effects e USING (effect_id) WHERE o.run_id = %s ORDER BY e.step", (run_id,))

    def test_the_demo_story(self):
        fake_url = self.start_fake()
        workers = {"TALLY_FAKE_TOOL_URL": fake_url, "BILLING_HMAC_SECRET": SECRET,
                   "TALLY_SHUTDOWN_GRACE_MS": 5000}
        for w in ("tally-dispatcher", "tally-reconciler", "tally-compensator"):
            self.start(w, **workers)

        prefix = "dt" + uuid.uuid4().hex[:6]
        env = self.env(TALLY_FAKE_TOOL_URL=fake_url, BILLING_HMAC_SECRET=SECRET)
        agent = subprocess.run(
            [PYTHON, AGENT, "--tally", binary("tally"), "--run-prefix", prefix,
             "--timeout", "60", "--color", "never"],
            capture_output=True, text=True, env=env, timeout=600)
        story = agent.stdout + agent.stderr
        self.assertEqual(agent.returncode, 0, "the agent's story stopped:\n" + story)
        self.assertIn("the agent's story is told", story)
        run = {name: f"{prefix}-{name}" for name in
               ("checkout", "timeout", "duplicate", "refund", "stuck")}

        # 1. all four steps CONFIRMED with receipts; the replay, the conflict, the intent for an
        # unknown tool (step 5) and the late one after run.complete() (step 6) added nothing
        self.assertRegex(story, r"→ step 5 send_sms .*\n +✗ REFUSED  unknown_tool \(data\.tool\)",
                         "the intent for an unknown tool was not answered by a refusal")
        self.assertRegex(story, r"✓ run COMPLETED  4 effects \(4 CONFIRMED\), none waiting",
                         "run.complete() did not return the run's summary")
        self.assertRegex(story, r"→ step 6 send_email .*\n +✗ REFUSED  run_not_active",
                         "the late intent was not refused with run_not_active")
        eff = self.effects(run["checkout"])
        self.assertEqual(sorted(eff), ["1", "2", "3", "4"], eff)
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s",
                                     (run["checkout"],)), "COMPLETED")
        self.assertEqual(self.scalar(
            "SELECT count(*) FROM events WHERE run_id = %s AND reason = 'run_not_active'",
            (run["checkout"],)), 1, "the late intent's refusal is not in the audit trail")
        self.assertEqual([r for r in self.fake_records(fake_url, "emails")
                          if r["idempotency_key"] == f"send_email:msg-{prefix}-1b"], [],
                         "the late intent of the completed run sent its email")
        for step, (status, tool, ref, has_receipt) in eff.items():
            self.assertEqual(status, "CONFIRMED", f"step {step} ({tool})")
            self.assertTrue(has_receipt and ref, f"step {step} ({tool}) has no receipt")
        self.assertEqual(self.scalar(
            "SELECT count(*) FROM events WHERE run_id = %s AND kind = 'conflict'",
            (run["checkout"],)), 1)
        charges = [r for r in self.fake_records(fake_url, "charges")
                   if r["idempotency_key"] == f"charge_card:t1:pay-{prefix}-1"]
        self.assertEqual(len(charges), 1, "the replayed intent charged again")

        # 2. UNKNOWN, then CONFIRMED by the status check; the tool saw one charge
        (status, _, ref, _), = self.effects(run["timeout"]).values()
        self.assertEqual(status, "CONFIRMED")
        self.assertGreaterEqual(self.scalar(
            "SELECT count(*) FROM events v JOIN effects e USING (effect_id)"
            " WHERE e.run_id = %s AND v.to_status = 'UNKNOWN'", (run["timeout"],)), 1,
            "the charge never was UNKNOWN: the fault did not fire")
        timeout_key = f"charge_card:t1:pay-{prefix}-2"
        charges = [r for r in self.fake_records(fake_url, "charges")
                   if r["idempotency_key"] == timeout_key]
        self.assertEqual([r["id"] for r in charges], [ref])

        # 3. two holds upstream: the receipt kept, the extra reversed through an obligation
        (status, _, ref, _), = self.effects(run["duplicate"]).values()
        self.assertEqual(status, "CONFIRMED")
        obs = self.obligations(run["duplicate"])
        self.assertEqual(len(obs), 1, obs)
        _, _, ob_status, reason, extra_ref = obs[0]
        self.assertEqual((ob_status, reason), ("RESOLVED", "duplicate"))
        holds = {r["id"]: r["status"] for r in self.fake_records(fake_url, "holds")
                 if r["idempotency_key"] == f"create_hold:hold-{prefix}-3"}
        self.assertEqual(holds, {ref: "active", extra_ref: "reversed"})

        # 4. the failed run: compensated last step first, the email uncompensatable
        eff = self.effects(run["refund"])
        self.assertEqual({s: v[0] for s, v in eff.items()},
                         {"1": "CONFIRMED", "2": "CONFIRMED", "3": "CONFIRMED", "4": "FAILED"})
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s",
                                     (run["refund"],)), "PARTIALLY_COMPENSATED")
        by_tool = {tool: st for tool, _, st, _, _ in self.obligations(run["refund"])}
        self.assertEqual(by_tool, {"check_balance": "SKIPPED", "charge_card": "RESOLVED",
                                   "send_email": "UNCOMPENSATABLE"})
        refunded = [r for r in self.fake_records(fake_url, "charges")
                    if r["idempotency_key"] == f"charge_card:t1:pay-{prefix}-4"]
        self.assertEqual([r["status"] for r in refunded], ["reversed"])

        # 5. the refund that kept failing: STUCK, paged, resolved by the operator
        obs = self.obligations(run["stuck"])
        self.assertEqual([o[2] for o in obs], ["RESOLVED"], obs)
        alerts = self.query("SELECT status FROM alerts WHERE run_id = %s", (run["stuck"],))
        self.assertEqual(alerts, [("RESOLVED",)])
        self.assertGreaterEqual(self.scalar(
            "SELECT count(*) FROM events WHERE run_id = %s AND actor = 'demo'"
            " AND reason = 'refunded by hand'", (run["stuck"],)), 1,
            "the operator's resolution is not in the audit trail")
        self.assertNotEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s",
                                        (run["stuck"],)), "STUCK")

        # 6. nothing left for a human: `tally status` is clean
        st = self.cli("status")
        self.assertEqual(st.returncode, 0, st.stdout + st.stderr)

        # 7. each run's `tally doctor` fits a screen (40 lines) at 80 columns, and every id of
        # its effects and obligations is whole on one line, whatever the width
        for name, rid in run.items():
            ids = [r[0] for r in self.query(
                "SELECT effect_id::text FROM effects WHERE run_id = %s UNION ALL"
                " SELECT obligation_id::text FROM obligations WHERE run_id = %s", (rid, rid))]
            self.assertTrue(ids, name)
            for width in ("40", "80", "200"):
                doc = self.cli("doctor", "--run", rid, env=self.env(COLUMNS=width))
                self.assertEqual(doc.returncode, 0, doc.stdout + doc.stderr)
                lines = doc.stdout.splitlines()
                if width == "80":
                    self.assertLessEqual(len(lines), 40, f"doctor of {name}:\n" + doc.stdout)
                for i in ids:
                    self.assertTrue(any(i in line for line in lines),
                                    f"{i} is not whole on a line of doctor of {name} at "
                                    f"{width} columns:\n" + doc.stdout)

        check_invariants(self, fake_url=fake_url, allow_duplicates=True,
                         obligations_settled=True)


if __name__ == "__main__":
    tallytest.main()
