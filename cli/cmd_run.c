/* cmd_run.c — run-level decisions: `tally compensate --run R` (undo what the
 * run did, last step first) and `tally cancel --run R [--compensate]` (stop
 * what has not happened yet, and optionally undo what has). Both print the plan
 * step by step — each effect's class, its tool's compensation mode, what will
 * happen to it and why — and with --dry-run print only the plan, in a read-only
 * transaction, so nothing can change.
 *
 * The SQL is runops.h's, shared with the dispatcher (which does the same for
 * tally.compensate_run.v1 and tally.cancel_run.v1) and the compensator; this
 * file adds the operator's audit event and the report. */
#include <ctype.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/audit.h"
#include "tally/outbox.h"
#include "tally/registry.h"
#include "tally/runops.h"

static const char USAGE_COMPENSATE[] =
    "usage: tally compensate --run R --reason TEXT [--deadline D] [--actor NAME] [--json]\n"
    "       tally compensate --run R --dry-run [--json]\n"
    "\n"
    "Undo what run R did: one obligation per CONFIRMED effect, run by the compensator last\n"
    "step first. What happens to each effect follows its tool's contract (TALLY_TOOLS):\n"
    "reversible tools are reversed, reads and idempotent calls are skipped, append-only\n"
    "effects are recorded with their blast radius (and contained when the tool can), and\n"
    "destructive ones page a human. Effects still in flight are compensated once confirmed.\n"
    "Asking twice creates nothing new.\n"
    "\n"
    "  --run R        the run id\n"
    "  --dry-run      print the plan only; nothing is written (read-only transaction)\n"
    "  --reason TEXT  why (required unless --dry-run; goes into the audit trail)\n"
    "  --deadline D   the compensation must be finished within D: milliseconds (90000) or a\n"
    "                 number with a unit, ms s m h d (90s, 15m, 24h), 1 s to 24 d. An\n"
    "                 obligation still open after a share of it pages a warning\n"
    "                 (TALLY_DEADLINE_WARN_SHARE), at it a critical page; an earlier deadline\n"
    "                 of the run still running is kept\n"
    "  --actor NAME   who decided (default: the OS user)\n"
    "  --json         print the result and the plan as JSON\n"
    "  -h, --help     this text\n"
    "\n"
    "Exit status: 0 done (or planned); 1 no such run; 2 usage error; 3 PostgreSQL could not\n"
    "be reached.\n";

static const char USAGE_CANCEL[] =
    "usage: tally cancel --run R --reason TEXT [--compensate [--deadline D]] [--actor NAME]\n"
    "                    [--json]\n"
    "       tally cancel --run R --dry-run [--compensate] [--json]\n"
    "\n"
    "Stop run R: its PLANNED and AWAITING_APPROVAL effects become CANCELLED and are never\n"
    "dispatched; a call already in flight is left to finish. An ACTIVE run becomes\n"
    "CANCELLED. With --compensate, what the run already did is undone as by\n"
    "`tally compensate` (the run becomes COMPENSATING).\n"
    "\n"
    "  --run R        the run id\n"
    "  --compensate   also compensate the run's CONFIRMED effects\n"
    "  --deadline D   with --compensate: finish the compensation within D (as for\n"
    "                 tally compensate: 90000, 90s, 15m, 24h, 1d)\n"
    "  --dry-run      print the plan only; nothing is written (read-only transaction)\n"
    "  --reason TEXT  why (required unless --dry-run; goes into the audit trail)\n"
    "  --actor NAME   who decided (default: the OS user)\n"
    "  --json         print the result and the plan as JSON\n"
    "  -h, --help     this text\n"
    "\n"
    "Exit status: 0 done (or planned); 1 no such run; 2 usage error; 3 PostgreSQL could not\n"
    "be reached.\n";

static const char SQL_RUN_STATUS[] = "SELECT (SELECT to_jsonb(status) FROM runs WHERE run_id = $1)";

typedef struct run_op {
    const char *verb;
    tally_runop_kind_t kind;
    const char *run;
    const char *reason;
    const char *actor;
    bool compensate;
    bool dry_run;
    bool as_json;
    int deadline_ms; /* --deadline; 0: none */
    char source[300];
} run_op_t;

/* --deadline: milliseconds alone, or a number with a unit (ms, s, m, h, d), within the bounds
 * a compensate_run's data.deadline_ms takes. @returns false with a sentence on stderr. */
static bool parse_deadline(const char *verb, const char *text, int *out)
{
    static const struct {
        const char *unit;
        long long ms;
    } units[] = {{"", 1}, {"ms", 1}, {"s", 1000}, {"m", 60000}, {"h", 3600000}, {"d", 86400000}};
    char *end = NULL;
    long long n = isdigit((unsigned char)text[0]) ? strtoll(text, &end, 10) : -1;
    long long ms = -1;
    for (size_t i = 0; n >= 0 && end != NULL && i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(end, units[i].unit) == 0)
            ms = n <= TALLY_RUNOP_DEADLINE_MS_MAX / units[i].ms ? n * units[i].ms
                                                                : TALLY_RUNOP_DEADLINE_MS_MAX + 1LL;
    }
    if (ms < 0) {
        fprintf(stderr,
                "tally %s: --deadline '%s' is not a duration: give milliseconds (90000) or a "
                "number with a unit, ms s m h d (90s, 15m, 24h)\n",
                verb, text);
        return false;
    }
    if (ms < TALLY_RUNOP_DEADLINE_MS_MIN || ms > TALLY_RUNOP_DEADLINE_MS_MAX) {
        fprintf(stderr, "tally %s: --deadline '%s' is out of range: 1 s to 24 d (%d to %d ms)\n",
                verb, text, TALLY_RUNOP_DEADLINE_MS_MIN, TALLY_RUNOP_DEADLINE_MS_MAX);
        return false;
    }
    *out = (int)ms;
    return true;
}

static int parse(run_op_t *o, const char *usage, int argc, char **argv)
{
    enum { O_RUN = 256, O_REASON, O_ACTOR, O_COMPENSATE, O_DRY_RUN, O_JSON, O_DEADLINE };
    static const struct option all[] = {
        {"run", required_argument, NULL, O_RUN},
        {"deadline", required_argument, NULL, O_DEADLINE},
        {"reason", required_argument, NULL, O_REASON},
        {"actor", required_argument, NULL, O_ACTOR},
        {"dry-run", no_argument, NULL, O_DRY_RUN},
        {"json", no_argument, NULL, O_JSON},
        {"help", no_argument, NULL, 'h'},
        {"compensate", no_argument, NULL, O_COMPENSATE},
        {NULL, 0, NULL, 0},
    };
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option(o->verb, usage, argc, argv, all, &rc)) != -1) {
        switch (c) {
        case O_RUN:
            o->run = optarg;
            break;
        case O_REASON:
            o->reason = optarg;
            break;
        case O_ACTOR:
            o->actor = optarg;
            break;
        case O_COMPENSATE:
            o->compensate = true;
            break;
        case O_DRY_RUN:
            o->dry_run = true;
            break;
        case O_JSON:
            o->as_json = true;
            break;
        case O_DEADLINE:
            if (!parse_deadline(o->verb, optarg, &o->deadline_ms))
                return CLI_EXIT_USAGE;
            break;
        }
    }
    if (rc >= 0)
        return rc;
    if (o->deadline_ms > 0 && o->kind == TALLY_RUNOP_CANCEL && !o->compensate)
        return cli_usage_error(o->verb, "--deadline is for the compensation: add --compensate");
    if (o->kind == TALLY_RUNOP_COMPENSATE && o->compensate)
        return cli_usage_error(o->verb, "--compensate belongs to tally cancel (tally compensate "
                                        "always compensates)");
    if (o->run == NULL)
        return cli_usage_error(o->verb, "--run R is required");
    if (!cli_check_text(o->verb, "--run", o->run))
        return CLI_EXIT_USAGE;
    if (!cli_check_decision(o->verb, o->reason, !o->dry_run, &o->actor, o->source,
                            sizeof o->source))
        return CLI_EXIT_USAGE;
    return -1;
}

/* The registry, for the plan. NULL (with the reason printed) when TALLY_TOOLS
 * is not set or does not load; *@p bad tells the second case. */
static tally_registry_t *load_registry(const run_op_t *o, const tally_config_t *cfg, bool *bad)
{
    *bad = false;
    if (cfg->tools_path == NULL || cfg->tools_path[0] == '\0')
        return NULL;
    tally_problems_t problems = {0};
    tally_registry_t *reg = tally_registry_load_file(cfg->tools_path, &problems);
    if (reg == NULL) {
        fprintf(stderr, "tally %s: the tool registry %s (TALLY_TOOLS) does not load:\n", o->verb,
                cfg->tools_path);
        for (size_t i = 0; i < problems.n; i++)
            fprintf(stderr, "  %s\n", problems.lines[i]);
        *bad = true;
    }
    tally_problems_clear(&problems);
    return reg;
}

/* ---------------------------------------------------------------------------------------- */
/* Output                                                                                   */

static void print_plan(const json_t *plan, bool have_registry)
{
    size_t i;
    json_t *step;
    json_array_foreach(plan, i, step)
    {
        char line[1024], step_text[128];
        const json_t *s = json_object_get(step, "step");
        if (json_is_integer(s))
            snprintf(step_text, sizeof step_text, "%lld", (long long)json_integer_value(s));
        else
            snprintf(step_text, sizeof step_text, "%s",
                     json_string_value(s) != NULL ? json_string_value(s) : "?");
        snprintf(line, sizeof line, "%zu. step %s  %s  %s  → %s", i + 1, step_text,
                 cli_str(step, "tool", "?"), cli_str(step, "effect_status", "?"),
                 cli_str(step, "action", "?"));
        printf("  ");
        cli_wrap(stdout, line, 2, 6);
        snprintf(line, sizeof line, "%s, compensation %s", cli_str(step, "effect_class", "?"),
                 cli_str(step, "compensation_mode",
                         have_registry ? "unknown (the tool is not in TALLY_TOOLS)" : "?"));
        cli_field(stdout, 5, 6, "class", line);
        cli_field(stdout, 5, 6, "effect", cli_str(step, "effect_id", "?"));
        if (cli_str(step, "external_ref", NULL) != NULL)
            cli_field(stdout, 5, 6, "ref", cli_str(step, "external_ref", NULL));
        cli_field(stdout, 5, 6, "will", cli_str(step, "will", "-"));
        cli_field(stdout, 5, 6, "why", cli_str(step, "why", "-"));
        const json_t *ob = json_object_get(step, "obligation");
        if (json_is_object(ob)) {
            snprintf(line, sizeof line, "%s %s", cli_str(ob, "obligation_id", "?"),
                     cli_str(ob, "status", "?"));
            cli_field(stdout, 5, 6, "oblig.", line);
        }
        size_t k;
        json_t *copy;
        json_array_foreach(json_object_get(step, "duplicates"), k, copy)
        {
            snprintf(line, sizeof line, "%s %s, for the extra copy %s",
                     cli_str(copy, "obligation_id", "?"), cli_str(copy, "status", "?"),
                     cli_str(copy, "external_ref", "?"));
            cli_field(stdout, 5, 6, "dupl.", line);
        }
    }
    if (json_array_size(plan) == 0)
        printf("  the run has no effects\n");
}

static bool report(const run_op_t *o, const tally_runop_result_t *r, const char *status_before,
                   const json_t *plan, bool have_registry)
{
    if (o->as_json) {
        json_t *doc = json_pack("{s:s, s:s, s:b, s:b, s:s, s:s, s:O?}", "verb", o->verb, "run_id",
                                o->run, "dry_run", o->dry_run, "compensate",
                                o->kind == TALLY_RUNOP_COMPENSATE || o->compensate, "status_before",
                                status_before, "status_after",
                                o->dry_run ? status_before : r->status_after, "plan", plan);
        if (doc != NULL && !o->dry_run) {
            json_object_set_new(doc, "actor", json_string(o->actor));
            json_object_set_new(doc, "reason", json_string(o->reason));
            json_object_set_new(doc, "obligations_created",
                                json_integer((json_int_t)r->obligations_created));
            json_object_set_new(doc, "obligations_existing",
                                json_integer((json_int_t)r->obligations_existing));
            json_object_set_new(doc, "effects_cancelled",
                                json_integer((json_int_t)r->effects_cancelled));
            json_object_set_new(doc, "effects_waiting",
                                json_integer((json_int_t)r->effects_waiting));
            json_object_set_new(doc, "compensation_deadline_at",
                                r->deadline_at[0] != '\0' ? json_string(r->deadline_at)
                                                          : json_null());
        }
        bool ok = doc != NULL && cli_print_json(doc);
        json_decref(doc);
        return ok;
    }
    char line[1024];
    const char *what = o->kind == TALLY_RUNOP_COMPENSATE ? "compensate"
                       : o->compensate                   ? "cancel and compensate"
                                                         : "cancel";
    if (o->dry_run) {
        snprintf(line, sizeof line,
                 "DRY RUN: the plan to %s run %s (%s), step by step, last step first. Nothing was "
                 "changed.",
                 what, o->run, status_before);
        cli_wrap(stdout, line, 0, 0);
    } else {
        if (r->before == r->after)
            snprintf(line, sizeof line, "%s %s run %s: %s (unchanged), by %s", CLI_SYM_OK, what,
                     o->run, status_before, o->actor);
        else
            snprintf(line, sizeof line, "%s %s run %s: %s → %s, by %s", CLI_SYM_OK, what, o->run,
                     status_before, r->status_after, o->actor);
        cli_wrap(stdout, line, 0, 2);
        cli_field(stdout, 2, 11, "reason", o->reason);
        if (o->kind == TALLY_RUNOP_COMPENSATE || o->compensate) {
            if (r->obligations_created > 0)
                snprintf(line, sizeof line,
                         "%zu created (a tally.obligation.v1 each), %zu already there",
                         r->obligations_created, r->obligations_existing);
            else
                snprintf(line, sizeof line,
                         "none new: %zu already there (asking again creates nothing)",
                         r->obligations_existing);
            cli_field(stdout, 2, 11, "obligations", line);
            if (r->deadline_at[0] != '\0') {
                snprintf(line, sizeof line,
                         "%s: an obligation still open then pages (a warning before it)",
                         r->deadline_at);
                cli_field(stdout, 2, 11, "deadline", line);
            }
        }
        if (o->kind == TALLY_RUNOP_CANCEL) {
            snprintf(line, sizeof line, "%zu effect%s CANCELLED (never dispatched)",
                     r->effects_cancelled, r->effects_cancelled == 1 ? "" : "s");
            cli_field(stdout, 2, 11, "cancelled", line);
        }
        if (r->effects_waiting > 0) {
            snprintf(line, sizeof line, "%zu effect%s still in flight (DISPATCHING or UNKNOWN)%s",
                     r->effects_waiting, r->effects_waiting == 1 ? "" : "s",
                     o->kind == TALLY_RUNOP_COMPENSATE || o->compensate
                         ? ": compensated once confirmed"
                         : ": left to finish");
            cli_field(stdout, 2, 11, "in flight", line);
        }
        if (plan != NULL)
            printf("\nThe plan, step by step (the compensator runs it last step first):\n");
    }
    if (plan != NULL)
        print_plan(plan, have_registry);
    else
        printf("(the plan step by step needs the tool registry: TALLY_TOOLS)\n");
    if (!o->dry_run && (o->kind == TALLY_RUNOP_COMPENSATE || o->compensate)) {
        snprintf(line, sizeof line,
                 "Follow it with `tally summary --run %s`; `tally doctor --run %s` shows every "
                 "step as it happens.",
                 o->run, o->run);
        printf("\n");
        cli_wrap(stdout, line, 0, 0);
    }
    return fflush(stdout) == 0;
}

/* ---------------------------------------------------------------------------------------- */
/* The verbs                                                                                */

static int run_verb(run_op_t *o, tally_config_t *cfg)
{
    bool bad_registry = false;
    tally_registry_t *reg = load_registry(o, cfg, &bad_registry);
    /* The registry only explains the plan: a real request goes ahead without it (an operator
     * stopping a run must not be held up by a registry problem), a dry run cannot. */
    if (bad_registry && o->dry_run)
        return CLI_EXIT_REFUSED;
    if (bad_registry)
        fprintf(stderr, "tally %s: going ahead without the plan\n", o->verb);
    if (reg == NULL && o->dry_run) {
        tally_registry_free(reg);
        return cli_usage_error(
            o->verb, "--dry-run prints the plan, which needs the tool registry: set TALLY_TOOLS");
    }
    tally_pg_t *pg = cli_connect(o->verb, cfg);
    if (pg == NULL) {
        tally_registry_free(reg);
        return CLI_EXIT_INFRA;
    }
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    tally_audit_batch_t *ab = tally_audit_batch_new();
    json_t *status = NULL, *plan = NULL;
    tally_runop_t op = {.kind = o->kind,
                        .run_id = o->run,
                        .compensate = o->compensate,
                        .reason = o->reason,
                        .intent_id = NULL,
                        .deadline_ms = o->deadline_ms};
    tally_runop_result_t result;
    memset(&result, 0, sizeof result);
    tally_error_t err;
    int rc = CLI_EXIT_REFUSED;
    const char *params[1] = {o->run};
    if (ob == NULL || ab == NULL) {
        fprintf(stderr, "tally %s: out of memory\n", o->verb);
        goto out;
    }
    if (!(o->dry_run ? cli_begin_snapshot(pg, &err) : tally_pg_run(pg, "BEGIN", 0, NULL, &err)) ||
        (status = cli_query_json(pg, SQL_RUN_STATUS, 1, params, &err)) == NULL) {
        rc = cli_pg_fail(o->verb, "cannot read the run", &err);
        goto out;
    }
    if (!json_is_string(status)) {
        fprintf(stderr, "tally %s: no run '%s' in this ledger; nothing was changed\n", o->verb,
                o->run);
        rc = CLI_EXIT_REFUSED;
        goto out;
    }
    char before[24];
    snprintf(before, sizeof before, "%s", json_string_value(status));

    if (!o->dry_run) {
        if (!tally_runops_apply(pg, &op, 1, o->actor, o->source, ob, ab, &result, &err)) {
            rc = cli_pg_fail(o->verb, "nothing was changed", &err);
            goto out;
        }
        if (!result.found) { /* deleted between the two statements: cannot happen,
                                runs stay */
            fprintf(stderr, "tally %s: no run '%s' in this ledger; nothing was changed\n", o->verb,
                    o->run);
            goto out;
        }
        json_t *data = json_pack("{s:s, s:b, s:I, s:I, s:I, s:I}", "verb", o->verb, "compensate",
                                 o->kind == TALLY_RUNOP_COMPENSATE || o->compensate,
                                 "obligations_created", (json_int_t)result.obligations_created,
                                 "obligations_existing", (json_int_t)result.obligations_existing,
                                 "effects_cancelled", (json_int_t)result.effects_cancelled,
                                 "effects_waiting", (json_int_t)result.effects_waiting);
        if (data != NULL && o->deadline_ms > 0) {
            json_object_set_new(data, "deadline_ms", json_integer(o->deadline_ms));
            json_object_set_new(data, "compensation_deadline_at", json_string(result.deadline_at));
        }
        tally_audit_event_t ev = {.run_id = o->run,
                                  .kind = "operator",
                                  .actor = o->actor,
                                  .reason = o->reason,
                                  .data = data};
        (void)tally_audit_move(ab, TALLY_MACHINE_RUN, (int)result.before, (int)result.after, &ev);
        json_decref(data);
    }
    /* The plan, read in the same transaction: after the request, it shows the
     * obligations it created; in a dry run, what the request would do. */
    if (reg != NULL && (plan = tally_runops_plan(pg, reg, &op, &err)) == NULL) {
        rc = cli_pg_fail(o->verb, "cannot build the plan; nothing was changed", &err);
        goto out;
    }
    if (o->dry_run) {
        tally_pg_rollback(pg);
    } else if (!tally_audit_batch_flush(ab, pg, &err) || !tally_outbox_batch_flush(ob, pg, &err) ||
               !tally_pg_commit(pg, &err)) {
        rc = cli_pg_fail(o->verb, "nothing was changed", &err);
        goto out;
    }
    if (!report(o, &result, o->dry_run ? before : result.status_before, plan, reg != NULL)) {
        fprintf(stderr, "tally %s: %s, but the report could not be written\n", o->verb,
                o->dry_run ? "planned" : "done");
        rc = CLI_EXIT_REFUSED;
        goto out;
    }
    rc = CLI_EXIT_OK;
out:
    json_decref(plan);
    json_decref(status);
    tally_outbox_batch_free(ob);
    tally_audit_batch_free(ab);
    tally_pg_free(pg); /* an open transaction is rolled back with the connection */
    tally_registry_free(reg);
    return rc;
}

int tally_cmd_compensate(int argc, char **argv, tally_config_t *cfg)
{
    run_op_t o = {.verb = "compensate", .kind = TALLY_RUNOP_COMPENSATE};
    int rc = parse(&o, USAGE_COMPENSATE, argc, argv);
    return rc >= 0 ? rc : run_verb(&o, cfg);
}

int tally_cmd_cancel(int argc, char **argv, tally_config_t *cfg)
{
    run_op_t o = {.verb = "cancel", .kind = TALLY_RUNOP_CANCEL};
    int rc = parse(&o, USAGE_CANCEL, argc, argv);
    return rc >= 0 ? rc : run_verb(&o, cfg);
}
