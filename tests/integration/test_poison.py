"""The poison test (issue 20): random and crafted hostile intents, interleaved with good ones,
against the real dispatcher, reconciler and compensator (separate processes, ASan/UBSan in the
sanitizer build), a real PostgreSQL, the embedded Kafka and tally-fake-tool over TCP.

Hostile inputs: every limit of schemas/README.md at and over its byte count, with multi-byte
characters ending exactly at the limit (accepted) and straddling it (refused); control
characters in every field that becomes a header or an index key; numbers that would silently
become 0.0; unknown tools; reasons of compensate_run/cancel_run at 4096 and 4097 bytes; writes
PostgreSQL refuses (a test trigger raises 22021, 54000 and 23514 for marked rows, the three
classes of refusal retrying cannot fix); and hostile answers from the tool (the fake's
huge_id, etag_version, receipt_not_utf8 and receipt_not_json faults, tests/fakes/README.md):
ids of 512, 513 and 10240 bytes, versions of 64, 256, 257 and 10240 bytes, receipts that are
not UTF-8 or not JSON. Plus events that would be larger than 900000 bytes (a receipt, a DLQ
record, a run summary), and runs whose ids put a multi-byte character across byte 80 or 200
and whose obligation goes STUCK.

Afterwards: every good intent has its final answer on <prefix>outcomes, every hostile message
its record on <prefix>dlq with the right reason (matched by partition and offset), every
worker is alive and ready, nothing is STUCK but what should be (and that is paged), the
outboxes are empty, the dispatcher's group committed every offset, every message on every
topic is UTF-8 JSON of at most 900000 bytes, and the ledger invariants hold.

Each case is reported by name with its input and what was seen; the test fails once, at the
end, listing every case that failed. The schedule is drawn from a seeded generator:
TALLY_POISON_SEED picks another one; the seed and the command that replays it are printed
first. TALLY_POISON_RANDOM sets how many random intents of each kind (good, hostile) are
drawn (default 40)."""

import json
import os
import random
import re
import sys
import time

from confluent_kafka import Consumer, TopicPartition

from dispatchcase import SECRET, main
from invariants import check_invariants, fake_vs_ledger
from tallytest import BUILD_DIR, SOURCE_DIR, wait_for
from test_compensate_flow import CompensateCase
from test_dispatch_runs import run_message

SEED = int(os.environ.get("TALLY_POISON_SEED", "20261120"))
N_RANDOM = int(os.environ.get("TALLY_POISON_RANDOM", "40"))
SETTLE_S = float(os.environ.get("TALLY_POISON_SETTLE_SECONDS", "40"))

# schemas/README.md / common/include/tally/text.h, in bytes of UTF-8
LIMIT = {"run_id": 200, "step": 100, "tool": 200, "operation_key": 500, "event_id": 200,
         "tenant": 200, "reason": 4096, "external_ref": 512, "receipt_version": 256}
EVENT_MAX = 900000

# Characters by UTF-8 width; none is a control character, a space or a quote, so a string
# made of them is a good header value too.
CHARS = {1: "aZ09-_.:", 2: "éжßΩ", 3: "€漢あ한", 4: "😀𝄞🚀𠜎"}
CONTROL = ["\r\n", "\n", "\r", "\t", "\x01", "\x1b", "\x7f", "\x0b"]
# JSON numbers that are not zero as written but read as 0.0 in a double
UNDERFLOWS = ["1e-400", "-1e-400", "2.5E-999", "1e-324", "0." + "0" * 400 + "1",
              "-0." + "0" * 350 + "7e-10"]
NUM = "@@poison-number@@"  # placeholder replaced by a raw number in the JSON text

FINAL_SKIP = {"tally.effect.unknown.v1", "tally.effect.planned.v1",
              "tally.effect.dispatching.v1", "tally.effect.compensated.v1"}
CONFIRMED = "tally.effect.confirmed.v1"
CONFLICT = "tally.effect.conflict.v1"

# The test trigger: an effect whose args carry "poison_refuse": "<SQLSTATE>" is refused by
# PostgreSQL with that SQLSTATE, as a write PostgreSQL can never accept would be.
REFUSE_SQL = """
CREATE FUNCTION poison_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE m text[];
BEGIN
    m := regexp_match(NEW.args_canonical, '"poison_refuse":"([0-9A-Z]{5})"');
    IF m IS NOT NULL THEN
        RAISE EXCEPTION 'poison test: the ledger refuses this row (SQLSTATE %)', m[1]
            USING ERRCODE = m[1];
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER poison_refuse BEFORE INSERT OR UPDATE ON effects
    FOR EACH ROW EXECUTE FUNCTION poison_refuse();
"""
REFUSALS = [("22021", "not UTF-8 (character_not_in_repertoire)"),
            ("54000", "too long for an index (program_limit_exceeded)"),
            ("23514", "a constraint (check_violation)")]


def nbytes(s):
    return len(s.encode())


def filled(rnd, n, prefix=""):
    """prefix, then random characters of 1 to 4 bytes: exactly n bytes of UTF-8."""
    out, left = [prefix], n - nbytes(prefix)  # (a prefix longer than n is kept whole)
    while left > 0:
        w = rnd.choice([w for w in (1, 2, 3, 4) if w <= left])
        out.append(rnd.choice(CHARS[w]))
        left -= w
    return "".join(out)


def ending_with(rnd, n, w, prefix=""):
    """Exactly n bytes whose last character is w bytes wide (it ends AT the limit n)."""
    return filled(rnd, n - w, prefix) + rnd.choice(CHARS[w])


def straddling(rnd, limit, w, k, prefix=""):
    """A w-byte character starting k bytes before `limit` (0 < k < w): it crosses the limit,
    and the string is limit - k + w bytes long."""
    return filled(rnd, limit - k, prefix) + rnd.choice(CHARS[w])


def blob(n):
    """Exactly n bytes of text with multi-byte characters throughout."""
    unit = "poison é€😀 "
    s = unit * (n // nbytes(unit))
    return s + "x" * (n - nbytes(s))


def show(v, n=24):
    """A short picture of an input: its size in bytes and its first and last characters."""
    size = len(v) if isinstance(v, bytes) else None
    if isinstance(v, bytes):
        v = v.decode(errors="backslashreplace")
    if not isinstance(v, str):
        return repr(v)[:120]
    size = nbytes(v) if size is None else size
    if len(v) <= 2 * n:
        return f"{size} bytes {v!r}"
    return f"{size} bytes {v[:n]!r}...{v[-n:]!r}"


def cut(s, n=400):
    s = str(s)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} chars)"


def put_field(ce, field, s):
    """Set one field of an update_ledger intent: a data member, the CloudEvents id, or the
    argument its key is derived from."""
    if field == "event_id":
        ce["id"] = s
    elif field == "derived_key":
        ce["data"]["args"]["entry_id"] = s
    else:
        ce["data"][field] = s


class Msg:
    """One message the test produces, and where Kafka put it."""

    def __init__(self, name, value, key, what, ce_id=None):
        self.name, self.value, self.key, self.what, self.ce_id = name, value, key, what, ce_id
        self.partition = self.offset = self.error = None


class Good(Msg):
    """An intent that must get its final answer (`want`, a CloudEvents type)."""

    def __init__(self, name, ce, what, want=CONFIRMED, ensure_ascii=False):
        super().__init__(name, json.dumps(ce, ensure_ascii=ensure_ascii).encode(),
                         str(ce["data"]["run_id"]).encode(), what, ce["id"])
        self.ce, self.want = ce, want


class Hostile(Msg):
    """A message that must be dead-lettered with one of `reasons`."""

    def __init__(self, name, value, key, what, reasons, ce_id=None, detail_has=None, run=None):
        super().__init__(name, value, key, what, ce_id)
        self.reasons = set(reasons)
        self.detail_has = detail_has
        self.run = run  # a run-level message: its run must stay untouched


class PoisonTest(CompensateCase):

    # --- building the messages -----------------------------------------------------------

    def ce(self, run_id, step, tool, args, ce_id=None, **data):
        ev = self.intent(run_id, step, tool, args, **data)
        if ce_id is not None:
            ev["id"] = ce_id
        return ev

    def uniq(self, prefix="p"):
        self._n += 1
        return f"{prefix}{self._n}-"

    def ledger_intent(self, run, step, **data):
        """An update_ledger intent with its own entry id (and so its own key)."""
        return self.ce(run, step, "update_ledger", {"entry_id": self.uniq("e") + "x",
                                                    "amount": 1}, **data)

    def raw_intent(self, ce):
        return json.dumps(ce, ensure_ascii=False).encode()

    def build_boundaries(self, rnd):
        """Every intent-field limit: exactly at it with the last character 1..4 bytes wide
        (accepted), and one to three bytes over it, ASCII or with a character straddling it
        (refused)."""
        goods, hostiles = [], []
        derived_room = LIMIT["operation_key"] - nbytes("update_ledger:")

        def make(field, s):
            """An intent whose `field` is s (all else ordinary)."""
            run = self.uniq("b") + "run"
            if field == "run_id":
                return self.ledger_intent(s, 1)
            if field == "step":
                return self.ledger_intent(run, s)
            if field == "operation_key":
                return self.ledger_intent(run, 1, operation_key=s)
            if field == "derived_key":
                return self.ce(run, 1, "update_ledger", {"entry_id": s, "amount": 2})
            if field == "event_id":
                return self.ledger_intent(run, 1, ce_id=s)
            if field == "tenant":
                return self.ledger_intent(run, 1, tenant=s)
            if field == "tool":
                return self.ce(run, 1, s, {"entry_id": self.uniq("t")})
            raise AssertionError(field)

        fields = [("run_id", LIMIT["run_id"]), ("step", LIMIT["step"]),
                  ("operation_key", LIMIT["operation_key"]), ("derived_key", derived_room),
                  ("event_id", LIMIT["event_id"]), ("tenant", LIMIT["tenant"]),
                  ("tool", LIMIT["tool"])]
        for field, limit in fields:
            label = "operation_key (derived from args.entry_id)" if field == "derived_key" \
                else field
            shown_limit = LIMIT["operation_key"] if field == "derived_key" else limit
            for w in (1, 2, 3, 4):
                s = ending_with(rnd, limit, w, self.uniq("at"))
                ce = make(field, s)
                what = f"{label} of exactly {shown_limit} bytes, last character {w} bytes: " \
                       f"{show(s)}"
                if field == "tool":  # at the limit, but no such tool
                    hostiles.append(Hostile(f"tool-at-limit-w{w}", self.raw_intent(ce),
                                            str(ce["data"]["run_id"]).encode(), what,
                                            {"unknown_tool"}, ce["id"]))
                else:
                    goods.append(Good(f"{field}-at-limit-w{w}", ce, what,
                                      ensure_ascii=bool(w % 2)))
            overs = [(1, 1)] + [(w, k) for w in (2, 3, 4) for k in range(1, w)]
            for w, k in overs:
                if w == 1:
                    s = self.uniq("o")
                    s += "x" * (limit + 1 - nbytes(s))
                    name = f"{field}-over-by-1-ascii"
                else:
                    s = straddling(rnd, limit, w, k, self.uniq("st"))
                    name = f"{field}-straddles-w{w}-k{k}"
                ce = make(field, s)
                reasons = {"invalid_field"}
                if field == "tool":
                    # over the limit AND not a tool: either reason names a refusal
                    reasons = {"invalid_field", "unknown_tool"}
                what = f"{label} of {nbytes(s)} bytes (limit {shown_limit}), " + \
                       ("all ASCII" if w == 1 else
                        f"a {w}-byte character starting {k} byte(s) before the limit") + \
                       f": {show(s)}"
                hostiles.append(Hostile(name, json.dumps(ce, ensure_ascii=bool(k % 2)).encode(),
                                        str(ce["data"]["run_id"]).encode(), what, reasons,
                                        ce["id"] if field != "event_id" else None))
        return goods, hostiles

    def build_crafted(self, rnd):
        """Control characters, numbers that underflow, unknown tools, shapes, big messages."""
        goods, hostiles = [], []

        def hostile(name, ce, what, reasons, raw=None):
            value = raw if raw is not None else self.raw_intent(ce)
            hostiles.append(Hostile(name, value, str(ce["data"].get("run_id")).encode(), what,
                                    reasons, ce.get("id")))

        for i, c in enumerate(CONTROL):
            run = self.uniq("c") + "run"
            hostile(f"explicit-key-control-{i}",
                    self.ledger_intent(run, 1, operation_key=f"k{i}{c}X-Injected: 1"),
                    f"data.operation_key with {c!r}", {"invalid_field"})
            hostile(f"derived-key-control-{i}",
                    self.ce(run, 2, "update_ledger", {"entry_id": f"e{i}{c}X-Injected: 1"}),
                    f"args.entry_id (the derived operation key) with {c!r}", {"invalid_field"})
        for field in ("run_id", "step", "tenant", "tool"):
            c = rnd.choice(CONTROL)
            run = self.uniq("cf") + "run"
            v = f"ctl{c}{field}"
            ce = {"run_id": lambda: self.ledger_intent(v, 1),
                  "step": lambda: self.ledger_intent(run, v),
                  "tenant": lambda: self.ledger_intent(run, 1, tenant=v),
                  "tool": lambda: self.ce(run, 1, v, {"entry_id": "x"})}[field]()
            hostile(f"{field}-control", ce, f"data.{field} = {v!r}", {"invalid_field"})
        # U+0000 cannot reach tally as text: jansson refuses the escape
        hostile("derived-key-nul", self.ce(self.uniq("n") + "run", 1, "update_ledger",
                                           {"entry_id": "a\u0000b"}),
                "args.entry_id with \\u0000", {"not_json", "invalid_field"})
        for i, num in enumerate(UNDERFLOWS):
            ce = self.ce(self.uniq("u") + "run", 1, "update_ledger",
                         {"entry_id": self.uniq("u"), "nested": [1, {"v": NUM}]})
            raw = self.raw_intent(ce).replace(json.dumps(NUM).encode(), num.encode())
            hostile(f"underflow-{i}", ce, f"args.nested[1].v = {show(num, 12)} (reads as 0.0)",
                    {"invalid_field"}, raw)
        for i, num in enumerate(["1e400", "18446744073709551616"]):
            ce = self.ce(self.uniq("big") + "run", 1, "update_ledger",
                         {"entry_id": self.uniq("big"), "v": NUM})
            raw = self.raw_intent(ce).replace(json.dumps(NUM).encode(), num.encode())
            hostile(f"number-out-of-range-{i}", ce, f"args.v = {num}",
                    {"not_json", "invalid_field"}, raw)
        # numbers at the edge that are fine: the smallest double, and zeros written as zeros
        for i, num in enumerate(["5e-324", "0e-400", "-0.0E-999", "2.2250738585072014e-308"]):
            ce = self.ce(self.uniq("edge") + "run", 1, "update_ledger",
                         {"entry_id": self.uniq("edge"), "v": NUM})
            good = Good(f"number-edge-{i}", ce, f"args.v = {num} (not an underflow)")
            good.value = good.value.replace(json.dumps(NUM).encode(), num.encode())
            goods.append(good)
        hostile("unknown-tool-emoji", self.ce(self.uniq("ut") + "run", 1, "launch_🚀",
                                              {"id": 1}), "data.tool = 'launch_🚀'",
                {"unknown_tool"})
        for field, value in [("run_id", ""), ("step", ""), ("operation_key", ""), ("step", -1),
                             ("run_id", 42), ("step", True), ("args", [1, 2])]:
            run = self.uniq("sh") + "run"
            ce = self.ledger_intent(run, 1)
            ce["data"][field] = value
            hostile(f"shape-{field}-{json.dumps(value)}", ce, f"data.{field} = {value!r}",
                    {"invalid_field"})
        # a DLQ record that would be over 900000 bytes: the original must be cut, on a
        # character boundary
        ce = self.ce(self.uniq("dlqbig") + "run", 1, "no_such_tool",
                     {"entry_id": "x", "pad": blob(940000)})
        hostile("dlq-record-of-a-940kB-message", ce,
                "an unknown tool with 940000 bytes of multi-byte args (its DLQ record would "
                "be over 900000 bytes)", {"unknown_tool"})
        # an answer whose receipt (the tool echoes the body) is over 900000 bytes
        goods.append(Good("effect-event-of-a-920kB-receipt",
                          self.ce(self.uniq("rbig") + "run", 1, "update_ledger",
                                  {"entry_id": self.uniq("rbig"), "pad": blob(920000)}),
                          "update_ledger with 920000 bytes of args; the fake echoes them in the "
                          "receipt, so the effect event would be over 900000 bytes"))
        return goods, hostiles

    def build_conflicts(self, rnd):
        """Answers whose sentence quotes a key or a run id with a character across a cut."""
        goods = []
        key = straddling(rnd, 150, 3, 1, self.uniq("ck")) + filled(rnd, 150)
        run = self.uniq("cr") + "run"
        a = self.ce(run, 1, "update_ledger", {"entry_id": "c1", "amount": 1}, operation_key=key)
        b = self.ce(run, 2, "update_ledger", {"entry_id": "c1", "amount": 2}, operation_key=key)
        goods.append(Good("conflict-key-first", a, f"operation_key {show(key)} (first use)"))
        goods.append(Good("conflict-key-second", b, "the same operation_key with other args",
                          want=CONFLICT))
        run = straddling(rnd, 150, 4, 2, self.uniq("cs")) + filled(rnd, 48)
        a = self.ce(run, "s1", "update_ledger", {"entry_id": self.uniq("cs"), "amount": 1})
        b = self.ce(run, "s1", "create_hold", {"hold_id": self.uniq("cs"), "amount": 1})
        goods.append(Good("conflict-step-first", a, f"run {show(run)} step s1 (first use)"))
        goods.append(Good("conflict-step-second", b,
                          "the same run and step with another tool", want=CONFLICT))
        return goods, [(goods[0], goods[1]), (goods[2], goods[3])]

    def build_refusals(self):
        """Runs of three steps whose middle one PostgreSQL refuses."""
        goods, hostiles = [], []
        for state, why in REFUSALS:
            run = self.uniq("pg") + "run"
            for step in (1, 3):
                goods.append(Good(f"ledger-refused-{state}-neighbour-{step}",
                                  self.ledger_intent(run, step),
                                  f"step {step} of run {run}, beside a refused one"))
            ce = self.ce(run, 2, "update_ledger",
                         {"entry_id": self.uniq("pg"), "poison_refuse": state})
            hostiles.append(Hostile(f"ledger-refused-{state}", self.raw_intent(ce),
                                    run.encode(),
                                    f"an intent PostgreSQL refuses with SQLSTATE {state}: {why}",
                                    {"ledger_refused"}, ce["id"], detail_has="poison test"))
        return goods, hostiles

    def build_random(self, rnd):
        goods, hostiles = [], []
        runs = [filled(rnd, rnd.randint(4, LIMIT["run_id"]), self.uniq("r"))
                for _ in range(8)]
        tools = ["update_ledger", "create_hold", "charge_card", "send_email", "check_balance"]
        for i in range(N_RANDOM):
            run = rnd.choice(runs)
            step = i if rnd.random() < 0.5 else filled(rnd, rnd.randint(4, LIMIT["step"]),
                                                       f"s{i}-")
            tool = rnd.choice(tools)
            u = filled(rnd, rnd.randint(8, 60), self.uniq("k"))
            note = filled(rnd, rnd.randint(0, 300))
            args = {"update_ledger": {"entry_id": u, "note": note},
                    "create_hold": {"hold_id": u, "amount": rnd.randint(1, 10 ** 6)},
                    "charge_card": {"tenant_id": "t1", "payment_id": u, "amount": 5,
                                    "currency": "EUR", "memo": note},
                    "send_email": {"message_id": u, "to": "a@example.com", "subject": note},
                    "check_balance": {"request_id": u}}[tool]
            data = {}
            if rnd.random() < 0.3:
                data["operation_key"] = filled(rnd, rnd.randint(8, LIMIT["operation_key"]),
                                               self.uniq("K"))
            if rnd.random() < 0.3:
                data["tenant"] = filled(rnd, rnd.randint(0, LIMIT["tenant"]))
            ce_id = filled(rnd, rnd.randint(8, LIMIT["event_id"]), self.uniq("id")) \
                if rnd.random() < 0.3 else None
            ce = self.ce(run, step, tool, args, ce_id=ce_id, **data)
            key = f"explicit {nbytes(data['operation_key'])} bytes" \
                if "operation_key" in data else "derived"
            what = (f"{tool}, run {nbytes(run)} bytes, step {show(step, 10)}, key {key}, "
                    f"event id {nbytes(ce['id'])} bytes")
            goods.append(Good(f"random-good-{i:02d}", ce, what, ensure_ascii=rnd.random() < 0.3))

        for i in range(N_RANDOM):
            kind = rnd.choice(["over", "over", "control", "underflow", "unknown_tool"])
            run = rnd.choice(runs)
            ce = self.ledger_intent(run, f"h{i}")
            raw = None
            reasons = {"invalid_field"}
            if kind == "over":
                field = rnd.choice(["run_id", "step", "operation_key", "tenant", "event_id",
                                    "derived_key"])
                limit = LIMIT.get(field, LIMIT["operation_key"] - nbytes("update_ledger:"))
                w = rnd.choice([1, 2, 3, 4])
                if w == 1:
                    s = filled(rnd, limit + rnd.randint(1, 3), self.uniq("ro"))
                else:
                    s = straddling(rnd, limit, w, rnd.randint(1, w - 1), self.uniq("rs"))
                put_field(ce, field, s)
                what = f"{field} of {nbytes(s)} bytes: {show(s)}"
            elif kind == "control":
                field = rnd.choice(["run_id", "step", "operation_key", "tenant", "tool",
                                    "derived_key"])
                base = filled(rnd, rnd.randint(2, 60), self.uniq("rc"))
                at = rnd.randint(1, len(base))
                s = base[:at] + rnd.choice(CONTROL) + base[at:]
                put_field(ce, field, s)
                what = f"{field} with a control character: {s!r}"
            elif kind == "underflow":
                num = rnd.choice(UNDERFLOWS)
                ce["data"]["args"][rnd.choice(["a", "b", "c"])] = \
                    rnd.choice([NUM, [NUM], {"deep": [0, NUM]}])
                raw = json.dumps(ce, ensure_ascii=rnd.random() < 0.5).encode() \
                    .replace(json.dumps(NUM).encode(), num.encode())
                what = f"args with the number {show(num, 12)}"
            else:
                ce["data"]["tool"] = filled(rnd, rnd.randint(4, LIMIT["tool"]), "no-")
                reasons = {"unknown_tool"}
                what = f"unknown tool {show(ce['data']['tool'])}"
            value = raw if raw is not None else \
                json.dumps(ce, ensure_ascii=rnd.random() < 0.5).encode()
            hostiles.append(Hostile(f"random-hostile-{i:02d}-{kind}", value,
                                    str(ce["data"]["run_id"]).encode(), what, reasons,
                                    ce["id"] if nbytes(ce["id"]) <= LIMIT["event_id"] else None))
        return goods, hostiles

    def build_answers(self):
        """Good intents the fake tool answers in hostile ways; rules keyed by operation key."""
        cases = []

        def add(name, tool, args, fault, what, **kw):
            run = self.uniq("ans") + "run"
            ce = self.ce(run, 1, tool, args)
            key = self.op_key(tool, args)
            self.fault(fault, key=key, collection=self.collection(tool), op="execute", **kw)
            g = Good(name, ce, what)
            g.run, g.key, g.tool, g.fault = run, key, tool, (fault, kw)
            cases.append(g)
            return g

        for size in (512, 513, 10240):
            add(f"answer-id-{size}-bytes", "charge_card",
                {"tenant_id": "t1", "payment_id": self.uniq("hid") + "x", "amount": 5,
                 "currency": "EUR"}, "huge_id",
                f"a 201 whose receipt id (receipt_ref /id) is {size} bytes, its last character"
                " two bytes wide", size=size)
        for fault, body in (("receipt_not_utf8", "JSON with bytes that are not UTF-8"),
                            ("receipt_not_json", "HTML, not JSON")):
            add(f"answer-{fault}", "create_hold", {"hold_id": self.uniq("bad") + "x",
                                                  "amount": 3}, fault,
                f"a 201 whose body is {body}")
        for size in (64, 256, 257, 10240):
            add(f"answer-version-{size}-bytes", "create_hold",
                {"hold_id": self.uniq("etag") + "x", "amount": 4}, "etag_version",
                f"a receipt whose version is an opaque {size}-byte string", size=size)
        return cases

    # --- publishing and reading ----------------------------------------------------------

    def send_all(self, msgs):
        p = self.producer()
        for m in msgs:
            def cb(err, km, m=m):
                if err:
                    m.error = str(err)
                else:
                    m.partition, m.offset = km.partition(), km.offset()
            p.produce(self.topic("intents"), value=m.value, key=m.key, on_delivery=cb)
            p.poll(0)
        p.flush(60)
        lost = [f"{m.name}: {m.error}" for m in msgs if m.offset is None]
        self.assertFalse(lost, f"Kafka did not take: {lost[:5]}")

    def drain(self):
        for t, c in self.readers.items():
            while True:
                batch = c.consume(num_messages=1000, timeout=0.05)
                if not batch:
                    break
                for m in batch:
                    if m.error():
                        continue
                    raw = m.value() or b""
                    ent = {"raw_len": len(raw), "partition": m.partition(),
                           "offset": m.offset(), "v": None}
                    try:
                        ent["v"] = json.loads(raw.decode("utf-8"))
                    except (UnicodeDecodeError, ValueError) as e:
                        ent["bad"] = f"{type(e).__name__}: {e}"
                        ent["head"] = raw[:200]
                    self.msgs[t].append(ent)

    def drain_quiet(self, quiet=1.0, most=10.0):
        """Read until no topic brings anything new for `quiet` seconds."""
        end = time.monotonic() + most
        last, seen = time.monotonic(), sum(len(v) for v in self.msgs.values())
        while time.monotonic() - last < quiet and time.monotonic() < end:
            self.drain()
            n = sum(len(v) for v in self.msgs.values())
            if n != seen:
                last, seen = time.monotonic(), n
            time.sleep(0.1)

    def outcome_index(self):
        by_intent, by_effect = {}, {}
        for ent in self.msgs["outcomes"]:
            v = ent["v"] or {}
            d = v.get("data") or {}
            if d.get("intent_id") is not None:
                by_intent.setdefault(d["intent_id"], []).append(v)
            if d.get("effect_id") is not None:
                by_effect.setdefault(d["effect_id"], []).append(v)
        return by_intent, by_effect

    def final_answer(self, intent_id, by_intent, by_effect):
        evs = by_intent.get(intent_id) or []
        if not evs:
            return None
        for ev in evs:
            if ev.get("type") not in FINAL_SKIP:
                return ev
        eid = (evs[0].get("data") or {}).get("effect_id")
        for ev in by_effect.get(eid, []):
            if ev.get("type") not in FINAL_SKIP:
                return ev
        return evs[0]

    def dlq_index(self):
        return {(ent["v"]["data"].get("partition"), ent["v"]["data"].get("offset")): ent
                for ent in self.msgs["dlq"] if ent["v"] and isinstance(ent["v"].get("data"), dict)}

    # --- results -------------------------------------------------------------------------

    def result(self, name, ok, what, expected, seen=""):
        self.results.append((name, bool(ok), what, expected, seen))

    def report(self):
        failed = [r for r in self.results if not r[1]]
        lines = [f"poison: seed {SEED}: {len(self.results)} checks, "
                 f"{len(self.results) - len(failed)} passed, {len(failed)} failed"]
        for name, ok, what, expected, seen in self.results:
            if ok:
                lines.append(f"  PASS {name}: {cut(seen, 160)}")
        for name, ok, what, expected, seen in failed:
            lines.append(f"  FAIL {name}\n       input:    {cut(what)}\n"
                         f"       expected: {cut(expected)}\n       seen:     {cut(seen, 1200)}")
        lines.append(f"poison: replay with TALLY_POISON_SEED={SEED}")
        text = "\n".join(lines)
        print(text)
        sys.stdout.flush()
        return failed, text

    # --- the test ------------------------------------------------------------------------

    def test_hostile_intents_and_answers_among_good_ones(self):
        t0 = time.monotonic()
        rnd = random.Random(SEED)
        print(f"poison: seed {SEED}; replay: TALLY_POISON_SEED={SEED} "
              f"TALLY_BUILD_DIR={BUILD_DIR} TALLY_SOURCE_DIR={SOURCE_DIR} "
              f"PYTHONPATH={SOURCE_DIR}/tests/integration /usr/bin/python3 -u "
              f"{os.path.abspath(__file__)}")
        sys.stdout.flush()
        self._n = 0
        self.results = []
        self.query(REFUSE_SQL)
        self.readers = {t: self.reader(t) for t in ("outcomes", "dlq", "alerts", "obligations")}
        self.msgs = {t: [] for t in self.readers}

        # --- phase 1: intents, good and hostile, interleaved ------------------------------
        goods, hostiles = [], []
        for g, h in (self.build_boundaries(rnd), self.build_crafted(rnd), self.build_refusals(),
                     self.build_random(rnd)):
            goods += g
            hostiles += h
        conflict_goods, ordered = self.build_conflicts(rnd)
        goods += conflict_goods
        answers = self.build_answers()
        goods += answers
        # runs compensated or cancelled in phase 2 (each with one ordinary create_hold)
        comp_runs = {}
        for name in ("comp-reason-4096", "comp-reason-straddles-200", "cancel-reason-4096",
                     "comp-reason-4097", "cancel-reason-4097"):
            run = self.uniq("cr") + name
            g = Good(f"{name}-effect", self.ce(run, 1, "create_hold",
                                              {"hold_id": self.uniq("h") + "x", "amount": 7}),
                     f"the effect of run {run}")
            goods.append(g)
            comp_runs[name] = run
        # runs whose reverse call is answered 2xx with a body that is not UTF-8 / not JSON (the
        # only reverse calls to "charges": each rule is taken by one of them)
        rev_runs = {}
        for fault in ("receipt_not_utf8", "receipt_not_json"):
            run = self.uniq("rv") + "reverse-" + fault
            goods.append(Good(f"reverse-{fault}-effect",
                              self.ce(run, 1, "charge_card",
                                      {"tenant_id": "t1", "payment_id": self.uniq("rv") + "x",
                                       "amount": 9, "currency": "EUR"}),
                              f"the charge of run {run}"))
            self.fault(fault, collection="charges", op="reverse")
            rev_runs[fault] = run
        stuck_runs = {}
        for w in (2, 3, 4):
            run = straddling(rnd, 80, w, 1, self.uniq("s80")) + filled(rnd, 40)
            stuck_runs[f"stuck-run-id-w{w}-across-byte-80"] = run
        stuck_runs["stuck-run-id-200-bytes"] = ending_with(rnd, 200, 4, self.uniq("s200"))
        for name, run in stuck_runs.items():
            goods.append(Good(f"{name}-effect",
                              self.ce(run, 1, "refund_manual", {"refund_id": self.uniq("rf")}),
                              f"refund_manual (obligations go STUCK at once) in run {show(run)}"))
        big_run = self.uniq("sum") + "big-summary"
        for step in (1, 2):
            goods.append(Good(f"big-summary-email-{step}",
                              self.ce(big_run, step, "send_email",
                                      {"message_id": self.uniq("m"), "to": "a@example.com",
                                       "subject": "big", "body": blob(330000)}),
                              "send_email with 330000 bytes of args (append-only: its blast "
                              "radius keeps args and receipt)"))

        msgs = goods + hostiles
        rnd.shuffle(msgs)
        for group in ordered:  # a conflict's first use goes first
            at = sorted(msgs.index(m) for m in group)
            for i, m in zip(at, group):
                msgs[i] = m
        print(f"poison: {len(goods)} good intents, {len(hostiles)} hostile messages, "
              f"{sum(len(m.value) for m in msgs)} bytes")
        sys.stdout.flush()

        recon = self.start("tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url,
                           BILLING_HMAC_SECRET=SECRET, TALLY_POLL_MS=200, TALLY_SWEEP_MS=200)
        comp = self.compensator()
        self.send_all(msgs)  # all of it waits in Kafka: the dispatcher's first batches are full
        disp = self.dispatcher()
        workers = {"dispatcher": disp, "reconciler": recon, "compensator": comp}
        not_ready = []

        def sample_workers():
            for name, p in workers.items():
                if not p.alive():
                    continue
                try:
                    status, body = p.http_get("/readyz", timeout=2)
                except OSError as e:
                    status, body = None, str(e)
                if status != 200:
                    not_ready.append(f"{time.monotonic() - t0:.1f} s {name}: {status} "
                                     f"{cut(body, 200)}")
            if disp.alive():
                try:
                    paused = self.metric_value(self.metrics(disp), "tally_intake_paused")
                except OSError as e:
                    paused = str(e)
                if paused != 0:
                    not_ready.append(f"{time.monotonic() - t0:.1f} s dispatcher: "
                                     f"tally_intake_paused {paused}")

        # --- phase 2: compensate and cancel, once the runs' effects are confirmed ----------
        run_goods = [g for g in goods if g.name.endswith("-effect") or
                     g.name.startswith("big-summary") or g.name.startswith("answer-version")]
        run_ids = sorted({str(g.ce["data"]["run_id"]) for g in run_goods})

        def runs_confirmed():
            self.drain()
            n = self.scalar("SELECT count(*) FROM effects WHERE run_id = ANY(%s)"
                            " AND status = 'CONFIRMED'", (run_ids,))
            return n == len(run_goods)
        try:
            wait_for(runs_confirmed, timeout=30, interval=0.3,
                     what="the effects of the runs to compensate to be CONFIRMED")
        except AssertionError as e:
            rows = self.query("SELECT run_id, step, tool, status, error_code FROM effects"
                              " WHERE run_id = ANY(%s) AND status <> 'CONFIRMED'", (run_ids,))
            self.result("phase-2-precondition", False, "the runs phase 2 compensates",
                        "every effect of them CONFIRMED within 30 s", f"{e}; {rows}")
        sample_workers()

        reason_4096 = ending_with(rnd, 4096, 4, "poison reason ")
        reason_200 = straddling(rnd, 200, 3, 1, "poison reason ") + filled(rnd, 100)
        cancel_4096 = filled(rnd, 4096, "poison cancel ")
        reason_4097 = "x" * 4095 + "é"
        run_msgs = []

        def run_msg(name, kind, run, what, hostile=False, **data):
            ce = run_message(self, kind, run, **data)
            value = json.dumps(ce, ensure_ascii=False).encode()
            if hostile:
                m = Hostile(name, value, run.encode(), what, {"invalid_field"}, ce["id"],
                            run=run)
            else:
                m = Msg(name, value, run.encode(), what, ce["id"])
            run_msgs.append(m)
            return m

        comp_msgs = {
            "comp-reason-4096": run_msg("comp-reason-4096", "compensate_run",
                                        comp_runs["comp-reason-4096"],
                                        f"compensate_run, reason {show(reason_4096)}",
                                        reason=reason_4096),
            "comp-reason-straddles-200": run_msg(
                "comp-reason-straddles-200", "compensate_run",
                comp_runs["comp-reason-straddles-200"],
                f"compensate_run, reason with a 3-byte character across byte 200: "
                f"{show(reason_200)}", reason=reason_200),
            "cancel-reason-4096": run_msg("cancel-reason-4096", "cancel_run",
                                          comp_runs["cancel-reason-4096"],
                                          f"cancel_run compensate=true, reason {show(cancel_4096)}",
                                          reason=cancel_4096, compensate=True),
        }
        run_hostiles = [
            run_msg("comp-reason-4097", "compensate_run", comp_runs["comp-reason-4097"],
                    "compensate_run, reason of 4097 bytes (a 2-byte character across 4096)",
                    hostile=True, reason=reason_4097),
            run_msg("cancel-reason-4097", "cancel_run", comp_runs["cancel-reason-4097"],
                    "cancel_run compensate=true, reason of 4097 ASCII bytes", hostile=True,
                    reason="y" * 4097, compensate=True),
        ]
        for name, run in stuck_runs.items():
            run_msg(name, "compensate_run", run, f"compensate_run of run {show(run)}")
        for fault, run in rev_runs.items():
            run_msg(f"reverse-{fault}", "compensate_run", run, f"compensate_run of run {run}")
        version_runs = {g.name: g for g in answers if g.name.startswith("answer-version")}
        for g in version_runs.values():
            run_msg(f"{g.name}-compensate", "compensate_run", g.run,
                    f"compensate_run of the run whose receipt version is "
                    f"{g.fault[1]['size']} bytes")
        run_msg("big-summary-compensate", "compensate_run", big_run,
                "compensate_run of two append-only effects with 330 kB args each (the run "
                "summary would be over 900000 bytes)")
        self.send_all(run_msgs)
        hostiles += run_hostiles

        # --- phase 3: settle ----------------------------------------------------------------
        expect_stuck_runs = set(stuck_runs.values()) | {
            g.run for g in version_runs.values()
            if g.fault[1]["size"] > LIMIT["receipt_version"]}
        settle_runs = set(stuck_runs.values()) | {g.run for g in version_runs.values()} | {
            comp_runs[n] for n in comp_msgs} | {big_run} | set(rev_runs.values())

        def pending():
            self.drain()
            by_intent, by_effect = self.outcome_index()
            dlq = self.dlq_index()
            left = []
            for g in goods:
                ev = self.final_answer(g.ce_id, by_intent, by_effect)
                if ev is None or ev.get("type") in FINAL_SKIP:
                    left.append(f"answer to {g.name}")
            for h in hostiles:
                if (h.partition, h.offset) not in dlq and not (h.ce_id is not None and self.scalar(
                        "SELECT count(*) FROM effects WHERE intent_id = %s", (h.ce_id,))):
                    left.append(f"DLQ record of {h.name}")  # (one let in will never come)
            busy = self.query("SELECT status, count(*) FROM effects WHERE status IN"
                              " ('PLANNED', 'DISPATCHING', 'UNKNOWN') GROUP BY 1")
            if busy:
                left.append(f"effects {busy}")
            busy = self.query("SELECT status, count(*) FROM obligations WHERE status IN"
                              " ('PENDING', 'RUNNING', 'AWAITING_APPROVAL') GROUP BY 1")
            if busy:
                left.append(f"obligations {busy}")
            unsettled = self.query("SELECT run_id, status FROM runs WHERE run_id = ANY(%s)"
                                   " AND (status IN ('ACTIVE', 'COMPENSATING')"
                                   " OR summary IS NULL)", (sorted(settle_runs),))
            if unsettled:
                left.append(f"{len(unsettled)} runs not summarised")
            n = self.scalar("SELECT (SELECT count(*) FROM message_outbox)"
                            " + (SELECT count(*) FROM message_refs)")
            if n:
                left.append(f"{n} rows in message_outbox and message_refs")
            if not all(p.alive() for p in workers.values()):
                return []  # nothing more will come; report what is there
            return left

        deadline = time.monotonic() + SETTLE_S
        left = pending()
        last_sample = 0.0
        while left and time.monotonic() < deadline:
            if time.monotonic() - last_sample > 1.0:
                sample_workers()
                last_sample = time.monotonic()
            time.sleep(0.3)
            left = pending()
        self.result("settled", not left, "everything above",
                    f"settled within {SETTLE_S:.0f} s of the run messages",
                    f"still waiting for: {left[:20]}{' ...' if len(left) > 20 else ''}")
        # the STUCK gauge is refreshed every few seconds
        expected_stuck = self.scalar("SELECT count(*) FROM obligations WHERE status = 'STUCK'")
        try:
            wait_for(lambda: self.metric_value(self.metrics(comp), "tally_stuck_obligations")
                     == expected_stuck, timeout=15, interval=0.5,
                     what="tally_stuck_obligations to count the STUCK obligations")
        except (AssertionError, OSError):
            pass
        # a page follows its STUCK obligation (give it a moment, not the whole deadline)
        try:
            wait_for(lambda: self.scalar(
                "SELECT count(*) FROM obligations o WHERE status = 'STUCK' AND NOT EXISTS"
                " (SELECT 1 FROM alerts a WHERE a.obligation_id = o.obligation_id)") == 0,
                timeout=5, interval=0.3, what="an alert for every STUCK obligation")
        except AssertionError:
            pass
        sample_workers()
        self.drain_quiet()
        print(f"poison: settled after {time.monotonic() - t0:.1f} s")

        # --- the verdicts ---------------------------------------------------------------------
        by_intent, by_effect = self.outcome_index()
        dlq = self.dlq_index()
        self.check_goods(goods, by_intent, by_effect)
        self.check_hostiles(hostiles, dlq)
        self.check_answers(answers, by_intent, by_effect)
        self.check_runs(comp_runs, comp_msgs, stuck_runs, version_runs, big_run, rev_runs,
                        expect_stuck_runs, comp)
        self.check_topics()
        self.check_workers(workers, not_ready)
        self.check_ledger(answers, expect_stuck_runs)
        self.check_offsets()
        self.check_shutdown(dict(workers, **{"fake-tool": self.fake}))
        sizes = [int(x) for x in re.findall(r"refused a batch of (\d+) messages", disp.log())]
        print(f"poison: note: the dispatcher's log shows PostgreSQL refusing batches of "
              f"{sizes or 'no size it names'} messages before isolating the poisoned ones")
        print(f"poison: {time.monotonic() - t0:.1f} s in all")
        failed, text = self.report()
        if failed:
            self.fail(f"{len(failed)} poison checks failed (seed {SEED}):\n" +
                      "\n".join(line for line in text.splitlines() if line.startswith(
                          ("  FAIL", "       "))))

    # --- checks --------------------------------------------------------------------------

    def check_goods(self, goods, by_intent, by_effect):
        for g in goods:
            ev = self.final_answer(g.ce_id, by_intent, by_effect)
            d = (ev or {}).get("data") or {}
            want_data = g.ce["data"]
            problems = []
            if ev is None:
                problems.append("no answer on outcomes")
            else:
                if ev.get("type") != g.want:
                    problems.append(f"type {ev.get('type')} (error {d.get('error')})")
                for field in ("run_id", "step"):
                    if d.get(field) != want_data[field]:
                        problems.append(f"data.{field} {show(d.get(field))} != the intent's "
                                        f"{show(want_data[field])}")
                if g.want == CONFIRMED and "operation_key" in want_data and \
                        d.get("operation_key") != want_data["operation_key"]:
                    problems.append(f"data.operation_key {show(d.get('operation_key'))}")
            self.result(g.name, not problems, g.what, g.want.split(".")[2] + " answer naming "
                        "the intent's run_id and step", "; ".join(problems) or
                        (ev or {}).get("type"))

    def check_hostiles(self, hostiles, dlq):
        for h in hostiles:
            ent = dlq.get((h.partition, h.offset))
            problems = []
            seen = ""
            if ent is None:
                problems.append(f"no DLQ record for partition {h.partition} offset {h.offset}")
                if h.ce_id is not None:
                    rows = self.query("SELECT status, error_code FROM effects WHERE intent_id = %s",
                                      (h.ce_id,))
                    if rows:
                        problems.append(f"an effect was written for it: {rows}")
            else:
                d = ent["v"]["data"]
                seen = f"reason {d.get('reason')}: {cut(d.get('detail'), 300)}"
                if d.get("reason") not in h.reasons:
                    problems.append(f"reason {d.get('reason')!r} not in {sorted(h.reasons)}")
                if not isinstance(d.get("detail"), str) or not d.get("detail"):
                    problems.append("no detail sentence")
                elif h.detail_has and h.detail_has not in d["detail"]:
                    problems.append(f"the detail does not quote the error ({h.detail_has!r})")
                if ent["raw_len"] > EVENT_MAX:
                    problems.append(f"the DLQ record is {ent['raw_len']} bytes (> {EVENT_MAX})")
                orig = d.get("original")
                if isinstance(orig, str) and not h.value.startswith(orig.encode()):
                    problems.append("data.original is not (a prefix of) the bytes sent")
                if h.ce_id is not None and self.scalar(
                        "SELECT count(*) FROM effects WHERE intent_id = %s", (h.ce_id,)):
                    problems.append("an effect was written for it anyway")
            if h.run is not None:
                obs = self.query("SELECT status FROM obligations WHERE run_id = %s", (h.run,))
                st = self.scalar("SELECT status FROM runs WHERE run_id = %s", (h.run,))
                if obs or st != "ACTIVE":
                    problems.append(f"its run was acted on: run {st}, obligations {obs}")
            self.result(h.name, not problems, h.what,
                        f"DLQ record with reason {' or '.join(sorted(h.reasons))} and a detail"
                        + (f" naming {h.detail_has!r}" if h.detail_has else ""),
                        "; ".join(problems) + (f" [{seen}]" if problems and seen else "")
                        or seen)

    def effect_row(self, run):
        rows = self.query("SELECT effect_id::text, status, external_ref, receipt, error_code,"
                          " error_message, octet_length(receipt->>'id') FROM effects"
                          " WHERE run_id = %s", (run,))
        cols = ("effect_id", "status", "external_ref", "receipt", "error_code",
                "error_message", "receipt_id_bytes")
        return dict(zip(cols, rows[0])) if rows else None

    def check_answers(self, answers, by_intent, by_effect):
        for g in answers:
            if g.name.startswith("answer-version"):
                continue  # checked with their compensation
            eff = self.effect_row(g.run) or {}
            ev = self.final_answer(g.ce_id, by_intent, by_effect) or {}
            d = ev.get("data") or {}
            err = d.get("error")
            rec = [r for r in self.records(self.collection(g.tool))
                   if r["idempotency_key"] == g.key]
            real_id = rec[0]["id"] if rec else None
            problems = []
            if eff.get("status") != "CONFIRMED":
                problems.append(f"effect {eff.get('status')} ({eff.get('error_code')}: "
                                f"{cut(eff.get('error_message'), 200)})")
            if eff.get("receipt") is None:
                problems.append("no receipt kept")
            seen = (f"event {ev.get('type')}, external_ref {show(d.get('external_ref'))}, "
                    f"error {cut(err, 200)}, ledger error_code {eff.get('error_code')}")
            if g.name.startswith("answer-id-"):
                size = g.fault[1]["size"]
                if size <= LIMIT["external_ref"]:
                    if d.get("external_ref") != real_id or eff.get("external_ref") != real_id:
                        problems.append(f"external_ref is {show(eff.get('external_ref'))}, not "
                                        f"the {size}-byte id")
                    if err is not None:
                        problems.append(f"error {err}")
                else:
                    if eff.get("external_ref") is not None or d.get("external_ref") is not None:
                        problems.append("external_ref is not null "
                                        f"({nbytes(str(eff.get('external_ref')))} bytes)")
                    if not (isinstance(err, dict) and err.get("code") == "protocol_error"
                            and err.get("message")):
                        problems.append(f"the event's error is {cut(err, 200)}, not "
                                        "{code: protocol_error, message}")
                    if eff.get("receipt_id_bytes") != size:
                        problems.append(f"the ledger's receipt.id is "
                                        f"{eff.get('receipt_id_bytes')} bytes, not {size}")
                expected = (f"CONFIRMED, external_ref the {size}-byte id, error null"
                            if size <= LIMIT["external_ref"] else
                            "CONFIRMED, receipt kept whole, external_ref null, event error "
                            "{code protocol_error, message}")
            else:
                # connector.c: a 2xx body that is not text/JSON is kept as a receipt note with
                # an excerpt; the ref is null unless a status check fetched the real record
                if eff.get("external_ref") not in (None, real_id):
                    problems.append(f"external_ref {show(eff.get('external_ref'))}")
                if eff.get("external_ref") is None and isinstance(eff.get("receipt"), dict) \
                        and "excerpt" not in eff["receipt"] and "body" not in eff["receipt"]:
                    problems.append(f"receipt without the excerpt: {cut(eff['receipt'], 200)}")
                if err is not None and not (isinstance(err, dict) and
                                            err.get("code") == "protocol_error"):
                    problems.append(f"error {cut(err, 200)}")
                expected = ("CONFIRMED (the tool did it), the receipt kept as a note with an "
                            "excerpt (or the real record from a status check), error null or "
                            "protocol_error, the worker up")
            if ev.get("type") != CONFIRMED:
                problems.append(f"final answer {ev.get('type')}")
            self.result(f"{g.name}-ledger", not problems, g.what, expected,
                        "; ".join(problems) + f" [{seen}]" if problems else seen)

    def check_runs(self, comp_runs, comp_msgs, stuck_runs, version_runs, big_run, rev_runs,
                   expect_stuck_runs, comp):
        run_events = {}
        for ent in self.msgs["outcomes"]:
            v = ent["v"] or {}
            if str(v.get("type", "")).startswith("tally.run."):
                run_events.setdefault((v.get("data") or {}).get("run_id"), []).append(ent)
        alert_events = [ent["v"] for ent in self.msgs["alerts"] if ent["v"]]
        reverses = self.fake_requests(op="reverse")

        def obligations(run):
            return self.query("SELECT obligation_id::text, status, error_code, error_message"
                              " FROM obligations WHERE run_id = %s", (run,))

        for name in ("comp-reason-4096", "comp-reason-straddles-200", "cancel-reason-4096"):
            run = comp_runs[name]
            obs = obligations(run)
            st = self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,))
            problems = []
            if [o[1] for o in obs] != ["RESOLVED"]:
                problems.append(f"obligations {obs}")
            if st not in ("COMPENSATED", "CANCELLED"):
                problems.append(f"run {st}")
            if not run_events.get(run):
                problems.append("no tally.run.*.v1 event")
            self.result(name, not problems, comp_msgs[name].what,
                        "accepted: the effect reversed (obligation RESOLVED), the run "
                        "summarised", "; ".join(problems) or f"run {st}")

        for name, g in version_runs.items():
            size = g.fault[1]["size"]
            eff = self.effect_row(g.run) or {}
            version = (eff.get("receipt") or {}).get("version")
            obs = obligations(g.run)
            oids = [o[0] for o in obs]
            mine = [r for r in reverses
                    if (r.get("idempotency_key") or "").split(":", 1)[-1] in oids]
            problems = []
            if not isinstance(version, str) or nbytes(version) != size:
                problems.append(f"the ledger's receipt.version is {show(version)}")
            if size <= LIMIT["receipt_version"]:
                if [o[1] for o in obs] != ["RESOLVED"]:
                    problems.append(f"obligations {obs}")
                sent = [r.get("if_match") for r in mine]
                if not sent or any(im is None or im.strip('W/"') != version for im in sent):
                    problems.append(f"If-Match sent: {[show(im) for im in sent]}")
                expected = f"the reverse call carries the whole {size}-byte version as " \
                           "If-Match; the obligation RESOLVED"
            else:
                if [o[1] for o in obs] != ["STUCK"]:
                    problems.append(f"obligations {obs}")
                if mine:
                    problems.append(f"{len(mine)} reverse call(s) went out, If-Match "
                                    f"{[show(r.get('if_match')) for r in mine]}")
                problems += self.page_problems(g.run, oids, alert_events)
                expected = "no reverse call without the whole version as If-Match: the " \
                           "obligation STUCK, an alerts row TRIGGERED and a " \
                           "tally.alert.trigger.v1 naming the run"
            self.result(f"{name}-compensation", not problems,
                        f"compensate_run; the receipt's version is {size} bytes", expected,
                        "; ".join(problems) + (" [" if problems else "") +
                        f"obligations {[(o[1], o[2]) for o in obs]}, reverse calls' If-Match "
                        f"{[show(r.get('if_match'), 12) for r in mine]}" +
                        ("]" if problems else ""))

        for name, run in stuck_runs.items():
            obs = obligations(run)
            problems = []
            if [o[1] for o in obs] != ["STUCK"]:
                problems.append(f"obligations {obs}")
            problems += self.page_problems(run, [o[0] for o in obs], alert_events)
            self.result(name, not problems, f"compensate_run of run {show(run)} whose "
                        "refund_manual obligation goes STUCK (manual_runbook)",
                        "the obligation STUCK; an alerts row TRIGGERED with the run id whole, "
                        "a tally.alert.trigger.v1 naming it",
                        "; ".join(problems) or f"obligation STUCK ({obs[0][2]}), paged")

        rules_left = [r["fault"] for r in self.fake_get("/_control/faults")["faults"]
                      if r["op"] == "reverse"]
        for i, run in enumerate(rev_runs.values()):
            rows = self.query("SELECT status, error_code, reverse_receipt FROM obligations"
                              " WHERE run_id = %s", (run,))
            st = self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,))
            problems = []
            if [r[0] for r in rows] != ["RESOLVED"]:
                problems.append(f"obligations {[r[:2] for r in rows]}")
            if not rows or not isinstance(rows[0][2], dict):
                problems.append(f"reverse_receipt {cut(rows[0][2] if rows else None, 200)}")
            if st != "COMPENSATED":
                problems.append(f"run {st}")
            if rules_left:
                problems.append(f"fault rules not taken: {rules_left}")
            self.result(f"reverse-answer-spoiled-{i + 1}", not problems,
                        f"compensate_run of {run}; its reverse call is answered 201 with JSON "
                        "holding bytes that are not UTF-8, or with HTML (one of the two runs "
                        "gets each)",
                        "RESOLVED (the tool reversed it), the answer kept as the reverse "
                        "receipt (a note with an excerpt), the run COMPENSATED",
                        "; ".join(problems) or
                        f"reverse_receipt {cut(rows[0][2], 150)}")

        ents = run_events.get(big_run) or []
        st = self.scalar("SELECT status FROM runs WHERE run_id = %s", (big_run,))
        problems = []
        if not ents:
            problems.append("no tally.run.*.v1 event on outcomes")
        big = [e["raw_len"] for e in ents if e["raw_len"] > EVENT_MAX]
        if big:
            problems.append(f"run events of {big} bytes")
        obs = obligations(big_run)
        if sorted(o[1] for o in obs) != ["UNCOMPENSATABLE", "UNCOMPENSATABLE"]:
            problems.append(f"obligations {obs}")
        whole = self.scalar("SELECT octet_length(summary::text) FROM runs WHERE run_id = %s",
                            (big_run,))
        self.result("big-summary", not problems,
                    "compensate_run of a run with two 330 kB append-only effects",
                    f"a bounded run event (<= {EVENT_MAX} bytes), both obligations "
                    "UNCOMPENSATABLE", "; ".join(problems) or
                    f"run {st}, run events of {[e['raw_len'] for e in ents]} bytes, "
                    f"runs.summary {whole} bytes")

        n_stuck = self.scalar("SELECT count(*) FROM obligations WHERE status = 'STUCK'")
        try:
            gauge = self.metric_value(self.metrics(comp), "tally_stuck_obligations")
        except OSError as e:
            gauge = f"unreadable: {e}"
        self.result("stuck-gauge", gauge == n_stuck and n_stuck == len(expect_stuck_runs),
                    "the compensator's /metrics",
                    f"tally_stuck_obligations = {len(expect_stuck_runs)} (the STUCK "
                    "obligations expected)",
                    f"gauge {gauge}, STUCK obligations in the ledger {n_stuck}")

    def page_problems(self, run, oids, alert_events):
        problems = []
        rows = self.query("SELECT dedup_key, status, run_id, obligation_id::text FROM alerts"
                          " WHERE obligation_id::text = ANY(%s) OR run_id = %s", (oids, run))
        if not any(r[1] == "TRIGGERED" and r[2] == run for r in rows):
            problems.append(f"no TRIGGERED alerts row with the run id: {cut(rows, 300)}")
        trig = [a for a in alert_events if a.get("type") == "tally.alert.trigger.v1" and (
            (a.get("data") or {}).get("obligation_id") in oids)]
        if not trig:
            problems.append("no tally.alert.trigger.v1 for the obligation")
        elif not any((a["data"].get("run_id") == run) for a in trig):
            problems.append(f"the trigger's run_id is {show(trig[0]['data'].get('run_id'))}")
        return problems

    def check_topics(self):
        for t, ents in self.msgs.items():
            bad = [f"offset {e['offset']}: {e['bad']} {e['head'][:80]!r}" for e in ents
                   if e["v"] is None]
            big = [f"offset {e['offset']}: {e['raw_len']} bytes "
                   f"({(e['v'] or {}).get('type')})" for e in ents if e["raw_len"] > EVENT_MAX]
            self.result(f"topic-{t}", not bad and not big, f"every message on {self.topic(t)}",
                        f"UTF-8 JSON of at most {EVENT_MAX} bytes",
                        "; ".join(bad + big) or f"{len(ents)} messages, the largest "
                        f"{max([e['raw_len'] for e in ents] or [0])} bytes")

    def check_workers(self, workers, not_ready):
        disp = workers["dispatcher"]
        for name, p in workers.items():
            problems = []
            if not p.alive():
                problems.append(f"exited with {p.popen.returncode}: {cut(p.log()[-3000:], 1500)}")
            else:
                for path in ("/healthz", "/readyz"):
                    try:
                        status, body = p.http_get(path)
                    except OSError as e:
                        status, body = None, str(e)
                    if status != 200:
                        problems.append(f"{path} {status}: {cut(body, 200)}")
            mine = [s for s in not_ready if f" {name}: " in s]
            if mine:
                problems.append(f"/readyz was not 200 at {mine[:5]}")
            self.result(f"worker-{name}", not problems, f"tally-{name}",
                        "alive, /healthz and /readyz 200 throughout", "; ".join(problems)
                        or "ready")
        try:
            paused = self.metric_value(self.metrics(disp), "tally_intake_paused")
        except OSError as e:
            paused = f"unreadable: {e}"
        self.result("intake-not-paused", paused == 0, "the dispatcher's /metrics",
                    "tally_intake_paused 0", f"tally_intake_paused {paused}")

    def check_ledger(self, answers, expect_stuck_runs):
        rows = self.query("SELECT run_id, step, tool, status, error_code FROM effects"
                          " WHERE status IN ('STUCK', 'UNKNOWN', 'PLANNED', 'DISPATCHING')")
        self.result("effects-settled", not rows, "every effect",
                    "none STUCK, UNKNOWN, PLANNED or DISPATCHING",
                    cut(rows, 800) if rows else "none")
        rows = self.query("SELECT o.run_id, e.tool, o.status, o.error_code FROM obligations o"
                          " JOIN effects e USING (effect_id) WHERE o.status NOT IN"
                          " ('RESOLVED', 'SKIPPED', 'UNCOMPENSATABLE', 'CANCELLED')")
        wrong = [r for r in rows if not (r[2] == "STUCK" and r[0] in expect_stuck_runs)]
        self.result("obligations-settled", not wrong, "every obligation",
                    "terminal; STUCK only where expected (versions over 256 bytes, "
                    "manual_runbook)", cut(wrong, 800) if wrong else
                    f"{len(rows)} STUCK as expected")
        n = self.scalar("SELECT (SELECT count(*) FROM message_outbox)"
                        " + (SELECT count(*) FROM message_refs)")
        m = self.scalar("SELECT count(*) FROM outbox")
        stuck = self.query("SELECT topic, attempts, last_error FROM message_outbox"
                           " UNION ALL SELECT 'outcomes (reference)', attempts, last_error"
                           " FROM message_refs LIMIT 5")
        self.result("outbox-drained", n == 0 and m == 0,
                    "message_outbox, message_refs and outbox",
                    "empty", f"message_outbox and message_refs {n}, outbox {m}" +
                    (f": {cut(stuck, 600)}" if stuck else ""))
        try:
            check_invariants(self, obligations_settled=True)
            self.result("invariants-sql", True, "invariants.py SQL checks", "hold", "hold")
        except AssertionError as e:
            self.result("invariants-sql", False, "invariants.py SQL checks", "hold", str(e))
        # The ids over 512 bytes leave CONFIRMED effects without an external ref, by contract.
        exempt = set()
        for g in answers:
            eff = self.effect_row(g.run)
            if eff and eff["external_ref"] is None:
                exempt.add(eff["effect_id"])
        problems = [p for p in fake_vs_ledger(self, self.fake_url)
                    if not any(e in p and "with ref None" in p for e in exempt)]
        self.result("invariants-fake-vs-ledger", not problems,
                    "invariants.fake_vs_ledger (CONFIRMED effects without a ref exempted)",
                    "one upstream record per CONFIRMED effect",
                    cut(problems, 1500) if problems else f"hold ({len(exempt)} exempted)")
        try:
            self.compensation_invariants()
            self.result("invariants-compensation", True, "compensation_invariants", "hold",
                        "hold")
        except AssertionError as e:
            self.result("invariants-compensation", False, "compensation_invariants", "hold",
                        str(e))

    def check_offsets(self):
        """The dispatcher stores an offset once its batch is committed; librdkafka commits the
        stored offsets every auto.commit.interval.ms (5 s): wait up to 20 s for them."""
        topic = self.topic("intents")
        group = self.prefix.rstrip("._-") + "-dispatcher"
        c = Consumer({"bootstrap.servers": self.stack.kafka, "group.id": group,
                      "enable.auto.commit": False})
        try:
            parts = c.list_topics(topic=topic, timeout=10).topics[topic].partitions
            tps = [TopicPartition(topic, p) for p in parts]
            high = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                    for p in parts}
            deadline = time.monotonic() + 20
            while True:
                committed = {tp.partition: tp.offset for tp in c.committed(tps, timeout=10)}
                behind = {p: (committed.get(p), high[p]) for p in parts
                          if high[p] > 0 and committed.get(p) != high[p]}
                if not behind or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            c.close()
        self.result("offsets-committed", not behind, f"group {group} on {topic}",
                    "committed up to the end of every partition",
                    f"(committed, end) behind: {behind}" if behind else "all committed")

    def check_shutdown(self, workers):
        for name, p in workers.items():
            if not p.alive():
                continue
            try:
                rc = p.terminate(timeout=30)
            except AssertionError as e:
                rc = str(e)
            log = p.log()
            san = [line for line in log.splitlines()
                   if "AddressSanitizer" in line or "runtime error:" in line
                   or "LeakSanitizer" in line]
            self.result(f"shutdown-{name}", rc == 0 and not san, f"SIGTERM to {p.name}",
                        "exit 0, no sanitizer report", f"exit {rc}; {cut(san[:5], 800)}"
                        if san or rc != 0 else "exit 0")


if __name__ == "__main__":
    main()
