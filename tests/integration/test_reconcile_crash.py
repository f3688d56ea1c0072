"""Crashes and shutdowns around the reconciler (DESIGN §3 rule 1, §9, §11): a dispatcher
SIGKILLed in the middle of a call leaves a DISPATCHING effect whose lease expires; the
reconciler turns it into UNKNOWN (never re-dispatching it directly) and resolves it to what the
tool really did. A reconciler told to stop finishes the status checks it has in flight and
records them before it exits 0."""

import time

from tallytest import wait_for
from test_reconcile_resolve import ReconcileCase, main, run_id

DISPATCH_LEASE_MS = 1000  # TALLY_LEASE_MS of the dispatcher that gets killed


class ReconcileCrashTest(ReconcileCase):

    def kill_dispatcher_mid_call(self, run, key, fault, delay_ms):
        """Start a dispatcher, let it send the run's charge into `fault`, SIGKILL it while the
        call hangs. Returns the effect row, still DISPATCHING."""
        disp = self.dispatcher(TALLY_LEASE_MS=DISPATCH_LEASE_MS)
        self.fault(fault, key=key, delay_ms=delay_ms)
        self.charge(run)
        wait_for(lambda: any(r["status"] is None for r in self.requests(key)), timeout=30,
                 what="the call to be in flight at the tool")
        disp.kill()
        row = self.effect("charge_card", key)
        self.assertEqual(row["status"], "DISPATCHING")
        return row

    def assert_lease_expiry(self, effect_id, reconciler_proc):
        moves = self.transitions(effect_id)
        [expiry] = [m for m in moves if m[:2] == ("DISPATCHING", "UNKNOWN")]
        self.assertIn("dispatch lease expired", expiry[3])
        self.assertIn(":", expiry[2])  # the reconciler's worker id wrote it
        self.assertEqual(self.metric(reconciler_proc, "tally_lease_expired_total"), 1)
        [(lease, _, _)] = [e for e in self.events_of(effect_id, "transition")
                           if e[1] and "lease expired" in e[1]]
        self.assertIsNotNone(lease["lease_owner"])
        unknown = self.messages("outcomes", lambda ms: any(
            m["type"] == "tally.effect.unknown.v1" and m["data"]["error"]
            and m["data"]["error"]["code"] == "lease_expired" for m in ms))
        [ev] = [m for m in unknown if m["type"] == "tally.effect.unknown.v1"
                and m["data"]["error"]["code"] == "lease_expired"]
        self.assertEqual(ev["data"]["effect_id"], effect_id)
        self.assertTrue(ev["source"].startswith("/tally/reconciler/"))

    def test_dispatcher_killed_after_the_tool_applied_is_confirmed(self):
        rec = self.reconciler()
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        # the tool sleeps 2.5 s, then applies: the dispatcher is dead by then
        row = self.kill_dispatcher_mid_call(run, key, "slow", 2500)
        done = self.wait_status("charge_card", key, "CONFIRMED", timeout=40)
        [record] = self.records("charges")
        self.assertEqual(done["receipt"], record)
        self.assertEqual(done["external_ref"], record["id"])
        self.assertEqual(len(self.requests(key)), 1)       # never re-sent
        self.assertEqual([m[:2] for m in self.transitions(row["effect_id"])],
                         [(None, "PLANNED"), ("PLANNED", "DISPATCHING"),
                          ("DISPATCHING", "UNKNOWN"), ("UNKNOWN", "CONFIRMED")])
        self.assert_lease_expiry(row["effect_id"], rec)
        self.invariants()

    def test_dispatcher_killed_before_the_tool_applied_is_redispatched_once(self):
        rec = self.reconciler()
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        # the tool sleeps 3 s and then refuses: nothing was applied
        row = self.kill_dispatcher_mid_call(run, key, "hang_before_apply", 3000)
        self.wait_status("charge_card", key, "PLANNED", timeout=40)
        self.assertEqual(self.records("charges"), [])
        self.dispatcher()  # a dispatcher comes back and sends it again, with the same key
        done = self.wait_status("charge_card", key, "CONFIRMED", timeout=40)
        self.assertEqual(len(self.records("charges")), 1)
        executes = self.requests(key)
        self.assertEqual(len(executes), 2)
        self.assertEqual({r["idempotency_key"] for r in executes}, {key})
        self.assertEqual(done["attempts"], 2)
        self.assertEqual([m[:2] for m in self.transitions(row["effect_id"])],
                         [(None, "PLANNED"), ("PLANNED", "DISPATCHING"),
                          ("DISPATCHING", "UNKNOWN"), ("UNKNOWN", "PLANNED"),
                          ("PLANNED", "DISPATCHING"), ("DISPATCHING", "CONFIRMED")])
        self.assert_lease_expiry(row["effect_id"], rec)
        self.invariants()

    def test_a_verdict_whose_lease_was_taken_over_writes_nothing(self):
        self.dispatcher()
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        self.charge(run)
        row = self.wait_status("charge_card", key, "UNKNOWN", timeout=30)
        self.fault("slow", key=key, op="status", delay_ms=700)
        rec = self.reconciler()
        wait_for(lambda: any(r["status"] is None for r in self.status_requests(key)),
                 timeout=20, what="the status check to be in flight")
        # Another worker takes the lease over while the answer is on its way (rule 3).
        self.query("UPDATE effects SET lease_epoch = lease_epoch + 1, lease_owner = 'other'"
                   " WHERE effect_id = %s RETURNING 1", (row["effect_id"],))
        wait_for(lambda: self.metric(rec, "tally_reconciler_lost_leases_total") == 1,
                 timeout=10, what="the lost lease to be counted")
        self.assertEqual(self.effect("charge_card", key)["status"], "UNKNOWN")
        self.assertEqual([m[:2] for m in self.transitions(row["effect_id"])][-1],
                         ("DISPATCHING", "UNKNOWN"))
        self.assertEqual([d for d, _, _ in self.events_of(row["effect_id"], "connector_call")
                          if d.get("op") == "status"], [])
        self.assertTrue(any("lease lost" in line.get("msg", "") for line in rec.log_lines()))
        # Once that lease ends, the effect is checked again and resolved once.
        self.query("UPDATE effects SET lease_until = now() - interval '1 second'"
                   " WHERE effect_id = %s RETURNING 1", (row["effect_id"],))
        self.wait_status("charge_card", key, "CONFIRMED", timeout=20)
        self.assertEqual([m[:2] for m in self.transitions(row["effect_id"])
                          if m[0] == "UNKNOWN"], [("UNKNOWN", "CONFIRMED")])
        self.invariants()

    def test_sigterm_finishes_the_checks_in_flight_and_records_them(self):
        self.dispatcher()
        run = run_id()
        keys = []
        for step in (1, 2, 3):
            key = f"charge_card:t1:{run}-p{step}"
            self.fault("apply_then_hang", key=key, delay_ms=5000)
            self.charge(run, step)
            keys.append(key)
        for key in keys:
            self.wait_status("charge_card", key, "UNKNOWN", timeout=30)
        # every status check takes 600 ms (within the tool's 800 ms timeout)
        self.fault("slow", op="status", times=-1, delay_ms=600)
        rec = self.reconciler()
        wait_for(lambda: len([r for r in self.requests(op="status") if r["status"] is None]) == 3,
                 timeout=20, what="three status checks in flight")
        t0 = time.monotonic()
        self.assertEqual(rec.terminate(timeout=30), 0)
        self.assertLess(time.monotonic() - t0, 5)
        for key in keys:  # recorded before the exit, not left to a lease expiry
            self.assertEqual(self.effect("charge_card", key)["status"], "CONFIRMED")
        msgs = [line.get("msg", "") for line in rec.log_lines()]
        stop = next(i for i, m in enumerate(msgs) if m.startswith("stopping on SIGTERM"))
        confirmed = [i for i, m in enumerate(msgs) if m.startswith("UNKNOWN -> CONFIRMED")]
        self.assertEqual(len(confirmed), 3)
        self.assertTrue(all(i > stop for i in confirmed), "the checks finished during the drain")
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE lease_owner IS NOT NULL"),
                         0)
        self.assertEqual(len(self.requests(op="status")), 3)
        self.invariants()


if __name__ == "__main__":
    main()
