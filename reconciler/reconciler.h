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
#include "tally/machines.h"

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

/* ---- Audits of CONFIRMED effects (DESIGN §12; audit.c, store.c) ---------------------------- */

/** What one audit check of a CONFIRMED effect found. */
typedef enum {
    TALLY_AUDIT_CLEAN = 0, /**< one record, the one the ledger keeps */
    TALLY_AUDIT_DUPLICATE, /**< several: obligations for the extras, the receipt kept */
    TALLY_AUDIT_MISSING,   /**< none: the tool holds no record for a CONFIRMED effect */
    TALLY_AUDIT_MISMATCH,  /**< one record, but not the one the ledger keeps */
    TALLY_AUDIT_RETRY,     /**< inconclusive: asked again after a backoff */
    TALLY_AUDIT_GIVE_UP,   /**< inconclusive retry_max times in a row: the audit is dropped */
} tally_audit_result_t;

/** The names used in tally_audits_total{result} and the audit events. */
const char *tally_audit_result_name(tally_audit_result_t r);

typedef struct tally_audit_input {
    tally_verdict_t verdict; /**< of the status check */
    bool kept_matches;       /**< FOUND: the one record's ref is the ledger's external ref */
    int passes;              /**< checks made before this one */
    int again_ms;            /**< the tool's audit.again_ms: a second pass when > 0 */
    int failures;            /**< inconclusive checks in a row before this one */
    int max_attempts;        /**< the tool's retry.max_attempts */
    int backoff_ms;
    int max_backoff_ms;
    uint32_t random;
} tally_audit_input_t;

typedef struct tally_audit_decision {
    tally_audit_result_t result;
    bool counted;         /**< a conclusive check: passes + 1 */
    long long next_in_ms; /**< when to check again; -1 when this was the last check */
} tally_audit_decision_t;

/**
 * @brief What an audit check found and what follows: FOUND is CLEAN when the record is the
 * ledger's (MISMATCH otherwise), DUPLICATE is DUPLICATE, NOT_FOUND is MISSING; each counts a
 * pass, and a second pass follows audit.again_ms later after the first. INCONCLUSIVE is RETRY
 * after the tool's backoff, or GIVE_UP once it is the max_attempts-th in a row (an audit is
 * best-effort: `tally verify --tools` can always ask again).
 */
tally_audit_decision_t tally_audit_decide(const tally_audit_input_t *in);

/* ---- The orphan sweep (DESIGN §12; sweep.c) ----------------------------------------------- */

/** The longest next_cursor a list answer may carry, in bytes. */
#define TALLY_SWEEP_CURSOR_MAX 1024
/** Records asked for per list page. */
#define TALLY_SWEEP_PAGE 100

/** What one record a tool listed is to the ledger. */
typedef enum {
    TALLY_SWEEP_OURS = 0,  /**< the receipt of a CONFIRMED effect, or under an obligation */
    TALLY_SWEEP_UNSETTLED, /**< its effect has not settled: the status path decides */
    TALLY_SWEEP_DUPLICATE, /**< an extra record of a CONFIRMED effect: a 'duplicate' obligation */
    TALLY_SWEEP_ORPHAN,    /**< a record of a FAILED, CANCELLED or REJECTED effect: an 'orphan'
                              obligation */
    TALLY_SWEEP_FINDING,   /**< no such effect, or the tool cannot compensate: a finding, paged */
    TALLY_SWEEP_FOREIGN,   /**< carries no tally effect id: not ours to judge */
} tally_sweep_class_t;

const char *tally_sweep_class_name(tally_sweep_class_t c);

/** @brief One listed record, as the ledger sees it. */
typedef struct tally_sweep_record {
    bool ours;                   /**< it carries a well-formed tally-effect-id and a ref */
    bool known;                  /**< the ledger has that effect */
    tally_effect_state_t status; /**< its status, when known */
    const char *ledger_ref;      /**< the effect's external ref; may be NULL */
    const char *ref;             /**< the record's ref (receipt_ref into it) */
    bool has_obligation;         /**< an obligation already reverses (effect, ref) */
    bool can_compensate;         /**< the tool declares compensate and a mode other than
                                    not_supported */
} tally_sweep_record_t;

/** @brief DESIGN §12: what a listed record is (see tally_sweep_class_t). */
tally_sweep_class_t tally_sweep_classify(const tally_sweep_record_t *r);

/** @brief Whether @p s is a UUID in its canonical 36-character text form. */
bool tally_sweep_uuid_valid(const char *s);

/**
 * @brief Read a list answer: {"records": [objects], "next_cursor": string|null}.
 * @returns true with @p records (a new reference) and @p next_cursor (malloc'd, NULL on the
 * last page); false with a sentence in @p why.
 */
bool tally_sweep_page(const char *body, size_t len, json_t **records, char **next_cursor, char *why,
                      size_t whysz);

/** @brief What the pages of one sweep held, by class. */
typedef struct tally_sweep_counts {
    int recorded, unsettled, foreign; /**< records left alone */
    int obligations;                  /**< obligations filed (duplicates and orphans) */
    int findings;                     /**< findings filed and paged */
} tally_sweep_counts_t;

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
    /* an audit of a CONFIRMED effect rather than an UNKNOWN's check (epoch is the audit row's) */
    bool audit;
    int audit_passes;
    int audit_failures;
    char *external_ref; /**< the ledger's ref for the effect; may be NULL */
    tally_audit_decision_t audit_decision;
    /* a page of an orphan sweep (a list call) rather than a status check */
    bool list;
    char *next_cursor; /**< the page's next_cursor; NULL on the last page */
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

/**
 * @brief Publish the audit policies of the registry's tools (table audit_policies, read by the
 * trigger that queues an audit when an effect is CONFIRMED) and make their pacing rows, in one
 * transaction: tools with audit enabled are upserted, tools of this registry with it disabled
 * are removed. @returns false with @p err.
 */
bool tally_audit_publish(tally_recon_db_t *db, tally_error_t *err);

/**
 * @brief Lease due audits (at most @p limit) of the tools in @p tools_json (a JSON array of
 * {tool, n, lease_ms, slot_ms}: at most n each, every one paid for from the tool's shared
 * budget in tool_pacing at slot_ms per call), in one statement. Items have audit set.
 * @returns the number stored in @p out, or -1 with @p err.
 */
int tally_audit_claim(tally_recon_db_t *db, const char *tools_json, int limit,
                      tally_recon_item_t **out, tally_error_t *err);

/**
 * @brief Record the audit checks of @p items (audit_decision set) in one transaction: a
 * compare-and-set on the audit rows (rescheduled or deleted), and for those won the DUPLICATE
 * obligations and events (as tally_recon_record writes them), the findings and pages of
 * MISSING and MISMATCH, and one "audit" event each. @returns false with @p err.
 */
bool tally_audit_record(tally_recon_db_t *db, tally_recon_item_t **items, size_t n,
                        tally_error_t *err);

/* Shared by store.c and sweep.c: one transaction's batches (alerts, audit events, messages)
 * begin with tally_recon_tx_begin and are written, then committed, by tally_recon_tx_end (or
 * rolled back when @p ok is false). */
bool tally_recon_tx_begin(tally_recon_db_t *tx, tally_error_t *err);
bool tally_recon_tx_end(tally_recon_db_t *tx, bool ok, tally_error_t *err);
/** @brief Queue a CloudEvent of @p type with @p data (stolen) on @p topic, keyed by the run. */
bool tally_recon_queue_message(tally_recon_db_t *db, const char *topic, const char *type,
                               const char *run_id, json_t *data, tally_error_t *err);

/**
 * @brief File @p findings (a JSON array of {finding_id, kind, tool, external_ref, run_id,
 * effect_id, summary, evidence}) inside the transaction of @p tx (its batches set): a finding
 * already on file for (kind, tool, external_ref) is skipped; each new one is paged (dedup key
 * "finding:<id>", closed by `tally resolve --finding`) with a "finding" audit event.
 */
bool tally_recon_file_findings(tally_recon_db_t *tx, const json_t *findings, tally_error_t *err);

/**
 * @brief Take this period's sweep of @p tool (its cursor row is made on first use, looking back
 * audit.lookback_ms): true when this worker sweeps it now, with the cursor's time in @p since and
 * the database's now in @p started (RFC 3339, UTC); false when another worker did within
 * audit.sweep_ms, or with @p err set on a failure.
 */
bool tally_sweep_claim(tally_recon_db_t *db, const tally_tool_t *tool, char since[40],
                       char started[40], tally_error_t *err);

/** @brief End a sweep: move the cursor to @p new_since (never back; NULL leaves it) and keep
 * @p error (NULL after a sweep that went through). */
bool tally_sweep_finish(tally_recon_db_t *db, const tally_tool_t *tool, const char *new_since,
                        const char *error, tally_error_t *err);

/**
 * @brief Set one page of listed @p records against the ledger and act, in one transaction:
 * obligations for duplicates and orphans (with their events and messages), findings paged
 * (tally_recon_file_findings). A sensitive tool's records are redacted in place first.
 * Adds to @p counts. @returns false with @p err (nothing written).
 */
bool tally_sweep_record_page(tally_recon_db_t *db, const tally_tool_t *tool, json_t *records,
                             tally_sweep_counts_t *counts, tally_error_t *err);

/** @brief The ledger's UNKNOWN count, the age of the oldest UNKNOWN in seconds, the STUCK
 * count and how long the oldest STUCK effect has been STUCK in seconds, in one query. */
bool tally_recon_gauges(tally_recon_db_t *db, long long *unknown, double *oldest_s,
                        long long *stuck, double *stuck_oldest_s, tally_error_t *err);

#endif
