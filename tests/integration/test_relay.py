"""The message-outbox relay inside every worker: a row becomes one Kafka message (key, payload,
"ce_id" header) and is deleted only after the broker acknowledged it; with Kafka down the row
stays with its error; several relays share the outbox without losing a row."""

import json
import time
import uuid

from psycopg2.extras import execute_values

import tallytest
from tallytest import TallyCase, free_port, wait_for


def cloudevent(run_id, status="CONFIRMED"):
    return {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/relay",
            "type": "tally.effect.confirmed.v1", "datacontenttype": "application/json",
            "subject": run_id,
            "data": {"effect_id": str(uuid.uuid4()), "run_id": run_id, "step": "1",
                     "tool": "relay_test", "operation_key": "relay:" + run_id, "status": status,
                     "receipt": None, "external_ref": None, "error": None, "attempts": 1,
                     "intent_id": str(uuid.uuid4())}}


class RelayTest(TallyCase):

    def insert(self, events, topic="outcomes"):
        """Rows as the ledger's own writer (outbox.c) stores them: compact JSON text."""
        rows = [(topic, ev["subject"], ev["id"], json.dumps(ev, separators=(",", ":")))
                for ev in events]
        with self.db.cursor() as cur:
            execute_values(cur, "INSERT INTO message_outbox (topic, msg_key, event_id, payload)"
                                " VALUES %s", rows, page_size=1000)

    def outbox_count(self):
        return self.scalar("SELECT count(*) FROM message_outbox")

    def read_raw(self, logical, want, timeout=60, settle=0.0):
        """Raw messages of a topic until `want` distinct CloudEvent ids were seen, then keep
        reading `settle` seconds more (to catch duplicates)."""
        c = self.reader(logical)
        got, ids = [], set()
        deadline = time.monotonic() + timeout
        settle_until = None
        while True:
            now = time.monotonic()
            if settle_until is not None and now >= settle_until:
                return got
            if now >= deadline:
                raise AssertionError(f"{len(ids)} of {want} events arrived on "
                                     f"{self.topic(logical)} within {timeout}s")
            m = c.poll(0.2)
            if m is None or m.error():
                continue
            got.append(m)
            ids.add(json.loads(m.value())["id"])
            if len(ids) >= want and settle_until is None:
                settle_until = time.monotonic() + settle

    def test_row_is_published_once_with_key_payload_and_header_then_deleted(self):
        events = [cloudevent(f"run-{i}-" + uuid.uuid4().hex[:6]) for i in range(3)]
        self.insert(events)
        self.start("tally-reconciler")

        msgs = self.read_raw("outcomes", want=len(events), settle=3.0)
        self.assertEqual(len(msgs), len(events), "each row must be published exactly once")
        by_id = {ev["id"]: ev for ev in events}
        for m in msgs:
            value = json.loads(m.value())
            sent = by_id[value["id"]]
            self.assertEqual(value, sent)
            self.assertEqual(m.value().decode(), json.dumps(sent, separators=(",", ":")))
            self.assertEqual(m.key().decode(), sent["subject"])
            headers = dict(m.headers() or [])
            self.assertEqual(headers.get("ce_id"), sent["id"].encode())
        wait_for(lambda: self.outbox_count() == 0, timeout=30, what="the outbox to empty")

        # new rows while the relay idles are picked up by the NOTIFY wake-up
        later = cloudevent("run-later")
        self.insert([later], topic="alerts")
        got = self.read_until("alerts", lambda vs: any(v.get("id") == later["id"] for v in vs))
        self.assertEqual([v["id"] for v in got], [later["id"]])
        wait_for(lambda: self.outbox_count() == 0, timeout=30, what="the outbox to empty")

    def test_row_stays_while_kafka_is_down_then_is_published(self):
        ev = cloudevent("run-down")
        self.insert([ev])
        dead = f"127.0.0.1:{free_port()}"
        down = self.start("tally-reconciler", wait_ready=False, TALLY_KAFKA_BROKERS=dead,
                          TALLY_KAFKA_MESSAGE_TIMEOUT_MS=1000)
        row = wait_for(lambda: self.query(
            "SELECT attempts, last_error, lease_owner FROM message_outbox"
            " WHERE event_id = %s AND last_error IS NOT NULL", (ev["id"],)),
            timeout=60, what="a failed delivery to be recorded")
        attempts, last_error, lease_owner = row[0]
        self.assertGreater(attempts, 0)
        self.assertIn("timed out", last_error)
        self.assertIsNone(lease_owner, "a failed row must be released for the next relay")
        down.terminate()
        self.assertEqual(self.outbox_count(), 1, "an undelivered row must never be deleted")
        self.assertTrue(any("not delivered" in line.get("msg", "") for line in down.log_lines()),
                        "the failed delivery must be logged with its reason")

        self.start("tally-reconciler")
        msgs = self.read_raw("outcomes", want=1, timeout=90, settle=1.0)
        self.assertEqual([json.loads(m.value())["id"] for m in msgs], [ev["id"]])
        wait_for(lambda: self.outbox_count() == 0, timeout=30, what="the outbox to empty")

    def test_two_relays_publish_2000_rows(self):
        env = {"TALLY_RELAY_BATCH": 100}
        a = self.start("tally-reconciler", **env)
        b = self.start("tally-reconciler", **env)
        events = [cloudevent(f"run-{i % 50}") for i in range(2000)]
        for i in range(0, len(events), 250):
            self.insert(events[i:i + 250])
        msgs = self.read_raw("outcomes", want=len(events), timeout=120, settle=1.0)
        seen = {json.loads(m.value())["id"] for m in msgs}
        self.assertEqual(seen, {ev["id"] for ev in events})
        wait_for(lambda: self.outbox_count() == 0, timeout=60, what="the outbox to empty")
        self.assertTrue(a.alive() and b.alive())
        # every message carries its run as the key, so a run stays on one partition
        for m in msgs:
            self.assertEqual(m.key().decode(), json.loads(m.value())["subject"])


    def test_a_reference_whose_audit_event_is_missing_waits_and_the_rest_go_out(self):
        """A message_refs row names an audit event the ledger does not hold (a hand-made row:
        tally never writes one): the relay cannot build its event, so it keeps the row with
        the reason and backs it off, never publishes garbage, and the rows beside it go out."""
        missing = str(uuid.uuid4())
        self.query("INSERT INTO message_refs (event_id, msg_key) VALUES (%s, 'run-missing')",
                   (missing,))
        ev = cloudevent("run-beside")
        self.insert([ev])
        w = self.start("tally-reconciler")
        msgs = self.read_raw("outcomes", want=1, settle=2.0)
        self.assertEqual([json.loads(m.value())["id"] for m in msgs], [ev["id"]])
        row = wait_for(lambda: self.query(
            "SELECT attempts, last_error, lease_owner FROM message_refs"
            " WHERE event_id = %s AND attempts > 0", (missing,)),
            timeout=30, what="the reference to be backed off")
        attempts, last_error, lease_owner = row[0]
        self.assertIn("not in the ledger", last_error)
        self.assertIsNone(lease_owner)
        self.assertTrue(w.alive(), w.log())
        wait_for(lambda: self.outbox_count() == 0, timeout=30, what="the outbox to empty")


if __name__ == "__main__":
    tallytest.main()
