"""The Python client library (clients/python, tally_client) against the real stack: the
dispatcher, the reconciler and the compensator answering on the client's own reply topic
(docs/agent-protocol.md). Agents run in this process, or as separate processes
(clientagent.py) where a crash or two processes are the point."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

from confluent_kafka import Consumer, TopicPartition

from dispatchcase import SECRET, DispatchCase, main, run_id
from tallytest import SOURCE_DIR, wait_for

sys.path.insert(0, os.path.join(SOURCE_DIR, "clients", "python", "src"))

from tally_client import (EffectConflict, EffectFailed, EffectRejected,  # noqa: E402
                          IntentRefused, OutcomeTimeout, Tally)
from tally_client.aio import AsyncTally  # noqa: E402

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clientagent.py")
PYTHON = "/usr/bin/python3"


class ClientCase(DispatchCase):
    """DispatchCase with a tally_client per test and the other workers on demand."""

    def setUp(self):
        super().setUp()
        self.clients = []
        self.agent_logs = []

    def tearDown(self):
        for c in self.clients:
            c.close()
        for f in self.agent_logs:
            f.close()
        super().tearDown()

    def client(self, agent="test-agent", **kw):
        c = Tally(self.stack.kafka, agent, topic_prefix=self.prefix, **kw)
        self.clients.append(c)
        return c

    def worker(self, name, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
                "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 300, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start(name, **base)

    def agent_process(self, agent, calls, timeout=30):
        spec = {"brokers": self.stack.kafka, "prefix": self.prefix, "agent": agent,
                "timeout": timeout, "calls": calls}
        log = open(os.path.join(self.tmp, f"{agent}-{uuid.uuid4().hex[:6]}.err"), "w")
        self.agent_logs.append(log)
        return subprocess.Popen([PYTHON, AGENT, json.dumps(spec)], stdout=subprocess.PIPE,
                                stderr=log, text=True)

    def warm(self, tally):
        """One call answered: the dispatcher has joined its consumer group (its first
        intents wait for that, about 3 s after /healthz) and the reply path is in use."""
        run = run_id()
        o = tally.run(run).call(0, "check_balance", {"request_id": f"{run}-warm",
                                                     "account": "warm"})
        self.assertEqual(o.status, "CONFIRMED")

    def upstream(self, collection, key):
        return [r for r in self.records(collection) if r["idempotency_key"] == key]

    def outcome_events(self, run, settle=1.0):
        """Every event of `run` on <prefix>outcomes (read until quiet for `settle` s)."""
        c = self.reader("outcomes")
        got, quiet_until = [], time.monotonic() + settle
        while time.monotonic() < quiet_until:
            m = c.poll(0.1)
            if m is not None and not m.error():
                ev = json.loads(m.value())
                if ev.get("data", {}).get("run_id") == run:
                    got.append(ev)
                quiet_until = time.monotonic() + settle
        return got


def charge_args(run, n=1, amount=500):
    return {"tenant_id": "t1", "payment_id": f"{run}-pay{n}", "amount": amount,
            "currency": "EUR"}


def statuses(outcome):
    return [h.status for h in outcome.history]


class ClientPythonTest(ClientCase):

    def test_three_step_run_read_reversible_append_only(self):
        self.dispatcher()
        tally = self.client()
        self.assertTrue(tally.reply_topic.startswith(self.prefix + "replies.test-agent."))
        run = tally.run(run_id(), tenant="t1")
        steps = [(1, "check_balance", {"request_id": f"{run.run_id}-bal", "account": "a1"}),
                 (2, "charge_card", charge_args(run.run_id)),
                 (3, "send_email", {"message_id": f"{run.run_id}-mail", "to": "a@example.com",
                                    "template": "receipt"})]
        records = {}
        for step, tool, args in steps:
            o = run.call(step, tool, args, timeout=30)
            self.assertEqual((o.status, o.run_id, o.step, o.tool), ("CONFIRMED", run.run_id,
                                                                     step, tool))
            self.assertIs(o.history[-1].event, o.event)
            self.assertEqual(o.event["type"], "tally.effect.confirmed.v1")
            self.assertFalse(o.replay)
            self.assertIsNone(o.error)
            row = self.effect(tool, o.operation_key)
            self.assertEqual((row["effect_id"], row["status"]), (o.effect_id, "CONFIRMED"))
            self.assertEqual(o.receipt, row["receipt"])
            self.assertEqual(o.external_ref, row["external_ref"])
            records[tool] = o
        [rec] = self.upstream("charges", records["charge_card"].operation_key)
        self.assertEqual(rec["id"], records["charge_card"].external_ref)
        self.assertEqual(rec["body"], steps[1][2])
        # Each call read its own answers, and only those: one message per call here.
        st = tally.stats()
        self.assertEqual(st["published"], 3)
        self.assertEqual(st["foreign"], 0)
        self.assertGreaterEqual(st["answers"], 3)
        self.assertEqual(st["messages_read"],
                         st["answers"] + st["duplicates"] + st["late"])
        self.invariants()

    def test_answers_that_end_a_call_in_error_raise_typed_errors(self):
        self.dispatcher()
        tally = self.client()
        run = tally.run(run_id())
        args = charge_args(run.run_id)
        self.assertEqual(run.call(1, "charge_card", args).status, "CONFIRMED")
        # The same payment id with another amount: a conflict, nothing called.
        with self.assertRaises(EffectConflict) as cm:
            run.call(2, "charge_card", dict(args, amount=9900))
        self.assertEqual(cm.exception.code, "conflict")
        self.assertEqual(cm.exception.outcome.status, "CONFLICT")
        self.assertEqual(len(self.requests(f"charge_card:t1:{run.run_id}-pay1")), 1)
        # The tool refuses with a 422: FAILED.
        hold = {"hold_id": f"{run.run_id}-hold", "amount": 5}
        self.fault("error_4xx", key=f"create_hold:{hold['hold_id']}", status=422)
        with self.assertRaises(EffectFailed) as cm:
            run.call(3, "create_hold", hold)
        self.assertEqual(cm.exception.code, "http_422")
        self.assertEqual(cm.exception.outcome.effect_id,
                         self.effect("create_hold", f"create_hold:{hold['hold_id']}")
                         ["effect_id"])

    def test_timeout_resolved_by_the_reconciler_is_one_final_answer(self):
        self.dispatcher()
        self.worker("tally-reconciler")
        tally = self.client()
        run = tally.run(run_id())
        args = charge_args(run.run_id)
        key = f"charge_card:t1:{args['payment_id']}"
        # Applied, then the answer hangs past the connector's 2 s timeout: UNKNOWN, until the
        # reconciler's status check finds the record.
        self.fault("apply_then_hang", key=key, collection="charges", delay_ms=4000)
        o = run.call(1, "charge_card", args, timeout=30)
        self.assertEqual(o.status, "CONFIRMED")
        self.assertEqual(statuses(o), ["UNKNOWN", "CONFIRMED"])
        self.assertEqual(o.history[0].effect_id, o.effect_id)
        self.assertTrue(o.event["source"].startswith("/tally/reconciler/"), o.event["source"])
        [rec] = self.upstream("charges", key)
        self.assertEqual(o.external_ref, rec["id"])
        self.assertEqual(len(self.requests(key)), 1)

    def test_replay_after_the_agent_is_killed_and_restarted(self):
        self.dispatcher()
        run = run_id()
        args = charge_args(run)
        key = f"charge_card:t1:{args['payment_id']}"
        self.fault("slow", key=key, collection="charges", delay_ms=1500)
        calls = [{"run": run, "step": 1, "tool": "charge_card", "args": args}]
        first = self.agent_process("crashy", calls)
        try:
            # Published: the ledger has the effect and the tool holds the call. Crash now.
            wait_for(lambda: self.effect("charge_card", key), timeout=20,
                     what="the first agent's intent in the ledger")
            self.assertIsNone(first.poll(), "the agent ended before it was killed")
            first.send_signal(signal.SIGKILL)
            out, _ = first.communicate(timeout=10)
        finally:
            if first.poll() is None:
                first.kill()
        self.assertNotIn('"outcome"', out)
        second = self.agent_process("crashy", calls)
        out, _ = second.communicate(timeout=60)
        self.assertEqual(second.returncode, 0)
        lines = [json.loads(line) for line in out.splitlines()]
        [answer] = [x["outcome"] for x in lines if "outcome" in x]
        self.assertEqual(answer["status"], "CONFIRMED")
        self.assertEqual(answer["effect_id"], self.effect("charge_card", key)["effect_id"])
        self.assertTrue(any(h["replay"] for h in answer["history"]), answer)
        self.assertEqual(len(self.upstream("charges", key)), 1)
        self.assertEqual(len(self.requests(key)), 1)
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE run_id = %s", (run,)), 1)

    def test_refused_intent_raises_intent_refused_within_a_second(self):
        self.dispatcher()
        tally = self.client()
        self.warm(tally)
        run = tally.run(run_id())
        t0 = time.monotonic()
        with self.assertRaises(IntentRefused) as cm:
            run.call(1, "no_such_tool", {"x": 1}, timeout=10)
        took = time.monotonic() - t0
        e = cm.exception
        self.assertEqual((e.reason, e.field), ("unknown_tool", "data.tool"))
        self.assertIn("no_such_tool", e.detail)
        self.assertEqual(e.outcome.status, "REFUSED")
        self.assertEqual(e.outcome.event["type"], "tally.intent.rejected.v1")
        self.assertLess(took, 1.0)
        # A step tally cannot take (negative) is refused the same way, naming the field.
        with self.assertRaises(IntentRefused) as cm:
            run.call(-1, "check_balance", {"request_id": "r", "account": "a"}, timeout=10)
        self.assertEqual((cm.exception.reason, cm.exception.field),
                         ("invalid_field", "data.step"))

    def test_reply_topic_outside_the_allowed_prefix_is_refused(self):
        self.dispatcher()
        elsewhere = f"elsewhere.{uuid.uuid4().hex[:8]}"
        self.producer().list_topics(elsewhere, timeout=10)  # the broker creates it
        # A deployment whose TALLY_REPLY_TOPIC_PREFIX allows it says so with reply_prefix.
        self.assertIsNone(self.client(reply_topic=elsewhere,
                                      reply_prefix="elsewhere.")._transport.refusal)
        tally = self.client(reply_topic=elsewhere)
        t0 = time.monotonic()
        with self.assertRaises(IntentRefused) as cm:
            tally.run(run_id()).call(1, "check_balance", {"request_id": "r", "account": "a"})
        self.assertLess(time.monotonic() - t0, 1.0)
        local = cm.exception
        self.assertEqual(local.reason, "invalid_reply_to")
        self.assertEqual(tally.stats()["published"], 0)
        # What the client spares itself: the dispatcher refuses such a message and answers
        # on <prefix>outcomes only, never on the refused destination.
        run = run_id()
        ce = self.intent(run, 1, "check_balance", {"request_id": "r", "account": "a"})
        self.producer().produce(self.topic("intents"), key=run, value=json.dumps(ce),
                                headers=[("kafka_replyTopic", elsewhere.encode()),
                                         ("kafka_correlationId", b"c-1")])
        self.producer().flush(10)
        [ev] = [m for m in self.read_until(
            "outcomes", lambda got: any(m.get("data", {}).get("intent_id") == ce["id"]
                                        for m in got))
            if m.get("data", {}).get("intent_id") == ce["id"]]
        self.assertEqual(ev["type"], "tally.intent.rejected.v1")
        # The client said what the dispatcher says.
        self.assertEqual((ev["data"]["reason"], ev["data"]["field"]),
                         (local.reason, local.field))
        c = Consumer({"bootstrap.servers": self.stack.kafka, "group.id": "x"})
        try:
            _, high = c.get_watermark_offsets(TopicPartition(elsewhere, 0), timeout=5)
            self.assertEqual(high, 0)
        finally:
            c.close()

    def test_compensate_returns_the_summary(self):
        self.dispatcher()
        self.worker("tally-compensator")
        tally = self.client()
        run = tally.run(run_id())
        r = run.run_id
        run.call(1, "check_balance", {"request_id": f"{r}-bal", "account": "a1"})
        charge = run.call(2, "charge_card", charge_args(r))
        run.call(3, "send_email", {"message_id": f"{r}-mail", "to": "b@example.com",
                                   "template": "order_confirmed"})
        s = run.compensate("the customer cancelled", timeout=60)
        self.assertEqual(s.type, "tally.run.compensated.v1")
        self.assertEqual((s.run_id, s.status), (r, "PARTIALLY_COMPENSATED"))
        self.assertEqual([(x["step"], x["tool"]) for x in s.compensated], [(2, "charge_card")])
        self.assertEqual([(x["step"], x["tool"]) for x in s.uncompensatable],
                         [(3, "send_email")])
        self.assertEqual([(x["step"], x["tool"]) for x in s.skipped], [(1, "check_balance")])
        self.assertEqual(s.failed, [])
        [rec] = self.upstream("charges", charge.operation_key)
        self.assertEqual(rec["status"], "reversed")

    def test_complete_returns_the_summary_and_closes_the_run(self):
        self.dispatcher()
        tally = self.client()
        run = tally.run(run_id())
        run.call(1, "check_balance", {"request_id": f"{run.run_id}-bal", "account": "a1"})
        run.call("2", "update_ledger", {"entry_id": f"{run.run_id}-le", "amount": 5})
        s = run.complete("done", timeout=30)
        self.assertEqual(s.type, "tally.run.completed.v1")
        self.assertEqual((s.run_id, s.status, s.reason), (run.run_id, "COMPLETED",
                                                          "complete_run"))
        self.assertEqual(s.summary["total"], 2)
        self.assertEqual(s.summary["effects"], {"CONFIRMED": 2})
        self.assertEqual((s.open, s.summary["open_count"]), ([], 0))
        t0 = time.monotonic()
        with self.assertRaises(IntentRefused) as cm:
            run.call(3, "check_balance", {"request_id": f"{run.run_id}-late", "account": "a1"})
        self.assertLess(time.monotonic() - t0, 1.0)
        self.assertEqual(cm.exception.reason, "run_not_active")
        self.assertIsNone(cm.exception.dlq)
        # Completing a completed run answers with its summary again.
        self.assertEqual(run.complete(timeout=30).status, "COMPLETED")

    def test_cancel_returns_the_cancelled_summary(self):
        self.dispatcher()
        tally = self.client()
        run = tally.run(run_id())
        run.call(1, "check_balance", {"request_id": f"{run.run_id}-bal", "account": "a1"})
        s = run.cancel("agent looping", timeout=30)
        self.assertEqual((s.type, s.run_id, s.status),
                         ("tally.run.cancelled.v1", run.run_id, "CANCELLED"))
        self.assertEqual(s.effects_cancelled, 0)

    def test_two_agent_processes_each_read_only_their_own_answers(self):
        self.dispatcher()
        runs = {"agent-a": run_id(), "agent-b": run_id()}
        procs = {}
        for agent, run in runs.items():
            calls = [{"run": run, "step": i, "tool": "check_balance",
                      "args": {"request_id": f"{run}-{i}", "account": agent}}
                     for i in range(1, 4)]
            procs[agent] = self.agent_process(agent, calls)
        got = {}
        for agent, p in procs.items():
            out, _ = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0, out)
            got[agent] = [json.loads(line) for line in out.splitlines()]
        topics = set()
        for agent, lines in got.items():
            [topic] = [x["reply_topic"] for x in lines if "reply_topic" in x]
            topics.add(topic)
            outcomes = [x["outcome"] for x in lines if "outcome" in x]
            self.assertEqual([(o["status"], o["run_id"]) for o in outcomes],
                             [("CONFIRMED", runs[agent])] * 3, lines)
            [st] = [x["stats"] for x in lines if "stats" in x]
            # What its reply consumer read is exactly the answers about its own run.
            mine = self.outcome_events(runs[agent])
            self.assertEqual(st["foreign"], 0, st)
            self.assertEqual(st["messages_read"] - st["duplicates"], len(mine), (st, mine))
            self.assertEqual(st["published"], 3)
        self.assertEqual(len(topics), 2)

    def test_shared_reply_topic_is_told_apart_by_correlation_id(self):
        self.dispatcher()
        shared = self.prefix + "replies.shared"
        self.producer().list_topics(shared, timeout=10)  # the broker creates it
        a = self.client("a", reply_topic=shared)
        b = self.client("b", reply_topic=shared)
        run = run_id()
        for i, c in enumerate((a, b, a, b), start=1):
            o = c.run(run).call(i, "check_balance", {"request_id": f"{run}-{i}",
                                                     "account": "x"})
            self.assertEqual((o.status, o.step), ("CONFIRMED", i))
            self.assertTrue(all(h.step == i for h in o.history), statuses(o))
        # Each read the other's answers too, and set them aside.
        wait_for(lambda: a.stats()["foreign"] >= 2 and b.stats()["foreign"] >= 2,
                 timeout=10, what="each client to read the other's two answers")

    def test_one_client_shared_by_threads(self):
        self.dispatcher()
        tally = self.client()
        results, errors = {}, []

        def work(i):
            try:
                run = tally.run(run_id())
                results[i] = run.call(i, "update_ledger", {"entry_id": f"{run.run_id}-e",
                                                           "amount": i})
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(errors, [])
        for i, o in results.items():
            self.assertEqual((o.status, o.step, o.receipt["body"]["amount"]),
                             ("CONFIRMED", i, i))
        self.assertEqual(len(results), 6)

    def test_asyncio_api(self):
        self.dispatcher()
        r = run_id()

        async def agent():
            async with AsyncTally(self.stack.kafka, "async-agent",
                                  topic_prefix=self.prefix) as tally:
                run = tally.run(r)
                outs = await asyncio.gather(*[
                    run.call(i, "check_balance", {"request_id": f"{r}-{i}", "account": "a"})
                    for i in range(1, 4)])
                try:
                    await run.call(9, "no_such_tool", {})
                    refused = None
                except IntentRefused as e:
                    refused = e
                return outs, await run.complete(timeout=30), refused, tally.stats()
        outs, summary, refused, st = asyncio.run(agent())
        self.assertEqual([(o.status, o.step) for o in outs],
                         [("CONFIRMED", 1), ("CONFIRMED", 2), ("CONFIRMED", 3)])
        self.assertEqual(len({o.effect_id for o in outs}), 3)
        self.assertEqual(refused.reason, "unknown_tool")
        self.assertEqual((summary.status, summary.summary["total"]), ("COMPLETED", 3))
        self.assertEqual(st["published"], 5)

    def test_steps_of_both_types_and_multibyte_arguments(self):
        self.dispatcher()
        tally = self.client(agent="bøt ✓/1")  # not a topic name: sanitised
        self.assertRegex(tally.reply_topic, r"^[A-Za-z0-9._-]+$")
        run = tally.run(run_id() + "-ü")
        args = {"request_id": f"{run.run_id}-Grüße-€-😀", "account": "Zoë", "note": "日本語"}
        o = run.call(7, "check_balance", args)
        self.assertEqual((o.status, o.step), ("CONFIRMED", 7))
        self.assertEqual(o.receipt["body"], args)
        o = run.call("étape-2 ✓", "check_balance", dict(args, request_id=args["request_id"] + "2"))
        self.assertEqual((o.status, o.step, o.run_id), ("CONFIRMED", "étape-2 ✓", run.run_id))
        self.assertEqual(o.receipt["body"]["note"], "日本語")
        # 34 characters, 102 bytes: over the 100-byte limit of a step, which tally counts in
        # bytes.
        with self.assertRaises(IntentRefused) as cm:
            run.call("€" * 34, "check_balance", dict(args, request_id="r-long-step"))
        self.assertEqual((cm.exception.reason, cm.exception.field),
                         ("invalid_field", "data.step"))
        with self.assertRaises(TypeError):
            run.call(True, "check_balance", args)

    def test_timeouts_carry_the_last_answer(self):
        self.dispatcher()
        tally = self.client()
        self.warm(tally)
        run = tally.run(run_id())
        # The tool takes 1.5 s to answer: nothing within 0.5 s.
        args = {"request_id": f"{run.run_id}-1", "account": "a"}
        self.fault("slow", key=f"check_balance:{args['request_id']}", delay_ms=1500)
        t0 = time.monotonic()
        with self.assertRaises(OutcomeTimeout) as cm:
            run.call(1, "check_balance", args, timeout=0.5)
        self.assertIsNone(cm.exception.last)
        self.assertGreaterEqual(time.monotonic() - t0, 0.5)
        # A destructive tool waits for a human: AWAITING_APPROVAL, and nothing more.
        args = {"account_id": f"{run.run_id}-acct"}
        with self.assertRaises(OutcomeTimeout) as cm:
            run.call(2, "delete_account", args, timeout=3)
        last = cm.exception.last
        self.assertEqual(last.status, "AWAITING_APPROVAL")
        eid = self.effect("delete_account", f"delete_account:{args['account_id']}")["effect_id"]
        self.assertEqual(last.effect_id, eid)
        # first=True returns that first answer; without it, the call waits through it
        # until the human's decision: a denial raises EffectRejected.
        self.assertEqual(run.call(2, "delete_account", args, first=True).status,
                         "AWAITING_APPROVAL")
        deny = threading.Timer(0.5, lambda: self.cli("deny", "--effect", eid, "--reason",
                                                     "not this account"))
        deny.start()
        try:
            with self.assertRaises(EffectRejected) as cm:
                run.call(2, "delete_account", args, timeout=20)
        finally:
            deny.join()
        self.assertEqual(cm.exception.outcome.effect_id, eid)
        self.assertIn("AWAITING_APPROVAL", statuses(cm.exception.outcome))


if __name__ == "__main__":
    main()
