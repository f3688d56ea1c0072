/* audit.c — the append-only audit trail (events table), written in the caller's transaction. */
#include "tally/audit.h"

#include <stdlib.h>

#include "tally/id.h"
#include "tally/recordset.h"

/* The batch is kept as the text of its JSON parameter (recordset.h): each event's data is
 * serialised once, with no copy of the object kept in between. */
struct tally_audit_batch {
    tally_recordset_t rows;
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
    return calloc(1, sizeof(tally_audit_batch_t));
}

void tally_audit_batch_add(tally_audit_batch_t *b, const tally_audit_event_t *ev)
{
    tally_recordset_t *rs = &b->rows;
    if (rs->failed)
        return;
    if (ev->kind == NULL || ev->actor == NULL) {
        tally_recordset_fail(rs, "an audit event needs a kind and an actor");
        return;
    }
    char event_id[37];
    tally_uuid_v7(event_id);
    /* serialised now: the caller may change or free its data after this returns */
    char *data = ev->data ? json_dumps(ev->data, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    bool ok = (ev->data == NULL || data != NULL) && tally_recordset_row_begin(rs) &&
              tally_recordset_text(rs, "event_id", event_id) &&
              tally_recordset_text(rs, "run_id", ev->run_id) &&
              tally_recordset_text(rs, "effect_id", ev->effect_id) &&
              tally_recordset_text(rs, "obligation_id", ev->obligation_id) &&
              tally_recordset_text(rs, "kind", ev->kind) &&
              tally_recordset_text(rs, "from_status", ev->from_status) &&
              tally_recordset_text(rs, "to_status", ev->to_status) &&
              tally_recordset_text(rs, "actor", ev->actor) &&
              tally_recordset_text(rs, "reason", ev->reason) &&
              tally_recordset_json(rs, "data", data);
    free(data);
    if (!tally_recordset_row_end(rs, ok))
        tally_recordset_fail(
            rs, "an audit event could not be queued (out of memory, or text that is not UTF-8)");
}

size_t tally_audit_batch_len(const tally_audit_batch_t *b)
{
    return b->rows.n;
}

bool tally_audit_batch_flush(tally_audit_batch_t *b, tally_pg_t *pg, tally_error_t *err)
{
    return tally_recordset_flush(&b->rows, pg, SQL_INSERT, "audit", err);
}

void tally_audit_batch_free(tally_audit_batch_t *b)
{
    if (b == NULL)
        return;
    tally_recordset_release(&b->rows);
    free(b);
}
