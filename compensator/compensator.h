/* compensator.h — tally-compensator's state and its parts: the loop that waits on curl,
 * PostgreSQL and Kafka at once (compensate.c), leasing obligations and acting on them
 * (obligation.c), run summaries and STUCK runs (settle.c), the pure builders the tests read
 * (summary.c) and the PagerDuty sender (pager.c).
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
#include <jansson.h>
#include <librdkafka/rdkafka.h>

#include "tally/config.h"
#include "tally/connector.h"
#include "tally/metrics.h"
#include "tally/pg.h"
#include "tally/registry.h"
#include "tally/runops.h"
#include "tally/text.h"
#include "tally/worker.h"

/** The worker ops of tally-compensator; main.c hands them to tally_worker_main. */
extern const tally_worker_ops_t tally_compensator_ops;

/* A lease covers the tool's timeout plus this margin (and never less than TALLY_LEASE_MS),
 * so a reverse call still legitimately running is not taken over. */
#define COMP_LEASE_MARGIN_MS 2000

/** The obligation states counted for tally_obligations (settle.c). */
#define COMP_OBLIGATION_STATES 8

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
    const tally_tool_t *tool; /**< NULL when the tool left the registry */
    char from_status[24];     /**< PENDING, or RUNNING for an expired lease taken over */
    long long epoch;
    int attempts; /**< including this one */
    bool approved;
    tally_comp_decision_t dec;
    json_t *blast_radius; /**< append_only / destructive (owned) */
    double started;       /**< monotonic seconds when the call was submitted */
} comp_ob_t;

/** A decided move of one obligation, waiting to be written. */
typedef struct comp_outcome {
    comp_ob_t *ob;              /**< owned */
    const char *to_status;      /**< PENDING, RESOLVED, SKIPPED, UNCOMPENSATABLE, STUCK */
    char code[48];              /**< status_reason: reverse verdict code or decision code */
    char message[512];          /**< one sentence */
    bool is_error;              /**< code/message are an error (error_code, error_message) */
    json_t *reverse_receipt;    /**< RESOLVED (owned) */
    json_t *call;               /**< the connector exchange for the audit trail (owned) */
    long long delay_ms;         /**< PENDING: back off this long */
    bool refund_attempt;        /**< PENDING without a call made (capacity): attempts - 1 */
    const char *alert_severity; /**< raise a page: "critical"; NULL for none */
    const char *alert_reason;   /**< its machine-readable reason */
} comp_outcome_t;

typedef struct comp_pager comp_pager_t;

typedef struct compensator {
    tally_worker_t *w;
    const tally_config_t *cfg;
    const tally_registry_t *reg;
    tally_pg_t *pg;
    rd_kafka_t *rk;
    rd_kafka_queue_t *queue;
    int kafka_pipe[2];
    tally_connector_t *conn;
    const char *worker_id;
    char source[300];     /**< CloudEvents source of everything this worker publishes */
    char *approval_tools; /**< JSON array of tools whose compensation needs approval */
    unsigned rand_state;

    bool lease_wanted; /**< a wake-up, a NOTIFY, a recorded outcome or the sweep timer */
    double next_sweep; /**< monotonic seconds */
    double record_retry_at;
    bool minimal_pages; /**< the last record with pages was refused: raise them minimal */
    double settle_retry_at;
    rd_kafka_topic_partition_list_t *offsets; /**< wake-ups read, stored after the next round */
    bool draining;

    comp_outcome_t *done; /**< outcomes to record */
    size_t n_done, cap_done;
    json_t *settle_runs; /**< runs whose obligations moved: settle them next (array of ids) */

    comp_pager_t *pager;

    double gauge_counts[COMP_OBLIGATION_STATES]; /**< the last counts, settle.c's order */
    bool live_moved;            /**< live counts changed since the terminal ones were read */
    double terminal_counted_at; /**< monotonic seconds; 0: not yet */
    int settled_sweep_in;       /**< sweeps until the late-confirmation sweep reads settled runs */

    tally_metric_t *m_obligations; /**< tally_obligations{state} */
    tally_metric_t *m_stuck;       /**< tally_stuck_obligations */
    tally_metric_t *m_drain;       /**< tally_obligation_drain_seconds */
    tally_metric_t *m_reverse;     /**< tally_reverse_call_seconds{tool} */
    tally_metric_t *m_alerts;      /**< tally_alerts_sent_total{channel} */
    tally_metric_t *m_alert_fail;  /**< tally_alert_write_failures_total */
    tally_metric_t *m_outcomes;    /**< tally_compensations_total{tool,outcome} */
    tally_metric_t *m_lease_lost;  /**< tally_obligation_lease_lost_total */
    tally_metric_t *m_inflight;    /**< tally_compensator_inflight */
    tally_metric_t *m_db_errors;   /**< tally_compensator_db_errors_total{step} */
    tally_metric_t *m_runs;        /**< tally_runs_settled_total{status} */
} compensator_t;

/* compensate.c */
double comp_now(void);

/* obligation.c */

/** @brief Lease what may run now (one statement) and act on it. @returns obligations leased,
 * -1 on a database error. */
int comp_lease(compensator_t *c);

/** @brief The connector's completion callback: classify and queue the outcome. */
void comp_on_done(const tally_conn_result_t *res, void *opaque);

/** @brief Write every queued outcome in one transaction. @returns outcomes written, -1. */
int comp_record(compensator_t *c);

/** @brief Move PENDING obligations of approval_required tools to AWAITING_APPROVAL. */
int comp_hold_for_approval(compensator_t *c);

/** @brief Frees a leased obligation (also for calls abandoned at exit). */
void comp_ob_free(void *ob);

/** @brief Frees an outcome's members (not the array slot). */
void comp_outcome_clear(comp_outcome_t *o);

/* settle.c */

/**
 * @brief Write the summary of every run under compensation whose obligations can make no more
 * progress — @p run_ids (a JSON array; NULL: every such run) — and publish
 * tally.run.compensated.v1 / tally.run.stuck.v1 once per outcome. @returns runs settled, -1.
 */
int comp_settle(compensator_t *c, const json_t *run_ids);

/** @brief The sweep: obligations for late confirmations, approvals, settlement, gauges. */
int comp_sweep(compensator_t *c);

/* summary.c — pure: no I/O, for the unit tests */

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

/** What a receipt's "version" gives the If-Match header. */
typedef enum {
    COMP_VERSION_NONE = 0, /**< no version: no If-Match */
    COMP_VERSION_OK,       /**< sent as If-Match */
    COMP_VERSION_UNUSABLE, /**< over TALLY_LIMIT_RECEIPT_VERSION, or with control characters */
} comp_version_t;

/** The If-Match text of a receipt version, with its NUL. */
#define COMP_IF_MATCH_SIZE (TALLY_LIMIT_RECEIPT_VERSION + 1)

/**
 * @brief The receipt's "version" (a string or an integer) as If-Match text in @p out. A version
 * that cannot travel whole in the header is UNUSABLE, never cut: the stale-state guard would
 * be lost.
 */
comp_version_t comp_if_match(const json_t *receipt, char out[COMP_IF_MATCH_SIZE]);

/**
 * @brief Backoff before retry @p attempts (1 = after the first call): the tool's backoff_ms
 * doubling per attempt, capped at max_backoff_ms, with "equal jitter" (half fixed, half
 * random from @p rand_state); at least @p retry_after_ms when the tool sent Retry-After.
 */
long long comp_backoff_ms(const tally_tool_t *tool, int attempts, long retry_after_ms,
                          unsigned *rand_state);

/**
 * @brief A run's compensation summary (DESIGN §7) from the ledger's view of it: @p items is an
 * array of objects, one per effect and obligation (see settle.c for the fields). Fills
 * @p status with COMPENSATED, PARTIALLY_COMPENSATED or STUCK. @returns {"run_id", "status",
 * "reason", "compensated", "uncompensatable", "skipped", "failed", "counts"}, a new reference
 * or NULL (OOM).
 */
json_t *comp_run_summary(const char *run_id, const char *reason, const json_t *items,
                         const char **status);

/* pager.c */

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
