/* connector.c — the HTTP connector engine (libcurl multi) and DESIGN §6 classification. */
#include "tally/connector.h"

#if LIBCURL_VERSION_NUM < 0x075000
#error "tally needs libcurl 7.80 or newer (CURLOPT_PREREQFUNCTION, see on_prereq)"
#endif

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <openssl/evp.h>
#include <openssl/params.h>

#include "tally/json.h"
#include "tally/log.h"
#include "tally/text.h"

#ifndef TALLY_VERSION
#define TALLY_VERSION "0"
#endif

/* Reused response buffers larger than this are released instead of pooled. */
#define CONN_POOL_BUF_MAX (64 * 1024)
/* A Retry-After longer than a day is a tool bug; cap it. */
#define CONN_RETRY_AFTER_MAX_MS (24L * 3600L * 1000L)

const char *tally_conn_op_name(tally_conn_op_t op)
{
    switch (op) {
    case TALLY_CONN_EXECUTE:
        return "execute";
    case TALLY_CONN_STATUS:
        return "status";
    case TALLY_CONN_COMPENSATE:
        return "compensate";
    case TALLY_CONN_CONTAIN:
        return "contain";
    }
    return "?";
}

const char *tally_verdict_name(tally_verdict_t v)
{
    switch (v) {
    case TALLY_VERDICT_CONFIRMED:
        return "confirmed";
    case TALLY_VERDICT_FAILED:
        return "failed";
    case TALLY_VERDICT_RETRY:
        return "retry";
    case TALLY_VERDICT_UNKNOWN:
        return "unknown";
    case TALLY_VERDICT_NOT_FOUND:
        return "not_found";
    case TALLY_VERDICT_FOUND:
        return "found";
    case TALLY_VERDICT_DUPLICATE:
        return "duplicate";
    case TALLY_VERDICT_INCONCLUSIVE:
        return "inconclusive";
    case TALLY_VERDICT_RESOLVED:
        return "resolved";
    case TALLY_VERDICT_STUCK:
        return "stuck";
    }
    return "?";
}

/* ---------------------------------------------------------------------------------------- */
/* Classification (pure)                                                                    */

static void verdict_set(tally_conn_verdict_t *out, tally_verdict_t v, const char *code,
                        const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static void verdict_set(tally_conn_verdict_t *out, tally_verdict_t v, const char *code,
                        const char *fmt, ...)
{
    out->verdict = v;
    snprintf(out->code, sizeof out->code, "%s", code);
    va_list ap;
    va_start(ap, fmt);
    tally_vfmt(out->message, sizeof out->message, fmt, ap); /* valid UTF-8, cut whole */
    va_end(ap);
}

static void verdict_init(const tally_conn_result_t *res, tally_conn_verdict_t *out)
{
    memset(out, 0, sizeof *out);
    out->retry_after_ms = res->retry_after_ms;
}

static const char *curl_msg(const tally_conn_result_t *res)
{
    if (res->curl_error && res->curl_error[0])
        return res->curl_error;
    return curl_easy_strerror((CURLcode)res->curl_code);
}

/* The request left but no status line came back: name what the transport saw. */
static void verdict_no_answer(const tally_conn_result_t *res, tally_conn_verdict_t *out,
                              tally_verdict_t v)
{
    const char *code = "no_response";
    switch ((CURLcode)res->curl_code) {
    case CURLE_OPERATION_TIMEDOUT:
        code = "timeout";
        break;
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
        code = "connection_reset";
        break;
    case CURLE_GOT_NOTHING:
        code = "empty_reply";
        break;
    default:
        break;
    }
    verdict_set(out, v, code, "%s %s: the request was sent but no answer came back: %s",
                res->method ? res->method : "?", res->url ? res->url : "?", curl_msg(res));
}

static bool status_refused_unprocessed(long s)
{
    return s == 408 || s == 425 || s == 429 || s == 503;
}

void tally_conn_classify_execute(const tally_conn_result_t *res, tally_conn_verdict_t *out)
{
    verdict_init(res, out);
    long s = res->http_status;
    if (!res->sent) {
        verdict_set(out, TALLY_VERDICT_RETRY, "not_sent",
                    "the request was not sent (nothing reached the tool): %s", curl_msg(res));
        return;
    }
    if (s == 0) {
        verdict_no_answer(res, out, TALLY_VERDICT_UNKNOWN);
        return;
    }
    char code[32];
    snprintf(code, sizeof code, "http_%ld", s);
    if (s >= 200 && s < 300) {
        if (res->curl_code != CURLE_OK) {
            verdict_set(out, TALLY_VERDICT_UNKNOWN, "incomplete_body",
                        "HTTP %ld but the response body did not arrive whole (%s): the effect "
                        "happened and its receipt must be fetched with a status check",
                        s, curl_msg(res));
            return;
        }
        verdict_set(out, TALLY_VERDICT_CONFIRMED, code, "HTTP %ld", s);
        return;
    }
    if (status_refused_unprocessed(s)) {
        verdict_set(out, TALLY_VERDICT_RETRY, code,
                    "HTTP %ld: the tool refused the request without applying it", s);
        return;
    }
    if (s == 409) {
        out->in_progress = true;
        verdict_set(out, TALLY_VERDICT_RETRY, code,
                    "HTTP 409: a request with the same idempotency key is still in progress");
        return;
    }
    if (s == 401 || s == 403) {
        out->alert_owner = true;
        verdict_set(out, TALLY_VERDICT_FAILED, code,
                    "HTTP %ld: the tool refused tally's credentials", s);
        return;
    }
    if (s >= 400 && s < 500) {
        verdict_set(out, TALLY_VERDICT_FAILED, code, "HTTP %ld: the tool rejected the request", s);
        return;
    }
    verdict_set(out, TALLY_VERDICT_UNKNOWN, code,
                "HTTP %ld after the request was sent: the effect may or may not have happened", s);
}

void tally_conn_classify_status(const tally_conn_result_t *res, tally_conn_verdict_t *out)
{
    verdict_init(res, out);
    long s = res->http_status;
    if (!res->sent) {
        verdict_set(out, TALLY_VERDICT_INCONCLUSIVE, "not_sent",
                    "the status check was not sent: %s", curl_msg(res));
        return;
    }
    if (s == 0) {
        verdict_no_answer(res, out, TALLY_VERDICT_INCONCLUSIVE);
        return;
    }
    if (s != 200) {
        char code[32];
        snprintf(code, sizeof code, "http_%ld", s);
        verdict_set(out, TALLY_VERDICT_INCONCLUSIVE, code, "status check answered HTTP %ld", s);
        return;
    }
    if (res->curl_code != CURLE_OK || res->body_truncated) {
        verdict_set(out, TALLY_VERDICT_INCONCLUSIVE, "incomplete_body",
                    "status check answered 200 but its body was incomplete or over %zu bytes",
                    res->body_len);
        return;
    }
    json_error_t jerr;
    json_t *doc = json_loadb(res->body ? res->body : "", res->body_len,
                             TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, &jerr);
    if (!doc || !json_is_array(doc)) {
        verdict_set(out, TALLY_VERDICT_INCONCLUSIVE, "not_an_array",
                    "status check answered 200 without a JSON array%s%s", doc ? "" : ": ",
                    doc ? "" : jerr.text);
        json_decref(doc);
        return;
    }
    out->n_records = json_array_size(doc);
    json_decref(doc);
    if (out->n_records == 0)
        verdict_set(out, TALLY_VERDICT_NOT_FOUND, "not_found",
                    "no upstream record carries the key");
    else if (out->n_records == 1)
        verdict_set(out, TALLY_VERDICT_FOUND, "found", "one upstream record carries the key");
    else
        verdict_set(out, TALLY_VERDICT_DUPLICATE, "duplicate", "%zu upstream records carry the key",
                    out->n_records);
}

void tally_conn_classify_compensate(const tally_conn_result_t *res, tally_conn_verdict_t *out)
{
    verdict_init(res, out);
    long s = res->http_status;
    if (!res->sent) {
        verdict_set(out, TALLY_VERDICT_RETRY, "not_sent", "the reverse call was not sent: %s",
                    curl_msg(res));
        return;
    }
    if (s == 0) {
        verdict_no_answer(res, out, TALLY_VERDICT_RETRY);
        return;
    }
    char code[32];
    snprintf(code, sizeof code, "http_%ld", s);
    if (s >= 200 && s < 300) {
        verdict_set(out, TALLY_VERDICT_RESOLVED, code, "HTTP %ld", s);
        return;
    }
    if (s == 404) {
        verdict_set(out, TALLY_VERDICT_RESOLVED, "already_reversed",
                    "HTTP 404: the external ref is already reversed or gone");
        return;
    }
    if (s == 412) {
        verdict_set(out, TALLY_VERDICT_STUCK, "stale_state",
                    "HTTP 412: the resource changed since tally touched it (If-Match failed); "
                    "not overwriting");
        return;
    }
    if (s == 409) {
        out->in_progress = true;
        verdict_set(out, TALLY_VERDICT_RETRY, code,
                    "HTTP 409: the same reverse key is still in progress");
        return;
    }
    if (status_refused_unprocessed(s)) {
        verdict_set(out, TALLY_VERDICT_RETRY, code,
                    "HTTP %ld: the tool refused the reverse call without applying it", s);
        return;
    }
    if (s >= 400 && s < 500) {
        verdict_set(out, TALLY_VERDICT_STUCK, code, "HTTP %ld: the tool rejected the reverse call",
                    s);
        return;
    }
    verdict_set(out, TALLY_VERDICT_RETRY, code, "HTTP %ld from the reverse call", s);
}

/* ---------------------------------------------------------------------------------------- */
/* Receipts, refs, excerpts                                                                 */

static json_t *base64_string(const char *data, size_t len)
{
    if (len > (size_t)INT_MAX / 2)
        return NULL;
    size_t outlen = 4 * ((len + 2) / 3) + 1;
    unsigned char *out = malloc(outlen);
    if (!out)
        return NULL;
    int n = EVP_EncodeBlock(out, (const unsigned char *)data, (int)len);
    json_t *s = n >= 0 ? json_stringn((const char *)out, (size_t)n) : NULL;
    free(out);
    return s;
}

/* How much of the body an excerpt keeps (cut back to a character boundary so a multi-byte
 * character is not split), and whether that part can be kept as text. */
static size_t excerpt_cut(const char *body, size_t len, size_t max, bool *text)
{
    size_t n = len < max ? len : max;
    if (n < len)
        while (n > 0 && ((unsigned char)body[n] & 0xC0) == 0x80)
            n--;
    *text = n == 0 || (memchr(body, '\0', n) == NULL && tally_utf8_valid(body, n));
    return n;
}

json_t *tally_conn_excerpt(const char *body, size_t len, size_t max)
{
    if (!body)
        len = 0;
    bool text;
    size_t n = excerpt_cut(body, len, max, &text);
    json_t *o = json_object();
    if (!o)
        return NULL;
    json_t *v = text ? json_stringn(n ? body : "", n) : base64_string(body, n);
    if (!v || json_object_set_new(o, text ? "text" : "base64", v) != 0) {
        json_decref(o);
        return NULL;
    }
    if (n < len) {
        if (json_object_set_new(o, "truncated", json_true()) != 0 ||
            json_object_set_new(o, "bytes", json_integer((json_int_t)len)) != 0) {
            json_decref(o);
            return NULL;
        }
    }
    return o;
}

void tally_conn_excerpt_text(tally_jtext_t *j, const char *key, const char *body, size_t len,
                             size_t max)
{
    if (!body)
        len = 0;
    bool text;
    size_t n = excerpt_cut(body, len, max, &text);
    if (!text) { /* binary: the jansson form, base64 and all (rare) */
        json_t *o = tally_conn_excerpt(body, len, max);
        if (!o)
            j->failed = true;
        tally_jtext_value(j, key, o);
        json_decref(o);
        return;
    }
    tally_jtext_begin(j, key);
    tally_jtext_strn(j, "text", body, n);
    if (n < len) {
        tally_jtext_bool(j, "truncated", true);
        tally_jtext_int(j, "bytes", (long long)len);
    }
    tally_jtext_end(j);
}

static bool has_nul_escape(const char *s, size_t len)
{
    static const char pat[] = "\\u0000";
    if (len < sizeof pat - 1)
        return false;
    for (size_t i = 0; i + sizeof pat - 1 <= len; i++)
        if (s[i] == '\\' && memcmp(s + i, pat, sizeof pat - 1) == 0)
            return true;
    return false;
}

json_t *tally_conn_receipt(const tally_conn_result_t *res)
{
    const char *body = res->body ? res->body : "";
    json_t *doc = NULL;
    /* jsonb refuses U+0000: such a body is kept as an excerpt, never parsed into the receipt. */
    bool parseable =
        res->curl_code == CURLE_OK && !res->body_truncated && !has_nul_escape(body, res->body_len);
    if (parseable)
        doc = json_loadb(body, res->body_len, TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, NULL);
    if (doc && json_is_object(doc))
        return doc;

    json_t *note = json_object();
    if (!note) {
        json_decref(doc);
        return NULL;
    }
    bool ok = json_object_set_new(note, "http_status", json_integer(res->http_status)) == 0 &&
              json_object_set_new(note, "bytes", json_integer((json_int_t)res->body_total)) == 0 &&
              json_object_set_new(note, "truncated", json_boolean(res->body_truncated)) == 0;
    if (ok && doc) {
        ok = json_object_set(note, "body", doc) == 0;
    } else if (ok) {
        json_t *ex = tally_conn_excerpt(body, res->body_len, 64 * 1024);
        ok = ex && json_object_set_new(note, "excerpt", ex) == 0;
    }
    json_decref(doc);
    if (!ok) {
        json_decref(note);
        return NULL;
    }
    return note;
}

char *tally_conn_external_ref(const tally_tool_t *tool, const json_t *receipt)
{
    if (!receipt)
        return NULL;
    const char *ptr = tool && tool->receipt_ref ? tool->receipt_ref : "/id";
    const json_t *v = tally_json_pointer(receipt, ptr);
    return v ? tally_json_scalar_text(v) : NULL;
}

char *tally_conn_ref_within_limit(char *ref, size_t *over)
{
    *over = 0;
    if (ref != NULL && strlen(ref) > TALLY_LIMIT_EXTERNAL_REF) {
        *over = strlen(ref);
        free(ref);
        ref = NULL;
    }
    return ref;
}

bool tally_conn_receipt_text(const tally_conn_result_t *res, const tally_tool_t *tool,
                             char **receipt, char **external_ref)
{
    *receipt = *external_ref = NULL;
    const char *body = res->body ? res->body : "";
    if (res->curl_code == CURLE_OK && !res->body_truncated) {
        /* The common case, a plain JSON object: no tree to build, print and free. The check
         * for U+0000 is the scanner's own (it is unsure of \u0000). */
        const char *ref = NULL;
        size_t ref_len = 0;
        const char *ptr = tool && tool->receipt_ref ? tool->receipt_ref : "/id";
        *receipt = tally_json_object_compact(body, res->body_len, ptr, &ref, &ref_len);
        if (*receipt) {
            *external_ref = ref ? tally_json_scalar_text_of(ref, ref_len) : NULL;
            return true;
        }
    }
    json_t *doc = tally_conn_receipt(res);
    *receipt = doc ? json_dumps(doc, JSON_COMPACT) : NULL;
    if (*receipt)
        *external_ref = tally_conn_external_ref(tool, doc);
    json_decref(doc);
    return *receipt != NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* Request building                                                                         */

bool tally_conn_signature(const char *secret, long long t, const char *body, size_t body_len,
                          char *out, size_t outsz)
{
    char ts[32];
    int tn = snprintf(ts, sizeof ts, "%lld.", t);
    if (tn < 0 || (size_t)tn >= sizeof ts)
        return false;
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int maclen = 0;
    bool ok = false;
    /* HMAC over "<t>." followed by the body, fed in two pieces so the body is not copied. */
    EVP_MAC *m = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *ctx = m ? EVP_MAC_CTX_new(m) : NULL;
    if (ctx) {
        OSSL_PARAM params[] = {
            OSSL_PARAM_construct_utf8_string("digest", (char *)"SHA256", 0),
            OSSL_PARAM_construct_end(),
        };
        size_t outl = 0;
        ok = EVP_MAC_init(ctx, (const unsigned char *)secret, strlen(secret), params) == 1 &&
             EVP_MAC_update(ctx, (const unsigned char *)ts, (size_t)tn) == 1 &&
             (body_len == 0 || EVP_MAC_update(ctx, (const unsigned char *)body, body_len) == 1) &&
             EVP_MAC_final(ctx, mac, &outl, sizeof mac) == 1;
        maclen = (unsigned int)outl;
    }
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(m);
    if (!ok || maclen != 32)
        return false;
    char hex[65];
    for (unsigned i = 0; i < maclen; i++)
        snprintf(hex + 2 * i, 3, "%02x", mac[i]);
    int n = snprintf(out, outsz, "t=%lld,v1=%s", t, hex);
    return n > 0 && (size_t)n < outsz;
}

const char *tally_conn_method(const tally_tool_t *tool, tally_conn_op_t op)
{
    const tally_endpoint_t *ep = NULL;
    switch (op) {
    case TALLY_CONN_EXECUTE:
        ep = &tool->execute;
        break;
    case TALLY_CONN_STATUS:
        ep = &tool->status;
        break;
    case TALLY_CONN_COMPENSATE:
        ep = &tool->compensate;
        break;
    case TALLY_CONN_CONTAIN:
        ep = &tool->contain;
        break;
    }
    if (ep && ep->method && ep->method[0])
        return ep->method;
    return op == TALLY_CONN_STATUS ? "GET" : "POST";
}

static const tally_endpoint_t *conn_endpoint(const tally_tool_t *tool, tally_conn_op_t op)
{
    switch (op) {
    case TALLY_CONN_EXECUTE:
        return &tool->execute;
    case TALLY_CONN_STATUS:
        return &tool->status;
    case TALLY_CONN_COMPENSATE:
        return &tool->compensate;
    case TALLY_CONN_CONTAIN:
        return &tool->contain;
    }
    return NULL;
}

char *tally_conn_url(const tally_tool_t *tool, tally_conn_op_t op, const char *idempotency_key,
                     tally_error_t *err)
{
    const tally_endpoint_t *ep = conn_endpoint(tool, op);
    if (!ep || !ep->path || !tool->base_url) {
        tally_error_set(err, "no_endpoint", false, "tool '%s' declares no %s endpoint",
                        tool->name ? tool->name : "?", tally_conn_op_name(op));
        return NULL;
    }
    char *esc = NULL;
    if (op == TALLY_CONN_STATUS) {
        const char *k = idempotency_key ? idempotency_key : "";
        esc = curl_easy_escape(NULL, k, (int)strlen(k));
        if (!esc) {
            tally_error_set(err, "oom", true, "out of memory escaping the idempotency key");
            return NULL;
        }
    }
    char *url = NULL;
    int n;
    if (esc)
        n = asprintf(&url, "%s%s%cidempotency_key=%s", tool->base_url, ep->path,
                     strchr(ep->path, '?') ? '&' : '?', esc);
    else
        n = asprintf(&url, "%s%s", tool->base_url, ep->path);
    curl_free(esc);
    if (n < 0) {
        tally_error_set(err, "oom", true, "out of memory building the URL");
        return NULL;
    }
    return url;
}

static bool header_value_ok(const char *v)
{
    if (!v[0])
        return false;
    for (const unsigned char *p = (const unsigned char *)v; *p; p++)
        if (*p < 0x20 || *p == 0x7f)
            return false;
    return true;
}

static bool add_header(struct curl_slist **list, const char *name, const char *value,
                       tally_error_t *err)
{
    if (!value)
        return true;
    if (!header_value_ok(value)) {
        tally_error_set(err, "invalid_header", false,
                        "%s is empty or holds a control character; refusing to send it", name);
        return false;
    }
    char *line = NULL;
    if (asprintf(&line, "%s: %s", name, value) < 0) {
        tally_error_set(err, "oom", true, "out of memory building headers");
        return false;
    }
    struct curl_slist *n = curl_slist_append(*list, line);
    free(line);
    if (!n) {
        tally_error_set(err, "oom", true, "out of memory building headers");
        return false;
    }
    *list = n;
    return true;
}

bool tally_conn_no_replay(const tally_tool_t *tool, tally_conn_op_t op)
{
    if (op != TALLY_CONN_EXECUTE && op != TALLY_CONN_CONTAIN)
        return false;
    return tool->effect_class != TALLY_CLASS_READ && tool->effect_class != TALLY_CLASS_IDEMPOTENT;
}

struct curl_slist *tally_conn_headers(const tally_conn_request_t *req, const char *secret,
                                      long long now, tally_error_t *err)
{
    struct curl_slist *list = NULL;
    bool ok = add_header(&list, "Idempotency-Key", req->idempotency_key, err) &&
              add_header(&list, "Tally-Run-Id", req->run_id, err) &&
              add_header(&list, "Tally-Effect-Id", req->effect_id, err) &&
              add_header(&list, "traceparent", req->traceparent, err) &&
              add_header(&list, "If-Match", req->if_match, err) &&
              add_header(&list, "Accept", "application/json", err);
    if (ok && req->body) {
        ok = add_header(&list, "Content-Type", "application/json", err);
        /* No "Expect: 100-continue" round trip for bodies over 1 KiB. */
        struct curl_slist *n = ok ? curl_slist_append(list, "Expect:") : NULL;
        if (ok && !n) {
            tally_error_set(err, "oom", true, "out of memory building headers");
            ok = false;
        }
        if (n)
            list = n;
    }
    if (ok && secret) {
        char sig[128];
        if (!tally_conn_signature(secret, now, req->body ? req->body : "",
                                  req->body ? req->body_len : 0, sig, sizeof sig)) {
            tally_error_set(err, "signature", false, "computing the HMAC-SHA256 signature failed");
            ok = false;
        } else {
            ok = add_header(&list, "Tally-Signature", sig, err);
        }
    }
    if (!ok) {
        curl_slist_free_all(list);
        return NULL;
    }
    return list;
}

/* ---------------------------------------------------------------------------------------- */
/* The engine                                                                               */

typedef struct conn_slot {
    const tally_tool_t *tool;
    int inflight;
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
    c->slots[c->n_slots] = (conn_slot_t){.tool = tool, .inflight = 0};
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
            tally_error_set(err, "secret_missing", true,
                            "tool '%s' signs its requests but %s is not set", tool->name,
                            tool->secret_env);
            return false;
        }
    }
    /* Take the room first (under the lock: calls finishing on the engine's thread free it),
     * then build the request outside the lock. */
    pthread_mutex_lock(&c->mu);
    size_t slot_idx = 0;
    conn_xfer_t *x = NULL;
    if (capacity_locked(c, tool) <= 0) {
        tally_error_set(err, "capacity", true,
                        "no room for another call to '%s' (%d in flight, %d for the tool)",
                        tool->name, c->inflight, tool_inflight_locked(c, tool));
    } else if (!slot_for(c, tool, &slot_idx) || !(x = xfer_take(c))) {
        tally_error_set(err, "oom", true, "out of memory");
    } else {
        c->inflight++;
        c->slots[slot_idx].inflight++;
    }
    pthread_mutex_unlock(&c->mu);
    if (!x)
        return false;

    x->url = tally_conn_url(tool, req->op, req->idempotency_key, err);
    if (!x->url)
        goto fail;
    x->headers = tally_conn_headers(req, secret, (long long)time(NULL), err);
    if (!x->headers)
        goto fail;
    if (req->body) {
        x->body = malloc(req->body_len + 1);
        if (!x->body) {
            tally_error_set(err, "oom", true, "out of memory");
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
        tally_error_set(err, "curl", false, "setting curl options for '%s' failed", tool->name);
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
        tally_error_set(err, "curl", true, "curl_multi_add_handle: %s", curl_multi_strerror(mc));
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
        tally_error_set(err, "curl", true, "curl_multi_perform: %s", curl_multi_strerror(mc));
        return -1;
    }
    n += drain_done(c, done, opaque);
    int numfds = 0;
    mc = curl_multi_poll(c->multi, extra, n_extra, n > 0 ? 0 : (timeout_ms > 0 ? timeout_ms : 0),
                         &numfds);
    if (mc != CURLM_OK) {
        tally_error_set(err, "curl", true, "curl_multi_poll: %s", curl_multi_strerror(mc));
        return -1;
    }
    if (c->threaded)
        n += take_incoming(c, done, opaque);
    mc = curl_multi_perform(c->multi, &running);
    if (mc != CURLM_OK) {
        tally_error_set(err, "curl", true, "curl_multi_perform: %s", curl_multi_strerror(mc));
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
    int backoff_ms = 10;
    while (!atomic_load(&c->stop)) {
        tally_error_t err;
        tally_error_clear(&err);
        if (tally_connector_poll(c, NULL, 0, 1000, c->done, c->done_opaque, &err) < 0) {
            /* curl_multi_* only fail when out of memory or misused: say so and slow down */
            TALLY_ERROR("connector: %s", err.message);
            struct timespec ts = {0, (long)backoff_ms * 1000000L};
            nanosleep(&ts, NULL);
            backoff_ms = backoff_ms * 2 > 1000 ? 1000 : backoff_ms * 2;
        } else {
            backoff_ms = 10;
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
