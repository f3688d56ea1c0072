/* policy.c — the reconciler's decisions, without I/O: what an UNKNOWN effect becomes after a
 * status check, how long to wait before the next one, and which upstream record is kept when
 * there are several. DESIGN §3 is the contract; tests/unit/test_reconcile.c reads it back. */
#include "reconciler.h"
#include "tally/backoff.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

const char *tally_recon_action_name(tally_recon_action_t a)
{
    switch (a) {
    case TALLY_RECON_CONFIRM:
        return "confirmed";
    case TALLY_RECON_DUPLICATE:
        return "duplicate";
    case TALLY_RECON_WAIT_SETTLE:
        return "settling";
    case TALLY_RECON_REDISPATCH:
        return "redispatched";
    case TALLY_RECON_RETRY_CHECK:
        return "inconclusive";
    case TALLY_RECON_STUCK:
        return "stuck";
    case TALLY_RECON_CANCEL:
        return "cancelled";
    }
    return "unknown";
}

/* Not found, or no way to look: re-dispatching is allowed while attempts remain. */
static tally_recon_decision_t redispatch_or_stuck(const tally_recon_input_t *in)
{
    tally_recon_decision_t d = {TALLY_RECON_REDISPATCH, NULL, 0};
    if (in->attempts >= in->max_attempts) {
        d.action = TALLY_RECON_STUCK;
        d.stuck_reason = "attempts_exhausted";
    }
    return d;
}

tally_recon_decision_t tally_recon_decide(const tally_recon_input_t *in)
{
    tally_recon_decision_t d = {TALLY_RECON_STUCK, NULL, 0};
    if (!in->has_status) {
        if (in->effect_class == TALLY_CLASS_READ || in->effect_class == TALLY_CLASS_IDEMPOTENT) {
            return redispatch_or_stuck(in);
        }
        d.stuck_reason = "no_status_check";
        return d;
    }
    switch (in->verdict) {
    case TALLY_VERDICT_FOUND:
        d.action = TALLY_RECON_CONFIRM;
        return d;
    case TALLY_VERDICT_DUPLICATE:
        d.action = TALLY_RECON_DUPLICATE;
        return d;
    case TALLY_VERDICT_NOT_FOUND:
        if (!in->settled) {
            d.action = TALLY_RECON_WAIT_SETTLE;
            return d;
        }
        return redispatch_or_stuck(in);
    default:
        break;
    }
    /* Inconclusive (an error, or an answer that is not the protocol's). */
    int n = in->inconclusive_checks + 1;
    long long deadline = (long long)TALLY_RECON_DEADLINE_FACTOR * in->max_backoff_ms;
    if (n >= in->max_attempts || in->unknown_ms >= deadline) {
        d.stuck_reason = "status_inconclusive";
        return d;
    }
    d.action = TALLY_RECON_RETRY_CHECK;
    d.delay_ms = tally_backoff_ms(n, in->backoff_ms, in->max_backoff_ms, -1, in->random);
    return d;
}

/* Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil). */
static long long days_from_civil(long long y, unsigned m, unsigned d)
{
    y -= m <= 2;
    long long era = (y >= 0 ? y : y - 399) / 400;
    unsigned yoe = (unsigned)(y - era * 400);
    unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (long long)doe - 719468;
}

/* Exactly @p n digits at *@p s; advances past them. */
static bool digits(const char **s, int n, int *out)
{
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (!isdigit((unsigned char)(*s)[i])) {
            return false;
        }
        v = v * 10 + ((*s)[i] - '0');
    }
    *s += n;
    *out = v;
    return true;
}

static bool expect(const char **s, char c)
{
    if (**s != c) {
        return false;
    }
    (*s)++;
    return true;
}

bool tally_recon_parse_time(const char *s, long long *us_out)
{
    if (s == NULL) {
        return false;
    }
    int y, mo, d, h, mi, sec;
    if (!digits(&s, 4, &y) || !expect(&s, '-') || !digits(&s, 2, &mo) || !expect(&s, '-') ||
        !digits(&s, 2, &d)) {
        return false;
    }
    if (*s != 'T' && *s != 't' && *s != ' ') {
        return false;
    }
    s++;
    if (!digits(&s, 2, &h) || !expect(&s, ':') || !digits(&s, 2, &mi) || !expect(&s, ':') ||
        !digits(&s, 2, &sec)) {
        return false;
    }
    static const int mdays[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (mo < 1 || mo > 12 || d < 1 || d > mdays[mo - 1] || h > 23 || mi > 59 || sec > 60) {
        return false;
    }
    long long frac_us = 0;
    if (*s == '.') {
        s++;
        if (!isdigit((unsigned char)*s)) {
            return false;
        }
        long long scale = 100000;
        while (isdigit((unsigned char)*s)) {
            frac_us += (*s - '0') * scale;
            scale /= 10;
            s++;
        }
    }
    long long offset_s = 0;
    if (*s == 'Z' || *s == 'z') {
        s++;
    } else if (*s == '+' || *s == '-') {
        int sign = *s == '-' ? -1 : 1;
        s++;
        int oh, om;
        if (!digits(&s, 2, &oh) || !expect(&s, ':') || !digits(&s, 2, &om) || oh > 23 || om > 59) {
            return false;
        }
        offset_s = sign * (oh * 3600LL + om * 60LL);
    } else {
        return false;
    }
    if (*s != '\0') {
        return false;
    }
    long long days = days_from_civil(y, (unsigned)mo, (unsigned)d);
    long long secs = days * 86400 + h * 3600LL + mi * 60LL + sec - offset_s;
    *us_out = secs * 1000000 + frac_us;
    return true;
}

size_t tally_recon_earliest(const json_t *records)
{
    size_t n = json_array_size(records);
    size_t best = 0;
    long long best_us = 0;
    for (size_t i = 0; i < n; i++) {
        const char *at =
            json_string_value(json_object_get(json_array_get(records, i), "created_at"));
        long long us;
        if (!tally_recon_parse_time(at, &us)) {
            return 0; /* not every record says when it was made: trust the tool's order */
        }
        if (i == 0 || us < best_us) {
            best = i;
            best_us = us;
        }
    }
    return best;
}

bool tally_recon_records_usable(const json_t *records, char *why, size_t whysz)
{
    if (!json_is_array(records)) {
        snprintf(why, whysz, "the status answer is not a JSON array");
        return false;
    }
    for (size_t i = 0; i < json_array_size(records); i++) {
        if (!json_is_object(json_array_get(records, i))) {
            snprintf(why, whysz,
                     "record %zu of the status answer is not a JSON object, so it cannot be a "
                     "receipt",
                     i);
            return false;
        }
    }
    return true;
}

/* ---- audits of CONFIRMED effects ------------------------------------------------------------ */

const char *tally_audit_result_name(tally_audit_result_t r)
{
    switch (r) {
    case TALLY_AUDIT_CLEAN:
        return "clean";
    case TALLY_AUDIT_DUPLICATE:
        return "duplicate";
    case TALLY_AUDIT_MISSING:
        return "missing";
    case TALLY_AUDIT_MISMATCH:
        return "mismatch";
    case TALLY_AUDIT_RETRY:
        return "inconclusive";
    case TALLY_AUDIT_GIVE_UP:
        return "gave_up";
    }
    return "unknown";
}

tally_audit_decision_t tally_audit_decide(const tally_audit_input_t *in)
{
    tally_audit_decision_t d = {.result = TALLY_AUDIT_CLEAN, .counted = true, .next_in_ms = -1};
    switch (in->verdict) {
    case TALLY_VERDICT_FOUND:
        d.result = in->kept_matches ? TALLY_AUDIT_CLEAN : TALLY_AUDIT_MISMATCH;
        break;
    case TALLY_VERDICT_DUPLICATE:
        d.result = TALLY_AUDIT_DUPLICATE;
        break;
    case TALLY_VERDICT_NOT_FOUND:
        d.result = TALLY_AUDIT_MISSING;
        break;
    default: {
        int n = in->failures + 1;
        d.counted = false;
        if (n >= in->max_attempts) {
            d.result = TALLY_AUDIT_GIVE_UP;
            return d;
        }
        d.result = TALLY_AUDIT_RETRY;
        d.next_in_ms = tally_backoff_ms(n, in->backoff_ms, in->max_backoff_ms, -1, in->random);
        return d;
    }
    }
    /* the first pass may be followed by one more */
    if (in->passes == 0 && in->again_ms > 0) {
        d.next_in_ms = in->again_ms;
    }
    return d;
}

/* ---- the orphan sweep -------------------------------------------------------------------- */

const char *tally_sweep_class_name(tally_sweep_class_t c)
{
    switch (c) {
    case TALLY_SWEEP_OURS:
        return "recorded";
    case TALLY_SWEEP_UNSETTLED:
        return "unsettled";
    case TALLY_SWEEP_DUPLICATE:
        return "duplicate";
    case TALLY_SWEEP_ORPHAN:
        return "orphan";
    case TALLY_SWEEP_FINDING:
        return "finding";
    case TALLY_SWEEP_FOREIGN:
        return "foreign";
    }
    return "unknown";
}

tally_sweep_class_t tally_sweep_classify(const tally_sweep_record_t *r)
{
    if (!r->ours) {
        return TALLY_SWEEP_FOREIGN;
    }
    if (!r->known) {
        return TALLY_SWEEP_FINDING;
    }
    if (r->has_obligation) {
        return TALLY_SWEEP_OURS;
    }
    switch (r->status) {
    case TALLY_EFFECT_CONFIRMED:
        if (r->ledger_ref != NULL && r->ref != NULL && strcmp(r->ledger_ref, r->ref) == 0) {
            return TALLY_SWEEP_OURS;
        }
        return r->can_compensate ? TALLY_SWEEP_DUPLICATE : TALLY_SWEEP_FINDING;
    case TALLY_EFFECT_FAILED:
    case TALLY_EFFECT_CANCELLED:
    case TALLY_EFFECT_REJECTED:
        return r->can_compensate ? TALLY_SWEEP_ORPHAN : TALLY_SWEEP_FINDING;
    default:
        /* not settled: a status check will find the record and decide */
        return TALLY_SWEEP_UNSETTLED;
    }
}

bool tally_sweep_uuid_valid(const char *s)
{
    if (s == NULL || strlen(s) != 36) {
        return false;
    }
    for (int i = 0; i < 36; i++) {
        bool dash = i == 8 || i == 13 || i == 18 || i == 23;
        if (dash ? s[i] != '-' : !isxdigit((unsigned char)s[i])) {
            return false;
        }
    }
    return true;
}

bool tally_sweep_page(const char *body, size_t len, json_t **records, char **next_cursor, char *why,
                      size_t whysz)
{
    *records = NULL;
    *next_cursor = NULL;
    json_error_t jerr;
    json_t *doc = json_loadb(body, len, TALLY_JSON_LOAD_FLAGS, &jerr);
    if (doc == NULL) {
        tally_fmt(why, whysz, "the list answer is not JSON: %s", jerr.text);
        return false;
    }
    json_t *recs = json_object_get(doc, "records");
    json_t *next = json_object_get(doc, "next_cursor");
    if (!json_is_array(recs)) {
        tally_fmt(why, whysz, "the list answer has no \"records\" array");
    } else if (next != NULL && !json_is_null(next) &&
               (!json_is_string(next) || json_string_length(next) == 0 ||
                json_string_length(next) > TALLY_SWEEP_CURSOR_MAX)) {
        tally_fmt(why, whysz,
                  "the list answer's \"next_cursor\" must be null or a string of 1 to %d bytes",
                  TALLY_SWEEP_CURSOR_MAX);
    } else {
        for (size_t i = 0; i < json_array_size(recs); i++) {
            if (!json_is_object(json_array_get(recs, i))) {
                tally_fmt(why, whysz, "the list answer's record %zu is not an object", i);
                json_decref(doc);
                return false;
            }
        }
        if (json_is_string(next)) {
            *next_cursor = strdup(json_string_value(next));
            if (*next_cursor == NULL) {
                tally_fmt(why, whysz, "out of memory");
                json_decref(doc);
                return false;
            }
        }
        *records = json_incref(recs);
        json_decref(doc);
        return true;
    }
    json_decref(doc);
    return false;
}
