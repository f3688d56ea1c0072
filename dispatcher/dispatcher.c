/* dispatcher.c — the dispatcher's loop (DESIGN §2): take intents in, claim and call, record,
 * and wait on curl, PostgreSQL (LISTEN tally_outbox) and the Kafka queue at once. Also
 * backpressure (pause intake when the outbox backlog or the calls in flight are too many),
 * the worker's metrics, and the SIGTERM drain. */
#include <errno.h>
#include <malloc.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "dispatcher.h"
#include "tally/alert.h"
#include "tally/ledger.h"
#include "tally/log.h"

/* Backpressure only needs to know whether the backlog passed the limit: counting stops one
 * row past it ($1), so a large backlog does not cost a full scan every second. */
static const char SQL_BACKLOG[] = "SELECT count(*) FROM (SELECT 1 FROM outbox LIMIT $1) b";
/* Live states only: they are few and indexed (effects_status_idx), while counting the
 * terminal ones would scan a table that only grows, from every dispatcher, every few seconds.
 * Terminal outcomes are counted by tally_connector_calls_total and the relay's counters. */
static const char SQL_EFFECTS_BY_STATE[] =
    "SELECT tool, status, count(*) FROM effects"
    " WHERE status IN ('PLANNED', 'AWAITING_APPROVAL', 'DISPATCHING', 'UNKNOWN', 'STUCK')"
    " GROUP BY tool, status";

#define EFFECTS_REFRESH_S 5.0
#define BACKLOG_REFRESH_S 1.0

double dispatch_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

void dispatch_spent(dispatcher_t *d, const char *phase, double since)
{
    double s = dispatch_now() - since;
    if (s > 0)
        tally_metric_add(d->m_seconds, s, phase);
}

/* ---------------------------------------------------------------------------------------- */
/* Backpressure                                                                             */

static void set_paused(dispatcher_t *d, bool pause, const char *why)
{
    if (!d->rk)
        return;
    rd_kafka_topic_partition_list_t *parts = NULL;
    if (rd_kafka_assignment(d->rk, &parts) != RD_KAFKA_RESP_ERR_NO_ERROR || !parts)
        return;
    if (parts->cnt > 0) {
        rd_kafka_resp_err_t err = pause ? rd_kafka_pause_partitions(d->rk, parts)
                                        : rd_kafka_resume_partitions(d->rk, parts);
        if (err)
            TALLY_WARN("%s %d partitions: %s", pause ? "pausing" : "resuming", parts->cnt,
                       rd_kafka_err2str(err));
    }
    rd_kafka_topic_partition_list_destroy(parts);
    if (pause != d->paused)
        TALLY_INFO("intake %s: %s", pause ? "paused" : "resumed", why);
    d->paused = pause;
    d->paused_at = dispatch_now();
    tally_metric_set(d->m_paused, pause ? 1 : 0);
}

static void refresh_backlog(dispatcher_t *d, double now)
{
    if (now - d->backlog_at < BACKLOG_REFRESH_S)
        return;
    d->backlog_at = now;
    tally_error_t err;
    tally_error_clear(&err);
    char cap[24];
    snprintf(cap, sizeof cap, "%lld", (long long)d->cfg->backlog_limit + 1);
    const char *params[1] = {cap};
    PGresult *res = tally_pg_exec(d->pg, SQL_BACKLOG, 1, params, &err);
    if (!res) {
        TALLY_DEBUG("outbox backlog not refreshed: %s", err.message);
        return;
    }
    d->backlog = atoll(PQgetvalue(res, 0, 0));
    PQclear(res);
    tally_metric_set(d->m_backlog, (double)d->backlog);
}

/* Stop fetching intents while the outbox holds more than backlog_limit rows, or while every
 * call slot is busy and work is already queued; resume below three quarters of the limit.
 * A held (failed) intake batch also pauses intake until it is written. Paused partitions are
 * re-paused once a second so partitions assigned meanwhile are held too. */
static void backpressure(dispatcher_t *d, double now)
{
    long long limit = d->cfg->backlog_limit;
    bool saturated = tally_connector_inflight(d->conn) >= d->cfg->max_inflight &&
                     d->backlog >= d->cfg->batch_size;
    bool over = d->backlog > limit || saturated || d->intake_failed;
    bool under = d->backlog <= limit * 3 / 4 && !saturated && !d->intake_failed;
    if (!d->paused && over) {
        char why[160];
        if (d->intake_failed)
            snprintf(why, sizeof why, "holding a batch the database refused");
        else
            snprintf(why, sizeof why, "outbox backlog %lld (limit %lld), %d calls in flight",
                     d->backlog, limit, tally_connector_inflight(d->conn));
        set_paused(d, true, why);
    } else if (d->paused && under) {
        set_paused(d, false, "backlog drained");
    } else if (d->paused && now - d->paused_at >= 1.0) {
        set_paused(d, true, "still over the limit");
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Metrics                                                                                  */

static void refresh_effects(dispatcher_t *d, double now)
{
    if (now - d->effects_at < EFFECTS_REFRESH_S)
        return;
    d->effects_at = now;
    tally_error_t err;
    tally_error_clear(&err);
    PGresult *res = tally_pg_exec(d->pg, SQL_EFFECTS_BY_STATE, 0, NULL, &err);
    if (!res)
        return;
    tally_metric_reset(d->m_effects);
    for (int row = 0; row < PQntuples(res); row++)
        tally_metric_set(d->m_effects, atof(PQgetvalue(res, row, 2)), PQgetvalue(res, row, 0),
                         PQgetvalue(res, row, 1));
    PQclear(res);
}

static void declare_metrics(dispatcher_t *d, tally_metrics_t *m)
{
    d->m_effects =
        tally_metrics_gauge(m, "tally_effects", "Effects by tool and state", "tool,state");
    d->m_intents = tally_metrics_counter(m, "tally_intents_total",
                                         "Intents-topic messages by what became of them", "result");
    d->m_dlq = tally_metrics_counter(m, "tally_dlq_total", "Messages sent to the DLQ", "reason");
    d->m_dispatch_seconds = tally_metrics_histogram(
        m, "tally_dispatch_seconds", "Claim to recorded outcome of one dispatch", NULL,
        tally_latency_buckets, tally_n_latency_buckets);
    d->m_connector_seconds =
        tally_metrics_histogram(m, "tally_connector_seconds", "Connector call latency", "tool",
                                tally_latency_buckets, tally_n_latency_buckets);
    d->m_calls = tally_metrics_counter(m, "tally_connector_calls_total",
                                       "Connector calls by tool and verdict", "tool,outcome");
    d->m_inflight =
        tally_metrics_gauge(m, "tally_inflight_calls", "Connector calls in flight", NULL);
    d->m_tool_inflight = tally_metrics_gauge(m, "tally_connector_inflight",
                                             "Connector calls in flight, by tool", "tool");
    d->m_backlog = tally_metrics_gauge(
        m, "tally_dispatch_backlog",
        "Effects waiting in the dispatch outbox (due or not), counted up to the backlog limit + 1",
        NULL);
    d->m_lease_lost = tally_metrics_counter(
        m, "tally_lease_lost_total", "Results dropped because the lease was taken over", NULL);
    d->m_paused = tally_metrics_gauge(m, "tally_intake_paused",
                                      "1 while intake is paused by backpressure", NULL);
    d->m_db_errors = tally_metrics_counter(m, "tally_dispatcher_db_errors_total",
                                           "Failed dispatcher transactions by stage", "stage");
    d->m_alert_fail = tally_alert_failures_counter(m, "dispatcher");
    /* Where a dispatcher's time goes (bench/README.md, "The mock broker"): the main loop's
     * kafka, intake, claim and wait add up to its wall time; record is the recorder's thread. */
    d->m_seconds = tally_metrics_counter(
        m, "tally_dispatcher_seconds_total",
        "Time spent by phase: reading intents from Kafka (kafka), writing them (intake), "
        "claiming (claim), waiting for work (wait), recording results (record, its own thread)",
        "phase");
    static const char *const phases[] = {"kafka", "intake", "claim", "wait", "record"};
    for (size_t i = 0; i < sizeof phases / sizeof phases[0]; i++)
        tally_metric_add(d->m_seconds, 0, phases[i]);
    /* The series a dashboard rates exist at 0 from the start: rate() and increase() cannot see
     * the event that creates a series, such as a tool's first failed call since the start. */
    static const char *const results[] = {"created", "replay",     "conflict",
                                          "dlq",     "cancel_run", "compensate_run"};
    for (size_t i = 0; i < sizeof results / sizeof results[0]; i++)
        tally_metric_add(d->m_intents, 0, results[i]);
    for (int r = TALLY_DLQ_TOO_LARGE; r <= TALLY_DLQ_INVALID_REPLY_TO; r++)
        tally_metric_add(d->m_dlq, 0, tally_dlq_reason_name((tally_dlq_reason_t)r));
    static const tally_verdict_t verdicts[] = {TALLY_VERDICT_CONFIRMED, TALLY_VERDICT_FAILED,
                                               TALLY_VERDICT_RETRY, TALLY_VERDICT_UNKNOWN};
    for (size_t t = 0; t < tally_registry_count(d->reg); t++) {
        const char *tool = tally_registry_at(d->reg, t)->name;
        for (size_t i = 0; i < sizeof verdicts / sizeof verdicts[0]; i++)
            tally_metric_add(d->m_calls, 0, tool, tally_verdict_name(verdicts[i]));
        tally_metric_add(d->m_calls, 0, tool, "not_started");
        tally_metric_set(d->m_tool_inflight, 0, tool);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Lifecycle                                                                                */

/* 5,000 calls in flight need 5,000 sockets: lift the soft descriptor limit to the hard one. */
static void raise_fd_limit(int want)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    rlim_t need = (rlim_t)want + 256;
    if (rl.rlim_cur >= need)
        return;
    rlim_t target = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > need ? need : rl.rlim_max;
    rl.rlim_cur = target;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0 || target < need)
        TALLY_WARN("open-file limit %llu is below the %d calls TALLY_MAX_INFLIGHT allows",
                   (unsigned long long)target, want);
}

static bool dispatcher_init(tally_worker_t *w, void **state)
{
    dispatcher_t *d = calloc(1, sizeof *d);
    if (!d) {
        TALLY_ERROR("out of memory");
        return false;
    }
    d->rec_pipe[0] = d->rec_pipe[1] = -1;
    d->w = w;
    d->cfg = tally_worker_config(w);
    d->reg = tally_worker_registry(w);
    d->keys = tally_worker_keyring(w);
    for (size_t i = 0; i < tally_registry_count(d->reg); i++)
        d->any_sensitive = d->any_sensitive || tally_tool_sensitive(tally_registry_at(d->reg, i));
    d->pg = tally_worker_pg(w);
    d->rk = tally_worker_consumer(w);
    d->worker_id = tally_worker_id(w);
    snprintf(d->source, sizeof d->source, TALLY_CE_DISPATCHER_SOURCE "%s", d->worker_id);
    *state = d;
    declare_metrics(d, tally_worker_metrics(w));

    raise_fd_limit(d->cfg->max_inflight);
    char errstr[256];
    d->conn = tally_connector_new(d->cfg->max_inflight, 0, errstr, sizeof errstr);
    if (!d->conn) {
        TALLY_ERROR("connector engine: %s", errstr);
        return false;
    }
    if (!recorder_start(d))
        return false;
    /* Calls progress on the connector's thread while this one waits on PostgreSQL. */
    if (!tally_connector_start(d->conn, deliver_on_done, d, errstr, sizeof errstr)) {
        TALLY_ERROR("connector engine: %s", errstr);
        return false;
    }
    tally_error_t err;
    tally_error_clear(&err);
    if (!tally_pg_listen(d->pg, "tally_outbox", &err)) {
        TALLY_ERROR("LISTEN tally_outbox: %s", err.message);
        return false;
    }
    /* One wait covers Kafka too: the consumer's wake-up pipe (consume.h). */
    if (d->rk && (d->cs = tally_worker_consume(w)) == NULL)
        return false;
    d->claim_wanted = true;
    TALLY_INFO("dispatcher ready: %zu tools, %d calls in flight at most, batches of %d",
               tally_registry_count(d->reg), d->cfg->max_inflight, d->cfg->batch_size);
    return true;
}

/* Wait for a NOTIFY on tally_outbox, the Kafka queue or the recorder, up to timeout_ms. The
 * calls run on the connector's own thread and reach the recorder from there; the recorder's
 * pipe says when results were written (and room freed). @returns results written. */
static int wait_and_collect(dispatcher_t *d, int timeout_ms)
{
    struct pollfd fds[3];
    nfds_t n = 0;
    PGconn *conn = tally_pg_conn(d->pg);
    int pgfd = conn ? PQsocket(conn) : -1;
    if (pgfd >= 0)
        fds[n++] = (struct pollfd){.fd = pgfd, .events = POLLIN};
    if (d->cs)
        fds[n++] = (struct pollfd){.fd = tally_consume_fd(d->cs), .events = POLLIN};
    fds[n++] = (struct pollfd){.fd = d->rec_pipe[0], .events = POLLIN};
    if (poll(fds, n, timeout_ms) < 0 && errno != EINTR)
        TALLY_ERROR("poll: %s", strerror(errno));
    if (d->cs)
        (void)tally_consume_ready(d->cs); /* empties the pipe */
    /* Notifications may also have arrived with an earlier statement's results. */
    if (tally_pg_wait_notify(d->pg, 0) > 0)
        d->claim_wanted = true;
    return recorder_collect(d);
}

static int next_timeout_ms(dispatcher_t *d, double now, int work)
{
    if (work > 0 || d->intake_more)
        return 0;
    if (d->cs && !d->paused && !d->intake_failed && tally_consume_ready(d->cs))
        return 0;
    if (d->claim_wanted && tally_connector_inflight(d->conn) < d->cfg->max_inflight)
        return 0;
    double until = now + d->cfg->poll_ms / 1000.0;
    if (d->next_sweep < until)
        until = d->next_sweep;
    if (d->intake_failed && d->intake_retry_at < until)
        until = d->intake_retry_at;
    double ms = (until - now) * 1000.0;
    if (ms < 0)
        return 0;
    return (int)ms + 1;
}

/* A burst leaves the heap full of freed chunks between live ones, which glibc only gives back
 * from its top: after a second without work (and at most every TRIM_EVERY_S), hand every free
 * page back. Calls held open by a slow tool count as idle, so the memory a dispatcher holds
 * then is what its calls need, not what its last burst needed. */
#define TRIM_IDLE_S  1.0
#define TRIM_EVERY_S 10.0
static void trim_when_idle(dispatcher_t *d, int work)
{
    double now = dispatch_now();
    if (work > 0) {
        d->busy_at = now;
        d->trim_wanted = true;
        return;
    }
    if (!d->trim_wanted || now - d->busy_at < TRIM_IDLE_S || now - d->trimmed_at < TRIM_EVERY_S)
        return;
    malloc_trim(0);
    d->trim_wanted = false;
    d->trimmed_at = now;
}

static int dispatcher_tick(tally_worker_t *w, void *state)
{
    dispatcher_t *d = state;
    double now = dispatch_now();
    refresh_backlog(d, now);
    backpressure(d, now);
    refresh_effects(d, now);

    /* The recorder is the last stage: while a full batch of results waits for it, taking more
     * work would only lengthen its queue and the time every result waits there. Intake and
     * claims wait for its next batch instead (its pipe wakes the loop). */
    bool behind = recorder_pending(d) >= (size_t)(d->cfg->batch_size > 0 ? d->cfg->batch_size : 1);
    int work = 0;
    if (!behind) {
        int n = intake_step(d);
        if (n > 0)
            work += n;
        double t = dispatch_now();
        n = deliver_claim(d);
        dispatch_spent(d, "claim", t);
        if (n > 0)
            work += n;
    }
    double t = dispatch_now();
    int timeout = behind ? d->cfg->poll_ms : next_timeout_ms(d, t, work);
    work += wait_and_collect(d, timeout);
    dispatch_spent(d, "wait", t);
    trim_when_idle(d, work);
    tally_worker_heartbeat(w);
    return work;
}

/* SIGTERM: stop intake (the held batch is dropped uncommitted; Kafka delivers it again),
 * let the calls in flight finish and record them. Calls still running when the grace period
 * ends are left to lease expiry. */
static bool dispatcher_drain(tally_worker_t *w, void *state)
{
    dispatcher_t *d = state;
    if (!d->draining) {
        d->draining = true;
        intake_discard(d);
        set_paused(d, true, "shutting down");
        TALLY_INFO("draining: %d calls in flight, %zu results to record",
                   tally_connector_inflight(d->conn), recorder_pending(d));
    }
    /* Serve rebalances and errors. Partitions are paused; anything still queued is dropped
     * unstored and read again by the partition's next owner. */
    if (d->cs)
        tally_consume_serve(d->cs);
    wait_and_collect(d, 100);
    tally_worker_heartbeat(w);
    bool done = tally_connector_inflight(d->conn) == 0 && recorder_pending(d) == 0;
    if (done)
        TALLY_INFO("drained: every call finished and was recorded");
    return done;
}

static void dispatcher_fini(tally_worker_t *w, void *state)
{
    (void)w;
    dispatcher_t *d = state;
    if (!d)
        return;
    int left = d->conn ? tally_connector_inflight(d->conn) : 0;
    size_t unrecorded = d->rec_init ? recorder_pending(d) : 0;
    if (left > 0 || unrecorded > 0)
        TALLY_WARN("exiting with %d calls in flight and %zu unrecorded results: their leases "
                   "will expire and the reconciler will resolve them",
                   left, unrecorded);
    /* No result arrives once the connector's thread has stopped; the recorder then writes what
     * it holds (it stops once its queue is empty) before the calls still in flight are
     * abandoned. */
    tally_connector_stop(d->conn);
    recorder_stop(d);
    tally_connector_free(d->conn, dispatch_call_free);
    intake_discard(d);
    free(d->batch);
    free(d);
}

static const char *const dispatcher_topics[] = {"intents", NULL};

const tally_worker_ops_t tally_dispatcher_ops = {
    .name = "dispatcher",
    .summary = "Records agents' intents in the ledger and delivers them to the tools.",
    .topics = dispatcher_topics,
    .init = dispatcher_init,
    .tick = dispatcher_tick,
    .drain = dispatcher_drain,
    .fini = dispatcher_fini,
};
