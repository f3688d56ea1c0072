/* reconcile.c — the reconciler's loop (DESIGN §2): wake on tally.effect.unknown.v1 outcomes,
 * on a NOTIFY from PostgreSQL or on the sweep interval; turn expired dispatch leases into
 * UNKNOWN; lease the due UNKNOWN effects, ask each tool's status endpoint concurrently, and
 * record every verdict with a compare-and-set (store.c), deciding with policy.c.
 *
 * One thread waits on everything at once: curl's sockets, the PostgreSQL socket (LISTEN
 * tally_unknown) and the consumer's wake-up pipe (consume.h). Kafka messages are only
 * wake-ups: the offsets are stored after the claim round they triggered, and PostgreSQL
 * decides what is due. */
#include "reconciler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tally/alert.h"
#include "tally/backoff.h"
#include "tally/consume.h"
#include "tally/crashpoint.h"
#include "tally/json.h"
#include "tally/log.h"
#include "tally/metrics.h"
#include "tally/pacing.h"
#include "tally/text.h"

#define NOTIFY_CHANNEL    "tally_unknown"
#define LEASE_MARGIN_MS   1000
#define MAX_RECORD_TRIES  5
#define RECORD_BACKOFF_MS 200
/* the record backoff stops growing here: 3.2 s */
#define RECORD_BACKOFF_MAX_MS (RECORD_BACKOFF_MS << (MAX_RECORD_TRIES - 1))
#define DRAIN_POLL_MS         50
#define MAX_MESSAGES_TICK     1000
/* how often due audits are looked for when the last claim found none */
#define AUDIT_POLL_MS 1000
/* audits take at most this share of the checks in flight (the rest is UNKNOWN resolution's) */
#define AUDIT_INFLIGHT_SHARE 4

typedef struct reconciler {
    tally_worker_t *w;
    const tally_config_t *cfg;
    const tally_registry_t *reg;
    tally_recon_db_t db;
    char source[320];
    tally_connector_t *conn;
    /* wake-ups from the consumer; their offsets are stored once the claim round after them
     * is done (owned by the worker) */
    tally_consume_t *cs;
    /* checks finished (or decided without a call), waiting to be recorded */
    tally_recon_item_t **done;
    size_t n_done;
    size_t cap_done;
    size_t inflight;
    /* audit checks finished, waiting to be recorded, and how many are in flight */
    tally_recon_item_t **adone;
    size_t n_adone;
    size_t cap_adone;
    size_t audit_inflight;
    long long next_audit_ms;
    long long audit_retry_ms;
    bool audit_published; /* the registry's audit policies are in the database */
    tally_metric_t *m_audits;
    /* the orphan sweep this worker is making (one tool at a time), page by page */
    const tally_tool_t *sw_tool;
    char sw_since[40];
    char sw_started[40];
    char *sw_cursor;             /* the next page's cursor; NULL for the first */
    long long sw_latest_us;      /* the latest created_at listed, 0 for none */
    bool sw_undated;             /* a record listed without a created_at */
    bool sw_inflight;            /* a list call is out */
    tally_recon_item_t *sw_page; /* a page answered, to record */
    long long sw_next_ms;        /* not before this: the budget, a retry, or the next claim */
    size_t sw_next_tool;         /* where the next claim starts looking (round robin) */
    int sw_pages;
    int sw_failures; /* failed records of the page in hand */
    tally_sweep_counts_t sw_counts;
    tally_metric_t *m_sweeps;
    tally_metric_t *m_swept;
    bool want_claim; /* a wake-up arrived, or due work was left over */
    bool backlog;    /* the last claim filled its limit: more may be due */
    long long next_sweep_ms;
    long long next_due_ms;     /* the earliest reschedule recorded by this worker, 0 for none */
    long long record_retry_ms; /* after a failed record: not before this */
    unsigned int seed;
    tally_metric_t *m_unknown;
    tally_metric_t *m_oldest;
    tally_metric_t *m_stuck;
    tally_metric_t *m_stuck_oldest;
    tally_metric_t *m_resolutions;
    tally_metric_t *m_check_seconds;
    tally_metric_t *m_lease_expired;
    tally_metric_t *m_lost;
    tally_metric_t *m_inflight;
    tally_metric_t *m_tool_inflight; /* tally_status_checks_inflight{tool} */
    tally_metric_t *m_alert_fail;
    tally_metric_t *m_db_errors; /* tally_reconciler_db_errors_total{step} */
} reconciler_t;

/* The steps of tally_reconciler_db_errors_total, each a transaction or statement of store.c
 * or sweep.c that can fail; every series exists at 0 from the start. */
static const char *const db_steps[] = {"record", "claim",  "release",       "audit",
                                       "sweep",  "expire", "complete_runs", "gauges"};

/* A statement (or the transaction around it) failed; the caller logs why. */
static void db_error(reconciler_t *rc, const char *step)
{
    tally_metric_add(rc->m_db_errors, 1, step);
}

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- recording -------------------------------------------------------------------------- */

static bool push_item(tally_recon_item_t ***list, size_t *n, size_t *cap, tally_recon_item_t *it)
{
    if (*n == *cap) {
        size_t grow = *cap ? *cap * 2 : 64;
        tally_recon_item_t **grown = realloc(*list, grow * sizeof *grown);
        if (grown == NULL) {
            return false;
        }
        *list = grown;
        *cap = grow;
    }
    (*list)[(*n)++] = it;
    return true;
}

/* A finished check waits for its record round: an UNKNOWN's in done, an audit's in adone. */
static bool push_done(reconciler_t *rc, tally_recon_item_t *it)
{
    if (it->audit) {
        return push_item(&rc->adone, &rc->n_adone, &rc->cap_adone, it);
    }
    return push_item(&rc->done, &rc->n_done, &rc->cap_done, it);
}

static void decide(reconciler_t *rc, tally_recon_item_t *it)
{
    const tally_tool_t *tool = it->tool;
    tally_recon_input_t in = {
        .has_status = tool->status.path != NULL,
        .verdict = it->verdict.verdict,
        .effect_class = tool->effect_class,
        .attempts = it->attempts,
        .max_attempts = tool->max_attempts,
        .settled = it->settled,
        .inconclusive_checks = it->inconclusive_checks,
        .unknown_ms = it->unknown_ms + (long long)(it->seconds * 1000.0),
        .backoff_ms = tool->backoff_ms,
        .max_backoff_ms = tool->max_backoff_ms,
        .random = (uint32_t)rand_r(&rc->seed),
    };
    it->decision = tally_recon_decide(&in);
}

static void log_outcome(const tally_recon_item_t *it)
{
    tally_log_ctx_t ctx = {
        .run_id = it->run_id, .effect_id = it->effect_id, .tool = it->tool->name};
    switch (it->decision.action) {
    case TALLY_RECON_CONFIRM:
        TALLY_LOG(TALLY_LOG_INFO, &ctx, "UNKNOWN -> CONFIRMED: one upstream record carries key %s",
                  it->operation_key);
        break;
    case TALLY_RECON_DUPLICATE:
        TALLY_LOG(TALLY_LOG_WARN, &ctx,
                  "UNKNOWN -> CONFIRMED with a DUPLICATE: %zu upstream records carry key %s; "
                  "obligations opened for the extras",
                  json_array_size(it->records), it->operation_key);
        break;
    case TALLY_RECON_WAIT_SETTLE:
        TALLY_LOG(TALLY_LOG_DEBUG, &ctx,
                  "no upstream record yet for key %s; checking again when the %d ms settle "
                  "window has passed",
                  it->operation_key, it->tool->settle_ms);
        break;
    case TALLY_RECON_REDISPATCH:
        if (it->tool->status.path == NULL)
            TALLY_LOG(TALLY_LOG_INFO, &ctx,
                      "UNKNOWN -> PLANNED: tool '%s' has no status check and is %s, so key %s "
                      "is sent again (attempt %d of %d done)",
                      it->tool->name, tally_effect_class_name(it->tool->effect_class),
                      it->operation_key, it->attempts, it->tool->max_attempts);
        else
            TALLY_LOG(TALLY_LOG_INFO, &ctx,
                      "UNKNOWN -> PLANNED: nothing upstream carries key %s after the settle "
                      "window; re-dispatching with the same key (attempt %d of %d done)",
                      it->operation_key, it->attempts, it->tool->max_attempts);
        break;
    case TALLY_RECON_RETRY_CHECK:
        TALLY_LOG(TALLY_LOG_WARN, &ctx,
                  "status check inconclusive (%s: %s); checking again in %lld ms", it->verdict.code,
                  it->verdict.message, it->decision.delay_ms);
        break;
    case TALLY_RECON_STUCK:
        TALLY_LOG(TALLY_LOG_ERROR, &ctx, "UNKNOWN -> STUCK (%s): paging a human",
                  it->decision.stuck_reason);
        break;
    case TALLY_RECON_CANCEL:
        TALLY_LOG(TALLY_LOG_INFO, &ctx,
                  "UNKNOWN -> PLANNED -> CANCELLED: nothing upstream carries key %s after the "
                  "settle window and the run is no longer ACTIVE, so it is not sent again",
                  it->operation_key);
        break;
    }
}

/* Record every finished check in one transaction. On a failure the batch is kept for the next
 * tick (the leases still hold); a batch that fails for a reason other than a lost connection
 * is recorded one item at a time so one bad item cannot hold the others back. Verdicts are kept
 * through a database outage however long (retriable errors; the backoff stops growing at
 * RECORD_BACKOFF_MAX_MS): dropping one would only ask the tool again once its lease expired.
 * Other errors give up after MAX_RECORD_TRIES. */
static int record_round(reconciler_t *rc)
{
    if (rc->n_done == 0 || now_ms() < rc->record_retry_ms) {
        return 0;
    }
    for (size_t i = 0; i < rc->n_done; i++) {
        if (rc->done[i]->record_tries == 0) {
            decide(rc, rc->done[i]);
        }
    }
    tally_error_t err;
    tally_error_clear(&err);
    bool ok = tally_recon_record(&rc->db, rc->done, rc->n_done, &err);
    if (!ok) {
        db_error(rc, "record");
    }
    if (!ok && !err.retriable && rc->n_done > 1) {
        TALLY_WARN("recording %zu verdicts failed (%s: %s); recording them one by one", rc->n_done,
                   err.code, err.message);
        for (size_t i = 0; i < rc->n_done; i++) {
            tally_error_t one;
            tally_error_clear(&one);
            bool recorded = tally_recon_record(&rc->db, &rc->done[i], 1, &one);
            if (!recorded) {
                db_error(rc, "record");
            }
            if (!recorded && !one.retriable && rc->done[i]->decision.action == TALLY_RECON_STUCK) {
                /* A STUCK effect must page: its page was refused, so raise it minimal. */
                tally_metric_add(rc->m_alert_fail, 1, "reconciler");
                TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                                    "recording STUCK effect %s and its page was refused (%s: "
                                    "%s); retrying with a minimal page",
                                    rc->done[i]->effect_id, one.code, one.message);
                rc->db.minimal_pages = true;
                tally_error_clear(&one);
                recorded = tally_recon_record(&rc->db, &rc->done[i], 1, &one);
                rc->db.minimal_pages = false;
                if (!recorded) {
                    db_error(rc, "record");
                }
            }
            if (!recorded) {
                tally_log_ctx_t ctx = {.effect_id = rc->done[i]->effect_id,
                                       .tool = rc->done[i]->tool->name};
                TALLY_LOG(TALLY_LOG_ERROR, &ctx,
                          "cannot record the status check verdict (%s: %s); the lease will "
                          "expire and the effect will be checked again",
                          one.code, one.message);
                rc->done[i]->record_tries = MAX_RECORD_TRIES;
            }
        }
        ok = true;
    } else if (!ok) {
        int tries = rc->done[0]->record_tries + 1;
        long long wait = tally_backoff_step_ms(tries, RECORD_BACKOFF_MS, RECORD_BACKOFF_MAX_MS);
        rc->record_retry_ms = now_ms() + wait;
        if (err.retriable)
            TALLY_LOG_REPEATING(
                TALLY_LOG_ERROR, NULL,
                "recording %zu verdicts failed (%s: %s); retrying in %lld ms (their "
                "leases keep them safe meanwhile)",
                rc->n_done, err.code, err.message, wait);
        else
            TALLY_ERROR("recording %zu verdicts failed (%s: %s); %s", rc->n_done, err.code,
                        err.message,
                        tries < MAX_RECORD_TRIES
                            ? "retrying shortly"
                            : "giving up: their leases expire and the effects are checked again");
    }
    size_t kept = 0;
    int recorded = 0;
    long long now = now_ms();
    for (size_t i = 0; i < rc->n_done; i++) {
        tally_recon_item_t *it = rc->done[i];
        if (!ok) {
            if (err.retriable) {
                /* kept; the count stops below MAX_RECORD_TRIES, which marks a verdict given up */
                if (it->record_tries < MAX_RECORD_TRIES - 1)
                    it->record_tries++;
                rc->done[kept++] = it;
                continue;
            }
            if (++it->record_tries < MAX_RECORD_TRIES) {
                rc->done[kept++] = it;
                continue;
            }
        } else if (it->won) {
            recorded++;
            log_outcome(it);
            tally_metric_add(rc->m_resolutions, 1, tally_recon_action_name(it->decision.action));
            bool again = it->decision.action == TALLY_RECON_WAIT_SETTLE ||
                         it->decision.action == TALLY_RECON_RETRY_CHECK;
            long long due = now + it->next_in_ms;
            if (again && (rc->next_due_ms == 0 || due < rc->next_due_ms)) {
                rc->next_due_ms = due;
            }
        } else if (it->record_tries < MAX_RECORD_TRIES) {
            tally_log_ctx_t ctx = {
                .run_id = it->run_id, .effect_id = it->effect_id, .tool = it->tool->name};
            TALLY_LOG(TALLY_LOG_WARN, &ctx,
                      "lease lost before the verdict was recorded (epoch %lld is no longer "
                      "current, or the effect left UNKNOWN); writing nothing",
                      it->epoch);
            tally_metric_add(rc->m_lost, 1);
        }
        tally_recon_item_free(it);
    }
    rc->n_done = kept;
    return recorded;
}

/* ---- status checks ---------------------------------------------------------------------- */

static void inconclusive(tally_recon_item_t *it, const char *code, const char *message)
{
    memset(&it->verdict, 0, sizeof it->verdict);
    it->verdict.verdict = TALLY_VERDICT_INCONCLUSIVE;
    it->verdict.retry_after_ms = -1;
    snprintf(it->verdict.code, sizeof it->verdict.code, "%s", code);
    snprintf(it->verdict.message, sizeof it->verdict.message, "%s", message);
    json_decref(it->records);
    it->records = NULL;
}

/* A sensitive tool's status answer, before anything keeps it: the record that becomes the
 * receipt sealed whole, every record redacted and scrubbed, the message scrubbed (a parse error
 * quotes the body). */
static bool redact_answer(tally_recon_item_t *it)
{
    char *msg = tally_redactor_scrub(it->red, it->verdict.message, strlen(it->verdict.message));
    if (msg == NULL)
        return false;
    tally_text_copy(it->verdict.message, sizeof it->verdict.message, msg);
    free(msg);
    if (it->records == NULL)
        return true;
    char *kept =
        json_dumps(json_array_get(it->records, tally_recon_earliest(it->records)), JSON_COMPACT);
    if (kept == NULL)
        return false;
    char aad[64];
    snprintf(aad, sizeof aad, "%s/receipt", it->effect_id);
    it->receipt_sealed = tally_seal(&it->red->key, aad, kept, strlen(kept));
    free(kept);
    bool ok = it->receipt_sealed != NULL;
    for (size_t i = 0; ok && i < json_array_size(it->records); i++) {
        json_t *rec = json_array_get(it->records, i);
        ok = tally_redactor_apply(it->red, rec, it->tool->sensitive_receipt,
                                  it->tool->n_sensitive_receipt) >= 0 &&
             tally_redactor_scrub_json(it->red, rec);
    }
    return ok;
}

/* ---- the orphan sweep ------------------------------------------------------------------ */

/* A list page came back: keep what it says for the next tick to record. */
static void sweep_page_answered(reconciler_t *rc, tally_recon_item_t *it,
                                const tally_conn_result_t *res)
{
    rc->sw_inflight = false;
    it->checked = true;
    it->http_status = res->http_status;
    it->seconds = res->seconds;
    char why[300];
    if (res->http_status != 200) {
        tally_conn_verdict_t v;
        tally_conn_classify_status(res, &v);
        tally_fmt(why, sizeof why, "the list call answered %ld (%s: %s)", res->http_status, v.code,
                  v.message);
        inconclusive(it, "list_failed", why);
    } else if (res->body == NULL) {
        inconclusive(it, "bad_list", "the list call answered 200 with no body");
    } else if (!tally_sweep_page(res->body, res->body_len, &it->records, &it->next_cursor, why,
                                 sizeof why)) {
        inconclusive(it, "bad_list", why);
    }
    tally_recon_item_free(rc->sw_page); /* none: one page is out at a time */
    rc->sw_page = it;
}

static void on_check_done(const tally_conn_result_t *res, void *opaque)
{
    reconciler_t *rc = opaque;
    tally_recon_item_t *it = res->opaque;
    TALLY_CRASHPOINT("reconcile.after_status_answer");
    rc->inflight--;
    if (it->list) {
        sweep_page_answered(rc, it, res);
        return;
    }
    if (it->audit) {
        rc->audit_inflight--;
    }
    it->checked = true;
    it->http_status = res->http_status;
    it->seconds = res->seconds;
    tally_metric_observe(rc->m_check_seconds, res->seconds, it->tool->name);
    tally_conn_classify_status(res, &it->verdict);
    if (it->verdict.verdict == TALLY_VERDICT_FOUND ||
        it->verdict.verdict == TALLY_VERDICT_DUPLICATE) {
        json_error_t jerr;
        it->records = json_loadb(res->body, res->body_len, TALLY_JSON_LOAD_FLAGS, &jerr);
        char why[200];
        if (it->records == NULL) {
            char msg[256]; /* jansson's text can end inside a character: cut it whole */
            tally_fmt(msg, sizeof msg, "the status answer could not be parsed: %s", jerr.text);
            inconclusive(it, "unparseable", msg);
        } else if (!tally_recon_records_usable(it->records, why, sizeof why)) {
            inconclusive(it, "bad_record", why);
        }
    }
    if (it->red != NULL && !redact_answer(it))
        inconclusive(it, "oom", "out of memory redacting the status answer");
    if (!push_done(rc, it)) {
        TALLY_ERROR("out of memory keeping a status check verdict; the lease on %s will expire",
                    it->effect_id);
        tally_recon_item_free(it);
    }
}

/* Lease due UNKNOWN effects of the tools with room, and start their status checks. */
static int claim_round(reconciler_t *rc, tally_error_t *err)
{
    long long room = (long long)rc->cfg->max_inflight - (long long)rc->inflight;
    if (room > rc->cfg->batch_size) {
        room = rc->cfg->batch_size;
    }
    if (room <= 0) {
        return 0;
    }
    json_t *tools = json_array();
    if (tools == NULL) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "out of memory listing the tools");
        return -1;
    }
    for (size_t i = 0; i < tally_registry_count(rc->reg); i++) {
        const tally_tool_t *t = tally_registry_at(rc->reg, i);
        if (t->status.path != NULL && tally_connector_capacity(rc->conn, t) <= 0) {
            continue;
        }
        /* the lease outlives the call and the time to record it, so no other reconciler can
         * ask about this effect while we are */
        long long lease = (long long)t->timeout_ms * 2 + LEASE_MARGIN_MS;
        if (lease < rc->cfg->lease_ms) {
            lease = rc->cfg->lease_ms;
        }
        json_array_append_new(tools, json_pack("{s:s, s:I, s:i}", "tool", t->name, "lease_ms",
                                               (json_int_t)lease, "settle_ms", t->settle_ms));
    }
    char *tools_json = json_dumps(tools, JSON_COMPACT);
    json_decref(tools);
    tally_recon_item_t **items = calloc((size_t)room, sizeof *items);
    if (tools_json == NULL || items == NULL) {
        free(tools_json);
        free(items);
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "out of memory preparing a claim");
        return -1;
    }
    int n = tally_recon_claim(&rc->db, tools_json, (int)room, items, err);
    free(tools_json);
    if (n < 0) {
        db_error(rc, "claim");
        free(items);
        return -1;
    }
    rc->backlog = n == room;
    tally_recon_item_t **release = calloc((size_t)n + 1, sizeof *release);
    size_t n_release = 0;
    for (int i = 0; i < n; i++) {
        tally_recon_item_t *it = items[i];
        TALLY_CRASHPOINT("reconcile.after_lease_commit");
        if (it->sealed_err.errc != TALLY_ERR_NONE) {
            /* its tenant key does not open: nothing can be asked in its name; the checks stay
             * inconclusive and page once they have lasted too long */
            it->checked = false;
            inconclusive(it, it->sealed_err.code, it->sealed_err.message);
            if (!push_done(rc, it)) {
                tally_recon_item_free(it);
            }
            continue;
        }
        if (it->tool->status.path == NULL) {
            /* nothing to ask: the decision needs no call */
            it->verdict.verdict = TALLY_VERDICT_INCONCLUSIVE;
            snprintf(it->verdict.code, sizeof it->verdict.code, "no_status_endpoint");
            if (!push_done(rc, it)) {
                tally_recon_item_free(it);
            }
            continue;
        }
        tally_conn_request_t req = {
            .tool = it->tool,
            .op = TALLY_CONN_STATUS,
            .idempotency_key = it->operation_key,
            .run_id = it->run_id,
            .effect_id = it->effect_id,
            .traceparent = it->traceparent,
            .opaque = it,
        };
        tally_error_t serr;
        tally_error_clear(&serr);
        if (tally_connector_submit(rc->conn, &req, &serr)) {
            rc->inflight++;
            continue;
        }
        if (serr.errc == TALLY_ERR_CAPACITY && release != NULL) {
            release[n_release++] = it;
            continue;
        }
        /* the call could not be made (a missing secret, a bad header value): that is an
         * inconclusive check like any other, and pages once it has lasted too long */
        it->checked = true;
        inconclusive(it, serr.code, serr.message);
        if (!push_done(rc, it)) {
            tally_recon_item_free(it);
        }
    }
    if (n_release > 0) {
        tally_error_t rerr;
        tally_error_clear(&rerr);
        if (tally_recon_release(&rc->db, release, n_release, &rerr) < 0) {
            db_error(rc, "release");
            TALLY_WARN("cannot release %zu leases taken beyond a tool's concurrency (%s); they "
                       "expire on their own",
                       n_release, rerr.message);
        }
        for (size_t i = 0; i < n_release; i++) {
            tally_recon_item_free(release[i]);
        }
    }
    free(release);
    free(items);
    tally_metric_set(rc->m_inflight, (double)rc->inflight);
    tally_connector_publish_inflight(rc->conn, rc->m_tool_inflight);
    return n - (int)n_release;
}

/* ---- audits of CONFIRMED effects -------------------------------------------------------- */

static void audit_decide(reconciler_t *rc, tally_recon_item_t *it)
{
    const tally_tool_t *tool = it->tool;
    bool matches = true;
    if (it->verdict.verdict == TALLY_VERDICT_FOUND && it->external_ref != NULL) {
        char *ref = tally_conn_external_ref(tool, json_array_get(it->records, 0));
        matches = ref != NULL && strcmp(ref, it->external_ref) == 0;
        free(ref);
    }
    tally_audit_input_t in = {
        .verdict = it->verdict.verdict,
        .kept_matches = matches,
        .passes = it->audit_passes,
        .again_ms = tool->audit.again_ms,
        .failures = it->audit_failures,
        .max_attempts = tool->max_attempts,
        .backoff_ms = tool->backoff_ms,
        .max_backoff_ms = tool->max_backoff_ms,
        .random = (uint32_t)rand_r(&rc->seed),
    };
    it->audit_decision = tally_audit_decide(&in);
}

static void log_audit(const tally_recon_item_t *it)
{
    tally_log_ctx_t ctx = {
        .run_id = it->run_id, .effect_id = it->effect_id, .tool = it->tool->name};
    switch (it->audit_decision.result) {
    case TALLY_AUDIT_CLEAN:
        TALLY_LOG(TALLY_LOG_DEBUG, &ctx, "audit: one upstream record carries key %s, as recorded",
                  it->operation_key);
        break;
    case TALLY_AUDIT_DUPLICATE:
        TALLY_LOG(TALLY_LOG_WARN, &ctx,
                  "audit found a DUPLICATE: %zu upstream records carry key %s of a CONFIRMED "
                  "effect; obligations opened for the extras, the receipt kept",
                  json_array_size(it->records), it->operation_key);
        break;
    case TALLY_AUDIT_MISSING:
    case TALLY_AUDIT_MISMATCH:
        TALLY_LOG(TALLY_LOG_WARN, &ctx,
                  "audit: the tool's records for key %s do not match the ledger (%s); finding "
                  "filed and paged",
                  it->operation_key, tally_audit_result_name(it->audit_decision.result));
        break;
    case TALLY_AUDIT_RETRY:
        TALLY_LOG(TALLY_LOG_DEBUG, &ctx,
                  "audit check inconclusive (%s: %s); asking again in %lld ms", it->verdict.code,
                  it->verdict.message, it->audit_decision.next_in_ms);
        break;
    case TALLY_AUDIT_GIVE_UP:
        TALLY_LOG(TALLY_LOG_WARN, &ctx,
                  "audit dropped after %d inconclusive checks in a row (%s: %s); `tally verify "
                  "--tools --run %s` asks again",
                  it->audit_failures + 1, it->verdict.code, it->verdict.message, it->run_id);
        break;
    }
}

/* Record the finished audits in one transaction; on failure they wait (their leases hold) and
 * are given up after MAX_RECORD_TRIES: the lease expires and the audit is made again. */
static int audit_record_round(reconciler_t *rc)
{
    if (rc->n_adone == 0 || now_ms() < rc->audit_retry_ms) {
        return 0;
    }
    for (size_t i = 0; i < rc->n_adone; i++) {
        if (rc->adone[i]->record_tries == 0) {
            audit_decide(rc, rc->adone[i]);
        }
    }
    tally_error_t err;
    tally_error_clear(&err);
    bool ok = tally_audit_record(&rc->db, rc->adone, rc->n_adone, &err);
    size_t kept = 0;
    int recorded = 0;
    if (!ok) {
        db_error(rc, "audit");
        int tries = rc->adone[0]->record_tries + 1;
        long long wait = tally_backoff_step_ms(tries, RECORD_BACKOFF_MS, RECORD_BACKOFF_MAX_MS);
        rc->audit_retry_ms = now_ms() + wait;
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL, "recording %zu audits failed (%s: %s); %s",
                            rc->n_adone, err.code, err.message,
                            err.retriable || tries < MAX_RECORD_TRIES
                                ? "retrying shortly"
                                : "giving up: their leases expire and they are made again");
    }
    for (size_t i = 0; i < rc->n_adone; i++) {
        tally_recon_item_t *it = rc->adone[i];
        if (!ok && (err.retriable || ++it->record_tries < MAX_RECORD_TRIES)) {
            rc->adone[kept++] = it;
            continue;
        }
        if (ok && it->won) {
            recorded++;
            log_audit(it);
            tally_metric_add(rc->m_audits, 1, it->tool->name,
                             tally_audit_result_name(it->audit_decision.result));
        } else if (ok) {
            tally_metric_add(rc->m_lost, 1);
        }
        tally_recon_item_free(it);
    }
    rc->n_adone = kept;
    return recorded;
}

/* Lease due audits of the tools with room and budget, and start their status checks. Only
 * when UNKNOWN resolution has nothing more to claim, and within AUDIT_INFLIGHT_SHARE. */
static int audit_round(reconciler_t *rc, tally_error_t *err)
{
    long long cap = rc->cfg->max_inflight / AUDIT_INFLIGHT_SHARE;
    if (cap < 1) {
        cap = 1;
    }
    /* every way out below looks again after a poll at the latest: a round that returned
     * without moving this would be due again at once, and the tick would spin */
    rc->next_audit_ms = now_ms() + AUDIT_POLL_MS;
    long long room = cap - (long long)rc->audit_inflight;
    long long free_slots = (long long)rc->cfg->max_inflight - (long long)rc->inflight;
    if (room > free_slots) {
        room = free_slots;
    }
    if (room > rc->cfg->batch_size) {
        room = rc->cfg->batch_size;
    }
    if (room <= 0) {
        return 0;
    }
    json_t *tools = json_array();
    if (tools == NULL) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "out of memory listing the tools");
        return -1;
    }
    for (size_t i = 0; i < tally_registry_count(rc->reg); i++) {
        const tally_tool_t *t = tally_registry_at(rc->reg, i);
        int capacity = tally_connector_capacity(rc->conn, t);
        if (!t->audit.enabled || t->status.path == NULL || capacity <= 0) {
            continue;
        }
        int n = tally_pace_burst(t->audit.rate_per_s);
        if (n > capacity) {
            n = capacity;
        }
        /* as an UNKNOWN's check: the lease outlives the call and its recording, through an
         * outage as long as TALLY_LEASE_MS */
        long long lease = (long long)t->timeout_ms * 2 + LEASE_MARGIN_MS;
        if (lease < rc->cfg->lease_ms) {
            lease = rc->cfg->lease_ms;
        }
        json_array_append_new(tools, json_pack("{s:s, s:i, s:I, s:f}", "tool", t->name, "n", n,
                                               "lease_ms", (json_int_t)lease, "slot_ms",
                                               1000.0 / t->audit.rate_per_s));
    }
    if (json_array_size(tools) == 0) {
        json_decref(tools);
        return 0;
    }
    char *tools_json = json_dumps(tools, JSON_COMPACT);
    json_decref(tools);
    tally_recon_item_t **items = calloc((size_t)room, sizeof *items);
    if (tools_json == NULL || items == NULL) {
        free(tools_json);
        free(items);
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "out of memory preparing audits");
        return -1;
    }
    int n = tally_audit_claim(&rc->db, tools_json, (int)room, items, err);
    free(tools_json);
    if (n < 0) {
        db_error(rc, "audit");
        free(items);
        return -1;
    }
    /* a full claim may leave more due: look again at once (the budget still paces) */
    if (n == room) {
        rc->next_audit_ms = 0;
    }
    for (int i = 0; i < n; i++) {
        tally_recon_item_t *it = items[i];
        tally_error_t serr;
        tally_error_clear(&serr);
        if (it->sealed_err.errc != TALLY_ERR_NONE) {
            serr = it->sealed_err;
        } else {
            tally_conn_request_t req = {
                .tool = it->tool,
                .op = TALLY_CONN_STATUS,
                .idempotency_key = it->operation_key,
                .run_id = it->run_id,
                .effect_id = it->effect_id,
                .traceparent = it->traceparent,
                .opaque = it,
            };
            if (tally_connector_submit(rc->conn, &req, &serr)) {
                rc->inflight++;
                rc->audit_inflight++;
                continue;
            }
        }
        /* not asked (no room after all, a missing secret, a key that does not open): an
         * inconclusive check, asked again after the backoff */
        inconclusive(it, serr.code, serr.message);
        if (!push_done(rc, it)) {
            tally_recon_item_free(it);
        }
    }
    free(items);
    return n;
}

/* The registry's audit policies go into the database once per start (retried until then). */
static void publish_audit_policies(reconciler_t *rc)
{
    if (rc->audit_published) {
        return;
    }
    tally_error_t err;
    tally_error_clear(&err);
    if (tally_audit_publish(&rc->db, &err)) {
        rc->audit_published = true;
    } else {
        db_error(rc, "audit");
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                            "publishing the tools' audit policies failed (%s: %s); retrying at "
                            "the next sweep",
                            err.code, err.message);
    }
}

/* ---- the orphan sweep, driven ------------------------------------------------------------ */

/* How often a worker without a sweep looks for a tool whose period has come. */
#define SWEEP_CLAIM_MS 5000
/* The cursor moves to the latest record listed, less this (a record the tool was still
 * writing, or a clock a little behind, is listed again rather than missed). */
#define SWEEP_OVERLAP_US (60LL * 1000000)

static void format_us(long long us, char out[40])
{
    time_t secs = (time_t)(us / 1000000);
    struct tm tm;
    gmtime_r(&secs, &tm);
    size_t n = strftime(out, 40, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out + n, 40 - n, ".%06dZ", (int)(us % 1000000));
}

static void sweep_end(reconciler_t *rc, const char *error)
{
    const tally_tool_t *tool = rc->sw_tool;
    char since[40];
    const char *new_since = NULL;
    long long started = 0;
    (void)tally_recon_parse_time(rc->sw_started, &started);
    if (error == NULL && (rc->sw_latest_us > 0 || rc->sw_undated)) {
        long long upto = rc->sw_latest_us > 0 && rc->sw_latest_us < started && !rc->sw_undated
                             ? rc->sw_latest_us
                             : started;
        format_us(upto - SWEEP_OVERLAP_US, since);
        new_since = since;
    }
    tally_error_t err;
    tally_error_clear(&err);
    if (!tally_sweep_finish(&rc->db, tool, new_since, error, &err)) {
        db_error(rc, "sweep");
        TALLY_LOG_REPEATING(TALLY_LOG_WARN, NULL,
                            "could not move the orphan sweep cursor of '%s' (%s); the next sweep "
                            "lists those records again",
                            tool->name, err.message);
    }
    tally_log_ctx_t ctx = {.tool = tool->name};
    if (error != NULL) {
        TALLY_LOG(TALLY_LOG_WARN, &ctx,
                  "orphan sweep of '%s' stopped after %d page%s: %s; the next period sweeps "
                  "from the same cursor",
                  tool->name, rc->sw_pages, rc->sw_pages == 1 ? "" : "s", error);
    } else {
        TALLY_LOG(rc->sw_counts.obligations + rc->sw_counts.findings > 0 ? TALLY_LOG_WARN
                                                                         : TALLY_LOG_DEBUG,
                  &ctx,
                  "orphan sweep of '%s' since %s: %d page%s, %d recorded, %d unsettled, %d not "
                  "tally's; %d obligation%s filed, %d finding%s paged",
                  tool->name, rc->sw_since, rc->sw_pages, rc->sw_pages == 1 ? "" : "s",
                  rc->sw_counts.recorded, rc->sw_counts.unsettled, rc->sw_counts.foreign,
                  rc->sw_counts.obligations, rc->sw_counts.obligations == 1 ? "" : "s",
                  rc->sw_counts.findings, rc->sw_counts.findings == 1 ? "" : "s");
    }
    tally_metric_add(rc->m_sweeps, 1, tool->name, error == NULL ? "done" : "failed");
    free(rc->sw_cursor);
    rc->sw_cursor = NULL;
    rc->sw_tool = NULL;
}

/* Record the page in hand; on to the next page or the end of the sweep. */
static int sweep_record(reconciler_t *rc)
{
    tally_recon_item_t *page = rc->sw_page;
    if (page->verdict.verdict == TALLY_VERDICT_INCONCLUSIVE) {
        rc->sw_page = NULL;
        sweep_end(rc, page->verdict.message);
        tally_recon_item_free(page);
        return 0;
    }
    for (size_t i = 0; i < json_array_size(page->records); i++) {
        long long us;
        const char *at =
            json_string_value(json_object_get(json_array_get(page->records, i), "created_at"));
        if (at != NULL && tally_recon_parse_time(at, &us)) {
            if (us > rc->sw_latest_us)
                rc->sw_latest_us = us;
        } else {
            rc->sw_undated = true;
        }
    }
    tally_sweep_counts_t before = rc->sw_counts;
    tally_error_t err;
    tally_error_clear(&err);
    if (!tally_sweep_record_page(&rc->db, rc->sw_tool, page->records, &rc->sw_counts, &err)) {
        db_error(rc, "sweep");
        rc->sw_counts = before;
        if (!err.retriable && ++rc->sw_failures >= MAX_RECORD_TRIES) {
            rc->sw_page = NULL;
            sweep_end(rc, err.message);
            tally_recon_item_free(page);
            return 0;
        }
        rc->sw_next_ms = now_ms() + tally_backoff_step_ms(rc->sw_failures + 1, RECORD_BACKOFF_MS,
                                                          RECORD_BACKOFF_MAX_MS);
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                            "recording a page of the orphan sweep of '%s' failed (%s: %s); "
                            "retrying",
                            rc->sw_tool->name, err.code, err.message);
        return 0;
    }
    rc->sw_failures = 0;
    rc->sw_pages++;
    int n = (int)json_array_size(page->records);
    tally_metric_add(rc->m_swept, n, rc->sw_tool->name);
    rc->sw_page = NULL;
    free(rc->sw_cursor);
    rc->sw_cursor = page->next_cursor;
    page->next_cursor = NULL;
    tally_recon_item_free(page);
    if (rc->sw_cursor == NULL) {
        sweep_end(rc, NULL);
    }
    return n;
}

/* Find a tool whose sweep is due and take it (one claim statement per tool looked at). */
static void sweep_claim(reconciler_t *rc)
{
    size_t n = tally_registry_count(rc->reg);
    for (size_t k = 0; k < n; k++) {
        const tally_tool_t *t = tally_registry_at(rc->reg, (rc->sw_next_tool + k) % n);
        if (t->list.path == NULL || t->audit.sweep_ms <= 0) {
            continue;
        }
        tally_error_t err;
        tally_error_clear(&err);
        char since[40], started[40];
        if (tally_sweep_claim(&rc->db, t, since, started, &err)) {
            rc->sw_next_tool = (rc->sw_next_tool + k + 1) % n;
            rc->sw_tool = t;
            memcpy(rc->sw_since, since, sizeof since);
            memcpy(rc->sw_started, started, sizeof started);
            rc->sw_latest_us = 0;
            rc->sw_undated = false;
            rc->sw_pages = 0;
            rc->sw_failures = 0;
            memset(&rc->sw_counts, 0, sizeof rc->sw_counts);
            return;
        }
        if (err.errc != TALLY_ERR_NONE) {
            db_error(rc, "sweep");
            TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                                "taking the orphan sweep of '%s' failed (%s: %s)", t->name,
                                err.code, err.message);
            break;
        }
    }
    rc->sw_next_ms = now_ms() + SWEEP_CLAIM_MS;
}

/* Ask for the next page, once the tool's budget has a slot. */
static void sweep_ask(reconciler_t *rc)
{
    const tally_tool_t *t = rc->sw_tool;
    tally_error_t err;
    tally_error_clear(&err);
    long long wait = 0;
    int got = tally_pace_take(rc->db.pg, t->name, t->audit.rate_per_s, 1, &wait, &err);
    if (got < 0) {
        rc->sw_next_ms = now_ms() + AUDIT_POLL_MS;
        return;
    }
    if (got == 0) {
        rc->sw_next_ms = now_ms() + (wait > 0 ? wait : 1);
        return;
    }
    char *since = curl_easy_escape(NULL, rc->sw_since, 0);
    char *cursor = rc->sw_cursor ? curl_easy_escape(NULL, rc->sw_cursor, 0) : NULL;
    char query[2200];
    snprintf(query, sizeof query, "since=%s&limit=%d%s%s", since ? since : "", TALLY_SWEEP_PAGE,
             cursor ? "&cursor=" : "", cursor ? cursor : "");
    curl_free(since);
    curl_free(cursor);
    tally_recon_item_t *it = calloc(1, sizeof *it);
    if (it == NULL) {
        rc->sw_next_ms = now_ms() + AUDIT_POLL_MS;
        return;
    }
    it->list = true;
    it->tool = t;
    tally_conn_request_t req = {.tool = t, .op = TALLY_CONN_LIST, .query = query, .opaque = it};
    if (tally_connector_submit(rc->conn, &req, &err)) {
        rc->inflight++;
        rc->sw_inflight = true;
        return;
    }
    tally_recon_item_free(it);
    if (err.errc == TALLY_ERR_CAPACITY) {
        rc->sw_next_ms = now_ms() + AUDIT_POLL_MS; /* the tool is busy: the slot is spent */
        return;
    }
    sweep_end(rc, err.message);
}

static int sweep_round(reconciler_t *rc, bool stopping)
{
    int work = 0;
    if (rc->sw_page != NULL && now_ms() >= rc->sw_next_ms) {
        work += sweep_record(rc);
    }
    if (stopping || rc->sw_inflight || rc->sw_page != NULL || now_ms() < rc->sw_next_ms) {
        return work;
    }
    if (rc->sw_tool == NULL) {
        sweep_claim(rc);
    }
    if (rc->sw_tool != NULL) {
        sweep_ask(rc);
    }
    return work;
}

/* ---- sweeping --------------------------------------------------------------------------- */

static void sweep(reconciler_t *rc)
{
    publish_audit_policies(rc);
    tally_error_t err;
    tally_error_clear(&err);
    int expired = tally_recon_expire_leases(&rc->db, rc->cfg->batch_size, &err);
    if (expired < 0) {
        db_error(rc, "expire");
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL, "expiring dispatch leases failed (%s: %s)",
                            err.code, err.message);
    } else if (expired > 0) {
        tally_metric_add(rc->m_lease_expired, expired);
        if (expired == rc->cfg->batch_size) {
            rc->next_sweep_ms = 0; /* more may have expired: sweep again at once */
        }
    }
    tally_error_clear(&err);
    int completed =
        tally_recon_complete_runs(&rc->db, rc->cfg->batch_size, rc->cfg->run_idle_timeout_ms, &err);
    if (completed < 0) {
        db_error(rc, "complete_runs");
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL, "completing runs failed (%s: %s)", err.code,
                            err.message);
    } else if (completed > 0) {
        TALLY_INFO("%d run%s completed", completed, completed == 1 ? "" : "s");
        if (completed == rc->cfg->batch_size) {
            rc->next_sweep_ms = 0;
        }
    }
    long long unknown = 0;
    long long stuck = 0;
    double oldest = 0;
    double stuck_oldest = 0;
    tally_error_clear(&err);
    if (tally_recon_gauges(&rc->db, &unknown, &oldest, &stuck, &stuck_oldest, &err)) {
        tally_metric_set(rc->m_unknown, (double)unknown);
        tally_metric_set(rc->m_oldest, oldest);
        tally_metric_set(rc->m_stuck, (double)stuck);
        tally_metric_set(rc->m_stuck_oldest, stuck_oldest);
    } else {
        db_error(rc, "gauges");
        TALLY_LOG_REPEATING(TALLY_LOG_WARN, NULL,
                            "reading the UNKNOWN and STUCK gauges failed (%s: %s)", err.code,
                            err.message);
    }
}

/* ---- waiting ---------------------------------------------------------------------------- */

/* Read the notifications libpq has buffered (or that wait on the socket). */
static void drain_notifies(reconciler_t *rc)
{
    PGconn *conn = tally_pg_conn(rc->db.pg);
    if (conn == NULL || !PQconsumeInput(conn)) {
        return;
    }
    PGnotify *nf;
    while ((nf = PQnotifies(conn)) != NULL) {
        if (strcmp(nf->relname, NOTIFY_CHANNEL) == 0) {
            rc->want_claim = true;
        }
        PQfreemem(nf);
    }
}

/* A tally.effect.unknown.v1 outcome asks for a claim round. */
static void on_wakeup(void *opaque, const rd_kafka_message_t *msg)
{
    reconciler_t *rc = opaque;
    json_t *ev = json_loadb(msg->payload, msg->len, 0, NULL);
    const char *type = json_string_value(json_object_get(ev, "type"));
    if (type != NULL && strcmp(type, "tally.effect.unknown.v1") == 0) {
        rc->want_claim = true;
    }
    json_decref(ev);
}

/* Take what the consumer has; every offset is stored after the next claim round. */
static void consume(reconciler_t *rc)
{
    if (tally_consume_wakeups(rc->cs, MAX_MESSAGES_TICK, on_wakeup, rc) == MAX_MESSAGES_TICK) {
        rc->want_claim = true; /* more are queued: come back at once */
    }
}

/* Wait up to @p timeout_ms for a status answer, a NOTIFY or a Kafka message, and collect
 * every finished check. With @p intake false (draining) messages are dropped unread and
 * unacknowledged, for whoever owns the partition next. */
static int wait_for_events(reconciler_t *rc, int timeout_ms, bool intake)
{
    struct curl_waitfd extra[2];
    unsigned n_extra = 0;
    PGconn *conn = tally_pg_conn(rc->db.pg);
    if (conn != NULL && PQsocket(conn) >= 0) {
        extra[n_extra++] = (struct curl_waitfd){PQsocket(conn), CURL_WAIT_POLLIN, 0};
    }
    extra[n_extra++] = (struct curl_waitfd){tally_consume_fd(rc->cs), CURL_WAIT_POLLIN, 0};
    tally_error_t err;
    tally_error_clear(&err);
    int n = tally_connector_poll(rc->conn, extra, n_extra, timeout_ms, on_check_done, rc, &err);
    if (n < 0) {
        TALLY_ERROR("waiting for status checks: %s", err.message);
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
        n = 0;
    }
    drain_notifies(rc);
    if (intake) {
        consume(rc);
    } else {
        tally_consume_serve(rc->cs);
    }
    tally_metric_set(rc->m_inflight, (double)rc->inflight);
    tally_connector_publish_inflight(rc->conn, rc->m_tool_inflight);
    return n;
}

/* ---- the worker ops --------------------------------------------------------------------- */

static void reconciler_free(reconciler_t *rc)
{
    if (rc == NULL) {
        return;
    }
    for (size_t i = 0; i < rc->n_done; i++) {
        tally_recon_item_free(rc->done[i]);
    }
    free(rc->done);
    for (size_t i = 0; i < rc->n_adone; i++) {
        tally_recon_item_free(rc->adone[i]);
    }
    free(rc->adone);
    tally_recon_item_free(rc->sw_page);
    free(rc->sw_cursor);
    free(rc);
}

static bool reconciler_init(tally_worker_t *w, void **state)
{
    reconciler_t *rc = calloc(1, sizeof *rc);
    if (rc == NULL) {
        TALLY_ERROR("out of memory");
        return false;
    }
    rc->w = w;
    rc->cfg = tally_worker_config(w);
    rc->reg = tally_worker_registry(w);
    snprintf(rc->source, sizeof rc->source, "/tally/reconciler/%s", tally_worker_id(w));
    rc->db = (tally_recon_db_t){
        .pg = tally_worker_pg(w),
        .reg = rc->reg,
        .keys = tally_worker_keyring(w),
        .actor = tally_worker_id(w),
        .source = rc->source,
    };
    rc->seed = (unsigned int)(getpid() ^ now_ms());
    rc->want_claim = true;

    tally_metrics_t *m = tally_worker_metrics(w);
    rc->m_unknown = tally_metrics_gauge(m, "tally_unknown_effects",
                                        "Effects in UNKNOWN, waiting for a status check", NULL);
    rc->m_oldest = tally_metrics_gauge(m, "tally_unknown_oldest_age_seconds",
                                       "How long the oldest UNKNOWN effect has been UNKNOWN", NULL);
    rc->m_stuck =
        tally_metrics_gauge(m, "tally_stuck_effects", "Effects STUCK, waiting for a human", NULL);
    rc->m_stuck_oldest =
        tally_metrics_gauge(m, "tally_stuck_oldest_age_seconds",
                            "How long the oldest STUCK effect has been STUCK (0 for none)", NULL);
    rc->m_resolutions = tally_metrics_counter(
        m, "tally_reconciler_resolutions_total",
        "Status check verdicts recorded, by what they did to the effect", "outcome");
    /* at 0 from the start: rate() cannot see the event that creates a series */
    for (int a = TALLY_RECON_CONFIRM; a <= TALLY_RECON_CANCEL; a++)
        tally_metric_add(rc->m_resolutions, 0, tally_recon_action_name((tally_recon_action_t)a));
    rc->m_check_seconds =
        tally_metrics_histogram(m, "tally_status_check_seconds", "Status check latency, by tool",
                                "tool", tally_latency_buckets, tally_n_latency_buckets);
    rc->m_lease_expired = tally_metrics_counter(
        m, "tally_lease_expired_total",
        "DISPATCHING effects whose dispatch lease expired and became UNKNOWN", NULL);
    rc->m_lost = tally_metrics_counter(
        m, "tally_reconciler_lost_leases_total",
        "Verdicts not recorded because another worker took the lease over", NULL);
    rc->m_inflight = tally_metrics_gauge(m, "tally_reconciler_inflight_checks",
                                         "Status checks in flight in this worker", NULL);
    rc->m_tool_inflight = tally_metrics_gauge(
        m, "tally_status_checks_inflight",
        "Calls in flight in this worker, by tool: status checks, audits of CONFIRMED effects "
        "and orphan sweep list pages",
        "tool");
    for (size_t i = 0; i < tally_registry_count(rc->reg); i++)
        tally_metric_set(rc->m_tool_inflight, 0, tally_registry_at(rc->reg, i)->name);
    rc->m_alert_fail = tally_alert_failures_counter(m, "reconciler");
    rc->m_db_errors =
        tally_metrics_counter(m, "tally_reconciler_db_errors_total",
                              "Failed reconciler transactions and statements, by step", "step");
    for (size_t i = 0; i < sizeof db_steps / sizeof db_steps[0]; i++) {
        tally_metric_add(rc->m_db_errors, 0, db_steps[i]);
    }
    rc->m_audits = tally_metrics_counter(
        m, "tally_audits_total",
        "Audit checks of CONFIRMED effects recorded, by tool and what they found (clean, "
        "duplicate, missing, mismatch, inconclusive, gave_up)",
        "tool,result");
    rc->m_sweeps = tally_metrics_counter(
        m, "tally_orphan_sweeps_total",
        "Orphan sweeps of tools' records this worker made, by tool and how they ended",
        "tool,result");
    rc->m_swept = tally_metrics_counter(m, "tally_orphan_sweep_records_total",
                                        "Records the tools listed to the orphan sweep", "tool");

    char errstr[512];
    rc->conn = tally_connector_new(rc->cfg->max_inflight, 0, errstr, sizeof errstr);
    if (rc->conn == NULL) {
        TALLY_ERROR("cannot create the connector engine: %s", errstr);
        reconciler_free(rc);
        return false;
    }
    rc->cs = tally_worker_consume(w); /* logged when NULL */
    if (rc->cs == NULL) {
        tally_connector_free(rc->conn, NULL);
        reconciler_free(rc);
        return false;
    }
    tally_error_t err;
    tally_error_clear(&err);
    if (!tally_pg_listen(rc->db.pg, NOTIFY_CHANNEL, &err)) {
        /* the sweep still finds everything; LISTEN is re-issued on the next reconnect */
        TALLY_WARN("LISTEN %s failed (%s); relying on the sweep and Kafka", NOTIFY_CHANNEL,
                   err.message);
    }
    TALLY_INFO("reconciling: sweep every %d ms, up to %d status checks in flight, lease at "
               "least %d ms",
               rc->cfg->sweep_ms, rc->cfg->max_inflight, rc->cfg->lease_ms);
    *state = rc;
    return true;
}

static int reconciler_tick(tally_worker_t *w, void *state)
{
    reconciler_t *rc = state;
    int work = 0;
    long long now = now_ms();
    if (now >= rc->next_sweep_ms) {
        rc->next_sweep_ms = now + rc->cfg->sweep_ms;
        sweep(rc);
        rc->want_claim = true;
    }
    if (rc->next_due_ms != 0 && now >= rc->next_due_ms) {
        rc->next_due_ms = 0;
        rc->want_claim = true;
    }
    if ((rc->want_claim || rc->backlog) && !tally_worker_stopping(w)) {
        rc->want_claim = false;
        tally_error_t err;
        tally_error_clear(&err);
        int n = claim_round(rc, &err);
        if (n < 0) {
            rc->backlog = false; /* the next sweep tries again; no tight loop on a failure */
            TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL,
                                "claiming due UNKNOWN effects failed (%s: %s)", err.code,
                                err.message);
            tally_worker_set_ready(w, tally_pg_ok(rc->db.pg), err.message);
        } else {
            work += n;
            tally_consume_store(rc->cs);
            tally_worker_set_ready(w, true, NULL);
        }
    }
    if (!rc->backlog && !tally_worker_stopping(w) && now_ms() >= rc->next_audit_ms) {
        tally_error_t err;
        tally_error_clear(&err);
        int n = audit_round(rc, &err);
        if (n < 0) {
            rc->next_audit_ms = now_ms() + AUDIT_POLL_MS;
            TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL, "claiming due audits failed (%s: %s)",
                                err.code, err.message);
        } else {
            work += n;
        }
    }
    long long wait = rc->next_sweep_ms - now_ms();
    if (rc->next_due_ms != 0 && rc->next_due_ms - now_ms() < wait) {
        wait = rc->next_due_ms - now_ms();
    }
    if (rc->next_audit_ms - now_ms() < wait) {
        wait = rc->next_audit_ms - now_ms();
    }
    if (rc->n_adone > 0 && rc->audit_retry_ms - now_ms() < wait) {
        wait = rc->audit_retry_ms - now_ms();
    }
    if (!rc->sw_inflight && rc->sw_next_ms - now_ms() < wait) {
        wait = rc->sw_next_ms - now_ms();
    }
    if (wait > rc->cfg->poll_ms) {
        wait = rc->cfg->poll_ms;
    }
    if (rc->n_done > 0 && rc->record_retry_ms - now_ms() < wait) {
        wait = rc->record_retry_ms - now_ms();
    }
    if (wait < 0 || rc->want_claim || (rc->backlog && rc->inflight == 0)) {
        wait = 0;
    }
    wait_for_events(rc, (int)wait, true);
    work += record_round(rc);
    work += audit_record_round(rc);
    work += sweep_round(rc, tally_worker_stopping(w));
    return work;
}

/* SIGTERM: claim nothing more, let the checks in flight finish and record them. */
static bool reconciler_drain(tally_worker_t *w, void *state)
{
    (void)w;
    reconciler_t *rc = state;
    if (rc->inflight > 0) {
        wait_for_events(rc, DRAIN_POLL_MS, false);
    }
    record_round(rc);
    audit_record_round(rc);
    return rc->inflight == 0 && rc->n_done == 0 && rc->n_adone == 0;
}

static reconciler_t *g_abandoning; /* the reconciler whose connector is being freed */

static void on_abandoned(void *opaque)
{
    tally_recon_item_t *it = opaque;
    if (it->list || !push_done(g_abandoning, it)) {
        tally_recon_item_free(it); /* a sweep page: the next period sweeps from the cursor */
    }
}

/* After the grace period: give back the leases of checks still in flight or unrecorded, so
 * another reconciler need not wait for them to expire. */
static void reconciler_fini(tally_worker_t *w, void *state)
{
    (void)w;
    reconciler_t *rc = state;
    for (size_t i = 0; i < rc->n_done; i++) {
        rc->done[i]->record_tries = MAX_RECORD_TRIES; /* unrecorded: released below */
    }
    g_abandoning = rc;
    tally_connector_free(rc->conn, on_abandoned);
    g_abandoning = NULL;
    rc->conn = NULL;
    if (rc->n_done > 0) {
        tally_error_t err;
        tally_error_clear(&err);
        int released = tally_recon_release(&rc->db, rc->done, rc->n_done, &err);
        if (released < 0) {
            db_error(rc, "release");
            TALLY_WARN("cannot release %zu leases at shutdown (%s); they expire on their own",
                       rc->n_done, err.message);
        } else {
            TALLY_INFO("released %d leases of status checks cut short by shutdown", released);
        }
    }
    reconciler_free(rc); /* offsets of messages read since the last claim stay unstored */
}

static const char *const reconciler_topics[] = {"outcomes", NULL};

const tally_worker_ops_t tally_reconciler_ops = {
    .name = "reconciler",
    .summary = "Resolves UNKNOWN effects from upstream evidence, detects duplicates and turns "
               "expired dispatch leases into UNKNOWN.",
    .topics = reconciler_topics,
    .init = reconciler_init,
    .tick = reconciler_tick,
    .drain = reconciler_drain,
    .fini = reconciler_fini,
};
