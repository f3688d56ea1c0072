/* audit.h — the append-only audit trail (events table), written in the caller's transaction. */
#ifndef TALLY_AUDIT_H
#define TALLY_AUDIT_H

#include <stdbool.h>
#include <jansson.h>

#include "tally/error.h"
#include "tally/pg.h"

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
} tally_audit_event_t;

typedef struct tally_audit_batch tally_audit_batch_t;

tally_audit_batch_t *tally_audit_batch_new(void) TALLY_WUR;

/** @brief Queue @p ev (copied). Sticky failure reported by flush. */
void tally_audit_batch_add(tally_audit_batch_t *b, const tally_audit_event_t *ev);

size_t tally_audit_batch_len(const tally_audit_batch_t *b);

/** @brief INSERT every queued event in one statement, then empty the batch. */
bool tally_audit_batch_flush(tally_audit_batch_t *b, tally_pg_t *pg, tally_error_t *err) TALLY_WUR;

void tally_audit_batch_free(tally_audit_batch_t *b);

#endif
