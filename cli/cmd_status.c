/* cmd_status.c — `tally status`: what needs a human, first. STUCK effects and
 * obligations (with the reason and the exact resolve command), then the oldest
 * UNKNOWNs, approvals waiting, open pages, and the counts by state and tool.
 * The exit code is the verdict, for scripts and probes: 0 clean, 1 an UNKNOWN
 * older than --unknown-age, 2 anything STUCK (STUCK wins).
 *
 * Every number comes from one read of the ledger, and every age from the
 * database's clock. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/alert.h"
#include "tally/ledger.h"
#include "tally/text.h"

#define VERB "status"

/* How many items of each list are read; the counts are always exact. */
#define LIST_LIMIT "200"

static const char USAGE[] =
    "usage: tally status [--unknown-age SECONDS] [--json]\n"
    "\n"
    "What needs a human in the ledger (TALLY_PG), most urgent first: STUCK effects and\n"
    "obligations with their reason and the exact command that resolves them, the oldest\n"
    "UNKNOWN effects, effects and obligations awaiting approval, open alerts; then the\n"
    "counts of effects by state and tool, of obligations and of runs (active, completing,\n"
    "completed, and the compensation states apart).\n"
    "\n"
    "  --unknown-age SECONDS  an UNKNOWN older than this makes the exit code 1\n"
    "                         (default TALLY_UNKNOWN_AGE_S, 300)\n"
    "  --json                 one JSON document with stable keys instead of text\n"
    "  -h, --help             this text\n"
    "\n"
    "Exit status: 0 clean; 1 an UNKNOWN effect older than --unknown-age; 2 something is\n"
    "STUCK (wins over 1); 3 PostgreSQL could not be reached. Usage errors exit 2 as well,\n"
    "with a message on stderr and nothing on stdout.\n";

/* The counts, and the queue lengths the verdict is computed from. $1: the age
 * in seconds. Counting every effect reads the whole table, so it is read once: the counts by
 * state are the sums of the counts by tool and state. */
#define SQL_COUNTS_(REFS_BACKLOG)                                                                  \
    "WITH x AS MATERIALIZED (SELECT tool, status, count(*) AS n FROM effects GROUP BY tool, "      \
    "status)"                                                                                      \
    " SELECT json_build_object("                                                                   \
    " 'now', now(),"                                                                               \
    " 'effects_by_state', (SELECT coalesce(json_object_agg(status, n ORDER BY status), '{}')"      \
    "   FROM (SELECT status, sum(n)::bigint AS n FROM x GROUP BY status) s),"                      \
    " 'effects_by_tool', (SELECT coalesce(json_object_agg(tool, states ORDER BY tool), '{}')"      \
    "   FROM (SELECT tool, json_object_agg(status, n ORDER BY status) AS states"                   \
    "     FROM x GROUP BY tool) t),"                                                               \
    " 'obligations_by_state', (SELECT coalesce(json_object_agg(status, n ORDER BY status), '{}')"  \
    "   FROM (SELECT status, count(*) AS n FROM obligations GROUP BY status) s),"                  \
    " 'runs_by_state', (SELECT coalesce(json_object_agg(status, n ORDER BY status), '{}')"         \
    "   FROM (SELECT status, count(*) AS n FROM runs GROUP BY status) s)," /* ACTIVE runs whose    \
                                                                              effects are all      \
                                                                              settled: done with   \
                                                                              their work, but      \
                                                                              never completed */   \
    " 'runs_active_settled', (SELECT count(*) FROM runs r WHERE r.status = 'ACTIVE'"               \
    "   AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.run_id = r.run_id"                         \
    "     AND e.status IN ('PLANNED', 'AWAITING_APPROVAL', 'DISPATCHING', 'UNKNOWN'))),"           \
    " 'stuck_effects', (SELECT count(*) FROM effects WHERE status = 'STUCK'),"                     \
    " 'stuck_obligations', (SELECT count(*) FROM obligations WHERE status = 'STUCK'),"             \
    " 'unknown', (SELECT count(*) FROM effects WHERE status = 'UNKNOWN'),"                         \
    " 'unknown_aging', (SELECT count(*) FROM effects WHERE status = 'UNKNOWN'"                     \
    "   AND now() - coalesce(unknown_since, updated_at) > make_interval(secs => $1::float8)),"     \
    " 'awaiting_approval', (SELECT count(*) FROM effects WHERE status = 'AWAITING_APPROVAL')"      \
    "   + (SELECT count(*) FROM obligations WHERE status = 'AWAITING_APPROVAL'),"                  \
    " 'alerts_open', (SELECT count(*) FROM alerts WHERE status = 'TRIGGERED'),"                    \
    " 'findings_open', (SELECT count(*) FROM findings WHERE status = 'OPEN'),"                     \
    " 'message_outbox_backlog', (SELECT count(*) FROM message_outbox)" REFS_BACKLOG ")"
static const char SQL_COUNTS[] = SQL_COUNTS_(" + 0");
/* On schema 17 the outcome messages by reference (message_refs) wait too. */
static const char SQL_COUNTS_REFS[] = SQL_COUNTS_(" + (SELECT count(*) FROM message_refs)");

/* STUCK effects and obligations, longest stuck first, each with its open page
 * if any. An obligation's page is the one naming it; an effect's is the one
 * naming it and no obligation. */
static const char SQL_STUCK[] =
    "SELECT coalesce(json_agg(x ORDER BY x.since, x.id), '[]') FROM ("
    " SELECT 'effect'::text AS kind, e.effect_id::text AS id, e.run_id, e.step, e.tool,"
    "   e.effect_class, e.status_reason AS reason,"
    "   CASE WHEN e.error_code IS NULL THEN NULL"
    "     ELSE json_build_object('code', e.error_code, 'message', e.error_message) END AS error,"
    "   e.external_ref, e.attempts, e.updated_at AS since,"
    "   extract(epoch FROM now() - e.updated_at)::float8 AS age_s,"
    "   a.dedup_key AS alert, a.runbook"
    " FROM effects e"
    " LEFT JOIN LATERAL (SELECT dedup_key, runbook FROM alerts"
    "   WHERE status = 'TRIGGERED' AND effect_id = e.effect_id AND obligation_id IS NULL"
    "   ORDER BY created_at LIMIT 1) a ON true"
    " WHERE e.status = 'STUCK'"
    " UNION ALL"
    " SELECT 'obligation', o.obligation_id::text, o.run_id, e.step, e.tool, e.effect_class,"
    "   o.status_reason,"
    "   CASE WHEN o.error_code IS NULL THEN NULL"
    "     ELSE json_build_object('code', o.error_code, 'message', o.error_message) END,"
    "   o.external_ref, o.attempts, o.updated_at,"
    "   extract(epoch FROM now() - o.updated_at)::float8, a.dedup_key, a.runbook"
    " FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
    " LEFT JOIN LATERAL (SELECT dedup_key, runbook FROM alerts"
    "   WHERE status = 'TRIGGERED' AND obligation_id = o.obligation_id"
    "   ORDER BY created_at LIMIT 1) a ON true"
    " WHERE o.status = 'STUCK'"
    " ORDER BY 11 LIMIT " LIST_LIMIT ") x";

/* UNKNOWN effects, oldest first. $1: the age in seconds. */
static const char SQL_UNKNOWN[] =
    "SELECT coalesce(json_agg(x ORDER BY x.since, x.effect_id), '[]') FROM ("
    " SELECT e.effect_id::text AS effect_id, e.run_id, e.step, e.tool, e.effect_class,"
    "   e.attempts, e.status_reason AS reason, coalesce(e.unknown_since, e.updated_at) AS since,"
    "   extract(epoch FROM now() - coalesce(e.unknown_since, e.updated_at))::float8 AS age_s,"
    "   now() - coalesce(e.unknown_since, e.updated_at) > make_interval(secs => $1::float8)"
    "     AS aging,"
    "   e.next_attempt_at AS next_check_at"
    " FROM effects e WHERE e.status = 'UNKNOWN'"
    " ORDER BY coalesce(e.unknown_since, e.updated_at), e.effect_id LIMIT " LIST_LIMIT ") x";

static const char SQL_APPROVALS[] =
    "SELECT coalesce(json_agg(x ORDER BY x.since, x.id), '[]') FROM ("
    " SELECT 'effect'::text AS kind, e.effect_id::text AS id, e.run_id, e.step, e.tool,"
    "   e.effect_class, e.updated_at AS since,"
    "   extract(epoch FROM now() - e.updated_at)::float8 AS age_s"
    " FROM effects e WHERE e.status = 'AWAITING_APPROVAL'"
    " UNION ALL"
    " SELECT 'obligation', o.obligation_id::text, o.run_id, e.step, e.tool, e.effect_class,"
    "   o.updated_at, extract(epoch FROM now() - o.updated_at)::float8"
    " FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
    " WHERE o.status = 'AWAITING_APPROVAL'"
    " ORDER BY 7 LIMIT " LIST_LIMIT ") x";

static const char SQL_ALERTS[] =
    "SELECT coalesce(json_agg(x ORDER BY x.created_at, x.dedup_key), '[]') FROM ("
    " SELECT dedup_key, severity, summary, run_id, effect_id::text AS effect_id,"
    "   obligation_id::text AS obligation_id, reason, runbook, resolve_command, pager_state,"
    "   created_at, extract(epoch FROM now() - created_at)::float8 AS age_s"
    " FROM alerts WHERE status = 'TRIGGERED' ORDER BY created_at LIMIT " LIST_LIMIT ") x";

/* The by-tool table's state columns, in the state machine's order, headed by the states' full
 * names. */
static const tally_effect_state_t STATE_COLUMNS[] = {
    TALLY_EFFECT_PLANNED,     TALLY_EFFECT_AWAITING_APPROVAL,
    TALLY_EFFECT_DISPATCHING, TALLY_EFFECT_CONFIRMED,
    TALLY_EFFECT_FAILED,      TALLY_EFFECT_UNKNOWN,
    TALLY_EFFECT_STUCK,       TALLY_EFFECT_REJECTED,
    TALLY_EFFECT_CANCELLED,
};
#define N_STATE_COLUMNS (sizeof STATE_COLUMNS / sizeof STATE_COLUMNS[0])
_Static_assert(N_STATE_COLUMNS == TALLY_EFFECT__COUNT, "a column for every effect state");

/* Run states in the order of their lives (DESIGN §3, agent-protocol.md "Runs that finish"):
 * the key in "runs" of --json, and the words of the RUNS line. The first three are always
 * shown; the others when some run is in them. */
static const struct {
    tally_run_state_t state;
    const char *key;
} RUN_STATES[] = {
    {TALLY_RUN_ACTIVE, "active"},
    {TALLY_RUN_COMPLETING, "completing"},
    {TALLY_RUN_COMPLETED, "completed"},
    {TALLY_RUN_COMPENSATING, "compensating"},
    {TALLY_RUN_COMPENSATED, "compensated"},
    {TALLY_RUN_PARTIALLY_COMPENSATED, "partially_compensated"},
    {TALLY_RUN_STUCK, "stuck"},
    {TALLY_RUN_CANCELLED, "cancelled"},
};
#define N_RUN_STATES      (sizeof RUN_STATES / sizeof RUN_STATES[0])
#define RUN_STATES_ALWAYS 3
_Static_assert(N_RUN_STATES == TALLY_RUN__COUNT, "a key for every run state");

static long long count_of(const json_t *obj, const char *key)
{
    return (long long)cli_num(obj, key, 0);
}

/* Attach the resolve command every STUCK item is printed with. */
static bool add_commands(json_t *items)
{
    size_t i;
    json_t *item;
    json_array_foreach(items, i, item)
    {
        const char *id = cli_str(item, "id", "");
        char *cmd = strcmp(cli_str(item, "kind", ""), "obligation") == 0
                        ? tally_alert_obligation_command(id)
                        : tally_alert_effect_command(id);
        if (cmd == NULL || json_object_set_new(item, "resolve_command", json_string(cmd)) != 0) {
            free(cmd);
            return false;
        }
        free(cmd);
    }
    return true;
}

/* The runs by state under stable lower-case keys, every known state present (0 when none) and
 * "total"; a state this command does not know is kept under its own name, lower-cased. */
static json_t *runs_counts(const json_t *by_state)
{
    json_t *runs = json_object();
    json_int_t total = 0;
    bool ok = runs != NULL;
    for (size_t s = 0; ok && s < N_RUN_STATES; s++)
        ok = json_object_set_new(runs, RUN_STATES[s].key,
                                 json_integer((json_int_t)count_of(
                                     by_state, tally_run_state_name(RUN_STATES[s].state)))) == 0;
    const char *state;
    const json_t *v;
    json_object_foreach((json_t *)by_state, state, v)
    {
        total += json_integer_value(v);
        tally_run_state_t known;
        if (tally_run_state_parse(state, &known) || !ok)
            continue;
        char key[64];
        size_t i = 0;
        for (; state[i] != '\0' && i + 1 < sizeof key; i++)
            key[i] = state[i] >= 'A' && state[i] <= 'Z' ? (char)(state[i] - 'A' + 'a') : state[i];
        key[i] = '\0';
        ok = json_object_set_new(runs, key, json_integer(json_integer_value(v))) == 0;
    }
    ok = ok && json_object_set_new(runs, "total", json_integer(total)) == 0;
    if (!ok) {
        json_decref(runs);
        return NULL;
    }
    return runs;
}

/* "RUNS        3 active, 1 completing, 12 completed, 2 compensated": the runs still taking
 * intents apart from those that finished, and the compensation states when any run is in
 * them. */
static void print_runs_line(const json_t *runs, long long active_settled)
{
    printf("%-12s", "RUNS");
    char line[1024] = "";
    size_t len = 0;
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)runs, key, v)
    {
        size_t s = 0;
        while (s < N_RUN_STATES && strcmp(key, RUN_STATES[s].key) != 0)
            s++;
        if (strcmp(key, "total") == 0 ||
            (s < N_RUN_STATES && s >= RUN_STATES_ALWAYS && json_integer_value(v) == 0))
            continue;
        char words[80];
        tally_text_copy(words, sizeof words, s < N_RUN_STATES ? RUN_STATES[s].key : key);
        for (char *c = words; *c != '\0'; c++)
            *c = *c == '_' ? ' ' : *c;
        char more[96] = "";
        if (strcmp(key, "active") == 0 && active_settled > 0)
            /* ACTIVE is the ledger's state; say that their work is over */
            snprintf(more, sizeof more, " (%lld with every effect settled, not completed)",
                     active_settled);
        int n = snprintf(line + len, sizeof line - len, "%s%lld %s%s", len ? ", " : "",
                         (long long)json_integer_value(v), words, more);
        if (n < 0 || (size_t)n >= sizeof line - len)
            break;
        len += (size_t)n;
    }
    cli_wrap(stdout, line, 12, 12);
}

/* "CONFIRMED 8, FAILED 1" for an object of counts; "none" when empty. */
static void print_counts_line(const char *label, const json_t *by_state)
{
    printf("%-12s", label);
    if (json_object_size(by_state) == 0) {
        printf("none\n");
        return;
    }
    char line[1024];
    size_t len = 0;
    const char *k;
    const json_t *v;
    json_object_foreach((json_t *)by_state, k, v)
    {
        int n = snprintf(line + len, sizeof line - len, "%s%s %lld", len ? ", " : "", k,
                         (long long)json_integer_value(v));
        if (n < 0 || (size_t)n >= sizeof line - len)
            break;
        len += (size_t)n;
    }
    cli_wrap(stdout, line, 12, 12);
}

static void print_stuck(const json_t *items, long long total)
{
    char head[160];
    snprintf(head, sizeof head,
             "STUCK: %lld item%s need%s a human; nothing more is attempted on %s", total,
             total == 1 ? "" : "s", total == 1 ? "s" : "", total == 1 ? "it" : "them");
    cli_wrap(stdout, head, 0, 2);
    size_t i;
    json_t *it;
    json_array_foreach(items, i, it)
    {
        char age[32], line[512];
        cli_age(cli_num(it, "age_s", 0), age, sizeof age);
        printf("\n  %s %s %s  STUCK for %s\n", CLI_SYM_FAIL, cli_str(it, "kind", "?"),
               cli_str(it, "id", "?"), age);
        snprintf(line, sizeof line, "run %s, step %s, %s (%s), %lld attempt%s",
                 cli_str(it, "run_id", "?"), cli_str(it, "step", "?"), cli_str(it, "tool", "?"),
                 cli_str(it, "effect_class", "?"), (long long)cli_num(it, "attempts", 0),
                 cli_num(it, "attempts", 0) == 1 ? "" : "s");
        printf("    ");
        cli_wrap(stdout, line, 4, 4);
        cli_field(stdout, 4, 8, "reason", cli_str(it, "reason", "-"));
        const json_t *error = json_object_get(it, "error");
        if (json_is_object(error)) {
            snprintf(line, sizeof line, "%s: %s", cli_str(error, "code", "?"),
                     cli_str(error, "message", ""));
            if (strcmp(line, cli_str(it, "reason", "")) != 0) /* workers often say it twice */
                cli_field(stdout, 4, 8, "error", line);
        }
        if (cli_str(it, "external_ref", NULL) != NULL)
            cli_field(stdout, 4, 8, "ref", cli_str(it, "external_ref", NULL));
        if (cli_str(it, "alert", NULL) != NULL) {
            snprintf(line, sizeof line, "%s (open)", cli_str(it, "alert", NULL));
            cli_field(stdout, 4, 8, "alert", line);
        }
        if (cli_str(it, "runbook", NULL) != NULL)
            cli_field(stdout, 4, 8, "runbook", cli_str(it, "runbook", NULL));
        cli_print_command(stdout, cli_str(it, "resolve_command", ""), 4);
    }
    if ((long long)json_array_size(items) < total)
        printf("\n  ... and %lld more (tally status --json lists the first %s)\n",
               total - (long long)json_array_size(items), LIST_LIMIT);
}

static bool print_unknown(const json_t *items, long long total, long long aging,
                          const char *threshold)
{
    char line[256];
    snprintf(line, sizeof line,
             "UNKNOWN: %lld, %lld older than %s; oldest first (the reconciler resolves these "
             "from upstream evidence)",
             total, aging, threshold);
    cli_wrap(stdout, line, 0, 2);
    static const char *const heads[] = {"AGE", "EFFECT", "RUN", "STEP", "TOOL"};
    cli_table_t *t = cli_table_new(5, heads);
    if (t == NULL)
        return false;
    cli_table_keep(t, 0);
    cli_table_keep(t, 1);
    cli_table_right(t, 0);
    size_t i;
    json_t *it;
    json_array_foreach(items, i, it)
    {
        char age[32], cell[48];
        cli_age(cli_num(it, "age_s", 0), age, sizeof age);
        snprintf(cell, sizeof cell, "%s %s",
                 json_is_true(json_object_get(it, "aging")) ? CLI_SYM_WARN : " ", age);
        const char *cells[] = {cell, cli_str(it, "effect_id", "?"), cli_str(it, "run_id", "?"),
                               cli_str(it, "step", "?"), cli_str(it, "tool", "?")};
        cli_table_add(t, cells);
    }
    bool ok = cli_table_print(t, stdout, 2);
    cli_table_free(t);
    if ((long long)json_array_size(items) < total)
        printf("  ... and %lld more\n", total - (long long)json_array_size(items));
    return ok;
}

static void print_approvals(const json_t *items, long long total)
{
    printf("AWAITING APPROVAL: %lld\n", total);
    printf("  tally approve|deny --effect|--obligation ID --reason \"...\"\n");
    size_t i;
    json_t *it;
    json_array_foreach(items, i, it)
    {
        char age[32], line[512];
        cli_age(cli_num(it, "age_s", 0), age, sizeof age);
        printf("  %s %s  waiting %s\n", cli_str(it, "kind", "?"), cli_str(it, "id", "?"), age);
        snprintf(line, sizeof line, "run %s, step %s, %s (%s)", cli_str(it, "run_id", "?"),
                 cli_str(it, "step", "?"), cli_str(it, "tool", "?"),
                 cli_str(it, "effect_class", "?"));
        printf("    ");
        cli_wrap(stdout, line, 4, 4);
    }
    if ((long long)json_array_size(items) < total)
        printf("  ... and %lld more\n", total - (long long)json_array_size(items));
}

static void print_alerts(const json_t *items, long long total)
{
    printf("ALERTS OPEN: %lld\n", total);
    size_t i;
    json_t *it;
    json_array_foreach(items, i, it)
    {
        char age[32];
        cli_age(cli_num(it, "age_s", 0), age, sizeof age);
        char line[512];
        snprintf(line, sizeof line, "%s %s  %s  open" CLI_NBSP "%s, pager" CLI_NBSP "%s",
                 CLI_SYM_WARN, cli_str(it, "severity", "?"), cli_str(it, "dedup_key", "?"), age,
                 cli_str(it, "pager_state", "?"));
        printf("  ");
        cli_wrap(stdout, line, 2, 4);
        printf("    ");
        cli_wrap(stdout, cli_str(it, "summary", ""), 4, 4);
    }
}

/* One line per tool, "charge_card  5 effects: CONFIRMED 3, STUCK 2": when the table with
 * the states' full names would not fit. */
static void print_by_tool_lines(const json_t *by_tool)
{
    const char *tool;
    const json_t *states;
    json_object_foreach((json_t *)by_tool, tool, states)
    {
        char line[1024];
        long long total = 0;
        for (size_t s = 0; s < N_STATE_COLUMNS; s++)
            total += count_of(states, tally_effect_state_name(STATE_COLUMNS[s]));
        size_t len = (size_t)snprintf(line, sizeof line, "%s  %lld effect%s:", tool, total,
                                      total == 1 ? "" : "s");
        for (size_t s = 0; s < N_STATE_COLUMNS && len < sizeof line; s++) {
            const char *name = tally_effect_state_name(STATE_COLUMNS[s]);
            long long v = count_of(states, name);
            if (json_object_get(states, name) == NULL)
                continue;
            int w = snprintf(line + len, sizeof line - len, "%s %s %lld",
                             len > 0 && line[len - 1] == ':' ? "" : ",", name, v);
            if (w < 0)
                break;
            len += (size_t)w;
        }
        printf("  ");
        cli_wrap(stdout, line, 2, 4);
    }
}

static bool print_by_tool(const json_t *by_tool)
{
    /* Only the states that occur get a column; when even so the table with the states' full
     * names is wider than the screen, one line per tool says the same. */
    bool used[N_STATE_COLUMNS] = {false};
    const char *tool;
    const json_t *states;
    json_object_foreach((json_t *)by_tool, tool, states)
    {
        for (size_t s = 0; s < N_STATE_COLUMNS; s++)
            used[s] = used[s] ||
                      json_object_get(states, tally_effect_state_name(STATE_COLUMNS[s])) != NULL;
    }
    const char *heads[N_STATE_COLUMNS + 2];
    size_t cols[N_STATE_COLUMNS];
    size_t n = 0;
    heads[n++] = "TOOL";
    heads[n++] = "TOTAL";
    size_t nstates = 0;
    size_t width = 2 + strlen("TOOL") + 2 + strlen("TOTAL");
    json_object_foreach((json_t *)by_tool, tool, states)
    {
        size_t w = 2 + cli_text_width(tool) + 2 + strlen("TOTAL");
        width = w > width ? w : width;
    }
    for (size_t s = 0; s < N_STATE_COLUMNS; s++) {
        if (used[s]) {
            cols[nstates++] = s;
            heads[n++] = tally_effect_state_name(STATE_COLUMNS[s]);
            width += 2 + strlen(heads[n - 1]);
        }
    }
    if (width > CLI_WIDTH) {
        print_by_tool_lines(by_tool);
        return true;
    }
    cli_table_t *t = cli_table_new(n, heads);
    if (t == NULL)
        return false;
    for (size_t c = 1; c < n; c++) {
        cli_table_right(t, c);
        cli_table_keep(t, c); /* a state's name is never cut */
    }
    char buf[N_STATE_COLUMNS + 1][24];
    const char *cells[N_STATE_COLUMNS + 2];
    json_object_foreach((json_t *)by_tool, tool, states)
    {
        long long total = 0;
        for (size_t k = 0; k < nstates; k++) {
            long long v = count_of(states, tally_effect_state_name(STATE_COLUMNS[cols[k]]));
            total += v;
            snprintf(buf[k + 1], sizeof buf[k + 1], "%lld", v);
            cells[k + 2] = buf[k + 1];
        }
        snprintf(buf[0], sizeof buf[0], "%lld", total);
        cells[0] = tool;
        cells[1] = buf[0];
        cli_table_add(t, cells);
    }
    bool ok = cli_table_print(t, stdout, 2);
    cli_table_free(t);
    return ok;
}

static bool print_human(const json_t *doc)
{
    char threshold[32];
    cli_age(cli_num(doc, "unknown_age_s", 0), threshold, sizeof threshold);
    const json_t *c = json_object_get(doc, "counts");
    long long stuck = count_of(c, "stuck_effects") + count_of(c, "stuck_obligations");
    long long unknown = count_of(c, "unknown"), aging = count_of(c, "unknown_aging");
    long long approvals = count_of(c, "awaiting_approval"), alerts = count_of(c, "alerts_open");
    bool ok = true;

    printf("tally status at %s\n", cli_str(c, "now", "?"));
    if (stuck > 0) {
        printf("\n");
        print_stuck(json_object_get(doc, "stuck"), stuck);
    }
    if (unknown > 0) {
        printf("\n");
        ok = ok && print_unknown(json_object_get(doc, "unknown"), unknown, aging, threshold);
    }
    if (approvals > 0) {
        printf("\n");
        print_approvals(json_object_get(doc, "awaiting_approval"), approvals);
    }
    if (alerts > 0) {
        printf("\n");
        print_alerts(json_object_get(doc, "alerts"), alerts);
    }

    printf("\nEFFECTS BY TOOL\n");
    const json_t *by_tool = json_object_get(c, "effects_by_tool");
    if (json_object_size(by_tool) == 0)
        printf("  no effects yet\n");
    else
        ok = ok && print_by_tool(by_tool);
    printf("\n");
    print_counts_line("EFFECTS", json_object_get(c, "effects_by_state"));
    print_counts_line("OBLIGATIONS", json_object_get(c, "obligations_by_state"));
    print_runs_line(json_object_get(doc, "runs"), count_of(c, "runs_active_settled"));
    long long findings = count_of(c, "findings_open");
    if (findings > 0)
        printf("%-12s%lld open: what the tools hold that the ledger cannot place (their pages "
               "above;\n%-12sdocs/operations.md, \"Upstream findings\")\n",
               "FINDINGS", findings, "");
    printf("%-12s%lld message%s waiting for the relay\n", "OUTBOX",
           count_of(c, "message_outbox_backlog"),
           count_of(c, "message_outbox_backlog") == 1 ? "" : "s");

    printf("\n");
    if (stuck > 0)
        printf("%s %lld STUCK: resolve with the commands above (exit 2)\n", CLI_SYM_FAIL, stuck);
    else if (aging > 0)
        printf("%s %lld UNKNOWN older than %s (exit 1): is the reconciler running, and can\n"
               "  it reach the tools?\n",
               CLI_SYM_WARN, aging, threshold);
    else
        printf("%s clean: nothing STUCK, no UNKNOWN older than %s\n", CLI_SYM_OK, threshold);
    return ok && fflush(stdout) == 0;
}

int tally_cmd_status(int argc, char **argv, tally_config_t *cfg)
{
    static const struct option opts[] = {
        {"unknown-age", required_argument, NULL, 'a'},
        {"json", no_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    long age_s = cfg->unknown_age_s;
    bool as_json = false;
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option(VERB, USAGE, argc, argv, opts, &rc)) != -1) {
        switch (c) {
        case 'a': {
            char *end = NULL;
            age_s = strtol(optarg, &end, 10);
            if (end == optarg || *end != '\0' || age_s < 0 || age_s > 365L * 86400)
                return cli_usage_error(VERB, "--unknown-age: '%s' is not a number of seconds",
                                       optarg);
            break;
        }
        case 'j':
            as_json = true;
            break;
        }
    }
    if (rc >= 0)
        return rc;

    tally_pg_t *pg = cli_connect(VERB, cfg);
    if (pg == NULL)
        return CLI_EXIT_INFRA;
    char age_text[32];
    snprintf(age_text, sizeof age_text, "%ld", age_s);
    const char *params[1] = {age_text};
    tally_error_t err;
    json_t *doc = NULL;
    json_t *counts = NULL, *stuck = NULL, *unknown = NULL, *approvals = NULL, *alerts = NULL;

    /* One snapshot: every list and count agrees with the others. */
    if (!cli_begin_snapshot(pg, &err) ||
        (counts = cli_query_json(pg, cli_has_message_refs(pg) ? SQL_COUNTS_REFS : SQL_COUNTS, 1,
                                 params, &err)) == NULL ||
        (stuck = cli_query_json(pg, SQL_STUCK, 0, NULL, &err)) == NULL ||
        (unknown = cli_query_json(pg, SQL_UNKNOWN, 1, params, &err)) == NULL ||
        (approvals = cli_query_json(pg, SQL_APPROVALS, 0, NULL, &err)) == NULL ||
        (alerts = cli_query_json(pg, SQL_ALERTS, 0, NULL, &err)) == NULL) {
        rc = cli_pg_fail(VERB, "cannot read the ledger", &err);
        goto out;
    }
    tally_pg_rollback(pg);
    if (!add_commands(stuck)) {
        fprintf(stderr, "tally status: out of memory\n");
        rc = CLI_EXIT_REFUSED;
        goto out;
    }

    long long n_stuck = count_of(counts, "stuck_effects") + count_of(counts, "stuck_obligations");
    long long n_aging = count_of(counts, "unknown_aging");
    int verdict = n_stuck > 0 ? 2 : n_aging > 0 ? 1 : 0;
    static const char *const verdicts[] = {"clean", "aging_unknown", "stuck"};
    /* "runs" NULL (out of memory) fails the pack; cli_print_report says so. */
    doc = json_pack("{s:s, s:i, s:I, s:O, s:o, s:O, s:O, s:O, s:O}", "verdict", verdicts[verdict],
                    "exit_code", verdict, "unknown_age_s", (json_int_t)age_s, "counts", counts,
                    "runs", runs_counts(json_object_get(counts, "runs_by_state")), "stuck", stuck,
                    "unknown", unknown, "awaiting_approval", approvals, "alerts", alerts);
    rc = cli_print_report(VERB, doc, as_json, print_human);
    if (rc == CLI_EXIT_OK)
        rc = verdict;
out:
    json_decref(doc);
    json_decref(counts);
    json_decref(stuck);
    json_decref(unknown);
    json_decref(approvals);
    json_decref(alerts);
    tally_pg_free(pg);
    return rc;
}
