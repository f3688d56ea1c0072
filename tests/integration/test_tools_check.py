"""`tally tools check` and `tally tools list` on the shipped registries.

No database or Kafka is needed: this is a plain unittest.TestCase that runs the built `tally`
binary and checks what an operator sees: exit codes and one line per problem naming the rule.
"""

import glob
import json
import os
import subprocess
import tempfile
import unittest

from tallytest import SOURCE_DIR, binary

TOOLS_DIR = os.path.join(SOURCE_DIR, "examples", "tools")
DEMO = os.path.join(TOOLS_DIR, "demo.json")
INVALID = sorted(glob.glob(os.path.join(TOOLS_DIR, "invalid", "*.json")))


def tally(*args, env_extra=None):
    env = dict(os.environ)
    # The registries must not depend on the caller's environment.
    for var in ("TALLY_FAKE_TOOL_URL", "TALLY_EXAMPLE_UNSET_URL", "TALLY_TOOLS"):
        env.pop(var, None)
    env.update(env_extra or {})
    return subprocess.run([binary("tally"), *args], capture_output=True, text=True, env=env,
                          timeout=60)


class ToolsCheck(unittest.TestCase):

    def test_demo_registry_is_valid(self):
        out = tally("tools", "check", DEMO)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        # valid, with one warning: charge_card signs with the legacy Tally-Signature alone
        self.assertEqual(out.stdout.strip().splitlines(), [
            f"{DEMO}: warning: tool 'charge_card': rule legacy-signature: connector.secret_env"
            " alone signs with the legacy Tally-Signature, which covers only the timestamp and"
            " the body (not the method, URL or idempotency key); add connector.signing"
            ' {"scheme": "rfc9421", ...} (docs/connectors.md)',
            f"{DEMO}: ok (7 tools)"])

    def test_every_invalid_example_is_refused_naming_its_rule(self):
        self.assertGreaterEqual(len(INVALID), 20)
        for path in INVALID:
            with self.subTest(file=os.path.basename(path)):
                with open(path) as f:
                    rule = json.load(f)["expect_rule"]
                out = tally("tools", "check", path)
                self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
                lines = out.stdout.splitlines()
                self.assertTrue(lines, "no problem printed")
                for line in lines:
                    self.assertTrue(line.startswith(f"{path}: "), line)
                self.assertTrue(any(f": rule {rule}: " in line for line in lines),
                                f"no line names rule {rule}:\n{out.stdout}")

    def test_several_files_and_problems_at_once(self):
        bad = os.path.join(TOOLS_DIR, "invalid", "reversible-without-compensate.json")
        with tempfile.TemporaryDirectory() as tmp:
            many = os.path.join(tmp, "many.json")
            with open(many, "w") as f:
                json.dump({"tools": [
                    {"name": "refund_card", "effect_class": "reversible",
                     "connector": {"type": "http", "base_url": "http://127.0.0.1:9000",
                                   "execute": {"method": "POST", "path": "/refunds"}}},
                    {"name": "wipe", "effect_class": "destructive", "requires_approval": False,
                     "connector": {"type": "http", "base_url": "http://127.0.0.1:9000",
                                   "execute": {"method": "POST", "path": "/wipes"},
                                   "timeout_ms": 0}},
                ]}, f)
            out = tally("tools", "check", DEMO, bad, many)
        self.assertEqual(out.returncode, 1, out.stderr)
        lines = out.stdout.splitlines()
        self.assertIn(f"{DEMO}: ok (7 tools)", lines)
        self.assertIn(f"{bad}: tool 'charge_card': rule reversible-needs-compensate: "
                      "a reversible tool must declare connector.compensate (the reverse call)",
                      lines)
        many_lines = [line for line in lines if line.startswith(many)]
        for want in ("tool 'refund_card': rule reversible-needs-compensate:",
                     "tool 'refund_card': rule reversible-needs-status:",
                     "tool 'wipe': rule destructive-requires-approval:",
                     "tool 'wipe': rule numeric-range: connector.timeout_ms"):
            self.assertTrue(any(want in line for line in many_lines), f"{want}\n{out.stdout}")
        self.assertEqual(len(many_lines), 4, out.stdout)

    def test_base_url_comes_from_the_environment(self):
        unset = os.path.join(TOOLS_DIR, "invalid", "base-url-unset-env.json")
        out = tally("tools", "check", unset,
                    env_extra={"TALLY_EXAMPLE_UNSET_URL": "http://billing.internal"})
        self.assertEqual(out.returncode, 0, out.stdout)
        out = tally("tools", "check", DEMO, env_extra={"TALLY_FAKE_TOOL_URL": "gopher://x"})
        self.assertEqual(out.returncode, 1)
        self.assertIn("rule connector-base-url: connector.base_url 'gopher://x' "
                      "(from '${TALLY_FAKE_TOOL_URL:-http://127.0.0.1:9000}')", out.stdout)

    def test_unreadable_and_malformed_files(self):
        with tempfile.TemporaryDirectory() as tmp:
            broken = os.path.join(tmp, "broken.json")
            with open(broken, "w") as f:
                f.write('{"tools": [}')
            missing = os.path.join(tmp, "missing.json")
            out = tally("tools", "check", broken, missing)
        self.assertEqual(out.returncode, 1)
        self.assertIn(f"{broken}: registry: rule json: not valid JSON at line 1", out.stdout)
        self.assertIn(f"{missing}: registry: rule file: cannot read the registry", out.stdout)

    def test_usage(self):
        for args in (("tools", "--help"), ("tools", "check", "--help"),
                     ("tools", "list", "--help")):
            out = tally(*args)
            self.assertEqual(out.returncode, 0, args)
            self.assertIn("usage: tally tools", out.stdout)
        for args in (("tools",), ("tools", "frob"),
                     ("tools", "check", "--bogus", DEMO), ("tools", "list", DEMO, DEMO)):
            out = tally(*args)
            self.assertEqual(out.returncode, 2, args)
            self.assertIn("usage: tally tools", out.stderr)
            self.assertEqual(out.stdout, "", args)
        # Without FILE, TALLY_TOOLS names the registry, as for the workers.
        out = tally("tools", "check", env_extra={"TALLY_TOOLS": DEMO})
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertEqual(out.stdout.strip().splitlines()[-1], f"{DEMO}: ok (7 tools)")
        missing = os.path.join(tempfile.gettempdir(), "no-such-registry.json")
        out = tally("tools", "list", env_extra={"TALLY_TOOLS": missing})
        self.assertEqual(out.returncode, 1)
        self.assertIn(f"{missing}: registry: rule file:", out.stdout)

    def test_list(self):
        out = tally("tools", "list", DEMO)
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(lines[0].split()[:4], ["NAME", "CLASS", "APPROVAL", "COMPENSATION"])
        rows = {line.split()[0]: line for line in lines[1:]}
        self.assertEqual(set(rows), {"check_balance", "charge_card", "create_hold", "send_email",
                                     "update_ledger", "delete_account", "refund_manual"})
        self.assertIn("compensate POST /charges/reverse", rows["charge_card"])
        self.assertIn("contain POST /emails/contain", rows["send_email"])
        self.assertEqual(rows["delete_account"].split()[1:3], ["destructive", "yes"])
        self.assertIn("manual_runbook", rows["refund_manual"])
        bad = os.path.join(TOOLS_DIR, "invalid", "duplicate-name.json")
        out = tally("tools", "list", bad)
        self.assertEqual(out.returncode, 1)
        self.assertIn("rule unique-name", out.stdout)

    def test_schema_accepts_demo_and_shape_errors(self):
        try:
            import jsonschema
        except ImportError:
            self.skipTest("python3-jsonschema is not installed")
        with open(os.path.join(SOURCE_DIR, "schemas", "registry.schema.json")) as f:
            schema = json.load(f)
        jsonschema.Draft202012Validator.check_schema(schema)
        validator = jsonschema.Draft202012Validator(schema)
        with open(DEMO) as f:
            validator.validate(json.load(f))
        # The schema refuses what it can express; unique names, ${VAR} expansion and comparing
        # two fields are tally's own checks.
        schema_blind = {"duplicate-name.json", "base-url-unset-env.json",
                        "max-backoff-below-backoff.json"}
        for path in INVALID:
            if os.path.basename(path) in schema_blind:
                continue
            with open(path) as f:
                doc = json.load(f)
            with self.subTest(file=os.path.basename(path)):
                self.assertFalse(validator.is_valid(doc), f"the schema accepts {path}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
