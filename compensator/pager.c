/* pager.c — delivers every alert of the ledger (any worker's) to PagerDuty's Events API v2.
 *
 * It runs on its own thread with its own PostgreSQL connection, so a slow or absent pager
 * never holds up compensation. An alert whose pager_state is 'pending' needs the action its
 * status says (TRIGGERED: trigger, RESOLVED: resolve); the pager leases a few such rows
 * (FOR UPDATE SKIP LOCKED, so several compensators never post one action twice), POSTs each
 * with a bounded timeout, and records 'sent', or a retry with backoff, or 'failed' (a 4xx that
 * retrying cannot fix, or PAGER_MAX_ATTEMPTS failures) — every result of a round in one
 * statement. Without TALLY_PAGER_URL, pending alerts are marked 'not_configured'. */
#include "compensator.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <curl/curl.h>

#include "tally/alert.h"
#include "tally/backoff.h"
#include "tally/ledger.h"
#include "tally/log.h"

#define PAGER_BATCH          20
#define PAGER_LEASE_MS       60000
#define PAGER_TIMEOUT_MS     10000
#define PAGER_CONNECT_MS     5000
#define PAGER_MAX_ATTEMPTS   12
#define PAGER_BACKOFF_MS     1000
#define PAGER_MAX_BACKOFF_MS 300000
#define PAGER_SUMMARY_MAX    1024

static const char SQL_NOT_CONFIGURED[] =
    "UPDATE alerts SET pager_state = 'not_configured', pager_last_error = NULL"
    " WHERE pager_state = 'pending'"
    " RETURNING dedup_key";

static const char SQL_CLAIM[] =
    "WITH c AS (SELECT dedup_key FROM alerts"
    "   WHERE pager_state = 'pending' AND pager_next_at <= now()"
    "     AND (pager_lease_until IS NULL OR pager_lease_until < now())"
    "   ORDER BY pager_next_at LIMIT $3 FOR UPDATE SKIP LOCKED)"
    " UPDATE alerts a SET pager_lease_owner = $1,"
    "   pager_lease_until = now() + $2::int * interval '1 millisecond',"
    "   pager_attempts = a.pager_attempts + 1"
    " FROM c WHERE a.dedup_key = c.dedup_key"
    " RETURNING a.dedup_key, a.status, a.severity, a.summary, a.run_id, a.effect_id::text,"
    "   a.obligation_id::text, a.reason, a.runbook, a.resolve_command, a.pager_attempts";

/* Compare-and-set on the lease and on the status the action was for: an alert resolved while
 * its trigger was in flight stays pending (its lease was reset) and gets its resolve next. */
static const char SQL_RESULTS[] =
    "UPDATE alerts a SET"
    "  pager_state = CASE WHEN r.outcome = 'retry' THEN 'pending' ELSE r.outcome END,"
    "  pager_last_action = CASE WHEN r.outcome = 'sent' THEN r.action ELSE a.pager_last_action END,"
    "  pager_sent_at = CASE WHEN r.outcome = 'sent' THEN now() ELSE a.pager_sent_at END,"
    "  pager_last_error = r.error,"
    "  pager_next_at = now() + r.delay_ms * interval '1 millisecond',"
    "  pager_lease_owner = NULL, pager_lease_until = NULL"
    " FROM json_to_recordset($1::json) AS r(dedup_key text, status text, action text,"
    "   outcome text, error text, delay_ms bigint)"
    " WHERE a.dedup_key = r.dedup_key AND a.pager_lease_owner = $2 AND a.status = r.status"
    "   AND a.pager_state = 'pending'";

struct comp_pager {
    pthread_t thread;
    bool started;
    atomic_int quit;
    volatile const int *stop;
    char *url;
    char *url_shown; /* url with its credentials masked (tally_config_mask): for logs, errors */
    char *routing_key;
    char worker_id[256];
    tally_pg_t *pg;
    CURL *easy;
    tally_metric_t *m_alerts;
    tally_metric_t *m_pager_seconds;
    tally_metric_t *m_failures; /* tally_pager_failures_total{outcome}: "retry" or "failed" */
    unsigned rand_state;
};

json_t *comp_pager_body(const char *routing_key, const char *action, const char *dedup_key,
                        const char *summary, const char *source, const char *severity,
                        const json_t *details, const char *runbook)
{
    json_t *body =
        json_pack("{s:s, s:s, s:s}", "routing_key", routing_key != NULL ? routing_key : "",
                  "event_action", action, "dedup_key", dedup_key);
    if (body == NULL || strcmp(action, "trigger") != 0) {
        return body;
    }
    /* PagerDuty caps the summary at 1024 characters: cut at a UTF-8 boundary. */
    char cut[PAGER_SUMMARY_MAX + 1];
    size_t len = strlen(summary != NULL ? summary : "");
    if (len > PAGER_SUMMARY_MAX) {
        len = PAGER_SUMMARY_MAX;
        while (len > 0 && ((unsigned char)summary[len] & 0xC0) == 0x80) {
            len--;
        }
    }
    memcpy(cut, summary != NULL ? summary : "", len);
    cut[len] = '\0';
    const char *sev = severity;
    if (sev == NULL || (strcmp(sev, "critical") != 0 && strcmp(sev, "error") != 0 &&
                        strcmp(sev, "warning") != 0 && strcmp(sev, "info") != 0)) {
        sev = "critical";
    }
    json_t *payload =
        json_pack("{s:s, s:s, s:s, s:o}", "summary", cut, "source",
                  source != NULL ? source : "tally", "severity", sev, "custom_details",
                  details != NULL ? json_deep_copy(details) : json_object());
    bool ok = payload != NULL && json_object_set_new(body, "payload", payload) == 0;
    if (ok && runbook != NULL && runbook[0] != '\0') {
        ok = json_object_set_new(
                 body, "links", json_pack("[{s:s, s:s}]", "href", runbook, "text", "runbook")) == 0;
    }
    if (!ok) {
        json_decref(body);
        return NULL;
    }
    return body;
}

/* A trigger's link to the console (TALLY_CONSOLE_URL, alert.h), first among its links: PagerDuty
 * shows "links" on the incident, and client_url as its "View in tally console" button. */
static bool add_console_link(json_t *body, const char *link, const char *run_id)
{
    json_t *links = json_object_get(body, "links");
    if (links == NULL) {
        links = json_array();
        if (links == NULL || json_object_set_new(body, "links", links) != 0) {
            return false;
        }
    }
    char *queues = tally_alert_console_link(NULL); /* where a page without a run links */
    char text[300];
    if (queues == NULL || strcmp(link, queues) == 0)
        snprintf(text, sizeof text, "tally console: what needs a human");
    else
        tally_fmt(text, sizeof text, "run %s in the tally console", run_id);
    free(queues);
    json_t *entry = json_pack("{s:s, s:s}", "href", link, "text", text);
    return entry != NULL && json_array_insert_new(links, 0, entry) == 0 &&
           json_object_set_new(body, "client", json_string("tally console")) == 0 &&
           json_object_set_new(body, "client_url", json_string(link)) == 0;
}

static size_t discard(char *ptr, size_t size, size_t nmemb, void *userdata)
{
    (void)ptr;
    (void)userdata;
    return size * nmemb;
}

/* POST @p body. @returns the HTTP status, or 0 with curl's message in @p why. */
static long post(comp_pager_t *p, const char *body, char *why, size_t whysz)
{
    struct curl_slist *headers = curl_slist_append(NULL, "Content-Type: application/json");
    headers = headers != NULL ? curl_slist_append(headers, "Accept: application/json") : NULL;
    if (headers == NULL) {
        snprintf(why, whysz, "out of memory building the request headers");
        return 0;
    }
    char errbuf[CURL_ERROR_SIZE] = "";
    curl_easy_reset(p->easy);
    curl_easy_setopt(p->easy, CURLOPT_URL, p->url);
    curl_easy_setopt(p->easy, CURLOPT_POST, 1L);
    curl_easy_setopt(p->easy, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(p->easy, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    curl_easy_setopt(p->easy, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(p->easy, CURLOPT_TIMEOUT_MS, (long)PAGER_TIMEOUT_MS);
    curl_easy_setopt(p->easy, CURLOPT_CONNECTTIMEOUT_MS, (long)PAGER_CONNECT_MS);
    curl_easy_setopt(p->easy, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(p->easy, CURLOPT_WRITEFUNCTION, discard);
    curl_easy_setopt(p->easy, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(p->easy, CURLOPT_USERAGENT, "tally-compensator/" TALLY_VERSION);
    CURLcode rc = curl_easy_perform(p->easy);
    long status = 0;
    if (rc == CURLE_OK) {
        curl_easy_getinfo(p->easy, CURLINFO_RESPONSE_CODE, &status);
    } else {
        snprintf(why, whysz, "%s", errbuf[0] != '\0' ? errbuf : curl_easy_strerror(rc));
    }
    curl_slist_free_all(headers);
    return status;
}

static long long backoff_ms(comp_pager_t *p, int attempts)
{
    return tally_backoff_ms(attempts, PAGER_BACKOFF_MS, PAGER_MAX_BACKOFF_MS, -1,
                            (uint32_t)rand_r(&p->rand_state));
}

/* What one delivery did, and the pager_state it leaves (SQL_RESULTS: a retry stays pending). */
typedef enum {
    PAGER_RETRY = 0,
    PAGER_SENT,
    PAGER_FAILED,
} pager_outcome_t;

static const char *pager_outcome_name(pager_outcome_t o)
{
    switch (o) {
    case PAGER_SENT:
        return "sent";
    case PAGER_FAILED:
        return "failed";
    case PAGER_RETRY:
        break;
    }
    return "retry";
}

static const char *col(PGresult *res, int row, int c)
{
    return PQgetisnull(res, row, c) ? NULL : PQgetvalue(res, row, c);
}

/* Deliver one claimed alert; append its result row to @p results. */
static void deliver(comp_pager_t *p, PGresult *res, int row, json_t *results)
{
    const char *key = PQgetvalue(res, row, 0);
    const char *status = PQgetvalue(res, row, 1);
    tally_alert_state_t st;
    bool resolved = tally_alert_state_parse(status, &st) && st == TALLY_ALERT_RESOLVED;
    const char *action = resolved ? "resolve" : "trigger";
    int attempts = atoi(PQgetvalue(res, row, 10));
    const char *run_id = col(res, row, 4);
    char source[300];
    snprintf(source, sizeof source, "tally/run/%s", run_id != NULL ? run_id : "-");
    char *link = resolved ? NULL : tally_alert_console_link(run_id); /* NULL: no console */
    json_t *details =
        json_pack("{s:s?, s:s?, s:s?, s:s?, s:s?, s:s?}", "run_id", run_id, "effect_id",
                  col(res, row, 5), "obligation_id", col(res, row, 6), "reason", col(res, row, 7),
                  "resolve_command", col(res, row, 9), "runbook", col(res, row, 8));
    bool ok = details != NULL &&
              (link == NULL || json_object_set_new(details, "console_url", json_string(link)) == 0);
    json_t *body = ok ? comp_pager_body(p->routing_key, action, key, col(res, row, 3), source,
                                        col(res, row, 2), details, col(res, row, 8))
                      : NULL;
    json_decref(details);
    if (body != NULL && link != NULL && !add_console_link(body, link, run_id)) {
        json_decref(body);
        body = NULL;
    }
    free(link);
    char *text = body != NULL ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    pager_outcome_t outcome = PAGER_RETRY;
    char why[512] = "";
    long long delay = 0;
    if (text == NULL) {
        snprintf(why, sizeof why, "out of memory building the PagerDuty event");
    } else {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        long http = post(p, text, why, sizeof why);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        tally_metric_observe(p->m_pager_seconds, (double)(t1.tv_sec - t0.tv_sec) +
                                                     (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
        if (http >= 200 && http < 300) {
            outcome = PAGER_SENT;
        } else if (http != 0) {
            snprintf(why, sizeof why, "HTTP %ld from %s", http, p->url_shown);
            /* 4xx other than 429 will not get better by retrying (bad event, bad key) */
            if (http >= 400 && http < 500 && http != 429 && http != 408) {
                outcome = PAGER_FAILED;
            }
        }
    }
    free(text);
    if (outcome == PAGER_RETRY) {
        if (attempts >= PAGER_MAX_ATTEMPTS) {
            outcome = PAGER_FAILED;
        } else {
            delay = backoff_ms(p, attempts);
        }
    }
    tally_log_ctx_t ctx = {
        .run_id = run_id, .effect_id = col(res, row, 5), .obligation_id = col(res, row, 6)};
    if (outcome != PAGER_SENT) {
        tally_metric_add(p->m_failures, 1, pager_outcome_name(outcome));
    }
    if (outcome == PAGER_SENT) {
        tally_metric_add(p->m_alerts, 1, "pagerduty");
        TALLY_LOG(TALLY_LOG_INFO, &ctx, "PagerDuty %s sent for %s", action, key);
    } else if (outcome == PAGER_FAILED) {
        TALLY_LOG(TALLY_LOG_ERROR, &ctx,
                  "PagerDuty %s for %s failed for good after %d attempts: %s", action, key,
                  attempts, why);
    } else {
        TALLY_LOG(TALLY_LOG_WARN, &ctx,
                  "PagerDuty %s for %s failed (attempt %d), retrying in %lld ms: %s", action, key,
                  attempts, delay, why);
    }
    json_array_append_new(
        results, json_pack("{s:s, s:s, s:s, s:s, s:s?, s:I}", "dedup_key", key, "status", status,
                           "action", action, "outcome", pager_outcome_name(outcome), "error",
                           outcome == PAGER_SENT ? NULL : why, "delay_ms", (json_int_t)delay));
}

/* One round: @returns alerts handled, -1 on a database error. */
static int pager_round(comp_pager_t *p)
{
    tally_error_t err;
    tally_error_clear(&err);
    if (p->url == NULL) {
        PGresult *res = tally_pg_exec(p->pg, SQL_NOT_CONFIGURED, 0, NULL, &err);
        if (res == NULL) {
            TALLY_WARN("pager: %s", err.message);
            return -1;
        }
        for (int row = 0; row < PQntuples(res); row++) {
            TALLY_DEBUG("pager not configured (TALLY_PAGER_URL is empty): alert %s is on the "
                        "alerts topic only",
                        PQgetvalue(res, row, 0));
        }
        PQclear(res);
        return 0;
    }
    char lease[16], batch[16];
    snprintf(lease, sizeof lease, "%d", PAGER_LEASE_MS);
    snprintf(batch, sizeof batch, "%d", PAGER_BATCH);
    const char *claim[3] = {p->worker_id, lease, batch};
    PGresult *res = tally_pg_exec(p->pg, SQL_CLAIM, 3, claim, &err);
    if (res == NULL) {
        TALLY_WARN("pager: claiming alerts: %s", err.message);
        return -1;
    }
    int n = PQntuples(res);
    json_t *results = json_array();
    for (int row = 0; results != NULL && row < n && !atomic_load(&p->quit); row++) {
        deliver(p, res, row, results);
    }
    PQclear(res);
    if (results == NULL) {
        return -1;
    }
    int rc = n;
    if (json_array_size(results) > 0) {
        char *text = json_dumps(results, JSON_COMPACT);
        const char *params[2] = {text, p->worker_id};
        PGresult *r2 = text != NULL ? tally_pg_exec(p->pg, SQL_RESULTS, 2, params, &err) : NULL;
        if (r2 == NULL) {
            /* the leases expire and the actions are delivered again: PagerDuty dedups by key */
            TALLY_WARN("pager: recording deliveries: %s",
                       text != NULL ? err.message : "out of memory");
            rc = -1;
        }
        PQclear(r2);
        free(text);
    }
    json_decref(results);
    return rc;
}

static bool stopping(const comp_pager_t *p)
{
    return atomic_load(&p->quit) || (p->stop != NULL && *p->stop);
}

static void *pager_main(void *arg)
{
    comp_pager_t *p = arg;
    bool listening = false;
    while (!stopping(p)) {
        tally_error_t err;
        tally_error_clear(&err);
        if (!tally_pg_ok(p->pg) || !listening) {
            if (!tally_pg_connect(p->pg, 0, p->stop, &err) ||
                !tally_pg_listen(p->pg, "tally_alerts", &err)) {
                TALLY_LOG_REPEATING(TALLY_LOG_WARN, NULL, "pager: PostgreSQL: %s (retrying)",
                                    err.message);
                for (int i = 0; i < 20 && !stopping(p); i++) {
                    struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000000L};
                    nanosleep(&ts, NULL);
                }
                continue;
            }
            listening = true;
        }
        int n = pager_round(p);
        if (n <= 0 && !stopping(p)) {
            /* short waits so a stop is seen quickly; a NOTIFY ends the wait at once */
            (void)tally_pg_wait_notify(p->pg, 200);
        }
    }
    return NULL;
}

comp_pager_t *comp_pager_start(const tally_config_t *cfg, const char *worker_id,
                               tally_metrics_t *metrics, tally_metric_t *m_alerts,
                               volatile const int *stop, char *errstr, size_t errsz)
{
    comp_pager_t *p = calloc(1, sizeof *p);
    if (p == NULL) {
        snprintf(errstr, errsz, "out of memory");
        return NULL;
    }
    atomic_init(&p->quit, 0);
    p->stop = stop;
    p->m_alerts = m_alerts;
    p->m_pager_seconds = tally_metrics_histogram(metrics, "tally_pager_post_seconds",
                                                 "Time to POST one event to the pager", NULL,
                                                 tally_latency_buckets, tally_n_latency_buckets);
    /* Every failed post, by what follows it: "retry" (tried again after a backoff) or
     * "failed" (given up: PagerDuty never got this action; tally.alerts still has it). */
    p->m_failures = tally_metrics_counter(metrics, "tally_pager_failures_total",
                                          "Failed posts to the pager, by what followed: retry, "
                                          "or failed (given up; the page did not reach it)",
                                          "outcome");
    tally_metric_add(p->m_failures, 0, pager_outcome_name(PAGER_RETRY));
    tally_metric_add(p->m_failures, 0, pager_outcome_name(PAGER_FAILED));
    p->rand_state = (unsigned)time(NULL) ^ (unsigned)(uintptr_t)p;
    snprintf(p->worker_id, sizeof p->worker_id, "%s", worker_id);
    if (cfg->pager_url != NULL && cfg->pager_url[0] != '\0') {
        p->url = strdup(cfg->pager_url);
        p->url_shown = tally_config_mask(cfg->pager_url);
        p->routing_key = strdup(cfg->pager_routing_key != NULL ? cfg->pager_routing_key : "");
        p->easy = curl_easy_init();
        if (p->url == NULL || p->url_shown == NULL || p->routing_key == NULL || p->easy == NULL) {
            snprintf(errstr, errsz, "cannot set up the pager's HTTP client");
            comp_pager_stop(p);
            return NULL;
        }
        if (p->routing_key[0] == '\0') {
            TALLY_WARN("TALLY_PAGER_URL is set but TALLY_PAGER_ROUTING_KEY is empty: PagerDuty "
                       "will refuse the events");
        }
    }
    p->pg = tally_pg_new(cfg->pg != NULL ? cfg->pg : "", "tally-compensator-pager");
    if (p->pg == NULL) {
        snprintf(errstr, errsz, "out of memory creating the pager's PostgreSQL handle");
        comp_pager_stop(p);
        return NULL;
    }
    tally_pg_set_deadline(p->pg, cfg->pg_deadline_ms);
    if (pthread_create(&p->thread, NULL, pager_main, p) != 0) {
        snprintf(errstr, errsz, "cannot start the pager thread");
        comp_pager_stop(p);
        return NULL;
    }
    p->started = true;
    TALLY_INFO("pager %s", p->url != NULL
                               ? "sends alerts to TALLY_PAGER_URL (PagerDuty Events API v2)"
                               : "not configured (TALLY_PAGER_URL is empty): alerts go "
                                 "to the alerts topic only");
    return p;
}

void comp_pager_stop(comp_pager_t *p)
{
    if (p == NULL) {
        return;
    }
    atomic_store(&p->quit, 1);
    if (p->started) {
        pthread_join(p->thread, NULL);
    }
    tally_pg_free(p->pg);
    if (p->easy != NULL) {
        curl_easy_cleanup(p->easy);
    }
    free(p->url);
    free(p->url_shown);
    free(p->routing_key);
    free(p);
}
