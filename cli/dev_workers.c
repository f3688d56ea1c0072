/* dev_workers.c — the workers of `tally dev` (dev.h): tally-dispatcher, tally-reconciler and
 * tally-compensator, and `tally console` beside them, as child processes pointed at the stack,
 * awaited until each answers /healthz, restarted a few times with backoff when one dies, and
 * drained at stop. */
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
    s->console.name = "tally console";
    s->console.restart_at_ms = -1;
}

/* The supervised children: the workers, then the console when it runs. */
static size_t children_count(const dev_stack_t *s)
{
    return DEV_N_WORKERS + (s->console.path[0] != '\0' ? 1 : 0);
}

static dev_worker_t *child_at(dev_stack_t *s, size_t i)
{
    return i < DEV_N_WORKERS ? &s->workers[i] : &s->console;
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
        w->argv[0] = w->path;
        w->argv[1] = "--tools";
        w->argv[2] = s->tools;
        w->argv[3] = NULL;
    }
    if (!s->no_console) {
        /* the console is this program: `tally console` */
        ssize_t m = readlink("/proc/self/exe", s->console.path, sizeof(s->console.path) - 1);
        if (m < 0) {
            dev_err(errstr, errsz, "cannot find this program (/proc/self/exe): %s",
                    strerror(errno));
            return false;
        }
        s->console.path[m] = '\0';
        s->console.argv[0] = s->console.path;
        s->console.argv[1] = "console";
        s->console.argv[2] = "--listen";
        s->console.argv[3] = s->console_listen;
        s->console.argv[4] = NULL;
    }
    return true;
}

bool dev_workers_check(dev_stack_t *s, char *errstr, size_t errsz)
{
    return workers_locate(s, errstr, errsz) && tools_check(s, errstr, errsz);
}

static bool worker_spawn(dev_stack_t *s, dev_worker_t *w, char *errstr, size_t errsz)
{
    dev_spawn_t sp = {.path = w->path,
                      .argv = w->argv,
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

/* Ready = /healthz answers 200; a child that exits now has a problem a restart won't fix. */
static bool await_ready(dev_worker_t *const *list, size_t n, const char *what, char *errstr,
                        size_t errsz)
{
    bool ready[DEV_N_WORKERS + 1] = {false};
    long long deadline = dev_now_ms() + DEV_WORKER_READY_TIMEOUT_MS;
    for (;;) {
        size_t n_ready = 0;
        for (size_t i = 0; i < n; i++) {
            dev_worker_t *w = list[i];
            int status;
            if (waitpid(w->pid, &status, WNOHANG) == w->pid) {
                w->pid = 0;
                char how[128];
                dev_describe_status(status, how, sizeof(how));
                dev_err(errstr, errsz, "%s %s while starting (its log is above)", w->name, how);
                return false;
            }
            if (!ready[i]) {
                char url[sizeof(((dev_stack_t *)0)->console_url) + 16];
                if (w->base_url != NULL) /* the console, wherever --console-addr put it */
                    snprintf(url, sizeof(url), "%s/healthz", w->base_url);
                else
                    snprintf(url, sizeof(url), "http://127.0.0.1:%d/healthz", w->metrics_port);
                ready[i] = http_status(url) == 200;
            }
            n_ready += ready[i];
        }
        if (n_ready == n)
            return true;
        if (dev_signals > 0) {
            dev_err(errstr, errsz, "interrupted while %s starting", what);
            return false;
        }
        if (dev_now_ms() > deadline) {
            size_t i = 0;
            while (i < n - 1 && ready[i])
                i++;
            dev_err(errstr, errsz, "%s (pid %d) did not answer /healthz on port %d within %d s",
                    list[i]->name, (int)list[i]->pid, list[i]->metrics_port,
                    DEV_WORKER_READY_TIMEOUT_MS / 1000);
            return false;
        }
        dev_sleep_ms(200);
    }
}

bool dev_console_up(dev_stack_t *s, char *errstr, size_t errsz)
{
    dev_worker_t *w = &s->console;
    if (w->path[0] == '\0')
        return true;
    if (s->console_addr != NULL) {
        const char *colon = strrchr(s->console_addr, ':');
        w->metrics_port = colon != NULL ? atoi(colon + 1) : 0;
        snprintf(s->console_listen, sizeof(s->console_listen), "%s", s->console_addr);
    } else {
        w->metrics_port = dev_free_port();
        if (w->metrics_port <= 0) {
            dev_err(errstr, errsz, "no free TCP port on 127.0.0.1 for the console");
            return false;
        }
        snprintf(s->console_listen, sizeof(s->console_listen), "127.0.0.1:%d", w->metrics_port);
    }
    snprintf(s->console_url, sizeof(s->console_url), "http://%s", s->console_listen);
    w->base_url = s->console_url;
    /* the read-only role: what an operator's console reads as (docs/operations.md); with --pg
     * that is the given role, and the console's READ ONLY transactions still hold */
    const char *reader = s->conn_role[TALLY_ROLE_READER];
    const char *const set[][2] = {
        {"TALLY_PG", reader},
        {"TALLY_PG_READER", reader},
    };
    w->envp = env_build(environ, set, sizeof(set) / sizeof(set[0]), NULL, 0);
    if (w->envp == NULL) {
        dev_err(errstr, errsz, "out of memory");
        return false;
    }
    if (!worker_spawn(s, w, errstr, errsz))
        return false;
    dev_worker_t *const list[] = {w};
    return await_ready(list, 1, "the console was", errstr, errsz);
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
         * workers may only run as it when told so. The console's URL goes last: set only when
         * the console runs, so that every alert and page links to it */
        const char *const set[][2] = {
            {"TALLY_PG", s->conn_role[i]},
            {"TALLY_ALLOW_OWNER_ROLE", s->pg_given != NULL ? "1" : "0"},
            {"TALLY_KAFKA_BROKERS", s->brokers},
            {"TALLY_TOPIC_PREFIX", s->cfg->topic_prefix},
            {"TALLY_TOOLS", s->tools},
            {"TALLY_METRICS_ADDR", addr},
            {"TALLY_CONSOLE_URL", s->console_url},
        };
        size_t n_set = sizeof(set) / sizeof(set[0]) - (s->console_url[0] == '\0' ? 1 : 0);
        const char *const dflt[][2] = {
            {"TALLY_SESSION_TIMEOUT_MS", "6000"},
            {"TALLY_KAFKA_HEARTBEAT_INTERVAL_MS", "500"},
            /* the mock broker holds an empty fetch for the whole wait (500 ms by default)
             * even when data arrives meanwhile: that would be every outcome's latency */
            {"TALLY_KAFKA_FETCH_WAIT_MAX_MS", "10"},
        };
        w->envp = env_build(environ, set, n_set, dflt, sizeof(dflt) / sizeof(dflt[0]));
        if (w->envp == NULL) {
            dev_err(errstr, errsz, "out of memory");
            return false;
        }
        if (!worker_spawn(s, w, errstr, errsz))
            return false;
    }
    dev_worker_t *const list[DEV_N_WORKERS] = {&s->workers[0], &s->workers[1], &s->workers[2]};
    return await_ready(list, DEV_N_WORKERS, "the workers were", errstr, errsz);
}

void dev_workers_stop(dev_stack_t *s)
{
    int signals_at_start = dev_signals;
    size_t n = children_count(s), running = 0;
    for (size_t i = 0; i < n; i++) {
        if (child_at(s, i)->pid > 0) {
            kill(child_at(s, i)->pid, SIGTERM);
            running++;
        }
    }
    long long deadline = dev_now_ms() + DEV_WORKER_STOP_GRACE_MS;
    bool killed = false;
    while (running > 0) {
        for (size_t i = 0; i < n; i++) {
            dev_worker_t *w = child_at(s, i);
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
            for (size_t i = 0; i < n; i++)
                if (child_at(s, i)->pid > 0)
                    kill(child_at(s, i)->pid, SIGKILL);
            killed = true;
        }
        dev_sleep_ms(50);
    }
    for (size_t i = 0; i < n; i++) {
        env_free(child_at(s, i)->envp);
        child_at(s, i)->envp = NULL;
    }
}

bool dev_workers_reaped(dev_stack_t *s, pid_t pid, int status)
{
    for (size_t i = 0; i < children_count(s); i++) {
        dev_worker_t *w = child_at(s, i);
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
    for (size_t i = 0; i < children_count(s); i++) {
        dev_worker_t *w = child_at(s, i);
        if (w->pid != 0 || w->restart_at_ms < 0 || dev_now_ms() < w->restart_at_ms)
            continue;
        char errstr[512];
        w->restarts++;
        if (worker_spawn(s, w, errstr, sizeof(errstr))) {
            if (w == &s->console)
                dev_say("%s restarted as pid %d (%s/)", w->name, (int)w->pid, s->console_url);
            else
                dev_say("%s restarted as pid %d (metrics http://127.0.0.1:%d/metrics)", w->name,
                        (int)w->pid, w->metrics_port);
        } else {
            dev_say("could not restart %s: %s", w->name, errstr);
            w->restart_at_ms =
                w->restarts < DEV_MAX_RESTARTS ? dev_now_ms() + (1000LL << w->restarts) : -1;
        }
    }
}
