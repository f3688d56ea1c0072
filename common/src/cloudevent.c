/* cloudevent.c — CloudEvents 1.0 structured JSON: build tally events, parse intents.
 *
 * tally_intent_parse is the gate of the intents topic: whatever bytes arrive, it answers
 * with a parsed intent or with one DLQ reason and a sentence naming the problem. The checks
 * run cheapest first (size, UTF-8, JSON, envelope, type, data) so an oversized or binary
 * message is never handed to the JSON parser. */
#include "tally/cloudevent.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "tally/id.h"
#include "tally/json.h"
#include "tally/runops.h"
#include "tally/text.h"

#define EXCERPT_MAX_BYTES 60

static const char *const TYPE_INTENT = "tally.intent.v1";
static const char *const TYPE_COMPENSATE_RUN = "tally.compensate_run.v1";
static const char *const TYPE_CANCEL_RUN = "tally.cancel_run.v1";
static const char *const TYPE_COMPLETE_RUN = "tally.complete_run.v1";

/* ---------------------------------------------------------------------------------------- */
/* Building                                                                                  */

/* RFC 3339 UTC with milliseconds: 2024-05-01T12:34:56.789Z */
static bool rfc3339_now(char out[32])
{
    struct timespec ts;
    struct tm tm;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0 || gmtime_r(&ts.tv_sec, &tm) == NULL)
        return false;
    char base[24];
    if (strftime(base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm) == 0)
        return false;
    int n = snprintf(out, 32, "%s.%03ldZ", base, ts.tv_nsec / 1000000L);
    return n > 0 && n < 32;
}

bool tally_ce_envelope_text(tally_jtext_t *j, const char *type, const char *source,
                            const char *subject, char id_out[37])
{
    char time_text[32];
    tally_uuid(id_out);
    if (!rfc3339_now(time_text)) {
        j->failed = true;
        return false;
    }
    return tally_ce_envelope_text_at(j, type, source, subject, id_out, time_text);
}

bool tally_ce_envelope_text_at(tally_jtext_t *j, const char *type, const char *source,
                               const char *subject, const char *id, const char *time)
{
    tally_jtext_str(j, "specversion", "1.0");
    tally_jtext_str(j, "id", id);
    tally_jtext_str(j, "source", source);
    tally_jtext_str(j, "type", type);
    tally_jtext_str(j, "time", time);
    tally_jtext_str(j, "datacontenttype", "application/json");
    if (subject != NULL)
        tally_jtext_str(j, "subject", subject);
    return !j->failed;
}

char *tally_ce_effect_text(const tally_effect_event_t *e, char id_out[37])
{
    char type[96];
    char lower[40];
    size_t i = 0;
    for (; e->status[i] && i < sizeof lower - 1; i++)
        lower[i] = (char)tolower((unsigned char)e->status[i]);
    lower[i] = '\0';
    snprintf(type, sizeof type, "tally.effect.%s.v1", lower);

    tally_jtext_t j = {0};
    tally_jtext_begin(&j, NULL);
    char now[32];
    if (e->id != NULL) {
        tally_text_copy(id_out, 37, e->id);
        if (e->time == NULL && !rfc3339_now(now))
            j.failed = true;
        tally_ce_envelope_text_at(&j, type, e->source, e->effect_id, e->id,
                                  e->time != NULL ? e->time : now);
    } else {
        tally_ce_envelope_text(&j, type, e->source, e->effect_id, id_out);
    }
    tally_jtext_begin(&j, "data");
    tally_jtext_str(&j, "effect_id", e->effect_id);
    tally_jtext_str(&j, "run_id", e->run_id);
    tally_step_jtext(&j, "step", e->step, e->step_is_number);
    tally_jtext_str(&j, "tool", e->tool);
    tally_jtext_str(&j, "operation_key", e->operation_key);
    tally_jtext_str(&j, "status", e->status);
    if (e->receipt_text)
        tally_jtext_raw(&j, "receipt", e->receipt_text);
    else
        tally_jtext_value(&j, "receipt", e->receipt);
    tally_jtext_str(&j, "external_ref", e->external_ref);
    if (e->error_code) {
        tally_jtext_begin(&j, "error");
        tally_jtext_str(&j, "code", e->error_code);
        tally_jtext_str(&j, "message", e->error_message ? e->error_message : "");
        tally_jtext_end(&j);
    } else {
        tally_jtext_raw(&j, "error", NULL);
    }
    tally_jtext_int(&j, "attempts", e->attempts);
    tally_jtext_str(&j, "intent_id", e->intent_id);
    const char *key;
    json_t *value;
    json_object_foreach((json_t *)e->extra, key, value)
    {
        tally_jtext_value(&j, key, value);
    }
    tally_jtext_end(&j); /* data */
    tally_jtext_end(&j); /* the event */
    return tally_jtext_take(&j);
}

json_t *tally_ce_new(const char *type, const char *source, const char *subject, json_t *data,
                     char id_out[37])
{
    if (type == NULL || source == NULL || data == NULL) {
        json_decref(data);
        return NULL;
    }
    char id[37];
    char time_text[32];
    tally_uuid(id);
    if (!rfc3339_now(time_text)) {
        json_decref(data);
        return NULL;
    }

    json_t *ev = json_object();
    if (ev == NULL) {
        json_decref(data);
        return NULL;
    }
    /* json_string returns NULL for invalid UTF-8 and json_object_set_new then fails: every
     * error, including an out-of-memory one, lands in the one check below. */
    int rc = 0;
    rc |= json_object_set_new(ev, "specversion", json_string("1.0"));
    rc |= json_object_set_new(ev, "id", json_string(id));
    rc |= json_object_set_new(ev, "source", json_string(source));
    rc |= json_object_set_new(ev, "type", json_string(type));
    rc |= json_object_set_new(ev, "time", json_string(time_text));
    rc |= json_object_set_new(ev, "datacontenttype", json_string("application/json"));
    if (subject != NULL)
        rc |= json_object_set_new(ev, "subject", json_string(subject));
    rc |= json_object_set_new(ev, "data", data); /* steals data, even on failure */
    if (rc != 0) {
        json_decref(ev);
        return NULL;
    }
    if (id_out != NULL)
        memcpy(id_out, id, sizeof id);
    return ev;
}

/* ---------------------------------------------------------------------------------------- */
/* Bounding                                                                                  */

static size_t dumped_size(const json_t *v)
{
    return json_dumpb(v, NULL, 0, JSON_COMPACT | JSON_ENCODE_ANY);
}

/* Note in @p cut that @p path was cut, saying how. */
static void note_cut(json_t *cut, const char *path, const char *how)
{
    char line[160]; /* 20 lines of these, and the rest of the note, fit its 4096-byte reserve */
    tally_fmt(line, sizeof line, "%s: %s", path, how);
    json_array_append_new(cut, json_string(line));
}

/* Make the member @p key of @p parent (an object) take at most @p target bytes when dumped:
 * an object by its largest members first, an array by its last elements, a string by its
 * end; anything else (or what cannot be cut that far) becomes null. */
static void shrink(json_t *parent, const char *key, const char *path, size_t target, json_t *cut)
{
    json_t *v = json_object_get(parent, key);
    size_t size = dumped_size(v);
    if (size <= target)
        return;
    if (json_is_string(v) && target > 8) {
        const char *s = json_string_value(v);
        size_t len = json_string_length(v);
        /* escapes make the dump longer than the text: cut by what is over, then check */
        size_t keep = len > size - target + 8 ? len - (size - target + 8) : 0;
        for (;;) {
            keep = tally_utf8_prefix(s, len, keep);
            char *t = malloc(keep + 4);
            if (t == NULL)
                break;
            memcpy(t, s, keep);
            memcpy(t + keep, "...", 4);
            json_t *nv = json_string(t);
            free(t);
            if (nv == NULL)
                break;
            if (dumped_size(nv) <= target || keep == 0) {
                char how[64];
                snprintf(how, sizeof how, "%zu of %zu bytes", keep, len);
                json_object_set_new(parent, key, nv);
                note_cut(cut, path, how);
                return;
            }
            json_decref(nv);
            keep = keep > 64 ? keep - keep / 8 : 0;
        }
    } else if (json_is_array(v) && target > 2) {
        size_t n = json_array_size(v);
        while (json_array_size(v) > 0 && dumped_size(v) > target)
            json_array_remove(v, json_array_size(v) - 1);
        char how[64];
        snprintf(how, sizeof how, "%zu of %zu items", json_array_size(v), n);
        note_cut(cut, path, how);
        return;
    } else if (json_is_object(v) && target > 2) {
        for (int round = 0; round < 64 && dumped_size(v) > target; round++) {
            const char *k, *big = NULL;
            json_t *m;
            size_t big_size = 0;
            json_object_foreach(v, k, m)
            {
                size_t s = dumped_size(m);
                if (s > big_size) {
                    big_size = s;
                    big = k;
                }
            }
            if (big == NULL || big_size <= 4)
                break;
            size_t over = dumped_size(v) - target;
            char sub[256];
            tally_fmt(sub, sizeof sub, "%s.%s", path, big);
            char *bkey = strdup(big);
            if (bkey == NULL)
                break;
            shrink(v, bkey, sub, big_size > over + 4 ? big_size - over : 4, cut);
            free(bkey);
        }
        if (dumped_size(v) <= target)
            return;
    }
    json_object_set_new(parent, key, json_null());
    note_cut(cut, path, "omitted");
}

char *tally_ce_bounded(const char *payload, size_t limit)
{
    json_t *ev = json_loads(payload, TALLY_JSON_LOAD_FLAGS, NULL);
    if (!json_is_object(ev)) {
        json_decref(ev);
        return NULL;
    }
    size_t original = strlen(payload);
    json_t *data = json_object_get(ev, "data");
    json_t *cut = json_array();
    /* An event cut before (the relay cuts again for a smaller producer limit): the note
     * keeps the first size and cuts, and is written anew below. */
    json_t *before = json_object_get(data, "truncated");
    if (json_is_object(before)) {
        json_t *n = json_object_get(before, "original_bytes");
        if (json_is_integer(n) && (size_t)json_integer_value(n) > original)
            original = (size_t)json_integer_value(n);
        if (json_is_array(json_object_get(before, "cut")))
            json_array_extend(cut, json_object_get(before, "cut"));
        json_object_del(data, "truncated");
    }
    /* the run names where the whole is shown (an effect event's subject is its effect) */
    const char *run = json_string_value(json_object_get(data, "run_id"));
    if (run == NULL)
        run = json_string_value(json_object_get(ev, "subject"));
    const char *type = json_string_value(json_object_get(ev, "type"));
    char full[320];
    if (run == NULL)
        snprintf(full, sizeof full, "tally doctor");
    else
        tally_fmt(full, sizeof full, "tally %s --run '%s'",
                  type != NULL && strncmp(type, "tally.run.", 10) == 0 ? "summary" : "doctor", run);
    json_t *note = json_pack("{s:I, s:O, s:s}", "original_bytes", (json_int_t)original, "cut", cut,
                             "full", full);
    json_decref(cut);
    char *out = NULL;
    if (note != NULL && json_is_object(data)) {
        /* room for the note, which grows as it lists the cuts */
        size_t reserve = 4096;
        size_t envelope = dumped_size(ev) - dumped_size(data);
        size_t target = limit > envelope + reserve ? limit - envelope - reserve : 2;
        json_t *holder = json_object(); /* shrink cuts a member of an object */
        json_object_set_new(holder, "d", json_incref(data));
        json_object_set_new(ev, "data", holder); /* data lives on in holder */
        shrink(holder, "d", "data", target, json_object_get(note, "cut"));
        json_t *d = json_incref(json_object_get(holder, "d"));
        /* the first 20 cuts are enough to say what happened */
        json_t *c = json_object_get(note, "cut");
        while (json_array_size(c) > 20)
            json_array_remove(c, 20);
        if (json_is_object(d)) {
            json_object_set(d, "truncated", note);
            json_object_set(ev, "data", d);
        } else {
            json_object_set_new(ev, "data", json_pack("{s:O}", "truncated", note));
        }
        json_decref(d);
        out = json_dumps(ev, JSON_COMPACT);
        if (out != NULL && strlen(out) > limit) {
            /* the note itself did not fit: without its list of cuts, then give up */
            free(out);
            json_array_clear(c);
            out = json_dumps(ev, JSON_COMPACT);
            if (out != NULL && strlen(out) > limit) {
                free(out);
                out = NULL;
            }
        }
    }
    json_decref(note);
    json_decref(ev);
    return out;
}

/* ---------------------------------------------------------------------------------------- */
/* Reasons                                                                                   */

const char *tally_dlq_reason_name(tally_dlq_reason_t r)
{
    switch (r) {
    case TALLY_DLQ_NONE:
        return "none";
    case TALLY_DLQ_TOO_LARGE:
        return "too_large";
    case TALLY_DLQ_INVALID_UTF8:
        return "invalid_utf8";
    case TALLY_DLQ_NOT_JSON:
        return "not_json";
    case TALLY_DLQ_NOT_CLOUDEVENT:
        return "not_cloudevent";
    case TALLY_DLQ_UNKNOWN_TYPE:
        return "unknown_type";
    case TALLY_DLQ_MISSING_FIELD:
        return "missing_field";
    case TALLY_DLQ_INVALID_FIELD:
        return "invalid_field";
    case TALLY_DLQ_UNKNOWN_TOOL:
        return "unknown_tool";
    case TALLY_DLQ_MISSING_OPERATION_KEY:
        return "missing_operation_key";
    case TALLY_DLQ_LEDGER_REFUSED:
        return "ledger_refused";
    case TALLY_DLQ_INVALID_REPLY_TO:
        return "invalid_reply_to";
    case TALLY_DLQ_RUN_NOT_ACTIVE:
        return "run_not_active";
    }
    return "unknown";
}

/* ---------------------------------------------------------------------------------------- */
/* Parsing helpers                                                                           */

static void set_detail(char *detail, size_t detailsz, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_detail(char *detail, size_t detailsz, const char *fmt, ...)
{
    if (detail == NULL || detailsz == 0)
        return;
    /* The detail goes into DLQ records and logs as a JSON string: valid UTF-8, cut on a
     * character boundary (text.h). */
    va_list ap;
    va_start(ap, fmt);
    tally_vfmt(detail, detailsz, fmt, ap);
    va_end(ap);
}

/* A short, printable excerpt of a value from the message, for quoting in a detail sentence:
 * at most EXCERPT_MAX_BYTES, cut on a character boundary, control characters as '?'. */
static void excerpt(const char *s, char out[EXCERPT_MAX_BYTES + 4])
{
    const unsigned char *u = (const unsigned char *)s;
    size_t len = strlen(s);
    size_t i = 0, o = 0;
    while (i < len) {
        size_t n = tally_utf8_seq(u + i, len - i);
        if (n == 0 || o + n > EXCERPT_MAX_BYTES)
            break;
        if (n == 1 && (u[i] < 0x20 || u[i] == 0x7F)) {
            out[o++] = '?';
        } else {
            memcpy(out + o, s + i, n);
            o += n;
        }
        i += n;
    }
    if (i < len) {
        memcpy(out + o, "...", 3);
        o += 3;
    }
    out[o] = '\0';
}

static const char *json_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a number with a fraction or exponent";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    case JSON_NULL:
        return "null";
    }
    return "an unknown JSON value";
}

static bool has_control_chars(const char *s, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7F)
            return true;
    }
    return false;
}

static bool all_digits(const char *s)
{
    if (*s == '\0')
        return false;
    for (; *s; s++)
        if (*s < '0' || *s > '9')
            return false;
    return true;
}

/* n lowercase hex digits (W3C trace context requires lowercase), not all zero when
 * @p nonzero. */
static bool hex_field(const char *s, size_t n, bool nonzero)
{
    bool any = false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return false;
        if (c != '0')
            any = true;
    }
    return !nonzero || any;
}

/* W3C Trace Context version 00: 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>. */
static bool traceparent_valid(const char *s)
{
    if (strlen(s) != 55)
        return false;
    return s[0] == '0' && s[1] == '0' && s[2] == '-' && hex_field(s + 3, 32, true) &&
           s[35] == '-' && hex_field(s + 36, 16, true) && s[52] == '-' &&
           hex_field(s + 53, 2, false);
}

/* "application/json", "application/json; charset=utf-8", "application/cloudevents+json":
 * the media type before any parameters is application/json or has the +json suffix. */
static bool media_type_is_json(const char *s)
{
    if (s == NULL)
        return false;
    size_t n = strcspn(s, ";");
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        n--;
    return (n == 16 && strncasecmp(s, "application/json", 16) == 0) ||
           (n > 5 && strncasecmp(s + n - 5, "+json", 5) == 0);
}

/* The outcome of checking one field; the caller turns it into a DLQ reason. */
typedef struct check {
    tally_dlq_reason_t reason;
    char *detail;
    size_t detailsz;
} check_t;

/* data.<name> as a string. Required: absent is MISSING_FIELD. Optional: absent or null gives
 * NULL with ck->reason left alone. A present value of the wrong type or shape is
 * INVALID_FIELD. @p rule says what a valid value is, for the sentence. */
static const char *data_string(const json_t *data, const char *name, bool required, bool nonempty,
                               size_t max_bytes, bool no_control, const char *rule, check_t *ck)
{
    json_t *v = json_object_get(data, name);
    if (v == NULL || (!required && json_is_null(v))) {
        if (required) {
            ck->reason = TALLY_DLQ_MISSING_FIELD;
            set_detail(ck->detail, ck->detailsz, "data.%s is missing; it must be %s", name, rule);
        }
        return NULL;
    }
    if (!json_is_string(v)) {
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        set_detail(ck->detail, ck->detailsz, "data.%s must be %s, not %s", name, rule,
                   json_type_name(v));
        return NULL;
    }
    const char *s = json_string_value(v);
    size_t len = json_string_length(v);
    /* Without JSON_ALLOW_NUL jansson refuses \u0000, so s has no embedded NUL; the check
     * stays in case the flags ever change, because callers use these as C strings. */
    if (strlen(s) != len) {
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        set_detail(ck->detail, ck->detailsz, "data.%s must be %s; it contains a NUL character",
                   name, rule);
        return NULL;
    }
    if (nonempty && len == 0) {
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        set_detail(ck->detail, ck->detailsz, "data.%s must be %s; it is empty", name, rule);
        return NULL;
    }
    if (max_bytes > 0 && len > max_bytes) {
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        set_detail(ck->detail, ck->detailsz, "data.%s must be %s; it is %zu bytes long", name, rule,
                   len);
        return NULL;
    }
    if (no_control && has_control_chars(s, len)) {
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        set_detail(ck->detail, ck->detailsz, "data.%s must be %s; it contains a control character",
                   name, rule);
        return NULL;
    }
    return s;
}

/* A CloudEvents attribute that must be a non-empty string. */
static const char *ce_attribute(const json_t *doc, const char *name, check_t *ck)
{
    json_t *v = json_object_get(doc, name);
    if (v == NULL) {
        ck->reason = TALLY_DLQ_NOT_CLOUDEVENT;
        set_detail(ck->detail, ck->detailsz,
                   "the CloudEvents attribute %s is missing (a CloudEvents 1.0 message needs "
                   "specversion, id, source and type)",
                   name);
        return NULL;
    }
    if (!json_is_string(v)) {
        ck->reason = TALLY_DLQ_NOT_CLOUDEVENT;
        set_detail(ck->detail, ck->detailsz,
                   "the CloudEvents attribute %s must be a string, not %s", name,
                   json_type_name(v));
        return NULL;
    }
    if (json_string_length(v) == 0) {
        ck->reason = TALLY_DLQ_NOT_CLOUDEVENT;
        set_detail(ck->detail, ck->detailsz,
                   "the CloudEvents attribute %s must be a non-empty string", name);
        return NULL;
    }
    return json_string_value(v);
}

static bool parse_step(const json_t *data, tally_intent_t *out, check_t *ck)
{
    static const char rule[] =
        "a string or a non-negative integer (a string of 1 to 100 bytes without control "
        "characters)";
    json_t *v = json_object_get(data, "step");
    if (v == NULL) {
        ck->reason = TALLY_DLQ_MISSING_FIELD;
        set_detail(ck->detail, ck->detailsz, "data.step is missing; it must be %s", rule);
        return false;
    }
    if (json_is_integer(v)) {
        json_int_t n = json_integer_value(v);
        if (n < 0) {
            ck->reason = TALLY_DLQ_INVALID_FIELD;
            set_detail(
                ck->detail, ck->detailsz,
                "data.step must be a string or a non-negative integer, not %" JSON_INTEGER_FORMAT,
                n);
            return false;
        }
        snprintf(out->step, sizeof out->step, "%" JSON_INTEGER_FORMAT, n);
        out->step_is_number = out->step_is_digits = true;
        return true;
    }
    if (!json_is_string(v)) {
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        set_detail(ck->detail, ck->detailsz,
                   "data.step must be a string or a non-negative integer, not %s",
                   json_type_name(v));
        return false;
    }
    const char *s = data_string(data, "step", true, true, TALLY_LIMIT_STEP, true, rule, ck);
    if (s == NULL)
        return false;
    memcpy(out->step, s, strlen(s) + 1); /* ≤ 100 bytes: fits step[128] */
    out->step_is_number = false;         /* echoed as the string it is, "03" as "03" */
    out->step_is_digits = all_digits(s);
    return true;
}

static bool parse_intent_data(const json_t *data, tally_intent_t *out, check_t *ck)
{
    out->run_id = data_string(data, "run_id", true, true, TALLY_LIMIT_RUN_ID, true,
                              "a non-empty string of at most 200 bytes without control "
                              "characters",
                              ck);
    if (out->run_id == NULL)
        return false;
    if (!parse_step(data, out, ck))
        return false;
    out->tool = data_string(data, "tool", true, true, TALLY_LIMIT_TOOL, true,
                            "a non-empty string of at most 200 bytes without control characters "
                            "(a tool name)",
                            ck);
    if (out->tool == NULL)
        return false;

    json_t *args = json_object_get(data, "args");
    if (args == NULL) {
        ck->reason = TALLY_DLQ_MISSING_FIELD;
        set_detail(ck->detail, ck->detailsz,
                   "data.args is missing; it must be a JSON object (the tool's arguments)");
        return false;
    }
    if (!json_is_object(args)) {
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        set_detail(ck->detail, ck->detailsz, "data.args must be a JSON object, not %s",
                   json_type_name(args));
        return false;
    }
    out->args = args;

    /* The operation key travels as the Idempotency-Key header: a CR/LF there would inject
     * headers. */
    out->operation_key =
        data_string(data, "operation_key", false, true, TALLY_LIMIT_OPERATION_KEY, true,
                    "a non-empty string of at most 500 bytes without control characters", ck);
    if (ck->reason != TALLY_DLQ_NONE)
        return false;
    out->tenant = data_string(data, "tenant", false, false, TALLY_LIMIT_TENANT, true,
                              "a string of at most 200 bytes without control characters", ck);
    if (ck->reason != TALLY_DLQ_NONE)
        return false;
    return true;
}

/* compensate_run's optional data.deadline_ms: the run's compensation must be finished within
 * it (runops.h). Absent or null: none. The bounds are the registry's compensation.deadline_ms. */
static bool parse_deadline(const json_t *data, tally_intent_t *out, check_t *ck)
{
    json_t *v = json_object_get(data, "deadline_ms");
    if (v == NULL || json_is_null(v))
        return true;
    json_int_t ms = json_is_integer(v) ? json_integer_value(v) : 0;
    if (!json_is_integer(v) || ms < TALLY_RUNOP_DEADLINE_MS_MIN ||
        ms > TALLY_RUNOP_DEADLINE_MS_MAX) {
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        if (json_is_integer(v))
            set_detail(ck->detail, ck->detailsz,
                       "data.deadline_ms must be an integer from %d to %d (milliseconds), not "
                       "%" JSON_INTEGER_FORMAT,
                       TALLY_RUNOP_DEADLINE_MS_MIN, TALLY_RUNOP_DEADLINE_MS_MAX, ms);
        else
            set_detail(ck->detail, ck->detailsz,
                       "data.deadline_ms must be an integer from %d to %d (milliseconds), not %s",
                       TALLY_RUNOP_DEADLINE_MS_MIN, TALLY_RUNOP_DEADLINE_MS_MAX, json_type_name(v));
        return false;
    }
    out->deadline_ms = (int)ms;
    return true;
}

static bool parse_run_data(const json_t *data, tally_intent_t *out, check_t *ck)
{
    out->run_id = data_string(data, "run_id", true, true, TALLY_LIMIT_RUN_ID, true,
                              "a non-empty string of at most 200 bytes without control "
                              "characters",
                              ck);
    if (out->run_id == NULL)
        return false;
    /* a run is completed for a reason when one is given; compensating and cancelling need one */
    bool need_reason = out->type != TALLY_MSG_COMPLETE_RUN;
    out->reason = data_string(data, "reason", need_reason, false, TALLY_LIMIT_REASON, false,
                              "a string of at most 4096 bytes", ck);
    if (out->reason == NULL && (need_reason || ck->reason != TALLY_DLQ_NONE))
        return false;
    if (out->type == TALLY_MSG_CANCEL_RUN) {
        json_t *c = json_object_get(data, "compensate");
        if (c != NULL && !json_is_null(c)) {
            if (!json_is_boolean(c)) {
                ck->reason = TALLY_DLQ_INVALID_FIELD;
                set_detail(ck->detail, ck->detailsz,
                           "data.compensate must be a boolean (true or false), not %s",
                           json_type_name(c));
                return false;
            }
            out->compensate = json_is_true(c);
        }
    }
    if (out->type == TALLY_MSG_COMPENSATE_RUN && !parse_deadline(data, out, ck))
        return false;
    return true;
}

/* The optional W3C traceparent, accepted on every message type. */
static bool parse_traceparent(const json_t *data, tally_intent_t *out, check_t *ck)
{
    static const char rule[] =
        "a W3C traceparent: 00-<32 lowercase hex, not all zero>-<16 lowercase hex, not all "
        "zero>-<2 hex flags>";
    out->traceparent = data_string(data, "traceparent", false, true, 0, false, rule, ck);
    if (ck->reason != TALLY_DLQ_NONE)
        return false;
    if (out->traceparent != NULL && !traceparent_valid(out->traceparent)) {
        char ex[EXCERPT_MAX_BYTES + 4];
        excerpt(out->traceparent, ex);
        ck->reason = TALLY_DLQ_INVALID_FIELD;
        set_detail(ck->detail, ck->detailsz, "data.traceparent must be %s; got \"%s\"", rule, ex);
        out->traceparent = NULL;
        return false;
    }
    return true;
}

/* The first number in the JSON text @p s[0..len) that is not zero as written but reads as 0
 * (1e-400): jansson would silently turn it into 0.0, and a tool would be called with a value
 * the agent did not send. Returns its offset, or len when there is none. @p s is JSON that
 * jansson has loaded, so outside strings a number starts with '-' or a digit. */
static size_t underflowing_number(const char *s, size_t len, size_t *toklen)
{
    size_t i = 0;
    while (i < len) {
        char c = s[i];
        if (c == '"') {
            for (i++; i < len && s[i] != '"'; i++)
                if (s[i] == '\\')
                    i++;
            i++;
            continue;
        }
        if (c != '-' && (c < '0' || c > '9')) {
            i++;
            continue;
        }
        size_t start = i;
        bool nonzero = false, exponent = false, point = false;
        size_t zeros = 0; /* after the point, before the first nonzero digit */
        while (i < len && (s[i] == '-' || s[i] == '+' || s[i] == '.' || s[i] == 'e' ||
                           s[i] == 'E' || (s[i] >= '0' && s[i] <= '9'))) {
            if (s[i] == 'e' || s[i] == 'E')
                exponent = true;
            else if (s[i] == '.')
                point = true;
            else if (!exponent && s[i] >= '1' && s[i] <= '9')
                nonzero = true;
            else if (!exponent && point && !nonzero && s[i] == '0')
                zeros++;
            i++;
        }
        /* Integers never underflow; a plain decimal only with hundreds of zeros after its
         * point (a double's smallest is about 4.9e-324); an exponent may always. */
        if (!nonzero || (!exponent && zeros < 300))
            continue;
        char *num = strndup(s + start, i - start);
        bool zero = num != NULL && strtod(num, NULL) == 0.0;
        free(num);
        if (zero) {
            *toklen = i - start;
            return start;
        }
    }
    return len;
}

/* ---------------------------------------------------------------------------------------- */
/* Parsing                                                                                   */

static tally_dlq_reason_t parse_doc(json_t *doc, tally_intent_t *out, check_t *ck)
{
    const char *specversion = ce_attribute(doc, "specversion", ck);
    if (specversion == NULL)
        return ck->reason;
    if (strcmp(specversion, "1.0") != 0) {
        char ex[EXCERPT_MAX_BYTES + 4];
        excerpt(specversion, ex);
        set_detail(ck->detail, ck->detailsz,
                   "the CloudEvents specversion is \"%s\"; tally accepts \"1.0\"", ex);
        return ck->reason = TALLY_DLQ_NOT_CLOUDEVENT;
    }
    out->id = ce_attribute(doc, "id", ck);
    if (out->id == NULL)
        return ck->reason;
    if (strlen(out->id) > TALLY_LIMIT_EVENT_ID) {
        /* The id names the intent in every answer and in the ledger. */
        set_detail(ck->detail, ck->detailsz,
                   "the CloudEvents id must be at most %d bytes; it is %zu bytes long",
                   TALLY_LIMIT_EVENT_ID, strlen(out->id));
        out->id = NULL;
        return ck->reason = TALLY_DLQ_INVALID_FIELD;
    }
    if (ce_attribute(doc, "source", ck) == NULL)
        return ck->reason;
    const char *type = ce_attribute(doc, "type", ck);
    if (type == NULL)
        return ck->reason;

    if (strcmp(type, TYPE_INTENT) == 0) {
        out->type = TALLY_MSG_INTENT;
    } else if (strcmp(type, TYPE_COMPENSATE_RUN) == 0) {
        out->type = TALLY_MSG_COMPENSATE_RUN;
    } else if (strcmp(type, TYPE_CANCEL_RUN) == 0) {
        out->type = TALLY_MSG_CANCEL_RUN;
    } else if (strcmp(type, TYPE_COMPLETE_RUN) == 0) {
        out->type = TALLY_MSG_COMPLETE_RUN;
    } else {
        char ex[EXCERPT_MAX_BYTES + 4];
        excerpt(type, ex);
        set_detail(ck->detail, ck->detailsz,
                   "the CloudEvents type \"%s\" is not one tally accepts on the intents topic "
                   "(%s, %s, %s, %s)",
                   ex, TYPE_INTENT, TYPE_COMPENSATE_RUN, TYPE_CANCEL_RUN, TYPE_COMPLETE_RUN);
        return ck->reason = TALLY_DLQ_UNKNOWN_TYPE;
    }

    /* Structured mode: data is inline JSON. A different datacontenttype means the producer
     * meant something other than what tally reads. */
    json_t *dct = json_object_get(doc, "datacontenttype");
    if (dct != NULL && !media_type_is_json(json_string_value(dct))) {
        char ex[EXCERPT_MAX_BYTES + 4];
        excerpt(json_is_string(dct) ? json_string_value(dct) : json_type_name(dct), ex);
        set_detail(ck->detail, ck->detailsz,
                   "datacontenttype must be \"application/json\" (or another JSON media type), "
                   "not %s%s%s",
                   json_is_string(dct) ? "\"" : "", ex, json_is_string(dct) ? "\"" : "");
        return ck->reason = TALLY_DLQ_INVALID_FIELD;
    }

    json_t *data = json_object_get(doc, "data");
    if (data == NULL) {
        set_detail(
            ck->detail, ck->detailsz, "data is missing; %s needs a JSON object in data%s", type,
            json_object_get(doc, "data_base64") != NULL ? " (data_base64 is not accepted)" : "");
        return ck->reason = TALLY_DLQ_MISSING_FIELD;
    }
    if (!json_is_object(data)) {
        set_detail(ck->detail, ck->detailsz, "data must be a JSON object, not %s",
                   json_type_name(data));
        return ck->reason = TALLY_DLQ_INVALID_FIELD;
    }

    bool ok = out->type == TALLY_MSG_INTENT ? parse_intent_data(data, out, ck)
                                            : parse_run_data(data, out, ck);
    if (ok)
        ok = parse_traceparent(data, out, ck);
    return ok ? TALLY_DLQ_NONE : ck->reason;
}

tally_dlq_reason_t tally_intent_parse(const void *buf, size_t len, size_t max_bytes,
                                      tally_intent_t *out, char *detail, size_t detailsz)
{
    memset(out, 0, sizeof *out);
    if (detail != NULL && detailsz > 0)
        detail[0] = '\0';
    if (buf == NULL)
        buf = "";
    check_t ck = {TALLY_DLQ_NONE, detail, detailsz};

    if (len > max_bytes) {
        set_detail(detail, detailsz,
                   "the message is %zu bytes, above the limit of %zu bytes "
                   "(TALLY_MAX_MESSAGE_BYTES)",
                   len, max_bytes);
        return TALLY_DLQ_TOO_LARGE;
    }
    if (!tally_utf8_valid(buf, len)) {
        /* Point at the first bad byte so the producer can find it. */
        size_t off = 0;
        while (off < len) {
            size_t n = tally_utf8_seq((const unsigned char *)buf + off, len - off);
            if (n == 0)
                break;
            off += n;
        }
        set_detail(detail, detailsz,
                   "the message is not valid UTF-8 (first bad byte 0x%02X at offset %zu)",
                   off < len ? ((const unsigned char *)buf)[off] : 0u, off);
        return TALLY_DLQ_INVALID_UTF8;
    }

    json_error_t jerr;
    json_t *doc = json_loadb(buf, len, TALLY_JSON_LOAD_FLAGS, &jerr);
    if (doc == NULL) {
        set_detail(detail, detailsz, "the message is not JSON: %s (line %d, column %d)", jerr.text,
                   jerr.line, jerr.column);
        return TALLY_DLQ_NOT_JSON;
    }
    if (!json_is_object(doc)) {
        set_detail(detail, detailsz, "the message is %s, not a JSON object", json_type_name(doc));
        json_decref(doc);
        return TALLY_DLQ_NOT_JSON;
    }

    tally_dlq_reason_t r = parse_doc(doc, out, &ck);
    size_t toklen = 0, at = r == TALLY_DLQ_NONE ? underflowing_number(buf, len, &toklen) : len;
    if (at < len) {
        char num[EXCERPT_MAX_BYTES + 4];
        memcpy(num, (const char *)buf + at,
               toklen < EXCERPT_MAX_BYTES ? toklen : EXCERPT_MAX_BYTES);
        num[toklen < EXCERPT_MAX_BYTES ? toklen : EXCERPT_MAX_BYTES] = '\0';
        set_detail(detail, detailsz,
                   "the number %s%s at offset %zu is too small for a double and would be read as "
                   "0; send it as a string or as 0",
                   num, toklen > EXCERPT_MAX_BYTES ? "..." : "", at);
        r = TALLY_DLQ_INVALID_FIELD;
    }
    if (r != TALLY_DLQ_NONE) {
        json_decref(doc);
        memset(out, 0, sizeof *out);
        return r;
    }
    out->doc = doc;
    return TALLY_DLQ_NONE;
}

/* A string of 1..@p max bytes without control characters, or NULL. */
static const char *plain_string(const json_t *v, size_t max)
{
    const char *s = json_string_value(v);
    size_t n = s != NULL ? json_string_length(v) : 0;
    if (s == NULL || n == 0 || n > max || strlen(s) != n || has_control_chars(s, n))
        return NULL;
    return s;
}

bool tally_intent_peek(const void *buf, size_t len, tally_intent_peek_t *out)
{
    memset(out, 0, sizeof *out);
    if (buf == NULL || len > TALLY_PEEK_MAX_BYTES || !tally_utf8_valid(buf, len))
        return false;
    json_t *doc = json_loadb(buf, len, TALLY_JSON_LOAD_FLAGS, NULL);
    json_t *data = json_object_get(doc, "data");
    out->id = plain_string(json_object_get(doc, "id"), TALLY_LIMIT_EVENT_ID);
    out->run_id = plain_string(json_object_get(data, "run_id"), TALLY_LIMIT_RUN_ID);
    if (!json_is_object(doc) || out->id == NULL || out->run_id == NULL) {
        json_decref(doc);
        memset(out, 0, sizeof *out);
        return false;
    }
    out->doc = doc;
    out->type = plain_string(json_object_get(doc, "type"), TALLY_LIMIT_EVENT_ID);
    out->tool = plain_string(json_object_get(data, "tool"), TALLY_LIMIT_TOOL);
    json_t *step = json_object_get(data, "step");
    if (json_is_integer(step) || plain_string(step, TALLY_LIMIT_STEP) != NULL)
        out->step = step;
    return true;
}

void tally_intent_peek_clear(tally_intent_peek_t *p)
{
    if (p == NULL)
        return;
    json_decref(p->doc);
    memset(p, 0, sizeof *p);
}

void tally_intent_clear(tally_intent_t *in)
{
    if (in == NULL)
        return;
    json_decref(in->doc);
    memset(in, 0, sizeof *in);
}

json_t *tally_step_json(const char *step, bool is_number)
{
    if (step == NULL)
        return json_null();
    if (is_number) {
        char *end = NULL;
        errno = 0;
        long long n = strtoll(step, &end, 10);
        if (errno == 0 && end != step && *end == '\0')
            return json_integer((json_int_t)n);
    }
    return json_string(step);
}

void tally_step_jtext(tally_jtext_t *j, const char *key, const char *step, bool is_number)
{
    if (step != NULL && is_number) {
        char *end = NULL;
        errno = 0;
        long long n = strtoll(step, &end, 10);
        if (errno == 0 && end != step && *end == '\0') {
            tally_jtext_int(j, key, n);
            return;
        }
    }
    tally_jtext_str(j, key, step != NULL ? step : "");
}
