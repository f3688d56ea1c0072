"""One database role per component (issue 23): each runtime role connects and tries every
forbidden thing — rewriting or removing the audit trail, turning its triggers off, altering or
dropping tables, creating objects, granting itself more, and each table operation it was not
given — and is refused (SQLSTATE 42501), with the audit trail unchanged after every attempt.
A worker connected as the owner or a superuser refuses to start unless allowed; a `tally
migrate` run by an owner without CREATEROLE works when the roles exist and says what to do
when they do not.

The privileges each role should have are written out here again, from what each component
does (docs/operations.md, "Database roles"), rather than read from the code: this test is the
second opinion on common/src/roles.c."""

import uuid

import psycopg2
import psycopg2.extensions

import tallytest
from tallytest import OWNER_ROLE, PROGRAM_ROLES, ROLES, TallyCase, wait_for

# role -> table -> what it may do (anything else on that table is refused)
S, I, U, D = "SELECT", "INSERT", "UPDATE", "DELETE"
EXPECTED = {
    "dispatcher": {"runs": {S, I, U}, "effects": {S, I, U}, "outbox": {S, I, U, D},
                   "obligations": {S, I}, "alerts": {S, I, U}, "events": {S, I},
                   "message_outbox": {S, I, U, D}, "message_refs": {S, I, U, D},
                   "replies": {S, I}, "tenant_keys": {S, I}, "tally_migrations": {S}, "tally_schema_window": {S}},
    "reconciler": {"runs": {S, U}, "effects": {S, U}, "outbox": {S, I, U},
                   "obligations": {S, I}, "alerts": {S, I, U}, "events": {S, I},
                   "message_outbox": {S, I, U, D}, "message_refs": {S, I, U, D},
                   "replies": {S}, "tenant_keys": {S},
                   "tally_migrations": {S}, "tally_schema_window": {S},
                   "audit_policies": {S, I, U, D},
                   "audits": {S, I, U, D}, "tool_pacing": {S, I, U},
                   "sweep_cursors": {S, I, U}, "findings": {S, I, U}},
    "compensator": {"runs": {S, U}, "effects": {S}, "obligations": {S, I, U},
                    "alerts": {S, I, U}, "events": {S, I}, "message_outbox": {S, I, U, D},
                    "message_refs": {S, I, U, D}, "replies": {S}, "tenant_keys": {S}, "tally_migrations": {S},
                    "tally_schema_window": {S}, "findings": {S}},
    "operator": {"runs": {S, U}, "effects": {S, U}, "outbox": {S, I, U, D},
                 "obligations": {S, I, U}, "alerts": {S, I, U}, "events": {S, I},
                 "message_outbox": {S, I}, "message_refs": {S}, "replies": {S},
                 "tenant_keys": {S, U},
                 "tally_migrations": {S}, "tally_schema_window": {S},
                 "tally_schema_history": {S}, "schema_machines": {S},
                 "audit_policies": {S},
                 "audits": {S}, "tool_pacing": {S, I, U}, "sweep_cursors": {S},
                 "findings": {S, I, U}},
    "reader": {t: {S} for t in ("runs", "effects", "outbox", "obligations", "alerts", "events",
                                "message_outbox", "message_refs", "replies", "tally_migrations",
                                "tally_schema_window", "tally_schema_history",
                                "schema_machines", "audit_policies", "audits", "tool_pacing",
                                "sweep_cursors", "findings")},
}
TABLES = ("runs", "effects", "outbox", "obligations", "alerts", "events", "message_outbox",
          "message_refs", "replies", "tenant_keys", "tally_migrations", "tally_schema_window",
          "tally_schema_history", "schema_machines", "audit_policies", "audits", "tool_pacing",
          "sweep_cursors", "findings")


def attempts(table, privilege):
    """A statement that needs @privilege on @table and changes nothing when it runs."""
    return {
        S: f"SELECT 1 FROM {table} LIMIT 0",
        I: f"INSERT INTO {table} ({_column(table)}) SELECT {_column(table)} FROM {table}"
           " WHERE false",
        U: f"UPDATE {table} SET {_column(table)} = {_column(table)} WHERE false",
        D: f"DELETE FROM {table} WHERE false",
    }[privilege]


def _column(table):
    return {"tally_migrations": "name", "tally_schema_window": "serves_from_release",
            "tally_schema_history": "release",
            "schema_machines": "sha256", "runs": "status",
            "effects": "status", "outbox": "tool", "obligations": "status", "alerts": "summary",
            "events": "reason", "message_outbox": "topic", "message_refs": "msg_key",
            "replies": "run_id",
            "tenant_keys": "tenant", "audit_policies": "tool", "audits": "tool",
            "tool_pacing": "tool", "sweep_cursors": "tool", "findings": "summary"}[table]


# What no runtime role may do, whatever it was granted.
def forbidden(role_name):
    return [
        "UPDATE events SET reason = 'rewritten'",
        "DELETE FROM events",
        "TRUNCATE events",
        "ALTER TABLE events DISABLE TRIGGER events_no_update",
        "ALTER TABLE events DISABLE TRIGGER ALL",
        "SET session_replication_role = replica",
        "DROP TRIGGER events_no_update ON events",
        "DROP TRIGGER events_no_truncate ON events",
        "DROP TABLE events",
        "DROP FUNCTION tally_events_append_only() CASCADE",
        "CREATE OR REPLACE FUNCTION tally_events_append_only() RETURNS trigger"
        " LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$",
        "CREATE TABLE public.planted (x int)",
        "CREATE TABLE planted (x int)",
        "CREATE FUNCTION public.planted() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        "ALTER TABLE effects ADD COLUMN planted int",
        "ALTER TABLE events OWNER TO CURRENT_USER",
        "CREATE TRIGGER planted BEFORE INSERT ON events FOR EACH ROW"
        " EXECUTE FUNCTION tally_events_append_only()",
        "CREATE RULE planted AS ON INSERT TO events DO INSTEAD NOTHING",
        "TRUNCATE runs, effects, outbox, obligations, alerts, message_outbox, replies",
        f"GRANT {OWNER_ROLE} TO {role_name}",
        f"SET ROLE {OWNER_ROLE}",
        "CREATE ROLE planted",
        "ALTER ROLE CURRENT_USER SUPERUSER",
        "ALTER ROLE CURRENT_USER BYPASSRLS",
    ]


class RolesTest(TallyCase):

    def connect(self, role):
        conn = psycopg2.connect(self.pg_as(role))
        self.addCleanup(conn.close)
        return conn

    def audit_trail(self):
        """The audit trail as a count and a hash of every row, read as the superuser."""
        return self.query("SELECT count(*), md5(coalesce(string_agg(e::text, '|' ORDER BY seq),"
                          " '')) FROM events e")[0]

    def seed_events(self):
        """A few events, written the way the components write them (INSERT as the
        dispatcher), so that rewriting or removing one would show."""
        conn = self.connect("dispatcher")
        with conn, conn.cursor() as cur:
            for n in range(3):
                cur.execute("INSERT INTO events (event_id, run_id, kind, actor, reason)"
                            " VALUES (%s, 'run-roles', 'test_seed', 'test_roles', %s)",
                            (str(uuid.uuid4()), f"seed {n}"))
        before = self.audit_trail()
        self.assertEqual(before[0], 3)
        return before

    def refused(self, conn, sql, role):
        """@sql, as @role, is refused for want of privilege (42501: by PostgreSQL, or by the
        append-only trigger, which raises the same code)."""
        with conn.cursor() as cur:
            try:
                cur.execute(sql)
            except psycopg2.Error as e:
                conn.rollback()
                self.assertEqual(e.pgcode, "42501",
                                 f"{role}: {sql!r} failed, but not for want of privilege: "
                                 f"{e.pgcode} {e.pgerror}")
                return
            conn.rollback()
            self.fail(f"{role}: {sql!r} was allowed")

    def test_each_role_is_refused_every_forbidden_statement(self):
        trail = self.seed_events()
        for component, user in ROLES.items():
            conn = self.connect(component)
            for sql in forbidden(user):
                self.refused(conn, sql, component)
                self.assertEqual(self.audit_trail(), trail, f"{component}: {sql!r} changed the "
                                                            "audit trail")
            # granting itself more is no error when it holds some privilege (PostgreSQL only
            # warns that nothing was granted), so look at what it holds afterwards
            with conn.cursor() as cur:
                for sql in (f"GRANT ALL ON events TO {user}", f"GRANT ALL ON ALL TABLES IN SCHEMA"
                            f" public TO {user}"):
                    try:
                        cur.execute(sql)
                    except psycopg2.Error as e:
                        self.assertEqual(e.pgcode, "42501", f"{component}: {sql}: {e.pgerror}")
                    conn.rollback()
            for privilege in ("UPDATE", "DELETE", "TRUNCATE", "TRIGGER", "REFERENCES"):
                self.assertFalse(self.scalar("SELECT has_table_privilege(%s, 'events', %s)",
                                             (user, privilege)), f"{component} {privilege}")
            self.assertEqual(self.audit_trail(), trail)

    def test_each_role_may_do_exactly_what_its_component_needs(self):
        trail = self.seed_events()
        tables = {r[0] for r in self.query(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
        self.assertEqual(tables, set(TABLES), "a ledger table this test (and roles.c) does "
                                              "not know")
        for component, user in ROLES.items():
            conn = self.connect(component)
            for table in TABLES:
                allowed = EXPECTED[component].get(table, set())
                for privilege in (S, I, U, D):
                    held = self.scalar("SELECT has_table_privilege(%s, %s, %s)",
                                       (user, table, privilege))
                    self.assertEqual(held, privilege in allowed,
                                     f"{component} {privilege} on {table}")
                    sql = attempts(table, privilege)
                    if privilege in allowed:
                        with conn.cursor() as cur:
                            cur.execute(sql)
                        conn.rollback()
                    else:
                        self.refused(conn, sql, component)
                for privilege in ("TRUNCATE", "TRIGGER", "REFERENCES"):
                    self.assertFalse(self.scalar("SELECT has_table_privilege(%s, %s, %s)",
                                                 (user, table, privilege)),
                                     f"{component} {privilege} on {table}")
            self.assertEqual(self.audit_trail(), trail, component)
            # no runtime role owns anything, is privileged, or may create in the schema
            self.assertEqual(self.scalar(
                "SELECT count(*) FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner"
                " WHERE r.rolname = %s", (user,)), 0, f"{component} owns something")
            self.assertEqual(self.query(
                "SELECT rolsuper, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls,"
                " rolcanlogin FROM pg_roles WHERE rolname = %s", (user,)),
                [(False, False, False, False, False, True)])
            self.assertFalse(self.scalar("SELECT has_schema_privilege(%s, 'public', 'CREATE')",
                                         (user,)))
            self.assertFalse(self.scalar("SELECT pg_has_role(%s, %s, 'MEMBER')",
                                         (user, OWNER_ROLE)))

    def test_the_append_only_trigger_still_holds_for_the_owner(self):
        trail = self.seed_events()
        conn = self.connect("owner")
        self.refused(conn, "UPDATE events SET reason = 'rewritten'", "owner")
        self.refused(conn, "DELETE FROM events", "owner")
        self.refused(conn, "TRUNCATE events", "owner")
        self.assertEqual(self.audit_trail(), trail)

    # --- the workers' start-up check -----------------------------------------------------

    def worker_exit(self, name, **env):
        p = self.start(name, wait_ready=False, **env)
        wait_for(lambda: not p.alive(), timeout=60, what=f"{name} to exit")
        return p.popen.returncode, p.log()

    def test_a_worker_refuses_to_run_as_the_owner_or_a_superuser(self):
        rc, log = self.worker_exit("tally-dispatcher", TALLY_PG=self.pg_as("owner"))
        self.assertEqual(rc, 2, log)
        self.assertIn("rule owner-role: refusing to start", log)
        self.assertIn(f'role \\"{OWNER_ROLE}\\" owns the ledger', log)
        self.assertIn("TALLY_ALLOW_OWNER_ROLE=1", log)

        rc, log = self.worker_exit("tally-reconciler", TALLY_PG=self.pg_as("admin"))
        self.assertEqual(rc, 2, log)
        self.assertIn("rule owner-role: refusing to start", log)
        self.assertIn("is a superuser", log)

        # a member of the owner is the owner
        member = "m_" + uuid.uuid4().hex[:10]
        self.admin(f"CREATE ROLE {member} LOGIN IN ROLE {OWNER_ROLE}")
        self.addCleanup(self.admin, f"DROP ROLE {member}")
        rc, log = self.worker_exit(
            "tally-compensator",
            TALLY_PG=psycopg2.extensions.make_dsn(self.pg, user=member))
        self.assertEqual(rc, 2, log)
        self.assertIn(f'is a member of \\"{OWNER_ROLE}\\"', log)

    def test_allowed_to_run_as_the_owner_a_worker_warns_at_every_start(self):
        for _ in range(2):
            p = self.start("tally-dispatcher", TALLY_PG=self.pg_as("owner"),
                           TALLY_ALLOW_OWNER_ROLE="1")
            warnings = [line for line in p.log_lines()
                        if line.get("level") == "warn" and "rule owner-role" in line["msg"]]
            self.assertEqual(len(warnings), 1, p.log())
            self.assertIn(OWNER_ROLE, warnings[0]["msg"])
            self.assertEqual(p.terminate(), 0)

    def test_each_worker_connects_as_its_own_role(self):
        for name in ("tally-dispatcher", "tally-reconciler", "tally-compensator"):
            self.start(name)
        def users():
            # application_name is "tally-dispatcher/<release> (schema N-M)" (migrate.h)
            rows = self.query("SELECT DISTINCT split_part(application_name, '/', 1), usename"
                              " FROM pg_stat_activity"
                              " WHERE datname = %s AND application_name LIKE 'tally-%%'",
                              (self.dbname,))
            return rows if len({r[0] for r in rows} & set(PROGRAM_ROLES)) == 3 else None
        rows = wait_for(users, timeout=30, what="the workers' sessions")
        for app, user in rows:
            if app in PROGRAM_ROLES:
                self.assertEqual(user, ROLES[PROGRAM_ROLES[app]], app)
            else:  # the relays' own connections: a worker's role too
                self.assertIn(user, ROLES.values(), app)


class MigrateRolesTest(TallyCase):
    """`tally migrate` by owners of different powers."""

    migrate = False

    def owner_without_createrole(self):
        """A login role that owns the test's database and may create no role, as on a managed
        PostgreSQL whose administrator hands out one database."""
        owner = "o_" + uuid.uuid4().hex[:10]
        self.admin(f"CREATE ROLE {owner} LOGIN")
        self.admin(f'ALTER DATABASE "{self.dbname}" OWNER TO {owner}')
        self.addCleanup(self.drop_role, owner)
        return owner, psycopg2.extensions.make_dsn(self.pg, user=owner)

    def drop_role(self, role):
        """After the test: what @role owns and was granted in the test's database, then it."""
        self.drop_grants(role)
        self.admin(f'ALTER DATABASE "{self.dbname}" OWNER TO {OWNER_ROLE}')
        self.admin(f"DROP ROLE {role}")

    def drop_grants(self, role):
        conn = psycopg2.connect(self.pg)
        try:
            with conn, conn.cursor() as cur:
                cur.execute(f"DROP OWNED BY {role} CASCADE")
        finally:
            conn.close()

    def test_an_owner_without_createrole_grants_roles_that_exist(self):
        # the stack's own `tally migrate` created the default roles
        owner, dsn = self.owner_without_createrole()
        out = self.cli("migrate", env=self.env(TALLY_PG=dsn))
        self.assertEqual(out.returncode, 0, out.stderr)
        for component, user in ROLES.items():
            self.assertRegex(out.stdout, rf"role {user} +{component} +existed, granted on \d+")
        self.assertEqual(self.scalar("SELECT tableowner FROM pg_tables WHERE tablename = 'events'"),
                         owner)
        self.assertTrue(self.scalar("SELECT has_table_privilege('tally_dispatcher', 'events',"
                                    " 'INSERT')"))
        self.assertFalse(self.scalar("SELECT has_table_privilege('tally_dispatcher', 'events',"
                                     " 'UPDATE')"))

    def test_an_owner_without_createrole_names_the_missing_role_and_what_to_do(self):
        owner, dsn = self.owner_without_createrole()
        missing = "missing_" + uuid.uuid4().hex[:8]
        out = self.cli("migrate", env=self.env(TALLY_PG=dsn, TALLY_ROLE_RECONCILER=missing))
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn(f"the reconciler role {missing} does not exist", out.stderr)
        self.assertIn(f"{owner} may not create it (it has no CREATEROLE)", out.stderr)
        self.assertIn(f"CREATE ROLE {missing} LOGIN", out.stderr)
        self.assertIn("TALLY_ROLE_RECONCILER", out.stderr)
        self.assertIn("still at version 0", out.stderr)
        self.assertIsNone(self.scalar("SELECT to_regclass('events')::text"),
                          "nothing of the failed migrate may remain")
        self.assertEqual(self.admin("SELECT count(*) FROM pg_roles WHERE rolname = %s",
                                    (missing,))[0][0], 0)

    def test_roles_of_other_names_are_created_with_their_passwords(self):
        prefix = "r" + uuid.uuid4().hex[:8]
        names = {c: f"{prefix}_{c}" for c in ROLES}
        env = {f"TALLY_ROLE_{c.upper()}": n for c, n in names.items()}
        env["TALLY_ROLE_PASSWORD_READER"] = "s3cret-reader"
        env["TALLY_PG"] = self.pg_as("owner")
        out = self.cli("migrate", "--roles", env=self.env(**env))
        for name in names.values():
            self.addCleanup(self.admin, f"DROP ROLE IF EXISTS {name}")
            self.addCleanup(self.drop_grants, name)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(out.stdout, rf"role {names['reader']} +reader +created, granted on "
                                     r"\d+ tables, password set")
        self.assertRegex(out.stdout, rf"role {names['dispatcher']} +dispatcher +created")
        self.assertIn("  tenant_keys        SELECT, INSERT", out.stdout)  # --roles: the grants
        self.assertNotIn("s3cret", out.stdout + out.stderr)
        self.assertTrue(self.admin("SELECT rolpassword IS NOT NULL FROM pg_authid"
                                   " WHERE rolname = %s", (names["reader"],))[0][0])
        self.assertFalse(self.admin("SELECT rolpassword IS NOT NULL FROM pg_authid"
                                    " WHERE rolname = %s", (names["operator"],))[0][0])
        # again: the roles exist, nothing is created, the grants are the same
        again = self.cli("migrate", env=self.env(**env))
        self.assertEqual(again.returncode, 0, again.stderr)
        self.assertRegex(again.stdout, rf"role {names['reader']} +reader +existed")

        # `tally migrate` as a runtime role says whom to run it as
        wrong = self.cli("migrate", env=self.env(TALLY_PG=self.pg_as("reader")))
        self.assertEqual(wrong.returncode, 1)
        self.assertIn("tally_reader, the reader's role", wrong.stderr)


if __name__ == "__main__":
    tallytest.main()
