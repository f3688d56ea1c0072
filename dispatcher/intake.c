/* intake.c — intents into the ledger: take a Kafka poll batch, read and validate each message
 * (refusing the invalid ones to the DLQ with an answer), have intake_write.c write the batch in
 * one PostgreSQL transaction, and store the batch's offsets only after its COMMIT, so a crash
 * anywhere before makes Kafka deliver it again and the ledger's uniqueness turns the second
 * delivery into replays. */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/evp.h>

#include "dispatcher.h"
#include "tally/audit.h"
#include "tally/backoff.h"
#include "tally/crashpoint.h"
#include "tally/id.h"
#include "tally/json.h"
#include "tally/log.h"
#include "tally/text.h"

/* librdkafka's default message.max.bytes is 1,000,000: a DLQ record must stay below it even
 * when TALLY_MAX_MESSAGE_BYTES is larger, or the relay could never publish it. */
#define DLQ_MAX_BYTES     900000
#define DLQ_OVERHEAD      4096
#define DLQ_KEY_MAX_BYTES 1024

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
    intake_sensitive_clear(m);
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
    if (d->cs)
        tally_consume_forget(d->cs); /* after a store, nothing is left to forget */
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
        m->reason = err.errc == TALLY_ERR_INVALID_FIELD ? TALLY_DLQ_INVALID_FIELD
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
    const size_t size = len;
    if (m->dlq_original != NULL) {
        /* a sensitive tool's intent: its args redacted (sensitive.c), re-serialised */
        val = m->dlq_original;
        len = strlen(val);
        rc |= json_object_set_new(data, "original_redacted", json_true());
    } else if (m->dlq_withheld) {
        /* not readable as JSON while tools declare sensitive fields: which bytes are sensitive
         * cannot be known, so none is copied; the offset names the original */
        rc |= json_object_set_new(data, "original_withheld",
                                  json_string("the registry declares sensitive fields and this "
                                              "message cannot be read to redact them"));
        len = 0;
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
    rc |= json_object_set_new(data, "original_size", json_integer((json_int_t)size));
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

/* tally.intent.rejected.v1: the answer to a message tally refuses (dispatcher.h). */
bool intake_answer_rejected(dispatcher_t *d, tally_outbox_batch_t *ob, const intake_msg_t *m,
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
bool intake_refuse(dispatcher_t *d, tally_outbox_batch_t *ob, intake_msg_t *m)
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
    bool ok =
        intake_answer_rejected(d, ob, m, pk.id, pk.run_id, pk.step, pk.tool, pk.type, reply, true);
    free(reply);
    tally_intent_peek_clear(&pk);
    return ok;
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
        call->red = m->red; /* the call's now */
        m->red = NULL;
        deliver_start(d, call, m->canonical, strlen(m->canonical), m->in.traceparent);
    }
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
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory");
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

static int intake_write_batch(dispatcher_t *d);

int intake_step(dispatcher_t *d)
{
    if (d->draining || !d->cs)
        return 0;
    size_t limit = (size_t)(d->cfg->batch_size > 0 ? d->cfg->batch_size : 1);
    /* Keep serving the consumer (rebalances, errors) even while paused or holding a failed
     * batch; paused partitions deliver nothing. */
    d->intake_more = false;
    /* Holding a failed batch (partitions paused): poll anyway, one message at most. */
    size_t cap = d->intake_failed ? d->n_batch + 1 : limit;
    double t = dispatch_now();
    while (d->n_batch < cap) {
        rd_kafka_message_t *rkm = tally_consume_next(d->cs);
        if (!rkm)
            break;
        if (!batch_push(d, rkm)) {
            /* Not stored, so not lost: Kafka delivers it again after a restart. */
            TALLY_ERROR("out of memory holding an intent; it stays uncommitted in Kafka");
            rd_kafka_message_destroy(rkm);
            break;
        }
        tally_consume_note(d->cs, rkm); /* stored once the whole batch is committed */
        if (d->n_batch >= limit)
            d->intake_more = true;
    }
    dispatch_spent(d, "kafka", t);
    if (d->n_batch == 0)
        return 0;
    if (d->intake_failed && dispatch_now() < d->intake_retry_at)
        return 0;
    t = dispatch_now();
    int n = intake_write_batch(d);
    dispatch_spent(d, "intake", t);
    return n;
}

/* Parse and write the batch held (intake_step): @returns its messages once committed, -1 when
 * it is held for a retry. */
static int intake_write_batch(dispatcher_t *d)
{

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
        d->intake_backoff_ms = (int)tally_backoff_step_ms(++d->intake_failures, 100, 5000);
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
    d->intake_failures = d->intake_backoff_ms = 0;
    tally_consume_store(d->cs);
    int n = (int)d->n_batch;
    intake_discard(d);
    return n;
}
