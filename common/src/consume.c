/* consume.c — wake-ups from the consumer queue, reading it, and offsets stored after the
 * round's COMMIT (consume.h). */
#include "tally/consume.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tally/log.h"

struct tally_consume {
    rd_kafka_t *rk;        /* borrowed */
    rd_kafka_queue_t *rkq; /* the consumer queue (the main queue is forwarded to it) */
    int pipefd[2];         /* librdkafka writes [1] when the queue becomes non-empty */
    rd_kafka_topic_partition_list_t *offsets; /* noted: the next offset to read, per partition */
    tally_metric_t *m_read;                   /* messages noted, by partition (may be NULL) */
};

tally_consume_t *tally_consume_new(rd_kafka_t *rk, char *errstr, size_t errsz)
{
    tally_consume_t *cs = calloc(1, sizeof *cs);
    if (cs == NULL) {
        snprintf(errstr, errsz, "out of memory");
        return NULL;
    }
    cs->rk = rk;
    cs->pipefd[0] = cs->pipefd[1] = -1;
    cs->offsets = rd_kafka_topic_partition_list_new(8);
    cs->rkq = rk != NULL ? rd_kafka_queue_get_consumer(rk) : NULL;
    if (cs->offsets == NULL || cs->rkq == NULL) {
        snprintf(errstr, errsz, "%s",
                 cs->offsets == NULL ? "out of memory" : "the Kafka client has no consumer queue");
        tally_consume_free(cs);
        return NULL;
    }
    if (pipe2(cs->pipefd, O_NONBLOCK | O_CLOEXEC) != 0) {
        snprintf(errstr, errsz, "cannot create the consumer wake-up pipe: %s", strerror(errno));
        cs->pipefd[0] = cs->pipefd[1] = -1;
        tally_consume_free(cs);
        return NULL;
    }
    rd_kafka_queue_io_event_enable(cs->rkq, cs->pipefd[1], "k", 1);
    return cs;
}

void tally_consume_free(tally_consume_t *cs)
{
    if (cs == NULL) {
        return;
    }
    if (cs->rkq != NULL) {
        rd_kafka_queue_io_event_enable(cs->rkq, -1, NULL, 0);
        rd_kafka_queue_destroy(cs->rkq);
    }
    for (int i = 0; i < 2; i++) {
        if (cs->pipefd[i] >= 0) {
            close(cs->pipefd[i]);
        }
    }
    if (cs->offsets != NULL) {
        rd_kafka_topic_partition_list_destroy(cs->offsets);
    }
    free(cs);
}

int tally_consume_fd(const tally_consume_t *cs)
{
    return cs->pipefd[0];
}

static void empty_pipe(tally_consume_t *cs)
{
    char buf[256];
    while (read(cs->pipefd[0], buf, sizeof buf) > 0) {
    }
}

bool tally_consume_ready(tally_consume_t *cs)
{
    empty_pipe(cs);
    return rd_kafka_queue_length(cs->rkq) > 0;
}

rd_kafka_message_t *tally_consume_next(tally_consume_t *cs)
{
    for (;;) {
        rd_kafka_message_t *msg = rd_kafka_consumer_poll(cs->rk, 0);
        if (msg == NULL || msg->err == RD_KAFKA_RESP_ERR_NO_ERROR) {
            return msg;
        }
        if (msg->err != RD_KAFKA_RESP_ERR__PARTITION_EOF) {
            TALLY_WARN("consumer: %s", rd_kafka_message_errstr(msg));
        }
        rd_kafka_message_destroy(msg);
    }
}

void tally_consume_note(tally_consume_t *cs, const rd_kafka_message_t *msg)
{
    const char *topic = rd_kafka_topic_name(msg->rkt);
    rd_kafka_topic_partition_t *tp =
        rd_kafka_topic_partition_list_find(cs->offsets, topic, msg->partition);
    if (tp == NULL) {
        tp = rd_kafka_topic_partition_list_add(cs->offsets, topic, msg->partition);
    }
    /* the next offset to read, as Kafka commits it; a partition read again after a rebalance
     * never moves it back */
    if (msg->offset + 1 > tp->offset) {
        tp->offset = msg->offset + 1;
    }
    if (cs->m_read != NULL) {
        char partition[16];
        snprintf(partition, sizeof partition, "%d", (int)msg->partition);
        tally_metric_add(cs->m_read, 1, partition, topic);
    }
}

void tally_consume_count(tally_consume_t *cs, tally_metric_t *read)
{
    cs->m_read = read;
}

int tally_consume_wakeups(tally_consume_t *cs, int max, tally_consume_fn *fn, void *opaque)
{
    empty_pipe(cs);
    int n = 0;
    while (n < max) {
        rd_kafka_message_t *msg = tally_consume_next(cs);
        if (msg == NULL) {
            break;
        }
        tally_consume_note(cs, msg);
        if (fn != NULL) {
            fn(opaque, msg);
        }
        rd_kafka_message_destroy(msg);
        n++;
    }
    return n;
}

/* Empty the list in place: no allocation, so dropping offsets cannot fail. */
static void clear_offsets(tally_consume_t *cs)
{
    while (cs->offsets->cnt > 0) {
        rd_kafka_topic_partition_list_del_by_idx(cs->offsets, cs->offsets->cnt - 1);
    }
}

void tally_consume_forget(tally_consume_t *cs)
{
    clear_offsets(cs);
}

void tally_consume_store(tally_consume_t *cs)
{
    if (cs->offsets->cnt == 0) {
        return;
    }
    rd_kafka_resp_err_t err = rd_kafka_offsets_store(cs->rk, cs->offsets);
    if (err != RD_KAFKA_RESP_ERR_NO_ERROR) {
        /* A partition revoked since the messages were read: its new owner reads them again. */
        for (int i = 0; i < cs->offsets->cnt; i++) {
            const rd_kafka_topic_partition_t *tp = &cs->offsets->elems[i];
            if (tp->err != RD_KAFKA_RESP_ERR_NO_ERROR) {
                TALLY_INFO("offset %lld of %s [%d] not stored (%s): the partition's next owner "
                           "will see those messages again",
                           (long long)tp->offset, tp->topic, (int)tp->partition,
                           rd_kafka_err2str(tp->err));
            }
        }
    }
    clear_offsets(cs);
}

size_t tally_consume_noted(const tally_consume_t *cs)
{
    return (size_t)cs->offsets->cnt;
}

void tally_consume_serve(tally_consume_t *cs)
{
    empty_pipe(cs);
    rd_kafka_message_t *msg = rd_kafka_consumer_poll(cs->rk, 0);
    if (msg != NULL) {
        rd_kafka_message_destroy(msg);
    }
}
