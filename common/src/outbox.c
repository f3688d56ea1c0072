/* outbox.c — the message outbox writer: events for Kafka, written in the caller's transaction. */
#include "tally/outbox.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tally_outbox_batch {
    json_t *rows; /* array of {n, topic, msg_key, event_id, payload} */
    bool failed;  /* sticky: an add could not be queued */
    char why[200];
};

/* "n" keeps the order of the batch in message_outbox.id, which is the relay's order. */
static const char SQL_INSERT[] =
    "INSERT INTO message_outbox (topic, msg_key, event_id, payload)"
    " SELECT r.topic, r.msg_key, r.event_id, r.payload"
    " FROM json_to_recordset($1::json) AS r(n int, topic text, msg_key text, event_id text,"
    " payload text)"
    " ORDER BY r.n";

tally_outbox_batch_t *tally_outbox_batch_new(void)
{
    tally_outbox_batch_t *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return NULL;
    b->rows = json_array();
    if (b->rows == NULL) {
        free(b);
        return NULL;
    }
    return b;
}

static void fail(tally_outbox_batch_t *b, const char *fmt, const char *arg)
{
    if (!b->failed)
        snprintf(b->why, sizeof(b->why), fmt, arg);
    b->failed = true;
}

void tally_outbox_batch_add(tally_outbox_batch_t *b, const char *topic, const char *key,
                            const json_t *event)
{
    if (b->failed)
        return;
    if (topic == NULL || event == NULL) {
        fail(b, "%s", "a message needs a topic and an event");
        return;
    }
    const char *event_id = json_string_value(json_object_get(event, "id"));
    if (event_id == NULL || *event_id == '\0') {
        fail(b, "the event for topic '%s' has no string \"id\" to deduplicate by", topic);
        return;
    }
    char *payload = json_dumps(event, JSON_COMPACT);
    if (payload == NULL) {
        fail(b, "%s", "out of memory while serialising an outbox message");
        return;
    }
    json_t *row =
        json_pack("{s:I, s:s, s:s?, s:s, s:s}", "n", (json_int_t)json_array_size(b->rows), "topic",
                  topic, "msg_key", key, "event_id", event_id, "payload", payload);
    free(payload);
    if (row == NULL) {
        fail(b,
             "the message for topic '%s' could not be queued (out of memory, or a key that is "
             "not UTF-8)",
             topic);
        return;
    }
    if (json_array_append_new(b->rows, row) != 0) /* releases row even when it fails */
        fail(b, "%s", "out of memory while queueing an outbox message");
}

size_t tally_outbox_batch_len(const tally_outbox_batch_t *b)
{
    return json_array_size(b->rows);
}

static void reset(tally_outbox_batch_t *b)
{
    json_array_clear(b->rows);
    b->failed = false;
    b->why[0] = '\0';
}

bool tally_outbox_batch_flush(tally_outbox_batch_t *b, tally_pg_t *pg, tally_error_t *err)
{
    if (b->failed) {
        tally_error_set(err, "outbox", false, "outbox batch not written: %s", b->why);
        reset(b);
        return false;
    }
    if (json_array_size(b->rows) == 0)
        return true;
    char *text = json_dumps(b->rows, JSON_COMPACT);
    if (text == NULL) {
        tally_error_set(err, "oom", false, "outbox batch not written: out of memory");
        reset(b);
        return false;
    }
    const char *params[1] = {text};
    bool ok = tally_pg_run(pg, SQL_INSERT, 1, params, err);
    free(text);
    reset(b);
    return ok;
}

void tally_outbox_batch_free(tally_outbox_batch_t *b)
{
    if (b == NULL)
        return;
    json_decref(b->rows);
    free(b);
}
