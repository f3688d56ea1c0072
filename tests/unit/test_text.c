/* test_text.c — text cut on character boundaries, always valid UTF-8; and the limits table,
 * held against schemas/README.md and the message schemas that state it for other people. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "tally/json.h"
#include "tally/text.h"

/* 2-, 3- and 4-byte characters, to put at every cut */
static const char *const WIDE[] = {"\xc3\xbc", "\xe2\x82\xac", "\xf0\x9f\x98\x80"};

static void assert_valid(const char *s)
{
    if (!tally_utf8_valid(s, strlen(s)))
        fail_msg("not valid UTF-8: \"%s\"", s);
}

/* Every buffer size against a text with a wide character at every position: the result is
 * valid UTF-8, fits, is a prefix of the text (before a "..."), and is whole when it fits. */
static void test_copy_cuts_on_character_boundaries(void **state)
{
    (void)state;
    for (size_t w = 0; w < 3; w++) {
        for (size_t at = 0; at < 12; at++) {
            char text[64];
            memset(text, 'a', at);
            strcpy(text + at, WIDE[w]);
            strcat(text, "bcdef");
            size_t len = strlen(text);
            for (size_t sz = 1; sz <= len + 2; sz++) {
                char out[80];
                memset(out, 'Z', sizeof out);
                bool whole = tally_text_copy(out, sz, text);
                assert_true(strlen(out) < sz);
                assert_valid(out);
                assert_true(out[sz] == 'Z' || sz >= sizeof out); /* nothing written past it */
                if (sz > len) {
                    assert_true(whole);
                    assert_string_equal(out, text);
                } else {
                    assert_false(whole);
                    size_t n = strlen(out);
                    if (n >= 3) {
                        assert_memory_equal(out + n - 3, "...", 3);
                        assert_memory_equal(out, text, n - 3);
                    } else {
                        assert_int_equal(n, 0);
                    }
                }
            }
        }
    }
}

/* Malformed bytes become '?', so that the copy can always go into JSON and PostgreSQL. */
static void test_copy_makes_malformed_text_valid(void **state)
{
    (void)state;
    char out[64];
    assert_false(tally_text_copy(out, sizeof out, "caf\xc3"));
    assert_string_equal(out, "caf?");
    assert_false(tally_text_copy(out, sizeof out, "\xff\xfe ok \xed\xa0\x80"));
    assert_string_equal(out, "?? ok ???");
    assert_false(tally_text_copy(out, sizeof out, "\xc0\xaf")); /* overlong '/' */
    assert_string_equal(out, "??");
    assert_true(tally_text_copy(out, sizeof out, NULL));
    assert_string_equal(out, "");
}

static void test_fmt_quotes_outside_text_safely(void **state)
{
    (void)state;
    char out[32];
    /* a run id whose 2-byte character straddles the cut, as "%.Ns" would have split it */
    char run[64];
    memset(run, 'r', 20);
    strcpy(run + 20, "\xc3\xbc tail");
    assert_false(tally_fmt(out, sizeof out, "run %s is STUCK", run));
    assert_valid(out);
    assert_true(strlen(out) < sizeof out);
    assert_true(tally_fmt(out, sizeof out, "%d %s", 42, "\xe2\x82\xac"));
    assert_string_equal(out, "42 \xe2\x82\xac");
    /* longer than the formatter's stack buffer: cut by us, not by vsnprintf */
    char *big = malloc(5000);
    assert_non_null(big);
    for (size_t i = 0; i < 4998; i += 3)
        memcpy(big + i, "\xe2\x82\xac", 3);
    big[4998] = '\0';
    char line[3000];
    assert_false(tally_fmt(line, sizeof line, "x%s", big));
    assert_valid(line);
    assert_true(strlen(line) < sizeof line && strlen(line) > sizeof line - 8);
    free(big);
}

static void test_prefix_and_dup(void **state)
{
    (void)state;
    const char *s = "ab\xe2\x82\xac"
                    "cd";
    assert_int_equal(tally_utf8_prefix(s, strlen(s), 100), strlen(s));
    assert_int_equal(tally_utf8_prefix(s, strlen(s), 2), 2);
    assert_int_equal(tally_utf8_prefix(s, strlen(s), 3), 2);
    assert_int_equal(tally_utf8_prefix(s, strlen(s), 4), 2);
    assert_int_equal(tally_utf8_prefix(s, strlen(s), 5), 5);
    char *d = tally_text_dup(s, 4);
    assert_string_equal(d, "a...");
    free(d);
    d = tally_text_dup(s, 100);
    assert_string_equal(d, s);
    free(d);
    assert_null(tally_text_dup(NULL, 10));
    for (size_t w = 0; w < 3; w++)
        assert_int_equal(tally_utf8_seq((const unsigned char *)WIDE[w], 4), w + 2);
    assert_int_equal(tally_utf8_seq((const unsigned char *)"\xf0\x9f\x98", 3), 0);
}

/* ---------------------------------------------------------------- the limits table */

static char *read_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        fail_msg("cannot open %s", path);
    char *buf = malloc(1 << 20);
    assert_non_null(buf);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* The rows of the "## Limits" table of schemas/README.md: "| `name` | bytes | ... |". */
static void test_limits_table_matches_the_readme(void **state)
{
    (void)state;
    char *md = read_file(TALLY_SOURCE_DIR "/schemas/README.md");
    char *sec = strstr(md, "\n## Limits\n");
    assert_non_null(sec);
    char *end = strstr(sec + 1, "\n## ");
    if (end != NULL)
        *end = '\0';
    size_t n = 0;
    const tally_limit_t *lim = tally_limits(&n);
    size_t row = 0;
    for (char *line = strtok(sec, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        char name[64];
        unsigned long bytes;
        if (sscanf(line, "| `%63[a-z_]` | %lu |", name, &bytes) != 2)
            continue;
        if (row >= n)
            fail_msg("README lists %s, which text.h does not have", name);
        if (strcmp(name, lim[row].name) != 0 || bytes != lim[row].bytes)
            fail_msg("README row %zu is %s = %lu; text.h says %s = %zu", row + 1, name, bytes,
                     lim[row].name, lim[row].bytes);
        row++;
    }
    if (row != n)
        fail_msg("README lists %zu limits; text.h has %zu", row, n);
    free(md);
}

static size_t limit_of(const char *name)
{
    size_t n = 0;
    const tally_limit_t *lim = tally_limits(&n);
    for (size_t i = 0; i < n; i++)
        if (strcmp(lim[i].name, name) == 0)
            return lim[i].bytes;
    fail_msg("no limit %s", name);
    return 0;
}

/* The schemas other people validate against state the same limits (as maxLength). */
static void test_limits_table_matches_the_schemas(void **state)
{
    (void)state;
    struct {
        const char *schema, *path, *limit;
    } checks[] = {
        {"intent", "/properties/id/maxLength", "event_id"},
        {"intent", "/properties/data/properties/run_id/maxLength", "run_id"},
        {"intent", "/properties/data/properties/tool/maxLength", "tool"},
        {"intent", "/properties/data/properties/operation_key/maxLength", "operation_key"},
        {"intent", "/properties/data/properties/tenant/maxLength", "tenant"},
        {"compensate_run", "/properties/id/maxLength", "event_id"},
        {"compensate_run", "/properties/data/properties/run_id/maxLength", "run_id"},
        {"compensate_run", "/properties/data/properties/reason/maxLength", "reason"},
        {"cancel_run", "/properties/id/maxLength", "event_id"},
        {"cancel_run", "/properties/data/properties/run_id/maxLength", "run_id"},
        {"cancel_run", "/properties/data/properties/reason/maxLength", "reason"},
    };
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, "%s/schemas/%s.schema.json", TALLY_SOURCE_DIR,
                 checks[i].schema);
        json_error_t jerr;
        json_t *doc = json_load_file(path, 0, &jerr);
        if (doc == NULL)
            fail_msg("%s: %s", path, jerr.text);
        json_t *v = tally_json_pointer(doc, checks[i].path);
        if (!json_is_integer(v) || (size_t)json_integer_value(v) != limit_of(checks[i].limit))
            fail_msg("%s.schema.json %s is not %zu", checks[i].schema, checks[i].path,
                     limit_of(checks[i].limit));
        json_decref(doc);
    }
}

/* tally_strbuf: grows, says "" for nothing put, and hands the text over once. */
static void test_strbuf_grows_and_hands_over(void **state)
{
    (void)state;
    tally_strbuf_t b = {0};
    char *empty = tally_strbuf_take(&b);
    assert_string_equal(empty, "");
    free(empty);
    for (int i = 0; i < 1000; i++)
        tally_strbuf_puts(&b, "ab");
    tally_strbuf_put(&b, "xyz", 1);
    assert_int_equal(b.len, 2001);
    char *s = tally_strbuf_take(&b);
    assert_non_null(s);
    assert_int_equal(strlen(s), 2001);
    assert_int_equal(s[2000], 'x');
    assert_null(b.s);
    free(s);
    b.failed = true; /* as after an append that ran out of memory */
    tally_strbuf_puts(&b, "lost");
    assert_null(tally_strbuf_take(&b));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_copy_cuts_on_character_boundaries),
        cmocka_unit_test(test_copy_makes_malformed_text_valid),
        cmocka_unit_test(test_fmt_quotes_outside_text_safely),
        cmocka_unit_test(test_prefix_and_dup),
        cmocka_unit_test(test_limits_table_matches_the_readme),
        cmocka_unit_test(test_limits_table_matches_the_schemas),
        cmocka_unit_test(test_strbuf_grows_and_hands_over),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
