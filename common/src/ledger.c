/* ledger.c — the effect and obligation state machines of DESIGN §3.
 *
 * The tables below are the whole truth about which moves exist; the SQL that performs a move
 * checks tally_*_transition_allowed() first, and the unit tests read the same tables. A move
 * may appear more than once when different actors make it for different reasons. */
#include "tally/ledger.h"

#include <stddef.h>
#include <string.h>

#define E(s) TALLY_EFFECT_##s
#define O(s) TALLY_OBLIGATION_##s

const tally_transition_t tally_effect_transitions[] = {
    {E(AWAITING_APPROVAL), E(PLANNED), "operator", "approved"},
    {E(AWAITING_APPROVAL), E(REJECTED), "operator", "denied"},
    {E(PLANNED), E(DISPATCHING), "dispatcher", "claimed with a lease"},
    {E(DISPATCHING), E(CONFIRMED), "dispatcher", "2xx with receipt"},
    {E(DISPATCHING), E(FAILED), "dispatcher", "definite failure (4xx) or attempt cap"},
    {E(DISPATCHING), E(PLANNED), "dispatcher",
     "not applied (refused, 429/503, connection refused), retry with backoff"},
    {E(DISPATCHING), E(UNKNOWN), "dispatcher", "timeout after send or 5xx"},
    {E(DISPATCHING), E(UNKNOWN), "reconciler", "dispatch lease expired"},
    {E(UNKNOWN), E(CONFIRMED), "reconciler", "status: one or more upstream records"},
    {E(UNKNOWN), E(PLANNED), "reconciler", "status: none after the settle window"},
    {E(UNKNOWN), E(STUCK), "reconciler",
     "no status check, attempts exhausted or inconclusive too long"},
    {E(PLANNED), E(CANCELLED), "dispatcher", "run cancelled"},
    {E(PLANNED), E(CANCELLED), "operator", "run cancelled"},
    {E(AWAITING_APPROVAL), E(CANCELLED), "dispatcher", "run cancelled"},
    {E(AWAITING_APPROVAL), E(CANCELLED), "operator", "run cancelled"},
    {E(UNKNOWN), E(CONFIRMED), "operator", "operator resolution with evidence"},
    {E(UNKNOWN), E(FAILED), "operator", "operator resolution with evidence"},
    {E(STUCK), E(CONFIRMED), "operator", "operator resolution with evidence"},
    {E(STUCK), E(FAILED), "operator", "operator resolution with evidence"},
    {-1, -1, NULL, NULL},
};

const tally_transition_t tally_obligation_transitions[] = {
    {O(PENDING), O(RUNNING), "compensator", "leased"},
    {O(RUNNING), O(RUNNING), "compensator", "expired lease taken over"},
    {O(RUNNING), O(PENDING), "compensator", "retry with backoff (timeout, 5xx, 409)"},
    {O(RUNNING), O(RESOLVED), "compensator", "reversed (2xx, or 404 on an already-reversed ref)"},
    {O(RUNNING), O(SKIPPED), "compensator", "nothing to reverse (read or idempotent tool)"},
    {O(RUNNING), O(UNCOMPENSATABLE), "compensator",
     "append_only or destructive: blast radius recorded"},
    {O(RUNNING), O(STUCK), "compensator", "412 stale state, other 4xx, or attempts exhausted"},
    {O(PENDING), O(AWAITING_APPROVAL), "compensator", "compensation.mode approval_required"},
    {O(PENDING), O(STUCK), "compensator", "manual_runbook"},
    {O(PENDING), O(CANCELLED), "compensator", "nothing to compensate"},
    {O(AWAITING_APPROVAL), O(PENDING), "operator", "approved"},
    {O(AWAITING_APPROVAL), O(SKIPPED), "operator", "denied"},
    {O(STUCK), O(RESOLVED), "operator", "operator resolution with evidence"},
    {O(STUCK), O(SKIPPED), "operator", "operator decided nothing is to be undone"},
    {-1, -1, NULL, NULL},
};

#undef E
#undef O

/* Indexed by the enums; the spelling is the one stored in the status columns. */
static const char *const effect_names[TALLY_EFFECT__COUNT] = {
    [TALLY_EFFECT_PLANNED] = "PLANNED",
    [TALLY_EFFECT_AWAITING_APPROVAL] = "AWAITING_APPROVAL",
    [TALLY_EFFECT_DISPATCHING] = "DISPATCHING",
    [TALLY_EFFECT_CONFIRMED] = "CONFIRMED",
    [TALLY_EFFECT_FAILED] = "FAILED",
    [TALLY_EFFECT_UNKNOWN] = "UNKNOWN",
    [TALLY_EFFECT_STUCK] = "STUCK",
    [TALLY_EFFECT_REJECTED] = "REJECTED",
    [TALLY_EFFECT_CANCELLED] = "CANCELLED",
};

static const char *const obligation_names[TALLY_OBLIGATION__COUNT] = {
    [TALLY_OBLIGATION_PENDING] = "PENDING",
    [TALLY_OBLIGATION_AWAITING_APPROVAL] = "AWAITING_APPROVAL",
    [TALLY_OBLIGATION_RUNNING] = "RUNNING",
    [TALLY_OBLIGATION_RESOLVED] = "RESOLVED",
    [TALLY_OBLIGATION_SKIPPED] = "SKIPPED",
    [TALLY_OBLIGATION_UNCOMPENSATABLE] = "UNCOMPENSATABLE",
    [TALLY_OBLIGATION_STUCK] = "STUCK",
    [TALLY_OBLIGATION_CANCELLED] = "CANCELLED",
};

static bool name_lookup(const char *const *names, int n, const char *s, int *out)
{
    if (s == NULL)
        return false;
    for (int i = 0; i < n; i++) {
        if (strcmp(names[i], s) == 0) {
            *out = i;
            return true;
        }
    }
    return false;
}

static bool table_allows(const tally_transition_t *t, int from, int to)
{
    for (; t->by != NULL; t++) {
        if (t->from == from && t->to == to)
            return true;
    }
    return false;
}

const char *tally_effect_state_name(tally_effect_state_t s)
{
    if ((int)s < 0 || s >= TALLY_EFFECT__COUNT)
        return "INVALID";
    return effect_names[s];
}

bool tally_effect_state_parse(const char *s, tally_effect_state_t *out)
{
    int i;
    if (!name_lookup(effect_names, TALLY_EFFECT__COUNT, s, &i))
        return false;
    *out = (tally_effect_state_t)i;
    return true;
}

bool tally_effect_state_terminal(tally_effect_state_t s)
{
    switch (s) {
    case TALLY_EFFECT_CONFIRMED:
    case TALLY_EFFECT_FAILED:
    case TALLY_EFFECT_REJECTED:
    case TALLY_EFFECT_CANCELLED:
        return true;
    case TALLY_EFFECT_PLANNED:
    case TALLY_EFFECT_AWAITING_APPROVAL:
    case TALLY_EFFECT_DISPATCHING:
    case TALLY_EFFECT_UNKNOWN:
    case TALLY_EFFECT_STUCK: /* waits for an operator */
    case TALLY_EFFECT__COUNT:
        break;
    }
    return false;
}

bool tally_effect_transition_allowed(tally_effect_state_t from, tally_effect_state_t to)
{
    return table_allows(tally_effect_transitions, (int)from, (int)to);
}

const char *tally_obligation_state_name(tally_obligation_state_t s)
{
    if ((int)s < 0 || s >= TALLY_OBLIGATION__COUNT)
        return "INVALID";
    return obligation_names[s];
}

bool tally_obligation_state_parse(const char *s, tally_obligation_state_t *out)
{
    int i;
    if (!name_lookup(obligation_names, TALLY_OBLIGATION__COUNT, s, &i))
        return false;
    *out = (tally_obligation_state_t)i;
    return true;
}

bool tally_obligation_state_terminal(tally_obligation_state_t s)
{
    switch (s) {
    case TALLY_OBLIGATION_RESOLVED:
    case TALLY_OBLIGATION_SKIPPED:
    case TALLY_OBLIGATION_UNCOMPENSATABLE:
    case TALLY_OBLIGATION_CANCELLED:
        return true;
    case TALLY_OBLIGATION_PENDING:
    case TALLY_OBLIGATION_AWAITING_APPROVAL:
    case TALLY_OBLIGATION_RUNNING:
    case TALLY_OBLIGATION_STUCK: /* waits for an operator */
    case TALLY_OBLIGATION__COUNT:
        break;
    }
    return false;
}

bool tally_obligation_transition_allowed(tally_obligation_state_t from, tally_obligation_state_t to)
{
    return table_allows(tally_obligation_transitions, (int)from, (int)to);
}
