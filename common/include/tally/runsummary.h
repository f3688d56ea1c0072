/* runsummary.h — a run's compensation summary (DESIGN §7): where each effect and obligation of
 * a run goes — compensated (with the reverse receipt), uncompensatable (with the blast radius),
 * skipped (with the reason), failed/STUCK (with the error, the original receipt and the action
 * required), or still under way — and what its entry says.
 *
 * One classification for both readers of a run: the compensator, which writes the summary into
 * runs.summary and tally.run.*.v1 once nothing of the run can progress (the SETTLED view), and
 * `tally summary`, which computes it from the ledger at any time (the LIVE view) and otherwise
 * prints the stored one. Pure: no I/O; tests/unit/test_runsummary.c reads it back. */
#ifndef TALLY_RUNSUMMARY_H
#define TALLY_RUNSUMMARY_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/ledger.h"

/** The lists of a summary, in the order they are written. */
typedef enum {
    TALLY_RUNSUM_COMPENSATED = 0, /**< reversed: with the reverse call's receipt */
    TALLY_RUNSUM_UNCOMPENSATABLE, /**< cannot be undone: with the blast radius */
    TALLY_RUNSUM_SKIPPED,         /**< nothing to undo: with the reason */
    TALLY_RUNSUM_FAILED,          /**< STUCK or held behind a STUCK step: a human acts */
    TALLY_RUNSUM_PENDING,         /**< still under way (the LIVE views only) */
    TALLY_RUNSUM__COUNT
} tally_runsum_list_t;

/** Two more lists, which only `tally summary` shows (tally_runsum_sort_all): the summary the
 * compensator writes and tally_runsum_sort keep to the five above. */
/** happened and stands: a CONFIRMED effect of a run no compensation was asked for */
#define TALLY_RUNSUM_DONE ((tally_runsum_list_t)TALLY_RUNSUM__COUNT)
/** an extra copy a DUPLICATE found, settled by its own obligation (reversed, mostly): not a
 * compensation of the run (tally_runsum_sort lists it by its state, "duplicate_copy": true) */
#define TALLY_RUNSUM_DUPLICATES ((tally_runsum_list_t)(TALLY_RUNSUM__COUNT + 1))
#define TALLY_RUNSUM__ALL       (TALLY_RUNSUM__COUNT + 2)

/** @brief "compensated", "uncompensatable", "skipped", "failed", "pending", "done",
 * "duplicates": the list's key. */
const char *tally_runsum_list_name(tally_runsum_list_t l);

/** Who reads the run, which decides what an unfinished item means. */
typedef enum {
    /** The compensator, once nothing of the run can progress (compensator/settle.c): an
     * obligation not yet terminal is held behind a STUCK later step, and an effect without an
     * obligation will not get one. Action texts carry the page's resolve command and runbook. */
    TALLY_RUNSUM_SETTLED = 0,
    /** `tally summary`, at any time: obligations under way and confirmed or in-flight effects
     * without one yet are pending. Action texts end with the commands to copy. */
    TALLY_RUNSUM_LIVE,
    /** `tally summary` of a run no compensation was asked for (ACTIVE, COMPLETING, COMPLETED,
     * CANCELLED): as LIVE, but what is CONFIRMED happened and stands: done, not pending (the
     * TALLY_RUNSUM_DONE list: tally_runsum_sort_all only). */
    TALLY_RUNSUM_UNCOMPENSATED,
} tally_runsum_view_t;

/** What one item (an obligation, or an effect without one) is. */
typedef enum {
    TALLY_RUNSUM_REVERSED = 0,      /**< obligation RESOLVED: compensated */
    TALLY_RUNSUM_IRREVERSIBLE,      /**< obligation UNCOMPENSATABLE: uncompensatable */
    TALLY_RUNSUM_NOTHING_TO_UNDO,   /**< obligation SKIPPED or CANCELLED: skipped */
    TALLY_RUNSUM_OBLIGATION_STUCK,  /**< obligation STUCK: failed */
    TALLY_RUNSUM_BLOCKED,           /**< SETTLED: obligation not terminal, behind a STUCK step */
    TALLY_RUNSUM_UNDER_WAY,         /**< LIVE: obligation PENDING, AWAITING_APPROVAL, RUNNING */
    TALLY_RUNSUM_EFFECT_STUCK,      /**< no obligation, effect STUCK: failed */
    TALLY_RUNSUM_NO_OBLIGATION_YET, /**< LIVE: CONFIRMED, DISPATCHING or UNKNOWN, no obligation */
    TALLY_RUNSUM_NO_OBLIGATION,     /**< SETTLED: the same, and none will come: skipped */
    TALLY_RUNSUM_NEVER_APPLIED,     /**< no obligation, the effect did not or will not happen */
    TALLY_RUNSUM_STANDS, /**< UNCOMPENSATED: CONFIRMED, no obligation: done, not compensated */
} tally_runsum_kind_t;

/**
 * @brief The classification. @p ob is the obligation's state, NULL for an effect without
 * one; @p effect the effect's state, NULL when it is not known.
 *
 * | item                                        | SETTLED                | LIVE                |
 * |---------------------------------------------|------------------------|---------------------|
 * | obligation RESOLVED                         | REVERSED               | REVERSED            |
 * | obligation UNCOMPENSATABLE                  | IRREVERSIBLE           | IRREVERSIBLE        |
 * | obligation SKIPPED, CANCELLED               | NOTHING_TO_UNDO        | NOTHING_TO_UNDO     |
 * | obligation STUCK                            | OBLIGATION_STUCK       | OBLIGATION_STUCK    |
 * | obligation PENDING, AWAITING_APPROVAL, RUN. | BLOCKED                | UNDER_WAY           |
 * | no obligation, effect STUCK                 | EFFECT_STUCK           | EFFECT_STUCK        |
 * | no obligation, CONFIRMED, DISPATCHING, UNK. | NO_OBLIGATION          | NO_OBLIGATION_YET   |
 * | no obligation, any other or unknown state   | NEVER_APPLIED          | NEVER_APPLIED       |
 *
 * UNCOMPENSATED is LIVE but for a CONFIRMED effect without an obligation: STANDS.
 */
tally_runsum_kind_t tally_runsum_classify(tally_runsum_view_t view,
                                          const tally_obligation_state_t *ob,
                                          const tally_effect_state_t *effect);

/** @brief The list a kind of item goes to. */
tally_runsum_list_t tally_runsum_kind_list(tally_runsum_kind_t k);

/**
 * @brief The entry of one item, as both summaries write it: {"effect_id", "step" (an integer
 * when the agent sent one), "tool", "obligation_id", "external_ref"}, then by kind
 * "reverse_receipt" | "blast_radius" | "status", "error", "receipt", "action_required" and
 * "attempts" | "reason".
 * @p item is one effect and obligation as the ledger has them: "effect_id", "step",
 * "step_is_number", "tool", "effect_status", "effect_error" ({code, message} or null),
 * "receipt", "external_ref", "obligation_id", "obligation_status" (absent or null: none),
 * "status_reason", "error_code", "error_message", "reverse_receipt", "blast_radius",
 * "attempts", and for the SETTLED view "runbook" and "resolve_command" (the page's); optional
 * "effect_class", "obligation_reason" and "kept_ref" (the effect's own external ref). Borrowed.
 *
 * Beyond the table: an obligation of a "duplicate" is an extra copy's, not a compensation of
 * the effect: its entry says so ("duplicate_copy": true, and what became of the copy and of the
 * kept record), and once settled it goes to the duplicates list in the LIVE views. A read or
 * idempotent effect's obligation held behind a STUCK step (BLOCKED) needs nothing: skipped. An
 * uncompensatable entry's reason ends with its containment action's result, as the compensator
 * recorded it in the blast radius.
 * @param list receives the list the entry goes to.
 * @returns a new reference, or NULL when out of memory.
 */
json_t *tally_runsum_entry(tally_runsum_view_t view, const json_t *item, tally_runsum_list_t *list);

/**
 * @brief Append the entry of each of @p items (an array, in the order given: last step first)
 * to its list in @p lists, TALLY_RUNSUM__COUNT arrays indexed by tally_runsum_list_t.
 * @returns false when out of memory (the lists then hold a part).
 */
bool tally_runsum_sort(tally_runsum_view_t view, const json_t *items,
                       json_t *const lists[TALLY_RUNSUM__COUNT]);

/**
 * @brief tally_runsum_sort into all TALLY_RUNSUM__ALL lists: the settled extra copies of a
 * DUPLICATE go to TALLY_RUNSUM_DUPLICATES, and with the UNCOMPENSATED view what stands to
 * TALLY_RUNSUM_DONE. (tally_runsum_sort, with five lists, keeps the copies in their state's list
 * and counts what stands as pending.)
 */
bool tally_runsum_sort_all(tally_runsum_view_t view, const json_t *items,
                           json_t *const lists[TALLY_RUNSUM__ALL]);

/** @brief A settled run's outcome: STUCK when something failed, PARTIALLY_COMPENSATED when
 * something cannot be undone, else COMPENSATED. */
tally_run_state_t tally_runsum_outcome(size_t n_failed, size_t n_uncompensatable);

/**
 * @brief The summary the compensator writes when a run settles (runs.summary, and the
 * "summary" of tally.run.compensated.v1 / tally.run.stuck.v1): {"run_id", "status", "reason"
 * (null when @p reason is NULL), "counts": {"compensated", "uncompensatable", "skipped",
 * "failed"}, "compensated", "uncompensatable", "skipped", "failed"}, the SETTLED view of
 * @p items. Fills @p status with the outcome (tally_runsum_outcome).
 * @returns a new reference, or NULL when out of memory.
 */
json_t *tally_runsum_settled(const char *run_id, const char *reason, const json_t *items,
                             tally_run_state_t *status);

#endif
