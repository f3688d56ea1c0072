/* intake.c — intents into the ledger: one PostgreSQL transaction per Kafka poll batch (runs,
 * effects, dispatch outbox, audit events, outcome and DLQ messages); the batch's offsets are
 * stored only after its COMMIT, so a crash anywhere before makes Kafka deliver it again and
 * the ledger's uniqueness turns the second delivery into replays. */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/evp.h>

#include "dispatcher.h"
#include "tally/runops.h"
#include "tally/audit.h"
#include "tally/crashpoint.h"
#include "tally/id.h"
#include "tally/json.h"
#include "tally/log.h"
#include "tally/columns.h"
#include "tally/text.h"

/* librdkafka's default message.max.bytes is 1,000,000: a DLQ record must stay below it even
 * when TALLY_MAX_MESSAGE_BYTES is larger, or the relay could never publish it. */
#define DLQ_MAX_BYTES     900000
#define DLQ_OVERHEAD      4096
#define DLQ_KEY_MAX_BYTES 1024

/* ---------------------------------------------------------------------------------------- */
/* SQL                                                                                      */

/* Every statement handles the whole batch; its rows travel as one columns parameter
 * (columns.h), typed here. */

// clang-format off
static const char SQL_RUNS[] =
    "INSERT INTO runs (run_id, tenant)"
    " SELECT DISTINCT ON (r.run_id) r.run_id, r.tenant"
    " FROM unnest(" TALLY_COLUMN("$1", 1) "," TALLY_COLUMN("$1", 2) ") AS r(run_id, tenant)"
    " ORDER BY r.run_id, r.tenant NULLS LAST"
    " ON CONFLICT (run_id) DO NOTHING";
// clang-format on

/* The run rows are share-locked so an operator's cancel of the same run serialises with this
 * batch: either the cancel sees these effects, or this batch sees the cancelled run.
 * Rows with a lease_ms are claimed in the same statement (DESIGN §3 rule 1: the effect is
 * committed as DISPATCHING under a lease, times from the database clock, before its call
 * starts): they skip the dispatch outbox and a second transaction. The others (no room for
 * their tool in this worker just now) wait in the outbox as PLANNED. */
// clang-format off
static const char SQL_EFFECTS[] =
    "WITH r AS ("
    "  SELECT u.ord::int AS ord, u.effect_id::uuid AS effect_id, u.run_id, u.step,"
    "    u.step_num::numeric AS step_num, u.tool, u.effect_class, u.operation_key, u.input_hash,"
    "    u.args_canonical, u.tenant, u.traceparent, u.intent_id, u.gated::boolean AS gated,"
    "    u.lease_ms::int AS lease_ms"
    "  FROM unnest(" TALLY_COLUMN("$1", 1) "," TALLY_COLUMN("$1", 2) "," TALLY_COLUMN("$1", 3) ","
    TALLY_COLUMN("$1", 4) "," TALLY_COLUMN("$1", 5) "," TALLY_COLUMN("$1", 6) ","
    TALLY_COLUMN("$1", 7) "," TALLY_COLUMN("$1", 8) "," TALLY_COLUMN("$1", 9) ","
    TALLY_COLUMN("$1", 10) "," TALLY_COLUMN("$1", 11) "," TALLY_COLUMN("$1", 12) ","
    TALLY_COLUMN("$1", 13) "," TALLY_COLUMN("$1", 14) "," TALLY_COLUMN("$1", 15) ")"
    "  AS u(ord, effect_id, run_id, step, step_num, tool, effect_class, operation_key,"
    "    input_hash, args_canonical, tenant, traceparent, intent_id, gated, lease_ms)),"
    " ru AS (SELECT run_id, status FROM runs WHERE run_id IN (SELECT run_id FROM r)"
    "    ORDER BY run_id FOR SHARE),"
    " ins AS ("
    "  INSERT INTO effects (effect_id, run_id, step, step_num, tool, effect_class, operation_key,"
    "    input_hash, args_canonical, tenant, traceparent, intent_id, status, status_reason,"
    "    lease_owner, lease_until, lease_epoch, attempts)"
    "  SELECT r.effect_id, r.run_id, r.step, r.step_num, r.tool, r.effect_class,"
    "    r.operation_key, r.input_hash, r.args_canonical, r.tenant, r.traceparent, r.intent_id,"
    "    s.status, CASE WHEN ru.status <> 'ACTIVE' THEN 'the run is ' || ru.status END,"
    "    CASE WHEN s.status = 'DISPATCHING' THEN $2::text END,"
    "    CASE WHEN s.status = 'DISPATCHING' THEN now() + r.lease_ms * interval '1 millisecond'"
    "    END,"
    "    CASE WHEN s.status = 'DISPATCHING' THEN 1 ELSE 0 END,"
    "    CASE WHEN s.status = 'DISPATCHING' THEN 1 ELSE 0 END"
    "  FROM r JOIN ru ON ru.run_id = r.run_id AND ru.status NOT IN ('COMPLETING', 'COMPLETED')"
    "  CROSS JOIN LATERAL (SELECT CASE WHEN ru.status <> 'ACTIVE' THEN 'CANCELLED'"
    "    WHEN r.gated THEN 'AWAITING_APPROVAL'"
    "    WHEN r.lease_ms IS NOT NULL THEN 'DISPATCHING' ELSE 'PLANNED' END AS status) s"
    "  ORDER BY r.ord"
    "  ON CONFLICT DO NOTHING"
    "  RETURNING effect_id, tool, status, status_reason, lease_epoch, attempts,"
    "    to_json(lease_until) #>> '{}' AS lease_until),"
    " ob AS (INSERT INTO outbox (effect_id, tool)"
    "  SELECT effect_id, tool FROM ins WHERE status = 'PLANNED')"
    " SELECT effect_id::text, status, status_reason, lease_epoch, attempts, lease_until"
    " FROM ins";
// clang-format on
#define EFFECT_COLS 15

/* For the intents that created nothing: the effect holding their (tool, key), and the one
 * holding their (run, step), in one query. */
// clang-format off
static const char SQL_EXISTING[] =
    "SELECT k.ord, e.effect_id::text, e.run_id, e.step, e.step_num IS NOT NULL, e.tool,"
    "  e.operation_key, e.status, e.input_hash, e.receipt::text, e.external_ref, e.error_code,"
    "  e.error_message, e.attempts, s.effect_id::text, s.tool, s.operation_key, ru.status"
    " FROM unnest(" TALLY_COLUMN("$1", 1) "," TALLY_COLUMN("$1", 2) "," TALLY_COLUMN("$1", 3) ","
    TALLY_COLUMN("$1", 4) "," TALLY_COLUMN("$1", 5) ") AS k(ord, tool, operation_key, run_id,"
    "   step)"
    " LEFT JOIN effects e ON e.tool = k.tool AND e.operation_key = k.operation_key"
    " LEFT JOIN effects s ON s.run_id = k.run_id AND s.step = k.step"
    " LEFT JOIN runs ru ON ru.run_id = k.run_id";

/* Where the answers of the batch's messages go too (docs/agent-protocol.md): for an intent, the
 * effect it created or found; for a run message, the run (effect_id NULL). */
// clang-format off
static const char SQL_REPLIES[] =
    "INSERT INTO replies (run_id, effect_id, intent_id, destination)"
    " SELECT r.run_id, r.effect_id::uuid, r.intent_id, r.destination::jsonb"
    " FROM unnest(" TALLY_COLUMN("$1", 1) "," TALLY_COLUMN("$1", 2) "," TALLY_COLUMN("$1", 3) ","
    TALLY_COLUMN("$1", 4) ") AS r(run_id, effect_id, intent_id, destination)"
    " ON CONFLICT DO NOTHING";
// clang-format on
#define REPLY_COLS 4

/* complete_run: the runs' statuses, locked (their completion serialises with other batches). */
static const char SQL_COMPLETE_LOCK[] =
    "SELECT run_id, status, status_reason, summary::text FROM runs"
    " WHERE run_id = ANY ($1::text[]) ORDER BY run_id FOR UPDATE";

/* complete_run of ACTIVE runs: no new intents from now on; tally_runops_complete finishes the
 * ones with nothing in flight at once, the reconciler's sweep the others when they settle. */
static const char SQL_COMPLETING[] =
    "UPDATE runs SET status = 'COMPLETING', status_reason = 'complete_run', updated_at = now()"
    " WHERE run_id = ANY ($1::text[]) AND status = 'ACTIVE' RETURNING run_id";
// clang-format on

/* ---------------------------------------------------------------------------------------- */
/* The batch in memory                                                                      */

static void msg_clear(intake_msg_t *m)
{
    if (m->rkm)
        rd_kafka_message_destroy(m->rkm);
    tally_intent_clear(&m->in);
    free(m->op_key);
    free(m->canonical);
    free(m->reply);
    memset(m, 0, sizeof *m);
}

void intake_discard(dispatcher_t *d)
{
    for (size_t i = 0; i < d->n_batch; i++)
        msg_clear(&d->batch[i]);
    d->n_batch = 0;
    d->intake_failed = false;
    d->intake_done = 0;
    d->intake_window = 0;
}

static bool batch_push(dispatcher_t *d, rd_kafka_message_t *rkm)
{
    if (d->n_batch == d->cap_batch) {
        size_t cap = d->cap_batch ? 2 * d->cap_batch : 64;
        intake_msg_t *b = realloc(d->batch, cap * sizeof *b);
        if (!b)
            return false;
        memset(b + d->cap_batch, 0, (cap - d->cap_batch) * sizeof *b);
        d->batch = b;
        d->cap_batch = cap;
    }
    intake_msg_t *m = &d->batch[d->n_batch++];
    memset(m, 0, sizeof *m);
    m->rkm = rkm;
    return true;
}

static bool has_control_char(const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if (*p < 0x20 || *p == 0x7f)
            return true;
    return false;
}

/* ---------------------------------------------------------------------------------------- */
/* Reply destinations (docs/agent-protocol.md)                                              */

typedef enum { REPLY_NONE = 0, REPLY_OK, REPLY_INVALID } reply_read_t;

/* The last value of header @p name, or NULL. */
static const void *header(rd_kafka_headers_t *hdrs, const char *name, size_t *size)
{
    const void *v = NULL;
    *size = 0;
    if (hdrs == NULL ||
        rd_kafka_header_get_last(hdrs, name, &v, size) != RD_KAFKA_RESP_ERR_NO_ERROR)
        return NULL;
    return v != NULL ? v : "";
}

static bool topic_char(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
}

/* A partition as digits, or (a header, @p binary) as Spring Kafka writes it: 4 bytes,
 * big-endian. */
static bool partition_bytes(const unsigned char *v, size_t n, bool binary, long long *out)
{
    bool digits = n > 0 && n <= 10;
    for (size_t i = 0; i < n && digits; i++)
        digits = v[i] >= '0' && v[i] <= '9';
    if (binary && n == 4 && !digits) {
        int32_t p = (int32_t)((uint32_t)v[0] << 24 | (uint32_t)v[1] << 16 | (uint32_t)v[2] << 8 |
                              (uint32_t)v[3]);
        *out = p;
        return p >= 0;
    }
    if (!digits)
        return false;
    long long p = 0;
    for (size_t i = 0; i < n; i++)
        p = p * 10 + (v[i] - '0');
    *out = p;
    return p <= INT32_MAX;
}

static json_t *base64_json(const void *data, size_t len);

/* Read where the answers of message @p rkm (its parsed CloudEvent @p doc, may be NULL) go:
 * the Spring Kafka headers, else the CloudEvents extension attributes. REPLY_OK sets *@p out to
 * the destination as JSON text (replies.destination); REPLY_INVALID says why in @p detail and
 * names the field in @p field. */
static reply_read_t read_reply_to(const char *allowed, const rd_kafka_message_t *rkm,
                                  const json_t *doc, char **out, char *detail, size_t detailsz,
                                  char *field, size_t fieldsz)
{
    *out = NULL;
    rd_kafka_headers_t *hdrs = NULL;
    if (rd_kafka_message_headers(rkm, &hdrs) != RD_KAFKA_RESP_ERR_NO_ERROR)
        hdrs = NULL;
    size_t tlen = 0, plen = 0, clen = 0;
    const char *topic = header(hdrs, "kafka_replyTopic", &tlen);
    const unsigned char *part = header(hdrs, "kafka_replyPartition", &plen);
    const unsigned char *corr = header(hdrs, "kafka_correlationId", &clen);
    const char *tname = "kafka_replyTopic", *pname = "kafka_replyPartition",
               *cname = "kafka_correlationId";
    json_t *pjson = NULL;
    if (topic == NULL) {
        json_t *t = json_object_get(doc, "replytopic");
        if (t == NULL)
            return REPLY_NONE;
        tname = "replytopic";
        if (!json_is_string(t)) {
            tally_text_copy(field, fieldsz, tname);
            tally_fmt(detail, detailsz, "replytopic must be a string (a topic name)");
            return REPLY_INVALID;
        }
        topic = json_string_value(t);
        tlen = json_string_length(t);
    }
    if (part == NULL && (pjson = json_object_get(doc, "replypartition")) != NULL)
        pname = "replypartition";
    if (corr == NULL) {
        json_t *c = json_object_get(doc, "correlationid");
        if (c != NULL) {
            cname = "correlationid";
            if (!json_is_string(c)) {
                tally_text_copy(field, fieldsz, cname);
                tally_fmt(detail, detailsz, "correlationid must be a string");
                return REPLY_INVALID;
            }
            corr = (const unsigned char *)json_string_value(c);
            clen = json_string_length(c);
        }
    }

    size_t alen = strlen(allowed);
    bool chars = tlen > 0;
    for (size_t i = 0; i < tlen && chars; i++)
        chars = topic_char((unsigned char)topic[i]);
    if (!chars || tlen > TALLY_LIMIT_REPLY_TOPIC || tlen <= alen ||
        memcmp(topic, allowed, alen) != 0) {
        char shown[128];
        if (tally_utf8_valid(topic, tlen) && !memchr(topic, '\0', tlen)) {
            char *t = strndup(topic, tlen);
            tally_text_copy(shown, sizeof shown, t ? t : "");
            free(t);
        } else {
            snprintf(shown, sizeof shown, "(%zu bytes that are not text)", tlen);
        }
        tally_text_copy(field, fieldsz, tname);
        if (!chars || tlen > TALLY_LIMIT_REPLY_TOPIC)
            tally_fmt(detail, detailsz,
                      "%s '%s' is not a topic name (1-%d bytes of A-Z a-z 0-9 . _ -)", tname, shown,
                      TALLY_LIMIT_REPLY_TOPIC);
        else
            tally_fmt(detail, detailsz,
                      "%s '%s' is outside the allowed prefix '%s' (TALLY_REPLY_TOPIC_PREFIX): "
                      "tally answers only on reply topics it is allowed to write",
                      tname, shown, allowed);
        return REPLY_INVALID;
    }
    long long p = -1;
    bool p_ok = true;
    if (part != NULL)
        p_ok = partition_bytes(part, plen, true, &p);
    else if (pjson != NULL && json_is_integer(pjson))
        p = json_integer_value(pjson), p_ok = p >= 0 && p <= INT32_MAX;
    else if (pjson != NULL && json_is_string(pjson))
        p_ok = partition_bytes((const unsigned char *)json_string_value(pjson),
                               json_string_length(pjson), false, &p);
    else if (pjson != NULL && !json_is_null(pjson))
        p_ok = false;
    if (!p_ok) {
        tally_text_copy(field, fieldsz, pname);
        tally_fmt(detail, detailsz,
                  "%s must be a partition number from 0 to 2147483647 (Spring Kafka's 4-byte "
                  "big-endian int, or digits)",
                  pname);
        return REPLY_INVALID;
    }
    if (corr != NULL && (clen == 0 || clen > TALLY_LIMIT_CORRELATION)) {
        tally_text_copy(field, fieldsz, cname);
        tally_fmt(detail, detailsz, "%s must be 1 to %d bytes; it is %zu", cname,
                  TALLY_LIMIT_CORRELATION, clen);
        return REPLY_INVALID;
    }
    json_t *dest = json_object();
    int rc = dest ? json_object_set_new(dest, "topic", json_stringn(topic, tlen)) : -1;
    if (p >= 0)
        rc |= json_object_set_new(dest, "partition", json_integer((json_int_t)p));
    if (corr != NULL) {
        rc |= json_object_set_new(dest, "correlation", base64_json(corr, clen));
        bool text = tally_utf8_valid((const char *)corr, clen);
        for (size_t i = 0; i < clen && text; i++)
            text = corr[i] >= 0x20 && corr[i] != 0x7f;
        if (text)
            rc |= json_object_set_new(dest, "correlation_text",
                                      json_stringn((const char *)corr, clen));
    }
    *out = rc == 0 ? json_dumps(dest, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(dest);
    if (*out == NULL) {
        tally_text_copy(field, fieldsz, tname);
        tally_fmt(detail, detailsz, "out of memory reading the reply destination");
        return REPLY_INVALID;
    }
    return REPLY_OK;
}

/* The field a refusal's detail sentence names ("data.tool", "id", ...), for its answer. */
static void field_of(const intake_msg_t *m, char *out, size_t outsz)
{
    if (m->field[0] != '\0') {
        tally_text_copy(out, outsz, m->field);
        return;
    }
    out[0] = '\0';
    const char *d = m->detail;
    const char *p = strstr(d, "data.");
    if (m->reason == TALLY_DLQ_UNKNOWN_TOOL) {
        tally_text_copy(out, outsz, "data.tool");
    } else if (m->reason == TALLY_DLQ_MISSING_OPERATION_KEY) {
        tally_text_copy(out, outsz, "data.operation_key");
    } else if (p != NULL) {
        size_t n = 5;
        while (p[n] && (isalnum((unsigned char)p[n]) || p[n] == '_' || p[n] == '.') &&
               n + 1 < outsz)
            n++;
        while (n > 5 && p[n - 1] == '.')
            n--;
        memcpy(out, p, n);
        out[n] = '\0';
    } else if (strstr(d, "CloudEvents id") != NULL) {
        tally_text_copy(out, outsz, "id");
    } else if (strstr(d, "CloudEvents type") != NULL) {
        tally_text_copy(out, outsz, "type");
    } else if (strstr(d, "specversion") != NULL) {
        tally_text_copy(out, outsz, "specversion");
    } else if (strstr(d, "datacontenttype") != NULL) {
        tally_text_copy(out, outsz, "datacontenttype");
    } else if (strncmp(d, "data ", 5) == 0 || strncmp(d, "data is", 7) == 0) {
        tally_text_copy(out, outsz, "data");
    }
}

/* Validate one message: envelope and data (cloudevent.c), then the registry. */
static void parse_msg(dispatcher_t *d, intake_msg_t *m)
{
    m->parsed = true;
    const rd_kafka_message_t *rkm = m->rkm;
    m->reason = tally_intent_parse(rkm->payload, rkm->len, (size_t)d->cfg->max_message_bytes,
                                   &m->in, m->detail, sizeof m->detail);
    if (m->reason != TALLY_DLQ_NONE)
        return;
    if (has_control_char(m->in.run_id)) {
        m->reason = TALLY_DLQ_INVALID_FIELD;
        snprintf(m->detail, sizeof m->detail, "data.run_id holds a control character");
        return;
    }
    char allowed[256];
    tally_config_reply_prefix(d->cfg, allowed, sizeof allowed);
    if (read_reply_to(allowed, rkm, m->in.doc, &m->reply, m->detail, sizeof m->detail, m->field,
                      sizeof m->field) == REPLY_INVALID) {
        m->reason = TALLY_DLQ_INVALID_REPLY_TO;
        return;
    }
    if (m->in.type != TALLY_MSG_INTENT)
        return;
    m->tool = tally_registry_find(d->reg, m->in.tool);
    if (!m->tool) {
        m->reason = TALLY_DLQ_UNKNOWN_TOOL;
        tally_fmt(m->detail, sizeof m->detail, "tool '%s' is not in the registry (%s)", m->in.tool,
                  d->cfg->tools_path);
        return;
    }
    tally_error_t err;
    tally_error_clear(&err);
    m->op_key = tally_registry_operation_key(m->tool, m->in.args, m->in.operation_key, &err);
    if (!m->op_key) {
        /* A value that cannot make a key (control characters, over the limit) is invalid;
         * none at all is missing. */
        m->reason = strcmp(err.code, "invalid_field") == 0 ? TALLY_DLQ_INVALID_FIELD
                                                           : TALLY_DLQ_MISSING_OPERATION_KEY;
        tally_text_copy(m->detail, sizeof m->detail, err.message);
        return;
    }
    m->canonical = tally_json_canonical(m->in.args);
    if (!m->canonical || !tally_sha256_hex(m->canonical, strlen(m->canonical), m->input_hash)) {
        /* Out of memory: keep the message unparsed so the next attempt tries again. */
        m->parsed = false;
        tally_intent_clear(&m->in);
        free(m->op_key);
        free(m->canonical);
        free(m->reply);
        m->op_key = m->canonical = m->reply = NULL;
        return;
    }
    tally_uuid_v7(m->effect_id);
}

/* ---------------------------------------------------------------------------------------- */
/* Dead letters                                                                             */

static json_t *b64(const void *data, size_t len)
{
    size_t outlen = 4 * ((len + 2) / 3) + 1;
    unsigned char *out = malloc(outlen);
    if (!out)
        return NULL;
    int n = EVP_EncodeBlock(out, data, (int)len);
    json_t *s = json_stringn((const char *)out, (size_t)(n > 0 ? n : 0));
    free(out);
    return s;
}

static json_t *base64_json(const void *data, size_t len)
{
    return b64(data, len);
}

static json_t *dlq_data(dispatcher_t *d, const intake_msg_t *m, size_t budget)
{
    const rd_kafka_message_t *rkm = m->rkm;
    const char *val = rkm->payload ? rkm->payload : "";
    size_t len = rkm->payload ? rkm->len : 0;
    rd_kafka_timestamp_type_t tstype;
    int64_t ts = rd_kafka_message_timestamp(rkm, &tstype);
    json_t *data = json_pack(
        "{s:s, s:s, s:s, s:i, s:I, s:o, s:I}", "reason", tally_dlq_reason_name(m->reason), "detail",
        m->detail, "topic", rd_kafka_topic_name(rkm->rkt), "partition", (int)rkm->partition,
        "offset", (json_int_t)rkm->offset, "timestamp",
        ts >= 0 ? json_integer((json_int_t)ts) : json_null(), "original_bytes", (json_int_t)len);
    if (!data)
        return NULL;
    int rc = 0;
    if (rkm->key && rkm->key_len > 0) {
        /* A key may be as large as the message: keep at most DLQ_KEY_MAX_BYTES of it, so the
         * record always fits (the original offset names the whole). */
        size_t klen = rkm->key_len;
        bool cut = klen > DLQ_KEY_MAX_BYTES;
        if (tally_utf8_valid(rkm->key, klen) && !memchr(rkm->key, '\0', klen)) {
            klen = tally_utf8_prefix(rkm->key, klen, DLQ_KEY_MAX_BYTES);
            /* "original_key" is the schema's name (dlq.schema.json); "key" the older one */
            rc |= json_object_set_new(data, "key", json_stringn(rkm->key, klen));
            rc |= json_object_set_new(data, "original_key", json_stringn(rkm->key, klen));
        } else {
            rc |= json_object_set_new(data, "key_base64",
                                      b64(rkm->key, cut ? DLQ_KEY_MAX_BYTES : klen));
            rc |= json_object_set_new(data, "original_key", json_null());
        }
        if (cut)
            rc |= json_object_set_new(data, "key_bytes", json_integer((json_int_t)rkm->key_len));
    } else {
        rc |= json_object_set_new(data, "key", json_null());
        rc |= json_object_set_new(data, "original_key", json_null());
    }
    bool text = tally_utf8_valid(val, len);
    size_t keep;
    if (text) {
        keep = tally_utf8_prefix(val, len, budget);
        rc |= json_object_set_new(data, "original", json_stringn(val, keep));
    } else {
        keep = len < budget / 4 * 3 ? len : budget / 4 * 3;
        rc |= json_object_set_new(data, "original_base64", b64(val, keep));
    }
    rc |= json_object_set_new(data, "original_truncated", json_boolean(keep < len));
    rc |= json_object_set_new(data, "original_size", json_integer((json_int_t)len));
    (void)d;
    if (rc != 0) {
        json_decref(data);
        return NULL;
    }
    return data;
}

/* A DLQ record under the size limit: halve the kept original until the event fits. */
static bool dlq_add(dispatcher_t *d, tally_outbox_batch_t *ob, const intake_msg_t *m)
{
    size_t limit = (size_t)d->cfg->max_message_bytes;
    if (limit > DLQ_MAX_BYTES)
        limit = DLQ_MAX_BYTES;
    size_t budget = limit > 2 * DLQ_OVERHEAD ? limit - DLQ_OVERHEAD : DLQ_OVERHEAD;
    const rd_kafka_message_t *rkm = m->rkm;
    char subject[320];
    snprintf(subject, sizeof subject, "%s/%d/%lld", rd_kafka_topic_name(rkm->rkt),
             (int)rkm->partition, (long long)rkm->offset);
    const char *key = NULL;
    char keybuf[256];
    if (rkm->key && rkm->key_len > 0 && rkm->key_len < sizeof keybuf &&
        !memchr(rkm->key, '\0', rkm->key_len) && tally_utf8_valid(rkm->key, rkm->key_len)) {
        memcpy(keybuf, rkm->key, rkm->key_len);
        keybuf[rkm->key_len] = '\0';
        key = keybuf;
    }
    for (int round = 0; round < 16; round++) {
        json_t *data = dlq_data(d, m, budget);
        if (!data)
            return false;
        json_t *ce = tally_ce_new("tally.dlq.v1", d->source, subject, data, NULL);
        if (!ce)
            return false;
        char *s = json_dumps(ce, JSON_COMPACT);
        size_t n = s ? strlen(s) : 0;
        free(s);
        if (n > 0 && n <= limit) {
            tally_outbox_batch_add(ob, "dlq", key, ce);
            json_decref(ce);
            return true;
        }
        json_decref(ce);
        budget /= 2;
    }
    return false;
}

/* tally.intent.rejected.v1 (docs/agent-protocol.md): the answer to a message tally refuses,
 * on the outcomes topic and on @p reply (may be NULL). @p step (borrowed) may be NULL. @p dlq:
 * the message was dead-lettered (its position is named). */
static bool reject_add(dispatcher_t *d, tally_outbox_batch_t *ob, const intake_msg_t *m,
                       const char *id, const char *run_id, json_t *step, const char *tool,
                       const char *type, const char *reply, bool dlq)
{
    char field[64];
    field_of(m, field, sizeof field);
    const rd_kafka_message_t *rkm = m->rkm;
    json_t *where =
        dlq ? json_pack("{s:s, s:i, s:I}", "topic", rd_kafka_topic_name(rkm->rkt), "partition",
                        (int)rkm->partition, "offset", (json_int_t)rkm->offset)
            : json_null();
    json_t *data = json_pack(
        "{s:s, s:s, s:O, s:o, s:o, s:s, s:s, s:o, s:s, s:o}", "intent_id", id, "run_id", run_id,
        "step", step ? step : json_null(), "tool", tool ? json_string(tool) : json_null(), "type",
        type ? json_string(type) : json_null(), "status", "REJECTED", "reason",
        tally_dlq_reason_name(m->reason), "field", field[0] ? json_string(field) : json_null(),
        "detail", m->detail, "dlq", where);
    if (!data)
        return false;
    char eid[37];
    json_t *ce = tally_ce_new("tally.intent.rejected.v1", d->source, run_id, data, eid);
    char *payload = ce ? json_dumps(ce, JSON_COMPACT) : NULL;
    json_decref(ce);
    if (!payload)
        return false;
    tally_outbox_batch_add_answer(ob, "outcomes", run_id, eid, NULL, payload, TALLY_REPLY_NONE,
                                  reply);
    free(payload);
    return true;
}

/* A dead-lettered message: its DLQ record, and its answer when its id and run id can be read
 * (with its reply destination when that is valid). */
static bool refuse(dispatcher_t *d, tally_outbox_batch_t *ob, intake_msg_t *m)
{
    if (!dlq_add(d, ob, m))
        return false;
    const rd_kafka_message_t *rkm = m->rkm;
    tally_intent_peek_t pk;
    if (!tally_intent_peek(rkm->payload, rkm->payload ? rkm->len : 0, &pk))
        return true; /* the DLQ alone: nothing names whom to answer */
    char *reply = NULL;
    if (m->reason != TALLY_DLQ_INVALID_REPLY_TO) {
        char allowed[256], detail[256], field[64];
        tally_config_reply_prefix(d->cfg, allowed, sizeof allowed);
        if (read_reply_to(allowed, rkm, pk.doc, &reply, detail, sizeof detail, field,
                          sizeof field) != REPLY_OK)
            reply = NULL;
    }
    bool ok = reject_add(d, ob, m, pk.id, pk.run_id, pk.step, pk.tool, pk.type, reply, true);
    free(reply);
    tally_intent_peek_clear(&pk);
    return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* The transaction                                                                          */

typedef struct intake_counts {
    int created, planned, replay, conflict, dlq, cancel, compensate, complete, not_active;
    int dlq_by_reason[16];
} intake_counts_t;

static int cmp_effect_id(const void *a, const void *b)
{
    const intake_msg_t *const *x = a, *const *y = b;
    return strcmp((*x)->effect_id, (*y)->effect_id);
}

/* Run @p sql with the rows of @p c as $1 (and @p param2, when not NULL, as $2); its result
 * goes to @p out, or is dropped when @p out is NULL. */
static bool exec_rows(dispatcher_t *d, const char *sql, tally_columns_t *c, const char *param2,
                      PGresult **out, tally_error_t *err)
{
    int lengths[2] = {0, 0}, formats[2] = {1, 0};
    const char *params[2] = {tally_columns_param(c, &lengths[0]), param2};
    if (!params[0]) {
        if (c->bad_text)
            tally_error_set(err, "invalid_text", false, "intake batch not written: %s", c->why);
        else
            tally_error_set(err, "oom", true, "intake batch not written: %s",
                            c->failed ? c->why : "out of memory");
        return false;
    }
    PGresult *res = tally_pg_exec_bin(d->pg, sql, param2 ? 2 : 1, params, lengths, formats, err);
    if (!res)
        return false;
    if (out)
        *out = res;
    else
        PQclear(res);
    return true;
}

static const char *val(PGresult *res, int row, int col)
{
    return PQgetisnull(res, row, col) ? NULL : PQgetvalue(res, row, col);
}

/* An audit event whose data is the object of @p n members (audit.h): text, without a jansson
 * object to build and serialise for each intent. */
static void audit_add(tally_audit_batch_t *ab, const char *run_id, const char *effect_id,
                      const char *kind, const char *from, const char *to, const char *actor,
                      const char *reason, const tally_audit_member_t *members, size_t n)
{
    tally_audit_event_t ev = {.run_id = run_id,
                              .effect_id = effect_id,
                              .kind = kind,
                              .from_status = from,
                              .to_status = to,
                              .actor = actor,
                              .reason = reason,
                              .members = members,
                              .n_members = n};
    tally_audit_batch_add(ab, &ev);
}

/* Note that the answers about @p effect_id (NULL: the run's own) go to @p m's reply
 * destination too, when it named one. */
static bool add_reply(tally_columns_t *rp, const char *run_id, const char *effect_id,
                      const intake_msg_t *m)
{
    if (!m->reply)
        return true;
    bool row = tally_columns_row_begin(rp) && tally_columns_text(rp, run_id) &&
               tally_columns_text(rp, effect_id) && tally_columns_text(rp, m->in.id) &&
               tally_columns_text(rp, m->reply);
    return tally_columns_row_end(rp, row);
}

/* An intent or complete_run for a run that is completed (or cancelled, compensated, for a
 * complete_run): answered tally.intent.rejected.v1 run_not_active, and noted in the audit
 * trail; it is not dead-lettered (nothing is wrong with the message). */
static bool reject_not_active(dispatcher_t *d, tally_outbox_batch_t *ob, tally_audit_batch_t *ab,
                              intake_msg_t *m, const char *run_status, intake_counts_t *c)
{
    m->reason = TALLY_DLQ_RUN_NOT_ACTIVE;
    tally_fmt(m->detail, sizeof m->detail, "run %s is %s: it takes no new %s", m->in.run_id,
              run_status, m->in.type == TALLY_MSG_INTENT ? "intents" : "requests to complete");
    tally_text_copy(m->field, sizeof m->field, "data.run_id");
    json_t *step = m->in.type == TALLY_MSG_INTENT
                       ? dispatch_step_json(m->in.step, m->in.step_is_number)
                       : NULL;
    bool ok = reject_add(d, ob, m, m->in.id, m->in.run_id, step, m->in.tool,
                         json_string_value(json_object_get(m->in.doc, "type")), m->reply, false);
    json_decref(step);
    const tally_audit_member_t data[] = {
        {"intent_id", m->in.id, false},
        {"run_status", run_status, false},
    };
    audit_add(ab, m->in.run_id, NULL, "intent", NULL, NULL, d->worker_id, "run_not_active", data,
              sizeof data / sizeof data[0]);
    c->not_active++;
    return ok;
}

/* The intents that created an effect: their first "transition" event, and the
 * outcome for those that start gated (awaiting approval) or in a run that is over. */
static bool record_created(dispatcher_t *d, PGresult *res, intake_msg_t **sorted, size_t n,
                           tally_audit_batch_t *ab, tally_outbox_batch_t *ob, intake_counts_t *c,
                           bool *created, tally_columns_t *rp)
{
    for (int row = 0; row < PQntuples(res); row++) {
        const char *eid = PQgetvalue(res, row, 0);
        const char *status = PQgetvalue(res, row, 1);
        const char *why = val(res, row, 2);
        intake_msg_t key = {0}, *kp = &key;
        snprintf(key.effect_id, sizeof key.effect_id, "%s", eid);
        intake_msg_t **hit = bsearch(&kp, sorted, n, sizeof *sorted, cmp_effect_id);
        if (!hit)
            continue;
        intake_msg_t *m = *hit;
        created[m - d->batch] = true;
        c->created++;
        if (!add_reply(rp, m->in.run_id, eid, m))
            return false;
        if (strcmp(status, "PLANNED") == 0)
            c->planned++;
        const tally_audit_member_t data[] = {
            {"intent_id", m->in.id, false},
            {"tool", m->tool->name, false},
            {"operation_key", m->op_key, false},
            {"input_hash", m->input_hash, false},
            {"effect_class", tally_effect_class_name(m->tool->effect_class), false},
            {"traceparent", m->in.traceparent, false}, /* left out when absent */
        };
        bool claimed = strcmp(status, "DISPATCHING") == 0;
        /* One row: the effect's first transition carries the intent it came from (merged
         * from a separate "intent" row: one audit row less per effect, the same facts). */
        audit_add(ab, m->in.run_id, eid, "transition", NULL, claimed ? "PLANNED" : status,
                  d->worker_id, why, data, sizeof data / sizeof data[0]);
        if (claimed) {
            /* Claimed in the same statement: the claim's own transition, as deliver.c's. */
            m->dispatch = true;
            m->epoch = atoll(PQgetvalue(res, row, 3));
            m->attempts = atoi(PQgetvalue(res, row, 4));
            char epoch[24], attempt[16];
            snprintf(epoch, sizeof epoch, "%lld", (long long)m->epoch);
            snprintf(attempt, sizeof attempt, "%d", m->attempts);
            const tally_audit_member_t lease[] = {
                {"lease_owner", d->worker_id, false},
                {"lease_epoch", epoch, true},
                {"lease_until", PQgetvalue(res, row, 5), false},
                {"attempt", attempt, true},
            };
            audit_add(ab, m->in.run_id, eid, "transition", "PLANNED", "DISPATCHING", d->worker_id,
                      NULL, lease, sizeof lease / sizeof lease[0]);
            continue;
        }
        if (strcmp(status, "PLANNED") != 0) {
            effect_view_t v = {.effect_id = eid,
                               .run_id = m->in.run_id,
                               .step = m->in.step,
                               .step_is_number = m->in.step_is_number,
                               .tool = m->tool->name,
                               .operation_key = m->op_key,
                               .status = status,
                               .error_code = why ? "run_not_active" : NULL,
                               .error_message = why,
                               .intent_id = m->in.id};
            if (!dispatch_publish_effect(d, ob, &v, NULL))
                return false;
        }
    }
    return true;
}

/* The intents that created nothing: a replay of the same effect, or a conflict. */
static bool record_existing(dispatcher_t *d, PGresult *res, tally_audit_batch_t *ab,
                            tally_outbox_batch_t *ob, intake_counts_t *c, tally_columns_t *rp,
                            tally_error_t *err)
{
    for (int row = 0; row < PQntuples(res); row++) {
        int ord = atoi(PQgetvalue(res, row, 0));
        if (ord < 0 || (size_t)ord >= d->n_batch)
            continue;
        intake_msg_t *m = &d->batch[ord];
        const char *eid = val(res, row, 1);
        const char *sid = val(res, row, 14);
        const char *run_status = val(res, row, 17);
        bool same = eid && strcmp(PQgetvalue(res, row, 8), m->input_hash) == 0;
        if (!same && !sid && run_status &&
            (strcmp(run_status, "COMPLETING") == 0 || strcmp(run_status, "COMPLETED") == 0)) {
            /* A completed run takes no new intent (its effects' replays are answered). */
            if (!reject_not_active(d, ob, ab, m, run_status, c)) {
                tally_error_set(err, "oom", true, "out of memory building a refusal");
                return false;
            }
            continue;
        }
        if (same) {
            /* Rule 5: the same effect. Answer with its state, naming this intent; its later
             * answers go to this intent's reply destination too. */
            c->replay++;
            if (!add_reply(rp, PQgetvalue(res, row, 2), eid, m)) {
                tally_error_set(err, "oom", true, "out of memory noting a reply destination");
                return false;
            }
            json_t *receipt = NULL;
            if (val(res, row, 9))
                receipt = json_loads(PQgetvalue(res, row, 9), 0, NULL);
            effect_view_t v = {.effect_id = eid,
                               .run_id = m->in.run_id,
                               .step = m->in.step,
                               .step_is_number = m->in.step_is_number,
                               .tool = PQgetvalue(res, row, 5),
                               .operation_key = PQgetvalue(res, row, 6),
                               .status = PQgetvalue(res, row, 7),
                               .receipt = receipt,
                               .external_ref = val(res, row, 10),
                               .error_code = val(res, row, 11),
                               .error_message = val(res, row, 12),
                               .attempts = atoll(PQgetvalue(res, row, 13)),
                               .intent_id = m->in.id,
                               .own = true,
                               .reply_to = m->reply};
            json_t *extra = json_pack(
                "{s:b, s:s, s:o}", "replay", 1, "effect_run_id", PQgetvalue(res, row, 2),
                "effect_step",
                dispatch_step_json(PQgetvalue(res, row, 3), PQgetvalue(res, row, 4)[0] == 't'));
            bool ok = extra && dispatch_publish_effect(d, ob, &v, extra);
            const tally_audit_member_t data[] = {
                {"intent_id", m->in.id, false},
                {"replay_of", eid, false},
                {"status", v.status, false},
            };
            audit_add(ab, m->in.run_id, eid, "intent", NULL, NULL, d->worker_id,
                      "replay: same tool, operation key and input hash", data,
                      sizeof data / sizeof data[0]);
            json_decref(extra);
            json_decref(receipt);
            if (!ok) {
                tally_error_set(err, "oom", true, "out of memory building a replay event");
                return false;
            }
            continue;
        }
        if (!eid && !sid) {
            /* The conflicting row vanished between the INSERT and this SELECT: only a
             * concurrent transaction that rolled back can do that. Try the batch again. */
            tally_error_set(err, "race", true,
                            "intent %s created nothing yet no effect holds its key or step",
                            m->in.id);
            return false;
        }
        c->conflict++;
        char msg[1024];
        const char *other = eid ? eid : sid;
        if (eid)
            /* lint: slice (the first 12 hex digits of each input hash) */
            tally_fmt(msg, sizeof msg,
                      "operation key '%s' of tool '%s' is already effect %s with different "
                      "arguments (input hash %.*s, this intent's %.*s)",
                      m->op_key, m->tool->name, eid, 12, PQgetvalue(res, row, 8), 12,
                      m->input_hash);
        else
            tally_fmt(msg, sizeof msg,
                      "step %s of run %s is already effect %s (tool '%s', key '%s')", m->in.step,
                      m->in.run_id, sid, PQgetvalue(res, row, 15), PQgetvalue(res, row, 16));
        /* effect_id names the effect that holds the key or step (DESIGN §5 keeps effect_id in
         * every effect event); status CONFLICT is this intent's own answer */
        effect_view_t v = {.effect_id = other,
                           .run_id = m->in.run_id,
                           .step = m->in.step,
                           .step_is_number = m->in.step_is_number,
                           .tool = m->tool->name,
                           .operation_key = m->op_key,
                           .status = "CONFLICT",
                           .error_code = "conflict",
                           .error_message = msg,
                           .intent_id = m->in.id,
                           .own = true,
                           .reply_to = m->reply};
        json_t *extra = json_pack("{s:s}", "conflicting_effect_id", other);
        bool ok = extra && dispatch_publish_effect(d, ob, &v, extra);
        const tally_audit_member_t data[] = {
            {"intent_id", m->in.id, false},
            {"operation_key", m->op_key, false},
            {"input_hash", m->input_hash, false},
            {"tool", m->tool->name, false},
        };
        audit_add(ab, m->in.run_id, other, "conflict", NULL, NULL, d->worker_id, msg, data,
                  sizeof data / sizeof data[0]);
        json_decref(extra);
        if (!ok) {
            tally_error_set(err, "oom", true, "out of memory building a conflict event");
            return false;
        }
    }
    return true;
}

static int tool_index(dispatcher_t *d, const tally_tool_t *tool)
{
    for (size_t t = 0; t < tally_registry_count(d->reg); t++)
        if (tally_registry_at(d->reg, t) == tool)
            return (int)t;
    return -1;
}

/* The calls of the effects messages [lo, hi) claimed, once their COMMIT made the claims
 * durable. */
static void start_claimed(dispatcher_t *d, size_t lo, size_t hi)
{
    for (size_t i = lo; i < hi; i++) {
        intake_msg_t *m = &d->batch[i];
        if (!m->dispatch)
            continue;
        dispatch_call_t *call =
            dispatch_call_new(m->effect_id, m->in.run_id, m->in.step, m->in.step_is_number, m->tool,
                              m->op_key, m->in.id, m->epoch, m->attempts);
        if (!call) {
            TALLY_ERROR("effect %s claimed but out of memory; its lease will expire", m->effect_id);
            continue;
        }
        deliver_start(d, call, m->canonical, strlen(m->canonical), m->in.traceparent);
    }
}

/* complete_run requests (docs/agent-protocol.md): an ACTIVE run turns COMPLETING, and
 * COMPLETED at once when nothing of it is in flight; a COMPLETED one is answered with its
 * summary again; a COMPLETING one is answered when it completes; any other (cancelled, under
 * compensation) refuses with run_not_active. */
static bool complete_runs(dispatcher_t *d, intake_msg_t **ms, size_t n, tally_audit_batch_t *ab,
                          tally_outbox_batch_t *ob, intake_counts_t *c, tally_error_t *err)
{
    bool ok = false;
    PGresult *res = NULL, *moved = NULL;
    const char **moving = calloc(n, sizeof *moving);
    size_t n_moving = 0, done = 0;
    char *ids = NULL;
    for (size_t i = 0; moving && i < n; i++)
        moving[i] = ms[i]->in.run_id;
    if (!moving || !(ids = tally_pg_text_array(moving, n))) {
        tally_error_set(err, "oom", true, "out of memory listing the runs to complete");
        goto out;
    }
    const char *params[1] = {ids};
    res = tally_pg_exec(d->pg, SQL_COMPLETE_LOCK, 1, params, err);
    if (!res)
        goto out;
    for (size_t i = 0; i < n; i++) {
        intake_msg_t *m = ms[i];
        const char *status = "ACTIVE", *summary = NULL, *why = NULL;
        for (int row = 0; row < PQntuples(res); row++)
            if (strcmp(PQgetvalue(res, row, 0), m->in.run_id) == 0) {
                status = PQgetvalue(res, row, 1);
                why = val(res, row, 2);
                summary = val(res, row, 3);
            }
        const tally_audit_member_t data[] = {{"intent_id", m->in.id, false}};
        if (strcmp(status, "ACTIVE") == 0 || strcmp(status, "COMPLETING") == 0) {
            audit_add(ab, m->in.run_id, NULL, "complete_run", NULL, NULL, d->worker_id,
                      m->in.reason, data, 1);
            moving[n_moving++] = m->in.run_id;
        } else if (strcmp(status, "COMPLETED") == 0) {
            audit_add(ab, m->in.run_id, NULL, "complete_run", NULL, NULL, d->worker_id,
                      m->in.reason, data, 1);
            if (!tally_runops_completed_event(m->in.run_id, why, summary, d->source, ob))
                goto oom;
        } else if (!reject_not_active(d, ob, ab, m, status, c)) {
            goto oom;
        }
    }
    if (n_moving > 0) {
        moved = tally_pg_exec(d->pg, SQL_COMPLETING, 1, params, err);
        if (!moved)
            goto out;
        for (int row = 0; row < PQntuples(moved); row++) {
            tally_audit_event_t ev = {.run_id = PQgetvalue(moved, row, 0),
                                      .kind = "transition",
                                      .from_status = "ACTIVE",
                                      .to_status = "COMPLETING",
                                      .actor = d->worker_id,
                                      .reason = "complete_run"};
            tally_audit_batch_add(ab, &ev);
        }
        if (!tally_runops_complete(d->pg, moving, n_moving, (int)n_moving, 0, d->worker_id,
                                   d->source, ob, ab, &done, err))
            goto out;
    }
    ok = true;
    goto out;
oom:
    tally_error_set(err, "oom", true, "out of memory answering complete_run");
out:
    PQclear(res);
    PQclear(moved);
    free(moving);
    free(ids);
    return ok;
}

/* Everything messages [lo, hi) of the batch say, in one transaction. The caller commits or
 * rolls back. The messages are leased to this worker's relay and @p handed receives them, for
 * the caller to hand to the relay after COMMIT. */
static bool intake_write(dispatcher_t *d, size_t lo, size_t hi, tally_audit_batch_t *ab,
                         tally_outbox_batch_t *ob, intake_counts_t *c, PGresult **handed,
                         tally_error_t *err)
{
    bool ok = false;
    /* The statements' $1 */
    tally_columns_t runs = {0}, effects = {0}, existing = {0}, replies = {0};
    tally_columns_init(&runs, 2);
    tally_columns_init(&effects, EFFECT_COLS);
    tally_columns_init(&existing, 5);
    tally_columns_init(&replies, REPLY_COLS);
    /* complete_run: the messages, and the runs they name */
    intake_msg_t **completes = calloc(d->n_batch ? d->n_batch : 1, sizeof *completes);
    size_t n_completes = 0;
    intake_msg_t **sorted = calloc(d->n_batch ? d->n_batch : 1, sizeof *sorted);
    bool *created = calloc(d->n_batch ? d->n_batch : 1, sizeof *created);
    /* compensate_run / cancel_run: the same run-level SQL as `tally compensate|cancel` */
    tally_runop_t *ops = calloc(d->n_batch ? d->n_batch : 1, sizeof *ops);
    tally_runop_result_t *op_results = calloc(d->n_batch ? d->n_batch : 1, sizeof *op_results);
    size_t n_tools = tally_registry_count(d->reg);
    int *room = calloc(n_tools ? n_tools : 1, sizeof *room);
    PGresult *res = NULL;
    size_t n_sorted = 0, n_ops = 0;
    if (!sorted || !created || !ops || !op_results || !room || !completes) {
        tally_error_set(err, "oom", true, "out of memory building the intake batch");
        goto out;
    }

    for (size_t t = 0; t < n_tools; t++)
        room[t] = tally_connector_capacity(d->conn, tally_registry_at(d->reg, t));
    for (size_t i = lo; i < hi; i++) {
        intake_msg_t *m = &d->batch[i];
        m->dispatch = false;                         /* a retried batch claims again */
        if (m->reason == TALLY_DLQ_RUN_NOT_ACTIVE) { /* decided by the failed try: decide again */
            m->reason = TALLY_DLQ_NONE;
            m->detail[0] = m->field[0] = '\0';
        }
        if (m->reason != TALLY_DLQ_NONE) {
            if (!refuse(d, ob, m)) {
                tally_error_set(err, "oom", true, "out of memory building a DLQ record");
                goto out;
            }
            c->dlq++;
            if ((size_t)m->reason < sizeof c->dlq_by_reason / sizeof c->dlq_by_reason[0])
                c->dlq_by_reason[m->reason]++;
            continue;
        }
        const tally_intent_t *in = &m->in;
        bool run = tally_columns_row_begin(&runs) && tally_columns_text(&runs, in->run_id) &&
                   tally_columns_text(&runs, in->tenant);
        if (!tally_columns_row_end(&runs, run))
            goto oom;
        /* An intent after a complete_run of its run in this batch: the run is over for it. */
        bool after_complete = false;
        for (size_t k = 0; k < n_completes && in->type == TALLY_MSG_INTENT; k++)
            after_complete = after_complete || strcmp(completes[k]->in.run_id, in->run_id) == 0;
        if (after_complete) {
            if (!reject_not_active(d, ob, ab, m, "COMPLETING", c))
                goto oom;
            continue;
        }
        switch (in->type) {
        case TALLY_MSG_COMPLETE_RUN:
            c->complete++;
            completes[n_completes++] = m;
            if (!add_reply(&replies, in->run_id, NULL, m))
                goto oom;
            break;
        case TALLY_MSG_INTENT: {
            bool gated =
                m->tool->effect_class == TALLY_CLASS_DESTRUCTIVE || m->tool->requires_approval;
            /* Claim it now if its tool has room in this worker (the intents of one batch
             * share that room; a replay or conflict wastes a slot only until COMMIT). No
             * lease_ms (null): not claimed. */
            char ord[16], lease_ms[16];
            const char *lease = NULL;
            int t = tool_index(d, m->tool);
            if (!gated && t >= 0 && room[t] > 0) {
                room[t]--;
                snprintf(lease_ms, sizeof lease_ms, "%d", dispatch_lease_ms(d, m->tool));
                lease = lease_ms;
            }
            snprintf(ord, sizeof ord, "%d", (int)i);
            tally_columns_t *rs = &effects; /* in SQL_EFFECTS' order */
            bool row = tally_columns_row_begin(rs) && tally_columns_text(rs, ord) &&
                       tally_columns_text(rs, m->effect_id) && tally_columns_text(rs, in->run_id) &&
                       tally_columns_text(rs, in->step) &&
                       tally_columns_text(rs, in->step_is_number ? in->step : NULL) &&
                       tally_columns_text(rs, m->tool->name) &&
                       tally_columns_text(rs, tally_effect_class_name(m->tool->effect_class)) &&
                       tally_columns_text(rs, m->op_key) && tally_columns_text(rs, m->input_hash) &&
                       tally_columns_text(rs, m->canonical) && tally_columns_text(rs, in->tenant) &&
                       tally_columns_text(rs, in->traceparent) && tally_columns_text(rs, in->id) &&
                       tally_columns_text(rs, gated ? "true" : "false") &&
                       tally_columns_text(rs, lease);
            if (!tally_columns_row_end(rs, row))
                goto oom;
            sorted[n_sorted++] = m;
            break;
        }
        case TALLY_MSG_CANCEL_RUN:
        case TALLY_MSG_COMPENSATE_RUN:
            if (!add_reply(&replies, in->run_id, NULL, m))
                goto oom;
            if (in->type == TALLY_MSG_CANCEL_RUN)
                c->cancel++;
            else
                c->compensate++;
            ops[n_ops++] =
                (tally_runop_t){.kind = in->type == TALLY_MSG_CANCEL_RUN ? TALLY_RUNOP_CANCEL
                                                                         : TALLY_RUNOP_COMPENSATE,
                                .run_id = in->run_id,
                                .compensate = in->type == TALLY_MSG_CANCEL_RUN && in->compensate,
                                .reason = in->reason,
                                .intent_id = in->id};
            break;
        }
    }
    qsort(sorted, n_sorted, sizeof *sorted, cmp_effect_id);

    if (!tally_pg_begin(d->pg, err))
        goto out;
    if (runs.n > 0 && !exec_rows(d, SQL_RUNS, &runs, NULL, NULL, err))
        goto out;
    if (effects.n > 0) {
        if (!exec_rows(d, SQL_EFFECTS, &effects, d->worker_id, &res, err))
            goto out;
        if (!record_created(d, res, sorted, n_sorted, ab, ob, c, created, &replies))
            goto oom;
        PQclear(res);
        res = NULL;
        for (size_t k = 0; k < n_sorted; k++) {
            intake_msg_t *m = sorted[k];
            if (created[m - d->batch])
                continue;
            char ord[16];
            snprintf(ord, sizeof ord, "%d", (int)(m - d->batch));
            tally_columns_t *rs = &existing; /* in SQL_EXISTING's order */
            bool row = tally_columns_row_begin(rs) && tally_columns_text(rs, ord) &&
                       tally_columns_text(rs, m->tool->name) && tally_columns_text(rs, m->op_key) &&
                       tally_columns_text(rs, m->in.run_id) && tally_columns_text(rs, m->in.step);
            if (!tally_columns_row_end(rs, row))
                goto oom;
        }
        if (existing.n > 0) {
            if (!exec_rows(d, SQL_EXISTING, &existing, NULL, &res, err))
                goto out;
            if (!record_existing(d, res, ab, ob, c, &replies, err))
                goto out;
            PQclear(res);
            res = NULL;
        }
    }
    /* The reply destinations first: the answers below are copied to them. */
    if (replies.n > 0 && !exec_rows(d, SQL_REPLIES, &replies, NULL, NULL, err))
        goto out;
    if (n_ops > 0 &&
        !tally_runops_apply(d->pg, ops, n_ops, d->worker_id, d->source, ob, ab, op_results, err))
        goto out;
    if (n_completes > 0 && !complete_runs(d, completes, n_completes, ab, ob, c, err))
        goto out;
    if (!tally_audit_batch_flush(ab, d->pg, err) ||
        !dispatch_flush_messages(d, d->pg, ob, handed, err))
        goto out;
    ok = true;
    goto out;
oom:
    if (runs.bad_text || effects.bad_text || existing.bad_text || replies.bad_text)
        tally_error_set(err, "invalid_text", false, "intake batch not written: %s",
                        runs.bad_text      ? runs.why
                        : effects.bad_text ? effects.why
                        : replies.bad_text ? replies.why
                                           : existing.why);
    else
        tally_error_set(err, "oom", true, "out of memory building the intake batch");
out:
    PQclear(res);
    tally_columns_release(&runs);
    tally_columns_release(&effects);
    tally_columns_release(&existing);
    tally_columns_release(&replies);
    free(completes);
    free(ops);
    free(op_results);
    free(sorted);
    free(created);
    free(room);
    return ok;
}

/* Offsets of the committed batch: the next offset to read, per partition. */
static void store_offsets(dispatcher_t *d)
{
    rd_kafka_topic_partition_list_t *offs = rd_kafka_topic_partition_list_new(8);
    for (size_t i = 0; i < d->n_batch; i++) {
        const rd_kafka_message_t *rkm = d->batch[i].rkm;
        const char *topic = rd_kafka_topic_name(rkm->rkt);
        rd_kafka_topic_partition_t *tp =
            rd_kafka_topic_partition_list_find(offs, topic, rkm->partition);
        if (!tp)
            tp = rd_kafka_topic_partition_list_add(offs, topic, rkm->partition);
        if (rkm->offset + 1 > tp->offset)
            tp->offset = rkm->offset + 1;
    }
    rd_kafka_resp_err_t err = rd_kafka_offsets_store(d->rk, offs);
    if (err != RD_KAFKA_RESP_ERR_NO_ERROR) {
        /* A partition revoked while the batch was in flight: its new owner reads these
         * messages again and the ledger answers them as replays. */
        for (int i = 0; i < offs->cnt; i++)
            if (offs->elems[i].err)
                TALLY_INFO("offset %lld of %s [%d] not stored (%s): the partition's next owner "
                           "will see those messages again",
                           (long long)offs->elems[i].offset, offs->elems[i].topic,
                           (int)offs->elems[i].partition, rd_kafka_err2str(offs->elems[i].err));
    }
    rd_kafka_topic_partition_list_destroy(offs);
}

/* Write messages [lo, hi) of the batch and commit; then hand their messages to the relay,
 * start the calls they claimed, and count them. */
static bool intake_commit(dispatcher_t *d, size_t lo, size_t hi, tally_error_t *err)
{
    intake_counts_t c = {0};
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    PGresult *handed = NULL;
    bool ok = ab && ob && intake_write(d, lo, hi, ab, ob, &c, &handed, err) &&
              tally_pg_commit(d->pg, err);
    if (!ab || !ob)
        tally_error_set(err, "oom", true, "out of memory");
    tally_audit_batch_free(ab);
    tally_outbox_batch_free(ob);
    if (!ok) {
        PQclear(handed);
        tally_pg_rollback(d->pg);
        return false;
    }
    dispatch_hand_messages(d, handed);
    TALLY_CRASHPOINT("dispatch.after_intake_commit");
    start_claimed(d, lo, hi);
    if (c.planned)
        d->claim_wanted = true; /* no room to claim them with the batch: claim when it frees */
    tally_metric_add(d->m_intents, c.created, "created");
    tally_metric_add(d->m_intents, c.replay, "replay");
    tally_metric_add(d->m_intents, c.conflict, "conflict");
    tally_metric_add(d->m_intents, c.dlq, "dlq");
    tally_metric_add(d->m_intents, c.cancel, "cancel_run");
    tally_metric_add(d->m_intents, c.compensate, "compensate_run");
    for (size_t r = 1; r < sizeof c.dlq_by_reason / sizeof c.dlq_by_reason[0]; r++)
        if (c.dlq_by_reason[r])
            tally_metric_add(d->m_dlq, c.dlq_by_reason[r],
                             tally_dlq_reason_name((tally_dlq_reason_t)r));
    if (c.dlq)
        TALLY_INFO("intake: %d created, %d replayed, %d conflicts, %d to the DLQ", c.created,
                   c.replay, c.conflict, c.dlq);
    else
        TALLY_DEBUG("intake: %d created, %d replayed, %d conflicts", c.created, c.replay,
                    c.conflict);
    return true;
}

int intake_step(dispatcher_t *d)
{
    if (d->draining || !d->rk)
        return 0;
    size_t limit = (size_t)(d->cfg->batch_size > 0 ? d->cfg->batch_size : 1);
    /* Keep serving the consumer (rebalances, errors) even while paused or holding a failed
     * batch; paused partitions deliver nothing. */
    d->intake_more = false;
    /* Holding a failed batch (partitions paused): poll anyway, one message at most. */
    size_t cap = d->intake_failed ? d->n_batch + 1 : limit;
    while (d->n_batch < cap) {
        rd_kafka_message_t *rkm = rd_kafka_consumer_poll(d->rk, 0);
        if (!rkm)
            break;
        if (rkm->err) {
            if (rkm->err != RD_KAFKA_RESP_ERR__PARTITION_EOF)
                TALLY_WARN("consumer: %s", rd_kafka_message_errstr(rkm));
            rd_kafka_message_destroy(rkm);
            continue;
        }
        if (!batch_push(d, rkm)) {
            /* Not stored, so not lost: Kafka delivers it again after a restart. */
            TALLY_ERROR("out of memory holding an intent; it stays uncommitted in Kafka");
            rd_kafka_message_destroy(rkm);
            break;
        }
        if (d->n_batch >= limit)
            d->intake_more = true;
    }
    if (d->n_batch == 0)
        return 0;
    if (d->intake_failed && dispatch_now() < d->intake_retry_at)
        return 0;

    for (size_t i = 0; i < d->n_batch; i++)
        if (!d->batch[i].parsed)
            parse_msg(d, &d->batch[i]);
    for (size_t i = 0; i < d->n_batch; i++)
        if (!d->batch[i].parsed) {
            d->intake_failed = true;
            d->intake_retry_at = dispatch_now() + 0.5;
            return -1;
        }

    /* Write the batch; a part PostgreSQL refuses for its data is split in halves until the
     * message at fault stands alone, which is then dead-lettered with the refusal. */
    while (d->intake_done < d->n_batch) {
        size_t lo = d->intake_done, hi = d->n_batch;
        if (d->intake_window > 0 && lo + d->intake_window < hi)
            hi = lo + d->intake_window;
        tally_error_t err;
        tally_error_clear(&err);
        if (intake_commit(d, lo, hi, &err)) {
            d->intake_done = hi;
            d->intake_window *= 2; /* past the message at fault: grow back to whole batches */
            continue;
        }
        if (tally_pg_error_is_data(&err) &&
            !(hi - lo == 1 && d->batch[lo].reason != TALLY_DLQ_NONE)) {
            tally_metric_add(d->m_db_errors, 1, "intake_refused");
            if (hi - lo > 1) {
                d->intake_window = (hi - lo) / 2;
                TALLY_WARN("intake: PostgreSQL refused a batch of %zu messages (%s: %s); "
                           "writing it in parts of %zu to find the message at fault",
                           hi - lo, err.code, err.message, d->intake_window);
                continue;
            }
            intake_msg_t *m = &d->batch[lo];
            m->reason = TALLY_DLQ_LEDGER_REFUSED;
            tally_fmt(m->detail, sizeof m->detail, "PostgreSQL refused to store it (%s: %s)",
                      err.code, err.message);
            TALLY_WARN("intake: message %s [%d] offset %lld is refused by PostgreSQL (%s: %s); "
                       "it goes to the DLQ",
                       rd_kafka_topic_name(m->rkm->rkt), (int)m->rkm->partition,
                       (long long)m->rkm->offset, err.code, err.message);
            continue;
        }
        /* Retriable (a connection, a lock), or not the data's fault: hold the batch, retry. */
        d->intake_backoff_ms = d->intake_backoff_ms ? d->intake_backoff_ms * 2 : 100;
        if (d->intake_backoff_ms > 5000)
            d->intake_backoff_ms = 5000;
        d->intake_retry_at = dispatch_now() + d->intake_backoff_ms / 1000.0;
        if (!d->intake_failed)
            TALLY_ERROR("intake batch of %zu messages not written (%s: %s); holding it and "
                        "retrying in %d ms, offsets not stored",
                        hi - lo, err.code, err.message, d->intake_backoff_ms);
        else
            TALLY_LOG_REPEATING(
                TALLY_LOG_WARN, NULL,
                "intake batch of %zu messages still not written (%s: %s); retrying in "
                "%d ms",
                hi - lo, err.code, err.message, d->intake_backoff_ms);
        d->intake_failed = true;
        tally_metric_add(d->m_db_errors, 1, "intake");
        tally_worker_set_ready(d->w, false, err.message);
        return -1;
    }
    if (d->intake_failed) {
        TALLY_INFO("intake batch of %zu messages written after retrying", d->n_batch);
        tally_worker_set_ready(d->w, true, NULL);
    }
    d->intake_backoff_ms = 0;
    store_offsets(d);
    int n = (int)d->n_batch;
    intake_discard(d);
    return n;
}
