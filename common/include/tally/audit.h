/* audit.h — the append-only audit trail (events table), written in the caller's transaction. */
#ifndef TALLY_AUDIT_H
#define TALLY_AUDIT_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/error.h"
#include "tally/pg.h"
#include "tally/recordset.h"

/** @brief A member of an event's data given as text (tally_audit_event_t.members). */
typedef struct tally_audit_member {
    const char *key;
    const char *value; /**< written as a JSON string; NULL leaves the member out */
    bool json;         /**< @c value is JSON text (a number, true/false), copied as is */
} tally_audit_member_t;

/** @brief One audit event. Every member but kind and actor may be NULL. */
typedef struct tally_audit_event {
    const char *run_id;
    const char *effect_id;
    const char *obligation_id;
    const char *kind; /**< "intent", "transition", "conflict", "connector_call", "lease",
                           "duplicate", "obligation", "alert", "operator", ... */
    const char *from_status;
    const char *to_status;
    const char *actor; /**< worker id, or the operator for CLI actions */
    const char *reason;
    const json_t *data; /**< borrowed; serialised when added */
    /** When @c data is NULL: the data is the object of these @c n_members members, in order,
     * written straight into the batch's text (no jansson object to build and serialise on the
     * per-intent paths). Borrowed; copied when added. */
    const tally_audit_member_t *members;
    size_t n_members;
    /** When @c data and @c members are NULL: the data as JSON text (an object), copied as is
     * (tally_jtext_t builds it). */
    const char *data_text;
} tally_audit_event_t;

typedef struct tally_audit_batch tally_audit_batch_t;

tally_audit_batch_t *tally_audit_batch_new(void) TALLY_WUR;

/** @brief Queue @p ev (copied). Sticky failure reported by flush. */
void tally_audit_batch_add(tally_audit_batch_t *b, const tally_audit_event_t *ev);

size_t tally_audit_batch_len(const tally_audit_batch_t *b);

/** @brief INSERT every queued event in one statement, then empty the batch. */
bool tally_audit_batch_flush(tally_audit_batch_t *b, tally_pg_t *pg, tally_error_t *err) TALLY_WUR;

/**
 * @brief The INSERT that writes a batch's rows from the json_to_recordset parameter @p PARAM
 * ("$2") and their data from the binary text[] parameter @p BULK, keeping only the rows that
 * pass @p WHERE ("" for all; the rows are "r"). For a statement that writes a batch together
 * with the state change it records (see tally_audit_batch_text and tally_audit_batch_bulk);
 * tally_audit_batch_flush is this with "$1", "$2" and "".
 */
#define TALLY_AUDIT_INSERT(PARAM, BULK, WHERE)                                                     \
    "INSERT INTO events (event_id, run_id, effect_id, obligation_id, kind, from_status,"           \
    " to_status, actor, reason, data)"                                                             \
    " SELECT r.event_id, r.run_id, r.effect_id, r.obligation_id, r.kind, r.from_status,"           \
    " r.to_status, r.actor, r.reason, r.unnest::jsonb FROM" TALLY_RECORDSET_ROWS(                  \
        PARAM, BULK,                                                                               \
        "n int, event_id uuid, run_id text, effect_id uuid, obligation_id uuid,"                   \
        " kind text, from_status text, to_status text, actor text, reason text",                   \
        "r") " " WHERE " ORDER BY r.n"

/**
 * @brief The batch as the text of its parameter for TALLY_AUDIT_INSERT, or NULL when it has no
 * rows or failed (@p why, when not NULL, then says why, or is "" for no rows). Valid until the
 * batch changes or is freed.
 */
const char *tally_audit_batch_text(tally_audit_batch_t *b, const char **why);

/**
 * @brief The events' data as the bytes of the binary text[] parameter for TALLY_AUDIT_INSERT's
 * @p BULK (format 1), their length in @p len; an empty array for an empty batch. NULL when out
 * of memory. Valid until the batch changes or is freed.
 */
const char *tally_audit_batch_bulk(tally_audit_batch_t *b, int *len);

void tally_audit_batch_free(tally_audit_batch_t *b);

#endif
