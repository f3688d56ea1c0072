/* connector_request.c — what a call sends: its method and URL, its headers (idempotency key,
 * run and effect ids, traceparent, If-Match) and its HMAC signature. Header values are checked
 * here, so an argument can never inject a header. */
#include "tally/connector.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>
#include <openssl/params.h>

#include "tally/text.h"

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

const char *tally_conn_method(const tally_tool_t *tool, tally_conn_op_t op)
{
    const tally_endpoint_t *ep = conn_endpoint(tool, op);
    if (ep && ep->method && ep->method[0])
        return ep->method;
    return op == TALLY_CONN_STATUS ? "GET" : "POST";
}

char *tally_conn_url(const tally_tool_t *tool, tally_conn_op_t op, const char *idempotency_key,
                     tally_error_t *err)
{
    const tally_endpoint_t *ep = conn_endpoint(tool, op);
    if (!ep || !ep->path || !tool->base_url) {
        tally_error_setc(err, TALLY_ERR_NO_ENDPOINT, "tool '%s' declares no %s endpoint",
                         tool->name ? tool->name : "?", tally_conn_op_name(op));
        return NULL;
    }
    char *esc = NULL;
    if (op == TALLY_CONN_STATUS) {
        const char *k = idempotency_key ? idempotency_key : "";
        esc = curl_easy_escape(NULL, k, (int)strlen(k));
        if (!esc) {
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory escaping the idempotency key");
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
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building the URL");
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
        tally_error_setc(err, TALLY_ERR_INVALID_HEADER,
                         "%s is empty or holds a control character; refusing to send it", name);
        return false;
    }
    char *line = NULL;
    if (asprintf(&line, "%s: %s", name, value) < 0) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building headers");
        return false;
    }
    struct curl_slist *n = curl_slist_append(*list, line);
    free(line);
    if (!n) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building headers");
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
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building headers");
            ok = false;
        }
        if (n)
            list = n;
    }
    if (ok && secret) {
        char sig[128];
        if (!tally_conn_signature(secret, now, req->body ? req->body : "",
                                  req->body ? req->body_len : 0, sig, sizeof sig)) {
            tally_error_setc(err, TALLY_ERR_SIGNATURE,
                             "computing the HMAC-SHA256 signature failed");
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
