/* store.c — every statement the compensator runs on obligations, beside the moves they make
 * (DESIGN §3): PENDING | expired RUNNING → RUNNING (the lease), RUNNING → PENDING | RESOLVED |
 * SKIPPED | UNCOMPENSATABLE | STUCK (an outcome), PENDING → AWAITING_APPROVAL (the hold), and
 * the counts of every state. Each outcome is a compare-and-set on (status, lease_epoch) written
 * with its audit events, pages and Kafka events in one transaction; a worker whose lease was
 * taken over writes nothing. Runs are settle.c's. */
#include "compensator.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>

#include "tally/alert.h"
#include "tally/audit.h"
#include "tally/cloudevent.h"
#include "tally/columns.h"
#include "tally/json.h"
#include "tally/log.h"
#include "tally/outbox.h"
#include "tally/text.h"

/* SQL assembled from fragments reads best one clause per line. */
// clang-format off

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
 * may run, so an obligation held behind a STUCK later step is dropped before anything is looked
 * up for it. Asking per candidate is several times slower: bench/README.md, "compensator lease".
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
    "    AND (o.reason IN ('duplicate', 'orphan') OR NOT EXISTS (SELECT 1 FROM effects e3"
    "      WHERE e3.run_id = o.run_id AND " COMP_SQL_STEP_KEY("e3") " > " COMP_SQL_STEP_KEY("f")
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
    "   o.approved_at IS NOT NULL, e.step, " TALLY_SQL_STEP_IS_NUMBER("e") ", e.tool, e.effect_class,"
    "   e.operation_key, e.args_canonical, e.traceparent, e.intent_id, e.attempts,"
    "   to_char(coalesce((SELECT max(ev.occurred_at) FROM events ev"
    "       WHERE ev.run_id = e.run_id AND ev.effect_id = e.effect_id"
    "         AND ev.to_status = 'CONFIRMED'), e.updated_at)"
    "     AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),"
    /* a sensitive tool's effect: its tenant key, sealed args and (when the obligation reverses
     * the effect's own record) its sealed receipt (seal.h) */
    "   e.seal_key::text,"
    "   (SELECT k.master_key_id FROM tenant_keys k WHERE k.key_id = e.seal_key),"
    "   (SELECT k.wrapped FROM tenant_keys k WHERE k.key_id = e.seal_key), e.args_sealed,"
    "   CASE WHEN o.receipt IS NULL OR o.external_ref IS NOT DISTINCT FROM e.external_ref"
    "     THEN e.receipt_sealed END";

/* Every outcome of a batch in one statement, each a compare-and-set on (status, lease_epoch).
 * Each row carries its place in the batch (ord), which RETURNING gives back for the rows won. */
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
    "   blast_radius jsonb, delay_ms bigint, refund boolean, ord bigint)"
    " WHERE o.obligation_id = r.obligation_id AND o.status = 'RUNNING'"
    "   AND o.lease_epoch = r.epoch"
    " RETURNING r.ord, extract(epoch FROM now() - o.created_at)::float8";

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

/* Obligations by state (tally_obligations), in two parts: the live states are few and read
 * through obligations_due_idx, which leads with the status; the terminal ones only grow, and
 * are counted less often (comp_policy_count_terminal). */
/* The live states with the age of each one's oldest row: a STUCK obligation is not written
 * again until someone settles it, so its updated_at is when it went STUCK. */
static const char SQL_COUNT_LIVE[] =
    "SELECT status, count(*), extract(epoch FROM now() - min(updated_at))::float8"
    " FROM obligations"
    " WHERE status IN ('PENDING', 'AWAITING_APPROVAL', 'RUNNING', 'STUCK') GROUP BY status";
static const char SQL_COUNT_TERMINAL[] =
    "SELECT status, count(*) FROM obligations"
    " WHERE status IN ('RESOLVED', 'SKIPPED', 'UNCOMPENSATABLE', 'CANCELLED') GROUP BY status";

/* The columns SQL_LEASE returns, in order. */
enum {
    L_OBLIGATION_ID = 0,
    L_RUN_ID,
    L_EFFECT_ID,
    L_REASON,
    L_EXTERNAL_REF,
    L_RECEIPT,
    L_FROM_STATUS,
    L_EPOCH,
    L_ATTEMPTS,
    L_APPROVED,
    L_STEP,
    L_STEP_IS_NUMBER,
    L_TOOL,
    L_EFFECT_CLASS,
    L_OPERATION_KEY,
    L_ARGS,
    L_TRACEPARENT,
    L_INTENT_ID,
    L_EFFECT_ATTEMPTS,
    L_CONFIRMED_AT,
    L_SEAL_KEY,
    L_MASTER_KEY_ID,
    L_WRAPPED,
    L_ARGS_SEALED,
    L_RECEIPT_SEALED,
};

/* ---------------------------------------------------------------------------------------- */
/* Leasing                                                                                  */

static char *dup_or_null(PGresult *res, int row, int col)
{
    return PQgetisnull(res, row, col) ? NULL : strdup(PQgetvalue(res, row, col));
}

/* A sensitive tool's obligation: the tenant key, the args and the effect's receipt opened for
 * the reverse call; when they do not open, sealed_err says why (the call is not made). */
static void open_sealed(const compensator_t *c, comp_ob_t *ob, PGresult *res, int row)
{
    const char *v[5];
    for (int i = 0; i < 5; i++)
        v[i] = PQgetisnull(res, row, L_SEAL_KEY + i) ? NULL : PQgetvalue(res, row, L_SEAL_KEY + i);
    tally_sealed_row_t sr = {.effect_id = ob->effect_id,
                             .key_id = v[0],
                             .master_id = v[1],
                             .wrapped = v[2],
                             .args_sealed = v[3]};
    size_t len = 0;
    if (!tally_sensitive_open(c->keys, ob->tool, &sr, &ob->red, &ob->args_plain, &len,
                              &ob->sealed_err))
        return;
    if (v[4] == NULL)
        return;
    char aad[64], *plain = NULL;
    snprintf(aad, sizeof aad, "%s/receipt", ob->effect_id);
    if (!tally_unseal(&ob->red->key, aad, v[4], &plain, &len, &ob->sealed_err))
        return;
    ob->receipt_plain = json_loadb(plain, len, 0, NULL);
    /* the receipt's values are kept out of the answers too */
    json_t *copy = ob->receipt_plain ? json_deep_copy(ob->receipt_plain) : NULL;
    if (copy == NULL || tally_redactor_apply(ob->red, copy, ob->tool->sensitive_receipt,
                                             ob->tool->n_sensitive_receipt) < 0)
        tally_error_setc(&ob->sealed_err, TALLY_ERR_SEALED,
                         "the sealed receipt of effect %s does not read", ob->effect_id);
    json_decref(copy);
    OPENSSL_cleanse(plain, len);
    free(plain);
}

/* The state a leased row came from, parsed here once: PENDING, or RUNNING for an expired lease
 * taken over. */
static tally_obligation_state_t lease_from(PGresult *res, int row)
{
    tally_obligation_state_t from;
    if (!tally_obligation_state_parse(PQgetvalue(res, row, L_FROM_STATUS), &from)) {
        from = TALLY_OBLIGATION_PENDING;
    }
    return from;
}

static comp_ob_t *ob_from_row(compensator_t *c, PGresult *res, int row)
{
    comp_ob_t *ob = calloc(1, sizeof *ob);
    if (ob == NULL) {
        return NULL;
    }
    snprintf(ob->obligation_id, sizeof ob->obligation_id, "%s",
             PQgetvalue(res, row, L_OBLIGATION_ID));
    ob->run_id = strdup(PQgetvalue(res, row, L_RUN_ID));
    snprintf(ob->effect_id, sizeof ob->effect_id, "%s", PQgetvalue(res, row, L_EFFECT_ID));
    ob->reason = strdup(PQgetvalue(res, row, L_REASON));
    ob->external_ref = dup_or_null(res, row, L_EXTERNAL_REF);
    if (!PQgetisnull(res, row, L_RECEIPT)) {
        ob->receipt = json_loads(PQgetvalue(res, row, L_RECEIPT), 0, NULL);
    }
    ob->from = lease_from(res, row);
    ob->epoch = atoll(PQgetvalue(res, row, L_EPOCH));
    ob->attempts = atoi(PQgetvalue(res, row, L_ATTEMPTS));
    ob->approved = PQgetvalue(res, row, L_APPROVED)[0] == 't';
    ob->step = strdup(PQgetvalue(res, row, L_STEP));
    ob->step_is_number = PQgetvalue(res, row, L_STEP_IS_NUMBER)[0] == 't';
    ob->tool_name = strdup(PQgetvalue(res, row, L_TOOL));
    ob->cls_known = tally_effect_class_parse(PQgetvalue(res, row, L_EFFECT_CLASS), &ob->cls);
    ob->operation_key = strdup(PQgetvalue(res, row, L_OPERATION_KEY));
    ob->args_canonical = strdup(PQgetvalue(res, row, L_ARGS));
    ob->traceparent = dup_or_null(res, row, L_TRACEPARENT);
    ob->intent_id = dup_or_null(res, row, L_INTENT_ID);
    ob->effect_attempts = atoi(PQgetvalue(res, row, L_EFFECT_ATTEMPTS));
    ob->confirmed_at = dup_or_null(res, row, L_CONFIRMED_AT);
    ob->tool = tally_registry_find(c->reg, ob->tool_name);
    if (ob->tool != NULL && tally_tool_sensitive(ob->tool))
        open_sealed(c, ob, res, row);
    if (ob->run_id == NULL || ob->reason == NULL || ob->step == NULL || ob->tool_name == NULL ||
        ob->operation_key == NULL || ob->args_canonical == NULL) {
        comp_ob_free(ob);
        return NULL;
    }
    return ob;
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

int comp_store_lease(compensator_t *c, int limit, comp_ob_t ***out)
{
    *out = NULL;
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
        tally_obligation_state_t from = lease_from(res, row);
        json_t *data =
            json_pack("{s:I, s:i, s:s}", "lease_epoch",
                      (json_int_t)atoll(PQgetvalue(res, row, L_EPOCH)), "attempts",
                      atoi(PQgetvalue(res, row, L_ATTEMPTS)), "tool", PQgetvalue(res, row, L_TOOL));
        tally_audit_event_t ev = {
            .run_id = PQgetvalue(res, row, L_RUN_ID),
            .effect_id = PQgetvalue(res, row, L_EFFECT_ID),
            .obligation_id = PQgetvalue(res, row, L_OBLIGATION_ID),
            .kind = "lease",
            .actor = c->worker_id,
            .reason = from == TALLY_OBLIGATION_RUNNING ? "expired lease taken over" : "leased",
            .data = data};
        (void)tally_audit_move(ab, TALLY_MACHINE_OBLIGATION, (int)from, TALLY_OBLIGATION_RUNNING,
                               &ev);
        json_decref(data);
    }
    if (!tally_audit_batch_flush(ab, c->pg, &err) || !tally_pg_commit(c->pg, &err)) {
        goto out;
    }
    n = PQntuples(res);
    comp_ob_t **obs = calloc(n > 0 ? (size_t)n : 1, sizeof *obs);
    if (obs == NULL) {
        TALLY_ERROR("out of memory reading %d leased obligations; their leases will expire", n);
        n = 0;
        goto out;
    }
    for (int row = 0; row < n; row++) {
        obs[row] = ob_from_row(c, res, row);
        if (obs[row] == NULL) {
            TALLY_ERROR("out of memory reading leased obligation %s; its lease will expire",
                        PQgetvalue(res, row, L_OBLIGATION_ID));
        }
    }
    *out = obs;
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

int comp_store_hold_for_approval(compensator_t *c)
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
    const char *params[1] = {c->approval_tools};
    res = tally_pg_exec(c->pg, SQL_HOLD, 1, params, &err);
    if (res == NULL) {
        goto out;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        tally_audit_event_t ev = {.run_id = PQgetvalue(res, row, 1),
                                  .effect_id = PQgetvalue(res, row, 2),
                                  .obligation_id = PQgetvalue(res, row, 0),
                                  .kind = "obligation",
                                  .actor = c->worker_id,
                                  .reason = "approval_required"};
        (void)tally_audit_move(ab, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_PENDING,
                               TALLY_OBLIGATION_AWAITING_APPROVAL, &ev);
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

bool comp_store_count(compensator_t *c, bool terminal, double counts[TALLY_OBLIGATION__COUNT],
                      double *stuck_oldest_s)
{
    tally_error_t err;
    tally_error_clear(&err);
    PGresult *res =
        tally_pg_exec(c->pg, terminal ? SQL_COUNT_TERMINAL : SQL_COUNT_LIVE, 0, NULL, &err);
    if (res == NULL) {
        TALLY_LOG_REPEATING(TALLY_LOG_WARN, NULL, "reading obligation counts: %s", err.message);
        return false;
    }
    for (int s = 0; s < TALLY_OBLIGATION__COUNT; s++) {
        if (tally_obligation_state_terminal((tally_obligation_state_t)s) == terminal) {
            counts[s] = 0;
        }
    }
    if (!terminal) {
        *stuck_oldest_s = 0;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        tally_obligation_state_t s;
        if (tally_obligation_state_parse(PQgetvalue(res, row, 0), &s)) {
            counts[s] = atof(PQgetvalue(res, row, 1));
            if (s == TALLY_OBLIGATION_STUCK) {
                *stuck_oldest_s = atof(PQgetvalue(res, row, 2));
            }
        }
    }
    PQclear(res);
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Recording                                                                                */

static json_t *step_json(const comp_ob_t *ob)
{
    return tally_step_json(ob->step, ob->step_is_number);
}

static json_t *outcome_row(const comp_outcome_t *o, size_t ord)
{
    const comp_ob_t *ob = o->ob;
    char reason[600];
    snprintf(reason, sizeof reason, "%s: %s", o->code, o->message);
    bool uncomp = o->to == TALLY_OBLIGATION_UNCOMPENSATABLE;
    return json_pack("{s:s, s:I, s:s, s:s, s:s?, s:s?, s:O?, s:O?, s:I, s:b, s:I}", "obligation_id",
                     ob->obligation_id, "epoch", (json_int_t)ob->epoch, "to_status",
                     tally_obligation_state_name(o->to), "status_reason", reason, "error_code",
                     o->is_error ? o->code : NULL, "error_message", o->is_error ? o->message : NULL,
                     "reverse_receipt", o->reverse_receipt, "blast_radius",
                     uncomp ? ob->blast_radius : NULL, "delay_ms", (json_int_t)o->delay_ms,
                     "refund", o->refund_attempt, "ord", (json_int_t)ord);
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

/* An obligation's page: critical, keyed and commanded by its obligation. */
static tally_alert_t obligation_page(const comp_ob_t *ob, const char *key, const char *summary,
                                     const char *reason, const char *cmd)
{
    return (tally_alert_t){.dedup_key = key,
                           .severity = "critical",
                           .summary = summary,
                           .run_id = ob->run_id,
                           .effect_id = ob->effect_id,
                           .obligation_id = ob->obligation_id,
                           .reason = reason,
                           .resolve_command = cmd};
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
             ob->obligation_id, tally_obligation_state_name(o->to));
    bool ok = key != NULL && cmd != NULL;
    if (ok) {
        tally_alert_t a = obligation_page(ob, key, summary, "page_refused", cmd);
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
    bool final = o->to == TALLY_OBLIGATION_UNCOMPENSATABLE;
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
        tally_alert_t a = obligation_page(ob, key, summary, o->page, cmd);
        a.runbook = ob->tool != NULL ? ob->tool->runbook : NULL;
        a.details = details;
        tally_alert_batch_add(alerts, &a);
    }
    json_decref(details);
    free(key);
    free(cmd);
    return ok;
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
            o->to == TALLY_OBLIGATION_UNCOMPENSATABLE ? ob->blast_radius : NULL);
        tally_audit_event_t ev = {.run_id = ob->run_id,
                                  .effect_id = ob->effect_id,
                                  .obligation_id = ob->obligation_id,
                                  .kind = "obligation",
                                  .actor = c->worker_id,
                                  .reason = o->message,
                                  .data = data};
        (void)tally_audit_move(ab, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_RUNNING, (int)o->to,
                               &ev);
        json_decref(data);
        if (o->to == TALLY_OBLIGATION_RESOLVED && !publish_compensated(c, obx, o)) {
            return false;
        }
        if (o->page[0] != '\0' && !queue_alert(alerts, o, c->minimal_pages)) {
            return false;
        }
        if (o->to == TALLY_OBLIGATION_STUCK) {
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
    PGresult *res = tally_pg_exec_json(c->pg, SQL_RUNS_STUCK, stuck_runs, err);
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
        tally_audit_event_t ev = {.run_id = run_id, .actor = c->worker_id, .reason = reason};
        tally_run_state_t was = TALLY_RUN__COUNT;
        (void)tally_run_state_parse(PQgetvalue(res, row, 1), &was);
        (void)tally_audit_move(ab, TALLY_MACHINE_RUN, (int)was, TALLY_RUN_STUCK, &ev);
        TALLY_LOG(TALLY_LOG_ERROR, (&(tally_log_ctx_t){.run_id = run_id}),
                  "run is STUCK: %s; a human decides", reason);
    }
    PQclear(res);
    return true;
}

/* Write every outcome in c->done in one transaction; see comp_store_record. When it fails, @p
 * err_out says why and @p pages_out how many pages the transaction held. */
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
    size_t *pos = NULL;
    int written = -1;
    size_t n_won = 0, pages = 0, queued_pages = 0;
    if (rows == NULL || stuck_runs == NULL || won == NULL || age == NULL || ab == NULL ||
        obx == NULL || alerts == NULL) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory recording outcomes");
        goto out;
    }
    for (size_t i = 0; i < c->n_done; i++) {
        if (json_array_append_new(rows, outcome_row(&c->done[i], i)) != 0) {
            tally_error_setc(&err, TALLY_ERR_OOM, "out of memory recording outcomes");
            goto out;
        }
    }
    if (!tally_pg_begin(c->pg, &err)) {
        goto out;
    }
    res = tally_pg_exec_json(c->pg, SQL_RECORD, rows, &err);
    if (res == NULL) {
        goto out;
    }
    pos = tally_columns_positions(res, 0, NULL, c->n_done);
    if (pos == NULL) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory recording outcomes");
        goto out;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        size_t i = pos[row];
        if (i != SIZE_MAX && !won[i]) {
            won[i] = true;
            age[i] = atof(PQgetvalue(res, row, 1));
            n_won++;
        }
    }
    if (!queue_consequences(c, won, ab, obx, alerts, stuck_runs)) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory building the events of outcomes");
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
                      ob->epoch, tally_obligation_state_name(o->to));
            tally_metric_add(c->m_lease_lost, 1);
            comp_outcome_clear(o);
            continue;
        }
        tally_metric_add(c->m_outcomes, 1, ob->tool_name, tally_obligation_state_name(o->to));
        if (tally_obligation_state_terminal(o->to)) {
            tally_metric_observe(c->m_drain, age[i]);
        }
        TALLY_LOG(o->to == TALLY_OBLIGATION_STUCK ? TALLY_LOG_ERROR : TALLY_LOG_INFO, &ctx,
                  "obligation %s -> %s (%s: %s)", ob->obligation_id,
                  tally_obligation_state_name(o->to), o->code, o->message);
        if (o->to != TALLY_OBLIGATION_PENDING) {
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
    free(pos);
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

int comp_store_record(compensator_t *c)
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
                      tally_obligation_state_name(all[i].to), err.code, err.message);
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
