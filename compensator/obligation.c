/* obligation.c — lease the obligations that may run now, act on each by its effect class and
 * compensation mode (DESIGN §4), classify the reverse calls (DESIGN §6), and record every
 * outcome as a compare-and-set on (status, lease_epoch) with its audit events, pages and
 * Kafka events in one transaction. A worker whose lease was taken over writes nothing. */
#include "compensator.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/alert.h"
#include "tally/audit.h"
#include "tally/cloudevent.h"
#include "tally/crashpoint.h"
#include "tally/json.h"
#include "tally/log.h"
#include "tally/outbox.h"
#include "tally/text.h"

/* SQL assembled from fragments reads best one clause per line. */
// clang-format off

/* The sort key of a step: numeric steps by value, other steps in arrival order after them. */
#define STEP_KEY(e) "(" e ".step_num IS NULL, coalesce(" e ".step_num, 0), " e ".seq)"
/* The same order, latest first, for a window over a run's obligations. */
#define STEP_KEY_DESC(e)                                                                           \
    e ".step_num IS NULL DESC, coalesce(" e ".step_num, 0) DESC, " e ".seq DESC"

/* One statement leases what may run now: due PENDING rows and RUNNING rows whose lease expired,
 * not waiting for approval, whose effect is settled, with no unfinished obligation of a later
 * step in the run (saga order) and, for run compensations, no later effect still in flight,
 * STUCK, or confirmed but without its obligation yet (the sweep is about to create it).
 * $1 worker, $2 JSON {tool: lease ms}, $3 default lease ms, $4 limit, $5 JSON array of the
 * tools whose compensation needs approval.
 * Saga order is read per run, once: `front` ranks each run's unfinished obligations by step,
 * and only those of the latest step (rank 1: several when one effect has several obligations)
 * may run. An obligation held behind a later one — every earlier step of a run whose latest is
 * STUCK, while a human is paged — is thus dropped before anything is looked up for it. Asked
 * per candidate instead, after the other checks, it cost 320–360 ms a sweep against 90–115 ms
 * (EXPLAIN ANALYZE; a ledger of 100,000 effects with 21,600 obligations held behind 5,400
 * STUCK ones); every compensator sweeps once a second.
 * The time each effect was confirmed is read from its transitions through its run: the events
 * table is indexed by run, and by effect only for the kinds that may name another run's
 * effect (schema 8). */
static const char SQL_LEASE[] =
    "WITH front AS ("
    "  SELECT o.obligation_id, e.tool, e.status AS effect_status, e.step_num, e.seq,"
    "    rank() OVER (PARTITION BY o.run_id ORDER BY " STEP_KEY_DESC("e") ") AS pos"
    "  FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
    "  WHERE o.status IN ('PENDING', 'AWAITING_APPROVAL', 'RUNNING', 'STUCK')),"
    " cand AS ("
    "  SELECT o.obligation_id, o.status AS from_status"
    "  FROM front f JOIN obligations o ON o.obligation_id = f.obligation_id"
    "  WHERE f.pos = 1"
    "    AND ((o.status = 'PENDING' AND o.next_attempt_at <= now())"
    "      OR (o.status = 'RUNNING' AND o.lease_until < now()))"
    "    AND (o.approved_at IS NOT NULL"
    "      OR f.tool NOT IN (SELECT json_array_elements_text($5::json)))"
    "    AND f.effect_status NOT IN ('DISPATCHING', 'UNKNOWN')"
    "    AND (o.reason = 'duplicate' OR NOT EXISTS (SELECT 1 FROM effects e3"
    "      WHERE e3.run_id = o.run_id AND " STEP_KEY("e3") " > " STEP_KEY("f")
    "        AND (e3.status IN ('DISPATCHING', 'UNKNOWN', 'STUCK')"
    "          OR (e3.status = 'CONFIRMED' AND NOT EXISTS (SELECT 1 FROM obligations o3"
    "            WHERE o3.effect_id = e3.effect_id"
    "              AND o3.external_ref IS NOT DISTINCT FROM e3.external_ref)))))"
    "  ORDER BY o.next_attempt_at"
    "  LIMIT $4"
    "  FOR UPDATE OF o SKIP LOCKED)"
    " UPDATE obligations o SET status = 'RUNNING', lease_owner = $1,"
    "   lease_until = now() + coalesce(($2::json ->> e.tool)::int, $3::int)"
    "     * interval '1 millisecond',"
    "   lease_epoch = o.lease_epoch + 1, attempts = o.attempts + 1, updated_at = now()"
    " FROM cand, effects e"
    " WHERE o.obligation_id = cand.obligation_id AND e.effect_id = o.effect_id"
    " RETURNING o.obligation_id::text, o.run_id, o.effect_id::text, o.reason, o.external_ref,"
    "   coalesce(o.receipt, e.receipt)::text, cand.from_status, o.lease_epoch, o.attempts,"
    "   o.approved_at IS NOT NULL, e.step, e.step_num IS NOT NULL, e.tool, e.effect_class,"
    "   e.operation_key, e.args_canonical, e.traceparent, e.intent_id, e.attempts,"
    "   to_char(coalesce((SELECT max(ev.occurred_at) FROM events ev"
    "       WHERE ev.run_id = e.run_id AND ev.effect_id = e.effect_id"
    "         AND ev.to_status = 'CONFIRMED'), e.updated_at)"
    "     AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')";

/* Every outcome of a batch in one statement, each a compare-and-set on (status, lease_epoch). */
static const char SQL_RECORD[] =
    "UPDATE obligations o SET status = r.to_status, status_reason = r.status_reason,"
    "  error_code = r.error_code, error_message = r.error_message,"
    "  reverse_receipt = coalesce(r.reverse_receipt, o.reverse_receipt),"
    "  blast_radius = coalesce(r.blast_radius, o.blast_radius),"
    "  next_attempt_at = CASE WHEN r.to_status = 'PENDING'"
    "    THEN now() + r.delay_ms * interval '1 millisecond' ELSE o.next_attempt_at END,"
    "  attempts = o.attempts - CASE WHEN r.refund THEN 1 ELSE 0 END,"
    "  lease_owner = NULL, lease_until = NULL,"
    "  finished_at = CASE WHEN r.to_status IN ('PENDING', 'RUNNING') THEN NULL ELSE now() END,"
    "  updated_at = now()"
    " FROM json_to_recordset($1::json) AS r(obligation_id uuid, epoch bigint, to_status text,"
    "   status_reason text, error_code text, error_message text, reverse_receipt jsonb,"
    "   blast_radius jsonb, delay_ms bigint, refund boolean)"
    " WHERE o.obligation_id = r.obligation_id AND o.status = 'RUNNING'"
    "   AND o.lease_epoch = r.epoch"
    " RETURNING o.obligation_id::text, extract(epoch FROM now() - o.created_at)::float8";

/* A STUCK obligation stops its run. */
static const char SQL_RUNS_STUCK[] =
    "UPDATE runs r SET status = 'STUCK', status_reason = x.reason, updated_at = now()"
    " FROM json_to_recordset($1::json) AS x(run_id text, reason text), runs old"
    " WHERE r.run_id = x.run_id AND old.run_id = r.run_id AND r.status <> 'STUCK'"
    " RETURNING r.run_id, old.status";

static const char SQL_HOLD[] =
    "UPDATE obligations o SET status = 'AWAITING_APPROVAL',"
    "  status_reason = 'approval_required: the tool''s compensation.mode asks a human first',"
    "  updated_at = now()"
    " FROM effects e"
    " WHERE e.effect_id = o.effect_id AND o.status = 'PENDING' AND o.approved_at IS NULL"
    "   AND e.tool IN (SELECT json_array_elements_text($1::json))"
    " RETURNING o.obligation_id::text, o.run_id, o.effect_id::text, e.tool";

// clang-format on

/* ---------------------------------------------------------------------------------------- */

void comp_ob_free(void *p)
{
    comp_ob_t *ob = p;
    if (ob == NULL) {
        return;
    }
    free(ob->run_id);
    free(ob->step);
    free(ob->tool_name);
    free(ob->operation_key);
    free(ob->args_canonical);
    free(ob->traceparent);
    free(ob->external_ref);
    free(ob->reason);
    free(ob->confirmed_at);
    free(ob->intent_id);
    json_decref(ob->receipt);
    json_decref(ob->blast_radius);
    free(ob);
}

void comp_outcome_clear(comp_outcome_t *o)
{
    comp_ob_free(o->ob);
    json_decref(o->reverse_receipt);
    json_decref(o->call);
    memset(o, 0, sizeof *o);
}

static char *dup_or_null(PGresult *res, int row, int col)
{
    return PQgetisnull(res, row, col) ? NULL : strdup(PQgetvalue(res, row, col));
}

static comp_outcome_t *push_outcome(compensator_t *c, comp_ob_t *ob, const char *to_status)
{
    if (c->n_done == c->cap_done) {
        size_t cap = c->cap_done ? 2 * c->cap_done : 64;
        comp_outcome_t *d = realloc(c->done, cap * sizeof *d);
        if (d == NULL) {
            return NULL;
        }
        c->done = d;
        c->cap_done = cap;
    }
    comp_outcome_t *o = &c->done[c->n_done++];
    memset(o, 0, sizeof *o);
    o->ob = ob;
    o->to_status = to_status;
    return o;
}

/* Queue an outcome; when even that fails (out of memory), forget the obligation: its lease
 * expires and it runs again with the same idempotency key. */
static comp_outcome_t *decide_outcome(compensator_t *c, comp_ob_t *ob, const char *to_status,
                                      const char *code, const char *message)
{
    comp_outcome_t *o = push_outcome(c, ob, to_status);
    if (o == NULL) {
        TALLY_ERROR("out of memory queueing the outcome of obligation %s; its lease will expire",
                    ob->obligation_id);
        comp_ob_free(ob);
        return NULL;
    }
    tally_text_copy(o->code, sizeof o->code, code);
    tally_text_copy(o->message, sizeof o->message, message); /* may quote a tool's answer */
    return o;
}

static int max_attempts(const comp_ob_t *ob)
{
    return ob->tool != NULL && ob->tool->max_attempts > 0 ? ob->tool->max_attempts : 5;
}

/* Whether the registry's contract of @p tool asks for approval before compensating (the same
 * rule that fills the approval list the lease statement excludes). */
static bool tool_needs_approval(const tally_tool_t *tool)
{
    if (tool == NULL) {
        return false;
    }
    tally_comp_decision_t dec;
    tally_comp_decide(tool, tool->name, tool->effect_class, false, &dec);
    return dec.action == TALLY_COMP_ACT_AWAIT_APPROVAL;
}

static comp_ob_t *ob_from_row(compensator_t *c, PGresult *res, int row)
{
    comp_ob_t *ob = calloc(1, sizeof *ob);
    if (ob == NULL) {
        return NULL;
    }
    snprintf(ob->obligation_id, sizeof ob->obligation_id, "%s", PQgetvalue(res, row, 0));
    ob->run_id = strdup(PQgetvalue(res, row, 1));
    snprintf(ob->effect_id, sizeof ob->effect_id, "%s", PQgetvalue(res, row, 2));
    ob->reason = strdup(PQgetvalue(res, row, 3));
    ob->external_ref = dup_or_null(res, row, 4);
    if (!PQgetisnull(res, row, 5)) {
        ob->receipt = json_loads(PQgetvalue(res, row, 5), 0, NULL);
    }
    snprintf(ob->from_status, sizeof ob->from_status, "%s", PQgetvalue(res, row, 6));
    ob->epoch = atoll(PQgetvalue(res, row, 7));
    ob->attempts = atoi(PQgetvalue(res, row, 8));
    ob->approved = PQgetvalue(res, row, 9)[0] == 't';
    ob->step = strdup(PQgetvalue(res, row, 10));
    ob->step_is_number = PQgetvalue(res, row, 11)[0] == 't';
    ob->tool_name = strdup(PQgetvalue(res, row, 12));
    ob->cls_known = tally_effect_class_parse(PQgetvalue(res, row, 13), &ob->cls);
    ob->operation_key = strdup(PQgetvalue(res, row, 14));
    ob->args_canonical = strdup(PQgetvalue(res, row, 15));
    ob->traceparent = dup_or_null(res, row, 16);
    ob->intent_id = dup_or_null(res, row, 17);
    ob->effect_attempts = atoi(PQgetvalue(res, row, 18));
    ob->confirmed_at = dup_or_null(res, row, 19);
    ob->tool = tally_registry_find(c->reg, ob->tool_name);
    if (ob->run_id == NULL || ob->reason == NULL || ob->step == NULL || ob->tool_name == NULL ||
        ob->operation_key == NULL || ob->args_canonical == NULL) {
        comp_ob_free(ob);
        return NULL;
    }
    return ob;
}

/* The connector exchange as the audit trail keeps it (kind "connector_call"). */
static json_t *call_record(const comp_ob_t *ob, const tally_conn_result_t *res,
                           const tally_conn_verdict_t *v, const char *key, const char *if_match)
{
    json_t *excerpt = tally_conn_excerpt(res->body, res->body_len, 2048);
    return json_pack(
        "{s:s, s:s, s:s, s:s, s:s?, s:i, s:b, s:s, s:s, s:s, s:f, s:i, s:o}", "op",
        tally_conn_op_name(res->op), "method", res->method, "url", res->url, "idempotency_key", key,
        "if_match", if_match, "http_status", (int)res->http_status, "sent", res->sent, "verdict",
        tally_verdict_name(v->verdict), "code", v->code, "message", v->message, "seconds",
        res->seconds, "attempt", ob->attempts, "response", excerpt != NULL ? excerpt : json_null());
}

/* ---------------------------------------------------------------------------------------- */
/* Acting on one leased obligation                                                          */

static void page(comp_outcome_t *o, const char *reason)
{
    if (o != NULL) {
        o->alert_severity = "critical";
        o->alert_reason = reason;
    }
}

/* Start the compensate or containment call. */
static void submit(compensator_t *c, comp_ob_t *ob, tally_conn_op_t op)
{
    json_t *args = json_loads(ob->args_canonical, 0, NULL);
    json_t *body = comp_reverse_body(ob->external_ref, ob->receipt, args, ob->reason);
    if (body != NULL && op == TALLY_CONN_CONTAIN && ob->blast_radius != NULL) {
        json_object_set(body, "blast_radius", ob->blast_radius);
    }
    char *text = body != NULL ? json_dumps(body, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(body);
    json_decref(args);
    char key[64];
    snprintf(key, sizeof key, "%s:%s", op == TALLY_CONN_CONTAIN ? "contain" : "reverse",
             ob->obligation_id);
    char if_match[COMP_IF_MATCH_SIZE];
    comp_version_t version =
        op == TALLY_CONN_COMPENSATE ? comp_if_match(ob->receipt, if_match) : COMP_VERSION_NONE;
    bool has_version = version == COMP_VERSION_OK;
    if (version == COMP_VERSION_UNUSABLE) {
        /* Without its If-Match the reverse call could overwrite a newer state: a human looks. */
        free(text);
        comp_outcome_t *o = decide_outcome(
            c, ob, "STUCK", "protocol_error",
            "the receipt's version is longer than 256 bytes or holds control characters, so it "
            "cannot be sent as If-Match; the reverse call is not made without that guard");
        if (o != NULL) {
            o->is_error = true;
        }
        page(o, "protocol_error");
        return;
    }
    if (text == NULL) {
        comp_outcome_t *o =
            decide_outcome(c, ob, "PENDING", "oom", "out of memory building the request body");
        if (o != NULL) {
            o->refund_attempt = true;
            o->delay_ms = 1000;
        }
        return;
    }
    tally_conn_request_t req = {
        .tool = ob->tool,
        .op = op,
        .idempotency_key = key,
        .run_id = ob->run_id,
        .effect_id = ob->effect_id,
        .traceparent = ob->traceparent,
        .if_match = has_version ? if_match : NULL,
        .body = text,
        .body_len = strlen(text),
        .opaque = ob,
    };
    tally_error_t err;
    tally_error_clear(&err);
    ob->started = comp_now();
    bool ok = tally_connector_submit(c->conn, &req, &err);
    free(text);
    if (ok) {
        TALLY_LOG(TALLY_LOG_DEBUG,
                  (&(tally_log_ctx_t){.run_id = ob->run_id,
                                      .effect_id = ob->effect_id,
                                      .obligation_id = ob->obligation_id,
                                      .tool = ob->tool_name}),
                  "%s call started (attempt %d, key %s)", tally_conn_op_name(op), ob->attempts,
                  key);
        return;
    }
    /* Nothing was sent. Capacity is not the tool's fault: no attempt is counted. */
    bool capacity = strcmp(err.code, "capacity") == 0;
    bool retry = capacity || err.retriable;
    comp_outcome_t *o;
    if (retry && (capacity || ob->attempts < max_attempts(ob))) {
        o = decide_outcome(c, ob, "PENDING", err.code, err.message);
        if (o != NULL) {
            o->is_error = true;
            o->refund_attempt = capacity;
            o->delay_ms =
                capacity ? 200 : comp_backoff_ms(ob->tool, ob->attempts, -1, &c->rand_state);
        }
    } else if (op == TALLY_CONN_CONTAIN) {
        /* a containment that cannot be made is recorded; it never makes the obligation STUCK */
        json_object_set_new(ob->blast_radius, "containment",
                            json_pack("{s:s, s:s, s:s}", "status", "failed", "code", err.code,
                                      "message", err.message));
        o = decide_outcome(c, ob, "UNCOMPENSATABLE", ob->dec.code, ob->dec.why);
    } else {
        o = decide_outcome(c, ob, "STUCK", retry ? "attempts_exhausted" : err.code, err.message);
        if (o != NULL) {
            o->is_error = true;
        }
        page(o, retry ? "attempts_exhausted" : err.code);
    }
}

static void act(compensator_t *c, comp_ob_t *ob)
{
    bool approved = ob->approved || !tool_needs_approval(ob->tool);
    if (!ob->cls_known) {
        ob->dec.action = TALLY_COMP_ACT_NO_TOOL;
        ob->dec.to_status = "STUCK";
        ob->dec.code = "unknown_class";
        snprintf(ob->dec.why, sizeof ob->dec.why,
                 "the effect's class is not one tally knows: a human decides");
    } else {
        tally_comp_decide(ob->tool, ob->tool_name, ob->cls, approved, &ob->dec);
    }
    comp_outcome_t *o;
    switch (ob->dec.action) {
    case TALLY_COMP_ACT_SKIP:
        decide_outcome(c, ob, "SKIPPED", ob->dec.code, ob->dec.why);
        return;
    case TALLY_COMP_ACT_RECORD:
    case TALLY_COMP_ACT_CONTAIN:
    case TALLY_COMP_ACT_ESCALATE:
    case TALLY_COMP_ACT_NOT_SUPPORTED: {
        json_t *args = json_loads(ob->args_canonical, 0, NULL);
        ob->blast_radius = comp_blast_radius(ob->tool_name, ob->operation_key, args, ob->receipt,
                                             ob->external_ref, ob->confirmed_at);
        json_decref(args);
        if (ob->dec.action == TALLY_COMP_ACT_CONTAIN && ob->blast_radius != NULL) {
            if (ob->attempts <= max_attempts(ob)) {
                submit(c, ob, TALLY_CONN_CONTAIN);
                return;
            }
            json_object_set_new(ob->blast_radius, "containment",
                                json_pack("{s:s, s:s, s:s}", "status", "failed", "code",
                                          "attempts_exhausted", "message",
                                          "the containment action was not confirmed within the "
                                          "tool's max_attempts"));
        }
        o = decide_outcome(c, ob, "UNCOMPENSATABLE", ob->dec.code, ob->dec.why);
        if (ob->dec.action == TALLY_COMP_ACT_ESCALATE) {
            page(o, "destructive");
        }
        return;
    }
    case TALLY_COMP_ACT_RUNBOOK:
    case TALLY_COMP_ACT_NO_TOOL:
        o = decide_outcome(c, ob, "STUCK", ob->dec.code, ob->dec.why);
        if (o != NULL) {
            o->is_error = true;
        }
        page(o, ob->dec.code);
        return;
    case TALLY_COMP_ACT_AWAIT_APPROVAL:
        /* the lease excludes these; a registry changed under us: give it back untouched */
        o = decide_outcome(c, ob, "PENDING", ob->dec.code, ob->dec.why);
        if (o != NULL) {
            o->refund_attempt = true;
            o->delay_ms = c->cfg->sweep_ms;
        }
        return;
    case TALLY_COMP_ACT_REVERSE:
        if (ob->attempts > max_attempts(ob)) {
            /* leases kept expiring mid-call (crashes): stop and page rather than loop */
            o = decide_outcome(c, ob, "STUCK", "attempts_exhausted",
                               "the reverse call was started max_attempts times without a "
                               "recorded answer (the workers making it stopped or lost their "
                               "leases)");
            if (o != NULL) {
                o->is_error = true;
            }
            page(o, "attempts_exhausted");
            return;
        }
        submit(c, ob, TALLY_CONN_COMPENSATE);
        return;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Leasing                                                                                  */

static PGresult *exec1(tally_pg_t *pg, const char *sql, const char *param, tally_error_t *err)
{
    const char *params[1] = {param};
    return tally_pg_exec(pg, sql, 1, params, err);
}

int comp_hold_for_approval(compensator_t *c)
{
    if (strcmp(c->approval_tools, "[]") == 0) {
        return 0;
    }
    tally_error_t err;
    tally_error_clear(&err);
    tally_audit_batch_t *ab = tally_audit_batch_new();
    if (ab == NULL) {
        return -1;
    }
    int n = -1;
    PGresult *res = NULL;
    if (!tally_pg_begin(c->pg, &err)) {
        goto out;
    }
    res = exec1(c->pg, SQL_HOLD, c->approval_tools, &err);
    if (res == NULL) {
        goto out;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        tally_audit_event_t ev = {.run_id = PQgetvalue(res, row, 1),
                                  .effect_id = PQgetvalue(res, row, 2),
                                  .obligation_id = PQgetvalue(res, row, 0),
                                  .kind = "obligation",
                                  .from_status = "PENDING",
                                  .to_status = "AWAITING_APPROVAL",
                                  .actor = c->worker_id,
                                  .reason = "approval_required"};
        tally_audit_batch_add(ab, &ev);
        TALLY_LOG(TALLY_LOG_INFO,
                  (&(tally_log_ctx_t){.run_id = ev.run_id,
                                      .effect_id = ev.effect_id,
                                      .obligation_id = ev.obligation_id,
                                      .tool = PQgetvalue(res, row, 3)}),
                  "compensation waits for approval: tally approve --obligation %s",
                  ev.obligation_id);
    }
    if (!tally_audit_batch_flush(ab, c->pg, &err) || !tally_pg_commit(c->pg, &err)) {
        goto out;
    }
    n = PQntuples(res);
out:
    if (n < 0) {
        tally_pg_rollback(c->pg);
        TALLY_ERROR("holding obligations for approval: %s", err.message);
        tally_metric_add(c->m_db_errors, 1, "hold");
    }
    PQclear(res);
    tally_audit_batch_free(ab);
    return n;
}

/* {tool: lease ms}: the tool's timeout plus a margin, never less than TALLY_LEASE_MS. */
static char *lease_map(const compensator_t *c)
{
    json_t *m = json_object();
    for (size_t i = 0; m != NULL && i < tally_registry_count(c->reg); i++) {
        const tally_tool_t *t = tally_registry_at(c->reg, i);
        int ms = t->timeout_ms + COMP_LEASE_MARGIN_MS;
        if (ms < c->cfg->lease_ms) {
            ms = c->cfg->lease_ms;
        }
        json_object_set_new(m, t->name, json_integer(ms));
    }
    char *text = m != NULL ? json_dumps(m, JSON_COMPACT) : NULL;
    json_decref(m);
    return text;
}

int comp_lease(compensator_t *c)
{
    int room = c->cfg->max_inflight - tally_connector_inflight(c->conn);
    int limit = c->cfg->batch_size < room ? c->cfg->batch_size : room;
    if (limit <= 0) {
        return 0;
    }
    char *leases = lease_map(c);
    tally_audit_batch_t *ab = tally_audit_batch_new();
    if (leases == NULL || ab == NULL) {
        free(leases);
        tally_audit_batch_free(ab);
        TALLY_ERROR("out of memory preparing a lease");
        return -1;
    }
    char lease_ms[16], lim[16];
    snprintf(lease_ms, sizeof lease_ms, "%d", c->cfg->lease_ms);
    snprintf(lim, sizeof lim, "%d", limit);
    const char *params[5] = {c->worker_id, leases, lease_ms, lim, c->approval_tools};
    tally_error_t err;
    tally_error_clear(&err);
    PGresult *res = NULL;
    int n = -1;
    if (!tally_pg_begin(c->pg, &err)) {
        goto out;
    }
    res = tally_pg_exec(c->pg, SQL_LEASE, 5, params, &err);
    if (res == NULL) {
        goto out;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        json_t *data =
            json_pack("{s:I, s:i, s:s}", "lease_epoch", (json_int_t)atoll(PQgetvalue(res, row, 7)),
                      "attempts", atoi(PQgetvalue(res, row, 8)), "tool", PQgetvalue(res, row, 12));
        tally_audit_event_t ev = {.run_id = PQgetvalue(res, row, 1),
                                  .effect_id = PQgetvalue(res, row, 2),
                                  .obligation_id = PQgetvalue(res, row, 0),
                                  .kind = "lease",
                                  .from_status = PQgetvalue(res, row, 6),
                                  .to_status = "RUNNING",
                                  .actor = c->worker_id,
                                  .reason = strcmp(PQgetvalue(res, row, 6), "RUNNING") == 0
                                                ? "expired lease taken over"
                                                : "leased",
                                  .data = data};
        tally_audit_batch_add(ab, &ev);
        json_decref(data);
    }
    if (!tally_audit_batch_flush(ab, c->pg, &err) || !tally_pg_commit(c->pg, &err)) {
        goto out;
    }
    n = PQntuples(res);
    for (int row = 0; row < n; row++) {
        TALLY_CRASHPOINT("compensate.after_lease_commit");
        comp_ob_t *ob = ob_from_row(c, res, row);
        if (ob == NULL) {
            TALLY_ERROR("out of memory reading leased obligation %s; its lease will expire",
                        PQgetvalue(res, row, 0));
            continue;
        }
        if (strcmp(ob->from_status, "RUNNING") == 0) {
            TALLY_LOG(TALLY_LOG_WARN,
                      (&(tally_log_ctx_t){.run_id = ob->run_id,
                                          .effect_id = ob->effect_id,
                                          .obligation_id = ob->obligation_id,
                                          .tool = ob->tool_name}),
                      "took over an expired lease (attempt %d); repeating the call with the "
                      "same idempotency key",
                      ob->attempts);
        }
        act(c, ob);
    }
out:
    if (n < 0) {
        tally_pg_rollback(c->pg);
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL, "leasing obligations: %s", err.message);
        tally_metric_add(c->m_db_errors, 1, "lease");
    }
    PQclear(res);
    free(leases);
    tally_audit_batch_free(ab);
    return n;
}

/* ---------------------------------------------------------------------------------------- */
/* A call finished                                                                          */

void comp_on_done(const tally_conn_result_t *res, void *opaque)
{
    compensator_t *c = opaque;
    comp_ob_t *ob = res->opaque;
    TALLY_CRASHPOINT("compensate.after_reverse_answer");
    tally_conn_verdict_t v;
    tally_conn_classify_compensate(res, &v);
    tally_metric_observe(c->m_reverse, res->seconds, ob->tool_name);
    bool contain = res->op == TALLY_CONN_CONTAIN;
    char key[64], if_match[COMP_IF_MATCH_SIZE];
    snprintf(key, sizeof key, "%s:%s", contain ? "contain" : "reverse", ob->obligation_id);
    bool has_version = !contain && comp_if_match(ob->receipt, if_match) == COMP_VERSION_OK;
    json_t *call = call_record(ob, res, &v, key, has_version ? if_match : NULL);
    TALLY_LOG(v.verdict == TALLY_VERDICT_RESOLVED ? TALLY_LOG_INFO : TALLY_LOG_WARN,
              (&(tally_log_ctx_t){.run_id = ob->run_id,
                                  .effect_id = ob->effect_id,
                                  .obligation_id = ob->obligation_id,
                                  .tool = ob->tool_name}),
              "%s call answered: %s (%s) in %.3f s", tally_conn_op_name(res->op),
              tally_verdict_name(v.verdict), v.message, res->seconds);

    comp_outcome_t *o = NULL;
    bool exhausted = ob->attempts >= max_attempts(ob);
    if (contain) {
        /* append_only: UNCOMPENSATABLE whatever the containment did; a transient failure is
         * retried (same key) within max_attempts, any other failure is recorded, not STUCK */
        if (v.verdict == TALLY_VERDICT_RETRY && !exhausted) {
            o = decide_outcome(c, ob, "PENDING", v.code, v.message);
            if (o != NULL) {
                o->is_error = true;
                o->delay_ms =
                    comp_backoff_ms(ob->tool, ob->attempts, v.retry_after_ms, &c->rand_state);
            }
        } else {
            json_t *receipt = v.verdict == TALLY_VERDICT_RESOLVED ? tally_conn_receipt(res) : NULL;
            json_object_set_new(
                ob->blast_radius, "containment",
                json_pack(
                    "{s:s, s:s, s:s, s:i, s:s, s:s, s:o}", "status",
                    v.verdict == TALLY_VERDICT_RESOLVED ? "done" : "failed", "method", res->method,
                    "url", res->url, "http_status", (int)res->http_status, "code",
                    exhausted && v.verdict == TALLY_VERDICT_RETRY ? "attempts_exhausted" : v.code,
                    "message", v.message, "receipt", receipt != NULL ? receipt : json_null()));
            o = decide_outcome(c, ob, "UNCOMPENSATABLE", ob->dec.code, ob->dec.why);
        }
    } else {
        switch (v.verdict) {
        case TALLY_VERDICT_RESOLVED:
            o = decide_outcome(c, ob, "RESOLVED", v.code, v.message);
            if (o != NULL) {
                o->reverse_receipt = tally_conn_receipt(res);
            }
            break;
        case TALLY_VERDICT_RETRY:
            if (exhausted) {
                char msg[512];
                snprintf(msg, sizeof msg,
                         "the reverse call failed %d times (max_attempts of tool '%s'); last: %s",
                         ob->attempts, ob->tool_name, v.message);
                o = decide_outcome(c, ob, "STUCK", "attempts_exhausted", msg);
                page(o, "attempts_exhausted");
            } else {
                o = decide_outcome(c, ob, "PENDING", v.code, v.message);
                if (o != NULL) {
                    o->delay_ms =
                        comp_backoff_ms(ob->tool, ob->attempts, v.retry_after_ms, &c->rand_state);
                }
            }
            break;
        default: /* STUCK: 412 stale_state (never retried) or another 4xx */
            o = decide_outcome(c, ob, "STUCK", v.code, v.message);
            page(o, strcmp(v.code, "stale_state") == 0 ? "stale_state" : "reverse_failed");
            break;
        }
        if (o != NULL && v.verdict != TALLY_VERDICT_RESOLVED) {
            o->is_error = true;
        }
    }
    if (o != NULL) {
        o->call = call;
    } else {
        json_decref(call);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Recording                                                                                */

static json_t *step_json(const comp_ob_t *ob)
{
    if (ob->step_is_number) {
        char *end = NULL;
        long long v = strtoll(ob->step, &end, 10);
        if (end != ob->step && *end == '\0') {
            return json_integer((json_int_t)v);
        }
    }
    return json_string(ob->step);
}

static json_t *outcome_row(const comp_outcome_t *o)
{
    const comp_ob_t *ob = o->ob;
    char reason[600];
    snprintf(reason, sizeof reason, "%s: %s", o->code, o->message);
    bool uncomp = strcmp(o->to_status, "UNCOMPENSATABLE") == 0;
    return json_pack("{s:s, s:I, s:s, s:s, s:s?, s:s?, s:O?, s:O?, s:I, s:b}", "obligation_id",
                     ob->obligation_id, "epoch", (json_int_t)ob->epoch, "to_status", o->to_status,
                     "status_reason", reason, "error_code", o->is_error ? o->code : NULL,
                     "error_message", o->is_error ? o->message : NULL, "reverse_receipt",
                     o->reverse_receipt, "blast_radius", uncomp ? ob->blast_radius : NULL,
                     "delay_ms", (json_int_t)o->delay_ms, "refund", o->refund_attempt);
}

/* tally.effect.compensated.v1: the effect's record was reversed. */
static bool publish_compensated(compensator_t *c, tally_outbox_batch_t *obx,
                                const comp_outcome_t *o)
{
    const comp_ob_t *ob = o->ob;
    json_t *data = json_pack(
        "{s:s, s:s, s:o, s:s, s:s, s:s, s:O?, s:s?, s:n, s:i, s:s?, s:s, s:s, s:O?, s:s}",
        "effect_id", ob->effect_id, "run_id", ob->run_id, "step", step_json(ob), "tool",
        ob->tool_name, "operation_key", ob->operation_key, "status", "CONFIRMED", "receipt",
        ob->receipt, "external_ref", ob->external_ref, "error", "attempts", ob->effect_attempts,
        "intent_id", ob->intent_id, "obligation_id", ob->obligation_id, "obligation_status",
        "RESOLVED", "reverse_receipt", o->reverse_receipt, "obligation_reason", ob->reason);
    json_t *ce = data != NULL ? tally_ce_new("tally.effect.compensated.v1", c->source, ob->run_id,
                                             data, NULL)
                              : NULL;
    if (ce == NULL) {
        return false;
    }
    tally_outbox_batch_add(obx, "outcomes", ob->run_id, ce);
    json_decref(ce);
    return true;
}

/* The page that can always be written: ids and fixed words only. Raised when the full page
 * was refused (alert.h makes its text safe; this is for whatever else could refuse it). */
static bool queue_minimal_alert(tally_alert_batch_t *alerts, const comp_outcome_t *o)
{
    const comp_ob_t *ob = o->ob;
    char *key = tally_alert_obligation_key(ob->obligation_id);
    char *cmd = key != NULL ? tally_alert_obligation_command(ob->obligation_id) : NULL;
    char summary[160];
    snprintf(summary, sizeof summary,
             "obligation %s is %s; its full page could not be written: see tally doctor",
             ob->obligation_id, o->to_status);
    bool ok = key != NULL && cmd != NULL;
    if (ok) {
        tally_alert_t a = {.dedup_key = key,
                           .severity = "critical",
                           .summary = summary,
                           .run_id = ob->run_id,
                           .effect_id = ob->effect_id,
                           .obligation_id = ob->obligation_id,
                           .reason = "page_refused",
                           .resolve_command = cmd};
        tally_alert_batch_add(alerts, &a);
    }
    free(key);
    free(cmd);
    return ok;
}

static bool queue_alert(tally_alert_batch_t *alerts, const comp_outcome_t *o, bool minimal)
{
    if (minimal)
        return queue_minimal_alert(alerts, o);
    const comp_ob_t *ob = o->ob;
    char *key = tally_alert_obligation_key(ob->obligation_id);
    /* an UNCOMPENSATABLE obligation is final: the page is closed, not the obligation moved */
    bool final = strcmp(o->to_status, "UNCOMPENSATABLE") == 0;
    char *cmd = key == NULL ? NULL
                : final     ? tally_alert_close_command(key)
                            : tally_alert_obligation_command(ob->obligation_id);
    /* One line for the pager: each quoted value cut on a character boundary (text.h), so
     * that no run id or ref can make the alert unwritable. */
    char run[84], step[44], tool[64], ref[64], summary[512];
    tally_text_copy(run, sizeof run, ob->run_id);
    tally_text_copy(step, sizeof step, ob->step);
    tally_text_copy(tool, sizeof tool, ob->tool_name);
    tally_text_copy(ref, sizeof ref, ob->external_ref != NULL ? ob->external_ref : "none");
    if (final) {
        tally_fmt(summary, sizeof summary,
                  "run %s step %s: destructive %s cannot be undone (ref %s)", run, step, tool, ref);
    } else {
        tally_fmt(summary, sizeof summary, "run %s step %s: compensation of %s is STUCK (%s): %s",
                  run, step, tool, o->code, o->message);
    }
    json_t *details = json_pack("{s:s, s:o, s:s?, s:s, s:s, s:i}", "tool", ob->tool_name, "step",
                                step_json(ob), "external_ref", ob->external_ref, "code", o->code,
                                "message", o->message, "attempts", ob->attempts);
    bool ok = key != NULL && cmd != NULL && details != NULL;
    if (ok) {
        tally_alert_t a = {.dedup_key = key,
                           .severity = o->alert_severity,
                           .summary = summary,
                           .run_id = ob->run_id,
                           .effect_id = ob->effect_id,
                           .obligation_id = ob->obligation_id,
                           .reason = o->alert_reason,
                           .runbook = ob->tool != NULL ? ob->tool->runbook : NULL,
                           .resolve_command = cmd,
                           .details = details};
        tally_alert_batch_add(alerts, &a);
    }
    json_decref(details);
    free(key);
    free(cmd);
    return ok;
}

static bool is_terminal(const char *status)
{
    return strcmp(status, "RESOLVED") == 0 || strcmp(status, "SKIPPED") == 0 ||
           strcmp(status, "UNCOMPENSATABLE") == 0 || strcmp(status, "CANCELLED") == 0;
}

/* Add @p run_id to the runs to settle after this commit. */
static void want_settle(compensator_t *c, const char *run_id)
{
    size_t i;
    json_t *v;
    json_array_foreach(c->settle_runs, i, v)
    {
        if (strcmp(json_string_value(v), run_id) == 0) {
            return;
        }
    }
    json_array_append_new(c->settle_runs, json_string(run_id));
}

/* Everything the won outcomes imply, queued for the same transaction. */
static bool queue_consequences(compensator_t *c, const bool *won, tally_audit_batch_t *ab,
                               tally_outbox_batch_t *obx, tally_alert_batch_t *alerts,
                               json_t *stuck_runs)
{
    for (size_t i = 0; i < c->n_done; i++) {
        if (!won[i]) {
            continue;
        }
        const comp_outcome_t *o = &c->done[i];
        const comp_ob_t *ob = o->ob;
        if (o->call != NULL) {
            tally_audit_event_t call = {.run_id = ob->run_id,
                                        .effect_id = ob->effect_id,
                                        .obligation_id = ob->obligation_id,
                                        .kind = "connector_call",
                                        .actor = c->worker_id,
                                        .reason = o->code,
                                        .data = o->call};
            tally_audit_batch_add(ab, &call);
        }
        json_t *data = json_pack(
            "{s:s, s:s, s:i, s:O?}", "code", o->code, "action",
            tally_comp_action_name(ob->dec.action), "attempts", ob->attempts, "blast_radius",
            strcmp(o->to_status, "UNCOMPENSATABLE") == 0 ? ob->blast_radius : NULL);
        tally_audit_event_t ev = {.run_id = ob->run_id,
                                  .effect_id = ob->effect_id,
                                  .obligation_id = ob->obligation_id,
                                  .kind = "obligation",
                                  .from_status = "RUNNING",
                                  .to_status = o->to_status,
                                  .actor = c->worker_id,
                                  .reason = o->message,
                                  .data = data};
        tally_audit_batch_add(ab, &ev);
        json_decref(data);
        if (strcmp(o->to_status, "RESOLVED") == 0 && !publish_compensated(c, obx, o)) {
            return false;
        }
        if (o->alert_severity != NULL && !queue_alert(alerts, o, c->minimal_pages)) {
            return false;
        }
        if (strcmp(o->to_status, "STUCK") == 0) {
            char reason[300];
            snprintf(reason, sizeof reason, "obligation %s is STUCK (%s)", ob->obligation_id,
                     o->code);
            json_array_append_new(stuck_runs,
                                  json_pack("{s:s, s:s}", "run_id", ob->run_id, "reason", reason));
        }
    }
    return true;
}

static bool mark_runs_stuck(compensator_t *c, json_t *stuck_runs, tally_audit_batch_t *ab,
                            tally_error_t *err)
{
    if (json_array_size(stuck_runs) == 0) {
        return true;
    }
    char *text = json_dumps(stuck_runs, JSON_COMPACT);
    if (text == NULL) {
        tally_error_set(err, "oom", true, "out of memory listing STUCK runs");
        return false;
    }
    PGresult *res = exec1(c->pg, SQL_RUNS_STUCK, text, err);
    free(text);
    if (res == NULL) {
        return false;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        const char *run_id = PQgetvalue(res, row, 0);
        const char *reason = "an obligation is STUCK";
        size_t i;
        json_t *v;
        json_array_foreach(stuck_runs, i, v)
        {
            if (strcmp(json_string_value(json_object_get(v, "run_id")), run_id) == 0) {
                reason = json_string_value(json_object_get(v, "reason"));
                break;
            }
        }
        tally_audit_event_t ev = {.run_id = run_id,
                                  .kind = "transition",
                                  .from_status = PQgetvalue(res, row, 1),
                                  .to_status = "STUCK",
                                  .actor = c->worker_id,
                                  .reason = reason};
        tally_audit_batch_add(ab, &ev);
        TALLY_LOG(TALLY_LOG_ERROR, (&(tally_log_ctx_t){.run_id = run_id}),
                  "run is STUCK: %s; a human decides", reason);
    }
    PQclear(res);
    return true;
}

/* Write every outcome in c->done in one transaction; see comp_record. When it fails, @p err_out
 * says why and @p pages_out how many pages the transaction held. */
static int record_outcomes(compensator_t *c, tally_error_t *err_out, size_t *pages_out)
{
    if (c->n_done == 0) {
        return 0;
    }
    json_t *rows = json_array();
    json_t *stuck_runs = json_array();
    bool *won = calloc(c->n_done, sizeof *won);
    double *age = calloc(c->n_done, sizeof *age);
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_outbox_batch_t *obx = tally_outbox_batch_new();
    tally_alert_batch_t *alerts = tally_alert_batch_new();
    tally_error_t err;
    tally_error_clear(&err);
    PGresult *res = NULL;
    char *text = NULL;
    int written = -1;
    size_t n_won = 0, pages = 0, queued_pages = 0;
    if (rows == NULL || stuck_runs == NULL || won == NULL || age == NULL || ab == NULL ||
        obx == NULL || alerts == NULL) {
        tally_error_set(&err, "oom", true, "out of memory recording outcomes");
        goto out;
    }
    for (size_t i = 0; i < c->n_done; i++) {
        if (json_array_append_new(rows, outcome_row(&c->done[i])) != 0) {
            tally_error_set(&err, "oom", true, "out of memory recording outcomes");
            goto out;
        }
    }
    text = json_dumps(rows, JSON_COMPACT);
    if (text == NULL) {
        tally_error_set(&err, "oom", true, "out of memory recording outcomes");
        goto out;
    }
    if (!tally_pg_begin(c->pg, &err)) {
        goto out;
    }
    res = exec1(c->pg, SQL_RECORD, text, &err);
    if (res == NULL) {
        goto out;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        const char *oid = PQgetvalue(res, row, 0);
        for (size_t i = 0; i < c->n_done; i++) {
            if (!won[i] && strcmp(c->done[i].ob->obligation_id, oid) == 0) {
                won[i] = true;
                age[i] = atof(PQgetvalue(res, row, 1));
                n_won++;
                break;
            }
        }
    }
    if (!queue_consequences(c, won, ab, obx, alerts, stuck_runs)) {
        tally_error_set(&err, "oom", true, "out of memory building the events of outcomes");
        goto out;
    }
    queued_pages = tally_alert_batch_len(alerts);
    if (!mark_runs_stuck(c, stuck_runs, ab, &err) ||
        !tally_alert_batch_flush(alerts, c->pg, c->worker_id, c->source, obx, ab, &pages, &err) ||
        !tally_audit_batch_flush(ab, c->pg, &err) || !tally_outbox_batch_flush(obx, c->pg, &err) ||
        !tally_pg_commit(c->pg, &err)) {
        goto out;
    }
    written = (int)n_won;
    c->minimal_pages = false;
    if (pages > 0) {
        tally_metric_add(c->m_alerts, (double)pages, "kafka");
    }

    /* Committed: metrics, logs, the runs to settle; forget every outcome. */
    for (size_t i = 0; i < c->n_done; i++) {
        comp_outcome_t *o = &c->done[i];
        const comp_ob_t *ob = o->ob;
        tally_log_ctx_t ctx = {.run_id = ob->run_id,
                               .effect_id = ob->effect_id,
                               .obligation_id = ob->obligation_id,
                               .tool = ob->tool_name};
        if (!won[i]) {
            TALLY_LOG(TALLY_LOG_WARN, &ctx,
                      "lease lost (epoch %lld taken over): outcome %s not written; the new "
                      "holder repeats the call with the same key",
                      ob->epoch, o->to_status);
            tally_metric_add(c->m_lease_lost, 1);
            comp_outcome_clear(o);
            continue;
        }
        tally_metric_add(c->m_outcomes, 1, ob->tool_name, o->to_status);
        if (is_terminal(o->to_status)) {
            tally_metric_observe(c->m_drain, age[i]);
        }
        TALLY_LOG(strcmp(o->to_status, "STUCK") == 0 ? TALLY_LOG_ERROR : TALLY_LOG_INFO, &ctx,
                  "obligation %s -> %s (%s: %s)", ob->obligation_id, o->to_status, o->code,
                  o->message);
        if (strcmp(o->to_status, "PENDING") != 0) {
            want_settle(c, ob->run_id);
        }
        comp_outcome_clear(o);
    }
    c->n_done = 0;
    c->record_retry_at = 0;
out:
    if (written < 0) {
        tally_pg_rollback(c->pg);
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                            "recording %zu outcomes (kept, retried shortly): %s", c->n_done,
                            err.message);
        tally_metric_add(c->m_db_errors, 1, "record");
        c->record_retry_at = comp_now() + 0.5;
        *err_out = err;
        *pages_out = queued_pages;
    }
    PQclear(res);
    free(text);
    json_decref(rows);
    json_decref(stuck_runs);
    free(won);
    free(age);
    tally_audit_batch_free(ab);
    tally_outbox_batch_free(obx);
    tally_alert_batch_free(alerts);
    return written;
}

/* A failed record that held pages: a page that cannot be written must not leave its
 * obligation unpaged, so say so loudly and raise it minimal on the retry, at once (a minimal
 * page refused too is retried after the usual wait). */
static void pages_refused(compensator_t *c, size_t pages, const tally_error_t *err)
{
    if (pages == 0 || err->retriable) {
        return;
    }
    tally_metric_add(c->m_alert_fail, (double)pages, "compensator");
    TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                        "%zu pages refused by PostgreSQL (%s: %s); raising them as minimal pages",
                        pages, err->code, err->message);
    if (!c->minimal_pages) {
        c->record_retry_at = 0;
    }
    c->minimal_pages = true;
}

int comp_record(compensator_t *c)
{
    tally_error_t err;
    tally_error_clear(&err);
    size_t pages = 0;
    int written = record_outcomes(c, &err, &pages);
    if (written >= 0) {
        return written;
    }
    if (c->n_done < 2 || !tally_pg_error_is_data(&err)) {
        pages_refused(c, pages, &err);
        return written;
    }
    /* PostgreSQL refused the batch for its data: one outcome it can never take must not hold
     * the others, so each is written alone; the ones still refused are kept and retried. */
    TALLY_WARN("recording %zu outcomes was refused (%s: %s); writing them one by one", c->n_done,
               err.code, err.message);
    comp_outcome_t *all = c->done;
    size_t n = c->n_done, kept = 0;
    bool minimal = c->minimal_pages, refused_pages = false;
    written = 0;
    for (size_t i = 0; i < n; i++) {
        c->done = &all[i]; /* a view of one: record_outcomes clears it when it is written */
        c->n_done = 1;
        c->minimal_pages = minimal; /* only a page refused on its own is raised minimal */
        tally_error_clear(&err);
        pages = 0;
        int w = record_outcomes(c, &err, &pages);
        if (w >= 0) {
            written += w;
        } else {
            pages_refused(c, pages, &err);
            refused_pages = refused_pages || c->minimal_pages;
            TALLY_LOG(TALLY_LOG_ERROR,
                      (&(tally_log_ctx_t){.run_id = all[i].ob->run_id,
                                          .obligation_id = all[i].ob->obligation_id}),
                      "the outcome %s of this obligation is refused by PostgreSQL (%s: %s); "
                      "kept and retried, its lease keeps it safe",
                      all[i].to_status, err.code, err.message);
            if (kept != i) {
                all[kept] = all[i];
            }
            kept++;
        }
    }
    c->done = all;
    c->n_done = kept;
    c->minimal_pages = refused_pages;
    if (kept > 0) {
        c->record_retry_at = refused_pages && !minimal ? 0 : comp_now() + 0.5;
    }
    return written;
}
