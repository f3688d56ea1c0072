/* console_pages.c — the console's pages: the runs (filtered, newest first, paged), one run
 * (its problems with their commands, its timeline, its effects and obligations), one effect,
 * the queues a human works through, and search. Each page reads the ledger with one or two
 * parameterised statements in the request's READ ONLY transaction, every list bounded; the
 * commands are the texts the alerts and the CLI already print (alert.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "console.h"
#include "format.h"
#include "tally/alert.h"
#include "tally/machines.h"

/* Most of a run's effects, obligations, pages and events one page shows. */
#define RUN_LIST_MAX   "500"
#define RUN_EVENTS_MAX 2000
#define QUEUE_MAX      "200"

/* The effect states that are not settled: in flight, waiting for approval, or STUCK. An
 * ACTIVE run with none of them reads as tally doctor's header says (run_state). */
#define SQL_UNSETTLED                                                                              \
    "e.status IN ('PLANNED', 'AWAITING_APPROVAL', 'DISPATCHING', 'UNKNOWN', 'STUCK')"

/* A run's state: its badge, and for an ACTIVE run whose effects are all settled, tally doctor's
 * words, so that it does not read as one still going. @p run has "status", "n_effects" and
 * "n_unsettled" (SQL_UNSETTLED). */
static void run_state(con_req_t *rq, const json_t *run)
{
    con_badge(rq, cli_str(run, "status", NULL));
    tally_run_state_t st;
    long long total = (long long)cli_num(run, "n_effects", 0);
    if (tally_run_state_parse(cli_str(run, "status", ""), &st) && st == TALLY_RUN_ACTIVE &&
        total > 0 && cli_num(run, "n_unsettled", 1) == 0)
        con_rawf(rq, " <span class=\"settled\">%s %lld effect%s settled, not completed</span>",
                 total == 1 ? "its" : "all", total, total == 1 ? "" : "s");
}

/* ---------------------------------------------------------------------------------------- */
/* Runs                                                                                     */

/* $1 state, $2 tenant, $3 tool, $4 since, $5 until (NULL: no filter), $6 rows, $7 offset.
 * Newest first through runs_created_idx and its siblings (schema 14). A run's tool is in its
 * effects, and which way to look it up depends on how common the tool is (TOOL_FEW): for a
 * common one, walk the runs newest first and probe each run's effects until the page is full;
 * for a rare one, collect its runs from the effects first. The planner cannot tell them apart:
 * it took the second way for both, 300 ms and more for a common tool (bench/README.md). */
#define TOOL_FEW "2000"
#define SQL_RUNS(TOOL_CLAUSE)                                                                      \
    "SELECT coalesce(json_agg(x ORDER BY x.created_at DESC, x.run_id DESC), '[]') FROM ("          \
    " SELECT r.run_id, r.tenant, r.status, r.status_reason, r.created_at, r.updated_at,"           \
    "   s.n_effects, s.n_unsettled, s.n_stuck, s.n_unknown, s.n_approval, s.tools"                 \
    " FROM (SELECT * FROM runs r"                                                                  \
    "   WHERE ($1::text IS NULL OR r.status = $1::text)"                                           \
    "     AND ($2::text IS NULL OR r.tenant = $2::text)"                                           \
    "     AND ($3::text IS NULL OR " TOOL_CLAUSE ")"                                               \
    "     AND ($4::timestamptz IS NULL OR r.created_at >= $4::timestamptz)"                        \
    "     AND ($5::timestamptz IS NULL OR r.created_at < $5::timestamptz)"                         \
    "   ORDER BY r.created_at DESC, r.run_id DESC LIMIT $6::int OFFSET $7::int) r"                 \
    " LEFT JOIN LATERAL (SELECT count(*) AS n_effects,"                                            \
    "   count(*) FILTER (WHERE " SQL_UNSETTLED ") AS n_unsettled,"                                 \
    "   count(*) FILTER (WHERE e.status = 'STUCK') AS n_stuck,"                                    \
    "   count(*) FILTER (WHERE e.status = 'UNKNOWN') AS n_unknown,"                                \
    "   count(*) FILTER (WHERE e.status = 'AWAITING_APPROVAL') AS n_approval,"                     \
    "   string_agg(DISTINCT e.tool, ', ') AS tools"                                                \
    "   FROM effects e WHERE e.run_id = r.run_id) s ON true) x"
/* a scalar subquery is a filter evaluated row by row: the runs' order drives */
static const char SQL_RUNS_COMMON_TOOL[] = SQL_RUNS(
    "(SELECT true FROM effects e WHERE e.run_id = r.run_id AND e.tool = $3::text LIMIT 1)");
/* the tool's runs as an array, looked up in the runs' key: its effects drive (an IN, which the
 * planner makes a hashed filter over every run newest first, took 120 ms for 20 runs) */
static const char SQL_RUNS_RARE_TOOL[] =
    SQL_RUNS("r.run_id = ANY (ARRAY(SELECT e.run_id FROM effects e WHERE e.tool = $3::text))");
/* up to TOOL_FEW effects of the tool, through the unique (tool, operation_key) index */
static const char SQL_TOOL_FEW[] =
    "SELECT to_json(count(*) < " TOOL_FEW ") FROM (SELECT 1 FROM effects WHERE tool = $1"
    " LIMIT " TOOL_FEW ") t";

/* The link to another page of the runs list, with the same filters. */
static void runs_page_link(con_req_t *rq, long page, const char *text)
{
    static const char *const keys[] = {"state", "tenant", "tool", "since", "until"};
    con_raw(rq, "<a href=\"");
    con_href(rq, "runs?");
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const char *v = con_param(rq, keys[i]);
        if (v == NULL)
            continue;
        con_raw(rq, keys[i]);
        con_raw(rq, "=");
        con_url(rq, v);
        con_raw(rq, "&amp;");
    }
    con_rawf(rq, "page=%ld\">%s</a>", page, text);
}

static void filter_input(con_req_t *rq, const char *name, const char *label, const char *type)
{
    con_rawf(rq, "<label>%s <input name=\"%s\" type=\"%s\" value=\"", label, name, type);
    con_esc(rq, con_param(rq, name) != NULL ? con_param(rq, name) : "");
    con_raw(rq, "\"></label>");
}

unsigned con_page_runs(con_req_t *rq)
{
    static const char *const allowed[] = {"state", "tenant", "tool", "since",
                                          "until", "page",   NULL};
    if (!con_check_params(rq, allowed))
        return rq->status;
    const char *state = con_param(rq, "state");
    tally_run_state_t st;
    if (state != NULL && !tally_run_state_parse(state, &st))
        return con_error(rq, 400, "state '%s' is not a run state", state);
    const char *since = con_param(rq, "since"), *until = con_param(rq, "until");
    if ((since != NULL && !con_valid_time(since)) || (until != NULL && !con_valid_time(until)))
        return con_error(rq, 400,
                         "since and until are ISO 8601 times: 2026-11-27, "
                         "2026-11-27T02:30, 2026-11-27T02:30:05Z, ...+01:00");
    long page;
    if (!con_page_number(rq, &page))
        return rq->status;
    char rows[16], offset[24];
    snprintf(rows, sizeof rows, "%d", CON_PAGE_ROWS + 1);
    snprintf(offset, sizeof offset, "%ld", (page - 1) * CON_PAGE_ROWS);
    const char *params[] = {
        state, con_param(rq, "tenant"), con_param(rq, "tool"), since, until, rows, offset};
    const char *sql = SQL_RUNS_COMMON_TOOL;
    if (params[2] != NULL) {
        json_t *few = con_query(rq, SQL_TOOL_FEW, 1, &params[2]);
        if (few == NULL)
            return rq->status;
        if (json_is_true(few))
            sql = SQL_RUNS_RARE_TOOL;
        json_decref(few);
    }
    json_t *runs = con_query(rq, sql, 7, params);
    if (runs == NULL)
        return rq->status;

    con_head(rq, "Runs");
    con_raw(rq, "<form class=\"filters\" method=\"get\" action=\"");
    con_href(rq, "runs");
    con_raw(rq, "\"><label>state <select name=\"state\"><option value=\"\">any</option>");
    for (int s = 0; s < TALLY_RUN__COUNT; s++) {
        const char *name = tally_run_state_name((tally_run_state_t)s);
        con_raw(rq, "<option");
        if (state != NULL && (int)st == s)
            con_raw(rq, " selected");
        con_raw(rq, ">");
        con_esc(rq, name);
        con_raw(rq, "</option>");
    }
    con_raw(rq, "</select></label>");
    filter_input(rq, "tenant", "tenant", "text");
    filter_input(rq, "tool", "tool", "text");
    filter_input(rq, "since", "since (UTC)", "text");
    filter_input(rq, "until", "until", "text");
    con_raw(rq, "<button>Filter</button> <a href=\"");
    con_href(rq, "runs");
    con_raw(rq, "\">clear</a></form>");

    size_t n = json_array_size(runs);
    if (n == 0) {
        con_raw(rq, "<p class=\"muted\" id=\"no-runs\">No runs match.</p>");
    } else {
        con_raw(rq, "<div class=\"wide\">"
                    "<table id=\"runs\"><thead><tr><th>run</th><th>state</th><th>tenant</th>"
                    "<th>effects</th><th>tools</th><th>created (UTC)</th><th>updated</th>"
                    "</tr></thead><tbody>");
        for (size_t i = 0; i < n && i < CON_PAGE_ROWS; i++) {
            const json_t *r = json_array_get(runs, i);
            con_raw(rq, "<tr><td class=\"id\">");
            con_run_link(rq, cli_str(r, "run_id", ""));
            con_raw(rq, "</td><td>");
            run_state(rq, r);
            con_raw(rq, "</td><td>");
            con_esc(rq, cli_str(r, "tenant", NULL));
            con_rawf(rq, "</td><td>%lld", (long long)cli_num(r, "n_effects", 0));
            if (cli_num(r, "n_stuck", 0) > 0)
                con_rawf(rq, " <span class=\"badge s-STUCK\">%lld STUCK</span>",
                         (long long)cli_num(r, "n_stuck", 0));
            if (cli_num(r, "n_unknown", 0) > 0)
                con_rawf(rq, " <span class=\"badge s-UNKNOWN\">%lld UNKNOWN</span>",
                         (long long)cli_num(r, "n_unknown", 0));
            if (cli_num(r, "n_approval", 0) > 0)
                con_rawf(rq, " <span class=\"badge s-AWAITING_APPROVAL\">%lld approval</span>",
                         (long long)cli_num(r, "n_approval", 0));
            con_raw(rq, "</td><td>");
            con_esc(rq, cli_str(r, "tools", NULL));
            con_raw(rq, "</td><td>");
            con_time(rq, cli_str(r, "created_at", NULL));
            con_raw(rq, "</td><td>");
            con_time(rq, cli_str(r, "updated_at", NULL));
            con_raw(rq, "</td></tr>");
        }
        con_raw(rq, "</tbody></table></div>");
    }
    con_raw(rq, "<div class=\"pager\">");
    if (page > 1)
        runs_page_link(rq, page - 1, "← newer");
    con_rawf(rq, "<span>page %ld</span>", page);
    if (n > CON_PAGE_ROWS && page < CON_MAX_PAGE)
        runs_page_link(rq, page + 1, "older →");
    con_raw(rq, "</div>");
    con_foot(rq);
    json_decref(runs);
    return rq->status;
}

/* ---------------------------------------------------------------------------------------- */
/* Commands                                                                                 */

/* The open page naming this effect alone (@p obligation_id NULL) or this obligation. */
static const json_t *open_alert(const json_t *alerts, const char *effect_id,
                                const char *obligation_id)
{
    size_t i;
    const json_t *a;
    json_array_foreach(alerts, i, a)
    {
        tally_alert_state_t st;
        if (!tally_alert_state_parse(cli_str(a, "status", ""), &st) || st != TALLY_ALERT_TRIGGERED)
            continue;
        const char *ob = cli_str(a, "obligation_id", NULL);
        if (obligation_id != NULL ? (ob != NULL && strcmp(ob, obligation_id) == 0)
                                  : (ob == NULL && effect_id != NULL &&
                                     strcmp(cli_str(a, "effect_id", ""), effect_id) == 0))
            return a;
    }
    return NULL;
}

/* The command that settles a STUCK item: its page's own when it has one, else alert.h's. */
static void stuck_command(con_req_t *rq, const json_t *alert, bool obligation, const char *id)
{
    const char *stored = cli_str(alert, "resolve_command", NULL);
    if (stored != NULL) {
        con_command(rq, stored);
        return;
    }
    char *cmd = obligation ? tally_alert_obligation_command(id) : tally_alert_effect_command(id);
    if (cmd == NULL)
        rq->body.failed = true;
    con_command(rq, cmd);
    free(cmd);
}

static void approve_command(con_req_t *rq, bool obligation, const char *id)
{
    char *cmd = tally_alert_approval_command(obligation, id);
    if (cmd == NULL)
        rq->body.failed = true;
    con_command(rq, cmd);
    free(cmd);
}

/* ---------------------------------------------------------------------------------------- */
/* One run                                                                                  */

/* Events: the run's, and those of its effects and obligations written under another run id
 * or none, each part through its own index (as `tally doctor` reads them); "lane" is the
 * effect the event belongs to. */
#define EV_COLS                                                                                    \
    "SELECT ev.seq, ev.run_id, ev.occurred_at,"                                                    \
    " (extract(epoch FROM ev.occurred_at) * 1000)::float8 AS occurred_at_ms,"                      \
    " ev.effect_id, ev.obligation_id, ev.kind, ev.from_status, ev.to_status, ev.actor,"            \
    " ev.reason, ev.data->>'op' AS op FROM events ev"
// clang-format off
static const char SQL_RUN[] =
    "SELECT json_build_object("
    " 'run', (SELECT to_json(r) FROM (SELECT run_id, tenant, status, status_reason, created_at,"
    "   updated_at, completed_at, compensation_deadline_at, summary_status, summary_at,"
    "   s.n_effects, s.n_unsettled FROM runs, LATERAL (SELECT count(*) AS n_effects,"
    "   count(*) FILTER (WHERE " SQL_UNSETTLED ") AS n_unsettled"
    "   FROM effects e WHERE e.run_id = $1) s WHERE run_id = $1) r),"
    " 'effects', (SELECT coalesce(json_agg(e ORDER BY e.step_num IS NULL, e.step_num, e.seq),"
    "   '[]') FROM (SELECT effect_id, seq, step, step_num, tool, effect_class, operation_key,"
    "   status, status_reason, attempts, external_ref, error_code, error_message, created_at,"
    "   updated_at, extract(epoch FROM now() - coalesce(unknown_since, updated_at))::float8"
    "   AS age_s FROM effects WHERE run_id = $1"
    "   ORDER BY step_num IS NULL, step_num, seq LIMIT " RUN_LIST_MAX ") e),"
    " 'obligations', (SELECT coalesce(json_agg(o ORDER BY o.created_at), '[]') FROM ("
    "   SELECT o.obligation_id, o.effect_id, e.step, e.tool, o.reason, o.status,"
    "   o.status_reason, o.attempts, o.external_ref, o.error_code, o.error_message,"
    "   o.created_at, o.updated_at FROM obligations o JOIN effects e USING (effect_id)"
    "   WHERE o.run_id = $1 ORDER BY o.created_at LIMIT " RUN_LIST_MAX ") o),"
    " 'alerts', (SELECT coalesce(json_agg(a ORDER BY a.created_at), '[]') FROM ("
    "   SELECT dedup_key, status, severity, summary, effect_id, obligation_id, reason, runbook,"
    "   resolve_command, created_at, resolved_at FROM alerts WHERE run_id = $1"
    "   ORDER BY created_at LIMIT " RUN_LIST_MAX ") a),"
    " 'events', (SELECT coalesce(json_agg(v ORDER BY v.seq), '[]') FROM ("
    "   SELECT u.*, coalesce(u.effect_id, o.effect_id) AS lane FROM ("
    EV_COLS " WHERE ev.run_id = $1"
    "   UNION " EV_COLS " WHERE ev.effect_id IN (SELECT effect_id FROM effects WHERE run_id = $1)"
    "     AND ev.kind NOT IN ('transition', 'connector_call')"
    "   UNION " EV_COLS " WHERE ev.obligation_id IN"
    "     (SELECT obligation_id FROM obligations WHERE run_id = $1)) u"
    "   LEFT JOIN obligations o ON o.obligation_id = u.obligation_id"
    "   ORDER BY u.seq LIMIT $2::int) v))";
// clang-format on

static void dl_item(con_req_t *rq, const char *term, const char *value)
{
    con_raw(rq, "<dt>");
    con_raw(rq, term);
    con_raw(rq, "</dt><dd>");
    con_esc(rq, value);
    con_raw(rq, "</dd>");
}

/* One problem of a run or a queue: what, where, why, and the command. */
static void problem_head(con_req_t *rq, const char *cls, const char *what, const char *id,
                         bool obligation)
{
    con_rawf(rq, "<div class=\"item %s\" data-kind=\"%s\" data-id=\"", cls,
             obligation ? "obligation" : "effect");
    con_esc(rq, id);
    con_raw(rq, "\"><b>");
    con_raw(rq, what);
    con_raw(rq, "</b> ");
    con_raw(rq, obligation ? "obligation " : "effect ");
    con_raw(rq, "<span class=\"mono\">");
    con_esc(rq, id);
    con_raw(rq, "</span>");
}

/* One problem of a run's page: an effect or obligation (@p obligation) STUCK (@p stuck) or
 * awaiting approval, its step and tool, then the commands that move it. */
static void item_problem(con_req_t *rq, const json_t *item, const json_t *alerts, bool obligation,
                         bool stuck)
{
    const char *id = cli_str(item, obligation ? "obligation_id" : "effect_id", "");
    problem_head(rq, stuck ? "" : "warn", stuck ? "STUCK" : "Awaiting approval", id, obligation);
    con_raw(rq, obligation && !stuck ? " — the reversal of step " : " — step ");
    con_esc(rq, cli_str(item, "step", ""));
    con_raw(rq, " ");
    con_esc(rq, cli_str(item, "tool", ""));
    if (stuck) {
        con_raw(rq, ": ");
        con_esc(rq, cli_str(item, "status_reason", cli_str(item, "error_message", "")));
        stuck_command(rq, obligation ? open_alert(alerts, NULL, id) : open_alert(alerts, id, NULL),
                      obligation, id);
    } else {
        approve_command(rq, obligation, id);
    }
    con_raw(rq, "</div>");
}

/* The run's problems, most urgent first; @returns how many. */
static size_t run_problems(con_req_t *rq, const json_t *doc)
{
    const json_t *effects = json_object_get(doc, "effects");
    const json_t *obligations = json_object_get(doc, "obligations");
    const json_t *alerts = json_object_get(doc, "alerts");
    size_t n = 0, i;
    const json_t *e;
    for (int pass = 0; pass < 3; pass++) {
        json_array_foreach(obligations, i, e)
        {
            tally_obligation_state_t st;
            if (!tally_obligation_state_parse(cli_str(e, "status", ""), &st))
                continue;
            if ((pass == 0 && st == TALLY_OBLIGATION_STUCK) ||
                (pass == 1 && st == TALLY_OBLIGATION_AWAITING_APPROVAL)) {
                item_problem(rq, e, alerts, true, pass == 0);
                n++;
            }
        }
        json_array_foreach(effects, i, e)
        {
            tally_effect_state_t st;
            if (!tally_effect_state_parse(cli_str(e, "status", ""), &st))
                continue;
            const char *id = cli_str(e, "effect_id", "");
            if ((pass == 0 && st == TALLY_EFFECT_STUCK) ||
                (pass == 1 && st == TALLY_EFFECT_AWAITING_APPROVAL)) {
                item_problem(rq, e, alerts, false, pass == 0);
                n++;
            } else if (pass == 2 && st == TALLY_EFFECT_UNKNOWN) {
                bool aging = cli_num(e, "age_s", 0) > (double)rq->unknown_age_s;
                char age[32];
                cli_age(cli_num(e, "age_s", 0), age, sizeof age);
                problem_head(rq, aging ? "warn" : "info", "UNKNOWN", id, false);
                con_raw(rq, " — step ");
                con_esc(rq, cli_str(e, "step", ""));
                con_raw(rq, " ");
                con_esc(rq, cli_str(e, "tool", ""));
                con_raw(rq, " for ");
                con_esc(rq, age);
                con_raw(rq, aging ? "; older than TALLY_UNKNOWN_AGE_S: if the reconciler "
                                    "cannot settle it, settle it from upstream evidence"
                                  : "; the reconciler resolves it from upstream evidence");
                if (aging) {
                    char *cmd = tally_alert_effect_command(id);
                    con_command(rq, cmd);
                    free(cmd);
                }
                con_raw(rq, "</div>");
                n++;
            }
        }
    }
    /* open pages not about one STUCK item: auth failures, deadlines, findings */
    json_array_foreach(alerts, i, e)
    {
        tally_alert_state_t st;
        if (!tally_alert_state_parse(cli_str(e, "status", ""), &st) || st != TALLY_ALERT_TRIGGERED)
            continue;
        bool covered = false;
        size_t j;
        const json_t *x;
        json_array_foreach(effects, j, x)
        {
            tally_effect_state_t es;
            covered = covered ||
                      (cli_str(e, "obligation_id", NULL) == NULL &&
                       strcmp(cli_str(x, "effect_id", ""), cli_str(e, "effect_id", "-")) == 0 &&
                       tally_effect_state_parse(cli_str(x, "status", ""), &es) &&
                       es == TALLY_EFFECT_STUCK);
        }
        json_array_foreach(obligations, j, x)
        {
            tally_obligation_state_t os;
            covered = covered || (strcmp(cli_str(x, "obligation_id", ""),
                                         cli_str(e, "obligation_id", "-")) == 0 &&
                                  tally_obligation_state_parse(cli_str(x, "status", ""), &os) &&
                                  os == TALLY_OBLIGATION_STUCK);
        }
        if (covered)
            continue;
        con_raw(rq, "<div class=\"item\" data-kind=\"alert\" data-id=\"");
        con_esc(rq, cli_str(e, "dedup_key", ""));
        con_raw(rq, "\"><b>Open page</b> <span class=\"mono\">");
        con_esc(rq, cli_str(e, "dedup_key", ""));
        con_raw(rq, "</span> — ");
        con_esc(rq, cli_str(e, "summary", ""));
        con_command(rq, cli_str(e, "resolve_command", NULL));
        con_raw(rq, "</div>");
        n++;
    }
    return n;
}

unsigned con_page_run(con_req_t *rq, const char *run_id)
{
    static const char *const allowed[] = {NULL};
    if (!con_check_params(rq, allowed))
        return rq->status;
    if (run_id[0] == '\0' || strlen(run_id) > 200)
        return con_error(rq, 400, "a run id is 1 to 200 bytes");
    char limit[16];
    snprintf(limit, sizeof limit, "%d", RUN_EVENTS_MAX + 1);
    const char *params[] = {run_id, limit};
    json_t *doc = con_query(rq, SQL_RUN, 2, params);
    if (doc == NULL)
        return rq->status;
    const json_t *run = json_object_get(doc, "run");
    if (!json_is_object(run)) {
        json_decref(doc);
        return con_error(rq, 404, "there is no run '%s' in the ledger", run_id);
    }
    char title[256];
    tally_fmt(title, sizeof title, "Run %s", run_id);
    con_head(rq, title);
    con_raw(rq, "<dl id=\"run-header\"><dt>state</dt><dd>");
    run_state(rq, run);
    if (cli_str(run, "status_reason", NULL) != NULL) {
        con_raw(rq, " ");
        con_esc(rq, cli_str(run, "status_reason", NULL));
    }
    con_raw(rq, "</dd>");
    dl_item(rq, "run id", cli_str(run, "run_id", ""));
    dl_item(rq, "tenant", cli_str(run, "tenant", NULL));
    con_raw(rq, "<dt>created</dt><dd>");
    con_time(rq, cli_str(run, "created_at", NULL));
    con_raw(rq, "</dd><dt>updated</dt><dd>");
    con_time(rq, cli_str(run, "updated_at", NULL));
    con_raw(rq, "</dd>");
    if (cli_str(run, "compensation_deadline_at", NULL) != NULL) {
        con_raw(rq, "<dt>compensation deadline</dt><dd>");
        con_time(rq, cli_str(run, "compensation_deadline_at", NULL));
        con_raw(rq, "</dd>");
    }
    con_raw(rq, "</dl>");

    con_raw(rq, "<h2>Problems</h2><div id=\"problems\">");
    if (run_problems(rq, doc) == 0)
        con_raw(rq, "<p class=\"muted\">Nothing here needs a human.</p>");
    con_raw(rq, "</div>");

    const json_t *effects = json_object_get(doc, "effects");
    json_t *events = json_object_get(doc, "events");
    con_raw(rq, "<h2>Timeline</h2>");
    if (json_array_size(events) > RUN_EVENTS_MAX) {
        json_array_remove(events, RUN_EVENTS_MAX);
        con_rawf(rq, "<p class=\"muted\">The first %d events are drawn.</p>", RUN_EVENTS_MAX);
    }
    con_timeline(rq, effects, events);

    con_raw(rq, "<h2>Effects</h2><div class=\"wide\">"
                "<table id=\"effects\"><thead><tr><th>step</th><th>tool</th>"
                "<th>effect</th><th>state</th><th>attempts</th><th>external ref</th>"
                "<th>operation key</th><th>updated</th></tr></thead><tbody>");
    size_t i;
    const json_t *e;
    json_array_foreach(effects, i, e)
    {
        con_raw(rq, "<tr><td>");
        con_esc(rq, cli_str(e, "step", ""));
        con_raw(rq, "</td><td>");
        con_esc(rq, cli_str(e, "tool", ""));
        con_raw(rq, " <span class=\"muted\">");
        con_esc(rq, cli_str(e, "effect_class", ""));
        con_raw(rq, "</span></td><td class=\"id\">");
        con_effect_link(rq, cli_str(e, "effect_id", ""));
        con_raw(rq, "</td><td>");
        con_badge(rq, cli_str(e, "status", NULL));
        con_rawf(rq, "</td><td>%lld</td><td class=\"id\">", (long long)cli_num(e, "attempts", 0));
        con_esc(rq, cli_str(e, "external_ref", NULL));
        con_raw(rq, "</td><td class=\"id\">");
        con_esc(rq, cli_str(e, "operation_key", ""));
        con_raw(rq, "</td><td>");
        con_time(rq, cli_str(e, "updated_at", NULL));
        con_raw(rq, "</td></tr>");
    }
    con_raw(rq, "</tbody></table></div>");

    const json_t *obligations = json_object_get(doc, "obligations");
    con_raw(rq, "<h2>Obligations</h2>");
    if (json_array_size(obligations) == 0) {
        con_raw(rq, "<p class=\"muted\">None: nothing of this run was asked to be undone.</p>");
    } else {
        con_raw(rq, "<div class=\"wide\">"
                    "<table id=\"obligations\"><thead><tr><th>obligation</th><th>effect</th>"
                    "<th>step</th><th>reason</th><th>state</th><th>attempts</th>"
                    "<th>why</th></tr></thead><tbody>");
        json_array_foreach(obligations, i, e)
        {
            con_raw(rq, "<tr><td class=\"id\">");
            con_esc(rq, cli_str(e, "obligation_id", ""));
            con_raw(rq, "</td><td class=\"id\">");
            con_effect_link(rq, cli_str(e, "effect_id", ""));
            con_raw(rq, "</td><td>");
            con_esc(rq, cli_str(e, "step", ""));
            con_raw(rq, " ");
            con_esc(rq, cli_str(e, "tool", ""));
            con_raw(rq, "</td><td>");
            con_esc(rq, cli_str(e, "reason", ""));
            con_raw(rq, "</td><td>");
            con_badge(rq, cli_str(e, "status", NULL));
            con_rawf(rq, "</td><td>%lld</td><td>", (long long)cli_num(e, "attempts", 0));
            con_esc(rq, cli_str(e, "status_reason", NULL));
            con_raw(rq, "</td></tr>");
        }
        con_raw(rq, "</tbody></table></div>");
    }
    const json_t *alerts = json_object_get(doc, "alerts");
    if (json_array_size(alerts) > 0) {
        con_raw(rq, "<h2>Pages</h2><div class=\"wide\">"
                    "<table id=\"alerts\"><thead><tr><th>page</th><th>state</th>"
                    "<th>summary</th><th>opened</th></tr></thead><tbody>");
        json_array_foreach(alerts, i, e)
        {
            con_raw(rq, "<tr><td class=\"id\">");
            con_esc(rq, cli_str(e, "dedup_key", ""));
            con_raw(rq, "</td><td>");
            con_badge(rq, cli_str(e, "status", NULL));
            con_raw(rq, "</td><td>");
            con_esc(rq, cli_str(e, "summary", ""));
            con_raw(rq, "</td><td>");
            con_time(rq, cli_str(e, "created_at", NULL));
            con_raw(rq, "</td></tr>");
        }
        con_raw(rq, "</tbody></table></div>");
    }
    con_raw(rq, "<p class=\"muted\">In a shell: <code>tally doctor --run ");
    con_esc(rq, run_id);
    con_raw(rq, "</code></p>");
    con_foot(rq);
    json_decref(doc);
    return rq->status;
}

/* ---------------------------------------------------------------------------------------- */
/* One effect                                                                               */

/* Its events through its run (as schema 8 says an effect's trail is read), and those of the
 * other kinds through the effect index. */
static const char SQL_EFFECT[] =
    "SELECT json_build_object("
    " 'effect', (SELECT to_jsonb(e) - 'args_sealed' - 'receipt_sealed' - 'seal_key'"
    "   FROM effects e WHERE e.effect_id = $1::uuid),"
    " 'events', (SELECT coalesce(json_agg(v ORDER BY v.seq), '[]') FROM ("
    "   SELECT seq, occurred_at, kind, from_status, to_status, actor, reason, obligation_id,"
    "   data FROM events WHERE run_id = (SELECT run_id FROM effects WHERE effect_id = $1::uuid)"
    "   AND effect_id = $1::uuid"
    "   UNION SELECT seq, occurred_at, kind, from_status, to_status, actor, reason,"
    "   obligation_id, data FROM events WHERE effect_id = $1::uuid"
    "   AND kind NOT IN ('transition', 'connector_call')"
    "   ORDER BY seq LIMIT 1000) v),"
    " 'obligations', (SELECT coalesce(json_agg(o ORDER BY o.created_at), '[]') FROM ("
    "   SELECT obligation_id, reason, status, status_reason, attempts, external_ref,"
    "   reverse_receipt, blast_radius, error_code, error_message, created_at, updated_at"
    "   FROM obligations WHERE effect_id = $1::uuid ORDER BY created_at LIMIT 100) o),"
    " 'alerts', (SELECT coalesce(json_agg(a ORDER BY a.created_at), '[]') FROM ("
    "   SELECT dedup_key, status, summary, effect_id, obligation_id, resolve_command,"
    "   created_at FROM alerts WHERE effect_id = $1::uuid ORDER BY created_at LIMIT 100) a))";

unsigned con_page_effect(con_req_t *rq, const char *effect_id)
{
    static const char *const allowed[] = {NULL};
    if (!con_check_params(rq, allowed))
        return rq->status;
    if (!cli_is_uuid(effect_id))
        return con_error(rq, 400, "'%s' is not an effect id (a UUID)", effect_id);
    const char *params[] = {effect_id};
    json_t *doc = con_query(rq, SQL_EFFECT, 1, params);
    if (doc == NULL)
        return rq->status;
    const json_t *e = json_object_get(doc, "effect");
    if (!json_is_object(e)) {
        json_decref(doc);
        return con_error(rq, 404, "there is no effect %s in the ledger", effect_id);
    }
    char title[128];
    tally_fmt(title, sizeof title, "Effect %s", effect_id);
    con_head(rq, title);
    con_raw(rq, "<dl id=\"effect-header\"><dt>state</dt><dd>");
    con_badge(rq, cli_str(e, "status", NULL));
    if (cli_str(e, "status_reason", NULL) != NULL) {
        con_raw(rq, " ");
        con_esc(rq, cli_str(e, "status_reason", NULL));
    }
    con_raw(rq, "</dd><dt>run</dt><dd>");
    con_run_link(rq, cli_str(e, "run_id", ""));
    con_raw(rq, "</dd>");
    dl_item(rq, "step", cli_str(e, "step", ""));
    dl_item(rq, "tool", cli_str(e, "tool", ""));
    dl_item(rq, "class", cli_str(e, "effect_class", ""));
    dl_item(rq, "operation key", cli_str(e, "operation_key", ""));
    dl_item(rq, "external ref", cli_str(e, "external_ref", NULL));
    dl_item(rq, "tenant", cli_str(e, "tenant", NULL));
    char attempts[32];
    snprintf(attempts, sizeof attempts, "%lld", (long long)cli_num(e, "attempts", 0));
    dl_item(rq, "attempts", attempts);
    if (cli_str(e, "error_code", NULL) != NULL) {
        char err[600];
        tally_fmt(err, sizeof err, "%s: %s", cli_str(e, "error_code", ""),
                  cli_str(e, "error_message", ""));
        dl_item(rq, "error", err);
    }
    dl_item(rq, "intent id", cli_str(e, "intent_id", ""));
    con_raw(rq, "<dt>created</dt><dd>");
    con_time(rq, cli_str(e, "created_at", NULL));
    con_raw(rq, "</dd><dt>updated</dt><dd>");
    con_time(rq, cli_str(e, "updated_at", NULL));
    con_raw(rq, "</dd></dl>");

    /* the commands that apply in its state */
    tally_effect_state_t st;
    const json_t *alerts = json_object_get(doc, "alerts");
    if (tally_effect_state_parse(cli_str(e, "status", ""), &st)) {
        if (st == TALLY_EFFECT_STUCK || st == TALLY_EFFECT_UNKNOWN) {
            con_raw(rq, "<h2>Commands</h2><div id=\"commands\">");
            stuck_command(rq, open_alert(alerts, effect_id, NULL), false, effect_id);
            con_raw(rq, "</div>");
        } else if (st == TALLY_EFFECT_AWAITING_APPROVAL) {
            con_raw(rq, "<h2>Commands</h2><div id=\"commands\">");
            approve_command(rq, false, effect_id);
            con_raw(rq, "</div>");
        }
    }
    con_raw(rq, "<h2>Arguments</h2>");
    json_t *args = json_loads(cli_str(e, "args_canonical", "null"), JSON_DECODE_ANY, NULL);
    con_json(rq, args);
    json_decref(args);
    con_raw(rq, "<h2>Receipt</h2><div id=\"receipt\">");
    con_json(rq, json_object_get(e, "receipt"));
    con_raw(rq, "</div>");

    const json_t *obligations = json_object_get(doc, "obligations");
    con_raw(rq, "<h2>Obligations</h2>");
    if (json_array_size(obligations) == 0)
        con_raw(rq, "<p class=\"muted\">None.</p>");
    size_t i;
    const json_t *o;
    json_array_foreach(obligations, i, o)
    {
        const char *oid = cli_str(o, "obligation_id", "");
        con_raw(rq, "<div class=\"item info\" data-kind=\"obligation\" data-id=\"");
        con_esc(rq, oid);
        con_raw(rq, "\"><span class=\"mono\">");
        con_esc(rq, oid);
        con_raw(rq, "</span> ");
        con_badge(rq, cli_str(o, "status", NULL));
        con_raw(rq, " ");
        con_esc(rq, cli_str(o, "reason", ""));
        if (cli_str(o, "status_reason", NULL) != NULL) {
            con_raw(rq, " — ");
            con_esc(rq, cli_str(o, "status_reason", NULL));
        }
        tally_obligation_state_t os;
        if (tally_obligation_state_parse(cli_str(o, "status", ""), &os)) {
            if (os == TALLY_OBLIGATION_STUCK)
                stuck_command(rq, open_alert(alerts, NULL, oid), true, oid);
            else if (os == TALLY_OBLIGATION_AWAITING_APPROVAL)
                approve_command(rq, true, oid);
        }
        if (json_object_get(o, "reverse_receipt") != NULL &&
            !json_is_null(json_object_get(o, "reverse_receipt"))) {
            con_raw(rq, "<div>reverse receipt:</div>");
            con_json(rq, json_object_get(o, "reverse_receipt"));
        }
        if (json_object_get(o, "blast_radius") != NULL &&
            !json_is_null(json_object_get(o, "blast_radius"))) {
            con_raw(rq, "<div>blast radius:</div>");
            con_json(rq, json_object_get(o, "blast_radius"));
        }
        con_raw(rq, "</div>");
    }

    const json_t *events = json_object_get(doc, "events");
    con_raw(rq, "<h2>Events</h2><div class=\"wide\">"
                "<table id=\"events\"><thead><tr><th>time (UTC)</th><th>kind</th>"
                "<th>move</th><th>actor</th><th>reason</th><th>data</th></tr></thead><tbody>");
    const json_t *ev;
    json_array_foreach(events, i, ev)
    {
        con_raw(rq, "<tr><td>");
        con_time(rq, cli_str(ev, "occurred_at", NULL));
        con_raw(rq, "</td><td>");
        con_esc(rq, cli_str(ev, "kind", ""));
        con_raw(rq, "</td><td>");
        if (cli_str(ev, "to_status", NULL) != NULL) {
            con_esc(rq, cli_str(ev, "from_status", "∅"));
            con_raw(rq, " → ");
            con_esc(rq, cli_str(ev, "to_status", ""));
        }
        con_raw(rq, "</td><td>");
        con_esc(rq, cli_str(ev, "actor", ""));
        con_raw(rq, "</td><td>");
        con_esc(rq, cli_str(ev, "reason", NULL));
        con_raw(rq, "</td><td>");
        const json_t *data = json_object_get(ev, "data");
        if (data != NULL && !json_is_null(data)) {
            char *text = json_dumps(data, JSON_COMPACT | JSON_SORT_KEYS);
            con_raw(rq, "<pre>");
            con_esc(rq, text != NULL ? text : "");
            con_raw(rq, "</pre>");
            free(text);
        }
        con_raw(rq, "</td></tr>");
    }
    con_raw(rq, "</tbody></table></div>");
    con_foot(rq);
    json_decref(doc);
    return rq->status;
}

/* ---------------------------------------------------------------------------------------- */
/* Queues                                                                                   */

/* $1: TALLY_UNKNOWN_AGE_S. Each list oldest first, bounded; the counts exact. */
static const char SQL_QUEUES[] =
    "SELECT json_build_object("
    " 'stuck', (SELECT coalesce(json_agg(x ORDER BY x.since, x.id), '[]') FROM ("
    "   SELECT 'effect'::text AS kind, e.effect_id::text AS id, e.effect_id::text AS effect_id,"
    "   e.run_id, e.step, e.tool, e.status_reason AS reason, e.updated_at AS since,"
    "   extract(epoch FROM now() - e.updated_at)::float8 AS age_s, a.resolve_command"
    "   FROM effects e LEFT JOIN LATERAL (SELECT resolve_command FROM alerts"
    "     WHERE status = 'TRIGGERED' AND effect_id = e.effect_id AND obligation_id IS NULL"
    "     ORDER BY created_at LIMIT 1) a ON true WHERE e.status = 'STUCK'"
    "   UNION ALL"
    "   SELECT 'obligation', o.obligation_id::text, o.effect_id::text, o.run_id, e.step, e.tool,"
    "   o.status_reason, o.updated_at, extract(epoch FROM now() - o.updated_at)::float8,"
    "   a.resolve_command FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
    "   LEFT JOIN LATERAL (SELECT resolve_command FROM alerts WHERE status = 'TRIGGERED'"
    "     AND obligation_id = o.obligation_id ORDER BY created_at LIMIT 1) a ON true"
    "   WHERE o.status = 'STUCK' ORDER BY 8 LIMIT " QUEUE_MAX ") x),"
    " 'n_stuck', (SELECT count(*) FROM effects WHERE status = 'STUCK')"
    "   + (SELECT count(*) FROM obligations WHERE status = 'STUCK'),"
    " 'unknown', (SELECT coalesce(json_agg(x ORDER BY x.since, x.id), '[]') FROM ("
    "   SELECT 'effect'::text AS kind, e.effect_id::text AS id, e.effect_id::text AS effect_id,"
    "   e.run_id, e.step, e.tool, e.status_reason AS reason,"
    "   coalesce(e.unknown_since, e.updated_at) AS since,"
    "   extract(epoch FROM now() - coalesce(e.unknown_since, e.updated_at))::float8 AS age_s"
    "   FROM effects e WHERE e.status = 'UNKNOWN'"
    "   AND coalesce(e.unknown_since, e.updated_at) < now() - make_interval(secs => $1::float8)"
    "   ORDER BY 8 LIMIT " QUEUE_MAX ") x),"
    " 'n_unknown', (SELECT count(*) FROM effects WHERE status = 'UNKNOWN'"
    "   AND coalesce(unknown_since, updated_at) < now() - make_interval(secs => $1::float8)),"
    " 'approvals', (SELECT coalesce(json_agg(x ORDER BY x.since, x.id), '[]') FROM ("
    "   SELECT 'effect'::text AS kind, e.effect_id::text AS id, e.effect_id::text AS effect_id,"
    "   e.run_id, e.step, e.tool, e.effect_class AS reason, e.updated_at AS since,"
    "   extract(epoch FROM now() - e.updated_at)::float8 AS age_s"
    "   FROM effects e WHERE e.status = 'AWAITING_APPROVAL'"
    "   UNION ALL"
    "   SELECT 'obligation', o.obligation_id::text, o.effect_id::text, o.run_id, e.step, e.tool,"
    "   'the reversal of ' || e.effect_class, o.updated_at,"
    "   extract(epoch FROM now() - o.updated_at)::float8"
    "   FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
    "   WHERE o.status = 'AWAITING_APPROVAL' ORDER BY 8 LIMIT " QUEUE_MAX ") x),"
    " 'n_approvals', (SELECT count(*) FROM effects WHERE status = 'AWAITING_APPROVAL')"
    "   + (SELECT count(*) FROM obligations WHERE status = 'AWAITING_APPROVAL'))";

typedef enum { Q_STUCK, Q_UNKNOWN, Q_APPROVAL } queue_t;

static void queue_section(con_req_t *rq, const json_t *doc, queue_t q)
{
    static const struct {
        const char *list, *count, *id, *title, *empty, *cls;
    } Q[] = {
        [Q_STUCK] = {"stuck", "n_stuck", "queue-stuck", "STUCK", "Nothing is STUCK.", ""},
        [Q_UNKNOWN] = {"unknown", "n_unknown", "queue-unknown", "Aging UNKNOWN",
                       "No UNKNOWN effect is older than TALLY_UNKNOWN_AGE_S.", "warn"},
        [Q_APPROVAL] = {"approvals", "n_approvals", "queue-approvals", "Awaiting approval",
                        "Nothing awaits approval.", "warn"},
    };
    const json_t *items = json_object_get(doc, Q[q].list);
    long long total = (long long)cli_num(doc, Q[q].count, 0);
    con_rawf(rq, "<section id=\"%s\"><h2>%s: %lld</h2>", Q[q].id, Q[q].title, total);
    if (q == Q_UNKNOWN)
        con_rawf(rq,
                 "<p class=\"muted\">Older than %ld s; the reconciler keeps checking them "
                 "upstream. Settle one by hand only from upstream evidence.</p>",
                 rq->unknown_age_s);
    if (json_array_size(items) == 0)
        con_rawf(rq, "<p class=\"muted\">%s</p>", Q[q].empty);
    size_t i;
    const json_t *it;
    json_array_foreach(items, i, it)
    {
        bool obligation = strcmp(cli_str(it, "kind", ""), "obligation") == 0;
        const char *id = cli_str(it, "id", "");
        char age[32];
        cli_age(cli_num(it, "age_s", 0), age, sizeof age);
        problem_head(rq, Q[q].cls, Q[q].title, id, obligation);
        con_raw(rq, " — run ");
        con_run_link(rq, cli_str(it, "run_id", ""));
        con_raw(rq, ", step ");
        con_esc(rq, cli_str(it, "step", ""));
        con_raw(rq, " ");
        con_esc(rq, cli_str(it, "tool", ""));
        con_raw(rq, ", for ");
        con_esc(rq, age);
        if (cli_str(it, "reason", NULL) != NULL) {
            con_raw(rq, "<div class=\"muted\">");
            con_esc(rq, cli_str(it, "reason", NULL));
            con_raw(rq, "</div>");
        }
        con_raw(rq, "<div>");
        con_effect_link(rq, cli_str(it, "effect_id", ""));
        con_raw(rq, "</div>");
        if (q == Q_APPROVAL) {
            approve_command(rq, obligation, id);
        } else if (q == Q_STUCK) {
            const char *stored = cli_str(it, "resolve_command", NULL);
            json_t *a = stored != NULL ? json_pack("{s:s}", "resolve_command", stored) : NULL;
            stuck_command(rq, a, obligation, id);
            json_decref(a);
        } else {
            stuck_command(rq, NULL, false, id);
        }
        con_raw(rq, "</div>");
    }
    if ((long long)json_array_size(items) < total)
        con_rawf(rq, "<p class=\"muted\">… and %lld more, oldest first above.</p>",
                 total - (long long)json_array_size(items));
    con_raw(rq, "</section>");
}

unsigned con_page_queues(con_req_t *rq)
{
    static const char *const allowed[] = {NULL};
    if (!con_check_params(rq, allowed))
        return rq->status;
    char age[24];
    snprintf(age, sizeof age, "%ld", rq->unknown_age_s);
    const char *params[] = {age};
    json_t *doc = con_query(rq, SQL_QUEUES, 1, params);
    if (doc == NULL)
        return rq->status;
    con_head(rq, "Queues");
    queue_section(rq, doc, Q_STUCK);
    queue_section(rq, doc, Q_UNKNOWN);
    queue_section(rq, doc, Q_APPROVAL);
    con_foot(rq);
    json_decref(doc);
    return rq->status;
}

/* ---------------------------------------------------------------------------------------- */
/* Search                                                                                   */

/* $1 the text, $2 the same when it is a UUID (else NULL). Each branch an index lookup (schema 14
 * for operation keys and external refs). */
static const char SQL_SEARCH[] =
    "SELECT coalesce(json_agg(x), '[]') FROM (SELECT * FROM ("
    " SELECT 'run'::text AS what, run_id AS id, run_id, NULL::text AS detail"
    "   FROM runs WHERE run_id = $1"
    " UNION ALL SELECT 'effect', effect_id::text, run_id, tool || ' step ' || step"
    "   FROM effects WHERE effect_id = $2::uuid"
    " UNION ALL SELECT 'obligation', effect_id::text, run_id, 'obligation ' || obligation_id"
    "   FROM obligations WHERE obligation_id = $2::uuid"
    " UNION ALL SELECT 'operation key', effect_id::text, run_id, tool || ' step ' || step"
    "   FROM effects WHERE operation_key = $1"
    " UNION ALL SELECT 'external ref', effect_id::text, run_id, tool || ' step ' || step"
    "   FROM effects WHERE external_ref = $1"
    " UNION ALL SELECT 'obligation ref', effect_id::text, run_id, 'obligation ' || obligation_id"
    "   FROM obligations WHERE external_ref = $1) s LIMIT 51) x";

unsigned con_page_search(con_req_t *rq)
{
    static const char *const allowed[] = {"q", NULL};
    if (!con_check_params(rq, allowed))
        return rq->status;
    const char *q = con_param(rq, "q");
    if (q == NULL)
        return con_error(rq, 400,
                         "search for something: /search?q=<run id, effect id, "
                         "operation key or external ref>");
    const char *params[] = {q, cli_is_uuid(q) ? q : NULL};
    json_t *hits = con_query(rq, SQL_SEARCH, 2, params);
    if (hits == NULL)
        return rq->status;
    size_t n = json_array_size(hits);
    /* one page to go to, however many ways it matched (an effect's ref is its obligation's) */
    bool one_page = n > 0;
    for (size_t i = 1; i < n && one_page; i++) {
        const json_t *a = json_array_get(hits, 0), *b = json_array_get(hits, i);
        one_page = (strcmp(cli_str(a, "what", ""), "run") == 0) ==
                       (strcmp(cli_str(b, "what", ""), "run") == 0) &&
                   strcmp(cli_str(a, "id", ""), cli_str(b, "id", "")) == 0;
    }
    if (one_page) {
        const json_t *h = json_array_get(hits, 0);
        bool run = strcmp(cli_str(h, "what", ""), "run") == 0;
        /* a redirect: the page's own link, percent-encoded as the pages write them */
        con_href(rq, run ? "runs/" : "effects/");
        con_url(rq, cli_str(h, "id", ""));
        rq->location = tally_strbuf_take(&rq->body);
        if (rq->location == NULL) {
            json_decref(hits);
            return con_error(rq, 500, "out of memory");
        }
        rq->status = 302;
        con_head(rq, "Found");
        con_raw(rq, "<p>Found: <a href=\"");
        con_esc(rq, rq->location);
        con_raw(rq, "\">");
        con_esc(rq, rq->location);
        con_raw(rq, "</a></p>");
        con_foot(rq);
        json_decref(hits);
        return rq->status;
    }
    char title[512];
    tally_fmt(title, sizeof title, "Search: %s", q);
    con_head(rq, title);
    if (n == 0) {
        con_raw(rq, "<p id=\"no-match\">No run, effect, obligation, operation key or external "
                    "ref is exactly this.</p>");
    } else {
        con_raw(rq, "<div class=\"wide\">"
                    "<table id=\"hits\"><thead><tr><th>matched</th><th>run</th><th>effect</th>"
                    "<th>what</th></tr></thead><tbody>");
        size_t i;
        const json_t *h;
        json_array_foreach(hits, i, h)
        {
            if (i >= 50)
                break;
            bool run = strcmp(cli_str(h, "what", ""), "run") == 0;
            con_raw(rq, "<tr><td>");
            con_esc(rq, cli_str(h, "what", ""));
            con_raw(rq, "</td><td class=\"id\">");
            con_run_link(rq, cli_str(h, "run_id", ""));
            con_raw(rq, "</td><td class=\"id\">");
            if (!run)
                con_effect_link(rq, cli_str(h, "id", ""));
            con_raw(rq, "</td><td>");
            con_esc(rq, cli_str(h, "detail", NULL));
            con_raw(rq, "</td></tr>");
        }
        con_raw(rq, "</tbody></table></div>");
        if (n > 50)
            con_raw(rq, "<p class=\"muted\">The first 50 matches.</p>");
    }
    con_foot(rq);
    json_decref(hits);
    return rq->status;
}
