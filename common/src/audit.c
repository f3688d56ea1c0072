/* audit.c — the append-only audit trail (events table), written in the caller's transaction. */
#include "tally/audit.h"

#include <stdlib.h>
#include <string.h>

#include "tally/id.h"
#include "tally/json.h"
#include "tally/log.h"

/* The batch is kept as its parameter's columns (columns.h): each event serialised once, with no
 * copy of the object kept in between, and never lexed by PostgreSQL but for its data. */
struct tally_audit_batch {
    tally_columns_t cols;
};

/* event_id, run_id, effect_id, obligation_id, kind, from_status, to_status, actor, reason,
 * data: TALLY_AUDIT_INSERT's columns, in order; the row's place, "n", keeps the insertion
 * order in events.seq. */
#define N_COLS 10
static const char SQL_INSERT[] = TALLY_AUDIT_INSERT("$1", "");

tally_audit_batch_t *tally_audit_batch_new(void)
{
    tally_audit_batch_t *b = calloc(1, sizeof(tally_audit_batch_t));
    if (b)
        tally_columns_init(&b->cols, N_COLS);
    return b;
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

bool tally_audit_move(tally_audit_batch_t *b, tally_machine_t m, int from, int to,
                      const tally_audit_event_t *ev)
{
    tally_audit_event_t e = *ev;
    const char *to_name = tally_machine_state_name(m, to);
    e.kind = ev->kind != NULL ? ev->kind : "transition";
    e.from_status = from == -1 ? NULL : tally_machine_state_name(m, from);
    e.to_status = to_name;
    bool ok = to_name != NULL && (from == -1 || e.from_status != NULL) &&
              (from == to || tally_machine_allows(m, from, to));
    if (!ok)
        TALLY_ERROR("the %s move %s -> %s is not in the %s machine (schemas/machines.json); "
                    "the ledger will refuse it",
                    tally_machine_name(m), e.from_status != NULL ? e.from_status : "(new)",
                    to_name != NULL ? to_name : "(out of range)", tally_machine_name(m));
    tally_audit_batch_add(b, &e);
    return ok;
}

void tally_audit_batch_add(tally_audit_batch_t *b, const tally_audit_event_t *ev)
{
    tally_columns_t *c = &b->cols;
    if (c->failed)
        return;
    if (ev->kind == NULL || ev->actor == NULL) {
        tally_columns_fail(c, "an audit event needs a kind and an actor");
        return;
    }
    char fresh[37];
    const char *event_id = ev->event_id;
    if (event_id == NULL) {
        tally_uuid_v7(fresh);
        event_id = fresh;
    }
    /* serialised now: the caller may change or free its data after this returns */
    char *data = ev->data ? json_dumps(ev->data, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    char *members = NULL;
    if (ev->data == NULL && ev->members != NULL &&
        (members = members_text(ev->members, ev->n_members)) == NULL) {
        tally_columns_fail(c, "the data of an audit event could not be queued (out of memory, "
                              "or text that is not UTF-8)");
        return;
    }
    bool ok = (ev->data == NULL || data != NULL) && tally_columns_row_begin(c) &&
              tally_columns_text(c, event_id) && tally_columns_text(c, ev->run_id) &&
              tally_columns_text(c, ev->effect_id) && tally_columns_text(c, ev->obligation_id) &&
              tally_columns_text(c, ev->kind) && tally_columns_text(c, ev->from_status) &&
              tally_columns_text(c, ev->to_status) && tally_columns_text(c, ev->actor) &&
              tally_columns_text(c, ev->reason) &&
              tally_columns_text(c, data      ? data
                                    : members ? members
                                              : ev->data_text);
    free(data);
    free(members);
    if (!tally_columns_row_end(c, ok))
        tally_columns_fail(
            c, "an audit event could not be queued (out of memory, or text that is not UTF-8)");
}

size_t tally_audit_batch_len(const tally_audit_batch_t *b)
{
    return b->cols.n;
}

bool tally_audit_batch_flush(tally_audit_batch_t *b, tally_pg_t *pg, tally_error_t *err)
{
    return tally_audit_batch_flush_as(b, pg, SQL_INSERT, err);
}

bool tally_audit_batch_flush_as(tally_audit_batch_t *b, tally_pg_t *pg, const char *sql,
                                tally_error_t *err)
{
    const char *why = NULL;
    int len = 0;
    const char *param = tally_audit_batch_param(b, &len, &why);
    bool ok = false;
    if (param == NULL && b->cols.failed) {
        tally_error_setc(err, b->cols.bad_text ? TALLY_ERR_INVALID_TEXT : TALLY_ERR_AUDIT,
                         "audit batch not written: %s", why);
    } else if (param == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "audit batch not written: out of memory");
    } else if (b->cols.n == 0) {
        ok = true;
    } else {
        int format = 1;
        PGresult *res = tally_pg_exec_bin(pg, sql, 1, &param, &len, &format, err);
        ok = res != NULL;
        PQclear(res);
    }
    tally_columns_reset(&b->cols);
    return ok;
}

const char *tally_audit_batch_param(tally_audit_batch_t *b, int *len, const char **why)
{
    const char *param = tally_columns_param(&b->cols, len);
    if (why)
        *why = param ? "" : b->cols.failed ? b->cols.why : "out of memory";
    return param;
}

void tally_audit_batch_free(tally_audit_batch_t *b)
{
    if (b == NULL)
        return;
    tally_columns_release(&b->cols);
    free(b);
}
