/* deliver.c — the dispatch path of DESIGN §3: claim due outbox rows with a lease (committed
 * before any call), call the tools through the connector engine, and record each outcome
 * with a compare-and-set on status and lease epoch. A dispatcher whose lease was taken over
 * writes nothing. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dispatcher.h"
#include "tally/backoff.h"
#include "tally/json.h"
#include "tally/columns.h"
#include "tally/audit.h"
#include "tally/crashpoint.h"
#include "tally/log.h"
#include "tally/runops.h"
#include "tally/ledger.h"
#include "tally/text.h"

/* ---------------------------------------------------------------------------------------- */
/* SQL                                                                                      */

/* One statement, its own transaction: lock due outbox rows per tool up to that tool's room
 * (SKIP LOCKED, so dispatchers never wait on each other), delete them, move their effects
 * PLANNED → DISPATCHING under a new lease (times from the database clock) and write the
 * transition events. When it returns, the claim is committed and the calls may start. */
static const char SQL_CLAIM[] =
    "WITH l AS (SELECT * FROM json_to_recordset($1::json) AS l(tool text, lim int,"
    "   lease_ms int)),"
    /* The claimed ids as one array: the planner then looks each one up by primary key
     * instead of hash-joining all PLANNED effects against a guessed 100-rows-per-tool set;
     * the status through coalesce(), as in SQL_RECORD (RECORDED_EFFECTS), so that it does not
     * also walk the live-state index's dead PLANNED entries. */
    " c AS (SELECT ARRAY(SELECT o.effect_id FROM l CROSS JOIN LATERAL ("
    "   SELECT ob.effect_id FROM outbox ob"
    "   WHERE ob.tool = l.tool AND ob.due_at <= now()"
    "   ORDER BY ob.due_at LIMIT l.lim FOR UPDATE SKIP LOCKED) o) AS ids),"
    " d AS (DELETE FROM outbox ob WHERE ob.effect_id = ANY ((SELECT ids FROM c)::uuid[])),"
    " u AS (UPDATE effects e SET status = 'DISPATCHING', lease_owner = $2::text,"
    "   lease_until = now() + (SELECT l.lease_ms FROM l WHERE l.tool = e.tool)"
    "     * interval '1 millisecond',"
    "   lease_epoch = e.lease_epoch + 1, attempts = e.attempts + 1, updated_at = now()"
    "   WHERE e.effect_id = ANY ((SELECT ids FROM c)::uuid[])"
    "     AND coalesce(e.status, '') = 'PLANNED'"
    "   RETURNING e.effect_id, e.run_id, e.step, e.step_num, e.tool, e.operation_key,"
    "     e.args_canonical, e.traceparent, e.intent_id, e.lease_epoch, e.attempts,"
    "     e.lease_until),"
    " ev AS (INSERT INTO events (event_id, run_id, effect_id, kind, from_status, to_status,"
    "   actor, data)"
    /* event ids time-ordered like audit.c's (UUID version 7 layout): appends to the event_id
     * index stay on its last pages */
    "   SELECT (substr(ts.hex, 1, 8) || '-' || substr(ts.hex, 9, 4) || '-7'"
    "       || substr(gen_random_uuid()::text, 16))::uuid,"
    "     u.run_id, u.effect_id, 'transition', 'PLANNED', 'DISPATCHING',"
    "     $2::text, jsonb_build_object('lease_owner', $2::text, 'lease_epoch', u.lease_epoch,"
    "       'lease_until', u.lease_until, 'attempt', u.attempts)"
    "   FROM u, (SELECT lpad(to_hex((extract(epoch FROM now()) * 1000)::bigint), 12, '0')"
    "     AS hex) ts)"
    " SELECT effect_id::text, run_id, step, step_num IS NOT NULL, tool, operation_key,"
    "   args_canonical, traceparent, intent_id, lease_epoch, attempts FROM u";

/* The compare-and-set for a batch of finished calls (rule 3): only rows still DISPATCHING under
 * the epoch this worker claimed are written; the caller writes events for exactly the rows that
 * come back, in the state they came back in. A retry goes back to PLANNED with a new outbox row
 * due later, unless its run stopped being ACTIVE while the call was in flight (cancel_run,
 * compensate_run): then it is CANCELLED, as the run's other PLANNED effects were — or UNKNOWN
 * when this attempt or an earlier one may have been applied (an idempotent tool's timeout or
 * 5xx, retried only because the same key is safe to send again; TALLY_SQL_MAYBE_APPLIED): only
 * the tool can say whether it happened, and the reconciler asks it. The runs of retries are
 * share-locked, as intake does, so such a run operation and this statement serialise (runops
 * locks the run rows first). The effects are looked up by primary key, through an array of
 * their ids as the claim does, and their status is compared through coalesce() so that no other
 * index can serve it. Joined to the recordset with the status as a plain restriction, the
 * planner (which guesses 100 rows for any json_to_recordset) walked the partial index of live
 * states for every entry of status DISPATCHING — dead ones included: every effect dispatched
 * since the last vacuum — on each batch (12,530 entries and 1,126 heap pages for 8 rows, 8.5
 * ms, 20 s into a run at 1,000/s; with the array beside it, it ANDed that same walk in); with
 * the status hidden but no array, a profile showed it hashing a scan of the whole table. A
 * bitmap scan, unlike an ordinary index scan, never marks the dead entries it meets, so the
 * walk got longer until vacuum. */
#define RECORDED_EFFECTS                                                                           \
    "e.effect_id = ANY (ARRAY(SELECT effect_id FROM x)) AND e.effect_id = x.effect_id"             \
    " AND coalesce(e.status, '') = 'DISPATCHING'"
/* The finished calls, $1 of both record statements: a columns parameter (columns.h) built by
 * record_batch, typed here, and their number, N. The rows are zipped with generate_series(1, N)
 * for the planner's sake alone: a prepared statement's generic plan guesses 10 rows for an
 * unnest of a parameter — and at that guess the UPDATE below joined a thousand results to
 * their effects by a nested loop over all of them (about 270 ms a batch) — but 1,000 for a
 * generate_series it cannot count, and the plans below are made for a batch of hundreds. */
// clang-format off
#define RECORDED_ROWS(PARAM, N)                                                                    \
    " (SELECT u.effect_id::uuid AS effect_id, u.epoch::bigint AS epoch, u.status,"                 \
    "   u.receipt::jsonb AS receipt, u.external_ref, u.error_code, u.error_message,"               \
    "   u.delay_ms::bigint AS delay_ms, u.maybe::boolean AS maybe_applied"                         \
    "   FROM ROWS FROM (unnest(" TALLY_COLUMN(PARAM, 1) "),"                                       \
    "   unnest(" TALLY_COLUMN(PARAM, 2) "), unnest(" TALLY_COLUMN(PARAM, 3) "),"                   \
    "   unnest(" TALLY_COLUMN(PARAM, 4) "), unnest(" TALLY_COLUMN(PARAM, 5) "),"                   \
    "   unnest(" TALLY_COLUMN(PARAM, 6) "), unnest(" TALLY_COLUMN(PARAM, 7) "),"                   \
    "   unnest(" TALLY_COLUMN(PARAM, 8) "), unnest(" TALLY_COLUMN(PARAM, 9) "),"                   \
    "   generate_series(1, " N "::int))"                                                           \
    "   AS u(effect_id, epoch, status, receipt, external_ref, error_code, error_message,"          \
    "   delay_ms, maybe, k))"
#define REC_COLS 9 /* RECORDED_ROWS' columns, from effect_id to maybe_applied */
static const char SQL_RECORD[] =
    "WITH r AS (SELECT * FROM" RECORDED_ROWS("$1", "$2") " AS r),"
    " ru AS (SELECT run_id, status FROM runs WHERE run_id IN (SELECT e.run_id FROM r"
    "   JOIN effects e ON e.effect_id = r.effect_id WHERE r.status = 'PLANNED')"
    "   ORDER BY run_id FOR SHARE),"
    " x AS (SELECT r.*, CASE WHEN NOT " TALLY_SQL_RUN_GOES_ON("ru.status") " THEN"
    "   'the run is ' || ru.status END"
    "   AS stop, CASE WHEN NOT " TALLY_SQL_RUN_GOES_ON("ru.status") " THEN r.maybe_applied"
    "     OR " TALLY_SQL_MAYBE_APPLIED("e") " END AS maybe"
    "   FROM r LEFT JOIN effects e ON r.status = 'PLANNED' AND e.effect_id = r.effect_id"
    "   LEFT JOIN ru ON ru.run_id = e.run_id),"
    " upd AS (UPDATE effects e SET"
    "   status = CASE WHEN x.stop IS NULL THEN x.status WHEN x.maybe THEN 'UNKNOWN'"
    "     ELSE 'CANCELLED' END,"
    "   status_reason = coalesce(x.stop, e.status_reason),"
    "   receipt = CASE WHEN x.status = 'CONFIRMED' THEN x.receipt ELSE e.receipt END,"
    "   external_ref = CASE WHEN x.status = 'CONFIRMED' THEN x.external_ref"
    "     ELSE e.external_ref END,"
    "   error_code = CASE WHEN x.stop IS NOT NULL AND NOT x.maybe THEN 'run_not_active'"
    "     ELSE x.error_code END,"
    "   error_message = CASE WHEN x.stop IS NULL THEN x.error_message"
    "     WHEN x.maybe THEN x.stop || '; an attempt may have been applied, so the'"
    "       || ' reconciler asks the tool: ' || x.error_message"
    "     ELSE x.stop || '; the last attempt was not applied: ' || x.error_message END,"
    "   unknown_since = CASE WHEN x.status = 'UNKNOWN' OR (x.stop IS NOT NULL AND x.maybe)"
    "     THEN now() ELSE e.unknown_since END,"
    "   next_attempt_at = CASE WHEN x.status = 'PLANNED' AND x.stop IS NULL"
    "     THEN now() + x.delay_ms * interval '1 millisecond' ELSE e.next_attempt_at END,"
    "   lease_owner = NULL, lease_until = NULL, updated_at = now()"
    "   FROM x WHERE " RECORDED_EFFECTS " AND e.lease_epoch = x.epoch"
    "   RETURNING e.effect_id, e.tool, e.status, e.next_attempt_at, e.error_code,"
    "     e.error_message),"
    " ob AS (INSERT INTO outbox (effect_id, tool, due_at)"
    "   SELECT effect_id, tool, next_attempt_at FROM upd WHERE status = 'PLANNED')"
    " SELECT effect_id::text, status, error_code, error_message FROM upd";
// clang-format on

/* A batch of final results (CONFIRMED, FAILED, UNKNOWN: no retry, so no run to check, and no
 * page to open) in ONE statement and transaction: the compare-and-set of the results ($1, and
 * $6 their number), the events and the outcome messages of exactly the rows it wrote ($2 and
 * $3, the columns of the events and of the messages, hold them for every row; a row whose lease
 * was taken over keeps neither). Three statements, a BEGIN and a COMMIT fewer than the general
 * path below, on the path every outcome takes. The messages are leased to this worker's relay
 * ($4, for $5 ms) and come back ('m' rows) to be handed to it: it publishes them without a
 * notification and a read of its own, and nobody else takes them first. */
#define WON_EVENTS   "WHERE r.effect_id IN (SELECT effect_id FROM upd)"
#define WON_MESSAGES "WHERE r.effect_id IN (SELECT effect_id::text FROM upd)"
// clang-format off
static const char SQL_RECORD_FINAL[] =
    "WITH x AS (SELECT * FROM" RECORDED_ROWS("$1", "$6") " AS x),"
    " upd AS (UPDATE effects e SET status = x.status,"
    "   receipt = CASE WHEN x.status = 'CONFIRMED' THEN x.receipt ELSE e.receipt END,"
    "   external_ref = CASE WHEN x.status = 'CONFIRMED' THEN x.external_ref"
    "     ELSE e.external_ref END,"
    "   error_code = x.error_code, error_message = x.error_message,"
    "   unknown_since = CASE WHEN x.status = 'UNKNOWN' THEN now() ELSE e.unknown_since END,"
    "   lease_owner = NULL, lease_until = NULL, updated_at = now()"
    "   FROM x WHERE " RECORDED_EFFECTS " AND e.lease_epoch = x.epoch"
    "   RETURNING e.effect_id),"
    " ev AS (" TALLY_AUDIT_INSERT("$2", WON_EVENTS) "),"
    " mo AS (" TALLY_OUTBOX_INSERT_HANDED("$3", WON_MESSAGES, "$4", "$5") ")"
    " SELECT 'e', effect_id::text, NULL, NULL, NULL, NULL, NULL FROM upd"
    " UNION ALL SELECT 'm', id::text, topic, msg_key, event_id, payload, reply FROM mo";
// clang-format on

/* A page for the tool's owner; one open alert per tool (re-opened when it was resolved). */
static const char SQL_ALERTS[] =
    "INSERT INTO alerts (dedup_key, severity, summary, run_id, effect_id, reason, runbook,"
    "   resolve_command)"
    " SELECT a.dedup_key, a.severity, a.summary, a.run_id, a.effect_id, a.reason, a.runbook,"
    "   a.resolve_command"
    " FROM json_to_recordset($1::json) AS a(dedup_key text, severity text, summary text,"
    "   run_id text, effect_id uuid, reason text, runbook text, resolve_command text)"
    " ON CONFLICT (dedup_key) DO UPDATE SET status = 'TRIGGERED', severity = EXCLUDED.severity,"
    "   summary = EXCLUDED.summary, run_id = EXCLUDED.run_id, effect_id = EXCLUDED.effect_id,"
    "   reason = EXCLUDED.reason, runbook = EXCLUDED.runbook,"
    "   resolve_command = EXCLUDED.resolve_command, pager_state = 'pending',"
    "   created_at = now(), resolved_at = NULL"
    "   WHERE alerts.status = 'RESOLVED'"
    " RETURNING dedup_key";

/* ---------------------------------------------------------------------------------------- */
/* Calls                                                                                    */

void dispatch_call_free(void *p)
{
    dispatch_call_t *call = p;
    if (!call)
        return;
    free(call->run_id);
    free(call->step);
    free(call->operation_key);
    free(call->intent_id);
    free(call);
}

dispatch_call_t *dispatch_call_new(const char *effect_id, const char *run_id, const char *step,
                                   bool step_is_number, const tally_tool_t *tool,
                                   const char *operation_key, const char *intent_id,
                                   long long epoch, int attempts)
{
    if (!tool)
        return NULL;
    dispatch_call_t *call = calloc(1, sizeof *call);
    if (!call)
        return NULL;
    snprintf(call->effect_id, sizeof call->effect_id, "%s", effect_id);
    call->run_id = strdup(run_id);
    call->step = strdup(step);
    call->step_is_number = step_is_number;
    call->tool = tool;
    call->operation_key = strdup(operation_key);
    call->intent_id = strdup(intent_id);
    call->epoch = epoch;
    call->attempts = attempts;
    call->claimed_at = dispatch_now();
    if (!call->run_id || !call->step || !call->operation_key || !call->intent_id) {
        dispatch_call_free(call);
        return NULL;
    }
    return call;
}

/* Hand a finished call to the recorder thread (it owns everything @p x points to from now). */
static bool done_enqueue(dispatcher_t *d, const dispatch_done_t *x)
{
    pthread_mutex_lock(&d->rec_mu);
    bool ok = true;
    if (d->n_done == d->cap_done) {
        size_t cap = d->cap_done ? 2 * d->cap_done : 256;
        dispatch_done_t *n = realloc(d->done, cap * sizeof *n);
        if (n) {
            d->done = n;
            d->cap_done = cap;
        } else {
            ok = false;
        }
    }
    if (ok) {
        d->done[d->n_done++] = *x;
        pthread_cond_signal(&d->rec_cv);
    }
    pthread_mutex_unlock(&d->rec_mu);
    return ok;
}

static void done_clear(dispatch_done_t *x)
{
    dispatch_call_free(x->call);
    free(x->receipt_text);
    free(x->external_ref);
    free(x->call_record);
    memset(x, 0, sizeof *x);
}

/* The tool's backoff for this attempt (backoff.h: doubling, equal jitter, Retry-After). */
static long long backoff_ms(const tally_tool_t *tool, int attempts, long retry_after_ms)
{
    int base = tool->backoff_ms > 0 ? tool->backoff_ms : 200;
    int cap = tool->max_backoff_ms > 0 ? tool->max_backoff_ms : 60000;
    /* Jitter needs no shared state: calls finish on the connector's thread, calls that could
     * not start on the loop's. */
    static _Thread_local unsigned int seed;
    if (seed == 0)
        seed = (unsigned int)time(NULL) ^ (unsigned int)getpid() ^ (unsigned int)(uintptr_t)&seed;
    return tally_backoff_ms(attempts, base, cap, retry_after_ms, (uint32_t)rand_r(&seed));
}

static void set_error(dispatch_done_t *x, const char *code, const char *fmt, const char *msg)
    __attribute__((format(printf, 3, 0)));

static void set_error(dispatch_done_t *x, const char *code, const char *fmt, const char *msg)
{
    /* The message may quote a tool's answer: cut on a character boundary (text.h). */
    tally_text_copy(x->error_code, sizeof x->error_code, code);
    tally_fmt(x->error_message, sizeof x->error_message, fmt, msg);
}

/* Not applied (or, for read/idempotent tools, a timeout): try again with the same key, or
 * stop at the attempt cap. */
static void retry_or_stop(dispatch_done_t *x, bool was_unknown)
{
    const dispatch_call_t *call = x->call;
    const tally_tool_t *tool = call->tool;
    int cap = tool->max_attempts > 0 ? tool->max_attempts : 5;
    if (call->attempts < cap) {
        x->to_status = "PLANNED";
        /* An idempotent tool's attempt that may have happened: sent again with the same key
         * while its run is ACTIVE, asked about (UNKNOWN) once it is not (SQL_RECORD). */
        x->maybe_applied = was_unknown && tool->effect_class == TALLY_CLASS_IDEMPOTENT;
        x->delay_ms = backoff_ms(tool, call->attempts, x->v.retry_after_ms);
        set_error(x, x->v.code, "%s", x->v.message);
        return;
    }
    if (was_unknown && tool->effect_class == TALLY_CLASS_IDEMPOTENT) {
        /* The last try may have applied: only upstream evidence can say (the reconciler). */
        x->to_status = "UNKNOWN";
        tally_text_copy(x->error_code, sizeof x->error_code, x->v.code);
        tally_fmt(x->error_message, sizeof x->error_message, "attempt cap %d reached; last: %s",
                  cap, x->v.message);
        return;
    }
    x->to_status = "FAILED";
    snprintf(x->error_code, sizeof x->error_code, "attempts_exhausted");
    tally_fmt(x->error_message, sizeof x->error_message, "gave up after %d attempts; last: %s",
              call->attempts, x->v.message);
}

/* DESIGN §3: what the effect becomes after this verdict. */
static void decide(dispatch_done_t *x)
{
    const tally_tool_t *tool = x->call->tool;
    switch (x->v.verdict) {
    case TALLY_VERDICT_CONFIRMED:
        x->to_status = "CONFIRMED";
        return;
    case TALLY_VERDICT_FAILED:
        x->to_status = "FAILED";
        set_error(x, x->v.code, "%s", x->v.message);
        return;
    case TALLY_VERDICT_RETRY:
        retry_or_stop(x, false);
        return;
    case TALLY_VERDICT_UNKNOWN:
        /* Rule 2: a timeout of a read or idempotent tool is transient by definition. */
        if (tool->effect_class == TALLY_CLASS_READ ||
            tool->effect_class == TALLY_CLASS_IDEMPOTENT) {
            retry_or_stop(x, true);
            return;
        }
        x->to_status = "UNKNOWN";
        set_error(x, x->v.code, "%s", x->v.message);
        return;
    default:
        x->to_status = "UNKNOWN";
        set_error(x, "unexpected_verdict", "%s", tally_verdict_name(x->v.verdict));
        return;
    }
}

void deliver_on_done(const tally_conn_result_t *res, void *opaque)
{
    dispatcher_t *d = opaque;
    dispatch_call_t *call = res->opaque;
    TALLY_CRASHPOINT("dispatch.after_call_answer");
    dispatch_done_t done = {0}, *x = &done;
    x->call = call;
    x->seconds = res->seconds;
    tally_conn_classify_execute(res, &x->v);
    if (x->v.verdict == TALLY_VERDICT_CONFIRMED) {
        if (!tally_conn_receipt_text(res, call->tool, &x->receipt_text, &x->external_ref)) {
            x->v.verdict = TALLY_VERDICT_UNKNOWN;
            snprintf(x->v.code, sizeof x->v.code, "receipt_lost");
            snprintf(x->v.message, sizeof x->v.message,
                     "HTTP %ld but the receipt could not be kept (out of memory)",
                     res->http_status);
        }
    }
    decide(x);
    size_t ref_over = 0;
    x->external_ref = tally_conn_ref_within_limit(x->external_ref, &ref_over);
    if (ref_over > 0) {
        /* The tool did it (2xx), so the effect is CONFIRMED with its receipt as evidence; but
         * a ref this long would not fit the ledger's indexes: it is kept in the receipt only,
         * and the answer says so. */
        char msg[300];
        tally_fmt(msg, sizeof msg,
                  "the receipt's %s is %zu bytes, above the limit of %d bytes for an external "
                  "ref; it is kept in the receipt, not as the ref",
                  call->tool->receipt_ref ? call->tool->receipt_ref : "/id", ref_over,
                  TALLY_LIMIT_EXTERNAL_REF);
        set_error(x, "protocol_error", "%s", msg);
    }
    /* The "connector_call" audit data, written as text here on the connector's thread */
    tally_jtext_t rec = {0};
    tally_jtext_begin(&rec, NULL);
    tally_jtext_str(&rec, "method", res->method);
    tally_jtext_str(&rec, "url", res->url);
    tally_jtext_str(&rec, "op", tally_conn_op_name(res->op));
    tally_jtext_bool(&rec, "sent", res->sent);
    tally_jtext_real(&rec, "latency_ms", res->seconds * 1000.0, 3);
    tally_jtext_int(&rec, "attempt", call->attempts);
    tally_jtext_str(&rec, "verdict", tally_verdict_name(x->v.verdict));
    tally_jtext_str(&rec, "code", x->v.code);
    if (res->http_status)
        tally_jtext_int(&rec, "status_code", res->http_status);
    else
        tally_jtext_raw(&rec, "status_code", NULL);
    if (res->curl_code)
        tally_jtext_str(&rec, "transport_error", x->v.message);
    if (res->retry_after_ms >= 0)
        tally_jtext_int(&rec, "retry_after_ms", res->retry_after_ms);
    tally_conn_excerpt_text(&rec, "response", res->body, res->body_len, 2048);
    tally_jtext_end(&rec);
    x->call_record = tally_jtext_take(&rec);
    tally_metric_observe(d->m_connector_seconds, res->seconds, call->tool->name);
    tally_metric_add(d->m_calls, 1, call->tool->name, tally_verdict_name(x->v.verdict));
    if (!done_enqueue(d, x)) {
        /* Nothing recorded: the lease expires and the reconciler resolves the effect. */
        TALLY_ERROR("out of memory recording the result of effect %s; its lease will expire",
                    call->effect_id);
        done_clear(x);
    }
}

/* A call that could not start (nothing was sent): recorded like a refused request, or as
 * FAILED when it can never be sent (a header that would inject, a missing endpoint). */
static void submit_failed(dispatcher_t *d, dispatch_call_t *call, const tally_error_t *err)
{
    dispatch_done_t done = {0}, *x = &done;
    x->call = call;
    bool never = strcmp(err->code, "invalid_header") == 0 || strcmp(err->code, "no_endpoint") == 0;
    x->v.verdict = never ? TALLY_VERDICT_FAILED : TALLY_VERDICT_RETRY;
    x->v.retry_after_ms = -1;
    snprintf(x->v.code, sizeof x->v.code, "%s", err->code);
    tally_fmt(x->v.message, sizeof x->v.message, "the call was not started: %s", err->message);
    decide(x);
    tally_jtext_t rec = {0};
    tally_jtext_begin(&rec, NULL);
    tally_jtext_str(&rec, "op", "execute");
    tally_jtext_bool(&rec, "sent", false);
    tally_jtext_int(&rec, "attempt", call->attempts);
    tally_jtext_str(&rec, "code", err->code);
    tally_jtext_str(&rec, "transport_error", err->message);
    tally_jtext_end(&rec);
    x->call_record = tally_jtext_take(&rec);
    tally_metric_add(d->m_calls, 1, call->tool->name, "not_started");
    tally_log_ctx_t ctx = {
        .run_id = call->run_id, .effect_id = call->effect_id, .tool = call->tool->name};
    TALLY_LOG(TALLY_LOG_ERROR, &ctx, "call not started: %s", err->message);
    if (!done_enqueue(d, x))
        done_clear(x); /* its lease expires; the reconciler resolves it */
}

int dispatch_lease_ms(const dispatcher_t *d, const tally_tool_t *tool)
{
    int lease = tool->timeout_ms + DISPATCH_LEASE_MARGIN_MS;
    return lease < d->cfg->lease_ms ? d->cfg->lease_ms : lease;
}

void deliver_start(dispatcher_t *d, dispatch_call_t *call, const char *body, size_t body_len,
                   const char *traceparent)
{
    TALLY_CRASHPOINT("dispatch.after_claim_commit");
    tally_conn_request_t req = {
        .tool = call->tool,
        .op = TALLY_CONN_EXECUTE,
        .idempotency_key = call->operation_key,
        .run_id = call->run_id,
        .effect_id = call->effect_id,
        .traceparent = traceparent,
        .body = body,
        .body_len = body_len,
        .opaque = call,
    };
    tally_error_t err;
    tally_error_clear(&err);
    if (!tally_connector_submit(d->conn, &req, &err))
        submit_failed(d, call, &err);
}

int deliver_claim(dispatcher_t *d)
{
    if (d->draining)
        return 0;
    double now = dispatch_now();
    if (!d->claim_wanted && now < d->next_sweep)
        return 0;
    int batch = d->cfg->batch_size > 0 ? d->cfg->batch_size : 1;
    size_t n_tools = tally_registry_count(d->reg);
    json_t *limits = json_array();
    int *lims = calloc(n_tools ? n_tools : 1, sizeof *lims);
    int *got = calloc(n_tools ? n_tools : 1, sizeof *got);
    if (!limits || !lims || !got) {
        json_decref(limits);
        free(lims);
        free(got);
        return -1;
    }
    bool some_full = false;
    for (size_t i = 0; i < n_tools; i++) {
        const tally_tool_t *tool = tally_registry_at(d->reg, i);
        int room = tally_connector_capacity(d->conn, tool);
        lims[i] = room < batch ? room : batch;
        if (room <= 0) {
            some_full = true;
            continue;
        }
        json_array_append_new(limits, json_pack("{s:s, s:i, s:i}", "tool", tool->name, "lim",
                                                lims[i], "lease_ms", dispatch_lease_ms(d, tool)));
    }
    d->claim_capped = some_full;
    d->claim_wanted = false;
    d->next_sweep = now + (d->cfg->sweep_ms > 0 ? d->cfg->sweep_ms : 1000) / 1000.0;
    if (json_array_size(limits) == 0) {
        json_decref(limits);
        free(lims);
        free(got);
        return 0;
    }
    char *text = json_dumps(limits, JSON_COMPACT);
    json_decref(limits);
    tally_error_t err;
    tally_error_clear(&err);
    const char *params[2] = {text, d->worker_id};
    PGresult *res = text ? tally_pg_exec(d->pg, SQL_CLAIM, 2, params, &err) : NULL;
    free(text);
    if (!res) {
        TALLY_LOG_REPEATING(TALLY_LOG_WARN, NULL,
                            "claiming due effects failed (%s: %s); retrying in a second", err.code,
                            err.message);
        tally_metric_add(d->m_db_errors, 1, "claim");
        tally_worker_set_ready(d->w, false, err.message);
        free(lims);
        free(got);
        return -1;
    }
    int n = PQntuples(res);
    for (int row = 0; row < n; row++) {
        const char *tool_name = PQgetvalue(res, row, 4);
        const tally_tool_t *tool = tally_registry_find(d->reg, tool_name);
        for (size_t i = 0; tool && i < n_tools; i++)
            if (tally_registry_at(d->reg, i) == tool)
                got[i]++;
        dispatch_call_t *call =
            dispatch_call_new(PQgetvalue(res, row, 0), PQgetvalue(res, row, 1),
                              PQgetvalue(res, row, 2), PQgetvalue(res, row, 3)[0] == 't', tool,
                              PQgetvalue(res, row, 5), PQgetvalue(res, row, 8),
                              atoll(PQgetvalue(res, row, 9)), atoi(PQgetvalue(res, row, 10)));
        if (!call) {
            /* Claimed but not callable here: leave it to lease expiry (the reconciler). */
            TALLY_ERROR("effect %s (tool '%s') claimed but %s; its lease will expire",
                        PQgetvalue(res, row, 0), tool_name,
                        tool ? "out of memory" : "the tool is not in this worker's registry");
            continue;
        }
        deliver_start(d, call, PQgetvalue(res, row, 6), (size_t)PQgetlength(res, row, 6),
                      PQgetisnull(res, row, 7) ? NULL : PQgetvalue(res, row, 7));
    }
    PQclear(res);
    for (size_t i = 0; i < n_tools; i++)
        if (lims[i] > 0 && got[i] >= lims[i])
            some_full = true;
    /* A tool that filled its room may have more due: claim again as soon as room frees. */
    d->claim_capped = some_full;
    if (some_full && n > 0)
        d->claim_wanted = tally_connector_inflight(d->conn) < d->cfg->max_inflight;
    free(lims);
    free(got);
    tally_metric_set(d->m_inflight, tally_connector_inflight(d->conn));
    if (n > 0)
        TALLY_DEBUG("claimed %d effects; %d calls in flight", n, tally_connector_inflight(d->conn));
    return n;
}

/* ---------------------------------------------------------------------------------------- */
/* Recording                                                                                */

static int cmp_done(const void *a, const void *b)
{
    const dispatch_done_t *x = a, *y = b;
    return strcmp(x->call->effect_id, y->call->effect_id);
}

static const char *auth_runbook(const tally_tool_t *tool)
{
    return tool->runbook ? tool->runbook : "";
}

static bool record_alerts(dispatcher_t *d, json_t *alerts, tally_audit_batch_t *ab,
                          tally_outbox_batch_t *ob, tally_error_t *err)
{
    char *text = json_dumps(alerts, JSON_COMPACT);
    if (!text) {
        tally_error_set(err, "oom", true, "out of memory");
        return false;
    }
    const char *params[1] = {text};
    PGresult *res = tally_pg_exec(d->rec_pg, SQL_ALERTS, 1, params, err);
    free(text);
    if (!res)
        return false;
    for (int row = 0; row < PQntuples(res); row++) {
        const char *key = PQgetvalue(res, row, 0);
        json_t *a = NULL;
        for (size_t i = 0; i < json_array_size(alerts); i++) {
            json_t *c = json_array_get(alerts, i);
            if (strcmp(json_string_value(json_object_get(c, "dedup_key")), key) == 0)
                a = c;
        }
        if (!a)
            continue;
        json_t *data = json_deep_copy(a);
        if (!data || json_object_set_new(data, "obligation_id", json_null()) != 0) {
            json_decref(data);
            PQclear(res);
            tally_error_set(err, "oom", true, "out of memory");
            return false;
        }
        tally_audit_event_t ev = {
            .run_id = json_string_value(json_object_get(a, "run_id")),
            .effect_id = json_string_value(json_object_get(a, "effect_id")),
            .kind = "alert",
            .actor = d->worker_id,
            .reason = json_string_value(json_object_get(a, "reason")),
            .data = data,
        };
        tally_audit_batch_add(ab, &ev);
        json_t *ce = tally_ce_new("tally.alert.trigger.v1", d->source, key, data, NULL);
        if (!ce) {
            PQclear(res);
            tally_error_set(err, "oom", true, "out of memory");
            return false;
        }
        tally_outbox_batch_add(ob, "alerts", ev.run_id, ce);
        json_decref(ce);
        TALLY_WARN("alert %s triggered: %s", key, json_string_value(json_object_get(a, "summary")));
    }
    PQclear(res);
    return true;
}

/* Events for the rows the compare-and-set returned (flag `won`), then the alerts. */
static bool record_events(dispatcher_t *d, dispatch_done_t *done, size_t n_done, const bool *won,
                          tally_audit_batch_t *ab, tally_outbox_batch_t *ob, tally_error_t *err)
{
    json_t *alerts = json_array();
    if (!alerts) {
        tally_error_set(err, "oom", true, "out of memory");
        return false;
    }
    for (size_t i = 0; i < n_done; i++) {
        if (!won[i])
            continue;
        dispatch_done_t *x = &done[i];
        dispatch_call_t *call = x->call;
        tally_jtext_t td = {0};
        tally_jtext_begin(&td, NULL);
        tally_jtext_int(&td, "lease_epoch", (long long)call->epoch);
        tally_jtext_int(&td, "attempt", call->attempts);
        if (x->error_code[0]) {
            tally_jtext_begin(&td, "error");
            tally_jtext_str(&td, "code", x->error_code);
            tally_jtext_str(&td, "message", x->error_message);
            tally_jtext_end(&td);
        }
        if (strcmp(x->to_status, "PLANNED") == 0)
            tally_jtext_int(&td, "retry_in_ms", x->delay_ms);
        if (x->external_ref)
            tally_jtext_str(&td, "external_ref", x->external_ref);
        tally_jtext_end(&td);
        char *tdata = tally_jtext_take(&td);
        tally_audit_event_t ev = {.run_id = call->run_id,
                                  .effect_id = call->effect_id,
                                  .kind = "connector_call",
                                  .actor = d->worker_id,
                                  .reason = x->v.code,
                                  .data_text = x->call_record};
        tally_audit_batch_add(ab, &ev);
        ev.kind = "transition";
        ev.from_status = "DISPATCHING";
        ev.to_status = x->to_status;
        ev.reason = x->error_code[0] ? x->error_message : NULL;
        ev.data_text = tdata;
        tally_audit_batch_add(ab, &ev);
        free(tdata);
        if (strcmp(x->to_status, "PLANNED") != 0) {
            effect_view_t v = {.effect_id = call->effect_id,
                               .run_id = call->run_id,
                               .step = call->step,
                               .step_is_number = call->step_is_number,
                               .tool = call->tool->name,
                               .operation_key = call->operation_key,
                               .status = x->to_status,
                               .receipt_text = x->receipt_text,
                               .external_ref = x->external_ref,
                               .error_code = x->error_code[0] ? x->error_code : NULL,
                               .error_message = x->error_code[0] ? x->error_message : NULL,
                               .attempts = call->attempts,
                               .intent_id = call->intent_id};
            if (!dispatch_publish_effect(d, ob, &v, NULL)) {
                json_decref(alerts);
                tally_error_set(err, "oom", true, "out of memory");
                return false;
            }
        }
        if (x->v.alert_owner && strcmp(x->to_status, "FAILED") == 0) {
            char key[200];
            snprintf(key, sizeof key, "auth:%s", call->tool->name);
            bool seen = false;
            for (size_t k = 0; k < json_array_size(alerts); k++)
                if (strcmp(
                        json_string_value(json_object_get(json_array_get(alerts, k), "dedup_key")),
                        key) == 0)
                    seen = true;
            if (seen)
                continue;
            char summary[400], resolve[300];
            snprintf(summary, sizeof summary,
                     "tool '%s' (owner %s) refused tally's credentials with HTTP %s; its calls "
                     "fail until they are fixed",
                     call->tool->name, call->tool->owner ? call->tool->owner : "unknown",
                     x->v.code + 5);
            snprintf(resolve, sizeof resolve,
                     "tally resolve --effect %s --as failed --reason 'credentials of %s fixed'",
                     call->effect_id, call->tool->name);
            json_array_append_new(
                alerts, json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:s}", "dedup_key", key,
                                  "severity", "error", "summary", summary, "run_id", call->run_id,
                                  "effect_id", call->effect_id, "reason", "auth_failed", "runbook",
                                  auth_runbook(call->tool), "resolve_command", resolve, "owner",
                                  call->tool->owner ? call->tool->owner : ""));
        }
    }
    bool ok = json_array_size(alerts) == 0 || record_alerts(d, alerts, ab, ob, err);
    json_decref(alerts);
    return ok;
}

/* SQL_RECORD_FINAL: the events and messages are built for every row first; @p won then says
 * which rows the statement wrote. */
static bool record_final(dispatcher_t *d, dispatch_done_t *done, size_t n_done, const char *rows,
                         int rows_len, const char *n_rows, bool *won, tally_audit_batch_t *ab,
                         tally_outbox_batch_t *ob, tally_error_t *err)
{
    for (size_t i = 0; i < n_done; i++)
        won[i] = true;
    if (!record_events(d, done, n_done, won, ab, ob, err))
        return false;
    const char *why_ev = "", *why_mo = "";
    int lengths[6] = {rows_len, 0, 0, 0, 0, 0};
    int formats[6] = {1, 1, 1, 0, 0, 0};
    const char *ev = tally_audit_batch_param(ab, &lengths[1], &why_ev);
    const char *mo = tally_outbox_batch_param(ob, &lengths[2], &why_mo);
    if (!ev || !mo) {
        tally_error_set(err, "oom", false, "results not written: %s", !ev ? why_ev : why_mo);
        return false;
    }
    tally_relay_t *relay = tally_worker_relay(d->w);
    char lease[16];
    snprintf(lease, sizeof lease, "%d", TALLY_RELAY_HAND_LEASE_MS);
    const char *params[6] = {rows, ev, mo, relay ? tally_relay_owner(relay) : NULL, lease, n_rows};
    PGresult *res =
        tally_pg_exec_bin(d->rec_pg, SQL_RECORD_FINAL, 6, params, lengths, formats, err);
    if (!res)
        return false;
    memset(won, 0, n_done * sizeof *won);
    for (int row = 0; row < PQntuples(res); row++) {
        if (PQgetvalue(res, row, 0)[0] != 'e')
            continue;
        dispatch_call_t key_call;
        snprintf(key_call.effect_id, sizeof key_call.effect_id, "%s", PQgetvalue(res, row, 1));
        dispatch_done_t key = {.call = &key_call};
        dispatch_done_t *hit = bsearch(&key, done, n_done, sizeof *done, cmp_done);
        if (hit)
            won[hit - done] = true;
    }
    /* Committed: the relay may publish the messages ('m' rows) now. */
    (void)tally_relay_hand_result(relay, res, 0, 'm');
    PQclear(res);
    return true;
}

/* Write @p n finished calls in one transaction (on the recorder's connection). On success the
 * entries are released and @p due says when the earliest retry comes due (0: none); on a
 * database error they are left as they are, to be tried again, and @p err_out says why. */
static bool record_batch(dispatcher_t *d, dispatch_done_t *done, size_t n_done, double *due_out,
                         tally_error_t *err_out)
{
    double now = dispatch_now();
    qsort(done, n_done, sizeof *done, cmp_done);
    tally_columns_t rows = {0}; /* $1 of the record statements (RECORDED_ROWS) */
    tally_columns_init(&rows, REC_COLS);
    bool *won = calloc(n_done, sizeof *won);
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    tally_error_t err;
    tally_error_clear(&err);
    PGresult *res = NULL;
    bool ok = false;
    if (!won || !ab || !ob) {
        tally_error_set(&err, "oom", true, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n_done; i++) {
        dispatch_done_t *x = &done[i];
        char epoch[24], delay[24];
        snprintf(epoch, sizeof epoch, "%lld", (long long)x->call->epoch);
        snprintf(delay, sizeof delay, "%lld", x->delay_ms);
        const char *code = x->error_code[0] ? x->error_code : NULL;
        bool row = tally_columns_row_begin(&rows) &&
                   tally_columns_text(&rows, x->call->effect_id) &&
                   tally_columns_text(&rows, epoch) && tally_columns_text(&rows, x->to_status) &&
                   tally_columns_text(&rows, x->receipt_text) &&
                   tally_columns_text(&rows, x->external_ref) && tally_columns_text(&rows, code) &&
                   tally_columns_text(&rows, code ? x->error_message : NULL) &&
                   tally_columns_text(&rows, delay) &&
                   tally_columns_text(&rows, x->maybe_applied ? "t" : "f");
        if (!tally_columns_row_end(&rows, row)) {
            if (rows.bad_text)
                tally_error_set(&err, "invalid_text", false, "results not written: %s", rows.why);
            else
                tally_error_set(&err, "oom", true, "results not written: out of memory");
            goto out;
        }
    }
    int rows_len = 0;
    const char *param = tally_columns_param(&rows, &rows_len);
    char n_rows[24];
    snprintf(n_rows, sizeof n_rows, "%zu", rows.n);
    if (!param) {
        tally_error_set(&err, "oom", true, "out of memory");
        goto out;
    }
    bool final = true;
    for (size_t i = 0; i < n_done; i++)
        if (strcmp(done[i].to_status, "PLANNED") == 0 ||
            (done[i].v.alert_owner && strcmp(done[i].to_status, "FAILED") == 0))
            final = false;
    if (final) {
        ok = record_final(d, done, n_done, param, rows_len, n_rows, won, ab, ob, &err);
        goto out;
    }
    const char *params[2] = {param, n_rows};
    int lengths[2] = {rows_len, 0}, formats[2] = {1, 0};
    if (!tally_pg_begin(d->rec_pg, &err))
        goto out;
    res = tally_pg_exec_bin(d->rec_pg, SQL_RECORD, 2, params, lengths, formats, &err);
    if (!res)
        goto out;
    for (int row = 0; row < PQntuples(res); row++) {
        dispatch_call_t key_call;
        snprintf(key_call.effect_id, sizeof key_call.effect_id, "%s", PQgetvalue(res, row, 0));
        dispatch_done_t key = {.call = &key_call};
        dispatch_done_t *hit = bsearch(&key, done, n_done, sizeof *done, cmp_done);
        if (!hit)
            continue;
        won[hit - done] = true;
        const char *became = PQgetvalue(res, row, 1);
        if (strcmp(hit->to_status, "PLANNED") == 0 &&
            (strcmp(became, "CANCELLED") == 0 || strcmp(became, "UNKNOWN") == 0)) {
            /* Its run was stopped meanwhile: not tried again. CANCELLED when the attempt was
             * not applied, UNKNOWN when it may have been (the reconciler asks the tool). */
            hit->to_status = strcmp(became, "CANCELLED") == 0 ? "CANCELLED" : "UNKNOWN";
            snprintf(hit->error_code, sizeof hit->error_code, "%s", PQgetvalue(res, row, 2));
            snprintf(hit->error_message, sizeof hit->error_message, "%s", PQgetvalue(res, row, 3));
        }
    }
    PGresult *handed = NULL;
    ok = record_events(d, done, n_done, won, ab, ob, &err) &&
         tally_audit_batch_flush(ab, d->rec_pg, &err) &&
         dispatch_flush_messages(d, d->rec_pg, ob, &handed, &err) &&
         tally_pg_commit(d->rec_pg, &err);
    if (ok)
        dispatch_hand_messages(d, handed);
    else
        PQclear(handed);
out:
    PQclear(res);
    tally_columns_release(&rows);
    tally_audit_batch_free(ab);
    tally_outbox_batch_free(ob);
    if (!ok) {
        tally_pg_rollback(d->rec_pg);
        free(won);
        d->rec_backoff_ms = d->rec_backoff_ms ? d->rec_backoff_ms * 2 : 100;
        if (d->rec_backoff_ms > 2000)
            d->rec_backoff_ms = 2000;
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                            "recording %zu call results failed (%s: %s); retrying in %d ms (their "
                            "leases keep them safe meanwhile)",
                            n_done, err.code, err.message, d->rec_backoff_ms);
        tally_metric_add(d->m_db_errors, 1, "record");
        tally_worker_set_ready(d->w, false, err.message);
        *err_out = err;
        return false;
    }
    TALLY_CRASHPOINT("dispatch.after_record_commit");
    if (d->rec_backoff_ms)
        tally_worker_set_ready(d->w, true, NULL);
    d->rec_backoff_ms = 0;
    double due = 0;
    for (size_t i = 0; i < n_done; i++) {
        dispatch_done_t *x = &done[i];
        dispatch_call_t *call = x->call;
        tally_log_ctx_t ctx = {
            .run_id = call->run_id, .effect_id = call->effect_id, .tool = call->tool->name};
        if (!won[i]) {
            /* Rule 3: the lease was taken over (or the effect moved on); write nothing. */
            tally_metric_add(d->m_lease_lost, 1);
            TALLY_LOG(TALLY_LOG_WARN, &ctx,
                      "lease epoch %lld was taken over before the result (%s) could be "
                      "recorded; the result is dropped",
                      call->epoch, x->to_status);
            done_clear(x);
            continue;
        }
        tally_metric_observe(d->m_dispatch_seconds, now - call->claimed_at);
        if (strcmp(x->to_status, "PLANNED") == 0) {
            double at = now + x->delay_ms / 1000.0;
            if (due == 0 || at < due)
                due = at;
            TALLY_LOG(TALLY_LOG_INFO, &ctx, "attempt %d not applied (%s); retrying in %lld ms",
                      call->attempts, x->v.code, x->delay_ms);
        } else {
            TALLY_LOG(strcmp(x->to_status, "CONFIRMED") == 0 ? TALLY_LOG_DEBUG : TALLY_LOG_INFO,
                      &ctx, "%s after attempt %d (%s)", x->to_status, call->attempts, x->v.code);
        }
        done_clear(x);
    }
    free(won);
    *due_out = due;
    return true;
}

/* A result PostgreSQL refuses to store (a tool's answer the ledger cannot hold): in its place
 * a note naming the refusal, with an excerpt of the answer, and the effect's error says so. It
 * is evidence kept in the only form the ledger takes, never a reason to stop recording. */
static void downgrade_refused(dispatch_done_t *x, const tally_error_t *err)
{
    tally_jtext_t j = {0};
    tally_jtext_begin(&j, NULL);
    tally_jtext_str(&j, "refused_by_ledger", err->message);
    if (x->receipt_text != NULL) {
        size_t len = strlen(x->receipt_text);
        tally_jtext_int(&j, "bytes", (long long)len);
        char excerpt[2048];
        tally_text_copy(excerpt, sizeof excerpt, x->receipt_text);
        tally_jtext_str(&j, "excerpt", excerpt);
    }
    tally_jtext_end(&j);
    char *note = tally_jtext_take(&j);
    if (x->receipt_text != NULL || strcmp(x->to_status, "CONFIRMED") == 0) {
        free(x->receipt_text);
        x->receipt_text = note != NULL ? note : strdup("{}");
    } else {
        free(note);
    }
    free(x->external_ref);
    x->external_ref = NULL;
    set_error(x, "protocol_error",
              "PostgreSQL refused to store the tool's answer (%s); a note with an excerpt is "
              "kept in its place",
              err->message);
}

/* A batch PostgreSQL refused for its data: each result written alone, so that one bad answer
 * does not hold the others; a result refused alone is written again downgraded
 * (downgrade_refused). The ones still not written are moved to the front of @p done and
 * counted in @p *n. Returns the number written. */
static size_t record_isolating(dispatcher_t *d, dispatch_done_t *done, size_t *n, double *due_out)
{
    size_t written = 0, kept = 0;
    for (size_t i = 0; i < *n; i++) {
        double due = 0;
        tally_error_t err;
        tally_error_clear(&err);
        bool ok = record_batch(d, &done[i], 1, &due, &err);
        if (!ok && tally_pg_error_is_data(&err)) {
            tally_log_ctx_t ctx = {.run_id = done[i].call->run_id,
                                   .effect_id = done[i].call->effect_id,
                                   .tool = done[i].call->tool->name};
            TALLY_LOG(TALLY_LOG_WARN, &ctx,
                      "PostgreSQL refused the result of this call (%s: %s); writing it with a "
                      "note in place of the tool's answer",
                      err.code, err.message);
            downgrade_refused(&done[i], &err);
            tally_error_clear(&err);
            ok = record_batch(d, &done[i], 1, &due, &err);
        }
        if (ok) {
            written++;
            if (due > 0 && (*due_out == 0 || due < *due_out))
                *due_out = due;
        } else if (kept++ != i) {
            done[kept - 1] = done[i];
        }
    }
    *n = kept;
    return written;
}

/* ---------------------------------------------------------------------------------------- */
/* The recorder thread                                                                      */

/* Results are written by a thread of their own, on a PostgreSQL connection of their own, so
 * the loop keeps taking intents in and starting calls while a batch of results commits: the
 * two kinds of transaction overlap instead of taking turns on one connection. Whatever
 * finishes while a batch is being written forms the next batch. */
static void *recorder_main(void *arg)
{
    dispatcher_t *d = arg;
    dispatch_done_t *batch = NULL;
    size_t cap = 0;
    double retry_at = 0;
    pthread_mutex_lock(&d->rec_mu);
    for (;;) {
        while (!d->rec_stop && (d->n_done == 0 || dispatch_now() < retry_at)) {
            if (d->n_done == 0) {
                pthread_cond_wait(&d->rec_cv, &d->rec_mu);
                continue;
            }
            struct timespec ts = {.tv_sec = (time_t)retry_at,
                                  .tv_nsec = (long)((retry_at - (double)(time_t)retry_at) * 1e9)};
            pthread_cond_timedwait(&d->rec_cv, &d->rec_mu, &ts);
        }
        if (d->n_done == 0)
            break; /* stopping, and nothing is left */
        dispatch_done_t *taken = d->done;
        size_t taken_cap = d->cap_done, n = d->n_done;
        d->done = batch;
        d->cap_done = cap;
        d->n_done = 0;
        batch = taken;
        cap = taken_cap;
        d->rec_busy = true;
        pthread_mutex_unlock(&d->rec_mu);

        double due = 0;
        tally_error_t err;
        tally_error_clear(&err);
        bool ok = record_batch(d, batch, n, &due, &err);
        size_t recorded = ok ? n : 0;
        if (!ok && tally_pg_error_is_data(&err)) {
            recorded = record_isolating(d, batch, &n, &due);
            ok = n == 0;
        }

        pthread_mutex_lock(&d->rec_mu);
        d->rec_busy = false;
        d->rec_recorded += recorded;
        if (ok) {
            if (due > 0 && (d->rec_due == 0 || due < d->rec_due))
                d->rec_due = due;
            retry_at = 0;
        } else {
            /* Put the batch back in front of what finished meanwhile and try again after the
             * backoff; when stopping, or out of memory, leave it to lease expiry. */
            size_t total = n + d->n_done;
            dispatch_done_t *all = d->rec_stop ? NULL : realloc(batch, total * sizeof *all);
            if (!all) {
                TALLY_WARN("%zu call results not recorded; their leases will expire and the "
                           "reconciler will resolve them",
                           n);
                for (size_t i = 0; i < n; i++)
                    done_clear(&batch[i]);
            } else {
                if (d->n_done) /* d->done is NULL until a result has been queued */
                    memcpy(all + n, d->done, d->n_done * sizeof *all);
                batch = d->done;
                cap = d->cap_done;
                d->done = all;
                d->cap_done = total;
                d->n_done = total;
                retry_at = dispatch_now() + d->rec_backoff_ms / 1000.0;
            }
        }
        if (d->rec_pipe[1] >= 0) {
            ssize_t w = write(d->rec_pipe[1], "r", 1);
            (void)w; /* a full pipe already holds a wake-up */
        }
    }
    pthread_mutex_unlock(&d->rec_mu);
    free(batch);
    return NULL;
}

bool deliver_recorder_start(dispatcher_t *d)
{
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) != 0 ||
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) != 0 ||
        pthread_cond_init(&d->rec_cv, &attr) != 0) {
        TALLY_ERROR("recorder: cannot create its condition variable");
        return false;
    }
    pthread_condattr_destroy(&attr);
    if (pthread_mutex_init(&d->rec_mu, NULL) != 0) {
        pthread_cond_destroy(&d->rec_cv);
        TALLY_ERROR("recorder: cannot create its mutex");
        return false;
    }
    d->rec_init = true;
    if (pipe2(d->rec_pipe, O_NONBLOCK | O_CLOEXEC) != 0) {
        TALLY_ERROR("recorder: wake-up pipe: %s", strerror(errno));
        return false;
    }
    d->rec_pg = tally_pg_new(d->cfg->pg ? d->cfg->pg : "", "tally-dispatcher-record");
    if (!d->rec_pg) {
        TALLY_ERROR("recorder: out of memory");
        return false;
    }
    if (pthread_create(&d->rec_thread, NULL, recorder_main, d) != 0) {
        TALLY_ERROR("recorder: cannot start its thread");
        return false;
    }
    d->rec_started = true;
    return true;
}

void deliver_recorder_stop(dispatcher_t *d)
{
    if (!d->rec_init)
        return;
    if (d->rec_started) {
        pthread_mutex_lock(&d->rec_mu);
        d->rec_stop = true;
        pthread_cond_signal(&d->rec_cv);
        pthread_mutex_unlock(&d->rec_mu);
        pthread_join(d->rec_thread, NULL);
        d->rec_started = false;
    }
    for (size_t i = 0; i < d->n_done; i++)
        done_clear(&d->done[i]);
    free(d->done);
    d->done = NULL;
    d->n_done = d->cap_done = 0;
    tally_pg_free(d->rec_pg);
    d->rec_pg = NULL;
    for (int i = 0; i < 2; i++)
        if (d->rec_pipe[i] >= 0)
            close(d->rec_pipe[i]);
    d->rec_pipe[0] = d->rec_pipe[1] = -1;
    pthread_cond_destroy(&d->rec_cv);
    pthread_mutex_destroy(&d->rec_mu);
    d->rec_init = false;
}

int deliver_recorded(dispatcher_t *d)
{
    char buf[64];
    while (read(d->rec_pipe[0], buf, sizeof buf) > 0)
        ;
    pthread_mutex_lock(&d->rec_mu);
    size_t n = d->rec_recorded;
    double due = d->rec_due;
    d->rec_recorded = 0;
    d->rec_due = 0;
    pthread_mutex_unlock(&d->rec_mu);
    if (due > 0 && due < d->next_sweep)
        d->next_sweep = due;
    /* Room freed: a tool that filled its room may have more due. */
    if (n > 0 && d->claim_capped)
        d->claim_wanted = true;
    tally_metric_set(d->m_inflight, tally_connector_inflight(d->conn));
    return (int)n;
}

size_t deliver_unrecorded(dispatcher_t *d)
{
    pthread_mutex_lock(&d->rec_mu);
    size_t n = d->n_done + (d->rec_busy ? 1 : 0);
    pthread_mutex_unlock(&d->rec_mu);
    return n;
}
