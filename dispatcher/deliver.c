/* deliver.c — the dispatch path of DESIGN §3 up to the decision: claim due outbox rows with a
 * lease (committed before any call), call the tools through the connector engine, and decide
 * what each effect becomes (policy.c). The recorder (record.c) writes the decisions with a
 * compare-and-set on status and lease epoch. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "dispatcher.h"
#include "tally/crashpoint.h"
#include "tally/cloudevent.h"
#include "tally/json.h"
#include "tally/log.h"
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
    /* The ids as one array and the status through coalesce(), as record.c does: primary-key
     * lookups only. See bench/README.md (Planner notes: the dispatcher's claim and record). */
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
    "   RETURNING e.effect_id, e.run_id, e.step, e.step_num, e.step_quoted, e.tool, "
    "e.operation_key,"
    "     e.args_canonical, e.traceparent, e.intent_id, e.lease_epoch, e.attempts,"
    "     e.lease_until, e.seal_key, e.args_sealed),"
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
    " SELECT effect_id::text, run_id, step, " TALLY_SQL_STEP_IS_NUMBER(
        "u") ", tool, operation_key,"
             "   args_canonical, traceparent, intent_id, lease_epoch, attempts,"
             /* a sensitive tool's effect: its tenant key, to open the sealed args */
             "   u.seal_key::text, k.master_key_id, k.wrapped, u.args_sealed"
             " FROM u LEFT JOIN tenant_keys k ON k.key_id = u.seal_key";

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
    call_sensitive_clear(call);
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

/* A random number for the backoff's jitter. Jitter needs no shared state: calls finish on the
 * connector's thread, calls that could not start on the loop's. */
static uint32_t jitter_random(void)
{
    static _Thread_local unsigned int seed;
    if (seed == 0)
        seed = (unsigned int)time(NULL) ^ (unsigned int)getpid() ^ (unsigned int)(uintptr_t)&seed;
    return (uint32_t)rand_r(&seed);
}

/* DESIGN §3: what the effect becomes after this verdict (policy.c). */
static void decide(dispatch_done_t *x)
{
    const dispatch_call_t *call = x->call;
    const tally_tool_t *tool = call->tool;
    tally_dispatch_input_t in = {.v = &x->v,
                                 .effect_class = tool->effect_class,
                                 .attempts = call->attempts,
                                 .max_attempts = tool->max_attempts,
                                 .backoff_ms = tool->backoff_ms,
                                 .max_backoff_ms = tool->max_backoff_ms,
                                 .random = jitter_random()};
    tally_dispatch_decide(&in, &x->dec);
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
        /* a sensitive tool's receipt: sealed whole, kept redacted (seal.h) */
        bool kept =
            call->red != NULL
                ? tally_sensitive_receipt(call->red, call->tool, call->effect_id, res,
                                          &x->receipt_text, &x->external_ref, &x->receipt_sealed)
                : tally_conn_receipt_text(res, call->tool, &x->receipt_text, &x->external_ref);
        if (!kept) {
            x->v.verdict = TALLY_VERDICT_UNKNOWN;
            snprintf(x->v.code, sizeof x->v.code, "receipt_lost");
            snprintf(x->v.message, sizeof x->v.message,
                     "HTTP %ld but the receipt could not be kept (out of memory)",
                     res->http_status);
        }
    }
    /* The receipt is stored once, on the effect (ledger.h): the audit trail keeps the answer
     * of every other attempt, its only copy. */
    bool on_effect = x->v.verdict == TALLY_VERDICT_CONFIRMED && x->receipt_text != NULL;
    char *scrubbed = NULL; /* a sensitive tool's answer, as the audit trail may keep it */
    size_t scrubbed_len = 0;
    if (call->red != NULL) {
        char *msg = tally_redactor_scrub(call->red, x->v.message, strlen(x->v.message));
        tally_text_copy(x->v.message, sizeof x->v.message, msg ? msg : "(redacted)");
        free(msg);
        if (!on_effect)
            scrubbed = tally_sensitive_scrub_body(call->red, call->tool, res->body, res->body_len,
                                                  &scrubbed_len);
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
        tally_dispatch_set_error(&x->dec, "protocol_error", "%s", msg);
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
    if (on_effect)
        tally_conn_receipt_ref_text(&rec); /* its hash: the recorder's statement (record.c) */
    else if (call->red != NULL)
        tally_conn_excerpt_text(&rec, "response", scrubbed ? scrubbed : "(redacted)",
                                scrubbed ? scrubbed_len : 10, 2048);
    else
        tally_conn_excerpt_text(&rec, "response", res->body, res->body_len, 2048);
    free(scrubbed);
    tally_jtext_end(&rec);
    x->call_record = tally_jtext_take(&rec);
    tally_metric_observe(d->m_connector_seconds, res->seconds, call->tool->name);
    tally_metric_add(d->m_calls, 1, call->tool->name, tally_verdict_name(x->v.verdict));
    if (!recorder_queue(d, x)) {
        /* Nothing recorded: the lease expires and the reconciler resolves the effect. */
        TALLY_ERROR("out of memory recording the result of effect %s; its lease will expire",
                    call->effect_id);
        dispatch_done_clear(x);
    }
}

static const char *pg_value(const PGresult *res, int row, int col)
{
    return PQgetisnull(res, row, col) ? NULL : PQgetvalue(res, row, col);
}

/* A call that could not start (nothing was sent): recorded like a refused request, or as
 * FAILED when it can never be sent (a header that would inject, a missing endpoint). */
static void submit_failed(dispatcher_t *d, dispatch_call_t *call, const tally_error_t *err)
{
    dispatch_done_t done = {0}, *x = &done;
    x->call = call;
    bool never = err->errc == TALLY_ERR_INVALID_HEADER || err->errc == TALLY_ERR_NO_ENDPOINT ||
                 err->errc == TALLY_ERR_SEALED;
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
    if (!recorder_queue(d, x))
        dispatch_done_clear(x); /* its lease expires; the reconciler resolves it */
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
        d->claim_failed = true;
        free(lims);
        free(got);
        return -1;
    }
    if (d->claim_failed) {
        d->claim_failed = false;
        tally_worker_set_ready(d->w, true, NULL);
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
        const char *body = PQgetvalue(res, row, 6);
        size_t body_len = (size_t)PQgetlength(res, row, 6);
        char *opened = NULL;
        if (tally_tool_sensitive(tool)) {
            tally_error_t serr;
            tally_error_clear(&serr);
            if (!call_open_sealed(d, call, pg_value(res, row, 11), pg_value(res, row, 12),
                                  pg_value(res, row, 13), pg_value(res, row, 14), &opened,
                                  &body_len, &serr)) {
                submit_failed(d, call, &serr);
                continue;
            }
            if (opened == NULL)
                body_len = (size_t)PQgetlength(res, row, 6);
            else
                body = opened;
        }
        deliver_start(d, call, body, body_len,
                      PQgetisnull(res, row, 7) ? NULL : PQgetvalue(res, row, 7));
        if (opened != NULL) {
            OPENSSL_cleanse(opened, body_len);
            free(opened);
        }
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
    tally_connector_publish_inflight(d->conn, d->m_tool_inflight);
    if (n > 0)
        TALLY_DEBUG("claimed %d effects; %d calls in flight", n, tally_connector_inflight(d->conn));
    return n;
}
