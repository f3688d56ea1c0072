/* deadline.c — compensation deadlines (DESIGN §12; docs/operations.md "Compensation
 * deadlines"). An obligation's deadline is the earlier of its created_at + its tool's
 * compensation.deadline_ms and its run's compensation_deadline_at (a compensate_run's
 * deadline_ms). Open past a share of it (TALLY_DEADLINE_WARN_SHARE), whatever its state, it is
 * paged as a warning; open at it, critical. Each page once: its dedup key is the obligation's,
 * and a key that has a row in alerts (open, or resolved by hand) is never raised again. Both
 * resolve once the obligation closes, whoever closes it: `tally resolve --obligation` resolves
 * them in its own transaction, anything else (the compensator's own outcome, a deny, a cancel)
 * at the next look here.
 *
 * Every sweep is one transaction: one statement reads the deadlines, counts and picks the pages
 * due (share-locking those obligations, so none closes between the read and the page), the pages
 * and their events are written, and the pages of closed obligations resolved. A database error
 * rolls it all back and the next sweep repeats it. Several compensators: the paging is done by
 * whichever holds a transaction-level advisory lock that round (the others only count), so two
 * never interleave their writes to alerts; alerts' dedup key and INSERT ... ON CONFLICT would
 * keep one page per key even without it (alert.h). */
#include "compensator.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/alert.h"
#include "tally/audit.h"
#include "tally/cloudevent.h"
#include "tally/log.h"
#include "tally/outbox.h"

/* pg_try_advisory_xact_lock key of the deadline sweep: "tallydln" as ASCII. */
#define DEADLINE_LOCK_KEY "8386103194289466478"

/* The reasons of deadline pages (alerts.reason; migration 013 indexes the open ones). */
#define REASON_NEAR   "deadline_near"
#define REASON_PASSED "deadline_passed"

/* SQL: timestamptz @p X as RFC 3339 in UTC with milliseconds. */
#define SQL_RFC3339(X) "to_char((" X ") AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"

/* $1 the tools' deadlines [{tool, deadline_ms}], $2 the warning share, $3 the most pages to
 * raise, $4 the lock key. One row: whether this worker pages this round, the open obligations
 * past their deadline and near it, and the pages due as a JSON array (oldest deadline first),
 * their obligations share-locked and seen open under the lock. The states are literals so that
 * obligations_due_idx serves them; CANCELLED closes an obligation as the other terminal states
 * do. */
// clang-format off
static const char SQL_SWEEP[] =
    "WITH lk AS MATERIALIZED (SELECT pg_try_advisory_xact_lock($4::bigint) AS got),"
    " t AS (SELECT tool, deadline_ms FROM json_to_recordset($1::json)"
    "   AS t(tool text, deadline_ms bigint) WHERE deadline_ms > 0),"
    " d AS MATERIALIZED (SELECT o.obligation_id, o.run_id, o.effect_id, o.created_at,"
    "   o.external_ref, e.tool, e.step, " TALLY_SQL_STEP_IS_NUMBER("e") " AS step_is_number,"
    "   t.deadline_ms AS tool_ms, r.compensation_deadline_at AS run_at,"
    "   least(o.created_at + t.deadline_ms * interval '1 millisecond',"
    "     r.compensation_deadline_at) AS deadline_at"
    "  FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
    "  JOIN runs r ON r.run_id = o.run_id LEFT JOIN t ON t.tool = e.tool"
    "  WHERE o.status IN ('PENDING', 'AWAITING_APPROVAL', 'RUNNING', 'STUCK')"
    "    AND (t.deadline_ms IS NOT NULL OR r.compensation_deadline_at IS NOT NULL)),"
    " l AS (SELECT d.*, CASE WHEN d.deadline_at <= now() THEN 'critical'"
    "   WHEN $2::float8 < 1 AND d.created_at + $2::float8 * (d.deadline_at - d.created_at)"
    "     <= now() THEN 'warning' END AS level FROM d),"
    " todo AS (SELECT l.*, CASE l.level WHEN 'critical' THEN 'deadline:'"
    "   ELSE 'deadline-warning:' END || l.obligation_id AS dedup_key"
    "  FROM l WHERE l.level IS NOT NULL AND (SELECT got FROM lk)"
    "   AND NOT EXISTS (SELECT 1 FROM alerts a WHERE a.dedup_key = CASE l.level"
    "     WHEN 'critical' THEN 'deadline:' ELSE 'deadline-warning:' END || l.obligation_id)"
    "  ORDER BY l.deadline_at LIMIT $3::int),"
    " held AS (SELECT o.obligation_id, o.status FROM obligations o"
    "  WHERE o.obligation_id IN (SELECT obligation_id FROM todo)"
    "    AND o.status IN ('PENDING', 'AWAITING_APPROVAL', 'RUNNING', 'STUCK')"
    "  FOR SHARE OF o SKIP LOCKED)"
    " SELECT (SELECT got FROM lk),"
    "  (SELECT count(*) FROM l WHERE level = 'critical'),"
    "  (SELECT count(*) FROM l WHERE level = 'warning'),"
    "  coalesce((SELECT json_agg(json_build_object('level', todo.level,"
    "     'dedup_key', todo.dedup_key, 'obligation_id', todo.obligation_id,"
    "     'run_id', todo.run_id, 'effect_id', todo.effect_id, 'status', held.status,"
    "     'tool', todo.tool, 'step', todo.step, 'step_is_number', todo.step_is_number,"
    "     'external_ref', todo.external_ref,"
    "     'deadline', " SQL_RFC3339("todo.deadline_at") ","
    "     'filed_at', " SQL_RFC3339("todo.created_at") ","
    "     'tool_deadline_ms', todo.tool_ms,"
    "     'run_deadline', " SQL_RFC3339("todo.run_at") ","
    "     'deadline_source', CASE WHEN todo.run_at IS NOT NULL AND todo.run_at = todo.deadline_at"
    "       THEN 'run' ELSE 'tool' END)"
    "    ORDER BY todo.deadline_at, todo.dedup_key)"
    "   FROM todo JOIN held USING (obligation_id)), '[]')::text";
// clang-format on

/* The open deadline pages (alerts_deadline_open_idx), and whether their obligation has closed
 * (one that is gone counts as closed: nothing is left to wait for). */
static const char SQL_OPEN_PAGES[] =
    "SELECT a.dedup_key, coalesce(o.status IN ('RESOLVED', 'SKIPPED', 'UNCOMPENSATABLE',"
    "   'CANCELLED'), true)"
    " FROM alerts a LEFT JOIN obligations o ON o.obligation_id = a.obligation_id"
    " WHERE a.status = 'TRIGGERED' AND a.reason IN ('" REASON_NEAR "', '" REASON_PASSED "')"
    " ORDER BY a.dedup_key";

static const char SQL_TRY_LOCK[] = "SELECT pg_try_advisory_xact_lock($1::bigint)";

char *comp_deadline_tools(const tally_registry_t *reg)
{
    json_t *list = json_array();
    for (size_t i = 0; list != NULL && i < tally_registry_count(reg); i++) {
        const tally_tool_t *t = tally_registry_at(reg, i);
        if (t->deadline_ms > 0 &&
            json_array_append_new(list, json_pack("{s:s, s:i}", "tool", t->name, "deadline_ms",
                                                  t->deadline_ms)) != 0) {
            json_decref(list);
            list = NULL;
        }
    }
    char *text = list != NULL ? json_dumps(list, JSON_COMPACT) : NULL;
    json_decref(list);
    return text;
}

/* Queue the page of one due row of SQL_SWEEP. False only when out of memory. */
static bool queue_page(compensator_t *c, const json_t *p, tally_alert_batch_t *alerts)
{
    const char *level = json_string_value(json_object_get(p, "level"));
    bool passed = level != NULL && strcmp(level, "critical") == 0;
    const char *oid = json_string_value(json_object_get(p, "obligation_id"));
    const char *run_id = json_string_value(json_object_get(p, "run_id"));
    const char *tool_name = json_string_value(json_object_get(p, "tool"));
    const char *step = json_string_value(json_object_get(p, "step"));
    const char *status = json_string_value(json_object_get(p, "status"));
    const char *deadline = json_string_value(json_object_get(p, "deadline"));
    tally_obligation_state_t state = TALLY_OBLIGATION_PENDING;
    if (status == NULL || !tally_obligation_state_parse(status, &state))
        status = "?";
    const tally_tool_t *tool = tally_registry_find(c->reg, tool_name != NULL ? tool_name : "");
    char summary[TALLY_ALERT_SUMMARY_MAX];
    comp_deadline_summary(summary, sizeof summary, passed, c->cfg->deadline_warn_share, run_id,
                          step, tool_name, oid, status, deadline != NULL ? deadline : "?");
    char *cmd = comp_deadline_command(state, oid, run_id);
    json_t *details = json_pack(
        "{s:s?, s:o, s:O?, s:s, s:s?, s:s?, s:s?, s:O?, s:O?, s:s?, s:f}", "tool", tool_name,
        "step",
        tally_step_json(step != NULL ? step : "",
                        json_is_true(json_object_get(p, "step_is_number"))),
        "external_ref", json_object_get(p, "external_ref"), "obligation_status", status, "deadline",
        deadline, "deadline_source", json_string_value(json_object_get(p, "deadline_source")),
        "filed_at", json_string_value(json_object_get(p, "filed_at")), "tool_deadline_ms",
        json_object_get(p, "tool_deadline_ms"), "run_deadline", json_object_get(p, "run_deadline"),
        "level", level, "warn_share", c->cfg->deadline_warn_share);
    bool ok = cmd != NULL && details != NULL;
    if (ok) {
        tally_alert_t a = {.dedup_key = json_string_value(json_object_get(p, "dedup_key")),
                           .severity = passed ? "critical" : "warning",
                           .summary = summary,
                           .run_id = run_id,
                           .effect_id = json_string_value(json_object_get(p, "effect_id")),
                           .obligation_id = oid,
                           .reason = passed ? REASON_PASSED : REASON_NEAR,
                           .runbook = tool != NULL ? tool->runbook : NULL,
                           .resolve_command = cmd,
                           .details = details};
        tally_alert_batch_add(alerts, &a);
    }
    json_decref(details);
    free(cmd);
    return ok;
}

/* Resolve the open deadline pages whose obligation closed, in the caller's transaction (which
 * holds the lock). @p still_open receives how many stay open. @returns pages resolved, -1. */
static int resolve_closed(compensator_t *c, tally_outbox_batch_t *obx, tally_audit_batch_t *ab,
                          size_t *still_open, tally_error_t *err)
{
    PGresult *res = tally_pg_exec(c->pg, SQL_OPEN_PAGES, 0, NULL, err);
    if (res == NULL)
        return -1;
    int n = PQntuples(res);
    const char **keys = calloc(n > 0 ? (size_t)n : 1, sizeof *keys);
    if (keys == NULL) {
        PQclear(res);
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory listing deadline pages");
        return -1;
    }
    size_t n_closed = 0;
    *still_open = 0;
    for (int row = 0; row < n; row++) {
        if (PQgetvalue(res, row, 1)[0] == 't')
            keys[n_closed++] = PQgetvalue(res, row, 0);
        else
            (*still_open)++;
    }
    size_t resolved = 0;
    bool ok = tally_alert_resolve(c->pg, keys, n_closed, c->worker_id, c->source,
                                  "the obligation closed (RESOLVED, SKIPPED, UNCOMPENSATABLE or "
                                  "CANCELLED): its deadline no longer applies",
                                  obx, ab, &resolved, err);
    for (size_t i = 0; ok && i < n_closed; i++)
        TALLY_DEBUG("deadline page %s resolved: its obligation closed", keys[i]);
    free(keys);
    PQclear(res);
    return ok ? (int)resolved : -1;
}

/* Flush the queued events and commit. */
static bool finish(compensator_t *c, tally_outbox_batch_t *obx, tally_audit_batch_t *ab,
                   tally_error_t *err)
{
    return tally_audit_batch_flush(ab, c->pg, err) && tally_outbox_batch_flush(obx, c->pg, err) &&
           tally_pg_commit(c->pg, err);
}

/* Raise the due pages of SQL_SWEEP's row, in the transaction. @returns pages opened, -1. */
static int raise_pages(compensator_t *c, const char *pages_text, tally_outbox_batch_t *obx,
                       tally_audit_batch_t *ab, tally_error_t *err)
{
    json_t *pages = json_loads(pages_text, 0, NULL);
    tally_alert_batch_t *alerts = tally_alert_batch_new();
    int rc = -1;
    if (pages == NULL || alerts == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading the deadline pages");
        goto out;
    }
    size_t i;
    json_t *p;
    json_array_foreach(pages, i, p)
    {
        if (!queue_page(c, p, alerts)) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a deadline page");
            goto out;
        }
    }
    size_t opened = 0;
    if (!tally_alert_batch_flush(alerts, c->pg, c->worker_id, c->source, obx, ab, &opened, err)) {
        /* PostgreSQL refused the pages themselves (a lost connection is a db error only);
         * the next sweep raises them again */
        if (!err->retriable)
            tally_metric_add(c->m_alert_fail, (double)json_array_size(pages), "compensator");
        goto out;
    }
    json_array_foreach(pages, i, p)
    {
        bool passed = strcmp(json_string_value(json_object_get(p, "level")), "critical") == 0;
        TALLY_LOG(passed ? TALLY_LOG_ERROR : TALLY_LOG_WARN,
                  (&(tally_log_ctx_t){
                      .run_id = json_string_value(json_object_get(p, "run_id")),
                      .effect_id = json_string_value(json_object_get(p, "effect_id")),
                      .obligation_id = json_string_value(json_object_get(p, "obligation_id")),
                      .tool = json_string_value(json_object_get(p, "tool"))}),
                  "compensation %s its deadline %s (obligation %s): paged %s",
                  passed ? "is past" : "is near", json_string_value(json_object_get(p, "deadline")),
                  json_string_value(json_object_get(p, "status")),
                  json_string_value(json_object_get(p, "dedup_key")));
    }
    rc = (int)opened;
out:
    json_decref(pages);
    tally_alert_batch_free(alerts);
    return rc;
}

int comp_deadline_sweep(compensator_t *c)
{
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_outbox_batch_t *obx = tally_outbox_batch_new();
    tally_error_t err;
    tally_error_clear(&err);
    PGresult *res = NULL;
    int work = -1, opened = 0, resolved = 0;
    size_t still_open = 0;
    if (ab == NULL || obx == NULL) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory");
        goto out;
    }
    char share[32], limit[16];
    snprintf(share, sizeof share, "%.17g", c->cfg->deadline_warn_share);
    snprintf(limit, sizeof limit, "%d", c->cfg->batch_size);
    const char *params[4] = {c->deadline_tools, share, limit, DEADLINE_LOCK_KEY};
    if (!tally_pg_begin(c->pg, &err) ||
        (res = tally_pg_exec(c->pg, SQL_SWEEP, 4, params, &err)) == NULL) {
        goto out;
    }
    bool paging = PQgetvalue(res, 0, 0)[0] == 't';
    double past = atof(PQgetvalue(res, 0, 1)), near = atof(PQgetvalue(res, 0, 2));
    if (paging) {
        opened = raise_pages(c, PQgetvalue(res, 0, 3), obx, ab, &err);
        resolved = opened >= 0 ? resolve_closed(c, obx, ab, &still_open, &err) : -1;
        if (opened < 0 || resolved < 0)
            goto out;
    }
    if (!finish(c, obx, ab, &err))
        goto out;
    tally_metric_set(c->m_past_deadline, past);
    tally_metric_set(c->m_near_deadline, near);
    if (paging) {
        c->deadline_pages_open = still_open + (size_t)opened;
        if (opened > 0)
            tally_metric_add(c->m_alerts, (double)opened, "kafka");
    }
    work = opened + resolved;
out:
    if (work < 0) {
        tally_pg_rollback(c->pg);
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                            "the deadline sweep (retried at the next sweep): %s", err.message);
        tally_metric_add(c->m_db_errors, 1, "deadline");
    }
    PQclear(res);
    tally_audit_batch_free(ab);
    tally_outbox_batch_free(obx);
    return work;
}

int comp_deadline_resolve(compensator_t *c)
{
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_outbox_batch_t *obx = tally_outbox_batch_new();
    tally_error_t err;
    tally_error_clear(&err);
    PGresult *res = NULL;
    int resolved = -1;
    size_t still_open = 0;
    const char *params[1] = {DEADLINE_LOCK_KEY};
    if (ab == NULL || obx == NULL) {
        tally_error_setc(&err, TALLY_ERR_OOM, "out of memory");
        goto out;
    }
    if (!tally_pg_begin(c->pg, &err) ||
        (res = tally_pg_exec(c->pg, SQL_TRY_LOCK, 1, params, &err)) == NULL) {
        goto out;
    }
    if (PQgetvalue(res, 0, 0)[0] != 't') {
        /* another compensator is sweeping deadlines: it resolves them */
        tally_pg_rollback(c->pg);
        resolved = 0;
        goto out;
    }
    int n = resolve_closed(c, obx, ab, &still_open, &err);
    if (n < 0 || !finish(c, obx, ab, &err))
        goto out;
    c->deadline_pages_open = still_open;
    resolved = n;
out:
    if (resolved < 0) {
        tally_pg_rollback(c->pg);
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                            "resolving deadline pages (retried at the next sweep): %s",
                            err.message);
        tally_metric_add(c->m_db_errors, 1, "deadline");
    }
    PQclear(res);
    tally_audit_batch_free(ab);
    tally_outbox_batch_free(obx);
    return resolved;
}
