/* kafka.c — librdkafka producer and consumer set-up from the tally configuration. */
#include "tally/kafka.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "tally/log.h"
#include "tally/metrics.h"

/* librdkafka logs with syslog levels (0 emergency .. 7 debug) from its own threads. */
static void log_cb(const rd_kafka_t *rk, int level, const char *fac, const char *buf)
{
    tally_log_level_t lv = level <= 3   ? TALLY_LOG_ERROR
                           : level <= 4 ? TALLY_LOG_WARN
                           : level <= 6 ? TALLY_LOG_INFO
                                        : TALLY_LOG_DEBUG;
    /* TALLY_KAFKA_* applies to every client of a process, so a consumer property reaching a
     * producer (and the reverse) is expected, not a problem to warn about */
    if (strcmp(fac, "CONFWARN") == 0 && strstr(buf, "will be ignored by this") != NULL)
        lv = TALLY_LOG_DEBUG;
    /* a broker that cannot be reached is transient (the client retries); error_cb sees it too */
    if (strcmp(fac, "FAIL") == 0 && lv == TALLY_LOG_ERROR)
        lv = TALLY_LOG_WARN;
    tally_log_write(lv, "librdkafka", 0, NULL, "%s: %s: %s", rd_kafka_name(rk), fac, buf);
}

/* Client-level errors, served by rd_kafka_poll()/rd_kafka_consumer_poll(). Most are transient
 * (the client retries on its own); a fatal error makes the instance unusable. */
static void error_cb(rd_kafka_t *rk, int err, const char *reason, void *opaque)
{
    (void)opaque;
    if (err == RD_KAFKA_RESP_ERR__FATAL) {
        char why[512];
        rd_kafka_resp_err_t orig = rd_kafka_fatal_error(rk, why, sizeof(why));
        TALLY_ERROR("%s: fatal Kafka error %s: %s", rd_kafka_name(rk), rd_kafka_err2name(orig),
                    why);
        return;
    }
    TALLY_WARN("%s: Kafka: %s (%s)", rd_kafka_name(rk), reason,
               rd_kafka_err2name((rd_kafka_resp_err_t)err));
}

/* The environment variable a property came from, for error messages: "security.protocol" ->
 * "TALLY_KAFKA_SECURITY_PROTOCOL". */
static void env_name(const char *prop, char *out, size_t outsz)
{
    size_t n = (size_t)snprintf(out, outsz, "TALLY_KAFKA_");
    for (const char *p = prop; *p && n + 1 < outsz; p++)
        out[n++] = *p == '.' ? '_' : (char)toupper((unsigned char)*p);
    out[n < outsz ? n : outsz - 1] = '\0';
}

static bool conf_set(rd_kafka_conf_t *conf, const char *name, const char *value, const char *origin,
                     char *errstr, size_t errsz)
{
    char why[256];
    if (rd_kafka_conf_set(conf, name, value, why, sizeof(why)) == RD_KAFKA_CONF_OK)
        return true;
    snprintf(errstr, errsz, "Kafka property '%s' (from %s): %s", name, origin, why);
    return false;
}

static bool passed_through(const tally_config_t *cfg, const char *name)
{
    for (size_t i = 0; i < cfg->n_kafka_props; i++)
        if (strcmp(cfg->kafka_props[i].name, name) == 0)
            return true;
    return false;
}

rd_kafka_conf_t *tally_kafka_conf_new(const tally_config_t *cfg, char *errstr, size_t errsz)
{
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    if (conf == NULL) {
        snprintf(errstr, errsz, "out of memory creating a Kafka configuration");
        return NULL;
    }
    rd_kafka_conf_set_log_cb(conf, log_cb);
    rd_kafka_conf_set_error_cb(conf, error_cb);
    if (cfg->kafka_brokers && *cfg->kafka_brokers &&
        !conf_set(conf, "bootstrap.servers", cfg->kafka_brokers, "TALLY_KAFKA_BROKERS", errstr,
                  errsz))
        goto fail;
    if (cfg->worker_id && *cfg->worker_id &&
        !conf_set(conf, "client.id", cfg->worker_id, "TALLY_WORKER_ID", errstr, errsz))
        goto fail;
    for (size_t i = 0; i < cfg->n_kafka_props; i++) {
        char origin[128];
        env_name(cfg->kafka_props[i].name, origin, sizeof(origin));
        if (!conf_set(conf, cfg->kafka_props[i].name, cfg->kafka_props[i].value, origin, errstr,
                      errsz))
            goto fail;
    }
    return conf;
fail:
    rd_kafka_conf_destroy(conf);
    return NULL;
}

rd_kafka_t *tally_kafka_producer_new(const tally_config_t *cfg, bool idempotent,
                                     void (*dr_msg_cb)(rd_kafka_t *, const rd_kafka_message_t *,
                                                       void *),
                                     void *opaque, char *errstr, size_t errsz)
{
    rd_kafka_conf_t *conf = tally_kafka_conf_new(cfg, errstr, errsz);
    if (conf == NULL)
        return NULL;
    if (idempotent &&
        !conf_set(conf, "enable.idempotence", "true", "the relay's producer", errstr, errsz))
        goto fail;
    /* bound how long a message may wait for the cluster, unless the operator chose */
    if (!passed_through(cfg, "message.timeout.ms") && !passed_through(cfg, "delivery.timeout.ms") &&
        !conf_set(conf, "message.timeout.ms", "30000", "tally's default", errstr, errsz))
        goto fail;
    if (dr_msg_cb != NULL)
        rd_kafka_conf_set_dr_msg_cb(conf, dr_msg_cb);
    rd_kafka_conf_set_opaque(conf, opaque);

    char why[512];
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, why, sizeof(why));
    if (rk == NULL) {
        snprintf(errstr, errsz, "cannot create the Kafka producer: %s", why);
        goto fail;
    }
    return rk; /* rd_kafka_new took ownership of conf */
fail:
    rd_kafka_conf_destroy(conf);
    return NULL;
}

/* "tally.intents [0,2,3]": the partitions of a rebalance, for the log. Lists are sorted by
 * librdkafka per topic; a topic's name is printed again when it changes. */
static void describe_partitions(const rd_kafka_topic_partition_list_t *parts, char *out,
                                size_t outsz)
{
    size_t used = 0;
    out[0] = '\0';
    const char *topic = NULL;
    for (int i = 0; parts != NULL && i < parts->cnt && used + 1 < outsz; i++) {
        const rd_kafka_topic_partition_t *tp = &parts->elems[i];
        bool same = topic != NULL && strcmp(topic, tp->topic) == 0;
        int n = same ? snprintf(out + used, outsz - used, ",%d", (int)tp->partition)
                     : snprintf(out + used, outsz - used, "%s%s [%d", topic != NULL ? "] " : "",
                                tp->topic, (int)tp->partition);
        used += n > 0 ? (size_t)n : 0;
        topic = tp->topic;
    }
    if (topic != NULL && used + 1 < outsz)
        snprintf(out + used, outsz - used, "]");
    else if (topic == NULL)
        snprintf(out, outsz, "none");
}

/* The rebalance callback only logs and counts (@p opaque: tally_kafka_rebalances_total, may be
 * NULL); the assignment itself is what librdkafka does without a callback (rdkafka.h,
 * rd_kafka_conf_set_rebalance_cb): incremental for the cooperative protocol, the whole
 * assignment for the eager one, and an empty assignment on any other error. Offsets stored
 * for revoked partitions are committed by auto commit on the way out, as before. */
static void rebalance_cb(rd_kafka_t *rk, rd_kafka_resp_err_t err,
                         rd_kafka_topic_partition_list_t *parts, void *opaque)
{
    tally_metric_t *m_rebalances = opaque;
    /* NULL while no protocol is known (a consumer closing before it joined, say) */
    const char *protocol = rd_kafka_rebalance_protocol(rk);
    bool cooperative = protocol != NULL && strcmp(protocol, "COOPERATIVE") == 0;
    bool assign = err == RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS;
    bool revoke = err == RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS;
    if (assign || revoke) {
        char list[512];
        describe_partitions(parts, list, sizeof list);
        char *member = rd_kafka_memberid(rk);
        TALLY_INFO("%s: consumer group rebalance (%s): %s %d partition%s: %s; member %s",
                   rd_kafka_name(rk), cooperative ? "cooperative" : "eager",
                   assign                         ? "assigned"
                   : rd_kafka_assignment_lost(rk) ? "lost"
                                                  : "revoked",
                   parts != NULL ? parts->cnt : 0, parts != NULL && parts->cnt == 1 ? "" : "s",
                   list, member != NULL ? member : "-");
        if (member != NULL)
            rd_kafka_mem_free(rk, member);
        if (m_rebalances != NULL)
            tally_metric_add(m_rebalances, 1, assign ? "assign" : "revoke");
    } else {
        TALLY_WARN("%s: consumer group rebalance failed: %s; dropping the assignment",
                   rd_kafka_name(rk), rd_kafka_err2str(err));
    }

    rd_kafka_error_t *error = NULL;
    rd_kafka_resp_err_t e = RD_KAFKA_RESP_ERR_NO_ERROR;
    if (assign && cooperative)
        error = rd_kafka_incremental_assign(rk, parts);
    else if (assign)
        e = rd_kafka_assign(rk, parts);
    else if (revoke && cooperative)
        error = rd_kafka_incremental_unassign(rk, parts);
    else
        e = rd_kafka_assign(rk, NULL);
    if (error != NULL) {
        TALLY_WARN("%s: %s partitions: %s", rd_kafka_name(rk), assign ? "assigning" : "revoking",
                   rd_kafka_error_string(error));
        rd_kafka_error_destroy(error);
    } else if (e != RD_KAFKA_RESP_ERR_NO_ERROR) {
        TALLY_WARN("%s: %s partitions: %s", rd_kafka_name(rk), assign ? "assigning" : "revoking",
                   rd_kafka_err2str(e));
    }
}

rd_kafka_t *tally_kafka_consumer_new(const tally_config_t *cfg, const char *group_id,
                                     const char *const *topics, size_t n_topics,
                                     tally_metric_t *rebalances, char *errstr, size_t errsz)
{
    rd_kafka_conf_t *conf = tally_kafka_conf_new(cfg, errstr, errsz);
    if (conf == NULL)
        return NULL;
    rd_kafka_conf_set_rebalance_cb(conf, rebalance_cb);
    rd_kafka_conf_set_opaque(conf, rebalances);
    char session[16];
    snprintf(session, sizeof(session), "%d", cfg->session_timeout_ms);
    /* Cooperative-sticky moves only the partitions that must move on a rebalance, but before
     * librdkafka 2.3.0 a consumer closed during a cooperative rebalance aborts in
     * rd_kafka_sticky_assignor_state_destroy (librdkafka issue #4312; Debian 12 ships 2.0.2,
     * where a restarted worker rejoining its group hits it). There we use the eager default;
     * TALLY_KAFKA_PARTITION_ASSIGNMENT_STRATEGY still overrides either choice. */
    const char *strategy =
        rd_kafka_version() >= 0x020300ff ? "cooperative-sticky" : "range,roundrobin";
    if (passed_through(cfg, "partition.assignment.strategy"))
        strategy = NULL;
    const char *fixed[][3] = {
        {"group.id", group_id, "TALLY_CONSUMER_GROUP"},
        {"partition.assignment.strategy", strategy, "tally's consumer"},
        /* offsets are stored only after the PostgreSQL COMMIT of what they carried */
        {"enable.auto.offset.store", "false", "tally's consumer"},
        {"enable.auto.commit", "true", "tally's consumer"},
        {"auto.offset.reset", "earliest", "tally's consumer"},
        {"session.timeout.ms", session, "TALLY_SESSION_TIMEOUT_MS"},
    };
    for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]); i++)
        if (fixed[i][1] != NULL &&
            !conf_set(conf, fixed[i][0], fixed[i][1], fixed[i][2], errstr, errsz)) {
            rd_kafka_conf_destroy(conf);
            return NULL;
        }

    char why[512];
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, why, sizeof(why));
    if (rk == NULL) {
        snprintf(errstr, errsz, "cannot create the Kafka consumer: %s", why);
        rd_kafka_conf_destroy(conf);
        return NULL;
    }
    /* one queue for messages, rebalances and errors: rd_kafka_consumer_poll serves all */
    rd_kafka_poll_set_consumer(rk);

    rd_kafka_topic_partition_list_t *subs = rd_kafka_topic_partition_list_new((int)n_topics);
    for (size_t i = 0; i < n_topics; i++)
        rd_kafka_topic_partition_list_add(subs, topics[i], RD_KAFKA_PARTITION_UA);
    rd_kafka_resp_err_t e = rd_kafka_subscribe(rk, subs);
    rd_kafka_topic_partition_list_destroy(subs);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR) {
        snprintf(errstr, errsz, "cannot subscribe to %zu topic%s (first %s): %s", n_topics,
                 n_topics == 1 ? "" : "s", n_topics ? topics[0] : "-", rd_kafka_err2str(e));
        rd_kafka_destroy(rk);
        return NULL;
    }
    return rk;
}

void tally_kafka_consumer_close(rd_kafka_t *rk)
{
    if (rk == NULL)
        return;
    rd_kafka_resp_err_t e = rd_kafka_commit(rk, NULL, 0 /* synchronous */);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR && e != RD_KAFKA_RESP_ERR__NO_OFFSET)
        TALLY_WARN("final offset commit failed: %s (those messages will be consumed again)",
                   rd_kafka_err2str(e));
    e = rd_kafka_consumer_close(rk);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR)
        TALLY_WARN("leaving the consumer group failed: %s", rd_kafka_err2str(e));
    rd_kafka_destroy(rk);
}

void tally_kafka_consumer_lag(rd_kafka_t *rk, tally_metric_t *lag)
{
    rd_kafka_topic_partition_list_t *parts = NULL;
    if (rk == NULL || rd_kafka_assignment(rk, &parts) != RD_KAFKA_RESP_ERR_NO_ERROR || !parts)
        return;
    /* a partition revoked since the last refresh reads 0 here; its new owner reports it */
    if (parts->cnt == 0 || rd_kafka_position(rk, parts) == RD_KAFKA_RESP_ERR_NO_ERROR) {
        tally_metric_reset(lag);
        for (int i = 0; i < parts->cnt; i++) {
            int64_t lo = 0, hi = 0;
            rd_kafka_topic_partition_t *tp = &parts->elems[i];
            if (rd_kafka_get_watermark_offsets(rk, tp->topic, tp->partition, &lo, &hi) !=
                    RD_KAFKA_RESP_ERR_NO_ERROR ||
                hi < 0)
                continue;
            int64_t pos = tp->offset >= 0 ? tp->offset : lo;
            char label[32];
            snprintf(label, sizeof label, "%d", (int)tp->partition);
            tally_metric_set(lag, (double)(hi > pos ? hi - pos : 0), label, tp->topic);
        }
    }
    rd_kafka_topic_partition_list_destroy(parts);
}

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* RD_KAFKA_RESP_ERR_NO_ERROR once the topic exists with partitions, else the last error. */
static rd_kafka_resp_err_t topic_state(rd_kafka_t *rk, const char *name, int timeout_ms)
{
    rd_kafka_topic_t *rkt = rd_kafka_topic_new(rk, name, NULL);
    if (rkt == NULL)
        return rd_kafka_last_error();
    const struct rd_kafka_metadata *md = NULL;
    rd_kafka_resp_err_t e = rd_kafka_metadata(rk, 0, rkt, &md, timeout_ms);
    if (e == RD_KAFKA_RESP_ERR_NO_ERROR) {
        e = RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART;
        for (int i = 0; i < md->topic_cnt; i++)
            if (strcmp(md->topics[i].topic, name) == 0)
                e = md->topics[i].err != RD_KAFKA_RESP_ERR_NO_ERROR ? md->topics[i].err
                    : md->topics[i].partition_cnt > 0               ? RD_KAFKA_RESP_ERR_NO_ERROR
                                                      : RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE;
        rd_kafka_metadata_destroy(md);
    }
    rd_kafka_topic_destroy(rkt);
    return e;
}

bool tally_kafka_ensure_topics(rd_kafka_t *rk, const char *const *topics, size_t n_topics,
                               int timeout_ms, char *errstr, size_t errsz)
{
    long long deadline = mono_ms() + (timeout_ms > 0 ? timeout_ms : 0);
    size_t used = 0;
    bool all = true;
    if (errsz > 0)
        errstr[0] = '\0';
    for (size_t i = 0; i < n_topics; i++) {
        rd_kafka_resp_err_t e;
        /* the first request may create the topic; its leader appears a moment later */
        for (;;) {
            long long left = deadline - mono_ms();
            e = topic_state(rk, topics[i], left > 0 ? (int)left : 1);
            if (e == RD_KAFKA_RESP_ERR_NO_ERROR || mono_ms() + 100 >= deadline)
                break;
            struct timespec ts = {0, 100 * 1000000L};
            nanosleep(&ts, NULL);
        }
        if (e == RD_KAFKA_RESP_ERR_NO_ERROR)
            continue;
        if (all && used < errsz)
            used += (size_t)snprintf(errstr + used, errsz - used, "missing Kafka topics:");
        all = false;
        if (used < errsz)
            used += (size_t)snprintf(errstr + used, errsz - used, " %s (%s)", topics[i],
                                     rd_kafka_err2str(e));
    }
    return all;
}

void tally_kafka_producer_close(rd_kafka_t *rk, int timeout_ms)
{
    if (rk == NULL)
        return;
    rd_kafka_resp_err_t e = rd_kafka_flush(rk, timeout_ms);
    if (e != RD_KAFKA_RESP_ERR_NO_ERROR)
        TALLY_WARN("%d Kafka message%s still undelivered at shutdown: %s", rd_kafka_outq_len(rk),
                   rd_kafka_outq_len(rk) == 1 ? "" : "s", rd_kafka_err2str(e));
    rd_kafka_destroy(rk);
}
