/* runops.h — run-level operations of DESIGN §7: compensate or cancel a run, the obligations of
 * effects confirmed after compensation began, the compensation plan (`--dry-run`), and the
 * per-class decision table the compensator follows. Shared by the CLI (`tally compensate|cancel
 * --run R`), the dispatcher (tally.compensate_run.v1, tally.cancel_run.v1) and the compensator. */
#ifndef TALLY_RUNOPS_H
#define TALLY_RUNOPS_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/audit.h"
#include "tally/error.h"
#include "tally/ledger.h"
#include "tally/outbox.h"
#include "tally/pg.h"
#include "tally/registry.h"

/** SQL: whether a run in status @p COL still carries its effects forward: ACTIVE, and a
 * completed run (COMPLETING, COMPLETED), whose open effects still finish. Any other status
 * (cancelled, under compensation) stops what has not been sent. */
#define TALLY_SQL_RUN_GOES_ON(COL) "(" COL " IN ('ACTIVE', 'COMPLETING', 'COMPLETED'))"

/** SQL: whether a run in status @p COL takes new intents: ACTIVE only. */
#define TALLY_SQL_RUN_TAKES_INTENTS(COL) "(" COL " = 'ACTIVE')"

/** SQL: obligation @p O is the one for effect @p E's own record — the one a compensation of the
 * run creates and acts on — and not one for an extra copy a DUPLICATE found (those carry the
 * copy's external ref). (effect_id, external_ref) is the obligations' unique key, so an effect
 * has at most one. The compensation, its sweep, its plan and `tally summary` follow this rule. */
#define TALLY_SQL_OWN_OBLIGATION(O, E)                                                             \
    "(" O ".effect_id = " E ".effect_id AND " O ".external_ref IS NOT DISTINCT FROM " E            \
    ".external_ref)"

/* ---- the decision table (pure) -------------------------------------------------------- */

/** @brief What compensating one confirmed effect means (DESIGN §4). */
typedef enum {
    TALLY_COMP_ACT_SKIP = 0, /**< read / idempotent: nothing to undo -> SKIPPED */
    TALLY_COMP_ACT_REVERSE,  /**< reversible + automatic (or approved): the compensate call */
    TALLY_COMP_ACT_RECORD,   /**< append_only: UNCOMPENSATABLE, blast radius recorded */
    TALLY_COMP_ACT_CONTAIN,  /**< append_only with connector.contain: RECORD + containment call */
    TALLY_COMP_ACT_ESCALATE, /**< destructive: UNCOMPENSATABLE and a critical alert */
    TALLY_COMP_ACT_AWAIT_APPROVAL, /**< compensation.mode approval_required, not yet approved */
    TALLY_COMP_ACT_RUNBOOK, /**< compensation.mode manual_runbook: STUCK at once with the runbook */
    TALLY_COMP_ACT_NOT_SUPPORTED, /**< compensation.mode not_supported: UNCOMPENSATABLE with the
                                     reason */
    TALLY_COMP_ACT_NO_TOOL, /**< the tool is gone from the registry, or cannot reverse: STUCK */
} tally_comp_action_t;

/** @brief A decision: the action, the obligation state it leads to, a code and a sentence. */
typedef struct tally_comp_decision {
    tally_comp_action_t action;
    const char *to_status; /**< "SKIPPED", "RUNNING" (a call is made), "UNCOMPENSATABLE",
                                "AWAITING_APPROVAL", "STUCK" */
    const char *code;      /**< machine-readable status_reason: "read_only", "idempotent",
                                "reverse", "append_only", "destructive", "approval_required",
                                "manual_runbook", "not_supported", "unknown_tool",
                                "no_compensate_endpoint" */
    char why[320];         /**< one sentence for the audit trail, the summary and the plan */
} tally_comp_decision_t;

/**
 * @brief The decision table. @p tool is the registry's contract (NULL when @p tool_name is no
 * longer registered); @p cls the effect's class as recorded in the ledger; @p approved whether
 * an operator approved this compensation (approval_required tools).
 *
 * | class       | automatic | approval_required       | manual_runbook | not_supported  |
 * |-------------|-----------|-------------------------|----------------|----------------|
 * | read        | SKIP      | SKIP                    | SKIP           | SKIP           |
 * | idempotent  | SKIP      | SKIP                    | SKIP           | SKIP           |
 * | reversible  | REVERSE   | AWAIT, then REVERSE     | RUNBOOK        | NOT_SUPPORTED  |
 * | append_only | CONTAIN*  | AWAIT*, then CONTAIN*   | RUNBOOK        | RECORD         |
 * | destructive | ESCALATE  | ESCALATE                | ESCALATE       | ESCALATE       |
 *
 * (*) CONTAIN when the tool declares connector.contain, else RECORD (no approval needed).
 */
void tally_comp_decide(const tally_tool_t *tool, const char *tool_name, tally_effect_class_t cls,
                       bool approved, tally_comp_decision_t *out);

/** @brief "skip", "reverse", "record", "contain", "escalate", "await_approval", "runbook",
 * "not_supported", "no_tool". */
const char *tally_comp_action_name(tally_comp_action_t a);

/* ---- compensate / cancel a run (in the caller's transaction) ---------------------------- */

typedef enum {
    TALLY_RUNOP_COMPENSATE = 0, /**< tally.compensate_run.v1, `tally compensate --run` */
    TALLY_RUNOP_CANCEL,         /**< tally.cancel_run.v1, `tally cancel --run` */
} tally_runop_kind_t;

/** @brief One request. Strings are borrowed for the duration of the call. */
typedef struct tally_runop {
    tally_runop_kind_t kind;
    const char *run_id;
    bool compensate;       /**< cancel only: also compensate the CONFIRMED effects */
    const char *reason;    /**< the requester's words for the audit trail; may be NULL */
    const char *intent_id; /**< CloudEvents id of the request message; NULL from the CLI */
    int deadline_ms;       /**< with compensation: finish it within this many ms (1000 to
                                TALLY_RUNOP_DEADLINE_MS_MAX; runs.compensation_deadline_at);
                                0: no deadline asked */
} tally_runop_t;

/** The longest compensation deadline a request may ask for, in ms (24 days, as the registry's
 * compensation.deadline_ms), and the shortest. */
#define TALLY_RUNOP_DEADLINE_MS_MAX 2073600000
#define TALLY_RUNOP_DEADLINE_MS_MIN 1000

/** @brief What one request did. */
typedef struct tally_runop_result {
    bool found;                  /**< false: no such run (nothing was done) */
    tally_run_state_t before;    /**< the run's status before the request */
    tally_run_state_t after;     /**< and after */
    char status_before[24];      /**< tally_run_state_name(before), for JSON and logs */
    char status_after[24];       /**< tally_run_state_name(after) */
    size_t obligations_created;  /**< new obligations (0 when compensation was asked before) */
    size_t obligations_existing; /**< CONFIRMED effects that already had their obligation */
    size_t effects_cancelled;    /**< PLANNED / AWAITING_APPROVAL effects now CANCELLED */
    size_t effects_waiting;      /**< DISPATCHING / UNKNOWN: compensated once they are confirmed */
    char deadline_at[32];        /**< the run's compensation deadline after the request (RFC 3339,
                                      UTC), "" for none */
} tally_runop_result_t;

/**
 * @brief Apply @p n requests inside the caller's open transaction (the caller commits):
 * - locks the runs (FOR UPDATE, in run_id order);
 * - cancel: deletes the dispatch outbox rows of the runs' PLANNED effects, then moves their
 *   PLANNED and AWAITING_APPROVAL effects to CANCELLED (compare-and-set; an effect a dispatcher
 *   already claimed is DISPATCHING and left to finish); a run without compensation turns
 *   ACTIVE -> CANCELLED;
 * - compensate (and cancel with compensate): one obligation per CONFIRMED effect, inserted last
 *   step first with ON CONFLICT DO NOTHING (asking twice creates nothing new), reason
 *   "compensate_run" or "cancel_run"; the run turns COMPENSATING (from ACTIVE or CANCELLED, or
 *   from COMPENSATED / PARTIALLY_COMPENSATED when this created new obligations; STUCK stays
 *   STUCK). It turns COMPENSATING even when nothing is CONFIRMED yet: effects still DISPATCHING
 *   or UNKNOWN get their obligation when they are confirmed (tally_runops_sweep_confirmed), and
 *   the compensator writes the summary once nothing is left;
 * - a compensation with deadline_ms sets the run's compensation deadline
 *   (runs.compensation_deadline_at) to now() + deadline_ms, or keeps an earlier one that has not
 *   passed yet (so a redelivered request cannot move it later); without deadline_ms it is left
 *   as it is. Every result names the run's deadline after the request.
 * Every statement handles the whole batch. Queues on @p ab an audit event per cancelled effect,
 * per new obligation, per run status change and per request (kind "compensate_run" /
 * "cancel_run", by @p actor), and on @p ob a tally.obligation.v1 (topic "obligations", key run_id,
 * CloudEvents source @p source) per new obligation and a tally.effect.cancelled.v1 (topic
 * "outcomes") per cancelled effect; the caller flushes both before COMMIT.
 * @param results @p n entries, filled in request order.
 */
bool tally_runops_apply(tally_pg_t *pg, const tally_runop_t *ops, size_t n, const char *actor,
                        const char *source, tally_outbox_batch_t *ob, tally_audit_batch_t *ab,
                        tally_runop_result_t *results, tally_error_t *err) TALLY_WUR;

/**
 * @brief The compensator's sweep, in the caller's transaction: CONFIRMED effects of runs under
 * compensation (COMPENSATING, or STUCK runs that had compensation obligations, and with
 * @p settled also COMPENSATED and PARTIALLY_COMPENSATED ones) without an obligation for their
 * external ref get one (one statement, at most @p limit, ON CONFLICT DO NOTHING), with the
 * reason of the run's earlier obligations. A COMPENSATED or PARTIALLY_COMPENSATED run that
 * gains one turns COMPENSATING again. Events are queued on @p ob and @p ab as for
 * tally_runops_apply.
 * @param settled also read the settled runs, whose number grows with the ledger's history. A
 *   run settles only when none of its effects is DISPATCHING or UNKNOWN and every CONFIRMED one
 *   has its obligation, and a STUCK effect makes it STUCK, so an effect of a settled run is
 *   rarely confirmed later; the caller reads them less often.
 * @param created receives the number of new obligations.
 */
bool tally_runops_sweep_confirmed(tally_pg_t *pg, int limit, bool settled, const char *actor,
                                  const char *source, tally_outbox_batch_t *ob,
                                  tally_audit_batch_t *ab, size_t *created,
                                  tally_error_t *err) TALLY_WUR;

/**
 * @brief The plan of @p op for `--dry-run`, without changing anything: a JSON array with one
 * object per effect of the run, last step first: {"step", "effect_id", "tool", "effect_class",
 * "compensation_mode", "effect_status", "external_ref", "obligation" (the existing one or
 * null), "action", "will" (what will happen, in words), "why"}.
 * @returns a new reference, or NULL with @p err (code "not_found" when there is no such run).
 */
json_t *tally_runops_plan(tally_pg_t *pg, const tally_registry_t *reg, const tally_runop_t *op,
                          tally_error_t *err) TALLY_WUR;

/**
 * @brief Approve (AWAITING_APPROVAL -> PENDING, approved_at/approved_by set) or deny
 * (AWAITING_APPROVAL -> SKIPPED, reason "denied") obligations, compare-and-set, in the caller's
 * transaction, with an audit event of kind "operator" each.
 * @param changed receives how many obligations moved (the others were not AWAITING_APPROVAL).
 */
bool tally_runops_approve_obligations(tally_pg_t *pg, const char *const *obligation_ids, size_t n,
                                      bool approve, const char *actor, const char *reason,
                                      tally_audit_batch_t *ab, size_t *changed,
                                      tally_error_t *err) TALLY_WUR;

/* ---- runs that complete (docs/agent-protocol.md) ---------------------------------------- */

/**
 * @brief Complete the runs that are done, in the caller's transaction: COMPLETING runs (those
 * of @p run_ids, or every one when @p run_ids is NULL) none of whose effects is PLANNED,
 * DISPATCHING or UNKNOWN, and, when @p idle_ms > 0 and @p run_ids is NULL, ACTIVE runs none of
 * whose effects changed for @p idle_ms; at most @p limit (FOR UPDATE SKIP LOCKED). Each turns
 * COMPLETED with its summary in runs.summary ({"total", "effects": {status: n}, "open": [...]
 * (AWAITING_APPROVAL and STUCK effects, at most 100), "open_count"}), an audit transition on
 * @p ab and a tally.run.completed.v1 on @p ob. @p completed receives how many.
 */
bool tally_runops_complete(tally_pg_t *pg, const char *const *run_ids, size_t n, int limit,
                           int idle_ms, const char *actor, const char *source,
                           tally_outbox_batch_t *ob, tally_audit_batch_t *ab, size_t *completed,
                           tally_error_t *err) TALLY_WUR;

/** @brief Queue tally.run.completed.v1 of a COMPLETED run (its runs.summary as @p summary text,
 * may be NULL) on @p ob: the answer to a complete_run of a run that already completed. */
bool tally_runops_completed_event(const char *run_id, const char *reason, const char *summary,
                                  const char *source, tally_outbox_batch_t *ob) TALLY_WUR;

#endif
