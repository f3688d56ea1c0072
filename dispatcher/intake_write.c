/* intake_write.c — the intake transaction: everything a batch of messages says, written in one
 * PostgreSQL transaction (runs, effects — claimed at once when their tool has room —, reply
 * destinations, run operations, audit events, outcome and DLQ messages). intake.c reads and
 * refuses the messages, commits, and stores the offsets after the COMMIT. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatcher.h"
#include "tally/audit.h"
#include "tally/columns.h"
#include "tally/ledger.h"
#include "tally/runops.h"
#include "tally/text.h"

/* ---------------------------------------------------------------------------------------- */
/* SQL                                                                                      */

/* Every statement handles the whole batch; its rows travel as one columns parameter
 * (columns.h), typed here. */

// clang-format off
static const char SQL_RUNS[] =
    "INSERT INTO runs (run_id, tenant)"
    " SELECT DISTINCT ON (r.run_id) r.run_id, r.tenant"
    " FROM unnest(" TALLY_COLUMN("$1", 1) "," TALLY_COLUMN("$1", 2) ") AS r(run_id, tenant)"
    " ORDER BY r.run_id, r.tenant NULLS LAST"
    " ON CONFLICT (run_id) DO NOTHING";
// clang-format on

/* The run rows are share-locked so an operator's cancel of the same run serialises with this
 * batch: either the cancel sees these effects, or this batch sees the cancelled run.
 * Rows with a lease_ms are claimed in the same statement (DESIGN §3 rule 1: the effect is
 * committed as DISPATCHING under a lease, times from the database clock, before its call
 * starts): they skip the dispatch outbox and a second transaction. The others (no room for
 * their tool in this worker just now) wait in the outbox as PLANNED. */
// clang-format off
static const char SQL_EFFECTS[] =
    "WITH r AS ("
    "  SELECT u.ord::int AS ord, u.effect_id::uuid AS effect_id, u.run_id, u.step,"
    "    u.step_num::numeric AS step_num, u.tool, u.effect_class, u.operation_key, u.input_hash,"
    "    u.args_canonical, u.tenant, u.traceparent, u.intent_id, u.gated::boolean AS gated,"
    "    u.lease_ms::int AS lease_ms, u.quoted::boolean AS step_quoted,"
    "    u.seal_key::uuid AS seal_key, u.args_sealed::bytea AS args_sealed"
    "  FROM unnest(" TALLY_COLUMN("$1", 1) "," TALLY_COLUMN("$1", 2) "," TALLY_COLUMN("$1", 3) ","
    TALLY_COLUMN("$1", 4) "," TALLY_COLUMN("$1", 5) "," TALLY_COLUMN("$1", 6) ","
    TALLY_COLUMN("$1", 7) "," TALLY_COLUMN("$1", 8) "," TALLY_COLUMN("$1", 9) ","
    TALLY_COLUMN("$1", 10) "," TALLY_COLUMN("$1", 11) "," TALLY_COLUMN("$1", 12) ","
    TALLY_COLUMN("$1", 13) "," TALLY_COLUMN("$1", 14) "," TALLY_COLUMN("$1", 15) ","
    TALLY_COLUMN("$1", 16) "," TALLY_COLUMN("$1", 17) "," TALLY_COLUMN("$1", 18) ")"
    "  AS u(ord, effect_id, run_id, step, step_num, tool, effect_class, operation_key,"
    "    input_hash, args_canonical, tenant, traceparent, intent_id, gated, lease_ms, quoted,"
    "    seal_key, args_sealed)),"
    " ru AS (SELECT run_id, status FROM runs WHERE run_id IN (SELECT run_id FROM r)"
    "    ORDER BY run_id FOR SHARE),"
    " ins AS ("
    "  INSERT INTO effects (effect_id, run_id, step, step_num, step_quoted, tool, effect_class,"
    "    operation_key, input_hash, args_canonical, tenant, traceparent, intent_id, status,"
    "    status_reason, lease_owner, lease_until, lease_epoch, attempts, seal_key, args_sealed)"
    "  SELECT r.effect_id, r.run_id, r.step, r.step_num, r.step_quoted, r.tool, r.effect_class,"
    "    r.operation_key, r.input_hash, r.args_canonical, r.tenant, r.traceparent, r.intent_id,"
    "    s.status, CASE WHEN ru.status <> 'ACTIVE' THEN 'the run is ' || ru.status END,"
    "    CASE WHEN s.status = 'DISPATCHING' THEN $2::text END,"
    "    CASE WHEN s.status = 'DISPATCHING' THEN now() + r.lease_ms * interval '1 millisecond'"
    "    END,"
    "    CASE WHEN s.status = 'DISPATCHING' THEN 1 ELSE 0 END,"
    "    CASE WHEN s.status = 'DISPATCHING' THEN 1 ELSE 0 END, r.seal_key, r.args_sealed"
    "  FROM r JOIN ru ON ru.run_id = r.run_id AND ru.status NOT IN ('COMPLETING', 'COMPLETED')"
    "  CROSS JOIN LATERAL (SELECT CASE WHEN ru.status <> 'ACTIVE' THEN 'CANCELLED'"
    "    WHEN r.gated THEN 'AWAITING_APPROVAL'"
    "    WHEN r.lease_ms IS NOT NULL THEN 'DISPATCHING' ELSE 'PLANNED' END AS status) s"
    "  ORDER BY r.ord"
    "  ON CONFLICT DO NOTHING"
    "  RETURNING effect_id, tool, status, status_reason, lease_epoch, attempts,"
    "    to_json(lease_until) #>> '{}' AS lease_until),"
    " ob AS (INSERT INTO outbox (effect_id, tool)"
    "  SELECT effect_id, tool FROM ins WHERE status = 'PLANNED')"
    " SELECT effect_id::text, status, status_reason, lease_epoch, attempts, lease_until"
    " FROM ins";
// clang-format on
#define EFFECT_COLS 18

/* For the intents that created nothing: the effect holding their (tool, key), and the one
 * holding their (run, step), in one query. */
// clang-format off
static const char SQL_EXISTING[] =
    "SELECT k.ord, e.effect_id::text, e.run_id, e.step, " TALLY_SQL_STEP_IS_NUMBER("e") ", e.tool,"
    "  e.operation_key, e.status, e.input_hash, e.receipt::text, e.external_ref, e.error_code,"
    "  e.error_message, e.attempts, s.effect_id::text, s.tool, s.operation_key, ru.status"
    " FROM unnest(" TALLY_COLUMN("$1", 1) "," TALLY_COLUMN("$1", 2) "," TALLY_COLUMN("$1", 3) ","
    TALLY_COLUMN("$1", 4) "," TALLY_COLUMN("$1", 5) ") AS k(ord, tool, operation_key, run_id,"
    "   step)"
    " LEFT JOIN effects e ON e.tool = k.tool AND e.operation_key = k.operation_key"
    " LEFT JOIN effects s ON s.run_id = k.run_id AND s.step = k.step"
    " LEFT JOIN runs ru ON ru.run_id = k.run_id";

/* Where the answers of the batch's messages go too (docs/agent-protocol.md): for an intent, the
 * effect it created or found; for a run message, the run (effect_id NULL). */
// clang-format off
static const char SQL_REPLIES[] =
    "INSERT INTO replies (run_id, effect_id, intent_id, destination)"
    " SELECT r.run_id, r.effect_id::uuid, r.intent_id, r.destination::jsonb"
    " FROM unnest(" TALLY_COLUMN("$1", 1) "," TALLY_COLUMN("$1", 2) "," TALLY_COLUMN("$1", 3) ","
    TALLY_COLUMN("$1", 4) ") AS r(run_id, effect_id, intent_id, destination)"
    " ON CONFLICT DO NOTHING";
// clang-format on
#define REPLY_COLS 4

/* complete_run: the runs' statuses, locked (their completion serialises with other batches). */
static const char SQL_COMPLETE_LOCK[] =
    "SELECT run_id, status, status_reason, summary::text FROM runs"
    " WHERE run_id = ANY ($1::text[]) ORDER BY run_id FOR UPDATE";

/* complete_run of ACTIVE runs: no new intents from now on; tally_runops_complete finishes the
 * ones with nothing in flight at once, the reconciler's sweep the others when they settle. */
static const char SQL_COMPLETING[] =
    "UPDATE runs SET status = 'COMPLETING', status_reason = 'complete_run', updated_at = now()"
    " WHERE run_id = ANY ($1::text[]) AND status = 'ACTIVE' RETURNING run_id";
// clang-format on

/* ---------------------------------------------------------------------------------------- */
/* The transaction                                                                          */

/* Run @p sql with the rows of @p c as $1 (and @p param2, when not NULL, as $2); its result
 * goes to @p out, or is dropped when @p out is NULL. */
static bool exec_rows(dispatcher_t *d, const char *sql, tally_columns_t *c, const char *param2,
                      PGresult **out, tally_error_t *err)
{
    int lengths[2] = {0, 0}, formats[2] = {1, 0};
    const char *params[2] = {tally_columns_param(c, &lengths[0]), param2};
    if (!params[0]) {
        if (c->bad_text)
            tally_error_setc(err, TALLY_ERR_INVALID_TEXT, "intake batch not written: %s", c->why);
        else
            tally_error_setc(err, TALLY_ERR_OOM, "intake batch not written: %s",
                             c->failed ? c->why : "out of memory");
        return false;
    }
    PGresult *res = tally_pg_exec_bin(d->pg, sql, param2 ? 2 : 1, params, lengths, formats, err);
    if (!res)
        return false;
    if (out)
        *out = res;
    else
        PQclear(res);
    return true;
}

static const char *val(PGresult *res, int row, int col)
{
    return PQgetisnull(res, row, col) ? NULL : PQgetvalue(res, row, col);
}

/* An audit event whose data is the object of @p n members (audit.h): text, without a jansson
 * object to build and serialise for each intent. */
static void audit_add(tally_audit_batch_t *ab, const char *run_id, const char *effect_id,
                      const char *kind, const char *actor, const char *reason,
                      const tally_audit_member_t *members, size_t n)
{
    tally_audit_event_t ev = {.run_id = run_id,
                              .effect_id = effect_id,
                              .kind = kind,
                              .actor = actor,
                              .reason = reason,
                              .members = members,
                              .n_members = n};
    tally_audit_batch_add(ab, &ev);
}

/* Note that the answers about @p effect_id (NULL: the run's own) go to @p m's reply
 * destination too, when it named one. */
static bool add_reply(tally_columns_t *rp, const char *run_id, const char *effect_id,
                      const intake_msg_t *m)
{
    if (!m->reply)
        return true;
    bool row = tally_columns_row_begin(rp) && tally_columns_text(rp, run_id) &&
               tally_columns_text(rp, effect_id) && tally_columns_text(rp, m->in.id) &&
               tally_columns_text(rp, m->reply);
    return tally_columns_row_end(rp, row);
}

/* An intent or complete_run for a run that is completed (or cancelled, compensated, for a
 * complete_run): answered tally.intent.rejected.v1 run_not_active, and noted in the audit
 * trail; it is not dead-lettered (nothing is wrong with the message). */
static bool reject_not_active(dispatcher_t *d, tally_outbox_batch_t *ob, tally_audit_batch_t *ab,
                              intake_msg_t *m, tally_run_state_t run, intake_counts_t *c)
{
    const char *run_status = tally_run_state_name(run);
    m->reason = TALLY_DLQ_RUN_NOT_ACTIVE;
    tally_fmt(m->detail, sizeof m->detail, "run %s is %s: it takes no new %s", m->in.run_id,
              run_status, m->in.type == TALLY_MSG_INTENT ? "intents" : "requests to complete");
    tally_text_copy(m->field, sizeof m->field, "data.run_id");
    json_t *step =
        m->in.type == TALLY_MSG_INTENT ? tally_step_json(m->in.step, m->in.step_is_number) : NULL;
    bool ok = intake_answer_rejected(d, ob, m, m->in.id, m->in.run_id, step, m->in.tool,
                                     json_string_value(json_object_get(m->in.doc, "type")),
                                     m->reply, false);
    json_decref(step);
    const tally_audit_member_t data[] = {
        {"intent_id", m->in.id, false},
        {"run_status", run_status, false},
    };
    audit_add(ab, m->in.run_id, NULL, "intent", d->worker_id, "run_not_active", data,
              sizeof data / sizeof data[0]);
    c->not_active++;
    return ok;
}

/* The intents that created an effect: their first "transition" event, and the
 * outcome for those that start gated (awaiting approval) or in a run that is over. */
static bool record_created(dispatcher_t *d, PGresult *res, const size_t *pos,
                           tally_audit_batch_t *ab, tally_outbox_batch_t *ob, intake_counts_t *c,
                           bool *created, tally_columns_t *rp)
{
    for (int row = 0; row < PQntuples(res); row++) {
        if (pos[row] == SIZE_MAX)
            continue;
        const char *eid = PQgetvalue(res, row, 0);
        const char *status = PQgetvalue(res, row, 1);
        const char *why = val(res, row, 2);
        /* SQL_EFFECTS creates PLANNED, DISPATCHING (claimed), AWAITING_APPROVAL or CANCELLED */
        tally_effect_state_t state;
        bool known = tally_effect_state_parse(status, &state);
        bool planned = known && state == TALLY_EFFECT_PLANNED;
        bool claimed = known && state == TALLY_EFFECT_DISPATCHING;
        intake_msg_t *m = &d->batch[pos[row]];
        created[pos[row]] = true;
        c->created++;
        if (!add_reply(rp, m->in.run_id, eid, m))
            return false;
        if (planned)
            c->planned++;
        const tally_audit_member_t data[] = {
            {"intent_id", m->in.id, false},
            {"tool", m->tool->name, false},
            {"operation_key", m->op_key, false},
            {"input_hash", m->input_hash, false},
            {"effect_class", tally_effect_class_name(m->tool->effect_class), false},
            {"traceparent", m->in.traceparent, false}, /* left out when absent */
        };
        /* One row: the effect's first transition carries the intent it came from (merged
         * from a separate "intent" row: one audit row less per effect, the same facts). */
        tally_audit_event_t ev = {.run_id = m->in.run_id,
                                  .effect_id = eid,
                                  .actor = d->worker_id,
                                  .reason = why,
                                  .members = data,
                                  .n_members = sizeof data / sizeof data[0]};
        (void)tally_audit_move(ab, TALLY_MACHINE_EFFECT, -1,
                               claimed ? TALLY_EFFECT_PLANNED
                               : known ? (int)state
                                       : -1,
                               &ev);
        if (claimed) {
            /* Claimed in the same statement: the claim's own transition, as deliver.c's. */
            m->dispatch = true;
            m->epoch = atoll(PQgetvalue(res, row, 3));
            m->attempts = atoi(PQgetvalue(res, row, 4));
            char epoch[24], attempt[16];
            snprintf(epoch, sizeof epoch, "%lld", (long long)m->epoch);
            snprintf(attempt, sizeof attempt, "%d", m->attempts);
            const tally_audit_member_t lease[] = {
                {"lease_owner", d->worker_id, false},
                {"lease_epoch", epoch, true},
                {"lease_until", PQgetvalue(res, row, 5), false},
                {"attempt", attempt, true},
            };
            tally_audit_event_t claim = {.run_id = m->in.run_id,
                                         .effect_id = eid,
                                         .actor = d->worker_id,
                                         .members = lease,
                                         .n_members = sizeof lease / sizeof lease[0]};
            (void)tally_audit_move(ab, TALLY_MACHINE_EFFECT, TALLY_EFFECT_PLANNED,
                                   TALLY_EFFECT_DISPATCHING, &claim);
            continue;
        }
        if (!planned) {
            effect_view_t v = {.ev = {.effect_id = eid,
                                      .run_id = m->in.run_id,
                                      .step = m->in.step,
                                      .step_is_number = m->in.step_is_number,
                                      .tool = m->tool->name,
                                      .operation_key = m->op_key,
                                      .status = status,
                                      .error_code = why ? "run_not_active" : NULL,
                                      .error_message = why,
                                      .intent_id = m->in.id}};
            if (!dispatch_publish_effect(d, ob, &v, NULL))
                return false;
        }
    }
    return true;
}

/* A run that complete_run ended (or is ending): it takes no new intent. */
static bool completed(tally_run_state_t run)
{
    switch (run) {
    case TALLY_RUN_COMPLETING:
    case TALLY_RUN_COMPLETED:
        return true;
    default:
        return false;
    }
}

/* SQL_EXISTING's rows: message d->batch[pos[row]] created nothing, being a replay of the same
 * effect or a conflict. */
static bool record_existing_rows(dispatcher_t *d, PGresult *res, const size_t *pos,
                                 tally_audit_batch_t *ab, tally_outbox_batch_t *ob,
                                 intake_counts_t *c, tally_columns_t *rp, tally_error_t *err)
{
    for (int row = 0; row < PQntuples(res); row++) {
        if (pos[row] == SIZE_MAX)
            continue;
        intake_msg_t *m = &d->batch[pos[row]];
        const char *eid = val(res, row, 1);
        const char *sid = val(res, row, 14);
        const char *run_status = val(res, row, 17);
        tally_run_state_t run;
        bool run_over = run_status && tally_run_state_parse(run_status, &run) && completed(run);
        bool same = eid && strcmp(PQgetvalue(res, row, 8), m->input_hash) == 0;
        if (!same && !sid && run_over) {
            /* A completed run takes no new intent (its effects' replays are answered). */
            if (!reject_not_active(d, ob, ab, m, run, c)) {
                tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a refusal");
                return false;
            }
            continue;
        }
        if (same) {
            /* Rule 5: the same effect. Answer with its state, naming this intent; its later
             * answers go to this intent's reply destination too. */
            c->replay++;
            if (!add_reply(rp, PQgetvalue(res, row, 2), eid, m)) {
                tally_error_setc(err, TALLY_ERR_OOM, "out of memory noting a reply destination");
                return false;
            }
            json_t *receipt = NULL;
            if (val(res, row, 9))
                receipt = json_loads(PQgetvalue(res, row, 9), 0, NULL);
            effect_view_t v = {.ev = {.effect_id = eid,
                                      .run_id = m->in.run_id,
                                      .step = m->in.step,
                                      .step_is_number = m->in.step_is_number,
                                      .tool = PQgetvalue(res, row, 5),
                                      .operation_key = PQgetvalue(res, row, 6),
                                      .status = PQgetvalue(res, row, 7),
                                      .receipt = receipt,
                                      .external_ref = val(res, row, 10),
                                      .error_code = val(res, row, 11),
                                      .error_message = val(res, row, 12),
                                      .attempts = atoll(PQgetvalue(res, row, 13)),
                                      .intent_id = m->in.id},
                               .own = true,
                               .reply_to = m->reply};
            json_t *extra = json_pack(
                "{s:b, s:s, s:o}", "replay", 1, "effect_run_id", PQgetvalue(res, row, 2),
                "effect_step",
                tally_step_json(PQgetvalue(res, row, 3), PQgetvalue(res, row, 4)[0] == 't'));
            bool ok = extra && dispatch_publish_effect(d, ob, &v, extra);
            const tally_audit_member_t data[] = {
                {"intent_id", m->in.id, false},
                {"replay_of", eid, false},
                {"status", v.ev.status, false},
            };
            audit_add(ab, m->in.run_id, eid, "intent", d->worker_id,
                      "replay: same tool, operation key and input hash", data,
                      sizeof data / sizeof data[0]);
            json_decref(extra);
            json_decref(receipt);
            if (!ok) {
                tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a replay event");
                return false;
            }
            continue;
        }
        if (!eid && !sid) {
            /* The conflicting row vanished between the INSERT and this SELECT: only a
             * concurrent transaction that rolled back can do that. Try the batch again. */
            tally_error_setc(err, TALLY_ERR_RACE,
                             "intent %s created nothing yet no effect holds its key or step",
                             m->in.id);
            return false;
        }
        c->conflict++;
        char msg[1024];
        const char *other = eid ? eid : sid;
        if (eid)
            /* lint: slice (the first 12 hex digits of each input hash) */
            tally_fmt(msg, sizeof msg,
                      "operation key '%s' of tool '%s' is already effect %s with different "
                      "arguments (input hash %.*s, this intent's %.*s)",
                      m->op_key, m->tool->name, eid, 12, PQgetvalue(res, row, 8), 12,
                      m->input_hash);
        else
            tally_fmt(msg, sizeof msg,
                      "step %s of run %s is already effect %s (tool '%s', key '%s')", m->in.step,
                      m->in.run_id, sid, PQgetvalue(res, row, 15), PQgetvalue(res, row, 16));
        /* effect_id names the effect that holds the key or step (DESIGN §5 keeps effect_id in
         * every effect event); status CONFLICT is this intent's own answer */
        effect_view_t v = {.ev = {.effect_id = other,
                                  .run_id = m->in.run_id,
                                  .step = m->in.step,
                                  .step_is_number = m->in.step_is_number,
                                  .tool = m->tool->name,
                                  .operation_key = m->op_key,
                                  .status = "CONFLICT",
                                  .error_code = "conflict",
                                  .error_message = msg,
                                  .intent_id = m->in.id},
                           .own = true,
                           .reply_to = m->reply};
        json_t *extra = json_pack("{s:s}", "conflicting_effect_id", other);
        bool ok = extra && dispatch_publish_effect(d, ob, &v, extra);
        const tally_audit_member_t data[] = {
            {"intent_id", m->in.id, false},
            {"operation_key", m->op_key, false},
            {"input_hash", m->input_hash, false},
            {"tool", m->tool->name, false},
        };
        audit_add(ab, m->in.run_id, other, "conflict", d->worker_id, msg, data,
                  sizeof data / sizeof data[0]);
        json_decref(extra);
        if (!ok) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a conflict event");
            return false;
        }
    }
    return true;
}

/* The intents that created nothing: a replay of the same effect, or a conflict. */
static bool record_existing(dispatcher_t *d, PGresult *res, tally_audit_batch_t *ab,
                            tally_outbox_batch_t *ob, intake_counts_t *c, tally_columns_t *rp,
                            tally_error_t *err)
{
    size_t *pos = tally_columns_positions(res, 0, NULL, d->n_batch); /* the ord column */
    if (!pos) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading the existing effects");
        return false;
    }
    bool ok = record_existing_rows(d, res, pos, ab, ob, c, rp, err);
    free(pos);
    return ok;
}

static int tool_index(dispatcher_t *d, const tally_tool_t *tool)
{
    for (size_t t = 0; t < tally_registry_count(d->reg); t++)
        if (tally_registry_at(d->reg, t) == tool)
            return (int)t;
    return -1;
}

/* complete_run requests (docs/agent-protocol.md): an ACTIVE run turns COMPLETING, and
 * COMPLETED at once when nothing of it is in flight; a COMPLETED one is answered with its
 * summary again; a COMPLETING one is answered when it completes; any other (cancelled, under
 * compensation) refuses with run_not_active. */
static bool complete_runs(dispatcher_t *d, intake_msg_t **ms, size_t n, tally_audit_batch_t *ab,
                          tally_outbox_batch_t *ob, intake_counts_t *c, tally_error_t *err)
{
    bool ok = false;
    PGresult *res = NULL, *moved = NULL;
    const char **moving = calloc(n, sizeof *moving);
    size_t n_moving = 0, done = 0;
    char *ids = NULL;
    for (size_t i = 0; moving && i < n; i++)
        moving[i] = ms[i]->in.run_id;
    if (!moving || !(ids = tally_pg_text_array(moving, n))) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory listing the runs to complete");
        goto out;
    }
    const char *params[1] = {ids};
    res = tally_pg_exec(d->pg, SQL_COMPLETE_LOCK, 1, params, err);
    if (!res)
        goto out;
    for (size_t i = 0; i < n; i++) {
        intake_msg_t *m = ms[i];
        tally_run_state_t run = TALLY_RUN_ACTIVE; /* SQL_RUNS created it, ACTIVE */
        const char *summary = NULL, *why = NULL;
        for (int row = 0; row < PQntuples(res); row++)
            if (strcmp(PQgetvalue(res, row, 0), m->in.run_id) == 0 &&
                tally_run_state_parse(PQgetvalue(res, row, 1), &run)) {
                why = val(res, row, 2);
                summary = val(res, row, 3);
            }
        const tally_audit_member_t data[] = {{"intent_id", m->in.id, false}};
        switch (run) {
        case TALLY_RUN_ACTIVE:
        case TALLY_RUN_COMPLETING:
            audit_add(ab, m->in.run_id, NULL, "complete_run", d->worker_id, m->in.reason, data, 1);
            moving[n_moving++] = m->in.run_id;
            break;
        case TALLY_RUN_COMPLETED:
            audit_add(ab, m->in.run_id, NULL, "complete_run", d->worker_id, m->in.reason, data, 1);
            if (!tally_runops_completed_event(m->in.run_id, why, summary, d->source, ob))
                goto oom;
            break;
        default:
            if (!reject_not_active(d, ob, ab, m, run, c))
                goto oom;
            break;
        }
    }
    if (n_moving > 0) {
        moved = tally_pg_exec(d->pg, SQL_COMPLETING, 1, params, err);
        if (!moved)
            goto out;
        for (int row = 0; row < PQntuples(moved); row++) {
            tally_audit_event_t ev = {.run_id = PQgetvalue(moved, row, 0),
                                      .actor = d->worker_id,
                                      .reason = "complete_run"};
            (void)tally_audit_move(ab, TALLY_MACHINE_RUN, TALLY_RUN_ACTIVE, TALLY_RUN_COMPLETING,
                                   &ev);
        }
        if (!tally_runops_complete(d->pg, moving, n_moving, (int)n_moving, 0, d->worker_id,
                                   d->source, ob, ab, &done, err))
            goto out;
    }
    ok = true;
    goto out;
oom:
    tally_error_setc(err, TALLY_ERR_OOM, "out of memory answering complete_run");
out:
    PQclear(res);
    PQclear(moved);
    free(moving);
    free(ids);
    return ok;
}

/* Everything messages [lo, hi) of the batch say, in one transaction. The caller commits or
 * rolls back. The messages are leased to this worker's relay and @p handed receives them, for
 * the caller to hand to the relay after COMMIT. */
bool intake_write(dispatcher_t *d, size_t lo, size_t hi, tally_audit_batch_t *ab,
                  tally_outbox_batch_t *ob, intake_counts_t *c, PGresult **handed,
                  tally_error_t *err)
{
    bool ok = false;
    /* The statements' $1 */
    tally_columns_t runs = {0}, effects = {0}, existing = {0}, replies = {0};
    tally_columns_init(&runs, 2);
    tally_columns_init(&effects, EFFECT_COLS);
    tally_columns_init(&existing, 5);
    tally_columns_init(&replies, REPLY_COLS);
    /* complete_run: the messages, and the runs they name */
    intake_msg_t **completes = calloc(d->n_batch ? d->n_batch : 1, sizeof *completes);
    size_t n_completes = 0;
    /* the effect id each intent's effect gets (NULL for the other messages): RETURNING rows
     * name their message by it */
    const char **ids = calloc(d->n_batch ? d->n_batch : 1, sizeof *ids);
    size_t *pos = NULL;
    bool *created = calloc(d->n_batch ? d->n_batch : 1, sizeof *created);
    /* compensate_run / cancel_run: the same run-level SQL as `tally compensate|cancel` */
    tally_runop_t *ops = calloc(d->n_batch ? d->n_batch : 1, sizeof *ops);
    tally_runop_result_t *op_results = calloc(d->n_batch ? d->n_batch : 1, sizeof *op_results);
    size_t n_tools = tally_registry_count(d->reg);
    int *room = calloc(n_tools ? n_tools : 1, sizeof *room);
    PGresult *res = NULL;
    size_t n_ops = 0;
    if (!ids || !created || !ops || !op_results || !room || !completes) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the intake batch");
        goto out;
    }

    for (size_t t = 0; t < n_tools; t++)
        room[t] = tally_connector_capacity(d->conn, tally_registry_at(d->reg, t));
    /* Begun before the rows are built: the sensitive intents' tenant keys are read (and made)
     * in it, share-locked until the effects sealed under them are committed. */
    if (!tally_pg_begin(d->pg, err))
        goto out;
    if (!intake_seal(d, lo, hi, err))
        goto out;
    for (size_t i = lo; i < hi; i++) {
        intake_msg_t *m = &d->batch[i];
        m->dispatch = false;                         /* a retried batch claims again */
        if (m->reason == TALLY_DLQ_RUN_NOT_ACTIVE) { /* decided by the failed try: decide again */
            m->reason = TALLY_DLQ_NONE;
            m->detail[0] = m->field[0] = '\0';
        }
        if (m->reason != TALLY_DLQ_NONE) {
            if (!intake_refuse(d, ob, m)) {
                tally_error_setc(err, TALLY_ERR_OOM, "out of memory building a DLQ record");
                goto out;
            }
            c->dlq++;
            if ((size_t)m->reason < sizeof c->dlq_by_reason / sizeof c->dlq_by_reason[0])
                c->dlq_by_reason[m->reason]++;
            continue;
        }
        const tally_intent_t *in = &m->in;
        bool run = tally_columns_row_begin(&runs) && tally_columns_text(&runs, in->run_id) &&
                   tally_columns_text(&runs, in->tenant);
        if (!tally_columns_row_end(&runs, run))
            goto oom;
        /* An intent after a complete_run of its run in this batch: the run is over for it. */
        bool after_complete = false;
        for (size_t k = 0; k < n_completes && in->type == TALLY_MSG_INTENT; k++)
            after_complete = after_complete || strcmp(completes[k]->in.run_id, in->run_id) == 0;
        if (after_complete) {
            if (!reject_not_active(d, ob, ab, m, TALLY_RUN_COMPLETING, c))
                goto oom;
            continue;
        }
        switch (in->type) {
        case TALLY_MSG_COMPLETE_RUN:
            c->complete++;
            completes[n_completes++] = m;
            if (!add_reply(&replies, in->run_id, NULL, m))
                goto oom;
            break;
        case TALLY_MSG_INTENT: {
            bool gated =
                m->tool->effect_class == TALLY_CLASS_DESTRUCTIVE || m->tool->requires_approval;
            /* Claim it now if its tool has room in this worker (the intents of one batch
             * share that room; a replay or conflict wastes a slot only until COMMIT). No
             * lease_ms (null): not claimed. */
            char ord[16], lease_ms[16];
            const char *lease = NULL;
            int t = tool_index(d, m->tool);
            if (!gated && t >= 0 && room[t] > 0) {
                room[t]--;
                snprintf(lease_ms, sizeof lease_ms, "%d", dispatch_lease_ms(d, m->tool));
                lease = lease_ms;
            }
            snprintf(ord, sizeof ord, "%d", (int)i);
            tally_columns_t *rs = &effects; /* in SQL_EFFECTS' order */
            bool row = tally_columns_row_begin(rs) && tally_columns_text(rs, ord) &&
                       tally_columns_text(rs, m->effect_id) && tally_columns_text(rs, in->run_id) &&
                       tally_columns_text(rs, in->step) &&
                       tally_columns_text(rs, in->step_is_digits ? in->step : NULL) &&
                       tally_columns_text(rs, m->tool->name) &&
                       tally_columns_text(rs, tally_effect_class_name(m->tool->effect_class)) &&
                       tally_columns_text(rs, m->op_key) && tally_columns_text(rs, m->input_hash) &&
                       tally_columns_text(rs, m->stored_args ? m->stored_args : m->canonical) &&
                       tally_columns_text(rs, in->tenant) &&
                       tally_columns_text(rs, in->traceparent) && tally_columns_text(rs, in->id) &&
                       tally_columns_text(rs, gated ? "true" : "false") &&
                       tally_columns_text(rs, lease) &&
                       tally_columns_text(rs, in->step_is_number ? "false" : "true") &&
                       tally_columns_text(rs, m->seal_key[0] ? m->seal_key : NULL) &&
                       tally_columns_text(rs, m->args_sealed);
            if (!tally_columns_row_end(rs, row))
                goto oom;
            ids[i] = m->effect_id;
            break;
        }
        case TALLY_MSG_CANCEL_RUN:
        case TALLY_MSG_COMPENSATE_RUN:
            if (!add_reply(&replies, in->run_id, NULL, m))
                goto oom;
            if (in->type == TALLY_MSG_CANCEL_RUN)
                c->cancel++;
            else
                c->compensate++;
            ops[n_ops++] =
                (tally_runop_t){.kind = in->type == TALLY_MSG_CANCEL_RUN ? TALLY_RUNOP_CANCEL
                                                                         : TALLY_RUNOP_COMPENSATE,
                                .run_id = in->run_id,
                                .compensate = in->type == TALLY_MSG_CANCEL_RUN && in->compensate,
                                .reason = in->reason,
                                .intent_id = in->id,
                                .deadline_ms = in->deadline_ms};
            break;
        }
    }

    if (runs.n > 0 && !exec_rows(d, SQL_RUNS, &runs, NULL, NULL, err))
        goto out;
    if (effects.n > 0) {
        if (!exec_rows(d, SQL_EFFECTS, &effects, d->worker_id, &res, err))
            goto out;
        pos = tally_columns_positions(res, 0, ids, d->n_batch);
        if (!pos || !record_created(d, res, pos, ab, ob, c, created, &replies))
            goto oom;
        free(pos);
        pos = NULL;
        PQclear(res);
        res = NULL;
        for (size_t k = lo; k < hi; k++) {
            intake_msg_t *m = &d->batch[k];
            if (!ids[k] || created[k])
                continue;
            char ord[16];
            snprintf(ord, sizeof ord, "%d", (int)(m - d->batch));
            tally_columns_t *rs = &existing; /* in SQL_EXISTING's order */
            bool row = tally_columns_row_begin(rs) && tally_columns_text(rs, ord) &&
                       tally_columns_text(rs, m->tool->name) && tally_columns_text(rs, m->op_key) &&
                       tally_columns_text(rs, m->in.run_id) && tally_columns_text(rs, m->in.step);
            if (!tally_columns_row_end(rs, row))
                goto oom;
        }
        if (existing.n > 0) {
            if (!exec_rows(d, SQL_EXISTING, &existing, NULL, &res, err))
                goto out;
            if (!record_existing(d, res, ab, ob, c, &replies, err))
                goto out;
            PQclear(res);
            res = NULL;
        }
    }
    /* The reply destinations first: the answers below are copied to them. */
    if (replies.n > 0 && !exec_rows(d, SQL_REPLIES, &replies, NULL, NULL, err))
        goto out;
    if (n_ops > 0 &&
        !tally_runops_apply(d->pg, ops, n_ops, d->worker_id, d->source, ob, ab, op_results, err))
        goto out;
    if (n_completes > 0 && !complete_runs(d, completes, n_completes, ab, ob, c, err))
        goto out;
    if (!tally_audit_batch_flush(ab, d->pg, err) ||
        !dispatch_flush_messages(d, d->pg, ob, handed, err))
        goto out;
    ok = true;
    goto out;
oom:
    if (runs.bad_text || effects.bad_text || existing.bad_text || replies.bad_text)
        tally_error_setc(err, TALLY_ERR_INVALID_TEXT, "intake batch not written: %s",
                         runs.bad_text      ? runs.why
                         : effects.bad_text ? effects.why
                         : replies.bad_text ? replies.why
                                            : existing.why);
    else
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the intake batch");
out:
    PQclear(res);
    tally_columns_release(&runs);
    tally_columns_release(&effects);
    tally_columns_release(&existing);
    tally_columns_release(&replies);
    free(completes);
    free(ops);
    free(op_results);
    free(ids);
    free(pos);
    free(created);
    free(room);
    return ok;
}
