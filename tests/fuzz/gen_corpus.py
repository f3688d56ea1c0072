#!/usr/bin/python3
"""Write the seed corpora (tests/fuzz/corpus/<target>/) and dictionaries (tests/fuzz/dict/).

    /usr/bin/python3 tests/fuzz/gen_corpus.py

Each corpus directory is rewritten whole: what is in it comes from here, so edit this script
rather than the files. Seeds hold what a fuzzer finds slowly on its own: the valid messages of
schemas/README.md and the registries of examples/tools/, every field at and one over its limit
(common/include/tally/text.h), and 2-, 3- and 4-byte UTF-8 characters placed at, across and
just after every place the code cuts text (the 60-byte excerpts of cloudevent.c, the 76 bytes
of a name quoted by registry.c, the 256-byte detail of dispatcher.h, the 512-byte message of
tally_error_t, the limits). Crash reproducers do not go here but in tests/fuzz/regressions/.
"""
import json
import os
import re
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

WIDE = {2: "\u00e9", 3: "\u20ac", 4: "\U0001F600"}  # é € 😀
MALFORMED = [b"\x80", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc0\xaf", b"\xed\xa0\x80",
             b"\xf4\x90\x80\x80", b"\xff"]

LIMITS = {"run_id": 200, "step": 100, "tool": 200, "operation_key": 500, "id": 200,
          "tenant": 200, "reason": 4096}
EXCERPT = 60       # EXCERPT_MAX_BYTES in common/src/cloudevent.c
DETAIL = 256       # intake_msg_t.detail in dispatcher/dispatcher.h
MESSAGE = 512      # tally_error_t.message in common/include/tally/error.h
SHOWN = 80 - 4     # registry.c quotes names with shown(s, buf, 80): 76 bytes and "..."

# The key argument names of the wide_* tools of fuzz_intake.c: 'k' and 480 bytes of one
# character; keep the two in step.
INTAKE_WIDE = {"wide_two": "k" + "\u00e9" * 240, "wide_three": "k" + "\u20ac" * 160,
               "wide_four": "k" + "\U0001F600" * 120}


def straddling(boundary, filler="a", tail="z" * 4):
    """Strings with each wide character at, across and just before byte @boundary: for every
    width w and every start in [boundary - w, boundary], filler up to the start, the
    character, then @tail. Yields (name, text)."""
    for w, ch in WIDE.items():
        for start in range(max(0, boundary - w), boundary + 1):
            yield "%dB@%d" % (w, start), filler * start + ch + tail


def sized(n, ch_width=None, filler="a"):
    """A string of exactly @n bytes of UTF-8, ending with a character of @ch_width bytes."""
    if ch_width is None:
        return filler * n
    return filler * (n - ch_width) + WIDE[ch_width]


def dumps(v):
    return json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()


class Corpus:
    def __init__(self, target):
        self.dir = os.path.join(HERE, "corpus", target)
        if os.path.isdir(self.dir):
            shutil.rmtree(self.dir)
        os.makedirs(self.dir)
        self.names = set()

    def add(self, name, data):
        if isinstance(data, str):
            data = data.encode()
        name = re.sub(r"[^A-Za-z0-9_.@=+-]", "_", name)
        assert name not in self.names, name
        self.names.add(name)
        with open(os.path.join(self.dir, name), "wb") as f:
            f.write(data)


def readme_examples():
    text = open(os.path.join(ROOT, "schemas", "README.md"), encoding="utf-8").read()
    found = re.findall(r"<!-- example: (\w+) -->\s*```json\n(.*?)```", text, re.S)
    return {name: json.loads(body) for name, body in found}


# ---------------------------------------------------------------------------------- intents

def intent(**data):
    msg = {"specversion": "1.0", "id": "0b7c5d7e-3f1a-4c61-9d1e-2a6f4e8b9c01",
           "source": "/agents/fuzz", "type": "tally.intent.v1",
           "datacontenttype": "application/json",
           "data": {"run_id": "run-1", "step": 1, "tool": "charge_card",
                    "args": {"tenant_id": "t1", "payment_id": "pay_42"}}}
    for k, v in data.items():
        if v is Ellipsis:
            msg["data"].pop(k, None)
        else:
            msg["data"][k] = v
    return msg


def run_msg(kind, **data):
    msg = {"specversion": "1.0", "id": "5d0b2f8e-6a3c-4e2b-8f19-7c4d1a2b3c4d",
           "source": "/agents/fuzz", "type": "tally.%s.v1" % kind,
           "data": {"run_id": "run-1", "reason": "fuzz"}}
    msg["data"].update(data)
    return msg


def intent_seeds(c):
    examples = readme_examples()
    for name in ("intent", "compensate_run", "cancel_run"):
        c.add("readme-" + name, json.dumps(examples[name], indent=2, ensure_ascii=False))
    base = intent()

    # every data field and the id at, and one over, its limit; ASCII and ending in a wide
    # character (the cut of an over-long value must not split it)
    for field, limit in LIMITS.items():
        for n in (limit, limit + 1):
            for w in (None, 2, 3, 4):
                v = sized(n, w)
                tag = "%s-%d%s" % (field, n, "" if w is None else "-%dB" % w)
                if field == "id":
                    m = dict(base, id=v)
                elif field == "reason":
                    m = run_msg("compensate_run", reason=v)
                else:
                    m = intent(**{field: v})
                c.add(tag, dumps(m))

    # the 60-byte excerpts quoted in a detail: type, specversion, datacontenttype, traceparent
    for name, s in straddling(EXCERPT, tail="tail" * 3):
        c.add("excerpt-type-" + name, dumps(dict(base, type=s)))
        c.add("excerpt-specversion-" + name, dumps(dict(base, specversion=s)))
        c.add("excerpt-dct-" + name, dumps(dict(base, datacontenttype=s)))
        c.add("excerpt-traceparent-" + name, dumps(intent(traceparent=s)))

    # the number too small for a double, quoted (cut at 60 bytes) in the detail
    c.add("underflow", b'{"specversion":"1.0","id":"x","source":"/s","type":"tally.intent.v1",'
          b'"data":{"run_id":"r","step":1,"tool":"t","args":{"x":1e-400}}}')
    c.add("underflow-long", b'{"specversion":"1.0","id":"x","source":"/s","type":'
          b'"tally.intent.v1","data":{"run_id":"r","step":1,"tool":"t","args":{"x":0.'
          + b"0" * 70 + b'1e-400}}}')

    # jansson's error text (quoted in a not_json detail) around wide characters
    for w, ch in WIDE.items():
        b = ch.encode()
        c.add("not-json-token-%dB" % w, b'{"data": ' + b + b"}")
        c.add("not-json-key-%dB" % w, b"{" + b * 30 + b"}")
        c.add("not-json-late-%dB" % w, b'{"id": "' + b * 70 + b'", ' + b * 3)
        # jansson quotes the token it stopped in, which ends after the first byte of the
        # character following a backslash
        c.add("not-json-escape-%dB" % w, b'{"id": "a \\' + b + b'"}')
    for i, bad in enumerate(MALFORMED):
        c.add("invalid-utf8-%d" % i, b'{"specversion":"1.0","id":"' + bad + b'"}')

    # data shapes, one seed per refusal of cloudevent.c
    c.add("step-string", dumps(intent(step="3")))
    c.add("step-negative", dumps(intent(step=-1)))
    c.add("step-max", dumps(intent(step=9223372036854775807)))
    c.add("step-real", dumps(intent(step=1.5)))
    c.add("step-bool", dumps(intent(step=True)))
    c.add("step-control", dumps(intent(step="a\nb")))
    c.add("run-id-control", dumps(intent(run_id="run\u0001")))
    c.add("run-id-empty", dumps(intent(run_id="")))
    c.add("tool-missing", dumps(intent(tool=...)))
    c.add("args-missing", dumps(intent(args=...)))
    c.add("args-array", dumps(intent(args=[1, 2])))
    c.add("operation-key-null", dumps(intent(operation_key=None)))
    c.add("operation-key-empty", dumps(intent(operation_key="")))
    c.add("operation-key-crlf", dumps(intent(operation_key="k\r\nX-Injected: 1")))
    c.add("tenant-number", dumps(intent(tenant=5)))
    c.add("traceparent-valid", dumps(intent(
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")))
    c.add("traceparent-upper", dumps(intent(
        traceparent="00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01")))
    c.add("traceparent-zero", dumps(intent(
        traceparent="00-00000000000000000000000000000000-00f067aa0ba902b7-01")))
    c.add("cancel-compensate-string", dumps(run_msg("cancel_run", compensate="yes")))
    c.add("cancel-compensate-null", dumps(run_msg("cancel_run", compensate=None)))
    c.add("reason-missing", dumps({k: v for k, v in run_msg("compensate_run").items()
                                   if k != "data"} | {"data": {"run_id": "r"}}))
    c.add("dct-charset", dumps(dict(base, datacontenttype="application/json; charset=utf-8")))
    c.add("dct-cloudevents", dumps(dict(base, datacontenttype="application/cloudevents+json")))
    c.add("dct-text", dumps(dict(base, datacontenttype="text/plain")))
    c.add("dct-number", dumps(dict(base, datacontenttype=5)))
    c.add("data-base64", dumps({k: v for k, v in base.items() if k != "data"}
                               | {"data_base64": "e30="}))
    c.add("data-string", dumps(dict(base, data="{}")))
    c.add("specversion-0.3", dumps(dict(base, specversion="0.3")))
    c.add("id-empty", dumps(dict(base, id="")))
    c.add("id-number", dumps(dict(base, id=7)))
    c.add("source-missing", dumps({k: v for k, v in base.items() if k != "source"}))
    c.add("type-unknown", dumps(dict(base, type="tally.effect.confirmed.v1")))
    c.add("duplicate-key", b'{"specversion":"1.0","specversion":"1.0"}')
    c.add("duplicate-key-in-args", b'{"specversion":"1.0","id":"x","source":"/s","type":'
          b'"tally.intent.v1","data":{"run_id":"r","step":1,"tool":"t",'
          b'"args":{"a":1,"a":2}}}')
    c.add("nul-escape", b'{"specversion":"1.0","id":"a\\u0000b","source":"/s"}')
    c.add("array", b"[1,2,3]")
    c.add("string", b'"tally.intent.v1"')
    c.add("empty", b"")
    c.add("deep-args", b'{"specversion":"1.0","id":"x","source":"/s","type":"tally.intent.v1",'
          b'"data":{"run_id":"r","step":1,"tool":"t","args":{"a":' + b"[" * 2000 + b"]" * 2000
          + b"}}}")


def intake_seeds(c):
    intent_seeds(c)
    c.add("balance", dumps(intent(tool="check_balance", args={"request_id": "req-1"},
                                  operation_key=...)))
    c.add("charge-derived", dumps(intent(operation_key=...)))
    c.add("charge-explicit", dumps(intent(operation_key="charge_card:t1:pay_42")))
    c.add("charge-missing-arg", dumps(intent(args={"tenant_id": "t1"}, operation_key=...)))
    for name, v in (("int", 42), ("bool", True), ("real", 1.5), ("null", None), ("object", {}),
                    ("empty", ""), ("control", "a\tb"), ("wide", "\U0001F600" * 3)):
        c.add("charge-arg-" + name, dumps(intent(args={"tenant_id": "t1", "payment_id": v},
                                                 operation_key=...)))
    c.add("email", dumps(intent(tool="send_email", args={"message_id": "m-1"},
                                operation_key=...)))
    c.add("ledger-no-key", dumps(intent(tool="update_ledger", args={"id": 1},
                                        operation_key=...)))
    c.add("ledger-explicit", dumps(intent(tool="update_ledger", args={"id": 1},
                                          operation_key="ledger:1")))
    # derived keys at and over the 500-byte limit, ending in a wide character; and the key
    # argument missing, whose 512-byte error message is cut inside its long name
    for tool, field in INTAKE_WIDE.items():
        c.add(tool + "-missing", dumps(intent(tool=tool, args={}, operation_key=...)))
        c.add(tool + "-real", dumps(intent(tool=tool, args={field: 0.5}, operation_key=...)))
        room = LIMITS["operation_key"] - len(tool.encode()) - 1
        for n in (room, room + 1):
            for w in (None, 2, 3, 4):
                c.add("%s-key-%d%s" % (tool, n + len(tool) + 1, "" if w is None else "-%dB" % w),
                      dumps(intent(tool=tool, args={field: sized(n, w)}, operation_key=...)))
    for name, s in straddling(LIMITS["tool"] - 4):
        c.add("unknown-tool-" + name, dumps(intent(tool=s, operation_key=...)))


# ---------------------------------------------------------------------------------- registry

def tool(**over):
    t = {"name": "charge_card", "owner": "billing", "effect_class": "reversible",
         "operation_key": ["tenant_id", "payment_id"],
         "connector": {"type": "http", "base_url": "http://127.0.0.1:9000",
                       "execute": {"method": "POST", "path": "/charges"},
                       "status": {"method": "GET", "path": "/charges"},
                       "compensate": {"method": "POST", "path": "/charges/reverse"}}}
    for k, v in over.items():
        if k.startswith("connector_"):
            t["connector"][k[len("connector_"):]] = v
        elif v is Ellipsis:
            t.pop(k, None)
        else:
            t[k] = v
    return t


def registry(*tools):
    return json.dumps({"tools": list(tools)}, ensure_ascii=False, indent=1)


def registry_seeds(c):
    examples = os.path.join(ROOT, "examples", "tools")
    c.add("demo", open(os.path.join(examples, "demo.json"), "rb").read())
    for f in sorted(os.listdir(os.path.join(examples, "invalid"))):
        c.add("invalid-" + f, open(os.path.join(examples, "invalid", f), "rb").read())
    c.add("env-set", registry(tool(connector_base_url="${TALLY_FUZZ_URL}")))
    c.add("env-empty-default", registry(tool(
        connector_base_url="${TALLY_FUZZ_EMPTY:-https://fallback.internal/}")))
    c.add("env-unset", registry(tool(connector_base_url="${TALLY_FUZZ_UNSET}")))
    c.add("env-unclosed", registry(tool(connector_base_url="http://${TALLY_FUZZ_URL")))
    c.add("env-bad-name", registry(tool(connector_base_url="${1BAD:-http://x}")))
    c.add("env-long-name", registry(tool(connector_base_url="${" + "A" * 130 + "}")))
    c.add("url-no-host", registry(tool(connector_base_url="https:///")))
    c.add("url-query", registry(tool(connector_base_url="http://h/?q")))
    c.add("destructive", registry(tool(effect_class="destructive", requires_approval=False)))
    c.add("append-only-contain", registry(tool(effect_class="append_only",
                                               connector_contain={"method": "POST",
                                                                  "path": "/c"})))
    c.add("status-query", registry(tool(connector_status={"method": "GET", "path": "/s?x=1"})))
    c.add("numbers", registry(tool(retry={"max_attempts": 100, "backoff_ms": 86400000,
                                          "max_backoff_ms": 1}, settle_ms=-1,
                                   max_concurrency=10001, connector_timeout_ms=0)))
    c.add("key-duplicate", registry(tool(operation_key=["a", "a"])))
    c.add("key-not-string", registry(tool(operation_key=[1, None, ""])))
    c.add("receipt-ref-bad", registry(tool(connector_receipt_ref="/a~2")))
    c.add("secret-env", registry(tool(connector_secret_env="BILLING_SECRET")))
    c.add("comp-runbook", registry(tool(compensation={"mode": "manual_runbook"})))
    c.add("two-same-name", registry(tool(), tool()))
    c.add("not-object", b'{"tools": [1, "x", null]}')
    c.add("no-tools", b'{"tool": []}')
    c.add("top-array", b"[]")
    # names and values quoted by registry.c, wide characters where shown() cuts them (76)
    for name, s in straddling(SHOWN):
        c.add("shown-name-" + name, registry(tool(name=s)))
        c.add("shown-url-" + name, registry(tool(connector_base_url="ftp://" + s)))
        c.add("shown-method-" + name, registry(tool(connector_execute={"method": s,
                                                                       "path": "/x"})))
        c.add("shown-key-" + name, registry(tool(operation_key=[s, s])))
    # jansson's errors, quoted in the problem line
    for w, ch in WIDE.items():
        b = ch.encode()
        c.add("json-token-%dB" % w, b'{"tools": [' + b + b"]}")
        c.add("json-late-%dB" % w, b'{"tools": [{"name": "' + b * 40 + b'"' + b * 2)
        c.add("json-escape-%dB" % w, b'{"tools": [{"name": "a \\' + b + b'"}]}')
    for i, bad in enumerate(MALFORMED):
        c.add("json-invalid-utf8-%d" % i, b'{"tools": [{"name": "' + bad + b'"}]}')


# ---------------------------------------------------------------------------------- JSON

RECEIPT = {"id": "ch_3PqR8s", "amount": 1200, "currency": "EUR", "status": "succeeded",
           "version": "v\u00e9r-2", "nested": {"list": [1, {"b": True}, None], "a/b": 2, "~": 3},
           "price": 12.5}


def json_scan_seeds(c):
    compact = dumps(RECEIPT)
    spaced = json.dumps(RECEIPT, ensure_ascii=False, indent=2).encode()
    for ptr in ("/id", "", "/amount", "/price", "/status", "/version", "/nested",
                "/nested/list/1/b", "/nested/list/2", "/nested/a~1b", "/nested/~0",
                "/nested/list/9", "/missing", "id", "/nested/~2", "/nested/list/01"):
        tag = ptr.replace("/", "_").replace("~", "t") or "root"
        c.add("ptr" + tag, ptr.encode() + b"\n" + compact)
        c.add("ptr" + tag + "-spaced", ptr.encode() + b"\n" + spaced)
    c.add("no-pointer", compact)
    c.add("escapes", b'/s\n{"s":"a\\"b\\\\c\\/d\\b\\f\\n\\r\\t\\u00e9\\u20ac"}')
    c.add("surrogates", b'/s\n{"s":"\\ud83d\\ude00"}')
    c.add("lone-surrogate", b'/s\n{"s":"\\ud83d"}')
    c.add("u0000", b'/s\n{"s":"a\\u0000"}')
    c.add("key-escape", b'/a\n{"\\u0061":1}')
    c.add("key-duplicate", b'/a\n{"a":1,"a":2}')
    c.add("numbers", b'/n\n{"n":[0,-0,1.5,-0.25,123456789012345678,1234567890123456789,'
          b'9223372036854775807,-9223372036854775808,1e5,1E-5,0.1]}')
    c.add("number-300", b'/r\n{"r":0.' + b"1" * 298 + b"}")
    c.add("number-301", b'/r\n{"r":0.' + b"1" * 299 + b"}")
    c.add("leading-zero", b'{"n":01}')
    c.add("depth-32", b"/a\n" + b'{"a":' * 32 + b"1" + b"}" * 32)
    c.add("depth-33", b"/a\n" + b'{"a":' * 33 + b"1" + b"}" * 33)
    c.add("keys-64", b"/k63\n{" + b",".join(b'"k%d":%d' % (i, i) for i in range(64)) + b"}")
    c.add("keys-65", b"/k64\n{" + b",".join(b'"k%d":%d' % (i, i) for i in range(65)) + b"}")
    c.add("pointer-16", b"/" + b"/".join([b"a"] * 16) + b"\n" + b'{"a":' * 16 + b"1" + b"}" * 16)
    c.add("pointer-17", b"/" + b"/".join([b"a"] * 17) + b"\n" + b'{"a":' * 17 + b"1" + b"}" * 17)
    c.add("trailing", b'/a\n{"a":1} x')
    c.add("control-in-string", b'/a\n{"a":"\x01"}')
    c.add("not-object", b"/0\n[1]")
    c.add("empty-object", b"\n { } ")
    for w, ch in WIDE.items():
        b = ch.encode()
        c.add("wide-%dB" % w, b"/" + b + b"\n{\"" + b + b'":"' + b * 5 + b'"}')
    for i, bad in enumerate(MALFORMED):
        c.add("invalid-utf8-%d" % i, b'/a\n{"a":"' + bad + b'"}')


def canonical_seeds(c):
    values = {
        "receipt": dumps(RECEIPT),
        "reals": b"[0.1,1.0,-0.0,0.0,1e300,5e-324,1.7976931348623157e308,0.30000000000000004,"
                 b"2.5e-8,100.0,1e21,1e22,123456.789,-1.5e-300,4.35]",
        "integers": b"[0,-0,123456789012345678,-9223372036854775808,9223372036854775807]",
        "underflow": b"[1e-400,-1e-400]",
        "strings": b'["\\u0001\\u001f\\u007f","\\b\\f\\n\\r\\t\\"\\\\/","\\ud83d\\ude00",'
                   b'"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"]',
        "key-order": '{"z":1,"e":2,"\u00e9":3,"a":4,"ab":5,"":6,"A":7,"\U0001F600":8,"\u20ac":9}'
                     .encode(),
        "nested": b'{"b":[{"y":1,"x":[{}]},[]],"a":{"d":null,"c":true,"b":false}}',
        "scalar-string": b'"x"',
        "scalar-real": b"1.5",
        "scalar-true": b"true",
        "scalar-null": b"null",
        "empty-object": b"{}",
        "empty-array": b"[]",
        "deep": b"[" * 2040 + b"]" * 2040,
        "duplicate": b'{"a":1,"a":2}',
    }
    for name, data in values.items():
        c.add(name, data)


# ---------------------------------------------------------------------------------- text

# SIZES of fuzz_text.c: byte 0 of an input picks one by its index.
TEXT_SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 33, 60, 61, 62, 63, 64, 100, 101, 128, 200,
              201, 256, 500, 501, 512, 513, 768, 1023, 1024, 1025, 4096, 4097, 4100]


def text_input(size, dup_max, *parts):
    head = bytes([TEXT_SIZES.index(size), dup_max])
    return head + b"\xff".join(p.encode() if isinstance(p, str) else p for p in parts)


def text_seeds(c):
    c.add("plain", text_input(64, 10, "hello", "world", "abc", '{"a":[1,2.5,"x"]}'))
    c.add("empty", text_input(1, 0))
    for i, bad in enumerate(MALFORMED):
        c.add("malformed-%d" % i, text_input(8, 3, b"ab" + bad + b"cd", bad, bad + b"x", b"1"))
    # a wide character at, across and just before where a buffer of each size is full (size - 1)
    # and where a cut text ends before its "..." (size - 4)
    for size in (4, 5, 8, 61, 64, 256, 512, 1024, 1025, 4096):
        for boundary in sorted({size - 1, size - 4} - {-3, 0}):
            if boundary < 0:
                continue
            for name, s in straddling(boundary, tail="z"):
                c.add("size%d-at%d-%s" % (size, boundary, name),
                      text_input(size, 7, s, s[:8], "x", '"' + s[-5:] + '"'))
    # tally_text_dup's maximum (byte 1) and the run_id limit of the second pass (196..203)
    for name, s in straddling(200, tail=""):
        c.add("dup200-" + name, text_input(64, 4, "x", s))
    for name, s in straddling(9, tail="yy"):
        c.add("dup9-" + name, text_input(16, 9, s, s))
    # jtext: control characters and escapes in keys and values, a NUL in the strn part
    c.add("jtext-escapes", text_input(32, 200, 'k"\\\x01\x1f', "v\b\f\n\r\t\x7f", "n\x00ul",
                                      '["\\u00e9",1e300,null]'))
    c.add("jtext-key-dup", text_input(32, 1, "strn", "v", "w", "{}"))


# ---------------------------------------------------------------------------------- bounded

def bounded_seeds(c):
    """Byte 0 sets the limit to byte0/128 of the payload's length (fuzz_bounded.c)."""
    examples = readme_examples()
    for name in ("effect_event", "run_event", "obligation", "alert", "dlq"):
        body = dumps(examples[name])
        for ratio in (64, 127, 200):
            c.add("readme-%s-%d" % (name, ratio), bytes([ratio]) + body)
    run = examples["run_event"]
    for w, ch in WIDE.items():
        big = dict(run, data=dict(run["data"], note=ch * 1000, items=list(range(500)),
                                  deep={"k" * 200: {"l" * 200: ch * 600, "m": [ch] * 200}}))
        body = dumps(big)
        for ratio in (40, 100):
            c.add("big-%dB-%d" % (w, ratio), bytes([ratio]) + body)
    # many members with long names: the cut list, at most 20 lines, must fit the note's room
    wide = dict(run, data={("member-" + "n" * 180 + "-%d" % i): "v" * 150 for i in range(30)})
    c.add("many-long-names", bytes([100]) + dumps(wide))
    c.add("escapes", bytes([60]) + dumps(dict(run, data={"s": "\u0001\"\\" * 1000})))
    c.add("data-string", bytes([60]) + dumps(dict(run, data="x" * 6000)))
    c.add("no-data", bytes([10]) + dumps({k: v for k, v in run.items() if k != "data"}))
    c.add("not-object", bytes([100]) + b"[1,2,3]")


# ---------------------------------------------------------------------------------- dictionaries

JSON_TOKENS = ["{", "}", "[", "]", ":", ",", '"', "true", "false", "null", "-0", "0.0", "1e-400",
               "1e400", "9223372036854775807", "-9223372036854775808", "\\u0000", "\\ud83d",
               "\\ude00", "\\u00e9", '\\"', "\\\\", "\\/", "\\n", "\\t", " ", "\n",
               "\u00e9", "\u20ac", "\U0001F600"]
CE_TOKENS = ['"specversion"', '"1.0"', '"id"', '"source"', '"type"', '"subject"', '"time"',
             '"datacontenttype"', '"application/json"', '"application/cloudevents+json"',
             '"data"', '"data_base64"', '"tally.intent.v1"', '"tally.compensate_run.v1"',
             '"tally.cancel_run.v1"', '"run_id"', '"step"', '"tool"', '"args"',
             '"operation_key"', '"tenant"', '"traceparent"', '"reason"', '"compensate"',
             '"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"']
INTAKE_TOKENS = ['"check_balance"', '"charge_card"', '"send_email"', '"update_ledger"',
                 '"wide_two"', '"wide_three"', '"wide_four"', '"request_id"', '"tenant_id"',
                 '"payment_id"', '"message_id"']
REGISTRY_TOKENS = ['"tools"', '"name"', '"owner"', '"description"', '"effect_class"', '"read"',
                   '"idempotent"', '"reversible"', '"append_only"', '"destructive"',
                   '"operation_key"', '"connector"', '"type"', '"http"', '"base_url"',
                   '"execute"', '"status"', '"compensate"', '"contain"', '"method"', '"path"',
                   '"GET"', '"POST"', '"PUT"', '"PATCH"', '"DELETE"', '"timeout_ms"',
                   '"receipt_ref"', '"secret_env"', '"compensation"', '"mode"', '"automatic"',
                   '"approval_required"', '"manual_runbook"', '"not_supported"', '"runbook"',
                   '"retry"', '"max_attempts"', '"backoff_ms"', '"max_backoff_ms"',
                   '"settle_ms"', '"requires_approval"', '"max_concurrency"', "${", ":-", "}",
                   "${TALLY_FUZZ_URL}", "${TALLY_FUZZ_EMPTY:-", "http://", "https://"]
TEXT_TOKENS = ["...", "?", "%", "\u00e9", "\u20ac", "\U0001F600", "\x00", "\x7f"] + MALFORMED


def dict_entry(token):
    raw = token if isinstance(token, bytes) else token.encode()
    return '"' + "".join(chr(b) if 0x20 <= b < 0x7f and b not in b'"\\' else "\\x%02X" % b
                         for b in raw) + '"'


def write_dict(target, tokens):
    os.makedirs(os.path.join(HERE, "dict"), exist_ok=True)
    with open(os.path.join(HERE, "dict", target + ".dict"), "w") as f:
        f.write("# libFuzzer dictionary of fuzz_%s (written by gen_corpus.py)\n" % target)
        for t in tokens:
            f.write(dict_entry(t) + "\n")


def main():
    for target, seeds in (("intent", intent_seeds), ("intake", intake_seeds),
                          ("registry", registry_seeds), ("json_scan", json_scan_seeds),
                          ("canonical", canonical_seeds), ("text", text_seeds),
                          ("bounded", bounded_seeds)):
        c = Corpus(target)
        seeds(c)
        print("corpus/%s: %d files" % (target, len(c.names)))
    write_dict("intent", JSON_TOKENS + CE_TOKENS)
    write_dict("intake", JSON_TOKENS + CE_TOKENS + INTAKE_TOKENS)
    write_dict("registry", JSON_TOKENS + REGISTRY_TOKENS)
    write_dict("json_scan", JSON_TOKENS)
    write_dict("canonical", JSON_TOKENS)
    write_dict("text", TEXT_TOKENS)
    write_dict("bounded", JSON_TOKENS + CE_TOKENS)


if __name__ == "__main__":
    main()
