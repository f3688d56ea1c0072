#!/usr/bin/python3
"""An example agent on tally's Python client (clients/python, `tally_client`), and the narrator
of tally's demo (scripts/demo.sh).

What a real agent takes from this file (docs/agents.md walks through it):
  - one `Tally` per process; `tally.run(run_id)` per task; each tool call is one line,
    `run.call(step, tool, args)`, which returns the final answer (the library waits through
    UNKNOWN while the reconciler asks the tool) or raises what went wrong: EffectFailed,
    EffectConflict, IntentRefused (tally refused the intent itself, at once), OutcomeTimeout;
  - the arguments that make up the operation key come from the agent's own plan (payment id,
    message id), never from the clock, so a retried call is the same effect (a replay) and a
    changed one under the same key is a CONFLICT;
  - a run ends with `run.complete()` (its summary) or `run.compensate(reason)` (undo it, last
    step first); after complete(), tally refuses new intents for it (run_not_active).

The demo parts are marked [demo] or [operator]: arming faults on the fake tool service and
reading its records (a real agent has no control API over its tools), and running `tally`
verbs as an on-call engineer would.

Needs Debian's python3-confluent-kafka (the library's only dependency); the library is
imported from clients/python/src of this repository. Environment: TALLY_KAFKA_BROKERS,
TALLY_TOPIC_PREFIX (default "tally."), TALLY_FAKE_TOOL_URL (the fake tool service), and for
the `tally` steps whatever the CLI needs (TALLY_PG). Exit status: 0 when every scenario ended
as expected, 1 when one did not (the reason is printed), 2 on a usage error (or when the
library or its dependency is missing).
"""

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request

CLIENT_SRC = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                           "..", "clients", "python", "src"))
sys.path.insert(0, CLIENT_SRC)
try:
    from tally_client import (EffectConflict, EffectFailed, IntentRefused, Tally, TallyError)
except ImportError as e:  # pragma: no cover - a message instead of a traceback
    if e.name == "confluent_kafka":
        sys.stderr.write("agent.py: python3-confluent-kafka is missing (apt-get install "
                         "python3-confluent-kafka; run with Debian's /usr/bin/python3)\n")
    else:
        sys.stderr.write(f"agent.py: cannot import tally_client from {CLIENT_SRC} ({e}); "
                         "it is clients/python/src of the tally repository\n")
    sys.exit(2)


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

    def records(self, collection, key):
        """The tool's own records created under idempotency key `key`."""
        recs = self._call("GET", f"/_control/records?collection={collection}")["records"]
        return [r for r in recs if r.get("idempotency_key") == key]

    def executions(self, collection, key):
        """The execute requests the tool received for `key`."""
        return [r for r in self._call("GET", "/_control/requests")
                if r.get("op") == "execute" and r.get("collection") == collection
                and r.get("idempotency_key") == key]


# ---- the story --------------------------------------------------------------------------


class Expected:
    """What Demo.expect caught: `error`, the library's exception."""

    error = None


class Demo:
    """The story. The agent's own code is the `run.*` calls in each scenario; the rest prints
    what they answer ([demo] and [operator] lines are not an agent's business)."""

    def __init__(self, opts, out):
        self.opts = opts
        self.out = out
        self.timeout = opts.timeout
        self.fake = FakeTool(opts.fake_url)
        self.prefix = opts.run_prefix
        self.tenant = "t1"
        self.t0 = time.monotonic()
        # One client per process: its own reply topic brings it the answers to its messages.
        self.tally = Tally(opts.brokers, "demo-agent", topic_prefix=opts.topic_prefix)

    def close(self):
        self.tally.close()

    # -- printing what the library answers

    def step(self, step, tool, args):
        """Say which call the agent makes next, and start its clock."""
        shown = ", ".join(f"{k}={v}" for k, v in args.items())
        self.out.line(f"{self.out.cyan('→')} step {step} {self.out.bold(tool)}  "
                      + self.out.dim(shown))
        self.t0 = time.monotonic()

    def took(self):
        return f"  {(time.monotonic() - self.t0) * 1000:.0f} ms"

    def answer_line(self, o, last=True):
        """One answer of a call (an Outcome), as a line; `last` adds the time the call took."""
        took = self.took() if last else ""
        err = o.error or {}
        why = f"{err.get('code')}: {err.get('message')}" if err else ""
        receipt = f"  receipt {self.out.bold(str(o.external_ref))}"
        if o.status == "CONFIRMED":
            extra = "  replayed: the same effect, the tool was not called" if o.replay \
                else f"  attempt {o.attempts}"
            text = self.out.green("✓ CONFIRMED") + receipt + self.out.dim(extra + took)
        elif o.status == "DUPLICATE":
            text = (self.out.yellow("⚠ DUPLICATE") + receipt
                    + self.out.dim(f"  {why or 'applied more than once upstream'}{took}"))
        elif o.status in ("UNKNOWN", "AWAITING_APPROVAL", "STUCK", "PLANNED", "DISPATCHING"):
            text = self.out.yellow("? " + o.status) + "  " + self.out.dim(why + took)
        elif o.status == "REFUSED":
            fld = (o.event.get("data") or {}).get("field")
            text = (self.out.red("✗ REFUSED") + f"  {err.get('code')}"
                    + (f" ({fld})" if fld else "") + self.out.dim(f": {err.get('message')}{took}"))
        else:  # FAILED, CONFLICT, REJECTED, CANCELLED
            text = self.out.red("✗ " + o.status) + "  " + self.out.dim(why + took)
        self.out.line("  " + text)

    def show(self, o):
        """Print a call's answers (the history: e.g. UNKNOWN, then the final CONFIRMED) and
        return the final one."""
        for earlier in o.history[:-1]:
            self.answer_line(earlier, last=False)
        self.answer_line(o)
        return o

    @contextlib.contextmanager
    def expect(self, error_class):
        """The block's call must raise `error_class` (printed, then swallowed); any other
        outcome stops the story."""
        caught = Expected()
        try:
            yield caught
        except error_class as e:
            caught.error = e
            if e.outcome is not None:
                self.show(e.outcome)
            else:
                self.out.line("  " + self.out.red("✗ " + type(e).__name__) + "  " + str(e))
            return
        raise DemoFailed(f"the call returned instead of raising {error_class.__name__}")

    def show_run(self, s):
        """Print a RunSummary (tally.run.*.v1)."""
        mark = {"COMPLETED": self.out.green("✓"), "COMPENSATED": self.out.green("✓"),
                "PARTIALLY_COMPENSATED": self.out.green("✓")}.get(s.status, self.out.red("✗"))
        if s.status == "COMPLETED":
            by_status = sorted((s.summary.get("effects") or {}).items())
            effects = ", ".join(f"{n} {st}" for st, n in by_status)
            waiting = s.summary.get("open_count") or "none"
            detail = f"{s.summary.get('total')} effects ({effects}), {waiting} waiting for a human"
        else:
            counts = ((len(s.compensated), "reversed"),
                      (len(s.uncompensatable), "cannot be undone"),
                      (len(s.skipped), "skipped"), (len(s.failed), "failed"))
            detail = ", ".join(f"{n} {what}" for n, what in counts if n)
        self.out.line(f"  {mark} run {self.out.bold(str(s.status))}  {detail}"
                      + self.out.dim(f"  {s.type}{self.took()}"))

    # -- [operator] the tally command, as an on-call engineer runs it

    def cli(self, *args, ok=(0,), quiet=False):
        """Run a `tally` verb and show its output (unless quiet)."""
        shown = " ".join(a if a and all(c.isalnum() or c in "-_.:/=@" for c in a)
                         else "'" + a.replace("'", "'\\''") + "'" for a in args)
        if not quiet:
            self.out.line(self.out.dim("[operator] $ ") + self.out.bold("tally " + shown))
        try:
            p = subprocess.run([self.opts.tally, *args], capture_output=True, text=True,
                               timeout=60)
        except FileNotFoundError:
            raise DemoFailed(f"cannot run {self.opts.tally} (pass --tally PATH)") from None
        except subprocess.TimeoutExpired:
            raise DemoFailed(f"tally {shown} did not finish within 60 s") from None
        if not quiet:
            text = (p.stdout or "") + (p.stderr or "")
            self.out.block(text if text.strip() else "(no output)")
        if p.returncode not in ok:
            raise DemoFailed(f"tally {shown} exited with {p.returncode}: {p.stderr.strip()}")
        return p

    def until(self, what, probe):
        """Poll probe() until it returns something true; return that."""
        deadline = time.monotonic() + self.timeout
        while True:
            got = probe()
            if got:
                return got
            if time.monotonic() > deadline:
                raise DemoFailed(f"{what} did not happen within {self.timeout:g} s")
            time.sleep(0.2)

    # -- 1. a run that succeeds, a replay, a conflict, a refusal, and the run completed

    def scenario_success(self):
        run_id = f"{self.prefix}-checkout"
        self.out.heading(1, "A run that succeeds, and is completed", run_id)
        run = self.tally.run(run_id)
        t, p = self.timeout, self.prefix
        balance = {"request_id": f"bal-{p}-1", "account": "acct-42"}
        charge = {"tenant_id": self.tenant, "payment_id": f"pay-{p}-1", "amount": 1200,
                  "currency": "EUR"}
        email = {"message_id": f"msg-{p}-1", "to": "alice@example.com", "template": "receipt"}
        hold = {"hold_id": f"hold-{p}-1", "amount": 300}

        self.step(1, "check_balance", balance)
        self.show(run.call(1, "check_balance", balance, timeout=t))
        self.step(2, "charge_card", charge)
        first = self.show(run.call(2, "charge_card", charge, timeout=t))
        self.step(3, "send_email", email)
        self.show(run.call(3, "send_email", email, timeout=t))
        self.step(4, "create_hold", hold)
        self.show(run.call(4, "create_hold", hold, timeout=t))
        self.out.note("Every effect is in the ledger with the tool's receipt.")

        self.out.line()
        self.out.line("The agent restarts and makes step 2 again (same arguments):")
        self.step(2, "charge_card", charge)
        again = self.show(run.call(2, "charge_card", charge, timeout=t))
        if not again.replay or again.effect_id != first.effect_id \
                or again.external_ref != first.external_ref:
            raise DemoFailed("the retried step 2 was not answered with the first effect")
        calls = self.fake.executions("charges", first.operation_key)
        self.out.note(f"[demo] Same operation key {first.operation_key}, same effect "
                      f"{first.effect_id[:8]}…: the tool saw {len(calls)} charge request.")
        if len(calls) != 1:
            raise DemoFailed(f"the tool saw {len(calls)} charge requests for one intent")

        self.out.line()
        self.out.line("A buggy retry changes the amount under the same payment id:")
        changed = dict(charge, amount=9900)
        self.step(2, "charge_card", changed)
        with self.expect(EffectConflict):
            run.call(2, "charge_card", changed, timeout=t)
        self.out.note("Same key, different arguments: refused and recorded, nothing called.")

        self.out.line()
        self.out.line("The model asks for a tool that is not in the registry:")
        sms = {"to": "+15550100", "text": "Your order is on its way"}
        self.step(5, "send_sms", sms)
        with self.expect(IntentRefused) as refused:
            run.call(5, "send_sms", sms, timeout=t)
        if refused.error.reason != "unknown_tool":
            raise DemoFailed(f"the intent for send_sms was refused with {refused.error.reason}, "
                             "expected unknown_tool")
        self.out.note("tally refused the intent itself (tally.intent.rejected.v1): the agent "
                      "knows at once, instead of waiting out a timeout.")

        self.out.line()
        self.out.line("The agent is done and completes the run "
                      f"({self.out.bold('run.complete()')}):")
        self.t0 = time.monotonic()
        done = run.complete(timeout=t)
        self.show_run(done)
        if done.status != "COMPLETED" or done.summary.get("total") != 4:
            raise DemoFailed(f"run {run_id} completed as {done.status} with "
                             f"{json.dumps(done.summary)}, expected COMPLETED with 4 effects")
        late = {"message_id": f"msg-{p}-1b", "to": "alice@example.com", "template": "survey"}
        self.out.line("A late worker of the agent still sends one more step:")
        self.step(6, "send_email", late)
        with self.expect(IntentRefused) as refused:
            run.call(6, "send_email", late, timeout=t)
        if refused.error.reason != "run_not_active":
            raise DemoFailed(f"the late intent was refused with {refused.error.reason}, "
                             "expected run_not_active")
        sent = self.fake.executions("emails", f"send_email:{late['message_id']}")
        self.out.note("[demo] The run is over: the email was not sent "
                      f"(the tool saw {len(sent) or 'no'} request for it).")
        if sent:
            raise DemoFailed("the email of the late intent was sent")

    # -- 2. a timeout resolved by the reconciler

    def scenario_timeout(self):
        run_id = f"{self.prefix}-timeout"
        self.out.heading(2, "A timeout resolved by the reconciler", run_id)
        run = self.tally.run(run_id)
        charge = {"tenant_id": self.tenant, "payment_id": f"pay-{self.prefix}-2",
                  "amount": 4500, "currency": "EUR"}
        key = f"charge_card:{self.tenant}:{charge['payment_id']}"
        self.fake.arm("charges", "apply_then_hang", key=key, delay_ms=6000)
        self.out.note(f"[demo] the next charge for {key} is applied, then its answer hangs "
                      "for 6 s (tally gives up after 2 s)")
        self.out.note("The agent makes one call and gets one final answer; the library waits "
                      "through the UNKNOWN while")
        self.out.note(f"the reconciler asks the tool: GET /charges?idempotency_key={key}")
        self.step(1, "charge_card", charge)
        o = self.show(run.call(1, "charge_card", charge, timeout=self.timeout))
        if o.status != "CONFIRMED":
            raise DemoFailed(f"the timed-out charge ended {o.status}, not CONFIRMED")
        answers = " → ".join(h.status for h in o.history)
        self.out.note(f"The answers the call saw (outcome.history): {answers}. "
                      "With first=True it would have returned the first one.")
        calls = self.fake.executions("charges", key)
        recs = self.fake.records("charges", key)
        self.out.note(f"[demo] The tool was called once: {len(calls)} charge request, "
                      f"{len(recs)} record, found by the status check.")
        if len(calls) != 1 or len(recs) != 1:
            raise DemoFailed(f"expected 1 charge request and 1 record, got {len(calls)} "
                             f"and {len(recs)}")

    # -- 3. a duplicate detected and reversed

    def scenario_duplicate(self):
        run_id = f"{self.prefix}-duplicate"
        self.out.heading(3, "A duplicate detected and reversed", run_id)
        run = self.tally.run(run_id)
        hold = {"hold_id": f"hold-{self.prefix}-3", "amount": 700}
        key = f"create_hold:{hold['hold_id']}"
        # An upstream retry bug: the hold service applies the hold twice and loses its answer.
        self.fake.arm("holds", "apply_twice", key=key, status=500)
        self.out.note("[demo] the hold service applies the next hold twice (an upstream retry "
                      "bug), then answers 500")
        self.step(1, "create_hold", hold)
        o = self.show(run.call(1, "create_hold", hold, timeout=self.timeout))
        self.out.note(f"The reconciler asked GET /holds?idempotency_key={key} and found two "
                      "records: the effect happened, with one")
        self.out.note("as its receipt, and the compensator got an obligation to reverse the "
                      "other (tally.effect.duplicate.v1).")

        def reversed_extra():
            rs = self.fake.records("holds", key)
            return rs if len(rs) >= 2 and any(r.get("status") == "reversed" for r in rs) else None
        recs = self.until("the reversal of the extra hold", reversed_extra)
        self.out.line(f"  {self.out.green('✓ reversed')} by the compensator. "
                      "[demo] The hold service's own records:")
        for r in recs:
            state = (self.out.green("active   (kept: the receipt)") if r["status"] == "active"
                     else self.out.yellow(f"reversed (by {r.get('reversed_by')})"))
            self.out.line(f"{r['id']:<12} {state}", indent=8)
        kept = [r["id"] for r in recs if r["status"] == "active"]
        if kept != [o.external_ref] or len(recs) != 2:
            raise DemoFailed(f"expected the receipt {o.external_ref} kept and one hold "
                             f"reversed: {json.dumps(recs)}")
        self.fake.clear()

    # -- 4. a failed run, compensated

    def scenario_failed_run(self):
        run_id = f"{self.prefix}-refund"
        self.out.heading(4, "A failed run, compensated", run_id)
        run = self.tally.run(run_id)
        t, p = self.timeout, self.prefix
        balance = {"request_id": f"bal-{p}-4", "account": "acct-7"}
        charge = {"tenant_id": self.tenant, "payment_id": f"pay-{p}-4", "amount": 2500,
                  "currency": "EUR"}
        email = {"message_id": f"msg-{p}-4", "to": "bob@example.com",
                 "template": "order_confirmed"}
        hold = {"hold_id": f"hold-{p}-4", "amount": 2500}

        self.step(1, "check_balance", balance)
        self.show(run.call(1, "check_balance", balance, timeout=t))
        self.step(2, "charge_card", charge)
        self.show(run.call(2, "charge_card", charge, timeout=t))
        self.step(3, "send_email", email)
        self.show(run.call(3, "send_email", email, timeout=t))
        self.fake.arm("holds", "error_4xx", key=f"create_hold:{hold['hold_id']}", status=422)
        self.out.note("[demo] the hold service will refuse this hold with 422")
        self.step(4, "create_hold", hold)
        with self.expect(EffectFailed):
            run.call(4, "create_hold", hold, timeout=t)

        self.out.line()
        self.out.line("The run cannot finish, so the agent asks tally to undo it "
                      f"({self.out.bold('run.compensate()')}):")
        self.out.note("The compensator works last step first: nothing to undo for the failed "
                      "hold, the email cannot be unsent,")
        self.out.note("the charge is refunded, the balance check was a read.")
        self.t0 = time.monotonic()
        summary = run.compensate("hold refused: undo the order", timeout=t)
        self.show_run(summary)
        self.fake.clear()
        self.cli("summary", "--run", run_id)
        if summary.status != "PARTIALLY_COMPENSATED":
            raise DemoFailed(f"run {run_id} ended {summary.status}, expected "
                             "PARTIALLY_COMPENSATED (the email cannot be undone)")

    # -- 5. a reverse that fails, goes STUCK, pages, and is resolved by hand

    def scenario_stuck(self):
        run_id = f"{self.prefix}-stuck"
        self.out.heading(5, "A reverse that fails, goes STUCK, and pages a human", run_id)
        run = self.tally.run(run_id)
        charge = {"tenant_id": self.tenant, "payment_id": f"pay-{self.prefix}-5",
                  "amount": 8000, "currency": "EUR"}
        self.step(1, "charge_card", charge)
        self.show(run.call(1, "charge_card", charge, timeout=self.timeout))
        self.fake.arm("charges", "reverse_500", op="reverse", times=-1)
        self.out.note("[demo] from now on every refund fails with 500")
        self.out.line("The agent asks tally to undo the run "
                      f"({self.out.bold('run.compensate()')}):")
        self.out.note("The compensator retries the refund with the same reverse key, with "
                      "backoff, until its attempts run out…")
        self.t0 = time.monotonic()
        summary = run.compensate("customer cancelled", timeout=self.timeout)
        self.show_run(summary)
        if summary.status != "STUCK" or not summary.failed:
            raise DemoFailed(f"run {run_id} ended {summary.status}, expected STUCK")
        item = summary.failed[0]
        err = item.get("error") or {}
        self.out.line(self.out.dim(f"step {item.get('step')} {item.get('tool')}: "
                                   f"{err.get('code')}: {err.get('message')}"), indent=8)
        obligation = item.get("obligation_id")
        if not obligation:
            raise DemoFailed(f"the STUCK summary names no obligation: {json.dumps(item)}")
        self.out.note("tally stops here instead of guessing, and pages a human "
                      "(tally.alert.trigger.v1 on the alerts topic).")

        self.out.line()
        self.out.line("The on-call engineer is paged and looks at what needs a human:")
        self.cli("status", ok=(2,))  # 2: something is STUCK
        self.fake.clear()
        self.out.line("They refund the charge in the billing console, then tell tally:")
        self.cli("resolve", "--obligation", obligation, "--as", "resolved",
                 "--reason", "refunded by hand", "--actor", "demo")

        def settled():
            doc = json.loads(self.cli("doctor", "--run", run_id, "--json", quiet=True).stdout)
            status = (doc.get("run") or {}).get("status")
            alerts = [a.get("status") for a in doc.get("alerts") or []]
            if status in ("COMPENSATED", "PARTIALLY_COMPENSATED") and alerts \
                    and all(a == "RESOLVED" for a in alerts):
                return status
            return None
        status = self.until(f"the settlement of run {run_id} after the resolution", settled)
        self.out.line(f"  {self.out.green('✓')} run {self.out.bold(status)}, page resolved  "
                      + self.out.dim("(tally doctor --run): the compensator settled the run "
                                     "with the operator's resolution in its summary"))

    def run(self, which):
        scenarios = {1: self.scenario_success, 2: self.scenario_timeout,
                     3: self.scenario_duplicate, 4: self.scenario_failed_run,
                     5: self.scenario_stuck}
        for n in which:
            scenarios[n]()


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description="tally's example agent on the tally_client library: makes tool calls "
                    "through tally and tells the demo's story.")
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
    if o.timeout <= 0:
        ap.error("--timeout must be more than 0 seconds")
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
        out.line(out.dim(f"tally_client: answers come back on {demo.tally.reply_topic}"),
                 indent=0)
        demo.run(opts.which)
    except DemoFailed as e:
        print(flush=True)
        out.line(out.red("✗ the demo stopped: ") + str(e), indent=0)
        return 1
    except TallyError as e:  # an answer the story did not expect, or Kafka trouble
        print(flush=True)
        out.line(out.red(f"✗ the demo stopped: {type(e).__name__}: ") + str(e), indent=0)
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
            demo.close()
    print(flush=True)
    out.line(out.green("✓ the agent's story is told"), indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
