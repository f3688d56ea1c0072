/* audit.c — the append-only audit trail (events table), written in the caller's transaction. */
#include "tally/audit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tally/id.h"
#include "tally/json.h"

/* The batch is kept as the text of its JSON parameter, built as events are added: each
 * event's data is serialised once, with no copy of the object kept in between. */
struct tally_audit_batch {
    char *text; /* "[{...},{...}" — the closing bracket is added by flush */
    size_t len, cap;
    size_t n;
    bool failed; /* sticky: an add could not be queued */
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
    return calloc(1, sizeof(tally_audit_batch_t));
}

static void fail(tally_audit_batch_t *b, const char *why)
{
    if (!b->failed)
        snprintf(b->why, sizeof(b->why), "%s", why);
    b->failed = true;
}

static bool put(tally_audit_batch_t *b, const char *s, size_t n)
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

/* ,"key":"value" with @p s as a JSON string, or null. false when out of memory or @p s is not
 * UTF-8 (jansson refused such text too). */
static bool put_text(tally_audit_batch_t *b, const char *key, const char *s)
{
    if (!put(b, ",\"", 2) || !put(b, key, strlen(key)) || !put(b, "\":", 2))
        return false;
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

void tally_audit_batch_add(tally_audit_batch_t *b, const tally_audit_event_t *ev)
{
    if (b->failed)
        return;
    if (ev->kind == NULL || ev->actor == NULL) {
        fail(b, "an audit event needs a kind and an actor");
        return;
    }
    char event_id[37];
    tally_uuid_v7(event_id);
    /* serialised now: the caller may change or free its data after this returns */
    char *data = ev->data ? json_dumps(ev->data, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    size_t mark = b->len;
    char head[48];
    int k = snprintf(head, sizeof(head), "%s{\"n\":%zu", b->n ? "," : "[", b->n);
    bool ok = (ev->data == NULL || data != NULL) && put(b, head, (size_t)k) &&
              put_text(b, "event_id", event_id) && put_text(b, "run_id", ev->run_id) &&
              put_text(b, "effect_id", ev->effect_id) &&
              put_text(b, "obligation_id", ev->obligation_id) && put_text(b, "kind", ev->kind) &&
              put_text(b, "from_status", ev->from_status) &&
              put_text(b, "to_status", ev->to_status) && put_text(b, "actor", ev->actor) &&
              put_text(b, "reason", ev->reason) && put(b, ",\"data\":", 8) &&
              (data ? put(b, data, strlen(data)) : put(b, "null", 4)) && put(b, "}", 1);
    free(data);
    if (!ok) {
        b->len = mark;
        fail(b, "an audit event could not be queued (out of memory, or text that is not UTF-8)");
        return;
    }
    b->n++;
}

size_t tally_audit_batch_len(const tally_audit_batch_t *b)
{
    return b->n;
}

static void reset(tally_audit_batch_t *b)
{
    b->len = 0;
    b->n = 0;
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
    if (b->n == 0)
        return true;
    b->text[b->len] = ']'; /* put() always leaves room for these two */
    b->text[b->len + 1] = '\0';
    const char *params[1] = {b->text};
    bool ok = tally_pg_run(pg, SQL_INSERT, 1, params, err);
    reset(b);
    return ok;
}

void tally_audit_batch_free(tally_audit_batch_t *b)
{
    if (b == NULL)
        return;
    free(b->text);
    free(b);
}
