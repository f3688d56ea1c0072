#!/usr/bin/python3
"""tally's agents benchmark (bench/README.md, "Issue 21"): N agent processes, R intents/s in
total, S seconds, and how each of them gets its answers.

Starts the embedded stack the way bench/run.sh does (`tally dev --no-workers`: PostgreSQL and
librdkafka's mock Kafka cluster), the fake tool service and D dispatchers, then N agent
processes (this file again, with --role). Each agent calls bench_ledger (idempotent, fast) at
R/N intents/s, paced by the clock with as many calls in flight as it takes, in one of two ways:

  lib        the Python client (clients/python, tally_client): a reply topic of its own;
             read amplification = messages its reply consumer read / answers it received
             (Tally.stats(): messages_read / answers)
  outcomes   today's way (examples/agent/agent.py): publish without a reply topic, read every
             partition of <prefix>outcomes, keep the answers to its own intents;
             read amplification = messages read / own answers

By default N-1 agents use the library and one reads <prefix>outcomes beside them (same rate
per process), so the total is R. Latency is publish -> final answer: for the library, from
just before `run.call()` to its return with CONFIRMED. It prints `bench: agents.<name> = ...`
lines. Nothing here is a test assertion.

    bench/agents.sh                                   # 50 agents, 1,000/s, 20 s
    bench/agents.sh --agents 20 --rate 200 --duration 10 --build-dir build-agents --no-build

Run it with Debian's /usr/bin/python3 (python3-confluent-kafka); bench/agents.sh does.
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = "bench_ledger"
SETTLED = {"CONFIRMED", "DUPLICATE", "COMPENSATED", "FAILED", "CONFLICT", "REJECTED",
           "CANCELLED", "REFUSED"}


def pct(sorted_values, p):
    """Nearest-rank percentile (as bench_client.c)."""
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    rank = min(n, max(1, math.ceil(p / 100.0 * n - 1e-9)))
    return sorted_values[rank - 1]


# =========================================================================================
# The agent processes (--role lib | outcomes)
# =========================================================================================

class Agent:
    """What both kinds of agent share: the control protocol with the driver (stdout lines
    `ready`, `done`, `result <json>`; stdin lines `go <wall time>`, `stop`), the pacing and
    the per-call records (a file: intent_id sent_ns arrival_ns consumed_ns produced_ms
    latency_ms lag_ms status)."""

    def __init__(self, opts):
        self.o = opts
        self.records = []
        self.lock = threading.Lock()
        self.consumed = {}  # intent id -> (ns the reply consumer had it, Kafka timestamp ms)
        self.prefix_ids = f"{opts.nonce}-a{opts.index}"

    def say(self, line):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def wait_line(self, word):
        while True:
            line = sys.stdin.readline()
            if not line:
                raise SystemExit(f"agent {self.o.index}: the driver went away")
            parts = line.split()
            if parts and parts[0] == word:
                return parts[1:]

    def args_of(self, k):
        return {"entry_id": f"{self.prefix_ids}-{k}", "amount": 100 + k % 9900}

    def schedule(self, go_wall):
        """(k, scheduled monotonic time, run index, step) of every measured call."""
        o = self.o
        start = time.monotonic() + (go_wall - time.time())
        interval = o.agents / o.rate
        phase = o.index / o.agents * interval  # the agents' calls interleave evenly
        k = 0
        while True:
            at = phase + k * interval
            if at >= o.duration:
                return
            yield k, start + at, k % o.runs_per_agent, k // o.runs_per_agent
            k += 1

    def record(self, intent_id, sent_ns, latency_ms, lag_ms, status):
        arrival_ns = sent_ns + int(latency_ms * 1e6)
        consumed_ns, produced_ms = self.consumed.pop(intent_id, (0, 0)) if intent_id else (0, 0)
        with self.lock:
            self.records.append((intent_id or "-", sent_ns, arrival_ns, consumed_ns,
                                 produced_ms, latency_ms, lag_ms, status))

    def note_consumed(self, value, timestamp):
        """From the reply consumer's thread: when it had the answer to which intent (found
        with a byte search, not a second JSON parse) and the Kafka timestamp (the relay's
        produce time, CreateTime)."""
        i = value.find(b'"intent_id":"')
        if i < 0:
            return
        j = value.find(b'"', i + 13)
        if j > 0:
            key = value[i + 13:j].decode("ascii", "replace")
            if key not in self.consumed:
                self.consumed[key] = (time.time_ns(), timestamp[1] if timestamp else 0)

    @staticmethod
    def thread_cpu():
        """CPU seconds of each of this process's threads, by name: Python's threads by their
        threading name (tally-replies-*: the reply consumer's hand-off, tally-deliveries-*:
        the producer's delivery reports, MainThread: the event loop), librdkafka's by theirs
        (rdk:main, rdk:broker*)."""
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {}
        hz = os.sysconf("SC_CLK_TCK")
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    head, tail = f.read().rsplit(")", 1)
                comm = head.split("(", 1)[1]
                cpu = sum(int(x) for x in tail.split()[11:13]) / hz
            except (OSError, IndexError, ValueError):
                continue
            name = names.get(int(tid), comm)
            name = re.sub(r"-bench-agent-\d+$", "", name)
            name = re.sub(r"^(ThreadPoolExecutor|asyncio)_?\d*_\d+$", r"\1 workers", name)
            name = "rdk:broker" if name.startswith("rdk:broker") else name
            out[name] = out.get(name, 0.0) + cpu
        t = os.times()  # threads that have ended (a pool's workers) are only in the total
        gone = t.user + t.system - sum(out.values())
        if gone > 0.05:
            out["ended threads"] = gone
        return out

    def finish(self, before, after, sent, extra):
        with open(self.o.times_file, "w") as f:
            for r in self.records:
                f.write("%s %d %d %d %d %.3f %.3f %s\n" % r)
        stats = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        result = {"index": self.o.index, "role": self.o.role, "sent": sent,
                  "completed": len(self.records), "stats": stats,
                  "threads": self.thread_cpu()}
        result.update(extra)
        self.say("result " + json.dumps(result))


class LibAgent(Agent):
    """An agent on tally_client: a reply topic of its own, calls through run.call()."""

    def config(self):
        cfg = {}
        if self.o.agent_fetch_wait_ms is not None:
            cfg["fetch.wait.max.ms"] = self.o.agent_fetch_wait_ms
        return cfg or None

    def instrument(self, transport):
        """Wrap the transport's _take (the reply consumer thread's hand-off) to note when each
        answer left the consumer; the library itself is not changed."""
        take = getattr(transport, "_take", None)
        if take is None:  # the library changed: no relay/kafka/handoff split then
            return

        def noted(msg):
            self.note_consumed(msg.value() or b"", msg.timestamp())
            take(msg)

        transport._take = noted

    def main(self):
        if self.o.api == "asyncio":
            import asyncio
            asyncio.run(self.main_async())
        else:
            self.main_threads()

    def start_args(self):
        return dict(topic_prefix=self.o.topic_prefix, config=self.config())

    async def main_async(self):
        import asyncio
        from tally_client import TallyError
        from tally_client.aio import AsyncTally

        o = self.o
        tally = AsyncTally(o.brokers, f"bench-agent-{o.index}", **self.start_args())
        self.instrument(getattr(tally, "_transport", None))
        await tally.start()
        try:
            warm = tally.run(f"{self.prefix_ids}-warm")
            for w in range(o.warmup):
                await warm.call(w, TOOL, {"entry_id": f"{self.prefix_ids}-w{w}", "amount": 1},
                                timeout=60)
            self.consumed.clear()
            runs = [tally.run(f"{self.prefix_ids}-r{j}") for j in range(o.runs_per_agent)]
            self.say("ready " + tally.reply_topic)
            go = float(self.wait_line("go")[0])
            before = tally.stats()

            async def one(k, at, run, step):
                lag = (time.monotonic() - at) * 1000
                sent_ns = time.time_ns()
                t0 = time.monotonic()
                intent_id, status = None, "?"
                try:
                    out = await run.call(step, TOOL, self.args_of(k), timeout=o.timeout)
                    intent_id, status = out.intent_id, out.status
                except TallyError as e:
                    status = type(e).__name__
                    outcome = getattr(e, "outcome", None) or getattr(e, "last", None)
                    intent_id = getattr(outcome, "intent_id", None)
                self.record(intent_id, sent_ns, (time.monotonic() - t0) * 1000, lag, status)

            tasks = []
            sent = 0
            for k, at, r, step in self.schedule(go):
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(k, at, runs[r], step)))
                sent += 1
            await asyncio.gather(*tasks)
            self.say("done")
            await asyncio.get_running_loop().run_in_executor(None, self.wait_line, "stop")
            after = tally.stats()
            self.finish(before, after, sent, {"reply_topic": tally.reply_topic})
        finally:
            await tally.close()

    def main_threads(self):
        from concurrent.futures import ThreadPoolExecutor
        from tally_client import Tally, TallyError

        o = self.o
        tally = Tally(o.brokers, f"bench-agent-{o.index}", **self.start_args())
        self.instrument(getattr(tally, "_transport", None))
        try:
            warm = tally.run(f"{self.prefix_ids}-warm")
            for w in range(o.warmup):
                warm.call(w, TOOL, {"entry_id": f"{self.prefix_ids}-w{w}", "amount": 1},
                          timeout=60)
            self.consumed.clear()
            runs = [tally.run(f"{self.prefix_ids}-r{j}") for j in range(o.runs_per_agent)]
            self.say("ready " + tally.reply_topic)
            go = float(self.wait_line("go")[0])
            before = tally.stats()

            def one(k, at, run, step):
                lag = (time.monotonic() - at) * 1000
                sent_ns = time.time_ns()
                t0 = time.monotonic()
                intent_id, status = None, "?"
                try:
                    out = run.call(step, TOOL, self.args_of(k), timeout=o.timeout)
                    intent_id, status = out.intent_id, out.status
                except TallyError as e:
                    status = type(e).__name__
                    outcome = getattr(e, "outcome", None) or getattr(e, "last", None)
                    intent_id = getattr(outcome, "intent_id", None)
                self.record(intent_id, sent_ns, (time.monotonic() - t0) * 1000, lag, status)

            sent = 0
            with ThreadPoolExecutor(max_workers=o.threads) as pool:
                for k, at, r, step in self.schedule(go):
                    delay = at - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    pool.submit(one, k, at, runs[r], step)
                    sent += 1
            self.say("done")
            self.wait_line("stop")
            after = tally.stats()
            self.finish(before, after, sent, {"reply_topic": tally.reply_topic})
        finally:
            tally.close()


class OutcomesAgent(Agent):
    """Today's way (examples/agent/agent.py): intents without a reply topic; one consumer
    assigned every partition of <prefix>outcomes from its end, keeping the answers whose
    data.intent_id is one of ours. Same producer settings as the library's."""

    def main(self):
        from confluent_kafka import OFFSET_END, Consumer, Producer, TopicPartition

        o = self.o
        self.stats = {"published": 0, "messages_read": 0, "answers": 0, "duplicates": 0,
                      "foreign": 0, "unreadable": 0, "late": 0}
        self.pending = {}  # intent id -> [sent_ns, t0 monotonic, lag_ms, threading.Event]
        self.seen = set()
        producer = Producer({"bootstrap.servers": o.brokers, "enable.idempotence": True,
                             "linger.ms": 1, "message.timeout.ms": 30000})
        ccfg = {"bootstrap.servers": o.brokers, "group.id": "bench-outcomes-" + uuid.uuid4().hex,
                "enable.auto.commit": False, "enable.partition.eof": False,
                "fetch.wait.max.ms": o.agent_fetch_wait_ms if o.agent_fetch_wait_ms is not None
                else 10}
        consumer = Consumer(ccfg)
        topic = o.topic_prefix + "outcomes"
        md = consumer.list_topics(topic=topic, timeout=15)
        tmd = md.topics.get(topic)
        if tmd is None or tmd.error is not None or not tmd.partitions:
            raise SystemExit(f"agent {o.index}: topic {topic} is not available")
        parts = []
        for p in sorted(tmd.partitions):
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=15,
                                                     cached=False)
            parts.append(TopicPartition(topic, p, high if high >= 0 else OFFSET_END))
        consumer.assign(parts)
        producer.list_topics(topic=o.topic_prefix + "intents", timeout=15)
        stopping = threading.Event()

        def read():
            while not stopping.is_set():
                msg = consumer.poll(0.1)
                if msg is None or msg.error() is not None:
                    continue
                self.take(msg)

        def deliveries():
            while not stopping.is_set():
                producer.poll(0.1)

        threads = [threading.Thread(target=read, daemon=True),
                   threading.Thread(target=deliveries, daemon=True)]
        for t in threads:
            t.start()
        try:
            for w in range(o.warmup):
                ev = self.publish(producer, f"{self.prefix_ids}-warm", w,
                                  {"entry_id": f"{self.prefix_ids}-w{w}", "amount": 1}, 0.0)
                if not self.pending[ev][3].wait(60):
                    raise SystemExit(f"agent {o.index}: no answer to warm-up intent {ev}")
            self.consumed.clear()
            with self.lock:
                self.records.clear()
            self.say("ready " + topic)
            go = float(self.wait_line("go")[0])
            with self.lock:
                before = dict(self.stats)
            sent = 0
            ids = []
            for k, at, r, step in self.schedule(go):
                delay = at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                lag = (time.monotonic() - at) * 1000
                ids.append(self.publish(producer, f"{self.prefix_ids}-r{r}", step,
                                        self.args_of(k), lag))
                sent += 1
            deadline = time.monotonic() + o.timeout
            for ev in ids:
                entry = self.pending.get(ev)
                if entry is not None:
                    entry[3].wait(max(0.0, deadline - time.monotonic()))
            with self.lock:
                for ev, entry in list(self.pending.items()):
                    if not entry[3].is_set():
                        self.records.append((ev, entry[0], 0, 0, 0, float("nan"), entry[2],
                                             "OutcomeTimeout"))
            self.say("done")
            self.wait_line("stop")
            with self.lock:
                after = dict(self.stats)
            self.finish(before, after, sent, {"partitions": len(parts)})
        finally:
            stopping.set()
            for t in threads:
                t.join(2)
            producer.flush(5)
            consumer.close()

    def publish(self, producer, run_id, step, args, lag):
        ev_id = str(uuid.uuid4())
        t = time.time()
        event = {"specversion": "1.0", "id": ev_id, "source": f"/agents/bench-agent-{self.o.index}",
                 "type": "tally.intent.v1",
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
                 + f".{int(t * 1000) % 1000:03d}Z",
                 "datacontenttype": "application/json", "subject": run_id,
                 "data": {"run_id": run_id, "step": step, "tool": TOOL, "args": args}}
        with self.lock:
            self.pending[ev_id] = [time.time_ns(), time.monotonic(), lag, threading.Event()]
            self.stats["published"] += 1
        producer.produce(self.o.topic_prefix + "intents", key=run_id.encode(),
                         value=json.dumps(event, separators=(",", ":")).encode(),
                         headers=[("content-type", b"application/cloudevents+json")])
        return ev_id

    def take(self, msg):
        now = time.monotonic()
        consumed_ns = time.time_ns()
        value = msg.value() or b""
        try:
            ev = json.loads(value)
            ev_id, type_ = ev["id"], ev["type"]
            data = ev.get("data")
            intent_id = data.get("intent_id") if isinstance(data, dict) else None
        except (ValueError, KeyError, TypeError, AttributeError):
            ev = None
        with self.lock:
            self.stats["messages_read"] += 1
            if ev is None:
                self.stats["unreadable"] += 1
                return
            entry = self.pending.get(intent_id)
            if entry is None:
                self.stats["foreign"] += 1
                return
            if ev_id in self.seen:
                self.stats["duplicates"] += 1
                return
            self.seen.add(ev_id)
            if entry[3].is_set():
                self.stats["late"] += 1
                return
            self.stats["answers"] += 1
            parts = type_.split(".")
            kind = parts[2].upper() if len(parts) == 4 and parts[1] == "effect" \
                else ("REFUSED" if type_ == "tally.intent.rejected.v1" else "?")
            if kind in SETTLED:
                ts = msg.timestamp()
                self.records.append((intent_id, entry[0], entry[0] + int((now - entry[1]) * 1e9),
                                     consumed_ns, ts[1] if ts else 0, (now - entry[1]) * 1000,
                                     entry[2], kind))
                entry[3].set()


def agent_main(opts):
    sys.path.insert(0, os.path.join(ROOT, "clients", "python", "src"))
    # the driver ends us with SIGTERM if it has to; exit without a traceback
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    agent = (LibAgent if opts.role == "lib" else OutcomesAgent)(opts)
    if opts.profile and opts.index == 0:
        # the first agent's main thread under cProfile (its other threads are not seen)
        import cProfile
        prof = cProfile.Profile(time.thread_time)  # CPU time of the main thread
        try:
            prof.runcall(agent.main)
        finally:
            prof.dump_stats(opts.profile)
    else:
        agent.main()


# =========================================================================================
# The driver
# =========================================================================================

class Driver:
    def __init__(self, o):
        self.o = o
        self.work = tempfile.mkdtemp(prefix="tally-agents-")
        self.log_dir = o.log_dir or os.path.join(self.work, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.procs = []  # (name, Popen) of everything we started, in start order
        self.agents = []
        self.dispatchers = []
        self.metrics_ports = []
        self.env = dict(os.environ)

    def say(self, text):
        print(f"bench/agents: {text}", file=sys.stderr, flush=True)

    # ---- processes ----------------------------------------------------------------------
    def spawn(self, name, argv, env=None, **kw):
        log = open(os.path.join(self.log_dir, name + ".log"), "w")
        p = subprocess.Popen(argv, env=env or self.env, stdout=kw.pop("stdout", log),
                             stderr=log, **kw)
        self.procs.append((name, p))
        return p

    def stop(self, name, p, grace=20):
        if p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            self.say(f"{name} (pid {p.pid}) did not stop within {grace}s; killing it")
            p.kill()
            p.wait()

    def teardown(self, failed):
        for name, p in reversed(self.procs):  # agents, dispatchers, fake tool, then tally dev
            self.stop(name, p, 60 if name == "dev" else 20)
        if failed:
            for f in sorted(os.listdir(self.log_dir)):
                if f.endswith(".log") and not f.startswith("agent-"):
                    with open(os.path.join(self.log_dir, f), errors="replace") as fh:
                        tail = fh.readlines()[-15:]
                    sys.stderr.write(f"---- {f} ----\n" + "".join(tail))
        if self.o.log_dir:
            self.say(f"logs kept in {self.log_dir}")
        shutil.rmtree(self.work, ignore_errors=True)

    def wait_until(self, seconds, what, check):
        deadline = time.monotonic() + seconds
        while not check():
            if time.monotonic() > deadline:
                raise SystemExit(f"bench/agents: timed out after {seconds}s waiting for {what}")
            time.sleep(0.1)

    def alive(self, name, p):
        if p.poll() is not None:
            with open(os.path.join(self.log_dir, name + ".log"), errors="replace") as fh:
                tail = "".join(fh.readlines()[-20:])
            raise SystemExit(f"bench/agents: {name} exited ({p.returncode}):\n{tail}")
        return True

    # ---- CPU ------------------------------------------------------------------------------
    @staticmethod
    def cpu(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def pg_cpu(self):
        total = self.cpu(self.pg_pid)
        try:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.pg_pid)],
                                 capture_output=True, text=True).stdout.split()
        except OSError:
            out = []
        return total + sum(self.cpu(int(c)) for c in out)

    def cpu_snapshot(self):
        return {"dispatcher": sum(self.cpu(p.pid) for p in self.dispatchers),
                "postgres": self.pg_cpu(), "kafka-mock": self.cpu(self.dev.pid),
                "fake-tool": self.cpu(self.fake.pid),
                "agents": sum(self.cpu(a.pid) for a in self.agents)}

    # ---- the run --------------------------------------------------------------------------
    def build(self):
        o = self.o
        targets = ["tally", "tally-dispatcher", "tally-fake-tool"]
        if not o.no_build:
            if not os.path.exists(os.path.join(o.build_dir, "CMakeCache.txt")):
                subprocess.run(["cmake", "-S", ROOT, "-B", o.build_dir,
                                "-DCMAKE_BUILD_TYPE=RelWithDebInfo"], check=True,
                               stdout=subprocess.DEVNULL)
            subprocess.run(["cmake", "--build", o.build_dir, f"-j{os.cpu_count() or 2}",
                            "--target", *targets], check=True, stdout=sys.stderr)
        self.tally_bin = os.path.join(o.build_dir, "tally")
        self.dispatcher_bin = os.path.join(o.build_dir, "tally-dispatcher")
        self.fake_bin = os.path.join(o.build_dir, "tests", "fakes", "tally-fake-tool")
        for b in (self.tally_bin, self.dispatcher_bin, self.fake_bin):
            if not os.access(b, os.X_OK):
                raise SystemExit(f"bench/agents: {b} is not built (run without --no-build)")
        self.build_type = "?"
        try:
            with open(os.path.join(o.build_dir, "CMakeCache.txt")) as f:
                m = re.search(r"^CMAKE_BUILD_TYPE:\w*=(.*)$", f.read(), re.M)
                self.build_type = m.group(1) if m else "?"
        except OSError:
            pass

    def start_stack(self):
        env = dict(self.env)
        env.pop("TALLY_PG", None)
        env.pop("TALLY_TOPIC_PREFIX", None)
        env_file = os.path.join(self.work, "env")
        self.dev = self.spawn("dev", [self.tally_bin, "dev", "--no-workers", "--env-file",
                                      env_file], env=env)
        self.wait_until(120, "tally dev to start",
                        lambda: self.alive("dev", self.dev) and os.path.exists(env_file)
                        and os.path.getsize(env_file) > 0)
        with open(env_file) as f:
            for m in re.finditer(r"^export (\w+)='?([^'\n]*)'?$", f.read(), re.M):
                self.env[m.group(1)] = m.group(2)
        dev_log = os.path.join(self.log_dir, "dev.log")

        def summary():
            with open(dev_log, errors="replace") as fh:
                return re.search(r"PostgreSQL .*\(.*, pid (\d+),", fh.read())
        self.wait_until(10, "tally dev's summary", lambda: summary() is not None)
        self.pg_pid = int(summary().group(1))
        with open(dev_log, "a") as log:
            # each process as its own role (docs/operations.md, "Database roles"): migrate
            # as the owner, the dispatchers as theirs; psql() reads as the superuser
            subprocess.run([self.tally_bin, "migrate"],
                           env=dict(self.env, TALLY_PG=self.env["TALLY_PG_OWNER"]),
                           stdout=log, stderr=log,
                           check=True)
        self.brokers = self.env["TALLY_KAFKA_BROKERS"]
        self.prefix = self.env.get("TALLY_TOPIC_PREFIX", "tally.")

        port_file = os.path.join(self.work, "fake.port")
        self.fake = self.spawn("fake-tool", [self.fake_bin, "--listen", "127.0.0.1:0",
                                             "--port-file", port_file])
        self.wait_until(30, "tally-fake-tool",
                        lambda: self.alive("fake-tool", self.fake) and os.path.exists(port_file)
                        and os.path.getsize(port_file) > 0)
        with open(port_file) as f:
            self.env["TALLY_FAKE_TOOL_URL"] = f"http://127.0.0.1:{f.read().strip()}"

        self.env.update({"TALLY_TOOLS": os.path.join(ROOT, "bench", "tools.json"),
                         "TALLY_SESSION_TIMEOUT_MS": "6000",
                         "TALLY_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
                         "TALLY_KAFKA_FETCH_WAIT_MAX_MS": str(self.o.fetch_wait_ms),
                         "TALLY_MAX_INFLIGHT": "6000", "TALLY_SHUTDOWN_GRACE_MS": "5000"})
        for i in range(self.o.dispatchers):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            env = dict(self.env, TALLY_PG=self.env["TALLY_PG_DISPATCHER"],
                       TALLY_METRICS_ADDR=f"127.0.0.1:{port}",
                       TALLY_WORKER_ID=f"bench-dispatcher-{i + 1}")
            self.dispatchers.append(self.spawn(f"dispatcher-{i + 1}", [self.dispatcher_bin],
                                               env=env))
            self.metrics_ports.append(port)
        for i, (p, port) in enumerate(zip(self.dispatchers, self.metrics_ports)):
            def ready():
                self.alive(f"dispatcher-{i + 1}", p)
                try:
                    return urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz",
                                                  timeout=2).status == 200
                except OSError:
                    return False
            self.wait_until(60, f"tally-dispatcher {i + 1} /readyz", ready)
        self.say(f"{self.o.dispatchers} dispatcher(s) ready; Kafka (mock) {self.brokers}, "
                 f"fake tool {self.env['TALLY_FAKE_TOOL_URL']}")

    def start_agents(self):
        o = self.o
        nonce = uuid.uuid4().hex[:8]
        k = o.outcomes_agents
        for i in range(o.agents):
            role = "outcomes" if i >= o.agents - k else "lib"
            argv = [sys.executable, os.path.abspath(__file__), "--role", role,
                    "--index", str(i), "--agents", str(o.agents), "--rate", str(o.rate),
                    "--duration", str(o.duration), "--brokers", self.brokers,
                    "--topic-prefix", self.prefix, "--nonce", nonce,
                    "--runs-per-agent", str(o.runs_per_agent), "--warmup", str(o.warmup),
                    "--timeout", str(o.timeout), "--api", o.api, "--threads", str(o.threads),
                    "--times-file", os.path.join(self.work, f"agent-{i}.times")]
            if o.agent_fetch_wait_ms is not None:
                argv += ["--agent-fetch-wait-ms", str(o.agent_fetch_wait_ms)]
            if o.profile:
                argv += ["--profile", os.path.abspath(o.profile)]
            p = self.spawn(f"agent-{i}", argv, stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                           text=True, bufsize=1)
            p.role = role
            self.agents.append(p)
            if (i + 1) % o.start_batch == 0:
                self.wait_lines("ready", self.agents[i + 1 - o.start_batch:i + 1], 180)
        rest = len(self.agents) % o.start_batch
        if rest:
            self.wait_lines("ready", self.agents[-rest:], 180)
        self.say(f"{o.agents} agents ready ({o.agents - k} on tally_client, {k} reading "
                 f"{self.prefix}outcomes), {o.warmup} warm-up calls each")

    def wait_lines(self, word, agents, seconds):
        """The next line of each agent starting with `word` (its remaining words)."""
        out = []
        deadline = time.monotonic() + seconds
        for p in agents:
            result = []

            def read():
                for line in p.stdout:
                    if line.startswith(word):
                        result.append(line[len(word):].strip())
                        return
            t = threading.Thread(target=read, daemon=True)
            t.start()
            t.join(max(0.1, deadline - time.monotonic()))
            if not result:
                i = self.agents.index(p)
                self.alive(f"agent-{i}", p)
                raise SystemExit(f"bench/agents: agent {i} said no '{word}' within {seconds}s")
            out.append(result[0])
        return out

    def tell(self, line):
        for p in self.agents:
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def psql(self, sql):
        r = subprocess.run(["psql", self.env["TALLY_PG_ADMIN"] + " dbname=tally", "-qAt", "-F",
                            " ", "-v",
                            "ON_ERROR_STOP=1"], input=sql, capture_output=True, text=True,
                           env=self.env)
        if r.returncode != 0:
            self.say(f"psql: {r.stderr.strip()}")
            return ""
        return r.stdout

    def run(self):
        o = self.o
        self.build()
        load0 = open("/proc/loadavg").read().split()[:3]
        self.say(f"machine: {os.cpu_count()} cores, load average {' '.join(load0)}; build "
                 f"{o.build_dir} ({self.build_type}); logs in {self.log_dir}")
        self.start_stack()
        self.start_agents()
        idle = None
        if o.idle > 0:  # what the agents and the broker cost when nothing is asked
            c0, t0 = self.cpu_snapshot(), time.monotonic()
            time.sleep(o.idle)
            c1 = self.cpu_snapshot()
            idle = ({k: c1[k] - c0[k] for k in c0}, time.monotonic() - t0)
        cpu0 = self.cpu_snapshot()
        go = time.time() + 1.0
        self.tell(f"go {go:.6f}")
        self.wait_lines("done", self.agents, o.duration + o.timeout + 120)
        t_done = time.time()
        cpu1 = self.cpu_snapshot()
        self.tell("stop")
        results = [json.loads(x) for x in self.wait_lines("result", self.agents, 60)]
        load1 = open("/proc/loadavg").read().split()[:3]
        for p in self.agents:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.report(results, go, t_done, cpu0, cpu1, load0, load1, idle)

    # ---- figures --------------------------------------------------------------------------
    def load_times(self):
        rows = {"lib": [], "outcomes": []}
        for i, p in enumerate(self.agents):
            path = os.path.join(self.work, f"agent-{i}.times")
            with open(path) as f:
                for line in f:
                    x = line.split()
                    rows[p.role].append({"intent": x[0], "sent": int(x[1]), "arrival": int(x[2]),
                                         "consumed": int(x[3]), "produced_ms": int(x[4]),
                                         "lat": float(x[5]), "lag": float(x[6]), "status": x[7]})
            if self.o.log_dir:
                shutil.copy(path, self.log_dir)
        return rows

    def parts(self, rows, label):
        """Per intent, with the ledger's clock readings: in (publish -> intake transaction),
        ledger (-> recorded CONFIRMED), relay (-> the relay's produce, the Kafka timestamp),
        kafka (-> the agent's consumer had it), handoff (-> the call returned). p50/p99 of
        each, and second by second."""
        ok = [r for r in rows if r["status"] == "CONFIRMED" and r["intent"] != "-"]
        if not ok:
            return None
        path = os.path.join(self.work, f"{label}.join")
        with open(path, "w") as f:
            for r in ok:
                f.write(f"{r['intent']} {r['sent']} {r['arrival']} {r['consumed']} "
                        f"{r['produced_ms']}\n")
        cols = """extract(epoch FROM e.created_at) * 1000 - t.sent_ns / 1e6 AS kin,
                  extract(epoch FROM v.occurred_at - e.created_at) * 1000 AS ledger,
                  CASE WHEN t.produced_ms > 0 THEN t.produced_ms
                       - extract(epoch FROM v.occurred_at) * 1000 END AS relay,
                  CASE WHEN t.produced_ms > 0 AND t.consumed_ns > 0
                       THEN t.consumed_ns / 1e6 - t.produced_ms END AS kafka,
                  CASE WHEN t.consumed_ns > 0 THEN (t.arrival_ns - t.consumed_ns) / 1e6 END
                       AS handoff,
                  (t.arrival_ns - t.sent_ns) / 1e6 AS total"""
        q = ", ".join(f"round(percentile_cont({p}) WITHIN GROUP (ORDER BY {c})::numeric, 2)"
                      for c in ("kin", "ledger", "relay", "kafka", "handoff")
                      for p in (0.5, 0.99))
        out = self.psql(f"""
CREATE TEMP TABLE t (intent_id text, sent_ns bigint, arrival_ns bigint, consumed_ns bigint,
                     produced_ms bigint);
\\copy t FROM '{path}' WITH (DELIMITER ' ')
CREATE TEMP TABLE x AS
SELECT (t.sent_ns - min(t.sent_ns) OVER ()) / 1000000000 AS second, {cols}
FROM t JOIN effects e ON e.intent_id = t.intent_id
JOIN events v ON v.effect_id = e.effect_id
WHERE v.kind = 'transition' AND v.to_status = 'CONFIRMED';
SELECT count(*), {q} FROM x;
SELECT 'sec', second, count(*),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY total)::numeric, 1),
       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY total)::numeric, 1),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY kin)::numeric, 1),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ledger)::numeric, 1),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY relay)::numeric, 1),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY kafka)::numeric, 1),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY handoff)::numeric, 1)
FROM x GROUP BY second ORDER BY second;
""")
        lines = out.strip().splitlines()
        if not lines:
            return None
        head = lines[0].split(" ")
        by_second = ["second intents p50_ms p99_ms in_p50 ledger_p50 relay_p50 kafka_p50 "
                     "handoff_p50"] + [" ".join(l.split(" ")[1:]) for l in lines[1:]
                                       if l.startswith("sec ")]
        with open(os.path.join(self.log_dir, f"{label}_by_second.txt"), "w") as f:
            f.write("\n".join(by_second) + "\n")
        return head, by_second

    def report(self, results, go, t_done, cpu0, cpu1, load0, load1, idle):
        o = self.o
        rows = self.load_times()
        res = {"lib": [r for r in results if r["role"] == "lib"],
               "outcomes": [r for r in results if r["role"] == "outcomes"]}

        def amplification(rs):
            read = sum(r["stats"]["messages_read"] for r in rs)
            ans = sum(r["stats"]["answers"] for r in rs)
            per = [r["stats"]["messages_read"] / r["stats"]["answers"]
                   for r in rs if r["stats"]["answers"]]
            return read, ans, (read / ans if ans else float("nan")), per

        all_rows = rows["lib"] + rows["outcomes"]
        sent = sum(r["sent"] for r in results)
        first = min((r["sent"] for r in all_rows), default=0)
        last_sent = max((r["sent"] for r in all_rows), default=0)
        confirmed = [r for r in all_rows if r["status"] == "CONFIRMED"]
        last_arrival = max((r["arrival"] for r in confirmed), default=first)
        publish_rate = (len(all_rows) - 1) / ((last_sent - first) / 1e9) if last_sent > first \
            else 0.0
        answer_rate = len(confirmed) / ((last_arrival - first) / 1e9) if last_arrival > first \
            else 0.0
        lags = sorted(r["lag"] for r in all_rows)

        print()
        print(f"bench: agents.date = {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain"],
                               capture_output=True, text=True).stdout.strip()
        print(f"bench: agents.commit = {commit}{'+dirty' if dirty else ''}")
        print(f"bench: agents.build = {self.build_type}")
        print(f"bench: agents.machine = {os.cpu_count()} cores, load average "
              f"{' '.join(load0)} at start, {' '.join(load1)} at end")
        nlib, nout = len(res["lib"]), len(res["outcomes"])
        print(f"bench: agents.processes = {o.agents} ({nlib} on tally_client, {o.api} API; "
              f"{nout} reading every partition of {self.prefix}outcomes), "
              f"{o.dispatchers} dispatcher(s)")
        fw = o.agent_fetch_wait_ms if o.agent_fetch_wait_ms is not None else "10 (library default)"
        print(f"bench: agents.settings = {o.rate:g} intents/s asked for {o.duration:g} s, "
              f"{o.rate / o.agents:g}/s per agent, tool {TOOL}; agents' fetch.wait.max.ms {fw}, "
              f"dispatchers' {o.fetch_wait_ms}")
        print(f"bench: agents.intents = {len(confirmed)} of {sent} CONFIRMED "
              f"({len(all_rows) - len(confirmed)} other: "
              f"{', '.join(sorted(set(r['status'] for r in all_rows) - {'CONFIRMED'})) or 'none'})")
        print(f"bench: agents.publish_rate = {publish_rate:.1f} intents/s (first to last "
              f"publish; pacing lag p50 {pct(lags, 50):.2f} ms, p99 {pct(lags, 99):.2f} ms, "
              f"max {lags[-1] if lags else float('nan'):.1f} ms)")
        print(f"bench: agents.answer_rate = {answer_rate:.1f} answers/s (CONFIRMED, first "
              f"publish to last answer)")

        if res["lib"]:
            read, ans, amp, per = amplification(res["lib"])
            st = {k: sum(r["stats"].get(k, 0) for r in res["lib"])
                  for k in ("duplicates", "late", "foreign", "unreadable")}
            print(f"bench: agents.read_amplification = {amp:.3f} messages/answer "
                  f"(tally_client: {read} messages read on {nlib} reply topics, {ans} answers; "
                  f"per process {min(per):.3f}-{max(per):.3f}; duplicates {st['duplicates']}, "
                  f"late {st['late']}, foreign {st['foreign']}, unreadable {st['unreadable']}; "
                  f"target <= 1.1)")
        if res["outcomes"]:
            read, ans, amp, per = amplification(res["outcomes"])
            print(f"bench: agents.outcomes_read_amplification = {amp:.1f} messages/answer "
                  f"(today's way: {read} messages read from every partition of "
                  f"{self.prefix}outcomes by {nout} process(es), {ans} own answers; "
                  f"{o.agents} processes publish)")

        for role, name in (("lib", "lib"), ("outcomes", "outcomes")):
            rs = rows[role]
            if not rs:
                continue
            lat = sorted(r["lat"] for r in rs if r["status"] == "CONFIRMED")
            if not lat:
                continue
            first_r = min(r["sent"] for r in rs)
            last_r = max(r["sent"] for r in rs)
            rate = (len(rs) - 1) / ((last_r - first_r) / 1e9) if last_r > first_r else 0.0
            what = ("publish -> run.call() returned CONFIRMED" if role == "lib"
                    else "publish -> its CONFIRMED read from outcomes")
            print(f"bench: agents.{name}_latency_count = {len(lat)} calls at {rate:.1f} "
                  f"intents/s ({what})")
            tgt = " (target <= 10)" if role == "lib" else ""
            print(f"bench: agents.{name}_latency_p50 = {pct(lat, 50):.2f} ms{tgt}")
            tgt = " (target <= 50)" if role == "lib" else ""
            print(f"bench: agents.{name}_latency_p99 = {pct(lat, 99):.2f} ms{tgt}")
            print(f"bench: agents.{name}_latency_max = {lat[-1]:.2f} ms")
            pr = self.parts(rs, f"{name}_latency")
            if pr:
                h, by_second = pr
                v = [x if x != "" else "?" for x in h]
                print(f"bench: agents.{name}_latency_parts = {v[0]} intents: in p50 {v[1]} / "
                      f"p99 {v[2]} ms, ledger {v[3]} / {v[4]} ms, relay {v[5]} / {v[6]} ms, "
                      f"kafka {v[7]} / {v[8]} ms, handoff {v[9]} / {v[10]} ms (publish -> "
                      f"intake transaction -> recorded -> relay's produce -> agent's consumer "
                      f"-> returned)")
                if len(by_second) > 2:
                    s1 = by_second[1].split()
                    s2 = by_second[-1].split()
                    print(f"bench: agents.{name}_latency_drift = p50 {s1[2]} ms in second "
                          f"{s1[0]}, {s2[2]} ms in second {s2[0]} (by second: "
                          f"{name}_latency_by_second.txt with --log-dir)")
        threads = {}
        for r in res["lib"]:
            for k, v in r.get("threads", {}).items():
                threads[k] = threads.get(k, 0.0) + v
        if threads:
            top = sorted(threads.items(), key=lambda kv: -kv[1])[:8]
            print("bench: agents.lib_cpu_by_thread = " + ", ".join(f"{k} {v:.1f} s"
                                                                   for k, v in top)
                  + f" (the {nlib} library agents over their whole life, warm-up included)")
        cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
        window = t_done - go
        print("bench: agents.cpu = " + ", ".join(f"{k} {v:.1f} s" for k, v in cpu.items())
              + f" over {window:.1f} s (of {window * (os.cpu_count() or 1):.0f} core-seconds)")
        if idle is not None:
            c, secs = idle
            print("bench: agents.idle_cpu = " + ", ".join(f"{k} {v:.2f} s" for k, v in c.items())
                  + f" over {secs:.1f} s before the run, every agent connected and idle "
                  f"(cores: agents {c['agents'] / secs:.2f}, kafka-mock "
                  f"{c['kafka-mock'] / secs:.2f})")


def parse(argv):
    ap = argparse.ArgumentParser(
        prog="bench/agents.sh",
        description="N agent processes through tally: read amplification and latency of the "
                    "Python client beside today's reading of <prefix>outcomes "
                    "(bench/README.md, Issue 21).")
    ap.add_argument("--agents", type=int, default=50, help="agent processes (default 50)")
    ap.add_argument("--rate", type=float, default=1000, help="intents/s in total (default 1000)")
    ap.add_argument("--duration", type=float, default=20, help="seconds (default 20)")
    ap.add_argument("--outcomes-agents", type=int, default=1,
                    help="of the agents, how many read <prefix>outcomes the old way instead of "
                         "using the library (default 1; 0: none; --agents: all)")
    ap.add_argument("--dispatchers", type=int, default=1, help="tally-dispatcher processes")
    ap.add_argument("--api", choices=("asyncio", "threads"), default="asyncio",
                    help="the library's asyncio API (default) or the blocking one on a pool")
    ap.add_argument("--threads", type=int, default=32,
                    help="with --api threads: the pool's threads per agent (default 32)")
    ap.add_argument("--runs-per-agent", type=int, default=2,
                    help="runs each agent spreads its calls over (default 2: 100 runs in all)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per agent first")
    ap.add_argument("--timeout", type=float, default=60, help="per call (s)")
    ap.add_argument("--fetch-wait-ms", type=int, default=1,
                    help="the dispatchers' fetch.wait.max.ms (TALLY_KAFKA_FETCH_WAIT_MAX_MS, "
                         "default 1 as bench/run.sh)")
    ap.add_argument("--agent-fetch-wait-ms", type=int, default=None,
                    help="the agents' consumers' fetch.wait.max.ms (default: the library's, "
                         "10; passed to tally_client as config=)")
    ap.add_argument("--idle", type=float, default=5,
                    help="seconds the agents sit idle before the run, to measure what they and "
                         "the broker cost doing nothing (default 5; 0 skips)")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="run the first agent's main thread under cProfile, stats to FILE")
    ap.add_argument("--start-batch", type=int, default=10,
                    help="agents started at a time (each waits for its warm-up)")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--log-dir", default=None,
                    help="keep every process's log and the per-intent times here")
    # the agent processes' own arguments
    ap.add_argument("--role", choices=("lib", "outcomes"), help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--brokers", help=argparse.SUPPRESS)
    ap.add_argument("--topic-prefix", default="tally.", help=argparse.SUPPRESS)
    ap.add_argument("--nonce", default="x", help=argparse.SUPPRESS)
    ap.add_argument("--times-file", help=argparse.SUPPRESS)
    o = ap.parse_args(argv)
    if o.agents < 1 or o.rate <= 0 or o.duration <= 0 or not 0 <= o.outcomes_agents <= o.agents:
        ap.error("--agents >= 1, --rate > 0, --duration > 0, 0 <= --outcomes-agents <= --agents")
    o.build_dir = os.path.abspath(o.build_dir)
    if o.log_dir:
        o.log_dir = os.path.abspath(o.log_dir)
    return o


def main(argv=None):
    o = parse(sys.argv[1:] if argv is None else argv)
    if o.role:
        agent_main(o)
        return 0
    d = Driver(o)
    failed = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        d.run()
        failed = False
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        d.teardown(failed)


if __name__ == "__main__":
    sys.exit(main())
