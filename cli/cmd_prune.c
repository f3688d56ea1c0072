/* cmd_prune.c — `tally prune --settled-before DATE`: retention (DESIGN §12, "Sensitive
 * fields"). A run that settled long enough ago keeps its skeleton — ids, states, operation
 * keys, input hashes, external refs, error codes, times — and loses its payloads: the args and
 * receipts of its effects (sealed or not), the receipts, reverse receipts and blast radii of
 * its obligations, and their error messages. The audit trail (events) is append-only and is
 * not touched; each pruned run gets one "operator" event saying what was removed.
 *
 * Batches of BATCH runs, one transaction each: the runs are claimed with FOR UPDATE SKIP
 * LOCKED and pruned by one statement, so a worker touching a run at that moment is never
 * waited for and a crash leaves each run either whole or pruned. */
#include <ctype.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/audit.h"
#include "tally/ledger.h"
#include "tally/machines.h"

static const char USAGE[] =
    "usage: tally prune --settled-before DATE --reason TEXT [--limit N]\n"
    "                   [--actor NAME]\n"
    "       tally prune --settled-before DATE --dry-run [--limit N]\n"
    "\n"
    "Remove the payloads of runs that settled before DATE and keep their skeleton. A\n"
    "run is pruned when it is in a final state (COMPLETED, COMPENSATED, ...), last\n"
    "changed before DATE, and every effect and obligation of it is final too. Its\n"
    "effects lose their args and receipts (a CONFIRMED effect's receipt becomes\n"
    "{\"tally_pruned\":true}), sealed fields and error messages; its obligations lose\n"
    "their receipts, reverse receipts, blast radii and error messages. Ids, states,\n"
    "operation keys, input hashes, external refs, error codes and times stay: a\n"
    "replayed intent still finds its effect, and `tally doctor` still shows what\n"
    "happened and when. The audit trail (events) is append-only and is not touched;\n"
    "one event per pruned run records the pruning. docs/operations.md says how to\n"
    "choose DATE (after every upstream window: idempotency keys, status lookback,\n"
    "audits).\n"
    "\n"
    "  --settled-before DATE  an ISO 8601 date or timestamp (2026-01-31,\n"
    "                         2026-01-31T12:00Z; without a zone: UTC), not in\n"
    "                         the future\n"
    "  --dry-run              print what would be pruned; nothing is written\n"
    "  --limit N              prune at most N runs (oldest first)\n"
    "  --reason TEXT          why, e.g. the retention policy (required unless\n"
    "                         --dry-run; goes into the audit trail)\n"
    "  --actor NAME           who decided (default: the OS user)\n"
    "  -h, --help             this text\n"
    "\n"
    "Exit status: 0 done (or nothing to prune); 1 failed (the batches committed\n"
    "before the failure stay pruned, and the message says how many); 2 usage error\n"
    "(DATE is not a date, or is in the future); 3 PostgreSQL could not be reached.\n";

/* Runs pruned per transaction: one statement each, and one audit batch of as many events. */
enum { BATCH = 500 };

typedef struct prune_op {
    const char *before_text; /* --settled-before as given */
    char before[64];         /* as PostgreSQL read it, in UTC */
    const char *reason;
    const char *actor;
    long long limit; /* 0: none */
    bool dry_run;
    char source[300]; /* unused: prune publishes nothing; cli_check_decision fills it */
} prune_op_t;

/* ---------------------------------------------------------------------------------------- */
/* SQL                                                                                      */

static const char SQL_LOCK_TIMEOUT[] = "SET LOCAL lock_timeout = '10s'";

/* DATE read by PostgreSQL (in the session's zone, UTC), and whether it is still to come. */
static const char SQL_DATE[] = "SELECT $1::timestamptz::text, $1::timestamptz > now()";

/* The runs that may be pruned, oldest first: in a final state (not among $1, the run
 * machine's open states) since before $2, not pruned yet, and with no effect in an open state
 * ($3) and no obligation in an open state ($4); at most $5 (NULL: all). WAITING: more that
 * keeps a run (REFS_WAITING). */
#define SQL_PRUNABLE_(WAITING)                                                                     \
    "SELECT r.run_id, r.updated_at FROM runs r"                                                    \
    " WHERE r.pruned_at IS NULL AND r.updated_at < $2::timestamptz"                                \
    "   AND NOT (r.status = ANY ($1::text[]))"                                                     \
    "   AND NOT EXISTS (SELECT 1 FROM effects e"                                                   \
    "                    WHERE e.run_id = r.run_id AND e.status = ANY ($3::text[]))"               \
    "   AND NOT EXISTS (SELECT 1 FROM obligations o"                                               \
    "                    WHERE o.run_id = r.run_id AND o.status = ANY ($4::text[]))" WAITING       \
    " ORDER BY r.updated_at, r.run_id LIMIT $5::bigint"

/* On schema 17, a run with an outcome message by reference still waiting for the relay
 * (message_refs, keyed by the run) is kept until it is published: the relay builds that event
 * from the effect's receipt, which pruning replaces. */
#define REFS_WAITING "   AND NOT EXISTS (SELECT 1 FROM message_refs m WHERE m.msg_key = r.run_id)"

/* What is left where a payload was: valid JSON (args_canonical is NOT NULL, and a CONFIRMED
 * effect must keep a receipt), and plainly not the original. */
#define PRUNED_MARKER "'" TALLY_PRUNED_MARKER "'"

/* One batch: claim, strip, mark; per run pruned, how many effects and obligations it had. */
// clang-format off
#define SQL_PRUNE_(WAITING)                                                                        \
    "WITH picked AS (" SQL_PRUNABLE_(WAITING) " FOR UPDATE OF r SKIP LOCKED),"                     \
    " ef AS (UPDATE effects e SET args_canonical = " PRUNED_MARKER ","                             \
    "   receipt = CASE WHEN e.receipt IS NULL THEN NULL ELSE " PRUNED_MARKER "::jsonb END,"        \
    "   args_sealed = NULL, receipt_sealed = NULL, error_message = NULL"                           \
    "   FROM picked p WHERE e.run_id = p.run_id RETURNING e.run_id),"                              \
    " ob AS (UPDATE obligations o SET receipt = NULL, reverse_receipt = NULL,"                     \
    "   blast_radius = NULL, error_message = NULL"                                                 \
    "   FROM picked p WHERE o.run_id = p.run_id RETURNING o.run_id),"                              \
    " ru AS (UPDATE runs r SET pruned_at = now()"                                                  \
    "   FROM picked p WHERE r.run_id = p.run_id RETURNING r.run_id)"                               \
    " SELECT ru.run_id, coalesce(ne.n, 0), coalesce(nob.n, 0) FROM ru"                             \
    "  LEFT JOIN (SELECT run_id, count(*) AS n FROM ef GROUP BY run_id) ne USING (run_id)"         \
    "  LEFT JOIN (SELECT run_id, count(*) AS n FROM ob GROUP BY run_id) nob USING (run_id)"        \
    " ORDER BY ru.run_id"
// clang-format on
static const char SQL_PRUNE[] = SQL_PRUNE_("");
static const char SQL_PRUNE_REFS[] = SQL_PRUNE_(REFS_WAITING);

/* --dry-run: the same runs, counted, with the range of their settle times. */
// clang-format off
#define SQL_PLAN_(WAITING)                                                                         \
    "WITH picked AS (" SQL_PRUNABLE_(WAITING) ")"                                                  \
    " SELECT (SELECT count(*) FROM picked),"                                                       \
    "  (SELECT count(*) FROM effects e JOIN picked p USING (run_id)),"                             \
    "  (SELECT count(*) FROM obligations o JOIN picked p USING (run_id)),"                         \
    "  (SELECT date_trunc('second', min(updated_at))::text FROM picked),"                          \
    "  (SELECT date_trunc('second', max(updated_at))::text FROM picked)"
// clang-format on
static const char SQL_PLAN[] = SQL_PLAN_("");
static const char SQL_PLAN_REFS[] = SQL_PLAN_(REFS_WAITING);

/* ---------------------------------------------------------------------------------------- */
/* Options                                                                                  */

/* An ISO 8601 date first (YYYY-MM-DD), then the end or a time: PostgreSQL reads the rest,
 * but not its other spellings ("now", "yesterday", "01/02/2026", whose order is DateStyle's). */
static bool iso_date_shaped(const char *s)
{
    static const char shape[] = "dddd-dd-dd";
    for (size_t i = 0; i < sizeof shape - 1; i++)
        if (shape[i] == 'd' ? !isdigit((unsigned char)s[i]) : s[i] != shape[i])
            return false;
    char next = s[sizeof shape - 1];
    return next == '\0' || next == 'T' || next == ' ';
}

static int parse(prune_op_t *o, int argc, char **argv)
{
    enum { O_BEFORE = 256, O_DRY_RUN, O_LIMIT, O_REASON, O_ACTOR };
    static const struct option opts[] = {
        {"settled-before", required_argument, NULL, O_BEFORE},
        {"dry-run", no_argument, NULL, O_DRY_RUN},
        {"limit", required_argument, NULL, O_LIMIT},
        {"reason", required_argument, NULL, O_REASON},
        {"actor", required_argument, NULL, O_ACTOR},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *limit = NULL;
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option("prune", USAGE, argc, argv, opts, &rc)) != -1) {
        switch (c) {
        case O_BEFORE:
            o->before_text = optarg;
            break;
        case O_DRY_RUN:
            o->dry_run = true;
            break;
        case O_LIMIT:
            limit = optarg;
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
    if (o->before_text == NULL)
        return cli_usage_error("prune", "--settled-before DATE is required");
    if (!iso_date_shaped(o->before_text))
        return cli_usage_error("prune",
                               "--settled-before '%s' is not a date: give an ISO 8601 date or "
                               "timestamp such as 2026-01-31 or 2026-01-31T12:00:00Z",
                               o->before_text);
    if (limit != NULL) {
        char *end = NULL;
        o->limit = strtoll(limit, &end, 10);
        if (end == limit || *end != '\0' || o->limit <= 0)
            return cli_usage_error("prune", "--limit '%s' is not a number of runs above 0", limit);
    }
    return cli_check_decision("prune", o->reason, !o->dry_run, &o->actor, o->source,
                              sizeof o->source)
               ? -1
               : CLI_EXIT_USAGE;
}

/* --settled-before read by PostgreSQL into o->before; @returns -1 to go on, or the exit code
 * (CLI_EXIT_USAGE for what is not a date, or a date still to come). */
static int check_date(tally_pg_t *pg, prune_op_t *o)
{
    tally_error_t err;
    const char *params[1] = {o->before_text};
    PGresult *res = tally_pg_exec(pg, SQL_DATE, 1, params, &err);
    if (res == NULL && strncmp(err.sqlstate, "22", 2) == 0) /* a data exception: 22007, 22008 */
        return cli_usage_error("prune",
                               "--settled-before '%s' is not a date: give an ISO 8601 date or "
                               "timestamp such as 2026-01-31 or 2026-01-31T12:00:00Z",
                               o->before_text);
    if (res == NULL)
        return cli_pg_fail("prune", "cannot read --settled-before", &err);
    snprintf(o->before, sizeof o->before, "%s", PQgetvalue(res, 0, 0));
    bool future = strcmp(PQgetvalue(res, 0, 1), "t") == 0;
    PQclear(res);
    if (future)
        return cli_usage_error("prune",
                               "--settled-before %s is in the future (%s); only what settled "
                               "before now can be pruned",
                               o->before_text, o->before);
    return -1;
}

/* ---------------------------------------------------------------------------------------- */
/* The verb                                                                                 */

/* The open (not terminal) states of each machine, as text[] parameters (cli_open_states). */
typedef struct open_states {
    char *run, *effect, *obligation;
} open_states_t;

static bool open_states_build(open_states_t *s)
{
    s->run = cli_open_states(TALLY_MACHINE_RUN);
    s->effect = cli_open_states(TALLY_MACHINE_EFFECT);
    s->obligation = cli_open_states(TALLY_MACHINE_OBLIGATION);
    return s->run != NULL && s->effect != NULL && s->obligation != NULL;
}

static void open_states_free(open_states_t *s)
{
    free(s->run);
    free(s->effect);
    free(s->obligation);
}

typedef struct totals {
    long long runs, effects, obligations;
} totals_t;

static const char *plural(long long n)
{
    return n == 1 ? "" : "s";
}

/* --dry-run: count, in a read-only snapshot. */
static int plan(tally_pg_t *pg, const prune_op_t *o, const open_states_t *s)
{
    tally_error_t err;
    char limit[32];
    snprintf(limit, sizeof limit, "%lld", o->limit);
    const char *params[5] = {s->run, o->before, s->effect, s->obligation,
                             o->limit > 0 ? limit : NULL};
    PGresult *res = NULL;
    if (!cli_begin_snapshot(pg, &err) ||
        (res = tally_pg_exec(pg, cli_has_message_refs(pg) ? SQL_PLAN_REFS : SQL_PLAN, 5, params,
                             &err)) == NULL)
        return cli_pg_fail("prune", "cannot count what would be pruned", &err);
    totals_t t = {strtoll(PQgetvalue(res, 0, 0), NULL, 10),
                  strtoll(PQgetvalue(res, 0, 1), NULL, 10),
                  strtoll(PQgetvalue(res, 0, 2), NULL, 10)};
    char line[1024];
    if (t.runs == 0)
        snprintf(line, sizeof line,
                 "%s Nothing would be pruned: no run settled before %s is left with payloads "
                 "(or everything of it is not final yet). Nothing was changed (--dry-run).",
                 CLI_SYM_SKIP, o->before);
    else
        snprintf(line, sizeof line,
                 "%s Would prune %lld run%s settled before %s (from %s to %s): the payloads of "
                 "%lld effect%s and %lld obligation%s. Their skeleton and the audit trail would "
                 "stay. Nothing was changed (--dry-run).",
                 CLI_SYM_SKIP, t.runs, plural(t.runs), o->before, PQgetvalue(res, 0, 3),
                 PQgetvalue(res, 0, 4), t.effects, plural(t.effects), t.obligations,
                 plural(t.obligations));
    PQclear(res);
    tally_pg_rollback(pg);
    cli_wrap(stdout, line, 0, 2);
    return CLI_EXIT_OK;
}

/* One batch of at most @p want runs, in its own transaction. @returns the runs pruned (added
 * to @p t), or -1 after saying why (the batch is rolled back; *@p rc the exit code). */
static long long prune_batch(tally_pg_t *pg, const prune_op_t *o, const open_states_t *s,
                             long long want, totals_t *t, int *rc)
{
    tally_error_t err;
    char limit[32];
    snprintf(limit, sizeof limit, "%lld", want);
    const char *params[5] = {s->run, o->before, s->effect, s->obligation, limit};
    tally_audit_batch_t *ab = tally_audit_batch_new();
    PGresult *res = NULL;
    if (ab == NULL) {
        fprintf(stderr, "tally prune: out of memory\n");
        *rc = CLI_EXIT_REFUSED;
        return -1;
    }
    if (!tally_pg_begin(pg, &err) || !tally_pg_run(pg, SQL_LOCK_TIMEOUT, 0, NULL, &err) ||
        (res = tally_pg_exec(pg, cli_has_message_refs(pg) ? SQL_PRUNE_REFS : SQL_PRUNE, 5, params,
                             &err)) == NULL) {
        tally_pg_rollback(pg);
        *rc = cli_pg_fail("prune", "this batch was not pruned", &err);
        tally_audit_batch_free(ab);
        return -1;
    }
    totals_t batch = {PQntuples(res), 0, 0};
    for (int i = 0; i < PQntuples(res); i++) {
        const char *counts[2] = {PQgetvalue(res, i, 1), PQgetvalue(res, i, 2)};
        tally_audit_member_t data[] = {
            {"verb", "prune", false},
            {"settled_before", o->before, false},
            {"effects", counts[0], true},
            {"obligations", counts[1], true},
        };
        tally_audit_event_t ev = {.run_id = PQgetvalue(res, i, 0),
                                  .kind = "operator",
                                  .actor = o->actor,
                                  .reason = o->reason,
                                  .members = data,
                                  .n_members = sizeof data / sizeof data[0]};
        tally_audit_batch_add(ab, &ev);
        batch.effects += strtoll(counts[0], NULL, 10);
        batch.obligations += strtoll(counts[1], NULL, 10);
    }
    PQclear(res);
    bool ok = tally_audit_batch_flush(ab, pg, &err) && tally_pg_commit(pg, &err);
    tally_audit_batch_free(ab);
    if (!ok) {
        tally_pg_rollback(pg);
        *rc = cli_pg_fail("prune", "this batch was not pruned", &err);
        return -1;
    }
    t->runs += batch.runs;
    t->effects += batch.effects;
    t->obligations += batch.obligations;
    return batch.runs;
}

static int prune(tally_pg_t *pg, const prune_op_t *o, const open_states_t *s)
{
    totals_t t = {0, 0, 0};
    int rc = CLI_EXIT_OK;
    for (;;) {
        long long want = BATCH;
        if (o->limit > 0 && o->limit - t.runs < want)
            want = o->limit - t.runs;
        if (want <= 0)
            break;
        long long got = prune_batch(pg, o, s, want, &t, &rc);
        /* fewer than asked: the rest is locked by someone else right now, or there is none */
        if (got < want)
            break;
    }
    char line[1024];
    if (rc != CLI_EXIT_OK) {
        if (t.runs > 0) {
            snprintf(line, sizeof line,
                     "%lld run%s (%lld effect%s, %lld obligation%s) had been pruned, in earlier "
                     "batches, and stay pruned; run this again to go on.",
                     t.runs, plural(t.runs), t.effects, plural(t.effects), t.obligations,
                     plural(t.obligations));
            cli_wrap(stderr, line, 0, 0);
        }
        return rc;
    }
    if (t.runs == 0)
        snprintf(line, sizeof line,
                 "%s Nothing to prune: no run settled before %s is left with payloads (or "
                 "everything of it is not final yet).",
                 CLI_SYM_SKIP, o->before);
    else
        snprintf(line, sizeof line,
                 "%s Pruned %lld run%s settled before %s: the payloads of %lld effect%s and "
                 "%lld obligation%s are gone (args, receipts, sealed fields, reverse receipts, "
                 "blast radii, error messages); their ids, states, keys, hashes, refs, error "
                 "codes and times stay. The audit trail is untouched: one operator event per "
                 "run records this, by %s.",
                 CLI_SYM_OK, t.runs, plural(t.runs), o->before, t.effects, plural(t.effects),
                 t.obligations, plural(t.obligations), o->actor);
    cli_wrap(stdout, line, 0, 2);
    return CLI_EXIT_OK;
}

int tally_cmd_prune(int argc, char **argv, tally_config_t *cfg)
{
    prune_op_t o = {0};
    int rc = parse(&o, argc, argv);
    if (rc >= 0)
        return rc;
    open_states_t s = {NULL, NULL, NULL};
    if (!open_states_build(&s)) {
        open_states_free(&s);
        fprintf(stderr, "tally prune: out of memory\n");
        return CLI_EXIT_REFUSED;
    }
    tally_pg_t *pg = cli_connect("prune", cfg);
    if (pg == NULL) {
        open_states_free(&s);
        return CLI_EXIT_INFRA;
    }
    rc = check_date(pg, &o);
    if (rc < 0)
        rc = o.dry_run ? plan(pg, &o, &s) : prune(pg, &o, &s);
    tally_pg_free(pg);
    open_states_free(&s);
    return rc;
}
