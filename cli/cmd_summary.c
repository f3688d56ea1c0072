/* cmd_summary.c — `tally summary --run R`: a run's compensation summary (DESIGN §7), as the
 * compensator wrote it when the run settled, or computed from the ledger now (runsummary.h):
 * per effect, last step first, what became of it — and for a run no compensation was asked
 * for, what it did and left standing. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/cloudevent.h"
#include "tally/ledger.h"
#include "tally/runops.h"
#include "tally/runsummary.h"
#include "tally/text.h"

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
    "the obligations still in progress, the extra copies of a DUPLICATE (reversed on their\n"
    "own), and for a run no compensation was asked for, what happened and stands.\n"
    "\n"
    "  --run R     the run id\n"
    "  --json      {run_id, run_status, source, summary_status, effects: {total, settled},\n"
    "              compensated, uncompensatable, skipped, failed, pending, done, duplicates,\n"
    "              counts}\n"
    "  -h, --help  this text\n"
    "\n"
    "Exit status: 0 printed; 1 no such run; 2 usage error; 3 PostgreSQL could not be reached.\n";

/* The stored summary, and whether it still describes the run: the outcome it was written for
 * is the run's status, and no obligation moved after it was written. */
static const char SQL_STORED_SUMMARY[] =
    "SELECT (SELECT jsonb_build_object('status', r.status, 'status_reason', r.status_reason,"
    "  'summary', r.summary, 'summary_status', r.summary_status, 'summary_at', r.summary_at,"
    "  'current', r.summary IS NOT NULL"
    "    AND (r.summary_status IS NULL OR r.summary_status = r.status)"
    "    AND (r.summary_at IS NULL OR r.summary_at >= coalesce((SELECT max(o.updated_at)"
    "      FROM obligations o WHERE o.run_id = r.run_id), r.summary_at)))"
    " FROM runs r WHERE r.run_id = $1)";

/* The items runsummary.h reads, last step first: each effect with the obligation for its own
 * record (or none), then one item per obligation of an extra copy a DUPLICATE found, with the
 * record the effect kept (kept_ref). */
#define SUMMARY_ITEM_COLUMNS                                                                       \
    "   e.effect_id, e.step, " TALLY_SQL_STEP_IS_NUMBER(                                           \
        "e") " AS step_is_number, e.tool,"                                                         \
             "   e.effect_class, e.status AS effect_status,"                                       \
             "   CASE WHEN e.error_code IS NULL THEN NULL"                                         \
             "     ELSE jsonb_build_object('code', e.error_code, 'message', e.error_message) END"  \
             "     AS effect_error,"                                                               \
             "   coalesce(o.receipt, e.receipt) AS receipt,"                                       \
             "   coalesce(o.external_ref, e.external_ref) AS external_ref, e.external_ref AS "     \
             "kept_ref,"                                                                           \
             "   o.obligation_id, o.status AS obligation_status, o.reason AS obligation_reason,"   \
             "   o.status_reason, o.reverse_receipt, o.blast_radius, o.error_code, "               \
             "o.error_message,"                                                                    \
             "   o.attempts, e.step_num, e.seq, o.created_at AS ob_created"

// clang-format off
static const char SQL_SUMMARY_ITEMS[] =
    "SELECT coalesce(jsonb_agg(to_jsonb(x) - 'step_num' - 'seq' - 'ob_created'"
    "   ORDER BY x.step_num IS NULL DESC, x.step_num DESC, x.seq DESC,"
    "   x.ob_created NULLS FIRST), '[]') FROM ("
    " SELECT" SUMMARY_ITEM_COLUMNS
    " FROM effects e LEFT JOIN obligations o ON " TALLY_SQL_OWN_OBLIGATION("o", "e")
    " WHERE e.run_id = $1"
    " UNION ALL SELECT" SUMMARY_ITEM_COLUMNS
    " FROM effects e JOIN obligations o ON o.effect_id = e.effect_id"
    "   AND NOT " TALLY_SQL_OWN_OBLIGATION("o", "e")
    " WHERE e.run_id = $1) x";
// clang-format on

/* The lists in the order they are printed, with their symbol and title. */
static const struct {
    tally_runsum_list_t list;
    const char *sym, *title;
} SECTIONS[] = {
    {TALLY_RUNSUM_COMPENSATED, CLI_SYM_OK, "compensated"},
    {TALLY_RUNSUM_UNCOMPENSATABLE, CLI_SYM_WARN, "uncompensatable"},
    {TALLY_RUNSUM_SKIPPED, CLI_SYM_SKIP, "skipped"},
    {TALLY_RUNSUM_FAILED, CLI_SYM_FAIL, "failed / STUCK: action required"},
    {TALLY_RUNSUM_PENDING, "…", "in progress"},
    {TALLY_RUNSUM_DONE, CLI_SYM_OK, "done and standing: not compensated"},
    {TALLY_RUNSUM_DUPLICATES, "↺", "extra copies of a DUPLICATE, settled on their own"},
};
#define N_SECTIONS (sizeof SECTIONS / sizeof SECTIONS[0])
_Static_assert(N_SECTIONS == TALLY_RUNSUM__ALL, "a section for every list");

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

/* {total, settled}: the run's effects, and those that reached a state they stay in unless an
 * operator or a compensation moves them (not PLANNED, AWAITING_APPROVAL, DISPATCHING, UNKNOWN). */
static json_t *effect_counts(const json_t *items)
{
    json_t *seen = json_object();
    json_int_t total = 0, settled = 0;
    size_t i;
    json_t *item;
    json_array_foreach(items, i, item)
    {
        const char *id = cli_str(item, "effect_id", "");
        if (seen == NULL || json_object_get(seen, id) != NULL)
            continue;
        json_object_set_new(seen, id, json_true());
        total++;
        tally_effect_state_t st;
        if (!tally_effect_state_parse(cli_str(item, "effect_status", ""), &st))
            continue;
        switch (st) {
        case TALLY_EFFECT_PLANNED:
        case TALLY_EFFECT_AWAITING_APPROVAL:
        case TALLY_EFFECT_DISPATCHING:
        case TALLY_EFFECT_UNKNOWN:
        case TALLY_EFFECT__COUNT:
            break;
        case TALLY_EFFECT_CONFIRMED:
        case TALLY_EFFECT_FAILED:
        case TALLY_EFFECT_STUCK:
        case TALLY_EFFECT_REJECTED:
        case TALLY_EFFECT_CANCELLED:
            settled++;
            break;
        }
    }
    json_decref(seen);
    return json_pack("{s:I, s:I}", "total", total, "settled", settled);
}

/* The summary document: the stored one's lists (an extra copy's entry, which it lists by its
 * state, moved to the duplicates list), or the view of @p items that fits the run. */
static json_t *build_summary(const char *run_id, const json_t *stored, const json_t *items)
{
    const json_t *summary = json_object_get(stored, "summary");
    bool use_stored =
        json_is_true(json_object_get(stored, "current")) && !cli_is_completion_summary(summary);
    const char *run_status = json_string_value(json_object_get(stored, "status"));
    tally_runsum_view_t view =
        compensation_asked(run_status) ? TALLY_RUNSUM_LIVE : TALLY_RUNSUM_UNCOMPENSATED;
    const json_t *reason = json_object_get(stored, "status_reason");
    json_t *doc = json_pack("{s:s, s:O, s:O, s:s, s:O?, s:O?, s:o}", "run_id", run_id, "run_status",
                            json_object_get(stored, "status"), "run_reason",
                            reason != NULL ? reason : json_null(), "source",
                            use_stored ? "compensator" : "ledger", "summary_status",
                            json_object_get(stored, "summary_status"), "summary_at",
                            json_object_get(stored, "summary_at"), "effects", effect_counts(items));
    if (doc == NULL)
        return NULL;
    json_t *lists[TALLY_RUNSUM__ALL]; /* borrowed from doc */
    bool ok = true;
    for (int l = 0; ok && l < TALLY_RUNSUM__ALL; l++) {
        lists[l] = json_array();
        ok =
            lists[l] != NULL &&
            json_object_set_new(doc, tally_runsum_list_name((tally_runsum_list_t)l), lists[l]) == 0;
    }
    if (ok && use_stored) {
        for (int l = 0; ok && l < TALLY_RUNSUM__COUNT; l++) {
            size_t i;
            json_t *e;
            json_array_foreach(json_object_get(summary, tally_runsum_list_name(l)), i, e)
            {
                bool copy =
                    json_is_true(json_object_get(e, "duplicate_copy")) && l != TALLY_RUNSUM_FAILED;
                ok =
                    ok && json_array_append(lists[copy ? (int)TALLY_RUNSUM_DUPLICATES : l], e) == 0;
            }
        }
    } else if (ok) {
        ok = tally_runsum_sort_all(view, items, lists);
    }
    json_t *counts = json_object();
    ok = ok && counts != NULL;
    for (int l = 0; ok && l < TALLY_RUNSUM__ALL; l++)
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

/* An action_required text: the words, then the commands to copy when they end the text; a
 * command in the middle of a sentence stays in the sentence. */
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

/* One entry: the symbol, the step and tool (and what it is: an extra copy), then its details. */
static void print_entry(const char *sym, const json_t *e, tally_runsum_list_t list)
{
    char line[1024];
    const json_t *step = json_object_get(e, "step");
    char step_text[128];
    if (json_is_integer(step))
        snprintf(step_text, sizeof step_text, "%lld", (long long)json_integer_value(step));
    else
        tally_text_copy(step_text, sizeof step_text,
                        json_string_value(step) ? json_string_value(step) : "?");
    const char *status = cli_str(e, "status", NULL);
    tally_fmt(line, sizeof line, "%s step %s  %s%s%s%s", sym, step_text, cli_str(e, "tool", "?"),
              json_is_true(json_object_get(e, "duplicate_copy")) ? "  extra copy (DUPLICATE)" : "",
              status != NULL ? "  " : "", status != NULL ? status : "");
    printf("  ");
    cli_wrap(stdout, line, 2, 6);
    cli_field_member(e, "effect_id", "effect", 6);
    cli_field_member(e, "external_ref", "external ref", 6);
    if (list == TALLY_RUNSUM_UNCOMPENSATABLE) {
        const json_t *br = json_object_get(e, "blast_radius");
        const json_t *target = json_object_get(br, "target");
        if (json_is_object(target)) {
            const json_t *value = json_object_get(target, "value");
            char *text =
                json_is_string(value) ? strdup(json_string_value(value)) : cli_json_text(value);
            tally_fmt(line, sizeof line, "%s = %s", cli_str(target, "field", "?"),
                      text != NULL ? text : "?");
            free(text);
            cli_field(stdout, 6, 13, "reached", line);
        }
        cli_field_member(br, "time", "happened at", 6);
        cli_field_member(br, "receipt", "receipt", 6);
        cli_field_member(br, "args", "args", 6);
        cli_field_member(e, "reason", "why", 6);
        return;
    }
    if (list == TALLY_RUNSUM_FAILED) {
        const json_t *err = json_object_get(e, "error");
        if (json_is_object(err)) {
            tally_fmt(line, sizeof line, "%s: %s", cli_str(err, "code", "?"),
                      cli_str(err, "message", ""));
            cli_field(stdout, 6, 13, "error", line);
        }
        cli_field_member(e, "receipt", "receipt", 6);
        const char *action = cli_str(e, "action_required", NULL);
        if (action != NULL)
            print_action(action);
        return;
    }
    cli_field_member(e, "reverse_receipt", "reverse rcpt", 6);
    cli_field_member(e, "reason", list == TALLY_RUNSUM_COMPENSATED ? "how" : "reason", 6);
}

/* "ACTIVE · all 3 effects settled": the run's state as the ledger has it, and how far its
 * effects are, so a run whose work is over does not read as one still going. */
static void run_line(const json_t *doc, char *out, size_t outsz)
{
    const json_t *effects = json_object_get(doc, "effects");
    long long total = (long long)cli_num(effects, "total", 0);
    long long settled = (long long)cli_num(effects, "settled", 0);
    const char *status = cli_str(doc, "run_status", "?");
    if (total == 0)
        tally_fmt(out, outsz, "%s · no effects", status);
    else if (settled == total)
        tally_fmt(out, outsz, "%s · %s %lld effect%s settled", status, total == 1 ? "its" : "all",
                  total, total == 1 ? "" : "s");
    else
        tally_fmt(out, outsz, "%s · %lld of %lld effects settled, %lld in flight or waiting",
                  status, settled, total, total - settled);
}

static bool print_summary(const json_t *doc)
{
    char line[1024], run[256];
    const char *source = cli_str(doc, "source", "ledger");
    run_line(doc, run, sizeof run);
    tally_fmt(line, sizeof line, "COMPENSATION SUMMARY of run %s: %s", cli_str(doc, "run_id", "?"),
              run);
    cli_wrap(stdout, line, 0, 2);
    if (cli_str(doc, "run_reason", NULL) != NULL)
        cli_field(stdout, 2, 8, "reason", cli_str(doc, "run_reason", NULL));
    if (strcmp(source, "compensator") == 0) {
        char at[48];
        cli_date(cli_str(doc, "summary_at", NULL), at, sizeof at);
        tally_fmt(line, sizeof line, "written by the compensator%s%s",
                  cli_str(doc, "summary_at", NULL) ? " at " : "",
                  cli_str(doc, "summary_at", NULL) ? at : "");
    } else {
        tally_fmt(
            line, sizeof line,
            "computed from the ledger now (the compensator writes its own once the run settles)");
    }
    cli_field(stdout, 2, 8, "source", line);
    if (!compensation_asked(cli_str(doc, "run_status", NULL))) {
        tally_fmt(line, sizeof line,
                  "no compensation was asked for this run; `tally compensate --run %s "
                  "--dry-run` shows what it would do",
                  cli_str(doc, "run_id", "?"));
        cli_field(stdout, 2, 8, "note", line);
    }

    size_t total = 0;
    for (size_t s = 0; s < N_SECTIONS; s++) {
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

int tally_cmd_run_summary(int argc, char **argv, tally_config_t *cfg)
{
    static const struct option opts[] = {
        {"run", required_argument, NULL, 'r'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *verb = "summary", *run = NULL;
    bool as_json = false;
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option(verb, USAGE_SUMMARY, argc, argv, opts, &rc)) != -1) {
        if (c == 'r')
            run = optarg;
        else if (c == 'j')
            as_json = true;
    }
    if (rc >= 0)
        return rc;
    if (run == NULL)
        return cli_usage_error(verb, "--run R is required");
    if (!cli_check_text(verb, "--run", run))
        return CLI_EXIT_USAGE;
    tally_pg_t *pg = cli_connect(verb, cfg);
    if (pg == NULL)
        return CLI_EXIT_INFRA;
    const char *params[1] = {run};
    tally_error_t err;
    json_t *stored = NULL, *items = NULL, *doc = NULL;
    if (!cli_begin_snapshot(pg, &err)) {
        rc = cli_pg_fail(verb, "cannot read the ledger", &err);
        goto out;
    }
    if ((stored = cli_query_json(pg, SQL_STORED_SUMMARY, 1, params, &err)) == NULL) {
        rc = cli_pg_fail(verb, "cannot read the run", &err);
        goto out;
    }
    if (json_is_null(stored)) {
        fprintf(stderr, "tally summary: no run '%s' in this ledger\n", run);
        rc = CLI_EXIT_REFUSED;
        goto out;
    }
    if ((items = cli_query_json(pg, SQL_SUMMARY_ITEMS, 1, params, &err)) == NULL) {
        rc = cli_pg_fail(verb, "cannot read the run's obligations", &err);
        goto out;
    }
    tally_pg_rollback(pg);
    doc = build_summary(run, stored, items);
    rc = cli_print_report(verb, doc, as_json, print_summary);
out:
    json_decref(doc);
    json_decref(items);
    json_decref(stored);
    tally_pg_free(pg);
    return rc;
}
