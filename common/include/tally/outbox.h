/* outbox.h — the message outbox writer: events for Kafka, written in the caller's transaction. */
#ifndef TALLY_OUTBOX_H
#define TALLY_OUTBOX_H

#include <stdbool.h>
#include <jansson.h>

#include "tally/error.h"
#include "tally/pg.h"
#include "tally/columns.h"

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

/**
 * @brief Queue a message whose event is already JSON text (@p payload, copied): the same row as
 * tally_outbox_batch_add, with the event's id (@p event_id) and the effect its data names
 * (@p effect_id, may be NULL) given by the caller that wrote it.
 */
void tally_outbox_batch_add_text(tally_outbox_batch_t *b, const char *topic, const char *key,
                                 const char *event_id, const char *effect_id, const char *payload);

/**
 * @brief Queue an outcome event that the relay can build again, byte for byte, from the ledger:
 * @p event_id is the id of the "transition" audit event it reports (written in the same
 * statement) and the CloudEvent's id. Written by a statement with TALLY_OUTBOX_REFS_CTES, it
 * becomes a row of message_refs (that id and the key, no payload); written otherwise (a
 * ledger before schema 17), or when the event has reply destinations, it is the message_outbox
 * row tally_outbox_batch_add_text writes, @p payload and all.
 */
void tally_outbox_batch_add_ref(tally_outbox_batch_t *b, const char *topic, const char *key,
                                const char *event_id, const char *effect_id, const char *payload);

/** Who else an answer goes to besides its topic (docs/agent-protocol.md). */
typedef enum {
    TALLY_REPLY_AUTO = 0, /**< an effect event (data.effect_id, topic "outcomes") goes to its
                               effect's replies, a tally.run.* event to its run's */
    TALLY_REPLY_NONE,     /**< only the topic: an answer that belongs to one message alone */
} tally_reply_scope_t;

/**
 * @brief tally_outbox_batch_add_text with the reply routing spelt out: @p scope, and
 * @p reply_to (may be NULL), a destination (replies.destination's JSON) that gets a copy of
 * this message whatever the scope: the answer to a message that named it.
 */
void tally_outbox_batch_add_answer(tally_outbox_batch_t *b, const char *topic, const char *key,
                                   const char *event_id, const char *effect_id, const char *payload,
                                   tally_reply_scope_t scope, const char *reply_to);

/** @brief Number of queued messages. */
size_t tally_outbox_batch_len(const tally_outbox_batch_t *b);

/** @brief INSERT every queued message in one statement, then empty the batch. A batch of 0 is
 * a no-op. */
bool tally_outbox_batch_flush(tally_outbox_batch_t *b, tally_pg_t *pg,
                              tally_error_t *err) TALLY_WUR;

/**
 * @brief tally_outbox_batch_flush with the rows leased to the relay named @p owner for
 * @p lease_ms (TALLY_OUTBOX_INSERT_HANDED), so that after COMMIT they can be handed to it
 * (tally_relay_hand_result) instead of waking every relay. @p rows receives the inserted rows
 * (id, topic, msg_key, event_id, payload; the caller PQclears it), NULL for an empty batch.
 */
bool tally_outbox_batch_flush_handed(tally_outbox_batch_t *b, tally_pg_t *pg, const char *owner,
                                     int lease_ms, PGresult **rows, tally_error_t *err) TALLY_WUR;

/**
 * @brief The INSERT that writes a batch's rows from its columns parameter @p PARAM (a binary
 * two-dimensional text[]: columns.h), keeping the rows that pass @p WHERE ("" for all; the
 * rows are "r"; r.effect_id is the "effect_id" of the message's data, as text, or NULL); see
 * TALLY_AUDIT_INSERT. Each answer is also copied once for each of its reply destinations
 * (docs/agent-protocol.md): an effect event ("effect" scope) to the replies of its effect, a
 * run event ("run" scope) to the replies of its run, the 8 most recent each, as rows of topic
 * 'replies' right after it; a row of topic 'replies' carries its own destination.
 */
// clang-format off
#define TALLY_OUTBOX_INSERT(PARAM, WHERE)                                                          \
    "INSERT INTO message_outbox (topic, msg_key, event_id, payload, reply)"                        \
    TALLY_OUTBOX_ROWS_(PARAM, WHERE, "")
// clang-format on

/**
 * @brief TALLY_OUTBOX_INSERT for rows handed to a relay (tally_relay_hand): leased to the
 * relay named by the text parameter @p OWNER for @p LEASE_MS (an int parameter) milliseconds
 * from now(), or not leased when OWNER is NULL; returns id, topic, msg_key, event_id, payload,
 * reply (TALLY_OUTBOX_RETURNING).
 */
// clang-format off
#define TALLY_OUTBOX_INSERT_HANDED(PARAM, WHERE, OWNER, LEASE_MS)                                  \
    "INSERT INTO message_outbox (topic, msg_key, event_id, payload, reply, lease_owner,"           \
    " lease_until)"                                                                                \
    TALLY_OUTBOX_ROWS_(PARAM, WHERE, ", " OWNER "::text, CASE WHEN " OWNER "::text IS NOT NULL"    \
    " THEN now() + " LEASE_MS "::int * interval '1 millisecond' END")                              \
    " RETURNING " TALLY_OUTBOX_RETURNING

/** The columns a relay takes a message_outbox row with (tally_relay_hand_result). */
#define TALLY_OUTBOX_RETURNING "id, topic, msg_key, event_id, payload, reply::text"

/* The replies each row of ob_rows is copied to: the 8 newest of its effect ("effect" scope,
 * eid) or of its run ("run" scope, rid), in one join for the whole batch. */
#define TALLY_OUTBOX_REPLIES_                                                                      \
    " ob_replies AS (SELECT z.n, z.id, z.destination FROM ("                                       \
    "   SELECT o.n, q.id, q.destination,"                                                          \
    "    row_number() OVER (PARTITION BY o.n ORDER BY q.id DESC) AS rank"                          \
    "   FROM ob_rows o JOIN replies q ON q.effect_id = o.eid"                                      \
    "   UNION ALL SELECT o.n, q.id, q.destination,"                                                \
    "    row_number() OVER (PARTITION BY o.n ORDER BY q.id DESC)"                                  \
    "   FROM ob_rows o JOIN replies q ON q.effect_id IS NULL AND q.run_id = o.rid) z"              \
    "  WHERE z.rank <= 8)"

/* The batch's rows (ob_rows), the replies they are copied to (ob_replies: one join for the
 * whole batch, the 8 newest of each effect or run), and the rows to insert in batch order, each
 * message followed by its copies; MORE: further columns of the select list. */
#define TALLY_OUTBOX_ROWS_(PARAM, WHERE, MORE)                                                     \
    " WITH ob_rows AS MATERIALIZED (SELECT r.n, r.topic, r.msg_key, r.event_id, r.payload,"        \
    "   r.reply::jsonb AS reply,"                                                                  \
    "   CASE WHEN r.scope = 'effect' THEN r.effect_id::uuid END AS eid,"                           \
    "   CASE WHEN r.scope = 'run' THEN r.msg_key END AS rid"                                       \
    "  FROM unnest(" TALLY_COLUMN(PARAM, 1) "," TALLY_COLUMN(PARAM, 2) ","                         \
    TALLY_COLUMN(PARAM, 3) "," TALLY_COLUMN(PARAM, 4) "," TALLY_COLUMN(PARAM, 5) ","               \
    TALLY_COLUMN(PARAM, 6) "," TALLY_COLUMN(PARAM, 7) ")"                                          \
    "  WITH ORDINALITY AS r(topic, msg_key, event_id, effect_id, payload, scope, reply, n)"        \
    "  " WHERE "),"                                                                                \
    TALLY_OUTBOX_REPLIES_                                                                          \
    " SELECT x.topic, x.msg_key, x.event_id, x.payload, x.reply" MORE                              \
    " FROM (SELECT o.n, 0::bigint AS k, o.topic, o.msg_key, o.event_id,"                           \
    "  CASE WHEN o.reply IS NULL THEN o.payload ELSE tally_reply_payload(o.payload, o.reply)"     \
    "  END AS payload,"                                                                            \
    "  o.reply FROM ob_rows o"                                                                     \
    "  UNION ALL SELECT o.n, p.id, 'replies', o.msg_key, o.event_id,"                              \
    "   tally_reply_payload(o.payload, p.destination), p.destination"                              \
    "  FROM ob_replies p JOIN ob_rows o ON o.n = p.n) x"                                           \
    " ORDER BY x.n, x.k"
// clang-format on

/**
 * @brief TALLY_OUTBOX_INSERT_HANDED as items of a WITH (schema 17, message_refs): the rows
 * queued with tally_outbox_batch_add_ref that have no reply destination go to message_refs
 * ("mr": RETURNING id, event_id, msg_key), every other row to message_outbox ("mo": RETURNING
 * TALLY_OUTBOX_RETURNING), both leased as TALLY_OUTBOX_INSERT_HANDED leases them. Both tables
 * take their ids from one sequence (migration 17): the relay publishes them in id order.
 */
// clang-format off
#define TALLY_OUTBOX_REFS_CTES(PARAM, WHERE, OWNER, LEASE_MS)                                      \
    " ob_rows AS MATERIALIZED (SELECT r.n, r.topic, r.msg_key, r.event_id, r.payload,"             \
    "   r.reply::jsonb AS reply,"                                                                  \
    "   CASE WHEN r.scope = 'effect' THEN r.effect_id::uuid END AS eid,"                           \
    "   CASE WHEN r.scope = 'run' THEN r.msg_key END AS rid, r.ref"                                \
    "  FROM unnest(" TALLY_COLUMN(PARAM, 1) "," TALLY_COLUMN(PARAM, 2) ","                         \
    TALLY_COLUMN(PARAM, 3) "," TALLY_COLUMN(PARAM, 4) "," TALLY_COLUMN(PARAM, 5) ","               \
    TALLY_COLUMN(PARAM, 6) "," TALLY_COLUMN(PARAM, 7) "," TALLY_COLUMN(PARAM, 8) ")"               \
    "  WITH ORDINALITY AS r(topic, msg_key, event_id, effect_id, payload, scope, reply, ref, n)"   \
    "  " WHERE "),"                                                                                \
    TALLY_OUTBOX_REPLIES_ ","                                                                      \
    " ob_refs AS (SELECT o.n, o.ref::uuid AS ref, o.msg_key FROM ob_rows o"                        \
    "  WHERE o.ref IS NOT NULL AND o.reply IS NULL"                                                \
    "  AND NOT EXISTS (SELECT 1 FROM ob_replies p WHERE p.n = o.n)),"                              \
    " mr AS (INSERT INTO message_refs (event_id, msg_key, lease_owner, lease_until)"               \
    "  SELECT f.ref, f.msg_key, " OWNER "::text, CASE WHEN " OWNER "::text IS NOT NULL"            \
    "  THEN now() + " LEASE_MS "::int * interval '1 millisecond' END FROM ob_refs f ORDER BY f.n"  \
    "  RETURNING id, event_id, msg_key),"                                                          \
    " mo AS (INSERT INTO message_outbox (topic, msg_key, event_id, payload, reply, lease_owner,"   \
    "  lease_until)"                                                                               \
    "  SELECT x.topic, x.msg_key, x.event_id, x.payload, x.reply, " OWNER "::text,"                \
    "  CASE WHEN " OWNER "::text IS NOT NULL"                                                      \
    "  THEN now() + " LEASE_MS "::int * interval '1 millisecond' END"                              \
    "  FROM (SELECT o.n, 0::bigint AS k, o.topic, o.msg_key, o.event_id,"                          \
    "   CASE WHEN o.reply IS NULL THEN o.payload ELSE tally_reply_payload(o.payload, o.reply)"    \
    "   END AS payload,"                                                                           \
    "   o.reply FROM ob_rows o WHERE o.n NOT IN (SELECT n FROM ob_refs)"                           \
    "   UNION ALL SELECT o.n, p.id, 'replies', o.msg_key, o.event_id,"                             \
    "    tally_reply_payload(o.payload, p.destination), p.destination"                             \
    "   FROM ob_replies p JOIN ob_rows o ON o.n = p.n) x"                                          \
    "  ORDER BY x.n, x.k RETURNING " TALLY_OUTBOX_RETURNING ")"
// clang-format on

/**
 * @brief The batch as the bytes of its parameter for TALLY_OUTBOX_INSERT; see
 * tally_audit_batch_param.
 */
const char *tally_outbox_batch_param(tally_outbox_batch_t *b, int *len, const char **why);

void tally_outbox_batch_free(tally_outbox_batch_t *b);

#endif
