"""Every worker that consumes a topic reports its consumer lag and its consumer-group
rebalances the same way (common/src/worker.c, common/src/kafka.c; issue 26): the alert rules
TallyConsumerLag and TallyRebalancesFrequent read them for the dispatcher, the reconciler
and the compensator alike.

- tally_kafka_consumer_lag{partition,topic} on each worker, one series per partition of its
  own topic once the group assigned them (the embedded cluster makes 4);
- tally_kafka_rebalances_total{kind} exists at 0 for assign and revoke before the first
  rebalance, counts the assignment of a lone member, and a second member joining makes the
  first one give partitions up (counted, and logged at INFO with the partitions); leaving
  the group at SIGTERM logs the revocation.
"""

import json
import os
import re
import uuid
from collections import Counter

import tallytest
from tallytest import wait_for
from test_compensate_flow import CompensateCase

PARTITIONS = 4  # the embedded cluster creates topics with 4 partitions


class ConsumerMetricsTest(CompensateCase):

    def value(self, proc, name, **labels):
        return self.metric_value(self.metrics(proc), name, **labels)

    def lag_series(self, proc):
        """{(topic, partition): value} of @proc's tally_kafka_consumer_lag."""
        return {(m.group(2), int(m.group(1))): float(m.group(3)) for m in re.finditer(
            r'^tally_kafka_consumer_lag\{partition="(\d+)",topic="([^"]+)"\} (\S+)$',
            self.metrics(proc), re.M)}

    def rebalance_lines(self, proc, what):
        """The INFO lines @proc logged for a rebalance that @what (assigned, revoked, lost)."""
        return [ln["msg"] for ln in proc.log_lines()
                if ln.get("level") == "info" and "consumer group rebalance" in ln.get("msg", "")
                and f" {what} " in ln["msg"]]

    def test_every_consuming_worker_reports_its_lag_and_rebalances(self):
        workers = {"intents": self.dispatcher(),
                   "outcomes": self.start("tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url),
                   "obligations": self.compensator()}
        for topic, p in workers.items():
            # /healthz answers from before the consumer is made; /readyz once it started
            wait_for(lambda: p.http_get("/readyz")[0] == 200, timeout=60,
                     what=f"{p.name} started")
            # the counter is there at 0 for both kinds before anything happened to count
            text = self.metrics(p)
            self.assertIsNotNone(self.metric_value(text, "tally_kafka_rebalances_total",
                                                   kind="revoke"), p.name)
            self.assertIsNotNone(self.metric_value(text, "tally_kafka_rebalances_total",
                                                   kind="assign"), p.name)
        for topic, p in workers.items():
            wait_for(lambda: (self.value(p, "tally_kafka_rebalances_total", kind="assign")
                              or 0) >= 1, timeout=60, what=f"{p.name} assigned its partitions")
            self.assertEqual(self.value(p, "tally_kafka_rebalances_total", kind="revoke"), 0,
                             p.name)
            # the gauge is refilled every 10 s from the assignment: every partition of the
            # worker's own topic, and nothing else
            want = {(self.topic(topic), n) for n in range(PARTITIONS)}
            wait_for(lambda: set(self.lag_series(p)) == want, timeout=30,
                     what=f"{p.name}'s lag for the {PARTITIONS} partitions of {topic}")
            for key, lag in self.lag_series(p).items():
                self.assertGreaterEqual(lag, 0, f"{p.name} {key}")
            lines = self.rebalance_lines(p, "assigned")
            self.assertTrue(lines, p.log())
            self.assertIn(self.topic(topic) + " [0,1,2,3]", lines[0])

        # A second dispatcher joins the group: the first gives partitions up and gets its
        # share again; between them every partition has one owner.
        d1 = workers["intents"]
        d2 = self.dispatcher()
        wait_for(lambda: (self.value(d1, "tally_kafka_rebalances_total", kind="revoke")
                          or 0) >= 1, timeout=60, what="the first dispatcher's revocation")
        wait_for(lambda: (self.value(d2, "tally_kafka_rebalances_total", kind="assign")
                          or 0) >= 1, timeout=60, what="the second dispatcher's assignment")
        self.assertTrue(self.rebalance_lines(d1, "revoked"), d1.log())
        self.assertEqual(d2.terminate(), 0)
        self.assertTrue(self.rebalance_lines(d2, "revoked") or
                        self.rebalance_lines(d2, "lost"), d2.log())

    def test_intake_is_counted_by_partition_and_time_by_phase(self):
        d = self.dispatcher()
        wait_for(lambda: d.http_get("/readyz")[0] == 200, timeout=60, what="dispatcher ready")
        n = 40
        intents = [self.intent(f"run-{uuid.uuid4().hex[:12]}", 1, "update_ledger",
                               {"entry_id": f"e-{i}-{uuid.uuid4().hex[:8]}", "amount": i + 1})
                   for i in range(n)]
        self.publish_many(intents)
        self.wait_count("SELECT count(*) FROM effects WHERE status = 'CONFIRMED'", n)
        # what Kafka holds per partition, read by the test's own consumer
        mine = {ce["id"] for ce in intents}
        held = Counter()
        reader = self.reader("intents")
        seen = set()
        wait_for(lambda: self._read_ids(reader, mine, seen, held) >= n, timeout=30,
                 what="the test's reader to see every intent")
        topic = self.topic("intents")

        def read_by_partition():
            return {int(m.group(1)): float(m.group(3)) for m in re.finditer(
                r'^tally_kafka_messages_read_total\{partition="(\d+)",topic="([^"]+)"\} (\S+)$',
                self.metrics(d), re.M) if m.group(2) == topic}
        # every message read once, on the partition it is on
        wait_for(lambda: sum(read_by_partition().values()) == n, timeout=30,
                 what=f"{n} intents counted as read")
        self.assertEqual({p: v for p, v in read_by_partition().items() if v},
                         {p: float(c) for p, c in held.items()})
        self.assertGreater(len(held), 1, "the intents should spread over partitions")
        text = self.metrics(d)
        phases = {ph: self.metric_value(text, "tally_dispatcher_seconds_total", phase=ph)
                  for ph in ("kafka", "intake", "claim", "wait", "record")}
        for ph, v in phases.items():
            self.assertIsNotNone(v, ph)
            self.assertGreater(v, 0, f"{ph}: {text}")
        # the main loop's phases cannot add up to more than the time it has run
        with open(f"/proc/{d.pid}/stat") as f:
            alive_s = float(f.read().rsplit(") ", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        hz = float(os.sysconf("SC_CLK_TCK"))
        ran_s = uptime - alive_s / hz
        loop = sum(v for ph, v in phases.items() if ph != "record")
        self.assertLessEqual(loop, ran_s + 1.0, phases)

    @staticmethod
    def _read_ids(reader, mine, seen, held):
        m = reader.poll(0.2)
        while m is not None:
            if not m.error():
                ce = json.loads(m.value())
                if ce.get("id") in mine and ce["id"] not in seen:
                    seen.add(ce["id"])
                    held[m.partition()] += 1
            m = reader.poll(0)
        return len(seen)


if __name__ == "__main__":
    tallytest.main()
