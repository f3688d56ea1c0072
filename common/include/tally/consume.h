/* consume.h — the Kafka side of a worker's loop: a pipe that says when the consumer queue has
 * something, reading the queue, and storing offsets only after the PostgreSQL COMMIT of the
 * round the messages caused (STYLE.md: enable.auto.offset.store=false).
 *
 * One thread waits on everything at once (curl's sockets, the PostgreSQL socket, this pipe):
 * librdkafka writes a byte to the pipe when the consumer queue becomes non-empty
 * (rd_kafka_queue_io_event_enable). A round reads messages, notes each offset, commits its
 * work in PostgreSQL, then stores the noted offsets; a round that fails forgets them, and
 * Kafka delivers the messages again. Which messages a round takes and what it does with them
 * is the worker's: the dispatcher keeps intents until their batch commits, the reconciler and
 * the compensator treat messages as wake-ups (PostgreSQL holds the work). */
#ifndef TALLY_CONSUME_H
#define TALLY_CONSUME_H

#include <stdbool.h>
#include <stddef.h>
#include <librdkafka/rdkafka.h>

#include "tally/error.h"
#include "tally/metrics.h"

typedef struct tally_consume tally_consume_t;

/**
 * @brief Wake-ups and offsets for the consumer @p rk, which is borrowed and must outlive the
 * handle (worker.h: tally_worker_consume gives the worker's own).
 * @returns NULL with the reason in @p errstr when the queue or the pipe cannot be set up.
 */
tally_consume_t *tally_consume_new(rd_kafka_t *rk, char *errstr, size_t errsz) TALLY_WUR;

/**
 * @brief Stops the wake-ups and frees. Offsets noted and not stored stay unstored: the
 * partition's next reader sees those messages again. NULL is allowed.
 */
void tally_consume_free(tally_consume_t *cs);

/** @brief The pipe to wait on (POLLIN / CURL_WAIT_POLLIN) beside the other sockets. */
int tally_consume_fd(const tally_consume_t *cs);

/**
 * @brief Empty the pipe after a wait, and say whether the queue holds anything (messages,
 * rebalances, errors). A loop that leaves events queued must not wait on the pipe while this
 * is true: the pipe is written again only once the queue has been read empty.
 */
bool tally_consume_ready(tally_consume_t *cs);

/**
 * @brief The next message, or NULL when none is queued. Error events on the way are logged
 * (a partition's end is not an error) and skipped; rebalances are served. The caller owns the
 * message (rd_kafka_message_destroy); its offset is noted only by tally_consume_note.
 */
rd_kafka_message_t *tally_consume_next(tally_consume_t *cs);

/** @brief Store @p msg's offset (the next one to read) with the next tally_consume_store. */
void tally_consume_note(tally_consume_t *cs, const rd_kafka_message_t *msg);

/**
 * @brief Count every message tally_consume_note sees in @p read, a counter labelled
 * "partition,topic" (the worker's tally_kafka_messages_read_total: intake per partition).
 * NULL stops counting.
 */
void tally_consume_count(tally_consume_t *cs, tally_metric_t *read);

/** @brief Looks at one message read by tally_consume_wakeups; @p msg is destroyed after. */
typedef void tally_consume_fn(void *opaque, const rd_kafka_message_t *msg);

/**
 * @brief For workers whose messages are only wake-ups: empty the pipe, read up to @p max
 * messages, note each offset and show each to @p fn (may be NULL).
 * @returns the number read; @p max means more may be queued.
 */
int tally_consume_wakeups(tally_consume_t *cs, int max, tally_consume_fn *fn, void *opaque);

/**
 * @brief After the round's COMMIT: store the offsets noted since the last store or forget.
 * Offsets of partitions revoked meanwhile are not stored (logged): their next owner reads
 * those messages again, which the ledger answers as replays.
 */
void tally_consume_store(tally_consume_t *cs);

/**
 * @brief Drop the noted offsets, for a round that will not commit (shutting down): the
 * partition's next reader sees those messages again. This consumer does not (its position is
 * past them), so a round that failed and will be retried keeps its messages and its offsets.
 */
void tally_consume_forget(tally_consume_t *cs);

/** @brief Offsets noted and not yet stored (partitions, not messages). */
size_t tally_consume_noted(const tally_consume_t *cs);

/**
 * @brief While draining: empty the pipe and serve the consumer once (rebalances, errors)
 * without taking work. A message that comes is dropped unnoted, for the partition's next
 * owner.
 */
void tally_consume_serve(tally_consume_t *cs);

#endif
