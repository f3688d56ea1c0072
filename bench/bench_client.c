/* bench_client.c — tally-bench-client: the benchmark's agent.
 *
 * It plays an outside agent, so it links no tally code: librdkafka and jansson only. One
 * process publishes intents (as fast as it can, or at a fixed rate) on the main thread while
 * a second thread reads the outcomes topic, matches each effect event to its intent by
 * data.intent_id, and records publish→outcome latency. Every intent id is "<prefix><index>",
 * so matching is an array lookup, not a map, and events of anything else (earlier phases,
 * other agents) are ignored.
 *
 * The send time of each intent is taken right before rd_kafka_producev() and carried in the
 * CloudEvents extension attribute "benchsentns" (nanoseconds since the epoch, as a string:
 * CloudEvents integers are 32-bit). It is not put in data.args, which tally hashes and sends
 * to the tool. The same value is kept in memory, so latency never depends on parsing it back.
 *
 * It also counts Kafka bytes, exactly, for the steady counters (bench/README.md): in_bytes is
 * the key and value of every intent the broker acknowledged (delivery reports), out_bytes the
 * key, value and headers of every message on the outcomes topic from its end before the first
 * intent to its end once the last outcome arrived (the reader drains to the end offsets it
 * sees then). With --window it keeps at most W intents without an outcome (a closed loop: the
 * next intent goes out when an outcome frees a place), and --duration stops publishing after
 * S seconds; steady_effects_per_s counts the outcomes that arrived while it was publishing.
 *
 * Figures go to stdout as one `bench-client: key=value ...` line that bench/run.sh parses;
 * progress goes to stderr. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <librdkafka/rdkafka.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_TOOLS        16
#define MAX_FIELDS       8
#define MAX_NAME         64
#define MAX_PARTITIONS   1024
#define MSG_BUF          2048
#define MAX_COUNT        50000000L
#define PROGRESS_EVERY_S 2.0

typedef struct tool_spec {
    char name[MAX_NAME];
    char fields[MAX_FIELDS][MAX_NAME]; /* args filled with the intent's unique value */
    int n_fields;
} tool_spec_t;

/* What the outcome reader counts; written only by its thread, read after the join. */
typedef struct outcome_counts {
    long confirmed, failed, unknown, other; /* status of the first event per intent */
    long dup_events;                        /* further events for an intent already answered */
    long foreign_events;                    /* events on the topic that are not ours */
    long parse_errors;
    int64_t last_arrival_ns;
    long out_messages; /* every message read on the outcomes topic, ours or not */
    long out_bytes;    /* their key + value + header (name and value) bytes */
} outcome_counts_t;

typedef struct bench {
    /* options */
    const char *brokers;
    const char *intents_topic;
    const char *outcomes_topic;
    const char *label;
    long count;
    double rate; /* intents/s; 0 = as fast as possible */
    long runs;
    tool_spec_t tools[MAX_TOOLS];
    int n_tools;
    double timeout_s;
    double idle_timeout_s;
    int linger_ms; /* -1 = 0 when paced, 5 when not */
    int fetch_wait_ms;
    const char *dump;  /* --dump: "intent_id sent_ns arrival_ns" per answered intent */
    long window;       /* --window: at most this many intents published without an outcome */
    double duration_s; /* --duration: stop publishing after this long (0 = after --count) */
    bool wait;
    char prefix[48]; /* "b<nonce>-": every intent id, run id and unique arg starts with it */

    /* shared between the threads */
    _Atomic int64_t *sent_ns; /* CLOCK_REALTIME ns at produce; 0 = not sent */
    int64_t *lat_ns;          /* outcome arrival - sent; -1 = no outcome yet (reader only) */
    atomic_long received;
    atomic_long expect; /* outcomes to wait for: count, or what was published by --duration */
    atomic_long delivered;
    atomic_long delivered_bytes; /* key + value of every delivered intent */
    atomic_long delivery_failed;
    atomic_bool stop;
    int64_t publish_end_ns; /* CLOCK_REALTIME when publishing stopped */
    long window_max;        /* most intents published without an outcome at once */

    outcome_counts_t oc;
    rd_kafka_t *consumer;
} bench_t;

static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

static int64_t realtime_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void sleep_until_monotonic(int64_t t_ns)
{
    struct timespec ts = {(time_t)(t_ns / 1000000000), (long)(t_ns % 1000000000)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR && !interrupted)
        ;
}

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tally-bench-client --brokers B --intents-topic T --outcomes-topic T\n"
            "                          --count N --tool NAME:FIELD[,FIELD...] [--tool ...]\n"
            "                          [--rate R] [--runs K] [--no-wait] [--timeout S]\n"
            "                          [--idle-timeout S] [--linger-ms MS] [--fetch-wait-ms MS]\n"
            "                          [--label NAME] [--dump FILE] [--window W] [--duration S]\n\n"
            "Publish N tally.intent.v1 events (round-robin over the tools, spread over K runs,\n"
            "every operation key unique) and wait until an effect event for each has arrived on\n"
            "the outcomes topic. Prints one `bench-client: key=value ...` line on stdout.\n\n"
            "  --tool NAME:FIELDS  a registered tool and the args fields that make its\n"
            "                      operation key; each gets the intent's unique value\n"
            "  --rate R            intents per second (default: as fast as possible)\n"
            "  --runs K            spread the intents over K runs (default 100)\n"
            "  --no-wait           publish, flush and exit without reading outcomes\n"
            "  --timeout S         give up waiting for outcomes after S s (default 600)\n"
            "  --idle-timeout S    ... or after S s without a new outcome (default 60)\n"
            "  --linger-ms MS      producer linger (default 0 with --rate, else 5)\n"
            "  --fetch-wait-ms MS  outcome reader's fetch.wait.max.ms (default 5)\n"
            "  --label NAME        names the figures line (default: bench)\n"
            "  --dump FILE         write \"intent_id sent_ns arrival_ns\" (CLOCK_REALTIME) for\n"
            "                      every answered intent, to set beside the ledger's times\n"
            "  --window W          keep at most W intents published without an outcome: publish\n"
            "                      the next one as soon as an outcome frees a place\n"
            "  --duration S        stop publishing after S s (--count is then an upper bound)\n"
            "                      and wait for the outcomes of what was published\n\n"
            "The line also counts Kafka bytes: in_bytes is key + value of every intent\n"
            "delivered, out_bytes key + value + headers of every message read on the outcomes\n"
            "topic from its end before the first intent to its end after the last outcome.\n");
}

static bool valid_name(const char *s, size_t len)
{
    if (len == 0 || len >= MAX_NAME)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return false;
    }
    return true;
}

/* "charge:tenant_id,payment_id" → a tool_spec. Names are restricted to [a-z0-9_-] so they
 * can be written into JSON without escaping. */
static bool parse_tool(const char *arg, tool_spec_t *t)
{
    const char *colon = strchr(arg, ':');
    if (colon == NULL || !valid_name(arg, (size_t)(colon - arg)))
        return false;
    memcpy(t->name, arg, (size_t)(colon - arg));
    t->name[colon - arg] = '\0';
    t->n_fields = 0;
    const char *p = colon + 1;
    while (*p != '\0') {
        const char *comma = strchr(p, ',');
        size_t len = comma != NULL ? (size_t)(comma - p) : strlen(p);
        if (t->n_fields == MAX_FIELDS || !valid_name(p, len))
            return false;
        memcpy(t->fields[t->n_fields], p, len);
        t->fields[t->n_fields][len] = '\0';
        t->n_fields++;
        p += len + (comma != NULL ? 1 : 0);
    }
    return t->n_fields > 0;
}

static bool parse_long(const char *s, long min, long max, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < min || v > max)
        return false;
    *out = v;
    return true;
}

static bool parse_double(const char *s, double min, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno != 0 || end == s || *end != '\0' || !(v >= min))
        return false;
    *out = v;
    return true;
}

/* ---- the outcome reader -------------------------------------------------------------------- */

static rd_kafka_t *consumer_new(const bench_t *b, char *errstr, size_t errsz)
{
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    char group[96], fetch_wait[16];
    snprintf(group, sizeof group, "tally-bench-reader-%s", b->prefix);
    snprintf(fetch_wait, sizeof fetch_wait, "%d", b->fetch_wait_ms);
    const char *props[][2] = {
        {"bootstrap.servers", b->brokers},
        {"group.id", group}, /* required by librdkafka; offsets are assigned, never committed */
        {"enable.auto.commit", "false"},
        {"enable.auto.offset.store", "false"},
        {"enable.partition.eof", "false"},
        /* librdkafka's mock broker holds an empty fetch for the whole fetch.wait.max.ms
         * instead of answering when data arrives, so a long wait would be measured as
         * latency; a real broker answers at once. */
        {"fetch.wait.max.ms", fetch_wait},
    };
    char why[256]; /* smaller than the caller's errstr, so it is never cut */
    for (size_t i = 0; i < sizeof props / sizeof props[0]; i++)
        if (rd_kafka_conf_set(conf, props[i][0], props[i][1], why, sizeof why) !=
            RD_KAFKA_CONF_OK) {
            snprintf(errstr, errsz, "consumer property %s: %s", props[i][0], why);
            rd_kafka_conf_destroy(conf);
            return NULL;
        }
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, why, sizeof why);
    if (rk == NULL) {
        snprintf(errstr, errsz, "cannot create the consumer: %s", why);
        rd_kafka_conf_destroy(conf);
        return NULL;
    }
    rd_kafka_poll_set_consumer(rk);
    return rk;
}

/* Assign every partition of the outcomes topic at its current end, so only events produced
 * after this point are read. Done before the first intent is published. */
static bool consumer_assign_at_end(bench_t *b, char *errstr, size_t errsz)
{
    rd_kafka_topic_t *rkt = rd_kafka_topic_new(b->consumer, b->outcomes_topic, NULL);
    if (rkt == NULL) {
        snprintf(errstr, errsz, "cannot create topic handle %s", b->outcomes_topic);
        return false;
    }
    const struct rd_kafka_metadata *md = NULL;
    rd_kafka_resp_err_t err = RD_KAFKA_RESP_ERR_NO_ERROR;
    int partitions = 0;
    /* the mock cluster creates a topic on its first metadata request: ask until it answers */
    for (int attempt = 0; attempt < 50; attempt++) {
        err = rd_kafka_metadata(b->consumer, 0, rkt, &md, 5000);
        if (err == RD_KAFKA_RESP_ERR_NO_ERROR && md->topic_cnt == 1 &&
            md->topics[0].err == RD_KAFKA_RESP_ERR_NO_ERROR && md->topics[0].partition_cnt > 0) {
            partitions = md->topics[0].partition_cnt;
            rd_kafka_metadata_destroy(md);
            break;
        }
        if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
            rd_kafka_metadata_destroy(md);
        usleep(100000);
    }
    rd_kafka_topic_destroy(rkt);
    if (partitions == 0 || partitions > MAX_PARTITIONS) {
        snprintf(errstr, errsz, "no usable metadata for %s (%s)", b->outcomes_topic,
                 rd_kafka_err2str(err));
        return false;
    }
    rd_kafka_topic_partition_list_t *parts = rd_kafka_topic_partition_list_new(partitions);
    for (int p = 0; p < partitions; p++) {
        int64_t lo = 0, hi = 0;
        err = rd_kafka_query_watermark_offsets(b->consumer, b->outcomes_topic, p, &lo, &hi, 10000);
        if (err != RD_KAFKA_RESP_ERR_NO_ERROR) {
            snprintf(errstr, errsz, "watermarks of %s [%d]: %s", b->outcomes_topic, p,
                     rd_kafka_err2str(err));
            rd_kafka_topic_partition_list_destroy(parts);
            return false;
        }
        rd_kafka_topic_partition_list_add(parts, b->outcomes_topic, p)->offset = hi;
    }
    err = rd_kafka_assign(b->consumer, parts);
    rd_kafka_topic_partition_list_destroy(parts);
    if (err != RD_KAFKA_RESP_ERR_NO_ERROR) {
        snprintf(errstr, errsz, "assign %s: %s", b->outcomes_topic, rd_kafka_err2str(err));
        return false;
    }
    return true;
}

/* One message of the outcomes topic. */
static void outcome_handle(bench_t *b, const rd_kafka_message_t *m, int64_t arrival_ns)
{
    b->oc.out_messages++;
    b->oc.out_bytes += (long)(m->len + m->key_len);
    rd_kafka_headers_t *hdrs = NULL;
    if (rd_kafka_message_headers(m, &hdrs) == RD_KAFKA_RESP_ERR_NO_ERROR) {
        const char *name;
        const void *val;
        size_t size;
        for (size_t i = 0;
             rd_kafka_header_get_all(hdrs, i, &name, &val, &size) == RD_KAFKA_RESP_ERR_NO_ERROR;
             i++)
            b->oc.out_bytes += (long)(strlen(name) + size);
    }
    json_error_t jerr;
    json_t *ev = json_loadb(m->payload, m->len, 0, &jerr);
    if (ev == NULL) {
        b->oc.parse_errors++;
        return;
    }
    const char *type = json_string_value(json_object_get(ev, "type"));
    json_t *data = json_object_get(ev, "data");
    const char *intent_id = json_string_value(json_object_get(data, "intent_id"));
    size_t plen = strlen(b->prefix);
    if (type == NULL || strncmp(type, "tally.effect.", 13) != 0 || intent_id == NULL ||
        strncmp(intent_id, b->prefix, plen) != 0) {
        b->oc.foreign_events++;
        json_decref(ev);
        return;
    }
    long idx = -1;
    if (!parse_long(intent_id + plen, 0, b->count - 1, &idx)) {
        b->oc.foreign_events++;
        json_decref(ev);
        return;
    }
    if (b->lat_ns[idx] >= 0) {
        b->oc.dup_events++;
        json_decref(ev);
        return;
    }
    int64_t sent = atomic_load_explicit(&b->sent_ns[idx], memory_order_acquire);
    b->lat_ns[idx] = arrival_ns > sent ? arrival_ns - sent : 0;
    const char *status = json_string_value(json_object_get(data, "status"));
    if (status == NULL)
        b->oc.other++;
    else if (strcmp(status, "CONFIRMED") == 0)
        b->oc.confirmed++;
    else if (strcmp(status, "FAILED") == 0)
        b->oc.failed++;
    else if (strcmp(status, "UNKNOWN") == 0)
        b->oc.unknown++;
    else
        b->oc.other++;
    if (arrival_ns > b->oc.last_arrival_ns)
        b->oc.last_arrival_ns = arrival_ns;
    atomic_fetch_add(&b->received, 1);
    json_decref(ev);
}

static void outcome_poll(bench_t *b)
{
    rd_kafka_message_t *m = rd_kafka_consumer_poll(b->consumer, 100);
    if (m == NULL)
        return;
    int64_t arrival = realtime_ns();
    if (m->err == RD_KAFKA_RESP_ERR_NO_ERROR)
        outcome_handle(b, m, arrival);
    else
        fprintf(stderr, "tally-bench-client: outcomes: %s\n", rd_kafka_message_errstr(m));
    rd_kafka_message_destroy(m);
}

/* Once every outcome is in: read on to the end offsets the topic has now, so out_bytes holds
 * every message published up to the last outcome (events after it, or of other effects,
 * included), not only up to the one that happened to come last. At most @p limit_s. */
static void outcome_drain(bench_t *b, double limit_s)
{
    rd_kafka_topic_partition_list_t *parts = NULL;
    if (rd_kafka_assignment(b->consumer, &parts) != RD_KAFKA_RESP_ERR_NO_ERROR)
        return;
    int64_t *end = calloc((size_t)parts->cnt + 1, sizeof(int64_t));
    bool ok = end != NULL;
    for (int i = 0; ok && i < parts->cnt; i++) {
        int64_t lo = 0;
        ok = rd_kafka_query_watermark_offsets(b->consumer, parts->elems[i].topic,
                                              parts->elems[i].partition, &lo, &end[i],
                                              5000) == RD_KAFKA_RESP_ERR_NO_ERROR;
    }
    int64_t deadline = monotonic_ns() + (int64_t)(limit_s * 1e9);
    while (ok && !atomic_load(&b->stop) && monotonic_ns() < deadline) {
        if (rd_kafka_position(b->consumer, parts) != RD_KAFKA_RESP_ERR_NO_ERROR)
            break;
        bool behind = false;
        for (int i = 0; i < parts->cnt && !behind; i++)
            behind = parts->elems[i].offset < end[i];
        if (!behind)
            break;
        outcome_poll(b);
    }
    free(end);
    rd_kafka_topic_partition_list_destroy(parts);
}

static void *outcome_reader(void *arg)
{
    bench_t *b = arg;
    while (!atomic_load(&b->stop) && atomic_load(&b->received) < atomic_load(&b->expect))
        outcome_poll(b);
    outcome_drain(b, 5.0);
    return NULL;
}

/* ---- the publisher ------------------------------------------------------------------------- */

static void dr_cb(rd_kafka_t *rk, const rd_kafka_message_t *m, void *opaque)
{
    (void)rk;
    bench_t *b = opaque;
    if (m->err == RD_KAFKA_RESP_ERR_NO_ERROR) {
        atomic_fetch_add(&b->delivered, 1);
        atomic_fetch_add(&b->delivered_bytes, (long)(m->len + m->key_len));
    } else {
        long n = atomic_fetch_add(&b->delivery_failed, 1);
        if (n < 5)
            fprintf(stderr, "tally-bench-client: delivery failed: %s\n", rd_kafka_err2str(m->err));
    }
}

static rd_kafka_t *producer_new(bench_t *b, char *errstr, size_t errsz)
{
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    char linger[16];
    snprintf(linger, sizeof linger, "%d", b->linger_ms);
    const char *props[][2] = {
        {"bootstrap.servers", b->brokers},
        {"linger.ms", linger},
        {"queue.buffering.max.messages", "2000000"},
        {"queue.buffering.max.kbytes", "2097152"},
        {"batch.num.messages", "10000"},
        {"message.timeout.ms", "60000"},
    };
    char why[256]; /* smaller than the caller's errstr, so it is never cut */
    for (size_t i = 0; i < sizeof props / sizeof props[0]; i++)
        if (rd_kafka_conf_set(conf, props[i][0], props[i][1], why, sizeof why) !=
            RD_KAFKA_CONF_OK) {
            snprintf(errstr, errsz, "producer property %s: %s", props[i][0], why);
            rd_kafka_conf_destroy(conf);
            return NULL;
        }
    rd_kafka_conf_set_dr_msg_cb(conf, dr_cb);
    rd_kafka_conf_set_opaque(conf, b);
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, why, sizeof why);
    if (rk == NULL) {
        snprintf(errstr, errsz, "cannot create the producer: %s", why);
        rd_kafka_conf_destroy(conf);
        return NULL;
    }
    return rk;
}

/* The intent for index i, stamped with @p sent_ns. Returns its length, or -1 if it does not
 * fit (it always does with the name limits above). */
static int intent_format(const bench_t *b, long i, int64_t sent_ns, char *buf, size_t bufsz,
                         char *key, size_t keysz)
{
    const tool_spec_t *t = &b->tools[i % b->n_tools];
    long run = i % b->runs, step = i / b->runs;
    int klen = snprintf(key, keysz, "%srun-%ld", b->prefix, run);
    if (klen < 0 || (size_t)klen >= keysz)
        return -1;
    char args[MAX_FIELDS * (MAX_NAME + 64) + 128];
    size_t off = 0;
    args[0] = '\0';
    for (int f = 0; f < t->n_fields; f++) {
        int n = snprintf(args + off, sizeof args - off, "\"%s\":\"%s%ld\",", t->fields[f],
                         b->prefix, i);
        if (n < 0 || (size_t)n >= sizeof args - off)
            return -1;
        off += (size_t)n;
    }
    int n = snprintf(buf, bufsz,
                     "{\"specversion\":\"1.0\",\"id\":\"%s%ld\",\"source\":\"/bench/"
                     "tally-bench-client\",\"type\":\"tally.intent.v1\",\"datacontenttype\":"
                     "\"application/json\",\"benchsentns\":\"%" PRId64 "\",\"data\":{\"run_id\":"
                     "\"%s\",\"step\":%ld,\"tool\":\"%s\",\"args\":{%s\"amount\":%ld,"
                     "\"currency\":\"EUR\"}}}",
                     b->prefix, i, sent_ns, key, step, t->name, args, 100 + i % 9900);
    if (n < 0 || (size_t)n >= bufsz)
        return -1;
    return n;
}

/* Publish every intent, paced when a rate is given. Returns false on a produce error. */
static bool publish_all(bench_t *b, rd_kafka_t *rk, long *published)
{
    char buf[MSG_BUF], key[96];
    int64_t t0 = monotonic_ns();
    int64_t next_progress = t0 + (int64_t)(PROGRESS_EVERY_S * 1e9);
    int64_t stop_at = b->duration_s > 0 ? t0 + (int64_t)(b->duration_s * 1e9) : INT64_MAX;
    for (long i = 0; i < b->count && !interrupted; i++) {
        if (b->rate > 0) {
            int64_t due = t0 + (int64_t)((double)i * 1e9 / b->rate);
            if (monotonic_ns() < due)
                sleep_until_monotonic(due);
        }
        /* --window: wait until an outcome frees a place (polling delivery reports meanwhile) */
        while (b->window > 0 && i - atomic_load(&b->received) >= b->window && !interrupted &&
               monotonic_ns() < stop_at)
            rd_kafka_poll(rk, 1);
        if (monotonic_ns() >= stop_at)
            break;
        *published = i + 1;
        if (i - atomic_load(&b->received) + 1 > b->window_max)
            b->window_max = i - atomic_load(&b->received) + 1;
        for (;;) {
            int64_t now = realtime_ns();
            int len = intent_format(b, i, now, buf, sizeof buf, key, sizeof key);
            if (len < 0) {
                fprintf(stderr, "tally-bench-client: intent %ld does not fit\n", i);
                return false;
            }
            atomic_store_explicit(&b->sent_ns[i], now, memory_order_release);
            rd_kafka_resp_err_t err = rd_kafka_producev(
                rk, RD_KAFKA_V_TOPIC(b->intents_topic), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
                RD_KAFKA_V_KEY(key, strlen(key)), RD_KAFKA_V_VALUE(buf, (size_t)len),
                RD_KAFKA_V_END);
            if (err == RD_KAFKA_RESP_ERR_NO_ERROR)
                break;
            if (err != RD_KAFKA_RESP_ERR__QUEUE_FULL) {
                fprintf(stderr, "tally-bench-client: produce: %s\n", rd_kafka_err2str(err));
                return false;
            }
            rd_kafka_poll(rk, 5); /* the local queue is full: let deliveries drain it */
        }
        if ((i & 255) == 0) {
            rd_kafka_poll(rk, 0);
            int64_t now = monotonic_ns();
            if (now >= next_progress) {
                fprintf(stderr, "[%s] published %ld/%ld, outcomes %ld\n", b->label, i + 1, b->count,
                        atomic_load(&b->received));
                next_progress = now + (int64_t)(PROGRESS_EVERY_S * 1e9);
            }
        }
    }
    b->publish_end_ns = realtime_ns();
    while (rd_kafka_outq_len(rk) > 0 && !interrupted) {
        if (rd_kafka_flush(rk, 1000) == RD_KAFKA_RESP_ERR_NO_ERROR)
            break;
    }
    return !interrupted;
}

/* ---- figures ------------------------------------------------------------------------------- */

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Nearest-rank percentile of a sorted array. */
static double pct_ms(const int64_t *sorted, long n, double p)
{
    if (n == 0)
        return 0.0;
    long rank = (long)((p / 100.0) * (double)n + 0.999999);
    if (rank < 1)
        rank = 1;
    if (rank > n)
        rank = n;
    return (double)sorted[rank - 1] / 1e6;
}

static void report(const bench_t *b)
{
    long sent = 0;
    int64_t first = INT64_MAX, last = 0;
    for (long i = 0; i < b->count; i++) {
        int64_t s = atomic_load(&b->sent_ns[i]);
        if (s == 0)
            continue;
        sent++;
        if (s < first)
            first = s;
        if (s > last)
            last = s;
    }
    double publish_s = sent > 0 ? (double)(last - first) / 1e9 : 0.0;
    printf("bench-client: label=%s prefix=%s sent=%ld delivered=%ld delivery_failed=%ld "
           "publish_s=%.3f publish_rate=%.1f in_messages=%ld in_bytes=%ld",
           b->label, b->prefix, sent, atomic_load(&b->delivered), atomic_load(&b->delivery_failed),
           publish_s, publish_s > 0 ? (double)sent / publish_s : 0.0, atomic_load(&b->delivered),
           atomic_load(&b->delivered_bytes));
    if (!b->wait) {
        printf("\n");
        return;
    }
    long n = 0;
    int64_t *lat = malloc(sizeof(int64_t) * (size_t)(b->count > 0 ? b->count : 1));
    double sum = 0;
    for (long i = 0; lat != NULL && i < b->count; i++)
        if (b->lat_ns[i] >= 0) {
            lat[n++] = b->lat_ns[i];
            sum += (double)b->lat_ns[i];
        }
    if (lat != NULL)
        qsort(lat, (size_t)n, sizeof(int64_t), cmp_i64);
    double window_s = n > 0 && b->oc.last_arrival_ns > first
                          ? (double)(b->oc.last_arrival_ns - first) / 1e9
                          : 0.0;
    printf(" received=%ld complete=%s confirmed=%ld failed=%ld unknown=%ld other=%ld "
           "dup_events=%ld foreign_events=%ld parse_errors=%ld window_s=%.3f "
           "effects_per_s=%.1f p50_ms=%.2f p90_ms=%.2f p99_ms=%.2f max_ms=%.2f mean_ms=%.2f",
           n, n == atomic_load(&b->expect) ? "yes" : "no", b->oc.confirmed, b->oc.failed,
           b->oc.unknown, b->oc.other, b->oc.dup_events, b->oc.foreign_events, b->oc.parse_errors,
           window_s, window_s > 0 ? (double)n / window_s : 0.0, pct_ms(lat, n, 50),
           pct_ms(lat, n, 90), pct_ms(lat, n, 99), n > 0 ? (double)lat[n - 1] / 1e6 : 0.0,
           n > 0 ? sum / (double)n / 1e6 : 0.0);
    printf(" out_messages=%ld out_bytes=%ld", b->oc.out_messages, b->oc.out_bytes);
    if (b->window > 0 || b->duration_s > 0) {
        /* the outcomes that arrived while the publisher kept the window full */
        long steady = 0;
        for (long i = 0; i < b->count; i++) {
            int64_t s = atomic_load(&b->sent_ns[i]);
            if (s != 0 && b->lat_ns[i] >= 0 && s + b->lat_ns[i] <= b->publish_end_ns)
                steady++;
        }
        double steady_s =
            sent > 0 && b->publish_end_ns > first ? (double)(b->publish_end_ns - first) / 1e9 : 0.0;
        printf(" window=%ld window_max=%ld steady_s=%.3f steady_outcomes=%ld "
               "steady_effects_per_s=%.1f",
               b->window, b->window_max, steady_s, steady,
               steady_s > 0 ? (double)steady / steady_s : 0.0);
    }
    printf("\n");
    free(lat);
}

/* Every answered intent with its two clock readings; the ledger's own times (now() of the
 * transactions, the same machine's clock) split the interval between them. */
static bool dump_times(const bench_t *b)
{
    FILE *f = fopen(b->dump, "w");
    if (f == NULL) {
        fprintf(stderr, "tally-bench-client: --dump %s: %s\n", b->dump, strerror(errno));
        return false;
    }
    for (long i = 0; i < b->count; i++) {
        if (b->lat_ns[i] < 0)
            continue;
        int64_t s = atomic_load(&b->sent_ns[i]);
        fprintf(f, "%s%ld %" PRId64 " %" PRId64 "\n", b->prefix, i, s, s + b->lat_ns[i]);
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "tally-bench-client: --dump %s: %s\n", b->dump, strerror(errno));
        return false;
    }
    return true;
}

/* ---- main ---------------------------------------------------------------------------------- */

static bool options(bench_t *b, int argc, char **argv)
{
    enum {
        O_INTENTS = 1000,
        O_OUTCOMES,
        O_NO_WAIT,
        O_IDLE,
        O_LINGER,
        O_FETCH,
        O_DUMP,
        O_WINDOW,
        O_DURATION
    };
    static const struct option longopts[] = {
        {"brokers", required_argument, NULL, 'b'},
        {"intents-topic", required_argument, NULL, O_INTENTS},
        {"outcomes-topic", required_argument, NULL, O_OUTCOMES},
        {"count", required_argument, NULL, 'n'},
        {"rate", required_argument, NULL, 'r'},
        {"runs", required_argument, NULL, 'k'},
        {"tool", required_argument, NULL, 't'},
        {"no-wait", no_argument, NULL, O_NO_WAIT},
        {"timeout", required_argument, NULL, 'T'},
        {"idle-timeout", required_argument, NULL, O_IDLE},
        {"linger-ms", required_argument, NULL, O_LINGER},
        {"fetch-wait-ms", required_argument, NULL, O_FETCH},
        {"label", required_argument, NULL, 'l'},
        {"dump", required_argument, NULL, O_DUMP},
        {"window", required_argument, NULL, O_WINDOW},
        {"duration", required_argument, NULL, O_DURATION},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    long v = 0;
    int c;
    while ((c = getopt_long(argc, argv, "b:n:r:k:t:T:l:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'b':
            b->brokers = optarg;
            break;
        case O_INTENTS:
            b->intents_topic = optarg;
            break;
        case O_OUTCOMES:
            b->outcomes_topic = optarg;
            break;
        case 'n':
            if (!parse_long(optarg, 1, MAX_COUNT, &b->count)) {
                fprintf(stderr, "tally-bench-client: --count must be 1..%ld\n", MAX_COUNT);
                return false;
            }
            break;
        case 'r':
            if (!parse_double(optarg, 0.0, &b->rate)) {
                fprintf(stderr, "tally-bench-client: --rate must be a number >= 0\n");
                return false;
            }
            break;
        case 'k':
            if (!parse_long(optarg, 1, MAX_COUNT, &b->runs)) {
                fprintf(stderr, "tally-bench-client: --runs must be >= 1\n");
                return false;
            }
            break;
        case 't':
            if (b->n_tools == MAX_TOOLS || !parse_tool(optarg, &b->tools[b->n_tools])) {
                fprintf(stderr,
                        "tally-bench-client: --tool '%s' is not NAME:FIELD[,FIELD...] with "
                        "names of [a-z0-9_-] (at most %d tools)\n",
                        optarg, MAX_TOOLS);
                return false;
            }
            b->n_tools++;
            break;
        case O_NO_WAIT:
            b->wait = false;
            break;
        case 'T':
            if (!parse_double(optarg, 0.001, &b->timeout_s)) {
                fprintf(stderr, "tally-bench-client: --timeout must be > 0\n");
                return false;
            }
            break;
        case O_IDLE:
            if (!parse_double(optarg, 0.001, &b->idle_timeout_s)) {
                fprintf(stderr, "tally-bench-client: --idle-timeout must be > 0\n");
                return false;
            }
            break;
        case O_LINGER:
            if (!parse_long(optarg, 0, 60000, &v)) {
                fprintf(stderr, "tally-bench-client: --linger-ms must be 0..60000\n");
                return false;
            }
            b->linger_ms = (int)v;
            break;
        case O_FETCH:
            if (!parse_long(optarg, 0, 60000, &v)) {
                fprintf(stderr, "tally-bench-client: --fetch-wait-ms must be 0..60000\n");
                return false;
            }
            b->fetch_wait_ms = (int)v;
            break;
        case 'l':
            b->label = optarg;
            break;
        case O_DUMP:
            b->dump = optarg;
            break;
        case O_WINDOW:
            if (!parse_long(optarg, 1, MAX_COUNT, &b->window)) {
                fprintf(stderr, "tally-bench-client: --window must be 1..%ld\n", MAX_COUNT);
                return false;
            }
            break;
        case O_DURATION:
            if (!parse_double(optarg, 0.001, &b->duration_s)) {
                fprintf(stderr, "tally-bench-client: --duration must be > 0\n");
                return false;
            }
            break;
        case 'h':
            usage(stdout);
            exit(0);
        default:
            usage(stderr);
            return false;
        }
    }
    if (optind < argc || b->brokers == NULL || b->intents_topic == NULL || b->count <= 0 ||
        b->n_tools == 0 || (b->wait && b->outcomes_topic == NULL)) {
        fprintf(stderr, "tally-bench-client: --brokers, --intents-topic, --count, --tool and "
                        "(unless --no-wait) --outcomes-topic are required\n");
        usage(stderr);
        return false;
    }
    if (b->window > 0 && !b->wait) {
        fprintf(stderr, "tally-bench-client: --window needs the outcomes (not --no-wait)\n");
        return false;
    }
    if (b->linger_ms < 0)
        b->linger_ms = b->rate > 0 ? 0 : 5;
    return true;
}

int main(int argc, char **argv)
{
    static bench_t bench = {
        .label = "bench",
        .runs = 100,
        .timeout_s = 600,
        .idle_timeout_s = 60,
        .linger_ms = -1,
        .fetch_wait_ms = 5,
        .wait = true,
    };
    bench_t *b = &bench;
    if (!options(b, argc, argv))
        return 2;

    /* A prefix of our own, so ids never collide with another run on the same topics. */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned seed = (unsigned)ts.tv_nsec ^ (unsigned)getpid() ^ (unsigned)ts.tv_sec;
    snprintf(b->prefix, sizeof b->prefix, "b%08x%04x-", (unsigned)rand_r(&seed),
             (unsigned)(rand_r(&seed) & 0xffff));

    b->sent_ns = calloc((size_t)b->count, sizeof(*b->sent_ns));
    b->lat_ns = malloc(sizeof(int64_t) * (size_t)b->count);
    if (b->sent_ns == NULL || b->lat_ns == NULL) {
        fprintf(stderr, "tally-bench-client: out of memory for %ld intents\n", b->count);
        return 1;
    }
    atomic_store(&b->expect, b->count);
    for (long i = 0; i < b->count; i++) {
        atomic_init(&b->sent_ns[i], 0);
        b->lat_ns[i] = -1;
    }

    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    char err[512];
    pthread_t reader;
    bool reader_started = false;
    if (b->wait) {
        b->consumer = consumer_new(b, err, sizeof err);
        if (b->consumer == NULL || !consumer_assign_at_end(b, err, sizeof err)) {
            fprintf(stderr, "tally-bench-client: %s\n", err);
            return 1;
        }
        if (pthread_create(&reader, NULL, outcome_reader, b) != 0) {
            fprintf(stderr, "tally-bench-client: cannot start the outcome reader\n");
            return 1;
        }
        reader_started = true;
    }

    rd_kafka_t *producer = producer_new(b, err, sizeof err);
    if (producer == NULL) {
        fprintf(stderr, "tally-bench-client: %s\n", err);
        return 1;
    }
    fprintf(stderr, "[%s] publishing %ld intents to %s (%s), prefix %s\n", b->label, b->count,
            b->intents_topic, b->rate > 0 ? "paced" : "as fast as possible", b->prefix);
    long n_published = 0;
    bool published = publish_all(b, producer, &n_published);
    rd_kafka_destroy(producer);
    atomic_store(&b->expect, n_published); /* less than --count when --duration ended it */

    int rc = published && atomic_load(&b->delivery_failed) == 0 ? 0 : 1;
    if (reader_started) {
        int64_t start = monotonic_ns(), last_change = start, next_progress = start;
        long last_seen = -1;
        long expect = atomic_load(&b->expect);
        while (!interrupted && atomic_load(&b->received) < expect) {
            int64_t now = monotonic_ns();
            long got = atomic_load(&b->received);
            if (got != last_seen) {
                last_seen = got;
                last_change = now;
            }
            if ((double)(now - start) / 1e9 > b->timeout_s ||
                (double)(now - last_change) / 1e9 > b->idle_timeout_s) {
                fprintf(stderr, "[%s] gave up waiting: %ld/%ld outcomes\n", b->label, got, expect);
                break;
            }
            if (now >= next_progress) {
                fprintf(stderr, "[%s] outcomes %ld/%ld\n", b->label, got, expect);
                next_progress = now + (int64_t)(PROGRESS_EVERY_S * 1e9);
            }
            usleep(20000);
        }
        /* complete: the reader drains to the topic's end on its own; else it is stopped */
        if (atomic_load(&b->received) < expect)
            atomic_store(&b->stop, true);
        pthread_join(reader, NULL);
        if (atomic_load(&b->received) < expect)
            rc = 1;
    }
    report(b);
    if (b->dump != NULL && b->wait && !dump_times(b))
        rc = 1;
    if (b->consumer != NULL) {
        rd_kafka_consumer_close(b->consumer);
        rd_kafka_destroy(b->consumer);
    }
    free(b->sent_ns);
    free(b->lat_ns);
    return rc;
}
