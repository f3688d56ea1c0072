/* worker.c — the lifecycle every tally worker shares.
 *
 * Start-up refuses loudly rather than running half-safe: a bad environment exits 2, an unsafe
 * tool registry or a database at the wrong schema version exits 1. Then the loop ticks until
 * SIGTERM/SIGINT; the first signal drains within the grace period and exits 0, a second one
 * exits at once. Signal handlers only set flags (STYLE.md); everything else happens here. */
#include "tally/worker.h"

#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tally/alert.h"
#include "tally/crashpoint.h"
#include "tally/httpd.h"
#include "tally/kafka.h"
#include "tally/log.h"
#include "tally/migrate.h"
#include "tally/notify.h"
#include "tally/relay.h"
#include "tally/roles.h"
#include "tally/seal.h"

/* The stop flag is handed out as `volatile const int *`; that is only sound where
 * sig_atomic_t is int, as on every platform tally builds for. */
_Static_assert(_Generic((sig_atomic_t)0, int : 1, default : 0), "sig_atomic_t must be int");

#define MAX_TOPICS     16
#define TOPIC_NAME_LEN 256
/* The lag gauge needs no broker round trip (cached watermarks); 10 s is below any scrape. */
#define LAG_REFRESH_MS 10000

/* Set by the signal handler: the first SIGTERM/SIGINT stops the loop. */
static volatile sig_atomic_t g_stop;
static volatile sig_atomic_t g_signal;
/* The relay keeps publishing while the worker drains (drain may write outbox rows), and is
 * told to stop only after fini. */
static volatile sig_atomic_t g_relay_stop;
/* Prepared before the handlers are installed: the handler may only write(2) it. */
static char g_exit_line[512];
static size_t g_exit_line_len;

struct tally_worker {
    const tally_worker_ops_t *ops;
    int schema; /* the ledger's schema version, read at start */
    tally_config_t *cfg;
    tally_registry_t *reg;
    tally_keyring_t *keys; /* master keys, when a tool declares sensitive fields */
    tally_pg_t *pg;
    tally_metrics_t *metrics;
    tally_metric_t *m_up;
    tally_metric_t *m_ticks;
    tally_metric_t *m_build;
    tally_metric_t *m_db_up;
    tally_httpd_t *httpd;
    tally_httpd_t *health_httpd; /* TALLY_HEALTH_ADDR, when set */
    tally_notify_t *notify;      /* systemd's $NOTIFY_SOCKET, when set */
    pthread_t watchdog;          /* pings systemd's watchdog while /healthz would say alive */
    bool watchdog_running;
    atomic_bool watchdog_stop;
    tally_relay_t *relay;
    rd_kafka_t *consumer;
    tally_metric_t *m_lag;        /* tally_kafka_consumer_lag{partition,topic} */
    long long lag_at_ms;          /* when m_lag was last refilled */
    tally_metric_t *m_rebalances; /* tally_kafka_rebalances_total{kind} */
    tally_metric_t *m_read;       /* tally_kafka_messages_read_total{partition,topic} */
    tally_consume_t *consume;
    rd_kafka_t *producer;
    char id[256];
    char group[256];
    char metrics_addr[300];
    char topics[MAX_TOPICS][TOPIC_NAME_LEN];
    size_t n_topics;
    long long health_window_ms;
    /* Read by the HTTP thread. */
    _Atomic long long heartbeat_ms;
    atomic_bool pg_up;
    /* w->pg once made, for the probes: is the main loop waiting on PostgreSQL, and how long */
    _Atomic(tally_pg_t *) pg_watch;
    /* the last probe or scrape saw a statement unanswered past TALLY_PG_STALL_MS */
    atomic_bool pg_stalled;
    pthread_mutex_t ready_mu;
    bool started;
    bool ready;
    char ready_why[256];
    /* Main thread only. */
    unsigned long long ticks;
    unsigned long long work;
    unsigned long long tick_errors;
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Sleep up to @p ms, waking early when the stop flag is set. */
static void sleep_unless_stopped(long long ms)
{
    long long end = now_ms() + ms;
    while (!g_stop) {
        long long left = end - now_ms();
        if (left <= 0) {
            return;
        }
        struct timespec ts = {.tv_sec = 0, .tv_nsec = (left < 50 ? left : 50) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static void on_signal(int sig)
{
    if (g_stop) {
        ssize_t r = write(STDERR_FILENO, g_exit_line, g_exit_line_len);
        (void)r;
        _exit(1);
    }
    g_signal = sig;
    g_stop = 1;
}

static void install_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    struct sigaction ign;
    memset(&ign, 0, sizeof ign);
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, NULL);
}

/* Append @p s to @p out as JSON string content (quotes, backslashes, control bytes). */
static size_t json_escape_into(char *out, size_t outsz, size_t o, const char *s)
{
    for (; *s != '\0' && o + 7 < outsz; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[o++] = '\\';
            out[o++] = (char)c;
        } else if (c < 0x20) {
            o += (size_t)snprintf(out + o, outsz - o, "\\u%04x", c);
        } else {
            out[o++] = (char)c;
        }
    }
    out[o] = '\0';
    return o;
}

static void prepare_exit_line(const char *component, const char *worker_id)
{
    size_t o =
        (size_t)snprintf(g_exit_line, sizeof g_exit_line, "{\"level\":\"error\",\"component\":\"");
    o = json_escape_into(g_exit_line, sizeof g_exit_line, o, component);
    o += (size_t)snprintf(g_exit_line + o, sizeof g_exit_line - o, "\",\"worker\":\"");
    o = json_escape_into(g_exit_line, sizeof g_exit_line, o, worker_id);
    snprintf(g_exit_line + o, sizeof g_exit_line - o,
             "\",\"msg\":\"second signal: exiting at once without draining\"}\n");
    g_exit_line_len = strlen(g_exit_line);
}

static void usage(FILE *out, const tally_worker_ops_t *ops, const tally_config_t *cfg)
{
    fprintf(out,
            "Usage: tally-%s [--tools FILE] [--metrics-addr HOST:PORT]\n"
            "%s\n"
            "\n"
            "Options:\n"
            "  --tools FILE               the tool registry (overrides TALLY_TOOLS)\n"
            "  --metrics-addr HOST:PORT   serve /metrics, /healthz, /readyz here\n"
            "                             (overrides TALLY_METRICS_ADDR; \"\" disables)\n"
            "  --help                     this text\n"
            "  --version                  print the version\n"
            "\n"
            "Signals: SIGTERM or SIGINT drains in-flight work (up to TALLY_SHUTDOWN_GRACE_MS)\n"
            "and exits 0; a second one exits 1 at once.\n"
            "\n"
            "Configuration (environment):\n",
            ops->name, ops->summary != NULL ? ops->summary : "");
    if (cfg != NULL) {
        tally_config_describe(cfg, out);
    }
}

static bool replace_string(char **field, const char *value)
{
    char *copy = strdup(value);
    if (copy == NULL) {
        return false;
    }
    free(*field);
    *field = copy;
    return true;
}

/* --- /healthz and /readyz (called on the HTTP thread) ------------------------------------ */

/* Liveness is about this process, not its database: a loop waiting on PostgreSQL within the
 * deadline pg.c enforces is alive however long the server takes, and each wait that ends
 * (answered or given up) is progress. So a database stall never fails /healthz, and a liveness
 * probe restarts only a loop that is stuck somewhere no deadline covers. */
static bool health_check(void *opaque, char *why, size_t whysz)
{
    tally_worker_t *w = opaque;
    long long now = now_ms();
    tally_pg_t *pg = atomic_load(&w->pg_watch);
    long long since = 0;
    long long until = 0;
    bool waiting = tally_pg_waiting(pg, &since, &until);
    if (waiting && now <= until) {
        return true;
    }
    /* the last sign of progress: a turn, a wait that ended, or the deadline of this one */
    long long last = atomic_load(&w->heartbeat_ms);
    long long ended = tally_pg_last_wait_end_ms(pg);
    last = ended > last ? ended : last;
    last = waiting && until > last ? until : last;
    long long idle = now - last;
    if (waiting && idle > w->health_window_ms) {
        snprintf(why, whysz,
                 "the main loop has waited on PostgreSQL for %lld ms, %lld ms past its deadline "
                 "(limit %lld ms)",
                 now - since, idle, w->health_window_ms);
        return false;
    }
    if (idle > w->health_window_ms) {
        snprintf(why, whysz, "the main loop has not completed a turn for %lld ms (limit %lld ms)",
                 idle, w->health_window_ms);
        return false;
    }
    return true;
}

/* The dependency, for readiness and tally_db_up: the main connection is up, and no statement
 * on it has waited longer than TALLY_PG_STALL_MS. The relay's and the recorder's connections
 * are not counted: they reach the same server, and their statements are bounded alike. */
static bool db_answering(tally_worker_t *w, char *why, size_t whysz)
{
    long long since = 0;
    bool waiting = tally_pg_waiting(atomic_load(&w->pg_watch), &since, NULL);
    long long waited = waiting ? now_ms() - since : 0;
    bool stalled = waiting && waited >= w->cfg->pg_stall_ms;
    if (stalled) {
        snprintf(why, whysz, "PostgreSQL has not answered for %.1f s", (double)waited / 1000.0);
    }
    /* said once per stall, by whichever probe or scrape sees it first */
    if (atomic_exchange(&w->pg_stalled, stalled) != stalled) {
        if (stalled) {
            TALLY_WARN("not ready: %s (a statement waits; TALLY_PG_STALL_MS %d)", why,
                       w->cfg->pg_stall_ms);
        } else {
            TALLY_INFO("the wait on PostgreSQL ended (answered, or given up at the deadline)");
        }
    }
    if (stalled) {
        return false;
    }
    if (!atomic_load(&w->pg_up)) {
        snprintf(why, whysz, "PostgreSQL is not connected");
        return false;
    }
    return true;
}

/* tally_db_up at every scrape: the main loop cannot set it while it waits on the database. */
static void collect_db_up(void *opaque)
{
    tally_worker_t *w = opaque;
    char why[128];
    tally_metric_set(w->m_db_up, db_answering(w, why, sizeof why) ? 1 : 0);
}

static bool ready_check(void *opaque, char *why, size_t whysz)
{
    tally_worker_t *w = opaque;
    if (g_stop) {
        snprintf(why, whysz, "stopping");
        return false;
    }
    pthread_mutex_lock(&w->ready_mu);
    bool started = w->started;
    bool ready = w->ready;
    if (!ready) {
        snprintf(why, whysz, "%s", w->ready_why);
    }
    pthread_mutex_unlock(&w->ready_mu);
    if (!started) {
        snprintf(why, whysz, "starting");
        return false;
    }
    if (!db_answering(w, why, whysz)) {
        return false;
    }
    return ready;
}

/* --- systemd's watchdog -------------------------------------------------------------------- */

/* systemd's watchdog follows the liveness rule of /healthz, not the main loop's turns alone: a
 * loop waiting on PostgreSQL within its deadline is alive, so a database stall never gets a
 * worker killed that /healthz would keep (and a wait past its deadline still does). A thread
 * checks four times a period; tally_notify_heartbeat sends at most every half period
 * (EXTEND_TIMEOUT_USEC before READY=1). */
static void *watchdog_main(void *arg)
{
    tally_worker_t *w = arg;
    long long step = (long long)(tally_notify_watchdog_usec(w->notify) / 4000);
    step = step < 10 ? 10 : step > 1000 ? 1000 : step;
    while (!atomic_load(&w->watchdog_stop)) {
        char why[256];
        if (health_check(w, why, sizeof why)) {
            tally_notify_heartbeat(w->notify, now_ms());
        }
        struct timespec ts = {.tv_sec = step / 1000, .tv_nsec = (step % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void start_watchdog(tally_worker_t *w)
{
    if (tally_notify_watchdog_usec(w->notify) == 0) {
        return;
    }
    atomic_store(&w->watchdog_stop, false);
    int err = pthread_create(&w->watchdog, NULL, watchdog_main, w);
    if (err != 0) {
        TALLY_WARN("cannot start the systemd watchdog thread (%s): systemd will stop this worker "
                   "after WatchdogSec",
                   strerror(err));
        return;
    }
    w->watchdog_running = true;
}

/* Before the database connection it reads is freed. */
static void stop_watchdog(tally_worker_t *w)
{
    if (!w->watchdog_running) {
        return;
    }
    atomic_store(&w->watchdog_stop, true);
    pthread_join(w->watchdog, NULL);
    w->watchdog_running = false;
}

/* --- accessors ----------------------------------------------------------------------------- */

const tally_config_t *tally_worker_config(tally_worker_t *w)
{
    return w->cfg;
}

const tally_registry_t *tally_worker_registry(tally_worker_t *w)
{
    return w->reg;
}

const tally_keyring_t *tally_worker_keyring(tally_worker_t *w)
{
    return w->keys;
}

tally_pg_t *tally_worker_pg(tally_worker_t *w)
{
    return w->pg;
}

tally_metrics_t *tally_worker_metrics(tally_worker_t *w)
{
    return w->metrics;
}

tally_relay_t *tally_worker_relay(tally_worker_t *w)
{
    return w->relay;
}

int tally_worker_schema(const tally_worker_t *w)
{
    return w->schema;
}

rd_kafka_t *tally_worker_consumer(tally_worker_t *w)
{
    return w->consumer;
}

tally_consume_t *tally_worker_consume(tally_worker_t *w)
{
    if (w->consume == NULL && w->consumer != NULL) {
        char errstr[256];
        w->consume = tally_consume_new(w->consumer, errstr, sizeof errstr);
        if (w->consume == NULL) {
            TALLY_ERROR("cannot wait on the Kafka consumer: %s", errstr);
        } else {
            tally_consume_count(w->consume, w->m_read);
        }
    }
    return w->consume;
}

rd_kafka_t *tally_worker_producer(tally_worker_t *w)
{
    if (w->producer == NULL) {
        char errstr[512];
        w->producer = tally_kafka_producer_new(w->cfg, false, NULL, NULL, errstr, sizeof errstr);
        if (w->producer == NULL) {
            TALLY_ERROR("cannot create a Kafka producer: %s", errstr);
        }
    }
    return w->producer;
}

const char *tally_worker_id(const tally_worker_t *w)
{
    return w->id;
}

bool tally_worker_stopping(const tally_worker_t *w)
{
    (void)w;
    return g_stop != 0;
}

volatile const int *tally_worker_stop_flag(const tally_worker_t *w)
{
    (void)w;
    return &g_stop;
}

void tally_worker_heartbeat(tally_worker_t *w)
{
    atomic_store(&w->heartbeat_ms, now_ms());
}

void tally_worker_set_ready(tally_worker_t *w, bool ready, const char *why)
{
    pthread_mutex_lock(&w->ready_mu);
    if (w->ready != ready) {
        if (ready) {
            TALLY_INFO("ready again");
        } else {
            TALLY_WARN("not ready: %s", why != NULL ? why : "no reason given");
        }
    }
    w->ready = ready;
    snprintf(w->ready_why, sizeof w->ready_why, "%s",
             ready ? "" : (why != NULL && why[0] != '\0' ? why : "not ready"));
    pthread_mutex_unlock(&w->ready_mu);
}

/* --- start-up steps: each returns an exit code, 0 to carry on ------------------------------- */

/* argv and environment into w->cfg. -1 means "exit 0 now" (--help, --version). */
static int setup_config(tally_worker_t *w, int argc, char **argv)
{
    static const struct option longopts[] = {
        {"tools", required_argument, NULL, 't'},
        {"metrics-addr", required_argument, NULL, 'm'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    const char *tools = NULL;
    const char *metrics_addr = NULL;
    bool help = false;
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":", longopts, NULL)) != -1) {
        switch (c) {
        case 't':
            tools = optarg;
            break;
        case 'm':
            metrics_addr = optarg;
            break;
        case 'h':
            help = true;
            break;
        case 'V':
            printf("tally-%s %s\n", w->ops->name, TALLY_VERSION);
            return -1;
        case ':':
            fprintf(stderr, "tally-%s: %s needs a value\n", w->ops->name, argv[optind - 1]);
            usage(stderr, w->ops, NULL);
            return 2;
        default:
            fprintf(stderr, "tally-%s: unknown option '%s'\n", w->ops->name, argv[optind - 1]);
            usage(stderr, w->ops, NULL);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "tally-%s: unexpected argument '%s'\n", w->ops->name, argv[optind]);
        usage(stderr, w->ops, NULL);
        return 2;
    }
    w->cfg = tally_config_new();
    if (w->cfg == NULL) {
        TALLY_ERROR("out of memory reading the configuration");
        return 1;
    }
    char errstr[512];
    bool env_ok = tally_config_load_env(w->cfg, environ, errstr, sizeof errstr);
    if (help) {
        usage(stdout, w->ops, w->cfg);
        if (!env_ok) {
            printf("\nThe environment has a problem: %s\n", errstr);
        }
        return -1;
    }
    if (!env_ok) {
        TALLY_ERROR("invalid configuration: %s", errstr);
        return 2;
    }
    if ((tools != NULL && !replace_string(&w->cfg->tools_path, tools)) ||
        (metrics_addr != NULL && !replace_string(&w->cfg->metrics_addr, metrics_addr))) {
        TALLY_ERROR("out of memory reading the configuration");
        return 1;
    }
    tally_log_level_t level = TALLY_LOG_INFO;
    if (w->cfg->log_level != NULL && w->cfg->log_level[0] != '\0' &&
        !tally_log_level_parse(w->cfg->log_level, &level)) {
        TALLY_ERROR("invalid configuration: TALLY_LOG_LEVEL: '%s' is not one of debug, info, "
                    "warn, error",
                    w->cfg->log_level);
        return 2;
    }
    if (w->cfg->worker_id != NULL && w->cfg->worker_id[0] != '\0') {
        snprintf(w->id, sizeof w->id, "%s", w->cfg->worker_id);
    }
    tally_log_init(w->ops->name, w->id, level);
    /* every alert this worker raises, and every page it sends, links to the console */
    if (!tally_alert_set_console(w->cfg->console_url)) {
        TALLY_ERROR("invalid configuration: TALLY_CONSOLE_URL is longer than %d bytes",
                    TALLY_CONSOLE_URL_MAX);
        return 2;
    }
    if (w->cfg->poll_ms <= 0) {
        TALLY_ERROR("invalid configuration: TALLY_POLL_MS must be positive, not %d",
                    w->cfg->poll_ms);
        return 2;
    }
    long long window = 5LL * w->cfg->poll_ms;
    w->health_window_ms = window > 10000 ? window : 10000;
    return 0;
}

/* The master keys (seal.h). A registry that declares sensitive fields needs one: without it
 * nothing of those tools could be written, so the worker refuses to start rather than
 * dead-letter every intent. */
static int setup_keys(tally_worker_t *w, const char *path)
{
    tally_error_t err;
    tally_error_clear(&err);
    w->keys = tally_keyring_load(w->cfg, &err);
    if (w->keys == NULL) {
        TALLY_ERROR("refusing to start: %s", err.message);
        return 2;
    }
    for (size_t i = 0; i < tally_registry_count(w->reg); i++) {
        const tally_tool_t *t = tally_registry_at(w->reg, i);
        if (tally_tool_sensitive(t) && !tally_keyring_ready(w->keys)) {
            TALLY_ERROR("refusing to start: tool '%s' in %s declares sensitive fields, and "
                        "there is no master key to seal them: set TALLY_MASTER_KEY or "
                        "TALLY_MASTER_KEY_FILE (docs/security.md)",
                        t->name, path);
            return 2;
        }
    }
    return 0;
}

static int setup_registry(tally_worker_t *w)
{
    const char *path = w->cfg->tools_path;
    if (path == NULL || path[0] == '\0') {
        TALLY_ERROR("no tool registry: set TALLY_TOOLS or pass --tools FILE");
        return 2;
    }
    tally_problems_t problems = {NULL, 0};
    w->reg = tally_registry_load_file(path, &problems);
    if (w->reg == NULL) {
        for (size_t i = 0; i < problems.n; i++) {
            TALLY_ERROR("%s: %s", path, problems.lines[i]);
        }
        TALLY_ERROR("refusing to start: the tool registry is unsafe (%zu problem%s in %s)",
                    problems.n, problems.n == 1 ? "" : "s", path);
        tally_problems_clear(&problems);
        return 1;
    }
    tally_problems_clear(&problems);
    TALLY_DEBUG("tool registry %s: %zu tools", path, tally_registry_count(w->reg));
    const tally_problems_t *warnings = tally_registry_warnings(w->reg);
    for (size_t i = 0; warnings != NULL && i < warnings->n; i++)
        TALLY_WARN("%s: %s", path, warnings->lines[i]);
    /* A signing key that is not set: every request to the tool is refused until it is (the
     * connector says so per call; this says it once, at start). */
    for (size_t i = 0; i < tally_registry_count(w->reg); i++) {
        const tally_tool_t *t = tally_registry_at(w->reg, i);
        const char *keys[2] = {t->secret_env, t->signing.scheme == TALLY_SIGNING_RFC9421
                                                  ? t->signing.secret_env
                                                  : NULL};
        for (size_t k = 0; k < 2; k++) {
            if (keys[k] != NULL && keys[k][0] != '\0' && getenv(keys[k]) == NULL)
                TALLY_WARN("tool '%s' signs its requests (%s) with %s, which is not set: "
                           "requests to it are refused until it is",
                           t->name, k == 0 ? "Tally-Signature" : "RFC 9421", keys[k]);
        }
    }
    return setup_keys(w, path);
}

static int setup_metrics(tally_worker_t *w)
{
    w->metrics = tally_metrics_new();
    if (w->metrics == NULL) {
        TALLY_ERROR("out of memory creating the metrics registry");
        return 1;
    }
    w->m_up = tally_metrics_gauge(w->metrics, "tally_worker_up",
                                  "1 while the worker's main loop is running", NULL);
    w->m_ticks = tally_metrics_counter(w->metrics, "tally_worker_ticks_total",
                                       "Turns of the worker's main loop", NULL);
    w->m_build =
        tally_metrics_gauge(w->metrics, "tally_build_info",
                            "Always 1; the labels say which build is running", "version,worker");
    w->m_db_up = tally_metrics_gauge(w->metrics, "tally_db_up",
                                     "1 while the worker's main PostgreSQL connection is up and "
                                     "answering; 0 when it is closed or a statement has waited "
                                     "past TALLY_PG_STALL_MS",
                                     NULL);
    tally_metric_set(w->m_up, 0);
    tally_metric_set(w->m_db_up, 0);
    tally_metric_add(w->m_ticks, 0); /* exposed as 0 before the first turn */
    tally_metrics_on_render(w->metrics, collect_db_up, w);
    tally_metric_set(w->m_build, 1, TALLY_VERSION, w->ops->name);
    char errstr[512];
    const char *health = w->cfg->health_addr;
    if (health != NULL && health[0] != '\0') {
        w->health_httpd =
            tally_httpd_start_health(health, health_check, ready_check, w, errstr, sizeof errstr);
        if (w->health_httpd == NULL) {
            TALLY_ERROR("TALLY_HEALTH_ADDR: %s", errstr);
            return 1;
        }
        TALLY_INFO("serving /healthz and /readyz alone on port %d (TALLY_HEALTH_ADDR %s)",
                   tally_httpd_port(w->health_httpd), health);
    }
    const char *addr = w->cfg->metrics_addr;
    if (addr == NULL || addr[0] == '\0') {
        snprintf(w->metrics_addr, sizeof w->metrics_addr, "disabled");
        return 0;
    }
    w->httpd =
        tally_httpd_start(addr, w->metrics, health_check, ready_check, w, errstr, sizeof errstr);
    if (w->httpd == NULL) {
        TALLY_ERROR("%s", errstr);
        return 1;
    }
    /* Show the port actually bound, which differs from the request when it asked for 0. */
    const char *colon = strrchr(addr, ':');
    int host_len = colon != NULL ? (int)(colon - addr) : (int)strlen(addr);
    /* lint: slice (the host part of the address) */
    snprintf(w->metrics_addr, sizeof w->metrics_addr, "%.*s:%d", host_len, addr,
             tally_httpd_port(w->httpd));
    TALLY_INFO("serving /metrics, /healthz and /readyz on http://%s", w->metrics_addr);
    return 0;
}

/* A worker runs as its own role (roles.h), never as one that could rewrite the audit trail or
 * alter the ledger; TALLY_ALLOW_OWNER_ROLE=1 is for deployments that cannot create roles, and
 * says so at every start. */
static int check_role(tally_worker_t *w)
{
    tally_error_t err;
    tally_error_clear(&err);
    tally_session_role_t who;
    if (!tally_roles_session(w->pg, &who, &err)) {
        TALLY_ERROR("cannot tell which database role this connection runs as: %s", err.message);
        return 1;
    }
    char why[300];
    if (!tally_roles_privileged(&who, why, sizeof why)) {
        TALLY_DEBUG("connected to PostgreSQL as role \"%s\"", who.user);
        return 0;
    }
    if (strcmp(w->cfg->allow_owner_role, "1") == 0) {
        TALLY_WARN("rule owner-role: running with more privilege than a %s needs, because "
                   "TALLY_ALLOW_OWNER_ROLE=1: %s; give it its own role (`tally migrate` creates "
                   "one per component) as soon as the deployment can",
                   w->ops->name, why);
        return 0;
    }
    TALLY_ERROR(
        "rule owner-role: refusing to start: TALLY_PG connects as a role the %s must not run "
        "as: %s. Connect as the %s's own role (`tally migrate` creates and grants it; "
        "docs/operations.md, \"Database roles\"), or set TALLY_ALLOW_OWNER_ROLE=1 where "
        "no other role can be had",
        w->ops->name, why, w->ops->name);
    return 2;
}

static int setup_pg(tally_worker_t *w, int *schema)
{
    char app[64];
    snprintf(app, sizeof app, "tally-%s", w->ops->name);
    w->pg = tally_pg_new(w->cfg->pg != NULL ? w->cfg->pg : "", app);
    if (w->pg == NULL) {
        TALLY_ERROR("out of memory creating the PostgreSQL handle");
        return 1;
    }
    tally_pg_set_deadline(w->pg, w->cfg->pg_deadline_ms);
    atomic_store(&w->pg_watch, w->pg);
    long long last_warn = 0;
    for (;;) {
        tally_error_t err;
        tally_error_clear(&err);
        /* Short rounds so /healthz keeps seeing a live process while PostgreSQL is away. */
        if (tally_pg_connect(w->pg, 2000, &g_stop, &err)) {
            break;
        }
        tally_worker_heartbeat(w);
        if (g_stop) {
            return -1;
        }
        if (!err.retriable) {
            TALLY_ERROR("cannot connect to PostgreSQL: %s", err.message);
            return 1;
        }
        if (last_warn == 0 || now_ms() - last_warn >= 30000) {
            TALLY_WARN("waiting for PostgreSQL: %s", err.message);
            last_warn = now_ms();
        }
    }
    atomic_store(&w->pg_up, true);
    tally_worker_heartbeat(w);
    tally_error_t err;
    tally_error_clear(&err);
    tally_schema_window_t win;
    if (!tally_migrate_window(w->pg, &win, &err)) {
        TALLY_ERROR("cannot read the database schema version: %s", err.message);
        return 1;
    }
    char why[600];
    switch (tally_schema_fit(&win, TALLY_SCHEMA_OLDEST, tally_migrate_latest(), TALLY_VERSION, why,
                             sizeof why)) {
    case TALLY_SCHEMA_FITS:
        break;
    case TALLY_SCHEMA_FITS_OLDER:
    case TALLY_SCHEMA_FITS_NEWER:
        TALLY_WARN("%s", why);
        break;
    case TALLY_SCHEMA_TOO_OLD:
    case TALLY_SCHEMA_TOO_NEW:
        TALLY_ERROR("refusing to start: %s", why);
        return 1;
    }
    int version = win.version;
    *schema = version;
    w->schema = version;
    return check_role(w);
}

static int setup_relay(tally_worker_t *w)
{
    char errstr[512];
    w->relay = tally_relay_new(w->cfg, w->metrics, errstr, sizeof errstr);
    if (w->relay == NULL) {
        TALLY_ERROR("cannot create the outbox relay: %s", errstr);
        return 1;
    }
    tally_relay_use_refs(w->relay, w->schema >= TALLY_SCHEMA_MESSAGE_REFS);
    if (!tally_relay_start(w->relay, &g_relay_stop)) {
        TALLY_ERROR("cannot start the outbox relay thread");
        return 1;
    }
    return 0;
}

static int setup_consumer(tally_worker_t *w)
{
    if (w->ops->topics == NULL || w->ops->topics[0] == NULL) {
        return 0;
    }
    const char *names[MAX_TOPICS];
    for (size_t i = 0; w->ops->topics[i] != NULL; i++) {
        if (i == MAX_TOPICS) {
            TALLY_ERROR("a worker consumes at most %d topics", MAX_TOPICS);
            return 1;
        }
        if (!tally_config_topic(w->cfg, w->ops->topics[i], w->topics[i], TOPIC_NAME_LEN)) {
            TALLY_ERROR("topic name for '%s' with prefix '%s' is too long", w->ops->topics[i],
                        w->cfg->topic_prefix);
            return 2;
        }
        names[i] = w->topics[i];
        w->n_topics = i + 1;
    }
    if (w->cfg->consumer_group != NULL && w->cfg->consumer_group[0] != '\0') {
        snprintf(w->group, sizeof w->group, "%s", w->cfg->consumer_group);
    } else {
        /* "tally-dispatcher" for the default prefix "tally."; another prefix (a second
         * deployment on the same cluster, or a test) gets its own group, so its members never
         * rebalance with, or take partitions from, another deployment's. */
        const char *prefix = w->cfg->topic_prefix != NULL ? w->cfg->topic_prefix : "";
        size_t n = strlen(prefix);
        while (n > 0 && strchr("._-", prefix[n - 1]) != NULL) {
            n--;
        }
        if (n == 0) {
            snprintf(w->group, sizeof w->group, "tally-%s", w->ops->name);
        } else {
            /* lint: slice (the prefix without its trailing dot) */
            snprintf(w->group, sizeof w->group, "%.*s-%s", (int)n, prefix, w->ops->name);
        }
    }
    char errstr[512];
    rd_kafka_t *producer = tally_worker_producer(w);
    if (producer == NULL) {
        return 1;
    }
    if (!tally_kafka_ensure_topics(producer, names, w->n_topics, 5000, errstr, sizeof errstr)) {
        TALLY_WARN("Kafka topics not available yet (the consumer will pick them up when they "
                   "appear): %s",
                   errstr);
    }
    tally_worker_heartbeat(w);
    /* Every consuming worker reports its lag and rebalances under the same names (the dashboard
     * and the alert rules read them); the counter exists at 0 from the start. */
    w->m_lag =
        tally_metrics_gauge(w->metrics, "tally_kafka_consumer_lag",
                            "Messages not yet read, per assigned partition", "partition,topic");
    w->m_rebalances =
        tally_metrics_counter(w->metrics, "tally_kafka_rebalances_total",
                              "Consumer-group rebalances this worker took part in: partitions "
                              "assigned, or revoked (or lost)",
                              "kind");
    tally_metric_add(w->m_rebalances, 0, "assign");
    tally_metric_add(w->m_rebalances, 0, "revoke");
    w->m_read = tally_metrics_counter(w->metrics, "tally_kafka_messages_read_total",
                                      "Messages this worker read, per partition: its intake rate "
                                      "by partition",
                                      "partition,topic");
    w->consumer = tally_kafka_consumer_new(w->cfg, w->group, names, w->n_topics, w->m_rebalances,
                                           errstr, sizeof errstr);
    if (w->consumer == NULL) {
        TALLY_ERROR("cannot create the Kafka consumer: %s", errstr);
        return 1;
    }
    return 0;
}

/* --- the loop ------------------------------------------------------------------------------ */

static void run_loop(tally_worker_t *w, void *state)
{
    long long last_reconnect = 0;
    bool pg_was_up = true;
    while (!g_stop) {
        int n = w->ops->tick(w, state);
        w->ticks++;
        tally_metric_add(w->m_ticks, 1);
        if (n > 0) {
            w->work += (unsigned long long)n;
        } else if (n < 0) {
            /* The tick logged what failed; do not spin on a persistent failure. */
            w->tick_errors++;
            sleep_unless_stopped(w->cfg->poll_ms < 1000 ? w->cfg->poll_ms : 1000);
        }
        tally_worker_heartbeat(w);
        if (w->consumer != NULL && now_ms() - w->lag_at_ms >= LAG_REFRESH_MS) {
            w->lag_at_ms = now_ms();
            tally_kafka_consumer_lag(w->consumer, w->m_lag);
        }
        bool pg_up = tally_pg_ok(w->pg);
        if (!pg_up && now_ms() - last_reconnect >= 1000) {
            last_reconnect = now_ms();
            tally_error_t err;
            tally_error_clear(&err);
            if (tally_pg_connect(w->pg, 0, &g_stop, &err)) {
                pg_up = true;
            } else if (pg_was_up) {
                TALLY_WARN("lost the PostgreSQL connection, reconnecting: %s", err.message);
            }
        }
        if (pg_up != pg_was_up) {
            if (pg_up) {
                TALLY_INFO("PostgreSQL connection is back");
            }
            pg_was_up = pg_up;
        }
        atomic_store(&w->pg_up, pg_up);
    }
}

/* Call drain until it reports done or the grace period ends. @returns true when drained. */
static bool run_drain(tally_worker_t *w, void *state)
{
    if (w->ops->drain == NULL) {
        return true;
    }
    long long deadline = now_ms() + w->cfg->shutdown_grace_ms;
    for (;;) {
        bool done = w->ops->drain(w, state);
        tally_worker_heartbeat(w);
        if (done) {
            return true;
        }
        if (now_ms() >= deadline) {
            TALLY_WARN("shutdown grace period of %d ms ended with work still in flight; its "
                       "leases will expire and another worker will take it over",
                       w->cfg->shutdown_grace_ms);
            return false;
        }
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* The documented termination order: the consumer leaves its group (committing the offsets
 * stored so far), then the relay publishes what it leased and stops, then the producer flushes,
 * and the HTTP server and the database connection go last. Each step tolerates a part that
 * never started. */
static void close_all(tally_worker_t *w)
{
    /* offsets noted and not stored stay so: the partition's next owner reads them again */
    tally_consume_free(w->consume);
    w->consume = NULL;
    if (w->consumer != NULL) {
        tally_kafka_consumer_close(w->consumer);
        w->consumer = NULL;
        TALLY_DEBUG("consumer closed: left group %s", w->group);
    }
    g_relay_stop = 1;
    if (w->relay != NULL) {
        tally_relay_free(w->relay);
        w->relay = NULL;
        TALLY_DEBUG("outbox relay stopped");
    }
    if (w->producer != NULL) {
        tally_kafka_producer_close(w->producer, 5000);
        w->producer = NULL;
        TALLY_DEBUG("producer closed");
    }
    if (w->health_httpd != NULL) {
        tally_httpd_stop(w->health_httpd);
        w->health_httpd = NULL;
    }
    if (w->httpd != NULL) {
        tally_httpd_stop(w->httpd);
        w->httpd = NULL;
        TALLY_DEBUG("http server stopped");
    }
    atomic_store(&w->pg_watch, NULL);
    tally_pg_free(w->pg);
    w->pg = NULL;
}

static void join_topics(const tally_worker_t *w, char *out, size_t outsz)
{
    size_t o = 0;
    out[0] = '\0';
    if (w->n_topics == 0) {
        snprintf(out, outsz, "none");
        return;
    }
    for (size_t i = 0; i < w->n_topics && o < outsz; i++) {
        o += (size_t)snprintf(out + o, outsz - o, "%s%s", i > 0 ? "," : "", w->topics[i]);
    }
}

int tally_worker_main(int argc, char **argv, const tally_worker_ops_t *ops)
{
    static tally_worker_t worker; /* one per process: the signal flags are process-wide */
    tally_worker_t *w = &worker;
    memset(w, 0, sizeof *w);
    w->ops = ops;
    pthread_mutex_init(&w->ready_mu, NULL);
    w->ready = true;
    atomic_store(&w->heartbeat_ms, now_ms());
    atomic_store(&w->pg_up, false);
    atomic_store(&w->pg_watch, NULL);
    atomic_store(&w->pg_stalled, false);
    long long t_start = now_ms();

    char host[200] = "localhost";
    if (gethostname(host, sizeof host) != 0) {
        snprintf(host, sizeof host, "localhost");
    }
    host[sizeof host - 1] = '\0';
    snprintf(w->id, sizeof w->id, "%s:%ld", host, (long)getpid());
    tally_log_init(ops->name, w->id, TALLY_LOG_INFO);

    void *state = NULL;
    bool inited = false;
    int schema = 0;
    int rc = setup_config(w, argc, argv);
    if (rc != 0) {
        rc = rc < 0 ? 0 : rc;
        goto out;
    }
    prepare_exit_line(ops->name, w->id);
    tally_crashpoint_init(); /* a test build's TALLY_CRASH_AT, before any thread starts */
    install_signals();
    w->notify = tally_notify_new(); /* NULL unless systemd runs us as Type=notify */
    start_watchdog(w);
    if ((rc = setup_registry(w)) != 0 || (rc = setup_metrics(w)) != 0) {
        goto out;
    }
    tally_worker_heartbeat(w);
    rc = setup_pg(w, &schema);
    if (rc < 0) {
        TALLY_INFO("stopped before PostgreSQL was reachable");
        rc = 0;
        goto out;
    }
    if (rc != 0 || (rc = setup_relay(w)) != 0 || (rc = setup_consumer(w)) != 0) {
        goto out;
    }
    if (ops->init != NULL && !ops->init(w, &state)) {
        TALLY_ERROR("the %s could not initialise its state", ops->name);
        rc = 1;
        goto out;
    }
    inited = true;

    char topics[MAX_TOPICS * TOPIC_NAME_LEN];
    join_topics(w, topics, sizeof topics);
    tally_worker_heartbeat(w);
    pthread_mutex_lock(&w->ready_mu);
    w->started = true;
    pthread_mutex_unlock(&w->ready_mu);
    tally_metric_set(w->m_up, 1);
    TALLY_INFO("started: worker %s, topics %s, group %s, metrics %s, schema version %d, %zu tools",
               w->id, topics, w->n_topics > 0 ? w->group : "none", w->metrics_addr, schema,
               tally_registry_count(w->reg));
    char status[256];
    snprintf(status, sizeof status, "running: schema version %d, topics %s", schema, topics);
    tally_notify_ready(w->notify, status);

    run_loop(w, state);

    TALLY_INFO("stopping on %s: %llu ticks, %llu items of work, %llu failed ticks; draining for "
               "up to %d ms",
               g_signal == SIGINT ? "SIGINT" : "SIGTERM", w->ticks, w->work, w->tick_errors,
               w->cfg->shutdown_grace_ms);
    snprintf(status, sizeof status, "draining: up to %d ms", w->cfg->shutdown_grace_ms);
    tally_notify_stopping(w->notify, status);
    long long t_drain = now_ms();
    bool drained = run_drain(w, state);
    long long drain_ms = now_ms() - t_drain;
    if (ops->fini != NULL) {
        ops->fini(w, state);
    }
    inited = false;
    tally_metric_set(w->m_up, 0);
    stop_watchdog(w);
    close_all(w);
    TALLY_INFO("stopped: %llu ticks, %llu items of work, drain %s in %lld ms, up %lld s", w->ticks,
               w->work, drained ? "completed" : "cut short", drain_ms, (now_ms() - t_start) / 1000);
    rc = 0;

out:
    if (inited && ops->fini != NULL) {
        ops->fini(w, state);
    }
    stop_watchdog(w);
    close_all(w);
    tally_notify_free(w->notify);
    tally_metrics_free(w->metrics);
    tally_registry_free(w->reg);
    tally_keyring_free(w->keys);
    tally_config_free(w->cfg);
    pthread_mutex_destroy(&w->ready_mu);
    memset(w, 0, sizeof *w);
    return rc;
}
