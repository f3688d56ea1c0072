/* cmd_doctor.c — one run, read whole: `tally doctor --run R` (the timeline of
 * every audit event in order, then each effect's and obligation's current row,
 * and the run's pages; for a completed run, its completion summary) and `tally summary --run R`
 * (the compensation summary of DESIGN §7: what was undone, what cannot be, what was skipped and
 * what waits for a human).
 *
 * Both read one snapshot (REPEATABLE READ) so the timeline and the rows agree.
 * Rows come out of PostgreSQL as to_jsonb(row): --json gives every column under
 * its own name, and a column added by a later migration appears without a
 * change here. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/cloudevent.h"
#include "tally/alert.h"
#include "tally/ledger.h"
#include "tally/runsummary.h"
#include "tally/text.h"

/* Data of one timeline event printed in full up to this many bytes (--json has
 * it all). */
#define EVENT_DATA_MAX 1200

static const char USAGE_DOCTOR[] =
    "usage: tally doctor --run R [--json]\n"
    "\n"
    "Everything the ledger (TALLY_PG) knows about one run, for finding out what happened:\n"
    "the timeline of every event in order (intents, transitions with their actor and reason,\n"
    "leases, connector requests and responses, status checks, receipts, obligations,\n"
    "operator decisions, alerts), then each effect as it is now (state, attempts, lease\n"
    "owner/until/epoch, receipt, external ref, error), each obligation, and the run's alerts.\n"
    "A COMPLETED run shows its completion summary (effects by state, those left open); a\n"
    "COMPLETING run, the effects it waits for.\n"
    "\n"
    "  --run R     the run id\n"
    "  --json      one JSON document: {run, events, effects, obligations, alerts,\n"
    "              messages_waiting}; rows carry every column under its own name\n"
    "  -h, --help  this text\n"
    "\n"
    "Exit status: 0 printed; 1 no such run; 2 usage error; 3 PostgreSQL could not be reached.\n";

static const char USAGE_SUMMARY[] =
    "usage: tally summary --run R [--json]\n"
    "\n"
    "The run's compensation summary: the one the compensator wrote when it settled the run,\n"
    "or, while compensation is under way (or the stored one is older than the run's\n"
    "obligations), one computed from the ledger now. Per effect, last step first:\n"
    "  " CLI_SYM_OK " compensated      with the reverse call's receipt\n"
    "  " CLI_SYM_WARN
    " uncompensatable  with the blast radius (what it reached, when, the receipt)\n"
    "  " CLI_SYM_SKIP " skipped          with the reason\n"
    "  " CLI_SYM_FAIL " failed / STUCK   with the error, the original receipt and what to do\n"
    "and the obligations still in progress.\n"
    "\n"
    "  --run R     the run id\n"
    "  --json      {run_id, run_status, source, summary_status, compensated, uncompensatable,\n"
    "              skipped, failed, pending, counts}\n"
    "  -h, --help  this text\n"
    "\n"
    "Exit status: 0 printed; 1 no such run; 2 usage error; 3 PostgreSQL could not be reached.\n";

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

static const char SQL_EFFECTS[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(e) || jsonb_build_object("
    "   'outbox_due_at', o.due_at, 'lease_held', coalesce(e.lease_until > now(), false),"
    "   'updated_age_s', extract(epoch FROM now() - e.updated_at)::float8)"
    "   ORDER BY e.step_num IS NULL, e.step_num, e.seq), '[]')"
    " FROM effects e LEFT JOIN outbox o ON o.effect_id = e.effect_id WHERE e.run_id = $1";

/* In compensation order: last step first. */
static const char SQL_OBLIGATIONS[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(o) || jsonb_build_object('step', e.step,"
    "   'step_is_number', " TALLY_SQL_STEP_IS_NUMBER(
        "e") ", 'tool', e.tool, 'effect_class', e.effect_class,"
             "   'effect_status', e.status, 'lease_held', coalesce(o.lease_until > now(), false))"
             "   ORDER BY e.step_num IS NULL DESC, e.step_num DESC, e.seq DESC, o.created_at), "
             "'[]')"
             " FROM obligations o JOIN effects e ON e.effect_id = o.effect_id WHERE o.run_id = $1";

static const char SQL_ALERTS[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(a) ORDER BY a.created_at, a.dedup_key), '[]')"
    " FROM alerts a WHERE a.run_id = $1"
    "   OR a.effect_id IN (SELECT effect_id FROM effects WHERE run_id = $1)"
    "   OR a.obligation_id IN (SELECT obligation_id FROM obligations WHERE run_id = $1)";

static const char SQL_WAITING[] =
    "SELECT to_jsonb(count(*)) FROM message_outbox WHERE msg_key = $1";

/* For the summary: the stored one, and whether it still describes the run — the
 * outcome it was written for is the run's status, and no obligation moved after
 * it was written. */
static const char SQL_STORED_SUMMARY[] =
    "SELECT jsonb_build_object('status', r.status, 'status_reason', r.status_reason,"
    "  'summary', r.summary, 'summary_status', r.summary_status, 'summary_at', r.summary_at,"
    "  'current', r.summary IS NOT NULL"
    "    AND (r.summary_status IS NULL OR r.summary_status = r.status)"
    "    AND (r.summary_at IS NULL OR r.summary_at >= coalesce((SELECT max(o.updated_at)"
    "      FROM obligations o WHERE o.run_id = r.run_id), r.summary_at)))"
    " FROM runs r WHERE r.run_id = $1";

/* One item per obligation, and one per effect that has none, last step first:
 * what the compensator's own summary is built from. */
static const char SQL_SUMMARY_ITEMS[] =
    "SELECT coalesce(jsonb_agg(x ORDER BY x.ord), '[]') FROM ("
    " SELECT row_number() OVER (ORDER BY e.step_num IS NULL DESC, e.step_num DESC, e.seq DESC,"
    "     o.created_at) AS ord,"
    "   e.effect_id, e.step, " TALLY_SQL_STEP_IS_NUMBER(
        "e") " AS step_is_number, e.tool, e.effect_class,"
             "   e.status AS effect_status,"
             "   CASE WHEN e.error_code IS NULL THEN NULL ELSE jsonb_build_object('code', "
             "e.error_code,"
             "     'message', e.error_message) END AS effect_error,"
             "   coalesce(o.receipt, e.receipt) AS receipt,"
             "   coalesce(o.external_ref, e.external_ref) AS external_ref,"
             "   o.obligation_id, o.status AS obligation_status, o.reason AS obligation_reason,"
             "   o.status_reason, o.reverse_receipt, o.blast_radius, o.error_code, o.error_message,"
             "   o.attempts"
             " FROM effects e LEFT JOIN obligations o ON o.effect_id = e.effect_id"
             " WHERE e.run_id = $1) x";

/* ---------------------------------------------------------------------------------------- */
/* Shared                                                                                   */

typedef struct run_opts {
    const char *verb;
    const char *run;
    bool as_json;
} run_opts_t;

/* Parse the options and connect. @returns the connection, or NULL with *@p rc the exit code
 * (--help, a usage error, PostgreSQL out of reach). */
static tally_pg_t *open_run(run_opts_t *o, const char *usage, int argc, char **argv,
                            const tally_config_t *cfg, int *rc)
{
    static const struct option opts[] = {
        {"run", required_argument, NULL, 'r'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int c;
    cli_options_begin();
    while ((c = cli_next_option(o->verb, usage, argc, argv, opts, rc)) != -1) {
        switch (c) {
        case 'r':
            o->run = optarg;
            break;
        case 'j':
            o->as_json = true;
            break;
        }
    }
    if (*rc >= 0)
        return NULL;
    if (o->run == NULL) {
        *rc = cli_usage_error(o->verb, "--run R is required");
        return NULL;
    }
    if (!cli_check_text(o->verb, "--run", o->run)) {
        *rc = CLI_EXIT_USAGE;
        return NULL;
    }
    tally_pg_t *pg = cli_connect(o->verb, cfg);
    if (pg == NULL)
        *rc = CLI_EXIT_INFRA;
    return pg;
}

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

/* "2026-11-22 00:33:21 UTC" */
static void date_of(const char *iso, char *out, size_t outsz)
{
    if (iso == NULL || strlen(iso) < 19)
        snprintf(out, outsz, "%s", iso != NULL ? iso : "-");
    else
        /* lint: slice (the date and time of an ISO timestamp, ASCII) */
        snprintf(out, outsz, "%.*s %.*s UTC", 10, iso, 8, iso + 11);
}

/* A member as text for a field line: strings as they are, other JSON compact;
 * NULL when the member is missing or null. Malloc'd. */
static char *member_text(const json_t *obj, const char *key)
{
    const json_t *v = json_object_get(obj, key);
    if (v == NULL || json_is_null(v))
        return NULL;
    if (json_is_string(v))
        return strdup(json_string_value(v));
    return cli_json_text(v);
}

/* Print "label  value" when the member is set; an object or array too wide for the line is
 * printed indented below its label. */
static void field_member(const json_t *obj, const char *key, const char *label, size_t indent)
{
    char *text = member_text(obj, key);
    if (text == NULL)
        return;
    const json_t *v = json_object_get(obj, key);
    if ((json_is_object(v) || json_is_array(v)) && indent + 15 + cli_text_width(text) > CLI_WIDTH) {
        printf("%*s%s\n", (int)indent, "", label);
        cli_json_block(stdout, v, indent + 2);
    } else {
        cli_field(stdout, indent, 13, label, text);
    }
    free(text);
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

/* runs.summary holds a completed run's completion summary ({total, effects: {status: count},
 * open: [...], open_count}) or, once the run is compensated, the compensation summary
 * ({compensated, uncompensatable, skipped, failed, ...}). */
static bool is_completion_summary(const json_t *summary)
{
    return json_is_object(json_object_get(summary, "effects")) &&
           json_object_get(summary, "compensated") == NULL;
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

/* Whether a run in status @p status (its name) was ever asked to compensate: not while it is
 * ACTIVE, CANCELLED (without compensation) or completing; an unknown status counts as asked. */
static bool compensation_asked(const char *status)
{
    tally_run_state_t rs;
    if (status == NULL || !tally_run_state_parse(status, &rs))
        return true;
    switch (rs) {
    case TALLY_RUN_ACTIVE:
    case TALLY_RUN_CANCELLED:
    case TALLY_RUN_COMPLETING:
    case TALLY_RUN_COMPLETED:
        return false;
    default:
        return true;
    }
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
    if (!is_completion_summary(summary))
        return;
    size_t len = 0;
    long long total = (long long)cli_num(summary, "total", 0);
    char at[48] = "";
    if (cli_str(run, "completed_at", NULL) != NULL) {
        date_of(cli_str(run, "completed_at", NULL), at, sizeof at);
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
    if (!is_completion_summary(summary) || count == 0)
        return true;
    printf("\nLEFT OPEN AT COMPLETION: %lld (a human decides these)\n", count);
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
        char *text = cli_json_text(data);
        if (text != NULL && strlen(text) > EVENT_DATA_MAX) {
            /* cut on a character boundary and say so */
            size_t cut = EVENT_DATA_MAX;
            while (cut > 0 && ((unsigned char)text[cut] & 0xC0) == 0x80)
                cut--;
            snprintf(text + cut, strlen(text) + 1 - cut, " …(%zu bytes; --json has it all)",
                     strlen(text));
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
    field_member(e, "effect_id", "effect", 2);
    field_member(e, "operation_key", "key", 2);
    field_member(e, "status_reason", "reason", 2);
    snprintf(line, sizeof line, "%lld", (long long)cli_num(e, "attempts", 0));
    cli_field(stdout, 2, 13, "attempts", line);
    field_lease(e, 2);
    field_member(e, "receipt", "receipt", 2);
    field_member(e, "external_ref", "external ref", 2);
    field_error(e, "error_code", "error_message", 2);
    if (cli_str(e, "unknown_since", NULL) != NULL) {
        char since[48];
        date_of(cli_str(e, "unknown_since", NULL), since, sizeof since);
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
        date_of(cli_str(e, "outbox_due_at", NULL), due, sizeof due);
        snprintf(line, sizeof line, "due %s", due);
        cli_field(stdout, 2, 13, "dispatch", line);
    }
    field_member(e, "intent_id", "intent", 2);
    field_member(e, "args_canonical", "args", 2);
    tally_effect_state_t st;
    if (effect_state(e, &st) && st == TALLY_EFFECT_STUCK) {
        char *cmd = tally_alert_effect_command(cli_str(e, "effect_id", "?"));
        cli_print_command(stdout, cmd, 2);
        free(cmd);
    }
}

static void print_obligation(const json_t *o)
{
    char line[1024];
    snprintf(line, sizeof line, "obligation for step %s  %s (%s)  %s  [%s]",
             cli_str(o, "step", "?"), cli_str(o, "tool", "?"), cli_str(o, "effect_class", "?"),
             cli_str(o, "status", "?"), cli_str(o, "reason", "?"));
    cli_wrap(stdout, line, 0, 2);
    field_member(o, "obligation_id", "obligation", 2);
    field_member(o, "effect_id", "effect", 2);
    field_member(o, "external_ref", "external ref", 2);
    field_member(o, "status_reason", "reason", 2);
    snprintf(line, sizeof line, "%lld", (long long)cli_num(o, "attempts", 0));
    cli_field(stdout, 2, 13, "attempts", line);
    field_lease(o, 2);
    if (cli_str(o, "approved_by", NULL) != NULL) {
        char at[48];
        date_of(cli_str(o, "approved_at", NULL), at, sizeof at);
        snprintf(line, sizeof line, "by %s at %s", cli_str(o, "approved_by", "?"), at);
        cli_field(stdout, 2, 13, "approved", line);
    }
    field_member(o, "receipt", "receipt", 2);
    field_member(o, "reverse_receipt", "reverse rcpt", 2);
    field_member(o, "blast_radius", "blast radius", 2);
    field_error(o, "error_code", "error_message", 2);
    tally_obligation_state_t st;
    if (!tally_obligation_state_parse(cli_str(o, "status", ""), &st))
        return;
    if (st == TALLY_OBLIGATION_STUCK) {
        char *cmd = tally_alert_obligation_command(cli_str(o, "obligation_id", "?"));
        cli_print_command(stdout, cmd, 2);
        free(cmd);
    } else if (st == TALLY_OBLIGATION_AWAITING_APPROVAL) {
        snprintf(line, sizeof line,
                 "tally approve --obligation %s --reason \"<why>\"\n"
                 "tally deny --obligation %s --reason \"<why>\"",
                 cli_str(o, "obligation_id", "?"), cli_str(o, "obligation_id", "?"));
        cli_print_command(stdout, line, 2);
    }
}

static void print_alert(const json_t *a)
{
    char line[1024], at[48];
    bool open = alert_open(a);
    date_of(cli_str(a, "created_at", NULL), at, sizeof at);
    snprintf(line, sizeof line, "%s %s %s  %s  opened %s", open ? CLI_SYM_WARN : CLI_SYM_OK,
             cli_str(a, "status", "?"), cli_str(a, "dedup_key", "?"), cli_str(a, "severity", "?"),
             at);
    cli_wrap(stdout, line, 0, 4);
    field_member(a, "summary", "summary", 2);
    field_member(a, "reason", "reason", 2);
    field_member(a, "runbook", "runbook", 2);
    field_member(a, "pager_state", "pager", 2);
    if (!open) {
        date_of(cli_str(a, "resolved_at", NULL), at, sizeof at);
        cli_field(stdout, 2, 13, "resolved", at);
    } else if (cli_str(a, "resolve_command", NULL) != NULL) {
        cli_print_command(stdout, cli_str(a, "resolve_command", ""), 2);
    }
}

static bool print_doctor(const json_t *doc)
{
    const json_t *run = json_object_get(doc, "run");
    const json_t *events = json_object_get(doc, "events");
    const json_t *effects = json_object_get(doc, "effects");
    const json_t *obligations = json_object_get(doc, "obligations");
    const json_t *alerts = json_object_get(doc, "alerts");
    char line[1024], created[48], age[32];

    snprintf(line, sizeof line, "RUN %s  %s%s%s", cli_str(run, "run_id", "?"),
             cli_str(run, "status", "?"), cli_str(run, "status_reason", NULL) ? ": " : "",
             cli_str(run, "status_reason", ""));
    cli_wrap(stdout, line, 0, 2);
    date_of(cli_str(run, "created_at", NULL), created, sizeof created);
    cli_age(cli_num(run, "updated_age_s", -1), age, sizeof age);
    snprintf(line, sizeof line, "created %s, last change %s ago", created, age);
    cli_field(stdout, 2, 13, "when", line);
    if (cli_str(run, "tenant", NULL) != NULL)
        cli_field(stdout, 2, 13, "tenant", cli_str(run, "tenant", NULL));
    if (cli_str(run, "compensation_deadline_at", NULL) != NULL) /* compensate_run deadline_ms */
        cli_field(stdout, 2, 13, "deadline", cli_str(run, "compensation_deadline_at", NULL));
    size_t open = 0, i;
    json_t *row;
    json_array_foreach(alerts, i, row)
    {
        open += alert_open(row);
    }
    snprintf(line, sizeof line, "%zu effect%s, %zu obligation%s, %zu alert%s (%zu open)",
             json_array_size(effects), json_array_size(effects) == 1 ? "" : "s",
             json_array_size(obligations), json_array_size(obligations) == 1 ? "" : "s",
             json_array_size(alerts), json_array_size(alerts) == 1 ? "" : "s", open);
    cli_field(stdout, 2, 13, "holds", line);
    long long waiting = (long long)cli_num(doc, "messages_waiting", 0);
    snprintf(line, sizeof line, "%lld message%s of this run waiting for the relay", waiting,
             waiting == 1 ? "" : "s");
    cli_field(stdout, 2, 13, "outbox", line);
    field_completion(run, effects);
    const json_t *summary = json_object_get(run, "summary");
    if (summary != NULL && !json_is_null(summary) && !is_completion_summary(summary))
        cli_field(stdout, 2, 13, "summary", "written; see tally summary --run");
    bool ok = print_open(run);

    printf("\nTIMELINE: %zu event%s, in order (times UTC)\n", json_array_size(events),
           json_array_size(events) == 1 ? "" : "s");
    json_array_foreach(events, i, row)
    {
        print_event(row, effects, obligations);
    }

    printf("\nEFFECTS: %zu, in step order\n", json_array_size(effects));
    json_array_foreach(effects, i, row)
    {
        if (i > 0)
            printf("\n");
        print_effect(row);
    }
    if (json_array_size(obligations) > 0) {
        printf("\nOBLIGATIONS: %zu, in compensation order (last step first)\n",
               json_array_size(obligations));
        json_array_foreach(obligations, i, row)
        {
            if (i > 0)
                printf("\n");
            print_obligation(row);
        }
    }
    if (json_array_size(alerts) > 0) {
        printf("\nALERTS: %zu\n", json_array_size(alerts));
        json_array_foreach(alerts, i, row)
        {
            print_alert(row);
        }
    }
    return fflush(stdout) == 0 && ok;
}

int tally_cmd_doctor(int argc, char **argv, tally_config_t *cfg)
{
    run_opts_t o = {.verb = "doctor"};
    int rc;
    tally_pg_t *pg = open_run(&o, USAGE_DOCTOR, argc, argv, cfg, &rc);
    if (pg == NULL)
        return rc;
    const char *params[1] = {o.run};
    tally_error_t err;
    json_t *run = NULL, *events = NULL, *effects = NULL, *obligations = NULL, *alerts = NULL;
    json_t *waiting = NULL, *doc = NULL;
    if (!cli_begin_snapshot(pg, &err) ||
        (run = cli_query_json(pg, SQL_RUN, 1, params, &err)) == NULL) {
        rc = cli_pg_fail(o.verb, "cannot read the run", &err);
        goto out;
    }
    if (json_is_null(run)) {
        fprintf(stderr, "tally doctor: no run '%s' in this ledger\n", o.run);
        rc = CLI_EXIT_REFUSED;
        goto out;
    }
    if ((events = cli_query_json(pg, SQL_EVENTS, 1, params, &err)) == NULL ||
        (effects = cli_query_json(pg, SQL_EFFECTS, 1, params, &err)) == NULL ||
        (obligations = cli_query_json(pg, SQL_OBLIGATIONS, 1, params, &err)) == NULL ||
        (alerts = cli_query_json(pg, SQL_ALERTS, 1, params, &err)) == NULL ||
        (waiting = cli_query_json(pg, SQL_WAITING, 1, params, &err)) == NULL) {
        rc = cli_pg_fail(o.verb, "cannot read the run's history", &err);
        goto out;
    }
    tally_pg_rollback(pg);
    doc = json_pack("{s:O, s:O, s:O, s:O, s:O, s:O}", "run", run, "events", events, "effects",
                    effects, "obligations", obligations, "alerts", alerts, "messages_waiting",
                    waiting);
    rc = cli_print_report(o.verb, doc, o.as_json, print_doctor);
out:
    json_decref(doc);
    json_decref(run);
    json_decref(events);
    json_decref(effects);
    json_decref(obligations);
    json_decref(alerts);
    json_decref(waiting);
    tally_pg_free(pg);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* summary                                                                                  */

/* The summary document: the stored one's lists, or the LIVE view of @p items (runsummary.h). */
static json_t *build_summary(const char *run_id, const json_t *stored, const json_t *items)
{
    const json_t *summary = json_object_get(stored, "summary");
    bool use_stored =
        json_is_true(json_object_get(stored, "current")) && !is_completion_summary(summary);
    json_t *doc = json_pack("{s:s, s:O, s:O, s:s, s:O?, s:O?}", "run_id", run_id, "run_status",
                            json_object_get(stored, "status"), "run_reason",
                            json_object_get(stored, "status_reason")
                                ? json_object_get(stored, "status_reason")
                                : json_null(),
                            "source", use_stored ? "compensator" : "ledger", "summary_status",
                            json_object_get(stored, "summary_status"), "summary_at",
                            json_object_get(stored, "summary_at"));
    if (doc == NULL)
        return NULL;
    json_t *lists[TALLY_RUNSUM__COUNT]; /* borrowed from doc */
    bool ok = true;
    for (int l = 0; ok && l < TALLY_RUNSUM__COUNT; l++) {
        const char *name = tally_runsum_list_name((tally_runsum_list_t)l);
        const json_t *from = use_stored ? json_object_get(summary, name) : NULL;
        lists[l] = json_is_array(from) ? json_deep_copy(from) : json_array();
        ok = lists[l] != NULL && json_object_set_new(doc, name, lists[l]) == 0;
    }
    if (ok && !use_stored)
        ok = tally_runsum_sort(TALLY_RUNSUM_LIVE, items, lists);
    json_t *counts = json_object();
    ok = ok && counts != NULL;
    for (int l = 0; ok && l < TALLY_RUNSUM__COUNT; l++)
        ok = json_object_set_new(counts, tally_runsum_list_name((tally_runsum_list_t)l),
                                 json_integer((json_int_t)json_array_size(lists[l]))) == 0;
    if (ok) {
        ok = json_object_set_new(doc, "counts", counts) == 0; /* takes counts */
        counts = NULL;
    }
    json_decref(counts);
    if (!ok) {
        json_decref(doc);
        return NULL;
    }
    return doc;
}

/* An action_required text: the words, then the commands to copy when they end the text (this
 * file's summaries and the compensator's "...; then settle it: tally resolve ..."); a command
 * in the middle of a sentence stays in the sentence. */
static void print_action(const char *action)
{
    const char *cmd = strstr(action, "tally resolve");
    if (cmd == NULL || strchr(cmd, ';') != NULL) {
        cli_field(stdout, 6, 13, "action", action);
        return;
    }
    size_t len = (size_t)(cmd - action);
    while (len > 0 && (action[len - 1] == ' ' || action[len - 1] == '\n'))
        len--;
    char what[1024];
    char *slice = strndup(action, len);
    tally_text_copy(what, sizeof what, slice != NULL ? slice : action); /* may be a tool's text */
    free(slice);
    cli_field(stdout, 6, 13, "action", what);
    cli_print_command(stdout, cmd, 8);
}

/* One entry: the symbol, the step and tool, then its details. */
static void print_entry(const char *sym, const json_t *e, tally_runsum_list_t list)
{
    char line[1024];
    const json_t *step = json_object_get(e, "step");
    char step_text[128];
    if (json_is_integer(step))
        snprintf(step_text, sizeof step_text, "%lld", (long long)json_integer_value(step));
    else
        snprintf(step_text, sizeof step_text, "%s",
                 json_string_value(step) ? json_string_value(step) : "?");
    snprintf(line, sizeof line, "%s step %s  %s%s%s", sym, step_text, cli_str(e, "tool", "?"),
             cli_str(e, "status", NULL) ? "  " : "", cli_str(e, "status", ""));
    printf("  ");
    cli_wrap(stdout, line, 2, 6);
    field_member(e, "effect_id", "effect", 6);
    field_member(e, "external_ref", "external ref", 6);
    switch (list) {
    case TALLY_RUNSUM_COMPENSATED:
        field_member(e, "reverse_receipt", "reverse rcpt", 6);
        field_member(e, "reason", "how", 6);
        return;
    case TALLY_RUNSUM_UNCOMPENSATABLE: {
        const json_t *br = json_object_get(e, "blast_radius");
        const json_t *target = json_object_get(br, "target");
        if (json_is_object(target)) {
            char *value = member_text(target, "value");
            snprintf(line, sizeof line, "%s = %s", cli_str(target, "field", "?"),
                     value != NULL ? value : "?");
            free(value);
            cli_field(stdout, 6, 13, "reached", line);
        }
        field_member(br, "time", "happened at", 6);
        field_member(br, "receipt", "receipt", 6);
        field_member(br, "args", "args", 6);
        field_member(e, "reason", "why", 6);
        return;
    }
    case TALLY_RUNSUM_SKIPPED:
    case TALLY_RUNSUM_PENDING:
        field_member(e, "reason", "reason", 6);
        return;
    case TALLY_RUNSUM_FAILED:
    case TALLY_RUNSUM__COUNT:
        break;
    }
    const json_t *err = json_object_get(e, "error");
    if (json_is_object(err)) {
        snprintf(line, sizeof line, "%s: %s", cli_str(err, "code", "?"),
                 cli_str(err, "message", ""));
        cli_field(stdout, 6, 13, "error", line);
    }
    field_member(e, "receipt", "receipt", 6);
    const char *action = cli_str(e, "action_required", NULL);
    if (action != NULL)
        print_action(action);
}

static bool print_summary(const json_t *doc)
{
    static const struct {
        tally_runsum_list_t list;
        const char *sym, *title;
    } SECTIONS[] = {
        {TALLY_RUNSUM_COMPENSATED, CLI_SYM_OK, "compensated"},
        {TALLY_RUNSUM_UNCOMPENSATABLE, CLI_SYM_WARN, "uncompensatable"},
        {TALLY_RUNSUM_SKIPPED, CLI_SYM_SKIP, "skipped"},
        {TALLY_RUNSUM_FAILED, CLI_SYM_FAIL, "failed / STUCK: action required"},
        {TALLY_RUNSUM_PENDING, "…", "in progress"},
    };
    char line[1024];
    const char *source = cli_str(doc, "source", "ledger");
    snprintf(line, sizeof line, "COMPENSATION SUMMARY of run %s: %s", cli_str(doc, "run_id", "?"),
             cli_str(doc, "run_status", "?"));
    cli_wrap(stdout, line, 0, 2);
    if (cli_str(doc, "run_reason", NULL) != NULL)
        cli_field(stdout, 2, 8, "reason", cli_str(doc, "run_reason", NULL));
    if (strcmp(source, "compensator") == 0) {
        char at[48];
        date_of(cli_str(doc, "summary_at", NULL), at, sizeof at);
        snprintf(line, sizeof line, "written by the compensator%s%s",
                 cli_str(doc, "summary_at", NULL) ? " at " : "",
                 cli_str(doc, "summary_at", NULL) ? at : "");
    } else {
        snprintf(
            line, sizeof line,
            "computed from the ledger now (the compensator writes its own once the run settles)");
    }
    cli_field(stdout, 2, 8, "source", line);
    if (!compensation_asked(cli_str(doc, "run_status", NULL)) &&
        json_array_size(json_object_get(doc, "compensated")) == 0 &&
        json_array_size(json_object_get(doc, "uncompensatable")) == 0) {
        snprintf(line, sizeof line,
                 "no compensation was asked for this run; `tally compensate --run %s "
                 "--dry-run` shows what it would do",
                 cli_str(doc, "run_id", "?"));
        cli_field(stdout, 2, 8, "note", line);
    }

    size_t total = 0;
    for (size_t s = 0; s < sizeof SECTIONS / sizeof SECTIONS[0]; s++) {
        const json_t *list = json_object_get(doc, tally_runsum_list_name(SECTIONS[s].list));
        total += json_array_size(list);
        if (json_array_size(list) == 0)
            continue;
        printf("\n%s %s: %zu\n", SECTIONS[s].sym, SECTIONS[s].title, json_array_size(list));
        size_t i;
        json_t *e;
        json_array_foreach(list, i, e)
        {
            print_entry(SECTIONS[s].sym, e, SECTIONS[s].list);
        }
    }
    if (total == 0)
        printf("\nThe run has no effects.\n");
    return fflush(stdout) == 0;
}

int tally_cmd_summary(int argc, char **argv, tally_config_t *cfg)
{
    run_opts_t o = {.verb = "summary"};
    int rc;
    tally_pg_t *pg = open_run(&o, USAGE_SUMMARY, argc, argv, cfg, &rc);
    if (pg == NULL)
        return rc;
    const char *params[1] = {o.run};
    tally_error_t err;
    json_t *stored = NULL, *items = NULL, *doc = NULL;
    if (!cli_begin_snapshot(pg, &err)) {
        rc = cli_pg_fail(o.verb, "cannot read the ledger", &err);
        goto out;
    }
    PGresult *res = tally_pg_exec(pg, SQL_STORED_SUMMARY, 1, params, &err);
    if (res == NULL) {
        rc = cli_pg_fail(o.verb, "cannot read the run", &err);
        goto out;
    }
    if (PQntuples(res) == 0) {
        PQclear(res);
        fprintf(stderr, "tally summary: no run '%s' in this ledger\n", o.run);
        rc = CLI_EXIT_REFUSED;
        goto out;
    }
    stored = json_loads(PQgetvalue(res, 0, 0), 0, NULL);
    PQclear(res);
    if (stored == NULL ||
        (items = cli_query_json(pg, SQL_SUMMARY_ITEMS, 1, params, &err)) == NULL) {
        if (stored == NULL)
            tally_error_setc(&err, TALLY_ERR_JSON, "the run row did not read back as JSON");
        rc = cli_pg_fail(o.verb, "cannot read the run's obligations", &err);
        goto out;
    }
    tally_pg_rollback(pg);
    doc = build_summary(o.run, stored, items);
    rc = cli_print_report(o.verb, doc, o.as_json, print_summary);
out:
    json_decref(doc);
    json_decref(items);
    json_decref(stored);
    tally_pg_free(pg);
    return rc;
}
