/* test_cli_format.c — cli/format.c's output rules: text wraps to cli_width() only between
 * words (a UUID, a key, a ref, a URL is never split, and one wider than the line stands whole
 * on its own), widths count characters and not bytes, CLI_NBSP holds two words together; the
 * width comes from COLUMNS, else the terminal, else 80; JSON reals print in their shortest
 * round-trip form. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "format.h"
#include "tally/json.h"

/* cli/main.c's, which format.c calls for --actor defaults. */
const char *tally_cli_default_actor(void)
{
    return "test";
}

/* What cli_wrap writes for @p text at COLUMNS=@p width. Malloc'd. */
static char *wrapped(const char *text, size_t width, size_t first_col, size_t indent)
{
    char cols[16];
    snprintf(cols, sizeof cols, "%zu", width);
    setenv("COLUMNS", cols, 1);
    char *buf = NULL;
    size_t len = 0;
    FILE *out = open_memstream(&buf, &len);
    assert_non_null(out);
    cli_wrap(out, text, first_col, indent);
    fclose(out);
    unsetenv("COLUMNS");
    return buf;
}

/* Characters (UTF-8 code points) of @p s[0..n). */
static size_t chars(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += ((unsigned char)s[i] & 0xC0) != 0x80;
    return c;
}

/* Each line of @p out (the first starting at @p first_col) is at most @p width characters,
 * unless it holds one word only. */
static void assert_lines_fit(const char *out, size_t width, size_t first_col)
{
    size_t col0 = first_col;
    for (const char *line = out; *line != '\0';) {
        const char *nl = strchr(line, '\n');
        assert_non_null(nl);
        size_t n = (size_t)(nl - line);
        size_t lead = strspn(line, " ");
        bool one_word = memchr(line + lead, ' ', n - lead) == NULL;
        if (col0 + chars(line, n) > width && !(one_word && chars(line + lead, n - lead) > width))
            fail_msg("line wider than %zu: \"%.*s\"", width, (int)n, line);
        col0 = 0;
        line = nl + 1;
    }
}

/* @p word appears whole within one line of @p out. */
static void assert_whole(const char *out, const char *word)
{
    for (const char *line = out; *line != '\0';) {
        const char *nl = strchr(line, '\n');
        size_t n = nl != NULL ? (size_t)(nl - line) : strlen(line);
        if (memmem(line, n, word, strlen(word)) != NULL)
            return;
        line = nl != NULL ? nl + 1 : line + n;
    }
    fail_msg("\"%s\" is not whole on any line of:\n%s", word, out);
}

static void test_wrap_never_splits_a_word(void **state)
{
    (void)state;
    static const char *const words[] = {
        "01a21ad3-55df-745f-9dd8-369fe7b15539",
        "charge_card:t1:run-7f4e3282ebbb-p2",
        "https://runbooks.example.com/tally/effects-no_status_check-attempts_exhausted",
        "effect:01a21ad3-595d-7ee9-8916-1b322b4a5639",
    };
    char text[1024];
    snprintf(text, sizeof text,
             "step 2 charge_card CONFIRMED effect %s key %s runbook %s page %s is open, and "
             "a few more words to fill the lines up",
             words[0], words[1], words[2], words[3]);
    static const size_t widths[] = {20, 40, 60, 80, 200};
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        for (size_t first = 0; first < 12; first += 5) {
            char *out = wrapped(text, widths[w], first, 4);
            for (size_t i = 0; i < sizeof words / sizeof words[0]; i++)
                assert_whole(out, words[i]);
            assert_lines_fit(out, widths[w] < 24 ? 24 : widths[w], first);
            /* nothing lost or added but the line breaks and indents */
            char *flat_in = strdup(text), *flat_out = strdup(out);
            assert_non_null(flat_in);
            assert_non_null(flat_out);
            char *p = flat_out, *q = flat_out;
            for (; *p != '\0'; p++)
                if (*p != ' ' && *p != '\n')
                    *q++ = *p;
            *q = '\0';
            p = q = flat_in;
            for (; *p != '\0'; p++)
                if (*p != ' ')
                    *q++ = *p;
            *q = '\0';
            assert_string_equal(flat_out, flat_in);
            free(flat_in);
            free(flat_out);
            free(out);
        }
    }
}

/* A word wider than the line goes to a line of its own, whole, from the first column; the words
 * after it go on at the indent. */
static void test_wrap_puts_a_long_word_on_its_own_line(void **state)
{
    (void)state;
    const char *url = "http://127.0.0.1:46609/charges/reverse/with/a/long/path/to/it";
    char text[256];
    snprintf(text, sizeof text, "by worker-1: %s timed out", url);
    char *out = wrapped(text, 40, 0, 2);
    char expect[256];
    snprintf(expect, sizeof expect, "by worker-1:\n%s\n  timed out\n", url);
    assert_string_equal(out, expect);
    free(out);
    /* after a label, alone: on the next line */
    out = wrapped(url, 30, 10, 10);
    snprintf(expect, sizeof expect, "\n%s\n", url);
    assert_string_equal(out, expect);
    free(out);
    /* one that fits the width but not after the indent moves left so the line still fits */
    const char *anchor = "docs/operations.md#effects-no_status_check-attempts_exhausted-status_in";
    out = wrapped(anchor, 80, 14, 14);
    snprintf(expect, sizeof expect, "\n%*s%s\n", (int)(80 - strlen(anchor)), "", anchor);
    assert_string_equal(out, expect);
    free(out);
}

/* Widths are characters: 12 words of "ééééé" (5 characters, 10 bytes) at 20 columns are three
 * a line, and no line ends inside a character. */
static void test_wrap_counts_characters_not_bytes(void **state)
{
    (void)state;
    char text[256] = "";
    for (int i = 0; i < 12; i++)
        strcat(text, i ? " \xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"
                       : "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9");
    char *out = wrapped(text, 24, 0, 0);
    const char *line3 = "\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9 \xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9"
                        "\xc3\xa9 \xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9\xc3\xa9 \xc3\xa9\xc3\xa9\xc3\xa9"
                        "\xc3\xa9\xc3\xa9\n";
    size_t n3 = strlen(line3);
    char expect[512] = "";
    for (int i = 0; i < 3; i++)
        strcat(expect, line3);
    assert_int_equal(strlen(out), 3 * n3);
    assert_string_equal(out, expect);
    assert_true(tally_utf8_valid(out, strlen(out)));
    free(out);
}

/* "pager" CLI_NBSP "not_configured" is one word to the wrapper, printed with a plain space. */
static void test_nbsp_holds_two_words_together(void **state)
{
    (void)state;
    const char *text = "⚠ critical  effect:01a21ad3-595d-7ee9-8916-1b322b4a5639  open 3m12s, "
                       "pager" CLI_NBSP "not_configured";
    char *out = wrapped(text, 80, 2, 4);
    assert_non_null(strstr(out, "pager not_configured"));
    assert_null(strstr(out, "\xc2\xa0"));
    free(out);
    /* without it, the pair is split where the line ends: what `tally status` printed */
    out = wrapped("⚠ critical  effect:01a21ad3-595d-7ee9-8916-1b322b4a5639  open 3m12s, pager "
                  "not_configured",
                  80, 2, 4);
    assert_null(strstr(out, "pager not_configured"));
    free(out);
}

static void test_width_from_columns_then_the_terminal_then_80(void **state)
{
    (void)state;
    assert_int_equal(cli_width_of("40", 0), 40);
    assert_int_equal(cli_width_of("200", 120), 200);
    assert_int_equal(cli_width_of(NULL, 120), 120);
    assert_int_equal(cli_width_of("", 0), 80);
    assert_int_equal(cli_width_of(NULL, 0), 80);
    assert_int_equal(cli_width_of("wide", 0), 80);
    assert_int_equal(cli_width_of("12x", 100), 100);
    assert_int_equal(cli_width_of("-5", 0), 80);
    assert_int_equal(cli_width_of("5", 0), 20);
    assert_int_equal(cli_width_of("99999", 0), 1000);
    setenv("COLUMNS", "57", 1);
    assert_int_equal(cli_width(), 57);
    unsetenv("COLUMNS");
}

static void assert_real(double d, const char *expect)
{
    char out[48];
    assert_true(cli_format_real(d, out, sizeof out));
    assert_string_equal(out, expect);
    assert_true(strtod(out, NULL) == d);
}

static void test_reals_print_in_their_shortest_round_trip_form(void **state)
{
    (void)state;
    assert_real(0.73, "0.73");       /* jansson: 0.72999999999999998 */
    assert_real(800.623, "800.623"); /* jansson: 800.62300000000005 */
    assert_real(0.000376416, "0.000376416");
    assert_real(1.7397199999999999, "1.73972");
    assert_real(0.1 + 0.2, "0.30000000000000004"); /* needs 17 digits to read back */
    assert_real(1.0, "1.0");
    assert_real(-0.5, "-0.5");
    assert_real(1e300, "1e+300");
    char out[48];
    assert_false(cli_format_real(NAN, out, sizeof out));
    assert_false(cli_format_real(0.73, out, 3));
}

static void test_json_dumps_styles_and_reals(void **state)
{
    (void)state;
    json_t *doc = json_pack("{s:f, s:[i, f], s:s, s:{}, s:[], s:n, s:b}", "latency_ms", 0.73, "b",
                            1, 2.5, "s", "a\"b\\c\n\x01é", "o", "a", "z", "t", 1);
    assert_non_null(doc);
    char *text = cli_json_dumps(doc, CLI_JSON_COMPACT, true);
    assert_string_equal(text, "{\"a\":[],\"b\":[1,2.5],\"latency_ms\":0.73,\"o\":{},"
                              "\"s\":\"a\\\"b\\\\c\\n\\u0001é\",\"t\":true,\"z\":null}");
    free(text);
    text = cli_json_dumps(doc, CLI_JSON_LINE, true);
    assert_string_equal(text, "{\"a\": [], \"b\": [1, 2.5], \"latency_ms\": 0.73, \"o\": {}, "
                              "\"s\": \"a\\\"b\\\\c\\n\\u0001é\", \"t\": true, \"z\": null}");
    free(text);
    /* indented, in the document's order: jansson's JSON_INDENT(2) but for the reals */
    json_object_set_new(doc, "latency_ms", json_integer(1));
    json_array_set_new(json_object_get(doc, "b"), 1, json_integer(3));
    text = cli_json_dumps(doc, CLI_JSON_INDENT2, false);
    char *theirs = json_dumps(doc, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    assert_string_equal(text, theirs);
    free(text);
    free(theirs);
    json_decref(doc);
    /* every real of a document, whatever jansson would print */
    doc = json_pack("{s:[f, f, f]}", "x", 0.72999999999999998, 1e-7, 123456.789);
    text = cli_json_text(doc);
    assert_string_equal(text, "{\"x\":[0.73,1e-07,123456.789]}");
    free(text);
    json_decref(doc);
    text = cli_json_text(NULL);
    assert_string_equal(text, "null");
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_wrap_never_splits_a_word),
        cmocka_unit_test(test_wrap_puts_a_long_word_on_its_own_line),
        cmocka_unit_test(test_wrap_counts_characters_not_bytes),
        cmocka_unit_test(test_nbsp_holds_two_words_together),
        cmocka_unit_test(test_width_from_columns_then_the_terminal_then_80),
        cmocka_unit_test(test_reals_print_in_their_shortest_round_trip_form),
        cmocka_unit_test(test_json_dumps_styles_and_reals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
