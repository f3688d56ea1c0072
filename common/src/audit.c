/* audit.c — the append-only audit trail (events table), written in the caller's transaction. */
#include "tally/audit.h"

#include <stdlib.h>
#include <string.h>

#include "tally/id.h"
#include "tally/json.h"
#include "tally/recordset.h"

/* The batch is kept as the text of its JSON parameter (recordset.h) and each event's data as
 * an element of the bulk column beside it: serialised once, with no copy of the object kept in
 * between, and never lexed by PostgreSQL as part of the recordset. */
struct tally_audit_batch {
    tally_recordset_t rows;
};

/* Columns come from the JSON by name, the data from the bulk column; "n" keeps the insertion
 * order in events.seq. */
static const char SQL_INSERT[] = TALLY_AUDIT_INSERT("$1", "$2", "");

tally_audit_batch_t *tally_audit_batch_new(void)
{
    return calloc(1, sizeof(tally_audit_batch_t));
}

/* The object of @p n members @p m as JSON text (malloc'd): NULL when out of memory or a key
 * or value is not UTF-8. Members whose value is NULL are left out. */
static char *members_text(const tally_audit_member_t *m, size_t n)
{
    tally_jtext_t j = {0};
    tally_jtext_begin(&j, NULL);
    for (size_t i = 0; i < n; i++) {
        if (m[i].value == NULL)
            continue;
        if (m[i].json)
            tally_jtext_raw(&j, m[i].key, m[i].value);
        else
            tally_jtext_str(&j, m[i].key, m[i].value);
    }
    tally_jtext_end(&j);
    return tally_jtext_take(&j);
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
    char *members = NULL;
    if (ev->data == NULL && ev->members != NULL &&
        (members = members_text(ev->members, ev->n_members)) == NULL) {
        tally_recordset_fail(rs, "the data of an audit event could not be queued (out of memory, "
                                 "or text that is not UTF-8)");
        return;
    }
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
              tally_recordset_bulk(rs, data      ? data
                                       : members ? members
                                                 : ev->data_text);
    free(data);
    free(members);
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

const char *tally_audit_batch_text(tally_audit_batch_t *b, const char **why)
{
    if (why)
        *why = b->rows.failed ? b->rows.why : "";
    return tally_recordset_close(&b->rows);
}

const char *tally_audit_batch_bulk(tally_audit_batch_t *b, int *len)
{
    return tally_recordset_bulk_param(&b->rows, len);
}

void tally_audit_batch_free(tally_audit_batch_t *b)
{
    if (b == NULL)
        return;
    tally_recordset_release(&b->rows);
    free(b);
}
