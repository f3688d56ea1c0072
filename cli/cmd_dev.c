/* cmd_dev.c — `tally dev`: the embedded stack of DESIGN §10 in one foreground process.
 *
 * A throwaway PostgreSQL cluster (initdb in a temporary directory, the server in its own
 * session so a terminal's Ctrl-C reaches only us), librdkafka's mock cluster served from this
 * process, the ledger migrated, and the three workers as supervised child processes, with
 * `tally console` beside them, reading as the reader role. It prints the environment that
 * points at it, stays up until SIGINT/SIGTERM, then stops
 * everything in reverse order and leaves nothing behind: no process, no directory, no env
 * file — also when start-up fails halfway. This file is the command: its options, the order
 * things start and stop in, what it prints, and supervision; dev.h names the parts. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <curl/curl.h>

#include "cli.h"
#include "dev.h"
#include "tally/config.h"

enum {
    DEV_DEFAULT_PARTITIONS = 4,
    DEV_TICK_MS = 100,
};

/* Signal handlers only count: the main loop looks at the count. */
volatile sig_atomic_t dev_signals;

static void dev_on_signal(int sig)
{
    (void)sig;
    if (dev_signals < 100)
        dev_signals = dev_signals + 1;
}

static void dev_usage(FILE *out)
{
    fprintf(out,
            "usage: tally dev [--tools FILE] [--env-file PATH] [--no-workers] [--pg CONNINFO]\n"
            "                 [--partitions N] [--data-dir DIR] [--keep]\n"
            "                 [--console-addr HOST:PORT | --no-console]\n\n"
            "Run the embedded stack in the foreground: a throwaway PostgreSQL cluster, the\n"
            "librdkafka mock Kafka cluster with the tally topics, the ledger migrated, and\n"
            "tally-dispatcher, tally-reconciler, tally-compensator and the web console\n"
            "(tally console) as supervised child processes. Prints `export TALLY_...` lines\n"
            "on stdout; Ctrl-C (or SIGTERM) stops everything and removes what was created.\n\n"
            "options:\n"
            "  --tools FILE      the tool registry the workers load (default: $TALLY_TOOLS;\n"
            "                    required unless --no-workers)\n"
            "  --env-file PATH   also write the export lines to PATH (atomically); removed at\n"
            "                    stop\n"
            "  --no-workers      only PostgreSQL and Kafka (what the test suite uses): no\n"
            "                    workers, no console\n"
            "  --console-addr HOST:PORT\n"
            "                    where the console serves (default 127.0.0.1 and a free port)\n"
            "  --no-console      do not run the console\n"
            "  --pg CONNINFO     use this PostgreSQL instead of a throwaway cluster\n"
            "                    (default: $TALLY_PG when set)\n"
            "  --partitions N    partitions of each tally topic (default %d)\n"
            "  --data-dir DIR    keep the cluster in DIR (created when missing, reused when it\n"
            "                    holds one, never removed) instead of a temporary directory\n"
            "  --keep            do not remove the temporary directory at stop\n"
            "  -h, --help        this text\n\n"
            "Database roles: the cluster's superuser is tally (administration only); the\n"
            "ledger is owned by " DEV_OWNER_ROLE " (LOGIN CREATEROLE), which migrates it and\n"
            "creates the runtime roles; each worker connects as its own role, and the printed\n"
            "TALLY_PG as the operator's. The env file adds TALLY_PG_ADMIN, TALLY_PG_OWNER,\n"
            "TALLY_PG_READER, TALLY_PG_DISPATCHER, TALLY_PG_RECONCILER, TALLY_PG_COMPENSATOR;\n"
            "with workers it and stdout also carry TALLY_TOOLS, the registry's absolute path.\n"
            "With --pg every process connects as the given role (the workers with\n"
            "TALLY_ALLOW_OWNER_ROLE=1).\n\n"
            "The workers get TALLY_PG, TALLY_KAFKA_BROKERS, TALLY_TOPIC_PREFIX, their own\n"
            "TALLY_METRICS_ADDR, and TALLY_SESSION_TIMEOUT_MS=6000,\n"
            "TALLY_KAFKA_HEARTBEAT_INTERVAL_MS=500 and TALLY_KAFKA_FETCH_WAIT_MAX_MS=10 (the\n"
            "mock broker holds an empty fetch this long) unless those are set, and\n"
            "TALLY_CONSOLE_URL=http://HOST:PORT of the console, so that every alert and page\n"
            "links to its run there; the env file and stdout carry TALLY_CONSOLE_URL too. The\n"
            "console reads as TALLY_PG_READER (the read-only role). A worker or the console\n"
            "that dies is restarted at most %d times, with backoff. A temporary directory\n"
            "left behind by a tally dev that was killed outright (SIGKILL) is removed by the\n"
            "next one.\n",
            DEV_DEFAULT_PARTITIONS, DEV_MAX_RESTARTS);
}

/* "'value'" for a POSIX shell when the value needs it. */
static void shell_quote(const char *v, bool always, char *out, size_t outsz)
{
    bool plain = !always && v[0] != '\0';
    for (const char *p = v; *p != '\0'; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              strchr("._-:/,@+%", *p) != NULL))
            plain = false;
    if (plain) {
        snprintf(out, outsz, "%s", v);
        return;
    }
    size_t o = 0;
    if (outsz < 3) {
        if (outsz > 0)
            out[0] = '\0';
        return;
    }
    out[o++] = '\'';
    for (const char *p = v; *p != '\0' && o + 6 < outsz; p++) {
        if (*p == '\'') {
            memcpy(out + o, "'\\''", 4);
            o += 4;
        } else {
            out[o++] = *p;
        }
    }
    out[o++] = '\'';
    out[o] = '\0';
}

/* ---- the environment it prints ---------------------------------------------------------- */

/* TALLY_PG is the operator's role: what an on-call engineer in a dev shell runs tally as. The
 * other connections of our own cluster follow, for scripts and tests (docs/operations.md,
 * "Database roles"); with --pg there is only the given one. */
static bool exports_format(const dev_stack_t *s, char *out, size_t outsz)
{
    char pg[sizeof(s->conninfo) * 4 + 8], brokers[sizeof(s->brokers) * 4 + 8], prefix[1024];
    shell_quote(s->conninfo, true, pg, sizeof(pg)); /* a conninfo has spaces */
    shell_quote(s->brokers, false, brokers, sizeof(brokers));
    shell_quote(s->cfg->topic_prefix, false, prefix, sizeof(prefix));
    int n = snprintf(out, outsz,
                     "export TALLY_PG=%s\nexport TALLY_KAFKA_BROKERS=%s\n"
                     "export TALLY_TOPIC_PREFIX=%s\n",
                     pg, brokers, prefix);
    if (n <= 0 || (size_t)n >= outsz)
        return false;
    if (s->tools[0] != '\0') {
        /* the registry the workers run with, so that a verb in another shell (compensate
         * --dry-run, verify) reads the same tools; with --no-workers there is none */
        char tools[sizeof(s->tools) * 4 + 8];
        shell_quote(s->tools, false, tools, sizeof(tools));
        int m = snprintf(out + n, outsz - (size_t)n, "export TALLY_TOOLS=%s\n", tools);
        if (m <= 0 || (size_t)m >= outsz - (size_t)n)
            return false;
        n += m;
    }
    if (s->console_url[0] != '\0') {
        char url[sizeof(s->console_url) * 4 + 8];
        shell_quote(s->console_url, false, url, sizeof(url));
        int m = snprintf(out + n, outsz - (size_t)n, "export TALLY_CONSOLE_URL=%s\n", url);
        if (m <= 0 || (size_t)m >= outsz - (size_t)n)
            return false;
        n += m;
    }
    if (s->pg_given != NULL)
        return true;
    const struct {
        const char *name;
        const char *conninfo;
    } more[] = {
        {"TALLY_PG_ADMIN", s->conn_admin},
        {"TALLY_PG_OWNER", s->conn_owner},
        {"TALLY_PG_READER", s->conn_role[TALLY_ROLE_READER]},
        {"TALLY_PG_DISPATCHER", s->conn_role[TALLY_ROLE_DISPATCHER]},
        {"TALLY_PG_RECONCILER", s->conn_role[TALLY_ROLE_RECONCILER]},
        {"TALLY_PG_COMPENSATOR", s->conn_role[TALLY_ROLE_COMPENSATOR]},
    };
    for (size_t i = 0; i < sizeof(more) / sizeof(more[0]); i++) {
        shell_quote(more[i].conninfo, true, pg, sizeof(pg));
        size_t used = (size_t)n;
        int m = snprintf(out + used, outsz - used, "export %s=%s\n", more[i].name, pg);
        if (m <= 0 || (size_t)m >= outsz - used)
            return false;
        n += m;
    }
    return true;
}

static bool env_file_write(const char *path, const char *text, char *errstr, size_t errsz)
{
    char tmp[PATH_MAX + 32];
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        dev_err(errstr, errsz, "--env-file %s: cannot create %s: %s", path, tmp, strerror(errno));
        return false;
    }
    size_t len = strlen(text), off = 0;
    while (off < len) {
        ssize_t w = write(fd, text + off, len - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0) {
            dev_err(errstr, errsz, "--env-file %s: writing %s: %s", path, tmp, strerror(errno));
            close(fd);
            unlink(tmp);
            return false;
        }
        off += (size_t)w;
    }
    if (fsync(fd) != 0 || close(fd) != 0) {
        dev_err(errstr, errsz, "--env-file %s: writing %s: %s", path, tmp, strerror(errno));
        unlink(tmp);
        return false;
    }
    if (rename(tmp, path) != 0) {
        dev_err(errstr, errsz, "--env-file %s: rename: %s", path, strerror(errno));
        unlink(tmp);
        return false;
    }
    return true;
}

static void banner(const dev_stack_t *s)
{
    fprintf(stderr, "\ntally dev is up.\n");
    if (s->pg_given != NULL) {
        fprintf(stderr, "  PostgreSQL  %s (given)\n", s->conninfo);
    } else {
        fprintf(stderr, "  PostgreSQL  %s  (127.0.0.1:%d, pid %d", s->conninfo, s->pg_port,
                (int)s->pg_pid);
        if (s->pg_major > 0)
            fprintf(stderr, ", version %d", s->pg_major);
        fprintf(stderr, "%s)\n", s->as_postgres ? ", running as user postgres" : "");
        fprintf(stderr, "              data %s, server log %s/postgres.log\n", s->pgdata, s->dir);
        fprintf(stderr,
                "  roles       TALLY_PG is %s (operator); owner " DEV_OWNER_ROLE
                ", superuser tally; each worker its own (env file)\n",
                tally_role_name(s->cfg, TALLY_ROLE_OPERATOR));
    }
    fprintf(stderr, "  Kafka       %s  (librdkafka mock cluster in this process, %d broker)\n",
            s->brokers, DEV_MOCK_BROKERS);
    fprintf(stderr, "              topics");
    for (size_t i = 0; i < DEV_N_TOPICS; i++)
        fprintf(stderr, " %s%s", s->cfg->topic_prefix, dev_topics[i]);
    fprintf(stderr, " (%d partitions each)\n", s->partitions);
    fprintf(stderr, "  ledger      schema version %d", s->schema_after);
    if (s->schema_before != s->schema_after)
        fprintf(stderr, " (migrated from %d)", s->schema_before);
    fprintf(stderr, "\n");
    if (s->no_workers) {
        fprintf(stderr, "  workers     none (--no-workers)\n");
    } else {
        for (size_t i = 0; i < DEV_N_WORKERS; i++)
            fprintf(stderr, "  %-18s pid %-7d http://127.0.0.1:%d/metrics\n", s->workers[i].name,
                    (int)s->workers[i].pid, s->workers[i].metrics_port);
        fprintf(stderr, "  tools       %s\n", s->tools);
        if (s->console.pid > 0)
            fprintf(stderr,
                    "  console     %s/  (tally console, pid %d, reading as %s; every alert "
                    "links here)\n",
                    s->console_url, (int)s->console.pid,
                    s->pg_given != NULL ? "the given role"
                                        : tally_role_name(s->cfg, TALLY_ROLE_READER));
        else
            fprintf(stderr, "  console     none (--no-console)\n");
    }
    if (s->env_file != NULL)
        fprintf(stderr, "  env file    %s  (source it in another shell)\n", s->env_file);
    fprintf(stderr, "Ctrl-C to stop.\n\n");
}

/* ---- supervision ------------------------------------------------------------------------ */

/* Until a signal: reap children, restart dead workers with backoff (a few times, out loud).
 * @returns 0, or 1 when PostgreSQL died under us. */
static int supervise(dev_stack_t *s)
{
    while (dev_signals == 0) {
        int status;
        pid_t pid;
        while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
            if (dev_pg_reaped(s, pid, status))
                return 1;
            dev_workers_reaped(s, pid, status);
        }
        if (!s->no_workers)
            dev_workers_restart_due(s);
        dev_sleep_ms(DEV_TICK_MS);
    }
    return 0;
}

/* Everything that was started, stopped in reverse order; safe after any partial start. */
static void dev_stop(dev_stack_t *s)
{
    dev_workers_stop(s);
    dev_kafka_stop(s);
    dev_pg_stop(s);
    if (s->env_written && unlink(s->env_file) != 0 && errno != ENOENT)
        dev_say("could not remove %s: %s", s->env_file, strerror(errno));
    s->env_written = false;
    dev_pg_remove_dir(s);
}

/* ---- the command -------------------------------------------------------------------------- */

static int parse_args(dev_stack_t *s, int argc, char **argv)
{
    static const struct option opts[] = {
        {"tools", required_argument, NULL, 't'},
        {"env-file", required_argument, NULL, 'e'},
        {"no-workers", no_argument, NULL, 'n'},
        {"pg", required_argument, NULL, 'p'},
        {"partitions", required_argument, NULL, 'P'},
        {"data-dir", required_argument, NULL, 'd'},
        {"keep", no_argument, NULL, 'k'},
        {"console-addr", required_argument, NULL, 'c'},
        {"no-console", no_argument, NULL, 'C'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    /* the configuration has a default registry path; tally dev wants one chosen on purpose */
    const char *env_tools = getenv("TALLY_TOOLS");
    const char *tools = env_tools != NULL && env_tools[0] != '\0' ? s->cfg->tools_path : NULL;
    if (s->cfg->pg != NULL && s->cfg->pg[0] != '\0')
        s->pg_given = s->cfg->pg;
    s->partitions = DEV_DEFAULT_PARTITIONS;
    opterr = 0;
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, ":h", opts, NULL)) != -1) {
        switch (c) {
        case 't':
            tools = optarg;
            break;
        case 'e':
            s->env_file = optarg;
            break;
        case 'n':
            s->no_workers = true;
            break;
        case 'p':
            s->pg_given = optarg;
            break;
        case 'P': {
            char *end;
            errno = 0;
            long n = strtol(optarg, &end, 10);
            if (errno != 0 || *end != '\0' || end == optarg || n < 1 || n > 10000) {
                fprintf(stderr, "tally dev: --partitions: '%s' is not a number from 1 to 10000\n",
                        optarg);
                return 2;
            }
            s->partitions = (int)n;
            break;
        }
        case 'd':
            s->data_dir = optarg;
            break;
        case 'k':
            s->keep = true;
            break;
        case 'c':
            s->console_addr = optarg;
            break;
        case 'C':
            s->no_console = true;
            break;
        case 'h':
            dev_usage(stdout);
            return 0;
        case ':':
            fprintf(stderr, "tally dev: %s needs a value; see tally dev --help\n",
                    argv[optind - 1]);
            return 2;
        default:
            fprintf(stderr, "tally dev: unknown option '%s'; see tally dev --help\n",
                    argv[optind - 1]);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tally dev: unexpected argument '%s'; see tally dev --help\n",
                argv[optind]);
        return 2;
    }
    if (s->pg_given != NULL && s->data_dir != NULL) {
        fprintf(stderr, "tally dev: --data-dir is for the throwaway cluster; it cannot be "
                        "combined with --pg or TALLY_PG\n");
        return 2;
    }
    if (s->console_addr != NULL && (s->no_console || s->no_workers)) {
        fprintf(stderr, "tally dev: --console-addr places the console, which %s does not run\n",
                s->no_console ? "--no-console" : "--no-workers");
        return 2;
    }
    if (s->console_addr != NULL) {
        const char *colon = strrchr(s->console_addr, ':');
        char *end = NULL;
        long port = colon != NULL ? strtol(colon + 1, &end, 10) : 0;
        if (colon == NULL || colon == s->console_addr || end == colon + 1 || *end != '\0' ||
            port < 1 || port > 65535 || strlen(s->console_addr) >= sizeof(s->console_listen)) {
            fprintf(stderr,
                    "tally dev: --console-addr: '%s' is not HOST:PORT (e.g. 127.0.0.1:8089)\n",
                    s->console_addr);
            return 2;
        }
    }
    if (s->no_workers)
        s->no_console = true; /* only PostgreSQL and Kafka */
    if (!s->no_workers) {
        if (tools == NULL) {
            fprintf(stderr, "tally dev: the workers need a tool registry: pass --tools FILE "
                            "(e.g. examples/tools/demo.json) or set TALLY_TOOLS, or run with "
                            "--no-workers\n");
            return 2;
        }
        if (realpath(tools, s->tools) == NULL) {
            fprintf(stderr, "tally dev: --tools %s: %s\n", tools, strerror(errno));
            return 2;
        }
    }
    return -1;
}

int tally_cmd_dev(int argc, char **argv, tally_config_t *cfg)
{
    dev_stack_t *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        fprintf(stderr, "tally dev: out of memory\n");
        return 1;
    }
    s->cfg = cfg;
    dev_workers_init(s);
    int rc = parse_args(s, argc, argv);
    if (rc >= 0) {
        free(s);
        return rc;
    }

    struct sigaction sa = {.sa_handler = dev_on_signal}; /* no SA_RESTART: cut sleeps short */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    struct sigaction ign = {.sa_handler = SIG_IGN};
    sigaction(SIGPIPE, &ign, NULL);
    curl_global_init(CURL_GLOBAL_DEFAULT);

    char errstr[1024] = "";
    rc = 1;
    bool up = false;
    if (!s->no_workers && !dev_workers_check(s, errstr, sizeof(errstr)))
        goto out;

    if (s->pg_given != NULL) {
        /* one role for everything, the given one: it migrates, so it owns the ledger, and the
         * workers are told TALLY_ALLOW_OWNER_ROLE=1 */
        snprintf(s->conninfo, sizeof(s->conninfo), "%s", s->pg_given);
        snprintf(s->conn_admin, sizeof(s->conn_admin), "%s", s->pg_given);
        snprintf(s->conn_owner, sizeof(s->conn_owner), "%s", s->pg_given);
        for (int r = 0; r < TALLY_ROLE_COUNT; r++)
            snprintf(s->conn_role[r], sizeof(s->conn_role[r]), "%s", s->pg_given);
    } else if (!dev_pg_up(s, errstr, sizeof(errstr))) {
        goto out;
    }
    if (dev_signals > 0)
        goto interrupted;

    if (!dev_kafka_up(s, errstr, sizeof(errstr)))
        goto out;
    int mrc = dev_ledger_migrate(s, errstr, sizeof(errstr));
    if (mrc != 0) {
        rc = mrc;
        goto out;
    }
    if (dev_signals > 0)
        goto interrupted;

    /* the console first: the workers carry its URL, and its port is taken before they pick
     * theirs */
    if (!s->no_workers && !dev_console_up(s, errstr, sizeof(errstr)))
        goto out;
    if (dev_signals > 0)
        goto interrupted;
    if (!s->no_workers && !dev_workers_up(s, errstr, sizeof(errstr)))
        goto out;
    if (dev_signals > 0)
        goto interrupted;

    char exports[8192];
    if (!exports_format(s, exports, sizeof(exports))) {
        dev_err(errstr, sizeof(errstr), "the export lines do not fit in %zu bytes",
                sizeof(exports));
        goto out;
    }
    if (s->env_file != NULL) {
        if (!env_file_write(s->env_file, exports, errstr, sizeof(errstr)))
            goto out;
        s->env_written = true;
    }
    fputs(exports, stdout);
    fflush(stdout);
    banner(s);
    up = true;

    rc = supervise(s);
    dev_say("stopping%s", rc == 0 ? "" : " after a failure");
    goto stop;

interrupted:
    dev_err(errstr, sizeof(errstr), "interrupted while starting; stopping what was started");
    rc = 1;
out:
    if (errstr[0] != '\0')
        dev_say("%s", errstr);
stop:
    dev_stop(s);
    if (up && rc == 0)
        dev_say("stopped");
    curl_global_cleanup();
    free(s);
    return rc;
}
