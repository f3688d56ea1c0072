"""`tally approve` / `tally deny` (DESIGN §3, §4, §8): an effect AWAITING_APPROVAL (a
destructive tool) is released to the dispatcher, which calls the tool, or rejected, and then
the tool is never called; an obligation AWAITING_APPROVAL (a tool whose compensation.mode is
approval_required) is released to the compensator or skipped. Real tally-dispatcher,
tally-compensator and tally-fake-tool throughout."""

import json
import time

from invariants import check_invariants
from tallytest import wait_for
from test_cli_status import CliCase, main, run_id

SECRET = "whsec_dispatch_tests"


class ApproveTest(CliCase):

    def setUp(self):
        super().setUp()
        # create_hold's reversal needs a human's approval in these tests.
        with open(self.tools_file) as f:
            doc = json.load(f)
        for tool in doc["tools"]:
            if tool["name"] == "create_hold":
                tool["compensation"] = {"mode": "approval_required"}
        with open(self.tools_file, "w") as f:
            json.dump(doc, f)

    def compensator(self):
        return self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                          BILLING_HMAC_SECRET=SECRET, TALLY_POLL_MS=200, TALLY_SWEEP_MS=300)

    def awaiting_deletion(self, run, account):
        key = f"delete_account:{account}"
        self.publish(self.intent(run, 1, "delete_account", {"account_id": account}))
        row = self.wait_status("delete_account", key, "AWAITING_APPROVAL", timeout=30)
        return key, row["effect_id"]

    def test_approve_releases_the_effect_to_the_dispatcher(self):
        self.dispatcher()
        run = run_id()
        key, eid = self.awaiting_deletion(run, f"{run}-acct")
        time.sleep(0.5)
        self.assertEqual(self.requests(key), [])          # gated: not called
        out = self.tally("approve", "--effect", eid, "--reason", "the customer confirmed by "
                         "phone", "--actor", "dave")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("AWAITING_APPROVAL → PLANNED, by dave", out.stdout)
        row = self.wait_status("delete_account", key, "CONFIRMED", timeout=30)
        [record] = self.records("account_deletions")
        self.assertEqual((record["idempotency_key"], row["external_ref"]), (key, record["id"]))
        self.assertEqual(len(self.requests(key)), 1)
        moves = self.query("SELECT kind, from_status, to_status, actor FROM events"
                           " WHERE effect_id = %s AND kind IN ('transition', 'operator')"
                           " ORDER BY seq", (eid,))
        self.assertIn(("operator", "AWAITING_APPROVAL", "PLANNED", "dave"), moves)
        self.assertEqual([(f, t) for k, f, t, _ in moves if k == "transition"],
                         [(None, "AWAITING_APPROVAL"), ("AWAITING_APPROVAL", "PLANNED"),
                          ("PLANNED", "DISPATCHING"), ("DISPATCHING", "CONFIRMED")])
        # Approving again is refused: it is no longer waiting.
        again = self.tally("approve", "--effect", eid, "--reason", "twice")
        self.assertEqual(again.returncode, 1)
        self.assertIn("is CONFIRMED", again.stderr)
        self.invariants()

    def test_deny_rejects_the_effect_and_the_tool_is_never_called(self):
        self.dispatcher()
        run = run_id()
        key, eid = self.awaiting_deletion(run, f"{run}-acct")
        out = self.tally("deny", "--effect", eid, "--reason", "not this account", "--actor",
                         "erin")
        self.assertEqual(out.returncode, 0, out.stderr)
        [(status, code, message, reason)] = self.query(
            "SELECT status, error_code, error_message, status_reason FROM effects"
            " WHERE effect_id = %s", (eid,))
        self.assertEqual((status, code, reason),
                         ("REJECTED", "denied", "denied by erin: not this account"))
        msgs = self.read_until("outcomes", lambda ms: any(
            m["type"] == "tally.effect.rejected.v1" for m in ms))
        [ev] = [m for m in msgs if m["type"] == "tally.effect.rejected.v1"]
        self.assertEqual((ev["data"]["effect_id"], ev["data"]["status"],
                          ev["data"]["error"]["code"], ev["data"]["resolved_by"]),
                         (eid, "REJECTED", "denied", "erin"))
        # Re-publishing the same intent answers with the rejection; nothing calls the tool.
        self.publish(self.intent(run, 1, "delete_account", {"account_id": f"{run}-acct"}))
        time.sleep(2)
        self.assertEqual(self.requests(key), [])
        self.assertEqual(self.records("account_deletions"), [])
        self.assertEqual(self.scalar("SELECT status FROM effects WHERE effect_id = %s", (eid,)),
                         "REJECTED")
        approve = self.tally("approve", "--effect", eid, "--reason", "changed my mind")
        self.assertEqual(approve.returncode, 1)
        self.assertIn("is REJECTED", approve.stderr)
        self.invariants()

    def held_reversal(self, run):
        """A confirmed create_hold whose compensation waits for approval."""
        key = f"create_hold:{run}-h"
        self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h", "amount": 3}))
        eid = self.wait_status("create_hold", key, "CONFIRMED", timeout=30)["effect_id"]
        out = self.tally("compensate", "--run", run, "--reason", "undo the run")
        self.assertEqual(out.returncode, 0, out.stderr)
        [(oid,)] = wait_for(lambda: self.query(
            "SELECT obligation_id::text FROM obligations WHERE effect_id = %s"
            " AND status = 'AWAITING_APPROVAL'", (eid,)), timeout=30,
            what="the compensator to hold the reversal for approval")
        return eid, oid

    def test_approved_obligation_is_reversed_by_the_compensator(self):
        self.dispatcher()
        self.compensator()
        run = run_id()
        eid, oid = self.held_reversal(run)
        rc, doc = self.tally_json("status")
        self.assertEqual(doc["counts"]["awaiting_approval"], 1)
        out = self.tally("approve", "--obligation", oid, "--reason", "refund it", "--actor",
                         "frank")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("AWAITING_APPROVAL → PENDING, by frank", out.stdout)
        self.assertEqual(self.query("SELECT approved_by FROM obligations"
                                    " WHERE obligation_id = %s", (oid,)), [("frank",)])
        wait_for(lambda: self.scalar("SELECT status FROM obligations WHERE obligation_id = %s",
                                     (oid,)) == "RESOLVED", timeout=30,
                 what="the compensator to reverse the hold")
        self.assertEqual(len(self.requests(f"reverse:{oid}", op="reverse")), 1)
        self.assertEqual(self.query("SELECT kind, to_status, actor FROM events"
                                    " WHERE obligation_id = %s AND kind = 'operator'", (oid,)),
                         [("operator", "PENDING", "frank")])
        check_invariants(self)

    def test_denied_obligation_is_skipped_and_never_reversed(self):
        self.dispatcher()
        self.compensator()
        run = run_id()
        eid, oid = self.held_reversal(run)
        out = self.tally("deny", "--obligation", oid, "--reason", "the hold must stay",
                         "--actor", "gina")
        self.assertEqual(out.returncode, 0, out.stderr)
        [(status, reason, approved)] = self.query(
            "SELECT status, status_reason, approved_at FROM obligations"
            " WHERE obligation_id = %s", (oid,))
        self.assertEqual((status, reason, approved),
                         ("SKIPPED", "denied by gina: the hold must stay", None))
        time.sleep(2)
        self.assertEqual(self.requests(f"reverse:{oid}", op="reverse"), [])
        self.assertEqual(self.scalar("SELECT status FROM obligations WHERE obligation_id = %s",
                                     (oid,)), "SKIPPED")
        out = self.tally("approve", "--obligation", oid, "--reason", "late")
        self.assertEqual(out.returncode, 1)
        self.assertIn("is SKIPPED", out.stderr)
        check_invariants(self)


if __name__ == "__main__":
    main()
