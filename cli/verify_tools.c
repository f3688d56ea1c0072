/* verify_tools.c — `tally verify --tools` (verify.h): the tools' own records against the ledger.
 *
 * Each effect in range whose tool has a status endpoint is asked about with it; each tool that
 * offers `list` lists what it holds for the run or since the time, page by page. Every call
 * goes through the connector engine the workers use (signing, timeouts, body caps) and takes a
 * slot of the tool's call budget first (pacing.h), so verify never calls a tool above its
 * audit.rate_per_s, together with the reconcilers' audits and sweeps. A tool's answer is
 * hostile until proven otherwise: anything but the protocol's shape is "could not check",
 * never a finding; records are judged as the reconciler's sweep judges them. */
#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "format.h"
#include "tally/connector.h"
#include "tally/json.h"
#include "tally/ledger.h"
#include "tally/pacing.h"
#include "tally/text.h"
#include "verify.h"

#define LIST_PAGE    100   /* records asked for per list page */
#define CURSOR_MAX   1024  /* the longest next_cursor taken from a tool */
#define EVIDENCE_MAX 16384 /* bytes of a tool's record kept as a finding's evidence */
#define MAX_INFLIGHT 32    /* concurrent calls (each tool's max_concurrency applies too) */
#define WAIT_MAX_MS  1000  /* longest single wait for a call or for the budget */

/* The ledger's view of the effects a list page names: $1 [{i, effect_id, ref}]. */
static const char SQL_RECORD_LOOKUP[] =
    "SELECT coalesce(json_agg(json_build_object('i', x.i, 'tool', e.tool, 'status', e.status,"
    "   'external_ref', e.external_ref, 'run_id', e.run_id, 'has_obligation', EXISTS ("
    "     SELECT 1 FROM obligations o WHERE o.effect_id = x.effect_id"
    "       AND o.external_ref IS NOT DISTINCT FROM x.ref))), '[]')"
    " FROM json_to_recordset($1::json) AS x(i int, effect_id uuid, ref text)"
    " LEFT JOIN effects e ON e.effect_id = x.effect_id";

/* The calls of one verification: the engine, and how many are in flight. */
typedef struct tools {
    verify_t *v;
    tally_connector_t *conn;
    int inflight;
} tools_t;

static json_t *tool_entry(verify_t *v, const tally_tool_t *t)
{
    size_t i;
    json_t *row;
    json_array_foreach(v->tools, i, row)
    {
        if (strcmp(cli_str(row, "tool", ""), t->name) == 0)
            return row;
    }
    row = json_pack("{s:s, s:f, s:i, s:i, s:i, s:i, s:i, s:b, s:b}", "tool", t->name, "rate_per_s",
                    t->audit.rate_per_s, "status_checks", 0, "list_pages", 0, "records_listed", 0,
                    "records_not_ours", 0, "records_unsettled", 0, "has_status",
                    t->status.path != NULL, "has_list", t->list.path != NULL);
    if (row == NULL || json_array_append_new(v->tools, row) != 0)
        return NULL;
    return row;
}

static void bump(json_t *row, const char *key, long long by)
{
    if (row != NULL)
        json_object_set_new(row, key,
                            json_integer(json_integer_value(json_object_get(row, key)) + by));
}

/* Wait for the tool's call budget: @returns how many slots (1..@p want) were granted, or -1
 * when the budget could not be read (noted as incomplete). Calls in flight progress while it
 * waits. */
static int take_slots(tools_t *tc, const tally_tool_t *t, int want, tally_conn_done_fn done)
{
    verify_t *v = tc->v;
    for (;;) {
        long long wait_ms = 0;
        tally_error_t err;
        int got = tally_pace_take(v->pg, t->name, t->audit.rate_per_s, want, &wait_ms, &err);
        if (got < 0) {
            char why[700];
            tally_fmt(why, sizeof why,
                      "cannot take a slot of the tool's call budget (tool_pacing): %s%s",
                      err.message,
                      strcmp(err.sqlstate, "42501") == 0
                          ? " (--tools paces its calls there: run it as the operator role)"
                          : "");
            verify_incomplete(v, "pacing", t->name, NULL, why);
            return -1;
        }
        if (got > 0)
            return got;
        if (wait_ms < 1)
            wait_ms = 1;
        if (wait_ms > WAIT_MAX_MS)
            wait_ms = WAIT_MAX_MS;
        tally_error_t perr;
        if (tally_connector_poll(tc->conn, NULL, 0, (int)wait_ms, done, tc, &perr) < 0) {
            verify_incomplete(v, "calls", t->name, NULL, perr.message);
            return -1;
        }
    }
}

/* Drive the calls in flight until none is left. */
static void drain(tools_t *tc, tally_conn_done_fn done)
{
    while (tc->inflight > 0) {
        tally_error_t err;
        if (tally_connector_poll(tc->conn, NULL, 0, WAIT_MAX_MS, done, tc, &err) < 0) {
            verify_incomplete(tc->v, "calls", NULL, NULL, err.message);
            return;
        }
    }
}

/* The record's ref (receipt_ref into it), within the ledger's limit; NULL when it has none. */
static char *record_ref(const tally_tool_t *t, const json_t *rec, size_t *over)
{
    return tally_conn_ref_within_limit(tally_conn_external_ref(t, rec), over);
}

/* A record as evidence: whole when it is small and its tool declares no sensitive fields; an
 * excerpt when it is large; left out (the ref and headers say enough) when it may hold
 * personal data. */
static json_t *record_evidence(const tally_tool_t *t, const json_t *rec)
{
    if (t->n_sensitive_receipt > 0)
        return json_string("(left out: the tool declares sensitive fields)");
    char *text = json_dumps(rec, JSON_COMPACT | JSON_SORT_KEYS);
    if (text == NULL)
        return json_null();
    json_t *out = strlen(text) <= EVIDENCE_MAX
                      ? json_deep_copy(rec)
                      : tally_conn_excerpt(text, strlen(text), EVIDENCE_MAX);
    free(text);
    return out != NULL ? out : json_null();
}

/* ---- status checks ---------------------------------------------------------------------- */

typedef struct ask {
    const tally_tool_t *tool;
    const json_t *effect; /* a row of SQL_TOOL_EFFECTS (borrowed) */
} ask_t;

/* Whether @p ref (may be NULL) is one of the effect's obligation refs. */
static bool has_obligation(const json_t *effect, const char *ref)
{
    size_t i;
    json_t *r;
    json_array_foreach(json_object_get(effect, "obligation_refs"), i, r)
    {
        if (ref == NULL ? json_is_null(r)
                        : json_is_string(r) && strcmp(json_string_value(r), ref) == 0)
            return true;
    }
    return false;
}

static json_t *effect_finding(const json_t *e, const char *detail)
{
    return json_pack("{s:s, s:s, s:s, s:s, s:s, s:b}", "id", cli_str(e, "effect_id", "?"), "run_id",
                     cli_str(e, "run_id", "?"), "tool", cli_str(e, "tool", "?"), "effect_id",
                     cli_str(e, "effect_id", "?"), "detail", detail, "run_in_ledger", 1);
}

/* What the status check's records say about the effect. */
static void judge_status(verify_t *v, const ask_t *a, const json_t *records)
{
    const json_t *e = a->effect;
    const tally_tool_t *t = a->tool;
    const char *eid = cli_str(e, "effect_id", "?");
    const char *ledger_ref = cli_str(e, "external_ref", NULL);
    tally_effect_state_t status = TALLY_EFFECT_PLANNED;
    (void)tally_effect_state_parse(cli_str(e, "status", ""), &status);
    bool confirmed = status == TALLY_EFFECT_CONFIRMED;
    size_t n = json_array_size(records);
    char detail[1200];

    if (confirmed && n == 0) {
        tally_fmt(detail, sizeof detail,
                  "CONFIRMED with ref %s, but %s's status check finds no record for its key",
                  ledger_ref != NULL ? ledger_ref : "(none)", t->name);
        json_t *f = effect_finding(e, detail);
        json_object_set_new(f, "evidence",
                            json_pack("{s:s, s:s?, s:s, s:i}", "source", "status", "external_ref",
                                      ledger_ref, "operation_key", cli_str(e, "operation_key", ""),
                                      "records", 0));
        verify_tool_finding(v, VERIFY_UPSTREAM_MISSING, t, eid, f);
        return;
    }
    bool kept_seen = false;
    json_t *refs = json_array();
    for (size_t i = 0; i < n; i++) {
        const json_t *rec = json_array_get(records, i);
        size_t over = 0;
        char *ref = record_ref(t, rec, &over);
        json_array_append_new(refs, ref != NULL ? json_string(ref) : json_null());
        bool is_kept =
            confirmed && ((ref == NULL && ledger_ref == NULL) ||
                          (ref != NULL && ledger_ref != NULL && strcmp(ref, ledger_ref) == 0));
        if (is_kept) {
            kept_seen = true;
        } else if (ref == NULL) {
            char why[300];
            tally_fmt(why, sizeof why,
                      "record %zu of its status answer has no ref at %s%s: it cannot be placed", i,
                      t->receipt_ref != NULL ? t->receipt_ref : "/id",
                      over > 0 ? " of at most 512 bytes" : "");
            verify_incomplete(v, "status", t->name, eid, why);
        } else if (!has_obligation(e, ref)) {
            verify_tool_check_t ci = confirmed ? VERIFY_UPSTREAM_DUPLICATE : VERIFY_UPSTREAM_ORPHAN;
            if (confirmed)
                tally_fmt(detail, sizeof detail,
                          "it carries the key of effect %s, CONFIRMED with %s: an extra record "
                          "no obligation reverses",
                          eid, ledger_ref != NULL ? ledger_ref : "(no ref)");
            else
                tally_fmt(detail, sizeof detail,
                          "it carries the key of effect %s, which the ledger has as %s: applied "
                          "upstream, and no obligation reverses it",
                          eid, cli_str(e, "status", "?"));
            json_t *f = json_pack("{s:s, s:s, s:s, s:s, s:s, s:s, s:b}", "id", ref, "run_id",
                                  cli_str(e, "run_id", "?"), "tool", t->name, "effect_id", eid,
                                  "external_ref", ref, "detail", detail, "run_in_ledger", 1);
            json_object_set_new(f, "evidence",
                                json_pack("{s:s, s:s, s:s, s:s?, s:s, s:o}", "source", "status",
                                          "effect_status", cli_str(e, "status", "?"),
                                          "operation_key", cli_str(e, "operation_key", ""),
                                          "ledger_ref", ledger_ref, "record_ref", ref, "record",
                                          record_evidence(t, rec)));
            verify_tool_finding(v, ci, t, ref, f);
        }
        free(ref);
    }
    if (confirmed && n > 0 && !kept_seen) {
        char *got = json_dumps(refs, JSON_COMPACT);
        tally_fmt(detail, sizeof detail,
                  "CONFIRMED with ref %s, but %s's status check finds %s for its key",
                  ledger_ref != NULL ? ledger_ref : "(none)", t->name, got != NULL ? got : "?");
        free(got);
        json_t *f = effect_finding(e, detail);
        json_object_set_new(f, "evidence",
                            json_pack("{s:s, s:s?, s:s, s:O}", "source", "status", "external_ref",
                                      ledger_ref, "operation_key", cli_str(e, "operation_key", ""),
                                      "record_refs", refs));
        verify_tool_finding(v, VERIFY_UPSTREAM_MISMATCH, t, eid, f);
    }
    json_decref(refs);
}

static void on_status_done(const tally_conn_result_t *res, void *opaque)
{
    tools_t *tc = opaque;
    verify_t *v = tc->v;
    const ask_t *a = res->opaque;
    tc->inflight--;
    const char *eid = cli_str(a->effect, "effect_id", "?");
    tally_conn_verdict_t vd;
    tally_conn_classify_status(res, &vd);
    if (vd.verdict == TALLY_VERDICT_INCONCLUSIVE) {
        char why[400];
        tally_fmt(why, sizeof why, "%s: %s", vd.code, vd.message);
        verify_incomplete(v, "status", a->tool->name, eid, why);
        return;
    }
    json_error_t jerr;
    json_t *records = json_loadb(res->body != NULL ? res->body : "", res->body_len,
                                 TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, &jerr);
    bool ok = json_is_array(records);
    for (size_t i = 0; ok && i < json_array_size(records); i++)
        ok = json_is_object(json_array_get(records, i));
    if (!ok)
        verify_incomplete(v, "status", a->tool->name, eid,
                          "the status answer is not a JSON array of record objects");
    else
        judge_status(v, a, records);
    json_decref(records);
}

/* Ask each effect's tool about it, at the tool's rate. */
static void ask_status(tools_t *tc, const json_t *effects)
{
    verify_t *v = tc->v;
    size_t n = json_array_size(effects);
    if (n == 0)
        return;
    ask_t *asks = calloc(n, sizeof *asks);
    if (asks == NULL) {
        verify_incomplete(v, "status", NULL, NULL, "out of memory");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        asks[i].effect = json_array_get(effects, i);
        asks[i].tool = tally_registry_find(v->reg, cli_str(asks[i].effect, "tool", ""));
    }
    /* tool by tool, each paying from its own budget; the calls of one run concurrently */
    for (size_t ti = 0; ti < tally_registry_count(v->reg); ti++) {
        const tally_tool_t *t = tally_registry_at(v->reg, ti);
        if (t->status.path == NULL)
            continue;
        json_t *stats = NULL;
        bool broken = false;
        for (size_t i = 0; i < n && !broken;) {
            if (asks[i].tool != t) {
                i++;
                continue;
            }
            if (stats == NULL)
                stats = tool_entry(v, t);
            int room = tally_connector_capacity(tc->conn, t);
            if (room <= 0) {
                tally_error_t err;
                if (tally_connector_poll(tc->conn, NULL, 0, WAIT_MAX_MS, on_status_done, tc, &err) <
                    0) {
                    verify_incomplete(v, "calls", t->name, NULL, err.message);
                    broken = true;
                }
                continue;
            }
            size_t left = 0;
            for (size_t k = i; k < n; k++)
                left += asks[k].tool == t;
            int want = (int)(left < (size_t)room ? left : (size_t)room);
            int got = take_slots(tc, t, want, on_status_done);
            if (got < 0) {
                broken = true;
                break;
            }
            for (; i < n && got > 0; i++) {
                if (asks[i].tool != t)
                    continue;
                got--;
                const json_t *e = asks[i].effect;
                tally_conn_request_t req = {
                    .tool = t,
                    .op = TALLY_CONN_STATUS,
                    .idempotency_key = cli_str(e, "operation_key", ""),
                    .run_id = cli_str(e, "run_id", NULL),
                    .effect_id = cli_str(e, "effect_id", NULL),
                    .traceparent = cli_str(e, "traceparent", NULL),
                    .opaque = &asks[i],
                };
                tally_error_t err;
                if (tally_connector_submit(tc->conn, &req, &err)) {
                    tc->inflight++;
                    bump(stats, "status_checks", 1);
                } else {
                    verify_incomplete(v, "status", t->name, req.effect_id, err.message);
                }
            }
        }
    }
    drain(tc, on_status_done);
    free(asks);
}

/* ---- list ------------------------------------------------------------------------------- */

typedef struct page {
    bool done;
    int curl_code;
    long http_status;
    bool truncated;
    char *body; /* a copy of the answer */
    size_t body_len;
    char error[256];
} page_t;

static void on_page_done(const tally_conn_result_t *res, void *opaque)
{
    tools_t *tc = opaque;
    page_t *p = res->opaque;
    tc->inflight--;
    p->done = true;
    p->curl_code = res->curl_code;
    p->http_status = res->http_status;
    p->truncated = res->body_truncated;
    tally_fmt(p->error, sizeof p->error, "%s", res->curl_error != NULL ? res->curl_error : "");
    p->body = malloc(res->body_len + 1);
    if (p->body != NULL) {
        memcpy(p->body, res->body != NULL ? res->body : "", res->body_len);
        p->body[res->body_len] = '\0';
        p->body_len = res->body_len;
    }
}

/* One list answer read: its records (a new reference) and next cursor (malloc'd, NULL on the
 * last page). false, with a sentence in @p why, for anything else. */
static bool read_page(const page_t *p, json_t **records, char **next, char *why, size_t whysz)
{
    *records = NULL;
    *next = NULL;
    if (p->curl_code != 0 && p->http_status == 0) {
        tally_fmt(why, whysz, "no answer: %s", p->error[0] ? p->error : "connection failed");
        return false;
    }
    if (p->http_status != 200) {
        tally_fmt(why, whysz, "the list call answered HTTP %ld", p->http_status);
        return false;
    }
    if (p->curl_code != 0 || p->truncated || p->body == NULL) {
        tally_fmt(why, whysz, "the list answer was incomplete or over %d bytes",
                  TALLY_CONN_MAX_BODY);
        return false;
    }
    json_error_t jerr;
    json_t *doc = json_loadb(p->body, p->body_len, TALLY_JSON_LOAD_FLAGS, &jerr);
    json_t *recs = json_object_get(doc, "records");
    json_t *cursor = json_object_get(doc, "next_cursor");
    bool ok = false;
    if (doc == NULL)
        tally_fmt(why, whysz, "the list answer is not a JSON object: %s", jerr.text);
    else if (!json_is_array(recs))
        tally_fmt(why, whysz, "the list answer has no \"records\" array");
    else if (cursor != NULL && !json_is_null(cursor) &&
             (!json_is_string(cursor) || json_string_length(cursor) == 0 ||
              json_string_length(cursor) > CURSOR_MAX ||
              strlen(json_string_value(cursor)) != json_string_length(cursor)))
        tally_fmt(why, whysz,
                  "the list answer's \"next_cursor\" is neither null nor a string of 1 to %d "
                  "bytes",
                  CURSOR_MAX);
    else {
        ok = true;
        for (size_t i = 0; ok && i < json_array_size(recs); i++) {
            if (!json_is_object(json_array_get(recs, i))) {
                tally_fmt(why, whysz, "record %zu of the list answer is not an object", i);
                ok = false;
            }
        }
    }
    if (ok && json_is_string(cursor)) {
        *next = strdup(json_string_value(cursor));
        if (*next == NULL) {
            tally_fmt(why, whysz, "out of memory");
            ok = false;
        }
    }
    if (ok)
        *records = json_incref(recs);
    json_decref(doc);
    return ok;
}

/* A listed record's Tally header @p name, when it is a string. */
static const char *tally_header(const json_t *rec, const char *name)
{
    const json_t *h = json_object_get(json_object_get(rec, "tally_headers"), name);
    return json_is_string(h) ? json_string_value(h) : NULL;
}

/* Place each record of a page: look the effects it names up (one statement), then judge. */
static void judge_page(verify_t *v, const tally_tool_t *t, const json_t *records, json_t *stats)
{
    size_t n = json_array_size(records);
    json_t *items = json_array();
    char **refs = calloc(n ? n : 1, sizeof *refs);
    if (items == NULL || refs == NULL) {
        verify_incomplete(v, "list", t->name, NULL, "out of memory");
        json_decref(items);
        free(refs);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *rec = json_array_get(records, i);
        const char *eid = tally_header(rec, "tally-effect-id");
        if (eid == NULL || !cli_is_uuid(eid)) {
            bump(stats, "records_not_ours", 1); /* no tally effect id: not tally's to judge */
            continue;
        }
        size_t over = 0;
        refs[i] = record_ref(t, rec, &over);
        if (refs[i] == NULL) {
            /* no ref at receipt_ref to name or reverse it by: left alone, as the sweep does */
            bump(stats, "records_not_ours", 1);
            continue;
        }
        json_array_append_new(
            items, json_pack("{s:i, s:s, s:s}", "i", (int)i, "effect_id", eid, "ref", refs[i]));
    }
    json_t *rows = NULL;
    if (json_array_size(items) > 0) {
        tally_error_t err;
        char *text = json_dumps(items, JSON_COMPACT);
        const char *params[1] = {text};
        rows = text != NULL ? cli_query_json(v->pg, SQL_RECORD_LOOKUP, 1, params, &err) : NULL;
        free(text);
        if (rows == NULL)
            verify_incomplete(v, "the ledger's view of the listed records", t->name, NULL,
                              err.message);
    }
    size_t k;
    json_t *row;
    json_array_foreach(rows, k, row)
    {
        size_t i = (size_t)json_integer_value(json_object_get(row, "i"));
        if (i >= n || refs[i] == NULL)
            continue;
        const json_t *rec = json_array_get(records, i);
        const char *ref = refs[i];
        const char *eid = tally_header(rec, "tally-effect-id");
        const char *rid = tally_header(rec, "tally-run-id");
        const char *tool = cli_str(row, "tool", NULL);
        const char *ledger_ref = cli_str(row, "external_ref", NULL);
        const char *status_text = cli_str(row, "status", NULL);
        tally_effect_state_t status = TALLY_EFFECT_PLANNED;
        bool known = tool != NULL && strcmp(tool, t->name) == 0 &&
                     tally_effect_state_parse(status_text, &status);
        char detail[1200];
        verify_tool_check_t ci = VERIFY_UPSTREAM_ORPHAN;
        if (known && json_is_true(json_object_get(row, "has_obligation")))
            continue; /* an obligation reverses it */
        if (!known && tool != NULL)
            tally_fmt(detail, sizeof detail,
                      "it carries Tally-Effect-Id %s, which the ledger has as an effect of %s", eid,
                      tool);
        else if (!known)
            tally_fmt(detail, sizeof detail,
                      "it carries Tally-Effect-Id %s, which the ledger never had", eid);
        else if (status == TALLY_EFFECT_CONFIRMED) {
            if (ledger_ref != NULL && strcmp(ledger_ref, ref) == 0)
                continue; /* its receipt */
            ci = VERIFY_UPSTREAM_DUPLICATE;
            tally_fmt(detail, sizeof detail,
                      "it belongs to effect %s, CONFIRMED with %s: an extra record no obligation "
                      "reverses",
                      eid, ledger_ref != NULL ? ledger_ref : "(no ref)");
        } else if (status == TALLY_EFFECT_FAILED || status == TALLY_EFFECT_CANCELLED ||
                   status == TALLY_EFFECT_REJECTED) {
            tally_fmt(detail, sizeof detail,
                      "it belongs to effect %s, which the ledger has as %s: applied upstream, and "
                      "no obligation reverses it",
                      eid, status_text);
        } else {
            bump(stats, "records_unsettled", 1); /* the reconciler settles it with a status check */
            continue;
        }
        const char *run_id = known ? cli_str(row, "run_id", rid) : rid;
        json_t *f = json_pack("{s:s, s:s?, s:s, s:s, s:s, s:s, s:b}", "id", ref, "run_id", run_id,
                              "tool", t->name, "effect_id", eid, "external_ref", ref, "detail",
                              detail, "run_in_ledger", known || cli_str(row, "run_id", NULL));
        json_object_set_new(f, "evidence",
                            json_pack("{s:s, s:s?, s:s?, s:s, s:O?, s:o}", "source", "list",
                                      "effect_status", known ? status_text : NULL, "ledger_ref",
                                      known ? ledger_ref : NULL, "record_ref", ref, "tally_headers",
                                      json_object_get(rec, "tally_headers"), "record",
                                      record_evidence(t, rec)));
        verify_tool_finding(v, ci, t, ref, f);
    }
    json_decref(rows);
    json_decref(items);
    for (size_t i = 0; i < n; i++)
        free(refs[i]);
    free(refs);
}

/* "run_id=R&limit=N[&cursor=C]" or "since=T&limit=N[&cursor=C]", percent-encoded (malloc'd). */
static char *list_query(const verify_t *v, const char *cursor)
{
    const char *key = v->o->run != NULL ? "run_id" : "since";
    const char *value = v->o->run != NULL ? v->o->run : v->since;
    char *ev = curl_easy_escape(NULL, value, 0);
    char *ec = cursor != NULL ? curl_easy_escape(NULL, cursor, 0) : NULL;
    char *q = NULL;
    if (ev != NULL && (cursor == NULL || ec != NULL) &&
        asprintf(&q, "%s=%s&limit=%d%s%s", key, ev, LIST_PAGE, ec != NULL ? "&cursor=" : "",
                 ec != NULL ? ec : "") < 0)
        q = NULL;
    curl_free(ev);
    curl_free(ec);
    return q;
}

/* List every record tool @p t holds for the range, page by page, each page paid for. */
static void list_tool(tools_t *tc, const tally_tool_t *t)
{
    verify_t *v = tc->v;
    json_t *stats = tool_entry(v, t);
    char *cursor = NULL;
    long long seen = 0;
    for (int page_no = 1;; page_no++) {
        if (seen >= v->o->limit) {
            verify_incomplete(v, "list", t->name, NULL,
                              "stopped after --limit records with more to list: raise --limit, or "
                              "narrow the range");
            break;
        }
        char *query = list_query(v, cursor);
        if (query == NULL) {
            verify_incomplete(v, "list", t->name, NULL, "out of memory");
            break;
        }
        if (take_slots(tc, t, 1, on_page_done) < 0) {
            free(query);
            break;
        }
        page_t p = {0};
        tally_conn_request_t req = {.tool = t, .op = TALLY_CONN_LIST, .query = query, .opaque = &p};
        tally_error_t err;
        bool sent = tally_connector_submit(tc->conn, &req, &err);
        free(query);
        if (!sent) {
            verify_incomplete(v, "list", t->name, NULL, err.message);
            break;
        }
        tc->inflight++;
        bump(stats, "list_pages", 1);
        drain(tc, on_page_done);
        json_t *records = NULL;
        char *next = NULL;
        char why[400];
        if (!p.done || !read_page(&p, &records, &next, why, sizeof why)) {
            char what[600];
            tally_fmt(what, sizeof what, "page %d: %s", page_no,
                      p.done ? why : "the call did not finish");
            verify_incomplete(v, "list", t->name, NULL, what);
            free(p.body);
            break;
        }
        free(p.body);
        seen += (long long)json_array_size(records);
        bump(stats, "records_listed", (long long)json_array_size(records));
        judge_page(v, t, records, stats);
        json_decref(records);
        if (next != NULL && cursor != NULL && strcmp(next, cursor) == 0) {
            verify_incomplete(
                v, "list", t->name, NULL,
                "the list answer gave the same next_cursor again: it would never end");
            free(next);
            break;
        }
        free(cursor);
        cursor = next;
        if (cursor == NULL)
            break;
    }
    free(cursor);
}

void verify_tools(verify_t *v, const json_t *effects)
{
    char errstr[256];
    tools_t tc = {.v = v, .conn = tally_connector_new(MAX_INFLIGHT, 0, errstr, sizeof errstr)};
    if (tc.conn == NULL) {
        verify_incomplete(v, "calls", NULL, NULL, errstr);
        return;
    }
    size_t n = json_array_size(effects);
    json_t *asked = json_array();
    for (size_t i = 0; i < n && (long long)i < v->o->limit; i++)
        json_array_append(asked, json_array_get(effects, i));
    if ((long long)n > v->o->limit)
        verify_incomplete(v, "status", NULL, NULL,
                          "more effects are in range than --limit: only the first were asked "
                          "about (raise --limit, or narrow the range)");
    ask_status(&tc, asked);
    for (size_t i = 0; i < tally_registry_count(v->reg); i++) {
        const tally_tool_t *t = tally_registry_at(v->reg, i);
        if (t->list.path != NULL)
            list_tool(&tc, t);
    }
    json_decref(asked);
    tally_connector_free(tc.conn, NULL);
}
