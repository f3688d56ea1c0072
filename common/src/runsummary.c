/* runsummary.c — a run's compensation summary (runsummary.h): the classification of each item
 * and the entry it gets, for the compensator's summary and `tally summary`. */
#include "tally/cloudevent.h"
#include "tally/runsummary.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/alert.h"
#include "tally/registry.h"
#include "tally/text.h"

static const char *const LIST_NAMES[TALLY_RUNSUM__COUNT] = {
    [TALLY_RUNSUM_COMPENSATED] = "compensated", [TALLY_RUNSUM_UNCOMPENSATABLE] = "uncompensatable",
    [TALLY_RUNSUM_SKIPPED] = "skipped",         [TALLY_RUNSUM_FAILED] = "failed",
    [TALLY_RUNSUM_PENDING] = "pending",
};

const char *tally_runsum_list_name(tally_runsum_list_t l)
{
    if ((int)l == (int)TALLY_RUNSUM_DONE) {
        return "done";
    }
    if ((int)l == (int)TALLY_RUNSUM_DUPLICATES) {
        return "duplicates";
    }
    return (int)l >= 0 && l < TALLY_RUNSUM__COUNT ? LIST_NAMES[l] : "unknown";
}

tally_runsum_kind_t tally_runsum_classify(tally_runsum_view_t view,
                                          const tally_obligation_state_t *ob,
                                          const tally_effect_state_t *effect)
{
    bool settled = view == TALLY_RUNSUM_SETTLED;
    if (ob != NULL) {
        switch (*ob) {
        case TALLY_OBLIGATION_RESOLVED:
            return TALLY_RUNSUM_REVERSED;
        case TALLY_OBLIGATION_UNCOMPENSATABLE:
            return TALLY_RUNSUM_IRREVERSIBLE;
        case TALLY_OBLIGATION_SKIPPED:
        case TALLY_OBLIGATION_CANCELLED:
            return TALLY_RUNSUM_NOTHING_TO_UNDO;
        case TALLY_OBLIGATION_STUCK:
            return TALLY_RUNSUM_OBLIGATION_STUCK;
        case TALLY_OBLIGATION_PENDING:
        case TALLY_OBLIGATION_AWAITING_APPROVAL:
        case TALLY_OBLIGATION_RUNNING:
        case TALLY_OBLIGATION__COUNT:
            break;
        }
        /* settled: nothing of the run can progress, so what is not terminal waits behind a
         * STUCK later step (compensation runs last step first) */
        return settled ? TALLY_RUNSUM_BLOCKED : TALLY_RUNSUM_UNDER_WAY;
    }
    if (effect == NULL) {
        return TALLY_RUNSUM_NEVER_APPLIED;
    }
    switch (*effect) {
    case TALLY_EFFECT_STUCK:
        return TALLY_RUNSUM_EFFECT_STUCK;
    case TALLY_EFFECT_CONFIRMED:
        if (view == TALLY_RUNSUM_UNCOMPENSATED) {
            return TALLY_RUNSUM_STANDS;
        }
        return settled ? TALLY_RUNSUM_NO_OBLIGATION : TALLY_RUNSUM_NO_OBLIGATION_YET;
    case TALLY_EFFECT_DISPATCHING:
    case TALLY_EFFECT_UNKNOWN:
        return settled ? TALLY_RUNSUM_NO_OBLIGATION : TALLY_RUNSUM_NO_OBLIGATION_YET;
    case TALLY_EFFECT_PLANNED:
    case TALLY_EFFECT_AWAITING_APPROVAL:
    case TALLY_EFFECT_FAILED:
    case TALLY_EFFECT_REJECTED:
    case TALLY_EFFECT_CANCELLED:
    case TALLY_EFFECT__COUNT:
        break;
    }
    return TALLY_RUNSUM_NEVER_APPLIED;
}

tally_runsum_list_t tally_runsum_kind_list(tally_runsum_kind_t k)
{
    switch (k) {
    case TALLY_RUNSUM_REVERSED:
        return TALLY_RUNSUM_COMPENSATED;
    case TALLY_RUNSUM_IRREVERSIBLE:
        return TALLY_RUNSUM_UNCOMPENSATABLE;
    case TALLY_RUNSUM_NOTHING_TO_UNDO:
    case TALLY_RUNSUM_NO_OBLIGATION:
    case TALLY_RUNSUM_NEVER_APPLIED:
        return TALLY_RUNSUM_SKIPPED;
    case TALLY_RUNSUM_OBLIGATION_STUCK:
    case TALLY_RUNSUM_BLOCKED:
    case TALLY_RUNSUM_EFFECT_STUCK:
        return TALLY_RUNSUM_FAILED;
    case TALLY_RUNSUM_UNDER_WAY:
    case TALLY_RUNSUM_NO_OBLIGATION_YET:
        return TALLY_RUNSUM_PENDING;
    case TALLY_RUNSUM_STANDS:
        return TALLY_RUNSUM_DONE;
    }
    return TALLY_RUNSUM_FAILED;
}

tally_run_state_t tally_runsum_outcome(size_t n_failed, size_t n_uncompensatable)
{
    return n_failed > 0            ? TALLY_RUN_STUCK
           : n_uncompensatable > 0 ? TALLY_RUN_PARTIALLY_COMPENSATED
                                   : TALLY_RUN_COMPENSATED;
}

/* ---- entries ----------------------------------------------------------------------------- */

static const char *str(const json_t *item, const char *key)
{
    return json_string_value(json_object_get(item, key));
}

static const char *str_or(const json_t *item, const char *key, const char *dflt)
{
    const char *s = str(item, key);
    return s != NULL ? s : dflt;
}

/* The step as the agent sent it: an integer when it was one. */
static json_t *step_json(const json_t *item)
{
    const char *step = json_string_value(json_object_get(item, "step"));
    if (step == NULL) {
        return json_null();
    }
    return tally_step_json(step, json_is_true(json_object_get(item, "step_is_number")));
}

static bool set(json_t *obj, const char *key, json_t *v)
{
    return v != NULL && json_object_set_new(obj, key, v) == 0;
}

static bool set_copy(json_t *obj, const char *key, const json_t *v)
{
    return set(obj, key, v != NULL ? json_deep_copy(v) : json_null());
}

static bool set_text(json_t *obj, const char *key, const char *text)
{
    return set(obj, key, json_string(text));
}

/* Why an effect without an obligation left nothing to undo, with its state. */
static void never_applied_why(const tally_effect_state_t *effect, const char *status, char *out,
                              size_t outsz)
{
    const char *why = "unknown state";
    if (effect != NULL) {
        switch (*effect) {
        case TALLY_EFFECT_CANCELLED:
            why = "the effect was cancelled and never took effect";
            break;
        case TALLY_EFFECT_FAILED:
        case TALLY_EFFECT_REJECTED:
            why = "the effect never took effect";
            break;
        case TALLY_EFFECT_PLANNED:
        case TALLY_EFFECT_AWAITING_APPROVAL:
            why = "the effect has not been dispatched";
            break;
        case TALLY_EFFECT_CONFIRMED:
        case TALLY_EFFECT_DISPATCHING:
        case TALLY_EFFECT_UNKNOWN:
            why = "no obligation was created for this effect";
            break;
        case TALLY_EFFECT_STUCK:
        case TALLY_EFFECT__COUNT:
            break;
        }
    }
    tally_fmt(out, outsz, "%s (%s)", why, status != NULL ? status : "?");
}

/* What a human must do about a STUCK effect: settle it from upstream evidence first. */
static void effect_action(tally_runsum_view_t view, const json_t *item, char *out, size_t outsz)
{
    if (view == TALLY_RUNSUM_SETTLED) {
        tally_fmt(out, outsz,
                  "Settle the effect first from upstream evidence: tally resolve --effect %s "
                  "--as confirmed --ref <REF> | --as failed --reason \"...\"; if confirmed, its "
                  "compensation follows",
                  str_or(item, "effect_id", "<id>"));
        return;
    }
    char *cmd = tally_alert_effect_command(str_or(item, "effect_id", "?"));
    tally_fmt(out, outsz,
              "Settle the effect first from upstream evidence; if it happened, its compensation "
              "follows:\n%s",
              cmd != NULL ? cmd : "tally resolve --effect <id> --as confirmed|failed");
    free(cmd);
}

/* What a human must do about a STUCK obligation. The SETTLED view says it by the error code and
 * names the page's runbook and resolve command; the LIVE view ends with the commands. */
static void obligation_action(tally_runsum_view_t view, const json_t *item, char *out, size_t outsz)
{
    if (view == TALLY_RUNSUM_LIVE) {
        char *cmd = tally_alert_obligation_command(str_or(item, "obligation_id", "?"));
        tally_fmt(out, outsz,
                  "Reverse it by hand (the original receipt is here) or confirm nothing is to be "
                  "undone, then settle it:\n%s",
                  cmd != NULL ? cmd : "tally resolve --obligation <id> --as resolved|skipped");
        free(cmd);
        return;
    }
    /* the codes are the obligation's error_code as the compensator wrote it (ledger text) */
    const char *code = str(item, "error_code");
    const char *cmd = str(item, "resolve_command");
    const char *runbook = str(item, "runbook");
    char fallback[160];
    if (cmd == NULL) {
        tally_fmt(fallback, sizeof fallback,
                  "tally resolve --obligation %s --as resolved|skipped --reason \"...\"",
                  str_or(item, "obligation_id", "<id>"));
        cmd = fallback;
    }
    const char *what;
    if (code != NULL && strcmp(code, "stale_state") == 0) {
        what = "The record changed upstream since tally touched it (If-Match failed): check it "
               "in the tool, reverse it by hand if that is still right";
    } else if (code != NULL && strcmp(code, "manual_runbook") == 0) {
        what = "Reverse it by hand following the runbook";
    } else if (code != NULL && strcmp(code, "attempts_exhausted") == 0) {
        what = "The reverse call kept failing: find out why in the tool, reverse it by hand or "
               "fix the tool";
    } else {
        what = "Reverse it by hand (the original receipt is above) or confirm nothing is to be "
               "undone";
    }
    tally_fmt(out, outsz, "%s%s%s; then settle it: %s", what, runbook != NULL ? " " : "",
              runbook != NULL ? runbook : "", cmd);
}

/* Whether the item is the obligation of an extra copy a DUPLICATE found (reconciler), not one
 * that compensates the effect's own record. */
static bool is_copy(const json_t *item)
{
    const char *reason = str(item, "obligation_reason");
    return reason != NULL && strcmp(reason, "duplicate") == 0;
}

/* What became of an extra copy, and what that means for the record the effect kept. */
static void copy_reason(tally_runsum_view_t view, const json_t *item, const char *what, char *out,
                        size_t outsz)
{
    const char *kept = str(item, "kept_ref");
    tally_fmt(out, outsz,
              "the effect was applied twice upstream (DUPLICATE): this extra copy %s; the kept "
              "record%s%s %s",
              what, kept != NULL ? " " : "", kept != NULL ? kept : "",
              view == TALLY_RUNSUM_UNCOMPENSATED
                  ? "still stands: it is not compensated (no compensation was asked for this run)"
                  : "has its own entry");
}

/* The containment action's result, as the compensator recorded it in the blast radius:
 * "; the containment action: done (HTTP 200)", "...: failed: <code>: <message>"; "" when the
 * reason speaks of no containment action and none was recorded. */
static void containment_result(const json_t *item, char *out, size_t outsz)
{
    const json_t *c = json_object_get(json_object_get(item, "blast_radius"), "containment");
    const char *why = str(item, "status_reason");
    out[0] = '\0';
    if (!json_is_object(c)) {
        if (why != NULL && strstr(why, "containment action") != NULL &&
            strstr(why, "no containment") == NULL) {
            tally_fmt(out, outsz, "; the containment action: no result recorded");
        }
        return;
    }
    const char *status = str_or(c, "status", "no result recorded");
    json_int_t http = json_integer_value(json_object_get(c, "http_status"));
    if (strcmp(status, "done") == 0 && http > 0) {
        tally_fmt(out, outsz, "; the containment action: done (HTTP %lld)", (long long)http);
    } else if (strcmp(status, "done") == 0) {
        tally_fmt(out, outsz, "; the containment action: done");
    } else {
        tally_fmt(out, outsz, "; the containment action: %s: %s: %s", status,
                  str_or(c, "code", "?"), str_or(c, "message", ""));
    }
}

/* The kind's own fields, after the ones every entry carries. */
static bool fill(json_t *e, tally_runsum_kind_t kind, tally_runsum_view_t view, const json_t *item,
                 const tally_effect_state_t *effect)
{
    const char *ob_status = str(item, "obligation_status");
    const char *effect_status = str(item, "effect_status");
    char text[1024];
    switch (kind) {
    case TALLY_RUNSUM_REVERSED:
        if (is_copy(item)) {
            copy_reason(view, item, "was reversed", text, sizeof text);
            return set_copy(e, "reverse_receipt", json_object_get(item, "reverse_receipt")) &&
                   set_text(e, "reason", text);
        }
        return set_copy(e, "reverse_receipt", json_object_get(item, "reverse_receipt")) &&
               set_copy(e, "reason", json_object_get(item, "status_reason"));
    case TALLY_RUNSUM_IRREVERSIBLE: {
        char result[800];
        containment_result(item, result, sizeof result);
        tally_fmt(text, sizeof text, "%s%s", str_or(item, "status_reason", "uncompensatable"),
                  result);
        return set_copy(e, "blast_radius", json_object_get(item, "blast_radius")) &&
               set_text(e, "reason", text);
    }
    case TALLY_RUNSUM_NOTHING_TO_UNDO:
        if (is_copy(item)) {
            char what[512];
            tally_fmt(what, sizeof what, "was not reversed (%s: %s)", ob_status,
                      str_or(item, "status_reason", "nothing to undo"));
            copy_reason(view, item, what, text, sizeof text);
            return set_text(e, "reason", text);
        }
        return set_text(e, "reason", str_or(item, "status_reason", ob_status));
    case TALLY_RUNSUM_OBLIGATION_STUCK:
    case TALLY_RUNSUM_BLOCKED: {
        json_t *err;
        if (kind == TALLY_RUNSUM_OBLIGATION_STUCK) {
            err = json_pack("{s:s, s:s}", "code", str_or(item, "error_code", "stuck"), "message",
                            str_or(item, "error_message", "the obligation is STUCK"));
            obligation_action(view, item, text, sizeof text);
        } else {
            err = json_pack("{s:s, s:s}", "code", "blocked", "message",
                            "not attempted: a later step of the run is STUCK and compensation "
                            "runs last step first");
            tally_fmt(text, sizeof text,
                      "Nothing for this step: it runs by itself once the STUCK later step is "
                      "settled");
        }
        return set_text(e, "status", ob_status) && set(e, "error", err) &&
               set_copy(e, "receipt", json_object_get(item, "receipt")) &&
               set_text(e, "action_required", text) &&
               set_copy(e, "attempts", json_object_get(item, "attempts"));
    }
    case TALLY_RUNSUM_UNDER_WAY:
        return set_text(e, "status", ob_status) &&
               set_copy(e, "reason", json_object_get(item, "status_reason")) &&
               set_copy(e, "attempts", json_object_get(item, "attempts"));
    case TALLY_RUNSUM_EFFECT_STUCK: {
        const json_t *err = json_object_get(item, "effect_error");
        effect_action(view, item, text, sizeof text);
        return set_text(e, "status", "STUCK") &&
               set(e, "error",
                   json_is_object(err)
                       ? json_deep_copy(err)
                       : json_pack("{s:s, s:s}", "code", "effect_stuck", "message",
                                   "the effect is STUCK: whether it happened is not known")) &&
               set_copy(e, "receipt", json_object_get(item, "receipt")) &&
               set_text(e, "action_required", text);
    }
    case TALLY_RUNSUM_NO_OBLIGATION_YET:
        tally_fmt(text, sizeof text,
                  "%s and no obligation yet: one is created when the run is compensated%s",
                  effect_status,
                  *effect == TALLY_EFFECT_CONFIRMED ? "" : " and the effect confirmed");
        return set_text(e, "status", effect_status) && set_text(e, "reason", text);
    case TALLY_RUNSUM_NO_OBLIGATION:
    case TALLY_RUNSUM_NEVER_APPLIED:
        never_applied_why(effect, effect_status, text, sizeof text);
        return set_text(e, "reason", text);
    case TALLY_RUNSUM_STANDS:
        return set_text(e, "status", effect_status) &&
               set_text(e, "reason",
                        "it happened and stands: no compensation was asked for this "
                        "run, so it is not compensated");
    }
    return false;
}

/* A read's or an idempotent call's obligation held behind a STUCK later step: the compensator
 * will mark it SKIPPED, nothing is to be undone and nobody needs to act. */
static bool nothing_to_undo_when_reached(const json_t *item)
{
    tally_effect_class_t cls;
    const char *name = str(item, "effect_class");
    return name != NULL && tally_effect_class_parse(name, &cls) &&
           (cls == TALLY_CLASS_READ || cls == TALLY_CLASS_IDEMPOTENT);
}

json_t *tally_runsum_entry(tally_runsum_view_t view, const json_t *item, tally_runsum_list_t *list)
{
    /* Parsed once, here: an obligation state the ledger would refuse counts as not terminal,
     * an effect state it would refuse as unknown. */
    const char *ob_status = str(item, "obligation_status");
    tally_obligation_state_t ob = TALLY_OBLIGATION_PENDING;
    if (ob_status != NULL && !tally_obligation_state_parse(ob_status, &ob)) {
        ob = TALLY_OBLIGATION_PENDING;
    }
    const char *effect_status = str(item, "effect_status");
    tally_effect_state_t effect;
    bool effect_known = effect_status != NULL && tally_effect_state_parse(effect_status, &effect);
    tally_runsum_kind_t kind =
        tally_runsum_classify(view, ob_status != NULL ? &ob : NULL, effect_known ? &effect : NULL);
    bool blocked_read = kind == TALLY_RUNSUM_BLOCKED && nothing_to_undo_when_reached(item);
    *list = blocked_read ? TALLY_RUNSUM_SKIPPED : tally_runsum_kind_list(kind);

    json_t *e = json_object();
    bool ok = e != NULL && set_copy(e, "effect_id", json_object_get(item, "effect_id")) &&
              set(e, "step", step_json(item)) &&
              set_copy(e, "tool", json_object_get(item, "tool")) &&
              set_copy(e, "obligation_id", json_object_get(item, "obligation_id")) &&
              set_copy(e, "external_ref", json_object_get(item, "external_ref"));
    if (ok && is_copy(item)) {
        ok = set(e, "duplicate_copy", json_true());
    }
    if (ok && blocked_read) {
        char text[512];
        tally_fmt(text, sizeof text,
                  "nothing to undo (%s): its obligation is marked SKIPPED once the STUCK later "
                  "step is settled",
                  str_or(item, "effect_class", "read"));
        ok = set_text(e, "status", ob_status) && set_text(e, "reason", text);
    } else if (ok) {
        ok = fill(e, kind, view, item, effect_known ? &effect : NULL);
    }
    if (!ok) {
        json_decref(e);
        return NULL;
    }
    return e;
}

/* Sort into @p n_lists lists: five, or TALLY_RUNSUM__ALL. */
static bool sort_into(tally_runsum_view_t view, const json_t *items, json_t *const *lists,
                      int n_lists)
{
    size_t i;
    json_t *item;
    json_array_foreach(items, i, item)
    {
        tally_runsum_list_t list;
        json_t *e = tally_runsum_entry(view, item, &list);
        bool settled_copy =
            is_copy(item) && (list == TALLY_RUNSUM_COMPENSATED || list == TALLY_RUNSUM_SKIPPED ||
                              list == TALLY_RUNSUM_UNCOMPENSATABLE);
        if (n_lists == TALLY_RUNSUM__ALL && settled_copy && view != TALLY_RUNSUM_SETTLED) {
            list = TALLY_RUNSUM_DUPLICATES;
        }
        if ((int)list >= n_lists) {
            list = TALLY_RUNSUM_PENDING; /* what stands, in five lists: no obligation yet */
        }
        if (e == NULL || json_array_append_new(lists[list], e) != 0) {
            return false;
        }
    }
    return true;
}

bool tally_runsum_sort(tally_runsum_view_t view, const json_t *items,
                       json_t *const lists[TALLY_RUNSUM__COUNT])
{
    return sort_into(view, items, lists, TALLY_RUNSUM__COUNT);
}

bool tally_runsum_sort_all(tally_runsum_view_t view, const json_t *items,
                           json_t *const lists[TALLY_RUNSUM__ALL])
{
    return sort_into(view, items, lists, TALLY_RUNSUM__ALL);
}

json_t *tally_runsum_settled(const char *run_id, const char *reason, const json_t *items,
                             tally_run_state_t *status)
{
    json_t *lists[TALLY_RUNSUM__COUNT];
    bool ok = true;
    for (int l = 0; l < TALLY_RUNSUM__COUNT; l++) {
        lists[l] = json_array();
        ok = ok && lists[l] != NULL;
    }
    ok = ok && tally_runsum_sort(TALLY_RUNSUM_SETTLED, items, lists);
    *status = tally_runsum_outcome(json_array_size(lists[TALLY_RUNSUM_FAILED]),
                                   json_array_size(lists[TALLY_RUNSUM_UNCOMPENSATABLE]));
    json_t *summary = NULL;
    if (ok) {
        /* the SETTLED view has no pending list: nothing of a settled run is under way */
        summary = json_pack(
            "{s:s, s:s, s:s?, s:{s:I, s:I, s:I, s:I}, s:O, s:O, s:O, s:O}", "run_id", run_id,
            "status", tally_run_state_name(*status), "reason", reason, "counts", "compensated",
            (json_int_t)json_array_size(lists[TALLY_RUNSUM_COMPENSATED]), "uncompensatable",
            (json_int_t)json_array_size(lists[TALLY_RUNSUM_UNCOMPENSATABLE]), "skipped",
            (json_int_t)json_array_size(lists[TALLY_RUNSUM_SKIPPED]), "failed",
            (json_int_t)json_array_size(lists[TALLY_RUNSUM_FAILED]), "compensated",
            lists[TALLY_RUNSUM_COMPENSATED], "uncompensatable", lists[TALLY_RUNSUM_UNCOMPENSATABLE],
            "skipped", lists[TALLY_RUNSUM_SKIPPED], "failed", lists[TALLY_RUNSUM_FAILED]);
    }
    for (int l = 0; l < TALLY_RUNSUM__COUNT; l++) {
        json_decref(lists[l]);
    }
    return summary;
}
