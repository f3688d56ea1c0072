/* cmd_forget.c — `tally forget --tenant T`: erasure by crypto-shredding (DESIGN §12,
 * "Sensitive fields"). The sensitive fields of a tenant's effects are kept only sealed under
 * that tenant's data key (schemas/sql/011_sensitive.sql); destroying the key makes every one
 * of them unreadable at once, and nothing else has to be rewritten: the audit trail stays
 * append-only and verifiable, and keeps only redacted values and keyed hashes.
 *
 * One transaction: lock the tenant's keys, refuse while any effect or obligation of the
 * tenant is open (a tool may still need the real values: a retry, a status check, a reverse
 * call), then drop the wrapped keys and write the "operator" event. Forgetting a tenant
 * twice, or one that never had a key, changes nothing and writes nothing. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/audit.h"
#include "tally/machines.h"
#include "tally/seal.h"
#include "tally/text.h"

static const char USAGE[] =
    "usage: tally forget --tenant T --reason TEXT [--actor NAME]\n"
    "       tally forget --no-tenant --reason TEXT [--actor NAME]\n"
    "\n"
    "Erase a tenant's personal data by destroying its data key (crypto-shredding).\n"
    "The sensitive fields of its effects (the registry's sensitive args and receipt\n"
    "fields) are kept only sealed under that key: once it is gone nobody can read\n"
    "them, tally included. Everything else stays: effects, obligations and runs keep\n"
    "their ids, states, hashes and times, and their args and receipts keep the\n"
    "redaction marker and keyed hash they always showed. The audit trail is not\n"
    "touched (it never held the values); one event records who forgot the tenant,\n"
    "why, and which keys were destroyed.\n"
    "\n"
    "Refused while the tenant has an open effect or obligation (its tool may still\n"
    "need the real values): let them settle, or settle them (`tally status`), then\n"
    "run this again. Running it again for a forgotten tenant changes nothing. A\n"
    "tenant that comes back afterwards gets a new key.\n"
    "\n"
    "  --tenant T     the tenant, as intents name it\n"
    "  --no-tenant    the one key of every effect whose intent named no tenant;\n"
    "                 --tenant '' is refused, so that is never done by mistake\n"
    "  --reason TEXT  why, e.g. the erasure request's reference (required; goes\n"
    "                 into the audit trail)\n"
    "  --actor NAME   who decided (default: the OS user)\n"
    "  -h, --help     this text\n"
    "\n"
    "Exit status: 0 forgotten, or nothing left to forget; 1 refused (something of\n"
    "the tenant is still open) or failed, and nothing was changed; 2 usage error; 3\n"
    "PostgreSQL could not be reached.\n";

typedef struct forget_op {
    const char *tenant; /* '' for --no-tenant */
    bool no_tenant;
    const char *reason;
    const char *actor;
    char source[300]; /* unused: forget publishes nothing; cli_check_decision fills it */
} forget_op_t;

/* ---------------------------------------------------------------------------------------- */
/* SQL                                                                                      */

/* A wait on a row a worker holds must not hang an operator's terminal. */
static const char SQL_LOCK_TIMEOUT[] = "SET LOCAL lock_timeout = '10s'";

/* Every key the tenant ever had, locked, after the tenant's advisory lock (TALLY_SQL_TENANT_LOCK,
 * seal.h): a dispatcher sealing under one of its keys holds that lock shared until its batch
 * commits, so the check below sees every effect sealed before, and none is sealed after. */
static const char SQL_KEYS_LOCK[] =
    "WITH l AS MATERIALIZED (SELECT pg_advisory_xact_lock(" TALLY_SQL_TENANT_LOCK(
        "$1") ") AS ok)"
              " SELECT key_id::text, forgotten_at IS NULL, date_trunc('second', "
              "forgotten_at)::text,"
              "  forgotten_by"
              " FROM tenant_keys, l WHERE tenant = $1 ORDER BY created_at, key_id FOR UPDATE OF "
              "tenant_keys";

/* What of the tenant is still open, by machine and state ($2, $3: the open states of the
 * effect and obligation machines, in their order). An effect is the tenant's when its intent
 * named the tenant ('' is no tenant) or when it is sealed under one of its keys ($4). */
static const char SQL_OPEN[] =
    "SELECT 'effect', e.status, count(*), array_position($2::text[], e.status) FROM effects e"
    " WHERE (coalesce(e.tenant, '') = $1 OR e.seal_key = ANY($4::uuid[]))"
    "   AND e.status = ANY($2::text[])"
    " GROUP BY e.status"
    " UNION ALL "
    "SELECT 'obligation', o.status, count(*), array_position($3::text[], o.status)"
    " FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
    "  JOIN runs r ON r.run_id = o.run_id"
    " WHERE (coalesce(e.tenant, '') = $1 OR coalesce(r.tenant, '') = $1"
    "        OR e.seal_key = ANY($4::uuid[]))"
    "   AND o.status = ANY($3::text[])"
    " GROUP BY o.status"
    " ORDER BY 1, 4";

/* The effects whose sealed fields become unreadable. */
static const char SQL_SEALED[] = "SELECT count(*) FROM effects WHERE seal_key = ANY($1::uuid[])"
                                 " AND (args_sealed IS NOT NULL OR receipt_sealed IS NOT NULL)";

static const char SQL_FORGET[] =
    "WITH f AS (UPDATE tenant_keys SET wrapped = NULL, forgotten_at = now(), forgotten_by = $2"
    "  WHERE tenant = $1 AND forgotten_at IS NULL RETURNING key_id)"
    " SELECT key_id::text FROM f ORDER BY key_id";

/* ---------------------------------------------------------------------------------------- */
/* Options                                                                                  */

static int parse(forget_op_t *o, int argc, char **argv)
{
    enum { O_TENANT = 256, O_NO_TENANT, O_REASON, O_ACTOR };
    static const struct option opts[] = {
        {"tenant", required_argument, NULL, O_TENANT},
        {"no-tenant", no_argument, NULL, O_NO_TENANT},
        {"reason", required_argument, NULL, O_REASON},
        {"actor", required_argument, NULL, O_ACTOR},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option("forget", USAGE, argc, argv, opts, &rc)) != -1) {
        switch (c) {
        case O_TENANT:
            o->tenant = optarg;
            break;
        case O_NO_TENANT:
            o->no_tenant = true;
            break;
        case O_REASON:
            o->reason = optarg;
            break;
        case O_ACTOR:
            o->actor = optarg;
            break;
        }
    }
    if (rc >= 0)
        return rc;
    if (o->no_tenant && o->tenant != NULL)
        return cli_usage_error("forget", "name one tenant: --tenant T or --no-tenant");
    if (o->no_tenant) {
        o->tenant = "";
    } else if (o->tenant == NULL) {
        return cli_usage_error("forget", "--tenant T is required");
    } else if (o->tenant[0] == '\0') {
        return cli_usage_error(
            "forget", "--tenant is empty. Effects whose intents named no tenant share one key; "
                      "to destroy it (every one of them at once), say --no-tenant");
    } else if (strlen(o->tenant) > TALLY_LIMIT_TENANT) {
        return cli_usage_error("forget", "--tenant is %zu bytes; no tenant is longer than %d",
                               strlen(o->tenant), TALLY_LIMIT_TENANT);
    }
    return cli_check_decision("forget", o->reason, true, &o->actor, o->source, sizeof o->source)
               ? -1
               : CLI_EXIT_USAGE;
}

/* ---------------------------------------------------------------------------------------- */
/* The verb                                                                                 */

/* "tenant 'acme'" or "the effects with no tenant", for messages. */
static void tenant_words(const forget_op_t *o, char *out, size_t outsz)
{
    if (o->no_tenant)
        snprintf(out, outsz, "the effects with no tenant");
    else
        snprintf(out, outsz, "tenant '%s'", o->tenant);
}

/* The refusal: what is open, by state, and what to do. @p open is SQL_OPEN's result. */
static void explain_open(const forget_op_t *o, const PGresult *open)
{
    enum { LIST = 512 };
    long long n_effects = 0, n_obligations = 0;
    char effects[LIST] = "", obligations[LIST] = "";
    for (int i = 0; i < PQntuples(open); i++) {
        bool effect = strcmp(PQgetvalue(open, i, 0), "effect") == 0;
        long long n = strtoll(PQgetvalue(open, i, 2), NULL, 10);
        char *list = effect ? effects : obligations;
        size_t len = strlen(list);
        snprintf(list + len, LIST - len, "%s%lld %s", len ? ", " : "", n, PQgetvalue(open, i, 1));
        *(effect ? &n_effects : &n_obligations) += n;
    }
    char who[300], line[2048];
    tenant_words(o, who, sizeof who);
    snprintf(line, sizeof line,
             "tally forget: refused: %s still has %lld open effect%s%s%s%s and %lld open "
             "obligation%s%s%s%s. Their tools may still need the real values (a retry, a status "
             "check, a reverse call), so the key stays until they settle.",
             who, n_effects, n_effects == 1 ? "" : "s", n_effects ? " (" : "", effects,
             n_effects ? ")" : "", n_obligations, n_obligations == 1 ? "" : "s",
             n_obligations ? " (" : "", obligations, n_obligations ? ")" : "");
    cli_wrap(stderr, line, 0, 0);
    cli_wrap(stderr,
             "Let the workers settle them, or settle what waits for a human (`tally status` lists "
             "it), then run this again. Nothing was changed.",
             0, 0);
}

/* The report: what was destroyed, what is unreadable now, what stays. */
static void report(const forget_op_t *o, const PGresult *forgotten, long long sealed)
{
    int n_keys = PQntuples(forgotten);
    char who[300], keys[1024] = "", line[4096];
    tenant_words(o, who, sizeof who);
    for (int i = 0; i < n_keys; i++) {
        size_t len = strlen(keys);
        snprintf(keys + len, sizeof keys - len, "%s%s", i ? ", " : "", PQgetvalue(forgotten, i, 0));
    }
    snprintf(line, sizeof line,
             "%s Forgot %s: destroyed %d data key%s (%s). The sealed fields of %lld effect%s "
             "(their sensitive args and receipts) cannot be read from now on, by anyone; "
             "everything else stays, showing the redaction marker and keyed hash it always "
             "showed. The audit trail is untouched: one operator event records this, by %s.",
             CLI_SYM_OK, who, n_keys, n_keys == 1 ? "" : "s", keys, sealed, sealed == 1 ? "" : "s",
             o->actor);
    cli_wrap(stdout, line, 0, 2);
}

/* Nothing live: say whether the tenant was forgotten already (@p keys: SQL_KEYS_LOCK's rows). */
static void report_nothing(const forget_op_t *o, const PGresult *keys)
{
    char who[300], line[1024];
    tenant_words(o, who, sizeof who);
    int last = PQntuples(keys) - 1;
    if (last < 0)
        snprintf(line, sizeof line,
                 "%s Nothing to forget: %s has no data key (nothing of it was ever sealed). "
                 "Nothing was changed.",
                 CLI_SYM_SKIP, who);
    else
        snprintf(line, sizeof line,
                 "%s Nothing to forget: %s was forgotten already (%s, by %s). Nothing was "
                 "changed.",
                 CLI_SYM_SKIP, who, PQgetvalue(keys, last, 2), PQgetvalue(keys, last, 3));
    cli_wrap(stdout, line, 0, 2);
}

/* The live key ids among SQL_KEYS_LOCK's rows, as a text[] parameter (malloc'd); *@p n their
 * count. NULL when out of memory. */
static char *live_keys(const PGresult *keys, size_t *n)
{
    int rows = PQntuples(keys);
    const char **ids = calloc(rows > 0 ? (size_t)rows : 1, sizeof *ids);
    if (ids == NULL)
        return NULL;
    *n = 0;
    for (int i = 0; i < rows; i++)
        if (strcmp(PQgetvalue(keys, i, 1), "t") == 0)
            ids[(*n)++] = PQgetvalue(keys, i, 0);
    char *param = tally_pg_text_array(ids, *n);
    free(ids);
    return param;
}

/* Lock, check, destroy, record and commit, in the transaction @p pg has open. @returns the
 * exit code, after the report. */
static int forget(tally_pg_t *pg, const forget_op_t *o, tally_audit_batch_t *ab)
{
    tally_error_t err;
    PGresult *keys = NULL, *open = NULL, *sealed = NULL, *forgotten = NULL;
    char *key_ids = NULL, *effect_states = cli_open_states(TALLY_MACHINE_EFFECT);
    char *obligation_states = cli_open_states(TALLY_MACHINE_OBLIGATION);
    json_t *data = NULL, *destroyed = json_array();
    int rc = CLI_EXIT_REFUSED;
    if (effect_states == NULL || obligation_states == NULL || destroyed == NULL) {
        fprintf(stderr, "tally forget: out of memory\n");
        goto out;
    }
    const char *p_tenant[1] = {o->tenant};
    if ((keys = tally_pg_exec(pg, SQL_KEYS_LOCK, 1, p_tenant, &err)) == NULL) {
        rc = cli_pg_fail("forget", "cannot lock the tenant's keys; nothing was changed", &err);
        goto out;
    }
    size_t n_live = 0;
    if ((key_ids = live_keys(keys, &n_live)) == NULL) {
        fprintf(stderr, "tally forget: out of memory\n");
        goto out;
    }
    if (n_live == 0) {
        report_nothing(o, keys);
        rc = CLI_EXIT_OK;
        goto out;
    }
    const char *p_open[4] = {o->tenant, effect_states, obligation_states, key_ids};
    if ((open = tally_pg_exec(pg, SQL_OPEN, 4, p_open, &err)) == NULL) {
        rc = cli_pg_fail("forget", "cannot read what of the tenant is open; nothing was changed",
                         &err);
        goto out;
    }
    if (PQntuples(open) > 0) {
        explain_open(o, open);
        goto out;
    }
    const char *p_sealed[1] = {key_ids};
    const char *p_forget[2] = {o->tenant, o->actor};
    if ((sealed = tally_pg_exec(pg, SQL_SEALED, 1, p_sealed, &err)) == NULL ||
        (forgotten = tally_pg_exec(pg, SQL_FORGET, 2, p_forget, &err)) == NULL) {
        rc = cli_pg_fail("forget", "nothing was changed", &err);
        goto out;
    }
    long long n_sealed = strtoll(PQgetvalue(sealed, 0, 0), NULL, 10);
    bool ok = true;
    for (int i = 0; ok && i < PQntuples(forgotten); i++)
        ok = json_array_append_new(destroyed, json_string(PQgetvalue(forgotten, i, 0))) == 0;
    data = ok ? json_pack("{s:s, s:s, s:O, s:I}", "verb", "forget", "tenant", o->tenant, "key_ids",
                          destroyed, "sealed_effects", (json_int_t)n_sealed)
              : NULL;
    if (data == NULL) {
        fprintf(stderr, "tally forget: out of memory; nothing was changed\n");
        goto out;
    }
    tally_audit_event_t ev = {
        .kind = "operator", .actor = o->actor, .reason = o->reason, .data = data};
    tally_audit_batch_add(ab, &ev);
    if (!tally_audit_batch_flush(ab, pg, &err) || !tally_pg_commit(pg, &err)) {
        rc = cli_pg_fail("forget", "nothing was changed", &err);
        goto out;
    }
    report(o, forgotten, n_sealed);
    rc = CLI_EXIT_OK;
out:
    json_decref(data);
    json_decref(destroyed);
    PQclear(forgotten);
    PQclear(sealed);
    PQclear(open);
    PQclear(keys);
    free(key_ids);
    free(obligation_states);
    free(effect_states);
    return rc;
}

int tally_cmd_forget(int argc, char **argv, tally_config_t *cfg)
{
    forget_op_t o = {0};
    int rc = parse(&o, argc, argv);
    if (rc >= 0)
        return rc;
    tally_pg_t *pg = cli_connect("forget", cfg);
    if (pg == NULL)
        return CLI_EXIT_INFRA;
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_error_t err;
    rc = CLI_EXIT_REFUSED;
    if (ab == NULL)
        fprintf(stderr, "tally forget: out of memory\n");
    else if (!tally_pg_begin(pg, &err) || !tally_pg_run(pg, SQL_LOCK_TIMEOUT, 0, NULL, &err))
        rc = cli_pg_fail("forget", "cannot start the transaction", &err);
    else
        rc = forget(pg, &o, ab);
    tally_audit_batch_free(ab);
    tally_pg_free(pg); /* an open transaction is rolled back with the connection */
    return rc;
}
