/* compensate.c — the compensator's loop (DESIGN §2): obligations arrive as wake-ups on
 * <prefix>obligations and as NOTIFY tally_obligations, and a sweep every TALLY_SWEEP_MS finds
 * due retries, expired leases, late confirmations and settled runs. Each turn leases what may
 * run now, starts the reverse calls (libcurl multi, many at once), waits on curl, PostgreSQL
 * and Kafka together, and records what finished. Kafka offsets are stored only after the
 * round the wake-ups caused. The pager runs beside it on its own thread (pager.c). */
#include "compensator.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "tally/log.h"

double comp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void declare_metrics(compensator_t *c, tally_metrics_t *m)
{
    c->m_obligations =
        tally_metrics_gauge(m, "tally_obligations",
                            "Obligations in the ledger by state (the terminal states are "
                            "counted again 10-60 s apart, the live ones on every sweep)",
                            "state");
    c->m_stuck = tally_metrics_gauge(m, "tally_stuck_obligations",
                                     "Obligations that are STUCK: a human must decide", NULL);
    c->m_drain = tally_metrics_histogram(
        m, "tally_obligation_drain_seconds",
        "From an obligation's creation to its terminal state (RESOLVED, SKIPPED, "
        "UNCOMPENSATABLE)",
        NULL, tally_latency_buckets, tally_n_latency_buckets);
    c->m_reverse = tally_metrics_histogram(m, "tally_reverse_call_seconds",
                                           "Latency of reverse and containment calls", "tool",
                                           tally_latency_buckets, tally_n_latency_buckets);
    c->m_alerts = tally_metrics_counter(
        m, "tally_alerts_sent_total",
        "Pages raised by this worker (kafka: alert events written) and delivered (pagerduty)",
        "channel");
    c->m_alert_fail = tally_metrics_counter(
        m, "tally_alert_write_failures_total",
        "Pages that PostgreSQL refused to write (each is retried at once as a minimal page)",
        "worker");
    c->m_outcomes =
        tally_metrics_counter(m, "tally_compensations_total",
                              "Obligation outcomes recorded, by tool and state", "tool,outcome");
    c->m_lease_lost = tally_metrics_counter(
        m, "tally_obligation_lease_lost_total",
        "Outcomes not written because another worker had taken the lease over", NULL);
    c->m_inflight = tally_metrics_gauge(m, "tally_compensator_inflight",
                                        "Reverse and containment calls in flight", NULL);
    c->m_db_errors = tally_metrics_counter(m, "tally_compensator_db_errors_total",
                                           "PostgreSQL errors by step", "step");
    c->m_runs = tally_metrics_counter(m, "tally_runs_settled_total",
                                      "Run compensations settled, by outcome", "status");
    tally_metric_set(c->m_stuck, 0);
    tally_metric_add(c->m_alerts, 0, "kafka");
    tally_metric_add(c->m_alerts, 0, "pagerduty");
    tally_metric_add(c->m_alert_fail, 0, "compensator");
}

/* Tools whose compensation waits for approval (the decision table says so before approval). */
static char *approval_tools(const tally_registry_t *reg)
{
    json_t *list = json_array();
    for (size_t i = 0; list != NULL && i < tally_registry_count(reg); i++) {
        const tally_tool_t *t = tally_registry_at(reg, i);
        tally_comp_decision_t dec;
        tally_comp_decide(t, t->name, t->effect_class, false, &dec);
        if (dec.action == TALLY_COMP_ACT_AWAIT_APPROVAL) {
            json_array_append_new(list, json_string(t->name));
        }
    }
    char *text = list != NULL ? json_dumps(list, JSON_COMPACT) : NULL;
    json_decref(list);
    return text;
}

static void raise_fd_limit(int want)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
        return;
    }
    rlim_t need = (rlim_t)want + 256;
    if (rl.rlim_cur >= need) {
        return;
    }
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > need ? need : rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur < need) {
        TALLY_WARN("open-file limit %llu is below the %d calls TALLY_MAX_INFLIGHT allows",
                   (unsigned long long)rl.rlim_cur, want);
    }
}

static void compensator_fini(tally_worker_t *w, void *state);

static bool setup(compensator_t *c, tally_worker_t *w);

static bool compensator_init(tally_worker_t *w, void **state)
{
    compensator_t *c = calloc(1, sizeof *c);
    if (c == NULL) {
        TALLY_ERROR("out of memory");
        return false;
    }
    c->kafka_pipe[0] = c->kafka_pipe[1] = -1;
    if (!setup(c, w)) {
        /* the worker calls fini only after a successful init */
        compensator_fini(w, c);
        return false;
    }
    *state = c;
    return true;
}

static bool setup(compensator_t *c, tally_worker_t *w)
{
    c->w = w;
    c->cfg = tally_worker_config(w);
    c->reg = tally_worker_registry(w);
    c->pg = tally_worker_pg(w);
    c->rk = tally_worker_consumer(w);
    c->worker_id = tally_worker_id(w);
    c->rand_state = (unsigned)time(NULL) ^ (unsigned)getpid();
    snprintf(c->source, sizeof c->source, "/tally/compensator/%s", c->worker_id);
    declare_metrics(c, tally_worker_metrics(w));
    c->approval_tools = approval_tools(c->reg);
    c->settle_runs = json_array();
    c->offsets = rd_kafka_topic_partition_list_new(8);
    if (c->approval_tools == NULL || c->settle_runs == NULL || c->offsets == NULL) {
        TALLY_ERROR("out of memory");
        return false;
    }
    for (size_t i = 0; i < tally_registry_count(c->reg); i++) {
        const tally_tool_t *t = tally_registry_at(c->reg, i);
        if (t->secret_env != NULL && t->secret_env[0] != '\0' && getenv(t->secret_env) == NULL &&
            (t->compensate.path != NULL || t->contain.path != NULL)) {
            TALLY_WARN("tool '%s' signs its requests with %s, which is not set: its reverse "
                       "calls are retried until it is, then go STUCK",
                       t->name, t->secret_env);
        }
    }

    raise_fd_limit(c->cfg->max_inflight);
    char errstr[256];
    c->conn = tally_connector_new(c->cfg->max_inflight, 0, errstr, sizeof errstr);
    if (c->conn == NULL) {
        TALLY_ERROR("connector engine: %s", errstr);
        return false;
    }
    tally_error_t err;
    tally_error_clear(&err);
    if (!tally_pg_listen(c->pg, "tally_obligations", &err)) {
        TALLY_ERROR("LISTEN tally_obligations: %s", err.message);
        return false;
    }
    if (c->rk != NULL) {
        /* librdkafka writes a byte when the consumer queue becomes non-empty, so one wait
         * covers curl, PostgreSQL and Kafka */
        c->queue = rd_kafka_queue_get_consumer(c->rk);
        if (c->queue == NULL || pipe2(c->kafka_pipe, O_NONBLOCK | O_CLOEXEC) != 0) {
            TALLY_ERROR("consumer queue wake-up pipe: %s",
                        c->queue != NULL ? strerror(errno) : "no consumer queue");
            return false;
        }
        rd_kafka_queue_io_event_enable(c->queue, c->kafka_pipe[1], "k", 1);
    }
    c->pager = comp_pager_start(c->cfg, c->worker_id, tally_worker_metrics(w), c->m_alerts,
                                tally_worker_stop_flag(w), errstr, sizeof errstr);
    if (c->pager == NULL) {
        TALLY_ERROR("pager: %s", errstr);
        return false;
    }
    c->lease_wanted = true;
    TALLY_INFO("compensator ready: %zu tools (%s need approval to compensate), %d calls in "
               "flight at most, sweep every %d ms",
               tally_registry_count(c->reg), c->approval_tools, c->cfg->max_inflight,
               c->cfg->sweep_ms);
    return true;
}

/* Wake-ups from <prefix>obligations: PostgreSQL holds the obligations, so a message only says
 * "look now". Offsets are stored after the round that looked. */
static int read_wakeups(compensator_t *c)
{
    if (c->rk == NULL) {
        return 0;
    }
    int n = 0;
    int batch = c->cfg->batch_size > 0 ? c->cfg->batch_size : 1;
    while (n < batch) {
        rd_kafka_message_t *msg = rd_kafka_consumer_poll(c->rk, 0);
        if (msg == NULL) {
            break;
        }
        if (msg->err != RD_KAFKA_RESP_ERR_NO_ERROR) {
            if (msg->err != RD_KAFKA_RESP_ERR__PARTITION_EOF) {
                TALLY_WARN("consumer: %s", rd_kafka_message_errstr(msg));
            }
            rd_kafka_message_destroy(msg);
            continue;
        }
        const char *topic = rd_kafka_topic_name(msg->rkt);
        rd_kafka_topic_partition_t *tp =
            rd_kafka_topic_partition_list_find(c->offsets, topic, msg->partition);
        if (tp == NULL) {
            tp = rd_kafka_topic_partition_list_add(c->offsets, topic, msg->partition);
        }
        if (msg->offset + 1 > tp->offset) {
            tp->offset = msg->offset + 1;
        }
        rd_kafka_message_destroy(msg);
        n++;
    }
    if (n > 0) {
        c->lease_wanted = true;
    }
    return n;
}

static void store_offsets(compensator_t *c)
{
    if (c->rk == NULL || c->offsets->cnt == 0) {
        return;
    }
    rd_kafka_resp_err_t err = rd_kafka_offsets_store(c->rk, c->offsets);
    if (err != RD_KAFKA_RESP_ERR_NO_ERROR) {
        /* a partition revoked meanwhile: its wake-ups come again, which is harmless */
        TALLY_DEBUG("storing consumer offsets: %s", rd_kafka_err2str(err));
    }
    rd_kafka_topic_partition_list_destroy(c->offsets);
    c->offsets = rd_kafka_topic_partition_list_new(8);
}

static void drain_pipe(int fd)
{
    char buf[256];
    while (read(fd, buf, sizeof buf) > 0) {
    }
}

/* Wait for curl, a NOTIFY or Kafka, up to @p timeout_ms, and collect finished calls. */
static int wait_and_collect(compensator_t *c, int timeout_ms)
{
    struct curl_waitfd fds[2];
    unsigned n = 0;
    PGconn *conn = tally_pg_conn(c->pg);
    int pgfd = conn != NULL ? PQsocket(conn) : -1;
    if (pgfd >= 0) {
        fds[n++] = (struct curl_waitfd){.fd = pgfd, .events = CURL_WAIT_POLLIN};
    }
    if (c->kafka_pipe[0] >= 0) {
        fds[n++] = (struct curl_waitfd){.fd = c->kafka_pipe[0], .events = CURL_WAIT_POLLIN};
    }
    tally_error_t err;
    tally_error_clear(&err);
    int done = tally_connector_poll(c->conn, fds, n, timeout_ms, comp_on_done, c, &err);
    if (done < 0) {
        TALLY_ERROR("connector: %s", err.message);
    }
    if (c->kafka_pipe[0] >= 0) {
        drain_pipe(c->kafka_pipe[0]);
    }
    if (tally_pg_wait_notify(c->pg, 0) > 0) {
        c->lease_wanted = true;
    }
    tally_metric_set(c->m_inflight, tally_connector_inflight(c->conn));
    return done > 0 ? done : 0;
}

static int next_timeout_ms(compensator_t *c, double now, int work)
{
    if (work > 0) {
        return 0;
    }
    if (c->queue != NULL && rd_kafka_queue_length(c->queue) > 0) {
        return 0;
    }
    double until = now + c->cfg->poll_ms / 1000.0;
    if (!c->draining && c->next_sweep < until) {
        until = c->next_sweep;
    }
    if (c->n_done > 0 && c->record_retry_at < until) {
        until = c->record_retry_at;
    }
    double ms = (until - now) * 1000.0;
    return ms <= 0 ? 0 : (int)ms + 1;
}

/* Record finished calls, then settle the runs whose obligations moved. */
static int record_and_settle(compensator_t *c)
{
    int work = 0;
    if (c->n_done > 0 && comp_now() >= c->record_retry_at) {
        int n = comp_record(c);
        if (n > 0) {
            work += n;
            c->lease_wanted = true; /* a settled step may free an earlier one */
        }
    }
    if (json_array_size(c->settle_runs) > 0) {
        int n = comp_settle(c, c->settle_runs);
        if (n >= 0) {
            json_array_clear(c->settle_runs);
            work += n;
        }
        /* on an error the runs stay listed; the sweep settles them too */
    }
    return work;
}

static int compensator_tick(tally_worker_t *w, void *state)
{
    compensator_t *c = state;
    int work = 0;
    int n = read_wakeups(c);
    work += n;
    double now = comp_now();
    if (now >= c->next_sweep) {
        c->next_sweep = now + c->cfg->sweep_ms / 1000.0;
        work += comp_sweep(c);
        c->lease_wanted = true;
    }
    work += record_and_settle(c);
    if (c->lease_wanted) {
        c->lease_wanted = false;
        n = comp_lease(c);
        if (n >= 0) {
            store_offsets(c);
            work += n;
            /* a full batch: more may be waiting */
            c->lease_wanted = n >= c->cfg->batch_size;
        }
    }
    work += wait_and_collect(c, next_timeout_ms(c, comp_now(), work + (int)c->n_done));
    work += record_and_settle(c);
    tally_worker_heartbeat(w);
    return work;
}

/* SIGTERM: lease nothing more, let the calls in flight finish and record them. Calls still
 * running when the grace period ends are abandoned: their leases expire and another worker
 * repeats them with the same idempotency key. */
static bool compensator_drain(tally_worker_t *w, void *state)
{
    compensator_t *c = state;
    if (!c->draining) {
        c->draining = true;
        TALLY_INFO("draining: %d reverse calls in flight, %zu outcomes to record",
                   tally_connector_inflight(c->conn), c->n_done);
    }
    if (c->rk != NULL) {
        rd_kafka_poll(c->rk, 0);
    }
    wait_and_collect(c, c->n_done > 0 ? 0 : 100);
    (void)record_and_settle(c);
    tally_worker_heartbeat(w);
    bool done = tally_connector_inflight(c->conn) == 0 && c->n_done == 0;
    if (done) {
        TALLY_INFO("drained: every reverse call finished and was recorded");
    }
    return done;
}

static void compensator_fini(tally_worker_t *w, void *state)
{
    (void)w;
    compensator_t *c = state;
    if (c == NULL) {
        return;
    }
    comp_pager_stop(c->pager);
    int left = c->conn != NULL ? tally_connector_inflight(c->conn) : 0;
    if (left > 0 || c->n_done > 0) {
        TALLY_WARN("exiting with %d reverse calls in flight and %zu unrecorded outcomes: their "
                   "leases will expire and another compensator repeats them with the same "
                   "idempotency keys",
                   left, c->n_done);
    }
    tally_connector_free(c->conn, comp_ob_free);
    for (size_t i = 0; i < c->n_done; i++) {
        comp_outcome_clear(&c->done[i]);
    }
    free(c->done);
    if (c->queue != NULL) {
        rd_kafka_queue_io_event_enable(c->queue, -1, NULL, 0);
        rd_kafka_queue_destroy(c->queue);
    }
    if (c->kafka_pipe[0] >= 0) {
        close(c->kafka_pipe[0]);
    }
    if (c->kafka_pipe[1] >= 0) {
        close(c->kafka_pipe[1]);
    }
    if (c->offsets != NULL) {
        rd_kafka_topic_partition_list_destroy(c->offsets);
    }
    json_decref(c->settle_runs);
    free(c->approval_tools);
    free(c);
}

static const char *const compensator_topics[] = {"obligations", NULL};

const tally_worker_ops_t tally_compensator_ops = {
    .name = "compensator",
    .summary = "Runs compensations (reverse actions) for obligations, last step first.",
    .topics = compensator_topics,
    .init = compensator_init,
    .tick = compensator_tick,
    .drain = compensator_drain,
    .fini = compensator_fini,
};
