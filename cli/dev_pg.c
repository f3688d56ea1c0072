/* dev_pg.c — the throwaway PostgreSQL cluster of `tally dev` (dev.h): the server programs found,
 * a directory of its own (swept when a killed tally dev left one behind), initdb, the server in
 * its own session, the database tally, and the ledger migrated on it. */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <libpq-fe.h>

#include "dev.h"
#include "tally/migrate.h"
#include "tally/pg.h"

extern char **environ;

enum {
    DEV_PG_START_TIMEOUT_MS = 60000,
    DEV_PG_PORT_ATTEMPTS = 3,
    DEV_PG_STOP_TIMEOUT_MS = 30000,
};

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
                all = dev_is_executable(p);
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
            all = dev_is_executable(p);
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
        dev_remove_tree(dir);
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
    if (!dev_run_logged(s, argv, log, s->as_postgres, 120000, errstr, errsz)) {
        dev_tail_file(log, 20);
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

static void pg_conninfo(const dev_stack_t *s, const char *user, const char *dbname, char *out,
                        size_t outsz)
{
    snprintf(out, outsz, "host=127.0.0.1 port=%d user=%s dbname=%s", s->pg_port, user, dbname);
}

/* Start the server in its own session and wait until it accepts connections. */
static bool pg_start(dev_stack_t *s, char *errstr, size_t errsz)
{
    char postgres[PATH_MAX + 16], log[PATH_MAX + 16];
    snprintf(postgres, sizeof(postgres), "%s/postgres", s->bindir);
    snprintf(log, sizeof(log), "%s/postgres.log", s->dir);
    for (int attempt = 1; attempt <= DEV_PG_PORT_ATTEMPTS; attempt++) {
        s->pg_port = dev_free_port();
        if (s->pg_port <= 0) {
            dev_err(errstr, errsz, "no free TCP port on 127.0.0.1: %s", strerror(errno));
            return false;
        }
        char port[16];
        snprintf(port, sizeof(port), "%d", s->pg_port);
        /* wal_init_zero=off: a new cluster zero-fills each new WAL segment while COMMITs wait;
         * commits stay fsynced. Why: bench/README.md, "Fourth pass". */
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
        long long deadline = dev_now_ms() + DEV_PG_START_TIMEOUT_MS;
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
            if (dev_now_ms() > deadline) {
                dev_err(errstr, errsz,
                        "PostgreSQL did not accept connections on 127.0.0.1:%d within %d s "
                        "(server log: %s)",
                        s->pg_port, DEV_PG_START_TIMEOUT_MS / 1000, log);
                dev_tail_file(log, 20);
                return false;
            }
            dev_sleep_ms(100);
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
        dev_describe_status(status, how, sizeof(how));
        dev_err(errstr, errsz, "PostgreSQL %s during start-up (server log: %s)", how, log);
        dev_tail_file(log, 20);
        return false;
    }
    dev_err(errstr, errsz, "could not start PostgreSQL");
    return false;
}

static bool pg_create_database(dev_stack_t *s, char *errstr, size_t errsz)
{
    tally_pg_t *pg = tally_pg_new(s->conn_admin, "tally-dev");
    if (pg == NULL) {
        dev_err(errstr, errsz, "out of memory");
        return false;
    }
    tally_error_t err;
    tally_error_clear(&err);
    bool ok = tally_pg_connect(pg, 10000, &dev_signals, &err);
    PGresult *res = NULL;
    if (ok) {
        const char *params[] = {DEV_OWNER_ROLE};
        res = tally_pg_exec(pg, "SELECT 1 FROM pg_roles WHERE rolname = $1", 1, params, &err);
        ok = res != NULL;
    }
    /* CREATE ROLE and CREATE DATABASE take no parameters; the names are constants. The owner
     * is no superuser: it migrates, and creates the runtime roles, as on a managed server. */
    if (ok && PQntuples(res) == 0)
        ok = tally_pg_run(pg, "CREATE ROLE " DEV_OWNER_ROLE " LOGIN CREATEROLE", 0, NULL, &err);
    PQclear(res);
    res = NULL;
    if (ok) {
        const char *params[] = {"tally"};
        res =
            tally_pg_exec(pg, "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = $1",
                          1, params, &err);
        ok = res != NULL;
    }
    if (ok && PQntuples(res) == 0)
        ok = tally_pg_run(pg, "CREATE DATABASE tally OWNER " DEV_OWNER_ROLE, 0, NULL, &err);
    /* a cluster kept (--data-dir) by a tally dev from before the roles: its ledger belongs to
     * the superuser, and the owner could not migrate it */
    bool foreign = ok && PQntuples(res) == 1 && strcmp(PQgetvalue(res, 0, 0), DEV_OWNER_ROLE) != 0;
    if (foreign)
        dev_err(errstr, errsz,
                "the database tally in %s is owned by %s, not " DEV_OWNER_ROLE
                ": it was made by an older tally dev; remove the directory to start afresh",
                s->pgdata, PQgetvalue(res, 0, 0));
    PQclear(res);
    tally_pg_free(pg);
    if (foreign)
        return false;
    if (!ok)
        dev_err(errstr, errsz, "cannot create the role " DEV_OWNER_ROLE " and database tally: %s",
                err.message);
    return ok;
}

void dev_pg_stop(dev_stack_t *s)
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
    } else if (!dev_run_logged(s, argv, log, s->as_postgres, DEV_PG_STOP_TIMEOUT_MS + 5000, errstr,
                               sizeof(errstr))) {
        dev_say("pg_ctl stop failed: %s; sending the server SIGINT (fast shutdown)", errstr);
        dev_tail_file(log, 10);
        kill(s->pg_pid, SIGINT);
    }
    int status;
    if (!dev_wait_child(s->pg_pid, DEV_PG_STOP_TIMEOUT_MS, &status)) {
        dev_say("PostgreSQL (pid %d) is still running; sending SIGQUIT (immediate shutdown)",
                (int)s->pg_pid);
        kill(s->pg_pid, SIGQUIT);
        if (!dev_wait_child(s->pg_pid, 5000, &status)) {
            dev_say("PostgreSQL (pid %d) ignored SIGQUIT; killing its process group",
                    (int)s->pg_pid);
            kill(-s->pg_pid, SIGKILL);
            dev_wait_child(s->pg_pid, -1, &status);
        }
    }
    s->pg_pid = 0;
}

int dev_ledger_migrate(dev_stack_t *s, char *errstr, size_t errsz)
{
    tally_pg_t *pg = tally_pg_new(s->conn_owner, "tally-dev");
    if (pg == NULL) {
        dev_err(errstr, errsz, "out of memory");
        return 1;
    }
    tally_error_t err;
    tally_error_clear(&err);
    int rc = 0;
    if (!tally_pg_connect(pg, 10000, &dev_signals, &err)) {
        dev_err(errstr, errsz, "%s (conninfo: %s)", err.message, s->conn_owner);
        rc = 3;
    } else if (!tally_migrate_apply(pg, s->cfg, &s->schema_before, &s->schema_after, NULL, &err)) {
        dev_err(errstr, errsz, "migrating the ledger failed: %s%s%s", err.message,
                err.errc != TALLY_ERR_NONE ? " — " : "",
                err.errc != TALLY_ERR_NONE ? err.code : "");
        rc = 1;
    }
    tally_pg_free(pg);
    return rc;
}

bool dev_pg_up(dev_stack_t *s, char *errstr, size_t errsz)
{
    if (!find_pg_bindir(s, errstr, errsz) || !resolve_pg_user(s, errstr, errsz) ||
        !make_dir(s, errstr, errsz))
        return false;
    dev_say("starting PostgreSQL from %s in %s", s->bindir, s->dir);
    if (!pg_initdb(s, errstr, errsz) || !pg_start(s, errstr, errsz))
        return false;
    pg_conninfo(s, "tally", "postgres", s->conn_admin, sizeof(s->conn_admin));
    pg_conninfo(s, DEV_OWNER_ROLE, "tally", s->conn_owner, sizeof(s->conn_owner));
    for (int r = 0; r < TALLY_ROLE_COUNT; r++)
        pg_conninfo(s, tally_role_name(s->cfg, (tally_role_t)r), "tally", s->conn_role[r],
                    sizeof(s->conn_role[r]));
    snprintf(s->conninfo, sizeof(s->conninfo), "%s", s->conn_role[TALLY_ROLE_OPERATOR]);
    return pg_create_database(s, errstr, errsz);
}

bool dev_pg_reaped(dev_stack_t *s, pid_t pid, int status)
{
    if (s->pg_pid <= 0 || pid != s->pg_pid)
        return false;
    s->pg_pid = 0;
    kill(-pid, SIGKILL); /* whatever is left of its process group */
    char how[128];
    dev_describe_status(status, how, sizeof(how));
    dev_say("PostgreSQL (pid %d) %s unexpectedly; stopping the stack", (int)pid, how);
    char log[PATH_MAX + 16];
    snprintf(log, sizeof(log), "%s/postgres.log", s->dir);
    dev_tail_file(log, 20);
    return true;
}

void dev_pg_remove_dir(dev_stack_t *s)
{
    if (s->dir[0] == '\0' || !s->dir_is_temp)
        return;
    if (s->keep) {
        char owner[PATH_MAX + 32];
        snprintf(owner, sizeof(owner), "%s/" DEV_OWNER_FILE, s->dir);
        unlink(owner); /* kept on purpose: no later tally dev may sweep it */
        dev_say("kept %s (--keep)", s->dir);
    } else {
        dev_remove_tree(s->dir);
    }
}
