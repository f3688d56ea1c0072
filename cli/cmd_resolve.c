/* cmd_resolve.c — the operator's decisions on one item: `tally resolve` (an
 * UNKNOWN or STUCK effect is CONFIRMED or FAILED; a STUCK obligation is
 * RESOLVED or SKIPPED), `tally approve` and `tally deny` (an effect or
 * obligation AWAITING_APPROVAL).
 *
 * Each decision is one transaction, like any worker's transition (DESIGN §3,
 * rules 3 and 6): lock the row, refuse a move the state machine (ledger.h) does
 * not give operators, then a compare-and-set on status and lease_epoch that
 * also bumps the epoch, so a worker still holding a lease on the row can write
 * nothing more; the move's "transition" event (an obligation's: "obligation",
 * as the compensator writes it) and an "operator" event with the actor, the
 * reason and the evidence; the outcome event on the message outbox; and, when the item
 * was what kept a page open, the page's resolve (alert.h). Nothing is half
 * done. `tally resolve --finding ID` closes an upstream finding (tally verify, the
 * reconciler's audits and sweeps) the same way: the row, an "operator" event, and its page. */
#include <ctype.h>
#include <getopt.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/alert.h"
#include "tally/audit.h"
#include "tally/cloudevent.h"
#include "tally/json.h"
#include "tally/ledger.h"
#include "tally/outbox.h"
#include "tally/runops.h"
#include "tally/text.h"

typedef enum { VERB_RESOLVE, VERB_APPROVE, VERB_DENY, VERB__COUNT } verb_t;

static const char *const VERB_NAMES[VERB__COUNT] = {"resolve", "approve", "deny"};

/* ---------------------------------------------------------------------------------------- */
/* SQL                                                                                      */

/* A wait on a row a worker holds must not hang an operator's terminal. */
static const char SQL_LOCK_TIMEOUT[] = "SET LOCAL lock_timeout = '10s'";

static const char SQL_EFFECT_LOCK[] =
    "SELECT e.status, e.lease_epoch, e.run_id, e.step, " TALLY_SQL_STEP_IS_NUMBER(
        "e") ", e.tool,"
             "  e.operation_key, e.attempts, e.intent_id, e.receipt::text, e.external_ref,"
             "  e.error_code, e.error_message, e.lease_owner,"
             "  coalesce(e.lease_until > now(), false), e.status_reason"
             " FROM effects e WHERE e.effect_id = $1::uuid FOR UPDATE";

/* One statement for every operator move of an effect; $4..$9 are the new
 * values. The receipt and ref are kept when not given; the error is replaced.
 */
static const char SQL_EFFECT_MOVE[] =
    "UPDATE effects SET status = $4, status_reason = $5,"
    "  receipt = coalesce($6::jsonb, receipt), external_ref = coalesce($7, external_ref),"
    "  error_code = $8, error_message = $9,"
    "  lease_owner = NULL, lease_until = NULL, lease_epoch = lease_epoch + 1,"
    "  next_attempt_at = now(), updated_at = now()"
    " WHERE effect_id = $1::uuid AND status = $2 AND lease_epoch = $3::bigint"
    " RETURNING lease_epoch, attempts, receipt::text, external_ref";

/* Approved: due for dispatch now. The insert fires NOTIFY tally_outbox, waking
 * dispatchers. */
static const char SQL_OUTBOX_DUE[] =
    "INSERT INTO outbox (effect_id, tool, due_at) VALUES ($1::uuid, $2, now())"
    " ON CONFLICT (effect_id) DO UPDATE SET due_at = now()";

/* A final state is never dispatched. */
static const char SQL_OUTBOX_DROP[] = "DELETE FROM outbox WHERE effect_id = $1::uuid";

static const char SQL_OBLIGATION_LOCK[] =
    "SELECT o.status, o.lease_epoch, o.run_id, o.effect_id::text, o.reason, o.external_ref,"
    "  o.attempts, o.error_code, o.error_message, o.lease_owner,"
    "  coalesce(o.lease_until > now(), false), o.status_reason, o.receipt::text,"
    "  e.step, " TALLY_SQL_STEP_IS_NUMBER(
        "e") ", e.tool, e.operation_key, e.status, e.receipt::text,"
             "  e.external_ref, e.attempts, e.intent_id"
             " FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
             " WHERE o.obligation_id = $1::uuid FOR UPDATE OF o";

/* resolve --obligation: STUCK -> RESOLVED | SKIPPED. */
static const char SQL_OBLIGATION_SETTLE[] =
    "UPDATE obligations SET status = $4, status_reason = $5,"
    "  reverse_receipt = CASE WHEN $4 = 'RESOLVED' THEN $6::jsonb ELSE reverse_receipt END,"
    "  error_code = NULL, error_message = NULL,"
    "  lease_owner = NULL, lease_until = NULL, lease_epoch = lease_epoch + 1,"
    "  finished_at = now(), updated_at = now()"
    " WHERE obligation_id = $1::uuid AND status = $2 AND lease_epoch = $3::bigint"
    " RETURNING lease_epoch";

/* After runops' approve/deny (the shared SQL that sets
 * approved_at/approved_by): take any lease away and, for a denial, say who
 * denied and why. */
static const char SQL_OBLIGATION_AFTER_APPROVAL[] =
    "UPDATE obligations SET lease_epoch = lease_epoch + 1, lease_owner = NULL,"
    "  lease_until = NULL, status_reason = coalesce($4, status_reason)"
    " WHERE obligation_id = $1::uuid AND status = $2 AND lease_epoch = $3::bigint"
    " RETURNING lease_epoch";

/* The compensator listens for new obligations; an approved one is as good as
 * new. */
static const char SQL_WAKE_COMPENSATOR[] = "SELECT pg_notify('tally_obligations', '')";

/* The open pages this item kept open: an effect's page names it and no
 * obligation; an obligation's names the obligation. */
static const char SQL_ITEM_ALERTS[] =
    "SELECT coalesce(json_agg(dedup_key ORDER BY dedup_key), '[]') FROM alerts"
    " WHERE status = 'TRIGGERED' AND (dedup_key = $3 OR"
    "  CASE WHEN $2 = 'obligation' THEN obligation_id = $1::uuid"
    "       ELSE effect_id = $1::uuid AND obligation_id IS NULL END)";

/* The two states of a finding, as the findings table's CHECK spells them. Findings are no
 * machine of schemas/machines.json: OPEN until an operator says what was done, then RESOLVED. */
#define FINDING_OPEN     "OPEN"
#define FINDING_RESOLVED "RESOLVED"

/* resolve --finding: the finding, locked; $2 FINDING_OPEN. */
static const char SQL_FINDING_LOCK[] =
    "SELECT status = $2, coalesce(run_id, ''), effect_id::text, kind, tool, external_ref,"
    "  summary, resolved_by, to_char(resolved_at, 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), resolution"
    " FROM findings WHERE finding_id = $1::uuid FOR UPDATE";

/* $4 FINDING_RESOLVED, $5 FINDING_OPEN. */
static const char SQL_FINDING_RESOLVE[] =
    "UPDATE findings SET status = $4, resolved_at = now(), resolved_by = $2, resolution = $3"
    " WHERE finding_id = $1::uuid AND status = $5 RETURNING finding_id";

/* ---------------------------------------------------------------------------------------- */
/* What was asked, and what was done                                                        */

typedef struct op {
    verb_t verb;
    const char *name; /* "resolve", ... */
    const char *effect_id;
    const char *obligation_id;
    const char *alert_key;  /* resolve --alert */
    const char *finding_id; /* resolve --finding */
    const char *as;
    int as_state; /* --as parsed: a tally_effect_state_t or tally_obligation_state_t */
    const char *ref;
    const char *receipt_text;
    json_t *receipt; /* parsed --receipt (owned) */
    const char *reason;
    const char *actor;
    bool as_json;
    char source[300]; /* CloudEvents source */
} op_t;

/* What a move did, for the report. */
typedef struct done {
    const char *kind; /* "effect" or "obligation" */
    const char *id;
    char from[24];
    char to[24];
    char run_id[256];
    json_t *events; /* CloudEvents types queued, in order */
    json_t *alerts; /* dedup keys resolved */
    char note[512]; /* one more sentence for the human report, or "" */
    char warn[512]; /* something the operator should know, or "" */
} done_t;

/* ---------------------------------------------------------------------------------------- */
/* The state machine's answer, in words                                                     */

/* The command an operator uses to make a move. NULL for moves only workers
 * make. */
static const char *effect_move_verb(int from, int to)
{
    (void)from;
    switch ((tally_effect_state_t)to) {
    case TALLY_EFFECT_CONFIRMED:
        return "tally resolve --as confirmed";
    case TALLY_EFFECT_FAILED:
        return "tally resolve --as failed";
    case TALLY_EFFECT_PLANNED:
        return "tally approve";
    case TALLY_EFFECT_REJECTED:
        return "tally deny";
    case TALLY_EFFECT_CANCELLED:
        return "tally cancel --run";
    default:
        return NULL;
    }
}

static const char *obligation_move_verb(int from, int to)
{
    switch ((tally_obligation_state_t)to) {
    case TALLY_OBLIGATION_RESOLVED:
        return "tally resolve --as resolved";
    case TALLY_OBLIGATION_SKIPPED:
        return from == TALLY_OBLIGATION_STUCK ? "tally resolve --as skipped" : "tally deny";
    case TALLY_OBLIGATION_PENDING:
        return "tally approve";
    default:
        return NULL;
    }
}

/* Append to a fixed buffer, silently stopping at its end (the texts are short).
 */
static void appendf(char *buf, size_t sz, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void appendf(char *buf, size_t sz, const char *fmt, ...)
{
    size_t len = strlen(buf);
    if (len >= sz)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + len, sz - len, fmt, ap);
    va_end(ap);
}

static const char *state_name(bool effect, int state)
{
    return effect ? tally_effect_state_name((tally_effect_state_t)state)
                  : tally_obligation_state_name((tally_obligation_state_t)state);
}

/* The state an item's status column names; false for one the ledger does not know. */
static bool parse_state(bool effect, const char *text, int *state)
{
    tally_effect_state_t effect_state = TALLY_EFFECT_PLANNED;
    tally_obligation_state_t obligation_state = TALLY_OBLIGATION_PENDING;
    bool known = effect ? tally_effect_state_parse(text, &effect_state)
                        : tally_obligation_state_parse(text, &obligation_state);
    *state = effect ? (int)effect_state : (int)obligation_state;
    return known;
}

/* Where the verb moves an effect (@p effect) or an obligation. */
static int target_state(const op_t *o, bool effect)
{
    switch (o->verb) {
    case VERB_APPROVE:
        return effect ? (int)TALLY_EFFECT_PLANNED : (int)TALLY_OBLIGATION_PENDING;
    case VERB_DENY:
        return effect ? (int)TALLY_EFFECT_REJECTED : (int)TALLY_OBLIGATION_SKIPPED;
    case VERB_RESOLVE:
    default:
        return o->as_state; /* parse_as */
    }
}

/*
 * Print why a move is refused, from the transition tables alone: which states
 * this command applies to, and what an operator can do from the current one.
 */
static void explain_refusal(const op_t *o, bool effect, const char *id, int from, int to)
{
    const tally_transition_t *table =
        effect ? tally_effect_transitions : tally_obligation_transitions;
    const char *kind = effect ? "effect" : "obligation";
    const char *from_name = state_name(effect, from);
    const char *to_name = state_name(effect, to);
    char sources[256] = "", moves[512] = "";
    size_t n_sources = 0, n_moves = 0;
    for (const tally_transition_t *t = table; t->by != NULL; t++) {
        if (strcmp(t->by, "operator") != 0)
            continue;
        if (t->to == to) {
            const char *name = state_name(effect, t->from);
            if (strstr(sources, name) == NULL) {
                appendf(sources, sizeof sources, "%s%s", n_sources ? " or " : "", name);
                n_sources++;
            }
        }
        if (t->from == from) {
            const char *verb =
                effect ? effect_move_verb(t->from, t->to) : obligation_move_verb(t->from, t->to);
            if (verb != NULL && strstr(moves, verb) == NULL) {
                appendf(moves, sizeof moves, "%s%s", n_moves ? ", " : "", verb);
                n_moves++;
            }
        }
    }
    fprintf(stderr, "tally %s: refused: %s %s is %s", o->name, kind, id, from_name);
    if (from == to)
        fprintf(stderr, " already");
    fprintf(stderr, ".\n");
    char line[1024];
    snprintf(line, sizeof line, "`tally %s%s%s` moves an %s that is %s to %s.", o->name,
             o->as != NULL ? " --as " : "", o->as != NULL ? o->as : "", kind,
             n_sources ? sources : "(no state)", to_name);
    cli_wrap(stderr, line, 0, 0);
    if (n_moves > 0)
        snprintf(line, sizeof line, "From %s an operator can: %s.", from_name, moves);
    else
        snprintf(line, sizeof line, "From %s there is nothing for an operator to do%s.", from_name,
                 effect ? (tally_effect_state_terminal((tally_effect_state_t)from)
                               ? ": it is final"
                               : ": a worker moves it next")
                        : (tally_obligation_state_terminal((tally_obligation_state_t)from)
                               ? ": it is final"
                               : ": the compensator moves it next"));
    cli_wrap(stderr, line, 0, 0);
    fprintf(stderr, "Nothing was changed.\n");
}

static bool operator_may(bool effect, int from, int to)
{
    const tally_transition_t *table =
        effect ? tally_effect_transitions : tally_obligation_transitions;
    for (const tally_transition_t *t = table; t->by != NULL; t++) {
        if (t->from == from && t->to == to && strcmp(t->by, "operator") == 0)
            return effect ? tally_effect_transition_allowed((tally_effect_state_t)from,
                                                            (tally_effect_state_t)to)
                          : tally_obligation_transition_allowed((tally_obligation_state_t)from,
                                                                (tally_obligation_state_t)to);
    }
    return false;
}

/* ---------------------------------------------------------------------------------------- */
/* Events                                                                                   */

static const char *col(const PGresult *res, int row, int c)
{
    return PQgetisnull(res, row, c) ? NULL : PQgetvalue(res, row, c);
}

static json_t *str_or_null(const char *s)
{
    return s != NULL ? json_string(s) : json_null();
}

/* A JSON text from the ledger as a value (NULL stays NULL). */
static json_t *parse_or_null(const char *text)
{
    if (text == NULL)
        return NULL;
    return json_loads(text, JSON_DECODE_ANY, NULL);
}

/* What an effect event says about it (DESIGN §5). */
typedef struct effect_view {
    const char *effect_id, *run_id, *step, *tool, *operation_key, *status, *external_ref;
    bool step_is_number;
    const json_t *receipt;
    const char *error_code, *error_message;
    long long attempts;
    const char *intent_id;
} effect_view_t;

/* Queue tally.effect.<type>.v1 for @p v on "outcomes", with @p extra merged
 * into data. */
static bool queue_effect_event(const op_t *o, tally_outbox_batch_t *ob, const char *type,
                               const effect_view_t *v, json_t *extra, done_t *d)
{
    json_t *error = json_null();
    if (v->error_code != NULL)
        error = json_pack("{s:s, s:s}", "code", v->error_code, "message",
                          v->error_message != NULL ? v->error_message : "");
    json_t *data = json_object();
    bool ok = data != NULL && error != NULL;
    ok = ok && json_object_set_new(data, "effect_id", json_string(v->effect_id)) == 0;
    ok = ok && json_object_set_new(data, "run_id", json_string(v->run_id)) == 0;
    ok = ok &&
         json_object_set_new(
             data, "step", tally_step_json(v->step != NULL ? v->step : "", v->step_is_number)) == 0;
    ok = ok && json_object_set_new(data, "tool", json_string(v->tool)) == 0;
    ok = ok && json_object_set_new(data, "operation_key", json_string(v->operation_key)) == 0;
    ok = ok && json_object_set_new(data, "status", json_string(v->status)) == 0;
    ok = ok && json_object_set_new(data, "receipt",
                                   v->receipt ? json_deep_copy(v->receipt) : json_null()) == 0;
    ok = ok && json_object_set_new(data, "external_ref", str_or_null(v->external_ref)) == 0;
    ok = ok && json_object_set(data, "error", error) == 0;
    ok = ok && json_object_set_new(data, "attempts", json_integer((json_int_t)v->attempts)) == 0;
    ok = ok && json_object_set_new(data, "intent_id", str_or_null(v->intent_id)) == 0;
    ok = ok && json_object_set_new(data, "resolved_by", json_string(o->actor)) == 0;
    ok = ok && json_object_set_new(data, "reason", json_string(o->reason)) == 0;
    if (ok && extra != NULL)
        ok = json_object_update(data, extra) == 0;
    json_decref(error);
    if (!ok) {
        json_decref(data);
        return false;
    }
    json_t *ev = tally_ce_new(type, o->source, v->run_id, data, NULL); /* takes data */
    if (ev == NULL)
        return false;
    tally_outbox_batch_add(ob, "outcomes", v->run_id, ev);
    json_decref(ev);
    return json_array_append_new(d->events, json_string(type)) == 0;
}

/* Rule 3 of DESIGN §3: every move of a state writes its "transition" event, whoever makes it;
 * the "operator" event beside it carries the decision's evidence. */
static void add_transition(tally_audit_batch_t *ab, tally_machine_t m, const char *kind,
                           const char *run_id, const char *effect_id, const char *obligation_id,
                           int from, int to, const char *actor, const char *why)
{
    tally_audit_event_t ev = {.run_id = run_id,
                              .effect_id = effect_id,
                              .obligation_id = obligation_id,
                              .kind = kind,
                              .actor = actor,
                              .reason = why};
    (void)tally_audit_move(ab, m, from, to, &ev);
}

/* The "operator" event: the move in @p d, who decided it, why, and on what evidence
 * (@p evidence, borrowed). */
static void add_decision(tally_audit_batch_t *ab, const op_t *o, const done_t *d,
                         const char *run_id, const char *effect_id, const char *obligation_id,
                         const json_t *evidence)
{
    tally_audit_event_t ev = {.run_id = run_id,
                              .effect_id = effect_id,
                              .obligation_id = obligation_id,
                              .kind = "operator",
                              .from_status = d->from,
                              .to_status = d->to,
                              .actor = o->actor,
                              .reason = o->reason,
                              .data = evidence};
    tally_audit_batch_add(ab, &ev);
}

/* Resolve the pages the item moved in @p d kept open, in this transaction. */
static bool resolve_alerts(tally_pg_t *pg, const op_t *o, tally_outbox_batch_t *ob,
                           tally_audit_batch_t *ab, done_t *d, tally_error_t *err)
{
    const char *kind = d->kind, *id = d->id, *to = d->to;
    char *key =
        strcmp(kind, "effect") == 0 ? tally_alert_effect_key(id) : tally_alert_obligation_key(id);
    if (key == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory");
        return false;
    }
    const char *params[3] = {id, kind, key};
    json_t *keys = cli_query_json(pg, SQL_ITEM_ALERTS, 3, params, err);
    free(key);
    if (keys == NULL)
        return false;
    size_t n = json_array_size(keys);
    const char **list = calloc(n ? n : 1, sizeof *list);
    if (list == NULL) {
        json_decref(keys);
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory");
        return false;
    }
    for (size_t i = 0; i < n; i++)
        list[i] = json_string_value(json_array_get(keys, i));
    char why[1024];
    snprintf(why, sizeof why, "%s %s is %s: %s by %s: %s", kind, id, to,
             o->verb == VERB_RESOLVE ? "resolved" : "decided", o->actor, o->reason);
    size_t n_resolved = 0;
    bool ok = tally_alert_resolve(pg, list, n, o->actor, o->source, why, ob, ab, &n_resolved, err);
    for (size_t i = 0; ok && i < n; i++) {
        ok = json_array_append_new(d->alerts, json_string(list[i])) == 0 &&
             json_array_append_new(d->events, json_string("tally.alert.resolve.v1")) == 0;
    }
    free(list);
    json_decref(keys);
    return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* Effects and obligations                                                                  */

/*
 * Lock the row of the item named in @p d (SQL_EFFECT_LOCK when @p effect, else
 * SQL_OBLIGATION_LOCK) and check that an operator may make the verb's move from its state.
 * @returns CLI_EXIT_OK with the row in *@p cur (the caller clears it), the state to move to in
 * *@p to, and d->from, d->to, d->run_id and d->warn filled; otherwise the exit code, said on
 * stderr.
 */
static int lock_item(tally_pg_t *pg, const op_t *o, bool effect, PGresult **cur, int *to, done_t *d)
{
    const int lease_col = effect ? 13 : 9; /* lease_owner, then whether the lease is live */
    tally_error_t err;
    char what[64];
    snprintf(what, sizeof what, "cannot read the %s", d->kind);
    PGresult *res =
        tally_pg_exec(pg, effect ? SQL_EFFECT_LOCK : SQL_OBLIGATION_LOCK, 1, &d->id, &err);
    if (res == NULL)
        return cli_pg_fail(o->name, what, &err);
    if (PQntuples(res) == 0) {
        fprintf(stderr, "tally %s: no %s %s in this ledger. Nothing was changed.\n", o->name,
                d->kind, d->id);
        PQclear(res);
        return CLI_EXIT_REFUSED;
    }
    int from;
    if (!parse_state(effect, col(res, 0, 0), &from)) {
        fprintf(stderr, "tally %s: %s %s has the unknown status '%s'\n", o->name, d->kind, d->id,
                col(res, 0, 0));
        PQclear(res);
        return CLI_EXIT_REFUSED;
    }
    *to = target_state(o, effect);
    if (!operator_may(effect, from, *to)) {
        explain_refusal(o, effect, d->id, from, *to);
        PQclear(res);
        return CLI_EXIT_REFUSED;
    }
    snprintf(d->from, sizeof d->from, "%s", state_name(effect, from));
    snprintf(d->to, sizeof d->to, "%s", state_name(effect, *to));
    snprintf(d->run_id, sizeof d->run_id, "%s", col(res, 0, 2));
    if (col(res, 0, lease_col) != NULL && strcmp(col(res, 0, lease_col + 1), "t") == 0)
        snprintf(d->warn, sizeof d->warn,
                 "%s held a lease on it until now; that lease is void (epoch %s -> next)",
                 col(res, 0, lease_col), col(res, 0, 1));
    *cur = res;
    return CLI_EXIT_OK;
}

/* The item's new status_reason: "resolved by ACTOR: REASON" (or approved, denied). */
static void decision_reason(const op_t *o, char *out, size_t outsz)
{
    const char *decided = o->verb == VERB_RESOLVE   ? "resolved"
                          : o->verb == VERB_APPROVE ? "approved"
                                                    : "denied";
    snprintf(out, outsz, "%s by %s: %s", decided, o->actor, o->reason);
}

/* The receipt a settled item keeps: --receipt, or who resolved it, the ref and why. Compact
 * JSON with sorted keys, malloc'd; NULL when out of memory. */
static char *decision_receipt(const op_t *o)
{
    json_t *receipt = o->receipt != NULL ? json_incref(o->receipt)
                                         : json_pack("{s:s, s:s?, s:s}", "resolved_by", o->actor,
                                                     "external_ref", o->ref, "reason", o->reason);
    char *text = receipt != NULL ? json_dumps(receipt, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(receipt);
    return text;
}

/* The compare-and-set found no row: cannot happen under FOR UPDATE; said plainly if it does. */
static int changed_meanwhile(const op_t *o, const done_t *d)
{
    fprintf(stderr,
            "tally %s: %s %s changed while this ran; nothing was changed, run `tally "
            "doctor --run %s` and try again\n",
            o->name, d->kind, d->id, d->run_id);
    return CLI_EXIT_REFUSED;
}

/* The move of an effect, in the open transaction; @p cur is its row, locked (lock_item). The
 * obligation's below is the same. @returns an exit code; CLI_EXIT_OK means commit. */
static int effect_move(tally_pg_t *pg, const op_t *o, const PGresult *cur, tally_effect_state_t to,
                       tally_outbox_batch_t *ob, tally_audit_batch_t *ab, done_t *d)
{
    const char *id = d->id, *from_name = d->from, *to_name = d->to;
    tally_error_t err;

    /* The new values. */
    char status_reason[1024], error_message[1024];
    const char *error_code = NULL, *receipt_text = NULL, *ref = NULL;
    char *receipt_owned = NULL;
    decision_reason(o, status_reason, sizeof status_reason);
    error_message[0] = '\0';
    if (to == TALLY_EFFECT_CONFIRMED) {
        receipt_owned = decision_receipt(o);
        if (receipt_owned == NULL) {
            fprintf(stderr, "tally %s: out of memory\n", o->name);
            return CLI_EXIT_REFUSED;
        }
        receipt_text = receipt_owned;
        ref = o->ref;
    } else if (to == TALLY_EFFECT_FAILED) {
        error_code = "operator_failed";
        snprintf(error_message, sizeof error_message, "resolved as failed by %s: %s", o->actor,
                 o->reason);
    } else if (to == TALLY_EFFECT_REJECTED) {
        error_code = "denied";
        snprintf(error_message, sizeof error_message, "denied by %s: %s", o->actor, o->reason);
    }

    const char *p_move[9] = {id,      from_name,     col(cur, 0, 1),
                             to_name, status_reason, receipt_text,
                             ref,     error_code,    error_code != NULL ? error_message : NULL};
    PGresult *moved = tally_pg_exec(pg, SQL_EFFECT_MOVE, 9, p_move, &err);
    free(receipt_owned);
    if (moved == NULL)
        return cli_pg_fail(o->name, "cannot update the effect", &err);
    if (PQntuples(moved) != 1) {
        PQclear(moved);
        return changed_meanwhile(o, d);
    }

    const char *p_outbox[2] = {id, col(cur, 0, 5)};
    bool ok = tally_pg_run(pg, to == TALLY_EFFECT_PLANNED ? SQL_OUTBOX_DUE : SQL_OUTBOX_DROP,
                           to == TALLY_EFFECT_PLANNED ? 2 : 1, p_outbox, &err);
    if (!ok) {
        PQclear(moved);
        return cli_pg_fail(o->name, "cannot update the dispatch outbox", &err);
    }

    /* The audit events: the transition, and who decided, why, on what evidence. */
    tally_effect_state_t from = TALLY_EFFECT__COUNT; /* out of range: logged, if ever */
    (void)tally_effect_state_parse(from_name, &from);
    add_transition(ab, TALLY_MACHINE_EFFECT, "transition", d->run_id, id, NULL, (int)from, (int)to,
                   o->actor, status_reason);
    json_t *previous = json_pack("{s:s, s:s?, s:s?, s:s?, s:s?}", "status", from_name,
                                 "status_reason", col(cur, 0, 15), "external_ref", col(cur, 0, 10),
                                 "error_code", col(cur, 0, 11), "error_message", col(cur, 0, 12));
    json_t *evidence =
        json_pack("{s:s, s:s?, s:O?, s:s, s:o?}", "verb", o->name, "as", o->as, "receipt",
                  o->receipt, "lease_epoch", PQgetvalue(moved, 0, 0), "previous", previous);
    if (evidence != NULL && o->ref != NULL)
        json_object_set_new(evidence, "external_ref", json_string(o->ref));
    add_decision(ab, o, d, d->run_id, id, NULL, evidence);
    json_decref(evidence);

    /* The outcome: what agents waiting on this effect learn. Approval is not an
     * outcome: the dispatcher publishes the call's. */
    ok = true;
    if (to != TALLY_EFFECT_PLANNED) {
        json_t *receipt = parse_or_null(col(moved, 0, 2));
        effect_view_t v = {.effect_id = id,
                           .run_id = d->run_id,
                           .step = col(cur, 0, 3),
                           .step_is_number = strcmp(col(cur, 0, 4), "t") == 0,
                           .tool = col(cur, 0, 5),
                           .operation_key = col(cur, 0, 6),
                           .status = to_name,
                           .external_ref = col(moved, 0, 3),
                           .receipt = receipt,
                           .error_code = error_code,
                           .error_message = error_code != NULL ? error_message : NULL,
                           .attempts = strtoll(PQgetvalue(moved, 0, 1), NULL, 10),
                           .intent_id = col(cur, 0, 8)};
        const char *type = to == TALLY_EFFECT_CONFIRMED ? "tally.effect.confirmed.v1"
                           : to == TALLY_EFFECT_FAILED  ? "tally.effect.failed.v1"
                                                        : "tally.effect.rejected.v1";
        json_t *extra = json_pack("{s:s}", "previous_status", from_name);
        ok = extra != NULL && queue_effect_event(o, ob, type, &v, extra, d);
        json_decref(extra);
        json_decref(receipt);
    } else {
        snprintf(d->note, sizeof d->note,
                 "It is due for dispatch now; a running tally-dispatcher picks it up at once.");
    }
    PQclear(moved);
    if (!ok) {
        fprintf(stderr, "tally %s: out of memory building the outcome event\n", o->name);
        return CLI_EXIT_REFUSED;
    }
    return CLI_EXIT_OK;
}

static int obligation_move(tally_pg_t *pg, const op_t *o, const PGresult *cur,
                           tally_obligation_state_t to, tally_outbox_batch_t *ob,
                           tally_audit_batch_t *ab, done_t *d)
{
    const char *id = d->id, *from_name = d->from, *to_name = d->to;
    const char *effect_id = col(cur, 0, 3);
    tally_error_t err;

    char status_reason[1024];
    decision_reason(o, status_reason, sizeof status_reason);
    bool ok = true;
    char *reverse_text = NULL;

    if (o->verb == VERB_RESOLVE) {
        if (to == TALLY_OBLIGATION_RESOLVED) {
            reverse_text = decision_receipt(o);
            if (reverse_text == NULL) {
                fprintf(stderr, "tally %s: out of memory\n", o->name);
                return CLI_EXIT_REFUSED;
            }
        }
        const char *params[6] = {id,      from_name,     col(cur, 0, 1),
                                 to_name, status_reason, reverse_text};
        PGresult *moved = tally_pg_exec(pg, SQL_OBLIGATION_SETTLE, 6, params, &err);
        if (moved == NULL) {
            free(reverse_text);
            return cli_pg_fail(o->name, "cannot update the obligation", &err);
        }
        ok = PQntuples(moved) == 1;
        PQclear(moved);
        json_t *evidence =
            json_pack("{s:s, s:s, s:s?, s:O?, s:{s:s, s:s?, s:s?, s:s?}}", "verb", o->name, "as",
                      o->as, "external_ref", o->ref, "receipt", o->receipt, "previous", "status",
                      from_name, "status_reason", col(cur, 0, 11), "error_code", col(cur, 0, 7),
                      "error_message", col(cur, 0, 8));
        add_decision(ab, o, d, d->run_id, effect_id, id, evidence);
        json_decref(evidence);
    } else {
        /* The shared approval SQL (runops.h) sets approved_at/approved_by, which
         * the compensator waits for, and writes the "operator" audit event. */
        size_t changed = 0;
        const char *ids[1] = {id};
        if (!tally_runops_approve_obligations(pg, ids, 1, o->verb == VERB_APPROVE, o->actor,
                                              o->reason, ab, &changed, &err))
            return cli_pg_fail(o->name, "cannot update the obligation", &err);
        ok = changed == 1;
        if (ok) {
            const char *params[4] = {id, to_name, col(cur, 0, 1),
                                     o->verb == VERB_DENY ? status_reason : NULL};
            PGresult *moved = tally_pg_exec(pg, SQL_OBLIGATION_AFTER_APPROVAL, 4, params, &err);
            if (moved == NULL)
                return cli_pg_fail(o->name, "cannot update the obligation", &err);
            ok = PQntuples(moved) == 1;
            PQclear(moved);
        }
    }
    if (!ok) {
        free(reverse_text);
        return changed_meanwhile(o, d);
    }

    tally_obligation_state_t from = TALLY_OBLIGATION__COUNT; /* out of range: logged, if ever */
    (void)tally_obligation_state_parse(from_name, &from);
    add_transition(ab, TALLY_MACHINE_OBLIGATION, "obligation", d->run_id, effect_id, id, (int)from,
                   (int)to, o->actor, status_reason);

    /* What the compensator and the agents learn. */
    if (to == TALLY_OBLIGATION_PENDING) {
        json_t *data =
            json_pack("{s:s, s:s, s:s, s:s, s:s?, s:s, s:s}", "obligation_id", id, "run_id",
                      d->run_id, "effect_id", effect_id, "reason", col(cur, 0, 4), "external_ref",
                      col(cur, 0, 5), "approved_by", o->actor, "approval_reason", o->reason);
        json_t *ce = data != NULL
                         ? tally_ce_new("tally.obligation.v1", o->source, d->run_id, data, NULL)
                         : NULL;
        ok = ce != NULL;
        if (ok) {
            tally_outbox_batch_add(ob, "obligations", d->run_id, ce);
            ok = json_array_append_new(d->events, json_string("tally.obligation.v1")) == 0;
        }
        json_decref(ce);
        if (ok && !tally_pg_run(pg, SQL_WAKE_COMPENSATOR, 0, NULL, &err))
            return cli_pg_fail(o->name, "cannot wake the compensator", &err);
        snprintf(d->note, sizeof d->note,
                 "The compensator runs it next (in the run's reverse step order).");
    } else {
        /* A reversal settled by hand is published as the compensator publishes its own
         * (tally.effect.compensated.v1, with the record reversed and its receipt); a skip,
         * like the compensator's skips, only in the run's summary. */
        if (to == TALLY_OBLIGATION_RESOLVED) {
            json_t *receipt = parse_or_null(col(cur, 0, 12));
            json_t *rr = parse_or_null(reverse_text);
            effect_view_t v = {.effect_id = effect_id,
                               .run_id = d->run_id,
                               .step = col(cur, 0, 13),
                               .step_is_number = strcmp(col(cur, 0, 14), "t") == 0,
                               .tool = col(cur, 0, 15),
                               .operation_key = col(cur, 0, 16),
                               .status = col(cur, 0, 17),
                               .external_ref = col(cur, 0, 5),
                               .receipt = receipt,
                               .attempts = strtoll(col(cur, 0, 20), NULL, 10),
                               .intent_id = col(cur, 0, 21)};
            json_t *extra =
                json_pack("{s:s, s:s, s:s, s:O?}", "obligation_id", id, "obligation_status",
                          to_name, "obligation_reason", col(cur, 0, 4), "reverse_receipt", rr);
            ok = extra != NULL &&
                 queue_effect_event(o, ob, "tally.effect.compensated.v1", &v, extra, d);
            json_decref(extra);
            json_decref(rr);
            json_decref(receipt);
        }
        snprintf(d->note, sizeof d->note,
                 "The compensator settles the run (its summary) on its next sweep.");
    }
    free(reverse_text);
    if (!ok) {
        fprintf(stderr, "tally %s: out of memory building the events\n", o->name);
        return CLI_EXIT_REFUSED;
    }
    return CLI_EXIT_OK;
}

/* resolve, approve or deny an effect or an obligation: lock it, move it, then resolve the pages
 * it kept open. */
static int item_move(tally_pg_t *pg, const op_t *o, tally_outbox_batch_t *ob,
                     tally_audit_batch_t *ab, done_t *d)
{
    bool effect = o->effect_id != NULL;
    PGresult *cur = NULL;
    int to = 0;
    int rc = lock_item(pg, o, effect, &cur, &to, d);
    if (rc != CLI_EXIT_OK)
        return rc;
    rc = effect ? effect_move(pg, o, cur, (tally_effect_state_t)to, ob, ab, d)
                : obligation_move(pg, o, cur, (tally_obligation_state_t)to, ob, ab, d);
    PQclear(cur);
    tally_error_t err;
    if (rc == CLI_EXIT_OK && !resolve_alerts(pg, o, ob, ab, d, &err)) {
        char what[64];
        snprintf(what, sizeof what, "cannot resolve the %s's alert", d->kind);
        rc = cli_pg_fail(o->name, what, &err);
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* The verb                                                                                 */

static void report(const op_t *o, const done_t *d)
{
    if (o->as_json) {
        json_t *doc = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:s, s:O, s:O}", "verb",
                                o->name, "kind", d->kind, "id", d->id, "run_id", d->run_id, "from",
                                d->from, "to", d->to, "actor", o->actor, "reason", o->reason,
                                "events", d->events, "alerts_resolved", d->alerts);
        if (doc != NULL && o->ref != NULL)
            json_object_set_new(doc, "external_ref", json_string(o->ref));
        if (doc == NULL || !cli_print_json(doc))
            fprintf(stderr, "tally %s: done, but the report could not be written\n", o->name);
        json_decref(doc);
        return;
    }
    printf("%s %s %s: %s → %s, by %s\n", CLI_SYM_OK, d->kind, d->id, d->from, d->to, o->actor);
    if (d->run_id[0] != '\0')
        cli_field(stdout, 2, 8, "run", d->run_id);
    cli_field(stdout, 2, 8, "reason", o->reason);
    if (o->ref != NULL)
        cli_field(stdout, 2, 8, "ref", o->ref);
    if (d->warn[0] != '\0')
        cli_field(stdout, 2, 8, "lease", d->warn);
    size_t i;
    json_t *v;
    json_array_foreach(d->alerts, i, v)
    {
        char line[512];
        snprintf(line, sizeof line, "%s resolved (tally.alert.resolve.v1 queued)",
                 json_string_value(v));
        cli_field(stdout, 2, 8, "alert", line);
    }
    json_array_foreach(d->events, i, v)
    {
        if (strcmp(json_string_value(v), "tally.alert.resolve.v1") == 0)
            continue;
        char line[512];
        snprintf(line, sizeof line, "%s queued for the relay", json_string_value(v));
        cli_field(stdout, 2, 8, "event", line);
    }
    if (d->note[0] != '\0') {
        printf("  ");
        cli_wrap(stdout, d->note, 2, 2);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Alerts                                                                                   */

static const char SQL_ALERT_LOCK[] =
    "SELECT a.status, coalesce(a.run_id, ''), a.effect_id::text, a.obligation_id::text,"
    "       e.status, o.status"
    "  FROM alerts a"
    "  LEFT JOIN effects e ON e.effect_id = a.effect_id"
    "  LEFT JOIN obligations o ON o.obligation_id = a.obligation_id"
    " WHERE a.dedup_key = $1 FOR UPDATE OF a";

/* resolve --alert: close a TRIGGERED page whose item is no longer STUCK. */
static int alert_close(tally_pg_t *pg, const op_t *o, tally_outbox_batch_t *ob,
                       tally_audit_batch_t *ab, done_t *d)
{
    tally_error_t err;
    const char *key = o->alert_key;
    PGresult *res = tally_pg_exec(pg, SQL_ALERT_LOCK, 1, &key, &err);
    if (res == NULL)
        return cli_pg_fail(o->name, "nothing was changed", &err);
    if (PQntuples(res) == 0) {
        PQclear(res);
        fprintf(stderr,
                "tally %s: no alert has the dedup key '%s' (`tally status` lists the open "
                "ones)\n",
                o->name, key);
        return CLI_EXIT_REFUSED;
    }
    snprintf(d->from, sizeof d->from, "%s", PQgetvalue(res, 0, 0));
    snprintf(d->run_id, sizeof d->run_id, "%s", PQgetvalue(res, 0, 1));
    /* The states, read once: the page's, and its effect's and obligation's when it has them. */
    tally_alert_state_t alert = TALLY_ALERT_RESOLVED;
    bool triggered = tally_alert_state_parse(d->from, &alert) && alert == TALLY_ALERT_TRIGGERED;
    tally_effect_state_t effect = TALLY_EFFECT_PLANNED;
    bool stuck_effect = !PQgetisnull(res, 0, 4) &&
                        tally_effect_state_parse(PQgetvalue(res, 0, 4), &effect) &&
                        effect == TALLY_EFFECT_STUCK;
    tally_obligation_state_t obligation = TALLY_OBLIGATION_PENDING;
    bool stuck_obligation = !PQgetisnull(res, 0, 5) &&
                            tally_obligation_state_parse(PQgetvalue(res, 0, 5), &obligation) &&
                            obligation == TALLY_OBLIGATION_STUCK;
    char item[128] = "";
    if (stuck_obligation)
        snprintf(item, sizeof item, "--obligation %s", PQgetvalue(res, 0, 3));
    else if (stuck_effect)
        snprintf(item, sizeof item, "--effect %s", PQgetvalue(res, 0, 2));
    PQclear(res);
    if (!triggered) {
        fprintf(stderr, "tally %s: alert '%s' is already %s; nothing to do\n", o->name, key,
                d->from);
        return CLI_EXIT_REFUSED;
    }
    if (item[0] != '\0') {
        fprintf(stderr,
                "tally %s: alert '%s' still has a STUCK item; closing the page would hide it.\n"
                "Resolve the item instead (that closes the page too): tally resolve %s --as ... "
                "--reason ...\n",
                o->name, key, item);
        return CLI_EXIT_REFUSED;
    }
    char why[1024];
    snprintf(why, sizeof why, "alert %s closed by %s: %s", key, o->actor, o->reason);
    size_t n_resolved = 0;
    if (!tally_alert_resolve(pg, &key, 1, o->actor, o->source, why, ob, ab, &n_resolved, &err))
        return cli_pg_fail(o->name, "nothing was changed", &err);
    snprintf(d->to, sizeof d->to, "%s", tally_alert_state_name(TALLY_ALERT_RESOLVED));
    json_t *data = json_pack("{s:s}", "dedup_key", key);
    add_decision(ab, o, d, d->run_id[0] != '\0' ? d->run_id : NULL, NULL, NULL, data);
    json_decref(data);
    if (json_array_append_new(d->alerts, json_string(key)) != 0 ||
        json_array_append_new(d->events, json_string("tally.alert.resolve.v1")) != 0) {
        fprintf(stderr, "tally %s: out of memory\n", o->name);
        return CLI_EXIT_REFUSED;
    }
    return CLI_EXIT_OK;
}

/* resolve --finding: an OPEN finding becomes RESOLVED (who, when, what was done), an
 * "operator" event records the decision, and the finding's page (finding:<id>) is resolved.
 * The event carries the finding's two states in its data, not as a move: a finding is no
 * machine of the ledger. */
static int finding_close(tally_pg_t *pg, const op_t *o, tally_outbox_batch_t *ob,
                         tally_audit_batch_t *ab, done_t *d)
{
    tally_error_t err;
    const char *id = o->finding_id;
    const char *lock_params[2] = {id, FINDING_OPEN};
    PGresult *res = tally_pg_exec(pg, SQL_FINDING_LOCK, 2, lock_params, &err);
    if (res == NULL)
        return cli_pg_fail(o->name, "nothing was changed", &err);
    if (PQntuples(res) == 0) {
        PQclear(res);
        fprintf(stderr,
                "tally %s: no finding %s in this ledger (`tally verify` lists findings; the "
                "findings table holds those filed). Nothing was changed.\n",
                o->name, id);
        return CLI_EXIT_REFUSED;
    }
    snprintf(d->run_id, sizeof d->run_id, "%s", PQgetvalue(res, 0, 1));
    if (strcmp(PQgetvalue(res, 0, 0), "t") != 0) {
        char line[1024];
        tally_fmt(line, sizeof line,
                  "tally %s: finding %s is already resolved (%s by %s: %s); "
                  "nothing to do",
                  o->name, id, PQgetisnull(res, 0, 8) ? "?" : PQgetvalue(res, 0, 8),
                  PQgetisnull(res, 0, 7) ? "?" : PQgetvalue(res, 0, 7),
                  PQgetisnull(res, 0, 9) ? "?" : PQgetvalue(res, 0, 9));
        cli_wrap(stderr, line, 0, 0);
        PQclear(res);
        return CLI_EXIT_REFUSED;
    }
    json_t *evidence =
        json_pack("{s:s, s:s, s:s?, s:s?, s:s, s:s, s:s}", "finding_id", id, "kind",
                  PQgetvalue(res, 0, 3), "tool", col(res, 0, 4), "external_ref", col(res, 0, 5),
                  "summary", PQgetvalue(res, 0, 6), "from", FINDING_OPEN, "to", FINDING_RESOLVED);
    char effect_id[40] = "";
    if (col(res, 0, 2) != NULL)
        snprintf(effect_id, sizeof effect_id, "%s", col(res, 0, 2));
    PQclear(res);
    const char *params[5] = {id, o->actor, o->reason, FINDING_RESOLVED, FINDING_OPEN};
    res = tally_pg_exec(pg, SQL_FINDING_RESOLVE, 5, params, &err);
    if (res == NULL) {
        json_decref(evidence);
        return cli_pg_fail(o->name, "nothing was changed", &err);
    }
    bool moved = PQntuples(res) == 1;
    PQclear(res);
    if (!moved) {
        json_decref(evidence);
        return changed_meanwhile(o, d);
    }
    snprintf(d->from, sizeof d->from, "%s", FINDING_OPEN);
    snprintf(d->to, sizeof d->to, "%s", FINDING_RESOLVED);
    tally_audit_event_t ev = {.run_id = d->run_id[0] != '\0' ? d->run_id : NULL,
                              .effect_id = effect_id[0] != '\0' ? effect_id : NULL,
                              .kind = "operator",
                              .actor = o->actor,
                              .reason = o->reason,
                              .data = evidence};
    tally_audit_batch_add(ab, &ev);
    json_decref(evidence);

    /* its page, raised when it was filed (the reconciler pages what it files) */
    char key[64];
    snprintf(key, sizeof key, "finding:%s", id);
    const char *keys[1] = {key};
    char why[1024];
    tally_fmt(why, sizeof why, "finding %s is %s: resolved by %s: %s", id, FINDING_RESOLVED,
              o->actor, o->reason);
    size_t n_resolved = 0;
    if (!tally_alert_resolve(pg, keys, 1, o->actor, o->source, why, ob, ab, &n_resolved, &err))
        return cli_pg_fail(o->name, "nothing was changed", &err);
    if (n_resolved > 0 &&
        (json_array_append_new(d->alerts, json_string(key)) != 0 ||
         json_array_append_new(d->events, json_string("tally.alert.resolve.v1")) != 0)) {
        fprintf(stderr, "tally %s: out of memory\n", o->name);
        return CLI_EXIT_REFUSED;
    }
    snprintf(d->note, sizeof d->note,
             "The finding stays on file, resolved; `tally verify --file-findings` does not file "
             "the same record again.");
    return CLI_EXIT_OK;
}

static int run_op(op_t *o, tally_config_t *cfg)
{
    tally_pg_t *pg = cli_connect(o->name, cfg);
    if (pg == NULL)
        return CLI_EXIT_INFRA;
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    tally_audit_batch_t *ab = tally_audit_batch_new();
    done_t d = {.kind = o->effect_id != NULL       ? "effect"
                        : o->obligation_id != NULL ? "obligation"
                        : o->finding_id != NULL    ? "finding"
                                                   : "alert",
                .id = o->effect_id != NULL       ? o->effect_id
                      : o->obligation_id != NULL ? o->obligation_id
                      : o->finding_id != NULL    ? o->finding_id
                                                 : o->alert_key,
                .events = json_array(),
                .alerts = json_array()};
    int rc = CLI_EXIT_REFUSED;
    tally_error_t err;
    if (ob == NULL || ab == NULL || d.events == NULL || d.alerts == NULL) {
        fprintf(stderr, "tally %s: out of memory\n", o->name);
        goto out;
    }
    if (!tally_pg_begin(pg, &err) || !tally_pg_run(pg, SQL_LOCK_TIMEOUT, 0, NULL, &err)) {
        rc = cli_pg_fail(o->name, "cannot start the transaction", &err);
        goto out;
    }
    rc = o->alert_key != NULL    ? alert_close(pg, o, ob, ab, &d)
         : o->finding_id != NULL ? finding_close(pg, o, ob, ab, &d)
                                 : item_move(pg, o, ob, ab, &d);
    if (rc != CLI_EXIT_OK) {
        tally_pg_rollback(pg);
        goto out;
    }
    if (!tally_audit_batch_flush(ab, pg, &err) || !tally_outbox_batch_flush(ob, pg, &err) ||
        !tally_pg_commit(pg, &err)) {
        tally_pg_rollback(pg);
        rc = cli_pg_fail(o->name, "nothing was changed", &err);
        goto out;
    }
    report(o, &d);
    rc = CLI_EXIT_OK;
out:
    json_decref(d.events);
    json_decref(d.alerts);
    tally_outbox_batch_free(ob);
    tally_audit_batch_free(ab);
    tally_pg_free(pg);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Options                                                                                  */

#define VERB_BIT(v) (1u << (v))
#define ALL_VERBS   (VERB_BIT(VERB_RESOLVE) | VERB_BIT(VERB_APPROVE) | VERB_BIT(VERB_DENY))
#define NO_FIELD    ((size_t)-1)

/* Each verb's --help: its head, the options (OPTIONS below), then its exit statuses. */
static const char USAGE_RESOLVE_HEAD[] =
    "usage: tally resolve --effect ID --as confirmed --ref REF [--receipt JSON] --reason TEXT\n"
    "       tally resolve --effect ID --as failed --reason TEXT\n"
    "       tally resolve --obligation ID --as resolved|skipped [--ref REF] [--receipt JSON]\n"
    "                     --reason TEXT\n"
    "       tally resolve --alert DEDUP_KEY --reason TEXT\n"
    "       tally resolve --finding ID --as resolved --reason TEXT\n"
    "\n"
    "Settle what tally could not decide on its own, from what you verified upstream.\n"
    "An UNKNOWN or STUCK effect becomes CONFIRMED (it happened: --ref is the upstream record's\n"
    "id) or FAILED (it did not happen). A STUCK obligation becomes RESOLVED (you reversed it by\n"
    "hand) or SKIPPED (nothing is to be undone). Any worker still holding a lease on the row\n"
    "loses it. The audit trail records who, why and the evidence; the outcome is published\n"
    "on <prefix>outcomes; the item's open alert is resolved (its resolve event goes to\n"
    "<prefix>alerts). Every write happens in one transaction, or none does.\n"
    "--alert closes a page whose item needs no further state change (a destructive effect that\n"
    "was escalated as UNCOMPENSATABLE, once you have dealt with it); it is refused while the\n"
    "item is still STUCK, which must be resolved itself.\n"
    "--finding closes an upstream finding (an orphan or duplicate record a tool holds, or a\n"
    "broken ledger row, filed by `tally verify --file-findings` or the reconciler) once you\n"
    "have dealt with it: --reason says what you did; its page is resolved too.\n";

static const char USAGE_RESOLVE_TAIL[] =
    "Exit status: 0 done; 1 refused (the item is in a state this does not apply to, or does\n"
    "not exist) and nothing was changed; 2 usage error; 3 PostgreSQL could not be reached.\n";

static const char USAGE_APPROVE_HEAD[] =
    "usage: tally approve --effect ID | --obligation ID --reason TEXT [--actor NAME]\n"
    "\n"
    "Release what waits for a human's approval. An effect AWAITING_APPROVAL (a destructive\n"
    "tool, or one that requires approval) becomes PLANNED and is due for dispatch at once:\n"
    "the dispatcher is woken and calls the tool. An obligation AWAITING_APPROVAL (its tool's\n"
    "compensation.mode is approval_required) becomes PENDING and the compensator runs it.\n";

/* approve and deny */
static const char USAGE_DECIDE_TAIL[] =
    "Exit status: 0 done; 1 refused (not AWAITING_APPROVAL, or no such item), nothing changed;\n"
    "2 usage error; 3 PostgreSQL could not be reached.\n";

static const char USAGE_DENY_HEAD[] =
    "usage: tally deny --effect ID | --obligation ID --reason TEXT [--actor NAME]\n"
    "\n"
    "Refuse what waits for a human's approval. An effect AWAITING_APPROVAL becomes REJECTED:\n"
    "the tool is never called, and tally.effect.rejected.v1 goes to <prefix>outcomes. An\n"
    "obligation AWAITING_APPROVAL becomes SKIPPED (\"denied by ACTOR: REASON\"): its\n"
    "compensation is not run.\n";

static const char *const USAGE_HEAD[VERB__COUNT] = {USAGE_RESOLVE_HEAD, USAGE_APPROVE_HEAD,
                                                    USAGE_DENY_HEAD};
static const char *const USAGE_TAIL[VERB__COUNT] = {USAGE_RESOLVE_TAIL, USAGE_DECIDE_TAIL,
                                                    USAGE_DECIDE_TAIL};

/* One row per option: getopt_long's table, the checks of which verb takes what, and --help are
 * all made from it. */
typedef struct opt_row {
    const char *name; /* the long option, without "--" */
    char short_name;  /* its one-letter form, or 0 */
    const char *arg;  /* its argument as --help names it; NULL for a flag */
    unsigned verbs;   /* VERB_BIT() of each verb that takes it */
    size_t field;     /* offsetof(op_t, ...): a const char * (with an argument) or a bool */
    const char *help[VERB__COUNT]; /* per verb; NULL: the resolve text. Lines after the first
                                    * are indented under it */
} opt_row_t;

static const opt_row_t OPTIONS[] = {
    {"effect",
     0,
     "ID",
     ALL_VERBS,
     offsetof(op_t, effect_id),
     {"the effect (UUID, as `tally status` and the alert print it)", "the effect (UUID)",
      "the effect (UUID)"}},
    {"obligation",
     0,
     "ID",
     ALL_VERBS,
     offsetof(op_t, obligation_id),
     {"the obligation", "the obligation (UUID)", "the obligation (UUID)"}},
    {"alert",
     0,
     "KEY",
     VERB_BIT(VERB_RESOLVE),
     offsetof(op_t, alert_key),
     {"an open page, by its dedup key (as `tally status` prints it)"}},
    {"finding",
     0,
     "ID",
     VERB_BIT(VERB_RESOLVE),
     offsetof(op_t, finding_id),
     {"an upstream finding, by id (as `tally verify` and its page print it)"}},
    {"as",
     0,
     "OUTCOME",
     VERB_BIT(VERB_RESOLVE),
     offsetof(op_t, as),
     {"confirmed | failed (effects); resolved | skipped (obligations);\n"
      "resolved (findings)"}},
    {"ref",
     0,
     "REF",
     VERB_BIT(VERB_RESOLVE),
     offsetof(op_t, ref),
     {"the upstream record's id (required for --as confirmed); for an\n"
      "obligation, the reverse record's id, kept as evidence"}},
    {"receipt",
     0,
     "JSON",
     VERB_BIT(VERB_RESOLVE),
     offsetof(op_t, receipt_text),
     {"the upstream record itself, a JSON object; default\n"
      "{\"resolved_by\":ACTOR,\"external_ref\":REF,\"reason\":REASON}"}},
    {"reason",
     0,
     "TEXT",
     ALL_VERBS,
     offsetof(op_t, reason),
     {"what you verified (required; goes into the audit trail)",
      "why it may go ahead (required; goes into the audit trail)",
      "why (required; goes into the audit trail)"}},
    {"actor",
     0,
     "NAME",
     ALL_VERBS,
     offsetof(op_t, actor),
     {"who decided (default: the OS user)", "who approved (default: the OS user)",
      "who denied (default: the OS user)"}},
    {"json", 0, NULL, ALL_VERBS, offsetof(op_t, as_json), {"print what was done as JSON"}},
    {"help", 'h', NULL, ALL_VERBS, NO_FIELD, {"this text"}},
};

enum { N_OPTIONS = sizeof OPTIONS / sizeof OPTIONS[0], OPT_VAL_BASE = 256 };

/* The verb's --help: its text, its options, its exit statuses. */
static void usage_text(verb_t verb, char *out, size_t outsz)
{
    out[0] = '\0';
    appendf(out, outsz, "%s\n", USAGE_HEAD[verb]);
    for (size_t i = 0; i < N_OPTIONS; i++) {
        const opt_row_t *r = &OPTIONS[i];
        if (!(r->verbs & VERB_BIT(verb)))
            continue;
        char shown[64];
        if (r->short_name)
            snprintf(shown, sizeof shown, "-%c, --%s", r->short_name, r->name);
        else
            snprintf(shown, sizeof shown, "--%s%s%s", r->name, r->arg ? " " : "",
                     r->arg ? r->arg : "");
        const char *help = r->help[verb] != NULL ? r->help[verb] : r->help[VERB_RESOLVE];
        /* the help's first line beside the option, the others under it */
        const char *line = help;
        for (bool first = true; *line != '\0'; first = false) {
            size_t n = strcspn(line, "\n");
            /* lint: slice: one line of our own help text */
            appendf(out, outsz, "  %-18s %.*s\n", first ? shown : "", (int)n, line);
            line += n + (line[n] == '\n');
        }
    }
    appendf(out, outsz, "\n%s", USAGE_TAIL[verb]);
}

/* "--as, --ref and --receipt" in @p out: the options of @p given (flags by row) that @p verb
 * does not take, and in @p owners the verbs that do. @returns how many. */
static size_t foreign_options(verb_t verb, const bool *given, char *out, size_t outsz,
                              unsigned *owners)
{
    size_t n = 0, total = 0;
    for (size_t i = 0; i < N_OPTIONS; i++)
        total += given[i] && !(OPTIONS[i].verbs & VERB_BIT(verb));
    out[0] = '\0';
    *owners = 0;
    for (size_t i = 0; i < N_OPTIONS; i++) {
        if (!given[i] || (OPTIONS[i].verbs & VERB_BIT(verb)))
            continue;
        n++;
        appendf(out, outsz, "%s--%s", n == 1 ? "" : n == total ? " and " : ", ", OPTIONS[i].name);
        *owners |= OPTIONS[i].verbs;
    }
    return n;
}

/* --as names the state to move to, in lower case: an effect goes to CONFIRMED or FAILED, an
 * obligation to RESOLVED or SKIPPED. */
static bool parse_as(const char *as, bool effect, int *state)
{
    char upper[32];
    size_t n = strlen(as);
    if (n == 0 || n >= sizeof upper)
        return false;
    for (size_t i = 0; i < n; i++) {
        if (!islower((unsigned char)as[i]) && as[i] != '_')
            return false;
        upper[i] = (char)toupper((unsigned char)as[i]);
    }
    upper[n] = '\0';
    if (effect) {
        tally_effect_state_t s;
        if (!tally_effect_state_parse(upper, &s) ||
            (s != TALLY_EFFECT_CONFIRMED && s != TALLY_EFFECT_FAILED))
            return false;
        *state = (int)s;
        return true;
    }
    tally_obligation_state_t s;
    if (!tally_obligation_state_parse(upper, &s) ||
        (s != TALLY_OBLIGATION_RESOLVED && s != TALLY_OBLIGATION_SKIPPED))
        return false;
    *state = (int)s;
    return true;
}

/* Parse and check the options; @returns -1 to go on, or the exit code. */
static int parse(op_t *o, int argc, char **argv)
{
    struct option longopts[N_OPTIONS + 1];
    for (size_t i = 0; i < N_OPTIONS; i++)
        longopts[i] =
            (struct option){OPTIONS[i].name, OPTIONS[i].arg ? required_argument : no_argument, NULL,
                            OPTIONS[i].short_name ? OPTIONS[i].short_name : OPT_VAL_BASE + (int)i};
    longopts[N_OPTIONS] = (struct option){NULL, 0, NULL, 0};
    static char usage[8192];
    usage_text(o->verb, usage, sizeof usage);

    bool given[N_OPTIONS] = {false};
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option(o->name, usage, argc, argv, longopts, &rc)) != -1) {
        if (c < OPT_VAL_BASE || c >= OPT_VAL_BASE + (int)N_OPTIONS)
            continue;
        const opt_row_t *r = &OPTIONS[c - OPT_VAL_BASE];
        given[c - OPT_VAL_BASE] = true;
        if (r->arg != NULL)
            *(const char **)((char *)o + r->field) = optarg;
        else
            *(bool *)((char *)o + r->field) = true;
    }
    if (rc >= 0)
        return rc;
    char foreign[256];
    unsigned owners = 0;
    size_t n_foreign = foreign_options(o->verb, given, foreign, sizeof foreign, &owners);
    if (n_foreign > 0) {
        char verbs[64] = "";
        for (int v = 0; v < VERB__COUNT; v++)
            if (owners & VERB_BIT(v))
                appendf(verbs, sizeof verbs, "%stally %s", verbs[0] ? " or " : "", VERB_NAMES[v]);
        return cli_usage_error(o->name, "%s belong%s to %s", foreign, n_foreign == 1 ? "s" : "",
                               verbs);
    }
    if (o->finding_id != NULL) {
        if (o->effect_id != NULL || o->obligation_id != NULL || o->alert_key != NULL)
            return cli_usage_error(o->name, "name exactly one item: --effect, --obligation, "
                                            "--alert or --finding");
        if (!cli_is_uuid(o->finding_id))
            return cli_usage_error(o->name, "'%s' is not a finding id (a UUID such as %s)",
                                   o->finding_id, "0b6d5f4e-8f3c-4a8e-9d0c-6a1f3e2b7c44");
        if (o->ref != NULL || o->receipt_text != NULL)
            return cli_usage_error(o->name, "--finding takes no --ref or --receipt: say what you "
                                            "did in --reason");
        if (o->as == NULL || strcmp(o->as, "resolved") != 0)
            return cli_usage_error(o->name, "--finding needs --as resolved (a finding is open "
                                            "until an operator resolves it)");
        return cli_check_decision(o->name, o->reason, true, &o->actor, o->source, sizeof o->source)
                   ? -1
                   : CLI_EXIT_USAGE;
    }
    if (o->alert_key != NULL) {
        if (o->effect_id != NULL || o->obligation_id != NULL)
            return cli_usage_error(o->name, "name exactly one item: --effect, --obligation, "
                                            "--alert or --finding");
        if (o->as != NULL || o->ref != NULL || o->receipt_text != NULL)
            return cli_usage_error(o->name, "--alert takes no --as, --ref or --receipt: it only "
                                            "closes the page");
        if (!cli_check_text(o->name, "--alert", o->alert_key))
            return CLI_EXIT_USAGE;
        return cli_check_decision(o->name, o->reason, true, &o->actor, o->source, sizeof o->source)
                   ? -1
                   : CLI_EXIT_USAGE;
    }
    if ((o->effect_id == NULL) == (o->obligation_id == NULL))
        return cli_usage_error(o->name, "name exactly one item: --effect ID or --obligation ID");
    const char *id = o->effect_id != NULL ? o->effect_id : o->obligation_id;
    if (!cli_is_uuid(id))
        return cli_usage_error(o->name, "'%s' is not an id (a UUID such as %s)", id,
                               "0b6d5f4e-8f3c-4a8e-9d0c-6a1f3e2b7c44");
    if (o->verb == VERB_RESOLVE) {
        bool effect = o->effect_id != NULL;
        if (o->as == NULL)
            return cli_usage_error(o->name, "--as is required (%s)",
                                   effect ? "confirmed or failed" : "resolved or skipped");
        if (!parse_as(o->as, effect, &o->as_state))
            return cli_usage_error(o->name, "--as %s: %s", o->as,
                                   effect ? "an effect is resolved as confirmed or failed"
                                          : "an obligation is resolved as resolved or skipped");
        bool evidence = o->ref != NULL || o->receipt_text != NULL;
        if (effect && o->as_state == TALLY_EFFECT_CONFIRMED && o->ref == NULL)
            return cli_usage_error(o->name, "--as confirmed needs --ref REF: the id of the "
                                            "upstream record you found (the evidence)");
        if (effect && o->as_state == TALLY_EFFECT_FAILED && evidence)
            return cli_usage_error(
                o->name, "--as failed takes no --ref or --receipt: nothing happened upstream");
        if (!effect && o->as_state == TALLY_OBLIGATION_SKIPPED && evidence)
            return cli_usage_error(
                o->name, "--as skipped takes no --ref or --receipt: nothing was reversed");
        if (o->ref != NULL && !cli_check_text(o->name, "--ref", o->ref))
            return CLI_EXIT_USAGE;
        if (o->receipt_text != NULL) {
            json_error_t jerr;
            o->receipt = json_loads(o->receipt_text, TALLY_JSON_LOAD_FLAGS, &jerr);
            if (o->receipt == NULL)
                return cli_usage_error(o->name, "--receipt is not JSON: %s (column %d)", jerr.text,
                                       jerr.column);
            if (!json_is_object(o->receipt))
                return cli_usage_error(
                    o->name, "--receipt must be a JSON object, as the tool's own response is");
        }
    }
    return cli_check_decision(o->name, o->reason, true, &o->actor, o->source, sizeof o->source)
               ? -1
               : CLI_EXIT_USAGE;
}

static int cmd(verb_t verb, int argc, char **argv, tally_config_t *cfg)
{
    op_t o = {.verb = verb, .name = VERB_NAMES[verb]};
    int rc = parse(&o, argc, argv);
    /* the pages these verbs close carry the console link (TALLY_CONSOLE_URL, checked when the
     * configuration was read), as the workers' pages do */
    if (rc < 0 && !tally_alert_set_console(cfg->console_url)) {
        fprintf(stderr, "tally %s: TALLY_CONSOLE_URL is longer than %d bytes\n", o.name,
                TALLY_CONSOLE_URL_MAX);
        rc = CLI_EXIT_USAGE;
    }
    if (rc < 0)
        rc = run_op(&o, cfg);
    json_decref(o.receipt);
    return rc;
}

int tally_cmd_resolve(int argc, char **argv, tally_config_t *cfg)
{
    return cmd(VERB_RESOLVE, argc, argv, cfg);
}

int tally_cmd_approve(int argc, char **argv, tally_config_t *cfg)
{
    return cmd(VERB_APPROVE, argc, argv, cfg);
}

int tally_cmd_deny(int argc, char **argv, tally_config_t *cfg)
{
    return cmd(VERB_DENY, argc, argv, cfg);
}
