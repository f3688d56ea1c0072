"""The agent front door at the wire (docs/agent-protocol.md): answers routed to the reply
destination an intent names (Spring Kafka's request/reply headers or CloudEvents extension
attributes), every refused intent answered with tally.intent.rejected.v1, and runs that
complete. Real tally-dispatcher, tally-reconciler and tally-fake-tool; the reply topics are
read with a plain consumer, as a Spring ReplyingKafkaTemplate or any client would.
"""

import json
import struct
import time
import uuid

from confluent_kafka import Consumer, TopicPartition

import tallytest
from test_reconcile_resolve import ReconcileCase
from test_schemas import validator
from tallytest import wait_for


def headers_of(msg):
    return {k: v for k, v in (msg.headers() or [])}


SCHEMA_OF = {"tally.intent.rejected.v1": "intent_rejected", "tally.run.": "run_event",
             "tally.effect.": "effect_event"}


def check_schema(case, event):
    """Every answer tally sends to a reply topic is valid against its schema (schemas/)."""
    for prefix, name in SCHEMA_OF.items():
        if event["type"].startswith(prefix):
            errors = [e.message for e in validator(name).iter_errors(event)]
            case.assertEqual(errors, [], f"{event['type']} against {name}: {event}")
            return
    case.fail(f"no schema for {event['type']}")


class RepliesCase(ReconcileCase):

    def reply_topic(self):
        """A fresh reply topic under the allowed prefix (<prefix>replies.). The mock cluster
        does not answer CreateTopics; asking for the topic's metadata creates it (4
        partitions), as a cluster with auto.create.topics.enable does."""
        name = self.topic("replies.") + uuid.uuid4().hex[:10]
        wait_for(lambda: len(self.producer().list_topics(topic=name, timeout=10)
                             .topics[name].partitions) > 0, timeout=20, what=name)
        return name

    def reply_reader(self, topic):
        c = Consumer({"bootstrap.servers": self.stack.kafka, "group.id": "r-" + uuid.uuid4().hex,
                      "enable.auto.commit": False, "fetch.wait.max.ms": 10})
        md = c.list_topics(topic=topic, timeout=10)
        parts = md.topics[topic].partitions
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        self._consumers.append(c)
        return c

    def read_replies(self, reader, predicate, timeout=30, settle=0.5):
        """[(value dict, headers dict, partition)] until predicate(values) holds, plus what
        arrives in the next `settle` seconds."""
        got = []
        deadline = time.monotonic() + timeout
        settled_at = None
        while time.monotonic() < deadline:
            m = reader.poll(0.1)
            if m is not None and not m.error():
                got.append((json.loads(m.value()), headers_of(m), m.partition()))
                check_schema(self, got[-1][0])
            if settled_at is None and predicate([g[0] for g in got]):
                settled_at = time.monotonic()
            if settled_at is not None and time.monotonic() - settled_at >= settle:
                return got
        raise AssertionError(f"timed out reading replies; got {[g[0] for g in got]!r}"[:3000])

    def publish_with(self, ce, headers=None, key=None):
        errors = []
        p = self.producer()
        p.produce(self.topic("intents"), value=json.dumps(ce).encode() if isinstance(ce, dict)
                  else ce, key=key if key is not None else
                  (ce["data"]["run_id"] if isinstance(ce, dict) else None),
                  headers=headers or [],
                  on_delivery=lambda err, msg: err and errors.append(err))
        p.flush(10)
        self.assertFalse(errors)
        return ce

    def run_message(self, kind, run, **data):
        """A tally.<kind>.v1 run message (complete_run, cancel_run, compensate_run)."""
        data["run_id"] = run
        return {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests",
                "type": f"tally.{kind}.v1", "data": data}

    def spring_headers(self, topic, corr, partition=None):
        h = [("kafka_replyTopic", topic.encode()), ("kafka_correlationId", corr)]
        if partition is not None:
            h.append(("kafka_replyPartition", struct.pack(">i", partition)))
        return h

    def rejected_on_outcomes(self, intent_id, timeout=20):
        got = self.read_until("outcomes", lambda ms: any(
            m.get("type") == "tally.intent.rejected.v1" and
            m["data"].get("intent_id") == intent_id for m in ms), timeout=timeout)
        return [m for m in got if m.get("type") == "tally.intent.rejected.v1"
                and m["data"]["intent_id"] == intent_id][0]


class RepliesTest(RepliesCase):

    def test_spring_headers_route_every_answer_with_the_correlation_bytes(self):
        self.dispatcher()
        self.reconciler()
        topic = self.reply_topic()
        reader = self.reply_reader(topic)
        run = tallytest_run()
        # binary correlation bytes, as Spring's default correlation strategy makes them
        corr = uuid.uuid4().bytes
        # a timeout after the tool applied it: UNKNOWN first, then CONFIRMED from the reconciler
        key = f"charge_card:t1:{run}-p1"
        self.fault("apply_then_hang", key=key, delay_ms=3000)
        ce = self.intent(run, 1, "charge_card", {"tenant_id": "t1", "payment_id": f"{run}-p1",
                                                 "amount": 5})
        self.publish_with(ce, self.spring_headers(topic, corr, partition=2))
        got = self.read_replies(reader, lambda vs: any(
            v["type"] == "tally.effect.confirmed.v1" for v in vs), timeout=60)
        types = [v["type"] for v, _, _ in got]
        self.assertEqual(types[0], "tally.effect.unknown.v1", types)
        self.assertIn("tally.effect.confirmed.v1", types)
        for v, h, part in got:
            self.assertEqual(part, 2, "the named partition")
            self.assertEqual(h.get("kafka_correlationId"), corr)
            self.assertEqual(h.get("ce_id"), v["id"].encode())
            # bytes that are not text: the CloudEvent carries them in base64
            self.assertNotIn("correlationid", v)
            self.assertTrue(v["correlationidbase64"])
            self.assertEqual(v["data"]["effect_id"], got[0][0]["data"]["effect_id"])
        # the same events, by id, on the complete stream
        ids = {v["id"] for v, _, _ in got}
        outcomes = self.read_until("outcomes", lambda ms: ids <= {m["id"] for m in ms},
                                   timeout=20)
        self.assertTrue(ids <= {m["id"] for m in outcomes})
        for m in outcomes:
            self.assertNotIn("correlationidbase64", m, "outcomes carry no correlation")

    def test_cloudevent_attributes_and_a_replay_answered_to_its_own_asker(self):
        self.dispatcher()
        t1, t2 = self.reply_topic(), self.reply_topic()
        r1, r2 = self.reply_reader(t1), self.reply_reader(t2)
        run = tallytest_run()
        args = {"tenant_id": "t1", "payment_id": f"{run}-p1", "amount": 5}
        first = self.intent(run, 1, "charge_card", args)
        first["replytopic"] = t1
        first["correlationid"] = "call-1 \u00e9t\u00e9"
        self.publish_with(first)
        a = self.read_replies(r1, lambda vs: any(v["type"] == "tally.effect.confirmed.v1"
                                                 for v in vs))
        self.assertEqual(a[0][0]["correlationid"], "call-1 \u00e9t\u00e9")
        self.assertEqual(a[0][1]["kafka_correlationId"], "call-1 \u00e9t\u00e9".encode())
        # the same intent again after a crash, with another destination: the replay goes to
        # the new asker only, and names the new intent
        again = self.intent(run, 1, "charge_card", args)
        again["replytopic"] = t2
        again["correlationid"] = "call-2"
        again["replypartition"] = "0"
        self.publish_with(again)
        b = self.read_replies(r2, lambda vs: len(vs) >= 1, settle=1.0)
        self.assertEqual(len(b), 1, [v for v, _, _ in b])
        self.assertEqual(b[0][0]["data"]["intent_id"], again["id"])
        self.assertTrue(b[0][0]["data"]["replay"])
        self.assertEqual(b[0][0]["data"]["status"], "CONFIRMED")
        self.assertEqual(b[0][0]["correlationid"], "call-2")
        more = self.read_replies(r1, lambda vs: True, timeout=5, settle=1.0)
        self.assertEqual(more, [], "the first asker does not get the second asker's replay")
        self.assertEqual(len(self.records("charges")), 1)

    def test_a_destination_outside_the_prefix_is_refused_and_answered_on_outcomes(self):
        self.dispatcher()
        run = tallytest_run()
        evil = self.topic("intents")  # tally's own topic: never a reply destination
        ce = self.intent(run, 1, "check_balance", {"request_id": run})
        self.publish_with(ce, [("kafka_replyTopic", evil.encode()),
                               ("kafka_correlationId", b"x")])
        rej = self.rejected_on_outcomes(ce["id"])
        self.assertEqual(rej["data"]["reason"], "invalid_reply_to")
        self.assertEqual(rej["data"]["field"], "kafka_replyTopic")
        self.assertIn("allowed prefix", rej["data"]["detail"])
        self.assertEqual(rej["data"]["run_id"], run)
        self.assertEqual(rej["data"]["step"], 1)
        self.assertEqual(rej["data"]["status"], "REJECTED")
        dlq = self.read_until("dlq", lambda ms: any(
            ce["id"] in m["data"].get("original", "") for m in ms))
        self.assertTrue(dlq)
        self.assertEqual(rej["data"]["dlq"]["topic"], self.topic("intents"))
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE run_id = %s", (run,)),
                         0)

    def test_hostile_destinations_are_refused_with_their_field(self):
        self.dispatcher()
        topic = self.reply_topic()
        cases = [
            ([("kafka_replyTopic", topic.encode()), ("kafka_correlationId", b"c" * 257)],
             {}, "kafka_correlationId"),
            ([("kafka_replyTopic", topic.encode()), ("kafka_replyPartition", b"\xff\xff\xff\xff")],
             {}, "kafka_replyPartition"),
            ([("kafka_replyTopic", (topic + "/\u00e9").encode())], {}, "kafka_replyTopic"),
            ([("kafka_replyTopic", b"\xff\xfe" + topic.encode())], {}, "kafka_replyTopic"),
            ([], {"replytopic": 42}, "replytopic"),
            ([], {"replytopic": topic, "replypartition": -1}, "replypartition"),
            ([], {"replytopic": topic, "replypartition": 1.5}, "replypartition"),
            ([], {"replytopic": topic, "replypartition": "abcd"}, "replypartition"),
            ([], {"replytopic": topic, "replypartition": "99999999999"}, "replypartition"),
            ([], {"replytopic": topic, "correlationid": ""}, "correlationid"),
            ([], {"replytopic": "x" * 300}, "replytopic"),
        ]
        ids = []
        for i, (hdrs, attrs, field) in enumerate(cases):
            ce = self.intent(tallytest_run(), i, "check_balance", {"request_id": f"h{i}"})
            ce.update(attrs)
            self.publish_with(ce, hdrs)
            ids.append((ce["id"], field))
        for cid, field in ids:
            rej = self.rejected_on_outcomes(cid)
            self.assertEqual(rej["data"]["reason"], "invalid_reply_to", rej)
            self.assertEqual(rej["data"]["field"], field, rej)
        # the worker is still taking intents, and nothing reached the tool
        ok = self.intent(tallytest_run(), 1, "check_balance", {"request_id": "after"})
        self.publish_with(ok)
        self.outcomes_for([ok["id"]])
        self.assertEqual(self.scalar("SELECT count(*) FROM effects"), 1)

    def test_every_readable_refusal_is_answered_and_unreadable_bytes_go_to_the_dlq_alone(self):
        self.dispatcher()
        topic = self.reply_topic()
        reader = self.reply_reader(topic)
        run = tallytest_run()
        unknown = self.intent(run, 1, "no_such_tool", {"x": 1})
        self.publish_with(unknown, self.spring_headers(topic, b"c-unknown"))
        nokey = self.intent(run, 2, "charge_card", {"tenant_id": "t1", "amount": 1})
        self.publish_with(nokey, self.spring_headers(topic, b"c-nokey"))
        badstep = self.intent(run, {"a": 1}, "charge_card", {})
        self.publish_with(badstep, self.spring_headers(topic, b"c-badstep"))
        got = self.read_replies(reader, lambda vs: len(vs) >= 3)
        by_corr = {h["kafka_correlationId"]: v for v, h, _ in got}
        self.assertEqual(by_corr[b"c-unknown"]["data"]["reason"], "unknown_tool")
        self.assertEqual(by_corr[b"c-unknown"]["data"]["field"], "data.tool")
        self.assertEqual(by_corr[b"c-unknown"]["data"]["tool"], "no_such_tool")
        self.assertEqual(by_corr[b"c-nokey"]["data"]["reason"], "missing_operation_key")
        self.assertEqual(by_corr[b"c-badstep"]["data"]["field"], "data.step")
        self.assertIsNone(by_corr[b"c-badstep"]["data"]["step"])
        for v in by_corr.values():
            self.assertEqual(v["type"], "tally.intent.rejected.v1")
            self.assertEqual(v["data"]["run_id"], run)
        # bytes that name nobody: the DLQ alone
        self.publish_with(b"\xff\xfe not json", headers=self.spring_headers(topic, b"c-bytes"),
                          key=run.encode())
        self.publish_with(json.dumps({"id": "x", "data": {}}).encode(),
                          headers=self.spring_headers(topic, b"c-norun"), key=b"k")
        self.read_until("dlq", lambda ms: len(ms) >= 5)
        more = self.read_replies(reader, lambda vs: True, timeout=5, settle=1.5)
        self.assertEqual([v for v, _, _ in more], [])

    def test_a_completed_run_refuses_new_intents_and_answers_with_its_summary(self):
        self.dispatcher()
        topic = self.reply_topic()
        reader = self.reply_reader(topic)
        run = tallytest_run()
        args = {"request_id": run}
        one = self.intent(run, 1, "check_balance", args)
        self.publish_with(one)
        self.outcomes_for([one["id"]])
        done = self.run_message("complete_run", run, reason="all done")
        self.publish_with(done, self.spring_headers(topic, b"c-done"))
        got = self.read_replies(reader, lambda vs: any(
            v["type"] == "tally.run.completed.v1" for v in vs))
        ev = [v for v, _, _ in got if v["type"] == "tally.run.completed.v1"][0]
        self.assertEqual(ev["data"]["status"], "COMPLETED")
        self.assertEqual(ev["data"]["summary"]["total"], 1)
        self.assertEqual(ev["data"]["summary"]["effects"], {"CONFIRMED": 1})
        self.assertEqual(ev["data"]["summary"]["open"], [])
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "COMPLETED")
        # a new intent: refused with run_not_active, answered, not dead-lettered
        late = self.intent(run, 2, "check_balance", {"request_id": run + "-late"})
        self.publish_with(late, self.spring_headers(topic, b"c-late"))
        got = self.read_replies(reader, lambda vs: any(
            v["data"].get("intent_id") == late["id"] for v in vs))
        rej = [v for v, _, _ in got if v["data"].get("intent_id") == late["id"]][0]
        self.assertEqual(rej["type"], "tally.intent.rejected.v1")
        self.assertEqual(rej["data"]["reason"], "run_not_active")
        self.assertIsNone(rej["data"]["dlq"])
        # the replay of step 1 is still answered with its effect
        replay = self.intent(run, 1, "check_balance", args)
        self.publish_with(replay)
        ans = self.outcomes_for([replay["id"]])[replay["id"]]
        self.assertEqual(ans[0]["data"]["status"], "CONFIRMED")
        self.assertTrue(ans[0]["data"]["replay"])
        # completing again answers again; the run stays COMPLETED
        again = dict(done, id=str(uuid.uuid4()))
        self.publish_with(again, self.spring_headers(topic, b"c-again"))
        got = self.read_replies(reader, lambda vs: any(
            v["type"] == "tally.run.completed.v1" for v in vs), settle=0.2)
        self.assertTrue(any(h.get("kafka_correlationId") == b"c-again" for _, h, _ in got))
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE run_id = %s", (run,)),
                         1)
        # a completed run can still be compensated
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE run_id = %s AND"
                                     " kind = 'transition' AND to_status = 'COMPLETED'", (run,)),
                         1)

    def test_a_run_with_an_effect_in_flight_completes_when_it_settles(self):
        self.dispatcher()
        self.reconciler()
        topic = self.reply_topic()
        reader = self.reply_reader(topic)
        run = tallytest_run()
        key = f"charge_card:t1:{run}-p1"
        self.fault("slow", key=key, delay_ms=1500)
        self.publish_with(self.intent(run, 1, "charge_card",
                                      {"tenant_id": "t1", "payment_id": f"{run}-p1",
                                       "amount": 5}))
        self.wait_status("charge_card", key, "DISPATCHING", timeout=20)
        done = self.run_message("complete_run", run)
        self.publish_with(done, self.spring_headers(topic, b"c-done"))
        wait_for(lambda: self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,))
                 in ("COMPLETING", "COMPLETED"), timeout=20, what="COMPLETING")
        got = self.read_replies(reader, lambda vs: any(
            v["type"] == "tally.run.completed.v1" for v in vs), timeout=30)
        ev = [v for v, _, _ in got if v["type"] == "tally.run.completed.v1"][0]
        self.assertEqual(ev["data"]["summary"]["effects"], {"CONFIRMED": 1})
        self.assertEqual(self.effect("charge_card", key)["status"], "CONFIRMED")

    def test_idle_runs_complete_after_the_timeout_and_cancel_is_answered(self):
        self.dispatcher()
        self.reconciler(TALLY_RUN_IDLE_TIMEOUT_MS=1500)
        run = tallytest_run()
        one = self.intent(run, 1, "check_balance", {"request_id": run})
        self.publish_with(one)
        got = self.read_until("outcomes", lambda ms: any(
            m["type"] == "tally.run.completed.v1" and m["data"]["run_id"] == run for m in ms),
            timeout=30)
        ev = [m for m in got if m["type"] == "tally.run.completed.v1"][0]
        self.assertEqual(ev["data"]["reason"], "idle_timeout")
        # cancel: answered with tally.run.cancelled.v1 on the reply topic
        topic = self.reply_topic()
        reader = self.reply_reader(topic)
        other = tallytest_run()
        self.publish_with(self.intent(other, 1, "send_email",
                                      {"message_id": other, "to": "a@example.com"}))
        cancel = self.run_message("cancel_run", other, reason="stop")
        self.publish_with(cancel, self.spring_headers(topic, b"c-cancel"))
        got = self.read_replies(reader, lambda vs: any(
            v["type"] == "tally.run.cancelled.v1" for v in vs))
        ev = [v for v, _, _ in got if v["type"] == "tally.run.cancelled.v1"][0]
        self.assertEqual(ev["data"]["run_id"], other)
        self.assertEqual(ev["data"]["reason"], "stop")
        self.assertIn(ev["data"]["status"], ("CANCELLED",))


class RunAnswersTest(RepliesCase):

    def test_a_compensation_asked_again_is_answered_with_its_summary(self):
        self.dispatcher()
        self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                   BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                   TALLY_SWEEP_MS=200, TALLY_SHUTDOWN_GRACE_MS=5000)
        topic = self.reply_topic()
        reader = self.reply_reader(topic)
        run = tallytest_run()
        one = self.intent(run, 1, "charge_card", {"tenant_id": "t1", "payment_id": f"{run}-p1",
                                                  "amount": 5})
        self.publish_with(one)
        self.outcomes_for([one["id"]])

        def compensate(corr):
            ce = self.run_message("compensate_run", run, reason="undo")
            self.publish_with(ce, self.spring_headers(topic, corr))
            got = self.read_replies(reader, lambda vs: any(
                v["type"] == "tally.run.compensated.v1" for v in vs), timeout=60, settle=0.3)
            return [(v, h) for v, h, _ in got if v["type"] == "tally.run.compensated.v1"]

        first = compensate(b"c-first")
        self.assertEqual(first[0][0]["data"]["status"], "COMPENSATED")
        again = compensate(b"c-again")
        self.assertEqual(again[-1][1]["kafka_correlationId"], b"c-again")
        self.assertEqual(again[-1][0]["data"]["status"], "COMPENSATED")
        self.assertEqual(again[-1][0]["data"]["summary"]["counts"]["compensated"], 1)
        # asked twice, undone once
        self.assertEqual(len(self.requests(op="reverse")), 1)


class ReplyDeliveryTest(RepliesCase):

    def test_a_reply_the_destination_refuses_holds_nothing_else_and_is_given_up(self):
        disp = self.dispatcher()
        topic = self.reply_topic()  # 4 partitions: partition 99 does not exist
        run = tallytest_run()
        bad = self.intent(run, 1, "check_balance", {"request_id": run + "-bad"})
        self.publish_with(bad, self.spring_headers(topic, b"c-bad", partition=99))
        self.outcomes_for([bad["id"]])
        # the copy for partition 99 waits in the outbox with its reason, retried with a backoff
        row = wait_for(lambda: self.query(
            "SELECT attempts, last_error FROM message_outbox WHERE topic = 'replies'"
            " AND attempts > 0"), timeout=60, what="the failed reply to be retried")
        self.assertTrue(row[0][1], row)
        # meanwhile other answers, and other replies, flow at once
        good_topic = self.reply_topic()
        reader = self.reply_reader(good_topic)
        t0 = time.monotonic()
        ok = self.intent(run, 2, "check_balance", {"request_id": run + "-ok"})
        self.publish_with(ok, self.spring_headers(good_topic, b"c-ok"))
        self.read_replies(reader, lambda vs: len(vs) >= 1, settle=0)
        self.assertLess(time.monotonic() - t0, 10)
        # after its last attempt it is given up, counted, and the answer stays on outcomes
        self.query("UPDATE message_outbox SET attempts = 7, lease_until = NULL,"
                   " lease_owner = NULL WHERE topic = 'replies'")
        wait_for(lambda: self.scalar("SELECT count(*) FROM message_outbox") == 0, timeout=60,
                 what="the reply to be given up")
        status, body = disp.http_get("/metrics")
        self.assertIn("tally_relay_replies_dropped_total 1", body)


def tallytest_run():
    return "run-" + uuid.uuid4().hex[:12]


if __name__ == "__main__":
    tallytest.main()
