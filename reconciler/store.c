/* store.c — every statement the reconciler runs, beside the transitions they make (DESIGN §3):
 * DISPATCHING → UNKNOWN when a dispatch lease expired, and UNKNOWN → CONFIRMED | PLANNED |
 * STUCK | CANCELLED (or UNKNOWN again, rescheduled) from a status check.
 *
 * Each statement handles a whole batch (json_to_recordset), never one row at a time, and each
 * state change is a compare-and-set on status and lease_epoch whose audit events, outcome
 * messages, obligations and alerts are written in the same transaction — for the rows the
 * compare-and-set matched, and only for those. */
#include "reconciler.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/cloudevent.h"
#include "tally/columns.h"
#include "tally/id.h"
#include "tally/json.h"
#include "tally/ledger.h"
#include "tally/log.h"
#include "tally/runops.h"
#include "tally/text.h"

/* The effect columns every event is built from; RETURNING lists them first, in this order. */
#define EFFECT_COLS                                                                                \
    "e.effect_id::text, e.run_id, e.step, " TALLY_SQL_STEP_IS_NUMBER(                              \
        "e") ", e.tool, e.operation_key,"                                                          \
             " e.status, e.receipt::text, e.external_ref, e.error_code, e.error_message, "         \
             "e.attempts,"                                                                         \
             " e.intent_id"

enum {
    C_EFFECT_ID = 0,
    C_RUN_ID,
    C_STEP,
    C_STEP_IS_NUM,
    C_TOOL,
    C_OPERATION_KEY,
    C_STATUS,
    C_RECEIPT,
    C_EXTERNAL_REF,
    C_ERROR_CODE,
    C_ERROR_MESSAGE,
    C_ATTEMPTS,
    C_INTENT_ID,
    C__EFFECT, /* the first statement-specific column */
};

#define LEASE_EXPIRED_WHY "dispatch lease expired (the dispatcher died or stalled mid-call)"

/* What an on-call engineer does about a STUCK effect, whatever the tool (the tool's own
 * runbook is about compensating it, and travels in the alert's details). */
#define RUNBOOK_STUCK_EFFECT                                                                       \
    "docs/operations.md#effects-no_status_check-attempts_exhausted-status_inconclusive"

/* Rows whose dispatch lease ran out, oldest first; rows another transaction holds (the
 * dispatcher recording that very call) are skipped and seen by the next sweep. The CTE reads
 * the lease as it was, for the audit trail. */
static const char SQL_EXPIRE[] =
    "WITH expired AS ("
    "  SELECT effect_id, lease_owner, lease_until, lease_epoch FROM effects"
    "  WHERE status = 'DISPATCHING' AND lease_until < now()"
    "  ORDER BY lease_until LIMIT $1 FOR UPDATE SKIP LOCKED)"
    " UPDATE effects e SET status = 'UNKNOWN', status_reason = 'lease_expired',"
    " error_code = 'lease_expired', error_message = $2,"
    " unknown_since = now(), next_attempt_at = now(), inconclusive_checks = 0,"
    " lease_owner = NULL, lease_until = NULL, lease_epoch = e.lease_epoch + 1, updated_at = now()"
    " FROM expired x"
    " WHERE e.effect_id = x.effect_id AND e.status = 'DISPATCHING'"
    " RETURNING " EFFECT_COLS ", x.lease_owner, x.lease_until::text, x.lease_epoch";

/* The claim: due UNKNOWN effects of tools this worker can check, leased by the database
 * clock. unknown_since is filled in when a writer left it empty, so the settle window always
 * has a start. */
static const char SQL_CLAIM[] =
    "WITH tools AS ("
    "  SELECT * FROM json_to_recordset($1::json) AS t(tool text, lease_ms bigint, settle_ms "
    "bigint)),"
    " due AS ("
    "  SELECT e.effect_id FROM effects e"
    "  WHERE e.status = 'UNKNOWN' AND e.next_attempt_at <= now()"
    "  AND (e.lease_until IS NULL OR e.lease_until < now())"
    "  AND e.tool IN (SELECT tool FROM tools)"
    "  ORDER BY e.next_attempt_at LIMIT $3 FOR UPDATE OF e SKIP LOCKED)"
    " UPDATE effects e SET lease_owner = $2,"
    " lease_until = now() + t.lease_ms * interval '1 millisecond',"
    " lease_epoch = e.lease_epoch + 1, unknown_since = coalesce(e.unknown_since, now()),"
    " updated_at = now()"
    " FROM due, tools t"
    " WHERE e.effect_id = due.effect_id AND t.tool = e.tool AND e.status = 'UNKNOWN'"
    " RETURNING e.effect_id::text, e.lease_epoch, e.run_id, e.tool, e.operation_key,"
    " e.traceparent, e.attempts, e.inconclusive_checks,"
    " now() >= e.unknown_since + t.settle_ms * interval '1 millisecond',"
    " (extract(epoch FROM now() - e.unknown_since) * 1000)::bigint,"
    /* a sensitive tool's effect: its tenant key and sealed args (seal.h) */
    " e.seal_key::text,"
    " (SELECT k.master_key_id FROM tenant_keys k WHERE k.key_id = e.seal_key),"
    " (SELECT k.wrapped FROM tenant_keys k WHERE k.key_id = e.seal_key), e.args_sealed";

/* The verdicts: one compare-and-set for the batch. A reschedule (to_status UNKNOWN) waits for
 * the later of the backoff and the end of the settle window. The lease is released and the
 * epoch moves on, so a replay of this very batch matches nothing. */
static const char SQL_RECORD[] =
    "UPDATE effects e SET status = r.to_status,"
    " status_reason = coalesce(r.reason, e.status_reason),"
    " receipt = CASE WHEN r.to_status = 'CONFIRMED' THEN r.receipt ELSE e.receipt END,"
    " receipt_sealed = CASE WHEN r.to_status = 'CONFIRMED' THEN r.receipt_sealed::bytea"
    "   ELSE e.receipt_sealed END,"
    " external_ref = CASE WHEN r.to_status = 'CONFIRMED' THEN r.external_ref"
    "   ELSE e.external_ref END,"
    " error_code = CASE WHEN r.set_error THEN r.error_code ELSE e.error_code END,"
    " error_message = CASE WHEN r.set_error THEN r.error_message ELSE e.error_message END,"
    " next_attempt_at = CASE r.to_status"
    "   WHEN 'UNKNOWN' THEN greatest(now() + r.delay_ms * interval '1 millisecond',"
    "                                e.unknown_since + r.settle_ms * interval '1 millisecond')"
    "   WHEN 'PLANNED' THEN now() ELSE e.next_attempt_at END,"
    " unknown_since = CASE WHEN r.to_status = 'PLANNED' THEN NULL ELSE e.unknown_since END,"
    " inconclusive_checks = CASE WHEN r.inconclusive THEN e.inconclusive_checks + 1"
    "   WHEN r.to_status IN ('UNKNOWN', 'STUCK') THEN e.inconclusive_checks ELSE 0 END,"
    " status_checks = e.status_checks + CASE WHEN r.checked THEN 1 ELSE 0 END,"
    " last_status_check_at = CASE WHEN r.checked THEN now() ELSE e.last_status_check_at END,"
    " lease_owner = NULL, lease_until = NULL, lease_epoch = e.lease_epoch + 1, updated_at = now()"
    " FROM json_to_recordset($1::json) AS r(effect_id uuid, epoch bigint, to_status text,"
    " reason text, receipt jsonb, external_ref text, set_error boolean, error_code text,"
    " error_message text, delay_ms bigint, settle_ms bigint, inconclusive boolean,"
    " checked boolean, receipt_sealed text)"
    " WHERE e.effect_id = r.effect_id AND e.status = 'UNKNOWN' AND e.lease_epoch = r.epoch"
    " RETURNING " EFFECT_COLS ", e.inconclusive_checks,"
    " to_char(e.next_attempt_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),"
    " greatest(0, ceil(extract(epoch FROM e.next_attempt_at - now()) * 1000))::bigint";

/* The effects (of $1, a JSON array of ids) whose run is no longer ACTIVE; see cancel_if_stopped. */
static const char SQL_STOPPED_RUNS[] =
    "SELECT e.effect_id::text FROM effects e JOIN runs r USING (run_id)"
    " WHERE e.effect_id IN (SELECT json_array_elements_text($1::json)::uuid)"
    "   AND NOT " TALLY_SQL_RUN_GOES_ON("r.status") " ORDER BY r.run_id FOR SHARE OF r";

#define RUN_STOPPED                                                                                \
    "the run is no longer ACTIVE and the status check found no upstream record after the "         \
    "settle window: the retry is not sent"

/* Re-dispatch with the same key: a dispatch outbox row due now (the effect is PLANNED again;
 * the dispatcher counts the attempt when it claims it). */
static const char SQL_REDISPATCH[] =
    "INSERT INTO outbox (effect_id, tool, due_at)"
    " SELECT e.effect_id, e.tool, now() FROM effects e"
    " WHERE e.effect_id IN (SELECT json_array_elements_text($1::json)::uuid)"
    " ON CONFLICT (effect_id) DO UPDATE SET due_at = EXCLUDED.due_at";

/* One obligation per extra upstream record; UNIQUE (effect_id, external_ref) makes a second
 * detection of the same extra a no-op, and RETURNING names only the new ones. */
static const char SQL_OBLIGATIONS[] =
    "INSERT INTO obligations (obligation_id, run_id, effect_id, reason, external_ref, receipt)"
    " SELECT r.obligation_id, e.run_id, e.effect_id, 'duplicate', r.external_ref, r.receipt"
    " FROM json_to_recordset($1::json) AS r(n int, obligation_id uuid, effect_id uuid,"
    " external_ref text, receipt jsonb)"
    " JOIN effects e ON e.effect_id = r.effect_id"
    " ORDER BY r.n"
    " ON CONFLICT DO NOTHING"
    " RETURNING obligation_id::text, run_id, effect_id::text, external_ref";

static const char SQL_RELEASE[] =
    "UPDATE effects e SET lease_owner = NULL, lease_until = NULL,"
    " lease_epoch = e.lease_epoch + 1, updated_at = now()"
    " FROM json_to_recordset($1::json) AS r(effect_id uuid, epoch bigint)"
    " WHERE e.effect_id = r.effect_id AND e.status = 'UNKNOWN' AND e.lease_epoch = r.epoch";

static const char SQL_GAUGES[] =
    "SELECT count(*) FILTER (WHERE status = 'UNKNOWN'),"
    " coalesce(extract(epoch FROM now() - min(unknown_since) FILTER (WHERE status = 'UNKNOWN')),"
    " 0)::float8,"
    " count(*) FILTER (WHERE status = 'STUCK'),"
    /* a STUCK effect is not written again until someone settles it: updated_at is when it
     * went STUCK */
    " coalesce(extract(epoch FROM now() - min(updated_at) FILTER (WHERE status = 'STUCK')),"
    " 0)::float8"
    " FROM effects WHERE status IN ('UNKNOWN', 'STUCK')";

void tally_recon_item_free(tally_recon_item_t *it)
{
    if (it == NULL) {
        return;
    }
    free(it->run_id);
    free(it->operation_key);
    free(it->traceparent);
    json_decref(it->records);
    tally_redactor_free(it->red);
    free(it->receipt_sealed);
    free(it->external_ref);
    free(it->next_cursor);
    free(it);
}

/* ---- building events ------------------------------------------------------------------- */

static const char *col(const PGresult *res, int row, int c)
{
    return PQgetisnull(res, row, c) ? NULL : PQgetvalue(res, row, c);
}

/* The step as the agent sent it (cloudevent.h). */
static json_t *step_value(const PGresult *res, int row)
{
    return tally_step_json(col(res, row, C_STEP), PQgetvalue(res, row, C_STEP_IS_NUM)[0] == 't');
}

static json_t *text_or_null(const char *s)
{
    json_t *v = s ? json_string(s) : json_null();
    return v ? v : json_null();
}

/* DESIGN §5 effect event data from a RETURNING row. @returns a new reference or NULL. */
static json_t *effect_data(const PGresult *res, int row)
{
    const char *receipt_text = col(res, row, C_RECEIPT);
    json_t *receipt = receipt_text ? json_loads(receipt_text, 0, NULL) : NULL;
    const char *code = col(res, row, C_ERROR_CODE);
    json_t *error = NULL;
    if (code != NULL) {
        const char *msg = col(res, row, C_ERROR_MESSAGE);
        error = json_pack("{s:s, s:s}", "code", code, "message", msg ? msg : "");
    }
    return json_pack(
        "{s:s, s:s, s:o, s:s, s:s, s:s, s:o, s:o, s:o, s:i, s:s}", "effect_id",
        col(res, row, C_EFFECT_ID), "run_id", col(res, row, C_RUN_ID), "step", step_value(res, row),
        "tool", col(res, row, C_TOOL), "operation_key", col(res, row, C_OPERATION_KEY), "status",
        col(res, row, C_STATUS), "receipt", receipt ? receipt : json_null(), "external_ref",
        text_or_null(col(res, row, C_EXTERNAL_REF)), "error", error ? error : json_null(),
        "attempts", atoi(PQgetvalue(res, row, C_ATTEMPTS)), "intent_id",
        col(res, row, C_INTENT_ID));
}

/* Queue a CloudEvent of @p type with @p data (stolen) on @p topic, keyed by the run. */
bool tally_recon_queue_message(tally_recon_db_t *db, const char *topic, const char *type,
                               const char *run_id, json_t *data, tally_error_t *err)
{
    json_t *ev = data ? tally_ce_new(type, db->source, run_id, data, NULL) : NULL;
    if (ev == NULL) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "could not build a %s event", type);
        return false;
    }
    tally_outbox_batch_add(db->outbox, topic, run_id, ev);
    json_decref(ev);
    return true;
}

/* The outcome event for an effect row, with @p extra merged in (stolen; may be NULL). */
static bool queue_outcome(tally_recon_db_t *db, const PGresult *res, int row, const char *type,
                          json_t *extra, tally_error_t *err)
{
    json_t *data = effect_data(res, row);
    if (data != NULL && extra != NULL && json_object_update(data, extra) != 0) {
        json_decref(data);
        data = NULL;
    }
    json_decref(extra);
    return tally_recon_queue_message(db, "outcomes", type, col(res, row, C_RUN_ID), data, err);
}

static void audit(tally_recon_db_t *db, const PGresult *res, int row, const char *kind,
                  const char *reason, json_t *data)
{
    tally_audit_event_t ev = {
        .run_id = col(res, row, C_RUN_ID),
        .effect_id = col(res, row, C_EFFECT_ID),
        .kind = kind,
        .actor = db->actor,
        .reason = reason,
        .data = data,
    };
    tally_audit_batch_add(db->audit, &ev);
    json_decref(data);
}

/* The move the effect row @p row made, @p from -> @p to, as its event (audit.h); @p data is
 * stolen, as audit()'s. */
static void audit_move(tally_recon_db_t *db, const PGresult *res, int row,
                       tally_effect_state_t from, tally_effect_state_t to, const char *reason,
                       json_t *data)
{
    tally_audit_event_t ev = {
        .run_id = col(res, row, C_RUN_ID),
        .effect_id = col(res, row, C_EFFECT_ID),
        .actor = db->actor,
        .reason = reason,
        .data = data,
    };
    (void)tally_audit_move(db->audit, TALLY_MACHINE_EFFECT, (int)from, (int)to, &ev);
    json_decref(data);
}

/* ---- transactions ---------------------------------------------------------------------- */

/* Fresh batches for one transaction, so a failed one leaves nothing queued for the next. */
bool tally_recon_tx_begin(tally_recon_db_t *tx, tally_error_t *err)
{
    tx->audit = tally_audit_batch_new();
    tx->outbox = tally_outbox_batch_new();
    tx->alerts = tally_alert_batch_new();
    if (tx->audit == NULL || tx->outbox == NULL || tx->alerts == NULL) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "out of memory starting a transaction");
        return false;
    }
    return tally_pg_begin(tx->pg, err);
}

/* Raise the alerts, write the audit events and the messages, COMMIT; or roll back. */
bool tally_recon_tx_end(tally_recon_db_t *tx, bool ok, tally_error_t *err)
{
    ok = ok &&
         tally_alert_batch_flush(tx->alerts, tx->pg, tx->actor, tx->source, tx->outbox, tx->audit,
                                 NULL, err) &&
         tally_audit_batch_flush(tx->audit, tx->pg, err) &&
         tally_outbox_batch_flush(tx->outbox, tx->pg, err) && tally_pg_commit(tx->pg, err);
    if (!ok) {
        tally_pg_rollback(tx->pg);
    }
    tally_audit_batch_free(tx->audit);
    tally_outbox_batch_free(tx->outbox);
    tally_alert_batch_free(tx->alerts);
    tx->audit = NULL;
    tx->outbox = NULL;
    tx->alerts = NULL;
    return ok;
}

/* ---- lease expiry ---------------------------------------------------------------------- */

int tally_recon_expire_leases(tally_recon_db_t *db, int limit, tally_error_t *err)
{
    char limit_text[24];
    snprintf(limit_text, sizeof limit_text, "%d", limit);
    const char *params[2] = {limit_text, LEASE_EXPIRED_WHY};
    tally_recon_db_t tx = *db;
    if (!tally_recon_tx_begin(&tx, err)) {
        tally_recon_tx_end(&tx, false, err);
        return -1;
    }
    PGresult *res = tally_pg_exec(tx.pg, SQL_EXPIRE, 2, params, err);
    int n = res != NULL ? PQntuples(res) : -1;
    bool ok = res != NULL;
    for (int i = 0; ok && i < n; i++) {
        json_t *lease = json_pack("{s:s?, s:s?, s:I}", "lease_owner", col(res, i, C__EFFECT),
                                  "lease_until", col(res, i, C__EFFECT + 1), "lease_epoch",
                                  (json_int_t)strtoll(PQgetvalue(res, i, C__EFFECT + 2), NULL, 10));
        audit_move(&tx, res, i, TALLY_EFFECT_DISPATCHING, TALLY_EFFECT_UNKNOWN, LEASE_EXPIRED_WHY,
                   lease ? json_deep_copy(lease) : NULL);
        ok = queue_outcome(&tx, res, i, "tally.effect.unknown.v1", lease, err);
    }
    ok = tally_recon_tx_end(&tx, ok, err);
    for (int i = 0; ok && i < n; i++) {
        tally_log_ctx_t ctx = {.run_id = col(res, i, C_RUN_ID),
                               .effect_id = col(res, i, C_EFFECT_ID),
                               .tool = col(res, i, C_TOOL)};
        TALLY_LOG(TALLY_LOG_WARN, &ctx, "%s: the lease of %s ended at %s; the effect is UNKNOWN",
                  LEASE_EXPIRED_WHY, col(res, i, C__EFFECT) ? col(res, i, C__EFFECT) : "?",
                  col(res, i, C__EFFECT + 1) ? col(res, i, C__EFFECT + 1) : "?");
    }
    PQclear(res);
    return ok ? n : -1;
}

int tally_recon_complete_runs(tally_recon_db_t *db, int limit, int idle_ms, tally_error_t *err)
{
    tally_recon_db_t tx = *db;
    if (!tally_recon_tx_begin(&tx, err)) {
        tally_recon_tx_end(&tx, false, err);
        return -1;
    }
    size_t done = 0;
    bool ok = tally_runops_complete(tx.pg, NULL, 0, limit, idle_ms, tx.actor, tx.source, tx.outbox,
                                    tx.audit, &done, err);
    ok = tally_recon_tx_end(&tx, ok, err);
    return ok ? (int)done : -1;
}

/* ---- the claim ------------------------------------------------------------------------- */

static char *dup_or_null(const char *s)
{
    return s ? strdup(s) : NULL;
}

/* The item of claimed row @p i: the effect id, the lease epoch, the run, the tool, the key and
 * the traceparent in columns 0-5, and from column @p seal_col a sensitive tool's tenant key and
 * sealed args (seal.h). NULL when it cannot be used (out of memory, a tool not in the registry):
 * its lease runs out. */
static tally_recon_item_t *claimed_item(tally_recon_db_t *db, const PGresult *res, int i,
                                        int seal_col)
{
    tally_recon_item_t *it = calloc(1, sizeof *it);
    if (it == NULL) {
        return NULL;
    }
    snprintf(it->effect_id, sizeof it->effect_id, "%s", PQgetvalue(res, i, 0));
    it->epoch = strtoll(PQgetvalue(res, i, 1), NULL, 10);
    it->run_id = dup_or_null(col(res, i, 2));
    it->tool = tally_registry_find(db->reg, PQgetvalue(res, i, 3));
    it->operation_key = dup_or_null(col(res, i, 4));
    it->traceparent = dup_or_null(col(res, i, 5));
    if (it->tool == NULL || it->run_id == NULL || it->operation_key == NULL ||
        (col(res, i, 5) != NULL && it->traceparent == NULL)) {
        tally_recon_item_free(it);
        return NULL;
    }
    if (tally_tool_sensitive(it->tool)) {
        tally_sealed_row_t sr = {.effect_id = it->effect_id,
                                 .key_id = col(res, i, seal_col),
                                 .master_id = col(res, i, seal_col + 1),
                                 .wrapped = col(res, i, seal_col + 2),
                                 .args_sealed = col(res, i, seal_col + 3)};
        if (!tally_sensitive_open(db->keys, it->tool, &sr, &it->red, NULL, NULL, &it->sealed_err) &&
            it->sealed_err.errc == TALLY_ERR_NONE)
            tally_error_setc(&it->sealed_err, TALLY_ERR_OOM, "out of memory");
    }
    return it;
}

int tally_recon_claim(tally_recon_db_t *db, const char *tools_json, int limit,
                      tally_recon_item_t **out, tally_error_t *err)
{
    char limit_text[24];
    snprintf(limit_text, sizeof limit_text, "%d", limit);
    const char *params[3] = {tools_json, db->actor, limit_text};
    PGresult *res = tally_pg_exec(db->pg, SQL_CLAIM, 3, params, err);
    if (res == NULL) {
        return -1;
    }
    int n = 0;
    for (int i = 0; i < PQntuples(res) && n < limit; i++) {
        tally_recon_item_t *it = claimed_item(db, res, i, 10);
        if (it == NULL) {
            continue; /* its lease runs out and another round takes it */
        }
        it->attempts = atoi(PQgetvalue(res, i, 6));
        it->inconclusive_checks = atoi(PQgetvalue(res, i, 7));
        it->settled = strcmp(PQgetvalue(res, i, 8), "t") == 0;
        it->unknown_ms = strtoll(PQgetvalue(res, i, 9), NULL, 10);
        out[n++] = it;
    }
    PQclear(res);
    return n;
}

/* ---- recording verdicts ---------------------------------------------------------------- */

/* The state a decision moves the effect to (UNKNOWN: it stays, rescheduled). */
static tally_effect_state_t to_state(const tally_recon_item_t *it)
{
    switch (it->decision.action) {
    case TALLY_RECON_CONFIRM:
    case TALLY_RECON_DUPLICATE:
        return TALLY_EFFECT_CONFIRMED;
    case TALLY_RECON_REDISPATCH:
        return TALLY_EFFECT_PLANNED;
    case TALLY_RECON_STUCK:
        return TALLY_EFFECT_STUCK;
    case TALLY_RECON_CANCEL:
        return TALLY_EFFECT_CANCELLED;
    case TALLY_RECON_WAIT_SETTLE:
    case TALLY_RECON_RETRY_CHECK:
        break;
    }
    return TALLY_EFFECT_UNKNOWN;
}

/* One sentence on why the effect is STUCK, for error_message, the event and the page. */
static void stuck_message(const tally_recon_item_t *it, char *buf, size_t bufsz)
{
    const char *reason = it->decision.stuck_reason ? it->decision.stuck_reason : "";
    if (strcmp(reason, "no_status_check") == 0) {
        snprintf(buf, bufsz,
                 "tool '%s' declares no status endpoint, so whether this %s call took effect "
                 "cannot be read upstream; a human must find out",
                 it->tool->name, tally_effect_class_name(it->tool->effect_class));
    } else if (strcmp(reason, "attempts_exhausted") == 0) {
        snprintf(buf, bufsz,
                 "no upstream record carries the key after %d dispatch attempt%s (the tool's "
                 "max_attempts is %d); tally will not send it again",
                 it->attempts, it->attempts == 1 ? "" : "s", it->tool->max_attempts);
    } else {
        bool short_span = it->unknown_ms < 1000; /* "over 0 s" would say nothing true */
        tally_fmt(
            buf, bufsz, "the status check stayed inconclusive for %d check%s %s %lld %s (last: %s)",
            it->inconclusive_checks + 1, it->inconclusive_checks == 0 ? "" : "s",
            short_span ? "within" : "over", short_span ? it->unknown_ms : it->unknown_ms / 1000,
            short_span ? "ms" : "s", it->verdict.message);
    }
}

static const char *transition_reason(const tally_recon_item_t *it, char *buf, size_t bufsz)
{
    switch (it->decision.action) {
    case TALLY_RECON_CONFIRM:
        return "status check: one upstream record carries the key; it is the receipt";
    case TALLY_RECON_DUPLICATE:
        snprintf(buf, bufsz,
                 "status check: %zu upstream records carry the key; the earliest is the receipt, "
                 "each other one gets a compensation obligation",
                 json_array_size(it->records));
        return buf;
    case TALLY_RECON_REDISPATCH:
        return it->tool->status.path != NULL
                   ? "status check: no upstream record after the settle window; re-dispatching "
                     "with the same key"
                   : "no status endpoint and the tool is safe to retry; re-dispatching with the "
                     "same key";
    case TALLY_RECON_STUCK:
        stuck_message(it, buf, bufsz);
        return buf;
    case TALLY_RECON_CANCEL:
        return RUN_STOPPED;
    case TALLY_RECON_WAIT_SETTLE:
    case TALLY_RECON_RETRY_CHECK:
        break;
    }
    return NULL;
}

/* The kept record for CONFIRM and DUPLICATE: the earliest; for an audit, the one whose ref is
 * the ledger's (the receipt already kept), else the earliest. */
static json_t *kept_record(const tally_recon_item_t *it, size_t *idx)
{
    *idx = tally_recon_earliest(it->records);
    if (it->audit && it->external_ref != NULL) {
        for (size_t i = 0; i < json_array_size(it->records); i++) {
            char *ref = tally_conn_external_ref(it->tool, json_array_get(it->records, i));
            bool same = ref != NULL && strcmp(ref, it->external_ref) == 0;
            free(ref);
            if (same) {
                *idx = i;
                break;
            }
        }
    }
    return json_array_get(it->records, *idx);
}

/* The row of the record statement for one item. @returns a new reference or NULL. */
static json_t *record_row(const tally_recon_item_t *it)
{
    const tally_recon_decision_t *d = &it->decision;
    json_t *row =
        json_pack("{s:s, s:I, s:s, s:b, s:b, s:I}", "effect_id", it->effect_id, "epoch",
                  (json_int_t)it->epoch, "to_status", tally_effect_state_name(to_state(it)),
                  "checked", it->checked, "inconclusive", d->action == TALLY_RECON_RETRY_CHECK,
                  "delay_ms", (json_int_t)d->delay_ms);
    if (row == NULL) {
        return NULL;
    }
    bool ok = true;
    char buf[512];
    switch (d->action) {
    case TALLY_RECON_CONFIRM:
    case TALLY_RECON_DUPLICATE: {
        size_t idx;
        json_t *rec = kept_record(it, &idx);
        size_t over = 0;
        char *ref = tally_conn_ref_within_limit(tally_conn_external_ref(it->tool, rec), &over);
        if (over > 0) {
            /* kept in the receipt, not as the ref (connector.h); the answer says so */
            char msg[200];
            snprintf(msg, sizeof msg,
                     "the upstream record's ref is %zu bytes, above the limit of %d bytes for an "
                     "external ref; it is kept in the receipt, not as the ref",
                     over, TALLY_LIMIT_EXTERNAL_REF);
            ok = json_object_set_new(row, "error_code", json_string("protocol_error")) == 0 &&
                 json_object_set_new(row, "error_message", json_string(msg)) == 0;
        }
        ok = ok && json_object_set(row, "receipt", rec) == 0 &&
             json_object_set_new(row, "receipt_sealed", text_or_null(it->receipt_sealed)) == 0 &&
             json_object_set_new(row, "external_ref", text_or_null(ref)) == 0 &&
             json_object_set_new(row, "set_error", json_true()) == 0 &&
             json_object_set_new(row, "reason",
                                 json_string(d->action == TALLY_RECON_CONFIRM
                                                 ? "status_found"
                                                 : "status_duplicate")) == 0;
        free(ref);
        break;
    }
    case TALLY_RECON_WAIT_SETTLE:
        ok = json_object_set_new(row, "settle_ms", json_integer(it->tool->settle_ms)) == 0;
        break;
    case TALLY_RECON_REDISPATCH:
        ok = json_object_set_new(row, "reason", json_string("status_not_found")) == 0;
        break;
    case TALLY_RECON_CANCEL:
        ok = json_object_set_new(row, "reason", json_string("status_not_found")) == 0 &&
             json_object_set_new(row, "set_error", json_true()) == 0 &&
             json_object_set_new(row, "error_code", json_string("run_not_active")) == 0 &&
             json_object_set_new(row, "error_message", json_string(RUN_STOPPED)) == 0;
        break;
    case TALLY_RECON_RETRY_CHECK:
        ok = json_object_set_new(row, "set_error", json_true()) == 0 &&
             json_object_set_new(row, "error_code", json_string(it->verdict.code)) == 0 &&
             json_object_set_new(row, "error_message", json_string(it->verdict.message)) == 0;
        break;
    case TALLY_RECON_STUCK:
        stuck_message(it, buf, sizeof buf);
        ok = json_object_set_new(row, "reason", json_string(d->stuck_reason)) == 0 &&
             json_object_set_new(row, "set_error", json_true()) == 0 &&
             json_object_set_new(row, "error_code", json_string(d->stuck_reason)) == 0 &&
             json_object_set_new(row, "error_message", json_string(buf)) == 0;
        break;
    }
    if (!ok) {
        json_decref(row);
        return NULL;
    }
    return row;
}

/* The "connector_call" audit data of a status check. */
static json_t *check_data(const tally_recon_item_t *it, const char *next_at)
{
    return json_pack("{s:s, s:s, s:s, s:s, s:i, s:f, s:I, s:s?, s:s}", "op", "status", "verdict",
                     tally_verdict_name(it->verdict.verdict), "code", it->verdict.code, "message",
                     it->verdict.message, "http_status", (int)it->http_status, "seconds",
                     it->seconds, "records", (json_int_t)json_array_size(it->records),
                     "next_check_at", next_at, "decision",
                     tally_recon_action_name(it->decision.action));
}

/* The extras of a DUPLICATE as obligation rows (one per distinct external ref other than the
 * kept record's), appended to @p rows; @p refs receives every record's ref for the events. */
static bool duplicate_rows(const tally_recon_item_t *it, json_t *rows, json_t *refs)
{
    size_t kept;
    json_t *kept_rec = kept_record(it, &kept);
    size_t over = 0;
    char *kept_ref =
        tally_conn_ref_within_limit(tally_conn_external_ref(it->tool, kept_rec), &over);
    bool ok = true;
    for (size_t i = 0; ok && i < json_array_size(it->records); i++) {
        json_t *rec = json_array_get(it->records, i);
        /* a ref over the limit is no index key: the obligation's ref is null, its receipt
         * holds the record (connector.h) */
        char *ref = tally_conn_ref_within_limit(tally_conn_external_ref(it->tool, rec), &over);
        bool same_as_kept =
            i != kept && ref != NULL && kept_ref != NULL && strcmp(ref, kept_ref) == 0;
        ok = json_array_append_new(refs,
                                   json_pack("{s:o, s:b, s:b}", "external_ref", text_or_null(ref),
                                             "kept", i == kept, "same_as_kept", same_as_kept)) == 0;
        if (ok && i != kept && !same_as_kept) {
            char obligation_id[37];
            tally_uuid(obligation_id);
            ok = json_array_append_new(
                     rows, json_pack("{s:i, s:s, s:s, s:o, s:O}", "n", (int)json_array_size(rows),
                                     "obligation_id", obligation_id, "effect_id", it->effect_id,
                                     "external_ref", text_or_null(ref), "receipt", rec)) == 0;
        }
        free(ref);
    }
    free(kept_ref);
    return ok;
}

/* The events of one DUPLICATE (item @p i) whose obligations were just written. */
static bool queue_duplicate(tally_recon_db_t *db, const PGresult *res, int row,
                            const tally_recon_item_t *it, size_t i, const PGresult *obl,
                            const size_t *obl_pos, tally_error_t *err)
{
    json_t *refs = json_array();
    json_t *unused = json_array();
    json_t *new_obligations = json_array();
    bool ok = refs && unused && new_obligations && duplicate_rows(it, unused, refs);
    json_decref(unused);
    for (int j = 0; ok && obl != NULL && j < PQntuples(obl); j++) {
        if (obl_pos[j] != i) {
            continue;
        }
        const char *obligation_id = PQgetvalue(obl, j, 0);
        const char *ref = col(obl, j, 3);
        ok = json_array_append_new(new_obligations,
                                   json_pack("{s:s, s:o}", "obligation_id", obligation_id,
                                             "external_ref", text_or_null(ref))) == 0;
        tally_audit_event_t ev = {
            .run_id = col(res, row, C_RUN_ID),
            .effect_id = it->effect_id,
            .obligation_id = obligation_id,
            .kind = "obligation",
            .actor = db->actor,
            .reason = "duplicate: an extra upstream record carries the effect's key",
        };
        (void)tally_audit_move(db->audit, TALLY_MACHINE_OBLIGATION, -1, TALLY_OBLIGATION_PENDING,
                               &ev);
        ok = ok &&
             tally_recon_queue_message(
                 db, "obligations", "tally.obligation.v1", col(obl, j, 1),
                 json_pack("{s:s, s:s, s:s, s:s, s:o, s:s}", "obligation_id", obligation_id,
                           "run_id", col(obl, j, 1), "effect_id", it->effect_id, "reason",
                           "duplicate", "external_ref", text_or_null(ref), "status", "PENDING"),
                 err);
    }
    if (ok) {
        audit(db, res, row, "duplicate", "more than one upstream record carries the key",
              json_pack("{s:O, s:O, s:O}", "records", it->records, "external_refs", refs,
                        "new_obligations", new_obligations));
        ok = queue_outcome(db, res, row, "tally.effect.duplicate.v1",
                           json_pack("{s:I, s:O, s:O}", "records",
                                     (json_int_t)json_array_size(it->records), "external_refs",
                                     refs, "obligations", new_obligations),
                           err);
    } else {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "out of memory building the duplicate events");
    }
    json_decref(refs);
    json_decref(new_obligations);
    return ok;
}

/* The page for a STUCK effect. */
static void queue_alert(tally_recon_db_t *db, const PGresult *res, int row,
                        const tally_recon_item_t *it)
{
    char why[512];
    stuck_message(it, why, sizeof why);
    char summary[1024];
    if (db->minimal_pages)
        snprintf(summary, sizeof summary,
                 "tally: effect %s is STUCK; its full page could not be written: see tally doctor",
                 it->effect_id);
    else
        tally_fmt(summary, sizeof summary,
                  "tally: effect %s (tool %s, run %s, step %s) is STUCK: %s", it->effect_id,
                  it->tool->name, col(res, row, C_RUN_ID), col(res, row, C_STEP), why);
    char *key = tally_alert_effect_key(it->effect_id);
    char *command = tally_alert_effect_command(it->effect_id);
    json_t *details =
        db->minimal_pages
            ? NULL
            : json_pack("{s:s, s:s?, s:s?, s:s, s:s, s:i}", "tool", it->tool->name, "owner",
                        it->tool->owner, "tool_runbook", it->tool->runbook, "operation_key",
                        it->operation_key, "message", why, "attempts", it->attempts);
    tally_alert_t alert = {
        .dedup_key = key,
        .severity = "critical",
        .summary = summary,
        .run_id = col(res, row, C_RUN_ID),
        .effect_id = it->effect_id,
        .reason = it->decision.stuck_reason,
        .runbook = RUNBOOK_STUCK_EFFECT,
        .resolve_command = command,
        .details = details,
    };
    tally_alert_batch_add(db->alerts, &alert); /* a NULL key or command fails the batch */
    json_decref(details);
    free(key);
    free(command);
}

/* Audit events, messages and alerts for the item of RETURNING row @p row, item @p i of the
 * batch; @p obl_pos says which item each row of @p obl (the new obligations) belongs to. */
static bool queue_item_events(tally_recon_db_t *db, const PGresult *res, int row,
                              const tally_recon_item_t *it, size_t i, const PGresult *obl,
                              const size_t *obl_pos, tally_error_t *err)
{
    const char *next_at = col(res, row, C__EFFECT + 1);
    tally_effect_state_t to = to_state(it);
    if (it->checked) {
        audit(db, res, row, "connector_call", it->verdict.message,
              check_data(it, to == TALLY_EFFECT_UNKNOWN ? next_at : NULL));
    }
    char buf[600];
    const char *why = transition_reason(it, buf, sizeof buf);
    /* One event per move, the move the row made: a CANCEL goes UNKNOWN -> CANCELLED in one
     * UPDATE (schemas/machines.json), never through a PLANNED it did not stop at. */
    if (why != NULL) {
        json_t *data = NULL;
        if (to == TALLY_EFFECT_CONFIRMED) {
            data = json_pack("{s:o}", "external_ref", text_or_null(col(res, row, C_EXTERNAL_REF)));
        }
        audit_move(db, res, row, TALLY_EFFECT_UNKNOWN, to, why, data);
    }
    switch (it->decision.action) {
    case TALLY_RECON_CONFIRM:
        return queue_outcome(db, res, row, "tally.effect.confirmed.v1", NULL, err);
    case TALLY_RECON_DUPLICATE:
        return queue_outcome(db, res, row, "tally.effect.confirmed.v1", NULL, err) &&
               queue_duplicate(db, res, row, it, i, obl, obl_pos, err);
    case TALLY_RECON_STUCK:
        queue_alert(db, res, row, it);
        return queue_outcome(db, res, row, "tally.effect.stuck.v1",
                             json_pack("{s:s}", "reason", it->decision.stuck_reason), err);
    case TALLY_RECON_CANCEL:
        return queue_outcome(db, res, row, "tally.effect.cancelled.v1", NULL, err);
    case TALLY_RECON_WAIT_SETTLE:
    case TALLY_RECON_RETRY_CHECK:
    case TALLY_RECON_REDISPATCH:
        break;
    }
    return true;
}

/* A re-dispatch is a retry, and a run that stopped (cancel_run, compensate_run) has its retries
 * CANCELLED, as the dispatcher does with its own (DESIGN §3: DISPATCHING -> CANCELLED when no
 * attempt was applied): the status check found nothing after the settle window, so the effect
 * never happened and is not sent again; it goes UNKNOWN -> CANCELLED. Only after a status check: a
 * tool without one (read, idempotent) is sent the same key again, since nothing else can tell what
 * an earlier attempt did. The runs are share-locked, as the dispatcher's record does, so a run
 * operation and this transaction serialise. */
static bool cancel_if_stopped(tally_recon_db_t *tx, tally_recon_item_t **items, size_t n,
                              const char *const *ids_of_items, tally_error_t *err)
{
    json_t *ids = json_array();
    if (ids == NULL) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "out of memory building the run check");
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        if (items[i]->decision.action == TALLY_RECON_REDISPATCH && items[i]->checked &&
            items[i]->tool->status.path != NULL) {
            json_array_append_new(ids, json_string(items[i]->effect_id));
        }
    }
    bool ok = true;
    if (json_array_size(ids) > 0) {
        PGresult *res = tally_pg_exec_json(tx->pg, SQL_STOPPED_RUNS, ids, err);
        size_t *pos = res != NULL ? tally_columns_positions(res, 0, ids_of_items, n) : NULL;
        if (res != NULL && pos == NULL) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading the run check");
        }
        ok = pos != NULL;
        for (int r = 0; ok && r < PQntuples(res); r++) {
            if (pos[r] != SIZE_MAX && items[pos[r]]->decision.action == TALLY_RECON_REDISPATCH) {
                items[pos[r]]->decision.action = TALLY_RECON_CANCEL;
            }
        }
        free(pos);
        PQclear(res);
    }
    json_decref(ids);
    return ok;
}

bool tally_recon_record(tally_recon_db_t *db, tally_recon_item_t **items, size_t n,
                        tally_error_t *err)
{
    json_t *rows = json_array();
    const char **ids = calloc(n + 1, sizeof *ids); /* item i's effect id: how rows find items */
    json_t *redispatch = json_array();
    json_t *obligations = json_array();
    bool ok = rows != NULL && ids != NULL && redispatch != NULL && obligations != NULL;
    if (!ok) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "out of memory building the verdict batch");
    }
    for (size_t i = 0; ok && i < n; i++) {
        ids[i] = items[i]->effect_id;
    }
    tally_recon_db_t tx = *db;
    PGresult *res = NULL;
    PGresult *obl = NULL;
    size_t *pos = NULL;     /* the item of each RETURNING row */
    size_t *obl_pos = NULL; /* the item of each new obligation */
    ok = ok && tally_recon_tx_begin(&tx, err) && cancel_if_stopped(&tx, items, n, ids, err);
    for (size_t i = 0; ok && i < n; i++) {
        items[i]->won = false;
        ok = json_array_append_new(rows, record_row(items[i])) == 0;
        if (!ok) {
            tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                       "out of memory building the verdict batch");
        }
    }
    if (ok) {
        res = tally_pg_exec_json(tx.pg, SQL_RECORD, rows, err);
        pos = res != NULL ? tally_columns_positions(res, C_EFFECT_ID, ids, n) : NULL;
        if (res != NULL && pos == NULL) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading the verdicts recorded");
        }
        ok = pos != NULL;
    }
    for (int r = 0; ok && r < PQntuples(res); r++) {
        if (pos[r] == SIZE_MAX) {
            continue;
        }
        tally_recon_item_t *it = items[pos[r]];
        it->won = true;
        it->next_in_ms = strtoll(PQgetvalue(res, r, C__EFFECT + 2), NULL, 10);
        if (it->decision.action == TALLY_RECON_REDISPATCH) {
            ok = json_array_append_new(redispatch, json_string(it->effect_id)) == 0;
        } else if (it->decision.action == TALLY_RECON_DUPLICATE) {
            json_t *refs = json_array();
            ok = refs != NULL && duplicate_rows(it, obligations, refs);
            json_decref(refs);
        }
    }
    if (ok && json_array_size(redispatch) > 0) {
        PGresult *r2 = tally_pg_exec_json(tx.pg, SQL_REDISPATCH, redispatch, err);
        ok = r2 != NULL;
        PQclear(r2);
    }
    if (ok && json_array_size(obligations) > 0) {
        obl = tally_pg_exec_json(tx.pg, SQL_OBLIGATIONS, obligations, err);
        obl_pos = obl != NULL ? tally_columns_positions(obl, 2, ids, n) : NULL;
        if (obl != NULL && obl_pos == NULL) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading the obligations written");
        }
        ok = obl_pos != NULL;
    }
    for (int r = 0; ok && r < PQntuples(res); r++) {
        if (pos[r] != SIZE_MAX) {
            ok = queue_item_events(&tx, res, r, items[pos[r]], pos[r], obl, obl_pos, err);
        }
    }
    ok = tally_recon_tx_end(&tx, ok, err);
    if (!ok) {
        for (size_t i = 0; i < n; i++) {
            items[i]->won = false;
        }
    }
    PQclear(res);
    PQclear(obl);
    free(pos);
    free(obl_pos);
    free(ids);
    json_decref(redispatch);
    json_decref(obligations);
    json_decref(rows);
    return ok;
}

int tally_recon_release(tally_recon_db_t *db, tally_recon_item_t **items, size_t n,
                        tally_error_t *err)
{
    if (n == 0) {
        return 0;
    }
    json_t *rows = json_array();
    bool ok = rows != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        ok = json_array_append_new(rows, json_pack("{s:s, s:I}", "effect_id", items[i]->effect_id,
                                                   "epoch", (json_int_t)items[i]->epoch)) == 0;
    }
    if (!ok) {
        json_decref(rows);
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "out of memory building the release batch");
        return -1;
    }
    PGresult *res = tally_pg_exec_json(db->pg, SQL_RELEASE, rows, err);
    json_decref(rows);
    if (res == NULL) {
        return -1;
    }
    int released = atoi(PQcmdTuples(res));
    PQclear(res);
    return released;
}

bool tally_recon_gauges(tally_recon_db_t *db, long long *unknown, double *oldest_s,
                        long long *stuck, double *stuck_oldest_s, tally_error_t *err)
{
    PGresult *res = tally_pg_exec(db->pg, SQL_GAUGES, 0, NULL, err);
    if (res == NULL) {
        return false;
    }
    *unknown = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    *oldest_s = strtod(PQgetvalue(res, 0, 1), NULL);
    *stuck = strtoll(PQgetvalue(res, 0, 2), NULL, 10);
    *stuck_oldest_s = strtod(PQgetvalue(res, 0, 3), NULL);
    PQclear(res);
    return true;
}

/* ---- audits of CONFIRMED effects ---------------------------------------------------------- */

/* The registry's audit policies, in one transaction: enabled tools upserted (a change of
 * policy applies to effects confirmed from then on), disabled ones removed, and a pacing row
 * for every tool that is paced. */
static const char SQL_AUDIT_POLICIES[] =
    "INSERT INTO audit_policies AS a (tool, delay_ms, again_ms, sample_rate, updated_by)"
    " SELECT p.tool, p.delay_ms, p.again_ms, p.sample_rate, $2"
    " FROM json_to_recordset($1::json) AS p(tool text, enabled boolean, delay_ms int,"
    " again_ms int, sample_rate float8)"
    " WHERE p.enabled"
    " ON CONFLICT (tool) DO UPDATE SET delay_ms = EXCLUDED.delay_ms,"
    " again_ms = EXCLUDED.again_ms, sample_rate = EXCLUDED.sample_rate,"
    " updated_by = EXCLUDED.updated_by, updated_at = now()"
    " WHERE (a.delay_ms, a.again_ms, a.sample_rate)"
    "   IS DISTINCT FROM (EXCLUDED.delay_ms, EXCLUDED.again_ms, EXCLUDED.sample_rate)";

static const char SQL_AUDIT_UNPUBLISH[] =
    "DELETE FROM audit_policies WHERE tool IN (SELECT p.tool"
    " FROM json_to_recordset($1::json) AS p(tool text, enabled boolean) WHERE NOT p.enabled)";

/* audits queued before a tool's audit was turned off are not made */
static const char SQL_AUDIT_DROP[] =
    "DELETE FROM audits WHERE tool IN (SELECT p.tool"
    " FROM json_to_recordset($1::json) AS p(tool text, enabled boolean) WHERE NOT p.enabled)";

static const char SQL_PACING_ROWS[] =
    "INSERT INTO tool_pacing (tool) SELECT p.tool"
    " FROM json_to_recordset($1::json) AS p(tool text, paced boolean) WHERE p.paced"
    " ON CONFLICT (tool) DO NOTHING";

bool tally_audit_publish(tally_recon_db_t *db, tally_error_t *err)
{
    json_t *rows = json_array();
    bool ok = rows != NULL;
    for (size_t i = 0; ok && i < tally_registry_count(db->reg); i++) {
        const tally_tool_t *t = tally_registry_at(db->reg, i);
        const tally_audit_policy_t *a = &t->audit;
        ok = json_array_append_new(rows,
                                   json_pack("{s:s, s:b, s:i, s:i, s:f, s:b}", "tool", t->name,
                                             "enabled", a->enabled, "delay_ms", a->delay_ms,
                                             "again_ms", a->again_ms, "sample_rate", a->sample_rate,
                                             "paced", a->enabled || a->sweep_ms > 0)) == 0;
    }
    if (!ok) {
        json_decref(rows);
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "out of memory listing the audit policies");
        return false;
    }
    char *text = json_dumps(rows, JSON_COMPACT);
    json_decref(rows);
    if (text == NULL) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "out of memory listing the audit policies");
        return false;
    }
    const char *params[2] = {text, db->actor};
    ok = tally_pg_begin(db->pg, err) && tally_pg_run(db->pg, SQL_AUDIT_POLICIES, 2, params, err) &&
         tally_pg_run(db->pg, SQL_AUDIT_UNPUBLISH, 1, params, err) &&
         tally_pg_run(db->pg, SQL_AUDIT_DROP, 1, params, err) &&
         tally_pg_run(db->pg, SQL_PACING_ROWS, 1, params, err) && tally_pg_commit(db->pg, err);
    if (!ok) {
        tally_pg_rollback(db->pg);
    }
    free(text);
    return ok;
}

/* Due audits, paid for from each tool's budget (pacing.h): the pacing rows with at least one
 * slot are locked (another reconciler skips them this round), at most as many audits of each
 * are leased as it has slots (and n), and the budget moves on by what was taken. A tool with
 * nothing due pays nothing. */
static const char SQL_AUDIT_CLAIM[] =
    "WITH cfg AS ("
    "  SELECT c.*, greatest(1000, c.slot_ms) * interval '1 millisecond' AS burst"
    "  FROM json_to_recordset($1::json) AS c(tool text, n int, lease_ms bigint, slot_ms float8)),"
    " open AS ("
    "  SELECT p.tool, c.lease_ms, c.slot_ms, c.burst,"
    "    least(c.n, floor(extract(epoch FROM now() - greatest(p.next_at, now() - c.burst))"
    "      * 1000 / c.slot_ms))::int AS n"
    "  FROM tool_pacing p JOIN cfg c USING (tool)"
    "  WHERE greatest(p.next_at, now() - c.burst) + c.slot_ms * interval '1 millisecond' <= now()"
    "  ORDER BY p.tool FOR UPDATE OF p SKIP LOCKED),"
    " picked AS ("
    "  SELECT a.effect_id, o.tool, o.lease_ms FROM open o CROSS JOIN LATERAL ("
    "    SELECT x.effect_id FROM audits x WHERE x.tool = o.tool AND x.due_at <= now()"
    "    AND (x.lease_until IS NULL OR x.lease_until < now())"
    "    ORDER BY x.due_at LIMIT o.n FOR UPDATE OF x SKIP LOCKED) a"
    "  LIMIT $3),"
    " paced AS ("
    "  UPDATE tool_pacing t SET next_at = greatest(t.next_at, now() - o.burst)"
    "    + k.cnt * o.slot_ms * interval '1 millisecond'"
    "  FROM (SELECT tool, count(*) AS cnt FROM picked GROUP BY tool) k JOIN open o USING (tool)"
    "  WHERE t.tool = k.tool),"
    " claimed AS ("
    "  UPDATE audits a SET lease_owner = $2,"
    "    lease_until = now() + p.lease_ms * interval '1 millisecond',"
    "    lease_epoch = a.lease_epoch + 1"
    "  FROM picked p WHERE a.effect_id = p.effect_id"
    "  RETURNING a.effect_id, a.lease_epoch, a.passes, a.failures)"
    " SELECT c.effect_id::text, c.lease_epoch, e.run_id, e.tool, e.operation_key,"
    " e.traceparent, c.passes, c.failures, e.external_ref, e.seal_key::text,"
    " (SELECT k.master_key_id FROM tenant_keys k WHERE k.key_id = e.seal_key),"
    " (SELECT k.wrapped FROM tenant_keys k WHERE k.key_id = e.seal_key), e.args_sealed"
    " FROM claimed c JOIN effects e USING (effect_id)";

int tally_audit_claim(tally_recon_db_t *db, const char *tools_json, int limit,
                      tally_recon_item_t **out, tally_error_t *err)
{
    char limit_text[24];
    snprintf(limit_text, sizeof limit_text, "%d", limit);
    const char *params[3] = {tools_json, db->actor, limit_text};
    PGresult *res = tally_pg_exec(db->pg, SQL_AUDIT_CLAIM, 3, params, err);
    if (res == NULL) {
        return -1;
    }
    int n = 0;
    for (int i = 0; i < PQntuples(res) && n < limit; i++) {
        tally_recon_item_t *it = claimed_item(db, res, i, 9);
        if (it == NULL) {
            continue;
        }
        it->audit = true;
        it->settled = true;
        it->audit_passes = atoi(PQgetvalue(res, i, 6));
        it->audit_failures = atoi(PQgetvalue(res, i, 7));
        it->external_ref = dup_or_null(col(res, i, 8));
        if (col(res, i, 8) != NULL && it->external_ref == NULL) {
            tally_recon_item_free(it);
            continue;
        }
        out[n++] = it;
    }
    PQclear(res);
    return n;
}

/* Reschedule (next_ms >= 0) or finish (delete) each audit whose lease is still ours; the effect
 * rows of those won come back for the events. */
static const char SQL_AUDIT_RECORD[] =
    "WITH r AS (SELECT * FROM json_to_recordset($1::json) AS r(effect_id uuid, epoch bigint,"
    "  next_ms bigint, counted boolean, failed boolean)),"
    " moved AS ("
    "  UPDATE audits a SET passes = a.passes + CASE WHEN r.counted THEN 1 ELSE 0 END,"
    "    failures = CASE WHEN r.failed THEN a.failures + 1 ELSE 0 END,"
    "    due_at = now() + r.next_ms * interval '1 millisecond',"
    "    lease_owner = NULL, lease_until = NULL, lease_epoch = a.lease_epoch + 1"
    "  FROM r WHERE a.effect_id = r.effect_id AND a.lease_epoch = r.epoch AND r.next_ms >= 0"
    "  RETURNING a.effect_id),"
    " gone AS ("
    "  DELETE FROM audits a USING r"
    "  WHERE a.effect_id = r.effect_id AND a.lease_epoch = r.epoch AND r.next_ms < 0"
    "  RETURNING a.effect_id)"
    " SELECT " EFFECT_COLS " FROM effects e"
    " WHERE e.effect_id IN (SELECT effect_id FROM moved UNION ALL SELECT effect_id FROM gone)";

/* Findings no obligation can settle, each paged once: ON CONFLICT skips a finding already on
 * file (kind, tool, external ref), and RETURNING names only the new ones. */
static const char SQL_FINDINGS[] =
    "INSERT INTO findings (finding_id, kind, tool, external_ref, run_id, effect_id, summary,"
    " evidence, found_by)"
    " SELECT f.finding_id, f.kind, f.tool, f.external_ref, f.run_id, f.effect_id, f.summary,"
    " f.evidence, $2"
    " FROM json_to_recordset($1::json) AS f(finding_id uuid, kind text, tool text,"
    " external_ref text, run_id text, effect_id uuid, summary text, evidence jsonb)"
    " ON CONFLICT DO NOTHING"
    " RETURNING finding_id::text, run_id, effect_id::text, summary, kind, tool";

#define RUNBOOK_FINDING "docs/operations.md#upstream-findings"

/* File @p findings (a JSON array of rows for SQL_FINDINGS) in the transaction @p tx: the new
 * ones are paged (dedup key finding:<id>) with their evidence and the command that closes
 * them, and each gets a "finding" audit event. */
bool tally_recon_file_findings(tally_recon_db_t *tx, const json_t *findings, tally_error_t *err)
{
    if (json_array_size(findings) == 0) {
        return true;
    }
    char *text = json_dumps(findings, JSON_COMPACT);
    if (text == NULL) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "out of memory filing findings");
        return false;
    }
    const char *params[2] = {text, tx->actor};
    PGresult *res = tally_pg_exec(tx->pg, SQL_FINDINGS, 2, params, err);
    free(text);
    if (res == NULL) {
        return false;
    }
    bool ok = true;
    for (int r = 0; ok && r < PQntuples(res); r++) {
        const char *id = PQgetvalue(res, r, 0);
        char key[64], command[256];
        snprintf(key, sizeof key, "finding:%s", id);
        snprintf(command, sizeof command,
                 "tally resolve --finding %s --as resolved --reason \"<what you did upstream>\"",
                 id);
        json_t *details = json_pack("{s:s, s:s, s:s?}", "finding_id", id, "kind",
                                    PQgetvalue(res, r, 4), "tool", col(res, r, 5));
        tally_alert_t alert = {
            .dedup_key = key,
            .severity = "error",
            .summary = PQgetvalue(res, r, 3),
            .run_id = col(res, r, 1),
            .effect_id = col(res, r, 2),
            .reason = strcmp(PQgetvalue(res, r, 4), "orphan") == 0 ? "orphan" : "upstream_mismatch",
            .runbook = RUNBOOK_FINDING,
            .resolve_command = command,
            .details = details,
        };
        tally_alert_batch_add(tx->alerts, &alert);
        tally_audit_event_t ev = {
            .run_id = col(res, r, 1),
            .effect_id = col(res, r, 2),
            .kind = "finding",
            .actor = tx->actor,
            .reason = PQgetvalue(res, r, 3),
            .data = details,
        };
        tally_audit_batch_add(tx->audit, &ev);
        json_decref(details);
        ok = details != NULL;
    }
    PQclear(res);
    if (!ok) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "out of memory filing findings");
    }
    return ok;
}

/* The finding row of a MISSING or MISMATCH audit. */
static json_t *audit_finding(const tally_recon_item_t *it)
{
    char id[37], summary[400];
    tally_uuid(id);
    bool missing = it->audit_decision.result == TALLY_AUDIT_MISSING;
    json_t *rec = missing ? NULL : json_array_get(it->records, 0);
    char *ref = rec != NULL ? tally_conn_external_ref(it->tool, rec) : NULL;
    size_t over = 0;
    ref = tally_conn_ref_within_limit(ref, &over);
    if (missing)
        tally_fmt(summary, sizeof summary,
                  "tool '%s' holds no record for CONFIRMED effect %s (key %s): the receipt names "
                  "%s",
                  it->tool->name, it->effect_id, it->operation_key,
                  it->external_ref ? it->external_ref : "no ref");
    else
        tally_fmt(summary, sizeof summary,
                  "tool '%s' holds record %s for CONFIRMED effect %s (key %s), not the %s the "
                  "ledger keeps",
                  it->tool->name, ref ? ref : "(no ref)", it->effect_id, it->operation_key,
                  it->external_ref ? it->external_ref : "record");
    json_t *row = json_pack(
        "{s:s, s:s, s:s, s:o, s:s, s:s, s:s, s:{s:s, s:s, s:o, s:O}}", "finding_id", id, "kind",
        "ledger", "tool", it->tool->name, "external_ref",
        text_or_null(missing ? it->external_ref : ref), "run_id", it->run_id, "effect_id",
        it->effect_id, "summary", summary, "evidence", "check", "audit", "found",
        tally_audit_result_name(it->audit_decision.result), "ledger_ref",
        text_or_null(it->external_ref), "records", it->records ? it->records : json_null());
    free(ref);
    return row;
}

bool tally_audit_record(tally_recon_db_t *db, tally_recon_item_t **items, size_t n,
                        tally_error_t *err)
{
    json_t *rows = json_array();
    json_t *obligations = json_array();
    json_t *findings = json_array();
    const char **ids = calloc(n + 1, sizeof *ids);
    bool ok = rows != NULL && obligations != NULL && findings != NULL && ids != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        const tally_audit_decision_t *d = &items[i]->audit_decision;
        items[i]->won = false;
        ids[i] = items[i]->effect_id;
        ok = json_array_append_new(rows, json_pack("{s:s, s:I, s:I, s:b, s:b}", "effect_id",
                                                   items[i]->effect_id, "epoch",
                                                   (json_int_t)items[i]->epoch, "next_ms",
                                                   (json_int_t)d->next_in_ms, "counted", d->counted,
                                                   "failed", d->result == TALLY_AUDIT_RETRY)) == 0;
    }
    if (!ok) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "out of memory building the audit batch");
    }
    tally_recon_db_t tx = *db;
    PGresult *res = NULL;
    PGresult *obl = NULL;
    size_t *pos = NULL;
    size_t *obl_pos = NULL;
    ok = ok && tally_recon_tx_begin(&tx, err);
    if (ok) {
        res = tally_pg_exec_json(tx.pg, SQL_AUDIT_RECORD, rows, err);
        pos = res != NULL ? tally_columns_positions(res, C_EFFECT_ID, ids, n) : NULL;
        if (res != NULL && pos == NULL) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading the audits recorded");
        }
        ok = pos != NULL;
    }
    for (int r = 0; ok && r < PQntuples(res); r++) {
        if (pos[r] == SIZE_MAX) {
            continue;
        }
        tally_recon_item_t *it = items[pos[r]];
        it->won = true;
        switch (it->audit_decision.result) {
        case TALLY_AUDIT_DUPLICATE: {
            json_t *refs = json_array();
            ok = refs != NULL && duplicate_rows(it, obligations, refs);
            json_decref(refs);
            break;
        }
        case TALLY_AUDIT_MISSING:
        case TALLY_AUDIT_MISMATCH:
            ok = json_array_append_new(findings, audit_finding(it)) == 0;
            break;
        default:
            break;
        }
    }
    if (ok && json_array_size(obligations) > 0) {
        obl = tally_pg_exec_json(tx.pg, SQL_OBLIGATIONS, obligations, err);
        obl_pos = obl != NULL ? tally_columns_positions(obl, 2, ids, n) : NULL;
        if (obl != NULL && obl_pos == NULL) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading the obligations written");
        }
        ok = obl_pos != NULL;
    }
    ok = ok && tally_recon_file_findings(&tx, findings, err);
    for (int r = 0; ok && r < PQntuples(res); r++) {
        if (pos[r] == SIZE_MAX) {
            continue;
        }
        tally_recon_item_t *it = items[pos[r]];
        const tally_audit_decision_t *d = &it->audit_decision;
        audit(&tx, res, r, "audit", it->verdict.message,
              json_pack("{s:s, s:i, s:s, s:i, s:I, s:s?}", "found",
                        tally_audit_result_name(d->result), "pass",
                        it->audit_passes + (d->counted ? 1 : 0), "verdict",
                        tally_verdict_name(it->verdict.verdict), "http_status",
                        (int)it->http_status, "records", (json_int_t)json_array_size(it->records),
                        "code", it->verdict.code[0] ? it->verdict.code : NULL));
        if (d->result == TALLY_AUDIT_DUPLICATE) {
            ok = queue_duplicate(&tx, res, r, it, pos[r], obl, obl_pos, err);
        }
    }
    ok = tally_recon_tx_end(&tx, ok, err);
    if (!ok) {
        for (size_t i = 0; i < n; i++) {
            items[i]->won = false;
        }
    }
    PQclear(res);
    PQclear(obl);
    free(pos);
    free(obl_pos);
    free(ids);
    json_decref(rows);
    json_decref(obligations);
    json_decref(findings);
    return ok;
}
