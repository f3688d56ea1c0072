/* body.c — the documents the compensator builds, without I/O so the unit tests can read them:
 * the blast radius of what cannot be undone, the reverse call's body and If-Match, and the text
 * of a deadline page. (A run's compensation summary is tally/runsummary.h's, shared with
 * `tally summary`.) */
#include "compensator.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tally/alert.h"

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

/* ---------------------------------------------------------------------------------------- */
/* Deadline pages                                                                           */

/* @p s single-quoted for a POSIX shell ('it'\''s'), malloc'd; NULL on OOM. */
static char *shell_quoted(const char *s)
{
    size_t n = 2;
    for (const char *p = s; *p; p++)
        n += *p == '\'' ? 4 : 1;
    char *out = malloc(n + 1), *o = out;
    if (out == NULL)
        return NULL;
    *o++ = '\'';
    for (const char *p = s; *p; p++) {
        if (*p == '\'') {
            memcpy(o, "'\\''", 4);
            o += 4;
        } else {
            *o++ = *p;
        }
    }
    *o++ = '\'';
    *o = '\0';
    return out;
}

char *comp_deadline_command(tally_obligation_state_t state, const char *obligation_id,
                            const char *run_id)
{
    switch (state) {
    case TALLY_OBLIGATION_STUCK:
        return tally_alert_obligation_command(obligation_id);
    case TALLY_OBLIGATION_AWAITING_APPROVAL:
        return tally_alert_approval_command(true, obligation_id);
    default:
        break;
    }
    /* PENDING, RUNNING: the compensator is still at it, and no operator move applies until it
     * stops (STUCK); say what to look at, and the resolve that applies then. */
    char *run = shell_quoted(run_id != NULL ? run_id : "");
    const char *fmt = "tally doctor --run %s  # why the compensator has not finished it yet\n"
                      "tally resolve --obligation %s --as resolved --reason \"<what you did>\"  "
                      "# once it is STUCK: you reversed it by hand\n"
                      "tally resolve --obligation %s --as skipped --reason \"<why>\"  # once it "
                      "is STUCK: nothing is to be undone";
    int len = run != NULL ? snprintf(NULL, 0, fmt, run, obligation_id, obligation_id) : -1;
    char *out = len >= 0 ? malloc((size_t)len + 1) : NULL;
    if (out != NULL)
        snprintf(out, (size_t)len + 1, fmt, run, obligation_id, obligation_id);
    free(run);
    return out;
}

void comp_deadline_summary(char *out, size_t outsz, bool passed, double share, const char *run_id,
                           const char *step, const char *tool, const char *obligation_id,
                           const char *status, const char *deadline_at)
{
    /* each quoted value cut on a character boundary (text.h): no run id can crowd out the rest */
    char run[84], st[44], tl[64];
    tally_text_copy(run, sizeof run, run_id != NULL ? run_id : "?");
    tally_text_copy(st, sizeof st, step != NULL ? step : "?");
    tally_text_copy(tl, sizeof tl, tool != NULL ? tool : "?");
    if (passed)
        tally_fmt(out, outsz,
                  "run %s step %s: compensation of %s is past its deadline %s (obligation %s is "
                  "%s)",
                  run, st, tl, deadline_at, obligation_id, status);
    else
        tally_fmt(out, outsz,
                  "run %s step %s: compensation of %s has used %.0f%% of its time to its "
                  "deadline %s (obligation %s is %s)",
                  run, st, tl, share * 100.0, deadline_at, obligation_id, status);
}
