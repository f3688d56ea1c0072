"""The ledger enforces its state machines (DESIGN §12 rule 7): every status change that is not
in schemas/machines.json is refused by the database — through plain SQL, and through each
worker's and the CLI's own code paths — with an error that names the move.

The plain-SQL half is exhaustive: for every machine, every (from, to) pair of its states is
tried, and exactly the declared ones pass. The code-path half installs a machine that lacks one
move a worker is about to make (scripts/gen_machines.py --without), drives the worker to it, and
sees the move refused by name, the row left where it was, and the worker still serving.
"""

import json
import os
import subprocess
import sys
import time
import uuid

import psycopg2

import tallytest
from tallytest import TallyCase, wait_for
from test_cli_status import CliCase, run_id

sys.path.insert(0, os.path.join(tallytest.SOURCE_DIR, "scripts"))
import gen_machines  # noqa: E402

MACHINES = {m["name"]: m for m in gen_machines.load()}
GEN = os.path.join(tallytest.SOURCE_DIR, "scripts", "gen_machines.py")

# What a row needs besides its status for the table's other constraints to hold in a state.
EFFECT_EXTRA = {
    "CONFIRMED": "receipt = '{\"ref\": \"r\"}'::jsonb",
    "DISPATCHING": "lease_owner = 'test', lease_until = now() + interval '1 hour'",
}


def allowed(machine, frm, to):
    return any(mv["from"] == frm and mv["to"] == to for mv in MACHINES[machine]["moves"])


class MachineSQLTest(TallyCase):
    """Plain SQL, as an operator's hand-written statement would be."""

    def refused(self, sql, params=None):
        """The error of @sql, which must be a refused move (SQLSTATE 23514)."""
        with self.assertRaises(psycopg2.Error) as cm:
            self.query(sql, params)
        e = cm.exception
        self.assertEqual(e.pgcode, "23514", e.pgerror)
        return e

    def force(self, table, key, value, status, extra=""):
        """Put a row into @status whatever the machine says: triggers off for this one
        statement (session_replication_role = replica; the test's role is a superuser)."""
        with self.db.cursor() as cur:
            cur.execute("SET session_replication_role = replica")
            try:
                cur.execute(f"UPDATE {table} SET status = %s{', ' + extra if extra else ''}"
                            f" WHERE {key} = %s", (status, value))
            finally:
                cur.execute("SET session_replication_role = origin")

    def new_run(self, status="ACTIVE"):
        run = f"run-{uuid.uuid4().hex[:8]}"
        self.query("INSERT INTO runs (run_id) VALUES (%s)", (run,))
        if status != "ACTIVE":
            self.force("runs", "run_id", run, status)
        return run

    def new_effect(self, run, status):
        eid = str(uuid.uuid4())
        self.query(
            "INSERT INTO effects (effect_id, run_id, step, tool, effect_class, operation_key,"
            " input_hash, args_canonical, intent_id, status) VALUES (%s, %s, %s, 'charge',"
            " 'reversible', %s, repeat('a', 64), '{}', %s, 'PLANNED')",
            (eid, run, eid[:8], eid, eid))
        if status != "PLANNED":
            self.force("effects", "effect_id", eid, status, EFFECT_EXTRA.get(status, ""))
        return eid

    def new_obligation(self, run, effect, status):
        oid = str(uuid.uuid4())
        self.query("INSERT INTO obligations (obligation_id, run_id, effect_id, reason,"
                   " external_ref) VALUES (%s, %s, %s, 'compensate_run', %s)",
                   (oid, run, effect, oid))
        if status != "PENDING":
            self.force("obligations", "obligation_id", oid, status)
        return oid

    def new_alert(self, status):
        key = f"test:{uuid.uuid4().hex[:8]}"
        self.query("INSERT INTO alerts (dedup_key, severity, summary, reason)"
                   " VALUES (%s, 'critical', 's', 'r')", (key,))
        if status != "TRIGGERED":
            self.force("alerts", "dedup_key", key, status)
        return key

    def check_every_pair(self, machine, make, table, key, extra=None):
        states = [s["name"] for s in MACHINES[machine]["states"]]
        tried = refused = 0
        for frm in states:
            for to in states:
                if frm == to:
                    continue
                row = make(frm)
                more = (extra or {}).get(to, "")
                sql = (f"UPDATE {table} SET status = %s{', ' + more if more else ''}"
                       f" WHERE {key} = %s")
                tried += 1
                if allowed(machine, frm, to):
                    self.query(sql, (to, row))
                    self.assertEqual(self.scalar(f"SELECT status FROM {table} WHERE {key} = %s",
                                                 (row,)), to)
                else:
                    e = self.refused(sql, (to, row))
                    self.assertIn(f"the {machine} move {frm} -> {to} is not in the {machine}"
                                  " machine", e.pgerror)
                    self.assertIn(str(row), e.pgerror)
                    self.assertEqual(e.diag.constraint_name, f"{table}_machine")
                    self.assertIn("schemas/machines.json", e.diag.message_hint)
                    self.assertEqual(self.scalar(f"SELECT status FROM {table} WHERE {key} = %s",
                                                 (row,)), frm, "a refused move changed the row")
                    refused += 1
        self.assertEqual(tried, len(states) * (len(states) - 1))
        declared = {(mv["from"], mv["to"]) for mv in MACHINES[machine]["moves"]
                    if mv["from"] is not None and mv["from"] != mv["to"]}
        self.assertEqual(refused, tried - len(declared))

    def test_every_effect_move_outside_the_machine_is_refused(self):
        run = self.new_run()
        self.check_every_pair("effect", lambda s: self.new_effect(run, s), "effects",
                              "effect_id", EFFECT_EXTRA)

    def test_every_obligation_move_outside_the_machine_is_refused(self):
        run = self.new_run()
        eff = self.new_effect(run, "CONFIRMED")
        self.check_every_pair("obligation", lambda s: self.new_obligation(run, eff, s),
                              "obligations", "obligation_id")

    def test_every_run_move_outside_the_machine_is_refused(self):
        self.check_every_pair("run", self.new_run, "runs", "run_id")

    def test_every_alert_move_outside_the_machine_is_refused(self):
        self.check_every_pair("alert", self.new_alert, "alerts", "dedup_key")

    def test_rows_are_created_only_in_a_creation_state(self):
        run = self.new_run()
        for status in [s["name"] for s in MACHINES["effect"]["states"]]:
            eid = str(uuid.uuid4())
            sql = ("INSERT INTO effects (effect_id, run_id, step, tool, effect_class,"
                   " operation_key, input_hash, args_canonical, intent_id, status, receipt,"
                   " lease_owner, lease_until) VALUES (%s, %s, %s, 'charge', 'reversible', %s,"
                   " repeat('a', 64), '{}', %s, %s, '{}', CASE WHEN %s = 'DISPATCHING' THEN 'x' END,"
                   " CASE WHEN %s = 'DISPATCHING' THEN now() END)")
            params = (eid, run, eid[:8], eid, eid, status, status, status)
            if allowed("effect", None, status):
                self.query(sql, params)
            else:
                e = self.refused(sql, params)
                self.assertIn(f"an effect cannot be created as {status}", e.pgerror)
        for status in ("COMPLETED", "COMPENSATING", "STUCK", "CANCELLED"):
            e = self.refused("INSERT INTO runs (run_id, status) VALUES (%s, %s)",
                             (f"r-{uuid.uuid4().hex[:6]}", status))
            self.assertIn(f"a run cannot be created as {status}", e.pgerror)
        eff = self.new_effect(run, "CONFIRMED")
        for status in ("RUNNING", "RESOLVED", "STUCK"):
            e = self.refused("INSERT INTO obligations (obligation_id, run_id, effect_id, reason,"
                             " external_ref, status) VALUES (gen_random_uuid(), %s, %s,"
                             " 'duplicate', %s, %s)", (run, eff, status, status))
            self.assertIn(f"an obligation cannot be created as {status}", e.pgerror)
        e = self.refused("INSERT INTO alerts (dedup_key, severity, summary, reason, status)"
                         " VALUES ('k', 'critical', 's', 'r', 'RESOLVED')")
        self.assertIn("an alert cannot be created as RESOLVED", e.pgerror)

    def test_the_installed_moves_are_the_declaration(self):
        installed = set(self.query("SELECT machine, from_status, to_status"
                                   " FROM tally_machine_moves()"))
        declared = {(m, mv["from"], mv["to"]) for m, spec in MACHINES.items()
                    for mv in spec["moves"]}
        self.assertEqual(installed, declared)
        sha = self.scalar("SELECT sha256 FROM schema_machines")
        self.assertRegex(sha, r"^[0-9a-f]{64}$")

    def test_migrate_reinstalls_a_machine_that_differs(self):
        # An older or hand-edited machine in the database: migrate puts this binary's back.
        sql = subprocess.run([sys.executable, GEN, "--sql", "--without",
                              "effect:PLANNED:DISPATCHING"], capture_output=True, text=True,
                             check=True).stdout
        self.query(sql)
        self.query("UPDATE schema_machines SET sha256 = 'old'")
        run = self.new_run()
        eid = self.new_effect(run, "PLANNED")
        self.refused("UPDATE effects SET status = 'DISPATCHING', lease_owner = 'x',"
                     " lease_until = now() WHERE effect_id = %s", (eid,))
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.query("UPDATE effects SET status = 'DISPATCHING', lease_owner = 'x',"
                   " lease_until = now() WHERE effect_id = %s", (eid,))
        self.assertNotEqual(self.scalar("SELECT sha256 FROM schema_machines"), "old")


class MachineWorkerTest(CliCase):
    """Each writer's own code path, driven into a move the installed machine lacks."""

    def without(self, *moves):
        """Install the machine minus @moves ("machine:FROM:TO"), as `tally migrate` would."""
        sql = subprocess.run([sys.executable, GEN, "--sql", "--without", *moves],
                             capture_output=True, text=True, check=True).stdout
        self.query(sql)

    def refused_in_log(self, proc, machine, frm, to, timeout=40):
        needle = f"the {machine} move {frm} -> {to} is not in the {machine} machine"
        wait_for(lambda: needle in proc.log(), timeout=timeout,
                 what=f"{proc.name} to log the refused move {frm} -> {to}")
        self.assertTrue(proc.alive(), f"{proc.name} died on a refused move:\n{proc.log()}")
        self.assertTrue(self._healthy(proc), f"{proc.name} is not healthy after a refused move")

    def test_dispatcher_recording_a_move_the_ledger_lacks_is_refused_and_it_goes_on(self):
        self.without("effect:DISPATCHING:CONFIRMED")
        d = self.dispatcher()
        run = run_id()
        key, _, _ = self.charge(run, 1)
        self.refused_in_log(d, "effect", "DISPATCHING", "CONFIRMED")
        self.assertEqual(self.effect("charge_card", key)["status"], "DISPATCHING",
                         "the refused move must leave the effect where it was")
        # the dispatcher still records the moves that exist: a 4xx is FAILED
        key2 = f"charge_card:t1:{run}-p2"
        self.fault("error_4xx", key=key2, status=422)
        self.charge(run, 2)
        self.wait_status("charge_card", key2, "FAILED", timeout=30)

    def test_dispatcher_creating_a_row_the_ledger_refuses_dead_letters_only_that_intent(self):
        # an intent for a destructive tool creates its effect AWAITING_APPROVAL
        self.without("effect:NEW:AWAITING_APPROVAL")
        d = self.dispatcher()
        run = run_id()
        gated = self.publish(self.intent(run, 1, "delete_account", {"account_id": f"{run}-a"}))
        wait_for(lambda: "an effect cannot be created as AWAITING_APPROVAL" in d.log(),
                 timeout=40, what="the refused creation in the dispatcher's log")
        key, _, _ = self.charge(run, 2)
        self.wait_status("charge_card", key, "CONFIRMED", timeout=30)
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE intent_id = %s",
                                     (gated["id"],)), 0)
        self.assertTrue(d.alive())

    def test_reconciler_moving_unknown_to_confirmed_without_the_move_is_refused(self):
        self.dispatcher()
        run = run_id()
        eid = self.unknown_charge(run)
        self.without("effect:UNKNOWN:CONFIRMED")
        r = self.reconciler()
        self.refused_in_log(r, "effect", "UNKNOWN", "CONFIRMED", timeout=60)
        self.assertEqual(self.scalar("SELECT status FROM effects WHERE effect_id = %s", (eid,)),
                         "UNKNOWN")

    def test_compensator_resolving_without_the_move_is_refused(self):
        self.dispatcher()
        run = run_id()
        eid = self.confirmed_charge(run)
        self.without("obligation:RUNNING:RESOLVED")
        out = self.tally("compensate", "--run", run, "--reason", "machine test")
        self.assertEqual(out.returncode, 0, out.stderr)
        c = self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                       BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                       TALLY_SWEEP_MS=300)
        self.refused_in_log(c, "obligation", "RUNNING", "RESOLVED", timeout=60)
        self.assertNotEqual(self.scalar("SELECT status FROM obligations WHERE effect_id = %s",
                                        (eid,)), "RESOLVED")

    def test_cancel_run_without_the_run_move_is_refused(self):
        self.without("run:ACTIVE:CANCELLED")
        d = self.dispatcher()
        run = run_id()
        key, _, _ = self.charge(run, 1)
        self.wait_status("charge_card", key, "CONFIRMED", timeout=30)
        self.publish({"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/machines",
                      "type": "tally.cancel_run.v1", "datacontenttype": "application/json",
                      "data": {"run_id": run, "reason": "machine test"}})
        self.refused_in_log(d, "run", "ACTIVE", "CANCELLED")
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "ACTIVE")

    def test_operator_resolution_the_ledger_lacks_is_refused_by_name(self):
        self.dispatcher()
        self.reconciler()
        run = run_id()
        eid, _ = self.stuck_note(run)
        self.without("effect:STUCK:FAILED")
        out = self.tally("resolve", "--effect", eid, "--as", "failed", "--reason", "checked")
        self.assertNotEqual(out.returncode, 0, out.stdout)
        self.assertIn("the effect move STUCK -> FAILED is not in the effect machine",
                      out.stdout + out.stderr)
        self.assertEqual(self.scalar("SELECT status FROM effects WHERE effect_id = %s", (eid,)),
                         "STUCK")


if __name__ == "__main__":
    tallytest.main()
