/* tally-fake-tool: a real HTTP tool service (DESIGN.md §6) with switchable faults, for the
 * integration tests, the demo and the benchmark. It stands for an outside service, so it uses
 * no tally code: libmicrohttpd serves HTTP, jansson parses JSON, libcrypto checks signatures.
 *
 * A small pool of threads serves every connection with epoll. A request told to wait (slow,
 * hang) is suspended rather than slept on, so it holds no thread: thousands can wait at once
 * while the pool goes on serving. One timer thread resumes each at its deadline, and SIGTERM
 * resumes them all, so shutdown never waits for a hang to run out. */
#include "fake_faults.h"
#include "fake_sig9421.h"
#include "fake_store.h"

#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAX_BODY            (16u << 20)
#define MAX_COLLECTION      100
#define SIGNATURE_TOLERANCE 300
#define MAX_SECRETS         16
#define POOL_THREADS        2
#define MAX_RFC9421_KEYS    4
#define MAX_CAPTURED        256

typedef struct secret {
    const char *env;
    const char *value;
    size_t len;
} secret_t;

typedef struct server {
    fake_store_t *st;
    fake_faults_t *ff;
    secret_t secrets[MAX_SECRETS];
    size_t nsecrets;
    fake_sig_key_t keys[MAX_RFC9421_KEYS]; /* --rfc9421-key: every one is accepted */
    size_t nkeys;
    /* With RFC 9421 keys: the last MAX_CAPTURED tool requests as received (method, raw URI,
     * every header, body) and the verifier's verdict, for GET /_control/signed. */
    pthread_mutex_t captured_mu;
    json_t *captured;
    bool verbose;
} server_t;

typedef enum op { OP_EXECUTE, OP_STATUS, OP_REVERSE, OP_CONTAIN, OP_LIST } op_t;

static const char *const OP_NAMES[] = {"execute", "status", "reverse", "contain", "list"};

/* One request: its body, gathered over the upload calls, and, while it waits in a fault,
 * what it has done so far. */
typedef struct request {
    char *raw_uri; /* the request target as sent, query included (uri_logged) */
    bool begun;    /* on_request has seen the headers */
    char *body;
    size_t len, cap;
    bool too_large;
    struct timespec started;

    /* waiting: the request is in a wait (the fields below hold its state); parked: it counts
     * in waits.parked (under waits.mu) until it is back in the handler. */
    bool waiting, parked;
    struct MHD_Connection *conn;
    int64_t wake_ns; /* CLOCK_MONOTONIC */
    size_t slot;     /* index in the wait heap while parked */
    fake_fault_t fault;
    op_t op;
    char collection[MAX_COLLECTION + 1];
    const char *key;
    fake_request_info_t info;
    uint64_t seq;
    json_t *json;           /* the parsed body, for the apply after a slow wait */
    fake_list_query_t list; /* a list's query (its strings are MHD's, valid until the end) */
    fake_reply_t reply;     /* the answer already made (apply_then_hang) */
} request_t;

/* ---- requests that wait ------------------------------------------------------------------ */

/* The parked requests, in a min-heap on their deadline, and the thread that resumes them. */
static struct waits {
    pthread_mutex_t mu;
    pthread_cond_t wake; /* CLOCK_MONOTONIC: the earliest deadline changed, or stopping */
    pthread_cond_t idle; /* parked fell to 0 */
    request_t **heap;
    size_t n, cap;
    size_t parked; /* suspended, or resumed and not yet back in the handler */
    bool stopping;
    pthread_t thread;
} waits = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static struct timespec ns_to_timespec(int64_t ns)
{
    return (struct timespec){(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
}

static void heap_set(size_t i, request_t *rq)
{
    waits.heap[i] = rq;
    rq->slot = i;
}

static void heap_up(size_t i)
{
    request_t *rq = waits.heap[i];
    while (i > 0 && waits.heap[(i - 1) / 2]->wake_ns > rq->wake_ns) {
        heap_set(i, waits.heap[(i - 1) / 2]);
        i = (i - 1) / 2;
    }
    heap_set(i, rq);
}

static request_t *heap_pop(void)
{
    request_t *top = waits.heap[0], *last = waits.heap[--waits.n];
    if (waits.n == 0)
        return top;
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= waits.n)
            break;
        if (c + 1 < waits.n && waits.heap[c + 1]->wake_ns < waits.heap[c]->wake_ns)
            c++;
        if (waits.heap[c]->wake_ns >= last->wake_ns)
            break;
        heap_set(i, waits.heap[c]);
        i = c;
    }
    heap_set(i, last);
    return top;
}

/* Suspends the request's connection until delay_ms from now. Called from the handler, the
 * only place MHD allows a suspend. Returns false when it cannot wait (stopping, or out of
 * memory): the caller then answers at once, as a sleep cut short by SIGTERM did. */
static bool park(struct MHD_Connection *conn, request_t *rq, unsigned delay_ms)
{
    pthread_mutex_lock(&waits.mu);
    if (!waits.stopping && waits.n == waits.cap) {
        size_t cap = waits.cap ? waits.cap * 2 : 1024;
        request_t **grown = realloc(waits.heap, cap * sizeof *waits.heap);
        if (grown) {
            waits.heap = grown;
            waits.cap = cap;
        }
    }
    if (waits.stopping || waits.n == waits.cap) {
        pthread_mutex_unlock(&waits.mu);
        return false;
    }
    rq->conn = conn;
    rq->wake_ns = now_ns() + (int64_t)delay_ms * 1000000;
    rq->parked = true;
    waits.parked++;
    waits.heap[waits.n] = rq;
    heap_up(waits.n++);
    MHD_suspend_connection(conn);
    if (rq->slot == 0)
        pthread_cond_signal(&waits.wake);
    pthread_mutex_unlock(&waits.mu);
    return true;
}

/* The request is back in the handler, or ended without coming back (the client went away
 * while it was resumed): it no longer counts as parked. */
static void unpark(request_t *rq)
{
    pthread_mutex_lock(&waits.mu);
    if (rq->parked) {
        rq->parked = false;
        if (--waits.parked == 0)
            pthread_cond_broadcast(&waits.idle);
    }
    pthread_mutex_unlock(&waits.mu);
}

/* The timer thread: resumes each parked request at its deadline, and all of them once the
 * server stops. A parked request cannot end before it is resumed, so its connection is still
 * valid when resumed outside the lock. */
static void *wake_parked(void *arg)
{
    (void)arg;
    struct MHD_Connection *due[256];
    pthread_mutex_lock(&waits.mu);
    for (;;) {
        size_t k = 0;
        int64_t now = now_ns();
        while (waits.n > 0 && k < 256 && (waits.stopping || waits.heap[0]->wake_ns <= now))
            due[k++] = heap_pop()->conn;
        if (k > 0) {
            pthread_mutex_unlock(&waits.mu);
            for (size_t i = 0; i < k; i++)
                MHD_resume_connection(due[i]);
            pthread_mutex_lock(&waits.mu);
            continue;
        }
        if (waits.stopping)
            break;
        if (waits.n == 0) {
            pthread_cond_wait(&waits.wake, &waits.mu);
        } else {
            struct timespec until = ns_to_timespec(waits.heap[0]->wake_ns);
            pthread_cond_timedwait(&waits.wake, &waits.mu, &until);
        }
    }
    pthread_mutex_unlock(&waits.mu);
    return NULL;
}

static bool waits_start(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    bool ok = pthread_cond_init(&waits.wake, &attr) == 0 &&
              pthread_cond_init(&waits.idle, &attr) == 0 &&
              pthread_create(&waits.thread, NULL, wake_parked, NULL) == 0;
    pthread_condattr_destroy(&attr);
    return ok;
}

/* Resumes every parked request and waits, up to 10 s, until each is back in the handler:
 * MHD_stop_daemon must not find a connection suspended. */
static void waits_stop(void)
{
    pthread_mutex_lock(&waits.mu);
    waits.stopping = true;
    pthread_cond_signal(&waits.wake);
    pthread_mutex_unlock(&waits.mu);
    pthread_join(waits.thread, NULL);

    struct timespec until = ns_to_timespec(now_ns() + 10 * (int64_t)1000000000);
    pthread_mutex_lock(&waits.mu);
    while (waits.parked > 0 && pthread_cond_timedwait(&waits.idle, &waits.mu, &until) != ETIMEDOUT)
        ;
    pthread_mutex_unlock(&waits.mu);
}

/* ---- HTTP helpers ------------------------------------------------------------------------ */

/* Queues `r` (its body is handed to MHD) and clears it. */
static enum MHD_Result send_reply(struct MHD_Connection *conn, fake_reply_t *r, const char *allow)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer_with_free_callback(r->len, r->body, &free);
    if (!resp) {
        fake_reply_clear(r);
        return MHD_NO;
    }
    r->body = NULL;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE,
                            r->content_type ? r->content_type : "application/json");
    if (r->replayed)
        MHD_add_response_header(resp, "Idempotent-Replayed", "true");
    if (r->retry_after)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, "1");
    if (allow)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result ret = MHD_queue_response(conn, r->status, resp);
    MHD_destroy_response(resp);
    fake_reply_clear(r);
    return ret;
}

static enum MHD_Result send_error(struct MHD_Connection *conn, unsigned status, const char *msg,
                                  const char *allow)
{
    fake_reply_t r = {0};
    fake_reply_error(&r, status, msg);
    return send_reply(conn, &r, allow);
}

static enum MHD_Result send_json(struct MHD_Connection *conn, unsigned status, json_t *j)
{
    fake_reply_t r = {0};
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!text)
        return send_error(conn, 500, "out of memory", NULL);
    r.status = status;
    r.body = text;
    r.len = strlen(text);
    return send_reply(conn, &r, NULL);
}

static enum MHD_Result send_text(struct MHD_Connection *conn, unsigned status, char *text)
{
    if (!text)
        return send_error(conn, 500, "out of memory", NULL);
    fake_reply_t r = {.status = status, .body = text, .len = strlen(text)};
    return send_reply(conn, &r, NULL);
}

static const char *header(struct MHD_Connection *conn, const char *name)
{
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, name);
    return v && *v ? v : NULL;
}

static double elapsed_ms(const struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - since->tv_sec) * 1e3 +
           (double)(now.tv_nsec - since->tv_nsec) / 1e6;
}

/* ---- signatures -------------------------------------------------------------------------- */

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Checks `Tally-Signature: t=<unix>,v1=<hex>` (several v1 allowed) against every configured
 * secret. Returns NULL when it verifies, else why not. */
static const char *check_signature(const server_t *srv, const char *hdr, const char *body,
                                   size_t len)
{
    if (!hdr)
        return "missing Tally-Signature";
    char t[32] = "";
    unsigned char sigs[4][32];
    size_t nsigs = 0;
    for (const char *p = hdr; *p;) {
        while (*p == ' ' || *p == ',')
            p++;
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        while (n && p[n - 1] == ' ')
            n--;
        if (n > 2 && strncmp(p, "t=", 2) == 0 && n - 2 < sizeof t) {
            memcpy(t, p + 2, n - 2);
            t[n - 2] = '\0';
        } else if (n == 3 + 64 && strncmp(p, "v1=", 3) == 0 && nsigs < 4) {
            bool ok = true;
            for (size_t i = 0; i < 32; i++) {
                int hi = hexval(p[3 + 2 * i]), lo = hexval(p[4 + 2 * i]);
                ok = ok && hi >= 0 && lo >= 0;
                sigs[nsigs][i] = (unsigned char)((hi << 4) | (lo & 0xf));
            }
            nsigs += ok;
        }
        p = end ? end : p + strlen(p);
    }
    if (!*t || strspn(t, "0123456789") != strlen(t) || nsigs == 0)
        return "malformed Tally-Signature";
    long long ts = strtoll(t, NULL, 10);
    long long now = (long long)time(NULL);
    if (ts < now - SIGNATURE_TOLERANCE || ts > now + SIGNATURE_TOLERANCE)
        return "Tally-Signature timestamp outside the tolerance";

    size_t tlen = strlen(t);
    unsigned char *msg = malloc(tlen + 1 + len + 1);
    if (!msg)
        return "out of memory";
    memcpy(msg, t, tlen);
    msg[tlen] = '.';
    if (len)
        memcpy(msg + tlen + 1, body, len);
    bool match = false;
    for (size_t s = 0; s < srv->nsecrets; s++) {
        unsigned char mac[EVP_MAX_MD_SIZE];
        unsigned int maclen = 0;
        if (!HMAC(EVP_sha256(), srv->secrets[s].value, (int)srv->secrets[s].len, msg,
                  tlen + 1 + len, mac, &maclen) ||
            maclen != 32)
            continue;
        for (size_t i = 0; i < nsigs; i++)
            match |= CRYPTO_memcmp(mac, sigs[i], 32) == 0;
    }
    free(msg);
    return match ? NULL : "Tally-Signature does not match";
}

static const char *conn_header(void *ctx, const char *name)
{
    return MHD_lookup_connection_value((struct MHD_Connection *)ctx, MHD_HEADER_KIND, name);
}

static enum MHD_Result collect_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                      const char *value)
{
    (void)kind;
    json_t *h = cls;
    json_t *prev = json_object_get(h, key);
    if (prev && json_is_string(prev)) { /* repeated field: combined as RFC 9110 says */
        char *both = NULL;
        if (asprintf(&both, "%s, %s", json_string_value(prev), value ? value : "") >= 0) {
            json_object_set_new(h, key, json_string(both));
            free(both);
        }
    } else {
        json_object_set_new(h, key, json_string(value ? value : ""));
    }
    return MHD_YES;
}

/* Keeps what the RFC 9421 verifier saw, so a test can replay it (altered) or hand it to an
 * independent verifier. The body goes as base64: it is bytes, not text. */
static void capture(server_t *srv, struct MHD_Connection *conn, const request_t *rq,
                    const char *method, const char *why)
{
    json_t *h = json_object();
    MHD_get_connection_values(conn, MHD_HEADER_KIND, collect_header, h);
    size_t blen = 4 * ((rq->len + 2) / 3) + 1;
    char *b64 = malloc(blen);
    if (b64)
        EVP_EncodeBlock((unsigned char *)b64, (const unsigned char *)(rq->body ? rq->body : ""),
                        (int)rq->len);
    json_t *e =
        json_pack("{s:s, s:s, s:o, s:s?, s:s?}", "method", method, "uri",
                  rq->raw_uri ? rq->raw_uri : "", "headers", h, "body_b64", b64, "refused", why);
    free(b64);
    if (!e)
        return;
    pthread_mutex_lock(&srv->captured_mu);
    if (json_array_size(srv->captured) >= MAX_CAPTURED)
        json_array_remove(srv->captured, 0);
    json_array_append_new(srv->captured, e);
    pthread_mutex_unlock(&srv->captured_mu);
}

/* ---- the tool API ------------------------------------------------------------------------ */

/* "/<collection>", "/<collection>/reverse", "/<collection>/contain" or "/<collection>/list";
 * collection [a-z_]+. Returns the suffix ("", "/reverse", "/contain", "/list") or NULL when the
 * path is none of these. */
static const char *parse_tool_path(const char *url, char *collection, size_t sz)
{
    if (url[0] != '/')
        return NULL;
    size_t n = strspn(url + 1, "abcdefghijklmnopqrstuvwxyz_");
    if (n == 0 || n > MAX_COLLECTION || n >= sz)
        return NULL;
    const char *rest = url + 1 + n;
    if (*rest && strcmp(rest, "/reverse") != 0 && strcmp(rest, "/contain") != 0 &&
        strcmp(rest, "/list") != 0)
        return NULL;
    memcpy(collection, url + 1, n);
    collection[n] = '\0';
    return rest;
}

static void log_line(const server_t *srv, const request_t *rq, const fake_request_info_t *info,
                     unsigned status, const char *fault)
{
    if (!srv->verbose)
        return;
    char now[32];
    fake_now_rfc3339(now, sizeof now);
    json_t *j =
        json_pack("{s:s, s:s, s:s, s:s?, s:s?, s:s?, s:s?, s:i, s:s?, s:f}", "at", now, "method",
                  info->method, "path", info->path, "op", info->op, "collection", info->collection,
                  "idempotency_key", info->idempotency_key, "run_id", info->run_id, "status",
                  (int)status, "fault", fault, "duration_ms", elapsed_ms(&rq->started));
    char *text = j ? json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(6)) : NULL;
    json_decref(j);
    if (text) {
        size_t n = strlen(text);
        text[n] = '\n'; /* replaces the NUL; written with its length, never as a C string */
        ssize_t w = write(STDERR_FILENO, text, n + 1);
        (void)w;
        free(text);
    }
}

/* Applies the operation: validated, fault-free behaviour. */
static void apply(server_t *srv, op_t op, const char *collection, const char *key,
                  const request_t *rq, const fake_request_info_t *info, json_t *body, int copies,
                  const fake_shape_t *shape, fake_reply_t *out)
{
    char contained[MAX_COLLECTION + 16];
    switch (op) {
    case OP_EXECUTE:
        fake_store_execute(srv->st, collection, false, key, rq->body, rq->len, info->run_id,
                           info->effect_id, copies, shape, out);
        break;
    case OP_CONTAIN:
        snprintf(contained, sizeof contained, "%s_containments", collection);
        fake_store_execute(srv->st, contained, true, key, rq->body, rq->len, info->run_id,
                           info->effect_id, copies, shape, out);
        break;
    case OP_STATUS:
        fake_store_status(srv->st, collection, key, out);
        break;
    case OP_REVERSE:
        fake_store_reverse(srv->st, collection, key,
                           json_string_value(json_object_get(body, "external_ref")), body,
                           info->if_match, info->run_id, info->effect_id, out);
        break;
    case OP_LIST:
        fake_store_list(srv->st, collection, &rq->list, out);
        break;
    }
}

/* The query parameters of a list request, as MHD decoded them (percent-escapes, and '+' as a
 * space). */
enum { LIST_SINCE, LIST_RUN_ID, LIST_LIMIT, LIST_CURSOR, LIST_NPARAMS };
static const char *const LIST_PARAMS[LIST_NPARAMS] = {"since", "run_id", "limit", "cursor"};

typedef struct list_args {
    const char *value[LIST_NPARAMS]; /* NULL: not given; "" for "?since" without '=' */
    const char *why;                 /* the first unknown or repeated parameter, or a NUL */
    char *msg;                       /* the caller's buffer for a message naming one */
    size_t msgsz;
} list_args_t;

static enum MHD_Result list_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                                size_t key_size, const char *value, size_t value_size)
{
    list_args_t *a = cls;
    (void)kind;
    if (a->why)
        return MHD_YES;
    size_t i = 0;
    while (i < LIST_NPARAMS && strcmp(key, LIST_PARAMS[i]) != 0)
        i++;
    bool nul = key_size != strlen(key) || (value && value_size != strlen(value));
    if (nul) {
        a->why = "a query parameter holds a NUL byte";
    } else if (i == LIST_NPARAMS) {
        /* named back only when it is short UTF-8: the answer is JSON */
        if (key_size <= 64 && fake_utf8_valid(key))
            snprintf(a->msg, a->msgsz,
                     "unknown query parameter \"%s\" (list takes since or run_id, limit, cursor)",
                     key);
        else
            snprintf(a->msg, a->msgsz,
                     "unknown query parameter (list takes since or run_id, limit, cursor)");
        a->why = a->msg;
    } else if (a->value[i]) {
        snprintf(a->msg, a->msgsz, "query parameter %s given twice", LIST_PARAMS[i]);
        a->why = a->msg;
    } else {
        a->value[i] = value ? value : "";
    }
    return MHD_YES;
}

/* Reads a list request's query into *q (docs/connectors.md, "list"). Returns NULL, or why the
 * query is refused (400): a static string or `msg`. */
static const char *list_query(struct MHD_Connection *conn, fake_list_query_t *q, char *msg,
                              size_t msgsz)
{
    list_args_t a = {.msg = msg, .msgsz = msgsz};
    MHD_get_connection_values_n(conn, MHD_GET_ARGUMENT_KIND, list_arg, &a);
    if (a.why)
        return a.why;
    const char *since = a.value[LIST_SINCE], *run_id = a.value[LIST_RUN_ID];
    const char *limit = a.value[LIST_LIMIT], *cursor = a.value[LIST_CURSOR];
    *q = (fake_list_query_t){.limit = FAKE_LIST_DEFAULT, .cursor = cursor};
    if (since && run_id)
        return "give since or run_id, not both";
    if (!since && !run_id)
        return "since or run_id is required";
    if (since && !fake_rfc3339_ms(since, &q->since_ms))
        return "since must be an RFC 3339 date-time such as 2026-11-26T23:32:27.123Z (a '+' in "
               "the offset sent as %2B)";
    if (run_id && !*run_id)
        return "run_id must not be empty";
    if (run_id && !fake_utf8_valid(run_id))
        return "run_id must be UTF-8";
    q->by_run = run_id != NULL;
    q->run_id = run_id;
    if (limit) {
        /* digits only; any number above the maximum is served as the maximum */
        size_t nd = strspn(limit, "0123456789");
        if (nd == 0 || limit[nd])
            return "limit must be a positive integer";
        unsigned long v = 0;
        for (size_t i = 0; i < nd && v <= FAKE_LIST_MAX; i++)
            v = v * 10 + (unsigned long)(limit[i] - '0');
        if (v == 0)
            return "limit must be a positive integer";
        q->limit = v > FAKE_LIST_MAX ? FAKE_LIST_MAX : (unsigned)v;
    }
    if (cursor && !*cursor)
        return "cursor must not be empty (leave it out for the first page)";
    return NULL;
}

/* Checks what a well-formed request of `op` needs; on success *body is the parsed body (NULL
 * for a status check). Returns an error message otherwise. */
static const char *validate(op_t op, const char *key, const request_t *rq, json_t **body)
{
    *body = NULL;
    if (!key)
        return op == OP_STATUS ? "idempotency_key query parameter is required"
                               : "Idempotency-Key header is required";
    if (op == OP_STATUS)
        return NULL;
    json_error_t jerr;
    *body = rq->len ? json_loadb(rq->body, rq->len, JSON_DECODE_ANY, &jerr) : NULL;
    if (!*body)
        return "request body must be JSON";
    if (op == OP_REVERSE && !json_is_string(json_object_get(*body, "external_ref"))) {
        json_decref(*body);
        *body = NULL;
        return "external_ref (a string) is required";
    }
    return NULL;
}

/* A record keeps its key, run id and effect id, and shows them as JSON strings: one that is not
 * UTF-8 is refused before anything is applied. Returns the error message, or NULL. */
static const char *not_utf8(op_t op, const char *key, const fake_request_info_t *info)
{
    if (key && !fake_utf8_valid(key))
        return op == OP_STATUS ? "the idempotency_key query parameter must be UTF-8"
                               : "the Idempotency-Key header must be UTF-8";
    if (info->run_id && !fake_utf8_valid(info->run_id))
        return "the Tally-Run-Id header must be UTF-8";
    if (info->effect_id && !fake_utf8_valid(info->effect_id))
        return "the Tally-Effect-Id header must be UTF-8";
    return NULL;
}

/* The end of every tool request: log it and send `r` (or, for drop_connection, nothing). */
static enum MHD_Result answer(server_t *srv, struct MHD_Connection *conn, const request_t *rq,
                              const fake_request_info_t *info, uint64_t seq, fake_fault_kind_t kind,
                              fake_reply_t *r)
{
    const char *fault = fake_fault_name(kind);
    if (kind == FAKE_FAULT_DROP_CONNECTION) {
        fake_store_log_end(srv->st, seq, 0, fault);
        log_line(srv, rq, info, 0, fault);
        fake_reply_clear(r);
        return MHD_NO; /* MHD closes the socket without an answer */
    }
    fake_store_log_end(srv->st, seq, r->status, fault);
    log_line(srv, rq, info, r->status, fault);
    return send_reply(conn, r, NULL);
}

/* The hostile answers: a 2xx answer `r` (the record) made indigestible as fault `f` says.
 * Other answers (a 422 for a reused key) are left alone. */
static void spoil_answer(const fake_fault_t *f, fake_reply_t *r)
{
    if (r->status < 200 || r->status > 299 || !r->body || r->len == 0)
        return;
    if (f->kind == FAKE_FAULT_RECEIPT_NOT_JSON) {
        fake_reply_clear(r);
        fake_reply_raw(r, f->status,
                       "<html><body><h1>Created</h1><p>Your request was "
                       "accepted.</p></body></html>\n");
        r->content_type = "text/html; charset=utf-8";
        return;
    }
    /* receipt_not_utf8: the record with one more member whose string is Latin-1 ("café",
     * 0xE9) and two bytes that never occur in UTF-8 */
    static const char extra[] = ",\"note\":\"caf\xe9 \xff\xfe\"}";
    char *grown = realloc(r->body, r->len - 1 + sizeof extra);
    if (!grown)
        return;
    memcpy(grown + r->len - 1, extra, sizeof extra); /* replaces the closing '}' */
    r->body = grown;
    r->len = r->len - 1 + sizeof extra - 1;
    r->status = f->status;
}

/* A request whose wait is over (or cut short) does what follows the wait: slow applies,
 * hang_before_apply refuses, apply_then_hang sends the answer it made before waiting. */
static enum MHD_Result finish_wait(server_t *srv, struct MHD_Connection *conn, request_t *rq)
{
    unpark(rq);
    rq->waiting = false;
    fake_reply_t r = rq->reply;
    rq->reply = (fake_reply_t){0};
    if (rq->fault.kind == FAKE_FAULT_SLOW) {
        apply(srv, rq->op, rq->collection, rq->key, rq, &rq->info, rq->json, 1, NULL, &r);
    } else if (rq->fault.kind == FAKE_FAULT_HANG_BEFORE_APPLY) {
        fake_reply_error(&r, rq->fault.status, "timed out before applying");
        r.retry_after = true;
    }
    json_decref(rq->json);
    rq->json = NULL;
    return answer(srv, conn, rq, &rq->info, rq->seq, rq->fault.kind, &r);
}

static enum MHD_Result handle_tool(server_t *srv, struct MHD_Connection *conn, request_t *rq,
                                   const char *method, const char *url, const char *collection,
                                   const char *suffix)
{
    op_t op;
    const char *allow = NULL;
    if (*suffix == '\0' && strcmp(method, "POST") == 0)
        op = OP_EXECUTE;
    else if (*suffix == '\0' && strcmp(method, "GET") == 0)
        op = OP_STATUS;
    else if (strcmp(suffix, "/reverse") == 0 && strcmp(method, "POST") == 0)
        op = OP_REVERSE;
    else if (strcmp(suffix, "/contain") == 0 && strcmp(method, "POST") == 0)
        op = OP_CONTAIN;
    else if (strcmp(suffix, "/list") == 0 && strcmp(method, "GET") == 0)
        op = OP_LIST;
    else
        allow = strcmp(suffix, "/list") == 0 ? "GET" : *suffix ? "POST" : "GET, POST";
    if (allow)
        return send_error(conn, 405, "method not allowed", allow);

    /* A status check names its key in the query; the header, sent on every request, is what
     * the request log shows when present. */
    const char *key_header = header(conn, "Idempotency-Key");
    const char *key = key_header;
    if (op == OP_STATUS) {
        const char *q = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "idempotency_key");
        key = q && *q ? q : NULL;
    } else if (op == OP_LIST) {
        key = NULL; /* a list asks about no key; rules select it with key "*" */
    }
    const char *sig_error = NULL;
    if (srv->nsecrets)
        sig_error = check_signature(srv, header(conn, "Tally-Signature"), rq->body, rq->len);
    char why9421[256];
    if (srv->nkeys) {
        fake_sig_request_t sr = {
            method, rq->raw_uri ? rq->raw_uri : url, rq->body, rq->len, conn_header, conn};
        const char *e = fake_sig9421_verify(srv->keys, srv->nkeys, &sr, (long long)time(NULL),
                                            why9421, sizeof why9421);
        capture(srv, conn, rq, method, e);
        if (!sig_error)
            sig_error = e;
    }
    fake_request_info_t info = {
        .method = method,
        .path = url,
        .op = OP_NAMES[op],
        .collection = collection,
        .idempotency_key = key_header ? key_header : key,
        .run_id = header(conn, "Tally-Run-Id"),
        .effect_id = header(conn, "Tally-Effect-Id"),
        .traceparent = header(conn, "traceparent"),
        .if_match = header(conn, "If-Match"),
        .signature_ok = srv->nsecrets || srv->nkeys ? sig_error == NULL : -1,
    };
    uint64_t seq = fake_store_log_begin(srv->st, &info);
    fake_reply_t r = {0};
    json_t *body = NULL;
    const char *why;
    char why_list[160];
    fake_fault_t f = {FAKE_FAULT_NONE, 0, 0, 0};

    if (sig_error) {
        fake_reply_error(&r, 401, sig_error);
    } else if (rq->too_large) {
        fake_reply_error(&r, 413, "request body too large");
    } else if ((why = not_utf8(op, key, &info)) ||
               (why = op == OP_LIST ? list_query(conn, &rq->list, why_list, sizeof why_list)
                                    : validate(op, key, rq, &body))) {
        fake_reply_error(&r, 400, why);
    } else {
        f = fake_faults_take(srv->ff, collection, OP_NAMES[op], key);
        switch (f.kind) {
        case FAKE_FAULT_SLOW:
        case FAKE_FAULT_HANG_BEFORE_APPLY:
        case FAKE_FAULT_APPLY_THEN_HANG:
            if (f.kind == FAKE_FAULT_APPLY_THEN_HANG)
                apply(srv, op, collection, key, rq, &info, body, 1, NULL, &r);
            rq->waiting = true;
            rq->fault = f;
            rq->op = op;
            snprintf(rq->collection, sizeof rq->collection, "%s", collection);
            rq->key = key;
            rq->info = info;
            rq->info.collection = rq->collection;
            rq->seq = seq;
            rq->json = body;
            rq->reply = r;
            if (park(conn, rq, f.delay_ms))
                return MHD_YES;
            return finish_wait(srv, conn, rq);
        case FAKE_FAULT_REFUSE_503:
        case FAKE_FAULT_REFUSE_429:
            fake_reply_error(&r, f.status, "refused, try again later");
            r.retry_after = true;
            break;
        case FAKE_FAULT_ERROR_4XX:
            fake_reply_error(&r, f.status, "injected client error");
            break;
        case FAKE_FAULT_REVERSE_412:
            fake_reply_error(&r, f.status, "precondition failed");
            break;
        case FAKE_FAULT_REVERSE_409:
            fake_reply_error(&r, f.status, "a request with this key is in progress");
            break;
        case FAKE_FAULT_REVERSE_500:
        case FAKE_FAULT_STATUS_500:
            fake_reply_error(&r, f.status, "injected server error");
            break;
        case FAKE_FAULT_STATUS_GARBAGE:
            fake_reply_raw(&r, f.status, "[{\"id\": \"garbage");
            break;
        case FAKE_FAULT_FAIL_AFTER_APPLY:
            apply(srv, op, collection, key, rq, &info, body, 1, NULL, &r);
            fake_reply_clear(&r);
            fake_reply_error(&r, f.status,
                             f.status >= 500 ? "injected server error after applying"
                                             : "injected client error after applying");
            break;
        case FAKE_FAULT_APPLY_TWICE:
            apply(srv, op, collection, key, rq, &info, body, 2, NULL, &r);
            if (f.status >= 300) { /* the answer lost (5xx) or taken for a failure (4xx) */
                fake_reply_clear(&r);
                fake_reply_error(&r, f.status,
                                 f.status >= 500 ? "injected server error after applying twice"
                                                 : "injected client error after applying twice");
            } else if (r.status == 201) { /* a duplicate behind a success: the first record */
                r.status = f.status;
            }
            break;
        case FAKE_FAULT_HUGE_ID:
        case FAKE_FAULT_ETAG_VERSION: {
            fake_shape_t shape = {
                .id_bytes = f.kind == FAKE_FAULT_HUGE_ID ? f.size : 0,
                .etag_bytes = f.kind == FAKE_FAULT_ETAG_VERSION ? f.size : 0,
            };
            apply(srv, op, collection, key, rq, &info, body, 1, &shape, &r);
            break;
        }
        case FAKE_FAULT_RECEIPT_NOT_UTF8:
        case FAKE_FAULT_RECEIPT_NOT_JSON:
            apply(srv, op, collection, key, rq, &info, body, 1, NULL, &r);
            spoil_answer(&f, &r);
            break;
        case FAKE_FAULT_DROP_CONNECTION:
        case FAKE_FAULT_NONE:
            apply(srv, op, collection, key, rq, &info, body, 1, NULL, &r);
            break;
        }
    }
    json_decref(body);
    return answer(srv, conn, rq, &info, seq, f.kind, &r);
}

/* ---- the control API (for tests; not part of DESIGN.md) ---------------------------------- */

static enum MHD_Result handle_control(server_t *srv, struct MHD_Connection *conn,
                                      const request_t *rq, const char *method, const char *url)
{
    bool get = strcmp(method, "GET") == 0, post = strcmp(method, "POST") == 0;
    if (strcmp(url, "/_control/faults") == 0) {
        if (strcmp(method, "DELETE") == 0) {
            fake_faults_clear(srv->ff);
            return send_json(conn, 200, json_pack("{s:b}", "cleared", 1));
        }
        if (get)
            return send_json(conn, 200, json_pack("{s:o}", "faults", fake_faults_list(srv->ff)));
        if (!post)
            return send_error(conn, 405, "method not allowed", "GET, POST, DELETE");
        json_error_t jerr;
        json_t *rule = json_loadb(rq->body ? rq->body : "", rq->len, 0, &jerr);
        char err[256];
        json_t *added = rule ? fake_faults_add(srv->ff, rule, err, sizeof err) : NULL;
        if (!rule)
            snprintf(err, sizeof err, "the rule must be a JSON object: %.160s", jerr.text);
        json_decref(rule);
        return added ? send_json(conn, 201, added) : send_error(conn, 400, err, NULL);
    }
    if (strcmp(url, "/_control/records") == 0) {
        if (!get)
            return send_error(conn, 405, "method not allowed", "GET");
        const char *c = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "collection");
        return send_text(conn, 200, fake_store_dump(srv->st, c && *c ? c : NULL));
    }
    if (strcmp(url, "/_control/requests") == 0) {
        if (!get)
            return send_error(conn, 405, "method not allowed", "GET");
        return send_text(conn, 200, fake_store_requests(srv->st));
    }
    if (strcmp(url, "/_control/signed") == 0) {
        if (!get)
            return send_error(conn, 405, "method not allowed", "GET");
        pthread_mutex_lock(&srv->captured_mu);
        json_t *copy = json_deep_copy(srv->captured);
        pthread_mutex_unlock(&srv->captured_mu);
        return send_json(conn, 200, json_pack("{s:o}", "requests", copy ? copy : json_array()));
    }
    if (strcmp(url, "/_control/reset") == 0) {
        if (!post)
            return send_error(conn, 405, "method not allowed", "POST");
        fake_faults_clear(srv->ff);
        fake_store_reset(srv->st);
        pthread_mutex_lock(&srv->captured_mu);
        json_array_clear(srv->captured);
        pthread_mutex_unlock(&srv->captured_mu);
        return send_json(conn, 200, json_pack("{s:b}", "reset", 1));
    }
    return send_error(conn, 404, "no such control endpoint", NULL);
}

/* ---- MHD callbacks ----------------------------------------------------------------------- */

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    server_t *srv = cls;
    request_t *rq = *con_cls;
    (void)version;
    if (!rq || !rq->begun) {
        if (!rq) {
            rq = calloc(1, sizeof *rq);
            if (!rq)
                return MHD_NO;
            clock_gettime(CLOCK_MONOTONIC, &rq->started);
            *con_cls = rq;
        }
        rq->begun = true;
        return MHD_YES;
    }
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        if (rq->too_large || rq->len + n > MAX_BODY) {
            rq->too_large = true;
            return MHD_YES;
        }
        if (rq->len + n + 1 > rq->cap) {
            size_t cap = rq->cap ? rq->cap : 4096;
            while (cap < rq->len + n + 1)
                cap *= 2;
            char *grown = realloc(rq->body, cap);
            if (!grown)
                return MHD_NO;
            rq->body = grown;
            rq->cap = cap;
        }
        memcpy(rq->body + rq->len, upload_data, n);
        rq->len += n;
        rq->body[rq->len] = '\0';
        return MHD_YES;
    }

    if (rq->waiting)
        return finish_wait(srv, conn, rq);
    if (strncmp(url, "/_control", 9) == 0 && (url[9] == '/' || url[9] == '\0'))
        return handle_control(srv, conn, rq, method, url);
    char collection[MAX_COLLECTION + 1];
    const char *suffix = parse_tool_path(url, collection, sizeof collection);
    if (!suffix)
        return send_error(conn, 404, "not found", NULL);
    return handle_tool(srv, conn, rq, method, url, collection, suffix);
}

/* MHD's URI log callback: the first to see a request, with its target as sent (MHD hands
 * on_request the path only, the query already decoded). Its result becomes *con_cls. */
static void *uri_logged(void *cls, const char *uri, struct MHD_Connection *conn)
{
    (void)cls;
    (void)conn;
    request_t *rq = calloc(1, sizeof *rq);
    if (!rq)
        return NULL;
    clock_gettime(CLOCK_MONOTONIC, &rq->started);
    rq->raw_uri = strdup(uri ? uri : "");
    return rq;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    request_t *rq = *con_cls;
    (void)cls;
    (void)conn;
    (void)toe;
    if (rq) {
        unpark(rq);
        json_decref(rq->json);
        fake_reply_clear(&rq->reply);
        free(rq->raw_uri);
        free(rq->body);
        free(rq);
        *con_cls = NULL;
    }
}

/* ---- startup ----------------------------------------------------------------------------- */

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tally-fake-tool [--listen HOST:PORT] [--port-file PATH] [--secret-env VAR]...\n"
            "                       [--verbose]\n"
            "A tool service speaking tally's HTTP connector protocol, with switchable faults.\n"
            "  --listen HOST:PORT  address to serve (default 127.0.0.1:0; port 0 picks one)\n"
            "  --port-file PATH    write the bound port there (atomically) once ready\n"
            "  --secret-env VAR    require Tally-Signature made with the secret in $VAR\n"
            "                      (repeatable; any configured secret is accepted)\n"
            "  --rfc9421-key ID=VAR  require an RFC 9421 signature (label \"tally\",\n"
            "                      hmac-sha256) by key id ID with the key in $VAR (repeatable:\n"
            "                      every configured key id is accepted, for rotations)\n"
            "  --verbose           log one JSON line per request on stderr\n"
            "Tool API, for any collection C: POST /C (execute), GET /C?idempotency_key=K\n"
            "(status), GET /C/list?since=RFC3339|run_id=R[&limit=N][&cursor=X] (list),\n"
            "POST /C/reverse, POST /C/contain (records in C_containments).\n"
            "Faults: POST /_control/faults {\"fault\", \"collection\", \"op\", \"key\",\n"
            "\"times\", \"delay_ms\", \"status\", \"size\"}; op: execute, status, reverse,\n"
            "contain, list or *. For example:\n"
            "  apply_twice         execute/contain: two records for one key, then\n"
            "                      answer \"status\": 2xx (default 201) with the first\n"
            "                      record, or 4xx/5xx with an error\n"
            "  fail_after_apply    apply once, then answer \"status\" (400-599, default 500)\n"
            "Every fault and the control API: tests/fakes/README.md.\n");
}

static bool parse_listen(const char *arg, struct sockaddr_in *sa, char *host, size_t hostsz)
{
    const char *colon = strrchr(arg, ':');
    const char *port = colon ? colon + 1 : arg;
    size_t hl = colon ? (size_t)(colon - arg) : 0;
    if (hl >= hostsz)
        return false;
    memcpy(host, arg, hl);
    host[hl] = '\0';
    if (!*host)
        snprintf(host, hostsz, "127.0.0.1");
    char *end;
    long p = strtol(port, &end, 10);
    if (!*port || *end || p < 0 || p > 65535)
        return false;
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)p);
    return inet_pton(AF_INET, host, &sa->sin_addr) == 1;
}

static bool write_port_file(const char *path, unsigned port)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp)
        return false;
    FILE *f = fopen(tmp, "w");
    if (!f)
        return false;
    bool ok = fprintf(f, "%u\n", port) > 0;
    ok = fclose(f) == 0 && ok;
    if (ok && rename(tmp, path) == 0)
        return true;
    unlink(tmp);
    return false;
}

/* Raises the soft open-files limit to the hard one; returns the limit now in force. */
static rlim_t raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return 1024;
    rlim_t want = rl.rlim_max == RLIM_INFINITY ? 1048576 : rl.rlim_max;
    if (rl.rlim_cur < want) {
        rlim_t old = rl.rlim_cur;
        rl.rlim_cur = want;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            return old;
    }
    return rl.rlim_cur;
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"listen", required_argument, NULL, 'l'},
        {"port-file", required_argument, NULL, 'p'},
        {"secret-env", required_argument, NULL, 's'},
        {"rfc9421-key", required_argument, NULL, 'k'},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    static server_t srv;
    const char *listen_arg = "127.0.0.1:0", *port_file = NULL;
    int c;
    srv.captured = json_array();
    pthread_mutex_init(&srv.captured_mu, NULL);
    while ((c = getopt_long(argc, argv, "l:p:s:k:vh", opts, NULL)) != -1) {
        switch (c) {
        case 'l':
            listen_arg = optarg;
            break;
        case 'p':
            port_file = optarg;
            break;
        case 's': {
            if (srv.nsecrets == MAX_SECRETS) {
                fprintf(stderr, "tally-fake-tool: at most %d --secret-env\n", MAX_SECRETS);
                return 2;
            }
            const char *v = getenv(optarg);
            if (v && *v)
                srv.secrets[srv.nsecrets++] = (secret_t){optarg, v, strlen(v)};
            else
                fprintf(stderr, "tally-fake-tool: $%s is not set; not required\n", optarg);
            break;
        }
        case 'k': {
            char *eq = strchr(optarg, '=');
            if (!eq || eq == optarg || !eq[1] || srv.nkeys == MAX_RFC9421_KEYS) {
                fprintf(stderr, "tally-fake-tool: --rfc9421-key wants ID=ENVVAR (at most %d)\n",
                        MAX_RFC9421_KEYS);
                return 2;
            }
            *eq = '\0';
            const char *v = getenv(eq + 1);
            if (!v || !*v) {
                fprintf(stderr, "tally-fake-tool: $%s (key %s) is not set\n", eq + 1, optarg);
                return 2;
            }
            srv.keys[srv.nkeys++] = (fake_sig_key_t){optarg, v, strlen(v)};
            break;
        }
        case 'v':
            srv.verbose = true;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        usage(stderr);
        return 2;
    }
    struct sockaddr_in sa;
    char host[64];
    if (!parse_listen(listen_arg, &sa, host, sizeof host)) {
        fprintf(stderr, "tally-fake-tool: --listen wants IPV4:PORT, got \"%s\"\n", listen_arg);
        return 2;
    }

    /* Signals are taken by sigwait() in this thread; every thread started later inherits
     * the mask, so none of them is interrupted. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    rlim_t nofile = raise_nofile();
    unsigned limit = nofile > 128 ? (unsigned)(nofile - 64 < 1000000 ? nofile - 64 : 1000000) : 64;
    srv.st = fake_store_new();
    srv.ff = fake_faults_new();
    if (!srv.st || !srv.ff) {
        fprintf(stderr, "tally-fake-tool: out of memory\n");
        return 1;
    }
    if (!waits_start()) {
        fprintf(stderr, "tally-fake-tool: cannot start the timer thread\n");
        fake_store_free(srv.st);
        fake_faults_free(srv.ff);
        return 1;
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME;
    if (srv.verbose)
        flags |= MHD_USE_ERROR_LOG;
    struct MHD_Daemon *d = MHD_start_daemon(
        flags, 0, NULL, NULL, &on_request, &srv, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
        MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)300,
        MHD_OPTION_LISTEN_BACKLOG_SIZE, (unsigned)4096, MHD_OPTION_THREAD_POOL_SIZE,
        (unsigned)POOL_THREADS, MHD_OPTION_NOTIFY_COMPLETED, &on_completed, NULL,
        MHD_OPTION_URI_LOG_CALLBACK, &uri_logged, NULL, MHD_OPTION_END);
    if (!d) {
        int err = errno;
        waits_stop();
        fprintf(stderr, "tally-fake-tool: cannot listen on %s: %s\n", listen_arg, strerror(err));
        fake_store_free(srv.st);
        fake_faults_free(srv.ff);
        return 1;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    unsigned port = info ? info->port : ntohs(sa.sin_port);
    printf("listening on http://%s:%u\n", host, port);
    fflush(stdout);
    if (srv.verbose)
        fprintf(stderr,
                "{\"msg\":\"listening\",\"port\":%u,\"connection_limit\":%u,\"secrets\":%zu}\n",
                port, limit, srv.nsecrets);
    int rc = 0;
    if (port_file && !write_port_file(port_file, port)) {
        fprintf(stderr, "tally-fake-tool: cannot write %s: %s\n", port_file, strerror(errno));
        rc = 1;
    }
    while (rc == 0) {
        int sig;
        if (sigwait(&sigs, &sig) == 0)
            break;
    }
    waits_stop();
    MHD_stop_daemon(d);
    fake_store_free(srv.st);
    fake_faults_free(srv.ff);
    return rc;
}
