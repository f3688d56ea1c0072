/* outbox.h — the message outbox writer: events for Kafka, written in the caller's transaction. */
#ifndef TALLY_OUTBOX_H
#define TALLY_OUTBOX_H

#include <stdbool.h>
#include <jansson.h>

#include "tally/error.h"
#include "tally/pg.h"

/**
 * @brief A batch of messages to insert with one statement. Build with tally_outbox_batch_add,
 * write with tally_outbox_batch_flush inside the transaction that made the state change.
 * Sticky failure: an allocation failure in add is reported by flush.
 */
typedef struct tally_outbox_batch tally_outbox_batch_t;

tally_outbox_batch_t *tally_outbox_batch_new(void) TALLY_WUR;

/**
 * @brief Queue one message. @p topic is the logical name ("outcomes", "obligations", "alerts",
 * "dlq"); the relay adds the prefix. @p key is the Kafka key (the run_id; may be NULL).
 * @p event is a CloudEvent whose "id" is the dedup id (borrowed; serialised now).
 */
void tally_outbox_batch_add(tally_outbox_batch_t *b, const char *topic, const char *key,
                            const json_t *event);

/** @brief Number of queued messages. */
size_t tally_outbox_batch_len(const tally_outbox_batch_t *b);

/** @brief INSERT every queued message in one statement (json_to_recordset), then empty the
 * batch. A batch of 0 is a no-op. */
bool tally_outbox_batch_flush(tally_outbox_batch_t *b, tally_pg_t *pg,
                              tally_error_t *err) TALLY_WUR;

void tally_outbox_batch_free(tally_outbox_batch_t *b);

#endif
