"""PostgreSQL goes away under the workers and comes back (a failover, a restart): nothing is
lost, nothing is called twice, and the probes say what happened (DESIGN §2, §3 rule 1, §9).

The outage is made inside the test's own database: new connections are refused
(`ALLOW_CONNECTIONS false`) and every connection of the workers is terminated, as a server
that went down would leave them. The test's own connection, which watches, is kept."""

import contextlib
import re
import time

from dispatchcase import main, run_id
from tallytest import wait_for
from test_compensate_flow import CompensateCase

OUTAGE_S = 4.0


class PostgresOutageTest(CompensateCase):

    @contextlib.contextmanager
    def outage(self):
        """The test's database refuses connections and every worker's is terminated; the
        outage ends with the block. (PostgreSQL will not close the current database to
        connections, hence admin().)"""
        self.admin(f'ALTER DATABASE "{self.dbname}" ALLOW_CONNECTIONS false')
        try:
            self.assertTrue(self.terminate_backends(),
                            "the workers had no connection to terminate")
            yield
        finally:
            self.admin(f'ALTER DATABASE "{self.dbname}" ALLOW_CONNECTIONS true')

    def ride_out(self, worker, seconds=OUTAGE_S):
        """The outage lasts @p seconds; @p worker says it is not ready, and stays up."""
        wait_for(lambda: worker.http_get("/readyz")[0] == 503, timeout=seconds,
                 what=f"{worker.name}'s /readyz to report the outage")
        time.sleep(seconds)
        self.assertTrue(worker.alive(), f"{worker.name} exited during the outage:\n{worker.log()}")
        self.assertEqual(worker.http_get("/healthz"), (200, "ok"))

    def db_errors(self, worker, name):
        """{label value: count} of a worker's tally_<worker>_db_errors_total."""
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^' + name + r'\{\w+="([^"]+)"\} (\S+)$', self.metrics(worker), re.M)}

    def test_calls_in_flight_and_intents_sent_meanwhile_are_recorded_once_after_it(self):
        d = self.dispatcher()
        workers = [d, self.start("tally-reconciler"), self.start("tally-compensator")]
        for p in workers:
            wait_for(lambda: p.http_get("/readyz")[0] == 200, timeout=30,
                     what=f"{p.name} /readyz before the outage")
        run = run_id()
        # The first wave's calls are still at the tool when the database goes away, and
        # answer one at a time during the outage (the tool's timeout is 2 s).
        for i in range(10):
            self.fault("slow", key=f"create_hold:{run}-a{i}", delay_ms=1000 + 80 * i)
        first = [self.intent(run, i + 1, "create_hold", {"hold_id": f"{run}-a{i}"})
                 for i in range(10)]
        self.publish_many(first)
        wait_for(lambda: len(self.requests()) == 10, timeout=30,
                 what="the first wave's calls to reach the tool")

        with self.outage():
            second = [self.intent(run, i + 11, "create_hold", {"hold_id": f"{run}-b{i}"})
                      for i in range(10)]
            self.publish_many(second)
            # The slow calls answer during the outage; their results wait in the dispatcher.
            self.ride_out(d)
            self.assertEqual(len(self.requests()), 10,
                             "a call was made while its effect could not be written")
            for p in workers:
                self.assertTrue(p.alive(), f"{p.name} exited during the outage:\n{p.log()}")
                self.assertEqual(p.http_get("/healthz"), (200, "ok"))

        intents = first + second
        answers = self.outcomes_for([ce["id"] for ce in intents], timeout=60)
        for ce in intents:
            types = {ev["type"] for ev in answers[ce["id"]]}
            self.assertEqual(types, {"tally.effect.confirmed.v1"}, ce["data"]["step"])
        self.assertEqual(
            self.scalar("SELECT count(*) FROM effects WHERE run_id = %s AND status = 'CONFIRMED'"
                        " AND attempts = 1", (run,)), 20)
        # One call and one record per intent: the first wave's results were kept through
        # the outage and written after it, not left to the reconciler to ask about.
        reqs = self.requests()
        self.assertEqual(len(reqs), 20)
        self.assertEqual(len({r["idempotency_key"] for r in reqs}), 20)
        self.assertEqual(len(self.records("holds")), 20)
        self.assertEqual(self.scalar("SELECT count(*) FROM events e JOIN effects f USING"
                                     " (effect_id) WHERE f.run_id = %s AND e.kind ="
                                     " 'connector_call'", (run,)), 20)
        for p in workers:
            wait_for(lambda: p.http_get("/readyz")[0] == 200, timeout=30,
                     what=f"{p.name} /readyz after the outage")
        self.assertIn("retrying", d.log())
        self.invariants()

    def test_a_status_check_answered_during_the_outage_is_recorded_after_it(self):
        run = run_id()
        eff = self.add_effect(run, 1, "create_hold", {"hold_id": f"{run}-h"}, status="UNKNOWN",
                              execute=True)
        self.fault("slow", key=eff["key"], op="status", delay_ms=1000)
        rec = self.start("tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url,
                         TALLY_POLL_MS=200, TALLY_SWEEP_MS=200)
        wait_for(lambda: self.requests(eff["key"], op="status"), timeout=30,
                 what="the status check to reach the tool")
        # Every step's failure counter is there at 0 before anything failed.
        before = self.db_errors(rec, "tally_reconciler_db_errors_total")
        self.assertEqual(set(before), {"record", "claim", "release", "audit", "sweep", "expire",
                                       "complete_runs", "gauges"})
        self.assertEqual(sum(before.values()), 0, before)
        with self.outage():
            self.ride_out(rec)
            # the statements it tried meanwhile failed, and were counted (TallyDatabaseErrors)
            during = self.db_errors(rec, "tally_reconciler_db_errors_total")
            self.assertGreater(sum(during.values()), 0, during)
        row = self.wait_status("create_hold", eff["key"], "CONFIRMED", timeout=30)
        self.assertEqual(row["receipt"], eff["receipt"])
        # The verdict was kept through the outage, not dropped and asked for again.
        self.assertEqual(len(self.requests(eff["key"], op="status")), 1)
        wait_for(lambda: rec.http_get("/readyz")[0] == 200, timeout=30,
                 what="the reconciler's /readyz after the outage")
        self.invariants()

    def test_a_reverse_call_answered_during_the_outage_is_recorded_after_it(self):
        run = run_id()
        for step in (1, 2, 3):
            self.add_effect(run, step, "create_hold", {"hold_id": f"{run}-h{step}"})
        self.fault("slow", collection="holds", op="reverse", times=1, delay_ms=1000)
        self.compensate(run)
        comp = self.compensator()
        wait_for(lambda: self.requests(op="reverse"), timeout=30,
                 what="the first reverse call to reach the tool")
        with self.outage():
            self.ride_out(comp)
        self.wait_run(run, "COMPENSATED", timeout=60)
        obs = self.obligations(run)
        self.assertEqual([(o["step"], o["status"], o["attempts"]) for o in obs],
                         [("3", "RESOLVED", 1), ("2", "RESOLVED", 1), ("1", "RESOLVED", 1)])
        self.assertEqual(len(self.requests(op="reverse")), 3)
        self.assertEqual(len(self.reversals()), 3)
        wait_for(lambda: comp.http_get("/readyz")[0] == 200, timeout=30,
                 what="the compensator's /readyz after the outage")
        self.invariants(obligations_settled=True)
        self.compensation_invariants()


if __name__ == "__main__":
    main()
