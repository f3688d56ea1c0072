/* tally-dispatcher — DESIGN.md §2: consumes tally.intents. For each poll batch it validates
 * every message, then in ONE PostgreSQL transaction inserts the effects, their outbox entries
 * and their events; only after COMMIT does it store the Kafka offsets. It then claims due
 * outbox entries with leases, calls the tool connectors concurrently and records each outcome.
 * Malformed or unregistered intents go to tally.dlq with the reason.
 *
 * This first form runs the shared worker lifecycle (config, registry check, PostgreSQL and
 * schema check, the outbox relay, /metrics and /healthz, the consumer, SIGTERM drain) and
 * acknowledges what it reads without acting on it: the ledger loop replaces the tick. */
#include <stdint.h>
#include <stdlib.h>

#include <librdkafka/rdkafka.h>

#include "tally/config.h"
#include "tally/log.h"
#include "tally/worker.h"

typedef struct dispatcher {
    uint64_t received;
} dispatcher_t;

static bool dispatcher_init(tally_worker_t *w, void **state)
{
    (void)w;
    dispatcher_t *d = calloc(1, sizeof *d);
    if (d == NULL) {
        TALLY_ERROR("out of memory");
        return false;
    }
    *state = d;
    return true;
}

/* Wait up to poll_ms for the first message, take up to batch_size, store their offsets. */
static int dispatcher_tick(tally_worker_t *w, void *state)
{
    dispatcher_t *d = state;
    const tally_config_t *cfg = tally_worker_config(w);
    rd_kafka_t *rk = tally_worker_consumer(w);
    rd_kafka_topic_partition_list_t *offsets = rd_kafka_topic_partition_list_new(8);
    int n = 0;
    int batch = cfg->batch_size > 0 ? cfg->batch_size : 1;
    /* Wait in short slices so a SIGTERM is noticed quickly even when poll_ms is long. */
    int waited = 0;
    while (n < batch && !tally_worker_stopping(w)) {
        int slice = n == 0 && waited < cfg->poll_ms ? cfg->poll_ms - waited : 0;
        slice = slice > 100 ? 100 : slice;
        rd_kafka_message_t *msg = rd_kafka_consumer_poll(rk, slice);
        waited += slice;
        if (msg == NULL) {
            if (n == 0 && waited < cfg->poll_ms) {
                continue;
            }
            break;
        }
        if (msg->err != RD_KAFKA_RESP_ERR_NO_ERROR) {
            if (msg->err != RD_KAFKA_RESP_ERR__PARTITION_EOF) {
                TALLY_WARN("consumer: %s", rd_kafka_message_errstr(msg));
            }
            rd_kafka_message_destroy(msg);
            continue;
        }
        TALLY_DEBUG("intent at %s [%d] offset %lld (%zu bytes) acknowledged",
                    rd_kafka_topic_name(msg->rkt), (int)msg->partition, (long long)msg->offset,
                    msg->len);
        const char *topic = rd_kafka_topic_name(msg->rkt);
        rd_kafka_topic_partition_t *tp =
            rd_kafka_topic_partition_list_find(offsets, topic, msg->partition);
        if (tp == NULL) {
            tp = rd_kafka_topic_partition_list_add(offsets, topic, msg->partition);
        }
        tp->offset = msg->offset + 1; /* the next offset to read, as Kafka commits it */
        rd_kafka_message_destroy(msg);
        n++;
    }
    if (offsets->cnt > 0) {
        rd_kafka_resp_err_t err = rd_kafka_offsets_store(rk, offsets);
        if (err != RD_KAFKA_RESP_ERR_NO_ERROR) {
            TALLY_WARN("storing consumer offsets: %s", rd_kafka_err2str(err));
        }
    }
    rd_kafka_topic_partition_list_destroy(offsets);
    d->received += (uint64_t)n;
    return n;
}

static bool dispatcher_drain(tally_worker_t *w, void *state)
{
    (void)w;
    (void)state;
    return true;
}

static void dispatcher_fini(tally_worker_t *w, void *state)
{
    (void)w;
    dispatcher_t *d = state;
    TALLY_INFO("dispatcher read %llu intents", (unsigned long long)d->received);
    free(d);
}

int main(int argc, char **argv)
{
    static const char *const topics[] = {"intents", NULL};
    static const tally_worker_ops_t ops = {
        .name = "dispatcher",
        .summary = "Records agents' intents in the ledger and delivers them to the tools.",
        .topics = topics,
        .init = dispatcher_init,
        .tick = dispatcher_tick,
        .drain = dispatcher_drain,
        .fini = dispatcher_fini,
    };
    return tally_worker_main(argc, argv, &ops);
}
