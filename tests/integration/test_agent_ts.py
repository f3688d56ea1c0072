"""The TypeScript example agent (examples/agent-ts; docs/agents.md, "Publishing from
TypeScript") against a real dispatcher and the fake tool. It is built as its users build it
(`npm ci`, `npm run build`: the TypeScript compiler in strict mode) from a copy of the example
and of the client library it depends on (clients/typescript, as `file:../../clients/typescript`,
so the copy keeps the repository's layout), then run: it makes a run of two steps with
@tally/client, publishes step 2 again, which must be answered with the same effect and must
not reach the tool twice, and completes the run.
"""

import json
import os
import shutil
import subprocess
import tempfile

import tallytest
from dispatchcase import DispatchCase
from test_client_ts import build_client, npm

EXAMPLE = os.path.join(tallytest.SOURCE_DIR, "examples", "agent-ts")


class AgentTsTest(DispatchCase):

    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="tally-agent-ts-")
        # the library first: the example links to it and compiles against its dist/*.d.ts
        build_client(cls.root)
        cls.build = os.path.join(cls.root, "examples", "agent-ts")
        os.makedirs(cls.build)
        for name in ("package.json", "package-lock.json", "tsconfig.json"):
            shutil.copy(os.path.join(EXAMPLE, name), cls.build)
        shutil.copytree(os.path.join(EXAMPLE, "src"), os.path.join(cls.build, "src"))
        npm(["ci"], cls.build)
        npm(["run", "build"], cls.build)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.root, ignore_errors=True)

    def test_publishes_reads_its_answers_and_a_replay_is_the_same_effect(self):
        self.dispatcher()
        out = subprocess.run(["node", os.path.join("dist", "main.js")], cwd=self.build,
                             env=self.env(), capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        answers = [json.loads(line) for line in out.stdout.splitlines()]
        *answers, done = answers
        self.assertEqual([(a["label"], a["step"], a["tool"], a["status"], a["replay"])
                          for a in answers],
                         [("step 1", 1, "check_balance", "CONFIRMED", False),
                          ("step 2", 2, "update_ledger", "CONFIRMED", False),
                          ("step 2 again", 2, "update_ledger", "CONFIRMED", True)])
        first, second, replay = answers
        self.assertEqual(replay["effect_id"], second["effect_id"])
        self.assertNotEqual(replay["intent_id"], second["intent_id"])
        self.assertTrue(all(a["type"] == "tally.effect.confirmed.v1" for a in answers))
        self.assertEqual((done["label"], done["type"], done["run_id"], done["status"]),
                         ("run completed", "tally.run.completed.v1", first["run_id"],
                          "COMPLETED"))
        self.assertEqual((done["summary"]["total"], done["summary"]["effects"]),
                         (2, {"CONFIRMED": 2}))

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
