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
