/* main.c — the `tally` operator command: load the environment's configuration, then hand
 * argv to the verb named by argv[1]. One row per verb in the table below; the verb's own
 * file parses its options and answers --help. */
#include <ctype.h>
#include <errno.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <libpq-fe.h>
#include <librdkafka/rdkafka.h>

#include "cli.h"
#include "console.h"
#include "tally/config.h"
#include "tally/log.h"
#include "tally/registry.h"

extern char **environ;

static int cmd_version(int argc, char **argv, tally_config_t *cfg);

typedef struct cli_verb {
    const char *name;
    tally_cmd_fn fn;
    const char *help; /* one line for `tally --help` */
} cli_verb_t;

/* Add a verb: declare it in cli.h, implement it in its cmd_*.c, add a row here. */
static const cli_verb_t verbs[] = {
    {"migrate", tally_cmd_migrate, "apply the ledger's schema migrations to TALLY_PG"},
    {"tools", tally_cmd_tools, "check a tool registry against the safety rules (tools check FILE)"},
    {"publish", tally_cmd_publish,
     "publish an intent (or compensate/cancel/complete a run) and wait for its answer"},
    {"status", tally_cmd_status,
     "what needs a human: STUCK, aging UNKNOWN, approvals, alerts, counts"},
    {"console", tally_cmd_console, "serve the read-only web console: runs, timelines, queues"},
    {"doctor", tally_cmd_doctor,
     "one run: its problems and their commands, then its effects; --full: all"},
    {"verify", tally_cmd_verify, "the ledger's invariants, and with --tools the tools' records"},
    {"summary", tally_cmd_run_summary, "one run's compensation summary"},
    {"resolve", tally_cmd_resolve, "settle an UNKNOWN/STUCK effect or obligation, or a finding"},
    {"approve", tally_cmd_approve, "release an effect or obligation awaiting approval"},
    {"deny", tally_cmd_deny, "reject an effect or obligation awaiting approval"},
    {"compensate", tally_cmd_compensate, "undo a run, last step first (--dry-run: the plan)"},
    {"cancel", tally_cmd_cancel, "stop a run's pending effects (--compensate: undo the rest)"},
    {"forget", tally_cmd_forget, "erase a tenant's sealed personal data by destroying its key"},
    {"prune", tally_cmd_prune, "remove the payloads of runs settled before a date, keep the rest"},
    {"dev", tally_cmd_dev, "run the embedded stack: PostgreSQL, mock Kafka and the workers"},
    {"config", tally_cmd_config, "show every setting: variable, default, current value, help"},
    {"version", cmd_version, "print the version of tally and of its libraries"},
};

static const size_t n_verbs = sizeof(verbs) / sizeof(verbs[0]);

static void usage(FILE *out)
{
    fprintf(out, "tally — a side-effect ledger for AI-agent tool calls\n\n"
                 "usage: tally <command> [options]\n"
                 "       tally <command> --help\n\n"
                 "commands:\n");
    for (size_t i = 0; i < n_verbs; i++)
        fprintf(out, "  %-11s %s\n", verbs[i].name, verbs[i].help);
    fprintf(out, "\nConfiguration comes from the environment (TALLY_PG, TALLY_KAFKA_BROKERS, "
                 "TALLY_TOOLS, ...);\n`tally config` lists every setting.\n");
}

static const cli_verb_t *find_verb(const char *name)
{
    for (size_t i = 0; i < n_verbs; i++)
        if (strcmp(verbs[i].name, name) == 0)
            return &verbs[i];
    return NULL;
}

/* Levenshtein distance, capped: names longer than the buffer are simply "far". */
static size_t edit_distance(const char *a, const char *b)
{
    enum { MAXLEN = 64 };
    size_t la = strlen(a), lb = strlen(b);
    if (la >= MAXLEN || lb >= MAXLEN)
        return MAXLEN;
    size_t prev[MAXLEN + 1], cur[MAXLEN + 1];
    for (size_t j = 0; j <= lb; j++)
        prev[j] = j;
    for (size_t i = 1; i <= la; i++) {
        cur[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t sub = prev[j - 1] +
                         (tolower((unsigned char)a[i - 1]) != tolower((unsigned char)b[j - 1]));
            size_t del = prev[j] + 1, ins = cur[j - 1] + 1;
            cur[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
        memcpy(prev, cur, sizeof(size_t) * (lb + 1));
    }
    return prev[lb];
}

/* The verb a mistyped name most likely meant: a prefix, or within two edits. NULL if none. */
static const char *suggest_verb(const char *name)
{
    const char *best = NULL;
    size_t best_d = 3;
    for (size_t i = 0; i < n_verbs; i++) {
        if (name[0] != '\0' && strncmp(verbs[i].name, name, strlen(name)) == 0)
            return verbs[i].name;
        size_t d = edit_distance(name, verbs[i].name);
        if (d < best_d) {
            best_d = d;
            best = verbs[i].name;
        }
    }
    return best;
}

const char *tally_cli_default_actor(void)
{
    static char actor[256];
    if (actor[0] != '\0')
        return actor;
    const struct passwd *pw = getpwuid(geteuid());
    const char *name = pw != NULL ? pw->pw_name : NULL;
    if (name == NULL || name[0] == '\0')
        name = getenv("USER");
    if (name == NULL || name[0] == '\0')
        name = "unknown";
    snprintf(actor, sizeof(actor), "%s", name);
    return actor;
}

/* Whether each tool's secret variables are set here: the legacy signature's
 * connector.secret_env and connector.signing.secret_env. Never the values. */
static void describe_tool_secrets(const tally_config_t *cfg, FILE *out)
{
    fprintf(out,
            "\nTool secrets of the registry %s (TALLY_TOOLS), in this shell's environment\n"
            "(set or NOT SET; values are never shown):\n",
            cfg->tools_path);
    tally_problems_t problems = {0};
    tally_registry_t *reg = tally_registry_load_file(cfg->tools_path, &problems);
    if (reg == NULL) {
        fprintf(out, "  the registry does not load here:\n");
        for (size_t i = 0; i < problems.n; i++)
            fprintf(out, "    %s\n", problems.lines[i]);
    }
    tally_problems_clear(&problems);
    size_t n = reg != NULL ? tally_registry_count(reg) : 0;
    for (size_t i = 0; i < n; i++) {
        const tally_tool_t *tool = tally_registry_at(reg, i);
        const struct {
            const char *var, *what;
        } vars[] = {{tool->secret_env, "connector.secret_env"},
                    {tool->signing.secret_env, "connector.signing.secret_env"}};
        bool any = false;
        for (size_t v = 0; v < sizeof vars / sizeof vars[0]; v++) {
            if (vars[v].var == NULL || vars[v].var[0] == '\0')
                continue;
            any = true;
            const char *value = getenv(vars[v].var);
            fprintf(out, "  %-20s %-28s %-30s %s\n", tool->name, vars[v].var, vars[v].what,
                    value != NULL && value[0] != '\0' ? "set" : "NOT SET");
        }
        if (!any)
            fprintf(out, "  %-20s (no secret)\n", tool->name);
    }
    tally_registry_free(reg);
}

int tally_cmd_config(int argc, char **argv, tally_config_t *cfg)
{
    if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        printf("usage: tally config\n\n"
               "Print every setting tally reads from the environment: the variable, the value\n"
               "in force in this shell, where it comes from (this shell's environment or the\n"
               "default), the default, and what it does; then whether each tool's secret\n"
               "variables are set here. Workers already running may have other values: they\n"
               "read their own environment (for `tally dev`, source its env file first).\n");
        return 0;
    }
    if (argc > 1) {
        fprintf(stderr, "tally config: unexpected argument '%s' (it takes none)\n", argv[1]);
        return 2;
    }
    tally_config_describe_env(cfg, environ, stdout);
    describe_tool_secrets(cfg, stdout);
    return fflush(stdout) == 0 ? 0 : 1;
}

static int cmd_version(int argc, char **argv, tally_config_t *cfg)
{
    (void)cfg;
    if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        printf("usage: tally version\n\nPrint the version of tally and of the libraries it "
               "runs with.\n");
        return 0;
    }
    if (argc > 1) {
        fprintf(stderr, "tally version: unexpected argument '%s' (it takes none)\n", argv[1]);
        return 2;
    }
    int pq = PQlibVersion();
    printf("tally %s (librdkafka %s, libpq %d.%d)\n", TALLY_VERSION, rd_kafka_version_str(),
           pq / 10000, pq % 10000);
    return 0;
}

static tally_log_level_t log_level_of(const tally_config_t *cfg)
{
    tally_log_level_t level = TALLY_LOG_INFO;
    if (cfg->log_level != NULL && cfg->log_level[0] != '\0' &&
        !tally_log_level_parse(cfg->log_level, &level))
        level = TALLY_LOG_INFO;
    return level;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *name = argv[1];
    char *help_argv[3] = {NULL, "--help", NULL};
    if (strcmp(name, "--help") == 0 || strcmp(name, "-h") == 0 || strcmp(name, "help") == 0) {
        if (argc > 2 && strcmp(name, "help") == 0) {
            /* `tally help dev` is `tally dev --help` */
            if (find_verb(argv[2]) == NULL) {
                fprintf(stderr, "tally: unknown command '%s'; run 'tally --help' for the list\n",
                        argv[2]);
                return 2;
            }
            help_argv[0] = argv[2];
            argv = help_argv;
            argc = 2;
            name = argv[0];
        } else {
            usage(stdout);
            return 0;
        }
    } else {
        argv++;
        argc--;
    }
    if (strcmp(name, "--version") == 0 || strcmp(name, "-V") == 0)
        name = "version";

    const cli_verb_t *verb = find_verb(name);
    if (verb == NULL) {
        const char *hint = suggest_verb(name);
        if (name[0] == '-')
            fprintf(stderr, "tally: unknown option '%s'", name);
        else
            fprintf(stderr, "tally: unknown command '%s'", name);
        if (hint != NULL)
            fprintf(stderr, "; did you mean 'tally %s'?", hint);
        fprintf(stderr, "\nRun 'tally --help' for the list of commands.\n");
        return 2;
    }

    tally_config_t *cfg = tally_config_new();
    if (cfg == NULL) {
        fprintf(stderr, "tally: out of memory\n");
        return 1;
    }
    char errstr[512];
    if (!tally_config_load_env(cfg, environ, errstr, sizeof(errstr))) {
        fprintf(stderr, "tally: invalid configuration: %s\n", errstr);
        tally_config_free(cfg);
        return 2;
    }
    tally_log_init("tally", cfg->worker_id, log_level_of(cfg));

    /* verbs parse with getopt_long from argv[0] == the verb */
    optind = 1;
    int rc = verb->fn(argc, argv, cfg);
    tally_config_free(cfg);
    return rc;
}
