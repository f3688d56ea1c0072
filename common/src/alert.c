/* alert.c — pages: one alerts row per dedup key, raised and resolved in the caller's
 * transaction. The row is the dedup: INSERT ... ON CONFLICT tells which pages are new, and
 * only those get a tally.alert.trigger.v1 on the message outbox, so a worker that retries a
 * STUCK decision (or two workers that reach it at once) publish one page, not one per try. */
#include "tally/alert.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/cloudevent.h"
#include "tally/metrics.h"
#include "tally/text.h"

/* TALLY_CONSOLE_URL without its trailing slash, or "": set once at start-up, before any thread
 * reads it (tally_alert_set_console). */
static char g_console[TALLY_CONSOLE_URL_MAX + 1];

struct tally_alert_batch {
    json_t *rows; /* array of {n, dedup_key, severity, ..., details}, in the order added */
    bool failed;  /* sticky: an add could not be queued */
    char why[200];
};

/* One row per dedup key (the first queued wins): ON CONFLICT DO UPDATE may not touch a row
 * twice in one statement. A TRIGGERED page is left alone (the WHERE of DO UPDATE), a RESOLVED
 * one opens again; RETURNING lists exactly the pages this statement opened. */
static const char SQL_RAISE[] =
    "INSERT INTO alerts AS a (dedup_key, severity, summary, run_id, effect_id, obligation_id,"
    " reason, runbook, resolve_command)"
    " SELECT DISTINCT ON (r.dedup_key) r.dedup_key, r.severity, r.summary, r.run_id,"
    " r.effect_id, r.obligation_id, r.reason, r.runbook, r.resolve_command"
    " FROM json_to_recordset($1::json) AS r(n int, dedup_key text, severity text, summary text,"
    " run_id text, effect_id uuid, obligation_id uuid, reason text, runbook text,"
    " resolve_command text)"
    " ORDER BY r.dedup_key, r.n"
    " ON CONFLICT (dedup_key) DO UPDATE SET status = 'TRIGGERED', severity = EXCLUDED.severity,"
    " summary = EXCLUDED.summary, run_id = EXCLUDED.run_id, effect_id = EXCLUDED.effect_id,"
    " obligation_id = EXCLUDED.obligation_id, reason = EXCLUDED.reason,"
    " runbook = EXCLUDED.runbook, resolve_command = EXCLUDED.resolve_command,"
    " pager_state = 'pending', resolved_at = NULL"
    " WHERE a.status = 'RESOLVED'"
    " RETURNING a.dedup_key, (a.xmax <> 0) AS reopened";

static const char SQL_RESOLVE[] =
    "UPDATE alerts SET status = 'RESOLVED', resolved_at = now(), pager_state = 'pending'"
    " WHERE dedup_key IN (SELECT json_array_elements_text($1::json)) AND status = 'TRIGGERED'"
    " RETURNING dedup_key, severity, summary, run_id, effect_id::text, obligation_id::text,"
    " reason, runbook, resolve_command";

tally_alert_batch_t *tally_alert_batch_new(void)
{
    tally_alert_batch_t *b = calloc(1, sizeof(*b));
    if (b == NULL) {
        return NULL;
    }
    b->rows = json_array();
    if (b->rows == NULL) {
        free(b);
        return NULL;
    }
    return b;
}

static void fail(tally_alert_batch_t *b, const char *why)
{
    if (!b->failed) {
        snprintf(b->why, sizeof(b->why), "%s", why);
    }
    b->failed = true;
}

/* A nullable text member: JSON null for NULL. Text from outside (a run id, a tool's error)
 * must never make a page unwritable: it is made valid UTF-8 and cut on a character boundary
 * (text.h), the summary to one pager line. Returns false only when out of memory. */
static bool set_text(json_t *obj, const char *key, const char *value)
{
    json_t *v = json_null();
    if (value != NULL) {
        char *text = tally_text_dup(value, strcmp(key, "summary") == 0 ? TALLY_ALERT_SUMMARY_MAX
                                                                       : TALLY_LIMIT_REASON);
        v = text != NULL ? json_string(text) : NULL;
        free(text);
    }
    return v != NULL && json_object_set_new(obj, key, v) == 0;
}

void tally_alert_batch_add(tally_alert_batch_t *b, const tally_alert_t *a)
{
    if (b->failed) {
        return;
    }
    if (a->dedup_key == NULL || a->dedup_key[0] == '\0' || a->summary == NULL ||
        a->reason == NULL || a->resolve_command == NULL ||
        (a->effect_id == NULL && a->obligation_id == NULL)) {
        fail(b, "an alert needs a dedup key, a summary, a reason, a resolve command and an "
                "effect or obligation id");
        return;
    }
    json_t *row = json_object();
    bool ok = row != NULL;
    ok = ok &&
         json_object_set_new(row, "n", json_integer((json_int_t)json_array_size(b->rows))) == 0;
    ok = ok && set_text(row, "dedup_key", a->dedup_key);
    ok = ok && set_text(row, "severity", a->severity ? a->severity : "critical");
    ok = ok && set_text(row, "summary", a->summary);
    ok = ok && set_text(row, "run_id", a->run_id);
    ok = ok && set_text(row, "effect_id", a->effect_id);
    ok = ok && set_text(row, "obligation_id", a->obligation_id);
    ok = ok && set_text(row, "reason", a->reason);
    ok = ok && set_text(row, "runbook", a->runbook);
    ok = ok && set_text(row, "resolve_command", a->resolve_command);
    if (ok && a->details != NULL) {
        json_t *copy = json_deep_copy(a->details);
        ok = copy != NULL && json_object_set_new(row, "details", copy) == 0;
    }
    if (!ok) {
        json_decref(row);
        fail(b, "an alert could not be queued (out of memory, or text that is not UTF-8)");
        return;
    }
    if (json_array_append_new(b->rows, row) != 0) { /* releases row even when it fails */
        fail(b, "out of memory while queueing an alert");
    }
}

size_t tally_alert_batch_len(const tally_alert_batch_t *b)
{
    return json_array_size(b->rows);
}

static void reset(tally_alert_batch_t *b)
{
    json_array_clear(b->rows);
    b->failed = false;
    b->why[0] = '\0';
}

/* The event's data: the alert's fields, the console link (when a console is set), then its
 * details where they do not collide. */
static json_t *alert_data(const json_t *row, const char *status)
{
    static const char *const fields[] = {"dedup_key", "severity",  "summary",
                                         "run_id",    "effect_id", "obligation_id",
                                         "reason",    "runbook",   "resolve_command"};
    json_t *data = json_object();
    if (data == NULL) {
        return NULL;
    }
    bool ok = set_text(data, "status", status);
    for (size_t i = 0; ok && i < sizeof fields / sizeof fields[0]; i++) {
        json_t *v = json_object_get(row, fields[i]);
        ok = json_object_set(data, fields[i], v ? v : json_null()) == 0;
    }
    if (ok && g_console[0] != '\0') {
        char *link = tally_alert_console_link(json_string_value(json_object_get(row, "run_id")));
        ok = link != NULL && json_object_set_new(data, "console_url", json_string(link)) == 0;
        free(link);
    }
    json_t *details = json_object_get(row, "details");
    if (ok && json_is_object(details)) {
        ok = json_object_update_missing(data, details) == 0;
    }
    if (!ok) {
        json_decref(data);
        return NULL;
    }
    return data;
}

/* Queue the CloudEvent and the audit event for one opened or resolved page. */
static bool queue_events(const json_t *row, const char *type, const char *status, const char *actor,
                         const char *source, const char *reason, bool reopened,
                         tally_outbox_batch_t *ob, tally_audit_batch_t *ab, tally_error_t *err)
{
    const char *run_id = json_string_value(json_object_get(row, "run_id"));
    const char *dedup_key = json_string_value(json_object_get(row, "dedup_key"));
    json_t *data = alert_data(row, status);
    char event_id[37];
    json_t *ev = data ? tally_ce_new(type, source, run_id, data, event_id) : NULL;
    if (ev == NULL) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                   "the %s event for alert %s could not be built", type,
                                   dedup_key ? dedup_key : "?");
        return false;
    }
    tally_outbox_batch_add(ob, "alerts", run_id, ev);
    json_t *audit = json_pack("{s:s, s:s?, s:O?, s:s, s:b}", "dedup_key", dedup_key, "severity",
                              json_string_value(json_object_get(row, "severity")),
                              "resolve_command", json_object_get(row, "resolve_command"),
                              "event_id", event_id, "reopened", reopened);
    tally_audit_event_t ae = {
        .run_id = run_id,
        .effect_id = json_string_value(json_object_get(row, "effect_id")),
        .obligation_id = json_string_value(json_object_get(row, "obligation_id")),
        .kind = "alert",
        .actor = actor,
        .reason = reason,
        .data = audit,
    };
    /* opened (-1: created; re-opened: from RESOLVED) or resolved (from TRIGGERED) */
    tally_alert_state_t to = TALLY_ALERT__COUNT;
    (void)tally_alert_state_parse(status, &to);
    int from = to == TALLY_ALERT_RESOLVED ? TALLY_ALERT_TRIGGERED
               : reopened                 ? TALLY_ALERT_RESOLVED
                                          : -1;
    (void)tally_audit_move(ab, TALLY_MACHINE_ALERT, from, (int)to, &ae);
    json_decref(audit);
    json_decref(ev);
    return true;
}

bool tally_alert_batch_flush(tally_alert_batch_t *b, tally_pg_t *pg, const char *actor,
                             const char *source, tally_outbox_batch_t *ob, tally_audit_batch_t *ab,
                             size_t *n_opened, tally_error_t *err)
{
    if (n_opened != NULL) {
        *n_opened = 0;
    }
    if (b->failed) {
        tally_error_setc(err, TALLY_ERR_ALERT, "alerts not raised: %s", b->why);
        reset(b);
        return false;
    }
    if (json_array_size(b->rows) == 0) {
        return true;
    }
    PGresult *res = tally_pg_exec_json(pg, SQL_RAISE, b->rows, err);
    if (res == NULL) {
        reset(b);
        return false;
    }
    bool ok = true;
    for (int i = 0; ok && i < PQntuples(res); i++) {
        const char *key = PQgetvalue(res, i, 0);
        bool reopened = strcmp(PQgetvalue(res, i, 1), "t") == 0;
        const json_t *row = NULL;
        for (size_t j = 0; j < json_array_size(b->rows) && row == NULL; j++) {
            const json_t *cand = json_array_get(b->rows, j);
            if (strcmp(json_string_value(json_object_get(cand, "dedup_key")), key) == 0) {
                row = cand;
            }
        }
        if (row == NULL) { /* cannot happen: every returned key was queued */
            continue;
        }
        ok = queue_events(row, "tally.alert.trigger.v1", "TRIGGERED", actor, source,
                          json_string_value(json_object_get(row, "reason")), reopened, ob, ab, err);
        if (ok && n_opened != NULL) {
            (*n_opened)++;
        }
    }
    PQclear(res);
    reset(b);
    return ok;
}

void tally_alert_batch_free(tally_alert_batch_t *b)
{
    if (b == NULL) {
        return;
    }
    json_decref(b->rows);
    free(b);
}

/* A column of @p res as JSON: null for SQL NULL. */
static bool set_column(json_t *obj, const char *key, const PGresult *res, int row, int col)
{
    return set_text(obj, key, PQgetisnull(res, row, col) ? NULL : PQgetvalue(res, row, col));
}

bool tally_alert_resolve(tally_pg_t *pg, const char *const *dedup_keys, size_t n, const char *actor,
                         const char *source, const char *reason, tally_outbox_batch_t *ob,
                         tally_audit_batch_t *ab, size_t *n_resolved, tally_error_t *err)
{
    static const char *const cols[] = {"dedup_key", "severity",  "summary",
                                       "run_id",    "effect_id", "obligation_id",
                                       "reason",    "runbook",   "resolve_command"};
    if (n_resolved != NULL) {
        *n_resolved = 0;
    }
    if (n == 0) {
        return true;
    }
    json_t *keys = json_array();
    bool ok = keys != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        ok = json_array_append_new(keys, json_string(dedup_keys[i])) == 0;
    }
    if (!ok) {
        json_decref(keys);
        tally_error_setc_retriable(
            err, TALLY_ERR_OOM, false,
            "alerts not resolved: out of memory (or a key that is not UTF-8)");
        return false;
    }
    PGresult *res = tally_pg_exec_json(pg, SQL_RESOLVE, keys, err);
    json_decref(keys);
    if (res == NULL) {
        return false;
    }
    for (int i = 0; ok && i < PQntuples(res); i++) {
        json_t *row = json_object();
        ok = row != NULL;
        for (int c = 0; ok && c < (int)(sizeof cols / sizeof cols[0]); c++) {
            ok = set_column(row, cols[c], res, i, c);
        }
        if (ok) {
            json_t *details = json_pack("{s:s?}", "resolved_reason", reason);
            ok = details != NULL && json_object_set_new(row, "details", details) == 0;
        }
        if (!ok) {
            tally_error_setc_retriable(err, TALLY_ERR_OOM, false,
                                       "alerts not resolved: out of memory");
        } else {
            ok = queue_events(row, "tally.alert.resolve.v1", "RESOLVED", actor, source, reason,
                              false, ob, ab, err);
        }
        json_decref(row);
        if (ok && n_resolved != NULL) {
            (*n_resolved)++;
        }
    }
    PQclear(res);
    return ok;
}

bool tally_alert_set_console(const char *base_url)
{
    size_t n = base_url != NULL ? strlen(base_url) : 0;
    if (n > TALLY_CONSOLE_URL_MAX) {
        return false;
    }
    if (n > 0 && base_url[n - 1] == '/') {
        n--;
    }
    memcpy(g_console, base_url != NULL ? base_url : "", n);
    g_console[n] = '\0';
    return true;
}

char *tally_alert_url_segment(const char *text)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t n = strlen(text);
    char *out = malloc(3 * n + 1);
    if (out == NULL) {
        return NULL;
    }
    size_t o = 0;
    for (const unsigned char *c = (const unsigned char *)text; *c; c++) {
        /* unreserved = ALPHA / DIGIT / "-" / "." / "_" / "~" (RFC 3986 §2.3), in ASCII only:
         * no locale may widen isalnum */
        bool unreserved = (*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') ||
                          (*c >= '0' && *c <= '9') || *c == '-' || *c == '.' || *c == '_' ||
                          *c == '~';
        if (unreserved) {
            out[o++] = (char)*c;
        } else {
            out[o++] = '%';
            out[o++] = hex[*c >> 4];
            out[o++] = hex[*c & 0x0F];
        }
    }
    out[o] = '\0';
    return out;
}

char *tally_alert_link(const char *base, const char *run_id)
{
    if (base == NULL || base[0] == '\0') {
        return NULL;
    }
    size_t n = strlen(base);
    if (base[n - 1] == '/') {
        n--;
    }
    bool no_run = run_id == NULL || run_id[0] == '\0' || strcmp(run_id, ".") == 0 ||
                  strcmp(run_id, "..") == 0;
    char *segment = no_run ? NULL : tally_alert_url_segment(run_id);
    if (!no_run && segment == NULL) {
        return NULL;
    }
    const char *path = no_run ? "/queues" : "/runs/";
    size_t len = n + strlen(path) + (segment != NULL ? strlen(segment) : 0);
    char *out = malloc(len + 1);
    if (out != NULL) {
        memcpy(out, base, n);
        snprintf(out + n, len + 1 - n, "%s%s", path, segment != NULL ? segment : "");
    }
    free(segment);
    return out;
}

char *tally_alert_console_link(const char *run_id)
{
    return tally_alert_link(g_console, run_id);
}

static char *format(const char *fmt, const char *a, const char *b)
{
    int len = snprintf(NULL, 0, fmt, a, b);
    if (len < 0) {
        return NULL;
    }
    char *out = malloc((size_t)len + 1);
    if (out != NULL) {
        snprintf(out, (size_t)len + 1, fmt, a, b);
    }
    return out;
}

char *tally_alert_effect_key(const char *effect_id)
{
    return format("%s%s", "effect:", effect_id);
}

char *tally_alert_obligation_key(const char *obligation_id)
{
    return format("%s%s", "obligation:", obligation_id);
}

char *tally_alert_effect_command(const char *effect_id)
{
    return format("tally resolve --effect %s --as confirmed --ref <REF> --reason \"<what you "
                  "verified upstream>\"  # it happened: <REF> is the upstream record's id\n"
                  "tally resolve --effect %s --as failed --reason \"<what you verified "
                  "upstream>\"  # it did not happen",
                  effect_id, effect_id);
}

char *tally_alert_obligation_command(const char *obligation_id)
{
    return format("tally resolve --obligation %s --as resolved --reason \"<what you did>\"  # "
                  "you reversed it by hand\n"
                  "tally resolve --obligation %s --as skipped --reason \"<why>\"  # nothing is "
                  "to be undone",
                  obligation_id, obligation_id);
}

char *tally_alert_approval_command(bool obligation, const char *id)
{
    if (obligation)
        return format("tally approve --obligation %s --reason \"<why>\"  # reverse it now\n"
                      "tally deny --obligation %s --reason \"<why>\"  # nothing is to be "
                      "undone (SKIPPED)",
                      id, id);
    return format("tally approve --effect %s --reason \"<why>\"  # let it go ahead\n"
                  "tally deny --effect %s --reason \"<why>\"  # refuse it",
                  id, id);
}

char *tally_alert_close_command(const char *dedup_key)
{
    return format("tally resolve --alert %s --reason \"<what you did about it>\"  # close the "
                  "page once the damage is dealt with%s",
                  dedup_key, "");
}

tally_metric_t *tally_alert_failures_counter(tally_metrics_t *m, const char *worker)
{
    tally_metric_t *mt = tally_metrics_counter(
        m, "tally_alert_write_failures_total",
        "Pages that PostgreSQL refused to write (the reconciler and the compensator retry each "
        "at once as a minimal page)",
        "worker");
    tally_metric_add(mt, 0, worker);
    return mt;
}
