/* alert.h — pages: one alerts row per dedup key, raised and resolved in the caller's
 * transaction, each published to the alerts topic once (DESIGN §5, §8). */
#ifndef TALLY_ALERT_H
#define TALLY_ALERT_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/audit.h"
#include "tally/config.h"
#include "tally/error.h"
#include "tally/metrics.h"
#include "tally/outbox.h"
#include "tally/pg.h"

/** The longest summary a page keeps, in bytes: a longer one is cut on a character boundary. */
#define TALLY_ALERT_SUMMARY_MAX 512

/** @brief One page to raise. Strings are copied by tally_alert_batch_add: made valid UTF-8 and
 * cut on a character boundary (the summary at TALLY_ALERT_SUMMARY_MAX bytes, other text at
 * TALLY_LIMIT_REASON), so that no text can make a page unwritable. */
typedef struct tally_alert {
    const char *dedup_key; /**< required; one page per key (tally_alert_effect_key()) */
    const char *severity;  /**< "critical", "error", "warning" or "info" */
    const char *summary;   /**< required; one line for the pager */
    const char *run_id;    /**< the Kafka key; may be NULL */
    const char *effect_id; /**< at least one of effect_id and obligation_id */
    const char *obligation_id;
    const char *reason;          /**< required; machine-readable: attempts_exhausted, ... */
    const char *runbook;         /**< may be NULL */
    const char *resolve_command; /**< required; the exact `tally resolve ...` to run */
    const json_t *details;       /**< optional extra fields for the event's data (borrowed) */
} tally_alert_t;

/**
 * @brief Alerts to raise with one statement. Build with tally_alert_batch_add, write with
 * tally_alert_batch_flush inside the transaction that made the state change. Sticky failure:
 * an add that could not be queued is reported by flush.
 */
typedef struct tally_alert_batch tally_alert_batch_t;

tally_alert_batch_t *tally_alert_batch_new(void) TALLY_WUR;

/** @brief Queue one alert (copied). Two alerts with one dedup key in a batch open one page. */
void tally_alert_batch_add(tally_alert_batch_t *b, const tally_alert_t *alert);

size_t tally_alert_batch_len(const tally_alert_batch_t *b);

/**
 * @brief INSERT every queued alert in one statement (`ON CONFLICT (dedup_key)`: a TRIGGERED
 * page stays as it is; a RESOLVED one is triggered again with the new details). For each page
 * this opened or re-opened, and only for those, queue a tally.alert.trigger.v1 CloudEvent from
 * @p source on @p ob (topic "alerts", key run_id) and an audit event of kind "alert" by
 * @p actor on @p ab; the caller flushes both in the same transaction. A retry of a page that
 * is already open therefore publishes nothing. The event's data holds the alert's fields,
 * "console_url" when a console is set (tally_alert_set_console), then the details' fields that
 * do not collide with those. Empties the batch.
 * @param n_opened when not NULL, receives the number of pages opened or re-opened.
 */
bool tally_alert_batch_flush(tally_alert_batch_t *b, tally_pg_t *pg, const char *actor,
                             const char *source, tally_outbox_batch_t *ob, tally_audit_batch_t *ab,
                             size_t *n_opened, tally_error_t *err) TALLY_WUR;

void tally_alert_batch_free(tally_alert_batch_t *b);

/**
 * @brief Resolve the TRIGGERED pages among @p dedup_keys (one statement): status RESOLVED,
 * resolved_at now(), pager_state back to 'pending' so the pager sends the resolve. For each,
 * queue a tally.alert.resolve.v1 CloudEvent with the same dedup key (and console link) on
 * @p ob and an audit event of kind "alert" with @p reason on @p ab. Keys that are unknown or
 * already resolved are skipped.
 * @param n_resolved when not NULL, receives the number of pages resolved.
 */
bool tally_alert_resolve(tally_pg_t *pg, const char *const *dedup_keys, size_t n, const char *actor,
                         const char *source, const char *reason, tally_outbox_batch_t *ob,
                         tally_audit_batch_t *ab, size_t *n_resolved, tally_error_t *err) TALLY_WUR;

/**
 * @brief Where operators reach the web console (TALLY_CONSOLE_URL, checked by config.c), for
 * every alert this process raises or resolves and every page it sends: each then carries the
 * link tally_alert_link() makes. NULL or "" sets none, and alerts carry no link. Process-wide,
 * like the log's settings: set it once at start-up, before any thread raises or sends an alert
 * (tally_worker_main does, and the CLI verbs that close pages: resolve, approve, deny).
 * @returns false, setting nothing, when @p base_url is longer than TALLY_CONSOLE_URL_MAX.
 */
bool tally_alert_set_console(const char *base_url) TALLY_WUR;

/**
 * @brief The console link of a page about run @p run_id: "<base>/runs/<run id>", the run id
 * percent-encoded as one path segment (tally_alert_url_segment), @p base without one trailing
 * slash. A page that names no run links to "<base>/queues" (what needs a human), and so does
 * one whose run id is "." or ".." (a browser reads such a segment as a step up the path,
 * percent-encoded or not, so no /runs/ link can reach that run).
 * @returns a malloc'd string; NULL when @p base is NULL or "" (no console), or out of memory.
 */
char *tally_alert_link(const char *base, const char *run_id) TALLY_WUR;

/** @brief tally_alert_link() with the base of tally_alert_set_console(): NULL when none is set
 * (or out of memory). Malloc'd. */
char *tally_alert_console_link(const char *run_id) TALLY_WUR;

/** @brief @p text as one URI path segment (RFC 3986 §2): the unreserved characters (ALPHA,
 * DIGIT, "-", ".", "_", "~") as they are, every other byte as %XX, upper-case hex (a UTF-8
 * character is one escape per byte). Malloc'd; NULL on OOM. */
char *tally_alert_url_segment(const char *text) TALLY_WUR;

/** @brief The dedup key of the page for a STUCK effect: "effect:<id>". Malloc'd; NULL on OOM. */
char *tally_alert_effect_key(const char *effect_id) TALLY_WUR;

/** @brief The dedup key of the page for a STUCK obligation: "obligation:<id>". Malloc'd. */
char *tally_alert_obligation_key(const char *obligation_id) TALLY_WUR;

/**
 * @brief The resolve command for a STUCK effect, two copy-pasteable lines (the operator picks
 * the one the upstream evidence supports):
 *   tally resolve --effect <id> --as confirmed --ref <REF> --reason "<what you verified>"
 *   tally resolve --effect <id> --as failed --reason "<what you verified>"
 * each followed by a shell comment saying when it applies. Malloc'd; NULL on OOM.
 */
char *tally_alert_effect_command(const char *effect_id) TALLY_WUR;

/** @brief The same for a STUCK obligation (`--as resolved` / `--as skipped`). Malloc'd. */
char *tally_alert_obligation_command(const char *obligation_id) TALLY_WUR;

/**
 * @brief The approve and deny commands of an item AWAITING_APPROVAL, two lines each with its
 * shell comment: an effect's (`--effect`: let it go ahead / refuse it) or, with @p obligation,
 * an obligation's (`--obligation`: reverse it now / nothing is to be undone). Malloc'd.
 */
char *tally_alert_approval_command(bool obligation, const char *id) TALLY_WUR;

/**
 * @brief The command that closes a page whose item needs no state change (a destructive
 * effect escalated as UNCOMPENSATABLE): `tally resolve --alert <key> --reason ...`. Malloc'd.
 */
char *tally_alert_close_command(const char *dedup_key) TALLY_WUR;

/**
 * @brief tally_alert_write_failures_total{worker} in @p m, its @p worker series at 0 from the
 * start: the pages PostgreSQL refused to write, which every worker counts alike (the
 * TallyPageRefused rule). NULL when out of memory, which tally_metric_add accepts.
 */
tally_metric_t *tally_alert_failures_counter(tally_metrics_t *m, const char *worker);

#endif
