/* connector_request.c — what a call sends: its method and URL, its headers (idempotency key,
 * run and effect ids, traceparent, If-Match) and its signatures: RFC 9421 HTTP Message
 * Signatures with an RFC 9530 Content-Digest, and the legacy Tally-Signature. Header values
 * are checked here, so an argument can never inject a header. */
#include "tally/connector.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
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
    case TALLY_CONN_LIST:
        return "list";
    }
    return "?";
}

/* HMAC-SHA256 with @p key of @p a followed by @p b (either may be empty), into @p mac (32
 * bytes): two pieces, so that the legacy scheme's "<t>." and body need no copy. */
static bool hmac_sha256(const char *key, const void *a, size_t alen, const void *b, size_t blen,
                        unsigned char mac[32])
{
    size_t outl = 0;
    bool ok = false;
    EVP_MAC *m = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *ctx = m ? EVP_MAC_CTX_new(m) : NULL;
    if (ctx) {
        OSSL_PARAM params[] = {
            OSSL_PARAM_construct_utf8_string("digest", (char *)"SHA256", 0),
            OSSL_PARAM_construct_end(),
        };
        unsigned char buf[EVP_MAX_MD_SIZE];
        ok = EVP_MAC_init(ctx, (const unsigned char *)key, strlen(key), params) == 1 &&
             (alen == 0 || EVP_MAC_update(ctx, a, alen) == 1) &&
             (blen == 0 || EVP_MAC_update(ctx, b, blen) == 1) &&
             EVP_MAC_final(ctx, buf, &outl, sizeof buf) == 1 && outl == 32;
        if (ok)
            memcpy(mac, buf, 32);
        OPENSSL_cleanse(buf, sizeof buf);
    }
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(m);
    return ok;
}

bool tally_conn_signature(const char *secret, long long t, const char *body, size_t body_len,
                          char *out, size_t outsz)
{
    char ts[32];
    int tn = snprintf(ts, sizeof ts, "%lld.", t);
    unsigned char mac[32];
    if (tn < 0 || (size_t)tn >= sizeof ts ||
        !hmac_sha256(secret, ts, (size_t)tn, body, body_len, mac))
        return false;
    char hex[65];
    for (unsigned i = 0; i < sizeof mac; i++)
        snprintf(hex + 2 * i, 3, "%02x", mac[i]);
    int n = snprintf(out, outsz, "t=%lld,v1=%s", t, hex);
    return n > 0 && (size_t)n < outsz;
}

char *tally_conn_content_digest(const char *body, size_t body_len)
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    if (EVP_Digest(body_len ? body : "", body_len, md, &mdlen, EVP_sha256(), NULL) != 1 ||
        mdlen != 32)
        return NULL;
    char b64[48]; /* 4 * ceil(32 / 3) = 44, and the NUL */
    EVP_EncodeBlock((unsigned char *)b64, md, 32);
    char *out = NULL;
    if (asprintf(&out, "sha-256=:%s:", b64) < 0)
        return NULL;
    return out;
}

bool tally_conn_sig_hmac(const char *key, const char *base, char *out, size_t outsz)
{
    unsigned char mac[32];
    if (outsz < 45 || !hmac_sha256(key, base, strlen(base), NULL, 0, mac))
        return false;
    EVP_EncodeBlock((unsigned char *)out, mac, 32);
    return true;
}

/* RFC 9421 §2.1: a field's value with leading and trailing spaces and tabs removed. */
static void sb_field_value(tally_strbuf_t *b, const char *v)
{
    size_t n = strlen(v);
    while (n && (v[n - 1] == ' ' || v[n - 1] == '\t'))
        n--;
    size_t i = 0;
    while (i < n && (v[i] == ' ' || v[i] == '\t'))
        i++;
    tally_strbuf_put(b, v + i, n - i);
}

/* The key id goes into an sf-string: printable ASCII, no '"' or '\\' (so no escaping). */
static bool sf_string_plain(const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if (*p < 0x20 || *p > 0x7e || *p == '"' || *p == '\\')
            return false;
    return true;
}

char *tally_conn_sig_base(const tally_conn_request_t *req, const char *method, const char *url,
                          const char *content_digest, const tally_conn_sig_params_t *params,
                          char **input)
{
    *input = NULL;
    if (!params->key_id || !sf_string_plain(params->key_id))
        return NULL;
    struct {
        const char *name;
        const char *value;
    } comp[] = {
        {"@method", method},
        {"@target-uri", url},
        {"content-digest", content_digest},
        {"idempotency-key", req->idempotency_key},
        {"tally-run-id", req->run_id},
        {"tally-effect-id", req->effect_id},
        {"if-match", req->if_match},
    };
    tally_strbuf_t base = {0}, list = {0};
    tally_strbuf_puts(&list, "(");
    bool first = true;
    for (size_t i = 0; i < sizeof comp / sizeof comp[0]; i++) {
        if (!comp[i].value)
            continue;
        tally_strbuf_puts(&base, "\"");
        tally_strbuf_puts(&base, comp[i].name);
        tally_strbuf_puts(&base, "\": ");
        sb_field_value(&base, comp[i].value);
        tally_strbuf_puts(&base, "\n");
        if (!first)
            tally_strbuf_puts(&list, " ");
        first = false;
        tally_strbuf_puts(&list, "\"");
        tally_strbuf_puts(&list, comp[i].name);
        tally_strbuf_puts(&list, "\"");
    }
    char tail[64 + 64];
    snprintf(tail, sizeof tail, ");created=%lld;expires=%lld;keyid=\"", params->created,
             params->expires);
    tally_strbuf_puts(&list, tail);
    tally_strbuf_puts(&list, params->key_id);
    tally_strbuf_puts(&list, "\";alg=\"hmac-sha256\"");
    tally_strbuf_puts(&base, "\"@signature-params\": ");
    if (!list.failed)
        tally_strbuf_puts(&base, list.s);
    char *params_text = tally_strbuf_take(&list);
    char *base_text = tally_strbuf_take(&base);
    if (params_text == NULL || base_text == NULL) {
        free(params_text);
        free(base_text);
        return NULL;
    }
    *input = params_text;
    return base_text;
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
    case TALLY_CONN_LIST:
        return &tool->list;
    }
    return NULL;
}

const char *tally_conn_method(const tally_tool_t *tool, tally_conn_op_t op)
{
    const tally_endpoint_t *ep = conn_endpoint(tool, op);
    if (ep && ep->method && ep->method[0])
        return ep->method;
    return op == TALLY_CONN_STATUS || op == TALLY_CONN_LIST ? "GET" : "POST";
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
    else if (op == TALLY_CONN_LIST && idempotency_key != NULL && idempotency_key[0] != '\0')
        n = asprintf(&url, "%s%s%c%s", tool->base_url, ep->path, strchr(ep->path, '?') ? '&' : '?',
                     idempotency_key);
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
    tally_conn_signing_t sign = {.legacy_secret = secret};
    return tally_conn_headers_signed(req, NULL, NULL, &sign, now, err);
}

/* Content-Digest, Signature-Input and Signature (RFC 9421, label "tally") onto @p list. */
static bool add_rfc9421(struct curl_slist **list, const tally_conn_request_t *req,
                        const char *method, const char *url, const tally_conn_signing_t *sign,
                        long long now, tally_error_t *err)
{
    char *digest = NULL, *input = NULL, *base = NULL, *hv = NULL;
    bool ok = false;
    if (req->body && !(digest = tally_conn_content_digest(req->body, req->body_len))) {
        tally_error_setc(err, TALLY_ERR_SIGNATURE, "computing the Content-Digest failed");
        goto done;
    }
    tally_conn_sig_params_t params = {
        .key_id = sign->key_id ? sign->key_id : "",
        .created = now,
        .expires = now + (sign->window_s > 0 ? sign->window_s : 300),
    };
    base = tally_conn_sig_base(req, method, url, digest, &params, &input);
    char sig[64];
    if (!base || !tally_conn_sig_hmac(sign->key, base, sig, sizeof sig)) {
        tally_error_setc(err, TALLY_ERR_SIGNATURE,
                         "computing the RFC 9421 signature failed (key id, memory or OpenSSL)");
        goto done;
    }
    if (!add_header(list, "Content-Digest", digest, err))
        goto done;
    if (asprintf(&hv, "tally=%s", input) < 0) {
        hv = NULL;
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building headers");
        goto done;
    }
    if (!add_header(list, "Signature-Input", hv, err))
        goto done;
    free(hv);
    if (asprintf(&hv, "tally=:%s:", sig) < 0) {
        hv = NULL;
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building headers");
        goto done;
    }
    ok = add_header(list, "Signature", hv, err);
done:
    free(digest);
    free(input);
    free(base);
    free(hv);
    return ok;
}

struct curl_slist *tally_conn_headers_signed(const tally_conn_request_t *req, const char *method,
                                             const char *url, const tally_conn_signing_t *sign,
                                             long long now, tally_error_t *err)
{
    const char *secret = sign ? sign->legacy_secret : NULL;
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
    if (ok && sign && sign->key) {
        if (!method || !url) {
            tally_error_setc(err, TALLY_ERR_SIGNATURE,
                             "an RFC 9421 signature needs the request's method and URL");
            ok = false;
        } else {
            ok = add_rfc9421(&list, req, method, url, sign, now, err);
        }
    }
    if (!ok) {
        curl_slist_free_all(list);
        return NULL;
    }
    return list;
}
