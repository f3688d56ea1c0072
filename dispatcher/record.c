/* record.c — the recorder: writes each decided call result (deliver.c, policy.c) with a
 * compare-and-set on status and lease epoch (DESIGN §3 rule 3), together with its audit events,
 * its outcome message and any page, one transaction per batch, on a thread and a PostgreSQL
 * connection of its own. A dispatcher whose lease was taken over writes nothing. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dispatcher.h"
#include "tally/alert.h"
#include "tally/audit.h"
#include "tally/backoff.h"
#include "tally/columns.h"
#include "tally/crashpoint.h"
#include "tally/json.h"
#include "tally/ledger.h"
#include "tally/log.h"
#include "tally/migrate.h"
#include "tally/id.h"
#include "tally/runops.h"
#include "tally/text.h"

/* ---------------------------------------------------------------------------------------- */
/* SQL                                                                                      */

/* The compare-and-set (rule 3): only rows still DISPATCHING under the epoch this worker claimed
 * are written. The effects are looked up by primary key through an array of their ids, and
 * their status compared through coalesce() so that no other index serves it: see bench/README.md
 * (Planner notes: the dispatcher's claim and record). */
#define RECORDED_EFFECTS                                                                           \
    "e.effect_id = ANY (ARRAY(SELECT effect_id FROM x)) AND e.effect_id = x.effect_id"             \
    " AND coalesce(e.status, '') = 'DISPATCHING'"
/* The decided results, $1 of both record statements: a columns parameter (columns.h) built by
 * record_batch, typed here, and their number, N, zipped in with generate_series(1, N) only for
 * the planner's row estimate: see bench/README.md (Planner notes: the dispatcher's claim and
 * record). */
// clang-format off
#define RECORDED_ROWS(PARAM, N)                                                                    \
    " (SELECT u.effect_id::uuid AS effect_id, u.epoch::bigint AS epoch, u.status,"                 \
    "   u.receipt::jsonb AS receipt, u.external_ref, u.error_code, u.error_message,"               \
    "   u.delay_ms::bigint AS delay_ms, u.maybe::boolean AS maybe_applied,"                        \
    "   u.receipt_sealed::bytea AS receipt_sealed"                                                 \
    "   FROM ROWS FROM (unnest(" TALLY_COLUMN(PARAM, 1) "),"                                       \
    "   unnest(" TALLY_COLUMN(PARAM, 2) "), unnest(" TALLY_COLUMN(PARAM, 3) "),"                   \
    "   unnest(" TALLY_COLUMN(PARAM, 4) "), unnest(" TALLY_COLUMN(PARAM, 5) "),"                   \
    "   unnest(" TALLY_COLUMN(PARAM, 6) "), unnest(" TALLY_COLUMN(PARAM, 7) "),"                   \
    "   unnest(" TALLY_COLUMN(PARAM, 8) "), unnest(" TALLY_COLUMN(PARAM, 9) "),"                   \
    "   unnest(" TALLY_COLUMN(PARAM, 10) "),"                                                      \
    "   generate_series(1, " N "::int))"                                                           \
    "   AS u(effect_id, epoch, status, receipt, external_ref, error_code, error_message,"          \
    "   delay_ms, maybe, receipt_sealed, k))"
#define REC_COLS 10 /* RECORDED_ROWS' columns, from effect_id to receipt_sealed */

/* The general path: a batch with a retry or a page. Each row is written as decided, with one
 * exception, the OVERRIDE (CTE x), the one move decided here and not in policy.c because only
 * this statement can know it: a retry (PLANNED) whose run stopped going on while its call was
 * in flight (cancel_run, compensate_run) is not tried again. It becomes CANCELLED, as the run's
 * other PLANNED effects were — or UNKNOWN when this attempt or an earlier one may have been
 * applied (maybe_applied, or TALLY_SQL_MAYBE_APPLIED: only the tool can say, and the reconciler
 * asks it) — with error run_not_active or the attempt's own, and the run's status as the
 * reason. The runs of retries are share-locked first (ru), as intake does, so such a run
 * operation and this statement serialise (runops locks the run rows first). Every row comes
 * back in the state it was written in, for tally_dispatch_overridden to map back. */
// clang-format off
static const char SQL_RECORD[] =
    "WITH r AS (SELECT * FROM" RECORDED_ROWS("$1", "$2") " AS r),"
    " ru AS (SELECT run_id, status FROM runs WHERE run_id IN (SELECT e.run_id FROM r"
    "   JOIN effects e ON e.effect_id = r.effect_id WHERE r.status = 'PLANNED')"
    "   ORDER BY run_id FOR SHARE),"
    " x AS (SELECT r.effect_id, r.epoch, r.receipt, r.receipt_sealed, r.external_ref,"
    "   r.delay_ms, o.stop,"
    "   CASE WHEN o.stop IS NULL THEN r.status WHEN o.maybe THEN 'UNKNOWN'"
    "     ELSE 'CANCELLED' END AS status,"
    "   CASE WHEN o.stop IS NOT NULL AND NOT o.maybe THEN 'run_not_active'"
    "     ELSE r.error_code END AS error_code,"
    "   CASE WHEN o.stop IS NULL THEN r.error_message"
    "     WHEN o.maybe THEN o.stop || '; an attempt may have been applied, so the'"
    "       || ' reconciler asks the tool: ' || r.error_message"
    "     ELSE o.stop || '; the last attempt was not applied: ' || r.error_message"
    "   END AS error_message"
    "   FROM r LEFT JOIN effects e ON r.status = 'PLANNED' AND e.effect_id = r.effect_id"
    "   LEFT JOIN ru ON ru.run_id = e.run_id"
    "   CROSS JOIN LATERAL (SELECT"
    "     CASE WHEN NOT " TALLY_SQL_RUN_GOES_ON("ru.status") " THEN 'the run is ' || ru.status"
    "     END AS stop,"
    "     CASE WHEN NOT " TALLY_SQL_RUN_GOES_ON("ru.status") " THEN r.maybe_applied"
    "       OR " TALLY_SQL_MAYBE_APPLIED("e") " END AS maybe) o),"
    " upd AS (UPDATE effects e SET status = x.status,"
    "   status_reason = coalesce(x.stop, e.status_reason),"
    "   receipt = CASE WHEN x.status = 'CONFIRMED' THEN x.receipt ELSE e.receipt END,"
    "   receipt_sealed = CASE WHEN x.status = 'CONFIRMED' THEN x.receipt_sealed"
    "     ELSE e.receipt_sealed END,"
    "   external_ref = CASE WHEN x.status = 'CONFIRMED' THEN x.external_ref"
    "     ELSE e.external_ref END,"
    "   error_code = x.error_code, error_message = x.error_message,"
    "   unknown_since = CASE WHEN x.status = 'UNKNOWN' THEN now() ELSE e.unknown_since END,"
    "   next_attempt_at = CASE WHEN x.status = 'PLANNED'"
    "     THEN now() + x.delay_ms * interval '1 millisecond' ELSE e.next_attempt_at END,"
    "   lease_owner = NULL, lease_until = NULL, updated_at = now()"
    "   FROM x WHERE " RECORDED_EFFECTS " AND e.lease_epoch = x.epoch"
    "   RETURNING e.effect_id, e.tool, e.status, e.next_attempt_at, e.error_code,"
    "     e.error_message),"
    " ob AS (INSERT INTO outbox (effect_id, tool, due_at)"
    "   SELECT effect_id, tool, next_attempt_at FROM upd WHERE status = 'PLANNED')"
    " SELECT effect_id::text, status, error_code, error_message FROM upd";
// clang-format on

/* The receipt is stored once, on the effect (ledger.h): the "connector_call" data of a call
 * whose answer is the effect's receipt comes from deliver.c with "receipt": {"on": "effect"},
 * and is completed here, in the statement that writes it, with the SHA-256 of the receipt as
 * the effect row holds it (RECEIPT_REF of the row): RECEIPT_REF_DATA(REF), where @p REF is the
 * completed reference of the event "r"'s effect (NULL leaves the event as it is); every other
 * event passes as it is. */
// clang-format off
#define RECEIPT_REF(E)                                                                             \
    "jsonb_strip_nulls(jsonb_build_object('on', '" TALLY_RECEIPT_ON_EFFECT "', 'sha256', "         \
    TALLY_SQL_RECEIPT_SHA256(E) ", 'sealed_sha256', " TALLY_SQL_SEALED_SHA256(E) "))"
#define RECEIPT_REF_DATA(REF)                                                                      \
    "CASE WHEN r.kind = 'connector_call' AND r.data #>> '{receipt,on}' = '"                        \
    TALLY_RECEIPT_ON_EFFECT "' THEN r.data || jsonb_build_object('receipt', coalesce(" REF ","     \
    " r.data -> 'receipt')) ELSE r.data END"
// clang-format on

/* The general path's events, written after SQL_RECORD in its transaction: the effects hold
 * their receipts by then, each found by its primary key. */
static const char SQL_RECORD_EVENTS[] = TALLY_AUDIT_INSERT_DATA(
    "$1", "",
    RECEIPT_REF_DATA("(SELECT " RECEIPT_REF("e") " FROM effects e"
                                                 " WHERE e.effect_id = r.effect_id"
                                                 " AND e.receipt IS NOT NULL)"));

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
#define RECORD_FINAL_HEAD(UPD_MORE)                                                                \
    "WITH x AS (SELECT * FROM" RECORDED_ROWS("$1", "$6") " AS x),"                                 \
    " upd AS (UPDATE effects e SET status = x.status,"                                             \
    "   receipt = CASE WHEN x.status = 'CONFIRMED' THEN x.receipt ELSE e.receipt END,"             \
    "   receipt_sealed = CASE WHEN x.status = 'CONFIRMED' THEN x.receipt_sealed"                   \
    "     ELSE e.receipt_sealed END,"                                                              \
    "   external_ref = CASE WHEN x.status = 'CONFIRMED' THEN x.external_ref"                       \
    "     ELSE e.external_ref END,"                                                                \
    "   error_code = x.error_code, error_message = x.error_message,"                               \
    "   unknown_since = CASE WHEN x.status = 'UNKNOWN' THEN now() ELSE e.unknown_since END,"       \
    "   lease_owner = NULL, lease_until = NULL, updated_at = now()"                                \
    "   FROM x WHERE " RECORDED_EFFECTS " AND e.lease_epoch = x.epoch"                             \
    "   RETURNING e.effect_id,"                                                                    \
    "     CASE WHEN e.receipt IS NOT NULL THEN " RECEIPT_REF("e") " END AS receipt_ref" UPD_MORE   \
    "),"                                                                                           \
    /* the references by effect id, once: a subquery per event would scan all of upd */           \
    " rr AS (SELECT jsonb_object_agg(effect_id::text, receipt_ref) AS refs FROM upd"               \
    "   WHERE receipt_ref IS NOT NULL),"                                                           \
    " ev AS (" TALLY_AUDIT_INSERT_DATA("$2", WON_EVENTS,                                           \
                                       RECEIPT_REF_DATA("((SELECT refs FROM rr)"                   \
                                                        " -> r.effect_id::text)")) "),"
static const char SQL_RECORD_FINAL[] =
    RECORD_FINAL_HEAD("")
    " mo AS (" TALLY_OUTBOX_INSERT_HANDED("$3", WON_MESSAGES, "$4", "$5") ")"
    " SELECT 'e', effect_id::text, NULL, NULL, NULL, NULL, NULL FROM upd"
    " UNION ALL SELECT 'm', id::text, topic, msg_key, event_id, payload, reply FROM mo";

/* SQL_RECORD_FINAL on a ledger with message_refs (schema 17): an outcome that reports its
 * transition by reference (record_events) is a message_refs row. Those come back as 'r' rows
 * (id, key, the transition's id, and its time as the relay writes it: now() is the events'
 * occurred_at), and each effect ('e' rows) with its receipt when CONFIRMED: the recorder builds
 * each reference's event from them and from what it wrote (hand_refs), as the relay builds
 * it from the tables, without a join here (a join of these CTEs runs as nested loops: the
 * planner guesses 10 rows for each). */
static const char SQL_RECORD_FINAL_REFS[] =
    RECORD_FINAL_HEAD(", CASE WHEN e.status = 'CONFIRMED' THEN e.receipt::text END AS receipt")
    TALLY_OUTBOX_REFS_CTES("$3", WON_MESSAGES, "$4", "$5")
    " SELECT 'e', effect_id::text, NULL, NULL, NULL, receipt, NULL, NULL FROM upd"
    " UNION ALL SELECT 'm', id::text, topic, msg_key, event_id, payload, reply, NULL FROM mo"
    " UNION ALL SELECT 'r', id::text, 'outcomes', msg_key, event_id::text, NULL, NULL, "
    TALLY_SQL_EVENT_TIME("now()") " FROM mr";
// clang-format on

/* ---------------------------------------------------------------------------------------- */
/* Recording                                                                                */

/* The page for a tool that refused tally's credentials, raised through alert.c: one per tool
 * ("auth:<tool>"), re-opened when it was resolved. @returns false when out of memory. */
static bool queue_page(tally_alert_batch_t *alerts, const dispatch_done_t *x)
{
    const dispatch_call_t *call = x->call;
    const tally_tool_t *tool = call->tool;
    const char *http = strncmp(x->v.code, "http_", 5) == 0 ? x->v.code + 5 : x->v.code;
    char key[200], summary[400], resolve[300];
    tally_fmt(key, sizeof key, "auth:%s", tool->name);
    tally_fmt(summary, sizeof summary,
              "tool '%s' (owner %s) refused tally's credentials with HTTP %s; its calls fail "
              "until they are fixed",
              tool->name, tool->owner ? tool->owner : "unknown", http);
    /* the effect is FAILED already: what is left to close is the page, not the effect */
    tally_fmt(resolve, sizeof resolve,
              "tally resolve --alert %s --reason 'credentials of %s fixed'", key, tool->name);
    json_t *details = json_pack("{s:s}", "owner", tool->owner ? tool->owner : "");
    if (!details)
        return false;
    tally_alert_t alert = {.dedup_key = key,
                           .severity = "error",
                           .summary = summary,
                           .run_id = call->run_id,
                           .effect_id = call->effect_id,
                           .reason = "auth_failed",
                           .runbook = tool->runbook,
                           .resolve_command = resolve,
                           .details = details};
    tally_alert_batch_add(alerts, &alert);
    json_decref(details);
    return true;
}

/* The outcome event of a recorded result, as far as the call and its decision say it: the
 * general path adds the receipt, the reference path its id and time. */
static tally_effect_event_t recorded_event(const dispatch_done_t *x)
{
    const dispatch_call_t *call = x->call;
    const tally_dispatch_decision_t *dec = &x->dec;
    bool error = dec->error_code[0] != '\0';
    return (tally_effect_event_t){.effect_id = call->effect_id,
                                  .run_id = call->run_id,
                                  .step = call->step,
                                  .step_is_number = call->step_is_number,
                                  .tool = call->tool->name,
                                  .operation_key = call->operation_key,
                                  .status = tally_effect_state_name(dec->state),
                                  .external_ref = x->external_ref,
                                  .error_code = error ? dec->error_code : NULL,
                                  .error_message = error ? dec->error_message : NULL,
                                  .attempts = call->attempts,
                                  .intent_id = call->intent_id};
}

/* The events for the rows the compare-and-set wrote (flag @p won): the call, the transition
 * and, unless it is tried again, the outcome message; and the pages they call for on
 * @p alerts (NULL on the final path, whose results page nobody). */
static bool record_events(dispatcher_t *d, dispatch_done_t *done, size_t n_done, const bool *won,
                          tally_audit_batch_t *ab, tally_outbox_batch_t *ob,
                          tally_alert_batch_t *alerts, tally_error_t *err)
{
    for (size_t i = 0; i < n_done; i++) {
        if (!won[i])
            continue;
        dispatch_done_t *x = &done[i];
        const tally_dispatch_decision_t *dec = &x->dec;
        dispatch_call_t *call = x->call;
        bool retry = dec->state == TALLY_EFFECT_PLANNED;
        bool error = dec->error_code[0] != '\0';
        tally_jtext_t td = {0};
        tally_jtext_begin(&td, NULL);
        tally_jtext_int(&td, "lease_epoch", (long long)call->epoch);
        tally_jtext_int(&td, "attempt", call->attempts);
        if (error) {
            tally_jtext_begin(&td, "error");
            tally_jtext_str(&td, "code", dec->error_code);
            tally_jtext_str(&td, "message", dec->error_message);
            tally_jtext_end(&td);
        }
        if (retry)
            tally_jtext_int(&td, "retry_in_ms", dec->delay_ms);
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
        /* An outcome the relay can build again from the ledger alone (tally_relay_ref_event)
         * reports this transition by its id: its receipt is the effect's (CONFIRMED), or it
         * has none. */
        bool by_ref = !retry && (dec->state == TALLY_EFFECT_CONFIRMED || x->receipt_text == NULL);
        x->transition_id[0] = '\0';
        if (by_ref)
            tally_uuid_v7(x->transition_id);
        ev.kind = "transition";
        ev.reason = error ? dec->error_message : NULL;
        ev.data_text = tdata;
        ev.event_id = by_ref ? x->transition_id : NULL;
        (void)tally_audit_move(ab, TALLY_MACHINE_EFFECT, TALLY_EFFECT_DISPATCHING, dec->state, &ev);
        free(tdata);
        if (!retry) {
            effect_view_t v = {.ev = recorded_event(x)};
            v.ev.receipt_text = x->receipt_text;
            v.ev.id = by_ref ? x->transition_id : NULL;
            if (!dispatch_publish_effect(d, ob, &v, NULL)) {
                tally_error_setc(err, TALLY_ERR_OOM, "out of memory");
                return false;
            }
        }
        if (dec->page_owner && alerts && !queue_page(alerts, x)) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory");
            return false;
        }
    }
    return true;
}

/* The events of SQL_RECORD_FINAL_REFS's references ('r' rows), built as the relay builds them
 * from the tables (tally_relay_ref_event): id and time as the statement returned them, the
 * receipt as the ledger holds it (its 'e' row), and the rest as this recorder wrote it into
 * the effect and the transition — the same values the relay reads back. Handed to the relay;
 * one that cannot be built here is published when its lease ends, from the tables. */
static void hand_refs(dispatcher_t *d, tally_relay_t *relay, const PGresult *res,
                      const dispatch_done_t *done, size_t n_done, const char *const *effect_ids)
{
    int n = PQntuples(res);
    const char **tids = calloc(n_done ? n_done : 1, sizeof *tids);
    tally_relay_msg_t *msgs = calloc((size_t)n ? (size_t)n : 1, sizeof *msgs);
    char **built = calloc((size_t)n ? (size_t)n : 1, sizeof *built);
    int *receipt_row = malloc((n_done ? n_done : 1) * sizeof *receipt_row);
    size_t *by_tid = NULL, *by_effect = NULL;
    size_t k = 0;
    if (tids && msgs && built && receipt_row) {
        for (size_t i = 0; i < n_done; i++) {
            tids[i] = done[i].transition_id[0] ? done[i].transition_id : NULL;
            receipt_row[i] = -1;
        }
        by_tid = tally_columns_positions(res, 4, tids, n_done);
        by_effect = tally_columns_positions(res, 1, effect_ids, n_done);
    }
    if (by_tid == NULL || by_effect == NULL) {
        TALLY_WARN("out of memory handing over the outcomes of %zu results; they are published "
                   "when their lease ends",
                   n_done);
        goto out;
    }
    for (int row = 0; row < n; row++)
        if (PQgetvalue(res, row, 0)[0] == 'e' && by_effect[row] != SIZE_MAX)
            receipt_row[by_effect[row]] = row;
    for (int row = 0; row < n; row++) {
        if (PQgetvalue(res, row, 0)[0] != 'r' || by_tid[row] == SIZE_MAX)
            continue;
        const dispatch_done_t *x = &done[by_tid[row]];
        int rr = receipt_row[by_tid[row]];
        bool has_receipt = rr >= 0 && !PQgetisnull(res, rr, 5);
        tally_effect_event_t e = recorded_event(x);
        e.source = d->source;
        e.id = PQgetvalue(res, row, 4);
        e.time = PQgetvalue(res, row, 7);
        char why[256];
        built[k] = tally_relay_ref_event(&e, has_receipt ? PQgetvalue(res, rr, 5) : NULL,
                                         has_receipt ? (size_t)PQgetlength(res, rr, 5) : 0, why,
                                         sizeof why);
        if (built[k] == NULL) {
            TALLY_WARN("the outcome event %s cannot be built (%s); it is published when its lease "
                       "ends",
                       e.id, why);
            continue;
        }
        msgs[k] =
            (tally_relay_msg_t){.id = atoll(PQgetvalue(res, row, 1)),
                                .topic = "outcomes",
                                .key = PQgetisnull(res, row, 3) ? NULL : PQgetvalue(res, row, 3),
                                .event_id = e.id,
                                .payload = built[k],
                                .payload_len = strlen(built[k])};
        k++;
    }
    if (k > 0)
        (void)tally_relay_hand(relay, msgs, k);
out:
    for (size_t i = 0; built && i < k; i++)
        free(built[i]);
    free(built);
    free(msgs);
    free(tids);
    free(receipt_row);
    free(by_tid);
    free(by_effect);
}

/* SQL_RECORD_FINAL: the events and messages are built for every row first; @p won then says
 * which rows the statement wrote. */
static bool record_final(dispatcher_t *d, dispatch_done_t *done, size_t n_done,
                         const char *const *ids, const char *rows, int rows_len, const char *n_rows,
                         bool *won, tally_audit_batch_t *ab, tally_outbox_batch_t *ob,
                         tally_error_t *err)
{
    for (size_t i = 0; i < n_done; i++)
        won[i] = true;
    if (!record_events(d, done, n_done, won, ab, ob, NULL, err))
        return false;
    const char *why_ev = "", *why_mo = "";
    int lengths[6] = {rows_len, 0, 0, 0, 0, 0};
    int formats[6] = {1, 1, 1, 0, 0, 0};
    const char *ev = tally_audit_batch_param(ab, &lengths[1], &why_ev);
    const char *mo = tally_outbox_batch_param(ob, &lengths[2], &why_mo);
    if (!ev || !mo) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "results not written: %s",
                                   !ev ? why_ev : why_mo);
        return false;
    }
    tally_relay_t *relay = tally_worker_relay(d->w);
    char lease[16];
    snprintf(lease, sizeof lease, "%d", TALLY_RELAY_HAND_LEASE_MS);
    const char *params[6] = {rows, ev, mo, relay ? tally_relay_owner(relay) : NULL, lease, n_rows};
    bool refs = tally_worker_schema(d->w) >= TALLY_SCHEMA_MESSAGE_REFS;
    PGresult *res = tally_pg_exec_bin(d->rec_pg, refs ? SQL_RECORD_FINAL_REFS : SQL_RECORD_FINAL, 6,
                                      params, lengths, formats, err);
    if (!res)
        return false;
    /* Which rows it wrote ('e' rows). Out of memory for that, they all count as written: the
     * statement has committed, and only the log and the metrics would tell them apart. */
    size_t *pos = tally_columns_positions(res, 1, ids, n_done);
    if (pos) {
        memset(won, 0, n_done * sizeof *won);
        for (int row = 0; row < PQntuples(res); row++)
            if (PQgetvalue(res, row, 0)[0] == 'e' && pos[row] != SIZE_MAX)
                won[pos[row]] = true;
        free(pos);
    }
    /* Committed: the relay may publish the messages ('m' rows, and the references: 'r') now. */
    (void)tally_relay_hand_result(relay, res, 0, 'm');
    if (refs && relay != NULL)
        hand_refs(d, relay, res, done, n_done, ids);
    PQclear(res);
    return true;
}

/* SQL_RECORD's rows: which entries were written (@p won), and what each became — as decided,
 * or as the statement's override made it (tally_dispatch_overridden). @returns false when out
 * of memory. */
static bool record_returned(PGresult *res, dispatch_done_t *done, size_t n_done,
                            const char *const *ids, bool *won)
{
    size_t *pos = tally_columns_positions(res, 0, ids, n_done);
    if (!pos)
        return false;
    for (int row = 0; row < PQntuples(res); row++) {
        if (pos[row] == SIZE_MAX)
            continue;
        dispatch_done_t *hit = &done[pos[row]];
        won[pos[row]] = true;
        const char *became = PQgetvalue(res, row, 1);
        tally_effect_state_t state;
        if (!tally_effect_state_parse(became, &state) ||
            !tally_dispatch_overridden(&hit->dec, state, PQgetvalue(res, row, 2),
                                       PQgetvalue(res, row, 3))) {
            tally_log_ctx_t ctx = {.run_id = hit->call->run_id,
                                   .effect_id = hit->call->effect_id,
                                   .tool = hit->call->tool->name};
            TALLY_LOG(TALLY_LOG_ERROR, &ctx,
                      "the record statement wrote %s where %s was decided, and that is no "
                      "override of it; the events keep the decision",
                      became, tally_effect_state_name(hit->dec.state));
        }
    }
    free(pos);
    return true;
}

/* Write @p n finished calls in one transaction (on the recorder's connection). On success the
 * entries are released and @p due says when the earliest retry comes due (0: none); on a
 * database error they are left as they are, to be tried again, and @p err_out says why. */
static bool record_batch(dispatcher_t *d, dispatch_done_t *done, size_t n_done, double *due_out,
                         tally_error_t *err_out)
{
    double now = dispatch_now();
    tally_columns_t rows = {0}; /* $1 of the record statements (RECORDED_ROWS) */
    tally_columns_init(&rows, REC_COLS);
    bool *won = calloc(n_done, sizeof *won);
    const char **ids = calloc(n_done, sizeof *ids); /* what RETURNING rows name entries by */
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    tally_alert_batch_t *alerts = NULL;
    tally_error_t err;
    tally_error_clear(&err);
    PGresult *res = NULL;
    bool ok = false;
    size_t pages = 0;
    if (!won || !ids || !ab || !ob) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory");
        goto out;
    }
    bool final = true;
    for (size_t i = 0; i < n_done; i++) {
        dispatch_done_t *x = &done[i];
        ids[i] = x->call->effect_id;
        final = final && tally_dispatch_final(&x->dec);
        char epoch[24], delay[24];
        snprintf(epoch, sizeof epoch, "%lld", (long long)x->call->epoch);
        snprintf(delay, sizeof delay, "%lld", x->dec.delay_ms);
        const char *code = x->dec.error_code[0] ? x->dec.error_code : NULL;
        bool row = tally_columns_row_begin(&rows) &&
                   tally_columns_text(&rows, x->call->effect_id) &&
                   tally_columns_text(&rows, epoch) &&
                   tally_columns_text(&rows, tally_effect_state_name(x->dec.state)) &&
                   tally_columns_text(&rows, x->receipt_text) &&
                   tally_columns_text(&rows, x->external_ref) && tally_columns_text(&rows, code) &&
                   tally_columns_text(&rows, code ? x->dec.error_message : NULL) &&
                   tally_columns_text(&rows, delay) &&
                   tally_columns_text(&rows, x->dec.maybe_applied ? "t" : "f") &&
                   tally_columns_text(&rows, x->receipt_sealed);
        if (!tally_columns_row_end(&rows, row)) {
            if (rows.bad_text)
                tally_error_setc(&err, TALLY_ERR_INVALID_TEXT, "results not written: %s", rows.why);
            else
                tally_error_setc(&err, TALLY_ERR_OOM, "results not written: out of memory");
            goto out;
        }
    }
    int rows_len = 0;
    const char *param = tally_columns_param(&rows, &rows_len);
    char n_rows[24];
    snprintf(n_rows, sizeof n_rows, "%zu", rows.n);
    if (!param) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory");
        goto out;
    }
    if (final) {
        ok = record_final(d, done, n_done, ids, param, rows_len, n_rows, won, ab, ob, &err);
        goto out;
    }
    alerts = tally_alert_batch_new();
    if (!alerts) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory");
        goto out;
    }
    const char *params[2] = {param, n_rows};
    int lengths[2] = {rows_len, 0}, formats[2] = {1, 0};
    if (!tally_pg_begin(d->rec_pg, &err))
        goto out;
    res = tally_pg_exec_bin(d->rec_pg, SQL_RECORD, 2, params, lengths, formats, &err);
    if (!res)
        goto out;
    if (!record_returned(res, done, n_done, ids, won)) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory");
        goto out;
    }
    PGresult *handed = NULL;
    ok = record_events(d, done, n_done, won, ab, ob, alerts, &err);
    if (ok && !tally_alert_batch_flush(alerts, d->rec_pg, d->worker_id, d->source, ob, ab, &pages,
                                       &err)) {
        ok = false;
        /* PostgreSQL refused the pages themselves (a lost connection is a db error only) */
        if (!err.retriable)
            tally_metric_add(d->m_alert_fail, 1, "dispatcher");
    }
    ok = ok && tally_audit_batch_flush_as(ab, d->rec_pg, SQL_RECORD_EVENTS, &err) &&
         dispatch_flush_messages(d, d->rec_pg, ob, &handed, &err) &&
         tally_pg_commit(d->rec_pg, &err);
    if (ok)
        dispatch_hand_messages(d, handed);
    else
        PQclear(handed);
out:
    PQclear(res);
    free(ids);
    tally_columns_release(&rows);
    tally_audit_batch_free(ab);
    tally_outbox_batch_free(ob);
    tally_alert_batch_free(alerts);
    if (!ok) {
        tally_pg_rollback(d->rec_pg);
        free(won);
        d->rec_backoff_ms = (int)tally_backoff_step_ms(++d->rec_failures, 100, 2000);
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
    d->rec_failures = d->rec_backoff_ms = 0;
    if (pages > 0)
        TALLY_WARN("%zu page(s) opened for tools that refused tally's credentials (alerts "
                   "auth:<tool>)",
                   pages);
    double due = 0;
    for (size_t i = 0; i < n_done; i++) {
        dispatch_done_t *x = &done[i];
        dispatch_call_t *call = x->call;
        const char *became = tally_effect_state_name(x->dec.state);
        tally_log_ctx_t ctx = {
            .run_id = call->run_id, .effect_id = call->effect_id, .tool = call->tool->name};
        if (!won[i]) {
            /* Rule 3: the lease was taken over (or the effect moved on); write nothing. */
            tally_metric_add(d->m_lease_lost, 1);
            TALLY_LOG(TALLY_LOG_WARN, &ctx,
                      "lease epoch %lld was taken over before the result (%s) could be "
                      "recorded; the result is dropped",
                      call->epoch, became);
            dispatch_done_clear(x);
            continue;
        }
        tally_metric_observe(d->m_dispatch_seconds, now - call->claimed_at);
        switch (x->dec.state) {
        case TALLY_EFFECT_PLANNED: {
            double at = now + x->dec.delay_ms / 1000.0;
            if (due == 0 || at < due)
                due = at;
            TALLY_LOG(TALLY_LOG_INFO, &ctx, "attempt %d not applied (%s); retrying in %lld ms",
                      call->attempts, x->v.code, x->dec.delay_ms);
            break;
        }
        case TALLY_EFFECT_CONFIRMED:
            TALLY_LOG(TALLY_LOG_DEBUG, &ctx, "%s after attempt %d (%s)", became, call->attempts,
                      x->v.code);
            break;
        default:
            TALLY_LOG(TALLY_LOG_INFO, &ctx, "%s after attempt %d (%s)", became, call->attempts,
                      x->v.code);
            break;
        }
        dispatch_done_clear(x);
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
    if (x->receipt_text != NULL || x->dec.state == TALLY_EFFECT_CONFIRMED) {
        free(x->receipt_text);
        x->receipt_text = note != NULL ? note : strdup("{}");
    } else {
        free(note);
    }
    free(x->external_ref);
    x->external_ref = NULL;
    tally_dispatch_set_error(&x->dec, "protocol_error",
                             "PostgreSQL refused to store the tool's answer (%s); a note with an "
                             "excerpt is kept in its place",
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

void dispatch_done_clear(dispatch_done_t *x)
{
    dispatch_call_free(x->call);
    free(x->receipt_text);
    free(x->external_ref);
    free(x->receipt_sealed);
    free(x->call_record);
    memset(x, 0, sizeof *x);
}

bool recorder_queue(dispatcher_t *d, const dispatch_done_t *x)
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
        double t = dispatch_now();
        bool ok = record_batch(d, batch, n, &due, &err);
        size_t recorded = ok ? n : 0;
        if (!ok && tally_pg_error_is_data(&err)) {
            recorded = record_isolating(d, batch, &n, &due);
            ok = n == 0;
        }
        dispatch_spent(d, "record", t);

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
                    dispatch_done_clear(&batch[i]);
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

bool recorder_start(dispatcher_t *d)
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
    tally_pg_set_deadline(d->rec_pg, d->cfg->pg_deadline_ms);
    if (pthread_create(&d->rec_thread, NULL, recorder_main, d) != 0) {
        TALLY_ERROR("recorder: cannot start its thread");
        return false;
    }
    d->rec_started = true;
    return true;
}

void recorder_stop(dispatcher_t *d)
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
        dispatch_done_clear(&d->done[i]);
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

int recorder_collect(dispatcher_t *d)
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
    tally_connector_publish_inflight(d->conn, d->m_tool_inflight);
    return (int)n;
}

size_t recorder_pending(dispatcher_t *d)
{
    pthread_mutex_lock(&d->rec_mu);
    size_t n = d->n_done + (d->rec_busy ? 1 : 0);
    pthread_mutex_unlock(&d->rec_mu);
    return n;
}
