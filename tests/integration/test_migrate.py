"""`tally migrate`: the schema is applied once, idempotently, in one transaction, even when
several hosts run it at the same moment; the audit trail is append-only."""

import glob
import os
import re
import subprocess
import uuid

import psycopg2

import tallytest
from tallytest import TallyCase, binary, free_port

SCHEMA_TABLES = {"runs", "effects", "outbox", "obligations", "alerts", "events",
                 "message_outbox", "tally_migrations"}


def latest_version():
    """The newest migration in schemas/sql, which the binary embeds."""
    versions = [int(re.match(r"(\d+)_", os.path.basename(p)).group(1))
                for p in glob.glob(os.path.join(tallytest.SOURCE_DIR, "schemas", "sql", "*.sql"))]
    return max(versions)


class MigrateTest(TallyCase):
    migrate = False  # every test starts from an empty database

    def migrations(self):
        return self.query("SELECT version, name, applied_at FROM tally_migrations ORDER BY version")

    def test_migrate_twice_changes_nothing_the_second_time(self):
        latest = latest_version()
        first = self.cli("migrate")
        self.assertEqual(first.returncode, 0, first.stderr)
        self.assertEqual(first.stdout.splitlines()[0], f"database at version {latest} (was 0)")
        # then one line per runtime role: created by this first run, granted
        self.assertRegex(first.stdout, r"role tally_dispatcher +dispatcher +(created|existed), "
                                       r"granted on \d+ tables")
        rows = self.migrations()
        self.assertEqual([r[0] for r in rows], list(range(1, latest + 1)))

        second = self.cli("migrate")
        self.assertEqual(second.returncode, 0, second.stderr)
        self.assertEqual(second.stdout.splitlines()[0],
                         f"database at version {latest}, nothing to do")
        self.assertRegex(second.stdout, r"role tally_reader +reader +existed")
        self.assertEqual(self.migrations(), rows, "a second migrate must not touch the history")

        third = self.cli("migrate")
        self.assertEqual(third.returncode, 0, third.stderr)
        self.assertEqual(third.stdout, second.stdout)

    def test_every_table_of_the_schema_exists(self):
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stderr)
        tables = {r[0] for r in self.query(
            "SELECT table_name FROM information_schema.tables"
            " WHERE table_schema = 'public' AND table_type = 'BASE TABLE'")}
        self.assertTrue(SCHEMA_TABLES <= tables, f"missing: {SCHEMA_TABLES - tables}")
        triggers = {r[0] for r in self.query(
            "SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")}
        self.assertTrue({"events_no_update", "events_no_truncate", "message_outbox_notify",
                         "outbox_notify", "obligations_notify"} <= triggers, triggers)

    def test_audit_events_are_append_only(self):
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stderr)
        event_id = str(uuid.uuid4())
        self.query("INSERT INTO events (event_id, kind, actor, reason) VALUES (%s, %s, %s, %s)",
                   (event_id, "operator", "test", "append-only check"))
        for sql in ("UPDATE events SET reason = 'rewritten' WHERE event_id = %s",
                    "DELETE FROM events WHERE event_id = %s"):
            with self.subTest(sql=sql.split()[0]):
                with self.assertRaises(psycopg2.Error) as cm:
                    self.query(sql, (event_id,))
                self.assertEqual(cm.exception.pgcode, "42501")
                self.assertIn("append-only", str(cm.exception))
        with self.assertRaises(psycopg2.Error) as cm:
            self.query("TRUNCATE events")
        self.assertIn("append-only", str(cm.exception))
        self.assertEqual(self.scalar("SELECT reason FROM events WHERE event_id = %s",
                                     (event_id,)), "append-only check")

    def test_an_event_id_is_written_once(self):
        # Schema 8 made event_id the primary key in place of its own unique index.
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stderr)
        event_id = str(uuid.uuid4())
        insert = "INSERT INTO events (event_id, kind, actor) VALUES (%s, 'operator', %s)"
        self.query(insert, (event_id, "first"))
        with self.assertRaises(psycopg2.Error) as cm:
            self.query(insert, (event_id, "second"))
        self.assertEqual(cm.exception.pgcode, "23505")
        self.assertEqual(self.query("SELECT actor FROM events WHERE event_id = %s", (event_id,)),
                         [("first",)])

    def test_the_input_hash_is_64_lowercase_hex_digits(self):
        """Version 7 checks it without a regular expression; the rule is the same."""
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.query("INSERT INTO runs (run_id) VALUES ('r')")

        def insert(step, input_hash):
            self.query(
                "INSERT INTO effects (effect_id, run_id, step, tool, effect_class, operation_key,"
                " input_hash, args_canonical, intent_id, status)"
                " VALUES (%s, 'r', %s, 't', 'idempotent', %s, %s, '{}', 'i', 'PLANNED')",
                (str(uuid.uuid4()), step, step, input_hash))

        good = "0123456789abcdef" * 4
        insert("good", good)
        bad = {"upper": good.upper(), "short": good[:63], "long": good + "0",
               "not hex": good[:63] + "g", "newline": good[:63] + "\n", "space": " " + good[1:],
               "multibyte": good[:62] + "\u00e9", "empty": ""}
        for step, value in bad.items():
            with self.subTest(step=step):
                with self.assertRaises(psycopg2.Error) as cm:
                    insert(step, value)
                self.assertEqual(cm.exception.pgcode, "23514")  # check_violation
                self.assertIn("effects_input_hash_check", str(cm.exception))
        self.assertEqual(self.scalar("SELECT count(*) FROM effects"), 1)

    def test_concurrent_migrates_apply_each_version_once(self):
        latest = latest_version()
        procs = [subprocess.Popen([binary("tally"), "migrate"],
                                  env=self.env(TALLY_PG=self.pg_as("owner")),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
        results = [(p.wait(120), *p.communicate()) for p in procs]
        for rc, stdout, stderr in results:
            self.assertEqual(rc, 0, stderr)
        outputs = sorted(r[1].splitlines()[0] for r in results)
        self.assertEqual(outputs.count(f"database at version {latest} (was 0)"), 1, outputs)
        self.assertEqual(outputs.count(f"database at version {latest}, nothing to do"), 2,
                         outputs)
        self.assertEqual(self.scalar("SELECT count(*) FROM tally_migrations"), latest)
        self.assertEqual(self.scalar("SELECT count(DISTINCT version) FROM tally_migrations"),
                         latest)

    def test_status_before_and_after(self):
        latest = latest_version()
        before = self.cli("migrate", "--status")
        self.assertEqual(before.returncode, 1, before.stderr)
        self.assertIn("database at version 0", before.stdout)
        self.assertIn("run `tally migrate`", before.stdout)
        self.assertIsNone(self.scalar("SELECT to_regclass('tally_migrations')::text"),
                          "--status must not change the database")

        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stderr)
        after = self.cli("migrate", "--status")
        self.assertEqual(after.returncode, 0, after.stderr)
        self.assertIn(f"database at version {latest}", after.stdout)
        self.assertIn("up to date", after.stdout)

    def test_unreachable_postgres_exits_3_with_libpq_reason(self):
        port = free_port()
        env = self.env(TALLY_PG=f"host=127.0.0.1 port={port} dbname=nowhere user=nobody")
        out = self.cli("migrate", env=env)
        self.assertEqual(out.returncode, 3, out.stdout + out.stderr)
        self.assertIn("cannot connect to PostgreSQL", out.stderr)
        self.assertIn("Connection refused", out.stderr)
        self.assertIn(str(port), out.stderr)

    def test_database_newer_than_binary_is_left_alone_while_it_serves_this_release(self):
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stderr)
        future = latest_version() + 100
        # a later release's expand step: the window still serves this binary
        self.query("INSERT INTO tally_migrations (version, name) VALUES (%s, 'from_the_future')",
                   (future,))
        again = self.cli("migrate")
        self.assertEqual(again.returncode, 0, again.stdout + again.stderr)
        self.assertIn(f"database at version {future}, nothing to do", again.stdout)
        self.assertIn("still serves this one", again.stdout)
        status = self.cli("migrate", "--status")
        self.assertEqual(status.returncode, 1)
        self.assertIn("newer", status.stdout)
        plan = self.cli("migrate", "--plan")
        self.assertEqual(plan.returncode, 0, plan.stdout + plan.stderr)
        self.assertIn("nothing to apply", plan.stdout)

    def test_database_newer_than_binary_is_refused_once_it_no_longer_serves_it(self):
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 0, out.stderr)
        future = latest_version() + 100
        # a later release's contract step, which no longer serves this binary
        self.query("INSERT INTO tally_migrations (version, name) VALUES (%s, 'from_the_future')",
                   (future,))
        self.query("UPDATE tally_schema_window SET serves_from = %s,"
                   " serves_from_release = '9.9.9'", (future,))
        again = self.cli("migrate")
        self.assertEqual(again.returncode, 1, again.stdout + again.stderr)
        self.assertIn(f"version {future}", again.stderr)
        self.assertIn("deploy tally 9.9.9 or newer", again.stderr)
        plan = self.cli("migrate", "--plan")
        self.assertEqual(plan.returncode, 1, plan.stdout + plan.stderr)
        self.assertIn("deploy tally 9.9.9 or newer", plan.stdout)

    def test_check_says_whether_this_release_runs_on_the_schema(self):
        # as the init containers run it: with a worker's role
        env = self._as_role(self.env(), "dispatcher")
        empty = self.cli("migrate", "--check", env=env)
        self.assertEqual(empty.returncode, 1, empty.stdout + empty.stderr)
        self.assertIn("does not run on this database", empty.stdout)
        self.assertIn("run `tally migrate`", empty.stdout)
        self.assertEqual(self.cli("migrate").returncode, 0)
        ok = self.cli("migrate", "--check", env=env)
        self.assertEqual(ok.returncode, 0, ok.stdout + ok.stderr)
        self.assertIn("runs on this database", ok.stdout)
        # a later release's expand step: still runs; its contract step: no longer
        future = latest_version() + 100
        self.query("INSERT INTO tally_migrations (version, name) VALUES (%s, 'from_the_future')",
                   (future,))
        self.assertEqual(self.cli("migrate", "--check", env=env).returncode, 0)
        self.query("UPDATE tally_schema_window SET serves_from = %s,"
                   " serves_from_release = '9.9.9'", (future,))
        late = self.cli("migrate", "--check", env=env)
        self.assertEqual(late.returncode, 1, late.stdout + late.stderr)
        self.assertIn("deploy tally 9.9.9 or newer", late.stdout)
        both = self.cli("migrate", "--check", "--plan")
        self.assertEqual(both.returncode, 2, both.stdout + both.stderr)

    def test_plan_lists_the_steps_and_the_connected_processes(self):
        plan = self.cli("migrate", "--plan")
        self.assertEqual(plan.returncode, 0, plan.stdout + plan.stderr)
        self.assertIn("database now: schema 0", plan.stdout)
        self.assertIn("001_", plan.stdout)
        self.assertIn("to apply, in one transaction", plan.stdout)
        self.assertIsNone(self.scalar("SELECT to_regclass('runs')::text"), "--plan changes nothing")
        self.assertEqual(self.cli("migrate").returncode, 0)
        latest = latest_version()
        # a process of this release and one from before the window are connected
        this = psycopg2.connect(self.pg, application_name=f"tally-dispatcher/0.1.0 (schema 15-{latest})")
        old = psycopg2.connect(self.pg, application_name="tally-reconciler")
        try:
            plan = self.cli("migrate", "--plan")
            self.assertEqual(plan.returncode, 0, plan.stdout + plan.stderr)
            self.assertIn(f"database now: schema {latest}, serving binaries from schema 15"
                          " (tally 0.1.0) on", plan.stdout)
            self.assertIn("nothing to apply", plan.stdout)
            self.assertIn("tally processes connected now: 2", plan.stdout)
            self.assertRegex(plan.stdout, r"tally-dispatcher/0\.1\.0 \(schema 15-\d+\)\s+served after")
            self.assertRegex(plan.stdout, r"tally-reconciler\s+NOT SERVED after: a release before")
            self.assertIn("`tally migrate` would go ahead", plan.stdout)
        finally:
            this.close()
            old.close()

    def test_failed_migration_is_rolled_back_and_named(self):
        # A table in the way makes 001 fail half-way through; nothing of it may remain.
        self.query("CREATE TABLE alerts (in_the_way int)")
        out = self.cli("migrate")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertRegex(out.stderr, r"migration 001_\w+ failed")
        self.assertIn('relation "alerts" already exists', out.stderr)
        self.assertIn("still at version 0", out.stderr)
        self.assertIsNone(self.scalar("SELECT to_regclass('runs')::text"),
                          "tables created before the failure must be rolled back")
        self.assertIsNone(self.scalar("SELECT to_regclass('tally_migrations')::text"))

        self.query("DROP TABLE alerts")
        ok = self.cli("migrate")
        self.assertEqual(ok.returncode, 0, ok.stderr)
        self.assertIn("(was 0)", ok.stdout)

    def test_help(self):
        out = self.cli("migrate", "--help")
        self.assertEqual(out.returncode, 0)
        self.assertIn("--status", out.stdout)
        bad = self.cli("migrate", "--frobnicate")
        self.assertEqual(bad.returncode, 2)


if __name__ == "__main__":
    tallytest.main()
