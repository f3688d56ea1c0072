/* cmd_dev.c — `tally dev`: the embedded stack of DESIGN §10 in one foreground process.
 *
 * A throwaway PostgreSQL cluster (initdb in a temporary directory, the server in its own
 * session so a terminal's Ctrl-C reaches only us), librdkafka's mock cluster served from this
 * process, the ledger migrated, and the three workers as supervised child processes. It
 * prints the environment that points at it, stays up until SIGINT/SIGTERM, then stops
 * everything in reverse order and leaves nothing behind: no process, no directory, no env
 * file — also when start-up fails halfway. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <getopt.h>
#include <glob.h>
#include <grp.h>
#include <libgen.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pwd.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <libpq-fe.h>
#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#include "cli.h"
#include "tally/config.h"
#include "tally/migrate.h"
#include "tally/pg.h"
#include "tally/registry.h"

extern char **environ;

enum {
    DEV_DEFAULT_PARTITIONS = 4,
    DEV_MOCK_BROKERS = 1,
    DEV_PG_START_TIMEOUT_MS = 60000,
    DEV_PG_PORT_ATTEMPTS = 3,
    DEV_WORKER_READY_TIMEOUT_MS = 60000,
    DEV_WORKER_STOP_GRACE_MS = 20000,
    DEV_PG_STOP_TIMEOUT_MS = 30000,
    DEV_MAX_RESTARTS = 3,
    DEV_TICK_MS = 100,
    DEV_MAX_GROUPS = 256,
};

static const char *const dev_topics[] = {"intents", "outcomes", "obligations", "alerts", "dlq"};
#define DEV_N_TOPICS (sizeof(dev_topics) / sizeof(dev_topics[0]))

static const char *const dev_worker_names[] = {"tally-dispatcher", "tally-reconciler",
                                               "tally-compensator"};
#define DEV_N_WORKERS (sizeof(dev_worker_names) / sizeof(dev_worker_names[0]))

typedef struct dev_worker {
    const char *name;
    char path[PATH_MAX];
    int metrics_port;
    char **envp; /* built before any fork: the child only calls async-signal-safe functions */
    pid_t pid;   /* 0 while not running */
    int restarts;
    long long restart_at_ms; /* when pid == 0 and a restart is due; -1 when none */
} dev_worker_t;

typedef struct dev_stack {
    /* options */
    const char *env_file;
    const char *pg_given; /* --pg or TALLY_PG; NULL runs our own cluster */
    const char *data_dir; /* --data-dir; NULL uses a temporary directory */
    bool no_workers;
    bool keep;
    int partitions;
    char tools[PATH_MAX];
    const tally_config_t *cfg;

    /* our PostgreSQL cluster */
    char dir[PATH_MAX]; /* holds pgdata, the socket and the logs; "" when none */
    bool dir_is_temp;   /* created by us with mkdtemp: removed at stop unless --keep */
    char pgdata[PATH_MAX + 16];
    char bindir[PATH_MAX];
    int pg_major; /* from /usr/lib/postgresql/<N>/bin, 0 when found on PATH */
    bool as_postgres;
    uid_t pg_uid;
    gid_t pg_gid;
    gid_t pg_groups[DEV_MAX_GROUPS];
    int pg_ngroups;
    pid_t pg_pid;
    int pg_port;
    char conninfo[PATH_MAX + 128]; /* TALLY_PG as printed */
    int schema_before, schema_after;

    /* the mock Kafka cluster */
    rd_kafka_t *mock_rk;
    rd_kafka_mock_cluster_t *mcluster;
    char brokers[256];

    dev_worker_t workers[DEV_N_WORKERS];
    bool env_written;
} dev_stack_t;

/* Signal handlers only count: the main loop looks at the count. */
static volatile sig_atomic_t dev_signals;

static void dev_on_signal(int sig)
{
    (void)sig;
    if (dev_signals < 100)
        dev_signals = dev_signals + 1;
}

static void dev_say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void dev_say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tally dev: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* Setup paths report through (errstr, errsz); a long path may truncate the sentence, which
 * is fine for a message (and keeps -Wformat-truncation quiet, unlike a direct snprintf). */
static void dev_err(char *errstr, size_t errsz, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void dev_err(char *errstr, size_t errsz, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errstr, errsz, fmt, ap);
    va_end(ap);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL); /* a signal cuts it short, which is what the loops want */
}

static void dev_usage(FILE *out)
{
    fprintf(out,
            "usage: tally dev [--tools FILE] [--env-file PATH] [--no-workers] [--pg CONNINFO]\n"
            "                 [--partitions N] [--data-dir DIR] [--keep]\n\n"
            "Run the embedded stack in the foreground: a throwaway PostgreSQL cluster, the\n"
            "librdkafka mock Kafka cluster with the tally topics, the ledger migrated, and\n"
            "tally-dispatcher, tally-reconciler and tally-compensator as supervised child\n"
            "processes. Prints `export TALLY_...` lines on stdout; Ctrl-C (or SIGTERM) stops\n"
            "everything and removes what was created.\n\n"
            "options:\n"
            "  --tools FILE      the tool registry the workers load (default: $TALLY_TOOLS;\n"
            "                    required unless --no-workers)\n"
            "  --env-file PATH   also write the export lines to PATH (atomically); removed at\n"
            "                    stop\n"
            "  --no-workers      only PostgreSQL and Kafka (what the test suite uses)\n"
            "  --pg CONNINFO     use this PostgreSQL instead of a throwaway cluster\n"
            "                    (default: $TALLY_PG when set)\n"
            "  --partitions N    partitions of each tally topic (default %d)\n"
            "  --data-dir DIR    keep the cluster in DIR (created when missing, reused when it\n"
            "                    holds one, never removed) instead of a temporary directory\n"
            "  --keep            do not remove the temporary directory at stop\n"
            "  -h, --help        this text\n\n"
            "The workers get TALLY_PG, TALLY_KAFKA_BROKERS, TALLY_TOPIC_PREFIX, their own\n"
            "TALLY_METRICS_ADDR, and TALLY_SESSION_TIMEOUT_MS=6000,\n"
            "TALLY_KAFKA_HEARTBEAT_INTERVAL_MS=500 and TALLY_KAFKA_FETCH_WAIT_MAX_MS=10 (the\n"
            "mock broker holds an empty fetch this long) unless those are set. A worker that dies\n"
            "is restarted at most %d times, with backoff. A temporary directory left behind\n"
            "by a tally dev that was killed outright (SIGKILL) is removed by the next one.\n",
            DEV_DEFAULT_PARTITIONS, DEV_MAX_RESTARTS);
}

/* ---- small helpers ---------------------------------------------------------------------- */

static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
        getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
        port = ntohs(sa.sin_port);
    close(fd);
    return port;
}

static bool is_executable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

/* Print the last @p max_lines lines of a log file to stderr, indented. */
static void tail_file(const char *path, int max_lines)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return;
    char *lines[64] = {0};
    if (max_lines > 64)
        max_lines = 64;
    int n = 0;
    char buf[1024];
    while (fgets(buf, sizeof(buf), f) != NULL) {
        free(lines[n % max_lines]);
        lines[n % max_lines] = strdup(buf);
        n++;
    }
    fclose(f);
    int first = n > max_lines ? n - max_lines : 0;
    if (n > 0)
        fprintf(stderr, "---- last lines of %s ----\n", path);
    for (int i = first; i < n; i++) {
        const char *l = lines[i % max_lines];
        if (l != NULL)
            fprintf(stderr, "  %s%s", l, l[0] != '\0' && l[strlen(l) - 1] == '\n' ? "" : "\n");
    }
    for (int i = 0; i < max_lines; i++)
        free(lines[i]);
}

static void describe_status(int status, char *out, size_t outsz)
{
    if (WIFEXITED(status))
        snprintf(out, outsz, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(out, outsz, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(out, outsz, "stopped (status 0x%x)", (unsigned)status);
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

/* Recursive removal without following symlinks (nftw callback). */
static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    if (remove(path) != 0 && errno != ENOENT)
        dev_say("could not remove %s: %s", path, strerror(errno));
    return 0;
}

/* ---- child processes --------------------------------------------------------------------- */

typedef struct dev_spawn {
    const char *path;
    char *const *argv;
    char *const *envp;
    int out_fd;        /* stdout and stderr of the child */
    const char *cwd;   /* may be NULL */
    bool new_session;  /* setsid() instead of a new process group */
    bool as_postgres;  /* drop to the stack's postgres user */
    int pdeath_signal; /* sent to the child when tally dev dies; 0 for none */
} dev_spawn_t;

static void child_fail(int errfd, int err)
{
    ssize_t w = write(errfd, &err, sizeof(err));
    (void)w;
    _exit(127);
}

/*
 * fork + exec. Between the two the child only makes async-signal-safe calls (the mock
 * cluster's threads may hold locks at fork time). An exec failure comes back through a
 * close-on-exec pipe so the caller can name it. @returns the pid, or -1 with errstr.
 */
static pid_t dev_spawn(const dev_stack_t *s, const dev_spawn_t *sp, char *errstr, size_t errsz)
{
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        dev_err(errstr, errsz, "pipe: %s", strerror(errno));
        return -1;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        dev_err(errstr, errsz, "fork: %s", strerror(errno));
        close(pipefd[0]);
        close(pipefd[1]);
        return -1;
    }
    if (pid == 0) {
        close(pipefd[0]);
        if (sp->new_session ? setsid() < 0 : setpgid(0, 0) != 0)
            child_fail(pipefd[1], errno);
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        sigaction(SIGPIPE, &dfl, NULL);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull < 0 || dup2(devnull, STDIN_FILENO) < 0)
            child_fail(pipefd[1], errno);
        if (devnull > STDERR_FILENO)
            close(devnull);
        if (sp->out_fd >= 0 &&
            (dup2(sp->out_fd, STDOUT_FILENO) < 0 || dup2(sp->out_fd, STDERR_FILENO) < 0))
            child_fail(pipefd[1], errno);
        if (sp->out_fd < 0 && dup2(STDERR_FILENO, STDOUT_FILENO) < 0)
            child_fail(pipefd[1], errno);
        if (sp->as_postgres) {
            if (setgroups((size_t)s->pg_ngroups, s->pg_groups) != 0 || setgid(s->pg_gid) != 0 ||
                setuid(s->pg_uid) != 0)
                child_fail(pipefd[1], errno);
        }
        /* after setuid: changing credentials clears the parent-death signal */
        if (sp->pdeath_signal != 0 && prctl(PR_SET_PDEATHSIG, sp->pdeath_signal) != 0)
            child_fail(pipefd[1], errno);
        if (getppid() != parent)
            _exit(1); /* tally dev died before the parent-death signal was armed */
        if (sp->cwd != NULL && chdir(sp->cwd) != 0)
            child_fail(pipefd[1], errno);
        /* nothing of ours (mock broker sockets, libpq, log files) leaks into the program */
        if (close_range(STDERR_FILENO + 1, ~0U, CLOSE_RANGE_CLOEXEC) != 0)
            for (int fd = STDERR_FILENO + 1; fd < 4096; fd++)
                fcntl(fd, F_SETFD, FD_CLOEXEC);
        execve(sp->path, sp->argv, sp->envp);
        child_fail(pipefd[1], errno);
    }
    close(pipefd[1]);
    int child_errno = 0;
    ssize_t n;
    do {
        n = read(pipefd[0], &child_errno, sizeof(child_errno));
    } while (n < 0 && errno == EINTR);
    close(pipefd[0]);
    if (n == (ssize_t)sizeof(child_errno)) {
        int st;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
            ;
        dev_err(errstr, errsz, "cannot run %s%s: %s", sp->path,
                sp->as_postgres ? " as user postgres" : "", strerror(child_errno));
        return -1;
    }
    return pid;
}

/* Wait for @p pid up to @p timeout_ms (-1: forever). true when it ended; *status set. */
static bool wait_child(pid_t pid, int timeout_ms, int *status)
{
    long long deadline = timeout_ms < 0 ? -1 : now_ms() + timeout_ms;
    for (;;) {
        pid_t r = waitpid(pid, status, WNOHANG);
        if (r == pid)
            return true;
        if (r < 0 && errno != EINTR)
            return true; /* not our child any more: nothing to wait for */
        if (deadline >= 0 && now_ms() >= deadline)
            return false;
        sleep_ms(20);
    }
}

/* Run a command to completion with its output in @p log_path. true when it exited 0. */
static bool run_logged(const dev_stack_t *s, char *const *argv, const char *log_path,
                       bool as_postgres, int timeout_ms, char *errstr, size_t errsz)
{
    int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        dev_err(errstr, errsz, "cannot open %s: %s", log_path, strerror(errno));
        return false;
    }
    dev_spawn_t sp = {.path = argv[0],
                      .argv = argv,
                      .envp = environ,
                      .out_fd = fd,
                      .cwd = s->dir[0] != '\0' ? s->dir : NULL,
                      .as_postgres = as_postgres,
                      .pdeath_signal = SIGKILL};
    pid_t pid = dev_spawn(s, &sp, errstr, errsz);
    close(fd);
    if (pid < 0)
        return false;
    int status = 0;
    if (!wait_child(pid, timeout_ms, &status)) {
        kill(-pid, SIGKILL);
        wait_child(pid, -1, &status);
        dev_err(errstr, errsz, "%s did not finish within %d s (its output: %s)", argv[0],
                timeout_ms / 1000, log_path);
        return false;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char how[128];
        describe_status(status, how, sizeof(how));
        dev_err(errstr, errsz, "%s %s (its output: %s)", argv[0], how, log_path);
        return false;
    }
    return true;
}

/* ---- PostgreSQL -------------------------------------------------------------------------- */

/* initdb, pg_ctl and postgres from one directory: the newest /usr/lib/postgresql/N/bin (the
 * server packages; pg_config --bindir names libpq-dev's), else from PATH. */
static bool find_pg_bindir(dev_stack_t *s, char *errstr, size_t errsz)
{
    static const char *const tools[] = {"initdb", "pg_ctl", "postgres"};
    glob_t g;
    int best = -1;
    if (glob("/usr/lib/postgresql/*/bin", GLOB_ONLYDIR, NULL, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc; i++) {
            const char *dir = g.gl_pathv[i];
            int major = atoi(dir + strlen("/usr/lib/postgresql/"));
            bool all = true;
            for (size_t t = 0; t < 3 && all; t++) {
                char p[PATH_MAX];
                snprintf(p, sizeof(p), "%s/%s", dir, tools[t]);
                all = is_executable(p);
            }
            if (all && major > best) {
                best = major;
                snprintf(s->bindir, sizeof(s->bindir), "%s", dir);
            }
        }
        globfree(&g);
    }
    if (best >= 0) {
        s->pg_major = best;
        return true;
    }
    const char *path = getenv("PATH");
    char *copy = strdup(path != NULL ? path : "/usr/local/bin:/usr/bin:/bin");
    if (copy == NULL) {
        dev_err(errstr, errsz, "out of memory");
        return false;
    }
    bool found = false;
    for (char *save = NULL, *dir = strtok_r(copy, ":", &save); dir != NULL && !found;
         dir = strtok_r(NULL, ":", &save)) {
        bool all = true;
        for (size_t t = 0; t < 3 && all; t++) {
            char p[PATH_MAX];
            snprintf(p, sizeof(p), "%s/%s", dir, tools[t]);
            all = is_executable(p);
        }
        if (all) {
            snprintf(s->bindir, sizeof(s->bindir), "%s", dir);
            found = true;
        }
    }
    free(copy);
    if (!found)
        dev_err(errstr, errsz,
                "no PostgreSQL server found: initdb, pg_ctl and postgres are neither in "
                "/usr/lib/postgresql/*/bin nor on PATH (install the postgresql package, "
                "scripts/deps.sh does, or pass --pg CONNINFO)");
    return found;
}

/* PostgreSQL refuses to run as root: as root, its programs run as the postgres user. */
static bool resolve_pg_user(dev_stack_t *s, char *errstr, size_t errsz)
{
    if (geteuid() != 0)
        return true;
    struct passwd *pw = getpwnam("postgres");
    if (pw == NULL) {
        dev_err(errstr, errsz,
                "running as root, and PostgreSQL refuses to run as root, but there is no "
                "'postgres' user to run it as (install the postgresql package, or run tally "
                "dev as an ordinary user)");
        return false;
    }
    s->as_postgres = true;
    s->pg_uid = pw->pw_uid;
    s->pg_gid = pw->pw_gid;
    int n = DEV_MAX_GROUPS;
    if (getgrouplist("postgres", pw->pw_gid, s->pg_groups, &n) < 0) {
        s->pg_groups[0] = pw->pw_gid;
        n = 1;
    }
    s->pg_ngroups = n;
    return true;
}

/* The start time of a process (clock ticks since boot), or 0 when it is gone: with the pid it
 * names one process even after the pid is reused. */
static unsigned long long process_start(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long long start = 0;
    /* after ")": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
     * stime cutime cstime priority nice threads itrealvalue starttime */
    if (p == NULL || sscanf(p + 2,
                            "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d "
                            "%*d %*d %*d %*d %llu",
                            &start) != 1)
        return 0;
    return start;
}

#define DEV_OWNER_FILE "tally-dev.owner"

/*
 * A tally dev killed with SIGKILL cannot clean up: its server stops (parent-death signal) but
 * its directory stays. Each temporary directory names its owner; remove those whose owner and
 * server are both gone. Kept directories (--keep) have no owner file and are left alone.
 */
static void sweep_stale_dirs(const char *tmp)
{
    char pattern[PATH_MAX];
    snprintf(pattern, sizeof(pattern), "%s/tally-dev-*/" DEV_OWNER_FILE, tmp);
    glob_t g;
    if (glob(pattern, 0, NULL, &g) != 0)
        return;
    for (size_t i = 0; i < g.gl_pathc; i++) {
        FILE *f = fopen(g.gl_pathv[i], "r");
        int pid = 0;
        unsigned long long start = 0;
        bool parsed = f != NULL && fscanf(f, "%d %llu", &pid, &start) == 2;
        if (f != NULL)
            fclose(f);
        if (!parsed || pid <= 0 || process_start(pid) == start)
            continue;
        char dir[PATH_MAX], postmaster[PATH_MAX + 32];
        snprintf(dir, sizeof(dir), "%s", g.gl_pathv[i]);
        *strrchr(dir, '/') = '\0';
        snprintf(postmaster, sizeof(postmaster), "%s/pgdata/postmaster.pid", dir);
        int pg_pid = 0;
        if ((f = fopen(postmaster, "r")) != NULL) {
            if (fscanf(f, "%d", &pg_pid) != 1)
                pg_pid = 0;
            fclose(f);
        }
        if (pg_pid > 0 && (kill(pg_pid, 0) == 0 || errno == EPERM))
            continue; /* its server still runs: not ours to judge */
        dev_say("removing %s, left behind by tally dev (pid %d) which is gone", dir, pid);
        nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
    globfree(&g);
}

static bool write_owner_file(const dev_stack_t *s, char *errstr, size_t errsz)
{
    char path[PATH_MAX + 32];
    snprintf(path, sizeof(path), "%s/" DEV_OWNER_FILE, s->dir);
    FILE *f = fopen(path, "w");
    bool ok = f != NULL && fprintf(f, "%d %llu\n", (int)getpid(), process_start(getpid())) > 0;
    if (f != NULL && fclose(f) != 0)
        ok = false;
    if (!ok)
        dev_err(errstr, errsz, "cannot write %s: %s", path, strerror(errno));
    return ok;
}

static bool make_dir(dev_stack_t *s, char *errstr, size_t errsz)
{
    bool created = false;
    if (s->data_dir != NULL) {
        if (mkdir(s->data_dir, 0700) == 0)
            created = true;
        else if (errno != EEXIST) {
            dev_err(errstr, errsz, "--data-dir %s: %s", s->data_dir, strerror(errno));
            return false;
        }
        if (realpath(s->data_dir, s->dir) == NULL) {
            dev_err(errstr, errsz, "--data-dir %s: %s", s->data_dir, strerror(errno));
            return false;
        }
    } else {
        const char *tmp = getenv("TMPDIR");
        if (tmp == NULL || tmp[0] == '\0')
            tmp = "/tmp";
        sweep_stale_dirs(tmp);
        char tmpl[PATH_MAX];
        snprintf(tmpl, sizeof(tmpl), "%s/tally-dev-XXXXXX", tmp);
        if (mkdtemp(tmpl) == NULL) {
            dev_err(errstr, errsz, "cannot create a temporary directory in %s: %s", tmp,
                    strerror(errno));
            return false;
        }
        snprintf(s->dir, sizeof(s->dir), "%s", tmpl);
        s->dir_is_temp = true;
        created = true;
        if (!write_owner_file(s, errstr, errsz))
            return false;
    }
    if (created && s->as_postgres && chown(s->dir, s->pg_uid, s->pg_gid) != 0) {
        dev_err(errstr, errsz, "cannot hand %s to the postgres user: %s", s->dir, strerror(errno));
        return false;
    }
    snprintf(s->pgdata, sizeof(s->pgdata), "%s/pgdata", s->dir);
    return true;
}

static bool pg_initdb(dev_stack_t *s, char *errstr, size_t errsz)
{
    char version_file[PATH_MAX + 32];
    snprintf(version_file, sizeof(version_file), "%s/PG_VERSION", s->pgdata);
    if (access(version_file, F_OK) == 0) {
        dev_say("reusing the PostgreSQL cluster in %s", s->pgdata);
        return true;
    }
    char initdb[PATH_MAX + 16], log[PATH_MAX + 16];
    snprintf(initdb, sizeof(initdb), "%s/initdb", s->bindir);
    snprintf(log, sizeof(log), "%s/initdb.log", s->dir);
    /* --no-sync only for initdb (a throwaway cluster); the server keeps fsync on */
    char *argv[] = {initdb,  "-D", s->pgdata, "-U",         "tally",     "-A",
                    "trust", "-E", "UTF8",    "--locale=C", "--no-sync", NULL};
    if (!run_logged(s, argv, log, s->as_postgres, 120000, errstr, errsz)) {
        tail_file(log, 20);
        if (s->as_postgres) {
            size_t l = strlen(errstr);
            dev_err(errstr + l, errsz - l,
                    "; as root, PostgreSQL runs as user 'postgres', which must be able to "
                    "reach and write %s",
                    s->dir);
        }
        return false;
    }
    return true;
}

static void pg_conninfo(const dev_stack_t *s, const char *dbname, char *out, size_t outsz)
{
    snprintf(out, outsz, "host=127.0.0.1 port=%d user=tally dbname=%s", s->pg_port, dbname);
}

/* Start the server in its own session and wait until it accepts connections. */
static bool pg_start(dev_stack_t *s, char *errstr, size_t errsz)
{
    char postgres[PATH_MAX + 16], log[PATH_MAX + 16];
    snprintf(postgres, sizeof(postgres), "%s/postgres", s->bindir);
    snprintf(log, sizeof(log), "%s/postgres.log", s->dir);
    for (int attempt = 1; attempt <= DEV_PG_PORT_ATTEMPTS; attempt++) {
        s->pg_port = free_port();
        if (s->pg_port <= 0) {
            dev_err(errstr, errsz, "no free TCP port on 127.0.0.1: %s", strerror(errno));
            return false;
        }
        char port[16];
        snprintf(port, sizeof(port), "%d", s->pg_port);
        /* wal_init_zero=off: a new cluster has no WAL segment to recycle until its first
         * checkpoint, so every 16 MB of WAL creates a segment, and zero-filling it (16 MB
         * written and fsynced) stalls every COMMIT for tens of milliseconds — at 1,000
         * effects/s, every 2.5 s. A long-running server recycles segments instead and never
         * pays it. Commits are still fsynced: only the zero-fill is skipped. */
        // clang-format off
        char *argv[] = {postgres, "-D", s->pgdata, "-h", "127.0.0.1", "-p", port, "-k", s->dir,
                        "-c", "max_connections=200", "-c", "wal_init_zero=off", NULL};
        // clang-format on
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (fd < 0) {
            dev_err(errstr, errsz, "cannot open %s: %s", log, strerror(errno));
            return false;
        }
        off_t log_start = lseek(fd, 0, SEEK_END);
        dev_spawn_t sp = {.path = postgres,
                          .argv = argv,
                          .envp = environ,
                          .out_fd = fd,
                          .cwd = s->dir,
                          .new_session = true,
                          .as_postgres = s->as_postgres,
                          .pdeath_signal = SIGINT /* fast shutdown */};
        s->pg_pid = dev_spawn(s, &sp, errstr, errsz);
        close(fd);
        if (s->pg_pid < 0) {
            s->pg_pid = 0;
            return false;
        }
        char ping[PATH_MAX + 128];
        snprintf(ping, sizeof(ping),
                 "host=127.0.0.1 port=%d user=tally dbname=postgres connect_timeout=2", s->pg_port);
        long long deadline = now_ms() + DEV_PG_START_TIMEOUT_MS;
        int status = 0;
        for (;;) {
            if (PQping(ping) == PQPING_OK)
                return true;
            if (waitpid(s->pg_pid, &status, WNOHANG) == s->pg_pid)
                break;
            if (dev_signals > 0) {
                dev_err(errstr, errsz, "interrupted while PostgreSQL was starting");
                return false;
            }
            if (now_ms() > deadline) {
                dev_err(errstr, errsz,
                        "PostgreSQL did not accept connections on 127.0.0.1:%d within %d s "
                        "(server log: %s)",
                        s->pg_port, DEV_PG_START_TIMEOUT_MS / 1000, log);
                tail_file(log, 20);
                return false;
            }
            sleep_ms(100);
        }
        s->pg_pid = 0;
        /* lost the race for the port to another process: try another one */
        bool port_taken = false;
        FILE *f = fopen(log, "r");
        if (f != NULL) {
            char line[1024];
            if (fseeko(f, log_start, SEEK_SET) == 0)
                while (fgets(line, sizeof(line), f) != NULL)
                    if (strstr(line, "Address already in use") != NULL)
                        port_taken = true;
            fclose(f);
        }
        if (port_taken && attempt < DEV_PG_PORT_ATTEMPTS) {
            dev_say("port %d was taken before PostgreSQL could bind it; trying another",
                    s->pg_port);
            continue;
        }
        char how[128];
        describe_status(status, how, sizeof(how));
        dev_err(errstr, errsz, "PostgreSQL %s during start-up (server log: %s)", how, log);
        tail_file(log, 20);
        return false;
    }
    dev_err(errstr, errsz, "could not start PostgreSQL");
    return false;
}

static bool pg_create_database(dev_stack_t *s, char *errstr, size_t errsz)
{
    char admin[256];
    pg_conninfo(s, "postgres", admin, sizeof(admin));
    tally_pg_t *pg = tally_pg_new(admin, "tally-dev");
    if (pg == NULL) {
        dev_err(errstr, errsz, "out of memory");
        return false;
    }
    tally_error_t err;
    tally_error_clear(&err);
    bool ok = tally_pg_connect(pg, 10000, &dev_signals, &err);
    PGresult *res = NULL;
    if (ok) {
        const char *params[] = {"tally"};
        res = tally_pg_exec(pg, "SELECT 1 FROM pg_database WHERE datname = $1", 1, params, &err);
        ok = res != NULL;
    }
    /* CREATE DATABASE takes no parameters; the name is a constant */
    if (ok && PQntuples(res) == 0)
        ok = tally_pg_run(pg, "CREATE DATABASE tally", 0, NULL, &err);
    PQclear(res);
    tally_pg_free(pg);
    if (!ok)
        dev_err(errstr, errsz, "cannot create database tally: %s", err.message);
    return ok;
}

/* Stop the server: pg_ctl stop -m fast (as postgres when root), then escalate if needed. */
static void pg_stop(dev_stack_t *s)
{
    if (s->pg_pid <= 0)
        return;
    char pg_ctl[PATH_MAX + 16], log[PATH_MAX + 16], errstr[512];
    snprintf(pg_ctl, sizeof(pg_ctl), "%s/pg_ctl", s->bindir);
    snprintf(log, sizeof(log), "%s/pg_ctl.log", s->dir);
    char *argv[] = {pg_ctl, "stop", "-D", s->pgdata, "-m", "fast", "-w", "-t", "30", NULL};
    char pidfile[PATH_MAX + 32];
    snprintf(pidfile, sizeof(pidfile), "%s/postmaster.pid", s->pgdata);
    if (access(pidfile, F_OK) != 0) {
        /* stopped while still starting: pg_ctl has no pid file to go by */
        kill(s->pg_pid, SIGINT);
    } else if (!run_logged(s, argv, log, s->as_postgres, DEV_PG_STOP_TIMEOUT_MS + 5000, errstr,
                           sizeof(errstr))) {
        dev_say("pg_ctl stop failed: %s; sending the server SIGINT (fast shutdown)", errstr);
        tail_file(log, 10);
        kill(s->pg_pid, SIGINT);
    }
    int status;
    if (!wait_child(s->pg_pid, DEV_PG_STOP_TIMEOUT_MS, &status)) {
        dev_say("PostgreSQL (pid %d) is still running; sending SIGQUIT (immediate shutdown)",
                (int)s->pg_pid);
        kill(s->pg_pid, SIGQUIT);
        if (!wait_child(s->pg_pid, 5000, &status)) {
            dev_say("PostgreSQL (pid %d) ignored SIGQUIT; killing its process group",
                    (int)s->pg_pid);
            kill(-s->pg_pid, SIGKILL);
            wait_child(s->pg_pid, -1, &status);
        }
    }
    s->pg_pid = 0;
}

/* ---- Kafka: the mock cluster ------------------------------------------------------------- */

/* A real Kafka broker disables Nagle's algorithm on its connections (socket.server's
 * tcpNoDelay); librdkafka's mock broker does not. Without it, when several requests are in
 * flight on one connection (a relay producing to four partitions), each response after the
 * first waits for the client's delayed ACK — about 40 ms a round trip on Linux — which no
 * real cluster would add. Linux hands TCP_NODELAY from a listening socket to the sockets it
 * accepts, so setting it on the mock's listeners (found by their port) fixes every
 * connection to come. Best effort: without it the stack still works, only slower. */
static void mock_nodelay(const char *bootstraps)
{
    const char *colon = strrchr(bootstraps, ':');
    int port = colon ? atoi(colon + 1) : 0;
    DIR *dir = port > 0 ? opendir("/proc/self/fd") : NULL;
    if (!dir)
        return;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        int fd = atoi(de->d_name);
        if (de->d_name[0] == '.' || fd == dirfd(dir))
            continue;
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int listening = 0;
        socklen_t olen = sizeof listening;
        if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 ||
            getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &olen) != 0 || !listening)
            continue;
        int bound = ss.ss_family == AF_INET    ? ntohs(((struct sockaddr_in *)&ss)->sin_port)
                    : ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                               : -1;
        int one = 1;
        if (bound == port)
            (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    closedir(dir);
}

static bool kafka_start(dev_stack_t *s, char *errstr, size_t errsz)
{
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    char rderr[512];
    /* this handle only hosts the cluster: it has no bootstrap.servers to complain about */
    if (rd_kafka_conf_set(conf, "client.id", "tally-dev-mock", rderr, sizeof(rderr)) !=
            RD_KAFKA_CONF_OK ||
        rd_kafka_conf_set(conf, "log_level", "4", rderr, sizeof(rderr)) != RD_KAFKA_CONF_OK) {
        rd_kafka_conf_destroy(conf);
        dev_err(errstr, errsz, "librdkafka configuration: %s", rderr);
        return false;
    }
    s->mock_rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, rderr, sizeof(rderr));
    if (s->mock_rk == NULL) {
        rd_kafka_conf_destroy(conf);
        dev_err(errstr, errsz, "cannot create the librdkafka handle for the mock cluster: %s",
                rderr);
        return false;
    }
    s->mcluster = rd_kafka_mock_cluster_new(s->mock_rk, DEV_MOCK_BROKERS);
    if (s->mcluster == NULL) {
        dev_err(errstr, errsz, "librdkafka could not create its mock cluster");
        return false;
    }
    snprintf(s->brokers, sizeof(s->brokers), "%s", rd_kafka_mock_cluster_bootstraps(s->mcluster));
    mock_nodelay(s->brokers);
    for (size_t i = 0; i < DEV_N_TOPICS; i++) {
        char topic[256];
        if (!tally_config_topic(s->cfg, dev_topics[i], topic, sizeof(topic))) {
            dev_err(errstr, errsz, "topic name '%s%s' is too long", s->cfg->topic_prefix,
                    dev_topics[i]);
            return false;
        }
        rd_kafka_resp_err_t e =
            rd_kafka_mock_topic_create(s->mcluster, topic, s->partitions, DEV_MOCK_BROKERS);
        if (e != RD_KAFKA_RESP_ERR_NO_ERROR) {
            dev_err(errstr, errsz, "cannot create topic %s: %s", topic, rd_kafka_err2str(e));
            return false;
        }
    }
    return true;
}

static void kafka_stop(dev_stack_t *s)
{
    if (s->mcluster != NULL)
        rd_kafka_mock_cluster_destroy(s->mcluster);
    s->mcluster = NULL;
    if (s->mock_rk != NULL)
        rd_kafka_destroy(s->mock_rk);
    s->mock_rk = NULL;
}

/* ---- the ledger ------------------------------------------------------------------------- */

static int migrate_ledger(dev_stack_t *s, char *errstr, size_t errsz)
{
    tally_pg_t *pg = tally_pg_new(s->conninfo, "tally-dev");
    if (pg == NULL) {
        dev_err(errstr, errsz, "out of memory");
        return 1;
    }
    tally_error_t err;
    tally_error_clear(&err);
    int rc = 0;
    if (!tally_pg_connect(pg, 10000, &dev_signals, &err)) {
        dev_err(errstr, errsz, "%s (conninfo: %s)", err.message, s->conninfo);
        rc = 3;
    } else if (!tally_migrate_apply(pg, &s->schema_before, &s->schema_after, &err)) {
        dev_err(errstr, errsz, "migrating the ledger failed: %s%s%s", err.message,
                err.code[0] != '\0' ? " — " : "", err.code);
        rc = 1;
    }
    tally_pg_free(pg);
    return rc;
}

/* ---- workers ---------------------------------------------------------------------------- */

static char **env_build(char *const *base, const char *const (*set)[2], size_t n_set,
                        const char *const (*dflt)[2], size_t n_dflt)
{
    size_t n_base = 0;
    while (base[n_base] != NULL)
        n_base++;
    char **envp = calloc(n_base + n_set + n_dflt + 1, sizeof(char *));
    if (envp == NULL)
        return NULL;
    size_t n = 0;
    for (size_t i = 0; i < n_base; i++) {
        bool overridden = false;
        for (size_t k = 0; k < n_set && !overridden; k++) {
            size_t l = strlen(set[k][0]);
            overridden = strncmp(base[i], set[k][0], l) == 0 && base[i][l] == '=';
        }
        if (!overridden && (envp[n++] = strdup(base[i])) == NULL)
            goto oom;
    }
    for (size_t k = 0; k < n_set + n_dflt; k++) {
        const char *name = k < n_set ? set[k][0] : dflt[k - n_set][0];
        const char *value = k < n_set ? set[k][1] : dflt[k - n_set][1];
        if (k >= n_set && getenv(name) != NULL)
            continue;
        size_t len = strlen(name) + strlen(value) + 2;
        if ((envp[n] = malloc(len)) == NULL)
            goto oom;
        snprintf(envp[n++], len, "%s=%s", name, value);
    }
    envp[n] = NULL;
    return envp;
oom:
    for (size_t i = 0; i < n; i++)
        free(envp[i]);
    free(envp);
    return NULL;
}

static void env_free(char **envp)
{
    if (envp == NULL)
        return;
    for (size_t i = 0; envp[i] != NULL; i++)
        free(envp[i]);
    free(envp);
}

/* The workers refuse an unsafe registry; say so now rather than after starting a cluster. */
static bool tools_check(const dev_stack_t *s, char *errstr, size_t errsz)
{
    tally_problems_t problems = {0};
    tally_registry_t *reg = tally_registry_load_file(s->tools, &problems);
    bool ok = reg != NULL;
    if (!ok) {
        for (size_t i = 0; i < problems.n; i++)
            fprintf(stderr, "  %s\n", problems.lines[i]);
        dev_err(errstr, errsz,
                "the tool registry %s has %zu problem%s (above); the workers would refuse it "
                "(see tally tools check)",
                s->tools, problems.n, problems.n == 1 ? "" : "s");
    }
    tally_problems_clear(&problems);
    tally_registry_free(reg);
    return ok;
}

/* The worker binaries live next to this one (the build directory, or the install prefix). */
static bool workers_locate(dev_stack_t *s, char *errstr, size_t errsz)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n < 0) {
        dev_err(errstr, errsz, "cannot find this program's directory (/proc/self/exe): %s",
                strerror(errno));
        return false;
    }
    self[n] = '\0';
    const char *dir = dirname(self);
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        dev_worker_t *w = &s->workers[i];
        snprintf(w->path, sizeof(w->path), "%s/%s", dir, w->name);
        if (!is_executable(w->path)) {
            dev_err(errstr, errsz,
                    "%s not found next to tally (looked for %s); build it, or run "
                    "tally dev --no-workers",
                    w->name, w->path);
            return false;
        }
    }
    return true;
}

static bool worker_spawn(dev_stack_t *s, dev_worker_t *w, char *errstr, size_t errsz)
{
    char *argv[] = {w->path, "--tools", s->tools, NULL};
    dev_spawn_t sp = {.path = w->path,
                      .argv = argv,
                      .envp = w->envp,
                      .out_fd = -1, /* stderr shared with us; stdout kept for the exports */
                      /* its own group: a terminal's Ctrl-C reaches only us, and we send the
                       * worker exactly one SIGTERM (a second one would skip its drain) */
                      .pdeath_signal = SIGTERM};
    pid_t pid = dev_spawn(s, &sp, errstr, errsz);
    if (pid < 0)
        return false;
    w->pid = pid;
    w->restart_at_ms = -1;
    return true;
}

static size_t discard_body(char *ptr, size_t size, size_t nmemb, void *userdata)
{
    (void)ptr;
    (void)userdata;
    return size * nmemb;
}

static long http_status(const char *url)
{
    CURL *c = curl_easy_init();
    if (c == NULL)
        return 0;
    long code = 0;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 1000L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, discard_body);
    if (curl_easy_perform(c) == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    return code;
}

static bool workers_start(dev_stack_t *s, char *errstr, size_t errsz)
{
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        dev_worker_t *w = &s->workers[i];
        w->metrics_port = free_port();
        if (w->metrics_port <= 0) {
            dev_err(errstr, errsz, "no free TCP port on 127.0.0.1 for %s", w->name);
            return false;
        }
        char addr[64];
        snprintf(addr, sizeof(addr), "127.0.0.1:%d", w->metrics_port);
        const char *const set[][2] = {
            {"TALLY_PG", s->conninfo},
            {"TALLY_KAFKA_BROKERS", s->brokers},
            {"TALLY_TOPIC_PREFIX", s->cfg->topic_prefix},
            {"TALLY_TOOLS", s->tools},
            {"TALLY_METRICS_ADDR", addr},
        };
        const char *const dflt[][2] = {
            {"TALLY_SESSION_TIMEOUT_MS", "6000"},
            {"TALLY_KAFKA_HEARTBEAT_INTERVAL_MS", "500"},
            /* the mock broker holds an empty fetch for the whole wait (500 ms by default)
             * even when data arrives meanwhile: that would be every outcome's latency */
            {"TALLY_KAFKA_FETCH_WAIT_MAX_MS", "10"},
        };
        w->envp = env_build(environ, set, sizeof(set) / sizeof(set[0]), dflt,
                            sizeof(dflt) / sizeof(dflt[0]));
        if (w->envp == NULL) {
            dev_err(errstr, errsz, "out of memory");
            return false;
        }
        if (!worker_spawn(s, w, errstr, errsz))
            return false;
    }
    /* ready = /healthz answers 200; a worker that exits now has a problem a restart won't fix */
    bool ready[DEV_N_WORKERS] = {false};
    long long deadline = now_ms() + DEV_WORKER_READY_TIMEOUT_MS;
    for (;;) {
        size_t n_ready = 0;
        for (size_t i = 0; i < DEV_N_WORKERS; i++) {
            dev_worker_t *w = &s->workers[i];
            int status;
            if (waitpid(w->pid, &status, WNOHANG) == w->pid) {
                w->pid = 0;
                char how[128];
                describe_status(status, how, sizeof(how));
                dev_err(errstr, errsz, "%s %s while starting (its log is above)", w->name, how);
                return false;
            }
            if (!ready[i]) {
                char url[96];
                snprintf(url, sizeof(url), "http://127.0.0.1:%d/healthz", w->metrics_port);
                ready[i] = http_status(url) == 200;
            }
            n_ready += ready[i];
        }
        if (n_ready == DEV_N_WORKERS)
            return true;
        if (dev_signals > 0) {
            dev_err(errstr, errsz, "interrupted while the workers were starting");
            return false;
        }
        if (now_ms() > deadline) {
            size_t i = 0;
            while (i < DEV_N_WORKERS - 1 && ready[i])
                i++;
            dev_err(errstr, errsz, "%s (pid %d) did not answer /healthz on port %d within %d s",
                    s->workers[i].name, (int)s->workers[i].pid, s->workers[i].metrics_port,
                    DEV_WORKER_READY_TIMEOUT_MS / 1000);
            return false;
        }
        sleep_ms(200);
    }
}

/* SIGTERM each worker once, wait for the drain; a second signal to us or the grace running
 * out sends SIGKILL. */
static void workers_stop(dev_stack_t *s)
{
    int signals_at_start = dev_signals;
    size_t running = 0;
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        if (s->workers[i].pid > 0) {
            kill(s->workers[i].pid, SIGTERM);
            running++;
        }
    }
    long long deadline = now_ms() + DEV_WORKER_STOP_GRACE_MS;
    bool killed = false;
    while (running > 0) {
        for (size_t i = 0; i < DEV_N_WORKERS; i++) {
            dev_worker_t *w = &s->workers[i];
            int status;
            if (w->pid > 0 && waitpid(w->pid, &status, WNOHANG) == w->pid) {
                /* killed by our own SIGTERM: it had not installed its handler yet */
                bool expected = (WIFEXITED(status) && WEXITSTATUS(status) == 0) ||
                                (WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
                if (!expected) {
                    char how[128];
                    describe_status(status, how, sizeof(how));
                    dev_say("%s (pid %d) %s", w->name, (int)w->pid, how);
                }
                w->pid = 0;
                running--;
            }
        }
        if (running == 0)
            break;
        if (!killed && (now_ms() > deadline || dev_signals > signals_at_start)) {
            dev_say("%s: sending SIGKILL to the workers still running",
                    now_ms() > deadline ? "the workers did not stop in time" : "second signal");
            for (size_t i = 0; i < DEV_N_WORKERS; i++)
                if (s->workers[i].pid > 0)
                    kill(s->workers[i].pid, SIGKILL);
            killed = true;
        }
        sleep_ms(50);
    }
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        env_free(s->workers[i].envp);
        s->workers[i].envp = NULL;
    }
}

/* ---- the environment it prints ---------------------------------------------------------- */

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
    return n > 0 && (size_t)n < outsz;
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
            char how[128];
            describe_status(status, how, sizeof(how));
            if (pid == s->pg_pid) {
                s->pg_pid = 0;
                kill(-pid, SIGKILL); /* whatever is left of its process group */
                dev_say("PostgreSQL (pid %d) %s unexpectedly; stopping the stack", (int)pid, how);
                char log[PATH_MAX + 16];
                snprintf(log, sizeof(log), "%s/postgres.log", s->dir);
                tail_file(log, 20);
                return 1;
            }
            for (size_t i = 0; i < DEV_N_WORKERS; i++) {
                dev_worker_t *w = &s->workers[i];
                if (w->pid != pid)
                    continue;
                w->pid = 0;
                if (w->restarts < DEV_MAX_RESTARTS) {
                    int delay_s = 1 << w->restarts;
                    w->restart_at_ms = now_ms() + delay_s * 1000LL;
                    dev_say("%s (pid %d) %s; restarting it in %d s (restart %d of %d)", w->name,
                            (int)pid, how, delay_s, w->restarts + 1, DEV_MAX_RESTARTS);
                } else {
                    w->restart_at_ms = -1;
                    dev_say("%s (pid %d) %s; it was restarted %d times already, so it stays "
                            "down: the stack runs without it until you stop it",
                            w->name, (int)pid, how, DEV_MAX_RESTARTS);
                }
            }
        }
        for (size_t i = 0; i < DEV_N_WORKERS && !s->no_workers; i++) {
            dev_worker_t *w = &s->workers[i];
            if (w->pid != 0 || w->restart_at_ms < 0 || now_ms() < w->restart_at_ms)
                continue;
            char errstr[512];
            w->restarts++;
            if (worker_spawn(s, w, errstr, sizeof(errstr))) {
                dev_say("%s restarted as pid %d (metrics http://127.0.0.1:%d/metrics)", w->name,
                        (int)w->pid, w->metrics_port);
            } else {
                dev_say("could not restart %s: %s", w->name, errstr);
                w->restart_at_ms =
                    w->restarts < DEV_MAX_RESTARTS ? now_ms() + (1000LL << w->restarts) : -1;
            }
        }
        sleep_ms(DEV_TICK_MS);
    }
    return 0;
}

/* Everything that was started, stopped in reverse order; safe after any partial start. */
static void dev_stop(dev_stack_t *s)
{
    workers_stop(s);
    kafka_stop(s);
    pg_stop(s);
    if (s->env_written && unlink(s->env_file) != 0 && errno != ENOENT)
        dev_say("could not remove %s: %s", s->env_file, strerror(errno));
    s->env_written = false;
    if (s->dir[0] != '\0' && s->dir_is_temp) {
        if (s->keep) {
            char owner[PATH_MAX + 32];
            snprintf(owner, sizeof(owner), "%s/" DEV_OWNER_FILE, s->dir);
            unlink(owner); /* kept on purpose: no later tally dev may sweep it */
            dev_say("kept %s (--keep)", s->dir);
        } else
            nftw(s->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    }
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
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        s->workers[i].name = dev_worker_names[i];
        s->workers[i].restart_at_ms = -1;
    }
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
    if (!s->no_workers &&
        (!workers_locate(s, errstr, sizeof(errstr)) || !tools_check(s, errstr, sizeof(errstr))))
        goto out;

    if (s->pg_given != NULL) {
        snprintf(s->conninfo, sizeof(s->conninfo), "%s", s->pg_given);
    } else {
        if (!find_pg_bindir(s, errstr, sizeof(errstr)) ||
            !resolve_pg_user(s, errstr, sizeof(errstr)) || !make_dir(s, errstr, sizeof(errstr)))
            goto out;
        dev_say("starting PostgreSQL from %s in %s", s->bindir, s->dir);
        if (!pg_initdb(s, errstr, sizeof(errstr)) || !pg_start(s, errstr, sizeof(errstr)) ||
            !pg_create_database(s, errstr, sizeof(errstr)))
            goto out;
        pg_conninfo(s, "tally", s->conninfo, sizeof(s->conninfo));
    }
    if (dev_signals > 0)
        goto interrupted;

    if (!kafka_start(s, errstr, sizeof(errstr)))
        goto out;
    int mrc = migrate_ledger(s, errstr, sizeof(errstr));
    if (mrc != 0) {
        rc = mrc;
        goto out;
    }
    if (dev_signals > 0)
        goto interrupted;

    if (!s->no_workers && !workers_start(s, errstr, sizeof(errstr)))
        goto out;
    if (dev_signals > 0)
        goto interrupted;

    char exports[4096];
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
