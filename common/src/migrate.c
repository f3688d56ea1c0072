/* migrate.c — versioned SQL migrations compiled into the binaries. */
#include "tally/migrate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/log.h"
#include "tally/roles.h"

/* TALLY_MACHINES_SQL and TALLY_MACHINES_SHA256, generated from schemas/machines.json. */
#include "machines_sql.inc"

/* pg_advisory_xact_lock key shared by every `tally migrate`: "tallymig" as ASCII. */
#define MIGRATE_LOCK_KEY "8386103194290055527"

static const char SQL_CREATE_TABLE[] = "CREATE TABLE IF NOT EXISTS tally_migrations ("
                                       " version int PRIMARY KEY,"
                                       " name text NOT NULL,"
                                       " applied_at timestamptz NOT NULL DEFAULT now())";

int tally_migrate_latest(void)
{
    int latest = 0;
    for (const tally_migration_t *m = tally_migrations; m->name != NULL; m++)
        if (m->version > latest)
            latest = m->version;
    return latest;
}

/* The version recorded in tally_migrations (0 when the table is absent or empty). */
static bool read_version(tally_pg_t *pg, int *version, tally_error_t *err)
{
    PGresult *res = tally_pg_exec(pg,
                                  "SELECT CASE WHEN to_regclass('tally_migrations') IS NULL"
                                  " THEN -1 ELSE 0 END",
                                  0, NULL, err);
    if (res == NULL)
        return false;
    bool exists = atoi(PQgetvalue(res, 0, 0)) == 0;
    PQclear(res);
    if (!exists) {
        *version = 0;
        return true;
    }
    res = tally_pg_exec(pg, "SELECT coalesce(max(version), 0) FROM tally_migrations", 0, NULL, err);
    if (res == NULL)
        return false;
    *version = atoi(PQgetvalue(res, 0, 0));
    PQclear(res);
    return true;
}

bool tally_migrate_current(tally_pg_t *pg, int *version, tally_error_t *err)
{
    return read_version(pg, version, err);
}

/* Run one embedded migration's SQL (several statements: simple-query protocol). The text is
 * compiled into the binary, never built from input. */
static bool run_migration(tally_pg_t *pg, const tally_migration_t *m, tally_error_t *err)
{
    PGconn *conn = tally_pg_conn(pg);
    if (conn == NULL) {
        tally_error_set_pg(err, "08006", true, "migration %03d_%s: PostgreSQL connection lost",
                           m->version, m->name);
        return false;
    }
    PGresult *res = PQexec(conn, m->sql);
    ExecStatusType st = PQresultStatus(res);
    if (res != NULL && (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK)) {
        PQclear(res);
        return true;
    }
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    const char *primary = res ? PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY) : NULL;
    char msg[400];
    snprintf(msg, sizeof(msg), "%s", primary ? primary : PQerrorMessage(conn));
    msg[strcspn(msg, "\n")] = '\0';
    tally_error_set_pg(err, state, false, "migration %03d_%s failed: %s", m->version, m->name, msg);
    PQclear(res);
    return false;
}

/* The state machines' triggers (ledger.h), installed when the database has none or others than
 * this binary's: the generated SQL replaces functions and triggers, so it runs again safely. A
 * database older than version 10 has no schema_machines table: the caller applies the numbered
 * migrations first. */
static bool install_machines(tally_pg_t *pg, tally_error_t *err)
{
    const char *params[1] = {TALLY_MACHINES_SHA256};
    PGresult *res =
        tally_pg_exec(pg, "SELECT 1 FROM schema_machines WHERE sha256 = $1", 1, params, err);
    if (res == NULL)
        return false;
    bool current = PQntuples(res) == 1;
    PQclear(res);
    if (current)
        return true;
    TALLY_INFO("installing the state machines (schemas/machines.json, sha256 %s)",
               TALLY_MACHINES_SHA256);
    const tally_migration_t machines = {0, "machines", TALLY_MACHINES_SQL};
    if (!run_migration(pg, &machines, err))
        return false;
    return tally_pg_run(pg,
                        "INSERT INTO schema_machines (id, sha256) VALUES (1, $1)"
                        " ON CONFLICT (id) DO UPDATE SET sha256 = EXCLUDED.sha256,"
                        " installed_at = now()",
                        1, params, err);
}

bool tally_migrate_apply(tally_pg_t *pg, const tally_config_t *cfg, int *before, int *after,
                         tally_roles_report_t *roles, tally_error_t *err)
{
    const int latest = tally_migrate_latest();
    int found = 0;
    if (!tally_pg_begin(pg, err))
        return false;

    const char *lock_params[1] = {MIGRATE_LOCK_KEY};
    if (!tally_pg_run(pg, "SELECT pg_advisory_xact_lock($1::bigint)", 1, lock_params, err))
        goto fail;
    /* Created under the lock, so concurrent first runs never race on the catalog. */
    if (!tally_pg_run(pg, SQL_CREATE_TABLE, 0, NULL, err))
        goto fail;
    if (!read_version(pg, &found, err))
        goto fail;
    if (found > latest) {
        tally_error_setc(err, TALLY_ERR_SCHEMA_TOO_NEW,
                         "the database schema is at version %d but this tally only knows up to "
                         "version %d; upgrade tally before running it against this database",
                         found, latest);
        goto fail;
    }

    int applied = found;
    for (const tally_migration_t *m = tally_migrations; m->name != NULL; m++) {
        if (m->version <= found)
            continue;
        TALLY_INFO("applying migration %03d_%s", m->version, m->name);
        if (!run_migration(pg, m, err))
            goto fail;
        char version[16];
        snprintf(version, sizeof(version), "%d", m->version);
        const char *params[2] = {version, m->name};
        if (!tally_pg_run(pg, "INSERT INTO tally_migrations (version, name) VALUES ($1, $2)", 2,
                          params, err))
            goto fail;
        applied = m->version;
    }
    if (!install_machines(pg, err))
        goto fail;
    /* every run grants again, so a table a migration added gets its grants */
    if (!tally_roles_ensure(pg, cfg, roles, err))
        goto fail;
    if (!tally_pg_commit(pg, err))
        return false;
    if (before != NULL)
        *before = found;
    if (after != NULL)
        *after = applied;
    return true;

fail:
    tally_pg_rollback(pg);
    return false;
}
