/* cmd_doctor.c — `tally doctor`: one run, read for the on-call engineer. What needs a human
 * first, each with the command that handles it, then one line per effect and per obligation;
 * --full adds the timeline of every audit event in order and each row whole, every receipt and
 * body once. (`tally summary` is cmd_summary.c.)
 *
 * The doctor finds its run by the run id or by any handle an operator holds: an effect id (the
 * Tally-Effect-Id header a tool saw), an obligation id, an external ref or an operation key.
 * It reads one snapshot (REPEATABLE READ) so the timeline and the rows agree. Rows come out of
 * PostgreSQL as to_jsonb(row): --json gives every column under its own name, and a column added
 * by a later migration appears without a change here. */
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/cloudevent.h"
#include "tally/connector.h"
#include "tally/alert.h"
#include "tally/ledger.h"
#include "tally/text.h"

/* Data of one timeline event printed in full up to this many bytes (--json has
 * it all). */
#define EVENT_DATA_MAX 1200

/* The most candidates a --ref or --key that matches several items lists. */
#define CANDIDATES_MAX "20"

/* Marks the item a --effect, --obligation, --ref or --key named. */
#define MARK "▶"

static const char USAGE_DOCTOR[] =
    "usage: tally doctor --run R | --effect ID | --obligation ID | --ref EXTERNAL_REF\n"
    "                    | --key OPERATION_KEY  [--full] [--json]\n"
    "\n"
    "One run as the ledger (TALLY_PG) has it, to find out what happened and what to do.\n"
    "First the run (state, times, counts), then its PROBLEMS, most urgent first, each with\n"
    "the exact command that handles it: STUCK effects and obligations, UNKNOWN effects older\n"
    "than TALLY_UNKNOWN_AGE_S, approvals waiting, obligations past their deadline, open\n"
    "alerts and open upstream findings. Then one line per effect (step order) and per\n"
    "obligation (compensation order): state, attempts, first and last change (UTC), the\n"
    "external ref (or the operation key while there is none) and the id.\n"
    "\n"
    "  --run R               the run id\n"
    "  --effect ID           the run of this effect (the Tally-Effect-Id header a tool saw)\n"
    "  --obligation ID       the run of this obligation\n"
    "  --ref EXTERNAL_REF    the run of the effect or obligation with this upstream record id\n"
    "  --key OPERATION_KEY   the run of the effect with this operation key (Idempotency-Key)\n"
    "                        The item named is marked " MARK ". A --ref or --key that matches\n"
    "                        several lists them, each with its command, and exits 1.\n"
    "  --full                also the timeline: every event in order (transitions with their\n"
    "                        actor and reason, leases, connector calls with their request\n"
    "                        and response, status checks, obligations, operator decisions,\n"
    "                        alerts), then each effect's and obligation's whole row with its\n"
    "                        receipt and arguments, and the alerts. Each body is printed once:\n"
    "                        a response that is the receipt, or an obligation's receipt that\n"
    "                        is its effect's, points to it instead; a call that stored the\n"
    "                        receipt keeps its SHA-256, and says whether it still matches.\n"
    "  --json                one JSON document with stable keys: {run, match, counts,\n"
    "                        problems: [{kind, subject, id, step, tool, state, age_s, reason,\n"
    "                        alert, command (as printed), commands (without comments)}],\n"
    "                        effects, obligations, alerts, findings, messages_waiting}\n"
    "                        and with --full {events}; rows carry every\n"
    "                        column under its own name (an obligation's receipt only when it\n"
    "                        differs from its effect's; an effect's receipt_sha256 too, the\n"
    "                        hash its call's event keeps); reals in their shortest form\n"
    "  -h, --help            this text\n"
    "\n"
    "Lines wrap between words only, to COLUMNS (else the terminal's width, else 80): an id,\n"
    "a key, a ref or a URL is never split, so it copies whole; a long command goes on with\n"
    "' \\' between its options, so it still pastes as one.\n"
    "\n"
    "Exit status: 0 printed; 1 no such run or item, or a --ref/--key that matches several;\n"
    "2 usage error; 3 PostgreSQL could not be reached.\n";

/* ---------------------------------------------------------------------------------------- */
/* SQL: $1 is the run id everywhere                                                         */

static const char SQL_RUN[] = "SELECT (SELECT to_jsonb(r) || jsonb_build_object('updated_age_s',"
                              "   extract(epoch FROM now() - r.updated_at)::float8, 'now', now())"
                              " FROM runs r WHERE r.run_id = $1)";

/* The run's events, and those of its effects and obligations that were written under another
 * run id or none (a conflict answered for another run still names this run's effect). Each
 * part is read through its own index (schema 8); one WHERE with ORs cannot use them and scans
 * every event of the ledger. An effect's transitions and connector calls always carry its
 * run id, so the first part finds them, and the effect index leaves them out. */
#define EVENT_COLUMNS                                                                              \
    "SELECT seq, event_id, occurred_at, run_id, effect_id, obligation_id, kind, from_status,"      \
    " to_status, actor, reason, data FROM events"
// clang-format off
static const char SQL_EVENTS[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(v) ORDER BY v.seq), '[]') FROM ("
    EVENT_COLUMNS " WHERE run_id = $1"
    " UNION " EVENT_COLUMNS " WHERE effect_id IN (SELECT effect_id FROM effects WHERE run_id = $1)"
    "   AND kind NOT IN ('transition', 'connector_call')"
    " UNION " EVENT_COLUMNS
    "   WHERE obligation_id IN (SELECT obligation_id FROM obligations WHERE run_id = $1)) v";
// clang-format on

// clang-format off
static const char SQL_EFFECTS[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(e) || jsonb_build_object("
    "   'outbox_due_at', o.due_at, 'lease_held', coalesce(e.lease_until > now(), false),"
    "   'receipt_sha256', " TALLY_SQL_RECEIPT_SHA256("e") ","
    "   'updated_age_s', extract(epoch FROM now() - e.updated_at)::float8,"
    "   'unknown_age_s', extract(epoch FROM now() - coalesce(e.unknown_since, e.updated_at))"
    "     ::float8)"
    "   ORDER BY e.step_num IS NULL, e.step_num, e.seq), '[]')"
    " FROM effects e LEFT JOIN outbox o ON o.effect_id = e.effect_id WHERE e.run_id = $1";
// clang-format on

/* In compensation order: last step first. past_deadline: the run's compensation deadline has
 * passed, or the compensator's deadline sweep paged it as passed (a tool's deadline_ms is the
 * registry's, which the sweep reads). */
static const char SQL_OBLIGATIONS[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(o) || jsonb_build_object('step', e.step,"
    "   'step_is_number', " TALLY_SQL_STEP_IS_NUMBER(
        "e") ", 'tool', e.tool, 'effect_class', e.effect_class,"
             "   'effect_status', e.status, 'lease_held', coalesce(o.lease_until > now(), false),"
             "   'updated_age_s', extract(epoch FROM now() - o.updated_at)::float8,"
             "   'past_deadline', coalesce(r.compensation_deadline_at <= now(), false)"
             "     OR EXISTS (SELECT 1 FROM alerts a WHERE a.obligation_id = o.obligation_id"
             "       AND a.reason = 'deadline_passed'))"
             "   ORDER BY e.step_num IS NULL DESC, e.step_num DESC, e.seq DESC, o.created_at), "
             "'[]')"
             " FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
             " JOIN runs r ON r.run_id = o.run_id WHERE o.run_id = $1";

static const char SQL_ALERTS[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(a) ORDER BY a.created_at, a.dedup_key), '[]')"
    " FROM alerts a WHERE a.run_id = $1"
    "   OR a.effect_id IN (SELECT effect_id FROM effects WHERE run_id = $1)"
    "   OR a.obligation_id IN (SELECT obligation_id FROM obligations WHERE run_id = $1)";

/* The open upstream findings (tally verify, the reconciler's audits and sweeps) of the run. */
static const char SQL_FINDINGS[] =
    "SELECT coalesce(jsonb_agg(jsonb_build_object('finding_id', f.finding_id, 'kind', f.kind,"
    "   'tool', f.tool, 'external_ref', f.external_ref, 'effect_id', f.effect_id,"
    "   'obligation_id', f.obligation_id, 'summary', f.summary, 'created_at', f.created_at,"
    "   'age_s', extract(epoch FROM now() - f.created_at)::float8)"
    "   ORDER BY f.created_at, f.finding_id), '[]')"
    " FROM findings f WHERE f.status = 'OPEN' AND (f.run_id = $1"
    "   OR f.effect_id IN (SELECT effect_id FROM effects WHERE run_id = $1)"
    "   OR f.obligation_id IN (SELECT obligation_id FROM obligations WHERE run_id = $1))";

/* Finding the run of a handle. $1 is the handle, checked before (a UUID for the ids). */
static const char SQL_FIND_EFFECT[] =
    "SELECT (SELECT jsonb_build_object('kind', 'effect', 'id', effect_id, 'run_id', run_id)"
    " FROM effects WHERE effect_id = $1::uuid)";

static const char SQL_FIND_OBLIGATION[] =
    "SELECT (SELECT jsonb_build_object('kind', 'obligation', 'id', obligation_id,"
    " 'run_id', run_id) FROM obligations WHERE obligation_id = $1::uuid)";

#define CANDIDATE_EFFECT                                                                           \
    "SELECT 'effect'::text AS kind, e.effect_id::text AS id, e.run_id, e.step, e.tool,"            \
    " e.status, e.created_at FROM effects e"

/* The effects with this ref, and the obligations with it whose effect has another (an extra
 * record of a DUPLICATE): an obligation for the effect's own record is the effect's. */
// clang-format off
static const char SQL_FIND_REF[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(c) - 'created_at' ORDER BY c.created_at, c.id), '[]')"
    " FROM (" CANDIDATE_EFFECT " WHERE e.external_ref = $1"
    " UNION ALL SELECT 'obligation', o.obligation_id::text, o.run_id, e.step, e.tool, o.status,"
    "   o.created_at FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
    "   WHERE o.external_ref = $1 AND e.external_ref IS DISTINCT FROM $1"
    " ORDER BY 7, 2 LIMIT " CANDIDATES_MAX ") c";

/* One effect per tool can carry a key (UNIQUE (tool, operation_key)): several tools, several. */
static const char SQL_FIND_KEY[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(c) - 'created_at' ORDER BY c.created_at, c.id), '[]')"
    " FROM (" CANDIDATE_EFFECT " WHERE e.operation_key = $1"
    " ORDER BY 7, 2 LIMIT " CANDIDATES_MAX ") c";
// clang-format on

static const char SQL_WAITING[] =
    "SELECT to_jsonb(count(*)) FROM message_outbox WHERE msg_key = $1";
/* On schema 17 the run's outcome messages by reference (message_refs) wait too. */
static const char SQL_WAITING_REFS[] =
    "SELECT to_jsonb((SELECT count(*) FROM message_outbox WHERE msg_key = $1)"
    " + (SELECT count(*) FROM message_refs WHERE msg_key = $1))";

/* ---------------------------------------------------------------------------------------- */
/* Shared                                                                                   */

/* "HH:MM:SS.mmm" of an ISO timestamp as PostgreSQL writes it in UTC. */
static void clock_of(const char *iso, char *out, size_t outsz)
{
    if (iso == NULL || strlen(iso) < 19) {
        snprintf(out, outsz, "%s", iso != NULL ? iso : "-");
        return;
    }
    char ms[4] = "000";
    if (iso[19] == '.') {
        for (int i = 0; i < 3 && iso[20 + i] >= '0' && iso[20 + i] <= '9'; i++)
            ms[i] = iso[20 + i];
    }
    snprintf(out, outsz, "%.*s.%s", 8, iso + 11, ms); /* lint: slice (ISO time, ASCII) */
}

static void field_error(const json_t *obj, const char *code_key, const char *msg_key, size_t indent)
{
    const char *code = cli_str(obj, code_key, NULL);
    if (code == NULL)
        return;
    char line[1024];
    snprintf(line, sizeof line, "%s: %s", code, cli_str(obj, msg_key, ""));
    cli_field(stdout, indent, 13, "error", line);
}

static void field_lease(const json_t *obj, size_t indent)
{
    char line[512], until[32];
    long long epoch = (long long)cli_num(obj, "lease_epoch", 0);
    const char *owner = cli_str(obj, "lease_owner", NULL);
    if (owner == NULL) {
        snprintf(line, sizeof line, "none (epoch %lld)", epoch);
    } else {
        clock_of(cli_str(obj, "lease_until", NULL), until, sizeof until);
        snprintf(line, sizeof line, "%s until %s (epoch %lld%s)", owner, until, epoch,
                 json_is_true(json_object_get(obj, "lease_held")) ? ", held now" : ", expired");
    }
    cli_field(stdout, indent, 13, "lease", line);
}

/* "step 3 charge_card" for an effect id, from the run's effects; NULL when not
 * one of them. */
static const json_t *find_by(const json_t *rows, const char *key, const char *id)
{
    size_t i;
    json_t *row;
    if (id == NULL)
        return NULL;
    json_array_foreach(rows, i, row)
    {
        if (strcmp(cli_str(row, key, ""), id) == 0)
            return row;
    }
    return NULL;
}

/* A row's "status", parsed once here; false when it is missing or not a state the ledger has. */
static bool effect_state(const json_t *row, tally_effect_state_t *out)
{
    return tally_effect_state_parse(cli_str(row, "status", ""), out);
}

static bool run_state(const json_t *row, tally_run_state_t *out)
{
    return tally_run_state_parse(cli_str(row, "status", ""), out);
}

static bool alert_open(const json_t *alert)
{
    tally_alert_state_t st;
    return tally_alert_state_parse(cli_str(alert, "status", ""), &st) &&
           st == TALLY_ALERT_TRIGGERED;
}

/* ---------------------------------------------------------------------------------------- */
/* doctor                                                                                   */

/* Effects a COMPLETING run waits for: those still in flight. */
static bool in_flight(const json_t *effect)
{
    tally_effect_state_t st;
    if (!effect_state(effect, &st))
        return false;
    switch (st) {
    case TALLY_EFFECT_PLANNED:
    case TALLY_EFFECT_DISPATCHING:
    case TALLY_EFFECT_UNKNOWN:
        return true;
    default:
        return false;
    }
}

/* The header line of a finishing run: "completing" with what it waits for, or "completed" with
 * the counts of its completion summary. */
static void field_completion(const json_t *run, const json_t *effects)
{
    char line[1024];
    const json_t *summary = json_object_get(run, "summary");
    tally_run_state_t rs;
    if (run_state(run, &rs) && rs == TALLY_RUN_COMPLETING) {
        size_t waiting = 0, i;
        json_t *e;
        json_array_foreach(effects, i, e)
        {
            waiting += in_flight(e);
        }
        snprintf(line, sizeof line,
                 "new intents are refused; completed once %zu effect%s in flight "
                 "(PLANNED, DISPATCHING, UNKNOWN) settle%s",
                 waiting, waiting == 1 ? "" : "s", waiting == 1 ? "s" : "");
        cli_field(stdout, 2, 13, "completing", line);
        return;
    }
    if (!cli_is_completion_summary(summary))
        return;
    size_t len = 0;
    long long total = (long long)cli_num(summary, "total", 0);
    char at[48] = "";
    if (cli_str(run, "completed_at", NULL) != NULL) {
        cli_date(cli_str(run, "completed_at", NULL), at, sizeof at);
        tally_fmt(at + strlen(at), sizeof at - strlen(at), ": ");
    }
    int w = snprintf(line, sizeof line, "%s%lld effect%s", at, total, total == 1 ? "" : "s");
    len = w > 0 ? (size_t)w : 0;
    const char *state;
    const json_t *n;
    size_t k = 0;
    json_object_foreach((json_t *)json_object_get(summary, "effects"), state, n)
    {
        w = snprintf(line + len, sizeof line - len, "%s%s %lld", k++ ? ", " : ": ", state,
                     (long long)json_integer_value(n));
        if (w < 0 || (size_t)w >= sizeof line - len)
            break;
        len += (size_t)w;
    }
    long long open = (long long)cli_num(summary, "open_count", 0);
    if (len < sizeof line)
        snprintf(line + len, sizeof line - len, "; %lld left open%s", open,
                 open > 0 ? " (listed below)" : "");
    cli_field(stdout, 2, 13, "completed", line);
}

/* A completed run's open effects (AWAITING_APPROVAL, STUCK: a human decides them). */
static bool print_open(const json_t *run)
{
    const json_t *summary = json_object_get(run, "summary");
    const json_t *open = json_object_get(summary, "open");
    long long count = (long long)cli_num(summary, "open_count", (double)json_array_size(open));
    if (!cli_is_completion_summary(summary) || count == 0)
        return true;
    char head[128];
    snprintf(head, sizeof head, "LEFT OPEN AT COMPLETION: %lld (a human decides these)", count);
    printf("\n");
    cli_wrap(stdout, head, 0, 2);
    static const char *const heads[] = {"STEP", "TOOL", "STATUS", "EFFECT"};
    cli_table_t *t = cli_table_new(4, heads);
    if (t == NULL)
        return false;
    cli_table_keep(t, 3);
    size_t i;
    json_t *e;
    json_array_foreach(open, i, e)
    {
        char step[128];
        const json_t *sv = json_object_get(e, "step");
        if (json_is_integer(sv))
            snprintf(step, sizeof step, "%lld", (long long)json_integer_value(sv));
        else
            tally_text_copy(step, sizeof step, json_string_value(sv) ? json_string_value(sv) : "?");
        const char *cells[] = {step, cli_str(e, "tool", "?"), cli_str(e, "status", "?"),
                               cli_str(e, "effect_id", "?")};
        cli_table_add(t, cells);
    }
    bool ok = cli_table_print(t, stdout, 2);
    cli_table_free(t);
    if ((long long)json_array_size(open) < count)
        printf("  ... and %lld more (EFFECTS below has them all)\n",
               count - (long long)json_array_size(open));
    return ok;
}

/* A connector call that stored its answer as the effect's receipt keeps a reference to it and
 * its hash (ledger.h): what the reference says, in place of it, checked against the effect's
 * receipt as stored now (its receipt_sha256, SQL_EFFECTS); NULL when @p data holds none. */
static json_t *receipt_ref_shown(const json_t *data, const json_t *effect)
{
    const json_t *ref = json_object_get(data, "receipt");
    const char *now = cli_str(effect, "receipt_sha256", NULL);
    char where[400];
    switch (tally_conn_receipt_ref_check(ref, now)) {
    case TALLY_RECEIPT_REF_NONE:
        return NULL;
    case TALLY_RECEIPT_REF_MATCH:
        snprintf(where, sizeof where, "the receipt of its effect, under DETAILS (sha256 matches)");
        break;
    case TALLY_RECEIPT_REF_UNVERIFIED:
        snprintf(where, sizeof where, "the receipt of its effect, under DETAILS");
        break;
    case TALLY_RECEIPT_REF_MISMATCH: {
        json_t *pruned = json_loads(TALLY_PRUNED_MARKER, 0, NULL);
        bool was_pruned = json_equal(json_object_get(effect, "receipt"), pruned);
        json_decref(pruned);
        if (was_pruned)
            snprintf(where, sizeof where, "the receipt of its effect, pruned since");
        else
            tally_fmt(where, sizeof where,
                      "NOT the receipt its effect holds now: the call stored sha256 %s, the "
                      "effect's receipt has sha256 %s (tally verify: effect_receipt_changed)",
                      cli_str(ref, "sha256", "?"), now);
        break;
    }
    }
    json_t *copy = json_deep_copy(data);
    if (copy != NULL && json_object_set_new(copy, "receipt", json_string(where)) != 0) {
        json_decref(copy);
        return NULL;
    }
    return copy;
}

/* A connector call's response that is the receipt printed under DETAILS (the effect's, or the
 * reverse receipt of the obligation) is not printed a second time: a copy of @p data with the
 * response replaced by where it is, or NULL when @p data is to be printed as it is. Events
 * written since the receipt is stored once hold a reference instead (receipt_ref_shown); those
 * of 0.2.0 hold the answer, compared here with the receipt. */
static json_t *body_once(const json_t *data, const json_t *effect, const json_t *obligation)
{
    json_t *shown = receipt_ref_shown(data, effect);
    if (shown != NULL)
        return shown;
    const char *text = cli_str(json_object_get(data, "response"), "text", NULL);
    if (text == NULL || *text == '\0')
        return NULL;
    json_t *body = json_loads(text, JSON_DECODE_ANY, NULL);
    const char *where = NULL;
    if (body != NULL && obligation != NULL &&
        json_equal(body, json_object_get(obligation, "reverse_receipt")))
        where = "the reverse receipt of its obligation, under DETAILS";
    else if (body != NULL && effect != NULL && json_equal(body, json_object_get(effect, "receipt")))
        where = "the receipt of its effect, under DETAILS";
    json_decref(body);
    json_t *copy = where != NULL ? json_deep_copy(data) : NULL;
    if (copy != NULL && json_object_set_new(copy, "response", json_string(where)) != 0) {
        json_decref(copy);
        return NULL;
    }
    return copy;
}

static void print_event(const json_t *ev, const json_t *effects, const json_t *obligations)
{
    char at[32], head[512], subject[300] = "";
    clock_of(cli_str(ev, "occurred_at", NULL), at, sizeof at);
    const char *oid = cli_str(ev, "obligation_id", NULL);
    const char *eid = cli_str(ev, "effect_id", NULL);
    const json_t *effect = find_by(effects, "effect_id", eid);
    if (oid != NULL) {
        const json_t *ob = find_by(obligations, "obligation_id", oid);
        /* lint: slice (the first 8 hex digits of a UUID) */
        tally_fmt(subject, sizeof subject, "obligation %.*s step %s %s", 8, oid,
                  cli_str(ob, "step", "?"), cli_str(ob, "tool", ""));
    } else if (effect != NULL) {
        tally_fmt(subject, sizeof subject, "step %s %s", cli_str(effect, "step", "?"),
                  cli_str(effect, "tool", ""));
    } else if (eid != NULL) {
        snprintf(subject, sizeof subject, "effect %.*s", 8, eid); /* lint: slice (UUID) */
    } else {
        snprintf(subject, sizeof subject, "run");
    }
    const char *from = cli_str(ev, "from_status", NULL), *to = cli_str(ev, "to_status", NULL);
    char move[64] = "";
    if (from != NULL || to != NULL)
        snprintf(move, sizeof move, "  %s → %s", from != NULL ? from : "new",
                 to != NULL ? to : "-");
    snprintf(head, sizeof head, "#%lld %s %-14s %s%s", (long long)cli_num(ev, "seq", 0), at,
             cli_str(ev, "kind", "?"), subject, move);
    cli_wrap(stdout, head, 0, 4);

    char by[1024];
    const char *reason = cli_str(ev, "reason", NULL);
    snprintf(by, sizeof by, "by %s%s%s", cli_str(ev, "actor", "?"), reason != NULL ? ": " : "",
             reason != NULL ? reason : "");
    printf("    ");
    cli_wrap(stdout, by, 4, 6);

    const json_t *data = json_object_get(ev, "data");
    if (data != NULL && !json_is_null(data) &&
        !(json_is_object(data) && json_object_size(data) == 0)) {
        json_t *shown = body_once(data, effect, find_by(obligations, "obligation_id", oid));
        char *text = cli_json_line(shown != NULL ? shown : data);
        json_decref(shown);
        if (text != NULL && strlen(text) > EVENT_DATA_MAX) {
            /* cut on a character boundary and say so */
            size_t cut = EVENT_DATA_MAX;
            while (cut > 0 && ((unsigned char)text[cut] & 0xC0) == 0x80)
                cut--;
            char *whole = text;
            /* lint: slice (a prefix cut on a character boundary just above) */
            if (asprintf(&text, "%.*s …(%zu bytes; --full --json has it all)", (int)cut, whole,
                         strlen(whole)) < 0)
                text = NULL;
            free(whole);
        }
        printf("    ");
        cli_wrap(stdout, text != NULL ? text : "(out of memory)", 4, 6);
        free(text);
    }
}

static void print_effect(const json_t *e)
{
    char line[1024];
    snprintf(line, sizeof line, "step %s  %s (%s)  %s", cli_str(e, "step", "?"),
             cli_str(e, "tool", "?"), cli_str(e, "effect_class", "?"), cli_str(e, "status", "?"));
    cli_wrap(stdout, line, 0, 2);
    cli_field_member(e, "effect_id", "effect", 2);
    cli_field_member(e, "operation_key", "key", 2);
    cli_field_member(e, "status_reason", "reason", 2);
    snprintf(line, sizeof line, "%lld", (long long)cli_num(e, "attempts", 0));
    cli_field(stdout, 2, 13, "attempts", line);
    field_lease(e, 2);
    cli_field_member(e, "receipt", "receipt", 2);
    cli_field_member(e, "external_ref", "external ref", 2);
    field_error(e, "error_code", "error_message", 2);
    if (cli_str(e, "unknown_since", NULL) != NULL) {
        char since[48];
        cli_date(cli_str(e, "unknown_since", NULL), since, sizeof since);
        cli_field(stdout, 2, 13, "unknown since", since);
    }
    if (json_object_get(e, "status_checks") != NULL) {
        snprintf(line, sizeof line, "%lld (%lld inconclusive in a row)",
                 (long long)cli_num(e, "status_checks", 0),
                 (long long)cli_num(e, "inconclusive_checks", 0));
        cli_field(stdout, 2, 13, "status checks", line);
    }
    if (cli_str(e, "outbox_due_at", NULL) != NULL) {
        char due[48];
        cli_date(cli_str(e, "outbox_due_at", NULL), due, sizeof due);
        snprintf(line, sizeof line, "due %s", due);
        cli_field(stdout, 2, 13, "dispatch", line);
    }
    cli_field_member(e, "intent_id", "intent", 2);
    cli_field_member(e, "args_canonical", "args", 2);
}

static void print_obligation(const json_t *o)
{
    char line[1024];
    snprintf(line, sizeof line, "obligation for step %s  %s (%s)  %s  [%s]",
             cli_str(o, "step", "?"), cli_str(o, "tool", "?"), cli_str(o, "effect_class", "?"),
             cli_str(o, "status", "?"), cli_str(o, "reason", "?"));
    cli_wrap(stdout, line, 0, 2);
    cli_field_member(o, "obligation_id", "obligation", 2);
    cli_field_member(o, "effect_id", "effect", 2);
    cli_field_member(o, "external_ref", "external ref", 2);
    cli_field_member(o, "status_reason", "reason", 2);
    snprintf(line, sizeof line, "%lld", (long long)cli_num(o, "attempts", 0));
    cli_field(stdout, 2, 13, "attempts", line);
    field_lease(o, 2);
    if (cli_str(o, "approved_by", NULL) != NULL) {
        char at[48];
        cli_date(cli_str(o, "approved_at", NULL), at, sizeof at);
        snprintf(line, sizeof line, "by %s at %s", cli_str(o, "approved_by", "?"), at);
        cli_field(stdout, 2, 13, "approved", line);
    }
    if (json_is_true(json_object_get(o, "receipt_same_as_effect")))
        cli_field(stdout, 2, 13, "receipt", "its effect's (above)");
    else
        cli_field_member(o, "receipt", "receipt", 2);
    cli_field_member(o, "reverse_receipt", "reverse rcpt", 2);
    cli_field_member(o, "blast_radius", "blast radius", 2);
    field_error(o, "error_code", "error_message", 2);
}

static void print_alert(const json_t *a)
{
    char line[1024], at[48];
    bool open = alert_open(a);
    cli_date(cli_str(a, "created_at", NULL), at, sizeof at);
    snprintf(line, sizeof line, "%s %s %s  %s  opened %s", open ? CLI_SYM_WARN : CLI_SYM_OK,
             cli_str(a, "status", "?"), cli_str(a, "dedup_key", "?"), cli_str(a, "severity", "?"),
             at);
    cli_wrap(stdout, line, 0, 4);
    cli_field_member(a, "summary", "summary", 2);
    cli_field_member(a, "reason", "reason", 2);
    cli_field_member(a, "runbook", "runbook", 2);
    cli_field_member(a, "pager_state", "pager", 2);
    if (!open) {
        cli_date(cli_str(a, "resolved_at", NULL), at, sizeof at);
        cli_field(stdout, 2, 13, "resolved", at);
    } else {
        cli_field(stdout, 2, 13, "command", "under PROBLEMS above");
    }
}

/* ---------------------------------------------------------------------------------------- */
/* doctor: the problems and their commands                                                  */

/* The kinds of problem, most urgent first: the order PROBLEMS lists them in. */
typedef enum {
    PROBLEM_STUCK,
    PROBLEM_UNKNOWN_AGING,
    PROBLEM_APPROVAL,
    PROBLEM_DEADLINE_PASSED,
    PROBLEM_ALERT,
    PROBLEM_FINDING,
    PROBLEM__COUNT
} problem_kind_t;

static const char *const PROBLEM_NAMES[PROBLEM__COUNT] = {
    "stuck", "unknown_aging", "approval", "deadline_passed", "alert", "finding"};

/* The commands of a command text (alert.h's form: one a line, each maybe followed by
 * "  # when it applies"), without their comments: what a script would run. */
static json_t *command_list(const char *text)
{
    json_t *list = json_array();
    for (const char *line = text; list != NULL && line != NULL && *line != '\0';) {
        const char *nl = strchr(line, '\n');
        size_t len = nl != NULL ? (size_t)(nl - line) : strlen(line);
        const char *hash = memmem(line, len, "  #", 3);
        size_t cut = hash != NULL ? (size_t)(hash - line) : len;
        while (cut > 0 && line[cut - 1] == ' ')
            cut--;
        if (cut > 0 && json_array_append_new(list, json_stringn(line, cut)) != 0) {
            json_decref(list);
            return NULL;
        }
        line = nl != NULL ? nl + 1 : NULL;
    }
    return list;
}

/* A problem: {kind, subject, id, step, tool, state, age_s, reason, alert, command, commands}.
 * @p command is taken (NULL: out of memory, the problem is still listed without one). */
static json_t *problem_new(problem_kind_t kind, const char *subject, const json_t *row,
                           const char *id, const char *state, double age_s, const char *reason,
                           char *command)
{
    json_t *p =
        json_pack("{s:s, s:s, s:s, s:O?, s:O?, s:s?, s:f, s:s?, s:n, s:s?, s:o?}", "kind",
                  PROBLEM_NAMES[kind], "subject", subject, "id", id, "step",
                  json_object_get(row, "step"), "tool", json_object_get(row, "tool"), "state",
                  state, "age_s", age_s < 0 ? 0 : age_s, "reason", reason, "alert", "command",
                  command, "commands", command != NULL ? command_list(command) : NULL);
    free(command);
    return p;
}

/* The reason to show for a row: its error ("code: message") or its status_reason. Malloc'd. */
static char *row_reason(const json_t *row)
{
    const char *code = cli_str(row, "error_code", NULL);
    char *out = NULL;
    if (code != NULL && asprintf(&out, "%s: %s", code, cli_str(row, "error_message", "")) >= 0)
        return out;
    return strdup(cli_str(row, "status_reason", ""));
}

static bool problems_add(json_t *lists[PROBLEM__COUNT], problem_kind_t kind, json_t *p)
{
    return p != NULL && json_array_append_new(lists[kind], p) == 0;
}

/* The open alert naming this effect (and no obligation) or this obligation, if any. */
static const json_t *alert_of(const json_t *alerts, const char *effect_id,
                              const char *obligation_id)
{
    size_t i;
    json_t *a;
    json_array_foreach(alerts, i, a)
    {
        if (!alert_open(a))
            continue;
        const char *aoid = cli_str(a, "obligation_id", NULL);
        if (obligation_id != NULL ? aoid != NULL && strcmp(aoid, obligation_id) == 0
                                  : aoid == NULL && effect_id != NULL &&
                                        strcmp(cli_str(a, "effect_id", ""), effect_id) == 0)
            return a;
    }
    return NULL;
}

/* Every problem of the run, most urgent first (problem_kind_t), items in the order of their
 * lists. An open alert of an item listed already is said on that item, not listed again. NULL
 * when out of memory. */
static json_t *build_problems(const json_t *doc, long unknown_age_s)
{
    const json_t *effects = json_object_get(doc, "effects");
    const json_t *obligations = json_object_get(doc, "obligations");
    const json_t *alerts = json_object_get(doc, "alerts");
    const char *run_id = cli_str(json_object_get(doc, "run"), "run_id", "?");
    json_t *lists[PROBLEM__COUNT] = {NULL};
    json_t *all = json_array();
    bool ok = all != NULL;
    for (int k = 0; ok && k < PROBLEM__COUNT; k++)
        ok = (lists[k] = json_array()) != NULL;
    json_t *claimed = json_object(); /* dedup keys of the alerts said on an item */
    ok = ok && claimed != NULL;
    size_t i;
    json_t *row;
    json_array_foreach(effects, i, row)
    {
        tally_effect_state_t st;
        const char *id = cli_str(row, "effect_id", "?");
        if (!ok || !effect_state(row, &st))
            continue;
        json_t *p = NULL;
        char *reason = row_reason(row);
        if (st == TALLY_EFFECT_STUCK) {
            p = problem_new(PROBLEM_STUCK, "effect", row, id, tally_effect_state_name(st),
                            cli_num(row, "updated_age_s", 0), reason,
                            tally_alert_effect_command(id));
            ok = problems_add(lists, PROBLEM_STUCK, p);
        } else if (st == TALLY_EFFECT_UNKNOWN &&
                   cli_num(row, "unknown_age_s", 0) > (double)unknown_age_s) {
            char why[256];
            snprintf(why, sizeof why,
                     "older than %lds (TALLY_UNKNOWN_AGE_S); %lld status checks, %lld "
                     "inconclusive in a row; resolve it by hand only once you have checked "
                     "upstream",
                     unknown_age_s, (long long)cli_num(row, "status_checks", 0),
                     (long long)cli_num(row, "inconclusive_checks", 0));
            p = problem_new(PROBLEM_UNKNOWN_AGING, "effect", row, id, tally_effect_state_name(st),
                            cli_num(row, "unknown_age_s", 0), why, tally_alert_effect_command(id));
            ok = problems_add(lists, PROBLEM_UNKNOWN_AGING, p);
        } else if (st == TALLY_EFFECT_AWAITING_APPROVAL) {
            p = problem_new(PROBLEM_APPROVAL, "effect", row, id, tally_effect_state_name(st),
                            cli_num(row, "updated_age_s", 0), NULL,
                            tally_alert_approval_command(false, id));
            ok = problems_add(lists, PROBLEM_APPROVAL, p);
        }
        const json_t *a = p != NULL ? alert_of(alerts, id, NULL) : NULL;
        if (ok && a != NULL) {
            json_object_set(p, "alert", json_object_get(a, "dedup_key"));
            json_object_set(claimed, cli_str(a, "dedup_key", "?"), json_true());
        }
        free(reason);
    }
    json_array_foreach(obligations, i, row)
    {
        tally_obligation_state_t st;
        const char *id = cli_str(row, "obligation_id", "?");
        if (!ok || !tally_obligation_state_parse(cli_str(row, "status", ""), &st))
            continue;
        json_t *p = NULL;
        char *reason = row_reason(row);
        const json_t *a = alert_of(alerts, NULL, id);
        if (st == TALLY_OBLIGATION_STUCK) {
            p = problem_new(PROBLEM_STUCK, "obligation", row, id, tally_obligation_state_name(st),
                            cli_num(row, "updated_age_s", 0), reason,
                            tally_alert_obligation_command(id));
            ok = problems_add(lists, PROBLEM_STUCK, p);
        } else if (st == TALLY_OBLIGATION_AWAITING_APPROVAL) {
            p = problem_new(PROBLEM_APPROVAL, "obligation", row, id,
                            tally_obligation_state_name(st), cli_num(row, "updated_age_s", 0), NULL,
                            tally_alert_approval_command(true, id));
            ok = problems_add(lists, PROBLEM_APPROVAL, p);
        } else if (!tally_obligation_state_terminal(st) &&
                   json_is_true(json_object_get(row, "past_deadline"))) {
            /* nothing to decide on the obligation itself: its page says what to do */
            char *cmd = NULL;
            if (a != NULL && cli_str(a, "resolve_command", NULL) != NULL)
                cmd = strdup(cli_str(a, "resolve_command", ""));
            else if (asprintf(&cmd, "tally summary --run %s  # what the compensation reached",
                              run_id) < 0)
                cmd = NULL;
            p = problem_new(PROBLEM_DEADLINE_PASSED, "obligation", row, id,
                            tally_obligation_state_name(st), cli_num(row, "updated_age_s", 0),
                            "its compensation deadline has passed", cmd);
            ok = problems_add(lists, PROBLEM_DEADLINE_PASSED, p);
        }
        if (ok && p != NULL && a != NULL) {
            json_object_set(p, "alert", json_object_get(a, "dedup_key"));
            json_object_set(claimed, cli_str(a, "dedup_key", "?"), json_true());
        }
        free(reason);
    }
    json_array_foreach(alerts, i, row)
    {
        const char *key = cli_str(row, "dedup_key", "?");
        if (!ok || !alert_open(row) || json_object_get(claimed, key) != NULL)
            continue;
        char *cmd = cli_str(row, "resolve_command", NULL) != NULL
                        ? strdup(cli_str(row, "resolve_command", ""))
                        : tally_alert_close_command(key);
        json_t *p = problem_new(PROBLEM_ALERT, "alert", row, key, cli_str(row, "status", "?"),
                                cli_num(row, "age_s", 0), cli_str(row, "summary", NULL), cmd);
        ok = problems_add(lists, PROBLEM_ALERT, p) &&
             json_object_set(p, "alert", json_object_get(row, "dedup_key")) == 0;
    }
    json_array_foreach(json_object_get(doc, "findings"), i, row)
    {
        const char *id = cli_str(row, "finding_id", "?");
        char *cmd = NULL;
        if (!ok || asprintf(&cmd,
                            "tally resolve --finding %s --as resolved --reason \"<what you "
                            "did>\"  # once the upstream record is dealt with",
                            id) < 0) {
            ok = false;
            continue;
        }
        json_t *p = problem_new(PROBLEM_FINDING, "finding", row, id, cli_str(row, "kind", "?"),
                                cli_num(row, "age_s", 0), cli_str(row, "summary", NULL), cmd);
        ok = problems_add(lists, PROBLEM_FINDING, p);
    }
    for (int k = 0; ok && k < PROBLEM__COUNT; k++)
        ok = json_array_extend(all, lists[k]) == 0;
    for (int k = 0; k < PROBLEM__COUNT; k++)
        json_decref(lists[k]);
    json_decref(claimed);
    if (!ok) {
        json_decref(all);
        return NULL;
    }
    return all;
}

/* ---------------------------------------------------------------------------------------- */
/* doctor: printing                                                                         */

/* "02:26:27", or "11-26 02:26:27" when not on the day the run began (both UTC). */
static void when_of(const char *iso, const char *run_created, char *out, size_t outsz)
{
    if (iso == NULL || strlen(iso) < 19) {
        snprintf(out, outsz, "-");
        return;
    }
    if (run_created != NULL && strncmp(iso, run_created, 10) == 0)
        snprintf(out, outsz, "%.*s", 8, iso + 11); /* lint: slice (ISO time, ASCII) */
    else
        /* lint: slice (month, day and time of an ISO timestamp, ASCII) */
        snprintf(out, outsz, "%.*s %.*s", 5, iso + 5, 8, iso + 11);
}

static const char *plural(long long n)
{
    return n == 1 ? "" : "s";
}

/* "CONFIRMED 2, STUCK 1" of the rows' states, in the order first seen. */
static json_t *count_states(const json_t *rows)
{
    json_t *counts = json_object();
    size_t i;
    json_t *row;
    json_array_foreach(rows, i, row)
    {
        const char *st = cli_str(row, "status", "?");
        json_int_t n = json_integer_value(json_object_get(counts, st));
        if (counts != NULL && json_object_set_new(counts, st, json_integer(n + 1)) != 0) {
            json_decref(counts);
            return NULL;
        }
    }
    return counts;
}

static void counts_text(const json_t *counts, char *out, size_t outsz)
{
    size_t len = 0;
    const char *st;
    const json_t *n;
    out[0] = '\0';
    json_object_foreach((json_t *)counts, st, n)
    {
        int w = snprintf(out + len, outsz - len, "%s%s %lld", len > 0 ? ", " : "", st,
                         (long long)json_integer_value(n));
        if (w < 0 || (size_t)w >= outsz - len)
            break;
        len += (size_t)w;
    }
}

static bool is_marked(const json_t *doc, const char *kind, const char *id)
{
    const json_t *match = json_object_get(doc, "match");
    return id != NULL && strcmp(cli_str(match, "kind", ""), kind) == 0 &&
           strcmp(cli_str(match, "id", ""), id) == 0;
}

/* The run's header: state, times, what it holds. */
static void print_header(const json_t *doc)
{
    const json_t *run = json_object_get(doc, "run");
    const json_t *effects = json_object_get(doc, "effects");
    const json_t *obligations = json_object_get(doc, "obligations");
    const json_t *alerts = json_object_get(doc, "alerts");
    const json_t *counts = json_object_get(doc, "counts");
    char line[1024], created[48], age[32], states[512];

    int at = snprintf(line, sizeof line, "RUN %s  %s%s%s", cli_str(run, "run_id", "?"),
                      cli_str(run, "status", "?"), cli_str(run, "status_reason", NULL) ? ": " : "",
                      cli_str(run, "status_reason", ""));
    tally_run_state_t rs;
    size_t open = 0, i, moving = 0, total = json_array_size(effects);
    json_t *row;
    json_array_foreach(effects, i, row)
    {
        tally_effect_state_t st;
        moving += !effect_state(row, &st) || st == TALLY_EFFECT_AWAITING_APPROVAL ||
                  st == TALLY_EFFECT_STUCK || in_flight(row);
    }
    /* an ACTIVE run whose work is over (nothing in flight, waiting or STUCK) must not read as one
     * still going */
    if (run_state(run, &rs) && rs == TALLY_RUN_ACTIVE && total > 0 && moving == 0 && at > 0 &&
        (size_t)at < sizeof line)
        tally_fmt(line + at, sizeof line - (size_t)at, " · %s %zu effect%s settled, not completed",
                  total == 1 ? "its" : "all", total, total == 1 ? "" : "s");
    cli_wrap(stdout, line, 0, 2);
    cli_date(cli_str(run, "created_at", NULL), created, sizeof created);
    cli_age(cli_num(run, "updated_age_s", -1), age, sizeof age);
    snprintf(line, sizeof line, "created %s, last change %s ago", created, age);
    cli_field(stdout, 2, 13, "when", line);
    if (cli_str(run, "tenant", NULL) != NULL)
        cli_field(stdout, 2, 13, "tenant", cli_str(run, "tenant", NULL));
    if (cli_str(run, "compensation_deadline_at", NULL) != NULL) /* compensate_run deadline_ms */
        cli_field(stdout, 2, 13, "deadline", cli_str(run, "compensation_deadline_at", NULL));
    json_array_foreach(alerts, i, row)
    {
        open += alert_open(row);
    }
    counts_text(json_object_get(counts, "effects"), states, sizeof states);
    int n = snprintf(line, sizeof line, "%zu effect%s%s%s%s", json_array_size(effects),
                     plural((long long)json_array_size(effects)), *states ? " (" : "", states,
                     *states ? ")" : "");
    counts_text(json_object_get(counts, "obligations"), states, sizeof states);
    if (n > 0 && (size_t)n < sizeof line)
        n += snprintf(line + n, sizeof line - (size_t)n, ", %zu obligation%s%s%s%s",
                      json_array_size(obligations), plural((long long)json_array_size(obligations)),
                      *states ? " (" : "", states, *states ? ")" : "");
    if (n > 0 && (size_t)n < sizeof line)
        snprintf(line + n, sizeof line - (size_t)n, ", %zu alert%s (%zu" CLI_NBSP "open)",
                 json_array_size(alerts), plural((long long)json_array_size(alerts)), open);
    cli_field(stdout, 2, 13, "holds", line);
    long long waiting = (long long)cli_num(doc, "messages_waiting", 0);
    snprintf(line, sizeof line, "%lld message%s of this run waiting for the relay", waiting,
             plural(waiting));
    cli_field(stdout, 2, 13, "outbox", line);
    field_completion(run, effects);
    const json_t *summary = json_object_get(run, "summary");
    if (summary != NULL && !json_is_null(summary) && !cli_is_completion_summary(summary)) {
        snprintf(line, sizeof line, "written; see tally summary --run %s",
                 cli_str(run, "run_id", "?"));
        cli_field(stdout, 2, 13, "summary", line);
    }
    const json_t *match = json_object_get(doc, "match");
    if (match != NULL && strcmp(cli_str(match, "by", ""), "run") != 0) {
        snprintf(line, sizeof line, MARK " the %s %s (--%s)", cli_str(match, "kind", "?"),
                 cli_str(match, "id", "?"), cli_str(match, "by", "?"));
        cli_field(stdout, 2, 13, "found", line);
    }
}

static void print_problem(const json_t *p)
{
    static const char *const heads[PROBLEM__COUNT] = {
        "STUCK",      "UNKNOWN too long", "awaiting approval", "past its deadline",
        "open alert", "open finding"};
    problem_kind_t kind = PROBLEM_STUCK;
    for (int k = 0; k < PROBLEM__COUNT; k++)
        if (strcmp(cli_str(p, "kind", ""), PROBLEM_NAMES[k]) == 0)
            kind = (problem_kind_t)k;
    char line[1024], age[32], what[512];
    cli_age(cli_num(p, "age_s", 0), age, sizeof age);
    const char *subject = cli_str(p, "subject", "?");
    const json_t *step = json_object_get(p, "step");
    if (step != NULL && !json_is_null(step))
        tally_fmt(what, sizeof what, "%s, step %s %s", subject, json_string_value(step),
                  cli_str(p, "tool", ""));
    else if (kind == PROBLEM_FINDING)
        tally_fmt(what, sizeof what, "%s %s (%s)", subject, cli_str(p, "id", "?"),
                  cli_str(p, "state", "?"));
    else
        tally_fmt(what, sizeof what, "%s %s", subject, cli_str(p, "id", "?"));
    snprintf(line, sizeof line, "%s %s  %s  for" CLI_NBSP "%s",
             kind <= PROBLEM_UNKNOWN_AGING ? CLI_SYM_FAIL : CLI_SYM_WARN, heads[kind], what, age);
    printf("  ");
    cli_wrap(stdout, line, 2, 4);
    const char *reason = cli_str(p, "reason", NULL);
    if (reason != NULL && *reason != '\0') {
        printf("    ");
        cli_wrap(stdout, reason, 4, 4);
    }
    if (kind != PROBLEM_ALERT && cli_str(p, "alert", NULL) != NULL) {
        snprintf(line, sizeof line, "paged: alert %s is open", cli_str(p, "alert", "?"));
        printf("    ");
        cli_wrap(stdout, line, 4, 4);
    }
    cli_print_command(stdout, cli_str(p, "command", "tally status"), 4);
}

/* One line for an effect: step, tool, state, attempts, first and last change, ref or key, id. */
static void print_effect_line(const json_t *doc, const json_t *e, const char *run_created)
{
    char line[2048], first[32], last[32], extra[1024] = "";
    when_of(cli_str(e, "created_at", NULL), run_created, first, sizeof first);
    when_of(cli_str(e, "updated_at", NULL), run_created, last, sizeof last);
    long long attempts = (long long)cli_num(e, "attempts", 0);
    const char *ref = cli_str(e, "external_ref", NULL);
    tally_effect_state_t st;
    bool known = effect_state(e, &st);
    if (ref != NULL)
        tally_fmt(extra, sizeof extra, "  ref" CLI_NBSP "%s", ref);
    else if (!known || st != TALLY_EFFECT_CANCELLED)
        tally_fmt(extra, sizeof extra, "  key" CLI_NBSP "%s", cli_str(e, "operation_key", "?"));
    if (cli_str(e, "error_code", NULL) != NULL && (!known || st != TALLY_EFFECT_CONFIRMED)) {
        size_t len = strlen(extra);
        tally_fmt(extra + len, sizeof extra - len, "  error" CLI_NBSP "%s",
                  cli_str(e, "error_code", ""));
    }
    tally_fmt(line, sizeof line,
              "%s  %s  %s  %lld" CLI_NBSP "attempt%s  %s" CLI_NBSP "→" CLI_NBSP "%s%s  "
              "effect" CLI_NBSP "%s",
              cli_str(e, "step", "?"), cli_str(e, "tool", "?"), cli_str(e, "status", "?"), attempts,
              plural(attempts), first, last, extra, cli_str(e, "effect_id", "?"));
    printf(" %s ", is_marked(doc, "effect", cli_str(e, "effect_id", NULL)) ? MARK : " ");
    cli_wrap(stdout, line, 3, 5);
}

static void print_obligation_line(const json_t *doc, const json_t *o, const char *run_created)
{
    char line[2048], first[32], last[32], extra[1024] = "";
    when_of(cli_str(o, "created_at", NULL), run_created, first, sizeof first);
    when_of(cli_str(o, "updated_at", NULL), run_created, last, sizeof last);
    long long attempts = (long long)cli_num(o, "attempts", 0);
    if (cli_str(o, "external_ref", NULL) != NULL)
        tally_fmt(extra, sizeof extra, "  ref" CLI_NBSP "%s", cli_str(o, "external_ref", ""));
    if (cli_str(o, "error_code", NULL) != NULL) {
        size_t len = strlen(extra);
        tally_fmt(extra + len, sizeof extra - len, "  error" CLI_NBSP "%s",
                  cli_str(o, "error_code", ""));
    }
    tally_fmt(line, sizeof line,
              "%s  %s  %s" CLI_NBSP "(%s)  %lld" CLI_NBSP "attempt%s  %s" CLI_NBSP "→" CLI_NBSP
              "%s%s  obligation" CLI_NBSP "%s",
              cli_str(o, "step", "?"), cli_str(o, "tool", "?"), cli_str(o, "status", "?"),
              cli_str(o, "reason", "?"), attempts, plural(attempts), first, last, extra,
              cli_str(o, "obligation_id", "?"));
    printf(" %s ", is_marked(doc, "obligation", cli_str(o, "obligation_id", NULL)) ? MARK : " ");
    cli_wrap(stdout, line, 3, 5);
}

/* A section's heading, after a blank line, wrapped like any text. */
static void heading(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void heading(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    printf("\n");
    cli_wrap(stdout, line, 0, 2);
}

/* --full: the timeline, then each row whole, then the alerts. */
static void print_full(const json_t *doc)
{
    const json_t *events = json_object_get(doc, "events");
    const json_t *effects = json_object_get(doc, "effects");
    const json_t *obligations = json_object_get(doc, "obligations");
    const json_t *alerts = json_object_get(doc, "alerts");
    size_t i;
    json_t *row;
    heading("TIMELINE: %zu event%s, in order (times UTC)", json_array_size(events),
            plural((long long)json_array_size(events)));
    json_array_foreach(events, i, row)
    {
        print_event(row, effects, obligations);
    }
    heading("DETAILS OF THE EFFECTS: %zu, in step order", json_array_size(effects));
    json_array_foreach(effects, i, row)
    {
        if (i > 0)
            printf("\n");
        print_effect(row);
    }
    if (json_array_size(obligations) > 0) {
        heading("DETAILS OF THE OBLIGATIONS: %zu, in compensation order",
                json_array_size(obligations));
        json_array_foreach(obligations, i, row)
        {
            if (i > 0)
                printf("\n");
            print_obligation(row);
        }
    }
    if (json_array_size(alerts) > 0) {
        heading("ALERTS: %zu", json_array_size(alerts));
        json_array_foreach(alerts, i, row)
        {
            print_alert(row);
        }
    }
}

static bool print_doctor(const json_t *doc)
{
    const json_t *run = json_object_get(doc, "run");
    const json_t *effects = json_object_get(doc, "effects");
    const json_t *obligations = json_object_get(doc, "obligations");
    const json_t *problems = json_object_get(doc, "problems");
    const char *created = cli_str(run, "created_at", NULL);
    size_t i;
    json_t *row;

    print_header(doc);
    bool ok = print_open(run);
    if (json_array_size(problems) == 0) {
        heading("PROBLEMS: none");
    } else {
        heading("PROBLEMS: %zu, most urgent first", json_array_size(problems));
        json_array_foreach(problems, i, row)
        {
            print_problem(row);
        }
    }
    heading("EFFECTS: %zu, in step order (first → last change, UTC)", json_array_size(effects));
    json_array_foreach(effects, i, row)
    {
        print_effect_line(doc, row, created);
    }
    if (json_array_size(obligations) > 0) {
        heading("OBLIGATIONS: %zu, in compensation order (last step first)",
                json_array_size(obligations));
        json_array_foreach(obligations, i, row)
        {
            print_obligation_line(doc, row, created);
        }
    }
    if (json_object_get(doc, "events") != NULL)
        print_full(doc);
    return fflush(stdout) == 0 && ok;
}

/* ---------------------------------------------------------------------------------------- */
/* doctor: finding the run and reading it                                                   */

typedef enum { BY_RUN, BY_EFFECT, BY_OBLIGATION, BY_REF, BY_KEY, BY__COUNT } doctor_by_t;

static const char *const BY_FLAGS[BY__COUNT] = {"run", "effect", "obligation", "ref", "key"};

typedef struct doctor_opts {
    doctor_by_t by;
    const char *value;
    int given; /* how many of the handles were given */
    bool full, as_json;
} doctor_opts_t;

static bool check_handle(const doctor_opts_t *o)
{
    char flag[16];
    snprintf(flag, sizeof flag, "--%s", BY_FLAGS[o->by]);
    if (o->by == BY_EFFECT || o->by == BY_OBLIGATION) {
        if (cli_is_uuid(o->value))
            return true;
        return cli_usage_error("doctor", "%s takes a UUID (like %s)", flag,
                               "01a21ad3-55df-745f-9dd8-369fe7b15539") == CLI_EXIT_OK;
    }
    return cli_check_text("doctor", flag, o->value);
}

/* Several items carry this ref or key: list them, each with the command that shows it. */
static int print_candidates(const doctor_opts_t *o, const json_t *candidates)
{
    size_t n = json_array_size(candidates);
    fprintf(stderr,
            "tally doctor: --%s '%s' matches %s%zu items; name one with the commands below\n",
            BY_FLAGS[o->by], o->value, n >= (size_t)atoi(CANDIDATES_MAX) ? "at least " : "", n);
    if (o->as_json) {
        json_t *doc = json_pack("{s:s, s:s, s:s, s:O}", "error", "ambiguous", "by", BY_FLAGS[o->by],
                                "value", o->value, "candidates", candidates);
        size_t i;
        json_t *c;
        json_array_foreach(candidates, i, c)
        {
            char *cmd = NULL;
            if (asprintf(&cmd, "tally doctor --%s %s", cli_str(c, "kind", "?"),
                         cli_str(c, "id", "?")) >= 0)
                json_object_set_new(c, "command", json_string(cmd));
            free(cmd);
        }
        if (doc == NULL || !cli_print_json(doc))
            fprintf(stderr, "tally doctor: cannot write the candidates to stdout\n");
        json_decref(doc);
        return CLI_EXIT_REFUSED;
    }
    printf("%zu items match --%s %s:\n", n, BY_FLAGS[o->by], o->value);
    size_t i;
    json_t *c;
    json_array_foreach(candidates, i, c)
    {
        char line[1024], cmd[256];
        tally_fmt(line, sizeof line, "%s of run %s, step %s %s, %s", cli_str(c, "kind", "?"),
                  cli_str(c, "run_id", "?"), cli_str(c, "step", "?"), cli_str(c, "tool", "?"),
                  cli_str(c, "status", "?"));
        printf("  ");
        cli_wrap(stdout, line, 2, 4);
        snprintf(cmd, sizeof cmd, "tally doctor --%s %s", cli_str(c, "kind", "?"),
                 cli_str(c, "id", "?"));
        cli_print_command(stdout, cmd, 4);
    }
    fflush(stdout);
    return CLI_EXIT_REFUSED;
}

/* The match {by, value, kind, id, run_id} of the handle, or NULL with *@p rc set after saying
 * why (not found, several, a database error). */
static json_t *find_run(tally_pg_t *pg, const doctor_opts_t *o, int *rc)
{
    const char *params[1] = {o->value};
    tally_error_t err;
    json_t *found = NULL;
    tally_error_setc(&err, TALLY_ERR_OOM, "out of memory"); /* what a failed json_pack means */
    if (o->by == BY_RUN) {
        found = json_pack("{s:s, s:s}", "kind", "run", "id", o->value);
    } else if (o->by == BY_EFFECT || o->by == BY_OBLIGATION) {
        found = cli_query_json(pg, o->by == BY_EFFECT ? SQL_FIND_EFFECT : SQL_FIND_OBLIGATION, 1,
                               params, &err);
    } else {
        json_t *candidates =
            cli_query_json(pg, o->by == BY_REF ? SQL_FIND_REF : SQL_FIND_KEY, 1, params, &err);
        if (candidates != NULL && json_array_size(candidates) > 1) {
            *rc = print_candidates(o, candidates);
            json_decref(candidates);
            return NULL;
        }
        if (candidates != NULL) {
            found = json_array_size(candidates) == 1 ? json_incref(json_array_get(candidates, 0))
                                                     : json_null();
            json_decref(candidates);
        }
    }
    if (found == NULL) {
        *rc = cli_pg_fail("doctor", "cannot look the item up", &err);
        return NULL;
    }
    if (json_is_null(found)) {
        json_decref(found);
        fprintf(stderr, "tally doctor: no %s with %s '%s' in this ledger\n",
                o->by == BY_REF || o->by == BY_KEY ? "effect or obligation" : BY_FLAGS[o->by],
                o->by == BY_REF   ? "external ref"
                : o->by == BY_KEY ? "operation key"
                                  : "id",
                o->value);
        *rc = CLI_EXIT_REFUSED;
        return NULL;
    }
    if (o->by == BY_RUN)
        json_object_set_new(found, "run_id", json_string(o->value));
    json_object_set_new(found, "by", json_string(BY_FLAGS[o->by]));
    json_object_set_new(found, "value", json_string(o->value));
    json_object_del(found, "step");
    json_object_del(found, "tool");
    json_object_del(found, "status");
    return found;
}

/* An obligation's receipt is its effect's, copied when it was made (runops.c): printed once, on
 * the effect, and marked on the obligation. */
static void receipts_once(json_t *obligations, const json_t *effects)
{
    size_t i;
    json_t *o;
    json_array_foreach(obligations, i, o)
    {
        const json_t *e = find_by(effects, "effect_id", cli_str(o, "effect_id", NULL));
        const json_t *receipt = json_object_get(o, "receipt");
        bool same = e != NULL && receipt != NULL && !json_is_null(receipt) &&
                    json_equal(receipt, json_object_get(e, "receipt"));
        if (same)
            json_object_del(o, "receipt");
        json_object_set_new(o, "receipt_same_as_effect", json_boolean(same));
    }
}

static int doctor_options(doctor_opts_t *o, int argc, char **argv)
{
    static const struct option opts[] = {
        {"run", required_argument, NULL, 'r'},
        {"effect", required_argument, NULL, 'e'},
        {"obligation", required_argument, NULL, 'o'},
        {"ref", required_argument, NULL, 'f'},
        {"key", required_argument, NULL, 'k'},
        {"full", no_argument, NULL, 'F'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option("doctor", USAGE_DOCTOR, argc, argv, opts, &rc)) != -1) {
        doctor_by_t by = BY__COUNT;
        switch (c) {
        case 'r':
            by = BY_RUN;
            break;
        case 'e':
            by = BY_EFFECT;
            break;
        case 'o':
            by = BY_OBLIGATION;
            break;
        case 'f':
            by = BY_REF;
            break;
        case 'k':
            by = BY_KEY;
            break;
        case 'F':
            o->full = true;
            break;
        case 'j':
            o->as_json = true;
            break;
        }
        if (by != BY__COUNT) {
            o->by = by;
            o->value = optarg;
            o->given++;
        }
    }
    if (rc >= 0)
        return rc;
    if (o->given != 1)
        return cli_usage_error("doctor", "give one of --run R, --effect ID, --obligation ID, "
                                         "--ref EXTERNAL_REF or --key OPERATION_KEY");
    return check_handle(o) ? -1 : CLI_EXIT_USAGE;
}

int tally_cmd_doctor(int argc, char **argv, tally_config_t *cfg)
{
    doctor_opts_t o = {0};
    int rc = doctor_options(&o, argc, argv);
    if (rc >= 0)
        return rc;
    tally_pg_t *pg = cli_connect("doctor", cfg);
    if (pg == NULL)
        return CLI_EXIT_INFRA;
    tally_error_t err;
    json_t *match = NULL, *run = NULL, *events = NULL, *effects = NULL, *obligations = NULL;
    json_t *alerts = NULL, *findings = NULL, *waiting = NULL, *doc = NULL;
    if (!cli_begin_snapshot(pg, &err)) {
        rc = cli_pg_fail("doctor", "cannot read the ledger", &err);
        goto out;
    }
    if ((match = find_run(pg, &o, &rc)) == NULL)
        goto out;
    const char *params[1] = {cli_str(match, "run_id", "")};
    if ((run = cli_query_json(pg, SQL_RUN, 1, params, &err)) == NULL) {
        rc = cli_pg_fail("doctor", "cannot read the run", &err);
        goto out;
    }
    if (json_is_null(run)) {
        fprintf(stderr, "tally doctor: no run '%s' in this ledger\n", params[0]);
        rc = CLI_EXIT_REFUSED;
        goto out;
    }
    if ((o.full && (events = cli_query_json(pg, SQL_EVENTS, 1, params, &err)) == NULL) ||
        (effects = cli_query_json(pg, SQL_EFFECTS, 1, params, &err)) == NULL ||
        (obligations = cli_query_json(pg, SQL_OBLIGATIONS, 1, params, &err)) == NULL ||
        (alerts = cli_query_json(pg, SQL_ALERTS, 1, params, &err)) == NULL ||
        (findings = cli_query_json(pg, SQL_FINDINGS, 1, params, &err)) == NULL ||
        (waiting = cli_query_json(pg, cli_has_message_refs(pg) ? SQL_WAITING_REFS : SQL_WAITING, 1,
                                  params, &err)) == NULL) {
        rc = cli_pg_fail("doctor", "cannot read the run's history", &err);
        goto out;
    }
    tally_pg_rollback(pg);
    receipts_once(obligations, effects);
    json_t *counts = json_pack("{s:o?, s:o?}", "effects", count_states(effects), "obligations",
                               count_states(obligations));
    doc = json_pack("{s:O, s:O, s:o?, s:O, s:O, s:O, s:O, s:O}", "run", run, "match", match,
                    "counts", counts, "effects", effects, "obligations", obligations, "alerts",
                    alerts, "findings", findings, "messages_waiting", waiting);
    json_t *problems = doc != NULL ? build_problems(doc, cfg->unknown_age_s) : NULL;
    if (doc != NULL && (problems == NULL || json_object_set_new(doc, "problems", problems) != 0 ||
                        (events != NULL && json_object_set(doc, "events", events) != 0))) {
        json_decref(doc);
        doc = NULL;
    }
    rc = cli_print_report("doctor", doc, o.as_json, print_doctor);
out:
    json_decref(doc);
    json_decref(match);
    json_decref(run);
    json_decref(events);
    json_decref(effects);
    json_decref(obligations);
    json_decref(alerts);
    json_decref(findings);
    json_decref(waiting);
    tally_pg_free(pg);
    return rc;
}
