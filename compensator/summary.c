/* summary.c — what the compensator writes, built without I/O so the unit tests can read it:
 * the blast radius of what cannot be undone, the reverse call's body and If-Match, the retry
 * backoff, and a run's compensation summary (DESIGN §7). */
#include "compensator.h"
#include "tally/backoff.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Argument names that say who or what an effect reached, most specific first. */
static const char *const TARGET_FIELDS[] = {
    "to",           "recipient", "recipients", "email",       "email_address", "phone",
    "phone_number", "channel",   "account_id", "customer_id", "user_id",       "target",
};

const char *comp_target_field(const json_t *args)
{
    if (!json_is_object(args)) {
        return NULL;
    }
    for (size_t i = 0; i < sizeof TARGET_FIELDS / sizeof TARGET_FIELDS[0]; i++) {
        json_t *v = json_object_get(args, TARGET_FIELDS[i]);
        if (v != NULL && !json_is_null(v)) {
            return TARGET_FIELDS[i];
        }
    }
    return NULL;
}

static void utc_now(char *out, size_t outsz)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char base[24];
    size_t n = strftime(base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm);
    int ms = (int)(ts.tv_nsec / 1000000L) % 1000;
    snprintf(out, outsz, "%.*s.%03dZ", (int)n, base, ms); /* lint: slice */
}

static json_t *nullable_string(const char *s)
{
    return s != NULL ? json_string(s) : json_null();
}

static json_t *copy_or_null(const json_t *v)
{
    return v != NULL ? json_deep_copy(v) : json_null();
}

json_t *comp_blast_radius(const char *tool, const char *operation_key, const json_t *args,
                          const json_t *receipt, const char *external_ref, const char *time)
{
    char now[40];
    utc_now(now, sizeof now);
    const char *field = comp_target_field(args);
    json_t *target = field != NULL ? json_pack("{s:s, s:O}", "field", field, "value",
                                               json_object_get(args, field))
                                   : json_null();
    return json_pack("{s:s, s:o, s:s?, s:o, s:o, s:o, s:o, s:s}", "tool", tool, "target", target,
                     "operation_key", operation_key, "external_ref", nullable_string(external_ref),
                     "args", copy_or_null(args), "receipt", copy_or_null(receipt), "time",
                     nullable_string(time), "recorded_at", now);
}

json_t *comp_reverse_body(const char *external_ref, const json_t *receipt, const json_t *args,
                          const char *reason)
{
    return json_pack("{s:o, s:o, s:o, s:s}", "external_ref", nullable_string(external_ref),
                     "receipt", copy_or_null(receipt), "args", copy_or_null(args), "reason",
                     reason != NULL ? reason : "compensate_run");
}

comp_version_t comp_if_match(const json_t *receipt, char out[COMP_IF_MATCH_SIZE])
{
    json_t *v = json_object_get(receipt, "version");
    out[0] = '\0';
    if (json_is_integer(v)) {
        snprintf(out, COMP_IF_MATCH_SIZE, "%lld", (long long)json_integer_value(v));
        return COMP_VERSION_OK;
    }
    if (!json_is_string(v) || json_string_length(v) == 0) {
        return COMP_VERSION_NONE;
    }
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    if (len > TALLY_LIMIT_RECEIPT_VERSION || strlen(s) != len) {
        return COMP_VERSION_UNUSABLE;
    }
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch < 0x20 || ch == 0x7f) {
            return COMP_VERSION_UNUSABLE; /* CR/LF would inject headers */
        }
    }
    memcpy(out, s, len + 1);
    return COMP_VERSION_OK;
}

long long comp_backoff_ms(const tally_tool_t *tool, int attempts, long retry_after_ms,
                          unsigned *rand_state)
{
    int base = tool != NULL && tool->backoff_ms > 0 ? tool->backoff_ms : 200;
    int cap = tool != NULL && tool->max_backoff_ms > 0 ? tool->max_backoff_ms : 60000;
    return tally_backoff_ms(attempts, base, cap, retry_after_ms, (uint32_t)rand_r(rand_state));
}

/* ---- the run summary ----------------------------------------------------------------------- */

static json_t *step_json(const json_t *item)
{
    const char *step = json_string_value(json_object_get(item, "step"));
    if (step == NULL) {
        return json_null();
    }
    if (json_is_true(json_object_get(item, "step_is_number"))) {
        char *end = NULL;
        long long v = strtoll(step, &end, 10);
        if (end != step && *end == '\0') {
            return json_integer((json_int_t)v);
        }
    }
    return json_string(step);
}

static const char *str(const json_t *item, const char *key)
{
    return json_string_value(json_object_get(item, key));
}

/* The fields every entry carries. */
static json_t *entry_base(const json_t *item)
{
    json_t *e = json_pack(
        "{s:O, s:o, s:O, s:O, s:O}", "effect_id", json_object_get(item, "effect_id"), "step",
        step_json(item), "tool", json_object_get(item, "tool"), "obligation_id",
        json_object_get(item, "obligation_id") != NULL ? json_object_get(item, "obligation_id")
                                                       : json_null(),
        "external_ref",
        json_object_get(item, "external_ref") != NULL ? json_object_get(item, "external_ref")
                                                      : json_null());
    return e;
}

static bool set(json_t *obj, const char *key, json_t *v)
{
    return v != NULL && json_object_set_new(obj, key, v) == 0;
}

static bool set_copy(json_t *obj, const char *key, const json_t *v)
{
    return set(obj, key, v != NULL ? json_deep_copy(v) : json_null());
}

/* What a human must do for a STUCK obligation, by its code. */
static void action_for(const json_t *item, char *out, size_t outsz)
{
    const char *code = str(item, "error_code");
    const char *cmd = str(item, "resolve_command");
    const char *runbook = str(item, "runbook");
    const char *oid = str(item, "obligation_id");
    char fallback[160];
    if (cmd == NULL) {
        snprintf(fallback, sizeof fallback,
                 "tally resolve --obligation %s --as resolved|skipped --reason \"...\"",
                 oid != NULL ? oid : "<id>");
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
    snprintf(out, outsz, "%s%s%s; then settle it: %s", what, runbook != NULL ? " " : "",
             runbook != NULL ? runbook : "", cmd);
}

/* Sort one item into the summary. Returns false when out of memory. */
static bool classify(const json_t *item, json_t *compensated, json_t *uncompensatable,
                     json_t *skipped, json_t *failed)
{
    const char *ob_status = str(item, "obligation_status");
    const char *effect_status = str(item, "effect_status");
    json_t *e = entry_base(item);
    if (e == NULL) {
        return false;
    }
    bool ok = true;
    json_t *list = NULL;
    char text[1024];
    if (ob_status == NULL) {
        /* an effect without an obligation: nothing was or could be undone */
        if (effect_status != NULL && strcmp(effect_status, "STUCK") == 0) {
            json_t *err = json_object_get(item, "effect_error");
            snprintf(text, sizeof text,
                     "Settle the effect first from upstream evidence: tally resolve --effect %s "
                     "--as confirmed --ref <REF> | --as failed --reason \"...\"; if confirmed, "
                     "its compensation follows",
                     str(item, "effect_id") != NULL ? str(item, "effect_id") : "<id>");
            ok = set(e, "status", json_string("STUCK")) &&
                 set(e, "error",
                     json_is_object(err)
                         ? json_deep_copy(err)
                         : json_pack("{s:s, s:s}", "code", "effect_stuck", "message",
                                     "the effect is STUCK: whether it happened is not known")) &&
                 set_copy(e, "receipt", json_object_get(item, "receipt")) &&
                 set(e, "action_required", json_string(text));
            list = failed;
        } else {
            const char *why;
            if (effect_status == NULL) {
                why = "unknown state";
            } else if (strcmp(effect_status, "CANCELLED") == 0) {
                why = "the effect was cancelled and never took effect";
            } else if (strcmp(effect_status, "FAILED") == 0 ||
                       strcmp(effect_status, "REJECTED") == 0) {
                why = "the effect never took effect";
            } else if (strcmp(effect_status, "PLANNED") == 0 ||
                       strcmp(effect_status, "AWAITING_APPROVAL") == 0) {
                why = "the effect has not been dispatched";
            } else {
                why = "no obligation was created for this effect";
            }
            snprintf(text, sizeof text, "%s (%s)", why, effect_status ? effect_status : "?");
            ok = set(e, "reason", json_string(text));
            list = skipped;
        }
    } else if (strcmp(ob_status, "RESOLVED") == 0) {
        ok = set_copy(e, "reverse_receipt", json_object_get(item, "reverse_receipt")) &&
             set_copy(e, "reason", json_object_get(item, "status_reason"));
        list = compensated;
    } else if (strcmp(ob_status, "UNCOMPENSATABLE") == 0) {
        ok = set_copy(e, "blast_radius", json_object_get(item, "blast_radius")) &&
             set_copy(e, "reason", json_object_get(item, "status_reason"));
        list = uncompensatable;
    } else if (strcmp(ob_status, "SKIPPED") == 0 || strcmp(ob_status, "CANCELLED") == 0) {
        const char *reason = str(item, "status_reason");
        snprintf(text, sizeof text, "%s", reason != NULL ? reason : ob_status);
        ok = set(e, "reason", json_string(text));
        list = skipped;
    } else {
        /* STUCK, or PENDING behind a STUCK later step */
        bool stuck = strcmp(ob_status, "STUCK") == 0;
        json_t *err;
        if (stuck) {
            err = json_pack("{s:s, s:s}", "code",
                            str(item, "error_code") != NULL ? str(item, "error_code") : "stuck",
                            "message",
                            str(item, "error_message") != NULL ? str(item, "error_message")
                                                               : "the obligation is STUCK");
            action_for(item, text, sizeof text);
        } else {
            err = json_pack("{s:s, s:s}", "code", "blocked", "message",
                            "not attempted: a later step of the run is STUCK and compensation "
                            "runs last step first");
            snprintf(text, sizeof text,
                     "Nothing for this step: it runs by itself once the STUCK later step is "
                     "settled");
        }
        ok = set(e, "status", json_string(ob_status)) && set(e, "error", err) &&
             set_copy(e, "receipt", json_object_get(item, "receipt")) &&
             set(e, "action_required", json_string(text)) &&
             set_copy(e, "attempts", json_object_get(item, "attempts"));
        list = failed;
    }
    if (!ok || json_array_append_new(list, e) != 0) {
        if (!ok) {
            json_decref(e);
        }
        return false;
    }
    return true;
}

json_t *comp_run_summary(const char *run_id, const char *reason, const json_t *items,
                         const char **status)
{
    json_t *compensated = json_array(), *uncompensatable = json_array();
    json_t *skipped = json_array(), *failed = json_array();
    bool ok = compensated && uncompensatable && skipped && failed;
    size_t i;
    json_t *item;
    json_array_foreach(items, i, item)
    {
        ok = ok && classify(item, compensated, uncompensatable, skipped, failed);
    }
    *status = json_array_size(failed) > 0            ? "STUCK"
              : json_array_size(uncompensatable) > 0 ? "PARTIALLY_COMPENSATED"
                                                     : "COMPENSATED";
    json_t *summary = NULL;
    if (ok) {
        summary =
            json_pack("{s:s, s:s, s:s?, s:{s:I, s:I, s:I, s:I}, s:O, s:O, s:O, s:O}", "run_id",
                      run_id, "status", *status, "reason", reason, "counts", "compensated",
                      (json_int_t)json_array_size(compensated), "uncompensatable",
                      (json_int_t)json_array_size(uncompensatable), "skipped",
                      (json_int_t)json_array_size(skipped), "failed",
                      (json_int_t)json_array_size(failed), "compensated", compensated,
                      "uncompensatable", uncompensatable, "skipped", skipped, "failed", failed);
    }
    json_decref(compensated);
    json_decref(uncompensatable);
    json_decref(skipped);
    json_decref(failed);
    return summary;
}
