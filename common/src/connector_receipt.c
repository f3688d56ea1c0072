/* connector_receipt.c — what a call's answer leaves in the ledger: the receipt (the body when
 * it is a JSON object, else a note describing it), the external ref it names, and excerpts of
 * bodies for logs and the audit trail. */
#include "tally/connector.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "tally/json.h"
#include "tally/ledger.h"
#include "tally/text.h"

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

void tally_conn_receipt_ref_text(tally_jtext_t *j)
{
    tally_jtext_begin(j, "receipt");
    tally_jtext_str(j, "on", TALLY_RECEIPT_ON_EFFECT);
    tally_jtext_end(j);
}

tally_receipt_ref_t tally_conn_receipt_ref_check(const json_t *ref, const char *receipt_sha256)
{
    const char *on = json_string_value(json_object_get(ref, "on"));
    if (on == NULL || strcmp(on, TALLY_RECEIPT_ON_EFFECT) != 0)
        return TALLY_RECEIPT_REF_NONE;
    const char *sha = json_string_value(json_object_get(ref, "sha256"));
    if (sha == NULL || receipt_sha256 == NULL)
        return TALLY_RECEIPT_REF_UNVERIFIED;
    return strcmp(sha, receipt_sha256) == 0 ? TALLY_RECEIPT_REF_MATCH : TALLY_RECEIPT_REF_MISMATCH;
}
