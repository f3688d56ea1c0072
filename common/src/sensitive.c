/* sensitive.c — an effect's sensitive fields as every worker handles them (seal.h): its tenant
 * key opened, its sealed args opened for the tool, and the tool's answers redacted before
 * anything keeps them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>

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

char *tally_sensitive_scrub_body(tally_redactor_t *red, const tally_tool_t *tool, const char *body,
                                 size_t len)
{
    json_t *doc = body != NULL && len > 0 ? json_loadb(body, len, 0, NULL) : NULL;
    if (doc == NULL)
        return tally_redactor_scrub(red, body != NULL ? body : "", body != NULL ? len : 0);
    char *out = NULL;
    if (tally_redactor_apply(red, doc, tool->sensitive_receipt, tool->n_sensitive_receipt) >= 0 &&
        tally_redactor_scrub_json(red, doc))
        out = json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    return out;
}

bool tally_sensitive_receipt(tally_redactor_t *red, const tally_tool_t *tool, const char *effect_id,
                             char **receipt_text, char **sealed)
{
    *sealed = NULL;
    if (*receipt_text == NULL)
        return true;
    char aad[64];
    snprintf(aad, sizeof aad, "%s/receipt", effect_id);
    *sealed = tally_seal(&red->key, aad, *receipt_text, strlen(*receipt_text));
    json_t *doc = json_loads(*receipt_text, 0, NULL);
    bool ok =
        *sealed != NULL && doc != NULL &&
        tally_redactor_apply(red, doc, tool->sensitive_receipt, tool->n_sensitive_receipt) >= 0 &&
        tally_redactor_scrub_json(red, doc);
    char *redacted = ok ? json_dumps(doc, JSON_COMPACT) : NULL;
    json_decref(doc);
    if (redacted == NULL) {
        free(*sealed);
        *sealed = NULL;
        return false;
    }
    OPENSSL_cleanse(*receipt_text, strlen(*receipt_text));
    free(*receipt_text);
    *receipt_text = redacted;
    return true;
}
