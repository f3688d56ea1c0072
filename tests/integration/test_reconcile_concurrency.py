"""Two reconcilers on one backlog (DESIGN §2: any number of copies, PostgreSQL leases split the
work): ~200 effects made UNKNOWN by real timeouts, two tally-reconciler processes started
together. Each effect's status is asked by one reconciler at a time (the tool sees exactly one
status call per key) and no transition is written twice (one UNKNOWN -> CONFIRMED audit event
per effect), while both reconcilers take a share."""

from tallytest import wait_for
from test_reconcile_resolve import ReconcileCase, main, run_id

N = 200


class ReconcileConcurrencyTest(ReconcileCase):

    def test_two_reconcilers_split_a_backlog_without_double_work(self):
        disp = self.dispatcher(TALLY_MAX_INFLIGHT=N)
        run = run_id()
        self.fault("apply_then_hang", collection="charges", times=N, delay_ms=4000)
        self.publish_many([
            self.intent(run, i, "charge_card",
                        {"tenant_id": "t1", "payment_id": f"{run}-p{i}", "amount": i})
            for i in range(1, N + 1)])
        self.wait_count("SELECT count(*) FROM effects WHERE status = 'UNKNOWN'", N, timeout=90)
        self.assertEqual(disp.terminate(), 0)
        self.assertEqual(len(self.records("charges")), N)

        # Every status check takes 150 ms and each reconciler runs at most 10 at once, so one
        # alone would need 3 s: both are busy at the same time.
        self.fault("slow", op="status", times=-1, delay_ms=150)
        a = self.reconciler(wait_ready=False, TALLY_MAX_INFLIGHT=10, TALLY_BATCH_SIZE=10,
                            TALLY_WORKER_ID="reconciler-a")
        b = self.reconciler(wait_ready=False, TALLY_MAX_INFLIGHT=10, TALLY_BATCH_SIZE=10,
                            TALLY_WORKER_ID="reconciler-b")
        self.wait_count("SELECT count(*) FROM effects WHERE status = 'CONFIRMED'", N, timeout=120)
        self.assertTrue(a.alive() and b.alive())

        # The tool saw exactly one status call per key.
        statuses = self.requests(op="status")
        per_key = {}
        for r in statuses:
            per_key.setdefault(r["idempotency_key"], []).append(r)
        self.assertEqual(len(per_key), N)
        self.assertEqual({k: len(v) for k, v in per_key.items() if len(v) != 1}, {})

        # No transition written twice; every one by one of the two reconcilers.
        rows = self.query("SELECT effect_id, count(*), min(actor), max(actor) FROM events"
                          " WHERE kind = 'transition' AND from_status = 'UNKNOWN'"
                          " GROUP BY effect_id")
        self.assertEqual(len(rows), N)
        self.assertEqual([r for r in rows if r[1] != 1], [])
        by_actor = {}
        for _, _, actor, _ in rows:
            by_actor[actor] = by_actor.get(actor, 0) + 1
        self.assertEqual(set(by_actor), {"reconciler-a", "reconciler-b"}, by_actor)
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE kind = 'connector_call'"
                                     " AND data->>'op' = 'status'"), N)
        # One confirmed outcome per effect on the topic.
        got = self.messages("outcomes", lambda ms: len(
            {m["data"]["effect_id"] for m in ms if m["type"] == "tally.effect.confirmed.v1"}) == N,
            timeout=60)
        confirmed = [m for m in got if m["type"] == "tally.effect.confirmed.v1"]
        self.assertEqual(len(confirmed), N)
        wait_for(lambda: self.metric(a, "tally_unknown_effects") == 0
                 and self.metric(b, "tally_unknown_effects") == 0, timeout=10,
                 what="both UNKNOWN gauges to reach 0")
        self.assertIn(self.metric(a, "tally_reconciler_lost_leases_total"), (None, 0))
        self.assertIn(self.metric(b, "tally_reconciler_lost_leases_total"), (None, 0))
        self.assertEqual(a.terminate(), 0)
        self.assertEqual(b.terminate(), 0)
        self.invariants()


if __name__ == "__main__":
    main()
