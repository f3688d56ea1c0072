/* audit.h — the append-only audit trail (events table), written in the caller's transaction. */
#ifndef TALLY_AUDIT_H
#define TALLY_AUDIT_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/error.h"
#include "tally/pg.h"
#include "tally/columns.h"
#include "tally/ledger.h"

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
    /** The event's id, or NULL for a fresh one (tally_uuid_v7): given by a writer whose
     * message references the event (tally_outbox_batch_add_ref). */
    const char *event_id;
} tally_audit_event_t;

typedef struct tally_audit_batch tally_audit_batch_t;

tally_audit_batch_t *tally_audit_batch_new(void) TALLY_WUR;

/** @brief Queue @p ev (copied). Sticky failure reported by flush. */
void tally_audit_batch_add(tally_audit_batch_t *b, const tally_audit_event_t *ev);

/**
 * @brief Queue the event of a status move of machine @p m (tally/machines.h): @p from -> @p to
 * as its states (@p from -1: the row's creation), spelled by the generated table into
 * from_status and to_status; the rest of the event from @p ev (its kind "transition" when NULL;
 * its from_status and to_status are ignored). Every writer records its moves through this, in
 * the transaction that makes them (DESIGN §3 rule 3).
 * @return false, with the move named in an ERROR log line, when the machine lacks the move:
 * the event is queued all the same, and the database refuses the statement that makes the
 * move (its trigger names it too). A move from a state to itself is no move, and allowed.
 */
bool tally_audit_move(tally_audit_batch_t *b, tally_machine_t m, int from, int to,
                      const tally_audit_event_t *ev);

size_t tally_audit_batch_len(const tally_audit_batch_t *b);

/** @brief INSERT every queued event in one statement, then empty the batch. */
bool tally_audit_batch_flush(tally_audit_batch_t *b, tally_pg_t *pg, tally_error_t *err) TALLY_WUR;

/**
 * @brief tally_audit_batch_flush with the INSERT @p sql instead of the plain one: a
 * TALLY_AUDIT_INSERT_DATA("$1", ...) whose data the statement completes (record.c's receipt
 * references).
 */
bool tally_audit_batch_flush_as(tally_audit_batch_t *b, tally_pg_t *pg, const char *sql,
                                tally_error_t *err) TALLY_WUR;

/**
 * @brief The INSERT that writes a batch's rows from its columns parameter @p PARAM ("$2", a
 * binary two-dimensional text[]: columns.h), keeping only the rows that pass @p WHERE ("" for
 * all; the rows are "r", typed as the events table's columns, with their place "n"). For a
 * statement that writes a batch together with the state change it records (see
 * tally_audit_batch_param); tally_audit_batch_flush is this with "$1" and "".
 */
#define TALLY_AUDIT_INSERT(PARAM, WHERE) TALLY_AUDIT_INSERT_DATA(PARAM, WHERE, "r.data")

/**
 * @brief TALLY_AUDIT_INSERT writing @p DATA, an expression over the row "r" (its "r.data" as
 * the batch holds it), as each event's data.
 */
// clang-format off
#define TALLY_AUDIT_INSERT_DATA(PARAM, WHERE, DATA)                                                \
    "INSERT INTO events (event_id, run_id, effect_id, obligation_id, kind, from_status,"           \
    " to_status, actor, reason, data)"                                                             \
    " SELECT r.event_id, r.run_id, r.effect_id, r.obligation_id, r.kind, r.from_status,"           \
    " r.to_status, r.actor, r.reason, " DATA                                                       \
    " FROM (SELECT u.event_id::uuid AS event_id, u.run_id, u.effect_id::uuid AS effect_id,"        \
    " u.obligation_id::uuid AS obligation_id, u.kind, u.from_status, u.to_status, u.actor,"        \
    " u.reason, u.data::jsonb AS data, u.n FROM unnest("                                           \
    TALLY_COLUMN(PARAM, 1) "," TALLY_COLUMN(PARAM, 2) "," TALLY_COLUMN(PARAM, 3) ","               \
    TALLY_COLUMN(PARAM, 4) "," TALLY_COLUMN(PARAM, 5) "," TALLY_COLUMN(PARAM, 6) ","               \
    TALLY_COLUMN(PARAM, 7) "," TALLY_COLUMN(PARAM, 8) "," TALLY_COLUMN(PARAM, 9) ","               \
    TALLY_COLUMN(PARAM, 10) ") WITH ORDINALITY AS u(event_id, run_id, effect_id, obligation_id,"   \
    " kind, from_status, to_status, actor, reason, data, n)) AS r " WHERE " ORDER BY r.n"
// clang-format on

/**
 * @brief The batch as the bytes of its parameter for TALLY_AUDIT_INSERT (binary, format 1),
 * @p len bytes long; an empty array for an empty batch. NULL when the batch failed (@p why,
 * when not NULL, then says why) or out of memory (@p why "out of memory"). Valid until the
 * batch changes or is freed.
 */
const char *tally_audit_batch_param(tally_audit_batch_t *b, int *len, const char **why);

void tally_audit_batch_free(tally_audit_batch_t *b);

#endif
