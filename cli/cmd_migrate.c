/* cmd_migrate.c — `tally migrate`: bring the ledger schema up to this binary's version. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tally/migrate.h"
#include "tally/pg.h"
#include "tally/roles.h"

/* The least client deadline of a migration statement (TALLY_PG_DEADLINE_MS may raise it). */
#define MIGRATE_DEADLINE_MS 3600000

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tally migrate [--status | --check | --plan] [--roles] [--wait SECONDS]\n"
            "\n"
            "Apply every SQL migration compiled into this binary that the database (TALLY_PG)\n"
            "has not applied yet, in one transaction. Safe to run again and from several hosts\n"
            "at once: concurrent runs wait for each other and apply each migration once.\n"
            "\n"
            "The role TALLY_PG connects as owns the ledger: run migrate as the owner, never as\n"
            "a worker. In the same transaction it makes sure each runtime role exists\n"
            "(TALLY_ROLE_DISPATCHER, _RECONCILER, _COMPENSATOR, _OPERATOR, _READER; created\n"
            "LOGIN and nothing more, which needs CREATEROLE, not superuser) and grants each\n"
            "exactly what its component needs, again on every run. TALLY_ROLE_PASSWORD_<ROLE>,\n"
            "when set, becomes that role's password. docs/operations.md, \"Database roles\".\n"
            "\n"
            "  --status          print the database's version and whether it is current;\n"
            "                    exit 0 when current, 1 when not\n"
            "  --check           exit 0 when this tally runs on the database's schema (inside\n"
            "                    its window: what a worker of this release checks at start),\n"
            "                    1 when not, saying which release to run; for init containers\n"
            "  --plan            print what would run, the releases the schema would serve\n"
            "                    after it, and each tally process connected now with whether\n"
            "                    it stays served; change nothing. Exit 0 when migrate would\n"
            "                    go ahead, 1 when it would refuse\n"
            "  --roles           also print each role's grants, table by table\n"
            "  --wait SECONDS    keep retrying the connection this long (default 0: one try)\n"
            "  --help            this text\n"
            "\n"
            "Expand steps only add, so workers of the previous release keep running on the new\n"
            "schema; a contract step (a later release) no longer serves older binaries, and\n"
            "is refused while any of them is connected. A database newer than this tally that\n"
            "still serves it is left as it is (exit 0): a rollback inside the window.\n"
            "docs/operations.md, \"Upgrading and rolling back\".\n"
            "\n"
            "Exit codes: 0 done, 1 a migration failed (rolled back), a contract step was\n"
            "refused, a role is missing and cannot be created, or the database is newer than\n"
            "this binary and no longer serves it, 2 usage error, 3 PostgreSQL unreachable.\n");
}

/* One line per role: created or already there, its password, its tables; with @p grants,
 * what it may do to each table (roles.h's table). */
static void print_roles(const tally_roles_report_t *report, bool grants)
{
    for (int r = 0; r < TALLY_ROLE_COUNT; r++) {
        const tally_role_outcome_t *o = &report->role[r];
        printf("role %-20s %-11s %s, granted on %d table%s%s\n", o->name,
               tally_role_component((tally_role_t)r), o->created ? "created" : "existed", o->tables,
               o->tables == 1 ? "" : "s", o->password_set ? ", password set" : "");
        for (size_t t = 0; grants && t < tally_roles_n_tables(); t++) {
            const char *privileges = tally_roles_privileges((tally_role_t)r, t);
            printf("  %-18s %s\n", tally_roles_table(t), privileges[0] ? privileges : "-");
        }
    }
    if (report->warning[0] != '\0')
        printf("warning: %s\n", report->warning);
}

static bool is_connection_error(const tally_error_t *err)
{
    return err->errc == TALLY_ERR_PG_CONNECTION;
}

static void print_window(const char *what, int version, int serves_from, const char *release)
{
    if (serves_from > 0)
        printf("%s schema %d, serving binaries from schema %d (tally %s) on\n", what, version,
               serves_from, release != NULL && release[0] != '\0' ? release : "?");
    else
        printf("%s schema %d\n", what, version);
}

/* The schema's version and window; @returns 0, or the exit code when it cannot be read. */
static int read_window(tally_pg_t *pg, tally_schema_window_t *win)
{
    tally_error_t err;
    if (tally_migrate_window(pg, win, &err))
        return 0;
    fprintf(stderr, "tally migrate: cannot read the schema version: %s\n", err.message);
    return is_connection_error(&err) ? 3 : 1;
}

static int print_status(tally_pg_t *pg)
{
    tally_schema_window_t win;
    int rc = read_window(pg, &win);
    if (rc != 0)
        return rc;
    int version = win.version;
    int latest = tally_migrate_latest();
    if (version == latest) {
        printf("database at version %d; this tally's latest is %d: up to date\n", version, latest);
        return 0;
    }
    if (version < latest)
        printf("database at version %d; this tally's latest is %d: %d migration%s to apply "
               "(run `tally migrate`)\n",
               version, latest, latest - version, latest - version == 1 ? "" : "s");
    else
        printf("database at version %d; this tally's latest is %d: the database is newer, "
               "upgrade tally\n",
               version, latest);
    return 1;
}

/* The last run of `tally migrate` that applied something (tally_schema_history, from 16). */
static void print_last_migration(tally_pg_t *pg, int version)
{
    if (version < 16)
        return;
    tally_error_t err;
    PGresult *res = tally_pg_exec(pg,
                                  "SELECT from_version, to_version, release, migrated_by,"
                                  " to_char(migrated_at AT TIME ZONE 'UTC',"
                                  " 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
                                  " FROM tally_schema_history ORDER BY id DESC LIMIT 1",
                                  0, NULL, &err);
    if (res == NULL) {
        printf("last migrated: unknown (%s)\n", err.message);
        return;
    }
    if (PQntuples(res) == 1)
        printf("last migrated: from schema %s to %s by tally %s, as %s, at %s\n",
               PQgetvalue(res, 0, 0), PQgetvalue(res, 0, 1), PQgetvalue(res, 0, 2),
               PQgetvalue(res, 0, 3), PQgetvalue(res, 0, 4));
    PQclear(res);
}

/* --check: would a worker of this release start on this schema? */
static int print_check(tally_pg_t *pg)
{
    tally_schema_window_t win;
    int rc = read_window(pg, &win);
    if (rc != 0)
        return rc;
    char why[600];
    switch (tally_schema_fit(&win, TALLY_SCHEMA_OLDEST, tally_migrate_latest(), TALLY_VERSION, why,
                             sizeof why)) {
    case TALLY_SCHEMA_FITS:
    case TALLY_SCHEMA_FITS_OLDER:
    case TALLY_SCHEMA_FITS_NEWER:
        printf("tally %s runs on this database: %s\n", TALLY_VERSION, why);
        return 0;
    case TALLY_SCHEMA_TOO_OLD:
    case TALLY_SCHEMA_TOO_NEW:
        break;
    }
    printf("tally %s does not run on this database: %s\n", TALLY_VERSION, why);
    return 1;
}

/* --plan: what `tally migrate` would do, and whom the schema would serve after it. */
static int print_plan(tally_pg_t *pg)
{
    tally_schema_window_t win;
    int rc = read_window(pg, &win);
    if (rc != 0)
        return rc;
    const int latest = tally_migrate_latest();
    print_window("database now:", win.version, win.serves_from, win.serves_from_release);
    print_last_migration(pg, win.version);
    printf("this tally %s runs on schema %d to %d\n", TALLY_VERSION, TALLY_SCHEMA_OLDEST, latest);
    char why[600];
    if (win.version > latest) {
        tally_schema_fit_t fit =
            tally_schema_fit(&win, TALLY_SCHEMA_OLDEST, latest, TALLY_VERSION, why, sizeof why);
        printf("nothing to apply: %s\n", why);
        return fit == TALLY_SCHEMA_FITS_NEWER ? 0 : 1;
    }
    int steps = 0;
    for (const tally_migration_t *m = tally_migrations; m->name != NULL; m++) {
        if (m->version <= win.version)
            continue;
        if (steps++ == 0)
            printf("to apply, in one transaction:\n");
        if (m->serves_from > 0)
            printf("  %03d_%s  contract: serves binaries from schema %d on\n", m->version, m->name,
                   m->serves_from);
        else
            printf("  %03d_%s  expand\n", m->version, m->name);
    }
    if (steps == 0)
        printf("nothing to apply: the database is at this tally's schema\n");
    /* before 15 there is no window: the step to 15 makes one serving from 15 */
    int serves_from = win.version >= 15 ? win.serves_from : 15;
    int after = tally_migrate_serves_from_after(win.version, serves_from);
    const char *after_release =
        after == win.serves_from ? win.serves_from_release : tally_migrate_release_of(after);
    print_window("after:", latest > win.version ? latest : win.version, after, after_release);

    tally_schema_session_t s[64];
    size_t n = 0;
    tally_error_t err;
    if (!tally_migrate_sessions(pg, s, sizeof s / sizeof s[0], &n, &err)) {
        fprintf(stderr, "tally migrate: cannot list the connected processes: %s\n", err.message);
        return is_connection_error(&err) ? 3 : 1;
    }
    size_t shown = n < sizeof s / sizeof s[0] ? n : sizeof s / sizeof s[0];
    size_t unserved = 0;
    printf("tally processes connected now: %zu\n", n);
    for (size_t i = 0; i < shown; i++) {
        bool served = tally_schema_session_served(&s[i], after);
        unserved += served ? 0 : 1;
        printf("  pid %-7d %-20s %s  %s\n", s[i].pid, s[i].user, s[i].app,
               served             ? "served after"
               : s[i].newest == 0 ? "NOT SERVED after: a release before 0.1.0"
                                  : "NOT SERVED after: its newest schema is older");
    }
    if (n > shown)
        printf("  ... and %zu more, not checked here\n", n - shown);
    bool contract = after > serves_from;
    if (contract && (unserved > 0 || n > shown)) {
        printf("`tally migrate` would refuse: the contract step no longer serves %zu connected "
               "process%s; finish the rollout of tally %s first\n",
               unserved, unserved == 1 ? "" : "es", after_release != NULL ? after_release : "?");
        return 1;
    }
    if (unserved > 0)
        printf("note: %zu connected process%s of a release before the window: it keeps running, "
               "but will not start again on this schema\n",
               unserved, unserved == 1 ? "" : "es");
    printf("`tally migrate` would go ahead: %d step%s\n", steps, steps == 1 ? "" : "s");
    return 0;
}

int tally_cmd_migrate(int argc, char **argv, tally_config_t *cfg)
{
    static const struct option opts[] = {
        {"status", no_argument, NULL, 's'},
        {"check", no_argument, NULL, 'c'},
        {"plan", no_argument, NULL, 'p'},
        {"roles", no_argument, NULL, 'r'},
        {"wait", required_argument, NULL, 'w'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    bool status = false;
    bool plan = false;
    bool check = false;
    bool roles = false;
    int wait_s = 0;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            status = true;
            break;
        case 'p':
            plan = true;
            break;
        case 'c':
            check = true;
            break;
        case 'r':
            roles = true;
            break;
        case 'w': {
            char *end = NULL;
            long v = strtol(optarg, &end, 10);
            if (end == optarg || *end != '\0' || v < 0 || v > 86400) {
                fprintf(stderr, "tally migrate: --wait: '%s' is not a number of seconds\n", optarg);
                return 2;
            }
            wait_s = (int)v;
            break;
        }
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if ((int)status + (int)plan + (int)check > 1) {
        fprintf(stderr, "tally migrate: --status, --check and --plan: choose one\n");
        return 2;
    }
    if (optind < argc) {
        fprintf(stderr, "tally migrate: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }

    tally_pg_t *pg = tally_pg_new(cfg->pg, "tally-migrate");
    if (pg == NULL) {
        fprintf(stderr, "tally migrate: out of memory\n");
        return 1;
    }
    /* A migration may rewrite or index a large table: each statement gets at least an hour
     * (and the server's statement_timeout with it), still bounded. */
    tally_pg_set_deadline(pg, cfg->pg_deadline_ms > MIGRATE_DEADLINE_MS ? cfg->pg_deadline_ms
                                                                        : MIGRATE_DEADLINE_MS);
    tally_error_t err;
    if (!tally_pg_connect(pg, wait_s * 1000, NULL, &err)) {
        fprintf(stderr, "tally migrate: %s\n", err.message);
        tally_pg_free(pg);
        return 3;
    }
    if (status || plan || check) {
        int rc = status ? print_status(pg) : check ? print_check(pg) : print_plan(pg);
        tally_pg_free(pg);
        return rc;
    }

    /* a runtime role cannot migrate (it may create nothing): say so rather than "permission
     * denied for schema public" */
    tally_session_role_t who;
    if (!tally_roles_session(pg, &who, &err)) {
        fprintf(stderr, "tally migrate: %s\n", err.message);
        tally_pg_free(pg);
        return is_connection_error(&err) ? 3 : 1;
    }
    for (int r = 0; r < TALLY_ROLE_COUNT; r++) {
        if (strcmp(who.user, tally_role_name(cfg, (tally_role_t)r)) == 0) {
            fprintf(
                stderr,
                "tally migrate: TALLY_PG connects as %s, the %s's role, which may create or alter "
                "nothing; run tally migrate as the role that owns the ledger%s%s\n",
                who.user, tally_role_component((tally_role_t)r), who.owner[0] != '\0' ? ": " : "",
                who.owner);
            tally_pg_free(pg);
            return 1;
        }
    }

    int was = 0;
    if (!tally_migrate_current(pg, &was, &err)) {
        fprintf(stderr, "tally migrate: cannot read the schema version: %s\n", err.message);
        tally_pg_free(pg);
        return is_connection_error(&err) ? 3 : 1;
    }
    if (was > tally_migrate_latest()) {
        /* a rollback: the newer schema may still serve this release, which then has nothing
         * to do (and must not grant by an older table of grants) */
        tally_schema_window_t win;
        char why[600];
        int rc = read_window(pg, &win);
        if (rc != 0) {
            tally_pg_free(pg);
            return rc;
        }
        tally_schema_fit_t fit = tally_schema_fit(&win, TALLY_SCHEMA_OLDEST, tally_migrate_latest(),
                                                  TALLY_VERSION, why, sizeof why);
        tally_pg_free(pg);
        if (fit == TALLY_SCHEMA_FITS_NEWER) {
            printf("database at version %d, nothing to do: %s\n", was, why);
            return 0;
        }
        fprintf(stderr, "tally migrate: %s\n", why);
        return 1;
    }
    int before = 0, after = 0;
    tally_roles_report_t report;
    if (!tally_migrate_apply(pg, cfg, &before, &after, &report, &err)) {
        if (is_connection_error(&err))
            fprintf(stderr, "tally migrate: lost PostgreSQL while migrating: %s\n", err.message);
        else if (err.sqlstate[0] != '\0') /* an SQLSTATE */
            fprintf(stderr,
                    "tally migrate: %s (SQLSTATE %s); rolled back, the database is still at "
                    "version %d\n",
                    err.message, err.code, was);
        else
            fprintf(stderr, "tally migrate: %s; the database is still at version %d\n", err.message,
                    was);
        tally_pg_free(pg);
        return is_connection_error(&err) ? 3 : 1;
    }
    tally_pg_free(pg);
    if (after == before)
        printf("database at version %d, nothing to do\n", after);
    else
        printf("database at version %d (was %d)\n", after, before);
    print_roles(&report, roles);
    return 0;
}
