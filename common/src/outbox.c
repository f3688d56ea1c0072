/* outbox.c — the message outbox writer: events for Kafka, written in the caller's transaction. */
#include "tally/outbox.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/recordset.h"

/* The batch is kept as the text of its JSON parameter (recordset.h), and each event, serialised
 * once, in the bulk column beside it: it reaches PostgreSQL byte for byte, neither escaped
 * into a JSON string nor lexed out of one. */
struct tally_outbox_batch {
    tally_recordset_t rows;
};

/* "n" keeps the order of the batch in message_outbox.id, which is the relay's order. */
static const char SQL_INSERT[] = TALLY_OUTBOX_INSERT("$1", "$2", "");

tally_outbox_batch_t *tally_outbox_batch_new(void)
{
    return calloc(1, sizeof(tally_outbox_batch_t));
}

void tally_outbox_batch_add(tally_outbox_batch_t *b, const char *topic, const char *key,
                            const json_t *event)
{
    tally_recordset_t *rs = &b->rows;
    if (rs->failed)
        return;
    if (event == NULL) { /* the rest is checked by tally_outbox_batch_add_text */
        tally_recordset_fail(rs, "a message needs a topic and an event");
        return;
    }
    /* the effect the message is about, when its data names one (TALLY_OUTBOX_INSERT) */
    const char *about =
        json_string_value(json_object_get(json_object_get(event, "data"), "effect_id"));
    char *payload = json_dumps(event, JSON_COMPACT);
    if (payload == NULL) {
        tally_recordset_fail(rs, "out of memory while serialising an outbox message");
        return;
    }
    tally_outbox_batch_add_text(b, topic, key, json_string_value(json_object_get(event, "id")),
                                about, payload);
    free(payload);
}

void tally_outbox_batch_add_text(tally_outbox_batch_t *b, const char *topic, const char *key,
                                 const char *event_id, const char *effect_id, const char *payload)
{
    tally_recordset_t *rs = &b->rows;
    if (rs->failed)
        return;
    if (topic == NULL || payload == NULL) {
        tally_recordset_fail(rs, "a message needs a topic and an event");
        return;
    }
    if (event_id == NULL || *event_id == '\0') {
        tally_recordset_fail(rs, "the event for topic '%s' has no string \"id\" to deduplicate by",
                             topic);
        return;
    }
    bool ok = tally_recordset_row_begin(rs) && tally_recordset_text(rs, "topic", topic) &&
              tally_recordset_text(rs, "msg_key", key) &&
              tally_recordset_text(rs, "event_id", event_id) &&
              tally_recordset_text(rs, "effect_id", effect_id) && tally_recordset_bulk(rs, payload);
    if (!tally_recordset_row_end(rs, ok))
        tally_recordset_fail(rs,
                             "the message for topic '%s' could not be queued (out of memory, or "
                             "a key or event that is not UTF-8)",
                             topic);
}

size_t tally_outbox_batch_len(const tally_outbox_batch_t *b)
{
    return b->rows.n;
}

bool tally_outbox_batch_flush(tally_outbox_batch_t *b, tally_pg_t *pg, tally_error_t *err)
{
    return tally_recordset_flush(&b->rows, pg, SQL_INSERT, "outbox", err);
}

static const char SQL_INSERT_HANDED[] = TALLY_OUTBOX_INSERT_HANDED("$1", "$4", "", "$2", "$3");

bool tally_outbox_batch_flush_handed(tally_outbox_batch_t *b, tally_pg_t *pg, const char *owner,
                                     int lease_ms, PGresult **rows, tally_error_t *err)
{
    *rows = NULL;
    tally_recordset_t *rs = &b->rows;
    if (rs->failed) {
        tally_error_set(err, "outbox", false, "outbox batch not written: %s", rs->why);
        tally_recordset_release(rs);
        return false;
    }
    if (rs->n == 0)
        return true;
    char lease[16];
    snprintf(lease, sizeof lease, "%d", lease_ms);
    int lengths[4] = {0, 0, 0, 0}, formats[4] = {0, 0, 0, 1};
    const char *params[4] = {tally_recordset_close(rs), owner, lease,
                             tally_recordset_bulk_param(rs, &lengths[3])};
    if (params[3] == NULL)
        tally_error_set(err, "oom", true, "outbox batch not written: out of memory");
    else
        *rows = tally_pg_exec_bin(pg, SQL_INSERT_HANDED, 4, params, lengths, formats, err);
    tally_recordset_release(rs);
    return *rows != NULL;
}

const char *tally_outbox_batch_text(tally_outbox_batch_t *b, const char **why)
{
    if (why)
        *why = b->rows.failed ? b->rows.why : "";
    return tally_recordset_close(&b->rows);
}

const char *tally_outbox_batch_bulk(tally_outbox_batch_t *b, int *len)
{
    return tally_recordset_bulk_param(&b->rows, len);
}

void tally_outbox_batch_free(tally_outbox_batch_t *b)
{
    if (b == NULL)
        return;
    tally_recordset_release(&b->rows);
    free(b);
}
