/* sensitive.c — the dispatcher's side of sensitive fields (seal.h, docs/security.md).
 *
 * At intake, inside the batch's transaction: the tenant keys of the batch's sensitive intents
 * (made when a tenant has none), each intent's args redacted for the ledger and sealed whole,
 * and the dead letters of sensitive tools redacted. At delivery: the sealed args opened into the
 * exact bytes the tool receives, and the tool's answer redacted before anything keeps it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatcher.h"
#include "tally/json.h"
#include "tally/log.h"
#include "tally/text.h"

/* The tenants in $1 (a JSON array of names) locked shared, in one order (TALLY_SQL_TENANT_LOCK:
 * `tally forget` takes it exclusively, so no key is destroyed under a batch sealing with it);
 * then, in a statement of its own that sees what a forget committed meanwhile, their live
 * keys. */
static const char SQL_LOCK_TENANTS[] =
    "SELECT count(pg_advisory_xact_lock_shared(" TALLY_SQL_TENANT_LOCK(
        "t.name") "))"
                  " FROM (SELECT DISTINCT jsonb_array_elements_text($1::jsonb) AS name ORDER BY 1) "
                  "t";
static const char SQL_KEYS[] =
    "SELECT k.key_id::text, k.tenant, k.master_key_id, k.wrapped FROM tenant_keys k"
    " WHERE k.forgotten_at IS NULL"
    "   AND k.tenant IN (SELECT jsonb_array_elements_text($1::jsonb))";

/* New keys for tenants that have none; a concurrent dispatcher's key wins (the caller reads
 * the keys again). */
static const char SQL_NEW_KEYS[] =
    "INSERT INTO tenant_keys (key_id, tenant, master_key_id, wrapped)"
    " SELECT k.key_id, k.tenant, k.master_key_id, k.wrapped::bytea"
    " FROM json_to_recordset($1::json) AS k(key_id uuid, tenant text, master_key_id text,"
    "   wrapped text)"
    " ON CONFLICT (tenant) WHERE forgotten_at IS NULL DO NOTHING";

typedef struct tkey {
    const char *tenant; /* borrowed from the message */
    tally_tenant_key_t key;
    bool have;
} tkey_t;

typedef struct keyset {
    tkey_t *k;
    size_t n, cap;
} keyset_t;

static const char *tenant_of(const char *t)
{
    return t != NULL ? t : "";
}

static tkey_t *keyset_find(keyset_t *ks, const char *tenant)
{
    for (size_t i = 0; i < ks->n; i++)
        if (strcmp(ks->k[i].tenant, tenant) == 0)
            return &ks->k[i];
    return NULL;
}

static bool keyset_want(keyset_t *ks, const char *tenant)
{
    if (keyset_find(ks, tenant) != NULL)
        return true;
    if (ks->n == ks->cap) {
        size_t cap = ks->cap ? 2 * ks->cap : 8;
        tkey_t *p = realloc(ks->k, cap * sizeof *p);
        if (p == NULL)
            return false;
        ks->k = p;
        ks->cap = cap;
    }
    ks->k[ks->n++] = (tkey_t){.tenant = tenant};
    return true;
}

static void keyset_clear(keyset_t *ks)
{
    for (size_t i = 0; i < ks->n; i++)
        tally_tenant_key_clear(&ks->k[i].key);
    free(ks->k);
    memset(ks, 0, sizeof *ks);
}

/* Read the live keys of the wanted tenants that have none yet; @p missing counts the rest. */
static bool keyset_read(dispatcher_t *d, keyset_t *ks, bool lock, size_t *missing,
                        tally_error_t *err)
{
    json_t *names = json_array();
    for (size_t i = 0; names != NULL && i < ks->n; i++)
        if (!ks->k[i].have && json_array_append_new(names, json_string(ks->k[i].tenant)) != 0) {
            json_decref(names);
            names = NULL;
        }
    char *text = names ? json_dumps(names, JSON_COMPACT) : NULL;
    json_decref(names);
    if (text == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading tenant keys");
        return false;
    }
    const char *params[1] = {text};
    PGresult *res = NULL;
    if (lock)
        res = tally_pg_exec(d->pg, SQL_LOCK_TENANTS, 1, params, err);
    PQclear(res);
    res = res != NULL || !lock ? tally_pg_exec(d->pg, SQL_KEYS, 1, params, err) : NULL;
    free(text);
    if (res == NULL)
        return false;
    bool ok = true;
    for (int row = 0; ok && row < PQntuples(res); row++) {
        tkey_t *k = keyset_find(ks, PQgetvalue(res, row, 1));
        if (k == NULL || k->have)
            continue;
        ok = tally_tenant_key_open(d->keys, PQgetvalue(res, row, 0), PQgetvalue(res, row, 2),
                                   PQgetisnull(res, row, 3) ? NULL : PQgetvalue(res, row, 3),
                                   &k->key, err);
        k->have = ok;
    }
    PQclear(res);
    *missing = 0;
    for (size_t i = 0; i < ks->n; i++)
        *missing += !ks->k[i].have;
    return ok;
}

/* Keys for the tenants that have none: made here, inserted, then read back (a concurrent
 * dispatcher may have made one first). */
static bool keyset_make(dispatcher_t *d, keyset_t *ks, tally_error_t *err)
{
    json_t *rows = json_array();
    bool ok = rows != NULL;
    for (size_t i = 0; ok && i < ks->n; i++) {
        if (ks->k[i].have)
            continue;
        tally_tenant_key_t key;
        char *wrapped = NULL;
        const char *master = NULL;
        ok = tally_tenant_key_new(d->keys, &key, &wrapped, &master, err);
        if (ok)
            ok = json_array_append_new(rows, json_pack("{s:s, s:s, s:s, s:s}", "key_id", key.key_id,
                                                       "tenant", ks->k[i].tenant, "master_key_id",
                                                       master, "wrapped", wrapped)) == 0;
        tally_tenant_key_clear(&key);
        free(wrapped);
    }
    char *text = ok ? json_dumps(rows, JSON_COMPACT) : NULL;
    json_decref(rows);
    if (text == NULL) {
        if (ok)
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory making tenant keys");
        return false;
    }
    const char *params[1] = {text};
    ok = tally_pg_run(d->pg, SQL_NEW_KEYS, 1, params, err);
    free(text);
    return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* Intake                                                                                  */

void intake_sensitive_clear(intake_msg_t *m)
{
    free(m->stored_args);
    free(m->args_sealed);
    free(m->dlq_original);
    tally_redactor_free(m->red);
    m->stored_args = m->args_sealed = m->dlq_original = NULL;
    m->red = NULL;
    m->seal_key[0] = '\0';
    m->dlq_withheld = false;
}

/* The tool a dead letter names, and its data object, when the bytes read as JSON. */
static const tally_tool_t *dlq_tool(dispatcher_t *d, json_t *root, json_t **data)
{
    *data = json_object_get(root, "data");
    const char *tool = json_string_value(json_object_get(*data, "tool"));
    return tool != NULL ? tally_registry_find(d->reg, tool) : NULL;
}

/* The tenant a dead letter names, when it is one an intent could name (a refused message may
 * carry anything there: a megabyte, control characters); else '' (the shared key). */
static const char *dlq_tenant(const json_t *data)
{
    const json_t *t = json_object_get(data, "tenant");
    const char *s = json_string_value(t);
    if (s == NULL || json_string_length(t) > TALLY_LIMIT_TENANT ||
        strlen(s) != json_string_length(t))
        return "";
    for (const char *c = s; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            return "";
    return s;
}

/* Which messages of [lo, hi) need a tenant key; dead letters parsed into @p roots. */
static bool want_keys(dispatcher_t *d, size_t lo, size_t hi, keyset_t *ks, json_t **roots)
{
    for (size_t i = lo; i < hi; i++) {
        intake_msg_t *m = &d->batch[i];
        intake_sensitive_clear(m);
        if (m->reason == TALLY_DLQ_NONE) {
            if (m->in.type == TALLY_MSG_INTENT && m->tool && tally_tool_sensitive(m->tool) &&
                !keyset_want(ks, tenant_of(m->in.tenant)))
                return false;
            continue;
        }
        if (!d->any_sensitive)
            continue;
        const rd_kafka_message_t *rkm = m->rkm;
        json_t *root = rkm->payload ? json_loadb(rkm->payload, rkm->len, 0, NULL) : NULL;
        json_t *data = NULL;
        const tally_tool_t *tool = root ? dlq_tool(d, root, &data) : NULL;
        if (root == NULL) {
            /* Not JSON: which of its bytes are sensitive cannot be known. */
            m->dlq_withheld = rkm->payload != NULL && rkm->len > 0;
        } else if (tool != NULL && tool->n_sensitive_args > 0) {
            if (!json_is_object(json_object_get(data, "args"))) {
                m->dlq_withheld = true;
            } else {
                if (!keyset_want(ks, dlq_tenant(data))) {
                    json_decref(root);
                    return false;
                }
                roots[i - lo] = root;
                continue;
            }
        }
        json_decref(root);
    }
    return true;
}

/* An intent of a sensitive tool: args redacted for the ledger (and its input hash over them, so
 * that no digest of a sensitive value is kept in clear), sealed whole for the tool. */
static bool seal_intent(intake_msg_t *m, const tally_tenant_key_t *key)
{
    m->red = malloc(sizeof *m->red);
    json_t *doc = json_deep_copy(m->in.args);
    if (m->red == NULL || doc == NULL) {
        json_decref(doc);
        free(m->red);
        m->red = NULL;
        return false;
    }
    tally_redactor_init(m->red, key);
    snprintf(m->seal_key, sizeof m->seal_key, "%s", key->key_id);
    bool ok = tally_redactor_apply(m->red, doc, m->tool->sensitive_args,
                                   m->tool->n_sensitive_args) >= 0 &&
              (m->stored_args = tally_json_canonical(doc)) != NULL &&
              tally_sha256_hex(m->stored_args, strlen(m->stored_args), m->input_hash);
    json_decref(doc);
    if (ok && m->tool->n_sensitive_args > 0) {
        char aad[64];
        snprintf(aad, sizeof aad, "%s/args", m->effect_id);
        m->args_sealed = tally_seal(key, aad, m->canonical, strlen(m->canonical));
        ok = m->args_sealed != NULL;
    }
    return ok;
}

static bool redact_dead_letter(dispatcher_t *d, intake_msg_t *m, json_t *root,
                               const tally_tenant_key_t *key)
{
    json_t *data = NULL;
    const tally_tool_t *tool = dlq_tool(d, root, &data);
    tally_redactor_t r;
    tally_redactor_init(&r, key);
    bool ok = tally_redactor_apply(&r, json_object_get(data, "args"), tool->sensitive_args,
                                   tool->n_sensitive_args) >= 0 &&
              (m->dlq_original = json_dumps(root, JSON_COMPACT)) != NULL;
    tally_redactor_clear(&r);
    return ok;
}

bool intake_seal(dispatcher_t *d, size_t lo, size_t hi, tally_error_t *err)
{
    keyset_t ks = {0};
    json_t **roots = calloc(hi - lo + 1, sizeof *roots);
    size_t missing = 0;
    bool ok = roots != NULL && want_keys(d, lo, hi, &ks, roots);
    if (!ok)
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory preparing sensitive fields");
    if (ok && ks.n > 0) {
        ok = keyset_read(d, &ks, true, &missing, err);
        if (ok && missing > 0)
            ok = keyset_make(d, &ks, err) && keyset_read(d, &ks, false, &missing, err);
        if (ok && missing > 0) {
            tally_error_setc(err, TALLY_ERR_RACE,
                             "a tenant key was made and forgotten meanwhile; try again");
            ok = false;
        }
    }
    for (size_t i = lo; ok && i < hi; i++) {
        intake_msg_t *m = &d->batch[i];
        if (roots[i - lo] != NULL) {
            json_t *data = json_object_get(roots[i - lo], "data");
            ok = redact_dead_letter(d, m, roots[i - lo], &keyset_find(&ks, dlq_tenant(data))->key);
        } else if (m->reason == TALLY_DLQ_NONE && m->in.type == TALLY_MSG_INTENT && m->tool &&
                   tally_tool_sensitive(m->tool)) {
            ok = seal_intent(m, &keyset_find(&ks, tenant_of(m->in.tenant))->key);
        }
        if (!ok && err->errc == TALLY_ERR_NONE)
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory sealing sensitive fields");
    }
    for (size_t i = 0; roots != NULL && i < hi - lo; i++)
        json_decref(roots[i]);
    free(roots);
    keyset_clear(&ks);
    return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* Delivery                                                                                */

void call_sensitive_clear(dispatch_call_t *call)
{
    tally_redactor_free(call->red);
    call->red = NULL;
}

bool call_open_sealed(dispatcher_t *d, dispatch_call_t *call, const char *key_id,
                      const char *master_id, const char *wrapped, const char *sealed, char **body,
                      size_t *body_len, tally_error_t *err)
{
    tally_sealed_row_t row = {.effect_id = call->effect_id,
                              .key_id = key_id,
                              .master_id = master_id,
                              .wrapped = wrapped,
                              .args_sealed = sealed};
    return tally_sensitive_open(d->keys, call->tool, &row, &call->red, body, body_len, err);
}
