/* settle.c — every statement the compensator runs on runs: the end of a run's compensation
 * (DESIGN §7), and obligations for effects confirmed after it began.
 *
 * A run under compensation is settled when nothing of it can make progress on its own: no
 * obligation RUNNING or AWAITING_APPROVAL, no effect DISPATCHING or UNKNOWN, no CONFIRMED
 * effect without its obligation, and every PENDING obligation held behind a STUCK later step.
 * Then its summary is written to runs.summary, the run becomes COMPENSATED,
 * PARTIALLY_COMPENSATED or STUCK, and tally.run.compensated.v1 / tally.run.stuck.v1 goes out —
 * once per outcome (runs.summary_status). The runs are locked first (FOR UPDATE SKIP LOCKED),
 * and the check runs in a later statement, so it sees everything committed before the lock:
 * runops locks the same rows before it adds obligations. */
#include "compensator.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/audit.h"
#include "tally/cloudevent.h"
#include "tally/log.h"
#include "tally/outbox.h"
#include "tally/runsummary.h"

/* SQL assembled from fragments reads best one clause per line. */
// clang-format off

/* A PENDING obligation (o, e) held behind a STUCK later step of its run. */
#define BLOCKED(o, e)                                                                              \
    "(EXISTS (SELECT 1 FROM obligations ob JOIN effects eb ON eb.effect_id = ob.effect_id"         \
    "   WHERE ob.run_id = " o ".run_id AND ob.status = 'STUCK'"                                    \
    "     AND " COMP_SQL_STEP_KEY("eb") " > " COMP_SQL_STEP_KEY(e) ")"                             \
    " OR EXISTS (SELECT 1 FROM effects eb WHERE eb.run_id = " o ".run_id"                          \
    "   AND eb.status = 'STUCK' AND " COMP_SQL_STEP_KEY("eb") " > " COMP_SQL_STEP_KEY(e) "))"

/* Nothing of run r can make progress on its own. */
#define SETTLED(r)                                                                                 \
    " NOT EXISTS (SELECT 1 FROM obligations o WHERE o.run_id = " r ".run_id"                       \
    "   AND o.status IN ('RUNNING', 'AWAITING_APPROVAL'))"                                         \
    " AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.run_id = " r ".run_id"                       \
    "   AND e.status IN ('DISPATCHING', 'UNKNOWN'))"                                               \
    " AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.run_id = " r ".run_id"                       \
    "   AND e.status = 'CONFIRMED' AND NOT EXISTS (SELECT 1 FROM obligations o"                    \
    "     WHERE o.effect_id = e.effect_id"                                                         \
    "       AND o.external_ref IS NOT DISTINCT FROM e.external_ref))"                              \
    " AND NOT EXISTS (SELECT 1 FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"     \
    "   WHERE o.run_id = " r ".run_id AND o.status = 'PENDING' AND NOT " BLOCKED("o", "e") ")"

/* $1 JSON array of run ids or NULL for all, $2 limit. Only runs that look settled are
 * locked; SQL_SETTLED checks again once they are. A STUCK run is looked at again only while
 * its STUCK outcome is unpublished or once nothing of it is STUCK any more. */
static const char SQL_LOCK[] =
    "SELECT r.run_id FROM runs r"
    " WHERE r.status IN ('COMPENSATING', 'STUCK')"
    "   AND ($1::json IS NULL OR r.run_id IN (SELECT json_array_elements_text($1::json)))"
    "   AND (r.status = 'COMPENSATING' OR (EXISTS (SELECT 1 FROM obligations o"
    "       WHERE o.run_id = r.run_id AND o.reason IN ('compensate_run', 'cancel_run'))"
    "     AND (r.summary_status IS DISTINCT FROM 'STUCK'"
    "       OR (NOT EXISTS (SELECT 1 FROM obligations o WHERE o.run_id = r.run_id"
    "             AND o.status = 'STUCK')"
    "           AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.run_id = r.run_id"
    "             AND e.status = 'STUCK')))))"
    "   AND" SETTLED("r")
    " ORDER BY r.run_id LIMIT $2"
    " FOR UPDATE OF r SKIP LOCKED";

/* The locked runs that are settled (checked again: this statement sees everything committed
 * before the locks were taken), each with the ledger's view of every effect and obligation
 * (the items tally_runsum_settled reads). */
static const char SQL_SETTLED[] =
    "WITH s AS ("
    "  SELECT r.run_id, r.status, r.summary_status FROM runs r"
    "  WHERE r.run_id IN (SELECT json_array_elements_text($1::json))"
    "    AND" SETTLED("r") ")"
    " SELECT s.run_id, s.status, s.summary_status,"
    "  (SELECT ev.kind || coalesce(': ' || ev.reason, '') FROM events ev"
    "    WHERE ev.run_id = s.run_id AND ev.kind IN ('compensate_run', 'cancel_run')"
    "    ORDER BY ev.seq LIMIT 1),"
    "  (SELECT json_agg(json_build_object("
    "     'effect_id', e.effect_id, 'step', e.step, 'step_is_number', " TALLY_SQL_STEP_IS_NUMBER("e") ","
    "     'tool', e.tool, 'effect_class', e.effect_class, 'effect_status', e.status,"
    "     'effect_error', CASE WHEN e.error_code IS NOT NULL"
    "       THEN json_build_object('code', e.error_code, 'message', e.error_message) END,"
    "     'receipt', coalesce(o.receipt, e.receipt),"
    "     'external_ref', coalesce(o.external_ref, e.external_ref),"
    "     'obligation_id', o.obligation_id, 'obligation_status', o.status,"
    "     'obligation_reason', o.reason, 'status_reason', o.status_reason,"
    "     'error_code', o.error_code, 'error_message', o.error_message,"
    "     'reverse_receipt', o.reverse_receipt, 'blast_radius', o.blast_radius,"
    "     'attempts', o.attempts, 'blocked', o.status = 'PENDING',"
    "     'runbook', a.runbook, 'resolve_command', a.resolve_command)"
    "     ORDER BY e.step_num DESC NULLS FIRST, e.seq DESC, o.created_at)"
    "   FROM effects e LEFT JOIN obligations o ON o.effect_id = e.effect_id"
    "   LEFT JOIN alerts a ON a.dedup_key = 'obligation:' || o.obligation_id"
    "   WHERE e.run_id = s.run_id)::text"
    " FROM s";

static const char SQL_WRITE[] =
    "UPDATE runs r SET status = x.status, summary = x.summary, summary_status = x.status,"
    "  summary_at = now(), updated_at = now(),"
    "  status_reason = CASE WHEN x.status = r.status THEN r.status_reason ELSE x.reason END"
    " FROM json_to_recordset($1::json) AS x(run_id text, from_status text, status text,"
    "   reason text, summary jsonb)"
    " WHERE r.run_id = x.run_id AND r.status = x.from_status"
    " RETURNING r.run_id";

// clang-format on

/* One settled run: its summary, the update row, the event and the audit entry. */
static bool settle_one(compensator_t *c, PGresult *res, int row, json_t *updates,
                       tally_outbox_batch_t *ob, tally_audit_batch_t *ab)
{
    const char *run_id = PQgetvalue(res, row, 0);
    const char *status = PQgetvalue(res, row, 1);
    const char *reason = PQgetisnull(res, row, 3) ? NULL : PQgetvalue(res, row, 3);
    /* the states, parsed here once; a status the ledger would refuse is left by a transition */
    tally_run_state_t st, published;
    bool st_known = tally_run_state_parse(status, &st);
    bool was_published =
        !PQgetisnull(res, row, 2) && tally_run_state_parse(PQgetvalue(res, row, 2), &published);
    json_t *items =
        PQgetisnull(res, row, 4) ? json_array() : json_loads(PQgetvalue(res, row, 4), 0, NULL);
    tally_run_state_t outcome;
    json_t *summary = items != NULL ? tally_runsum_settled(run_id, reason, items, &outcome) : NULL;
    json_decref(items);
    if (summary == NULL) {
        return false;
    }
    comp_settle_t what = st_known
                             ? comp_policy_settle(st, was_published ? &published : NULL, outcome)
                             : COMP_SETTLE_TRANSITION;
    if (what == COMP_SETTLE_NONE) {
        json_decref(summary); /* this outcome is out already */
        return true;
    }
    const char *outcome_name = tally_run_state_name(outcome);
    bool ok =
        json_array_append_new(updates, json_pack("{s:s, s:s, s:s, s:s, s:O}", "run_id", run_id,
                                                 "from_status", status, "status", outcome_name,
                                                 "reason", reason != NULL ? reason : "compensation",
                                                 "summary", summary)) == 0;
    json_t *data = ok ? json_pack("{s:s, s:s, s:s?, s:O}", "run_id", run_id, "status", outcome_name,
                                  "reason", reason, "summary", summary)
                      : NULL;
    json_t *ce = data != NULL
                     ? tally_ce_new(comp_policy_run_event(outcome), c->source, run_id, data, NULL)
                     : NULL;
    if (ce != NULL) {
        tally_outbox_batch_add(ob, "outcomes", run_id, ce);
        json_t *counts = json_pack("{s:O}", "counts", json_object_get(summary, "counts"));
        tally_audit_event_t ev = {.run_id = run_id,
                                  .kind = what == COMP_SETTLE_SUMMARY ? "summary" : "transition",
                                  .actor = c->worker_id,
                                  .reason = "compensation settled: nothing more can progress",
                                  .data = counts};
        (void)tally_audit_move(ab, TALLY_MACHINE_RUN, st_known ? (int)st : TALLY_RUN__COUNT,
                               (int)outcome, &ev);
        json_decref(counts);
        json_t *cnt = json_object_get(summary, "counts");
        TALLY_LOG(outcome == TALLY_RUN_STUCK ? TALLY_LOG_ERROR : TALLY_LOG_INFO,
                  (&(tally_log_ctx_t){.run_id = run_id}),
                  "run %s: %lld compensated, %lld uncompensatable, %lld skipped, %lld failed",
                  outcome_name, (long long)json_integer_value(json_object_get(cnt, "compensated")),
                  (long long)json_integer_value(json_object_get(cnt, "uncompensatable")),
                  (long long)json_integer_value(json_object_get(cnt, "skipped")),
                  (long long)json_integer_value(json_object_get(cnt, "failed")));
        tally_metric_add(c->m_runs, 1, outcome_name);
    }
    json_decref(ce);
    json_decref(summary);
    return ce != NULL;
}

int comp_settle(compensator_t *c, const json_t *run_ids)
{
    if (run_ids != NULL && json_array_size(run_ids) == 0) {
        return 0;
    }
    char *ids_text = run_ids != NULL ? json_dumps(run_ids, JSON_COMPACT) : NULL;
    if (run_ids != NULL && ids_text == NULL) {
        return -1;
    }
    tally_error_t err;
    tally_error_clear(&err);
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    tally_audit_batch_t *ab = tally_audit_batch_new();
    json_t *locked = json_array(), *updates = json_array();
    PGresult *res = NULL;
    int n = -1;
    if (ob == NULL || ab == NULL || locked == NULL || updates == NULL) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory settling runs");
        goto out;
    }
    if (!tally_pg_begin(c->pg, &err)) {
        goto out;
    }
    char lim[16];
    snprintf(lim, sizeof lim, "%d", c->cfg->batch_size);
    const char *lock_params[2] = {ids_text, lim};
    res = tally_pg_exec(c->pg, SQL_LOCK, 2, lock_params, &err);
    if (res == NULL) {
        goto out;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        json_array_append_new(locked, json_string(PQgetvalue(res, row, 0)));
    }
    PQclear(res);
    res = NULL;
    if (json_array_size(locked) == 0) {
        tally_pg_rollback(c->pg);
        n = 0;
        goto out;
    }
    res = tally_pg_exec_json(c->pg, SQL_SETTLED, locked, &err);
    if (res == NULL) {
        goto out;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        if (!settle_one(c, res, row, updates, ob, ab)) {
            tally_error_setc(&err, TALLY_ERR_OOM, "out of memory building a run summary");
            goto out;
        }
    }
    PQclear(res);
    res = NULL;
    if (json_array_size(updates) > 0) {
        res = tally_pg_exec_json(c->pg, SQL_WRITE, updates, &err);
        if (res == NULL) {
            goto out;
        }
        if ((size_t)PQntuples(res) != json_array_size(updates)) {
            tally_error_setc(&err, TALLY_ERR_CONFLICT, "a run changed status under its lock");
            goto out;
        }
    }
    if (!tally_audit_batch_flush(ab, c->pg, &err) || !tally_outbox_batch_flush(ob, c->pg, &err) ||
        !tally_pg_commit(c->pg, &err)) {
        goto out;
    }
    n = (int)json_array_size(updates);
out:
    if (n < 0) {
        tally_pg_rollback(c->pg);
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL, "settling runs (retried at the next sweep): %s",
                            err.message);
        tally_metric_add(c->m_db_errors, 1, "settle");
    }
    PQclear(res);
    free(ids_text);
    json_decref(locked);
    json_decref(updates);
    tally_outbox_batch_free(ob);
    tally_audit_batch_free(ab);
    return n;
}

/* The late-confirmation sweep reads the COMPENSATED and PARTIALLY_COMPENSATED runs on the
 * first sweep and then on every this many (30 s at the default TALLY_SWEEP_MS): they are every
 * run ever compensated, an effect of one is seldom confirmed later, and reading them grows with
 * the ledger (bench/README.md, "late-confirmation sweep"). COMPENSATING and STUCK runs are read
 * on every sweep. */
#define SETTLED_SWEEP_EVERY 30

int comp_sweep_confirmed(compensator_t *c)
{
    tally_error_t err;
    tally_error_clear(&err);
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    tally_audit_batch_t *ab = tally_audit_batch_new();
    size_t created = 0;
    bool settled = c->settled_sweep_in <= 0;
    bool ok = ob != NULL && ab != NULL && tally_pg_begin(c->pg, &err) &&
              tally_runops_sweep_confirmed(c->pg, c->cfg->batch_size, settled, c->worker_id,
                                           c->source, ob, ab, &created, &err) &&
              tally_audit_batch_flush(ab, c->pg, &err) &&
              tally_outbox_batch_flush(ob, c->pg, &err) && tally_pg_commit(c->pg, &err);
    if (!ok) {
        tally_pg_rollback(c->pg);
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                            "creating obligations for late confirmations: %s",
                            err.message[0] != '\0' ? err.message : "out of memory");
        tally_metric_add(c->m_db_errors, 1, "sweep");
    } else {
        c->settled_sweep_in = settled ? SETTLED_SWEEP_EVERY - 1 : c->settled_sweep_in - 1;
        if (created > 0)
            TALLY_INFO("%zu effects confirmed after their run's compensation began: "
                       "obligations created",
                       created);
    }
    tally_outbox_batch_free(ob);
    tally_audit_batch_free(ab);
    return ok ? (int)created : -1;
}
