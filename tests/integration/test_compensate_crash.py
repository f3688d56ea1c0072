"""The compensator under crashes and concurrency (DESIGN §2, §3 rules 3-4, §11; issue 5):
SIGKILL in the middle of a reverse call loses nothing and reverses nothing twice (the lease
expires, the call is repeated with the same reverse key); SIGTERM lets the call in flight
finish and records it; two compensators on many runs keep the reverse order inside every run
and run nothing twice."""

import collections
import json
import os
import signal
import time
import uuid

import tallytest
from tallytest import wait_for
from test_compensate_flow import CompensateCase, new_run_id


class CompensateCrashTest(CompensateCase):

    def one_charge(self):
        run_id = new_run_id()
        eff = self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t3",
                                                         "payment_id": uuid.uuid4().hex[:10],
                                                         "amount": 42})
        return run_id, eff

    def in_flight(self):
        return [r for r in self.fake_requests(op="reverse") if r["status"] is None]

    def test_sigkill_mid_reverse_then_the_lease_expires_and_the_same_key_is_used(self):
        # the first reverse sleeps 3 s upstream, then applies; the worker dies meanwhile
        self.fault("slow", collection="charges", op="reverse", times=1, delay_ms=3000)
        run_id, eff = self.one_charge()
        self.compensate(run_id)
        first = self.compensator(TALLY_LEASE_MS=1000)
        wait_for(self.in_flight, timeout=30, what="the reverse call to be in flight")
        first.kill()
        ob = self.obligation_of(run_id, "charge_card")
        self.assertEqual((ob["status"], ob["attempts"]), ("RUNNING", 1))
        # a new worker takes the obligation over once the lease (from the database clock) ends
        second = self.compensator(TALLY_LEASE_MS=1000)
        run = self.wait_run(run_id, "COMPENSATED", timeout=60)
        reqs = self.fake_requests(op="reverse")
        self.assertEqual(len(reqs), 2)
        self.assertEqual({r["idempotency_key"] for r in reqs}, {f"reverse:{ob['obligation_id']}"})
        self.assertEqual(len(self.reversals()), 1)  # the tool saw one reversal
        ob = self.obligation_of(run_id, "charge_card")
        self.assertEqual((ob["status"], ob["attempts"]), ("RESOLVED", 2))
        self.assertEqual(run["summary"]["compensated"][0]["reverse_receipt"]["id"],
                         self.reversals()[0]["id"])
        takeover = self.query("SELECT reason FROM events WHERE obligation_id = %s"
                              " AND kind = 'lease' ORDER BY seq", (ob["obligation_id"],))
        self.assertEqual([r[0] for r in takeover], ["leased", "expired lease taken over"])
        self.assertEqual(second.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_a_worker_whose_lease_was_taken_over_writes_nothing(self):
        # A is frozen mid-call past its lease; B takes over and finishes; A wakes up late
        self.fault("slow", collection="charges", op="reverse", times=1, delay_ms=1500)
        run_id, eff = self.one_charge()
        self.compensate(run_id)
        a = self.compensator(TALLY_LEASE_MS=1000, TALLY_WORKER_ID="comp-a")
        wait_for(self.in_flight, timeout=30, what="A's reverse call to be in flight")
        os.kill(a.pid, signal.SIGSTOP)
        try:
            b = self.compensator(TALLY_LEASE_MS=1000, TALLY_WORKER_ID="comp-b")
            self.wait_run(run_id, "COMPENSATED", timeout=60)
        finally:
            os.kill(a.pid, signal.SIGCONT)
        wait_for(lambda: "lease lost" in a.log(), timeout=30, what="A to notice its lost lease")
        ob = self.obligation_of(run_id, "charge_card")
        self.assertEqual((ob["status"], ob["attempts"]), ("RESOLVED", 2))
        moves = self.query("SELECT actor, to_status FROM events WHERE obligation_id = %s"
                           " AND kind = 'obligation' AND from_status = 'RUNNING'",
                           (ob["obligation_id"],))
        self.assertEqual(moves, [("comp-b", "RESOLVED")])
        self.assertEqual(len(self.reversals()), 1)
        self.assertEqual(self.metric_value(self.metrics(a), "tally_obligation_lease_lost_total"),
                         1)
        self.assertEqual(a.terminate(), 0)
        self.assertEqual(b.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_sigterm_lets_the_reverse_in_flight_finish_and_records_it(self):
        self.fault("slow", collection="charges", op="reverse", times=1, delay_ms=1500)
        run_id, eff = self.one_charge()
        self.compensate(run_id)
        comp = self.compensator(TALLY_SHUTDOWN_GRACE_MS=10000)
        wait_for(self.in_flight, timeout=30, what="the reverse call to be in flight")
        started = time.monotonic()
        self.assertEqual(comp.terminate(timeout=30), 0)
        self.assertLess(time.monotonic() - started, 10)
        ob = self.obligation_of(run_id, "charge_card")
        self.assertEqual(ob["status"], "RESOLVED")
        self.assertEqual(len(self.reversals()), 1)
        self.assertIn("drained: every reverse call finished and was recorded", comp.log())
        # nothing new was leased after SIGTERM: a second run stays untouched
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_two_compensators_on_many_runs_keep_order_and_run_nothing_twice(self):
        runs = {}
        for _ in range(30):
            run_id, steps = self.four_step_run()
            runs[run_id] = steps
        batch = os.path.join(self.tmp, "batch.json")
        with open(batch, "w") as f:
            json.dump([{"kind": "compensate", "run_id": r, "reason": "load"} for r in runs], f)
        results = self.driver("batch", batch)
        self.assertEqual(sum(r["obligations_created"] for r in results), 120)
        # slow reverses spread the work, so both workers hold leases at once
        self.fault("slow", collection="holds", op="reverse", times=10, delay_ms=300)
        a = self.compensator(TALLY_BATCH_SIZE=4, TALLY_WORKER_ID="comp-a")
        b = self.compensator(TALLY_BATCH_SIZE=4, TALLY_WORKER_ID="comp-b")
        self.wait_count("SELECT count(*) FROM runs WHERE status = 'PARTIALLY_COMPENSATED'"
                        " AND summary IS NOT NULL", 30, timeout=180)

        reqs = [r for r in self.fake_requests() if r["op"] in ("reverse", "contain")]
        by_run = collections.defaultdict(list)
        for r in reqs:
            by_run[r["run_id"]].append((r["seq"], r["collection"], r["op"]))
        self.assertEqual(set(by_run), set(runs))
        for run_id, calls in by_run.items():
            order = [c for _, c, _ in sorted(calls)]
            self.assertEqual(order, ["holds", "emails", "charges"], run_id)
        # nothing ran twice: one request per obligation key, one reversal per reversible step
        keys = collections.Counter(r["idempotency_key"] for r in reqs)
        self.assertEqual(len(keys), 90)
        self.assertEqual(max(keys.values()), 1, keys.most_common(3))
        self.assertEqual(len(self.reversals()), 60)
        self.assertEqual(len(self.fake_get("/_control/records")["containments"]), 30)
        # both workers took part, and each obligation was recorded once
        actors = dict(self.query("SELECT actor, count(*) FROM events WHERE kind = 'obligation'"
                                 " AND from_status = 'RUNNING' GROUP BY actor"))
        self.assertEqual(set(actors), {"comp-a", "comp-b"}, actors)
        self.assertEqual(sum(actors.values()), 120)
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE kind = 'summary'"
                                     " OR (kind = 'transition' AND to_status ="
                                     " 'PARTIALLY_COMPENSATED')"), 30)
        self.assertEqual(a.terminate(), 0)
        self.assertEqual(b.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()


if __name__ == "__main__":
    tallytest.main()
