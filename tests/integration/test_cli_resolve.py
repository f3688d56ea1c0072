"""`tally resolve` (DESIGN §3 rule 6, §8): an operator settles what tally could not, from
upstream evidence. The move is a compare-and-set that voids any worker's lease, the audit
trail names the actor, the reason and the evidence, the outcome is published, and the page
that the item kept open is resolved (tally.alert.resolve.v1 on <prefix>alerts). Moves the state
machine does not give operators are refused with exit 1 and change nothing.

STUCK effects come from the real dispatcher and reconciler (a tool without a status endpoint
whose call timed out); STUCK obligations from the real compensator (a reverse call answered
412)."""

import json
import os
import pwd

from invariants import check_invariants
from tallytest import wait_for
from test_cli_status import CliCase, main, run_id


class ResolveTest(CliCase):

    def events(self, item_col, item_id, kind=None):
        sql = ("SELECT kind, from_status, to_status, actor, reason, data FROM events"
               f" WHERE {item_col} = %s")
        params = [item_id]
        if kind:
            sql += " AND kind = %s"
            params.append(kind)
        return self.query(sql + " ORDER BY seq", params)

    def alert_message(self, dedup_key, type_):
        msgs = self.read_until("alerts", lambda ms: any(
            m.get("type") == type_ and m["data"].get("dedup_key") == dedup_key for m in ms))
        [m] = [m for m in msgs if m.get("type") == type_
               and m["data"].get("dedup_key") == dedup_key]
        return m

    def outcome(self, effect_id, type_):
        msgs = self.read_until("outcomes", lambda ms: any(
            m.get("type") == type_ and m["data"].get("effect_id") == effect_id for m in ms))
        return [m for m in msgs if m.get("type") == type_
                and m["data"].get("effect_id") == effect_id]

    def test_stuck_effect_resolved_as_confirmed_closes_its_page(self):
        self.dispatcher()
        self.reconciler()
        run = run_id()
        eid, record = self.stuck_note(run)
        [(epoch,)] = self.query("SELECT lease_epoch FROM effects WHERE effect_id = %s", (eid,))

        out = self.tally("resolve", "--effect", eid, "--as", "confirmed", "--ref", record["id"],
                         "--receipt", json.dumps(record), "--reason",
                         "found the note in the notes admin", "--actor", "alice")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(f"effect {eid}: STUCK → CONFIRMED, by alice", out.stdout)
        self.assertIn(f"effect:{eid} resolved", out.stdout)

        [(status, ref, receipt, new_epoch, owner, reason)] = self.query(
            "SELECT status, external_ref, receipt, lease_epoch, lease_owner, status_reason"
            " FROM effects WHERE effect_id = %s", (eid,))
        self.assertEqual((status, ref, receipt, new_epoch, owner),
                         ("CONFIRMED", record["id"], record, epoch + 1, None))
        self.assertEqual(reason, "resolved by alice: found the note in the notes admin")
        # The audit trail: the transition, and the decision with its evidence, by alice.
        *_, transition, decision, page = self.events("effect_id", eid)
        self.assertEqual(transition[:5], ("transition", "STUCK", "CONFIRMED", "alice",
                                          "resolved by alice: found the note in the notes admin"))
        self.assertEqual(decision[:5], ("operator", "STUCK", "CONFIRMED", "alice",
                                        "found the note in the notes admin"))
        self.assertEqual(decision[5]["external_ref"], record["id"])
        self.assertEqual(decision[5]["receipt"], record)
        self.assertEqual(decision[5]["previous"]["error_code"], "no_status_check")
        self.assertEqual(page[:4], ("alert", "TRIGGERED", "RESOLVED", "alice"))
        # The page: RESOLVED in the ledger, its resolve event on <prefix>alerts (published by
        # the relay of the running workers), and the pager told again.
        self.assertEqual(self.query("SELECT status, pager_state FROM alerts"
                                    " WHERE dedup_key = %s", (f"effect:{eid}",)),
                         [("RESOLVED", "pending")])
        m = self.alert_message(f"effect:{eid}", "tally.alert.resolve.v1")
        self.assertEqual((m["data"]["status"], m["data"]["effect_id"], m["data"]["run_id"]),
                         ("RESOLVED", eid, run))
        self.assertIn("alice", m["data"]["resolved_reason"])
        # The outcome agents wait for.
        [ev] = self.outcome(eid, "tally.effect.confirmed.v1")
        self.assertEqual((ev["data"]["status"], ev["data"]["external_ref"], ev["data"]["receipt"],
                          ev["data"]["resolved_by"], ev["data"]["run_id"], ev["data"]["step"]),
                         ("CONFIRMED", record["id"], record, "alice", run, 1))
        # Nothing is STUCK any more.
        self.assertEqual(self.tally("status", "--unknown-age", "3600").returncode, 0)
        self.invariants()

    def test_stuck_effect_resolved_as_failed(self):
        self.dispatcher()
        self.reconciler()
        run = run_id()
        note = f"{run}-n1"
        key = f"post_note:{note}"
        self.fault("hang_before_apply", key=key, delay_ms=5000)   # never applied upstream
        self.publish(self.intent(run, 1, "post_note", {"note_id": note, "text": "hi"}))
        eid = self.wait_status("post_note", key, "STUCK", timeout=40)["effect_id"]
        wait_for(lambda: self.scalar("SELECT count(*) FROM alerts WHERE effect_id = %s",
                                     (eid,)) == 1, timeout=10, what="the page")
        out = self.tally("resolve", "--effect", eid, "--as", "failed", "--reason",
                         "no such note upstream", "--actor", "bob")
        self.assertEqual(out.returncode, 0, out.stderr)
        [(status, code, message, receipt)] = self.query(
            "SELECT status, error_code, error_message, receipt FROM effects"
            " WHERE effect_id = %s", (eid,))
        self.assertEqual((status, code, receipt), ("FAILED", "operator_failed", None))
        self.assertIn("bob", message)
        self.assertEqual(self.events("effect_id", eid, "operator")[0][1:5],
                         ("STUCK", "FAILED", "bob", "no such note upstream"))
        self.alert_message(f"effect:{eid}", "tally.alert.resolve.v1")
        [ev] = self.outcome(eid, "tally.effect.failed.v1")
        self.assertEqual(ev["data"]["error"]["code"], "operator_failed")
        self.assertEqual(self.records("notes"), [])
        self.invariants()

    def test_resolving_an_unknown_effect_voids_the_lease_a_worker_holds(self):
        self.dispatcher()             # no reconciler: the UNKNOWN stays
        run = run_id()
        eid = self.unknown_charge(run)
        # A reconciler claims it for a status check: lease owner, until, epoch.
        [(epoch,)] = self.query(
            "UPDATE effects SET lease_owner = 'reconciler-x', lease_until = now() + interval"
            " '1 minute', lease_epoch = lease_epoch + 1 WHERE effect_id = %s"
            " RETURNING lease_epoch", (eid,))
        out = self.tally("resolve", "--effect", eid, "--as", "confirmed", "--ref", "ch_seen",
                         "--reason", "seen in the dashboard")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("reconciler-x held a lease", out.stdout)
        [(status, owner, until, new_epoch, receipt)] = self.query(
            "SELECT status, lease_owner, lease_until, lease_epoch, receipt FROM effects"
            " WHERE effect_id = %s", (eid,))
        self.assertEqual((status, owner, until, new_epoch), ("CONFIRMED", None, None, epoch + 1))
        # The receipt the schema requires, when the operator has only the ref.
        self.assertEqual(receipt, {"resolved_by": pwd.getpwuid(os.geteuid()).pw_name,
                                   "external_ref": "ch_seen", "reason": "seen in the dashboard"})
        # The reconciler's compare-and-set with its old epoch now writes nothing.
        self.assertEqual(self.query(
            "UPDATE effects SET status = 'PLANNED' WHERE effect_id = %s AND status = 'UNKNOWN'"
            " AND lease_epoch = %s RETURNING 1", (eid, epoch)), [])
        check_invariants(self)

    def test_illegal_resolutions_are_refused_and_change_nothing(self):
        self.dispatcher()
        run = run_id()
        eid = self.confirmed_charge(run)
        oid = self.obligation(eid, "PENDING")
        before = self.snapshot()
        cases = [
            (("resolve", "--effect", eid, "--as", "confirmed", "--ref", "x"),
             ["is CONFIRMED already", "UNKNOWN or STUCK", "it is final"]),
            (("resolve", "--effect", eid, "--as", "failed"),
             ["is CONFIRMED", "UNKNOWN or STUCK"]),
            (("approve", "--effect", eid), ["is CONFIRMED", "AWAITING_APPROVAL"]),
            (("deny", "--effect", eid), ["is CONFIRMED", "AWAITING_APPROVAL"]),
            (("resolve", "--obligation", oid, "--as", "resolved"),
             ["obligation " + oid + " is PENDING", "STUCK", "the compensator moves it next"]),
            (("approve", "--obligation", oid), ["is PENDING", "AWAITING_APPROVAL"]),
            (("resolve", "--effect", "0b6d5f4e-8f3c-4a8e-9d0c-6a1f3e2b7c44", "--as", "failed"),
             ["no effect 0b6d5f4e-8f3c-4a8e-9d0c-6a1f3e2b7c44"]),
        ]
        for args, words in cases:
            out = self.tally(*args, "--reason", "trying")
            self.assertEqual(out.returncode, 1, (args, out.stdout, out.stderr))
            said = " ".join(out.stderr.split())
            for w in words:
                self.assertIn(w, said, args)
            self.assertIn("Nothing was changed", said)
            self.assertEqual(out.stdout, "")
        self.assertUnchanged(before, "a refused resolution")

    def test_usage_errors_exit_2_and_change_nothing(self):
        self.dispatcher()
        eid = self.confirmed_charge(run_id())
        before = self.snapshot()
        for args in (("resolve", "--effect", eid, "--as", "confirmed", "--reason", "r"),
                     ("resolve", "--effect", eid, "--as", "failed"),
                     ("resolve", "--effect", eid, "--as", "maybe", "--reason", "r"),
                     ("resolve", "--effect", "not-a-uuid", "--as", "failed", "--reason", "r"),
                     ("resolve", "--as", "failed", "--reason", "r"),
                     ("resolve", "--effect", eid, "--obligation", eid, "--as", "failed",
                      "--reason", "r"),
                     ("resolve", "--effect", eid, "--as", "confirmed", "--ref", "x",
                      "--receipt", "[1]", "--reason", "r"),
                     ("resolve", "--effect", eid, "--as", "failed", "--reason", " "),
                     ("approve", "--effect", eid, "--as", "confirmed", "--reason", "r")):
            out = self.tally(*args)
            self.assertEqual(out.returncode, 2, (args, out.stderr))
            self.assertTrue(out.stderr.startswith("tally "), out.stderr)
        self.assertUnchanged(before, "a usage error")

    def test_stuck_obligation_resolved_by_hand_closes_its_page(self):
        self.dispatcher()
        comp = self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                          BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                          TALLY_SWEEP_MS=300)
        self.assertTrue(comp.alive())
        run = run_id()
        eid = self.confirmed_charge(run)
        self.fault("reverse_412", op="reverse", times=-1)
        out = self.tally("compensate", "--run", run, "--reason", "the agent gave up")
        self.assertEqual(out.returncode, 0, out.stderr)
        [(oid,)] = wait_for(lambda: self.query(
            "SELECT obligation_id::text FROM obligations WHERE effect_id = %s"
            " AND status = 'STUCK'", (eid,)), timeout=30, what="the reverse to go STUCK")
        wait_for(lambda: self.scalar("SELECT count(*) FROM alerts WHERE obligation_id = %s"
                                     " AND status = 'TRIGGERED'", (oid,)) == 1,
                 timeout=10, what="the obligation's page")
        rc, doc = self.tally_json("status")
        self.assertEqual(rc, 2)
        self.assertIn(oid, [i["id"] for i in doc["stuck"]])

        out = self.tally("resolve", "--obligation", oid, "--as", "resolved", "--ref", "re_hand",
                         "--reason", "refunded by hand in the billing console", "--actor",
                         "carol")
        self.assertEqual(out.returncode, 0, out.stderr)
        [(status, rr, code, epoch_moved)] = self.query(
            "SELECT status, reverse_receipt, error_code, finished_at IS NOT NULL"
            " FROM obligations WHERE obligation_id = %s", (oid,))
        self.assertEqual((status, code, epoch_moved), ("RESOLVED", None, True))
        self.assertEqual(rr, {"resolved_by": "carol", "external_ref": "re_hand",
                              "reason": "refunded by hand in the billing console"})
        self.assertEqual(self.events("obligation_id", oid, "operator")[-1][1:5],
                         ("STUCK", "RESOLVED", "carol", "refunded by hand in the billing console"))
        m = self.alert_message(f"obligation:{oid}", "tally.alert.resolve.v1")
        self.assertEqual(m["data"]["obligation_id"], oid)
        [ev] = self.outcome(eid, "tally.effect.compensated.v1")
        self.assertEqual((ev["data"]["obligation_id"], ev["data"]["obligation_status"],
                          ev["data"]["resolved_by"]), (oid, "RESOLVED", "carol"))
        # Resolving again is refused.
        again = self.tally("resolve", "--obligation", oid, "--as", "skipped", "--reason", "x")
        self.assertEqual(again.returncode, 1)
        self.assertIn("is RESOLVED", again.stderr)
        # The compensator settles the run on its next sweep; the summary shows it undone.
        wait_for(lambda: self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,))
                 == "COMPENSATED", timeout=30, what="the compensator to settle the run")
        rc, summary = self.tally_json("summary", "--run", run)
        self.assertEqual(rc, 0)
        self.assertEqual([e["effect_id"] for e in summary["compensated"]], [eid])
        self.assertEqual(summary["failed"], [])
        self.assertEqual(self.tally("status").returncode, 0)


if __name__ == "__main__":
    main()
