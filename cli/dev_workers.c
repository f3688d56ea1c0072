/* dev_workers.c — the workers of `tally dev` (dev.h): tally-dispatcher, tally-reconciler and
 * tally-compensator as child processes pointed at the stack, awaited until each answers
 * /healthz, restarted a few times with backoff when one dies, and drained at stop. */
#include <errno.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <curl/curl.h>

#include "dev.h"
#include "tally/registry.h"

extern char **environ;

enum {
    DEV_WORKER_READY_TIMEOUT_MS = 60000,
    DEV_WORKER_STOP_GRACE_MS = 20000,
};

/* in roles.h's order: worker i runs as role i */
_Static_assert(TALLY_ROLE_DISPATCHER == 0 && TALLY_ROLE_RECONCILER == 1 &&
                   TALLY_ROLE_COMPENSATOR == 2,
               "dev_worker_names follows tally_role_t");
static const char *const dev_worker_names[DEV_N_WORKERS] = {"tally-dispatcher", "tally-reconciler",
                                                            "tally-compensator"};

void dev_workers_init(dev_stack_t *s)
{
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        s->workers[i].name = dev_worker_names[i];
        s->workers[i].restart_at_ms = -1;
    }
}

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
        if (!dev_is_executable(w->path)) {
            dev_err(errstr, errsz,
                    "%s not found next to tally (looked for %s); build it, or run "
                    "tally dev --no-workers",
                    w->name, w->path);
            return false;
        }
    }
    return true;
}

bool dev_workers_check(dev_stack_t *s, char *errstr, size_t errsz)
{
    return workers_locate(s, errstr, errsz) && tools_check(s, errstr, errsz);
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

bool dev_workers_up(dev_stack_t *s, char *errstr, size_t errsz)
{
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        dev_worker_t *w = &s->workers[i];
        w->metrics_port = dev_free_port();
        if (w->metrics_port <= 0) {
            dev_err(errstr, errsz, "no free TCP port on 127.0.0.1 for %s", w->name);
            return false;
        }
        char addr[64];
        snprintf(addr, sizeof(addr), "127.0.0.1:%d", w->metrics_port);
        /* each worker as its own role; one given conninfo (--pg) owns the ledger, and the
         * workers may only run as it when told so */
        const char *const set[][2] = {
            {"TALLY_PG", s->conn_role[i]},
            {"TALLY_ALLOW_OWNER_ROLE", s->pg_given != NULL ? "1" : "0"},
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
    long long deadline = dev_now_ms() + DEV_WORKER_READY_TIMEOUT_MS;
    for (;;) {
        size_t n_ready = 0;
        for (size_t i = 0; i < DEV_N_WORKERS; i++) {
            dev_worker_t *w = &s->workers[i];
            int status;
            if (waitpid(w->pid, &status, WNOHANG) == w->pid) {
                w->pid = 0;
                char how[128];
                dev_describe_status(status, how, sizeof(how));
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
        if (dev_now_ms() > deadline) {
            size_t i = 0;
            while (i < DEV_N_WORKERS - 1 && ready[i])
                i++;
            dev_err(errstr, errsz, "%s (pid %d) did not answer /healthz on port %d within %d s",
                    s->workers[i].name, (int)s->workers[i].pid, s->workers[i].metrics_port,
                    DEV_WORKER_READY_TIMEOUT_MS / 1000);
            return false;
        }
        dev_sleep_ms(200);
    }
}

void dev_workers_stop(dev_stack_t *s)
{
    int signals_at_start = dev_signals;
    size_t running = 0;
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        if (s->workers[i].pid > 0) {
            kill(s->workers[i].pid, SIGTERM);
            running++;
        }
    }
    long long deadline = dev_now_ms() + DEV_WORKER_STOP_GRACE_MS;
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
                    dev_describe_status(status, how, sizeof(how));
                    dev_say("%s (pid %d) %s", w->name, (int)w->pid, how);
                }
                w->pid = 0;
                running--;
            }
        }
        if (running == 0)
            break;
        if (!killed && (dev_now_ms() > deadline || dev_signals > signals_at_start)) {
            dev_say("%s: sending SIGKILL to the workers still running",
                    dev_now_ms() > deadline ? "the workers did not stop in time" : "second signal");
            for (size_t i = 0; i < DEV_N_WORKERS; i++)
                if (s->workers[i].pid > 0)
                    kill(s->workers[i].pid, SIGKILL);
            killed = true;
        }
        dev_sleep_ms(50);
    }
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        env_free(s->workers[i].envp);
        s->workers[i].envp = NULL;
    }
}

bool dev_workers_reaped(dev_stack_t *s, pid_t pid, int status)
{
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        dev_worker_t *w = &s->workers[i];
        if (w->pid != pid)
            continue;
        char how[128];
        dev_describe_status(status, how, sizeof(how));
        w->pid = 0;
        if (w->restarts < DEV_MAX_RESTARTS) {
            int delay_s = 1 << w->restarts;
            w->restart_at_ms = dev_now_ms() + delay_s * 1000LL;
            dev_say("%s (pid %d) %s; restarting it in %d s (restart %d of %d)", w->name, (int)pid,
                    how, delay_s, w->restarts + 1, DEV_MAX_RESTARTS);
        } else {
            w->restart_at_ms = -1;
            dev_say("%s (pid %d) %s; it was restarted %d times already, so it stays "
                    "down: the stack runs without it until you stop it",
                    w->name, (int)pid, how, DEV_MAX_RESTARTS);
        }
        return true;
    }
    return false;
}

void dev_workers_restart_due(dev_stack_t *s)
{
    for (size_t i = 0; i < DEV_N_WORKERS; i++) {
        dev_worker_t *w = &s->workers[i];
        if (w->pid != 0 || w->restart_at_ms < 0 || dev_now_ms() < w->restart_at_ms)
            continue;
        char errstr[512];
        w->restarts++;
        if (worker_spawn(s, w, errstr, sizeof(errstr))) {
            dev_say("%s restarted as pid %d (metrics http://127.0.0.1:%d/metrics)", w->name,
                    (int)w->pid, w->metrics_port);
        } else {
            dev_say("could not restart %s: %s", w->name, errstr);
            w->restart_at_ms =
                w->restarts < DEV_MAX_RESTARTS ? dev_now_ms() + (1000LL << w->restarts) : -1;
        }
    }
}
