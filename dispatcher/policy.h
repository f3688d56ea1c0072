/* policy.h — the dispatcher's decisions, without I/O (policy.c): what an effect becomes after
 * its connector call (DESIGN §3 rules 2 and 4), and how the one move only the database can
 * make — the run stopped while the call was in flight — maps back onto that decision.
 * tests/unit/test_dispatch_policy.c reads them directly. */
#ifndef TALLY_DISPATCH_POLICY_H
#define TALLY_DISPATCH_POLICY_H

#include <stdbool.h>
#include <stdint.h>

#include "tally/connector.h"
#include "tally/ledger.h"
#include "tally/registry.h"

/** @brief Everything the decision after a call depends on. */
typedef struct tally_dispatch_input {
    const tally_conn_verdict_t *v;     /**< the classified answer (connector.h); borrowed */
    tally_effect_class_t effect_class; /**< the tool's */
    int attempts;                      /**< this attempt's number, 1 for the first */
    int max_attempts;                  /**< the tool's retry.max_attempts */
    int backoff_ms;                    /**< the tool's retry.backoff_ms */
    int max_backoff_ms;                /**< the tool's retry.max_backoff_ms */
    uint32_t random;                   /**< a random number for the backoff's jitter */
} tally_dispatch_input_t;

/** @brief What the effect becomes: the compare-and-set the recorder writes (record.c). */
typedef struct tally_dispatch_decision {
    /** CONFIRMED, FAILED, PLANNED (tried again) or UNKNOWN. CANCELLED only as the database's
     * override (tally_dispatch_overridden). */
    tally_effect_state_t state;
    /** PLANNED: this attempt may have been applied (an idempotent tool's timeout or 5xx), so a
     * run that stops before the retry makes it UNKNOWN, not CANCELLED. */
    bool maybe_applied;
    /** FAILED because the tool refused tally's credentials (401/403): page its owner. */
    bool page_owner;
    long long delay_ms;      /**< PLANNED: the backoff before the next attempt; else 0 */
    char error_code[32];     /**< "" when there is no error */
    char error_message[512]; /**< cut on a character boundary (text.h) */
} tally_dispatch_decision_t;

/**
 * @brief DESIGN §3 after an execute call:
 * - CONFIRMED → CONFIRMED; FAILED → FAILED with the verdict's error, paging the owner when the
 *   verdict says so (alert_owner);
 * - RETRY → PLANNED after tally_backoff_ms while attempts < max_attempts, else FAILED
 *   attempts_exhausted;
 * - UNKNOWN of a read or idempotent tool (rule 2: retrying is safe) → as RETRY, except that at
 *   the cap an idempotent tool's effect is UNKNOWN (the last try may have applied: only the
 *   reconciler can tell); an idempotent tool's retry is maybe_applied;
 * - UNKNOWN of any other class → UNKNOWN;
 * - any other verdict (not an execute verdict) → UNKNOWN unexpected_verdict.
 */
void tally_dispatch_decide(const tally_dispatch_input_t *in, tally_dispatch_decision_t *out);

/** @brief Set the decision's error: @p code, and @p fmt with its one argument @p msg (a tool's
 * text, cut on a character boundary). */
void tally_dispatch_set_error(tally_dispatch_decision_t *dec, const char *code, const char *fmt,
                              const char *msg) __attribute__((format(printf, 3, 0)));

/**
 * @brief Whether a decision can be written without a look at its run or a page: true for
 * CONFIRMED, UNKNOWN and a FAILED that pages nobody (the recorder's one-statement path);
 * false for PLANNED (its run may have stopped: the override) and for a page.
 */
bool tally_dispatch_final(const tally_dispatch_decision_t *dec);

/**
 * @brief The database's override mapped back. A retry (PLANNED) whose run stopped being
 * ACTIVE while its call was in flight is not tried again: the record statement writes it
 * CANCELLED, or UNKNOWN when this attempt or an earlier one may have been applied — a run lock
 * and the effect's history that only the statement holds (record.c, SQL_RECORD). @p became is
 * the state the row came back in; @p code and @p message the error written with it.
 * @returns true when @p became is the decision itself (nothing changes) or an override of it
 * (@p dec takes the override's state and error); false when the statement could not have
 * written it (then @p dec is left as it is).
 */
bool tally_dispatch_overridden(tally_dispatch_decision_t *dec, tally_effect_state_t became,
                               const char *code, const char *message);

#endif
