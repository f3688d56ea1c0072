/* outbox.c — the message outbox writer: events for Kafka, written in the caller's transaction. */
#include "tally/outbox.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/cloudevent.h"
#include "tally/log.h"
#include "tally/text.h"

/* The batch is kept as its parameter's columns (columns.h): each event, serialised once,
 * reaches PostgreSQL byte for byte, neither escaped into a JSON string nor lexed out of one. */
struct tally_outbox_batch {
    tally_columns_t cols;
};

/* topic, msg_key, event_id, effect_id, payload, scope, reply (TALLY_OUTBOX_INSERT), and ref
 * (TALLY_OUTBOX_REFS_CTES) */
#define N_COLS 8

/* "n" keeps the order of the batch in message_outbox.id, which is the relay's order. */
static const char SQL_INSERT[] = TALLY_OUTBOX_INSERT("$1", "");

static void add_row(tally_outbox_batch_t *b, const char *topic, const char *key,
                    const char *event_id, const char *effect_id, const char *payload,
                    const char *fanout, const char *reply, const char *ref);
static bool uuid_text(const char *s);

tally_outbox_batch_t *tally_outbox_batch_new(void)
{
    tally_outbox_batch_t *b = calloc(1, sizeof(tally_outbox_batch_t));
    if (b)
        tally_columns_init(&b->cols, N_COLS);
    return b;
}

void tally_outbox_batch_add(tally_outbox_batch_t *b, const char *topic, const char *key,
                            const json_t *event)
{
    tally_columns_t *c = &b->cols;
    if (c->failed)
        return;
    if (event == NULL) { /* the rest is checked by tally_outbox_batch_add_text */
        tally_columns_fail(c, "a message needs a topic and an event");
        return;
    }
    /* the effect the message is about, when its data names one (TALLY_OUTBOX_INSERT) */
    const char *about =
        json_string_value(json_object_get(json_object_get(event, "data"), "effect_id"));
    char *payload = json_dumps(event, JSON_COMPACT);
    if (payload == NULL) {
        tally_columns_fail(c, "out of memory while serialising an outbox message");
        return;
    }
    /* A run's own events go to the replies of its run (its compensate, cancel and complete
     * requests); an effect's to its effect's. */
    const char *type = json_string_value(json_object_get(event, "type"));
    bool run_event = type != NULL && strncmp(type, "tally.run.", 10) == 0 && about == NULL;
    bool outcome = topic != NULL && strcmp(topic, "outcomes") == 0;
    add_row(b, topic, key, json_string_value(json_object_get(event, "id")), about, payload,
            !outcome           ? NULL
            : run_event        ? "run"
            : uuid_text(about) ? "effect"
                               : NULL,
            NULL, NULL);
    free(payload);
}

/* An effect id as PostgreSQL's uuid reads it (36 characters, hex and dashes). */
static bool uuid_text(const char *s)
{
    if (s == NULL || strlen(s) != 36)
        return false;
    for (int i = 0; i < 36; i++) {
        bool dash = i == 8 || i == 13 || i == 18 || i == 23;
        if (dash ? s[i] != '-' : !isxdigit((unsigned char)s[i]))
            return false;
    }
    return true;
}

void tally_outbox_batch_add_text(tally_outbox_batch_t *b, const char *topic, const char *key,
                                 const char *event_id, const char *effect_id, const char *payload)
{
    tally_outbox_batch_add_answer(b, topic, key, event_id, effect_id, payload, TALLY_REPLY_AUTO,
                                  NULL);
}

void tally_outbox_batch_add_answer(tally_outbox_batch_t *b, const char *topic, const char *key,
                                   const char *event_id, const char *effect_id, const char *payload,
                                   tally_reply_scope_t scope, const char *reply_to)
{
    const char *fanout = NULL;
    if (scope == TALLY_REPLY_AUTO && topic != NULL && strcmp(topic, "outcomes") == 0 &&
        uuid_text(effect_id))
        fanout = "effect";
    add_row(b, topic, key, event_id, effect_id, payload, fanout, NULL, NULL);
    if (reply_to != NULL)
        add_row(b, "replies", key, event_id, effect_id, payload, NULL, reply_to, NULL);
}

void tally_outbox_batch_add_ref(tally_outbox_batch_t *b, const char *topic, const char *key,
                                const char *event_id, const char *effect_id, const char *payload)
{
    add_row(b, topic, key, event_id, effect_id, payload,
            topic != NULL && strcmp(topic, "outcomes") == 0 && uuid_text(effect_id) ? "effect"
                                                                                    : NULL,
            NULL, event_id);
}

/* One row: @p fanout the reply scope ("effect", "run" or NULL), @p reply its own destination
 * (topic "replies"), @p ref the audit event the relay may build it from (or NULL). */
static void add_row(tally_outbox_batch_t *b, const char *topic, const char *key,
                    const char *event_id, const char *effect_id, const char *payload,
                    const char *fanout, const char *reply, const char *ref)
{
    tally_columns_t *c = &b->cols;
    if (c->failed)
        return;
    if (topic == NULL || payload == NULL) {
        tally_columns_fail(c, "a message needs a topic and an event");
        return;
    }
    if (event_id == NULL || *event_id == '\0') {
        tally_columns_fail(c, "the event for topic '%s' has no string \"id\" to deduplicate by",
                           topic);
        return;
    }
    /* Every event must fit the broker's message limit, or the relay could never publish it:
     * a larger one goes out cut, naming where the ledger keeps it whole (cloudevent.h). */
    char *bounded = NULL;
    size_t len = strlen(payload);
    if (len > TALLY_LIMIT_EVENT_BYTES) {
        bounded = tally_ce_bounded(payload, TALLY_LIMIT_EVENT_BYTES);
        if (bounded == NULL) {
            tally_columns_fail(c,
                               "the event %s for topic '%s' is %zu bytes, above the limit of %d, "
                               "and could not be cut",
                               event_id, topic, len, TALLY_LIMIT_EVENT_BYTES);
            return;
        }
        TALLY_WARN("event %s for topic '%s' is %zu bytes, above the limit of %d bytes: "
                   "published cut to %zu bytes (data.truncated says what was cut)",
                   event_id, topic, len, TALLY_LIMIT_EVENT_BYTES, strlen(bounded));
        payload = bounded;
    }
    bool ok = tally_columns_row_begin(c) && tally_columns_text(c, topic) &&
              tally_columns_text(c, key) && tally_columns_text(c, event_id) &&
              tally_columns_text(c, effect_id) && tally_columns_text(c, payload) &&
              tally_columns_text(c, fanout) && tally_columns_text(c, reply) &&
              tally_columns_text(c, ref);
    free(bounded);
    if (!tally_columns_row_end(c, ok))
        tally_columns_fail(c,
                           "the message for topic '%s' could not be queued (out of memory, or "
                           "a key or event that is not UTF-8)",
                           topic);
}

size_t tally_outbox_batch_len(const tally_outbox_batch_t *b)
{
    return b->cols.n;
}

/* The parameter, or NULL with @p err set (the batch then failed, or memory ran out). */
static const char *param_or_error(tally_outbox_batch_t *b, int *len, tally_error_t *err)
{
    const char *why = NULL;
    const char *param = tally_outbox_batch_param(b, len, &why);
    if (param == NULL && b->cols.failed)
        tally_error_setc(err, b->cols.bad_text ? TALLY_ERR_INVALID_TEXT : TALLY_ERR_OUTBOX,
                         "outbox batch not written: %s", why);
    else if (param == NULL)
        tally_error_setc(err, TALLY_ERR_OOM, "outbox batch not written: out of memory");
    return param;
}

bool tally_outbox_batch_flush(tally_outbox_batch_t *b, tally_pg_t *pg, tally_error_t *err)
{
    int len = 0, format = 1;
    const char *param = param_or_error(b, &len, err);
    bool ok = param != NULL;
    if (ok && b->cols.n > 0) {
        PGresult *res = tally_pg_exec_bin(pg, SQL_INSERT, 1, &param, &len, &format, err);
        ok = res != NULL;
        PQclear(res);
    }
    tally_columns_reset(&b->cols);
    return ok;
}

static const char SQL_INSERT_HANDED[] = TALLY_OUTBOX_INSERT_HANDED("$1", "", "$2", "$3");

bool tally_outbox_batch_flush_handed(tally_outbox_batch_t *b, tally_pg_t *pg, const char *owner,
                                     int lease_ms, PGresult **rows, tally_error_t *err)
{
    *rows = NULL;
    int lengths[3] = {0, 0, 0}, formats[3] = {1, 0, 0};
    const char *param = param_or_error(b, &lengths[0], err);
    bool ok = param != NULL;
    if (ok && b->cols.n > 0) {
        char lease[16];
        snprintf(lease, sizeof lease, "%d", lease_ms);
        const char *params[3] = {param, owner, lease};
        *rows = tally_pg_exec_bin(pg, SQL_INSERT_HANDED, 3, params, lengths, formats, err);
        ok = *rows != NULL;
    }
    tally_columns_reset(&b->cols);
    return ok;
}

const char *tally_outbox_batch_param(tally_outbox_batch_t *b, int *len, const char **why)
{
    const char *param = tally_columns_param(&b->cols, len);
    if (why)
        *why = param ? "" : b->cols.failed ? b->cols.why : "out of memory";
    return param;
}

void tally_outbox_batch_free(tally_outbox_batch_t *b)
{
    if (b == NULL)
        return;
    tally_columns_release(&b->cols);
    free(b);
}
