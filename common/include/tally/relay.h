/* relay.h — publishes the message outbox to Kafka; deletes a row only after its delivery report. */
#ifndef TALLY_RELAY_H
#define TALLY_RELAY_H

#include <stdbool.h>

#include "tally/config.h"
#include "tally/error.h"
#include "tally/metrics.h"

typedef struct tally_relay tally_relay_t;

/**
 * @brief A relay with its own PostgreSQL connection and idempotent producer.
 * @p metrics may be NULL. @returns NULL with the reason in @p errstr.
 */
tally_relay_t *tally_relay_new(const tally_config_t *cfg, tally_metrics_t *metrics, char *errstr,
                               size_t errsz) TALLY_WUR;

/**
 * @brief One round: lease up to relay_batch rows (FOR UPDATE SKIP LOCKED, lease from now()),
 * produce them, wait for their delivery reports, DELETE the delivered rows in one statement
 * and release the failed ones with a backoff and last_error.
 * Several relays may run at once against one database.
 * @returns the number of rows published, or -1 on an error (logged; the next round retries).
 */
int tally_relay_round(tally_relay_t *relay);

/**
 * @brief Run rounds until *@p stop is set, sleeping on LISTEN tally_message_outbox between
 * empty rounds. Meant to be a thread's body (see tally_relay_start).
 */
void tally_relay_run(tally_relay_t *relay, volatile const int *stop);

/** @brief Start tally_relay_run on a new thread. */
bool tally_relay_start(tally_relay_t *relay, volatile const int *stop) TALLY_WUR;

/** @brief Join the thread (if started), flush the producer, free. NULL is allowed. */
void tally_relay_free(tally_relay_t *relay);

#endif
