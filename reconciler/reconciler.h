/* reconciler.h — tally-reconciler (DESIGN §2, §3, §6): resolves UNKNOWN effects from upstream
 * evidence, detects DUPLICATEs, turns expired dispatch leases into UNKNOWN, and pages (STUCK)
 * when the evidence never becomes conclusive.
 *
 * The worker loop lives in reconcile.c, its SQL in store.c; the decisions themselves are pure
 * functions (policy.c) that the unit tests in tests/unit/test_reconcile.c read directly. */
#ifndef TALLY_RECONCILER_H
#define TALLY_RECONCILER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>

#include "tally/alert.h"
#include "tally/audit.h"
#include "tally/connector.h"
#include "tally/outbox.h"
#include "tally/pg.h"
#include "tally/registry.h"
#include "tally/seal.h"
#include "tally/worker.h"

/** The worker: `tally_worker_main(argc, argv, &tally_reconciler_ops)`. */
extern const tally_worker_ops_t tally_reconciler_ops;

/** An inconclusive UNKNOWN goes STUCK once it has been UNKNOWN for this many times the tool's
 * max_backoff_ms, even when fewer than max_attempts checks have been made (a slow status
 * endpoint that times out spends most of the window waiting). */
#define TALLY_RECON_DEADLINE_FACTOR 10

/** What the reconciler does with one UNKNOWN effect after looking upstream. */
typedef enum {
    TALLY_RECON_CONFIRM = 0, /**< one record: CONFIRMED, the record is the receipt */
    TALLY_RECON_DUPLICATE,   /**< several: CONFIRMED with the earliest, obligations for the rest */
    TALLY_RECON_WAIT_SETTLE, /**< none yet, inside the settle window: look again when it ends */
    TALLY_RECON_REDISPATCH, /**< none after the settle window: PLANNED, re-sent with the same key */
    TALLY_RECON_RETRY_CHECK, /**< inconclusive: look again after a backoff with jitter */
    TALLY_RECON_STUCK,       /**< cannot decide safely: STUCK, page a human */
    TALLY_RECON_CANCEL,      /**< REDISPATCH after a status check, but the run stopped: CANCELLED */
} tally_recon_action_t;

/** The names used in tally_reconciler_resolutions_total{outcome} and the logs. */
const char *tally_recon_action_name(tally_recon_action_t a);

/** @brief Everything a decision depends on; filled from the claim (database clock) and the
 * status check's verdict. */
typedef struct tally_recon_input {
    bool has_status;         /**< the tool declares a status endpoint */
    tally_verdict_t verdict; /**< FOUND, DUPLICATE, NOT_FOUND or INCONCLUSIVE */
    tally_effect_class_t effect_class;
    int attempts;            /**< dispatch attempts made (the dispatcher counts) */
    int max_attempts;        /**< the tool's retry.max_attempts */
    bool settled;            /**< the settle window had passed when the check began */
    int inconclusive_checks; /**< inconclusive checks before this one, this episode */
    long long unknown_ms;    /**< how long the effect has been UNKNOWN */
    int backoff_ms;          /**< the tool's retry.backoff_ms */
    int max_backoff_ms;      /**< the tool's retry.max_backoff_ms */
    uint32_t random;         /**< a random number for the jitter */
} tally_recon_input_t;

typedef struct tally_recon_decision {
    tally_recon_action_t action;
    /** STUCK: "attempts_exhausted", "status_inconclusive" or "no_status_check"; else NULL */
    const char *stuck_reason;
    /** RETRY_CHECK: the delay before the next check, in ms; 0 otherwise */
    long long delay_ms;
} tally_recon_decision_t;

/**
 * @brief DESIGN §3 for an UNKNOWN effect:
 * - no status endpoint: read/idempotent tools are re-dispatched (retry is safe by definition)
 *   while attempts < max_attempts, else STUCK attempts_exhausted; other classes STUCK
 *   no_status_check;
 * - FOUND: CONFIRM; DUPLICATE: DUPLICATE;
 * - NOT_FOUND: WAIT_SETTLE until the settle window has passed, then REDISPATCH while
 *   attempts < max_attempts, else STUCK attempts_exhausted;
 * - INCONCLUSIVE: RETRY_CHECK after the tool's backoff (tally_backoff_ms: n-th inconclusive
 *   check of the episode, backoff_ms doubled to max_backoff_ms, equal jitter), or STUCK
 *   status_inconclusive once this is the max_attempts-th inconclusive check or the effect has
 *   been UNKNOWN for TALLY_RECON_DEADLINE_FACTOR × max_backoff_ms.
 */
tally_recon_decision_t tally_recon_decide(const tally_recon_input_t *in);

/**
 * @brief Parse an RFC 3339 date-time ("2024-05-01T12:34:56.789Z", "...+02:00", lowercase t/z
 * allowed, any number of fraction digits) into microseconds since the Unix epoch.
 * @returns false when @p s is not such a date-time.
 */
bool tally_recon_parse_time(const char *s, long long *us_out);

/**
 * @brief Which of the upstream @p records (a JSON array of objects) is the one tally keeps:
 * the earliest by "created_at" when every record carries a parseable one (ties go to the
 * earlier position), otherwise the first in the array. @returns the index (0 for an empty or
 * malformed array).
 */
size_t tally_recon_earliest(const json_t *records);

/**
 * @brief Check a status answer's records before they go near the ledger: it must be an array
 * whose every element is a JSON object (a receipt is an object). U+0000, which jsonb cannot
 * store, never gets this far: without JSON_ALLOW_NUL jansson refuses to parse it.
 * @returns true when usable; otherwise false with a sentence in @p why.
 */
bool tally_recon_records_usable(const json_t *records, char *why, size_t whysz);

/* ---- The ledger side (store.c): every statement the reconciler runs ----------------------- */

/** @brief One UNKNOWN effect this reconciler holds a lease on, from its claim to its record. */
typedef struct tally_recon_item {
    char effect_id[37];
    long long epoch;          /**< lease_epoch after our claim: the compare-and-set fence */
    const tally_tool_t *tool; /**< borrowed from the registry */
    char *run_id;
    char *operation_key;
    char *traceparent; /**< may be NULL */
    int attempts;
    int inconclusive_checks;
    bool settled;         /**< the settle window had passed at the claim (database clock) */
    long long unknown_ms; /**< UNKNOWN for this long at the claim */
    /* the check, filled when it completes */
    bool checked;                 /**< a status request went out (its answer is evidence) */
    tally_conn_verdict_t verdict; /**< INCONCLUSIVE with a reason when nothing usable came */
    long http_status;             /**< 0 when no status line arrived */
    double seconds;               /**< the status call's duration */
    json_t *records;              /**< FOUND/DUPLICATE: the upstream records (owned) */
    tally_recon_decision_t decision;
    bool won;             /**< set by tally_recon_record: the compare-and-set matched */
    long long next_in_ms; /**< set with won: when the effect is due again (database clock) */
    int record_tries;     /**< failed attempts to record the verdict */
    /* a sensitive tool's effect (seal.h) */
    tally_redactor_t *red;    /**< its tenant key and the values to keep out of answers */
    char *receipt_sealed;     /**< FOUND/DUPLICATE: the kept record, sealed whole */
    tally_error_t sealed_err; /**< why its key would not open; errc NONE when it did */
} tally_recon_item_t;

/** @brief Frees an item and what it owns. NULL is allowed. */
void tally_recon_item_free(tally_recon_item_t *it);

/** @brief What the statements need: the connection and who writes. */
typedef struct tally_recon_db {
    tally_pg_t *pg;
    const tally_registry_t *reg;
    const tally_keyring_t *keys; /**< master keys, for sensitive tools' effects */
    const char *actor;           /**< the worker id, for audit events and lease_owner */
    const char *source;          /**< the CloudEvents source, "/tally/reconciler/<worker id>" */
    /* Set by store.c for the length of one transaction; the caller leaves them NULL. */
    tally_audit_batch_t *audit;
    tally_outbox_batch_t *outbox;
    tally_alert_batch_t *alerts;
    bool minimal_pages; /**< raise pages with ids and fixed words only (a page was refused) */
} tally_recon_db_t;

/**
 * @brief One transaction: every DISPATCHING effect whose lease ended before now() (at most
 * @p limit, oldest first, skipping rows another transaction holds) becomes UNKNOWN in one
 * statement — unknown_since and next_attempt_at now(), lease cleared, lease_epoch + 1 — with a
 * "transition" audit event and a tally.effect.unknown.v1 outcome each.
 * @returns the number of effects moved, or -1 with @p err.
 */
int tally_recon_expire_leases(tally_recon_db_t *db, int limit, tally_error_t *err);

/**
 * @brief Complete the runs that are done (tally_runops_complete): COMPLETING runs whose effects
 * settled, and with @p idle_ms > 0 ACTIVE runs idle that long; at most @p limit, in one
 * transaction with their tally.run.completed.v1. @returns runs completed, or -1.
 */
int tally_recon_complete_runs(tally_recon_db_t *db, int limit, int idle_ms, tally_error_t *err);

/**
 * @brief Lease up to @p limit due UNKNOWN effects (next_attempt_at <= now(), no live lease) of
 * the tools in @p tools_json (a JSON array of {tool, lease_ms, settle_ms}) in one statement:
 * FOR UPDATE SKIP LOCKED, lease_until = now() + lease_ms, lease_epoch + 1, lease_owner = actor.
 * The status stays UNKNOWN. @returns the number of items stored in @p out (the caller frees
 * each), or -1 with @p err.
 */
int tally_recon_claim(tally_recon_db_t *db, const char *tools_json, int limit,
                      tally_recon_item_t **out, tally_error_t *err);

/**
 * @brief Record the decisions of @p items in one transaction: one compare-and-set UPDATE on
 * (status 'UNKNOWN', lease_epoch) for all of them, then for those it matched (item->won) the
 * dispatch outbox rows (REDISPATCH), the obligations for extra records (DUPLICATE, ON CONFLICT
 * DO NOTHING), the alerts (STUCK), the audit events and the outcome, duplicate and obligation
 * messages. An item whose lease was taken over writes nothing.
 * @returns false with @p err when the transaction failed (nothing was written).
 */
bool tally_recon_record(tally_recon_db_t *db, tally_recon_item_t **items, size_t n,
                        tally_error_t *err);

/** @brief Give back the leases of @p items that were claimed but not checked (one statement).
 * @returns the number released, or -1 with @p err. */
int tally_recon_release(tally_recon_db_t *db, tally_recon_item_t **items, size_t n,
                        tally_error_t *err);

/** @brief The ledger's UNKNOWN count, the age of the oldest UNKNOWN in seconds and the STUCK
 * count, in one query. */
bool tally_recon_gauges(tally_recon_db_t *db, long long *unknown, double *oldest_s,
                        long long *stuck, tally_error_t *err);

#endif
