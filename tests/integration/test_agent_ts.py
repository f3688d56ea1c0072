"""The TypeScript example agent (examples/agent-ts; docs/agents.md, "Publishing from
TypeScript") against a real dispatcher and the fake tool. It is built as its users build it
(`npm ci`, `npm run build`: the TypeScript compiler in strict mode) from a copy of the example,
then run: it publishes a run of two steps, reads each answer by its intent id, and publishes
step 2 again, which must be answered with the same effect and must not reach the tool twice.
"""

import json
import os
import shutil
import subprocess
import tempfile

import tallytest
from dispatchcase import DispatchCase

EXAMPLE = os.path.join(tallytest.SOURCE_DIR, "examples", "agent-ts")


def npm(args, cwd):
    out = subprocess.run(["npm", *args, "--no-audit", "--no-fund"], cwd=cwd,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise AssertionError(f"npm {' '.join(args)} failed ({out.returncode}):\n"
                             f"{out.stdout[-4000:]}\n{out.stderr[-4000:]}")


class AgentTsTest(DispatchCase):

    @classmethod
    def setUpClass(cls):
        cls.build = tempfile.mkdtemp(prefix="tally-agent-ts-")
        for name in ("package.json", "package-lock.json", "tsconfig.json"):
            shutil.copy(os.path.join(EXAMPLE, name), cls.build)
        shutil.copytree(os.path.join(EXAMPLE, "src"), os.path.join(cls.build, "src"))
        npm(["ci"], cls.build)
        npm(["run", "build"], cls.build)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.build, ignore_errors=True)

    def test_publishes_reads_its_answers_and_a_replay_is_the_same_effect(self):
        self.dispatcher()
        out = subprocess.run(["node", os.path.join("dist", "main.js")], cwd=self.build,
                             env=self.env(), capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        answers = [json.loads(line) for line in out.stdout.splitlines()]
        self.assertEqual([(a["label"], a["step"], a["tool"], a["status"]) for a in answers],
                         [("step 1", 1, "check_balance", "CONFIRMED"),
                          ("step 2", 2, "update_ledger", "CONFIRMED"),
                          ("step 2 again", 2, "update_ledger", "CONFIRMED")])
        first, second, replay = answers
        self.assertEqual(replay["effect_id"], second["effect_id"])
        self.assertNotEqual(replay["intent_id"], second["intent_id"])
        self.assertTrue(all(a["type"] == "tally.effect.confirmed.v1" for a in answers))

        # The ledger and the tool agree, and the replay called nothing.
        run_id = first["run_id"]
        rows = self.query("SELECT effect_id::text, status, external_ref, intent_id, traceparent"
                          " FROM effects WHERE run_id = %s ORDER BY step", (run_id,))
        self.assertEqual([(r[0], r[1], r[2], r[3]) for r in rows],
                         [(a["effect_id"], "CONFIRMED", a["external_ref"], a["intent_id"])
                          for a in (first, second)])
        reqs = [r for r in self.requests() if r["run_id"] == run_id]
        self.assertEqual(sorted(r["collection"] for r in reqs),
                         ["balance_checks", "ledger_entries"])
        records = {r["id"]: r for r in self.records()}
        self.assertEqual(records[second["external_ref"]]["run_id"], run_id)
        # The trace the agent started reaches the tool (one trace id for the run).
        self.assertTrue(all(r["traceparent"] for r in reqs), reqs)
        traces = {r["traceparent"].split("-")[1] for r in reqs}
        self.assertEqual(len(traces), 1, reqs)
        self.assertEqual({row[4].split("-")[1] for row in rows}, traces)
        self.invariants()


if __name__ == "__main__":
    tallytest.main()
