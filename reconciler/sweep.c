/* sweep.c — the orphan sweep's statements (DESIGN §12, docs/operations.md "Upstream findings").
 *
 * A tool that declares connector.list is asked, every audit.sweep_ms, for the records created
 * since the tool's cursor (table sweep_cursors), page by page. Each record that carries a
 * tally effect id is set against the ledger: the receipt of a CONFIRMED effect, or a record an
 * obligation already reverses, is ours; an extra record of a CONFIRMED effect is a duplicate and
 * a record of a FAILED, CANCELLED or REJECTED effect an orphan, each reversed by an obligation
 * as the tool's compensation mode says; a record whose effect the ledger never had, or that the
 * tool cannot reverse, is a finding, paged with its evidence. One worker sweeps a tool per
 * period (the claim below); a sweep cut short is made again from the same cursor, and making it
 * again writes nothing twice (obligations and findings are unique per record). */
#include "reconciler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/id.h"
#include "tally/json.h"
#include "tally/log.h"
#include "tally/text.h"

/* The most of one record kept as evidence; a longer one is kept as an excerpt. */
#define EVIDENCE_MAX 16384

static const char SQL_CURSOR[] = "INSERT INTO sweep_cursors (tool, since)"
                                 " VALUES ($1, now() - $2::bigint * interval '1 millisecond')"
                                 " ON CONFLICT (tool) DO NOTHING";

/* This period's sweep of the tool, for one worker: the first to come after the period has
 * passed takes it. */
static const char SQL_CLAIM[] =
    "UPDATE sweep_cursors SET swept_at = now(), swept_by = $2"
    " WHERE tool = $1 AND (swept_at IS NULL"
    "   OR swept_at <= now() - $3::bigint * interval '1 millisecond')"
    " RETURNING to_char(since AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),"
    " to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')";

/* The cursor moves forward only (a sweep that saw nothing new leaves it). */
static const char SQL_FINISH[] =
    "UPDATE sweep_cursors SET since = greatest(since, coalesce($2::timestamptz, since)),"
    " last_error = $3, ended_at = now() WHERE tool = $1";

/* What the ledger holds for each listed record: an effect of another tool is no effect of
 * this one (its obligation would reverse this tool's record through the other's endpoint). */
static const char SQL_LOOKUP[] =
    "SELECT r.n, e.status, e.external_ref, e.run_id,"
    " EXISTS (SELECT 1 FROM obligations o"
    "   WHERE o.effect_id = r.effect_id AND o.external_ref = r.external_ref),"
    " (SELECT x.tool FROM effects x WHERE x.effect_id = r.effect_id AND x.tool <> $2)"
    " FROM json_to_recordset($1::json) AS r(n int, effect_id uuid, external_ref text)"
    " LEFT JOIN effects e ON e.effect_id = r.effect_id AND e.tool = $2 ORDER BY r.n";

/* One obligation per record to reverse; UNIQUE (effect_id, external_ref) makes a second sweep
 * of the same record a no-op, and RETURNING names only the new ones. */
static const char SQL_OBLIGATIONS[] =
    "INSERT INTO obligations (obligation_id, run_id, effect_id, reason, external_ref, receipt)"
    " SELECT r.obligation_id, e.run_id, e.effect_id, r.reason, r.external_ref, r.receipt"
    " FROM json_to_recordset($1::json) AS r(n int, obligation_id uuid, effect_id uuid,"
    " reason text, external_ref text, receipt jsonb)"
    " JOIN effects e ON e.effect_id = r.effect_id"
    " ORDER BY r.n"
    " ON CONFLICT DO NOTHING"
    " RETURNING obligation_id::text, run_id, effect_id::text, external_ref, reason, receipt";

bool tally_sweep_claim(tally_recon_db_t *db, const tally_tool_t *tool, char since[40],
                       char started[40], tally_error_t *err)
{
    char lookback[24], period[24];
    snprintf(lookback, sizeof lookback, "%d", tool->audit.lookback_ms);
    snprintf(period, sizeof period, "%d", tool->audit.sweep_ms);
    const char *p1[2] = {tool->name, lookback};
    if (!tally_pg_run(db->pg, SQL_CURSOR, 2, p1, err)) {
        return false;
    }
    const char *p2[3] = {tool->name, db->actor, period};
    PGresult *res = tally_pg_exec(db->pg, SQL_CLAIM, 3, p2, err);
    if (res == NULL) {
        return false;
    }
    bool claimed = PQntuples(res) == 1;
    if (claimed) {
        snprintf(since, 40, "%s", PQgetvalue(res, 0, 0));
        snprintf(started, 40, "%s", PQgetvalue(res, 0, 1));
    }
    PQclear(res);
    return claimed;
}

bool tally_sweep_finish(tally_recon_db_t *db, const tally_tool_t *tool, const char *new_since,
                        const char *error, tally_error_t *err)
{
    char cut[512];
    if (error != NULL) {
        tally_text_copy(cut, sizeof cut, error);
    }
    const char *params[3] = {tool->name, new_since, error != NULL ? cut : NULL};
    return tally_pg_run(db->pg, SQL_FINISH, 3, params, err);
}

/* @p rec with the values at the tool's sensitive.receipt pointers replaced by a marker: no key
 * is at hand for a record the ledger may not know, so the marker carries no keyed hash. */
static void redact_plain(const tally_tool_t *tool, json_t *rec)
{
    for (size_t i = 0; i < tool->n_sensitive_receipt; i++) {
        const char *ptr = tool->sensitive_receipt[i];
        const char *slash = strrchr(ptr, '/');
        if (slash == NULL) {
            continue;
        }
        char parent_ptr[512];
        size_t plen = (size_t)(slash - ptr);
        if (plen >= sizeof parent_ptr) {
            continue;
        }
        memcpy(parent_ptr, ptr, plen);
        parent_ptr[plen] = '\0';
        json_t *parent = plen == 0 ? rec : tally_json_pointer(rec, parent_ptr);
        /* the last token, unescaped (~1 is '/', ~0 is '~') */
        char key[512];
        size_t k = 0;
        for (const char *c = slash + 1; *c != '\0' && k + 1 < sizeof key; c++) {
            if (c[0] == '~' && (c[1] == '0' || c[1] == '1')) {
                key[k++] = c[1] == '0' ? '~' : '/';
                c++;
            } else {
                key[k++] = *c;
            }
        }
        key[k] = '\0';
        if (json_is_object(parent) && json_object_get(parent, key) != NULL) {
            json_object_set_new(parent, key, json_string("[redacted]"));
        } else if (json_is_array(parent)) {
            char *end = NULL;
            unsigned long idx = strtoul(key, &end, 10);
            if (end != key && *end == '\0' && idx < json_array_size(parent)) {
                json_array_set_new(parent, idx, json_string("[redacted]"));
            }
        }
    }
}

/* The record as evidence: itself, or an excerpt when it is large. @returns a new reference. */
static json_t *evidence_of(const json_t *rec)
{
    char *text = json_dumps(rec, JSON_COMPACT);
    if (text == NULL) {
        return json_null();
    }
    size_t len = strlen(text);
    json_t *out = len <= EVIDENCE_MAX ? json_deep_copy(rec) : NULL;
    if (out == NULL) {
        out = tally_conn_excerpt(text, len, EVIDENCE_MAX);
    }
    free(text);
    return out != NULL ? out : json_null();
}

/* A string member of the record's tally_headers, or NULL. */
static const char *header_of(const json_t *rec, const char *name)
{
    return json_string_value(json_object_get(json_object_get(rec, "tally_headers"), name));
}

typedef struct listed {
    json_t *rec; /* borrowed from the page, redacted in place */
    const char *effect_id;
    char *ref;
} listed_t;

/* The finding row for listed record @p l (its effect @p known to the ledger, in @p status; or
 * an effect of @p other_tool). */
static json_t *finding_row(const tally_tool_t *tool, const listed_t *l, bool known,
                           const char *run_id, const char *status, const char *other_tool)
{
    char id[37], summary[600];
    tally_uuid(id);
    /* an extra record of a CONFIRMED effect is a duplicate; anything else the tool holds
     * without the ledger's knowing is an orphan */
    const char *kind =
        status != NULL && strcmp(status, tally_effect_state_name(TALLY_EFFECT_CONFIRMED)) == 0
            ? "duplicate"
            : "orphan";
    if (!known && other_tool != NULL)
        tally_fmt(summary, sizeof summary,
                  "tool '%s' holds record %s for effect %s, which the ledger has for tool '%s', "
                  "not this one (an orphan: reverse it upstream by hand if it should not exist)",
                  tool->name, l->ref, l->effect_id, other_tool);
    else if (!known)
        tally_fmt(summary, sizeof summary,
                  "tool '%s' holds record %s for effect %s, which the ledger never had (an orphan: "
                  "reverse it upstream by hand if it should not exist)",
                  tool->name, l->ref, l->effect_id);
    else
        tally_fmt(summary, sizeof summary,
                  "tool '%s' holds record %s for effect %s, which the ledger has as %s, and the "
                  "tool cannot compensate (mode %s): reverse it upstream by hand",
                  tool->name, l->ref, l->effect_id, status, tally_comp_mode_name(tool->comp_mode));
    const char *listed_run = header_of(l->rec, "tally-run-id");
    if (run_id == NULL && listed_run != NULL && strlen(listed_run) <= TALLY_LIMIT_RUN_ID) {
        run_id = listed_run;
    }
    return json_pack("{s:s, s:s, s:s, s:s, s:s?, s:s, s:s, s:{s:s, s:s?, s:o, s:s?}}", "finding_id",
                     id, "kind", kind, "tool", tool->name, "external_ref", l->ref, "run_id", run_id,
                     "effect_id", l->effect_id, "summary", summary, "evidence", "check", "sweep",
                     "ledger_status", status, "record", evidence_of(l->rec), "idempotency_key",
                     header_of(l->rec, "idempotency-key"));
}

/* The events of the obligations just filed for listed records. */
static bool obligation_events(tally_recon_db_t *tx, const PGresult *obl, tally_error_t *err)
{
    bool ok = true;
    for (int j = 0; ok && j < PQntuples(obl); j++) {
        const char *obligation_id = PQgetvalue(obl, j, 0);
        const char *run_id = PQgetvalue(obl, j, 1);
        const char *effect_id = PQgetvalue(obl, j, 2);
        const char *ref = PQgetvalue(obl, j, 3);
        const char *reason = PQgetvalue(obl, j, 4);
        bool orphan = strcmp(reason, "orphan") == 0;
        tally_audit_event_t ev = {
            .run_id = run_id,
            .effect_id = effect_id,
            .obligation_id = obligation_id,
            .kind = "obligation",
            .actor = tx->actor,
            .reason = orphan ? "orphan: the tool holds a record of an effect that did not happen"
                             : "duplicate: the tool holds an extra record of a CONFIRMED effect",
        };
        (void)tally_audit_move(tx->audit, TALLY_MACHINE_OBLIGATION, -1, TALLY_OBLIGATION_PENDING,
                               &ev);
        json_t *record = json_loads(PQgetvalue(obl, j, 5), 0, NULL);
        json_t *data = json_pack("{s:s, s:s, s:o?}", "external_ref", ref, "found_by", "sweep",
                                 "record", record);
        tally_audit_event_t found = {
            .run_id = run_id,
            .effect_id = effect_id,
            .obligation_id = obligation_id,
            .kind = reason,
            .actor = tx->actor,
            .reason = orphan ? "the orphan sweep found a record upstream for this effect"
                             : "the orphan sweep found an extra record upstream for this effect",
            .data = data,
        };
        tally_audit_batch_add(tx->audit, &found);
        json_decref(data);
        ok = tally_recon_queue_message(
            tx, "obligations", "tally.obligation.v1", run_id,
            json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "obligation_id", obligation_id, "run_id",
                      run_id, "effect_id", effect_id, "reason", reason, "external_ref", ref,
                      "status", tally_obligation_state_name(TALLY_OBLIGATION_PENDING)),
            err);
    }
    return ok;
}

bool tally_sweep_record_page(tally_recon_db_t *db, const tally_tool_t *tool, json_t *records,
                             tally_sweep_counts_t *counts, tally_error_t *err)
{
    size_t n = json_array_size(records);
    listed_t *ls = calloc(n + 1, sizeof *ls);
    json_t *rows = json_array();
    json_t *obligations = json_array();
    json_t *findings = json_array();
    bool ok = ls != NULL && rows != NULL && obligations != NULL && findings != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        listed_t *l = &ls[i];
        l->rec = json_array_get(records, i);
        if (tally_tool_sensitive(tool)) {
            redact_plain(tool, l->rec);
        }
        const char *eid = header_of(l->rec, "tally-effect-id");
        size_t over = 0;
        l->ref = tally_conn_ref_within_limit(tally_conn_external_ref(tool, l->rec), &over);
        if (!tally_sweep_uuid_valid(eid) || l->ref == NULL) {
            counts->foreign++;
            continue;
        }
        l->effect_id = eid;
        ok = json_array_append_new(rows, json_pack("{s:i, s:s, s:s}", "n", (int)i, "effect_id", eid,
                                                   "external_ref", l->ref)) == 0;
    }
    if (!ok) {
        tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "out of memory reading a list page");
    }
    tally_recon_db_t tx = *db;
    PGresult *res = NULL;
    PGresult *obl = NULL;
    ok = ok && tally_recon_tx_begin(&tx, err);
    if (ok && json_array_size(rows) > 0) {
        char *text = json_dumps(rows, JSON_COMPACT);
        const char *params[2] = {text, tool->name};
        res = text != NULL ? tally_pg_exec(tx.pg, SQL_LOOKUP, 2, params, err) : NULL;
        if (text == NULL) {
            tally_error_setc_retriable(err, TALLY_ERR_OOM, false, "out of memory");
        }
        free(text);
        ok = res != NULL;
    }
    bool can_compensate =
        tool->compensate.path != NULL && tool->comp_mode != TALLY_COMP_NOT_SUPPORTED;
    for (int r = 0; ok && res != NULL && r < PQntuples(res); r++) {
        int i = atoi(PQgetvalue(res, r, 0));
        if (i < 0 || (size_t)i >= n) {
            continue;
        }
        const listed_t *l = &ls[i];
        bool known = !PQgetisnull(res, r, 1);
        const char *status = known ? PQgetvalue(res, r, 1) : NULL;
        tally_sweep_record_t sr = {
            .ours = true,
            .known = known,
            .ledger_ref = PQgetisnull(res, r, 2) ? NULL : PQgetvalue(res, r, 2),
            .ref = l->ref,
            .has_obligation = PQgetvalue(res, r, 4)[0] == 't',
            .can_compensate = can_compensate,
        };
        if (known && !tally_effect_state_parse(status, &sr.status)) {
            continue;
        }
        tally_sweep_class_t cls = tally_sweep_classify(&sr);
        switch (cls) {
        case TALLY_SWEEP_OURS:
            counts->recorded++;
            break;
        case TALLY_SWEEP_UNSETTLED:
            counts->unsettled++;
            break;
        case TALLY_SWEEP_DUPLICATE:
        case TALLY_SWEEP_ORPHAN: {
            char obligation_id[37];
            tally_uuid(obligation_id);
            ok = json_array_append_new(
                     obligations,
                     json_pack("{s:i, s:s, s:s, s:s, s:s, s:o}", "n", i, "obligation_id",
                               obligation_id, "effect_id", l->effect_id, "reason",
                               cls == TALLY_SWEEP_ORPHAN ? "orphan" : "duplicate", "external_ref",
                               l->ref, "receipt", evidence_of(l->rec))) == 0;
            break;
        }
        case TALLY_SWEEP_FINDING:
            ok = json_array_append_new(
                     findings,
                     finding_row(tool, l, known, known ? PQgetvalue(res, r, 3) : NULL, status,
                                 PQgetisnull(res, r, 5) ? NULL : PQgetvalue(res, r, 5))) == 0;
            break;
        case TALLY_SWEEP_FOREIGN:
            counts->foreign++;
            break;
        }
    }
    if (ok && json_array_size(obligations) > 0) {
        obl = tally_pg_exec_json(tx.pg, SQL_OBLIGATIONS, obligations, err);
        ok = obl != NULL && obligation_events(&tx, obl, err);
        if (obl != NULL) {
            counts->obligations += PQntuples(obl);
        }
    }
    size_t before = tally_alert_batch_len(tx.alerts);
    ok = ok && tally_recon_file_findings(&tx, findings, err);
    if (ok) {
        counts->findings += (int)(tally_alert_batch_len(tx.alerts) - before);
    }
    ok = tally_recon_tx_end(&tx, ok, err);
    PQclear(res);
    PQclear(obl);
    for (size_t i = 0; ls != NULL && i < n; i++) {
        free(ls[i].ref);
    }
    free(ls);
    json_decref(rows);
    json_decref(obligations);
    json_decref(findings);
    return ok;
}
