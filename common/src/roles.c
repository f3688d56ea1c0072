/* roles.c — one database role per component (roles.h).
 *
 * grants[] below is the only place a role's privileges are written: a row per ledger table, a
 * column per runtime role, read from the statements each component runs (its SQL, and what
 * common/ runs on its behalf). `tally migrate` applies it (tally_roles_ensure), docs/operations.md
 * ("Database roles") and tests/integration/test_roles.py say the same. SELECT ... FOR UPDATE or
 * FOR SHARE and INSERT ... ON CONFLICT DO UPDATE need UPDATE as well; identity columns need no
 * grant on their sequences; every tally function keeps PostgreSQL's default EXECUTE for PUBLIC
 * (trigger functions are not checked when they fire). The owner — whoever runs `tally migrate` —
 * owns every table and is in no column: only it may ALTER, DROP, TRUNCATE or take TRIGGER. */
#include "tally/roles.h"

#include <stdio.h>
#include <string.h>

#include <jansson.h>

#define S    "SELECT"
#define SI   "SELECT, INSERT"
#define SU   "SELECT, UPDATE"
#define SIU  "SELECT, INSERT, UPDATE"
#define SIUD "SELECT, INSERT, UPDATE, DELETE"
#define NONE ""

static const struct {
    const char *table;
    const char *privileges[TALLY_ROLE_COUNT];
} grants[] = {
    /* table             dispatcher reconciler compensator operator reader */
    {"runs", {SIU, SU, SU, SU, S}},
    {"effects", {SIU, SU, S, SU, S}},
    {"outbox", {SIUD, SIU, NONE, SIUD, S}},
    {"obligations", {SI, SI, SIU, SIU, S}},
    {"alerts", {SIU, SIU, SIU, SIU, S}},
    {"events", {SI, SI, SI, SI, S}}, /* the audit trail: append-only for everyone */
    {"message_outbox", {SIUD, SIUD, SIUD, SI, S}},
    {"message_refs", {SIUD, SIUD, SIUD, S, S}}, /* outcome messages by reference (017) */
    {"replies", {SI, S, S, S, S}},
    {"tenant_keys", {SI, S, S, SU, NONE}},
    {"tally_migrations", {S, S, S, S, S}},
    {"schema_machines", {NONE, NONE, NONE, S, S}},
    {"tally_schema_window", {S, S, S, S, S}},           /* which binaries the schema serves (015) */
    {"tally_schema_history", {NONE, NONE, NONE, S, S}}, /* each migrate that applied (016) */
    /* upstream audit (012): the confirm trigger queues audits as their owner */
    {"audit_policies", {NONE, SIUD, NONE, S, S}},
    {"audits", {NONE, SIUD, NONE, S, S}},
    {"tool_pacing", {NONE, SIU, NONE, SIU, S}}, /* tally verify --tools paces too */
    {"sweep_cursors", {NONE, SIU, NONE, S, S}},
    {"findings", {NONE, SIU, S, SIU, S}},
};

#undef S
#undef SI
#undef SU
#undef SIU
#undef SIUD
#undef NONE

#define N_TABLES (sizeof grants / sizeof grants[0])

static const char *const components[TALLY_ROLE_COUNT] = {"dispatcher", "reconciler", "compensator",
                                                         "operator", "reader"};

/* The setting that names each role (config.c). */
static const char *const settings[TALLY_ROLE_COUNT] = {
    "TALLY_ROLE_DISPATCHER", "TALLY_ROLE_RECONCILER", "TALLY_ROLE_COMPENSATOR",
    "TALLY_ROLE_OPERATOR", "TALLY_ROLE_READER"};

const char *tally_role_component(tally_role_t role)
{
    return role < TALLY_ROLE_COUNT ? components[role] : "unknown";
}

const char *tally_role_name(const tally_config_t *cfg, tally_role_t role)
{
    switch (role) {
    case TALLY_ROLE_DISPATCHER:
        return cfg->role_dispatcher;
    case TALLY_ROLE_RECONCILER:
        return cfg->role_reconciler;
    case TALLY_ROLE_COMPENSATOR:
        return cfg->role_compensator;
    case TALLY_ROLE_OPERATOR:
        return cfg->role_operator;
    case TALLY_ROLE_READER:
        return cfg->role_reader;
    case TALLY_ROLE_COUNT:
        break;
    }
    return "";
}

size_t tally_roles_n_tables(void)
{
    return N_TABLES;
}

const char *tally_roles_table(size_t i)
{
    return i < N_TABLES ? grants[i].table : NULL;
}

const char *tally_roles_privileges(tally_role_t role, size_t i)
{
    return i < N_TABLES && role < TALLY_ROLE_COUNT ? grants[i].privileges[role] : "";
}

/* Runs server-side on the spec in the transaction-local setting tally.roles_spec (set from a
 * bind parameter): DDL takes no parameters, so names and passwords are quoted here by format()
 * (%I, %L), never pasted into SQL by the client. The privilege lists are checked against the
 * four words grants[] uses. The outcome goes back through tally.roles_report. */
static const char SQL_ENSURE[] =
    "DO $tally$\n"
    "DECLARE\n"
    "  spec jsonb := current_setting('tally.roles_spec')::jsonb;\n"
    "  me text := current_user;\n"
    "  may_create boolean;\n"
    "  schema text := current_schema();\n"
    "  r jsonb;\n"
    "  g record;\n"
    "  role text;\n"
    "  created boolean;\n"
    "  n int;\n"
    "  report jsonb := '[]';\n"
    "  warning text := '';\n"
    "BEGIN\n"
    "  SELECT rolsuper OR rolcreaterole INTO may_create FROM pg_roles WHERE rolname = me;\n"
    "  FOR r IN SELECT * FROM jsonb_array_elements(spec -> 'roles') LOOP\n"
    "    role := r ->> 'name';\n"
    "    created := false;\n"
    "    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role) THEN\n"
    "      IF NOT may_create THEN\n"
    "        RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format('the %s role %I does not "
    "exist, and %I may not create it (it has no CREATEROLE): create it as an administrator "
    "(CREATE ROLE %I LOGIN) or grant %I CREATEROLE, then run tally migrate again; or name an "
    "existing role in %s', r ->> 'component', role, me, role, me, r ->> 'setting');\n"
    "      END IF;\n"
    "      BEGIN\n"
    "        EXECUTE format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
    "NOREPLICATION NOBYPASSRLS', role);\n"
    "        created := true;\n"
    "      EXCEPTION WHEN duplicate_object OR unique_violation THEN\n"
    "        NULL; -- another tally migrate, for another database on this cluster, made it\n"
    "      END;\n"
    "    END IF;\n"
    "    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role\n"
    "               AND (rolsuper OR rolbypassrls OR rolcreaterole OR rolreplication)) THEN\n"
    "      RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format('the %s role %I is a "
    "superuser or may create roles, replicate or bypass row security, which it must not: ALTER "
    "ROLE %I NOSUPERUSER NOCREATEROLE NOREPLICATION NOBYPASSRLS, or name another role in %s', "
    "r ->> 'component', role, role, r ->> 'setting');\n"
    "    END IF;\n"
    "    IF pg_has_role(role, me, 'MEMBER') THEN\n"
    "      RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format('the %s role %I is %I, or "
    "a member of it, and %I owns the ledger: name another role in %s, or run tally migrate as "
    "the owner', r ->> 'component', role, me, me, r ->> 'setting');\n"
    "    END IF;\n"
    "    IF r ->> 'password' IS NOT NULL AND NOT may_create THEN\n"
    "      RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = format('cannot set the password "
    "of the %s role %I: %I has no CREATEROLE; set it as an administrator (ALTER ROLE %I "
    "PASSWORD ...) and unset TALLY_ROLE_PASSWORD_%s', r ->> 'component', role, me, role, "
    "upper(r ->> 'component'));\n"
    "    END IF;\n"
    "    IF r ->> 'password' IS NOT NULL THEN\n"
    "      EXECUTE format('ALTER ROLE %I PASSWORD %L', role, r ->> 'password');\n"
    "    END IF;\n"
    "    IF NOT has_schema_privilege(role, schema, 'USAGE') THEN\n"
    "      EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', schema, role);\n"
    "    END IF;\n"
    "    n := 0;\n"
    "    FOR g IN SELECT key AS tbl, value AS privs FROM jsonb_each_text(r -> 'grants') LOOP\n"
    "      IF g.privs <> ''\n"
    "         AND g.privs !~ '^(SELECT|INSERT|UPDATE|DELETE)(, (SELECT|INSERT|UPDATE|DELETE))*$'\n"
    "      THEN\n"
    "        RAISE EXCEPTION 'privileges \"%\" on % are not a list of SELECT, INSERT, UPDATE, "
    "DELETE', g.privs, g.tbl;\n"
    "      END IF;\n"
    "      -- a table of a later schema than the ledger's (roles applied before it migrates)\n"
    "      CONTINUE WHEN to_regclass(quote_ident(g.tbl)) IS NULL;\n"
    "      EXECUTE format('REVOKE ALL ON TABLE %I FROM %I', g.tbl, role);\n"
    "      IF g.privs <> '' THEN\n"
    "        EXECUTE format('GRANT %s ON TABLE %I TO %I', g.privs, g.tbl, role);\n"
    "        n := n + 1;\n"
    "      END IF;\n"
    "    END LOOP;\n"
    "    IF has_schema_privilege(role, schema, 'CREATE') THEN\n"
    "      -- PostgreSQL before 15 lets PUBLIC create in schema public; its owner can take it "
    "back\n"
    "      IF pg_has_role(me, (SELECT nspowner FROM pg_namespace WHERE nspname = schema), "
    "'USAGE') THEN\n"
    "        EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM PUBLIC', schema);\n"
    "        EXECUTE format('REVOKE CREATE ON SCHEMA %I FROM %I', schema, role);\n"
    "      END IF;\n"
    "      IF has_schema_privilege(role, schema, 'CREATE') AND warning = '' THEN\n"
    "        warning := format('role %s can still create objects in schema %s; its owner should "
    "run: REVOKE CREATE ON SCHEMA %I FROM PUBLIC', role, schema, schema);\n"
    "      END IF;\n"
    "    END IF;\n"
    "    report := report || jsonb_build_object('name', role, 'created', created,\n"
    "      'password_set', r ->> 'password' IS NOT NULL, 'tables', n);\n"
    "  END LOOP;\n"
    "  PERFORM set_config('tally.roles_report', jsonb_build_object('roles', report,\n"
    "    'schema', schema, 'warning', warning)::text, true);\n"
    "END\n"
    "$tally$";

static const char *text_or_empty(const json_t *j)
{
    const char *s = json_string_value(j);
    return s != NULL ? s : "";
}

/* The spec the DO block reads: each role's name, password (or null), setting and grants. The
 * caller frees. */
static char *spec_json(const tally_config_t *cfg)
{
    json_t *roles = json_array();
    for (int r = 0; r < TALLY_ROLE_COUNT && roles != NULL; r++) {
        json_t *g = json_object();
        for (size_t t = 0; t < N_TABLES && g != NULL; t++)
            json_object_set_new(g, grants[t].table, json_string(grants[t].privileges[r]));
        const char *password = cfg->role_password[r];
        json_array_append_new(
            roles,
            json_pack("{s:s, s:s, s:s, s:o, s:o}", "component", components[r], "name",
                      tally_role_name(cfg, (tally_role_t)r), "setting", settings[r], "password",
                      password != NULL && password[0] != '\0' ? json_string(password) : json_null(),
                      "grants", g != NULL ? g : json_null()));
    }
    /* a role left out (out of memory) would silently keep its old grants: all or nothing */
    bool whole = json_array_size(roles) == TALLY_ROLE_COUNT;
    json_t *spec = json_pack("{s:o}", "roles", roles != NULL ? roles : json_null());
    char *text = spec != NULL && whole ? json_dumps(spec, JSON_COMPACT) : NULL;
    json_decref(spec);
    return text;
}

static bool valid_names(const tally_config_t *cfg, tally_error_t *err)
{
    for (int r = 0; r < TALLY_ROLE_COUNT; r++) {
        const char *name = tally_role_name(cfg, (tally_role_t)r);
        if (name == NULL || name[0] == '\0' || strlen(name) >= 64) {
            tally_error_setc(err, TALLY_ERR_INVALID,
                             "the %s role's name (%s) must be 1 to 63 bytes", components[r],
                             settings[r]);
            return false;
        }
        for (int o = 0; o < r; o++) {
            if (strcmp(name, tally_role_name(cfg, (tally_role_t)o)) == 0) {
                tally_error_setc(err, TALLY_ERR_INVALID,
                                 "the %s and the %s role are both named \"%s\": each component "
                                 "needs a role of its own",
                                 components[o], components[r], name);
                return false;
            }
        }
    }
    return true;
}

static void read_report(const char *text, tally_roles_report_t *report)
{
    memset(report, 0, sizeof *report);
    json_t *root = json_loads(text, 0, NULL);
    json_t *roles = json_object_get(root, "roles");
    for (size_t i = 0; i < json_array_size(roles) && i < TALLY_ROLE_COUNT; i++) {
        json_t *o = json_array_get(roles, i);
        tally_role_outcome_t *out = &report->role[i];
        snprintf(out->name, sizeof out->name, "%s", text_or_empty(json_object_get(o, "name")));
        out->created = json_is_true(json_object_get(o, "created"));
        out->password_set = json_is_true(json_object_get(o, "password_set"));
        out->tables = (int)json_integer_value(json_object_get(o, "tables"));
    }
    snprintf(report->schema, sizeof report->schema, "%s",
             text_or_empty(json_object_get(root, "schema")));
    snprintf(report->warning, sizeof report->warning, "%s",
             text_or_empty(json_object_get(root, "warning")));
    json_decref(root);
}

bool tally_roles_ensure(tally_pg_t *pg, const tally_config_t *cfg, tally_roles_report_t *report,
                        tally_error_t *err)
{
    if (!valid_names(cfg, err))
        return false;
    char *spec = spec_json(cfg);
    if (spec == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory describing the roles");
        return false;
    }
    const char *params[1] = {spec};
    bool ok = tally_pg_run(pg, "SELECT set_config('tally.roles_spec', $1, true)", 1, params, err);
    /* the spec holds the passwords: not a byte of it kept past the DO block */
    memset(spec, 0, strlen(spec));
    free(spec);
    if (!ok)
        return false;
    if (!tally_pg_run(pg, SQL_ENSURE, 0, NULL, err))
        return false; /* the caller rolls back, and the setting with it */
    if (!tally_pg_run(pg, "SELECT set_config('tally.roles_spec', '', true)", 0, NULL, err))
        return false;
    PGresult *res = tally_pg_exec(pg, "SELECT current_setting('tally.roles_report')", 0, NULL, err);
    if (res == NULL)
        return false;
    if (report != NULL)
        read_report(PQgetvalue(res, 0, 0), report);
    PQclear(res);
    return true;
}

bool tally_roles_session(tally_pg_t *pg, tally_session_role_t *who, tally_error_t *err)
{
    memset(who, 0, sizeof *who);
    PGresult *res =
        tally_pg_exec(pg,
                      "SELECT current_user, coalesce(o.rolname, ''),"
                      " (SELECT rolsuper FROM pg_roles WHERE rolname = current_user),"
                      " o.oid IS NOT NULL AND pg_has_role(current_user, o.oid, 'MEMBER')"
                      " FROM (SELECT 1) x LEFT JOIN pg_class c ON c.oid = to_regclass('events')"
                      " LEFT JOIN pg_roles o ON o.oid = c.relowner",
                      0, NULL, err);
    if (res == NULL)
        return false;
    snprintf(who->user, sizeof who->user, "%s", PQgetvalue(res, 0, 0));
    snprintf(who->owner, sizeof who->owner, "%s", PQgetvalue(res, 0, 1));
    who->superuser = PQgetvalue(res, 0, 2)[0] == 't';
    who->owner_member = PQgetvalue(res, 0, 3)[0] == 't';
    PQclear(res);
    return true;
}

bool tally_roles_privileged(const tally_session_role_t *who, char *why, size_t whysz)
{
    if (who->superuser) {
        snprintf(why, whysz, "role \"%s\" is a superuser: it could rewrite the audit trail",
                 who->user);
        return true;
    }
    if (who->owner_member) {
        if (strcmp(who->user, who->owner) == 0)
            snprintf(why, whysz,
                     "role \"%s\" owns the ledger's tables: it could alter or drop them",
                     who->user);
        else
            snprintf(why, whysz,
                     "role \"%s\" is a member of \"%s\", which owns the ledger's tables: it could "
                     "alter or drop them",
                     who->user, who->owner);
        return true;
    }
    if (why != NULL && whysz > 0)
        why[0] = '\0';
    return false;
}
