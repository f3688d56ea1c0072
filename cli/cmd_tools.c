/* cmd_tools.c — `tally tools check|list`: validate a tool registry, show its contracts. */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/registry.h"

static void usage_tools(FILE *out)
{
    fputs("usage: tally tools check [FILE...]\n"
          "       tally tools list [FILE]\n"
          "\n"
          "Work with tool registries (DESIGN §4; examples/tools/README.md).\n"
          "\n"
          "  check   validate each FILE against every registry rule; print \"FILE: ok (N tools)\"\n"
          "          or one line \"FILE: <problem>\" per problem found\n"
          "  list    print the tools of a valid registry: class, approval, compensation and\n"
          "          endpoints\n"
          "\n"
          "Without FILE, the registry named by TALLY_TOOLS is used, as by the workers.\n"
          "connector.base_url values may use ${VAR} and ${VAR:-default}; they are expanded from\n"
          "this environment, as a worker would.\n"
          "\n"
          "Exit status: 0 valid, 1 a problem was found, 2 usage error.\n",
          out);
}

static void usage_check(FILE *out)
{
    fputs("usage: tally tools check [FILE...]\n"
          "\n"
          "Validate tool registries. Every problem is reported, one line each, on stdout:\n"
          "  FILE: tool 'NAME': rule RULE-ID: what is wrong\n"
          "A valid file prints \"FILE: ok (N tools)\", after a line\n"
          "  FILE: warning: tool 'NAME': rule RULE-ID: ...\n"
          "for each thing that is allowed but weak (legacy-signature: Tally-Signature alone).\n"
          "Without FILE, TALLY_TOOLS is checked.\n"
          "\n"
          "Exit status: 0 every file valid, 1 a problem was found, 2 usage error.\n",
          out);
}

static void usage_list(FILE *out)
{
    fputs("usage: tally tools list [FILE]\n"
          "\n"
          "Print a table of the tools in a registry (TALLY_TOOLS without FILE): name, effect\n"
          "class, whether dispatch waits for approval, what compensation does, and the endpoints.\n"
          "An invalid registry prints its problems as `tally tools check` does.\n"
          "\n"
          "Exit status: 0 listed, 1 the registry is invalid, 2 usage error.\n",
          out);
}

static bool is_help(const char *a)
{
    return strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0;
}

/*
 * Collect FILE operands of a subcommand (argv[0] is the subcommand). Returns the number of
 * files written to @p files (borrowed from argv, or TALLY_TOOLS), -1 after printing help,
 * -2 after a usage error.
 */
static int collect_files(int argc, char **argv, tally_config_t *cfg, const char **files,
                         void (*usage)(FILE *))
{
    int n = 0;
    bool options_done = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!options_done && is_help(a)) {
            usage(stdout);
            return -1;
        }
        if (!options_done && strcmp(a, "--") == 0) {
            options_done = true;
            continue;
        }
        if (!options_done && a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "tally tools %s: unknown option '%s'\n", argv[0], a);
            usage(stderr);
            return -2;
        }
        files[n++] = a;
    }
    if (n == 0) {
        if (cfg == NULL || cfg->tools_path == NULL || cfg->tools_path[0] == '\0') {
            fprintf(stderr, "tally tools %s: no FILE given and TALLY_TOOLS is not set\n", argv[0]);
            usage(stderr);
            return -2;
        }
        files[n++] = cfg->tools_path;
    }
    return n;
}

/* Loads @p path; prints its problems (as "FILE: problem" on stdout) when it is invalid. */
static tally_registry_t *load_or_report(const char *path)
{
    tally_problems_t problems = {0};
    tally_registry_t *reg = tally_registry_load_file(path, &problems);
    for (size_t i = 0; i < problems.n; i++)
        printf("%s: %s\n", path, problems.lines[i]);
    if (reg == NULL && problems.n == 0)
        printf("%s: the registry could not be loaded (out of memory)\n", path);
    tally_problems_clear(&problems);
    return reg;
}

/* A registry with sensitive fields needs a master key wherever a worker runs it (a worker
 * refuses to start without one): said here when this environment has none, as a warning. */
static void warn_no_master_key(const tally_config_t *cfg, const char *file,
                               const tally_registry_t *reg)
{
    bool have = (cfg->master_key != NULL && cfg->master_key[0] != '\0') ||
                (cfg->master_key_file != NULL && cfg->master_key_file[0] != '\0');
    for (size_t i = 0; !have && i < tally_registry_count(reg); i++) {
        const tally_tool_t *t = tally_registry_at(reg, i);
        if (tally_tool_sensitive(t)) {
            printf("%s: warning: tool '%s' declares sensitive fields: the workers need "
                   "TALLY_MASTER_KEY or TALLY_MASTER_KEY_FILE to seal them, and neither is set "
                   "here (docs/security.md)\n",
                   file, t->name);
        }
    }
}

static int tools_check(int argc, char **argv, tally_config_t *cfg)
{
    const char **files = calloc((size_t)argc + 1, sizeof *files);
    if (files == NULL) {
        fputs("tally tools check: out of memory\n", stderr);
        return 1;
    }
    int n = collect_files(argc, argv, cfg, files, usage_check);
    if (n < 0) {
        free(files);
        return n == -1 ? 0 : 2;
    }
    int rc = 0;
    for (int i = 0; i < n; i++) {
        tally_registry_t *reg = load_or_report(files[i]);
        if (reg == NULL) {
            rc = 1;
            continue;
        }
        /* a warning is not a problem: the file is valid, and the exit status says so */
        const tally_problems_t *w = tally_registry_warnings(reg);
        for (size_t j = 0; w != NULL && j < w->n; j++)
            printf("%s: warning: %s\n", files[i], w->lines[j]);
        warn_no_master_key(cfg, files[i], reg);
        size_t count = tally_registry_count(reg);
        printf("%s: ok (%zu tool%s)\n", files[i], count, count == 1 ? "" : "s");
        tally_registry_free(reg);
    }
    free(files);
    return rc;
}

/* What compensating an effect of this tool does, in operator words. */
static const char *compensation_text(const tally_tool_t *t)
{
    switch (t->effect_class) {
    case TALLY_CLASS_READ:
    case TALLY_CLASS_IDEMPOTENT:
        return "skipped";
    case TALLY_CLASS_REVERSIBLE:
        return tally_comp_mode_name(t->comp_mode);
    case TALLY_CLASS_APPEND_ONLY:
        return t->contain.path != NULL ? "uncompensatable, contain" : "uncompensatable";
    case TALLY_CLASS_DESTRUCTIVE:
        return "uncompensatable, escalate";
    }
    return "unknown";
}

static void endpoints_text(const tally_tool_t *t, char *buf, size_t bufsz)
{
    const struct {
        const char *what;
        const tally_endpoint_t *ep;
    } eps[] = {{"execute", &t->execute},
               {"status", &t->status},
               {"compensate", &t->compensate},
               {"contain", &t->contain}};
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < sizeof eps / sizeof eps[0]; i++) {
        if (eps[i].ep->path == NULL)
            continue;
        int w = snprintf(buf + used, bufsz - used, "%s%s %s %s", used > 0 ? ", " : "", eps[i].what,
                         eps[i].ep->method, eps[i].ep->path);
        if (w < 0 || (size_t)w >= bufsz - used)
            break;
        used += (size_t)w;
    }
}

static int tools_list(int argc, char **argv, tally_config_t *cfg)
{
    const char **files = calloc((size_t)argc + 1, sizeof *files);
    if (files == NULL) {
        fputs("tally tools list: out of memory\n", stderr);
        return 1;
    }
    int n = collect_files(argc, argv, cfg, files, usage_list);
    const char *path = files[0];
    free(files);
    if (n < 0)
        return n == -1 ? 0 : 2;
    if (n > 1) {
        /* One registry at a time: `tally tools check` takes several. */
        fputs("tally tools list: give one FILE\n", stderr);
        usage_list(stderr);
        return 2;
    }
    tally_registry_t *reg = load_or_report(path);
    if (reg == NULL)
        return 1;

    int w_name = (int)strlen("NAME"), w_class = (int)strlen("CLASS");
    int w_comp = (int)strlen("COMPENSATION");
    for (size_t i = 0; i < tally_registry_count(reg); i++) {
        const tally_tool_t *t = tally_registry_at(reg, i);
        int a = (int)strlen(t->name), b = (int)strlen(tally_effect_class_name(t->effect_class));
        int c = (int)strlen(compensation_text(t));
        w_name = a > w_name ? a : w_name;
        w_class = b > w_class ? b : w_class;
        w_comp = c > w_comp ? c : w_comp;
    }
    printf("%-*s  %-*s  %-8s  %-*s  %s\n", w_name, "NAME", w_class, "CLASS", "APPROVAL", w_comp,
           "COMPENSATION", "ENDPOINTS");
    for (size_t i = 0; i < tally_registry_count(reg); i++) {
        const tally_tool_t *t = tally_registry_at(reg, i);
        char eps[1024];
        endpoints_text(t, eps, sizeof eps);
        printf("%-*s  %-*s  %-8s  %-*s  %s\n", w_name, t->name, w_class,
               tally_effect_class_name(t->effect_class), t->requires_approval ? "yes" : "no",
               w_comp, compensation_text(t), eps);
    }
    tally_registry_free(reg);
    return 0;
}

int tally_cmd_tools(int argc, char **argv, tally_config_t *cfg)
{
    if (argc < 2) {
        fputs("tally tools: missing command (check or list)\n", stderr);
        usage_tools(stderr);
        return 2;
    }
    const char *sub = argv[1];
    if (is_help(sub) || strcmp(sub, "help") == 0) {
        usage_tools(stdout);
        return 0;
    }
    if (strcmp(sub, "check") == 0)
        return tools_check(argc - 1, argv + 1, cfg);
    if (strcmp(sub, "list") == 0)
        return tools_list(argc - 1, argv + 1, cfg);
    fprintf(stderr, "tally tools: unknown command '%s' (expected check or list)\n", sub);
    usage_tools(stderr);
    return 2;
}
