/* runops.c — run-level operations of DESIGN §7 and the compensation decision table.
 *
 * Every statement handles a whole batch of runs (values travel as one JSON parameter) and runs
 * in the caller's transaction; the caller flushes the queued audit and outbox events and
 * commits. Lock order: runs, then the dispatch outbox, then effects — the dispatcher's intake
 * locks runs before effects and its claim locks outbox before effects, so none of these can
 * deadlock with each other. */
#include "tally/runops.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/cloudevent.h"
#include "tally/ledger.h"
#include "tally/text.h"

/* ---------------------------------------------------------------------------------------- */
/* The decision table                                                                       */

const char *tally_comp_action_name(tally_comp_action_t a)
{
    switch (a) {
    case TALLY_COMP_ACT_SKIP:
        return "skip";
    case TALLY_COMP_ACT_REVERSE:
        return "reverse";
    case TALLY_COMP_ACT_RECORD:
        return "record";
    case TALLY_COMP_ACT_CONTAIN:
        return "contain";
    case TALLY_COMP_ACT_ESCALATE:
        return "escalate";
    case TALLY_COMP_ACT_AWAIT_APPROVAL:
        return "await_approval";
    case TALLY_COMP_ACT_RUNBOOK:
        return "runbook";
    case TALLY_COMP_ACT_NOT_SUPPORTED:
        return "not_supported";
    case TALLY_COMP_ACT_NO_TOOL:
        return "no_tool";
    }
    return "unknown";
}

static void decided(tally_comp_decision_t *out, tally_comp_action_t action, const char *to_status,
                    const char *code, const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static void decided(tally_comp_decision_t *out, tally_comp_action_t action, const char *to_status,
                    const char *code, const char *fmt, ...)
{
    out->action = action;
    out->to_status = to_status;
    out->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->why, sizeof out->why, fmt, ap);
    va_end(ap);
}

void tally_comp_decide(const tally_tool_t *tool, const char *tool_name, tally_effect_class_t cls,
                       bool approved, tally_comp_decision_t *out)
{
    const char *name = tool != NULL ? tool->name : (tool_name != NULL ? tool_name : "?");
    switch (cls) {
    case TALLY_CLASS_READ:
        decided(out, TALLY_COMP_ACT_SKIP, "SKIPPED", "read_only",
                "tool '%s' is a read: it changed nothing, so there is nothing to undo", name);
        return;
    case TALLY_CLASS_IDEMPOTENT:
        decided(out, TALLY_COMP_ACT_SKIP, "SKIPPED", "idempotent",
                "tool '%s' is idempotent: its effect is not reversed by compensation (DESIGN §4)",
                name);
        return;
    case TALLY_CLASS_DESTRUCTIVE:
        decided(out, TALLY_COMP_ACT_ESCALATE, "UNCOMPENSATABLE", "destructive",
                "tool '%s' is destructive: it cannot be undone; the blast radius is recorded and "
                "a human is paged",
                name);
        return;
    case TALLY_CLASS_REVERSIBLE:
        break;
    case TALLY_CLASS_APPEND_ONLY:
        if (tool == NULL) {
            decided(out, TALLY_COMP_ACT_RECORD, "UNCOMPENSATABLE", "append_only",
                    "tool '%s' is append-only and no longer in the registry: it cannot be undone "
                    "and no containment action is known; the blast radius is recorded",
                    name);
            return;
        }
        switch (tool->comp_mode) {
        case TALLY_COMP_MANUAL_RUNBOOK:
            decided(out, TALLY_COMP_ACT_RUNBOOK, "STUCK", "manual_runbook",
                    "tool '%s' is append-only with compensation.mode manual_runbook: a human "
                    "follows the runbook (%s)",
                    name, tool->runbook != NULL ? tool->runbook : "none declared");
            return;
        case TALLY_COMP_NOT_SUPPORTED:
            decided(out, TALLY_COMP_ACT_RECORD, "UNCOMPENSATABLE", "append_only",
                    "tool '%s' is append-only (compensation.mode not_supported): it cannot be "
                    "undone; the blast radius is recorded",
                    name);
            return;
        case TALLY_COMP_AUTOMATIC:
        case TALLY_COMP_APPROVAL_REQUIRED:
            break;
        }
        if (tool->contain.path == NULL) {
            decided(out, TALLY_COMP_ACT_RECORD, "UNCOMPENSATABLE", "append_only",
                    "tool '%s' is append-only: it cannot be undone and declares no containment "
                    "action; the blast radius is recorded",
                    name);
        } else if (tool->comp_mode == TALLY_COMP_APPROVAL_REQUIRED && !approved) {
            decided(out, TALLY_COMP_ACT_AWAIT_APPROVAL, "AWAITING_APPROVAL", "approval_required",
                    "tool '%s' requires approval before its containment action runs", name);
        } else {
            decided(out, TALLY_COMP_ACT_CONTAIN, "UNCOMPENSATABLE", "append_only",
                    "tool '%s' is append-only: it cannot be undone; the blast radius is recorded "
                    "and its containment action is %s %s",
                    name, tool->contain.method != NULL ? tool->contain.method : "POST",
                    tool->contain.path);
        }
        return;
    }

    /* reversible */
    if (tool == NULL) {
        decided(out, TALLY_COMP_ACT_NO_TOOL, "STUCK", "unknown_tool",
                "tool '%s' is no longer in the registry: tally does not know how to reverse it",
                name);
        return;
    }
    switch (tool->comp_mode) {
    case TALLY_COMP_MANUAL_RUNBOOK:
        decided(out, TALLY_COMP_ACT_RUNBOOK, "STUCK", "manual_runbook",
                "tool '%s' has compensation.mode manual_runbook: a human reverses it following "
                "the runbook (%s)",
                name, tool->runbook != NULL ? tool->runbook : "none declared");
        return;
    case TALLY_COMP_NOT_SUPPORTED:
        decided(out, TALLY_COMP_ACT_NOT_SUPPORTED, "UNCOMPENSATABLE", "not_supported",
                "tool '%s' has compensation.mode not_supported: tally does not reverse it", name);
        return;
    case TALLY_COMP_APPROVAL_REQUIRED:
        if (!approved) {
            decided(out, TALLY_COMP_ACT_AWAIT_APPROVAL, "AWAITING_APPROVAL", "approval_required",
                    "tool '%s' has compensation.mode approval_required: the reverse call waits "
                    "for `tally approve --obligation`",
                    name);
            return;
        }
        break;
    case TALLY_COMP_AUTOMATIC:
        break;
    }
    if (tool->compensate.path == NULL) {
        decided(out, TALLY_COMP_ACT_NO_TOOL, "STUCK", "no_compensate_endpoint",
                "tool '%s' is reversible but declares no connector.compensate endpoint", name);
        return;
    }
    decided(out, TALLY_COMP_ACT_REVERSE, "RUNNING", "reverse", "tool '%s' is reversible: %s %s%s",
            name, tool->compensate.method != NULL ? tool->compensate.method : "POST",
            tool->base_url != NULL ? tool->base_url : "", tool->compensate.path);
}

/* ---------------------------------------------------------------------------------------- */
/* SQL                                                                                      */

/* SQL: timestamptz @p X as RFC 3339 in UTC with milliseconds, as tally writes times. */
#define SQL_RFC3339(X) "to_char((" X ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"

static const char SQL_LOCK_RUNS[] = "SELECT run_id, status, " SQL_RFC3339(
    "compensation_deadline_at") " FROM runs"
                                " WHERE run_id IN (SELECT json_array_elements_text($1::json))"
                                " ORDER BY run_id FOR UPDATE";

/* The compensation deadline a request asks for: now() + deadline_ms, unless the run has an
 * earlier one still running (a redelivered request, or a second one asking for more time, never
 * moves it later; one that has passed is replaced). The shortest wins when a batch asks twice. */
static const char SQL_DEADLINE[] =
    "UPDATE runs r SET compensation_deadline_at = CASE"
    "   WHEN r.compensation_deadline_at > now()"
    "   THEN least(r.compensation_deadline_at, now() + x.ms * interval '1 millisecond')"
    "   ELSE now() + x.ms * interval '1 millisecond' END"
    " FROM (SELECT run_id, min(ms) AS ms FROM json_to_recordset($1::json) AS q(run_id text,"
    "   ms bigint) GROUP BY run_id) x"
    " WHERE r.run_id = x.run_id"
    " RETURNING r.run_id, " SQL_RFC3339("r.compensation_deadline_at");

/* Outbox rows first, then the effects (the dispatcher's claim locks them in that order). A row
 * a dispatcher already claimed belongs to an effect that is DISPATCHING and is left alone.
 * So is a PLANNED effect an earlier attempt of which may have been applied (an idempotent
 * tool's retry after a timeout or 5xx; TALLY_SQL_MAYBE_APPLIED): CANCELLED would say it never
 * happened. Its retry goes out with the same key, which an idempotent tool answers with what it
 * did; a retry that is refused again becomes UNKNOWN (SQL_RECORD in dispatcher/deliver.c). */
// clang-format off
static const char SQL_CANCEL_OUTBOX[] =
    "DELETE FROM outbox o USING effects e"
    " WHERE o.effect_id = e.effect_id AND e.status = 'PLANNED'"
    "   AND e.run_id IN (SELECT run_id FROM json_to_recordset($1::json) AS r(run_id text))"
    "   AND NOT " TALLY_SQL_MAYBE_APPLIED("e");

static const char SQL_CANCEL_EFFECTS[] =
    "WITH req AS (SELECT run_id, reason FROM json_to_recordset($1::json)"
    "   AS r(run_id text, reason text)),"
    " old AS (SELECT e.effect_id, e.status FROM effects e JOIN req USING (run_id)"
    "   WHERE e.status IN ('PLANNED', 'AWAITING_APPROVAL')"
    "     AND NOT (e.status = 'PLANNED' AND " TALLY_SQL_MAYBE_APPLIED("e") ")"
    "   ORDER BY e.effect_id FOR UPDATE OF e)"
    " UPDATE effects e SET status = 'CANCELLED',"
    "   status_reason = 'cancel_run' || coalesce(': ' || req.reason, ''),"
    "   lease_owner = NULL, lease_until = NULL, updated_at = now()"
    " FROM old, req"
    " WHERE e.effect_id = old.effect_id AND e.run_id = req.run_id"
    "   AND e.status IN ('PLANNED', 'AWAITING_APPROVAL')"
    " RETURNING e.effect_id::text, e.run_id, old.status, e.step, " TALLY_SQL_STEP_IS_NUMBER("e") ", e.tool,"
    "   e.operation_key, e.attempts, e.intent_id";
// clang-format on

/* One obligation per CONFIRMED effect, last step first; asking twice creates nothing new
 * (UNIQUE NULLS NOT DISTINCT (effect_id, external_ref)). */
static const char SQL_OBLIGATIONS[] =
    "WITH req AS (SELECT run_id, kind FROM json_to_recordset($1::json)"
    "   AS r(run_id text, kind text))"
    " INSERT INTO obligations (obligation_id, run_id, effect_id, reason, external_ref, receipt)"
    " SELECT gen_random_uuid(), e.run_id, e.effect_id, req.kind, e.external_ref, e.receipt"
    " FROM effects e JOIN req USING (run_id)"
    " WHERE e.status = 'CONFIRMED'"
    " ORDER BY e.run_id, e.step_num DESC NULLS FIRST, e.seq DESC"
    " ON CONFLICT (effect_id, external_ref) DO NOTHING"
    " RETURNING obligation_id::text, run_id, effect_id::text, reason, external_ref";

static const char SQL_COUNTS[] =
    "SELECT run_id, count(*) FILTER (WHERE status = 'CONFIRMED'),"
    "   count(*) FILTER (WHERE status IN ('DISPATCHING', 'UNKNOWN'))"
    " FROM effects WHERE run_id IN (SELECT json_array_elements_text($1::json))"
    " GROUP BY run_id";

static const char SQL_RUN_STATUS[] =
    "UPDATE runs r SET status = x.status, status_reason = x.reason, updated_at = now()"
    " FROM json_to_recordset($1::json) AS x(run_id text, from_status text, status text,"
    "   reason text)"
    " WHERE r.run_id = x.run_id AND r.status = x.from_status"
    " RETURNING r.run_id";

/* Runs under compensation in the states @p STATES: COMPENSATING, or settled/STUCK runs that had
 * compensation obligations. Their CONFIRMED effects without an obligation for their own
 * external ref (an effect confirmed after compensation began) get one, with the reason of the
 * run's first. The states are literals so the partial index runs_compensation_idx serves them. */
// clang-format off
#define SQL_SWEEP_CONFIRMED(STATES)                                                                \
    "WITH cand AS ("                                                                               \
    "  SELECT e.effect_id, e.run_id, e.external_ref, e.receipt,"                                   \
    "    coalesce((SELECT o.reason FROM obligations o WHERE o.run_id = e.run_id"                   \
    "      AND o.reason IN ('compensate_run', 'cancel_run') ORDER BY o.created_at LIMIT 1),"       \
    "      'compensate_run') AS reason"                                                            \
    "  FROM runs r JOIN effects e ON e.run_id = r.run_id"                                          \
    "  WHERE r.status IN (" STATES ")"                                                             \
    "    AND (r.status = 'COMPENSATING' OR EXISTS (SELECT 1 FROM obligations o"                    \
    "      WHERE o.run_id = r.run_id AND o.reason IN ('compensate_run', 'cancel_run')))"           \
    "    AND e.status = 'CONFIRMED'"                                                               \
    "    AND NOT EXISTS (SELECT 1 FROM obligations o"                                              \
    "      WHERE " TALLY_SQL_OWN_OBLIGATION("o", "e") ")"                                          \
    "  ORDER BY e.run_id, e.step_num DESC NULLS FIRST, e.seq DESC"                                 \
    "  LIMIT $1),"                                                                                 \
    " ins AS ("                                                                                    \
    "  INSERT INTO obligations (obligation_id, run_id, effect_id, reason, external_ref, receipt)"  \
    "  SELECT gen_random_uuid(), run_id, effect_id, reason, external_ref, receipt FROM cand"       \
    "  ON CONFLICT (effect_id, external_ref) DO NOTHING"                                           \
    "  RETURNING obligation_id, run_id, effect_id, reason, external_ref),"                         \
    " ru AS ("                                                                                     \
    "  UPDATE runs r SET status = 'COMPENSATING',"                                                 \
    "    status_reason = 'an effect was confirmed after the compensation had ended',"              \
    "    updated_at = now()"                                                                       \
    "  FROM runs old"                                                                              \
    "  WHERE old.run_id = r.run_id AND r.run_id IN (SELECT run_id FROM ins)"                       \
    "    AND r.status IN ('COMPENSATED', 'PARTIALLY_COMPENSATED')"                                 \
    "  RETURNING r.run_id, old.status)"                                                            \
    " SELECT 'obligation', obligation_id::text, run_id, effect_id::text, reason, external_ref"     \
    " FROM ins"                                                                                    \
    " UNION ALL SELECT 'run', NULL, run_id, NULL, status, NULL FROM ru"
// clang-format on

/* COMPENSATING and STUCK runs: the ones whose effects may still move. */
static const char SQL_SWEEP_CONFIRMED_OPEN[] = SQL_SWEEP_CONFIRMED("'COMPENSATING', 'STUCK'");

/* Every run that had compensation, the settled ones (whose number grows with the ledger's
 * history) included. */
static const char SQL_SWEEP_CONFIRMED_ALL[] =
    SQL_SWEEP_CONFIRMED("'COMPENSATING', 'COMPENSATED', 'PARTIALLY_COMPENSATED', 'STUCK'");

static const char SQL_PLAN_RUN[] = "SELECT status FROM runs WHERE run_id = $1";

/* The summary a compensation ended with (runs.summary, written by the compensator). */
static const char SQL_RUN_SUMMARY[] =
    "SELECT summary::text, status_reason FROM runs WHERE run_id = $1 AND summary ? 'counts'";

// clang-format off
static const char SQL_PLAN_EFFECTS[] =
    "SELECT e.effect_id::text, e.step, " TALLY_SQL_STEP_IS_NUMBER("e") ", e.tool, e.effect_class,"
    "  e.status, e.external_ref, e.receipt->>'version',"
    "  (SELECT json_build_object('obligation_id', o.obligation_id, 'status', o.status,"
    "     'reason', o.reason, 'external_ref', o.external_ref,"
    "     'approved', o.approved_at IS NOT NULL)"
    "   FROM obligations o WHERE " TALLY_SQL_OWN_OBLIGATION("o", "e") ")::text,"
    "  (SELECT json_agg(json_build_object('obligation_id', o.obligation_id,"
    "     'status', o.status, 'reason', o.reason, 'external_ref', o.external_ref)"
    "     ORDER BY o.created_at)"
    "   FROM obligations o WHERE o.effect_id = e.effect_id"
    "     AND NOT " TALLY_SQL_OWN_OBLIGATION("o", "e") ")::text"
    " FROM effects e WHERE e.run_id = $1"
    " ORDER BY e.step_num DESC NULLS FIRST, e.seq DESC";
// clang-format on

static const char SQL_APPROVE[] =
    "UPDATE obligations SET status = $2,"
    "  approved_at = CASE WHEN $2 = 'PENDING' THEN now() END,"
    "  approved_by = CASE WHEN $2 = 'PENDING' THEN $3 END,"
    "  status_reason = CASE WHEN $2 = 'SKIPPED' THEN 'denied' ELSE status_reason END,"
    "  finished_at = CASE WHEN $2 = 'SKIPPED' THEN now() END,"
    "  next_attempt_at = now(), updated_at = now()"
    " WHERE obligation_id IN (SELECT json_array_elements_text($1::json)::uuid)"
    "   AND status = 'AWAITING_APPROVAL'"
    " RETURNING obligation_id::text, run_id, effect_id::text";

/* ---------------------------------------------------------------------------------------- */
/* Helpers                                                                                  */

static const char *nullable(PGresult *res, int row, int col)
{
    return PQgetisnull(res, row, col) ? NULL : PQgetvalue(res, row, col);
}

/* A tally.run.<what>.v1 on topic "outcomes" (key and subject: the run id; its replies get a
 * copy): data {run_id, status, reason (when given), and the members of @p extra (stolen)}. */
static bool queue_run_event(const char *type, const char *run_id, const char *status,
                            const char *reason, json_t *extra, const char *source,
                            tally_outbox_batch_t *ob)
{
    json_t *data = json_pack("{s:s, s:s}", "run_id", run_id, "status", status);
    if (data != NULL && reason != NULL &&
        json_object_set_new(data, "reason", json_string(reason)) != 0) {
        json_decref(data);
        data = NULL;
    }
    if (data != NULL && extra != NULL && json_object_update(data, extra) != 0) {
        json_decref(data);
        data = NULL;
    }
    json_decref(extra);
    if (data == NULL) {
        return false;
    }
    json_t *ce = tally_ce_new(type, source, run_id, data, NULL);
    if (ce == NULL) {
        return false;
    }
    tally_outbox_batch_add(ob, "outcomes", run_id, ce);
    json_decref(ce);
    return true;
}

/* The audit event and the tally.obligation.v1 of one new obligation. */
static bool queue_obligation(const char *oid, const char *run_id, const char *eid,
                             const char *reason, const char *ref, const char *intent_id,
                             const char *actor, const char *source, tally_outbox_batch_t *ob,
                             tally_audit_batch_t *ab)
{
    json_t *data = json_pack("{s:s, s:s, s:s, s:s, s:o, s:s}", "obligation_id", oid, "run_id",
                             run_id, "effect_id", eid, "reason", reason, "external_ref",
                             ref != NULL ? json_string(ref) : json_null(), "status", "PENDING");
    if (data == NULL) {
        return false;
    }
    json_t *audit = json_deep_copy(data);
    if (audit == NULL || (intent_id != NULL &&
                          json_object_set_new(audit, "intent_id", json_string(intent_id)) != 0)) {
        json_decref(audit);
        json_decref(data);
        return false;
    }
    tally_audit_event_t ev = {.run_id = run_id,
                              .effect_id = eid,
                              .obligation_id = oid,
                              .kind = "obligation",
                              .actor = actor,
                              .reason = reason,
                              .data = audit};
    (void)tally_audit_move(ab, TALLY_MACHINE_OBLIGATION, -1, TALLY_OBLIGATION_PENDING, &ev);
    json_decref(audit);
    json_t *ce = tally_ce_new("tally.obligation.v1", source, run_id, data, NULL); /* takes data */
    if (ce == NULL) {
        return false;
    }
    tally_outbox_batch_add(ob, "obligations", run_id, ce);
    json_decref(ce);
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Compensate / cancel                                                                      */

/* What the batch knows about one run. */
typedef struct run_state {
    const char *run_id; /* borrowed from the request */
    bool found;
    tally_run_state_t initial; /* as locked */
    tally_run_state_t status;  /* after the requests so far */
    char reason[256];
    char deadline_at[32]; /* RFC 3339; "" for none */
    size_t confirmed, waiting, created, cancelled;
    bool created_counted, cancelled_counted;
} run_state_t;

static run_state_t *find_run(run_state_t *runs, size_t n, const char *run_id)
{
    for (size_t i = 0; i < n; i++) {
        if (strcmp(runs[i].run_id, run_id) == 0) {
            return &runs[i];
        }
    }
    return NULL;
}

static bool wants_compensation(const tally_runop_t *op)
{
    return op->kind == TALLY_RUNOP_COMPENSATE || op->compensate;
}

static const char *op_kind_name(const tally_runop_t *op)
{
    return op->kind == TALLY_RUNOP_CANCEL ? "cancel_run" : "compensate_run";
}

/* The run's status after @p op (DESIGN §3 runs: ACTIVE -> COMPENSATING -> ..., CANCELLED). */
static tally_run_state_t next_run_status(const tally_runop_t *op, const run_state_t *rs)
{
    bool compensate = wants_compensation(op);
    switch (rs->status) {
    case TALLY_RUN_ACTIVE:
    case TALLY_RUN_COMPLETING:
        return compensate ? TALLY_RUN_COMPENSATING : TALLY_RUN_CANCELLED;
    case TALLY_RUN_CANCELLED:
    case TALLY_RUN_COMPLETED:
        /* a completed (or cancelled) run can still be undone */
        return compensate ? TALLY_RUN_COMPENSATING : rs->status;
    case TALLY_RUN_COMPENSATED:
    case TALLY_RUN_PARTIALLY_COMPENSATED:
        /* undone already: again only when this request found something new to undo */
        return compensate && rs->created > 0 ? TALLY_RUN_COMPENSATING : rs->status;
    case TALLY_RUN_COMPENSATING:
    case TALLY_RUN_STUCK:
    case TALLY_RUN__COUNT:
        break;
    }
    return rs->status;
}

static bool lock_runs(tally_pg_t *pg, run_state_t *runs, size_t n_runs, tally_error_t *err)
{
    json_t *ids = json_array();
    for (size_t i = 0; ids != NULL && i < n_runs; i++) {
        if (json_array_append_new(ids, json_string(runs[i].run_id)) != 0) {
            json_decref(ids);
            ids = NULL;
        }
    }
    if (ids == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory listing the runs");
        return false;
    }
    PGresult *res = tally_pg_exec_json(pg, SQL_LOCK_RUNS, ids, err);
    if (res == NULL) {
        json_decref(ids);
        return false;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        run_state_t *rs = find_run(runs, n_runs, PQgetvalue(res, row, 0));
        if (rs == NULL) {
            continue;
        }
        if (!tally_run_state_parse(PQgetvalue(res, row, 1), &rs->initial)) {
            tally_error_setc(err, TALLY_ERR_INVALID,
                             "run %s has status '%s', which this version of tally does not know",
                             rs->run_id, PQgetvalue(res, row, 1));
            PQclear(res);
            json_decref(ids);
            return false;
        }
        rs->found = true;
        rs->status = rs->initial;
        snprintf(rs->deadline_at, sizeof rs->deadline_at, "%s", PQgetvalue(res, row, 2));
    }
    PQclear(res);
    res = tally_pg_exec_json(pg, SQL_COUNTS, ids, err);
    json_decref(ids);
    if (res == NULL) {
        return false;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        run_state_t *rs = find_run(runs, n_runs, PQgetvalue(res, row, 0));
        if (rs != NULL) {
            rs->confirmed = strtoull(PQgetvalue(res, row, 1), NULL, 10);
            rs->waiting = strtoull(PQgetvalue(res, row, 2), NULL, 10);
        }
    }
    PQclear(res);
    return true;
}

/* tally.effect.cancelled.v1 for one cancelled effect (DESIGN §5 effect event fields), so the
 * agent waiting on that intent hears that it will never run. Row layout of SQL_CANCEL_EFFECTS. */
static bool queue_cancelled_event(PGresult *res, int row, const char *source,
                                  tally_outbox_batch_t *ob)
{
    const char *run_id = PQgetvalue(res, row, 1);
    const char *step = PQgetvalue(res, row, 3);
    json_t *step_json = tally_step_json(step, PQgetvalue(res, row, 4)[0] == 't');
    json_t *data =
        json_pack("{s:s, s:s, s:o, s:s, s:s, s:s, s:n, s:n, s:n, s:I, s:s, s:s}", "effect_id",
                  PQgetvalue(res, row, 0), "run_id", run_id, "step", step_json, "tool",
                  PQgetvalue(res, row, 5), "operation_key", PQgetvalue(res, row, 6), "status",
                  "CANCELLED", "receipt", "external_ref", "error", "attempts",
                  (json_int_t)strtoll(PQgetvalue(res, row, 7), NULL, 10), "intent_id",
                  PQgetvalue(res, row, 8), "previous_status", PQgetvalue(res, row, 2));
    json_t *ce =
        data != NULL ? tally_ce_new("tally.effect.cancelled.v1", source, run_id, data, NULL) : NULL;
    if (ce == NULL)
        return false;
    tally_outbox_batch_add(ob, "outcomes", run_id, ce);
    json_decref(ce);
    return true;
}

static bool cancel_effects(tally_pg_t *pg, const tally_runop_t *ops, size_t n, run_state_t *runs,
                           size_t n_runs, const char *actor, const char *source,
                           tally_outbox_batch_t *ob, tally_audit_batch_t *ab, tally_error_t *err)
{
    json_t *req = json_array();
    if (req == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the cancel batch");
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        run_state_t *rs = find_run(runs, n_runs, ops[i].run_id);
        if (ops[i].kind != TALLY_RUNOP_CANCEL || !rs->found || rs->cancelled_counted) {
            continue;
        }
        rs->cancelled_counted = true; /* one row per run */
        json_array_append_new(
            req, json_pack("{s:s, s:s?}", "run_id", ops[i].run_id, "reason", ops[i].reason));
    }
    bool ok = true;
    if (json_array_size(req) > 0) {
        PGresult *res = tally_pg_exec_json(pg, SQL_CANCEL_OUTBOX, req, err);
        ok = res != NULL;
        PQclear(res);
        res = ok ? tally_pg_exec_json(pg, SQL_CANCEL_EFFECTS, req, err) : NULL;
        ok = res != NULL;
        for (int row = 0; ok && row < PQntuples(res); row++) {
            const char *run_id = PQgetvalue(res, row, 1);
            run_state_t *rs = find_run(runs, n_runs, run_id);
            if (rs != NULL) {
                rs->cancelled++;
            }
            tally_audit_event_t ev = {.run_id = run_id,
                                      .effect_id = PQgetvalue(res, row, 0),
                                      .actor = actor,
                                      .reason = "cancel_run"};
            tally_effect_state_t was = TALLY_EFFECT__COUNT;
            (void)tally_effect_state_parse(PQgetvalue(res, row, 2), &was);
            (void)tally_audit_move(ab, TALLY_MACHINE_EFFECT, (int)was, TALLY_EFFECT_CANCELLED, &ev);
            if (!queue_cancelled_event(res, row, source, ob)) {
                tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a cancelled event");
                ok = false;
            }
        }
        PQclear(res);
    }
    json_decref(req);
    return ok;
}

static bool create_obligations(tally_pg_t *pg, const tally_runop_t *ops, size_t n,
                               run_state_t *runs, size_t n_runs, const char *actor,
                               const char *source, tally_outbox_batch_t *ob,
                               tally_audit_batch_t *ab, tally_error_t *err)
{
    json_t *req = json_array();
    if (req == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the compensation batch");
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        run_state_t *rs = find_run(runs, n_runs, ops[i].run_id);
        if (!wants_compensation(&ops[i]) || !rs->found || rs->created_counted) {
            continue;
        }
        rs->created_counted = true; /* the first request for a run names the reason */
        json_array_append_new(
            req, json_pack("{s:s, s:s}", "run_id", ops[i].run_id, "kind", op_kind_name(&ops[i])));
    }
    bool ok = true;
    if (json_array_size(req) > 0) {
        PGresult *res = tally_pg_exec_json(pg, SQL_OBLIGATIONS, req, err);
        ok = res != NULL;
        for (int row = 0; ok && row < PQntuples(res); row++) {
            const char *run_id = PQgetvalue(res, row, 1);
            run_state_t *rs = find_run(runs, n_runs, run_id);
            const char *intent_id = NULL;
            for (size_t i = 0; i < n; i++) {
                if (strcmp(ops[i].run_id, run_id) == 0 && wants_compensation(&ops[i])) {
                    intent_id = ops[i].intent_id;
                    break;
                }
            }
            if (rs != NULL) {
                rs->created++;
            }
            if (!queue_obligation(PQgetvalue(res, row, 0), run_id, PQgetvalue(res, row, 2),
                                  PQgetvalue(res, row, 3), nullable(res, row, 4), intent_id, actor,
                                  source, ob, ab)) {
                tally_error_setc(err, TALLY_ERR_OOM, "out of memory building an obligation event");
                ok = false;
            }
        }
        PQclear(res);
    }
    json_decref(req);
    return ok;
}

/* The compensation deadlines the requests ask for (SQL_DEADLINE), one statement for the batch. */
static bool set_deadlines(tally_pg_t *pg, const tally_runop_t *ops, size_t n, run_state_t *runs,
                          size_t n_runs, tally_error_t *err)
{
    json_t *req = json_array();
    bool ok = req != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        const run_state_t *rs = find_run(runs, n_runs, ops[i].run_id);
        if (!wants_compensation(&ops[i]) || ops[i].deadline_ms <= 0 || !rs->found)
            continue;
        ok = json_array_append_new(req, json_pack("{s:s, s:i}", "run_id", ops[i].run_id, "ms",
                                                  ops[i].deadline_ms)) == 0;
    }
    if (!ok) {
        json_decref(req);
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the deadlines");
        return false;
    }
    if (json_array_size(req) > 0) {
        PGresult *res = tally_pg_exec_json(pg, SQL_DEADLINE, req, err);
        ok = res != NULL;
        for (int row = 0; ok && row < PQntuples(res); row++) {
            run_state_t *rs = find_run(runs, n_runs, PQgetvalue(res, row, 0));
            if (rs != NULL)
                snprintf(rs->deadline_at, sizeof rs->deadline_at, "%s", PQgetvalue(res, row, 1));
        }
        PQclear(res);
    }
    json_decref(req);
    return ok;
}

bool tally_runops_apply(tally_pg_t *pg, const tally_runop_t *ops, size_t n, const char *actor,
                        const char *source, tally_outbox_batch_t *ob, tally_audit_batch_t *ab,
                        tally_runop_result_t *results, tally_error_t *err)
{
    if (n == 0) {
        return true;
    }
    memset(results, 0, n * sizeof *results);
    run_state_t *runs = calloc(n, sizeof *runs);
    json_t *updates = json_array();
    bool ok = false;
    if (runs == NULL || updates == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the run batch");
        goto out;
    }
    size_t n_runs = 0;
    for (size_t i = 0; i < n; i++) {
        if (ops[i].run_id == NULL || ops[i].run_id[0] == '\0') {
            tally_error_setc(err, TALLY_ERR_INVALID, "request %zu names no run", i);
            goto out;
        }
        if (find_run(runs, n_runs, ops[i].run_id) == NULL) {
            runs[n_runs++].run_id = ops[i].run_id;
        }
    }
    if (!lock_runs(pg, runs, n_runs, err) ||
        !cancel_effects(pg, ops, n, runs, n_runs, actor, source, ob, ab, err) ||
        !create_obligations(pg, ops, n, runs, n_runs, actor, source, ob, ab, err) ||
        !set_deadlines(pg, ops, n, runs, n_runs, err)) {
        goto out;
    }

    /* The requests in order: each sees the status the previous one left. */
    for (size_t i = 0; i < n; i++) {
        const tally_runop_t *op = &ops[i];
        run_state_t *rs = find_run(runs, n_runs, op->run_id);
        tally_runop_result_t *r = &results[i];
        r->found = rs->found;
        if (!rs->found) {
            continue;
        }
        r->before = rs->status;
        tally_run_state_t next = next_run_status(op, rs);
        if (next != rs->status) {
            rs->status = next;
            /* the run's status_reason: cut on a character boundary (text.h) */
            tally_fmt(rs->reason, sizeof rs->reason, "%s%s%s", op_kind_name(op),
                      op->reason != NULL ? ": " : "", op->reason != NULL ? op->reason : "");
        }
        r->after = rs->status;
        snprintf(r->status_before, sizeof r->status_before, "%s", tally_run_state_name(r->before));
        snprintf(r->status_after, sizeof r->status_after, "%s", tally_run_state_name(r->after));
        r->effects_waiting = rs->waiting;
        snprintf(r->deadline_at, sizeof r->deadline_at, "%s", rs->deadline_at);
        if (wants_compensation(op)) {
            /* the counts belong to the first request of the run that asked */
            bool first = true;
            for (size_t j = 0; j < i; j++) {
                first = first &&
                        !(strcmp(ops[j].run_id, op->run_id) == 0 && wants_compensation(&ops[j]));
            }
            r->obligations_created = first ? rs->created : 0;
            r->obligations_existing = rs->confirmed - (first ? rs->created : 0);
        }
        if (op->kind == TALLY_RUNOP_CANCEL) {
            bool first = true;
            for (size_t j = 0; j < i; j++) {
                first = first && !(strcmp(ops[j].run_id, op->run_id) == 0 &&
                                   ops[j].kind == TALLY_RUNOP_CANCEL);
            }
            r->effects_cancelled = first ? rs->cancelled : 0;
        }
        json_t *data = json_pack(
            "{s:s?, s:b, s:s, s:s, s:I, s:I, s:I, s:I}", "intent_id", op->intent_id, "compensate",
            wants_compensation(op), "status_before", r->status_before, "status_after",
            r->status_after, "obligations_created", (json_int_t)r->obligations_created,
            "obligations_existing", (json_int_t)r->obligations_existing, "effects_cancelled",
            (json_int_t)r->effects_cancelled, "effects_waiting", (json_int_t)r->effects_waiting);
        if (data != NULL && wants_compensation(op) && op->deadline_ms > 0) {
            json_object_set_new(data, "deadline_ms", json_integer(op->deadline_ms));
            json_object_set_new(data, "compensation_deadline_at", json_string(r->deadline_at));
        }
        tally_audit_event_t ev = {.run_id = op->run_id,
                                  .kind = op_kind_name(op),
                                  .actor = actor,
                                  .reason = op->reason,
                                  .data = data};
        tally_audit_batch_add(ab, &ev);
        json_decref(data);
        /* A cancel without compensation is answered at once; one with compensation by the
         * compensation summary (tally.run.compensated.v1 / stuck), later. */
        if (r->found && op->kind == TALLY_RUNOP_CANCEL && !op->compensate &&
            !queue_run_event(
                "tally.run.cancelled.v1", op->run_id, r->status_after, op->reason,
                json_pack("{s:I}", "effects_cancelled", (json_int_t)r->effects_cancelled), source,
                ob)) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a run event");
            goto out;
        }
    }

    for (size_t i = 0; i < n_runs; i++) {
        run_state_t *rs = &runs[i];
        if (!rs->found || rs->initial == rs->status) {
            continue;
        }
        const char *from = tally_run_state_name(rs->initial);
        const char *to = tally_run_state_name(rs->status);
        if (json_array_append_new(updates, json_pack("{s:s, s:s, s:s, s:s}", "run_id", rs->run_id,
                                                     "from_status", from, "status", to, "reason",
                                                     rs->reason)) != 0) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the run updates");
            goto out;
        }
        tally_audit_event_t ev = {.run_id = rs->run_id, .actor = actor, .reason = rs->reason};
        (void)tally_audit_move(ab, TALLY_MACHINE_RUN, (int)rs->initial, (int)rs->status, &ev);
    }
    if (json_array_size(updates) > 0) {
        PGresult *res = tally_pg_exec_json(pg, SQL_RUN_STATUS, updates, err);
        if (res == NULL) {
            goto out;
        }
        int moved = PQntuples(res);
        PQclear(res);
        if ((size_t)moved != json_array_size(updates)) {
            /* cannot happen while the rows are locked; refuse rather than write half */
            tally_error_setc(err, TALLY_ERR_CONFLICT,
                             "%zu run(s) changed status under the lock; nothing written",
                             json_array_size(updates) - (size_t)moved);
            goto out;
        }
    }
    /* A compensation asked again of a run whose compensation is over, with nothing new to
     * undo, is answered with the summary it ended with, as a second complete_run is. */
    for (size_t i = 0; i < n; i++) {
        const tally_runop_result_t *r = &results[i];
        bool over = r->after == TALLY_RUN_COMPENSATED ||
                    r->after == TALLY_RUN_PARTIALLY_COMPENSATED || r->after == TALLY_RUN_STUCK;
        if (!r->found || !wants_compensation(&ops[i]) || r->obligations_created > 0 || !over) {
            continue;
        }
        const char *params[1] = {ops[i].run_id};
        PGresult *res = tally_pg_exec(pg, SQL_RUN_SUMMARY, 1, params, err);
        if (res == NULL) {
            goto out;
        }
        bool have = PQntuples(res) == 1 && !PQgetisnull(res, 0, 0);
        json_t *summary = have ? json_loads(PQgetvalue(res, 0, 0), 0, NULL) : NULL;
        const char *why = have && !PQgetisnull(res, 0, 1) ? PQgetvalue(res, 0, 1) : NULL;
        bool queued = summary == NULL ||
                      queue_run_event(r->after == TALLY_RUN_STUCK ? "tally.run.stuck.v1"
                                                                  : "tally.run.compensated.v1",
                                      ops[i].run_id, r->status_after, why,
                                      json_pack("{s:o}", "summary", summary), source, ob);
        PQclear(res);
        if (!queued) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a run event");
            goto out;
        }
    }
    ok = true;
out:
    free(runs);
    json_decref(updates);
    return ok;
}

bool tally_runops_sweep_confirmed(tally_pg_t *pg, int limit, bool settled, const char *actor,
                                  const char *source, tally_outbox_batch_t *ob,
                                  tally_audit_batch_t *ab, size_t *created, tally_error_t *err)
{
    *created = 0;
    char lim[16];
    snprintf(lim, sizeof lim, "%d", limit > 0 ? limit : 1);
    const char *params[1] = {lim};
    PGresult *res = tally_pg_exec(pg, settled ? SQL_SWEEP_CONFIRMED_ALL : SQL_SWEEP_CONFIRMED_OPEN,
                                  1, params, err);
    if (res == NULL) {
        return false;
    }
    bool ok = true;
    for (int row = 0; ok && row < PQntuples(res); row++) {
        const char *run_id = PQgetvalue(res, row, 2);
        if (strcmp(PQgetvalue(res, row, 0), "run") == 0) {
            tally_audit_event_t ev = {.run_id = run_id,
                                      .actor = actor,
                                      .reason = "an effect was confirmed after the compensation "
                                                "had ended"};
            tally_run_state_t was = TALLY_RUN__COUNT;
            (void)tally_run_state_parse(PQgetvalue(res, row, 4), &was);
            (void)tally_audit_move(ab, TALLY_MACHINE_RUN, (int)was, TALLY_RUN_COMPENSATING, &ev);
            continue;
        }
        (*created)++;
        if (!queue_obligation(PQgetvalue(res, row, 1), run_id, PQgetvalue(res, row, 3),
                              PQgetvalue(res, row, 4), nullable(res, row, 5), NULL, actor, source,
                              ob, ab)) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building an obligation event");
            ok = false;
        }
    }
    PQclear(res);
    return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* The plan                                                                                 */

static bool obligation_terminal(const char *status)
{
    tally_obligation_state_t s;
    return tally_obligation_state_parse(status, &s) && tally_obligation_state_terminal(s);
}

/* "what will happen" for a CONFIRMED effect to be compensated. */
static void plan_confirmed(const tally_tool_t *tool, const tally_comp_decision_t *dec,
                           const char *version, char *will, size_t willsz)
{
    switch (dec->action) {
    case TALLY_COMP_ACT_SKIP:
        snprintf(will, willsz, "mark the obligation SKIPPED");
        return;
    case TALLY_COMP_ACT_REVERSE:
        snprintf(will, willsz,
                 "call %s %s%s with Idempotency-Key reverse:<obligation id>%s%s once every later "
                 "step is settled",
                 tool->compensate.method != NULL ? tool->compensate.method : "POST", tool->base_url,
                 tool->compensate.path, version != NULL ? " and If-Match: " : "",
                 version != NULL ? version : "");
        return;
    case TALLY_COMP_ACT_RECORD:
        snprintf(will, willsz, "mark UNCOMPENSATABLE and record the blast radius");
        return;
    case TALLY_COMP_ACT_CONTAIN:
        snprintf(will, willsz,
                 "mark UNCOMPENSATABLE, record the blast radius and call the containment action "
                 "%s %s%s",
                 tool->contain.method != NULL ? tool->contain.method : "POST", tool->base_url,
                 tool->contain.path);
        return;
    case TALLY_COMP_ACT_ESCALATE:
        snprintf(will, willsz, "mark UNCOMPENSATABLE, record the blast radius and page (critical)");
        return;
    case TALLY_COMP_ACT_AWAIT_APPROVAL:
        snprintf(will, willsz,
                 "wait in AWAITING_APPROVAL until `tally approve --obligation <id>`, then act");
        return;
    case TALLY_COMP_ACT_RUNBOOK:
        snprintf(will, willsz, "go STUCK at once and page with the runbook %s",
                 tool != NULL && tool->runbook != NULL ? tool->runbook : "(none declared)");
        return;
    case TALLY_COMP_ACT_NOT_SUPPORTED:
        snprintf(will, willsz, "mark UNCOMPENSATABLE");
        return;
    case TALLY_COMP_ACT_NO_TOOL:
        snprintf(will, willsz, "go STUCK and page: a human must reverse it");
        return;
    }
}

/* After what the compensation does to the effect's own record, what became of the extra
 * copies a DUPLICATE found: they have obligations of their own, which it does not touch. */
static void plan_copies(const json_t *copies, char *will, size_t willsz)
{
    size_t i;
    json_t *c;
    json_array_foreach(copies, i, c)
    {
        const char *st = json_string_value(json_object_get(c, "status"));
        const char *ref = json_string_value(json_object_get(c, "external_ref"));
        size_t len = strlen(will);
        if (len + 1 >= willsz) {
            return;
        }
        tally_obligation_state_t os;
        bool reversed =
            st != NULL && tally_obligation_state_parse(st, &os) && os == TALLY_OBLIGATION_RESOLVED;
        snprintf(will + len, willsz - len,
                 "; the extra copy %s (a DUPLICATE) has its own obligation, %s%s, which this "
                 "leaves alone",
                 ref != NULL ? ref : "(no ref)", st != NULL ? st : "?",
                 reversed ? ": it was reversed already" : "");
    }
}

static json_t *plan_entry(const tally_registry_t *reg, const tally_runop_t *op, PGresult *res,
                          int row)
{
    const char *eid = PQgetvalue(res, row, 0);
    const char *tool_name = PQgetvalue(res, row, 3);
    const char *cls_name = PQgetvalue(res, row, 4);
    const char *status = PQgetvalue(res, row, 5);
    const char *version = nullable(res, row, 7);
    const tally_tool_t *tool = tally_registry_find(reg, tool_name);
    /* the obligation for the effect's own record, which the compensation creates and acts on
     * (TALLY_SQL_OWN_OBLIGATION), and those of a DUPLICATE's extra copies, told apart */
    json_t *obl = PQgetisnull(res, row, 8) ? NULL : json_loads(PQgetvalue(res, row, 8), 0, NULL);
    json_t *copies = PQgetisnull(res, row, 9) ? NULL : json_loads(PQgetvalue(res, row, 9), 0, NULL);
    const char *action = "none";
    char will[512] = "";
    char why[512] = "";
    const char *mode = tool != NULL ? tally_comp_mode_name(tool->comp_mode) : NULL;
    bool compensate = wants_compensation(op);
    tally_effect_state_t state;
    if (!tally_effect_state_parse(status, &state)) {
        state = TALLY_EFFECT__COUNT; /* a state this version does not know: "nothing" below */
    }

    switch (state) {
    case TALLY_EFFECT_CONFIRMED: {
        tally_effect_class_t cls = TALLY_CLASS_REVERSIBLE;
        bool known = tally_effect_class_parse(cls_name, &cls);
        tally_comp_decision_t dec;
        bool approved = obl != NULL && json_is_true(json_object_get(obl, "approved"));
        tally_comp_decide(tool, tool_name, cls, approved, &dec);
        if (!known) {
            dec.action = TALLY_COMP_ACT_NO_TOOL;
            snprintf(dec.why, sizeof dec.why, "effect class '%s' is not one tally knows", cls_name);
        }
        if (!compensate) {
            action = "keep";
            snprintf(will, sizeof will, "nothing: it stays as it is");
            snprintf(why, sizeof why, "cancel without compensate leaves confirmed effects alone");
        } else if (obl != NULL &&
                   obligation_terminal(json_string_value(json_object_get(obl, "status")))) {
            action = "done";
            snprintf(will, sizeof will, "nothing: its obligation is already %s",
                     json_string_value(json_object_get(obl, "status")));
            snprintf(why, sizeof why, "%s", dec.why);
        } else {
            action = tally_comp_action_name(dec.action);
            plan_confirmed(tool, &dec, version, will, sizeof will);
            if (obl != NULL) {
                size_t len = strlen(will);
                snprintf(will + len, sizeof will - len, " (obligation already queued: %s)",
                         json_string_value(json_object_get(obl, "status")));
            }
            snprintf(why, sizeof why, "%s", dec.why);
        }
        plan_copies(copies, will, sizeof will);
        break;
    }
    case TALLY_EFFECT_DISPATCHING:
    case TALLY_EFFECT_UNKNOWN:
        action = "wait";
        if (compensate) {
            snprintf(will, sizeof will,
                     "wait for its outcome: compensated once confirmed; earlier steps wait");
        } else {
            snprintf(will, sizeof will, "nothing: the call in flight is left to finish");
        }
        snprintf(why, sizeof why, "the effect is %s: tally does not know yet whether it happened",
                 status);
        break;
    case TALLY_EFFECT_PLANNED:
    case TALLY_EFFECT_AWAITING_APPROVAL:
        if (op->kind == TALLY_RUNOP_CANCEL) {
            action = "cancel";
            snprintf(will, sizeof will, "mark the effect CANCELLED; it is never dispatched");
        } else {
            snprintf(will, sizeof will,
                     "nothing now; it is compensated if it is dispatched and confirmed later");
        }
        snprintf(why, sizeof why, "the effect is %s: it has not reached the tool", status);
        break;
    case TALLY_EFFECT_STUCK:
        action = "blocked";
        snprintf(will, sizeof will,
                 "nothing until an operator settles it (tally resolve --effect %s ...); earlier "
                 "steps wait for it",
                 eid);
        snprintf(why, sizeof why, "the effect is STUCK: whether it happened is not known");
        break;
    case TALLY_EFFECT_FAILED:
    case TALLY_EFFECT_REJECTED:
    case TALLY_EFFECT_CANCELLED:
    case TALLY_EFFECT__COUNT:
        snprintf(will, sizeof will, "nothing");
        snprintf(why, sizeof why, "the effect is %s: it never took effect", status);
        break;
    }

    json_t *entry = json_pack(
        "{s:o, s:s, s:s, s:s, s:s?, s:s, s:s?, s:O?, s:o, s:s, s:s, s:s}", "step",
        tally_step_json(PQgetvalue(res, row, 1), PQgetvalue(res, row, 2)[0] == 't'), "effect_id",
        eid, "tool", tool_name, "effect_class", cls_name, "compensation_mode", mode,
        "effect_status", status, "external_ref", nullable(res, row, 6), "obligation", obl,
        "duplicates", copies != NULL ? json_incref(copies) : json_array(), "action", action, "will",
        will, "why", why);
    json_decref(obl);
    json_decref(copies);
    return entry;
}

json_t *tally_runops_plan(tally_pg_t *pg, const tally_registry_t *reg, const tally_runop_t *op,
                          tally_error_t *err)
{
    const char *params[1] = {op->run_id};
    PGresult *res = tally_pg_exec(pg, SQL_PLAN_RUN, 1, params, err);
    if (res == NULL) {
        return NULL;
    }
    bool found = PQntuples(res) == 1;
    PQclear(res);
    if (!found) {
        tally_error_setc(err, TALLY_ERR_NOT_FOUND, "no run '%s' in the ledger", op->run_id);
        return NULL;
    }
    res = tally_pg_exec(pg, SQL_PLAN_EFFECTS, 1, params, err);
    if (res == NULL) {
        return NULL;
    }
    json_t *plan = json_array();
    for (int row = 0; plan != NULL && row < PQntuples(res); row++) {
        json_t *entry = plan_entry(reg, op, res, row);
        if (entry == NULL || json_array_append_new(plan, entry) != 0) {
            json_decref(plan);
            plan = NULL;
        }
    }
    PQclear(res);
    if (plan == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the plan");
    }
    return plan;
}

/* ---------------------------------------------------------------------------------------- */
/* Approval                                                                                 */

bool tally_runops_approve_obligations(tally_pg_t *pg, const char *const *obligation_ids, size_t n,
                                      bool approve, const char *actor, const char *reason,
                                      tally_audit_batch_t *ab, size_t *changed, tally_error_t *err)
{
    *changed = 0;
    json_t *ids = json_array();
    for (size_t i = 0; ids != NULL && i < n; i++) {
        if (json_array_append_new(ids, json_string(obligation_ids[i])) != 0) {
            json_decref(ids);
            ids = NULL;
        }
    }
    if (ids == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory listing the obligations");
        return false;
    }
    char *text = json_dumps(ids, JSON_COMPACT);
    json_decref(ids);
    if (text == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory listing the obligations");
        return false;
    }
    tally_obligation_state_t to_state =
        approve ? TALLY_OBLIGATION_PENDING : TALLY_OBLIGATION_SKIPPED;
    const char *to = tally_obligation_state_name(to_state);
    const char *params[3] = {text, to, actor};
    PGresult *res = tally_pg_exec(pg, SQL_APPROVE, 3, params, err);
    free(text);
    if (res == NULL) {
        return false;
    }
    for (int row = 0; row < PQntuples(res); row++) {
        tally_audit_event_t ev = {.run_id = PQgetvalue(res, row, 1),
                                  .effect_id = PQgetvalue(res, row, 2),
                                  .obligation_id = PQgetvalue(res, row, 0),
                                  .kind = "operator",
                                  .actor = actor,
                                  .reason =
                                      reason != NULL ? reason : (approve ? "approved" : "denied")};
        (void)tally_audit_move(ab, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_AWAITING_APPROVAL,
                               to_state, &ev);
    }
    *changed = (size_t)PQntuples(res);
    PQclear(res);
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Runs that complete                                                                       */

/* Runs that are done: COMPLETING ones (of $3, or all when $3 is NULL) with nothing in flight,
 * and with an idle timeout ($2 ms, 0: off) ACTIVE ones whose effects have not changed for that
 * long, at most $1, each with its short summary. Effects that wait for a human
 * (AWAITING_APPROVAL, STUCK) do not hold a run open: the summary lists them. */
// clang-format off
static const char SQL_COMPLETE[] =
    "WITH c AS (SELECT r.run_id, r.status AS from_status,"
    "   CASE WHEN r.status = 'COMPLETING' THEN 'complete_run' ELSE 'idle_timeout' END AS why"
    "  FROM runs r"
    "  WHERE (r.status = 'COMPLETING' OR ($2::int > 0 AND $3::text[] IS NULL"
    "     AND r.status = 'ACTIVE' AND r.created_at < now() - $2::int * interval '1 millisecond'"
    "     AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.run_id = r.run_id"
    "       AND e.updated_at > now() - $2::int * interval '1 millisecond')))"
    "   AND ($3::text[] IS NULL OR r.run_id = ANY ($3::text[]))"
    "   AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.run_id = r.run_id"
    "     AND e.status IN ('PLANNED', 'DISPATCHING', 'UNKNOWN'))"
    "  ORDER BY r.created_at LIMIT $1 FOR UPDATE OF r SKIP LOCKED),"
    " s AS (SELECT c.run_id, jsonb_build_object("
    "   'total', (SELECT count(*) FROM effects e WHERE e.run_id = c.run_id),"
    "   'effects', coalesce((SELECT jsonb_object_agg(g.status, g.n) FROM (SELECT e.status,"
    "     count(*) AS n FROM effects e WHERE e.run_id = c.run_id GROUP BY e.status) g), '{}'),"
    "   'open', coalesce((SELECT jsonb_agg(jsonb_build_object('effect_id', o.effect_id,"
    "     'step', CASE WHEN " TALLY_SQL_STEP_IS_NUMBER("o") " THEN to_jsonb(o.step_num)"
    "       ELSE to_jsonb(o.step) END, 'tool', o.tool, 'status', o.status)"
    "     ORDER BY o.step_num, o.seq) FROM (SELECT * FROM effects e WHERE e.run_id = c.run_id"
    "     AND e.status IN ('AWAITING_APPROVAL', 'STUCK') ORDER BY e.step_num, e.seq LIMIT 100) o),"
    "     '[]'),"
    "   'open_count', (SELECT count(*) FROM effects e WHERE e.run_id = c.run_id"
    "     AND e.status IN ('AWAITING_APPROVAL', 'STUCK'))) AS summary FROM c),"
    " u AS (UPDATE runs r SET status = 'COMPLETED', summary = s.summary, completed_at = now(),"
    "   status_reason = c.why, updated_at = now()"
    "  FROM c JOIN s USING (run_id) WHERE r.run_id = c.run_id RETURNING r.run_id)"
    " SELECT c.run_id, c.from_status, c.why, s.summary::text"
    " FROM c JOIN s USING (run_id) JOIN u USING (run_id)";
// clang-format on

bool tally_runops_completed_event(const char *run_id, const char *reason, const char *summary,
                                  const char *source, tally_outbox_batch_t *ob)
{
    json_t *sum = summary != NULL ? json_loads(summary, 0, NULL) : NULL;
    return queue_run_event("tally.run.completed.v1", run_id, "COMPLETED", reason,
                           json_pack("{s:o}", "summary", sum != NULL ? sum : json_object()), source,
                           ob);
}

bool tally_runops_complete(tally_pg_t *pg, const char *const *run_ids, size_t n, int limit,
                           int idle_ms, const char *actor, const char *source,
                           tally_outbox_batch_t *ob, tally_audit_batch_t *ab, size_t *completed,
                           tally_error_t *err)
{
    *completed = 0;
    char *ids = NULL;
    if (run_ids != NULL && (ids = tally_pg_text_array(run_ids, n)) == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory listing the runs to complete");
        return false;
    }
    char lim[16], idle[16];
    snprintf(lim, sizeof lim, "%d", limit > 0 ? limit : 1);
    snprintf(idle, sizeof idle, "%d", idle_ms > 0 ? idle_ms : 0);
    const char *params[3] = {lim, idle, ids};
    PGresult *res = tally_pg_exec(pg, SQL_COMPLETE, 3, params, err);
    free(ids);
    if (res == NULL) {
        return false;
    }
    bool ok = true;
    for (int row = 0; ok && row < PQntuples(res); row++) {
        const char *run_id = PQgetvalue(res, row, 0);
        const char *why = PQgetvalue(res, row, 2);
        tally_audit_event_t ev = {.run_id = run_id, .actor = actor, .reason = why};
        tally_run_state_t was = TALLY_RUN__COUNT;
        (void)tally_run_state_parse(PQgetvalue(res, row, 1), &was);
        (void)tally_audit_move(ab, TALLY_MACHINE_RUN, (int)was, TALLY_RUN_COMPLETED, &ev);
        ok = tally_runops_completed_event(run_id, why, PQgetvalue(res, row, 3), source, ob);
        if (!ok) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a run event");
        }
        (*completed)++;
    }
    PQclear(res);
    return ok;
}
