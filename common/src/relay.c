/* relay.c — publishes the message outbox to Kafka; deletes a row only after its delivery report.
 *
 * A round opens a transaction and takes a batch with one DELETE ... RETURNING (FOR UPDATE
 * SKIP LOCKED, so relays never wait on each other), produces it with the idempotent producer
 * and waits for every delivery report. All delivered: COMMIT, and the rows are gone. Anything
 * else: ROLLBACK (every row is back), then one statement deletes the delivered rows and puts
 * the failed ones back with a backoff. Until COMMIT the deletion is invisible to everyone, so
 * a relay that dies mid-round (its connection closes) or hangs (the session's
 * idle_in_transaction_session_timeout ends it) gives its rows back at once: a message may be
 * published twice (consumers deduplicate by the CloudEvent id, which the "ce_id" header also
 * carries) but is never lost. No lease UPDATE per row: one statement and one commit per round.
 *
 * On a ledger of schema 17 or later the relay drains message_refs beside message_outbox: a row
 * there names the "transition" audit event an outcome reports, and the statement that takes it
 * reads that event and its effect (REF_BUILD) so that the event is built here, with the
 * dispatcher's builder (tally_ce_effect_text, through tally_relay_ref_event), from rows that never
 * change: the same bytes on every retry (docs/hacking.md, "Outcome messages by reference").
 */
#include "tally/relay.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <openssl/evp.h>

#include "tally/backoff.h"
#include "tally/crashpoint.h"
#include "tally/kafka.h"
#include "tally/log.h"
#include "tally/pg.h"
#include "tally/cloudevent.h"
#include "tally/text.h"

#define NOTIFY_CHANNEL      "tally_message_outbox"
#define DEFAULT_MSG_TIMEOUT 30000
#define GAUGE_REFRESH_MS    1000
#define STOP_WAIT_CAP_MS    5000

/* The logical topics message_outbox allows (its CHECK constraint). */
static const char *const RELAY_TOPICS[] = {"outcomes", "obligations", "alerts", "dlq"};
#define N_RELAY_TOPICS (sizeof(RELAY_TOPICS) / sizeof(RELAY_TOPICS[0]))

/* Take up to $1 due rows, in id order, inside the round's transaction. lease_until is only
 * set on rows waiting out a backoff (or leased by a relay of an older version). The session
 * ends itself ($2 ms) if this relay ever stops between here and its COMMIT. */
static const char SQL_TAKE[] =
    "WITH t AS (SELECT set_config('idle_in_transaction_session_timeout', $2, true))"
    " DELETE FROM message_outbox m USING t"
    " WHERE m.id IN (SELECT id FROM message_outbox"
    "  WHERE lease_until IS NULL OR lease_until < now()"
    "  ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)"
    " RETURNING m.id, m.topic, m.msg_key, m.event_id, m.payload, m.reply::text";

/* What a reference's event is built from (ref_payload): of its "transition" audit event EV
 * (whose id is the event's id) the time, actor, state and data, and of the effect E what never
 * changes once the transition is written; its receipt only for CONFIRMED, a terminal state.
 * REF_NONE: as many NULLs, for the rows that are copies. */
// clang-format off
#define REF_BUILD(EV, E)                                                                           \
    TALLY_SQL_EVENT_TIME(EV ".occurred_at") ","                                                    \
    " " EV ".actor, " EV ".to_status, " EV ".data::text, " E ".effect_id::text, " E ".run_id,"     \
    " " E ".step, " TALLY_SQL_STEP_IS_NUMBER(E) ", " E ".tool, " E ".operation_key,"               \
    " " E ".intent_id, CASE WHEN " EV ".to_status = 'CONFIRMED' THEN " E ".receipt::text END"
#define REF_NONE                                                                                   \
    "NULL::text, NULL::text, NULL::text, NULL::text, NULL::text, NULL::text, NULL::text,"          \
    " NULL::boolean, NULL::text, NULL::text, NULL::text, NULL::text"

/* SQL_TAKE on schema 17: message_refs too, each reference with what its event is built from
 * (a reference whose audit event is missing comes back with NULLs there: it fails, and waits
 * out a backoff, rather than being lost). Both tables share one sequence, so the rows of both
 * sort into one order. The audit event and its effect are read through a subquery the planner
 * keeps apart (OFFSET 0): two primary-key probes per reference, never a hash join that would
 * read the whole events table for a round's few rows. */
#define TAKE_DUE(TABLE)                                                                            \
    " m.id IN (SELECT id FROM " TABLE " WHERE lease_until IS NULL OR lease_until < now()"          \
    "  ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)"
static const char SQL_TAKE_REFS[] =
    "WITH t AS (SELECT set_config('idle_in_transaction_session_timeout', $2, true)),"
    " mo AS (DELETE FROM message_outbox m USING t WHERE" TAKE_DUE("message_outbox")
    "  RETURNING m.id, m.topic, m.msg_key, m.event_id, m.payload, m.reply::text),"
    " mr AS (DELETE FROM message_refs m USING t WHERE" TAKE_DUE("message_refs")
    "  RETURNING m.id, m.msg_key, m.event_id)"
    " SELECT id, topic, msg_key, event_id, payload, reply, " REF_NONE " FROM mo"
    " UNION ALL SELECT mr.id, 'outcomes', mr.msg_key, mr.event_id::text, NULL, NULL, b.*"
    " FROM mr LEFT JOIN LATERAL (SELECT " REF_BUILD("ev", "e") " FROM events ev"
    "  JOIN effects e ON e.effect_id = ev.effect_id WHERE ev.event_id = mr.event_id"
    "  OFFSET 0) b ON true";
// clang-format on

/* Delivered after their round gave up on them: gone. */
static const char SQL_DELETE[] = "DELETE FROM message_outbox WHERE id = ANY($1::bigint[])";
static const char SQL_DELETE_REFS[] =
    "WITH mo AS (DELETE FROM message_outbox WHERE id = ANY($1::bigint[]))"
    " DELETE FROM message_refs WHERE id = ANY($1::bigint[])";

/* Handed over but never published (the relay stopped first): anybody may take them now. */
static const char SQL_RELEASE[] = "UPDATE message_outbox SET lease_owner = NULL, lease_until = NULL"
                                  " WHERE id = ANY($1::bigint[]) AND lease_owner = $2";
static const char SQL_RELEASE_REFS[] =
    "WITH mo AS (UPDATE message_outbox SET lease_owner = NULL, lease_until = NULL"
    " WHERE id = ANY($1::bigint[]) AND lease_owner = $2)"
    " UPDATE message_refs SET lease_owner = NULL, lease_until = NULL"
    " WHERE id = ANY($1::bigint[]) AND lease_owner = $2";

/* After a ROLLBACK: the delivered rows go; the failed ones wait 1 s, 2 s, 4 s ... 30 s, with
 * the reason; those without a report yet wait out the lease ($1 ms), deleted by a late report.
 * A row another relay took meanwhile is waited for; if it deleted it, nothing happens.
 * A reply (topic 'replies') that failed REPLY_MAX_ATTEMPTS times is given up: its destination
 * does not take it (no such topic or partition), and the answer is on <prefix>outcomes; the
 * statement returns how many were given up. */
#define REPLY_MAX_ATTEMPTS 8
#define STR_(x)            #x
#define STR(x)             STR_(x)
// clang-format off
#define SETTLE_BACKOFF(M)                                                                          \
    " attempts = " M ".attempts + 1, last_error = f.err,"                                          \
    " lease_owner = CASE WHEN f.st = 'pending' THEN $3 END,"                                       \
    " lease_until = CASE WHEN f.st = 'pending' THEN now() + $1::int * interval '1 millisecond'"    \
    "  ELSE now() + least(interval '30 seconds',"                                                  \
    "   interval '1 second' * power(2, least(" M ".attempts, 5))) END"
#define SETTLE_OUTBOX                                                                              \
    "WITH f AS (SELECT * FROM json_to_recordset($2::json) AS f(id bigint, st text, err text)),"    \
    " d AS (DELETE FROM message_outbox m USING f WHERE m.id = f.id AND f.st = 'delivered'),"       \
    " g AS (DELETE FROM message_outbox m USING f WHERE m.id = f.id AND f.st <> 'delivered'"        \
    "  AND m.topic = 'replies' AND m.attempts + 1 >= " STR(REPLY_MAX_ATTEMPTS)                     \
    "  RETURNING m.id, m.event_id, m.reply ->> 'topic' AS dest, f.err),"                           \
    " u AS (UPDATE message_outbox m SET" SETTLE_BACKOFF("m")                                       \
    "  FROM f WHERE m.id = f.id AND f.st <> 'delivered'"                                           \
    "  AND NOT (m.topic = 'replies' AND m.attempts + 1 >= " STR(REPLY_MAX_ATTEMPTS) "))"
static const char SQL_SETTLE[] = SETTLE_OUTBOX " SELECT event_id, dest, err FROM g";
/* The same for both tables (schema 17): a reference is no reply, and is never given up. */
static const char SQL_SETTLE_REFS[] =
    SETTLE_OUTBOX ","
    " rd AS (DELETE FROM message_refs m USING f WHERE m.id = f.id AND f.st = 'delivered'),"
    " ru AS (UPDATE message_refs m SET" SETTLE_BACKOFF("m")
    "  FROM f WHERE m.id = f.id AND f.st <> 'delivered')"
    " SELECT event_id, dest, err FROM g";
// clang-format on

/* How long a round waits for the reports of replies once every other message of the round is
 * reported: a reply topic that does not exist holds its message for the topic's whole message
 * timeout (REPLY_TIMEOUT_MS); the round goes on without it, and its row waits out the lease. */
#define REPLY_WAIT_MS    200
#define REPLY_TIMEOUT_MS "10000"
#define REPLY_CORR_MAX   256

/* Exact up to 10,000 rows; beyond that the id span (an upper bound), so a large backlog costs
 * two index probes instead of a scan. The lag is the age of the first row. */
static const char SQL_BACKLOG[] =
    "WITH head AS (SELECT id, created_at FROM message_outbox ORDER BY id LIMIT 1),"
    " n AS (SELECT count(*) AS n FROM (SELECT 1 FROM message_outbox LIMIT 10000) x)"
    " SELECT CASE WHEN n.n < 10000 THEN n.n"
    "  ELSE (SELECT max(id) FROM message_outbox) - head.id + 1 END,"
    " coalesce(extract(epoch FROM now() - head.created_at), 0)::float8,"
    " to_regclass('message_refs') IS NOT NULL"
    " FROM n LEFT JOIN head ON true";
/* The same over both tables (schema 17), each table counted as above. */
#define BACKLOG_OF(T, H, N)                                                                        \
    " " H " AS (SELECT id, created_at FROM " T " ORDER BY id LIMIT 1),"                            \
    " " N " AS (SELECT CASE WHEN c.n < 10000 THEN c.n"                                             \
    "  ELSE (SELECT max(id) FROM " T ") - (SELECT id FROM " H ") + 1 END AS n"                     \
    "  FROM (SELECT count(*) AS n FROM (SELECT 1 FROM " T " LIMIT 10000) x) c)"
// clang-format off
static const char SQL_BACKLOG_REFS[] =
    "WITH" BACKLOG_OF("message_outbox", "ho", "no") "," BACKLOG_OF("message_refs", "hr", "nr")
    " SELECT (SELECT n FROM no) + (SELECT n FROM nr),"
    " coalesce(extract(epoch FROM now() - least((SELECT created_at FROM ho),"
    "  (SELECT created_at FROM hr))), 0)::float8, true";
// clang-format on

typedef enum {
    RELAY_ROW_PENDING = 0,
    RELAY_ROW_DELIVERED,
    RELAY_ROW_FAILED,
} relay_row_state_t;

typedef struct relay_row {
    int64_t id;
    const char *topic; /* logical name; points into the round's PGresult */
    const char *key;   /* may be NULL */
    const char *event_id;
    const char *payload;
    int payload_len;
    const char *reply; /* topic 'replies': the destination (JSON), else NULL */
    char *built;       /* a reference's event, built by the relay (payload points at it) */
    relay_row_state_t state;
    char error[256];
} relay_row_t;

/* A message handed over by tally_relay_hand, its strings in the same allocation. */
typedef struct relay_hand {
    int64_t id;
    const char *topic, *key, *event_id, *payload, *reply;
    int payload_len;
    char data[];
} relay_hand_t;

/* A growable list of row ids. */
typedef struct id_list {
    int64_t *ids;
    size_t n, cap;
} id_list_t;

struct tally_relay {
    char *prefix;
    char *owner; /* lease_owner of rows held after a round without every report */
    char *worker_id;
    int batch;
    int poll_ms;
    int lease_ms; /* longer than the longest wait for delivery reports */
    int wait_ms;  /* message.timeout.ms plus a margin: every report arrives within it */
    bool refs;    /* the ledger has message_refs (schema 17): drain it too */

    const tally_config_t *cfg; /* for re-creating the producer after a fatal error */
    tally_pg_t *pg;
    rd_kafka_t *rk;
    /* handles for RELAY_TOPICS, made with the producer so their metadata is fetched early */
    rd_kafka_topic_t *rkt[N_RELAY_TOPICS];

    tally_metrics_t *metrics;
    tally_metric_t *m_published;
    tally_metric_t *m_failures;
    tally_metric_t *m_replies_dropped;
    tally_metric_t *m_backlog;
    tally_metric_t *m_lag;
    int64_t gauges_at_ms;

    /* the current round: delivery reports are matched to rows by id */
    relay_row_t *rows;
    size_t n_rows;
    size_t pending;
    size_t pending_replies; /* of pending: replies */
    /* delivered after their round stopped waiting (or whose DELETE failed): deleted next round */
    id_list_t late;

    /* handed over (tally_relay_hand), published before anything else; hand_mu guards them */
    pthread_mutex_t hand_mu;
    bool hand_init;
    relay_hand_t **hand;
    size_t n_hand, cap_hand;
    int hand_fd; /* eventfd: wakes the waiting relay when something is handed over */

    pthread_t thread;
    bool started;
    volatile const int *stop;
    atomic_int closing;
};

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static bool id_list_push(id_list_t *l, int64_t id)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        int64_t *grown = realloc(l->ids, cap * sizeof(*grown));
        if (grown == NULL)
            return false;
        l->ids = grown;
        l->cap = cap;
    }
    l->ids[l->n++] = id;
    return true;
}

static bool stopping(const tally_relay_t *r)
{
    return atomic_load(&r->closing) || (r->stop != NULL && *r->stop);
}

static int cmp_row_id(const void *a, const void *b)
{
    int64_t x = ((const relay_row_t *)a)->id, y = ((const relay_row_t *)b)->id;
    return (x > y) - (x < y);
}

static relay_row_t *find_row(tally_relay_t *r, int64_t id)
{
    relay_row_t key = {.id = id};
    if (r->n_rows == 0)
        return NULL;
    return bsearch(&key, r->rows, r->n_rows, sizeof(*r->rows), cmp_row_id);
}

/* Called from rd_kafka_poll/flush on the thread that polls: the relay's own. */
static void on_delivery(rd_kafka_t *rk, const rd_kafka_message_t *msg, void *opaque)
{
    (void)rk;
    tally_relay_t *r = opaque;
    int64_t id = (int64_t)(intptr_t)msg->_private;
    relay_row_t *row = find_row(r, id);
    if (row == NULL || row->state != RELAY_ROW_PENDING) {
        /* a report for an earlier round that stopped waiting for it */
        if (msg->err == RD_KAFKA_RESP_ERR_NO_ERROR) {
            if (!id_list_push(&r->late, id))
                TALLY_WARN("message_outbox row %" PRId64 " was delivered late but cannot be "
                           "queued for deletion (out of memory); it will be published again",
                           id);
        } else {
            TALLY_WARN("message_outbox row %" PRId64 " not delivered: %s; it will be retried "
                       "when its lease ends",
                       id, rd_kafka_err2str(msg->err));
        }
        return;
    }
    if (msg->err == RD_KAFKA_RESP_ERR_NO_ERROR) {
        row->state = RELAY_ROW_DELIVERED;
    } else {
        row->state = RELAY_ROW_FAILED;
        snprintf(row->error, sizeof(row->error), "%s", rd_kafka_err2str(msg->err));
    }
    r->pending--;
    if (row->reply != NULL)
        r->pending_replies--;
}

/* The message timeout the producer runs with: a passthrough, or tally's default. */
static int message_timeout_ms(const tally_config_t *cfg)
{
    for (size_t i = 0; i < cfg->n_kafka_props; i++)
        if (strcmp(cfg->kafka_props[i].name, "message.timeout.ms") == 0 ||
            strcmp(cfg->kafka_props[i].name, "delivery.timeout.ms") == 0) {
            long v = strtol(cfg->kafka_props[i].value, NULL, 10);
            /* 0 means "no limit" to librdkafka; the lease still has to end somewhere */
            return v > 0 && v < 3600000 ? (int)v : 300000;
        }
    return DEFAULT_MSG_TIMEOUT;
}

static void drop_producer(tally_relay_t *r)
{
    for (size_t i = 0; i < N_RELAY_TOPICS; i++) {
        if (r->rkt[i] != NULL)
            rd_kafka_topic_destroy(r->rkt[i]);
        r->rkt[i] = NULL;
    }
    rd_kafka_t *rk = r->rk;
    r->rk = NULL;
    tally_kafka_producer_close(rk, 5000);
}

static bool make_producer(tally_relay_t *r, char *errstr, size_t errsz)
{
    r->rk = tally_kafka_producer_new(r->cfg, true, on_delivery, r, errstr, errsz);
    if (r->rk == NULL)
        return false;
    for (size_t i = 0; i < N_RELAY_TOPICS; i++) {
        char name[512];
        snprintf(name, sizeof(name), "%s%s", r->prefix, RELAY_TOPICS[i]);
        r->rkt[i] = rd_kafka_topic_new(r->rk, name, NULL);
        if (r->rkt[i] == NULL) {
            snprintf(errstr, errsz, "Kafka topic %s: %s", name,
                     rd_kafka_err2str(rd_kafka_last_error()));
            drop_producer(r);
            return false;
        }
    }
    return true;
}

static rd_kafka_topic_t *topic_handle(tally_relay_t *r, const char *logical)
{
    for (size_t i = 0; i < N_RELAY_TOPICS; i++)
        if (strcmp(RELAY_TOPICS[i], logical) == 0)
            return r->rkt[i];
    return NULL;
}

tally_relay_t *tally_relay_new(const tally_config_t *cfg, tally_metrics_t *metrics, char *errstr,
                               size_t errsz)
{
    tally_relay_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        snprintf(errstr, errsz, "relay: out of memory");
        return NULL;
    }
    r->cfg = cfg;
    r->hand_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    r->hand_init = pthread_mutex_init(&r->hand_mu, NULL) == 0;
    if (r->hand_fd < 0 || !r->hand_init) {
        snprintf(errstr, errsz, "relay: cannot create its hand-over queue: %s", strerror(errno));
        tally_relay_free(r);
        return NULL;
    }
    r->prefix = strdup(cfg->topic_prefix ? cfg->topic_prefix : "");
    r->worker_id = strdup(cfg->worker_id ? cfg->worker_id : "tally");
    size_t olen = strlen(r->worker_id ? r->worker_id : "") + sizeof("/relay");
    r->owner = malloc(olen);
    if (r->prefix == NULL || r->worker_id == NULL || r->owner == NULL) {
        snprintf(errstr, errsz, "relay: out of memory");
        tally_relay_free(r);
        return NULL;
    }
    snprintf(r->owner, olen, "%s/relay", r->worker_id);
    r->batch = cfg->relay_batch > 0 ? cfg->relay_batch : 500;
    r->poll_ms = cfg->poll_ms > 0 ? cfg->poll_ms : 1000;
    r->wait_ms = message_timeout_ms(cfg) + 5000;
    r->lease_ms = cfg->lease_ms > r->wait_ms + 5000 ? cfg->lease_ms : r->wait_ms + 5000;

    r->pg = tally_pg_new(cfg->pg, "tally-relay");
    if (r->pg == NULL) {
        snprintf(errstr, errsz, "relay: out of memory");
        tally_relay_free(r);
        return NULL;
    }
    tally_pg_set_deadline(r->pg, cfg->pg_deadline_ms);
    if (strlen(r->prefix) > 200) {
        snprintf(errstr, errsz, "TALLY_TOPIC_PREFIX is longer than 200 bytes");
        tally_relay_free(r);
        return NULL;
    }
    if (!make_producer(r, errstr, errsz)) {
        tally_relay_free(r);
        return NULL;
    }
    if (metrics != NULL) {
        r->metrics = metrics;
        r->m_published = tally_metrics_counter(
            metrics, "tally_relay_published_total",
            "Outbox messages published to Kafka (delivery acknowledged)", "topic");
        r->m_failures = tally_metrics_counter(metrics, "tally_relay_failures_total",
                                              "Outbox messages whose delivery failed", NULL);
        r->m_replies_dropped = tally_metrics_counter(
            metrics, "tally_relay_replies_dropped_total",
            "Replies given up after 8 failed attempts (their destination does not take them; "
            "the answer is on <prefix>outcomes)",
            NULL);
        r->m_backlog = tally_metrics_gauge(metrics, "tally_outbox_backlog",
                                           "Rows waiting in message_outbox", NULL);
        r->m_lag = tally_metrics_gauge(metrics, "tally_relay_lag_seconds",
                                       "Age of the oldest row in message_outbox", NULL);
    }
    return r;
}

/* At most once a second. An idle relay wakes at least every poll interval, so the gauges
 * never lag by more than that; refreshing after every small round would cost a statement per
 * round at low rates. */
static void refresh_gauges(tally_relay_t *r)
{
    if (r->metrics == NULL)
        return;
    int64_t now = mono_ms();
    if (r->gauges_at_ms != 0 && now - r->gauges_at_ms < GAUGE_REFRESH_MS)
        return;
    r->gauges_at_ms = now;
    tally_error_t err;
    PGresult *res = tally_pg_exec(r->pg, r->refs ? SQL_BACKLOG_REFS : SQL_BACKLOG, 0, NULL, &err);
    if (res == NULL) {
        TALLY_DEBUG("relay: cannot read the outbox backlog: %s", err.message);
        return;
    }
    tally_metric_set(r->m_backlog, strtod(PQgetvalue(res, 0, 0), NULL));
    tally_metric_set(r->m_lag, strtod(PQgetvalue(res, 0, 1), NULL));
    if (!r->refs && PQgetvalue(res, 0, 2)[0] == 't') {
        /* migrated to schema 17 while running: take references from the next round on */
        TALLY_INFO("relay: the ledger has message_refs now; draining it too");
        r->refs = true;
    }
    PQclear(res);
}

/* "{1,2,3}" for a bigint[] parameter. @returns malloc'd text or NULL. */
static char *bigint_array(const int64_t *ids, size_t n)
{
    size_t cap = 2 + n * 21 + 1;
    char *s = malloc(cap);
    if (s == NULL)
        return NULL;
    size_t len = 0;
    s[len++] = '{';
    for (size_t i = 0; i < n; i++)
        len += (size_t)snprintf(s + len, cap - len, "%s%" PRId64, i ? "," : "", ids[i]);
    s[len++] = '}';
    s[len] = '\0';
    return s;
}

/* DELETE rows whose report came after their round settled them; kept for the next round
 * when PostgreSQL is unreachable (otherwise they would only be published again). */
static void delete_late(tally_relay_t *r)
{
    if (r->late.n == 0)
        return;
    char *arr = bigint_array(r->late.ids, r->late.n);
    if (arr == NULL) {
        TALLY_WARN("relay: out of memory deleting %zu delivered rows; retrying", r->late.n);
        return;
    }
    const char *params[1] = {arr};
    tally_error_t err;
    bool ok = tally_pg_run(r->pg, r->refs ? SQL_DELETE_REFS : SQL_DELETE, 1, params, &err);
    free(arr);
    if (!ok) {
        TALLY_WARN("relay: cannot delete %zu delivered message_outbox rows (%s: %s); retrying",
                   r->late.n, err.code, err.message);
        return;
    }
    r->late.n = 0;
}

static const char *const ROW_STATE_NAMES[] = {"pending", "delivered", "failed"};

/* After the round's ROLLBACK: delete what was delivered, back off what failed, hold what has
 * no report yet until the lease ends, in one statement. */
static void settle_round(tally_relay_t *r)
{
    /* Usually every row was delivered: delete them by id, through the primary key. (The
     * general statement below joins a json_to_recordset, which the planner may answer with a
     * scan of the whole table, dead rows included, on every round.) */
    size_t delivered = 0;
    for (size_t i = 0; i < r->n_rows; i++)
        delivered += r->rows[i].state == RELAY_ROW_DELIVERED;
    if (delivered == r->n_rows) {
        int64_t *ids = malloc((r->n_rows ? r->n_rows : 1) * sizeof *ids);
        for (size_t i = 0; ids != NULL && i < r->n_rows; i++)
            ids[i] = r->rows[i].id;
        char *text = ids ? bigint_array(ids, r->n_rows) : NULL;
        free(ids);
        tally_error_t err;
        const char *params[1] = {text};
        if (text == NULL)
            TALLY_WARN("relay: out of memory settling %zu message_outbox rows; they are "
                       "published again",
                       r->n_rows);
        else if (!tally_pg_run(r->pg, r->refs ? SQL_DELETE_REFS : SQL_DELETE, 1, params, &err))
            TALLY_WARN("relay: cannot delete %zu published message_outbox rows (%s: %s); they "
                       "are published again",
                       r->n_rows, err.code, err.message);
        free(text);
        return;
    }
    json_t *arr = json_array();
    for (size_t i = 0; arr != NULL && i < r->n_rows; i++) {
        relay_row_t *row = &r->rows[i];
        json_t *item = json_pack("{s:I, s:s, s:s?}", "id", (json_int_t)row->id, "st",
                                 ROW_STATE_NAMES[row->state], "err",
                                 row->state == RELAY_ROW_FAILED ? row->error : NULL);
        if (json_array_append_new(arr, item) != 0) {
            json_decref(arr);
            arr = NULL;
        }
    }
    char *text = arr ? json_dumps(arr, JSON_COMPACT) : NULL;
    json_decref(arr);
    if (text == NULL) {
        TALLY_WARN("relay: out of memory settling %zu message_outbox rows; they are published "
                   "again",
                   r->n_rows);
        return;
    }
    char lease[16];
    snprintf(lease, sizeof(lease), "%d", r->lease_ms);
    const char *params[3] = {lease, text, r->owner};
    tally_error_t err;
    PGresult *res = tally_pg_exec(r->pg, r->refs ? SQL_SETTLE_REFS : SQL_SETTLE, 3, params, &err);
    if (res == NULL)
        TALLY_WARN("relay: cannot settle %zu message_outbox rows (%s: %s); they are published "
                   "again",
                   r->n_rows, err.code, err.message);
    for (int i = 0; res != NULL && i < PQntuples(res); i++) {
        TALLY_WARN("relay: reply %s to topic %s given up after %d attempts (%s); the answer is "
                   "on the outcomes topic",
                   PQgetvalue(res, i, 0), PQgetvalue(res, i, 1), REPLY_MAX_ATTEMPTS,
                   PQgetisnull(res, i, 2) ? "no delivery report" : PQgetvalue(res, i, 2));
        if (r->m_replies_dropped != NULL)
            tally_metric_add(r->m_replies_dropped, 1.0);
    }
    PQclear(res);
    free(text);
}

/* base64 @p in into @p out (at most @p cap bytes). @returns the length, or -1. */
static int b64_decode(const char *in, unsigned char *out, size_t cap)
{
    size_t n = strlen(in);
    if (n == 0)
        return 0;
    if (n % 4 != 0 || n / 4 * 3 > cap)
        return -1;
    int len = EVP_DecodeBlock(out, (const unsigned char *)in, (int)n);
    if (len < 0)
        return -1;
    /* EVP_DecodeBlock counts the padding as zero bytes */
    if (in[n - 1] == '=')
        len--;
    if (n >= 2 && in[n - 2] == '=')
        len--;
    return len;
}

/* Where a reply goes (the row's destination, written by intake): its topic handle, partition
 * and correlation bytes. @returns false with the reason in row->error. */
typedef struct reply_dest {
    rd_kafka_topic_t *rkt; /* a reference of our own: rd_kafka_topic_destroy after producing */
    int32_t partition;
    unsigned char corr[REPLY_CORR_MAX];
    int corr_len; /* -1: none */
} reply_dest_t;

static bool reply_dest(tally_relay_t *r, relay_row_t *row, reply_dest_t *out)
{
    out->rkt = NULL;
    out->partition = RD_KAFKA_PARTITION_UA;
    out->corr_len = -1;
    json_t *dest = json_loads(row->reply, 0, NULL);
    const char *topic = json_string_value(json_object_get(dest, "topic"));
    json_t *part = json_object_get(dest, "partition");
    const char *corr = json_string_value(json_object_get(dest, "correlation"));
    bool ok = topic != NULL && *topic != '\0' && (part == NULL || json_is_integer(part));
    if (ok && part != NULL) {
        json_int_t p = json_integer_value(part);
        ok = p >= 0 && p <= INT32_MAX;
        out->partition = (int32_t)p;
    }
    if (ok && corr != NULL) {
        out->corr_len = b64_decode(corr, out->corr, sizeof out->corr);
        ok = out->corr_len >= 0;
    }
    if (!ok) {
        json_decref(dest);
        snprintf(row->error, sizeof(row->error), "the reply destination is not usable");
        return false;
    }
    /* A topic that does not exist holds a message for the whole message timeout: a reply's
     * is short, so one bad destination delays only itself. */
    char errstr[256];
    rd_kafka_topic_conf_t *tconf = rd_kafka_topic_conf_new();
    if (tconf != NULL && rd_kafka_topic_conf_set(tconf, "message.timeout.ms", REPLY_TIMEOUT_MS,
                                                 errstr, sizeof errstr) != RD_KAFKA_CONF_OK) {
        rd_kafka_topic_conf_destroy(tconf);
        tconf = NULL;
    }
    out->rkt = rd_kafka_topic_new(r->rk, topic, tconf);
    if (out->rkt == NULL)
        tally_fmt(row->error, sizeof(row->error), "reply topic '%s': %s", topic,
                  rd_kafka_err2str(rd_kafka_last_error()));
    json_decref(dest);
    return out->rkt != NULL;
}

static void produce_row(tally_relay_t *r, relay_row_t *row, int64_t deadline)
{
    reply_dest_t dest = {.rkt = NULL, .partition = RD_KAFKA_PARTITION_UA, .corr_len = -1};
    if (row->reply != NULL && !reply_dest(r, row, &dest)) {
        row->state = RELAY_ROW_FAILED;
        return;
    }
    rd_kafka_topic_t *rkt = row->reply != NULL ? dest.rkt : topic_handle(r, row->topic);
    if (rkt == NULL) { /* the table's CHECK constraint makes this unreachable */
        row->state = RELAY_ROW_FAILED;
        tally_fmt(row->error, sizeof(row->error), "unknown logical topic '%s'", row->topic);
        return;
    }
    const char *payload = row->payload;
    size_t len = (size_t)row->payload_len;
    char *cut = NULL;
    for (;;) {
        rd_kafka_headers_t *hdrs = rd_kafka_headers_new(2);
        rd_kafka_header_add(hdrs, "ce_id", -1, row->event_id, -1);
        if (dest.corr_len >= 0) /* Spring Kafka's ReplyingKafkaTemplate matches on it */
            rd_kafka_header_add(hdrs, "kafka_correlationId", -1, dest.corr, dest.corr_len);
        rd_kafka_resp_err_t e =
            rd_kafka_producev(r->rk, RD_KAFKA_V_RKT(rkt), RD_KAFKA_V_PARTITION(dest.partition),
                              RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
                              RD_KAFKA_V_KEY(row->key, row->key ? strlen(row->key) : 0),
                              RD_KAFKA_V_VALUE((void *)payload, len), RD_KAFKA_V_HEADERS(hdrs),
                              RD_KAFKA_V_OPAQUE((void *)(intptr_t)row->id), RD_KAFKA_V_END);
        if (e == RD_KAFKA_RESP_ERR_NO_ERROR) { /* the message owns the headers now */
            r->pending++;
            if (row->reply != NULL)
                r->pending_replies++;
            break;
        }
        rd_kafka_headers_destroy(hdrs);
        if (e == RD_KAFKA_RESP_ERR__QUEUE_FULL && mono_ms() < deadline) {
            rd_kafka_poll(r->rk, 100); /* serve delivery reports to make room */
            continue;
        }
        if (e == RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE && len > 8192) {
            /* The producer's message.max.bytes (TALLY_KAFKA_MESSAGE_MAX_BYTES) is below tally's
             * event limit: publish the event cut to half its size (cloudevent.h), and again
             * until it fits, rather than retry, forever, what can never go. The ledger keeps
             * the whole. */
            char *whole = strndup(payload, len);
            char *half = whole != NULL ? tally_ce_bounded(whole, len / 2) : NULL;
            free(whole);
            if (half != NULL) {
                free(cut);
                cut = half;
                TALLY_WARN("relay: event %s (%zu bytes) is above the producer's message.max.bytes; "
                           "publishing it cut to %zu bytes (data.truncated says what was cut)",
                           row->event_id, len, strlen(cut));
                payload = cut;
                len = strlen(cut);
                continue;
            }
        }
        row->state = RELAY_ROW_FAILED;
        snprintf(row->error, sizeof(row->error), "produce refused: %s", rd_kafka_err2str(e));
        break;
    }
    free(cut);
    if (dest.rkt != NULL)
        rd_kafka_topic_destroy(dest.rkt);
}

/* A receipt as the ledger gives it back (jsonb's text, with spaces) in the compact form the
 * events carry: its tokens byte for byte when json_scan.c is sure of them, else jansson's
 * compact form of it, else the ledger's text itself. Each is a function of the stored value
 * alone, so every build writes the same bytes. @returns malloc'd text, or NULL (memory). */
static char *receipt_compact(const char *text, size_t len)
{
    const char *ref = NULL;
    size_t ref_len = 0;
    char *compact = tally_json_object_compact(text, len, NULL, &ref, &ref_len);
    if (compact != NULL)
        return compact;
    json_t *doc = json_loadb(text, len, TALLY_JSON_LOAD_FLAGS, NULL);
    compact = doc != NULL ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    return compact != NULL ? compact : strndup(text, len);
}

char *tally_relay_ref_event(tally_effect_event_t *e, const char *receipt, size_t len, char *why,
                            size_t whysz)
{
    char *compact = NULL;
    if (receipt != NULL && (compact = receipt_compact(receipt, len)) == NULL) {
        tally_fmt(why, whysz, "out of memory");
        return NULL;
    }
    e->receipt_text = compact;
    char id[37];
    char *payload = tally_ce_effect_text(e, id);
    e->receipt_text = NULL;
    free(compact);
    if (payload == NULL) {
        tally_fmt(why, whysz, "out of memory");
        return NULL;
    }
    size_t n = strlen(payload);
    if (n > TALLY_LIMIT_EVENT_BYTES) {
        char *bounded = tally_ce_bounded(payload, TALLY_LIMIT_EVENT_BYTES);
        if (bounded == NULL)
            tally_fmt(why, whysz,
                      "the event is %zu bytes, above the limit of %d, and could not be cut", n,
                      TALLY_LIMIT_EVENT_BYTES);
        free(payload);
        payload = bounded;
    }
    return payload;
}

/* The event of a message_refs row, from the REF_BUILD columns of @p res at row @p row from
 * column @p c on (tally_relay_ref_event). @returns malloc'd text, or NULL with the reason in
 * @p why. */
static char *ref_payload(const PGresult *res, int row, int c, const char *event_id, char *why,
                         size_t whysz)
{
    if (PQgetisnull(res, row, c) || PQgetisnull(res, row, c + 4)) {
        tally_fmt(why, whysz, "its audit event %s or its effect is not in the ledger", event_id);
        return NULL;
    }
    json_t *data = json_loads(PQgetvalue(res, row, c + 3), 0, NULL);
    if (data == NULL) {
        tally_fmt(why, whysz, "the data of its audit event %s is not JSON", event_id);
        return NULL;
    }
    json_t *error = json_object_get(data, "error");
    char source[sizeof TALLY_CE_DISPATCHER_SOURCE + 256];
    tally_fmt(source, sizeof source, "%s%s", TALLY_CE_DISPATCHER_SOURCE,
              PQgetvalue(res, row, c + 1));
    const char *error_code = json_string_value(json_object_get(error, "code"));
    tally_effect_event_t e = {
        .source = source,
        .id = event_id,
        .time = PQgetvalue(res, row, c),
        .effect_id = PQgetvalue(res, row, c + 4),
        .run_id = PQgetvalue(res, row, c + 5),
        .step = PQgetvalue(res, row, c + 6),
        .step_is_number = PQgetvalue(res, row, c + 7)[0] == 't',
        .tool = PQgetvalue(res, row, c + 8),
        .operation_key = PQgetvalue(res, row, c + 9),
        .status = PQgetvalue(res, row, c + 2),
        .external_ref = json_string_value(json_object_get(data, "external_ref")),
        .error_code = error_code,
        .error_message =
            error_code != NULL ? json_string_value(json_object_get(error, "message")) : NULL,
        .attempts = (long long)json_integer_value(json_object_get(data, "attempt")),
        .intent_id = PQgetvalue(res, row, c + 10)};
    bool has_receipt = !PQgetisnull(res, row, c + 11);
    char *payload =
        tally_relay_ref_event(&e, has_receipt ? PQgetvalue(res, row, c + 11) : NULL,
                              has_receipt ? (size_t)PQgetlength(res, row, c + 11) : 0, why, whysz);
    json_decref(data);
    return payload;
}

/* After a fatal idempotent-producer error the instance is unusable: replace it. */
static void check_fatal(tally_relay_t *r)
{
    char why[512];
    rd_kafka_resp_err_t e = rd_kafka_fatal_error(r->rk, why, sizeof(why));
    if (e == RD_KAFKA_RESP_ERR_NO_ERROR)
        return;
    TALLY_ERROR("relay: fatal Kafka producer error (%s): %s; creating a new producer",
                rd_kafka_err2name(e), why);
    drop_producer(r); /* reports of purged messages are served here, as late reports */
    char errstr[512];
    if (!make_producer(r, errstr, sizeof(errstr)))
        TALLY_ERROR("relay: cannot create a new Kafka producer: %s", errstr);
}

/* Produce the current rows (r->rows, sorted by id) and wait for their delivery reports, at
 * most wait_ms from @p start (less when stopping); count how each row ended. */
static void publish_rows(tally_relay_t *r, int64_t start, size_t *delivered_out, size_t *failed_out,
                         size_t *unknown_out)
{
    int64_t deadline = start + r->wait_ms;
    for (size_t i = 0; i < r->n_rows; i++)
        if (r->rows[i].state == RELAY_ROW_PENDING) /* a reference may fail to build */
            produce_row(r, &r->rows[i], deadline);
    int64_t others_done = 0;
    while (r->pending > 0) {
        int64_t now = mono_ms();
        if (stopping(r) && deadline > now + STOP_WAIT_CAP_MS)
            deadline = now + STOP_WAIT_CAP_MS;
        if (now >= deadline)
            break;
        if (r->pending == r->pending_replies) {
            /* only replies left: a little longer, then they wait out their lease */
            if (others_done == 0)
                others_done = now;
            else if (now - others_done >= REPLY_WAIT_MS)
                break;
        }
        /* flush, not poll: it sends at once instead of after linger.ms, and serves reports */
        int64_t left = deadline - now;
        rd_kafka_flush(r->rk, left < 100 ? (int)left : 100);
    }

    size_t delivered = 0, failed = 0, unknown = 0;
    for (size_t i = 0; i < r->n_rows; i++) {
        relay_row_t *row = &r->rows[i];
        switch (row->state) {
        case RELAY_ROW_DELIVERED:
            delivered++;
            if (r->m_published != NULL)
                tally_metric_add(r->m_published, 1.0, row->topic);
            break;
        case RELAY_ROW_FAILED:
            failed++;
            if (r->m_failures != NULL)
                tally_metric_add(r->m_failures, 1.0);
            TALLY_WARN("relay: message_outbox row %" PRId64
                       " (topic %s, event %s) not delivered: %s; retrying after a backoff",
                       row->id, row->topic, row->event_id, row->error);
            break;
        case RELAY_ROW_PENDING:
            unknown++;
            break;
        }
    }
    *delivered_out = delivered;
    *failed_out = failed;
    *unknown_out = unknown;
}

int tally_relay_round(tally_relay_t *r)
{
    if (r->rk == NULL) {
        char errstr[512];
        if (!make_producer(r, errstr, sizeof(errstr))) {
            TALLY_ERROR("relay: cannot create the Kafka producer: %s", errstr);
            return -1;
        }
    }
    rd_kafka_poll(r->rk, 0); /* late reports from an earlier round */
    refresh_gauges(r);
    delete_late(r);

    char batch[16], lease[16];
    snprintf(batch, sizeof(batch), "%d", r->batch);
    snprintf(lease, sizeof(lease), "%d", r->lease_ms);
    const char *params[2] = {batch, lease};
    tally_error_t err;
    PGresult *res = NULL;
    if (tally_pg_begin(r->pg, &err))
        res = tally_pg_exec(r->pg, r->refs ? SQL_TAKE_REFS : SQL_TAKE, 2, params, &err);
    if (res == NULL) {
        tally_pg_rollback(r->pg);
        TALLY_LOG_REPEATING(TALLY_LOG_WARN, NULL, "relay: cannot take message_outbox rows (%s: %s)",
                            err.code, err.message);
        return -1;
    }
    int n = PQntuples(res);
    if (n == 0) {
        PQclear(res);
        tally_pg_rollback(r->pg);
        return 0;
    }
    r->rows = calloc((size_t)n, sizeof(*r->rows));
    if (r->rows == NULL) {
        PQclear(res);
        tally_pg_rollback(r->pg);
        TALLY_ERROR("relay: out of memory for %d rows; they stay in the outbox", n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        relay_row_t *row = &r->rows[i];
        row->id = strtoll(PQgetvalue(res, i, 0), NULL, 10);
        row->topic = PQgetvalue(res, i, 1);
        row->key = PQgetisnull(res, i, 2) ? NULL : PQgetvalue(res, i, 2);
        row->event_id = PQgetvalue(res, i, 3);
        row->payload = PQgetvalue(res, i, 4);
        row->payload_len = PQgetlength(res, i, 4);
        row->reply = PQgetisnull(res, i, 5) ? NULL : PQgetvalue(res, i, 5);
        if (PQgetisnull(res, i, 4)) { /* a reference (SQL_TAKE_REFS) */
            row->built = ref_payload(res, i, 6, row->event_id, row->error, sizeof row->error);
            row->payload = row->built != NULL ? row->built : "";
            row->payload_len = row->built != NULL ? (int)strlen(row->built) : 0;
            if (row->built == NULL) {
                row->state = RELAY_ROW_FAILED;
                TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                                    "relay: message_refs row %" PRId64 " (event %s) cannot be "
                                    "published: %s; retrying after a backoff",
                                    row->id, row->event_id, row->error);
            }
        }
    }
    /* keys of one run stay in outbox order; sorted ids also let reports find their row */
    qsort(r->rows, (size_t)n, sizeof(*r->rows), cmp_row_id);
    r->n_rows = (size_t)n;
    r->pending = 0;
    r->pending_replies = 0;

    int64_t start = mono_ms();
    size_t delivered = 0, failed = 0, unknown = 0;
    publish_rows(r, start, &delivered, &failed, &unknown);
    int result = (int)delivered;
    if (failed == 0 && unknown == 0) {
        TALLY_CRASHPOINT("relay.after_delivery");
        /* every row was acknowledged: now, and only now, their deletion becomes visible */
        if (!tally_pg_commit(r->pg, &err)) {
            tally_pg_rollback(r->pg);
            TALLY_WARN("relay: %zu messages published but their rows not deleted (%s: %s); "
                       "they will be published again",
                       delivered, err.code, err.message);
            result = -1;
        }
    } else {
        tally_pg_rollback(r->pg);
        if (unknown > 0)
            TALLY_WARN("relay: no delivery report for %zu message%s within %d ms; %s when the "
                       "lease ends unless the report still arrives",
                       unknown, unknown == 1 ? "" : "s", r->wait_ms,
                       unknown == 1 ? "it is retried" : "they are retried");
        settle_round(r);
    }
    if (delivered > 0)
        TALLY_DEBUG("relay: published %zu message%s in %lld ms", delivered,
                    delivered == 1 ? "" : "s", (long long)(mono_ms() - start));

    for (size_t i = 0; i < r->n_rows; i++)
        free(r->rows[i].built);
    free(r->rows);
    r->rows = NULL;
    r->n_rows = 0;
    r->pending = 0;
    PQclear(res);
    check_fatal(r);
    return result;
}

void tally_relay_use_refs(tally_relay_t *r, bool on)
{
    r->refs = on;
}

const char *tally_relay_owner(const tally_relay_t *r)
{
    return r->owner;
}

bool tally_relay_hand(tally_relay_t *r, const tally_relay_msg_t *msgs, size_t n)
{
    bool ok = true;
    pthread_mutex_lock(&r->hand_mu);
    for (size_t i = 0; i < n && ok; i++) {
        const tally_relay_msg_t *m = &msgs[i];
        if (r->n_hand == r->cap_hand) {
            size_t cap = r->cap_hand ? 2 * r->cap_hand : 256;
            relay_hand_t **grown = realloc(r->hand, cap * sizeof *grown);
            if (!grown) {
                ok = false;
                break;
            }
            r->hand = grown;
            r->cap_hand = cap;
        }
        size_t lt = strlen(m->topic) + 1, lk = m->key ? strlen(m->key) + 1 : 0,
               le = strlen(m->event_id) + 1, lr = m->reply ? strlen(m->reply) + 1 : 0;
        relay_hand_t *h = malloc(sizeof *h + lt + lk + le + lr + m->payload_len + 1);
        if (!h || m->payload_len > INT32_MAX) {
            free(h);
            ok = false;
            break;
        }
        char *p = h->data;
        h->id = m->id;
        h->topic = memcpy(p, m->topic, lt);
        p += lt;
        h->key = m->key ? memcpy(p, m->key, lk) : NULL;
        p += lk;
        h->event_id = memcpy(p, m->event_id, le);
        p += le;
        h->reply = m->reply ? memcpy(p, m->reply, lr) : NULL;
        p += lr;
        memcpy(p, m->payload, m->payload_len);
        p[m->payload_len] = '\0';
        h->payload = p;
        h->payload_len = (int)m->payload_len;
        r->hand[r->n_hand++] = h;
    }
    pthread_mutex_unlock(&r->hand_mu);
    uint64_t one = 1;
    if (write(r->hand_fd, &one, sizeof one) < 0 && errno != EAGAIN)
        TALLY_WARN("relay: cannot wake its thread: %s", strerror(errno));
    if (!ok)
        TALLY_WARN("relay: out of memory taking over %zu messages; they are published when "
                   "their lease ends",
                   n);
    return ok;
}

bool tally_relay_hand_result(tally_relay_t *r, const PGresult *res, int tag_col, char tag)
{
    int n = res ? PQntuples(res) : 0;
    if (r == NULL || n == 0)
        return true;
    tally_relay_msg_t *msgs = calloc((size_t)n, sizeof *msgs);
    if (msgs == NULL) {
        TALLY_WARN("relay: out of memory taking over %d messages; they are published when "
                   "their lease ends",
                   n);
        return false;
    }
    int c = tag_col >= 0 ? tag_col + 1 : 0;
    size_t k = 0;
    for (int row = 0; row < n; row++) {
        if (tag_col >= 0 && PQgetvalue(res, row, tag_col)[0] != tag)
            continue;
        msgs[k++] = (tally_relay_msg_t){
            .id = atoll(PQgetvalue(res, row, c)),
            .topic = PQgetvalue(res, row, c + 1),
            .key = PQgetisnull(res, row, c + 2) ? NULL : PQgetvalue(res, row, c + 2),
            .event_id = PQgetvalue(res, row, c + 3),
            .payload = PQgetvalue(res, row, c + 4),
            .payload_len = (size_t)PQgetlength(res, row, c + 4),
            .reply = PQgetisnull(res, row, c + 5) ? NULL : PQgetvalue(res, row, c + 5)};
    }
    bool ok = k == 0 || tally_relay_hand(r, msgs, k);
    free(msgs);
    return ok;
}

static bool hand_pending(tally_relay_t *r)
{
    pthread_mutex_lock(&r->hand_mu);
    bool any = r->n_hand > 0;
    pthread_mutex_unlock(&r->hand_mu);
    return any;
}

/* Publish what was handed over, then settle it in one statement: delivered rows are deleted,
 * failed ones backed off, the ones without a report held until their lease ends (as after a
 * round that could not commit). @returns messages delivered, -1 without a producer. */
static int hand_round(tally_relay_t *r)
{
    pthread_mutex_lock(&r->hand_mu);
    relay_hand_t **taken = r->hand;
    size_t n = r->n_hand;
    r->hand = NULL;
    r->n_hand = r->cap_hand = 0;
    pthread_mutex_unlock(&r->hand_mu);
    if (n == 0)
        return 0;
    int result = -1;
    char errstr[512];
    if (r->rk == NULL && !make_producer(r, errstr, sizeof(errstr))) {
        TALLY_ERROR("relay: cannot create the Kafka producer: %s; %zu handed-over messages are "
                    "published when their lease ends",
                    errstr, n);
        goto out;
    }
    r->rows = calloc(n, sizeof(*r->rows));
    if (r->rows == NULL) {
        TALLY_ERROR("relay: out of memory for %zu handed-over messages; they are published when "
                    "their lease ends",
                    n);
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        r->rows[i] = (relay_row_t){.id = taken[i]->id,
                                   .topic = taken[i]->topic,
                                   .key = taken[i]->key,
                                   .event_id = taken[i]->event_id,
                                   .payload = taken[i]->payload,
                                   .payload_len = taken[i]->payload_len,
                                   .reply = taken[i]->reply};
    qsort(r->rows, n, sizeof(*r->rows), cmp_row_id);
    r->n_rows = n;
    r->pending = 0;
    r->pending_replies = 0;
    rd_kafka_poll(r->rk, 0); /* late reports from an earlier round */
    int64_t start = mono_ms();
    size_t delivered = 0, failed = 0, unknown = 0;
    publish_rows(r, start, &delivered, &failed, &unknown);
    TALLY_CRASHPOINT("relay.after_delivery");
    settle_round(r);
    if (delivered > 0)
        TALLY_DEBUG("relay: published %zu handed-over message%s in %lld ms", delivered,
                    delivered == 1 ? "" : "s", (long long)(mono_ms() - start));
    result = (int)delivered;
    free(r->rows);
    r->rows = NULL;
    r->n_rows = 0;
    r->pending = 0;
    check_fatal(r);
out:
    for (size_t i = 0; i < n; i++)
        free(taken[i]);
    free(taken);
    return result;
}

/* Wait up to @p timeout_ms for a notification or a hand-over. @returns notifications. */
static int wait_for_work(tally_relay_t *r, int timeout_ms)
{
    if (hand_pending(r))
        return tally_pg_wait_notify(r->pg, 0);
    PGconn *conn = tally_pg_conn(r->pg);
    int fd = conn ? PQsocket(conn) : -1;
    if (fd < 0) /* reconnecting: tally_pg_wait_notify retries and sleeps */
        return tally_pg_wait_notify(r->pg, timeout_ms);
    struct pollfd fds[2] = {{.fd = fd, .events = POLLIN}, {.fd = r->hand_fd, .events = POLLIN}};
    if (poll(fds, 2, timeout_ms) > 0 && (fds[1].revents & POLLIN)) {
        uint64_t v;
        while (read(r->hand_fd, &v, sizeof v) > 0)
            ;
    }
    return tally_pg_wait_notify(r->pg, 0);
}

void tally_relay_run(tally_relay_t *r, volatile const int *stop)
{
    r->stop = stop;
    tally_error_t err;
    /* Registered even when PostgreSQL is down: every reconnect LISTENs again. */
    if (!tally_pg_listen(r->pg, NOTIFY_CHANNEL, &err))
        TALLY_WARN("relay: LISTEN %s: %s (will retry)", NOTIFY_CHANNEL, err.message);
    int failed_rounds = 0;
    bool want_round = true; /* a notification came, the last round was full, or at start */
    int64_t next_round = 0;
    while (!stopping(r)) {
        if (hand_pending(r)) {
            (void)hand_round(r);
            continue;
        }
        if (want_round || mono_ms() >= next_round) {
            int n = tally_relay_round(r);
            if (n < 0) {
                /* PostgreSQL or Kafka trouble: back off, up to the poll interval */
                long long ms = tally_backoff_step_ms(++failed_rounds, 100, r->poll_ms);
                struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
                nanosleep(&ts, NULL);
                continue;
            }
            failed_rounds = 0;
            if (n >= r->batch)
                continue; /* a full batch: more may be waiting */
            /* Fewer rows than a batch: everything committed before the round was taken, or
             * is another relay's, or waits out a backoff or a lease. Rows committed since have
             * notified, and a notification that arrived during the round ends the wait below
             * at once, so an empty round is not needed to find them. */
            want_round = false;
            next_round = mono_ms() + r->poll_ms;
        }
        int64_t left = next_round - mono_ms();
        if (wait_for_work(r, left > 0 ? (int)left : 0) > 0)
            want_round = true;
    }
    /* Stopping: what was handed over is leased to this relay; publish it now rather than
     * leave it to the lease. */
    while (hand_pending(r) && hand_round(r) >= 0)
        ;
}

static void *relay_thread(void *arg)
{
    tally_relay_t *r = arg;
    tally_relay_run(r, r->stop);
    return NULL;
}

bool tally_relay_start(tally_relay_t *r, volatile const int *stop)
{
    r->stop = stop;
    if (pthread_create(&r->thread, NULL, relay_thread, r) != 0) {
        TALLY_ERROR("relay: cannot start its thread");
        return false;
    }
    r->started = true;
    return true;
}

/* Handed over and never published (the thread never ran, or gave up): give the rows back to
 * every relay now instead of at the end of their lease. */
static void release_handed(tally_relay_t *r)
{
    if (!r->hand_init || r->n_hand == 0)
        return;
    int64_t *ids = malloc(r->n_hand * sizeof *ids);
    for (size_t i = 0; ids && i < r->n_hand; i++)
        ids[i] = r->hand[i]->id;
    char *arr = ids ? bigint_array(ids, r->n_hand) : NULL;
    const char *params[2] = {arr, r->owner};
    tally_error_t err;
    if (!arr || !r->pg ||
        !tally_pg_run(r->pg, r->refs ? SQL_RELEASE_REFS : SQL_RELEASE, 2, params, &err))
        TALLY_WARN("relay: %zu handed-over messages not published; they are when their lease "
                   "ends",
                   r->n_hand);
    free(arr);
    free(ids);
    for (size_t i = 0; i < r->n_hand; i++)
        free(r->hand[i]);
    free(r->hand);
    r->hand = NULL;
    r->n_hand = r->cap_hand = 0;
}

void tally_relay_free(tally_relay_t *r)
{
    if (r == NULL)
        return;
    atomic_store(&r->closing, 1);
    if (r->started)
        pthread_join(r->thread, NULL);
    r->started = false;
    /* reports served here for earlier rounds only queue ids; rows are no longer current */
    drop_producer(r);
    if (r->late.n > 0 && r->pg != NULL)
        delete_late(r);
    release_handed(r);
    tally_pg_free(r->pg);
    free(r->late.ids);
    free(r->rows);
    if (r->hand_fd >= 0)
        close(r->hand_fd);
    if (r->hand_init)
        pthread_mutex_destroy(&r->hand_mu);
    free(r->prefix);
    free(r->owner);
    free(r->worker_id);
    free(r);
}
