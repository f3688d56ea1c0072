/* migrate.c — versioned SQL migrations compiled into the binaries, and the window of schema
 * versions each binary runs on. */
#include "tally/migrate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TALLY_VERSION
#define TALLY_VERSION "0"
#endif

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

/* Every release, oldest first; the last is this binary's (a unit test holds the last entry to
 * TALLY_VERSION and tally_migrate_latest()). Add a line when the version or the newest migration
 * changes. */
const tally_release_t tally_releases[] = {
    {"0.1.0", 15},
    {"0.2.0", 16},
    {"0.3.0", 17},
    {NULL, 0},
};

const char *tally_migrate_release_of(int schema)
{
    for (const tally_release_t *r = tally_releases; r->name != NULL; r++)
        if (r->schema >= schema)
            return r->name;
    return NULL;
}

bool tally_migrate_parse_app_name(const char *app, char *release, size_t releasesz, int *oldest,
                                  int *newest)
{
    const char *slash = strchr(app, '/');
    if (strncmp(app, "tally-", 6) != 0 || slash == NULL)
        return false;
    const char *space = strchr(slash, ' ');
    size_t n = space != NULL ? (size_t)(space - slash - 1) : 0;
    if (n == 0 || n >= releasesz)
        return false;
    int lo = 0, hi = 0, used = 0;
    if (sscanf(space, " (schema %d-%d)%n", &lo, &hi, &used) != 2 || space[used] != '\0' ||
        lo <= 0 || hi < lo)
        return false;
    memcpy(release, slash + 1, n);
    release[n] = '\0';
    *oldest = lo;
    *newest = hi;
    return true;
}

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

bool tally_migrate_window(tally_pg_t *pg, tally_schema_window_t *win, tally_error_t *err)
{
    memset(win, 0, sizeof *win);
    if (!read_version(pg, &win->version, err))
        return false;
    if (win->version < 15)
        return true; /* no window recorded before version 15 */
    PGresult *res = tally_pg_exec(
        pg, "SELECT serves_from, serves_from_release FROM tally_schema_window WHERE id = 1", 0,
        NULL, err);
    if (res == NULL)
        return false;
    if (PQntuples(res) == 1) {
        win->serves_from = atoi(PQgetvalue(res, 0, 0));
        snprintf(win->serves_from_release, sizeof win->serves_from_release, "%s",
                 PQgetvalue(res, 0, 1));
    }
    PQclear(res);
    return true;
}

tally_schema_fit_t tally_schema_fit(const tally_schema_window_t *win, int oldest, int newest,
                                    const char *release, char *msg, size_t msgsz)
{
    const int v = win->version;
    if (v < oldest) {
        /* the release whose newest schema it is, when there is one */
        const char *theirs = NULL;
        for (const tally_release_t *r = tally_releases; r->name != NULL; r++)
            if (r->schema == v)
                theirs = r->name;
        if (theirs != NULL && strcmp(theirs, release) != 0)
            snprintf(msg, msgsz,
                     "database schema is at version %d; tally %s runs on schema %d to %d: run "
                     "`tally migrate` of tally %s first, or keep running tally %s, whose schema "
                     "it is",
                     v, release, oldest, newest, release, theirs);
        else
            snprintf(msg, msgsz,
                     "database schema is at version %d; tally %s runs on schema %d to %d: run "
                     "`tally migrate` of tally %s first",
                     v, release, oldest, newest, release);
        return TALLY_SCHEMA_TOO_OLD;
    }
    if (v == newest) {
        snprintf(msg, msgsz, "schema version %d", v);
        return TALLY_SCHEMA_FITS;
    }
    if (v < newest) {
        snprintf(msg, msgsz,
                 "database schema is at version %d, older than tally %s's %d but inside the "
                 "schemas it runs on (%d to %d); run `tally migrate` to finish the upgrade",
                 v, release, newest, oldest, newest);
        return TALLY_SCHEMA_FITS_OLDER;
    }
    if (win->serves_from == 0) {
        snprintf(msg, msgsz,
                 "database schema is at version %d, newer than tally %s's %d, and records no "
                 "window of releases it serves: deploy the release that migrated it",
                 v, release, newest);
        return TALLY_SCHEMA_TOO_NEW;
    }
    if (newest < win->serves_from) {
        snprintf(msg, msgsz,
                 "database schema is at version %d and serves binaries from schema %d (tally "
                 "%s) on; this is tally %s (schema %d): deploy tally %s or newer",
                 v, win->serves_from, win->serves_from_release, release, newest,
                 win->serves_from_release);
        return TALLY_SCHEMA_TOO_NEW;
    }
    snprintf(msg, msgsz,
             "database schema is at version %d, newer than tally %s's %d; a later release "
             "migrated it and still serves this one (from schema %d, tally %s)",
             v, release, newest, win->serves_from, win->serves_from_release);
    return TALLY_SCHEMA_FITS_NEWER;
}

bool tally_migrate_sessions(tally_pg_t *pg, tally_schema_session_t *sessions, size_t max, size_t *n,
                            tally_error_t *err)
{
    *n = 0;
    /* application_name and usename are visible for every session, whoever asks */
    PGresult *res = tally_pg_exec(pg,
                                  "SELECT pid, application_name, coalesce(usename, '') "
                                  "FROM pg_stat_activity "
                                  "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                                  " AND application_name LIKE 'tally-%' "
                                  " AND application_name NOT LIKE 'tally-migrate%' "
                                  "ORDER BY application_name, pid",
                                  0, NULL, err);
    if (res == NULL)
        return false;
    for (int i = 0; i < PQntuples(res); i++) {
        if (*n < max) {
            tally_schema_session_t *s = &sessions[*n];
            memset(s, 0, sizeof *s);
            s->pid = atoi(PQgetvalue(res, i, 0));
            snprintf(s->app, sizeof s->app, "%s", PQgetvalue(res, i, 1));
            snprintf(s->user, sizeof s->user, "%s", PQgetvalue(res, i, 2));
            if (!tally_migrate_parse_app_name(s->app, s->release, sizeof s->release, &s->oldest,
                                              &s->newest)) {
                s->release[0] = '\0';
                s->oldest = s->newest = 0;
            }
        }
        (*n)++;
    }
    PQclear(res);
    return true;
}

bool tally_schema_session_served(const tally_schema_session_t *s, int serves_from)
{
    /* a process of a release before the window compared versions for equality: only a ledger
     * that serves every binary from 15 on is one it started on, and a later step may not be */
    return s->newest > 0 && s->newest >= serves_from;
}

int tally_migrations_serves_from_after(const tally_migration_t *list, int version, int serves_from)
{
    for (const tally_migration_t *m = list; m->name != NULL; m++)
        if (m->version > version && m->serves_from > serves_from)
            serves_from = m->serves_from;
    return serves_from;
}

int tally_migrate_serves_from_after(int version, int serves_from)
{
    return tally_migrations_serves_from_after(tally_migrations, version, serves_from);
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
    /* within the deadline (tally migrate sets a long one); NULL: lost or no answer in time */
    PGresult *res = tally_pg_exec_script(pg, m->sql, err);
    if (res == NULL)
        return false;
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
    const tally_migration_t machines = {0, "machines", TALLY_MACHINES_SQL, 0};
    if (!run_migration(pg, &machines, err))
        return false;
    return tally_pg_run(pg,
                        "INSERT INTO schema_machines (id, sha256) VALUES (1, $1)"
                        " ON CONFLICT (id) DO UPDATE SET sha256 = EXCLUDED.sha256,"
                        " installed_at = now()",
                        1, params, err);
}

/* A contract step applied: the window's oldest served binary moves up. Refuses while a process
 * the new window no longer serves is connected, so the step never breaks a running worker.
 * Called inside the migration's transaction, after the steps ran (it rolls back with them). */
static bool raise_window(tally_pg_t *pg, int found, int applied, tally_error_t *err)
{
    if (applied < 15 || applied == found)
        return true;
    tally_schema_window_t win;
    if (!tally_migrate_window(pg, &win, err))
        return false;
    int after = tally_migrate_serves_from_after(found, win.serves_from);
    if (after <= win.serves_from)
        return true;
    tally_schema_session_t s[8];
    size_t n = 0;
    if (!tally_migrate_sessions(pg, s, sizeof s / sizeof s[0], &n, err))
        return false;
    char blockers[600] = "";
    size_t o = 0, nblock = 0;
    for (size_t i = 0; i < n && i < sizeof s / sizeof s[0]; i++) {
        if (tally_schema_session_served(&s[i], after))
            continue;
        nblock++;
        if (o < sizeof blockers)
            o += (size_t)snprintf(blockers + o, sizeof blockers - o, "%s%s (pid %d)",
                                  nblock > 1 ? ", " : "", s[i].app, s[i].pid);
    }
    if (nblock > 0 || n > sizeof s / sizeof s[0]) {
        tally_error_setc(err, TALLY_ERR_SCHEMA_TOO_NEW,
                         "refusing the contract step to schema %d: it serves binaries from schema "
                         "%d (tally %s) on, and older ones are connected: %s%s; finish the "
                         "rollout of tally %s (or stop them) and run `tally migrate` again",
                         applied, after, tally_migrate_release_of(after), blockers,
                         n > sizeof s / sizeof s[0] ? " and more" : "",
                         tally_migrate_release_of(after));
        return false;
    }
    const char *release = tally_migrate_release_of(after);
    char from[16];
    snprintf(from, sizeof from, "%d", after);
    const char *params[2] = {from, release != NULL ? release : TALLY_VERSION};
    TALLY_INFO("the schema serves binaries from schema %d (tally %s) on", after, params[1]);
    return tally_pg_run(pg,
                        "UPDATE tally_schema_window SET serves_from = $1::int,"
                        " serves_from_release = $2, updated_at = now() WHERE id = 1",
                        2, params, err);
}

/* One row of tally_schema_history (016) for a run that applied something. */
static bool record_history(tally_pg_t *pg, int found, int applied, tally_error_t *err)
{
    if (applied < 16 || applied == found)
        return true;
    char from[16], to[16];
    snprintf(from, sizeof from, "%d", found);
    snprintf(to, sizeof to, "%d", applied);
    const char *params[3] = {from, to, TALLY_VERSION};
    return tally_pg_run(pg,
                        "INSERT INTO tally_schema_history (from_version, to_version, release,"
                        " serves_from) SELECT $1::int, $2::int, $3, serves_from"
                        " FROM tally_schema_window WHERE id = 1",
                        3, params, err);
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
    if (!raise_window(pg, found, applied, err) || !record_history(pg, found, applied, err))
        goto fail;
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
