/* cmd_migrate.c — `tally migrate`: bring the ledger schema up to this binary's version. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tally/migrate.h"
#include "tally/pg.h"
#include "tally/roles.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tally migrate [--status] [--roles] [--wait SECONDS]\n"
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
            "  --roles           also print each role's grants, table by table\n"
            "  --wait SECONDS    keep retrying the connection this long (default 0: one try)\n"
            "  --help            this text\n"
            "\n"
            "Exit codes: 0 done, 1 a migration failed (rolled back), a role is missing and\n"
            "cannot be created, or the database is newer than this binary, 2 usage error,\n"
            "3 PostgreSQL unreachable.\n");
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

static int print_status(tally_pg_t *pg)
{
    tally_error_t err;
    int version = 0;
    if (!tally_migrate_current(pg, &version, &err)) {
        fprintf(stderr, "tally migrate: cannot read the schema version: %s\n", err.message);
        return is_connection_error(&err) ? 3 : 1;
    }
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

int tally_cmd_migrate(int argc, char **argv, tally_config_t *cfg)
{
    static const struct option opts[] = {
        {"status", no_argument, NULL, 's'},
        {"roles", no_argument, NULL, 'r'},
        {"wait", required_argument, NULL, 'w'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    bool status = false;
    bool roles = false;
    int wait_s = 0;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            status = true;
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
    tally_error_t err;
    if (!tally_pg_connect(pg, wait_s * 1000, NULL, &err)) {
        fprintf(stderr, "tally migrate: %s\n", err.message);
        tally_pg_free(pg);
        return 3;
    }
    if (status) {
        int rc = print_status(pg);
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
