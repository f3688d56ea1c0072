/* fake_sig9421.c — see fake_sig9421.h. Parses just the structured fields tally's signatures
 * use (an inner list of strings with integer and string parameters; a byte sequence). */
#include "fake_sig9421.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MAX_COMPONENTS  16
#define CREATED_MAX_AGE 300
#define CREATED_LEEWAY  60

static const char *fail(char *why, size_t whysz, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static const char *fail(char *why, size_t whysz, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, whysz, fmt, ap);
    va_end(ap);
    return why;
}

/* The value of dictionary member @p label in @p field (up to the next top-level ','), copied
 * into a new string; NULL when absent. */
static char *dict_member(const char *field, const char *label)
{
    size_t ll = strlen(label);
    const char *p = field;
    while (*p) {
        while (*p == ' ' || *p == '\t')
            p++;
        const char *start = p;
        bool quoted = false;
        while (*p && (quoted || *p != ',')) {
            if (*p == '\\' && quoted && p[1])
                p++;
            else if (*p == '"')
                quoted = !quoted;
            p++;
        }
        if ((size_t)(p - start) > ll && strncmp(start, label, ll) == 0 && start[ll] == '=') {
            size_t n = (size_t)(p - start) - ll - 1;
            while (n && (start[ll + 1 + n - 1] == ' ' || start[ll + 1 + n - 1] == '\t'))
                n--;
            char *v = malloc(n + 1);
            if (v) {
                memcpy(v, start + ll + 1, n);
                v[n] = '\0';
            }
            return v;
        }
        if (*p == ',')
            p++;
    }
    return NULL;
}

/* RFC 9421 §2.1: the field value without leading and trailing spaces and tabs. */
static void put_trimmed(char **b, size_t *len, size_t *cap, const char *v, bool *ok);

static void put(char **b, size_t *len, size_t *cap, const char *s, size_t n, bool *ok)
{
    if (!*ok)
        return;
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap * 2 : 512;
        while (c < *len + n + 1)
            c *= 2;
        char *g = realloc(*b, c);
        if (!g) {
            *ok = false;
            return;
        }
        *b = g;
        *cap = c;
    }
    memcpy(*b + *len, s, n);
    *len += n;
    (*b)[*len] = '\0';
}

static void put_trimmed(char **b, size_t *len, size_t *cap, const char *v, bool *ok)
{
    size_t n = strlen(v), i = 0;
    while (n && (v[n - 1] == ' ' || v[n - 1] == '\t'))
        n--;
    while (i < n && (v[i] == ' ' || v[i] == '\t'))
        i++;
    put(b, len, cap, v + i, n - i, ok);
}

static bool covered(char comps[][64], size_t n, const char *name)
{
    for (size_t i = 0; i < n; i++)
        if (strcmp(comps[i], name) == 0)
            return true;
    return false;
}

const char *fake_sig9421_verify(const fake_sig_key_t *keys, size_t nkeys,
                                const fake_sig_request_t *rq, long long now, char *why,
                                size_t whysz)
{
    const char *si = rq->header(rq->ctx, "Signature-Input");
    const char *sg = rq->header(rq->ctx, "Signature");
    if (!si || !sg)
        return fail(why, whysz, "missing Signature-Input or Signature");
    char *input = dict_member(si, "tally"), *sigv = dict_member(sg, "tally");
    char *base = NULL;
    const char *res = NULL;
    if (!input || !sigv) {
        res = fail(why, whysz, "no signature labelled \"tally\"");
        goto out;
    }

    /* The inner list: ("a" "b" ...) then ;param=value ... */
    char comps[MAX_COMPONENTS][64];
    size_t ncomps = 0;
    const char *p = input;
    if (*p++ != '(') {
        res = fail(why, whysz, "Signature-Input is not an inner list");
        goto out;
    }
    while (*p != ')') {
        while (*p == ' ')
            p++;
        if (*p == ')')
            break;
        const char *q = *p == '"' ? strchr(p + 1, '"') : NULL;
        if (!q || (size_t)(q - p - 1) >= sizeof comps[0] || ncomps == MAX_COMPONENTS) {
            res = fail(why, whysz, "Signature-Input has a malformed component list");
            goto out;
        }
        memcpy(comps[ncomps], p + 1, (size_t)(q - p - 1));
        comps[ncomps][q - p - 1] = '\0';
        for (size_t i = 0; i < ncomps; i++)
            if (strcmp(comps[i], comps[ncomps]) == 0) {
                res = fail(why, whysz, "component \"%s\" is covered twice", comps[i]);
                goto out;
            }
        ncomps++;
        p = q + 1;
        if (*p != ' ' && *p != ')') {
            res = fail(why, whysz, "Signature-Input has a malformed component list");
            goto out;
        }
    }
    p++;
    long long created = -1, expires = -1;
    char keyid[128] = "", alg[64] = "";
    while (*p == ';') {
        p++;
        const char *eq = strchr(p, '=');
        if (!eq) {
            res = fail(why, whysz, "Signature-Input has a malformed parameter");
            goto out;
        }
        size_t nl = (size_t)(eq - p);
        const char *v = eq + 1;
        if (*v == '"') {
            const char *end = strchr(v + 1, '"');
            if (!end || (size_t)(end - v - 1) >= sizeof keyid) {
                res = fail(why, whysz, "Signature-Input has a malformed parameter");
                goto out;
            }
            char *dst = nl == 5 && strncmp(p, "keyid", 5) == 0 ? keyid
                        : nl == 3 && strncmp(p, "alg", 3) == 0 ? alg
                                                               : NULL;
            if (dst && (size_t)(end - v - 1) < (dst == alg ? sizeof alg : sizeof keyid)) {
                memcpy(dst, v + 1, (size_t)(end - v - 1));
                dst[end - v - 1] = '\0';
            }
            p = end + 1;
        } else {
            char *end;
            long long n = strtoll(v, &end, 10);
            if (end == v) {
                res = fail(why, whysz, "Signature-Input has a malformed parameter");
                goto out;
            }
            if (nl == 7 && strncmp(p, "created", 7) == 0)
                created = n;
            else if (nl == 7 && strncmp(p, "expires", 7) == 0)
                expires = n;
            p = end;
        }
    }
    if (*p) {
        res = fail(why, whysz, "Signature-Input has trailing text");
        goto out;
    }
    if (*alg && strcmp(alg, "hmac-sha256") != 0) {
        res = fail(why, whysz, "alg \"%s\" is not hmac-sha256", alg);
        goto out;
    }
    if (created < 0 || created > now + CREATED_LEEWAY || created < now - CREATED_MAX_AGE) {
        res = fail(why, whysz, "created is missing, in the future or too old");
        goto out;
    }
    if (expires >= 0 && expires < now) {
        res = fail(why, whysz, "the signature expired");
        goto out;
    }
    const fake_sig_key_t *key = NULL;
    for (size_t i = 0; i < nkeys; i++)
        if (strcmp(keys[i].id, keyid) == 0)
            key = &keys[i];
    if (!key) {
        res = fail(why, whysz, "unknown key id \"%s\"", keyid);
        goto out;
    }

    /* What must be covered: the request line and every tally header the request carries. */
    static const char *const must[] = {"idempotency-key", "tally-run-id", "tally-effect-id",
                                       "if-match"};
    if (!covered(comps, ncomps, "@method") || !covered(comps, ncomps, "@target-uri")) {
        res = fail(why, whysz, "@method and @target-uri must be covered");
        goto out;
    }
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++)
        if (rq->header(rq->ctx, must[i]) && !covered(comps, ncomps, must[i])) {
            res = fail(why, whysz, "%s is sent but not covered", must[i]);
            goto out;
        }
    if (rq->len > 0) {
        if (!covered(comps, ncomps, "content-digest")) {
            res = fail(why, whysz, "the request has a body but content-digest is not covered");
            goto out;
        }
        const char *cd = rq->header(rq->ctx, "Content-Digest");
        char *have = cd ? dict_member(cd, "sha-256") : NULL;
        unsigned char md[32];
        unsigned int mdlen = 0;
        char want[64];
        bool match = false;
        if (have && EVP_Digest(rq->body, rq->len, md, &mdlen, EVP_sha256(), NULL) == 1) {
            want[0] = ':';
            int n = EVP_EncodeBlock((unsigned char *)want + 1, md, 32);
            want[1 + n] = ':';
            want[2 + n] = '\0';
            match = strcmp(have, want) == 0;
        }
        free(have);
        if (!match) {
            res = fail(why, whysz, "Content-Digest does not match the body");
            goto out;
        }
    }

    /* The signature base (RFC 9421 §2.5). */
    size_t len = 0, cap = 0;
    bool ok = true;
    for (size_t i = 0; i < ncomps; i++) {
        put(&base, &len, &cap, "\"", 1, &ok);
        put(&base, &len, &cap, comps[i], strlen(comps[i]), &ok);
        put(&base, &len, &cap, "\": ", 3, &ok);
        if (strcmp(comps[i], "@method") == 0) {
            put(&base, &len, &cap, rq->method, strlen(rq->method), &ok);
        } else if (strcmp(comps[i], "@target-uri") == 0) {
            const char *host = rq->header(rq->ctx, "Host");
            if (!host) {
                res = fail(why, whysz, "no Host to rebuild @target-uri from");
                goto out;
            }
            put(&base, &len, &cap, "http://", 7, &ok);
            put_trimmed(&base, &len, &cap, host, &ok);
            put(&base, &len, &cap, rq->raw_uri, strlen(rq->raw_uri), &ok);
        } else if (comps[i][0] == '@') {
            res = fail(why, whysz, "derived component \"%s\" is not supported", comps[i]);
            goto out;
        } else {
            const char *v = rq->header(rq->ctx, comps[i]);
            if (!v) {
                res = fail(why, whysz, "covered field %s is not in the request", comps[i]);
                goto out;
            }
            put_trimmed(&base, &len, &cap, v, &ok);
        }
        put(&base, &len, &cap, "\n", 1, &ok);
    }
    put(&base, &len, &cap, "\"@signature-params\": ", 21, &ok);
    put(&base, &len, &cap, input, strlen(input), &ok);
    if (!ok) {
        res = fail(why, whysz, "out of memory");
        goto out;
    }
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int maclen = 0;
    char want[64];
    if (!HMAC(EVP_sha256(), key->value, (int)key->len, (const unsigned char *)base, len, mac,
              &maclen) ||
        maclen != 32) {
        res = fail(why, whysz, "HMAC failed");
        goto out;
    }
    want[0] = ':';
    int n = EVP_EncodeBlock((unsigned char *)want + 1, mac, 32);
    want[1 + n] = ':';
    want[2 + n] = '\0';
    if (strlen(sigv) != strlen(want) || CRYPTO_memcmp(sigv, want, strlen(want)) != 0)
        res = fail(why, whysz, "signature does not match (key id \"%s\")", keyid);
out:
    free(input);
    free(sigv);
    free(base);
    return res;
}
