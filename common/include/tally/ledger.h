/* ledger.h — the effect and obligation state machines of DESIGN §3, as tables tests can read. */
#ifndef TALLY_LEDGER_H
#define TALLY_LEDGER_H

#include <stdbool.h>

typedef enum {
    TALLY_EFFECT_PLANNED = 0,
    TALLY_EFFECT_AWAITING_APPROVAL,
    TALLY_EFFECT_DISPATCHING,
    TALLY_EFFECT_CONFIRMED,
    TALLY_EFFECT_FAILED,
    TALLY_EFFECT_UNKNOWN,
    TALLY_EFFECT_STUCK,
    TALLY_EFFECT_REJECTED,
    TALLY_EFFECT_CANCELLED,
    TALLY_EFFECT__COUNT
} tally_effect_state_t;

typedef enum {
    TALLY_OBLIGATION_PENDING = 0,
    TALLY_OBLIGATION_AWAITING_APPROVAL,
    TALLY_OBLIGATION_RUNNING,
    TALLY_OBLIGATION_RESOLVED,
    TALLY_OBLIGATION_SKIPPED,
    TALLY_OBLIGATION_UNCOMPENSATABLE,
    TALLY_OBLIGATION_STUCK,
    TALLY_OBLIGATION_CANCELLED,
    TALLY_OBLIGATION__COUNT
} tally_obligation_state_t;

/** One allowed move, and who may make it. */
typedef struct tally_transition {
    int from;
    int to;
    const char *by; /**< "dispatcher", "reconciler", "compensator", "operator" */
    const char *why;
} tally_transition_t;

/**
 * SQL: whether an attempt of the effect row aliased @p E may have taken effect, with nothing
 * since to say it did not. An attempt may have when it was sent and its answer never came or
 * was a 5xx (its connector_call event's "verdict" is "unknown"; an idempotent tool's such
 * attempt is retried with the same key, so the effect can be PLANNED again); what says
 * otherwise is a later status check that found nothing (the reconciler's "redispatched"
 * decision). A run that stops must not call such an effect CANCELLED ("never applied").
 * Reads the run's events through their (run_id, seq) index; meant for rare paths.
 */
#define TALLY_SQL_MAYBE_APPLIED(E)                                                                 \
    "EXISTS (SELECT 1 FROM events mu WHERE mu.run_id = " E ".run_id"                               \
    " AND mu.effect_id = " E ".effect_id AND mu.kind = 'connector_call'"                           \
    " AND mu.data->>'op' = 'execute' AND mu.data->>'verdict' = 'unknown'"                          \
    " AND NOT EXISTS (SELECT 1 FROM events mn WHERE mn.run_id = " E ".run_id"                      \
    "   AND mn.effect_id = " E ".effect_id AND mn.kind = 'connector_call'"                         \
    "   AND mn.data->>'op' = 'status' AND mn.data->>'decision' = 'redispatched'"                   \
    "   AND mn.seq > mu.seq))"

/** The effect transitions of DESIGN §3, ended by {-1, -1, NULL, NULL}. */
extern const tally_transition_t tally_effect_transitions[];
/** The obligation transitions, ended by {-1, -1, NULL, NULL}. */
extern const tally_transition_t tally_obligation_transitions[];

const char *tally_effect_state_name(tally_effect_state_t s);
bool tally_effect_state_parse(const char *s, tally_effect_state_t *out);
/** CONFIRMED, FAILED, REJECTED, CANCELLED (STUCK is terminal for machines, not operators). */
bool tally_effect_state_terminal(tally_effect_state_t s);
bool tally_effect_transition_allowed(tally_effect_state_t from, tally_effect_state_t to);

const char *tally_obligation_state_name(tally_obligation_state_t s);
bool tally_obligation_state_parse(const char *s, tally_obligation_state_t *out);
bool tally_obligation_state_terminal(tally_obligation_state_t s);
bool tally_obligation_transition_allowed(tally_obligation_state_t from,
                                         tally_obligation_state_t to);

#endif
