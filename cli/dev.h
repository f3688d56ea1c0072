/* dev.h — what the files of `tally dev` share. cmd_dev.c is the command (options, the order
 * things start and stop in, what it prints, supervision); dev_pg.c the throwaway PostgreSQL
 * cluster and the ledger on it; dev_kafka.c librdkafka's mock cluster; dev_workers.c the three
 * workers and `tally console`, spawned, awaited and restarted; dev_proc.c the child processes
 * underneath. */
#ifndef TALLY_CLI_DEV_H
#define TALLY_CLI_DEV_H

#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>

#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#include "tally/config.h"
#include "tally/roles.h"

enum {
    DEV_MOCK_BROKERS = 1, /**< brokers of the mock cluster */
    DEV_MAX_RESTARTS = 3, /**< restarts of a worker that dies, with backoff, before it stays down */
    DEV_MAX_GROUPS = 256, /**< supplementary groups of the postgres user */
    DEV_N_TOPICS = 5,     /**< dev_topics */
    DEV_N_WORKERS = 3,    /**< dispatcher, reconciler, compensator */
};

/** The tally topics the mock cluster hosts, without the prefix (dev_kafka.c). */
extern const char *const dev_topics[DEV_N_TOPICS];

/* A supervised child: one of the workers, or `tally console`. */
typedef struct dev_worker {
    const char *name;
    char path[PATH_MAX];
    char *argv[5];        /* path and its arguments, NULL-terminated; set before the first spawn */
    int metrics_port;     /* where it answers /healthz: a worker's metrics, the console's pages */
    const char *base_url; /* the console's URL, its /healthz beneath; NULL: 127.0.0.1 */
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
    bool no_console;
    const char *console_addr; /* --console-addr; NULL: a free port on 127.0.0.1 */
    bool keep;
    int partitions;
    char tools[PATH_MAX];
    const tally_config_t *cfg;

    /* our PostgreSQL cluster (dev_pg.c) */
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
    char conninfo[PATH_MAX + 128]; /* TALLY_PG as printed: the operator's role */
    /* our own cluster's other connections (with --pg, each is the given conninfo): the
     * superuser on the maintenance database, the owner that migrates, and each runtime role
     * (roles.h order) */
    char conn_admin[PATH_MAX + 128];
    char conn_owner[PATH_MAX + 128];
    char conn_role[TALLY_ROLE_COUNT][PATH_MAX + 128];
    int schema_before, schema_after;

    /* the mock Kafka cluster (dev_kafka.c) */
    rd_kafka_t *mock_rk;
    rd_kafka_mock_cluster_t *mcluster;
    char brokers[256];

    dev_worker_t workers[DEV_N_WORKERS]; /* dev_workers.c */
    /* `tally console` reading as the reader role, its path "" when it does not run; its URL
     * is every worker's TALLY_CONSOLE_URL, so that each alert and page links to it */
    dev_worker_t console;
    char console_listen[300]; /* HOST:PORT, its --listen */
    char console_url[320];    /* http://HOST:PORT */
    bool env_written;
} dev_stack_t;

/** Signals received so far (cmd_dev.c's handler only counts; the loops look). */
extern volatile sig_atomic_t dev_signals;

/* ---- dev_proc.c: messages, time, child processes ------------------------------------------ */

/** "tally dev: <sentence>" on stderr. */
void dev_say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/** Setup paths report through (errstr, errsz); a long path may truncate the sentence, which is
 * fine for a message (and keeps -Wformat-truncation quiet, unlike a direct snprintf). */
void dev_err(char *errstr, size_t errsz, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

long long dev_now_ms(void);
/** Sleep; a signal cuts it short, which is what the loops want. */
void dev_sleep_ms(int ms);

/** A TCP port on 127.0.0.1 that was free a moment ago, or -1. */
int dev_free_port(void);
bool dev_is_executable(const char *path);
/** Print the last @p max_lines lines of a log file to stderr, indented. */
void dev_tail_file(const char *path, int max_lines);
/** "exited with status N", "was killed by signal N (name)", ... */
void dev_describe_status(int status, char *out, size_t outsz);
/** Remove @p dir and everything in it, never following a symlink; failures are said. */
void dev_remove_tree(const char *dir);

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

/**
 * fork + exec. Between the two the child only makes async-signal-safe calls (the mock
 * cluster's threads may hold locks at fork time). An exec failure comes back through a
 * close-on-exec pipe so the caller can name it. @returns the pid, or -1 with errstr.
 */
pid_t dev_spawn(const dev_stack_t *s, const dev_spawn_t *sp, char *errstr, size_t errsz);

/** Wait for @p pid up to @p timeout_ms (-1: forever). true when it ended; *status set. */
bool dev_wait_child(pid_t pid, int timeout_ms, int *status);

/** Run a command to completion with its output in @p log_path. true when it exited 0. */
bool dev_run_logged(const dev_stack_t *s, char *const *argv, const char *log_path, bool as_postgres,
                    int timeout_ms, char *errstr, size_t errsz);

/* ---- dev_pg.c: the throwaway cluster and the ledger --------------------------------------- */

/** The role `tally dev` migrates as: it owns the ledger and creates the runtime roles. */
#define DEV_OWNER_ROLE "tally_owner"

/** Find the server programs, make (or reuse) the cluster's directory, initdb (its superuser,
 * tally, administers), start the server in its own session, create the owner role
 * DEV_OWNER_ROLE (LOGIN CREATEROLE, no superuser) and the database tally owned by it, and fill
 * s->conninfo and the other connections. */
bool dev_pg_up(dev_stack_t *s, char *errstr, size_t errsz);

/** Migrate the ledger as the owner (s->conn_owner), creating and granting the runtime roles.
 * @returns 0, 1 (the migration failed) or 3 (PostgreSQL could not be reached), with errstr. */
int dev_ledger_migrate(dev_stack_t *s, char *errstr, size_t errsz);

/** @p pid (reaped with @p status) was our server: say so, with its log. */
bool dev_pg_reaped(dev_stack_t *s, pid_t pid, int status);

/** Stop the server: pg_ctl stop -m fast (as postgres when root), then escalate if needed. */
void dev_pg_stop(dev_stack_t *s);

/** Remove the temporary directory (or, with --keep, leave it for good). */
void dev_pg_remove_dir(dev_stack_t *s);

/* ---- dev_kafka.c: the mock cluster ------------------------------------------------------- */

/** The mock cluster in this process, with the tally topics; fills s->brokers. */
bool dev_kafka_up(dev_stack_t *s, char *errstr, size_t errsz);
void dev_kafka_stop(dev_stack_t *s);

/* ---- dev_workers.c: the workers ----------------------------------------------------------- */

/** Name the workers; none runs yet. */
void dev_workers_init(dev_stack_t *s);

/** Before anything starts: the worker binaries are next to this one and the registry is one
 * they accept. */
bool dev_workers_check(dev_stack_t *s, char *errstr, size_t errsz);

/** Unless --no-console: spawn `tally console` as the reader role on s->console_listen (a free
 * port on 127.0.0.1 unless --console-addr) and wait until it answers /healthz; fills
 * s->console_url. Before the workers, which carry the URL. */
bool dev_console_up(dev_stack_t *s, char *errstr, size_t errsz);

/** Spawn the three (with TALLY_CONSOLE_URL when the console runs) and wait until each answers
 * /healthz. */
bool dev_workers_up(dev_stack_t *s, char *errstr, size_t errsz);

/** @p pid (reaped with @p status) was a worker or the console: schedule its restart, or say it
 * stays down. false when it was none of ours. */
bool dev_workers_reaped(dev_stack_t *s, pid_t pid, int status);

/** Restart the workers (and the console) whose restart is due. */
void dev_workers_restart_due(dev_stack_t *s);

/** SIGTERM each worker and the console once, wait for the drain; a second signal to us or the
 * grace running out sends SIGKILL. */
void dev_workers_stop(dev_stack_t *s);

#endif
