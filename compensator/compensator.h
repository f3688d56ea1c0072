/* compensator.h — tally-compensator's state and its parts, on the reconciler's model:
 *   compensate.c  the loop: wake-ups, leases, the reverse calls in flight, recording, the sweep
 *   policy.c      the decisions, pure: what an obligation's tool, attempts and call answer make
 *                 it, the backoff, what a settled run publishes (tests/unit/test_compensate.c)
 *   body.c        the documents, pure: the blast radius, the reverse call's body and If-Match
 *   store.c       every statement on obligations: lease, record outcomes, hold for approval,
 *                 counts
 *   settle.c      every statement on runs: settle them (their summary is tally/runsummary.h's),
 *                 obligations for late confirmations
 *   deadline.c    compensation deadlines: page the open obligations near and past theirs,
 *                 resolve those pages when the obligations close, the deadline gauges
 *   pager.c       the PagerDuty sender, on its own thread
 *
 * Saga order. Within one run an obligation is leased only when every obligation of a later
 * step is terminal (RESOLVED, SKIPPED, UNCOMPENSATABLE, CANCELLED) and, for run compensations,
 * no later effect is still DISPATCHING, UNKNOWN or STUCK. "Later" is the order the steps were
 * taken in: (step_num IS NULL, step_num, seq) — numeric steps by value, other steps in arrival
 * order after them. A STUCK obligation is not terminal, so it holds every earlier one: the saga
 * stops and a human decides. Runs are independent of each other. */
#ifndef TALLY_COMPENSATOR_H
#define TALLY_COMPENSATOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

#include "tally/config.h"
#include "tally/connector.h"
#include "tally/consume.h"
#include "tally/ledger.h"
#include "tally/metrics.h"
#include "tally/pg.h"
#include "tally/registry.h"
#include "tally/seal.h"
#include "tally/runops.h"
#include "tally/text.h"
#include "tally/worker.h"

/** SQL: the sort key of the step of effect row @p e in saga order (above): numeric steps by
 * value, other steps in arrival order after them. */
#define COMP_SQL_STEP_KEY(e) "(" e ".step_num IS NULL, coalesce(" e ".step_num, 0), " e ".seq)"

/** The worker ops of tally-compensator; main.c hands them to tally_worker_main. */
extern const tally_worker_ops_t tally_compensator_ops;

/* A lease covers the tool's timeout plus this margin (and never less than TALLY_LEASE_MS),
 * so a reverse call still legitimately running is not taken over. */
#define COMP_LEASE_MARGIN_MS 2000

/** A leased obligation, from the lease until its outcome is recorded. */
typedef struct comp_ob {
    char obligation_id[37];
    char effect_id[37];
    char *run_id;
    char *step;
    bool step_is_number;
    char *tool_name;
    char *operation_key;
    char *args_canonical;
    char *traceparent;   /**< may be NULL */
    char *external_ref;  /**< the record to reverse; may be NULL */
    char *reason;        /**< duplicate, compensate_run, cancel_run */
    char *confirmed_at;  /**< when the effect was confirmed (RFC 3339) */
    char *intent_id;     /**< the intent that created the effect; may be NULL */
    int effect_attempts; /**< connector calls the dispatcher made for the effect */
    json_t *receipt;     /**< the record's receipt (owned; may be NULL) */
    tally_effect_class_t cls;
    bool cls_known;
    const tally_tool_t *tool;      /**< NULL when the tool left the registry */
    tally_obligation_state_t from; /**< PENDING, or RUNNING for an expired lease taken over */
    long long epoch;
    int attempts; /**< including this one */
    bool approved;
    tally_comp_decision_t dec;
    json_t *blast_radius; /**< what cannot be undone (owned; NULL otherwise) */
    double started;       /**< monotonic seconds when the call was submitted */
    /* a sensitive tool's (seal.h): the tool gets the real values, everything else the
     * redacted ones above */
    tally_redactor_t *red;    /**< its tenant key and the values to keep out of answers */
    char *args_plain;         /**< the sealed args opened, or NULL */
    json_t *receipt_plain;    /**< the effect's sealed receipt opened (owned), or NULL */
    tally_error_t sealed_err; /**< why they would not open; errc NONE when they did */
} comp_ob_t;

/** A decided move of one obligation, waiting to be written. */
typedef struct comp_outcome {
    comp_ob_t *ob;               /**< owned */
    tally_obligation_state_t to; /**< PENDING, RESOLVED, SKIPPED, UNCOMPENSATABLE, STUCK */
    char code[48];               /**< status_reason: reverse verdict code or decision code */
    char message[512];           /**< one sentence */
    bool is_error;               /**< code/message are an error (error_code, error_message) */
    json_t *reverse_receipt;     /**< RESOLVED (owned) */
    json_t *call;                /**< the connector exchange for the audit trail (owned) */
    long long delay_ms;          /**< PENDING: back off this long */
    bool refund_attempt;         /**< PENDING without a call made (capacity): attempts - 1 */
    char page[48];               /**< raise a critical page with this reason; "" for none */
} comp_outcome_t;

typedef struct comp_pager comp_pager_t;

typedef struct compensator {
    tally_worker_t *w;
    const tally_config_t *cfg;
    const tally_registry_t *reg;
    const tally_keyring_t *keys; /**< master keys (seal.h) */
    tally_pg_t *pg;
    tally_consume_t *cs; /**< wake-ups on <prefix>obligations (the worker's); NULL: none */
    tally_connector_t *conn;
    const char *worker_id;
    char source[300];     /**< CloudEvents source of everything this worker publishes */
    char *approval_tools; /**< JSON array of tools whose compensation needs approval */
    char *deadline_tools; /**< JSON array of {tool, deadline_ms} with a compensation deadline */
    size_t deadline_pages_open; /**< open deadline pages at the last look: resolve after records */
    unsigned rand_state;

    bool lease_wanted; /**< a wake-up, a NOTIFY, a recorded outcome or the sweep timer */
    double next_sweep; /**< monotonic seconds */
    double record_retry_at;
    bool minimal_pages; /**< the last record with pages was refused: raise them minimal */
    bool draining;

    comp_outcome_t *done; /**< outcomes to record */
    size_t n_done, cap_done;
    json_t *settle_runs; /**< runs whose obligations moved: settle them next (array of ids) */

    comp_pager_t *pager;

    double gauge_counts[TALLY_OBLIGATION__COUNT]; /**< the last counts, by state */
    bool live_moved;            /**< live counts changed since the terminal ones were read */
    double terminal_counted_at; /**< monotonic seconds; 0: not yet */
    int settled_sweep_in;       /**< sweeps until the late-confirmation sweep reads settled runs */

    tally_metric_t *m_obligations;   /**< tally_obligations{state} */
    tally_metric_t *m_stuck;         /**< tally_stuck_obligations */
    tally_metric_t *m_stuck_oldest;  /**< tally_stuck_obligations_oldest_age_seconds */
    tally_metric_t *m_drain;         /**< tally_obligation_drain_seconds */
    tally_metric_t *m_reverse;       /**< tally_reverse_call_seconds{tool} */
    tally_metric_t *m_alerts;        /**< tally_alerts_sent_total{channel} */
    tally_metric_t *m_alert_fail;    /**< tally_alert_write_failures_total */
    tally_metric_t *m_outcomes;      /**< tally_compensations_total{tool,outcome} */
    tally_metric_t *m_lease_lost;    /**< tally_obligation_lease_lost_total */
    tally_metric_t *m_inflight;      /**< tally_compensator_inflight */
    tally_metric_t *m_tool_inflight; /**< tally_reverse_calls_inflight{tool} */
    tally_metric_t *m_db_errors;     /**< tally_compensator_db_errors_total{step} */
    tally_metric_t *m_runs;          /**< tally_runs_settled_total{status} */
    tally_metric_t *m_past_deadline; /**< tally_obligations_past_deadline */
    tally_metric_t *m_near_deadline; /**< tally_obligations_near_deadline */
} compensator_t;

/* ---- compensate.c: the loop --------------------------------------------------------------- */

double comp_now(void);

/** @brief Frees a leased obligation (also for calls abandoned at exit). NULL is allowed. */
void comp_ob_free(void *ob);

/** @brief Frees an outcome's members (not the array slot). */
void comp_outcome_clear(comp_outcome_t *o);

/* ---- policy.c: the decisions (pure) ------------------------------------------------------- */

/** @brief The tool's max_attempts, 5 without one (or without the tool). */
int comp_max_attempts(const tally_tool_t *tool);

/** @brief Whether the registry's contract of @p tool asks for approval before compensating
 * (the rule that fills the approval list the lease statement excludes). False for NULL. */
bool comp_needs_approval(const tally_tool_t *tool);

/**
 * @brief Backoff before retry @p attempts (1 = after the first call): the tool's backoff_ms
 * doubling per attempt, capped at max_backoff_ms, with "equal jitter" (half fixed, half
 * drawn from @p random); at least @p retry_after_ms when the tool sent Retry-After.
 */
long long comp_backoff_ms(const tally_tool_t *tool, int attempts, long retry_after_ms,
                          uint32_t random);

/** What a receipt's "version" gives the If-Match header (body.c). */
typedef enum {
    COMP_VERSION_NONE = 0, /**< no version: no If-Match */
    COMP_VERSION_OK,       /**< sent as If-Match */
    COMP_VERSION_UNUSABLE, /**< over TALLY_LIMIT_RECEIPT_VERSION, or with control characters */
} comp_version_t;

/** Everything a decision about one leased obligation depends on. */
typedef struct comp_policy_in {
    const tally_tool_t *tool; /**< the registry's contract; NULL when the tool left it */
    const char *tool_name;
    bool cls_known; /**< the effect's class is one tally knows */
    tally_effect_class_t cls;
    bool approved;          /**< an operator approved this compensation */
    int attempts;           /**< calls started for it, this one included */
    comp_version_t version; /**< what the receipt's version gives If-Match */
    int hold_ms;            /**< how long an obligation given back untouched waits */
    uint32_t random;        /**< for the backoff's jitter */
} comp_policy_in_t;

/** How a decision is carried out. */
typedef enum {
    COMP_MOVE_RECORD = 0, /**< write the obligation's new state now */
    COMP_MOVE_CALL,       /**< make the call; comp_policy_answer decides on its answer */
} comp_move_kind_t;

/** What a containment did, as the blast radius records it ("containment": {"status", ...}). */
typedef enum {
    COMP_CONTAIN_NONE = 0, /**< nothing to record */
    COMP_CONTAIN_DONE,     /**< "done" */
    COMP_CONTAIN_FAILED,   /**< "failed": a containment never makes the obligation STUCK */
} comp_contain_t;

/** One decision about one obligation: from its lease, a call not sent, or a call's answer. */
typedef struct comp_move {
    comp_move_kind_t kind;
    tally_conn_op_t op;           /**< CALL: TALLY_CONN_COMPENSATE or TALLY_CONN_CONTAIN */
    tally_obligation_state_t to;  /**< RECORD: PENDING, RESOLVED, SKIPPED, UNCOMPENSATABLE, STUCK */
    const char *code;             /**< the status_reason code: static or borrowed from the input */
    char message[512];            /**< one sentence (may quote a tool's answer) */
    bool is_error;                /**< code and message are the error (error_code, _message) */
    bool refund_attempt;          /**< PENDING without a call made: the attempt is not counted */
    long long delay_ms;           /**< PENDING: wait this long */
    const char *page;             /**< raise a critical page with this reason; NULL: none */
    comp_contain_t containment;   /**< what to record of the containment in the blast radius */
    const char *containment_code; /**< its code (borrowed) */
    const char *containment_message; /**< its sentence (borrowed) */
} comp_move_t;

/**
 * @brief The decision table for a leased obligation: tally_comp_decide, with approval given
 * when an operator approved or the tool's contract does not ask for it, and an effect class
 * tally does not know made STUCK (unknown_class).
 */
void comp_policy_decide(const comp_policy_in_t *in, tally_comp_decision_t *dec);

/** @brief Whether the decided action records a blast radius (what cannot be undone). */
bool comp_policy_wants_blast_radius(tally_comp_action_t action);

/**
 * @brief What to do with a leased obligation, by its decision (DESIGN §4):
 * - SKIP: SKIPPED; RECORD, NOT_SUPPORTED: UNCOMPENSATABLE; ESCALATE: UNCOMPENSATABLE, paged
 *   "destructive";
 * - CONTAIN: the containment call while attempts ≤ max_attempts and @p can_contain (the blast
 *   radius it carries was built), else UNCOMPENSATABLE (with "attempts_exhausted" recorded as
 *   the containment's failure when that was why);
 * - RUNBOOK, NO_TOOL: STUCK, paged with the decision's code;
 * - AWAIT_APPROVAL (the registry changed under the lease): PENDING again, untouched, after
 *   hold_ms;
 * - REVERSE: the reverse call, unless attempts > max_attempts (leases kept expiring mid-call:
 *   STUCK "attempts_exhausted") or the receipt's version cannot travel as If-Match (STUCK
 *   "protocol_error": the call is not made without its stale-state guard); both paged.
 */
void comp_policy_lease(const comp_policy_in_t *in, const tally_comp_decision_t *dec,
                       bool can_contain, comp_move_t *mv);

/**
 * @brief A call that could not be sent (nothing went out). @p capacity: no room in the engine,
 * which is not the tool's fault: PENDING in 200 ms, the attempt not counted. A retriable
 * @p err with attempts left: PENDING after the backoff. Otherwise a containment is recorded as
 * failed (UNCOMPENSATABLE), a reverse call goes STUCK ("attempts_exhausted" when retriable,
 * else @p err's code), paged. @p err is borrowed into @p mv.
 */
void comp_policy_unsent(const comp_policy_in_t *in, const tally_comp_decision_t *dec,
                        tally_conn_op_t op, bool capacity, const tally_error_t *err,
                        comp_move_t *mv);

/** @brief Out of memory building a call's body: PENDING in 1 s, the attempt not counted. */
void comp_policy_no_body(comp_move_t *mv);

/**
 * @brief A call's answer, classified (DESIGN §6; @p v is borrowed into @p mv).
 * - containment (append_only): a transient failure is retried after the backoff within
 *   max_attempts; anything else is UNCOMPENSATABLE with the containment "done" or "failed"
 *   ("attempts_exhausted" when the retries ran out) — never STUCK;
 * - reverse: RESOLVED; a transient failure PENDING after the backoff (Retry-After honoured), or
 *   STUCK "attempts_exhausted" at max_attempts; anything else STUCK with the verdict's code,
 *   paged "stale_state" (412) or "reverse_failed".
 */
void comp_policy_answer(const comp_policy_in_t *in, const tally_comp_decision_t *dec,
                        tally_conn_op_t op, const tally_conn_verdict_t *v, comp_move_t *mv);

/** What settling a run writes. */
typedef enum {
    COMP_SETTLE_NONE = 0,   /**< this outcome was published already: nothing */
    COMP_SETTLE_SUMMARY,    /**< the run keeps its status: a new summary (audit "summary") */
    COMP_SETTLE_TRANSITION, /**< the run moves to the outcome (audit "transition") */
} comp_settle_t;

/**
 * @brief A settled run in @p status whose summary came out as @p outcome: nothing when the run
 * is in @p outcome and @p published (the outcome last published; NULL: none) is it too — each
 * outcome goes out once — else the summary, as a transition when the status changes.
 */
comp_settle_t comp_policy_settle(tally_run_state_t status, const tally_run_state_t *published,
                                 tally_run_state_t outcome);

/** @brief The event a settled run publishes: tally.run.stuck.v1 for STUCK, else
 * tally.run.compensated.v1. */
const char *comp_policy_run_event(tally_run_state_t outcome);

/**
 * @brief Whether the sweep counts the terminal obligations again (tally_obligations). They only
 * grow and reading them is the costly part (bench/README.md, "compensator gauges"): at once the
 * first time (@p counted_at 0), then when the live counts moved and COMP_TERMINAL_COUNT_MIN_S
 * passed, and every COMP_TERMINAL_COUNT_MAX_S in any case.
 */
bool comp_policy_count_terminal(double now, double counted_at, bool live_moved);
#define COMP_TERMINAL_COUNT_MIN_S 10.0
#define COMP_TERMINAL_COUNT_MAX_S 60.0

/* ---- body.c: the documents (pure) --------------------------------------------------------- */

/** @brief The first of the args that names who or what the effect reached ("to", "recipient",
 * "email", "account_id", ...), or NULL. Borrowed from the list of names. */
const char *comp_target_field(const json_t *args);

/**
 * @brief The blast radius of an effect that cannot be undone: {"tool", "target": {"field",
 * "value"} or null, "operation_key", "external_ref", "args", "receipt", "time" (when it
 * happened), "recorded_at" (now)}. Borrows everything. @returns a new reference or NULL (OOM).
 */
json_t *comp_blast_radius(const char *tool, const char *operation_key, const json_t *args,
                          const json_t *receipt, const char *external_ref, const char *time);

/** @brief The compensate body {"external_ref","receipt","args","reason"}. New reference. */
json_t *comp_reverse_body(const char *external_ref, const json_t *receipt, const json_t *args,
                          const char *reason);

/** The If-Match text of a receipt version, with its NUL. */
#define COMP_IF_MATCH_SIZE (TALLY_LIMIT_RECEIPT_VERSION + 1)

/**
 * @brief The receipt's "version" (a string or an integer) as If-Match text in @p out. A version
 * that cannot travel whole in the header is UNUSABLE, never cut: the stale-state guard would
 * be lost.
 */
comp_version_t comp_if_match(const json_t *receipt, char out[COMP_IF_MATCH_SIZE]);

/**
 * @brief The commands a deadline page gives, by the state the obligation is in when paged:
 * STUCK, `tally resolve --obligation ID --as resolved|skipped` (tally_alert_obligation_command);
 * AWAITING_APPROVAL, `tally approve|deny --obligation ID`; otherwise (the compensator is still
 * at it) `tally doctor --run RUN` (shell-quoted) and the resolve that applies once it is STUCK.
 * Each line ends with a shell comment saying when it applies. Malloc'd; NULL on OOM.
 */
char *comp_deadline_command(tally_obligation_state_t state, const char *obligation_id,
                            const char *run_id);

/**
 * @brief The one-line summary of a deadline page into @p out: past the deadline (@p passed), or
 * @p share of the time used. Names the run, step, tool, obligation, its status and the deadline
 * (RFC 3339); the run, step and tool are cut on character boundaries.
 */
void comp_deadline_summary(char *out, size_t outsz, bool passed, double share, const char *run_id,
                           const char *step, const char *tool, const char *obligation_id,
                           const char *status, const char *deadline_at);

/* ---- store.c: every statement on obligations ---------------------------------------------- */

/**
 * @brief Lease what may run now, at most @p limit (one statement, in saga order), with a
 * "lease" audit event each, in one transaction. @returns the number leased, with @p out a
 * malloc'd array of that many obligations (the caller frees it and each; an element is NULL
 * when the row could not be read: its lease expires), or -1 on a database error (logged).
 */
int comp_store_lease(compensator_t *c, int limit, comp_ob_t ***out);

/** @brief Write every queued outcome (c->done) in one transaction: each a compare-and-set on
 * (status, lease_epoch) with its audit events, pages and Kafka events. A batch PostgreSQL
 * refuses for its data is written one by one. @returns outcomes written, -1. */
int comp_store_record(compensator_t *c);

/** @brief Move PENDING obligations of approval_required tools to AWAITING_APPROVAL. */
int comp_store_hold_for_approval(compensator_t *c);

/** @brief Read the counts of the live (@p terminal false) or terminal obligation states into
 * @p counts (a state without rows is 0; the other states are left alone), and for the live
 * ones how long the oldest STUCK obligation has been STUCK into @p stuck_oldest_s (0 for
 * none; unused, may be NULL, for the terminal ones). False on an error, said in the log. */
bool comp_store_count(compensator_t *c, bool terminal, double counts[TALLY_OBLIGATION__COUNT],
                      double *stuck_oldest_s);

/* ---- settle.c: every statement on runs ---------------------------------------------------- */

/**
 * @brief Write the summary of every run under compensation whose obligations can make no more
 * progress — @p run_ids (a JSON array; NULL: every such run) — and publish
 * tally.run.compensated.v1 / tally.run.stuck.v1 once per outcome. @returns runs settled, -1.
 */
int comp_settle(compensator_t *c, const json_t *run_ids);

/** @brief Obligations for CONFIRMED effects of runs under compensation that have none yet
 * (tally_runops_sweep_confirmed). @returns obligations created, -1. */
int comp_sweep_confirmed(compensator_t *c);

/* ---- deadline.c: compensation deadlines ---------------------------------------------------- */

/** @brief The tools with a compensation.deadline_ms, as the deadline sweep's JSON parameter
 * [{"tool", "deadline_ms"}]. Malloc'd (the caller frees); NULL on OOM. */
char *comp_deadline_tools(const tally_registry_t *reg);

/**
 * @brief The deadline sweep, in one transaction: reads every open obligation (PENDING,
 * AWAITING_APPROVAL, RUNNING, STUCK) with a deadline — the earlier of its created_at + its
 * tool's compensation.deadline_ms and its run's compensation_deadline_at — in one statement
 * (the tools' deadlines travel as one JSON parameter); sets tally_obligations_past_deadline and
 * tally_obligations_near_deadline; raises a warning page ("deadline-warning:<id>") once
 * TALLY_DEADLINE_WARN_SHARE of its time has passed and a critical one ("deadline:<id>") at the
 * deadline, each once (a page with its key, open or resolved, is never raised again); resolves
 * the open deadline pages of obligations that have closed. One compensator at a time does the
 * paging (a transaction-level advisory lock; another skips it for that round).
 * @returns pages raised and resolved, -1 on a database error (logged; the next sweep repeats).
 */
int comp_deadline_sweep(compensator_t *c);

/** @brief Resolve the open deadline pages of obligations that have closed, at once (after
 * outcomes were recorded), in its own transaction. @returns pages resolved, -1. */
int comp_deadline_resolve(compensator_t *c);

/* ---- pager.c ------------------------------------------------------------------------------ */

/**
 * @brief The PagerDuty Events API v2 body for an alert: {"routing_key", "event_action"
 * ("trigger" or "resolve"), "dedup_key", "payload": {"summary" (at most 1024 bytes),
 * "source", "severity", "custom_details"}, "links": [{"href": runbook, "text"}]} (payload
 * and links for a trigger only). Borrows everything. @returns a new reference or NULL.
 */
json_t *comp_pager_body(const char *routing_key, const char *action, const char *dedup_key,
                        const char *summary, const char *source, const char *severity,
                        const json_t *details, const char *runbook);

/**
 * @brief Start the pager thread, with its own PostgreSQL connection. Without TALLY_PAGER_URL
 * it marks pending alerts 'not_configured' instead of sending. @returns NULL with @p errstr.
 */
comp_pager_t *comp_pager_start(const tally_config_t *cfg, const char *worker_id,
                               tally_metrics_t *metrics, tally_metric_t *m_alerts,
                               volatile const int *stop, char *errstr, size_t errsz);

/** @brief Stop (a POST in flight finishes within its timeout), join and free. NULL is allowed. */
void comp_pager_stop(comp_pager_t *p);

#endif
