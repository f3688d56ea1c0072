"""Dispatcher against bad input: every refused message lands in tally.dlq with its reason and
its original bytes, the good messages around it are processed, the dispatcher stays up."""

import base64
import json
import time
import uuid

from dispatchcase import DispatchCase, main, run_id


class DispatchDlqTest(DispatchCase):

    def test_every_bad_input_goes_to_the_dlq_and_the_good_ones_through(self):
        d = self.dispatcher(TALLY_MAX_MESSAGE_BYTES=8192)
        run = run_id()
        evil = "'; DROP TABLE effects; --"
        good = []

        def good_intent(i):
            ce = self.intent(run, i, "update_ledger", {"entry_id": f"{run}-{i}", "note": evil})
            good.append(ce)
            return json.dumps(ce).encode()

        missing = self.intent(run, 100, "update_ledger", {"entry_id": "x"})
        del missing["data"]["tool"]
        unknown_tool = self.intent(run, 101, "launch_rockets", {"id": 1})
        no_key = self.intent(run, 102, "charge_card", {"tenant_id": "t1"})
        ctl_key = self.intent(run, 103, "update_ledger", {"entry_id": "a\r\nX-Injected: 1"})
        oversized = self.intent(run, 104, "update_ledger", {"entry_id": "big", "pad": "x" * 20000})
        not_ce = {"hello": "world", "data": {"run_id": run}}
        bad_utf8 = json.dumps(self.intent(run, 105, "update_ledger", {"entry_id": "u"})) \
            .encode().replace(b'"u"', b'"\xff\xfe"')
        bad = [
            (b"{this is not json", "not_json"),
            (json.dumps(not_ce).encode(), "not_cloudevent"),
            (json.dumps(missing).encode(), "missing_field"),
            (json.dumps(unknown_tool).encode(), "unknown_tool"),
            (json.dumps(no_key).encode(), "missing_operation_key"),
            # A key with control characters is invalid (it would become a header), not missing.
            (json.dumps(ctl_key).encode(), "invalid_field"),
            (json.dumps(oversized).encode(), "too_large"),
            (bad_utf8, "invalid_utf8"),
        ]
        # Interleave: good, bad, good, bad, ... all with the run's key (one partition, in order).
        values = [good_intent(1)]
        for i, (value, _) in enumerate(bad):
            values.append(value)
            values.append(good_intent(i + 2))
        p = self.producer()
        for v in values:
            p.produce(self.topic("intents"), value=v, key=run.encode())
        p.flush(30)

        self.wait_count("SELECT count(*) FROM effects WHERE status = 'CONFIRMED'", len(good))
        dlq = self.read_until("dlq", lambda got: len(got) >= len(bad), timeout=60)
        self.assertEqual(len(dlq), len(bad))
        self.assertEqual([m["data"]["reason"] for m in dlq], [r for _, r in bad])
        offsets = [m["data"]["offset"] for m in dlq]
        self.assertEqual(offsets, sorted(offsets))
        for m, (value, reason) in zip(dlq, bad):
            data = m["data"]
            self.assertEqual(m["type"], "tally.dlq.v1")
            self.assertEqual(data["topic"], self.topic("intents"))
            self.assertEqual(data["key"], run)
            self.assertTrue(data["detail"], m)
            self.assertEqual(data["original_bytes"], len(value))
            if reason == "invalid_utf8":
                self.assertEqual(base64.b64decode(data["original_base64"]), value)
            elif reason == "too_large":
                self.assertTrue(data["original_truncated"])
                self.assertTrue(value.decode().startswith(data["original"]))
                self.assertLessEqual(len(json.dumps(m, separators=(",", ":"))), 8192)
            else:
                self.assertFalse(data["original_truncated"])
                self.assertEqual(data["original"].encode(), value)
        # SQL metacharacters are data: stored as given and sent to the tool as given.
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE args_canonical LIKE %s",
                                     ("%" + evil + "%",)), len(good))
        for rec in self.records("ledger_entries"):
            self.assertEqual(rec["body"]["note"], evil)
        self.assertTrue(d.alive())
        status, text = d.http_get("/metrics")
        self.assertIn('tally_dlq_total{reason="not_json"} 1', text)
        self.assertIn('tally_intents_total{result="dlq"} 8', text)
        self.assertEqual(d.http_get("/healthz")[0], 200)
        self.invariants()

    def test_sql_metacharacters_in_ids_are_stored_as_data(self):
        self.dispatcher()
        run = "run'); DELETE FROM runs; --" + uuid.uuid4().hex[:6]
        key = "k'||(SELECT 1)||'\"\\"
        ce = self.publish(self.intent(run, "step'--", "update_ledger", {"entry_id": key}))
        row = self.wait_status("update_ledger", f"update_ledger:{key}", "CONFIRMED")
        self.assertEqual(self.query("SELECT run_id, step FROM effects WHERE effect_id = %s",
                                    (row["effect_id"],)), [(run, "step'--")])
        [ev] = self.outcomes_for([ce["id"]])[ce["id"]]
        self.assertEqual(ev["data"]["run_id"], run)
        self.assertEqual(ev["data"]["step"], "step'--")
        self.assertEqual(self.scalar("SELECT count(*) FROM runs"), 1)
        self.invariants()

    def test_a_dlq_burst_does_not_stall_the_partition(self):
        d = self.dispatcher()
        run = run_id()
        p = self.producer()
        for i in range(300):
            p.produce(self.topic("intents"), value=b"\x00garbage %d" % i, key=run.encode())
        last = self.intent(run, 1, "update_ledger", {"entry_id": f"{run}-after"})
        p.produce(self.topic("intents"), value=json.dumps(last).encode(), key=run.encode())
        p.flush(30)
        self.wait_status("update_ledger", f"update_ledger:{run}-after", "CONFIRMED")
        dlq = self.read_until("dlq", lambda got: len(got) >= 300, timeout=60)
        self.assertEqual({m["data"]["reason"] for m in dlq}, {"not_json"})
        time.sleep(0.5)
        self.assertTrue(d.alive())
        self.invariants()


if __name__ == "__main__":
    main()
