/* connector.c — the connector engine: many concurrent calls in one thread with libcurl multi
 * (the caller's, through tally_connector_poll, or a thread of the engine's own), each call's
 * easy handle, pooled, and the room per tool. What a call sends is built in
 * connector_request.c; what its answer means, in connector_classify.c and connector_receipt.c. */
#include "tally/connector.h"

#if LIBCURL_VERSION_NUM < 0x075000
#error "tally needs libcurl 7.80 or newer (CURLOPT_PREREQFUNCTION, see on_prereq)"
#endif

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "tally/backoff.h"
#include "tally/log.h"

#ifndef TALLY_VERSION
#define TALLY_VERSION "0"
#endif

/* Reused response buffers larger than this are released instead of pooled. */
#define CONN_POOL_BUF_MAX (64 * 1024)
/* A Retry-After longer than a day is a tool bug; cap it. */
#define CONN_RETRY_AFTER_MAX_MS (24L * 3600L * 1000L)

typedef struct conn_slot {
    const tally_tool_t *tool;
    int inflight;
    int published; /* what tally_connector_publish_inflight last set */
} conn_slot_t;

typedef struct conn_xfer {
    struct conn_xfer *prev, *next; /* active list, or the free list (next only) */
    tally_connector_t *c;
    CURL *easy;
    struct curl_slist *headers;
    char *url;
    char *body;
    char *resp;
    size_t resp_len, resp_cap, resp_total;
    bool truncated;
    long retry_after_ms;
    void *opaque;
    const tally_tool_t *tool;
    size_t slot;
    tally_conn_op_t op;
    const char *method;
    struct timespec started;
    /* tally_conn_no_replay: requests curl began to write in this call, and whether a second
     * one (curl's own re-send) was refused */
    int requests;
    bool replay_refused;
    char errbuf[CURL_ERROR_SIZE];
} conn_xfer_t;

/* The multi handle belongs to whichever thread drives the calls: the caller of
 * tally_connector_poll, or the engine's own thread after tally_connector_start. mu guards
 * everything else, which the submitting thread shares with that one. */
struct tally_connector {
    CURLM *multi;
    int max_inflight;
    size_t max_body;
    pthread_mutex_t mu;
    int inflight; /* submitted and not yet handed to the completion callback */
    conn_slot_t *slots;
    size_t n_slots, cap_slots;
    conn_xfer_t *active;   /* in the multi handle */
    conn_xfer_t *incoming; /* submitted to the engine's thread, not yet in the multi handle */
    conn_xfer_t *pool;
    size_t n_pool;
    /* tally_connector_start */
    bool threaded;
    pthread_t thread;
    atomic_bool stop;
    tally_conn_done_fn done;
    void *done_opaque;
};

static int curl_global_ready(void)
{
    /* curl_global_init is not thread-safe before 7.84; tally calls it from the main thread. */
    static int state = 0; /* 0 not yet, 1 ok, -1 failed */
    if (state == 0)
        state = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK ? 1 : -1;
    return state;
}

tally_connector_t *tally_connector_new(int max_inflight, size_t max_body, char *errstr,
                                       size_t errsz)
{
    if (curl_global_ready() != 1) {
        snprintf(errstr, errsz, "curl_global_init failed");
        return NULL;
    }
    tally_connector_t *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(errstr, errsz, "out of memory");
        return NULL;
    }
    c->multi = curl_multi_init();
    if (!c->multi || pthread_mutex_init(&c->mu, NULL) != 0) {
        if (c->multi)
            curl_multi_cleanup(c->multi);
        free(c);
        snprintf(errstr, errsz, "curl_multi_init failed");
        return NULL;
    }
    atomic_init(&c->stop, false);
    c->max_inflight = max_inflight > 0 ? max_inflight : INT_MAX;
    c->max_body = max_body ? max_body : TALLY_CONN_MAX_BODY;
    /* Keep enough idle connections for every call in flight to reuse one. */
    long maxconnects = max_inflight > 0 ? max_inflight : 1024;
    curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, maxconnects);
    return c;
}

static conn_slot_t *slot_for(tally_connector_t *c, const tally_tool_t *tool, size_t *idx)
{
    for (size_t i = 0; i < c->n_slots; i++)
        if (c->slots[i].tool == tool) {
            *idx = i;
            return &c->slots[i];
        }
    if (c->n_slots == c->cap_slots) {
        size_t cap = c->cap_slots ? 2 * c->cap_slots : 16;
        conn_slot_t *s = realloc(c->slots, cap * sizeof *s);
        if (!s)
            return NULL;
        c->slots = s;
        c->cap_slots = cap;
    }
    c->slots[c->n_slots] = (conn_slot_t){.tool = tool, .inflight = 0, .published = 0};
    *idx = c->n_slots;
    return &c->slots[c->n_slots++];
}

static int tool_limit(const tally_tool_t *tool)
{
    return tool->max_concurrency > 0 ? tool->max_concurrency : INT_MAX;
}

static int tool_inflight_locked(const tally_connector_t *c, const tally_tool_t *tool)
{
    for (size_t i = 0; i < c->n_slots; i++)
        if (c->slots[i].tool == tool)
            return c->slots[i].inflight;
    return 0;
}

static int capacity_locked(const tally_connector_t *c, const tally_tool_t *tool)
{
    int global = c->max_inflight - c->inflight;
    int per = tool_limit(tool) - tool_inflight_locked(c, tool);
    int room = global < per ? global : per;
    return room > 0 ? room : 0;
}

/* The counts are read under the lock: the engine's thread changes them as calls finish. */
int tally_connector_tool_inflight(const tally_connector_t *c, const tally_tool_t *tool)
{
    tally_connector_t *m = (tally_connector_t *)c;
    pthread_mutex_lock(&m->mu);
    int n = tool_inflight_locked(c, tool);
    pthread_mutex_unlock(&m->mu);
    return n;
}

int tally_connector_inflight(const tally_connector_t *c)
{
    tally_connector_t *m = (tally_connector_t *)c;
    pthread_mutex_lock(&m->mu);
    int n = c->inflight;
    pthread_mutex_unlock(&m->mu);
    return n;
}

/* The counts are the ones that enforce max_concurrency, moved under the lock at submit and in
 * finish, so the gauge balances by construction. Only the tools whose count moved since the
 * last look are written (a lookup under the metrics lock each), nothing per call. */
void tally_connector_publish_inflight(tally_connector_t *c, tally_metric_t *gauge)
{
    pthread_mutex_lock(&c->mu);
    for (size_t i = 0; i < c->n_slots; i++) {
        conn_slot_t *s = &c->slots[i];
        if (s->inflight != s->published) {
            tally_metric_set(gauge, s->inflight, s->tool->name);
            s->published = s->inflight;
        }
    }
    pthread_mutex_unlock(&c->mu);
}

int tally_connector_capacity(const tally_connector_t *c, const tally_tool_t *tool)
{
    tally_connector_t *m = (tally_connector_t *)c;
    pthread_mutex_lock(&m->mu);
    int room = capacity_locked(c, tool);
    pthread_mutex_unlock(&m->mu);
    return room;
}

static size_t on_body(char *ptr, size_t size, size_t nmemb, void *userdata)
{
    conn_xfer_t *x = userdata;
    size_t n = size * nmemb;
    x->resp_total += n;
    size_t room = x->c->max_body - x->resp_len;
    size_t take = n < room ? n : room;
    if (take < n)
        x->truncated = true; /* keep reading: aborting would make curl report an error */
    if (take > 0) {
        if (x->resp_len + take + 1 > x->resp_cap) {
            size_t cap = x->resp_cap ? x->resp_cap : 4096;
            while (cap < x->resp_len + take + 1)
                cap *= 2;
            if (cap > x->c->max_body + 1)
                cap = x->c->max_body + 1;
            char *r = realloc(x->resp, cap);
            if (!r) {
                x->truncated = true;
                return n;
            }
            x->resp = r;
            x->resp_cap = cap;
        }
        memcpy(x->resp + x->resp_len, ptr, take);
        x->resp_len += take;
        x->resp[x->resp_len] = '\0';
    }
    return n;
}

static long parse_retry_after(const char *v, size_t len)
{
    char buf[128];
    while (len > 0 && isspace((unsigned char)*v))
        v++, len--;
    while (len > 0 && isspace((unsigned char)v[len - 1]))
        len--;
    if (len == 0 || len >= sizeof buf)
        return -1;
    memcpy(buf, v, len);
    buf[len] = '\0';
    bool digits = true;
    for (size_t i = 0; i < len; i++)
        if (!isdigit((unsigned char)buf[i]))
            digits = false;
    long ms;
    if (digits) {
        errno = 0;
        unsigned long long s = strtoull(buf, NULL, 10);
        if (errno || s > (unsigned long long)(CONN_RETRY_AFTER_MAX_MS / 1000))
            return CONN_RETRY_AFTER_MAX_MS;
        ms = (long)s * 1000L;
    } else {
        time_t t = curl_getdate(buf, NULL);
        if (t == (time_t)-1)
            return -1;
        time_t now = time(NULL);
        ms = t > now ? (long)(t - now) * 1000L : 0;
    }
    return ms > CONN_RETRY_AFTER_MAX_MS ? CONN_RETRY_AFTER_MAX_MS : ms;
}

static size_t on_header(char *buf, size_t size, size_t nitems, void *userdata)
{
    conn_xfer_t *x = userdata;
    size_t n = size * nitems;
    /* A new status line (after 1xx, or curl's own re-send) starts a new set of headers. */
    if (n >= 5 && memcmp(buf, "HTTP/", 5) == 0) {
        x->retry_after_ms = -1;
        return n;
    }
    static const char name[] = "retry-after:";
    if (n > sizeof name - 1 && strncasecmp(buf, name, sizeof name - 1) == 0)
        x->retry_after_ms = parse_retry_after(buf + sizeof name - 1, n - (sizeof name - 1));
    return n;
}

/* @p x was added to the multi handle: list it among the calls in flight. */
static void active_push(tally_connector_t *c, conn_xfer_t *x)
{
    pthread_mutex_lock(&c->mu);
    x->next = c->active;
    if (c->active)
        c->active->prev = x;
    c->active = x;
    pthread_mutex_unlock(&c->mu);
}

static void xfer_release(tally_connector_t *c, conn_xfer_t *x)
{
    curl_slist_free_all(x->headers);
    x->headers = NULL;
    free(x->url);
    x->url = NULL;
    free(x->body);
    x->body = NULL;
    if (x->resp_cap > CONN_POOL_BUF_MAX) {
        free(x->resp);
        x->resp = NULL;
        x->resp_cap = 0;
    }
    x->opaque = NULL;
    if (c->n_pool < 256) {
        x->next = c->pool;
        x->prev = NULL;
        c->pool = x;
        c->n_pool++;
    } else {
        curl_easy_cleanup(x->easy);
        free(x->resp);
        free(x);
    }
}

static conn_xfer_t *xfer_take(tally_connector_t *c)
{
    conn_xfer_t *x = c->pool;
    if (x) {
        c->pool = x->next;
        c->n_pool--;
        curl_easy_reset(x->easy);
    } else {
        x = calloc(1, sizeof *x);
        if (!x)
            return NULL;
        x->easy = curl_easy_init();
        if (!x->easy) {
            free(x);
            return NULL;
        }
    }
    x->c = c;
    x->prev = x->next = NULL;
    x->resp_len = x->resp_total = 0;
    x->truncated = false;
    x->retry_after_ms = -1;
    x->requests = 0;
    x->replay_refused = false;
    x->errbuf[0] = '\0';
    if (x->resp)
        x->resp[0] = '\0';
    return x;
}

/* curl calls this right before it writes a request on a connection, new or reused. A second
 * time within one call is curl re-sending the request on its own, after a reused connection
 * closed before any answer: the tool may have applied the first. For a call that may not be
 * replayed it is refused, so the call ends as sent without an answer (UNKNOWN). */
static int on_prereq(void *clientp, char *remote_ip, char *local_ip, int remote_port,
                     int local_port)
{
    conn_xfer_t *x = clientp;
    (void)remote_ip;
    (void)local_ip;
    (void)remote_port;
    (void)local_port;
    if (++x->requests > 1) {
        x->replay_refused = true;
        return CURL_PREREQFUNC_ABORT;
    }
    return CURL_PREREQFUNC_OK;
}

static bool xfer_setup(conn_xfer_t *x, const tally_conn_request_t *req)
{
    CURL *e = x->easy;
    int timeout = req->tool->timeout_ms > 0 ? req->tool->timeout_ms : 5000;
    bool ok = curl_easy_setopt(e, CURLOPT_URL, x->url) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_PRIVATE, x) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_ERRORBUFFER, x->errbuf) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)timeout) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)timeout) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https") == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_USERAGENT, "tally/" TALLY_VERSION) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_HTTPHEADER, x->headers) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_WRITEDATA, x) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header) == CURLE_OK &&
              curl_easy_setopt(e, CURLOPT_HEADERDATA, x) == CURLE_OK &&
              /* receipts are small: curl's default 16 KiB receive buffer per call would be
               * ~80 MB at 5,000 calls in flight; larger bodies just take more callbacks */
              curl_easy_setopt(e, CURLOPT_BUFFERSIZE, 1024L) == CURLE_OK;
    if (!ok)
        return false;
    if (tally_conn_no_replay(req->tool, req->op)) {
        /* See the header: curl may not send this request a second time. */
        ok = curl_easy_setopt(e, CURLOPT_PREREQFUNCTION, on_prereq) == CURLE_OK &&
             curl_easy_setopt(e, CURLOPT_PREREQDATA, x) == CURLE_OK;
        if (!ok)
            return false;
    }
    if (x->body) {
        ok = curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)req->body_len) ==
                 CURLE_OK &&
             curl_easy_setopt(e, CURLOPT_POSTFIELDS, x->body) == CURLE_OK;
        if (ok && strcmp(x->method, "POST") != 0)
            ok = curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, x->method) == CURLE_OK;
    } else if (strcmp(x->method, "GET") == 0) {
        ok = curl_easy_setopt(e, CURLOPT_HTTPGET, 1L) == CURLE_OK;
    } else {
        ok = curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, x->method) == CURLE_OK;
    }
    return ok;
}

bool tally_connector_submit(tally_connector_t *c, const tally_conn_request_t *req,
                            tally_error_t *err)
{
    const tally_tool_t *tool = req->tool;
    const char *secret = NULL;
    if (tool->secret_env && tool->secret_env[0]) {
        secret = getenv(tool->secret_env);
        if (!secret || !secret[0]) {
            tally_error_setc(err, TALLY_ERR_SECRET_MISSING,
                             "tool '%s' signs its requests but %s is not set", tool->name,
                             tool->secret_env);
            return false;
        }
    }
    tally_conn_signing_t sign = {.legacy_secret = secret};
    if (tool->signing.scheme == TALLY_SIGNING_RFC9421) {
        sign.key_id = tool->signing.key_id;
        sign.window_s = tool->signing.window_s;
        sign.key = getenv(tool->signing.secret_env);
        if (!sign.key || !sign.key[0]) {
            tally_error_setc(err, TALLY_ERR_SECRET_MISSING,
                             "tool '%s' signs its requests (RFC 9421) but %s is not set",
                             tool->name, tool->signing.secret_env);
            return false;
        }
    }
    /* Take the room first (under the lock: calls finishing on the engine's thread free it),
     * then build the request outside the lock. */
    pthread_mutex_lock(&c->mu);
    size_t slot_idx = 0;
    conn_xfer_t *x = NULL;
    if (capacity_locked(c, tool) <= 0) {
        tally_error_setc(err, TALLY_ERR_CAPACITY,
                         "no room for another call to '%s' (%d in flight, %d for the tool)",
                         tool->name, c->inflight, tool_inflight_locked(c, tool));
    } else if (!slot_for(c, tool, &slot_idx) || !(x = xfer_take(c))) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory");
    } else {
        c->inflight++;
        c->slots[slot_idx].inflight++;
    }
    pthread_mutex_unlock(&c->mu);
    if (!x)
        return false;

    x->url = tally_conn_url(tool, req->op,
                            req->op == TALLY_CONN_LIST ? req->query : req->idempotency_key, err);
    if (!x->url)
        goto fail;
    x->headers = tally_conn_headers_signed(req, tally_conn_method(tool, req->op), x->url, &sign,
                                           (long long)time(NULL), err);
    if (!x->headers)
        goto fail;
    if (req->body) {
        x->body = malloc(req->body_len + 1);
        if (!x->body) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory");
            goto fail;
        }
        memcpy(x->body, req->body, req->body_len);
        x->body[req->body_len] = '\0';
    }
    x->method = tally_conn_method(tool, req->op);
    x->tool = tool;
    x->op = req->op;
    x->opaque = req->opaque;
    x->slot = slot_idx;
    if (!xfer_setup(x, req)) {
        tally_error_setc_retriable(err, TALLY_ERR_CURL, false,
                                   "setting curl options for '%s' failed", tool->name);
        goto fail;
    }
    clock_gettime(CLOCK_MONOTONIC, &x->started);
    if (c->threaded) {
        /* The engine's thread adds it to the multi handle (only that thread touches it). */
        pthread_mutex_lock(&c->mu);
        bool first = c->incoming == NULL; /* later ones find the thread already woken */
        x->next = c->incoming;
        c->incoming = x;
        pthread_mutex_unlock(&c->mu);
        if (first)
            curl_multi_wakeup(c->multi);
        return true;
    }
    CURLMcode mc = curl_multi_add_handle(c->multi, x->easy);
    if (mc != CURLM_OK) {
        tally_error_setc(err, TALLY_ERR_CURL, "curl_multi_add_handle: %s", curl_multi_strerror(mc));
        goto fail;
    }
    active_push(c, x);
    return true;
fail:
    pthread_mutex_lock(&c->mu);
    c->inflight--;
    c->slots[slot_idx].inflight--;
    xfer_release(c, x);
    pthread_mutex_unlock(&c->mu);
    return false;
}

static bool conn_was_sent(CURL *easy, CURLcode rc, long http_status)
{
    if (http_status > 0)
        return true;
    switch (rc) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_CONNECT:
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_URL_MALFORMAT:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_CACERT_BADFILE:
        return false;
    default:
        break;
    }
    curl_off_t pretransfer = 0;
    long request_size = 0;
    if (curl_easy_getinfo(easy, CURLINFO_PRETRANSFER_TIME_T, &pretransfer) != CURLE_OK)
        return true;
    if (curl_easy_getinfo(easy, CURLINFO_REQUEST_SIZE, &request_size) != CURLE_OK)
        return true;
    return pretransfer > 0 || request_size > 0;
}

static double since(const struct timespec *t0)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t0->tv_sec) + (double)(now.tv_nsec - t0->tv_nsec) / 1e9;
}

/* Hand one finished call to @p done, then give its room back: a call counts as in flight
 * until its callback has returned, so "nothing in flight" means every result was handed on.
 * @p x is in the active list unless @p listed is false. */
static void finish(tally_connector_t *c, conn_xfer_t *x, bool listed, CURLcode rc,
                   tally_conn_done_fn done, void *opaque)
{
    CURL *easy = x->easy;
    long status = 0;
    curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
    bool sent = conn_was_sent(easy, rc, status);
    if (x->replay_refused) {
        /* What the first request met: the connection closed with no answer (curl's own
         * failure was replaced by the re-send that on_prereq refused). */
        rc = CURLE_GOT_NOTHING;
        sent = true;
        snprintf(x->errbuf, sizeof x->errbuf,
                 "the reused connection closed after the request was written, before any "
                 "answer; curl's automatic re-send was refused (this call may not be replayed)");
    }
    tally_conn_result_t res = {
        .opaque = x->opaque,
        .tool = x->tool,
        .op = x->op,
        .method = x->method,
        .url = x->url,
        .curl_code = (int)rc,
        .curl_error = x->errbuf,
        .sent = sent,
        .http_status = status,
        .retry_after_ms = x->retry_after_ms,
        .seconds = since(&x->started),
        .body = x->resp ? x->resp : "",
        .body_len = x->resp_len,
        .body_total = x->resp_total,
        .body_truncated = x->truncated,
    };
    if (listed)
        curl_multi_remove_handle(c->multi, easy);
    if (done)
        done(&res, opaque);
    pthread_mutex_lock(&c->mu);
    if (listed) {
        if (x->prev)
            x->prev->next = x->next;
        else
            c->active = x->next;
        if (x->next)
            x->next->prev = x->prev;
    }
    c->inflight--;
    c->slots[x->slot].inflight--;
    xfer_release(c, x);
    pthread_mutex_unlock(&c->mu);
}

static int drain_done(tally_connector_t *c, tally_conn_done_fn done, void *opaque)
{
    int n = 0;
    int left;
    CURLMsg *m;
    while ((m = curl_multi_info_read(c->multi, &left)) != NULL) {
        if (m->msg != CURLMSG_DONE)
            continue;
        conn_xfer_t *x = NULL;
        CURLcode rc = m->data.result;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&x);
        finish(c, x, true, rc, done, opaque);
        n++;
    }
    return n;
}

/* Threaded: move the calls submitted since the last look into the multi handle, in the order
 * they were submitted. One that curl refuses is finished at once as not sent. */
static int take_incoming(tally_connector_t *c, tally_conn_done_fn done, void *opaque)
{
    pthread_mutex_lock(&c->mu);
    conn_xfer_t *list = c->incoming;
    c->incoming = NULL;
    pthread_mutex_unlock(&c->mu);
    conn_xfer_t *rev = NULL;
    while (list) {
        conn_xfer_t *next = list->next;
        list->next = rev;
        rev = list;
        list = next;
    }
    int failed = 0;
    while (rev) {
        conn_xfer_t *x = rev;
        rev = rev->next;
        x->prev = x->next = NULL;
        CURLMcode mc = curl_multi_add_handle(c->multi, x->easy);
        if (mc != CURLM_OK) {
            snprintf(x->errbuf, sizeof x->errbuf, "curl_multi_add_handle: %s",
                     curl_multi_strerror(mc));
            finish(c, x, false, CURLE_FAILED_INIT, done, opaque);
            failed++;
            continue;
        }
        active_push(c, x);
    }
    return failed;
}

int tally_connector_poll(tally_connector_t *c, struct curl_waitfd *extra, unsigned n_extra,
                         int timeout_ms, tally_conn_done_fn done, void *opaque, tally_error_t *err)
{
    for (unsigned i = 0; i < n_extra; i++)
        extra[i].revents = 0;
    int n = c->threaded ? take_incoming(c, done, opaque) : 0;
    int running = 0;
    CURLMcode mc = curl_multi_perform(c->multi, &running);
    if (mc != CURLM_OK) {
        tally_error_setc(err, TALLY_ERR_CURL, "curl_multi_perform: %s", curl_multi_strerror(mc));
        return -1;
    }
    n += drain_done(c, done, opaque);
    int numfds = 0;
    mc = curl_multi_poll(c->multi, extra, n_extra, n > 0 ? 0 : (timeout_ms > 0 ? timeout_ms : 0),
                         &numfds);
    if (mc != CURLM_OK) {
        tally_error_setc(err, TALLY_ERR_CURL, "curl_multi_poll: %s", curl_multi_strerror(mc));
        return -1;
    }
    if (c->threaded)
        n += take_incoming(c, done, opaque);
    mc = curl_multi_perform(c->multi, &running);
    if (mc != CURLM_OK) {
        tally_error_setc(err, TALLY_ERR_CURL, "curl_multi_perform: %s", curl_multi_strerror(mc));
        return -1;
    }
    return n + drain_done(c, done, opaque);
}

void tally_connector_wakeup(tally_connector_t *c)
{
    curl_multi_wakeup(c->multi);
}

static void *engine_thread(void *arg)
{
    tally_connector_t *c = arg;
    int failures = 0;
    while (!atomic_load(&c->stop)) {
        tally_error_t err;
        tally_error_clear(&err);
        if (tally_connector_poll(c, NULL, 0, 1000, c->done, c->done_opaque, &err) < 0) {
            /* curl_multi_* only fail when out of memory or misused: say so and slow down */
            TALLY_ERROR("connector: %s", err.message);
            long long ms = tally_backoff_step_ms(++failures, 10, 1000);
            struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
            nanosleep(&ts, NULL);
        } else {
            failures = 0;
        }
    }
    return NULL;
}

bool tally_connector_start(tally_connector_t *c, tally_conn_done_fn done, void *opaque,
                           char *errstr, size_t errsz)
{
    if (c->threaded) {
        snprintf(errstr, errsz, "the connector's thread is already running");
        return false;
    }
    c->done = done;
    c->done_opaque = opaque;
    atomic_store(&c->stop, false);
    c->threaded = true;
    int rc = pthread_create(&c->thread, NULL, engine_thread, c);
    if (rc != 0) {
        c->threaded = false;
        snprintf(errstr, errsz, "cannot start the connector's thread: %s", strerror(rc));
        return false;
    }
    return true;
}

void tally_connector_stop(tally_connector_t *c)
{
    if (!c || !c->threaded)
        return;
    atomic_store(&c->stop, true);
    curl_multi_wakeup(c->multi);
    pthread_join(c->thread, NULL);
    /* Calls submitted but never added stay incoming: tally_connector_free abandons them. */
}

static void xfer_destroy(conn_xfer_t *x)
{
    curl_slist_free_all(x->headers);
    free(x->url);
    free(x->body);
    free(x->resp);
    curl_easy_cleanup(x->easy);
    free(x);
}

void tally_connector_free(tally_connector_t *c, void (*abandoned)(void *opaque))
{
    if (!c)
        return;
    tally_connector_stop(c);
    conn_xfer_t *lists[2] = {c->active, c->incoming};
    for (int l = 0; l < 2; l++) {
        conn_xfer_t *x = lists[l];
        while (x) {
            conn_xfer_t *next = x->next;
            if (l == 0)
                curl_multi_remove_handle(c->multi, x->easy);
            if (abandoned && x->opaque)
                abandoned(x->opaque);
            xfer_destroy(x);
            x = next;
        }
    }
    conn_xfer_t *x = c->pool;
    while (x) {
        conn_xfer_t *next = x->next;
        xfer_destroy(x);
        x = next;
    }
    curl_multi_cleanup(c->multi);
    pthread_mutex_destroy(&c->mu);
    free(c->slots);
    free(c);
}
