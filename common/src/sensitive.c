/* sensitive.c — an effect's sensitive fields as every worker handles them (seal.h): its tenant
 * key opened, its sealed args opened for the tool, and the tool's answers redacted before
 * anything keeps them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>

#include "tally/connector.h"
#include "tally/json.h"
#include "tally/registry.h"
#include "tally/seal.h"

void tally_redactor_free(tally_redactor_t *r)
{
    if (r == NULL)
        return;
    tally_redactor_clear(r);
    free(r);
}

bool tally_sensitive_open(const tally_keyring_t *kr, const tally_tool_t *tool,
                          const tally_sealed_row_t *row, tally_redactor_t **red, char **args,
                          size_t *args_len, tally_error_t *err)
{
    *red = NULL;
    if (args != NULL)
        *args = NULL;
    if (row->key_id == NULL) {
        tally_error_setc(err, TALLY_ERR_SEALED,
                         "tool '%s' declares sensitive fields but effect %s has no tenant key "
                         "(it was written before the tool declared them)",
                         tool->name, row->effect_id);
        return false;
    }
    tally_tenant_key_t key;
    if (!tally_tenant_key_open(kr, row->key_id, row->master_id, row->wrapped, &key, err))
        return false;
    tally_redactor_t *r = malloc(sizeof *r);
    if (r == NULL) {
        tally_tenant_key_clear(&key);
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory");
        return false;
    }
    tally_redactor_init(r, &key);
    tally_tenant_key_clear(&key);
    char *plain = NULL;
    size_t len = 0;
    bool ok = true;
    if (row->args_sealed != NULL) {
        char aad[64];
        snprintf(aad, sizeof aad, "%s/args", row->effect_id);
        ok = tally_unseal(&r->key, aad, row->args_sealed, &plain, &len, err);
        /* the values to keep out of the tool's answers when they echo them */
        json_t *doc = ok ? json_loadb(plain, len, 0, NULL) : NULL;
        if (ok && (doc == NULL || tally_redactor_apply(r, doc, tool->sensitive_args,
                                                       tool->n_sensitive_args) < 0)) {
            tally_error_setc(err, TALLY_ERR_SEALED, "the sealed args of effect %s are not JSON",
                             row->effect_id);
            ok = false;
        }
        json_decref(doc);
    }
    if (ok && args != NULL) {
        *args = plain;
        *args_len = len;
        plain = NULL;
    }
    if (plain != NULL) {
        OPENSSL_cleanse(plain, len);
        free(plain);
    }
    if (!ok) {
        tally_redactor_free(r);
        return false;
    }
    *red = r;
    return true;
}

/* @p res with its body scrubbed of every remembered value, as bytes (*@p buf owns it). */
static bool clean_result(tally_redactor_t *red, const tally_conn_result_t *res,
                         tally_conn_result_t *clean, char **buf)
{
    size_t n = 0;
    *buf = tally_redactor_scrub_bytes(red, res->body != NULL ? res->body : "",
                                      res->body != NULL ? res->body_len : 0, &n);
    if (*buf == NULL)
        return false;
    *clean = *res;
    clean->body = *buf;
    clean->body_len = n;
    return true;
}

/* The registry's receipt pointers redacted and every string scrubbed, in place. */
static bool redact_doc(tally_redactor_t *red, const tally_tool_t *tool, json_t *doc)
{
    return tally_redactor_apply(red, doc, tool->sensitive_receipt, tool->n_sensitive_receipt) >=
               0 &&
           tally_redactor_scrub_json(red, doc);
}

/* The body of @p res as a JSON object, when it is one (the receipt is then the body itself:
 * jansson refuses "\u0000" as tally_conn_receipt does): its values are scrubbed as JSON values;
 * any other body is scrubbed as bytes. */
static json_t *body_object(const tally_conn_result_t *res)
{
    if (res->curl_code != 0 || res->body_truncated || res->body == NULL || res->body_len == 0)
        return NULL;
    json_t *doc = json_loadb(res->body, res->body_len, TALLY_JSON_LOAD_FLAGS, NULL);
    if (doc != NULL && !json_is_object(doc)) {
        json_decref(doc);
        doc = NULL;
    }
    return doc;
}

char *tally_sensitive_scrub_body(tally_redactor_t *red, const tally_tool_t *tool, const char *body,
                                 size_t len, size_t *outlen)
{
    json_t *doc = body != NULL && len > 0 ? json_loadb(body, len, 0, NULL) : NULL;
    if (doc == NULL) {
        /* not JSON: scrubbed as bytes, whatever their encoding */
        return tally_redactor_scrub_bytes(red, body != NULL ? body : "", body ? len : 0, outlen);
    }
    char *out = redact_doc(red, tool, doc) ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    *outlen = out != NULL ? strlen(out) : 0;
    return out;
}

json_t *tally_sensitive_answer_json(tally_redactor_t *red, const tally_tool_t *tool,
                                    const tally_conn_result_t *res)
{
    json_t *doc = body_object(res);
    if (doc == NULL) {
        tally_conn_result_t clean;
        char *buf = NULL;
        doc = clean_result(red, res, &clean, &buf) ? tally_conn_receipt(&clean) : NULL;
        free(buf);
    }
    if (doc != NULL && !redact_doc(red, tool, doc)) {
        json_decref(doc);
        doc = NULL;
    }
    return doc;
}

bool tally_sensitive_receipt(tally_redactor_t *red, const tally_tool_t *tool, const char *effect_id,
                             const tally_conn_result_t *res, char **receipt_text,
                             char **external_ref, char **sealed)
{
    *sealed = *receipt_text = *external_ref = NULL;
    char *whole = NULL;
    if (!tally_conn_receipt_text(res, tool, &whole, external_ref))
        return false;
    char aad[64];
    snprintf(aad, sizeof aad, "%s/receipt", effect_id);
    *sealed = tally_seal(&red->key, aad, whole, strlen(whole));
    /* the receipt is the body when it is a JSON object: redacted and scrubbed as JSON values */
    json_t *doc = body_object(res);
    if (doc == NULL) {
        /* a note about a body that is not a JSON object: made again from the body's bytes
         * scrubbed, so that its excerpt (text or base64) holds no value */
        tally_conn_result_t clean;
        char *buf = NULL, *text = NULL, *ref = NULL;
        if (clean_result(red, res, &clean, &buf) &&
            tally_conn_receipt_text(&clean, tool, &text, &ref))
            doc = json_loads(text, 0, NULL);
        free(buf);
        free(text);
        free(ref);
    }
    OPENSSL_cleanse(whole, strlen(whole));
    free(whole);
    bool ok = *sealed != NULL && doc != NULL && redact_doc(red, tool, doc);
    *receipt_text = ok ? json_dumps(doc, JSON_COMPACT) : NULL;
    if (*receipt_text != NULL && *external_ref != NULL) {
        /* a tool whose record id is a sensitive value: the ref is kept as its marker */
        char *ref = tally_redactor_scrub(red, *external_ref, strlen(*external_ref));
        free(*external_ref);
        *external_ref = ref;
    }
    json_decref(doc);
    if (*receipt_text == NULL) {
        free(*sealed);
        free(*external_ref);
        *sealed = *external_ref = NULL;
        return false;
    }
    return true;
}
