/* outbox.c — the message outbox writer: events for Kafka, written in the caller's transaction. */
#include "tally/outbox.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/json.h"

/* The batch is kept as the text of its JSON parameter, built as messages are added: each
 * event is serialised once, and travels into the statement as JSON (not as an escaped JSON
 * string inside JSON, which costs a second serialisation with every quote escaped). */
struct tally_outbox_batch {
    char *text; /* "[{...},{...}" — the closing bracket is added by flush */
    size_t len, cap;
    size_t n;
    bool failed; /* sticky: an add could not be queued */
    char why[200];
};

/* "n" keeps the order of the batch in message_outbox.id, which is the relay's order. The
 * payload arrives as json, whose text PostgreSQL keeps byte for byte: the compact
 * serialisation made in tally_outbox_batch_add. A payload holding \u0000 (a dead letter's
 * original bytes) comes as a JSON string instead, payload_text: json_to_recordset cannot
 * take that escape inside a nested value. */
static const char SQL_INSERT[] =
    "INSERT INTO message_outbox (topic, msg_key, event_id, payload)"
    " SELECT r.topic, r.msg_key, r.event_id, coalesce(r.payload_text, r.payload::text)"
    " FROM json_to_recordset($1::json) AS r(n int, topic text, msg_key text, event_id text,"
    " payload json, payload_text text)"
    " ORDER BY r.n";

tally_outbox_batch_t *tally_outbox_batch_new(void)
{
    return calloc(1, sizeof(tally_outbox_batch_t));
}

static void fail(tally_outbox_batch_t *b, const char *fmt, const char *arg)
{
    if (!b->failed)
        snprintf(b->why, sizeof(b->why), fmt, arg);
    b->failed = true;
}

static bool put(tally_outbox_batch_t *b, const char *s, size_t n)
{
    if (b->len + n + 2 > b->cap) { /* room for "]" and the terminator at flush */
        size_t cap = b->cap ? b->cap : 4096;
        while (b->len + n + 2 > cap)
            cap *= 2;
        char *grown = realloc(b->text, cap);
        if (grown == NULL)
            return false;
        b->text = grown;
        b->cap = cap;
    }
    memcpy(b->text + b->len, s, n);
    b->len += n;
    return true;
}

/* @p s as a JSON string (or null). false when out of memory or @p s is not UTF-8. */
static bool put_string(tally_outbox_batch_t *b, const char *s)
{
    if (s == NULL)
        return put(b, "null", 4);
    size_t n = strlen(s);
    if (!tally_utf8_valid(s, n) || !put(b, "\"", 1))
        return false;
    size_t from = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        char esc[8];
        int k = c == '"'    ? snprintf(esc, sizeof(esc), "\\\"")
                : c == '\\' ? snprintf(esc, sizeof(esc), "\\\\")
                            : snprintf(esc, sizeof(esc), "\\u%04x", c);
        if (!put(b, s + from, i - from) || !put(b, esc, (size_t)k))
            return false;
        from = i + 1;
    }
    return put(b, s + from, n - from) && put(b, "\"", 1);
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
    size_t mark = b->len;
    char head[48];
    int k = snprintf(head, sizeof(head), "%s{\"n\":%zu,\"topic\":", b->n ? "," : "[", b->n);
    bool ok = put(b, head, (size_t)k) && put_string(b, topic) && put(b, ",\"msg_key\":", 11) &&
              put_string(b, key) && put(b, ",\"event_id\":", 12) && put_string(b, event_id) &&
              (strstr(payload, "\\u0000") == NULL
                   ? put(b, ",\"payload\":", 11) && put(b, payload, strlen(payload))
                   : put(b, ",\"payload_text\":", 16) && put_string(b, payload)) &&
              put(b, "}", 1);
    free(payload);
    if (!ok) {
        b->len = mark;
        fail(b,
             "the message for topic '%s' could not be queued (out of memory, or a key that is "
             "not UTF-8)",
             topic);
        return;
    }
    b->n++;
}

size_t tally_outbox_batch_len(const tally_outbox_batch_t *b)
{
    return b->n;
}

static void reset(tally_outbox_batch_t *b)
{
    b->len = 0;
    b->n = 0;
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
    if (b->n == 0)
        return true;
    b->text[b->len] = ']'; /* put() always leaves room for these two */
    b->text[b->len + 1] = '\0';
    const char *params[1] = {b->text};
    bool ok = tally_pg_run(pg, SQL_INSERT, 1, params, err);
    reset(b);
    return ok;
}

void tally_outbox_batch_free(tally_outbox_batch_t *b)
{
    if (b == NULL)
        return;
    free(b->text);
    free(b);
}
