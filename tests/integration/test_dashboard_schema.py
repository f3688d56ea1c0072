"""The Grafana dashboard (deploy/grafana/dashboards/tally.json) against Grafana's own types:
the dashboard, panel, field-config, variable and Prometheus-query types that Grafana publishes
in the npm package @grafana/schema, pinned to 10.4.2 like the compose image. Grafana itself is
not packaged for Debian; this is the check of the JSON that does not come from us.

tests/grafana-schema is copied to a temporary directory and installed from its lock (`npm ci`);
the test writes dashboard.ts there, `export const dashboard: TallyDashboard = <tally.json>;`,
and runs its strict tsc (no emit). The JSON is checked as an object literal, so a value of the
wrong type, a missing required field and a key the types do not know are all compiler errors;
check.ts says where it departs from @grafana/schema's `Dashboard` and why. The second case
proves the check can fail: copies of the JSON with a wrong type, an unknown key and a misspelt
value must each be rejected, with tsc's message.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import tallytest
from test_client_ts import npm

PROJECT = os.path.join(tallytest.SOURCE_DIR, "tests", "grafana-schema")
DASHBOARD = os.path.join(tallytest.SOURCE_DIR, "deploy", "grafana", "dashboards", "tally.json")
GRAFANA = "10.4.2"  # deploy/compose/compose.yaml: grafana/grafana-oss:10.4.2


class DashboardSchemaTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.build = tempfile.mkdtemp(prefix="tally-grafana-schema-")
        for name in ("package.json", "package-lock.json", "tsconfig.json", "check.ts"):
            shutil.copy(os.path.join(PROJECT, name), cls.build)
        npm(["ci"], cls.build)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.build, ignore_errors=True)

    def tsc(self, json_text):
        """Type-check JSON_TEXT as the dashboard: (exit status, tsc's output)."""
        with open(os.path.join(self.build, "dashboard.ts"), "w") as f:
            f.write('import type { TallyDashboard } from "./check";\n\n'
                    f"export const dashboard: TallyDashboard = {json_text.rstrip()};\n")
        out = subprocess.run([os.path.join(self.build, "node_modules", ".bin", "tsc"), "-p", "."],
                             cwd=self.build, capture_output=True, text=True, timeout=300)
        return out.returncode, out.stdout + out.stderr

    def test_the_types_are_grafana_10_4s(self):
        with open(os.path.join(self.build, "node_modules", "@grafana", "schema",
                               "package.json")) as f:
            self.assertEqual(json.load(f)["version"], GRAFANA)
        with open(os.path.join(tallytest.SOURCE_DIR, "deploy", "compose", "compose.yaml")) as f:
            self.assertIn(f"grafana/grafana-oss:{GRAFANA}", f.read())

    def test_tally_json_has_grafanas_dashboard_types(self):
        with open(DASHBOARD) as f:
            status, out = self.tsc(f.read())
        self.assertEqual(status, 0, f"tally.json does not type-check as Grafana {GRAFANA}'s "
                                    f"Dashboard (tests/grafana-schema/check.ts):\n{out}")

    def test_a_wrong_type_an_unknown_key_or_a_misspelt_value_is_rejected(self):
        with open(DASHBOARD) as f:
            text = f.read()
        dash = json.loads(text)
        top = dict(dash, refreshInterval="5s")
        cases = [
            ("gridPos.h a string", re.sub(r'"h": (\d+)', r'"h": "\1"', text, count=1),
             "error TS2322: Type 'string' is not assignable to type 'number'."),
            ("an unknown top-level key", json.dumps(top, indent=2),
             "error TS2353: Object literal may only specify known properties, and "
             "'\"refreshInterval\"' does not exist in type"),
            ("a misspelt color mode", text.replace('"palette-classic"', '"palette-clasic"', 1),
             "Did you mean '\"palette-classic\"'?"),
            ("an unknown key in a Prometheus query",
             text.replace('"legendFormat":', '"legendFromat":', 1),
             "'\"legendFromat\"' does not exist in type"),
        ]
        for what, bad, message in cases:
            with self.subTest(what):
                self.assertNotEqual(bad, text)
                status, out = self.tsc(bad)
                self.assertNotEqual(status, 0, out)
                self.assertIn(message, out)
                self.assertRegex(out, r"^dashboard\.ts\(\d+,\d+\): error TS\d+: ")


if __name__ == "__main__":
    tallytest.main()
