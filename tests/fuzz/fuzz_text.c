/* fuzz_text.c — the text builders of text.h, the JSON text builder of json.h, CloudEvents
 * envelopes (cloudevent.h) and the alert commands (alert.h), on fuzzed strings.
 *
 * Input: byte 0 picks a buffer size (SIZES, or a size of its own), byte 1 a second number
 * (the tally_text_dup maximum, decimals), then up to four strings separated by 0xFF (a byte
 * no UTF-8 text holds). Invariants:
 *   - text.h: every output is NUL-terminated within its buffer and valid UTF-8; tally_vfmt
 *     writes what tally_text_copy writes of the whole formatted text; a copy is the input made
 *     valid (each malformed byte '?'), whole when it fits, else a prefix of it cut on a
 *     character boundary and "..."; tally_utf8_prefix is the longest prefix within the
 *     maximum that ends on a character boundary; tally_utf8_seq agrees with tally_utf8_valid;
 *   - tally_jtext_*: the text loads with jansson to what was put in, or is NULL exactly when a
 *     string was not UTF-8 (or tally_jtext_strn held a NUL);
 *   - tally_ce_new and tally_ce_envelope_text: for UTF-8 strings, an event whose JSON text is
 *     valid UTF-8 and holds them; NULL (not a crash) otherwise;
 *   - the alert commands of valid UTF-8 ids are valid UTF-8 and quote the id. */
#include "fuzz.h"

#include <math.h>

#include "tally/alert.h"
#include "tally/cloudevent.h"
#include "tally/text.h"

/* The buffer sizes of the code: error codes and messages (tally_error_t), a detail
 * (intake_msg_t), excerpts (60 + "..." + NUL), the stack buffer of tally_vfmt (1024), limits. */
static const size_t SIZES[] = {1,   2,   3,   4,   5,   6,    7,    8,    9,    10,   16,  32,
                               33,  60,  61,  62,  63,  64,   100,  101,  128,  200,  201, 256,
                               500, 501, 512, 513, 768, 1023, 1024, 1025, 4096, 4097, 4100};
#define N_SIZES (sizeof SIZES / sizeof SIZES[0])
#define N_PARTS 4

/* @p s made valid as text.h says: each byte that does not start a well-formed sequence is '?'.
 * Malloc'd; *@p len receives its length. */
static char *made_valid(const char *s, size_t *len)
{
    size_t n = strlen(s), o = 0;
    char *out = malloc(n + 1);
    FUZZ_CHECK(out != NULL, "out of memory");
    for (size_t i = 0; i < n;) {
        size_t k = tally_utf8_seq((const unsigned char *)s + i, n - i);
        /* tally_utf8_seq (text.c) against tally_utf8_valid (json.c): the same table */
        if (k == 0) {
            for (size_t m = 1; m <= 4 && m <= n - i; m++)
                FUZZ_CHECK(!tally_utf8_valid(s + i, m),
                           "tally_utf8_seq refuses %zu bytes at %zu that are UTF-8", m, i);
            out[o++] = '?';
            i++;
        } else {
            FUZZ_CHECK(tally_utf8_valid(s + i, k), "tally_utf8_seq takes %zu bytes at %zu", k, i);
            memcpy(out + o, s + i, k);
            o += k;
            i += k;
        }
    }
    out[o] = '\0';
    *len = o;
    return out;
}

/* A copy of @p s into @p outsz bytes, as tally_text_copy documents it. */
static void check_copy(const char *what, const char *out, size_t outsz, bool whole, const char *s)
{
    size_t len = fuzz_check_text(what, out, outsz);
    FUZZ_CHECK(len < outsz, "%s: %zu bytes in a buffer of %zu", what, len, outsz);
    size_t vlen;
    char *valid = made_valid(s, &vlen);
    bool is_valid = strcmp(valid, s) == 0;
    if (vlen < outsz) {
        FUZZ_CHECK(strcmp(out, valid) == 0, "%s: \"%s\" of \"%s\", which fits", what, out, valid);
        FUZZ_CHECK(whole == is_valid, "%s: whole %d for a copy that fits", what, whole);
    } else {
        FUZZ_CHECK(!whole, "%s: whole, but cut", what);
        size_t keep = len;
        if (outsz > 4) {
            FUZZ_CHECK(len >= 3 && memcmp(out + len - 3, "...", 3) == 0,
                       "%s: cut without \"...\": \"%s\"", what, out);
            keep = len - 3;
        }
        FUZZ_CHECK(memcmp(out, valid, keep) == 0, "%s: \"%s\" is not a prefix of \"%s\"", what, out,
                   valid);
        FUZZ_CHECK(tally_utf8_seq((const unsigned char *)valid + keep, vlen - keep) != 0,
                   "%s: cut inside a character at %zu", what, keep);
        /* the longest prefix that fits: at most 3 bytes of a character left out */
        FUZZ_CHECK(outsz <= 4 || keep + 3 + 4 >= outsz, "%s: cut at %zu of %zu bytes", what, keep,
                   outsz);
    }
    free(valid);
}

static void check_text_h(const char *s, const char *s2, size_t outsz, size_t max)
{
    char *out = malloc(outsz); /* exactly outsz: ASan sees a write past it */
    char *out2 = malloc(outsz);
    FUZZ_CHECK(out != NULL && out2 != NULL, "out of memory");

    bool whole = tally_text_copy(out, outsz, s);
    check_copy("tally_text_copy", out, outsz, whole, s);

    /* tally_fmt: the copy of the whole formatted text, whatever its length (the 1024-byte stack
     * buffer of tally_vfmt or the malloc'd one). */
    int n = snprintf(NULL, 0, "<%s|%d|%s>", s, (int)max, s2);
    FUZZ_CHECK(n >= 0, "snprintf failed");
    char *full = malloc((size_t)n + 1);
    FUZZ_CHECK(full != NULL, "out of memory");
    snprintf(full, (size_t)n + 1, "<%s|%d|%s>", s, (int)max, s2);
    whole = tally_fmt(out, outsz, "<%s|%d|%s>", s, (int)max, s2);
    bool whole2 = tally_text_copy(out2, outsz, full);
    FUZZ_CHECK(whole == whole2 && strcmp(out, out2) == 0,
               "tally_fmt wrote \"%s\" (%d), tally_text_copy \"%s\" (%d)", out, whole, out2,
               whole2);
    check_copy("tally_fmt", out, outsz, whole, full);
    free(full);

    char *dup = tally_text_dup(s, max);
    FUZZ_CHECK(dup != NULL, "tally_text_dup returned NULL");
    size_t dup_len = fuzz_check_str("tally_text_dup", dup);
    FUZZ_CHECK(dup_len <= max, "tally_text_dup: %zu bytes, maximum %zu", dup_len, max);
    char *copy = malloc(max + 1);
    FUZZ_CHECK(copy != NULL, "out of memory");
    tally_text_copy(copy, max + 1, s);
    FUZZ_CHECK(strcmp(dup, copy) == 0, "tally_text_dup \"%s\", tally_text_copy \"%s\"", dup, copy);
    free(copy);
    free(dup);

    size_t len = strlen(s);
    size_t p = tally_utf8_prefix(s, len, max);
    FUZZ_CHECK(p <= len && p <= max, "tally_utf8_prefix %zu of %zu, maximum %zu", p, len, max);
    if (len <= max)
        FUZZ_CHECK(p == len, "tally_utf8_prefix cut %zu bytes that fit", len);
    if (tally_utf8_valid(s, len)) {
        FUZZ_CHECK(tally_utf8_valid(s, p), "tally_utf8_prefix %zu cuts a character", p);
        FUZZ_CHECK(p + 3 >= (len < max ? len : max), "tally_utf8_prefix %zu of %zu, maximum %zu", p,
                   len, max);
    }

    free(out);
    free(out2);
}

/* tally_jtext_*: members of every kind, one nested object; the text against the same object
 * built with jansson. */
static void check_jtext(char *const parts[N_PARTS], const size_t part_len[N_PARTS], int num)
{
    const char *key = parts[0], *s = parts[1];
    bool utf8 = tally_utf8_valid(key, strlen(key)) && tally_utf8_valid(s, strlen(s));
    bool strn_ok =
        tally_utf8_valid(parts[2], part_len[2]) && memchr(parts[2], '\0', part_len[2]) == NULL;
    double real = (double)num / 7.0 * pow(10.0, (double)(num % 40 - 20));
    int decimals = num % 18;

    tally_jtext_t j = {0};
    tally_jtext_begin(&j, NULL);
    tally_jtext_str(&j, key, s);
    tally_jtext_str(&j, "null", NULL);
    tally_jtext_strn(&j, "strn", parts[2], part_len[2]);
    tally_jtext_begin(&j, "inner");
    tally_jtext_int(&j, "int", (long long)num * 1000003LL);
    tally_jtext_bool(&j, "bool", num & 1);
    tally_jtext_real(&j, "real", real, decimals);
    tally_jtext_end(&j);
    json_t *value = json_loads(parts[3], JSON_DECODE_ANY, NULL);
    tally_jtext_value(&j, "value", value);
    tally_jtext_end(&j);
    char *text = tally_jtext_take(&j);
    FUZZ_CHECK(j.s == NULL && j.len == 0 && !j.failed, "tally_jtext_take left the builder full");

    if (!utf8 || !strn_ok) {
        FUZZ_CHECK(text == NULL, "tally_jtext_take of text that is not UTF-8: %s", text);
        json_decref(value);
        return;
    }
    FUZZ_CHECK(text != NULL, "tally_jtext_take returned NULL for UTF-8 text");
    fuzz_check_str("jtext", text);
    json_error_t jerr;
    json_t *got = json_loads(text, 0, &jerr); /* a fuzzed key may repeat one: the last wins */
    FUZZ_CHECK(got != NULL, "the jtext does not load: %s: %s", jerr.text, text);

    char buf[64];
    int n = snprintf(buf, sizeof buf, "%.*f", decimals, real);
    json_t *want_real =
        n > 0 && (size_t)n < sizeof buf ? json_loads(buf, JSON_DECODE_ANY, NULL) : json_null();
    json_t *want = json_object();
    json_object_set_new(want, key, json_string(s));
    json_object_set_new(want, "null", json_null());
    json_object_set_new(want, "strn", json_stringn(parts[2], part_len[2]));
    json_object_set_new(want, "inner",
                        json_pack("{s:I, s:b, s:o}", "int", (json_int_t)num * 1000003LL, "bool",
                                  num & 1, "real", want_real));
    json_object_set_new(want, "value", value ? json_incref(value) : json_null());
    char *want_text = json_dumps(want, JSON_COMPACT | JSON_SORT_KEYS);
    FUZZ_CHECK(json_equal(got, want), "the jtext %s is not %s", text, want_text);
    free(want_text);
    json_decref(want);
    json_decref(got);
    json_decref(value);
    free(text);
}

static void check_event(const char *source, const char *subject, const char *data_text)
{
    bool envelope_utf8 =
        tally_utf8_valid(source, strlen(source)) && tally_utf8_valid(subject, strlen(subject));
    bool utf8 = envelope_utf8 && tally_utf8_valid(data_text, strlen(data_text));
    char id[37];
    json_t *ev = tally_ce_new("tally.fuzz.v1", source, subject, json_string(data_text), id);
    if (!utf8) {
        FUZZ_CHECK(ev == NULL, "an event of text that is not UTF-8");
    } else {
        FUZZ_CHECK(ev != NULL, "tally_ce_new returned NULL for UTF-8 text");
        char *text = json_dumps(ev, JSON_COMPACT);
        fuzz_check_str("event", text);
        json_t *back = json_loads(text, TALLY_JSON_LOAD_FLAGS, NULL);
        FUZZ_CHECK(back != NULL && json_equal(back, ev), "the event does not load back: %s", text);
        FUZZ_CHECK(strcmp(json_string_value(json_object_get(back, "source")), source) == 0 &&
                       strcmp(json_string_value(json_object_get(back, "subject")), subject) == 0 &&
                       strcmp(json_string_value(json_object_get(back, "id")), id) == 0,
                   "the event lost a field: %s", text);
        json_decref(back);
        free(text);
    }
    json_decref(ev);

    tally_jtext_t j = {0};
    tally_jtext_begin(&j, NULL);
    bool ok = tally_ce_envelope_text(&j, "tally.fuzz.v1", source, subject, id);
    tally_jtext_str(&j, "data", data_text);
    tally_jtext_end(&j);
    char *text = tally_jtext_take(&j);
    FUZZ_CHECK(ok == envelope_utf8 && (text != NULL) == utf8, "the envelope text of %s UTF-8: %s",
               utf8 ? "" : "not", text ? text : "(null)");
    if (text != NULL) {
        fuzz_check_str("envelope text", text);
        json_t *back = json_loads(text, TALLY_JSON_LOAD_FLAGS, NULL);
        FUZZ_CHECK(back != NULL, "the envelope text does not load: %s", text);
        FUZZ_CHECK(strcmp(json_string_value(json_object_get(back, "subject")), subject) == 0 &&
                       strcmp(json_string_value(json_object_get(back, "data")), data_text) == 0,
                   "the envelope lost a field: %s", text);
        json_decref(back);
        free(text);
    }
}

static void check_alert(const char *id)
{
    bool utf8 = tally_utf8_valid(id, strlen(id));
    char *(*const commands[])(const char *) = {
        tally_alert_effect_key,         tally_alert_obligation_key, tally_alert_effect_command,
        tally_alert_obligation_command, tally_alert_close_command,
    };
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        char *out = commands[i](id);
        FUZZ_CHECK(out != NULL, "alert command %zu returned NULL", i);
        FUZZ_CHECK(strstr(out, id) != NULL, "alert command %zu does not quote the id", i);
        if (utf8)
            fuzz_check_str("alert command", out);
        free(out);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    size_t outsz = data[0] < N_SIZES ? SIZES[data[0]] : (size_t)data[0] - N_SIZES + 1;
    size_t max = data[1];
    int num = (int)data[1] - 128;
    data += 2;
    size -= 2;

    /* Split the rest on 0xFF into N_PARTS strings (missing ones empty). */
    char *parts[N_PARTS];
    size_t part_len[N_PARTS];
    for (size_t k = 0; k < N_PARTS; k++) {
        const uint8_t *end = k + 1 < N_PARTS ? memchr(data, 0xff, size) : NULL;
        size_t n = end ? (size_t)(end - data) : size;
        parts[k] = fuzz_strndup(data, n);
        part_len[k] = n;
        data += end ? n + 1 : n;
        size -= end ? n + 1 : n;
    }

    check_text_h(parts[0], parts[1], outsz, max);
    check_text_h(parts[1], parts[0], outsz, (size_t)TALLY_LIMIT_RUN_ID + max % 8 - 4);
    check_jtext(parts, part_len, num);
    check_event(parts[0], parts[1], parts[2]);
    check_alert(parts[1]);

    for (size_t k = 0; k < N_PARTS; k++)
        free(parts[k]);
    return 0;
}
