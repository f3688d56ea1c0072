"""The TypeScript client library (clients/typescript, @tally/client) against the real stack:
a dispatcher, the fake tool service, and a reconciler or compensator where a case needs one.

The package is built as its users build it (`npm ci`, `npm run build`: tsc in strict mode)
from a copy, and a small agent written in TypeScript against its published types (DRIVER
below, compiled with the same strict tsc) is started as a separate process per agent. The
test drives it over stdin — one JSON command per line: call, compensate, cancel, complete,
stats, close — and reads one JSON line per result, so it can kill an agent with SIGKILL in
the middle of a call and start another.

The cases follow docs/agent-protocol.md: answers come back on the agent's own reply topic,
matched by correlation id (the first case checks the wire format with replies made by
hand, without a dispatcher); a timeout resolved by the reconciler is one final answer; a
republished intent after a crash is the same effect; refusals come back as IntentRefused in
well under a second; compensation, cancellation and completion resolve with the run's
summary; two agents see only their own answers.
"""

import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition

import tallytest
from dispatchcase import SECRET, DispatchCase, run_id
from tallytest import wait_for

CLIENT = os.path.join(tallytest.SOURCE_DIR, "clients", "typescript")

# The test agent: a TypeScript program on @tally/client, checked by the strict compiler.
DRIVER = r"""
import { createInterface } from "node:readline";
import {
  CallOptions,
  IntentRefused,
  OutcomeTimeout,
  Outcome,
  RunOutcome,
  Tally,
  TallyError,
  TallyOptions,
  TallyStats,
} from "@tally/client";

interface Command {
  tag: string;
  op: "call" | "compensate" | "cancel" | "complete" | "stats" | "close";
  run?: string;
  tenant?: string;
  step?: number | string;
  tool?: string;
  args?: Record<string, unknown>;
  options?: CallOptions & { reason?: string; compensate?: boolean };
}

function emit(obj: unknown): void {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

function errorJson(err: unknown): Record<string, unknown> {
  if (err instanceof IntentRefused)
    return { class: err.name, tally: true, code: err.code, message: err.message, reason: err.reason,
             field: err.field, detail: err.detail, local: err.local, intent_id: err.intentId,
             event: err.event ?? null };
  if (err instanceof OutcomeTimeout)
    return { class: err.name, tally: true, code: err.code, message: err.message,
             last_answer: err.lastAnswer ?? null };
  if (err instanceof TallyError)
    return { class: err.name, tally: true, code: err.code, message: err.message,
             outcome: err.outcome ?? null };
  return { class: err instanceof Error ? err.name : typeof err, tally: false,
           message: String(err) };
}

async function perform(tally: Tally, c: Command): Promise<Outcome | RunOutcome | TallyStats> {
  const run = (): ReturnType<Tally["run"]> => tally.run(String(c.run), { tenant: c.tenant });
  const o = c.options ?? {};
  switch (c.op) {
    case "call":
      if (c.step === undefined || c.tool === undefined) throw new Error("call needs step and tool");
      return run().call(c.step, c.tool, c.args ?? {}, o);
    case "compensate":
      return run().compensate({ reason: o.reason, timeoutMs: o.timeoutMs });
    case "cancel":
      return run().cancel({ reason: o.reason, compensate: o.compensate, timeoutMs: o.timeoutMs });
    case "complete":
      return run().complete({ reason: o.reason, timeoutMs: o.timeoutMs });
    case "stats":
      return tally.stats();
    default:
      throw new Error(`unknown op ${String(c.op)}`);
  }
}

async function main(): Promise<void> {
  const options = JSON.parse(process.argv[2] ?? "{}") as TallyOptions;
  const started = Date.now();
  const tally = await Tally.connect(options);
  emit({ ready: { reply_topic: tally.replyTopic, reply_partition: tally.replyPartition ?? null,
                  connect_ms: Date.now() - started, pid: process.pid } });
  const lines = createInterface({ input: process.stdin });
  lines.on("line", (line) => {
    const c = JSON.parse(line) as Command;
    if (c.op === "close") {
      const stats = tally.stats();
      void tally.close().then(() => {
        emit({ tag: c.tag, ok: true, value: stats });
        process.exit(0);
      });
      return;
    }
    const t0 = Date.now();
    perform(tally, c).then(
      (value) => emit({ tag: c.tag, ok: true, ms: Date.now() - t0, value }),
      (err: unknown) => emit({ tag: c.tag, ok: false, ms: Date.now() - t0, error: errorJson(err) }),
    );
  });
  lines.on("close", () => void tally.close().then(() => process.exit(0)));
}

main().catch((err: unknown) => {
  emit({ fatal: err instanceof Error ? `${err.name}: ${err.message}` : String(err) });
  process.exit(2);
});
"""

DRIVER_TSCONFIG = {
    "compilerOptions": {
        "target": "ES2022", "module": "commonjs", "lib": ["ES2022"], "strict": True,
        "noUnusedLocals": True, "noImplicitReturns": True, "esModuleInterop": True,
        "typeRoots": ["../clients/typescript/node_modules/@types"], "types": ["node"],
        "rootDir": "src", "outDir": "dist"},
    "include": ["src"],
}


def npm(args, cwd):
    out = subprocess.run(["npm", *args, "--no-audit", "--no-fund"], cwd=cwd,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise AssertionError(f"npm {' '.join(args)} failed ({out.returncode}):\n"
                             f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")


def build_client(root):
    """Copy clients/typescript under ROOT/clients/typescript, `npm ci` and `npm run build` it;
    returns its directory. A repository copy without node_modules or dist, as a user has."""
    dst = os.path.join(root, "clients", "typescript")
    os.makedirs(dst)
    for name in ("package.json", "package-lock.json", "tsconfig.json", "README.md"):
        shutil.copy(os.path.join(CLIENT, name), dst)
    shutil.copytree(os.path.join(CLIENT, "src"), os.path.join(dst, "src"))
    npm(["ci"], dst)
    npm(["run", "build"], dst)
    return dst


class TsAgent:
    """One driver process: an agent on @tally/client, fed commands on stdin."""

    def __init__(self, case, script, options, name):
        self.case = case
        self.name = name
        safe = "".join(ch if ch.isalnum() else "-" for ch in name)
        self.log_path = os.path.join(case.tmp, f"{safe}-{uuid.uuid4().hex[:6]}.stderr")
        self._stderr = open(self.log_path, "w")
        self.popen = subprocess.Popen(["node", script, json.dumps(options)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True, bufsize=1)
        self.lines = queue.Queue()
        self.results = {}
        self.ready = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.popen.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                self.lines.put({"garbage": line})
        self.lines.put({"eof": True})

    def _next(self, deadline, what):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{self.name}: timed out waiting for {what}\n{self.stderr()}")
        try:
            return self.lines.get(timeout=left)
        except queue.Empty:
            raise AssertionError(f"{self.name}: timed out waiting for {what}\n{self.stderr()}")

    def wait_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        while self.ready is None:
            m = self._next(deadline, "ready")
            if "ready" in m:
                self.ready = m["ready"]
            elif "fatal" in m or "eof" in m:
                raise AssertionError(f"{self.name} did not start: {m}\n{self.stderr()}")
        return self.ready

    def send(self, op, **fields):
        tag = uuid.uuid4().hex[:8]
        self.popen.stdin.write(json.dumps({"tag": tag, "op": op, **fields}) + "\n")
        self.popen.stdin.flush()
        return tag

    def result(self, tag, timeout=60):
        deadline = time.monotonic() + timeout
        while tag not in self.results:
            m = self._next(deadline, f"the result of {tag}")
            if "tag" in m:
                self.results[m["tag"]] = m
            elif "eof" in m:
                raise AssertionError(f"{self.name} exited before answering {tag}\n"
                                     f"{self.stderr()}")
        return self.results[tag]

    def do(self, op, timeout=60, **fields):
        """Send a command and wait for its result line: {tag, ok, ms, value | error}."""
        return self.result(self.send(op, **fields), timeout=timeout)

    def call(self, run, step, tool, args, timeout=60, **options):
        return self.do("call", timeout=timeout, run=run, step=step, tool=tool, args=args,
                       options=options)

    def stats(self):
        r = self.do("stats")
        assert r["ok"], r
        return r["value"]

    def close(self):
        """Close the client (deleting its reply topic where the cluster can) and exit."""
        r = self.do("close", timeout=30)
        self.popen.wait(30)
        return r["value"]

    def kill(self):
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(10)

    def stop(self):
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)
        self._reader.join(10)
        for f in (self.popen.stdin, self.popen.stdout, self._stderr):
            try:
                f.close()
            except OSError:
                pass

    def stderr(self):
        if not self._stderr.closed:
            self._stderr.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-6000:]


class ClientTsTest(DispatchCase):

    @classmethod
    def setUpClass(cls):
        cls.build = tempfile.mkdtemp(prefix="tally-client-ts-")
        client = build_client(cls.build)
        driver = os.path.join(cls.build, "driver")
        os.makedirs(os.path.join(driver, "src"))
        os.makedirs(os.path.join(driver, "node_modules", "@tally"))
        os.symlink(client, os.path.join(driver, "node_modules", "@tally", "client"))
        with open(os.path.join(driver, "src", "driver.ts"), "w") as f:
            f.write(DRIVER)
        with open(os.path.join(driver, "tsconfig.json"), "w") as f:
            json.dump(DRIVER_TSCONFIG, f)
        tsc = os.path.join(client, "node_modules", "typescript", "bin", "tsc")
        out = subprocess.run(["node", tsc, "-p", driver], capture_output=True, text=True,
                             timeout=300)
        if out.returncode != 0:
            raise AssertionError(f"the driver does not compile against @tally/client:\n"
                                 f"{out.stdout}{out.stderr}")
        cls.script = os.path.join(driver, "dist", "driver.js")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.build, ignore_errors=True)

    # --- agents and workers ---------------------------------------------------------------

    def agent(self, name="agent", **options):
        opts = {"brokers": self.stack.kafka.split(","), "agent": name,
                "topicPrefix": self.prefix}
        opts.update(options)
        a = TsAgent(self, self.script, opts, name)
        self.addCleanup(a.stop)
        self.addCleanup(lambda: self._outcome_failed() and print(
            f"\n----- stderr of {a.name} -----\n{a.stderr()}"))
        a.wait_ready()
        return a

    def reconciler(self, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
                "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 300, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start("tally-reconciler", **base)

    def compensator(self, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
                "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 200, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start("tally-compensator", **base)

    def assert_ok(self, r, status="CONFIRMED"):
        self.assertTrue(r["ok"], json.dumps(r)[:3000])
        self.assertEqual(r["value"]["status"], status, json.dumps(r)[:3000])
        return r["value"]

    def assert_refused(self, r, cls="IntentRefused"):
        self.assertFalse(r["ok"], json.dumps(r)[:3000])
        self.assertEqual(r["error"]["class"], cls, json.dumps(r)[:3000])
        return r["error"]

    def assert_own_answers_only(self, stats, answers):
        self.assertEqual(stats["answersReceived"], answers, stats)
        self.assertEqual(stats["foreign"], 0, stats)
        self.assertEqual(stats["unreadable"], 0, stats)
        self.assertEqual(stats["messagesRead"], stats["answersReceived"] + stats["duplicates"]
                         + stats["late"], stats)

    def raw_messages(self, topic, predicate, timeout=20):
        """[(partition, key, headers dict, value)] read from every partition of TOPIC from the
        start until predicate(list) holds."""
        c = Consumer({"bootstrap.servers": self.stack.kafka, "group.id": "t-" + uuid.uuid4().hex,
                      "enable.auto.commit": False})
        self._consumers.append(c)
        md = c.list_topics(topic=topic, timeout=10)
        c.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
        got = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error():
                got.append((m.partition(), m.key(), dict(m.headers() or []), m.value()))
            if predicate(got):
                return got
        raise AssertionError(f"timed out reading {topic}: {got!r}"[:3000])

    # --- the cases ------------------------------------------------------------------------

    def test_wire_format_and_matching_with_replies_made_by_hand(self):
        """No dispatcher: the test plays tally. The intent carries the Spring headers and the
        run id as key; answers are matched by correlation id, duplicates and other clients'
        messages are dropped, UNKNOWN is waited through, and a fixed reply partition is the
        only one read."""
        a = self.agent("hand made/agent")
        own = a.ready["reply_topic"]
        self.assertRegex(own, r"^" + self.prefix.replace(".", r"\.")
                         + r"replies\.hand-made-agent\.[0-9a-f]{16}$")
        self.assertLess(a.ready["connect_ms"], 15000)
        run = run_id()
        tag = a.send("call", run=run, step=1, tool="charge_card",
                     args={"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 5},
                     options={"timeoutMs": 20000})
        [(_, key, headers, value)] = self.raw_messages(self.topic("intents"),
                                                       lambda got: len(got) >= 1)
        intent = json.loads(value)
        self.assertEqual(key, run.encode())
        self.assertEqual((intent["type"], intent["source"], intent["data"]["run_id"]),
                         ("tally.intent.v1", "/agents/hand%20made%2Fagent", run))
        self.assertEqual(headers["kafka_replyTopic"], own.encode())
        cid = headers["kafka_correlationId"]
        self.assertRegex(cid.decode(), r"^[0-9a-f-]{36}$")
        self.assertNotIn("kafka_replyPartition", headers)

        def reply(kind, status, ev_id=None, **extra):
            d = {"effect_id": str(uuid.uuid4()), "run_id": run, "step": 1, "tool": "charge_card",
                 "operation_key": f"charge_card:t1:{run}-p", "status": status, "receipt": None,
                 "external_ref": None, "error": None, "attempts": 1,
                 "intent_id": intent["id"]}
            d.update(extra)
            return json.dumps({"specversion": "1.0", "id": ev_id or str(uuid.uuid4()),
                               "source": "/tests", "type": f"tally.effect.{kind}.v1",
                               "datacontenttype": "application/json", "data": d}).encode()

        p = self.producer()
        unknown = reply("unknown", "UNKNOWN")
        p.produce(own, key=run, value=unknown, headers={"kafka_correlationId": cid})
        p.produce(own, key=run, value=unknown, headers={"kafka_correlationId": cid})  # again
        p.produce(own, key=run, value=reply("confirmed", "CONFIRMED"),
                  headers={"kafka_correlationId": b"someone else's"})
        p.produce(own, key=run, value=b"not json", headers={"kafka_correlationId": cid})
        # matched by the CloudEvents attribute when there is no header
        confirmed = json.loads(reply("confirmed", "CONFIRMED", receipt={"id": "ch_1"},
                                     external_ref="ch_1"))
        confirmed["correlationid"] = cid.decode()
        p.produce(own, key=run, value=json.dumps(confirmed).encode())
        p.flush(10)
        o = self.assert_ok(a.result(tag, timeout=20))
        self.assertEqual([h["type"] for h in o["history"]],
                         ["tally.effect.unknown.v1", "tally.effect.confirmed.v1"])
        self.assertEqual((o["externalRef"], o["intentId"], o["final"], o["replay"]),
                         ("ch_1", intent["id"], True, False))
        s = a.stats()
        self.assertEqual((s["messagesRead"], s["answersReceived"], s["duplicates"], s["foreign"],
                          s["unreadable"]), (5, 2, 1, 1, 1), s)

        # A shared topic and a fixed partition: the header is Spring's 4-byte big-endian int,
        # and only that partition is read, from its end.
        shared = self.prefix + "replies.shared"
        p.list_topics(topic=shared, timeout=10)          # created with the cluster's default
        p.produce(shared, value=b"from before the agent started", partition=2)
        p.flush(10)
        b = self.agent("pinned", replyTopic=shared, replyPartition=2)
        tag = b.send("call", run=run, step=2, tool="check_balance",
                     args={"request_id": f"{run}-rq", "account_id": "a"},
                     options={"timeoutMs": 20000, "first": True})
        got = self.raw_messages(self.topic("intents"), lambda got: len(got) >= 2)
        [(_, _, headers, value)] = [m for m in got if json.loads(m[3])["data"]["step"] == 2]
        self.assertEqual(headers["kafka_replyTopic"], shared.encode())
        self.assertEqual(headers["kafka_replyPartition"], b"\x00\x00\x00\x02")
        intent = json.loads(value)
        planned = json.loads(reply("planned", "PLANNED", step=2, tool="check_balance"))
        planned["data"]["intent_id"] = intent["id"]
        for part in (1, 2):   # partition 1 is not this agent's to read
            p.produce(shared, partition=part, value=json.dumps(planned).encode(),
                      headers={"kafka_correlationId": headers["kafka_correlationId"]})
        p.flush(10)
        o = self.assert_ok(b.result(tag, timeout=20), status="PLANNED")   # first: true
        self.assertFalse(o["final"])
        time.sleep(0.5)
        s = b.stats()
        self.assertEqual((s["messagesRead"], s["answersReceived"]), (1, 1), s)

    def test_three_tools_read_reversible_append_only(self):
        self.dispatcher()
        a = self.agent()
        run = run_id()
        steps = [(1, "check_balance", {"request_id": f"{run}-rq", "account_id": "acct-7"}),
                 (2, "charge_card", {"tenant_id": "t1", "payment_id": f"{run}-p",
                                     "amount": 500}),
                 (3, "send_email", {"message_id": f"{run}-m", "to": "ann@example.com",
                                    "subject": "paid"})]
        outcomes = [self.assert_ok(a.call(run, step, tool, args)) for step, tool, args in steps]
        records = {r["id"]: r for r in self.records()}
        for o, (step, tool, args) in zip(outcomes, steps):
            self.assertEqual((o["type"], o["runId"], o["step"], o["tool"], o["replay"]),
                             ("tally.effect.confirmed.v1", run, step, tool, False))
            self.assertEqual(len(o["history"]), 1)          # one answer, final at once
            # the reply is the outcome event plus the correlation id this client sent
            self.assertRegex(o["event"].get("correlationid", ""), r"^[0-9a-f-]{36}$")
            row = self.effect(tool, o["operationKey"])
            self.assertEqual((row["effect_id"], row["status"]), (o["effectId"], "CONFIRMED"))
            self.assertEqual(records[o["externalRef"]]["body"], args)
            self.assertEqual(o["receipt"], records[o["externalRef"]])
        self.assertEqual(len({o["intentId"] for o in outcomes}), 3)
        self.assert_own_answers_only(a.stats(), 3)
        self.invariants()

    def test_a_timeout_resolved_by_the_reconciler_is_one_final_answer(self):
        self.dispatcher()
        self.reconciler()
        a = self.agent()
        run = run_id()
        key = f"charge_card:t1:{run}-p"
        # The tool applies the charge, then holds the answer past the connector's timeout.
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        r = a.call(run, 1, "charge_card", {"tenant_id": "t1", "payment_id": f"{run}-p",
                                           "amount": 9}, timeoutMs=45000)
        o = self.assert_ok(r)
        self.assertEqual([h["type"] for h in o["history"]],
                         ["tally.effect.unknown.v1", "tally.effect.confirmed.v1"])
        self.assertEqual(len({h["data"]["effect_id"] for h in o["history"]}), 1)
        [record] = self.records("charges")
        self.assertEqual((o["externalRef"], o["receipt"]), (record["id"], record))
        self.assertEqual(len(self.requests(key)), 1)
        self.assertEqual(self.effect("charge_card", key)["status"], "CONFIRMED")
        s = a.stats()
        self.assert_own_answers_only(s, 2)
        self.invariants()

    def test_republished_after_a_kill_is_the_same_effect(self):
        self.dispatcher()
        run = run_id()
        key = f"charge_card:t1:{run}-p"
        args = {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 1200}
        self.fault("slow", key=key, delay_ms=1500)      # the call is in flight for a while
        first = self.agent("crashy")
        first.send("call", run=run, step=1, tool="charge_card", args=args)
        self.wait_status("charge_card", key, "DISPATCHING", timeout=20)
        first.kill()                                     # SIGKILL: no close, no goodbye
        row = self.wait_status("charge_card", key, "CONFIRMED", timeout=30)

        again = self.agent("crashy")                     # the restarted agent, a new process
        self.assertNotEqual(again.ready["reply_topic"], first.ready["reply_topic"])
        o = self.assert_ok(again.call(run, 1, "charge_card", args))
        self.assertTrue(o["replay"], o)
        self.assertEqual((o["effectId"], o["externalRef"]), (row["effect_id"], row["external_ref"]))
        self.assertEqual(len(o["history"]), 1)
        self.assertEqual(len([r for r in self.records("charges")
                              if r["idempotency_key"] == key]), 1)   # one upstream record
        self.assertEqual(len(self.requests(key)), 1)                 # the tool was called once
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE run_id = %s", (run,)), 1)
        self.invariants()

    def test_refusals_reject_with_intent_refused_within_a_second(self):
        self.dispatcher()
        a = self.agent()
        run = run_id()
        r = a.call(run, 1, "launch_rocket", {"x": 1}, timeoutMs=10000)
        e = self.assert_refused(r)
        self.assertEqual((e["reason"], e["field"], e["local"], e["code"]),
                         ("unknown_tool", "data.tool", False, "unknown_tool"))
        self.assertIn("launch_rocket", e["detail"])
        self.assertEqual(e["event"]["type"], "tally.intent.rejected.v1")
        self.assertIsNotNone(e["event"]["data"]["dlq"])
        self.assertLess(r["ms"], 1000, r)
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE run_id = %s", (run,)), 0)

        # A reply topic outside the allowed prefix: tally would answer on <prefix>outcomes
        # only, so the client refuses it itself and publishes nothing.
        elsewhere = "elsewhere.replies." + uuid.uuid4().hex[:8]
        b = self.agent("misconfigured", replyTopic=elsewhere)
        r = b.call(run, 2, "check_balance", {"request_id": f"{run}-rq", "account_id": "a"})
        e = self.assert_refused(r)
        self.assertEqual((e["reason"], e["field"], e["local"]),
                         ("invalid_reply_to", "replytopic", True))
        self.assertIn(self.prefix + "replies.", e["detail"])
        self.assertLess(r["ms"], 1000, r)
        # ... which is what tally answers such an intent, sent by hand, on outcomes only.
        ce = self.intent(run, 3, "check_balance", {"request_id": f"{run}-rq3", "account_id": "a"})
        self.producer().produce(self.topic("intents"), key=run, value=json.dumps(ce).encode(),
                                headers={"kafka_replyTopic": elsewhere.encode(),
                                         "kafka_correlationId": b"c-1"})
        self.producer().flush(10)
        got = self.read_until("outcomes", lambda ms: any(
            m.get("data", {}).get("intent_id") == ce["id"] for m in ms))
        [ans] = [m for m in got if m.get("data", {}).get("intent_id") == ce["id"]]
        self.assertEqual((ans["type"], ans["data"]["reason"]),
                         ("tally.intent.rejected.v1", "invalid_reply_to"))
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE run_id = %s", (run,)), 0)

    def test_compensate_and_cancel_resolve_with_the_summary(self):
        self.dispatcher()
        self.compensator()
        a = self.agent()
        run = run_id()
        steps = [(1, "check_balance", {"request_id": f"{run}-rq", "account_id": "acct-7"}),
                 (2, "charge_card", {"tenant_id": "t1", "payment_id": f"{run}-p",
                                     "amount": 500}),
                 (3, "send_email", {"message_id": f"{run}-m", "to": "bob@example.com",
                                    "subject": "paid"})]
        outcomes = [self.assert_ok(a.call(run, *s)) for s in steps]
        r = a.do("compensate", timeout=90, run=run,
                 options={"reason": "the customer disputed it", "timeoutMs": 60000})
        self.assertTrue(r["ok"], r)
        s = r["value"]
        self.assertEqual((s["type"], s["runId"], s["status"]),
                         ("tally.run.compensated.v1", run, "PARTIALLY_COMPENSATED"))
        summary = s["summary"]
        self.assertEqual([(i["step"], i["tool"]) for i in summary["compensated"]],
                         [(2, "charge_card")])
        self.assertEqual([(i["step"], i["tool"]) for i in summary["uncompensatable"]],
                         [(3, "send_email")])
        self.assertEqual([(i["step"], i["tool"]) for i in summary["skipped"]],
                         [(1, "check_balance")])
        self.assertEqual(summary["failed"], [])
        self.assertEqual(summary["compensated"][0]["effect_id"], outcomes[1]["effectId"])
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "PARTIALLY_COMPENSATED")

        # cancel: nothing in flight, so nothing to cancel; with compensate, the charge is undone
        plain, undo = run_id(), run_id()
        self.assert_ok(a.call(plain, 1, "check_balance", {"request_id": f"{plain}-rq",
                                                          "account_id": "a"}))
        r = a.do("cancel", run=plain, options={"reason": "stop", "timeoutMs": 30000})
        self.assertTrue(r["ok"], r)
        self.assertEqual((r["value"]["type"], r["value"]["status"],
                          r["value"]["effectsCancelled"]),
                         ("tally.run.cancelled.v1", "CANCELLED", 0))
        self.assert_ok(a.call(undo, 1, "charge_card", {"tenant_id": "t1",
                                                       "payment_id": f"{undo}-p", "amount": 3}))
        r = a.do("cancel", timeout=90, run=undo,
                 options={"reason": "stop and undo", "compensate": True, "timeoutMs": 60000})
        self.assertTrue(r["ok"], r)
        self.assertEqual((r["value"]["type"], r["value"]["status"]),
                         ("tally.run.compensated.v1", "COMPENSATED"))
        self.assertEqual([i["tool"] for i in r["value"]["summary"]["compensated"]],
                         ["charge_card"])

    def test_complete_then_a_later_intent_is_refused_run_not_active(self):
        self.dispatcher()
        a = self.agent()
        run = run_id()
        args = {"request_id": f"{run}-rq", "account_id": "acct-7"}
        first = self.assert_ok(a.call(run, 1, "check_balance", args))
        r = a.do("complete", run=run, options={"reason": "all done"})
        self.assertTrue(r["ok"], r)
        done = r["value"]
        self.assertEqual((done["type"], done["runId"], done["status"]),
                         ("tally.run.completed.v1", run, "COMPLETED"))
        self.assertEqual((done["summary"]["total"], done["summary"]["effects"],
                          done["summary"]["open"], done["summary"]["open_count"]),
                         (1, {"CONFIRMED": 1}, [], 0))
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "COMPLETED")

        r = a.call(run, 2, "check_balance", {"request_id": f"{run}-rq2", "account_id": "a"},
                   timeoutMs=10000)
        e = self.assert_refused(r)
        self.assertEqual((e["reason"], e["local"]), ("run_not_active", False))
        self.assertIsNone(e["event"]["data"]["dlq"])
        self.assertLess(r["ms"], 1000, r)
        # a replay of an intent whose effect exists is still answered with that effect
        again = self.assert_ok(a.call(run, 1, "check_balance", args))
        self.assertEqual((again["effectId"], again["replay"]), (first["effectId"], True))
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE run_id = %s", (run,)), 1)

    def test_two_agents_share_nothing(self):
        self.dispatcher()
        a, b = self.agent("ann"), self.agent("bob")
        self.assertNotEqual(a.ready["reply_topic"], b.ready["reply_topic"])
        runs = {a: [run_id(), run_id()], b: [run_id(), run_id()]}
        tags = {}
        for agent, their_runs in runs.items():     # all four calls in flight at once
            for i, run in enumerate(their_runs):
                for step in (1, 2):
                    tags[agent.send("call", run=run, step=step, tool="check_balance",
                                    args={"request_id": f"{run}-{step}", "account_id": "a"})] = \
                        (agent, run)
        for tag, (agent, run) in tags.items():
            o = self.assert_ok(agent.result(tag))
            self.assertEqual(o["runId"], run)
        for agent in (a, b):
            self.assert_own_answers_only(agent.stats(), 4)
        closed = a.close()
        self.assert_own_answers_only(closed, 4)


if __name__ == "__main__":
    tallytest.main()
