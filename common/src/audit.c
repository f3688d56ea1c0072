/* audit.c — the append-only audit trail (events table), written in the caller's transaction. */
#include "tally/audit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/id.h"

struct tally_audit_batch {
    json_t *rows; /* array of objects, one per event, in the order added */
    bool failed;  /* sticky: an add could not be queued */
    char why[200];
};

/* Columns come from the JSON by name; "n" keeps the insertion order in events.seq. */
static const char SQL_INSERT[] =
    "INSERT INTO events (event_id, run_id, effect_id, obligation_id, kind, from_status,"
    " to_status, actor, reason, data)"
    " SELECT r.event_id, r.run_id, r.effect_id, r.obligation_id, r.kind, r.from_status,"
    " r.to_status, r.actor, r.reason, r.data"
    " FROM json_to_recordset($1::json) AS r(n int, event_id uuid, run_id text, effect_id uuid,"
    " obligation_id uuid, kind text, from_status text, to_status text, actor text,"
    " reason text, data jsonb)"
    " ORDER BY r.n";

tally_audit_batch_t *tally_audit_batch_new(void)
{
    tally_audit_batch_t *b = calloc(1, sizeof(*b));
    if (b == NULL)
        return NULL;
    b->rows = json_array();
    if (b->rows == NULL) {
        free(b);
        return NULL;
    }
    return b;
}

static void fail(tally_audit_batch_t *b, const char *why)
{
    if (!b->failed)
        snprintf(b->why, sizeof(b->why), "%s", why);
    b->failed = true;
}

/* A nullable text member: JSON null for NULL. Returns false when out of memory. */
static bool set_text(json_t *obj, const char *key, const char *value)
{
    json_t *v = value ? json_string(value) : json_null();
    return v != NULL && json_object_set_new(obj, key, v) == 0;
}

void tally_audit_batch_add(tally_audit_batch_t *b, const tally_audit_event_t *ev)
{
    if (b->failed)
        return;
    if (ev->kind == NULL || ev->actor == NULL) {
        fail(b, "an audit event needs a kind and an actor");
        return;
    }
    char event_id[37];
    tally_uuid(event_id);
    json_t *row = json_object();
    bool ok = row != NULL;
    ok = ok &&
         json_object_set_new(row, "n", json_integer((json_int_t)json_array_size(b->rows))) == 0;
    ok = ok && set_text(row, "event_id", event_id);
    ok = ok && set_text(row, "run_id", ev->run_id);
    ok = ok && set_text(row, "effect_id", ev->effect_id);
    ok = ok && set_text(row, "obligation_id", ev->obligation_id);
    ok = ok && set_text(row, "kind", ev->kind);
    ok = ok && set_text(row, "from_status", ev->from_status);
    ok = ok && set_text(row, "to_status", ev->to_status);
    ok = ok && set_text(row, "actor", ev->actor);
    ok = ok && set_text(row, "reason", ev->reason);
    if (ok) {
        /* a deep copy: the caller may change or free its data after this returns */
        json_t *data = ev->data ? json_deep_copy(ev->data) : json_null();
        ok = data != NULL && json_object_set_new(row, "data", data) == 0;
    }
    if (!ok) {
        json_decref(row);
        fail(b, "an audit event could not be queued (out of memory, or text that is not UTF-8)");
        return;
    }
    if (json_array_append_new(b->rows, row) != 0) /* releases row even when it fails */
        fail(b, "out of memory while queueing an audit event");
}

size_t tally_audit_batch_len(const tally_audit_batch_t *b)
{
    return json_array_size(b->rows);
}

static void reset(tally_audit_batch_t *b)
{
    json_array_clear(b->rows);
    b->failed = false;
    b->why[0] = '\0';
}

bool tally_audit_batch_flush(tally_audit_batch_t *b, tally_pg_t *pg, tally_error_t *err)
{
    if (b->failed) {
        tally_error_set(err, "audit", false, "audit batch not written: %s", b->why);
        reset(b);
        return false;
    }
    if (json_array_size(b->rows) == 0)
        return true;
    char *text = json_dumps(b->rows, JSON_COMPACT);
    if (text == NULL) {
        tally_error_set(err, "oom", false, "audit batch not written: out of memory");
        reset(b);
        return false;
    }
    const char *params[1] = {text};
    bool ok = tally_pg_run(pg, SQL_INSERT, 1, params, err);
    free(text);
    reset(b);
    return ok;
}

void tally_audit_batch_free(tally_audit_batch_t *b)
{
    if (b == NULL)
        return;
    json_decref(b->rows);
    free(b);
}
