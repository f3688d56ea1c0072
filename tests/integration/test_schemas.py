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

MESSAGE_SCHEMAS = ("intent", "compensate_run", "cancel_run", "effect_event", "run_event",
                   "obligation", "alert", "dlq")
INTENTS_TOPIC = ("intent", "compensate_run", "cancel_run")


def load_schema(name):
    with open(os.path.join(SCHEMA_DIR, name + ".schema.json")) as f:
        return json.load(f)


def validator(name):
    return Draft202012Validator(load_schema(name), format_checker=Draft202012Validator.FORMAT_CHECKER)


def readme_examples():
    """{schema name: example document} from the `<!-- example: NAME -->` json blocks."""
    with open(os.path.join(SCHEMA_DIR, "README.md")) as f:
        text = f.read()
    found = {}
    for m in re.finditer(r"<!-- example: (\w+) -->\s*```json\n(.*?)\n```", text, re.S):
        found[m.group(1)] = json.loads(m.group(2))
    return found


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
        reason = load_schema("dlq")["properties"]["data"]["properties"]["reason"]
        self.assertEqual(sorted(reason["enum"]), sorted(names))


class ReadmeExamples(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.examples = readme_examples()

    def test_there_is_an_example_for_every_message_schema(self):
        self.assertEqual(sorted(self.examples), sorted(MESSAGE_SCHEMAS))

    def test_examples_validate(self):
        for name, doc in self.examples.items():
            with self.subTest(example=name):
                errors = [e.message for e in validator(name).iter_errors(doc)]
                self.assertEqual(errors, [])

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
            "compensate_run": [lambda d: d["data"].pop("reason")],
            "cancel_run": [lambda d: d["data"].__setitem__("compensate", "yes")],
            "effect_event": [lambda d: d["data"].pop("intent_id"),
                             lambda d: d["data"].pop("receipt"),
                             lambda d: d["data"].__setitem__("error", {"code": "x"}),
                             lambda d: d["data"].__setitem__("status", "DONE"),
                             lambda d: d.__setitem__("type", "tally.effect.exploded.v1")],
            "run_event": [lambda d: d["data"]["summary"].pop("failed"),
                          lambda d: d["data"]["summary"]["compensated"][0].pop("tool")],
            "obligation": [lambda d: d["data"].__setitem__("reason", "whim")],
            "alert": [lambda d: (d["data"].pop("effect_id"), d["data"].pop("obligation_id")),
                      lambda d: d["data"].pop("resolve_command")],
            "dlq": [lambda d: d["data"].__setitem__("original_base64", "e30="),
                    lambda d: d["data"].pop("original"),
                    lambda d: d["data"].__setitem__("reason", "bad_vibes")],
        }
        for name, mutations in cases.items():
            for i, mutate in enumerate(mutations):
                with self.subTest(example=name, mutation=i):
                    self.assertNotEqual(broken(name, mutate), [])


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

    def test_refusals_name_the_field(self):
        r = publish(["--run", "r", "--step", "1", "--tool", "t", "--args", "[1]", "--dry-run"])
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"invalid_field", r.stderr)
        self.assertIn(b"data.args must be a JSON object", r.stderr)
        self.assertEqual(r.stdout, b"")

        doc = readme_examples()["intent"]
        doc["data"]["step"] = True
        self.assertNotEqual(list(validator("intent").iter_errors(doc)), [])
        r = publish(["--stdin", "--dry-run"], stdin=json.dumps(doc).encode())
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"data.step must be a string or a non-negative integer", r.stderr)

        r = publish(["--stdin", "--dry-run"], stdin=b'{"a": "\xed\xa0\x80"}')
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"invalid_utf8", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
