#!/usr/bin/python3
"""An example agent: it publishes intents to tally and reads the outcomes, as a real agent
would, and tells the story of tally's demo (scripts/demo.sh) while it does.

What a real agent takes from this file (docs/agents.md walks through it):
  - an intent is a CloudEvent (structured JSON) on <prefix>intents with the run id as the
    Kafka key, so one run stays in order;
  - the answer is the tally.effect.*.v1 event on <prefix>outcomes whose data.intent_id is the
    intent's CloudEvents id; an UNKNOWN answer is followed later by the final one for the same
    effect (data.effect_id) once the reconciler has asked the tool;
  - arguments that make up the operation key come from the agent's own plan (payment id,
    message id), never from the clock, so a retried intent is the same effect (a replay)
    and a changed one with the same key is a CONFLICT.

The demo parts (arming faults on the fake tool service, running `tally summary`) are clearly
marked: a real agent has no control API over its tools.

Needs Debian's python3-confluent-kafka. Environment: TALLY_KAFKA_BROKERS, TALLY_TOPIC_PREFIX
(default "tally."), TALLY_FAKE_TOOL_URL (the fake tool service), and for the `tally` steps
whatever the CLI needs (TALLY_PG). Exit status: 0 when every scenario ended as expected,
1 when one did not (the reason is printed), 2 on a usage error.
"""

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

try:
    from confluent_kafka import OFFSET_END, Consumer, KafkaException, Producer, TopicPartition
except ImportError:  # pragma: no cover - a message instead of a traceback
    sys.stderr.write("agent.py: python3-confluent-kafka is missing (apt-get install "
                     "python3-confluent-kafka; run with Debian's /usr/bin/python3)\n")
    sys.exit(2)

SOURCE = "/agents/demo-agent"


class DemoFailed(Exception):
    """A scenario did not end as the story says; the message says what did not happen."""


# ---- output -----------------------------------------------------------------------------


class Out:
    """Readable lines; colour only when stdout is a terminal (and NO_COLOR is unset)."""

    def __init__(self, colour):
        self.colour = colour

    def _c(self, code, text):
        return f"\033[{code}m{text}\033[0m" if self.colour else text

    def bold(self, t):
        return self._c("1", t)

    def dim(self, t):
        return self._c("2", t)

    def green(self, t):
        return self._c("32", t)

    def yellow(self, t):
        return self._c("33", t)

    def red(self, t):
        return self._c("31", t)

    def cyan(self, t):
        return self._c("36", t)

    def line(self, text="", indent=3):
        print(" " * indent + text if text else "", flush=True)

    def heading(self, n, title, run_id):
        print(flush=True)
        print(self.bold(f"{n}. {title}") + self.dim(f"   run {run_id}"), flush=True)

    def note(self, text):
        self.line(self.dim(text))

    def block(self, text, indent=6):
        for ln in text.rstrip("\n").splitlines():
            print(" " * indent + ln, flush=True)


# ---- the tool service's control API (demo only) ------------------------------------------


class FakeTool:
    """tally-fake-tool's control API: arm faults, read the tool's own records. A real tool
    has no such thing; the demo uses it to make the tool misbehave on cue."""

    def __init__(self, url):
        self.url = url.rstrip("/")

    def _call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise DemoFailed(f"the fake tool service answered {method} {path} with {e.code}: "
                             f"{e.read().decode(errors='replace')}") from None
        except OSError as e:
            raise DemoFailed(f"cannot reach the fake tool service at {self.url}: {e}") from None
        return json.loads(raw) if raw else None

    def arm(self, collection, fault, op="execute", key="*", times=1, **extra):
        rule = {"collection": collection, "op": op, "key": key, "fault": fault, "times": times}
        rule.update(extra)
        return self._call("POST", "/_control/faults", rule)

    def clear(self):
        self._call("DELETE", "/_control/faults")

    def records(self, collection):
        return self._call("GET", f"/_control/records?collection={collection}")

    def requests(self):
        return self._call("GET", "/_control/requests")


# ---- the agent's side of tally ----------------------------------------------------------


def traceparent(trace_id):
    """A W3C traceparent for one step of a run: the run's trace, a new span."""
    return f"00-{trace_id}-{secrets.token_hex(8)}-01"


class Tally:
    """Publishing intents and reading what tally says back.

    One consumer reads <prefix>outcomes, <prefix>obligations and <prefix>alerts. It is
    assigned every partition from the current end (the high watermark, fetched before the
    first intent is published), outside any consumer group: a demo agent wants only the
    answers to what it publishes from now on, and joining a group would cost a rebalance.
    An agent service that must survive restarts would use a consumer group and commit its
    offsets instead. Every event is kept, deduplicated on its CloudEvents id (delivery is at
    least once), so a wait can find an answer that arrived while it was waiting for another.
    """

    def __init__(self, brokers, prefix):
        self.prefix = prefix
        self.producer = Producer({"bootstrap.servers": brokers, "enable.idempotence": True,
                                  "linger.ms": 0})
        self.consumer = Consumer({"bootstrap.servers": brokers,
                                  "group.id": "demo-agent-" + uuid.uuid4().hex[:8],
                                  "enable.auto.commit": False,
                                  "enable.partition.eof": False})
        parts = []
        for logical in ("outcomes", "obligations", "alerts"):
            topic = prefix + logical
            md = self.consumer.list_topics(topic=topic, timeout=10)
            tmd = md.topics.get(topic)
            if tmd is None or tmd.error is not None or not tmd.partitions:
                raise DemoFailed(f"topic {topic} is not available: "
                                 f"{tmd.error if tmd is not None else 'missing'}")
            for p in tmd.partitions:
                tp = TopicPartition(topic, p)
                _, high = self.consumer.get_watermark_offsets(tp, timeout=10, cached=False)
                parts.append(TopicPartition(topic, p, high if high >= 0 else OFFSET_END))
        self.consumer.assign(parts)
        self.seen = set()
        self.events = {"outcomes": [], "obligations": [], "alerts": []}

    def close(self):
        self.producer.flush(5)
        self.consumer.close()

    # -- publishing

    def _produce(self, event):
        errors = []
        self.producer.produce(
            self.prefix + "intents", key=event["data"]["run_id"].encode(),
            value=json.dumps(event).encode(),
            headers={"content-type": "application/cloudevents+json"},
            on_delivery=lambda err, msg: errors.append(err) if err else None)
        left = self.producer.flush(10)
        if left or errors:
            raise DemoFailed(f"Kafka did not take the event {event['id']}: "
                             f"{errors[0] if errors else 'no delivery report within 10 s'}")
        return event["id"]

    def publish_intent(self, run_id, step, tool, args, trace_id, operation_key=None):
        """A tally.intent.v1; returns its id (what the answer names as data.intent_id)."""
        data = {"run_id": run_id, "step": step, "tool": tool, "args": args,
                "traceparent": traceparent(trace_id)}
        if operation_key is not None:
            data["operation_key"] = operation_key
        return self._produce({
            "specversion": "1.0", "id": str(uuid.uuid4()), "source": SOURCE,
            "type": "tally.intent.v1", "time": now_rfc3339(),
            "datacontenttype": "application/json", "subject": run_id, "data": data})

    def compensate_run(self, run_id, reason):
        """tally.compensate_run.v1: undo what the run did, last step first."""
        return self._produce({
            "specversion": "1.0", "id": str(uuid.uuid4()), "source": SOURCE,
            "type": "tally.compensate_run.v1", "time": now_rfc3339(),
            "datacontenttype": "application/json", "subject": run_id,
            "data": {"run_id": run_id, "reason": reason}})

    # -- reading

    def _poll(self, seconds):
        msg = self.consumer.poll(seconds)
        if msg is None:
            return
        if msg.error():
            if msg.error().fatal():
                raise DemoFailed(f"Kafka consumer: {msg.error()}")
            return
        try:
            ev = json.loads(msg.value())
        except ValueError:
            return  # not ours to judge; a real agent would log it
        if not isinstance(ev, dict) or ev.get("id") in self.seen:
            return  # at-least-once delivery: the same event again
        self.seen.add(ev.get("id"))
        logical = msg.topic()[len(self.prefix):]
        self.events.setdefault(logical, []).append(ev)

    def wait(self, logical, match, timeout, what):
        """The first event of <prefix><logical> for which match(event) is true."""
        deadline = time.monotonic() + timeout
        checked = 0
        while True:
            evs = self.events[logical]
            for ev in evs[checked:]:
                if match(ev):
                    return ev
            checked = len(evs)
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoFailed(f"no {what} on {self.prefix}{logical} within {timeout:g} s")
            self._poll(min(0.2, left))

    def answer(self, intent_id, timeout):
        """The effect event that answers intent `intent_id`."""
        return self.wait("outcomes", lambda ev: ev.get("type", "").startswith("tally.effect.")
                         and data(ev).get("intent_id") == intent_id, timeout,
                         f"answer to intent {intent_id}")

    def settled(self, effect_id, timeout, what):
        """The next effect event of `effect_id` that is no longer UNKNOWN."""
        return self.wait("outcomes", lambda ev: ev.get("type", "").startswith("tally.effect.")
                         and data(ev).get("effect_id") == effect_id
                         and kind(ev) not in ("UNKNOWN", "DISPATCHING", "PLANNED"),
                         timeout, what)


def data(ev):
    d = ev.get("data")
    return d if isinstance(d, dict) else {}


def kind(ev):
    """What an effect event says, from its CloudEvents type: tally.effect.<kind>.v1 ->
    CONFIRMED, FAILED, UNKNOWN, DUPLICATE, CONFLICT, REJECTED, AWAITING_APPROVAL, STUCK,
    COMPENSATED. Agents switch on the type; data.status is the effect's ledger state."""
    parts = str(ev.get("type", "")).split(".")
    if len(parts) == 4 and parts[0] == "tally" and parts[1] == "effect":
        return parts[2].upper()
    return str(data(ev).get("status", "?"))


def now_rfc3339():
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


# ---- the story --------------------------------------------------------------------------


class Demo:
    def __init__(self, opts, out):
        self.opts = opts
        self.out = out
        self.timeout = opts.timeout
        self.fake = FakeTool(opts.fake_url)
        self.tally = Tally(opts.brokers, opts.topic_prefix)
        self.prefix = opts.run_prefix
        self.tenant = "t1"

    # -- helpers

    def run_id(self, name):
        return f"{self.prefix}-{name}"

    def step(self, run_id, step, tool, args, trace_id, expect=("CONFIRMED",), label=None):
        """Publish one intent, wait for its answer, print it. Returns the answer's data with
        "kind" added: what the answer says, from its type (CONFIRMED, UNKNOWN, CONFLICT...)."""
        shown = label or ", ".join(f"{k}={v}" for k, v in args.items())
        self.out.line(f"{self.out.cyan('→')} step {step} {self.out.bold(tool)} "
                      + self.out.dim(shown))
        t0 = time.monotonic()
        iid = self.tally.publish_intent(run_id, step, tool, args, trace_id)
        ev = self.tally.answer(iid, self.timeout)
        d = dict(data(ev), kind=kind(ev))
        self.print_answer(d, time.monotonic() - t0)
        if d["kind"] not in expect:
            raise DemoFailed(f"step {step} ({tool}) answered {d['kind']}, "
                             f"expected {' or '.join(expect)}: {json.dumps(d.get('error'))}")
        return d

    def print_answer(self, d, seconds=None):
        st = d.get("kind") or d.get("status")
        took = f"  {seconds * 1000:.0f} ms" if seconds is not None else ""
        err = d.get("error") or {}
        why = self.out.dim(f"{err.get('code', '')}: {err.get('message', '')}{took}")
        if st == "CONFIRMED":
            ref = d.get("external_ref") or "(no ref)"
            extra = "  replayed: the same effect, the tool was not called" if d.get("replay") \
                else f"  attempt {d.get('attempts')}"
            self.out.line(f"  {self.out.green('✓ CONFIRMED')}  receipt {self.out.bold(ref)}"
                          + self.out.dim(extra + took), indent=3)
        elif st in ("UNKNOWN", "AWAITING_APPROVAL"):
            self.out.line(f"  {self.out.yellow('? ' + st)}  " + why, indent=3)
        elif st == "DUPLICATE":
            self.out.line(f"  {self.out.yellow('⚠ DUPLICATE')}  " + why, indent=3)
        else:  # FAILED, CONFLICT, REJECTED, STUCK
            self.out.line(f"  {self.out.red('✗ ' + st)}  " + why, indent=3)

    def cli(self, *args, ok=(0,)):
        """Run a `tally` verb and show its output, as an operator would see it."""
        shown = " ".join(a if a and all(c.isalnum() or c in "-_.:/=@" for c in a)
                         else "'" + a.replace("'", "'\\''") + "'" for a in args)
        self.out.line(self.out.dim("$ ") + self.out.bold("tally " + shown))
        try:
            p = subprocess.run([self.opts.tally, *args], capture_output=True, text=True,
                               timeout=60)
        except FileNotFoundError:
            raise DemoFailed(f"cannot run {self.opts.tally} (pass --tally PATH)") from None
        except subprocess.TimeoutExpired:
            raise DemoFailed(f"tally {shown} did not finish within 60 s") from None
        text = (p.stdout or "") + (p.stderr or "")
        self.out.block(text if text.strip() else "(no output)")
        if p.returncode not in ok:
            raise DemoFailed(f"tally {shown} exited with {p.returncode}")
        return p

    def wait_records(self, collection, key, pred, what):
        """Poll the tool's own records until pred(records of key) holds."""
        deadline = time.monotonic() + self.timeout
        while True:
            recs = [r for r in self.fake.records(collection)["records"]
                    if r.get("idempotency_key") == key]
            if pred(recs):
                return recs
            if time.monotonic() > deadline:
                raise DemoFailed(f"{what} did not happen within {self.timeout:g} s "
                                 f"(the tool's records for {key}: {json.dumps(recs)})")
            time.sleep(0.2)

    def execute_requests(self, collection, key):
        return [r for r in self.fake.requests()
                if r.get("op") == "execute" and r.get("collection") == collection
                and r.get("idempotency_key") == key]

    # -- 1. a run that succeeds, then a replay and a conflict

    def scenario_success(self):
        run = self.run_id("checkout")
        self.out.heading(1, "A run that succeeds", run)
        trace = secrets.token_hex(16)
        pay = f"pay-{self.prefix}-1"
        charge = {"tenant_id": self.tenant, "payment_id": pay, "amount": 1200, "currency": "EUR"}
        self.step(run, 1, "check_balance", {"request_id": f"bal-{self.prefix}-1",
                                            "account": "acct-42"}, trace)
        first = self.step(run, 2, "charge_card", charge, trace)
        self.step(run, 3, "send_email", {"message_id": f"msg-{self.prefix}-1",
                                         "to": "alice@example.com", "template": "receipt"}, trace)
        self.step(run, 4, "create_hold", {"hold_id": f"hold-{self.prefix}-1", "amount": 300},
                  trace)
        self.out.note("Every effect is in the ledger with the tool's receipt.")

        self.out.line()
        self.out.line("The agent restarts and sends step 2 again (same arguments, new event id):")
        d = self.step(run, 2, "charge_card", charge, trace)
        if d.get("effect_id") != first.get("effect_id") or \
                d.get("external_ref") != first.get("external_ref"):
            raise DemoFailed("the retried step 2 was not answered with the first effect")
        calls = self.execute_requests("charges", first["operation_key"])
        self.out.note(f"Same operation key {first['operation_key']}, same effect "
                      f"{first['effect_id'][:8]}…: the tool saw {len(calls)} charge request.")
        if len(calls) != 1:
            raise DemoFailed(f"the tool saw {len(calls)} charge requests for one intent")

        self.out.line()
        self.out.line("A buggy retry changes the amount under the same payment id:")
        self.step(run, 2, "charge_card", dict(charge, amount=9900), trace, expect=("CONFLICT",))
        self.out.note("Same key, different arguments: refused and recorded, nothing called.")

    # -- 2. a timeout resolved by the reconciler

    def scenario_timeout(self):
        run = self.run_id("timeout")
        self.out.heading(2, "A timeout resolved by the reconciler", run)
        trace = secrets.token_hex(16)
        charge = {"tenant_id": self.tenant, "payment_id": f"pay-{self.prefix}-2",
                  "amount": 4500, "currency": "EUR"}
        key = f"charge_card:{self.tenant}:{charge['payment_id']}"
        self.fake.arm("charges", "apply_then_hang", key=key, delay_ms=6000)
        self.out.note(f"[fake tool] the next charge for {key} is applied, then the answer "
                      "hangs for 6 s (tally gives up after 2 s)")
        d = self.step(run, 1, "charge_card", charge, trace, expect=("UNKNOWN", "CONFIRMED"))
        if d["kind"] == "UNKNOWN":
            self.out.note("Nobody knows whether the card was charged. tally does not retry a "
                          "reversible call blindly;")
            self.out.note(f"the reconciler asks the tool: GET /charges?idempotency_key={key}")
            ev = self.tally.settled(d["effect_id"], self.timeout, "resolution of the UNKNOWN charge")
            final = dict(data(ev), kind=kind(ev))
            self.print_answer(final)
            if final["kind"] != "CONFIRMED":
                raise DemoFailed(f"the UNKNOWN charge ended {final['kind']}, not CONFIRMED")
        calls = self.execute_requests("charges", key)
        recs = self.fake.records("charges")["records"]
        n = len([r for r in recs if r.get("idempotency_key") == key])
        self.out.note(f"The tool was called once: {len(calls)} charge request, {n} record, "
                      "found by the status check.")
        if len(calls) != 1 or n != 1:
            raise DemoFailed(f"expected 1 charge request and 1 record, got {len(calls)} and {n}")

    # -- 3. a duplicate detected and reversed

    def arm_duplicate(self, key):
        """Make the hold service apply `key` twice and lose its answer (a 500): an upstream
        retry bug that created a second hold, which nobody saw."""
        self.fake.arm("holds", "apply_twice", key=key, status=500)
        return "applies the hold twice (an upstream retry bug), then answers 500"

    def scenario_duplicate(self):
        run = self.run_id("duplicate")
        self.out.heading(3, "A duplicate detected and reversed", run)
        trace = secrets.token_hex(16)
        args = {"hold_id": f"hold-{self.prefix}-3", "amount": 700}
        key = f"create_hold:{args['hold_id']}"
        how = self.arm_duplicate(key)
        self.out.note(f"[fake tool] the hold service {how}")
        # UNKNOWN first; the reconciler's verdict may overtake it when two workers' relays
        # publish at the same moment, so any of the three is a fine first answer.
        d = self.step(run, 1, "create_hold", args, trace,
                      expect=("UNKNOWN", "DUPLICATE", "CONFIRMED"))
        self.out.note(f"The reconciler asks GET /holds?idempotency_key={key} and finds two "
                      "records.")
        dup = self.tally.wait(
            "outcomes", lambda ev: data(ev).get("effect_id") == d["effect_id"]
            and kind(ev) == "DUPLICATE", self.timeout, "DUPLICATE event for the hold")
        dd = data(dup)
        self.out.line(f"  {self.out.yellow('⚠ DUPLICATE')}  " + self.out.dim(
            f"kept {dd.get('external_ref')} as the receipt; "
            f"the extra record is to be reversed"), indent=3)
        ob = self.tally.wait("obligations", lambda ev: data(ev).get("effect_id") == d["effect_id"],
                             self.timeout, "obligation for the extra hold")
        od = data(ob)
        self.out.line(f"  {self.out.cyan('→')} obligation {od.get('obligation_id')} "
                      + self.out.dim(f"({od.get('reason')}): reverse {od.get('external_ref')}"),
                      indent=3)
        recs = self.wait_records("holds", key, lambda rs: len(rs) >= 2 and any(
            r.get("status") == "reversed" for r in rs), "the reversal of the extra hold")
        self.out.line(f"  {self.out.green('✓ reversed')} by the compensator. "
                      "The hold service's own records:", indent=3)
        for r in recs:
            state = (self.out.green("active   (kept: the receipt)") if r["status"] == "active"
                     else self.out.yellow(f"reversed (by {r.get('reversed_by')})"))
            self.out.line(f"{r['id']:<12} {state}", indent=8)
        kept = [r for r in recs if r["status"] == "active"]
        if len(kept) != 1 or len(recs) != 2:
            raise DemoFailed(f"expected one hold kept and one reversed: {json.dumps(recs)}")
        self.fake.clear()

    # -- 4. a failed run, compensated

    def scenario_failed_run(self):
        run = self.run_id("refund")
        self.out.heading(4, "A failed run, compensated", run)
        trace = secrets.token_hex(16)
        p = self.prefix
        self.step(run, 1, "check_balance", {"request_id": f"bal-{p}-4", "account": "acct-7"},
                  trace)
        self.step(run, 2, "charge_card", {"tenant_id": self.tenant, "payment_id": f"pay-{p}-4",
                                          "amount": 2500, "currency": "EUR"}, trace)
        self.step(run, 3, "send_email", {"message_id": f"msg-{p}-4", "to": "bob@example.com",
                                         "template": "order_confirmed"}, trace)
        hold = {"hold_id": f"hold-{p}-4", "amount": 2500}
        self.fake.arm("holds", "error_4xx", key=f"create_hold:{hold['hold_id']}", status=422)
        self.out.note("[fake tool] the hold service will refuse this hold with 422")
        self.step(run, 4, "create_hold", hold, trace, expect=("FAILED",))
        self.out.line()
        self.out.line("The run cannot finish, so the agent asks tally to undo it "
                      f"({self.out.bold('tally.compensate_run.v1')}):")
        self.tally.compensate_run(run, "hold refused: undo the order")
        self.out.note("The compensator works last step first: nothing to undo for the failed "
                      "hold, the email cannot be unsent,")
        self.out.note("the charge is refunded, the balance check was a read.")
        ev = self.tally.wait("outcomes", lambda e: e.get("type", "").startswith("tally.run.")
                             and data(e).get("run_id") == run, self.timeout,
                             "run compensation summary (tally.run.*.v1)")
        st = data(ev).get("status")
        mark = self.out.green("✓") if st in ("COMPENSATED", "PARTIALLY_COMPENSATED") \
            else self.out.red("✗")
        self.out.line(f"  {mark} run {self.out.bold(st)}  " + self.out.dim(ev.get("type")),
                      indent=3)
        self.fake.clear()
        self.cli("summary", "--run", run)
        if st != "PARTIALLY_COMPENSATED":
            raise DemoFailed(f"run {run} ended {st}, expected PARTIALLY_COMPENSATED "
                             "(the email cannot be undone)")

    # -- 5. a reverse that fails, goes STUCK, pages, and is resolved by hand

    def scenario_stuck(self):
        run = self.run_id("stuck")
        self.out.heading(5, "A reverse that fails, goes STUCK, and pages a human", run)
        trace = secrets.token_hex(16)
        self.step(run, 1, "charge_card", {"tenant_id": self.tenant,
                                          "payment_id": f"pay-{self.prefix}-5",
                                          "amount": 8000, "currency": "EUR"}, trace)
        self.fake.arm("charges", "reverse_500", op="reverse", times=-1)
        self.out.note("[fake tool] from now on every refund fails with 500")
        self.out.line("The agent asks tally to undo the run:")
        self.tally.compensate_run(run, "customer cancelled")
        self.out.note("The compensator retries the refund with the same reverse key, with "
                      "backoff, until its attempts run out…")
        alert = self.tally.wait(
            "alerts", lambda e: e.get("type") == "tally.alert.trigger.v1"
            and data(e).get("run_id") == run, self.timeout, "alert for the STUCK refund")
        a = data(alert)
        self.out.line(f"  {self.out.red('! PAGE')} [{a.get('severity')}] "
                      + self.out.bold(str(a.get("summary"))), indent=3)
        self.out.line(self.out.dim(f"dedup key {a.get('dedup_key')}, reason {a.get('reason')}"),
                      indent=8)
        if a.get("runbook"):
            self.out.line(self.out.dim(f"runbook   {a.get('runbook')}"), indent=8)
        self.out.line(self.out.dim("to resolve:"), indent=8)
        self.out.block(str(a.get("resolve_command")), indent=10)
        obligation = a.get("obligation_id")
        if not obligation:
            raise DemoFailed(f"the alert names no obligation: {json.dumps(a)}")
        self.fake.clear()
        self.out.line()
        self.out.line("The on-call engineer refunds the charge in the billing console, then "
                      "tells tally:")
        self.cli("resolve", "--obligation", obligation, "--as", "resolved",
                 "--reason", "refunded by hand", "--actor", "demo")
        self.tally.wait("alerts", lambda e: e.get("type") == "tally.alert.resolve.v1"
                        and data(e).get("dedup_key") == a.get("dedup_key"), self.timeout,
                        "resolve event for the alert")
        self.out.line(f"  {self.out.green('✓ alert resolved')}  " + self.out.dim(
            "tally.alert.resolve.v1 sent with the same dedup key; the pager closes the page"),
            indent=3)
        ev = self.tally.wait(
            "outcomes", lambda e: e.get("type") == "tally.run.compensated.v1"
            and data(e).get("run_id") == run, self.timeout,
            "run summary after the resolution (tally.run.compensated.v1)")
        st = data(ev).get("status")
        self.out.line(f"  {self.out.green('✓')} run {self.out.bold(st)}  " + self.out.dim(
            "the compensator settled the run with the operator's resolution in its summary"),
            indent=3)
        if st not in ("COMPENSATED", "PARTIALLY_COMPENSATED"):
            raise DemoFailed(f"run {run} ended {st} after the resolution")

    def run(self, which):
        scenarios = {1: self.scenario_success, 2: self.scenario_timeout,
                     3: self.scenario_duplicate, 4: self.scenario_failed_run,
                     5: self.scenario_stuck}
        for n in which:
            scenarios[n]()


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="tally's example agent: publishes intents, reads outcomes, tells the "
                    "demo's story.")
    ap.add_argument("--brokers", default=os.environ.get("TALLY_KAFKA_BROKERS"),
                    help="Kafka bootstrap servers (default $TALLY_KAFKA_BROKERS)")
    ap.add_argument("--topic-prefix", default=os.environ.get("TALLY_TOPIC_PREFIX") or "tally.",
                    help="topic prefix (default $TALLY_TOPIC_PREFIX or tally.)")
    ap.add_argument("--fake-url", default=os.environ.get("TALLY_FAKE_TOOL_URL"),
                    help="the fake tool service (default $TALLY_FAKE_TOOL_URL)")
    ap.add_argument("--tally", default="tally", help="the tally command (default: tally)")
    ap.add_argument("--run-prefix", default="demo-" + secrets.token_hex(2),
                    help="prefix of every run id and business id (default demo-<random>)")
    ap.add_argument("--scenarios", default="1,2,3,4,5",
                    help="which parts of the story to tell, e.g. 1,2 (default all)")
    ap.add_argument("--timeout", type=float, default=45.0,
                    help="longest wait for any one answer, in seconds (default 45)")
    ap.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    o = ap.parse_args(argv)
    if not o.brokers:
        ap.error("no Kafka brokers: set TALLY_KAFKA_BROKERS or pass --brokers")
    if not o.fake_url:
        ap.error("no tool service: set TALLY_FAKE_TOOL_URL or pass --fake-url")
    try:
        o.which = sorted({int(s) for s in o.scenarios.split(",") if s.strip()})
    except ValueError:
        ap.error(f"--scenarios: '{o.scenarios}' is not a list of numbers")
    if not o.which or any(n not in range(1, 6) for n in o.which):
        ap.error("--scenarios takes numbers from 1 to 5")
    return o


def main(argv=None):
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    colour = opts.color == "always" or (opts.color == "auto" and sys.stdout.isatty()
                                        and not os.environ.get("NO_COLOR"))
    out = Out(colour)
    out.line(out.bold("The example agent") + out.dim(
        f"  Kafka {opts.brokers}, topics {opts.topic_prefix}*, tool service {opts.fake_url}"),
        indent=0)
    demo = None
    try:
        demo = Demo(opts, out)
        demo.run(opts.which)
    except DemoFailed as e:
        print(flush=True)
        out.line(out.red("✗ the demo stopped: ") + str(e), indent=0)
        return 1
    except KafkaException as e:
        out.line(out.red("✗ Kafka: ") + str(e), indent=0)
        return 1
    except KeyboardInterrupt:
        out.line(out.red("✗ interrupted"), indent=0)
        return 130
    finally:
        if demo is not None:
            try:
                demo.fake.clear()
            except DemoFailed:
                pass
            demo.tally.close()
    print(flush=True)
    out.line(out.green("✓ the agent's story is told"), indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
