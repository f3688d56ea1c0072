/* relay.h — publishes the message outbox to Kafka; deletes a row only after its delivery report. */
#ifndef TALLY_RELAY_H
#define TALLY_RELAY_H

#include <stdbool.h>
#include <stddef.h>

#include <libpq-fe.h>

#include "tally/cloudevent.h"
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
 * @brief Run rounds until *@p stop is set, sleeping on LISTEN tally_message_outbox (and on
 * handed-over messages) between rounds; handed-over messages go first, and the ones still
 * queued when it stops are published before it returns. Meant to be a thread's body (see
 * tally_relay_start).
 */
void tally_relay_run(tally_relay_t *relay, volatile const int *stop);

/**
 * @brief Handed-over messages: rows the caller wrote into message_outbox already leased to
 * this relay (lease_owner tally_relay_owner(), lease_until now() + TALLY_RELAY_HAND_LEASE_MS)
 * and committed. The relay publishes them at once, without waiting for a notification or
 * reading them back, then deletes them (or backs them off) as after any round. Nobody else
 * takes them before the lease ends, and everybody may after: a relay that dies holding them
 * delays them by the lease, and never loses them.
 */
typedef struct tally_relay_msg {
    long long id;      /**< message_outbox.id */
    const char *topic; /**< logical name */
    const char *key;   /**< may be NULL */
    const char *event_id;
    const char *payload;
    size_t payload_len;
    const char *reply; /**< topic "replies": the destination (JSON text), else NULL */
} tally_relay_msg_t;

#define TALLY_RELAY_HAND_LEASE_MS 10000

/** SQL: the timestamptz @p X as an event's time, RFC 3339 UTC with milliseconds, as the relay
 * writes a reference's (the time of its transition audit event). */
#define TALLY_SQL_EVENT_TIME(X)                                                                    \
    "to_char(" X " AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')"

/**
 * @brief The event of a message_refs row: @p e (its id the transition audit event's, its time
 * TALLY_SQL_EVENT_TIME of that event's, its receipt_text NULL) with the receipt @p receipt
 * (@p len bytes, the effect's receipt as PostgreSQL's jsonb text gives it, or NULL) in compact
 * form, cut as outbox.c cuts an event over TALLY_LIMIT_EVENT_BYTES. The one function that turns
 * a reference into its bytes: the relay calls it for the rows it takes, the dispatcher for the
 * rows it hands over (they must come out the same).
 * @returns malloc'd text, or NULL with the reason in @p why.
 */
char *tally_relay_ref_event(tally_effect_event_t *e, const char *receipt, size_t len, char *why,
                            size_t whysz) TALLY_WUR;

/** @brief lease_owner of the rows handed to @p relay (its worker id + "/relay"). */
const char *tally_relay_owner(const tally_relay_t *relay);

/**
 * @brief Queue @p n committed messages for publication (copied; safe from any thread).
 * @returns false when out of memory: they are then published when their lease ends.
 */
bool tally_relay_hand(tally_relay_t *relay, const tally_relay_msg_t *msgs, size_t n);

/**
 * @brief tally_relay_hand for the rows of a committed INSERT … RETURNING id, topic, msg_key,
 * event_id, payload, reply (TALLY_OUTBOX_INSERT_HANDED). With @p tag_col ≥ 0 only the rows whose
 * column @p tag_col starts with @p tag are messages, their six columns following it.
 * A NULL @p relay or @p res hands nothing. @returns false when they could not be handed
 * (out of memory): they are then published when their lease ends.
 */
bool tally_relay_hand_result(tally_relay_t *relay, const PGresult *res, int tag_col, char tag);

/**
 * @brief Whether the ledger has message_refs (schema 17 or later: the worker says so at start,
 * from the schema version it read); call before tally_relay_start. The relay then drains it
 * beside message_outbox. A relay started without it finds the table within a second of a
 * `tally migrate` that adds it (its backlog gauge's statement looks).
 */
void tally_relay_use_refs(tally_relay_t *relay, bool on);

/** @brief Start tally_relay_run on a new thread. */
bool tally_relay_start(tally_relay_t *relay, volatile const int *stop) TALLY_WUR;

/** @brief Join the thread (if started), flush the producer, free. NULL is allowed. */
void tally_relay_free(tally_relay_t *relay);

#endif
