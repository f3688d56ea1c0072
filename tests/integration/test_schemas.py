"""The message schemas (schemas/*.schema.json) against their README examples and tally itself.

Needs Debian's python3-jsonschema (4.10 has draft 2020-12) and a built `tally` for the
`tally publish --dry-run` checks; no PostgreSQL or Kafka.
"""

import copy
import glob
import json
import os
import re
import subprocess
import unittest

import jsonschema
from jsonschema import Draft202012Validator

SOURCE_DIR = os.environ.get(
    "TALLY_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BUILD_DIR = os.environ.get("TALLY_BUILD_DIR", os.path.join(SOURCE_DIR, "build"))
SCHEMA_DIR = os.path.join(SOURCE_DIR, "schemas")

MESSAGE_SCHEMAS = ("intent", "compensate_run", "cancel_run", "complete_run", "effect_event",
                   "intent_rejected", "run_event", "obligation", "alert", "dlq")
INTENTS_TOPIC = ("intent", "compensate_run", "cancel_run", "complete_run")
# Events tally also sends to a reply topic (docs/agent-protocol.md), with a correlation attribute
REPLY_EVENTS = ("effect_event", "run_event", "intent_rejected")


def load_schema(name):
    with open(os.path.join(SCHEMA_DIR, name + ".schema.json")) as f:
        return json.load(f)


def validator(name):
    return Draft202012Validator(load_schema(name), format_checker=Draft202012Validator.FORMAT_CHECKER)


def readme_example_list():
    """[(schema name, example document)] of every `<!-- example: NAME -->` json block, in order
    (a schema may have several: run_event has one per kind of run event)."""
    with open(os.path.join(SCHEMA_DIR, "README.md")) as f:
        text = f.read()
    return [(m.group(1), json.loads(m.group(2)))
            for m in re.finditer(r"<!-- example: (\w+) -->\s*```json\n(.*?)\n```", text, re.S)]


def readme_examples():
    """{schema name: its first example document}."""
    found = {}
    for name, doc in readme_example_list():
        found.setdefault(name, doc)
    return found


def readme_example(name, event_type):
    """The README example of schema @p name whose CloudEvents type is @p event_type."""
    for n, doc in readme_example_list():
        if n == name and doc.get("type") == event_type:
            return copy.deepcopy(doc)
    raise AssertionError(f"schemas/README.md has no {name} example of type {event_type}")


def text_limit(name):
    """TALLY_LIMIT_<NAME> of common/include/tally/text.h."""
    with open(os.path.join(SOURCE_DIR, "common", "include", "tally", "text.h")) as f:
        m = re.search(r"#define TALLY_LIMIT_%s\s+(\d+)" % name, f.read())
    assert m, f"text.h has no TALLY_LIMIT_{name}"
    return int(m.group(1))


def errors(name, doc):
    return [e.message for e in validator(name).iter_errors(doc)]


def tally_binary():
    path = os.path.join(BUILD_DIR, "tally")
    if not os.path.exists(path):
        raise unittest.SkipTest(f"tally is not built under {BUILD_DIR}")
    return path


def publish(args, stdin=None):
    env = dict(os.environ)
    env.pop("TALLY_KAFKA_BROKERS", None)  # --dry-run must not need a cluster
    return subprocess.run([tally_binary(), "publish"] + args, input=stdin, env=env,
                          capture_output=True, timeout=60)


class SchemasAreSchemas(unittest.TestCase):
    def test_every_schema_is_a_valid_2020_12_schema(self):
        files = sorted(glob.glob(os.path.join(SCHEMA_DIR, "*.schema.json")))
        names = {os.path.basename(f)[:-len(".schema.json")] for f in files}
        self.assertTrue(set(MESSAGE_SCHEMAS) <= names, f"missing: {set(MESSAGE_SCHEMAS) - names}")
        for f in files:
            with self.subTest(schema=os.path.basename(f)):
                with open(f) as fh:
                    schema = json.load(fh)
                self.assertEqual(schema.get("$schema"),
                                 "https://json-schema.org/draft/2020-12/schema")
                Draft202012Validator.check_schema(schema)

    def test_message_schemas_describe_the_cloudevents_envelope(self):
        for name in MESSAGE_SCHEMAS:
            with self.subTest(schema=name):
                schema = load_schema(name)
                for attr in ("specversion", "id", "source", "type", "data"):
                    self.assertIn(attr, schema["required"])
                self.assertEqual(schema["properties"]["specversion"]["const"], "1.0")

    def test_dlq_reasons_match_the_c_header(self):
        with open(os.path.join(SOURCE_DIR, "common", "include", "tally", "cloudevent.h")) as f:
            header = f.read()
        names = re.findall(r"TALLY_DLQ_[A-Z_0-9]+,\s*/\* \"([a-z_0-9]+)\"", header)
        self.assertIn("invalid_utf8", names)
        self.assertIn("invalid_reply_to", names)
        self.assertIn("run_not_active", names)
        # run_not_active answers a message without dead-lettering it: not a DLQ reason
        reason = load_schema("dlq")["properties"]["data"]["properties"]["reason"]
        self.assertEqual(sorted(reason["enum"]), sorted(set(names) - {"run_not_active"}))
        rejected = load_schema("intent_rejected")["properties"]["data"]["properties"]["reason"]
        self.assertEqual(sorted(rejected["enum"]), sorted(names))

    def test_reply_attributes_are_the_same_on_every_intents_topic_message(self):
        first = load_schema(INTENTS_TOPIC[0])["properties"]
        for name in INTENTS_TOPIC:
            with self.subTest(schema=name):
                props = load_schema(name)["properties"]
                for attr in ("replytopic", "replypartition", "correlationid"):
                    self.assertIn(attr, props)
                    self.assertEqual(props[attr], first[attr])
                    self.assertNotIn(attr, load_schema(name)["required"])
                self.assertEqual(props["replytopic"]["maxLength"], text_limit("REPLY_TOPIC"))
                self.assertEqual(props["correlationid"]["maxLength"], text_limit("CORRELATION"))
        for name in REPLY_EVENTS:
            with self.subTest(schema=name):
                schema = load_schema(name)
                self.assertNotIn("additionalProperties", schema)
                for attr in ("correlationid", "correlationidbase64"):
                    self.assertIn(attr, schema["properties"])
                    self.assertNotIn(attr, schema["required"])
                self.assertEqual(schema["properties"]["correlationid"]["maxLength"],
                                 text_limit("CORRELATION"))

    def test_complete_run_limits_match_the_c_header(self):
        data = load_schema("complete_run")["properties"]["data"]
        self.assertEqual(data["required"], ["run_id"])
        self.assertEqual(data["properties"]["reason"]["maxLength"], text_limit("REASON"))
        self.assertEqual(data["properties"]["run_id"],
                         load_schema("cancel_run")["properties"]["data"]["properties"]["run_id"])
        self.assertEqual(data["properties"]["run_id"]["maxLength"], text_limit("RUN_ID"))


class ReadmeExamples(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.examples = readme_examples()

    def test_there_is_an_example_for_every_message_schema(self):
        self.assertEqual(sorted(self.examples), sorted(MESSAGE_SCHEMAS))

    def test_examples_validate(self):
        for i, (name, doc) in enumerate(readme_example_list()):
            with self.subTest(example=name, block=i):
                self.assertEqual(errors(name, doc), [])

    def test_every_run_event_type_but_stuck_has_an_example(self):
        types = {doc["type"] for name, doc in readme_example_list() if name == "run_event"}
        self.assertEqual(types, {"tally.run.compensated.v1", "tally.run.completed.v1",
                                 "tally.run.cancelled.v1"})

    def test_schemas_are_not_vacuous(self):
        """Each schema refuses an obviously wrong variant of its own example."""
        def broken(name, mutate):
            doc = copy.deepcopy(self.examples[name])
            mutate(doc)
            return list(validator(name).iter_errors(doc))

        cases = {
            "intent": [lambda d: d["data"].__setitem__("step", -1),
                       lambda d: d["data"].__setitem__("step", True),
                       lambda d: d["data"].pop("args"),
                       lambda d: d["data"].__setitem__("args", []),
                       lambda d: d["data"].__setitem__("run_id", ""),
                       lambda d: d["data"].__setitem__("operation_key", ""),
                       lambda d: d["data"].__setitem__("traceparent", "00-" + "0" * 32 + "-00f067aa0ba902b7-01"),
                       lambda d: d.__setitem__("specversion", "0.3"),
                       lambda d: d.__setitem__("type", "tally.intent.v2")],
            "compensate_run": [lambda d: d["data"].pop("reason"),
                               lambda d: d.__setitem__("replytopic", ""),
                               lambda d: d["data"].__setitem__("deadline_ms", 999),
                               lambda d: d["data"].__setitem__("deadline_ms", "24h")],
            "cancel_run": [lambda d: d["data"].__setitem__("compensate", "yes"),
                           lambda d: d.__setitem__("correlationid", 7)],
            "complete_run": [lambda d: d["data"].pop("run_id"),
                             lambda d: d["data"].__setitem__("run_id", ""),
                             lambda d: d["data"].__setitem__("run_id", "a\tb"),
                             lambda d: d["data"].__setitem__("run_id", "r" * 201),
                             lambda d: d["data"].__setitem__("reason", 5),
                             lambda d: d["data"].__setitem__("reason", "x" * 4097),
                             lambda d: d["data"].__setitem__("traceparent", "01-x"),
                             lambda d: d.__setitem__("type", "tally.complete_run.v2"),
                             lambda d: d.__setitem__("replytopic", "tally.replies.bot 1"),
                             lambda d: d.__setitem__("replytopic", "t" * 250),
                             lambda d: d.__setitem__("replytopic", None),
                             lambda d: d.__setitem__("replypartition", -1),
                             lambda d: d.__setitem__("replypartition", 2147483648),
                             lambda d: d.__setitem__("replypartition", "2147483648"),
                             lambda d: d.__setitem__("replypartition", "9999999999"),
                             lambda d: d.__setitem__("replypartition", "12a"),
                             lambda d: d.__setitem__("replypartition", ""),
                             lambda d: d.__setitem__("replypartition", 1.5),
                             lambda d: d.__setitem__("correlationid", ""),
                             lambda d: d.__setitem__("correlationid", "c" * 257),
                             lambda d: d.__setitem__("correlationid", None)],
            "intent_rejected": [lambda d: d["data"].__setitem__("status", "CONFLICT"),
                                lambda d: d["data"].__setitem__("status", "rejected"),
                                lambda d: d["data"].__setitem__("reason", "bad_vibes"),
                                lambda d: d["data"].pop("field"),
                                lambda d: d["data"].pop("dlq"),
                                lambda d: d["data"].pop("detail"),
                                lambda d: d["data"].pop("intent_id"),
                                lambda d: d["data"].__setitem__("step", True),
                                lambda d: d["data"].__setitem__("tool", ""),
                                lambda d: d["data"]["dlq"].pop("offset"),
                                # run_not_active is never dead-lettered; every other reason is
                                lambda d: d["data"].__setitem__("reason", "run_not_active"),
                                lambda d: d["data"].__setitem__("dlq", None),
                                lambda d: d.__setitem__("correlationidbase64", "AAE="),
                                lambda d: d.__setitem__("correlationid", "a\nb"),
                                lambda d: d.__setitem__("type", "tally.intent.refused.v1")],
            "effect_event": [lambda d: d["data"].pop("intent_id"),
                             lambda d: d["data"].pop("receipt"),
                             lambda d: d["data"].__setitem__("error", {"code": "x"}),
                             lambda d: d["data"].__setitem__("status", "DONE"),
                             lambda d: d.__setitem__("type", "tally.effect.exploded.v1"),
                             # the correlation attribute of a copy sent to a reply topic
                             lambda d: d.__setitem__("correlationid", ""),
                             lambda d: d.__setitem__("correlationid", "a\x7fb"),
                             lambda d: d.__setitem__("correlationidbase64", "YQ"),
                             lambda d: d.update(correlationid="a", correlationidbase64="YQ==")],
            "run_event": [lambda d: d["data"]["summary"].pop("failed"),
                          lambda d: d["data"]["summary"]["compensated"][0].pop("tool"),
                          lambda d: d["data"].pop("summary"),
                          lambda d: d["data"].__setitem__("status", "COMPLETED"),
                          lambda d: d["data"].__setitem__("summary", {
                              "total": 1, "effects": {"CONFIRMED": 1}, "open": [],
                              "open_count": 0}),
                          lambda d: d.__setitem__("correlationidbase64", "%%%"),
                          lambda d: d.__setitem__("type", "tally.run.finished.v1")],
            "obligation": [lambda d: d["data"].__setitem__("reason", "whim")],
            "alert": [lambda d: (d["data"].pop("effect_id"), d["data"].pop("obligation_id")),
                      lambda d: d["data"].pop("resolve_command"),
                      # the console link: an http(s) URL to a run or to the queues, nothing else
                      lambda d: d["data"].__setitem__("console_url", "javascript:alert(1)"),
                      lambda d: d["data"].__setitem__("console_url", None),
                      lambda d: d["data"].__setitem__(
                          "console_url", "https://tally.example.com/console/runs/a/b"),
                      lambda d: d["data"].__setitem__(
                          "console_url", "https://tally.example.com/console/runs/a b")],
            "dlq": [lambda d: d["data"].__setitem__("original_base64", "e30="),
                    lambda d: d["data"].pop("original"),
                    lambda d: d["data"].__setitem__("reason", "bad_vibes")],
        }
        for name, mutations in cases.items():
            for i, mutate in enumerate(mutations):
                with self.subTest(example=name, mutation=i):
                    self.assertNotEqual(broken(name, mutate), [])
        # and accepts the copy of an event sent to a reply topic
        for name in REPLY_EVENTS:
            for attr, value in (("correlationid", "req-0042 \u00e9"),
                                ("correlationidbase64", "AP8=")):
                with self.subTest(example=name, attr=attr):
                    doc = copy.deepcopy(self.examples[name])
                    doc.pop("correlationid", None)
                    doc[attr] = value
                    self.assertEqual(errors(name, doc), [])

    def test_run_completed_needs_its_summary(self):
        base = readme_example("run_event", "tally.run.completed.v1")
        self.assertEqual(errors("run_event", base), [])
        for i, mutate in enumerate([
                lambda d: d["data"].pop("summary"),
                lambda d: d["data"].pop("reason"),
                lambda d: d["data"].__setitem__("reason", "whim"),
                lambda d: d["data"].__setitem__("status", "CANCELLED"),
                lambda d: d["data"]["summary"].pop("open_count"),
                lambda d: d["data"]["summary"].pop("effects"),
                lambda d: d["data"]["summary"].__setitem__("total", -1),
                lambda d: d["data"]["summary"]["effects"].__setitem__("DONE", 1),
                lambda d: d["data"]["summary"]["effects"].__setitem__("FAILED", "1"),
                lambda d: d["data"]["summary"]["open"][0].__setitem__("status", "CONFIRMED"),
                lambda d: d["data"]["summary"]["open"][0].pop("effect_id"),
                lambda d: d["data"]["summary"]["open"][0].__setitem__("step", -1),
                lambda d: d["data"]["summary"].__setitem__(
                    "open", d["data"]["summary"]["open"] * 101),
                # a compensation summary is not a completion summary
                lambda d: d["data"].__setitem__("summary", {
                    "compensated": [], "uncompensatable": [], "skipped": [], "failed": []})]):
            with self.subTest(mutation=i):
                doc = copy.deepcopy(base)
                mutate(doc)
                self.assertNotEqual(errors("run_event", doc), [])
        ok = copy.deepcopy(base)
        ok["data"]["reason"] = "idle_timeout"
        ok["data"]["summary"] = {"total": 0, "effects": {}, "open": [], "open_count": 0}
        ok["correlationid"] = "req-9"
        self.assertEqual(errors("run_event", ok), [])

    def test_run_cancelled_and_stuck(self):
        base = readme_example("run_event", "tally.run.cancelled.v1")
        self.assertEqual(errors("run_event", base), [])
        for i, mutate in enumerate([
                lambda d: d["data"].pop("effects_cancelled"),
                lambda d: d["data"].__setitem__("effects_cancelled", -1),
                lambda d: d["data"].__setitem__("status", "ACTIVE"),
                lambda d: d["data"].__setitem__("status", "DONE"),
                lambda d: d["data"].pop("run_id")]):
            with self.subTest(mutation=i):
                doc = copy.deepcopy(base)
                mutate(doc)
                self.assertNotEqual(errors("run_event", doc), [])
        # a cancel_run of a run that is already over answers with the run's own status
        over = copy.deepcopy(base)
        over["data"].update(status="COMPLETED", effects_cancelled=0)
        self.assertEqual(errors("run_event", over), [])

        # the compensated and stuck rules are what they were: the summary and its four lists
        stuck = readme_example("run_event", "tally.run.compensated.v1")
        stuck["type"] = "tally.run.stuck.v1"
        stuck["data"]["status"] = "STUCK"
        self.assertEqual(errors("run_event", stuck), [])
        for i, mutate in enumerate([
                lambda d: d["data"].pop("summary"),
                lambda d: d["data"]["summary"].pop("skipped"),
                lambda d: d["data"]["summary"]["failed"].append({"effect_id": "x"}),
                lambda d: d["data"].__setitem__("status", "COMPLETED"),
                lambda d: d["data"].__setitem__("status", "COMPLETING")]):
            with self.subTest(stuck_mutation=i):
                doc = copy.deepcopy(stuck)
                mutate(doc)
                self.assertNotEqual(errors("run_event", doc), [])

    def test_reply_attributes_accept_what_the_protocol_allows(self):
        base = copy.deepcopy(self.examples["complete_run"])
        for name in INTENTS_TOPIC:
            with self.subTest(schema=name):
                doc = copy.deepcopy(self.examples[name])
                doc.update(replytopic="tally.replies.a-b_c.9", replypartition="2147483647",
                           correlationid="\u00e9" * 256)
                self.assertEqual(errors(name, doc), [])
        for value in (0, 2147483647, "0", "7", "0000000012", "2147483647", "1999999999", None):
            with self.subTest(replypartition=value):
                self.assertEqual(errors("complete_run", dict(base, replypartition=value)), [])
        bare = {k: v for k, v in base.items()
                if k not in ("replytopic", "replypartition", "correlationid")}
        self.assertEqual(errors("complete_run", bare), [])
        bare["data"] = {"run_id": "r-1"}  # reason is optional
        self.assertEqual(errors("complete_run", bare), [])
        bare["data"]["reason"] = None
        self.assertEqual(errors("complete_run", bare), [])

    def test_intent_rejected_variants(self):
        base = self.examples["intent_rejected"]
        not_active = copy.deepcopy(base)
        not_active.pop("correlationid")
        not_active["data"].update(reason="run_not_active", field="data.run_id", dlq=None,
                                  tool="charge_card",
                                  detail="run run-2024-05-01-0042 is COMPLETED: it takes no new intents")
        self.assertEqual(errors("intent_rejected", not_active), [])
        # what could be read of a malformed message: no step, tool or type, bytes as base64
        bare = copy.deepcopy(base)
        bare.pop("correlationid")
        bare["correlationidbase64"] = "AP8="
        bare["data"].update(step=None, tool=None, type=None, field=None, reason="invalid_reply_to")
        self.assertEqual(errors("intent_rejected", bare), [])
        bare["data"].update(step="-1", reason="not_cloudevent")
        self.assertEqual(errors("intent_rejected", bare), [])


class PublishAgreesWithTheSchemas(unittest.TestCase):
    def test_intents_topic_examples_pass_the_dispatcher_check(self):
        examples = readme_examples()
        for name in INTENTS_TOPIC:
            with self.subTest(example=name):
                doc = json.dumps(examples[name]).encode()
                r = publish(["--stdin", "--dry-run"], stdin=doc)
                self.assertEqual(r.returncode, 0, r.stderr.decode())
                self.assertEqual(json.loads(r.stdout), examples[name])

    def test_published_events_validate(self):
        built = {
            "intent": ["--run", "r-1", "--step", "3", "--tool", "charge_card",
                       "--args", '{"payment_id": "p1"}', "--operation-key", "k1", "--tenant", "t1",
                       "--traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"],
            "compensate_run": ["--type", "compensate_run", "--run", "r-1", "--reason", "undo"],
            "cancel_run": ["--type", "cancel_run", "--run", "r-1", "--reason", "stop",
                           "--compensate"],
        }
        for name, args in built.items():
            with self.subTest(type=name):
                r = publish(args + ["--dry-run"])
                self.assertEqual(r.returncode, 0, r.stderr.decode())
                doc = json.loads(r.stdout)
                self.assertEqual([e.message for e in validator(name).iter_errors(doc)], [])
        r = publish(built["intent"] + ["--dry-run"])
        doc = json.loads(r.stdout)
        self.assertEqual(doc["data"]["step"], 3)  # all digits: an integer
        self.assertEqual(doc["data"]["run_id"], "r-1")
        self.assertEqual(doc["subject"], "r-1")

    def test_publish_builds_complete_run(self):
        r = publish(["--type", "complete_run", "--run", "r-1", "--reason", "done", "--dry-run"])
        if r.returncode == 2 and b"complete_run" in r.stderr:
            self.skipTest("this tally publish has no --type complete_run")
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        doc = json.loads(r.stdout)
        self.assertEqual(errors("complete_run", doc), [])
        self.assertEqual(doc["type"], "tally.complete_run.v1")
        self.assertEqual(doc["data"]["run_id"], "r-1")
        r = publish(["--type", "complete_run", "--run", "r-1", "--dry-run"])  # no reason
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        self.assertEqual(errors("complete_run", json.loads(r.stdout)), [])

    def test_complete_run_reason_is_optional_for_the_dispatcher_check_too(self):
        doc = readme_examples()["complete_run"]
        doc["data"].pop("reason")
        self.assertEqual(errors("complete_run", doc), [])
        r = publish(["--stdin", "--dry-run"], stdin=json.dumps(doc).encode())
        self.assertEqual(r.returncode, 0, r.stderr.decode())
        doc["data"]["reason"] = 5
        self.assertNotEqual(errors("complete_run", doc), [])
        r = publish(["--stdin", "--dry-run"], stdin=json.dumps(doc).encode())
        self.assertEqual(r.returncode, 6)  # refused before publishing
        self.assertIn(b"invalid_field", r.stderr)
        self.assertIn(b"data.reason", r.stderr)

    def test_refusals_name_the_field(self):
        r = publish(["--run", "r", "--step", "1", "--tool", "t", "--args", "[1]", "--dry-run"])
        self.assertEqual(r.returncode, 6)  # refused before publishing
        self.assertIn(b"invalid_field", r.stderr)
        self.assertIn(b"data.args must be a JSON object", r.stderr)
        self.assertEqual(r.stdout, b"")

        doc = readme_examples()["intent"]
        doc["data"]["step"] = True
        self.assertNotEqual(list(validator("intent").iter_errors(doc)), [])
        r = publish(["--stdin", "--dry-run"], stdin=json.dumps(doc).encode())
        self.assertEqual(r.returncode, 6)
        self.assertIn(b"data.step must be a string or a non-negative integer", r.stderr)

        r = publish(["--stdin", "--dry-run"], stdin=b'{"a": "\xed\xa0\x80"}')
        self.assertEqual(r.returncode, 6)
        self.assertIn(b"invalid_utf8", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
