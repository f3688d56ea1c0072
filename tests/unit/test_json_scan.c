/* test_json_scan.c — a receipt taken as text (tally_json_object_compact) agrees with jansson:
 * what it accepts jansson loads as the same value, the pointer finds the same value, and what
 * it is unsure of it leaves to jansson. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tally/json.h"

#include "test_rng.h"

/* The compact text of @p text, or NULL; the text of the value at @p ptr in @p ref. */
static char *compact(const char *text, const char *ptr, char **ref)
{
    const char *r = NULL;
    size_t rlen = 99;
    char *out = tally_json_object_compact(text, strlen(text), ptr, &r, &rlen);
    if (out && r) {
        assert_true(r >= out && r + rlen <= out + strlen(out));
        *ref = strndup(r, rlen);
    } else {
        assert_null(r);
        assert_int_equal(rlen, 0);
        *ref = NULL;
    }
    return out;
}

static void expect(const char *text, const char *ptr, const char *want, const char *want_ref)
{
    char *ref;
    char *got = compact(text, ptr, &ref);
    if (got == NULL)
        fail_msg("unsure of %s", text);
    assert_string_equal(got, want);
    if (want_ref) {
        if (ref == NULL)
            fail_msg("%s did not resolve in %s", ptr, text);
        assert_string_equal(ref, want_ref);
    } else if (ref) {
        fail_msg("%s resolved to %s in %s", ptr, ref, text);
    }
    free(ref);
    free(got);
}

static void test_plain_objects_are_compacted_byte_for_byte(void **state)
{
    (void)state;
    const char *doc =
        " {\n  \"id\" : \"ch_1\", \"amount\": 12.50, \"ok\": true,\t\"n\": null,\r\n"
        "  \"list\": [ 1, -2 , {\"a\": \"b\"}, [] , {} ], \"e\": \"x\\\"y\\u00e9\\n\" } ";
    const char *want = "{\"id\":\"ch_1\",\"amount\":12.50,\"ok\":true,\"n\":null,"
                       "\"list\":[1,-2,{\"a\":\"b\"},[],{}],\"e\":\"x\\\"y\\u00e9\\n\"}";
    expect(doc, "/id", want, "\"ch_1\"");
    expect(doc, "/amount", want, "12.50");
    expect(doc, "/ok", want, "true");
    expect(doc, "/n", want, "null");
    expect(doc, "/list/1", want, "-2");
    expect(doc, "/list/2/a", want, "\"b\"");
    expect(doc, "/list/3", want, "[]");
    expect(doc, "/list", want, "[1,-2,{\"a\":\"b\"},[],{}]");
    expect(doc, "/e", want, "\"x\\\"y\\u00e9\\n\"");
    expect(doc, "", want, want);
    /* pointers that do not resolve */
    expect(doc, "/missing", want, NULL);
    expect(doc, "/list/01", want, NULL);
    expect(doc, "/list/-", want, NULL);
    expect(doc, "/list/5", want, NULL);
    expect(doc, "/id/0", want, NULL);
    expect(doc, "id", want, NULL);
    expect(doc, "/x~2", want, NULL);
    expect(doc, NULL, want, NULL);
    /* ~0 and ~1, a key that looks like an index, an index past 9 */
    expect("{\"a/b\":1,\"m~n\":2,\"0\":3}", "/a~1b", "{\"a/b\":1,\"m~n\":2,\"0\":3}", "1");
    expect("{\"a/b\":1,\"m~n\":2,\"0\":3}", "/m~0n", "{\"a/b\":1,\"m~n\":2,\"0\":3}", "2");
    expect("{\"a/b\":1,\"m~n\":2,\"0\":3}", "/0", "{\"a/b\":1,\"m~n\":2,\"0\":3}", "3");
    expect("{\"l\":[0,1,2,3,4,5,6,7,8,9,10,11]}", "/l/11", "{\"l\":[0,1,2,3,4,5,6,7,8,9,10,11]}",
           "11");
    /* raw UTF-8, DEL, and the largest integers it decides */
    expect("{\"k\":\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x7f\"}", "/k",
           "{\"k\":\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x7f\"}",
           "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\x7f\"");
    expect("{\"i\":-999999999999999999,\"z\":-0,\"r\":0.0}", "/i",
           "{\"i\":-999999999999999999,\"z\":-0,\"r\":0.0}", "-999999999999999999");
}

static void test_scalar_text_of_a_ref(void **state)
{
    (void)state;
    const struct {
        const char *json, *want;
    } cases[] = {
        {"\"ch_1\"", "ch_1"}, {"\"x\\\"y\\u00e9\"", "x\"y\xc3\xa9"},
        {"12", "12"},         {"12.50", "12.5"},
        {"true", "true"},     {"false", "false"},
        {"null", NULL},       {"{\"a\":1}", NULL},
        {"[1]", NULL},        {"\"\"", ""},
        {"not json", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *got = tally_json_scalar_text_of(cases[i].json, strlen(cases[i].json));
        json_t *v = json_loads(cases[i].json, JSON_DECODE_ANY, NULL);
        char *via_tree = tally_json_scalar_text(v); /* the same as from a jansson tree */
        json_decref(v);
        if (cases[i].want) {
            assert_non_null(got);
            assert_string_equal(got, cases[i].want);
            assert_string_equal(got, via_tree);
        } else {
            assert_null(got);
            assert_null(via_tree);
        }
        free(got);
        free(via_tree);
    }
}

static void test_unsure_of_what_jansson_must_decide(void **state)
{
    (void)state;
    char deep[200] = "", wide[2000] = "{";
    for (int i = 0; i < 33; i++)
        strcat(deep, "{\"a\":");
    strcat(deep, "1");
    for (int i = 0; i < 33; i++)
        strcat(deep, "}");
    for (int i = 0; i < 65; i++)
        snprintf(wide + strlen(wide), sizeof wide - strlen(wide), "%s\"k%d\":1", i ? "," : "", i);
    strcat(wide, "}");
    const char *cases[] = {
        "",
        "  ",
        "[1]",
        "\"x\"",
        "1",
        "null", /* not an object */
        "{",
        "{\"a\"}",
        "{\"a\":}",
        "{\"a\":1,}",
        "{,}", /* syntax */
        "{\"a\":1}x",
        "{\"a\":1;\"b\":2}",
        "{\"a\":[1;2]}",
        "{\"a\":1]",
        "{\"a\":[1}}",
        "{\"a\":1}{}",
        "{\"a\":[1,]}",
        "{a:1}",
        "{'a':1}",
        "{\"a\":01}",
        "{\"a\":1.}",
        "{\"a\":.5}",
        "{\"a\":+1}",
        "{\"a\":-}",
        "{\"a\":tru}",
        "{\"a\":truex}",
        "{\"a\":nul}",
        "{\"a\":\"x}",
        "{\"a\":1,\"a\":2}",
        "{\"a\":{\"b\":1,\"c\":2,\"b\":3}}", /* duplicates */
        "{\"\\u0061\":1}",
        "{\"a\\n\":1}",        /* escaped keys */
        "{\"a\":\"\\u0000\"}", /* U+0000 */
        "{\"a\":\"\\ud83d\\ude00\"}",
        "{\"a\":\"\\ud800\"}",
        "{\"a\":\"\\udc00\"}",
        "{\"a\":\"\\x\"}",
        "{\"a\":\"\\u12\"}",
        "{\"a\":\"\\u12g4\"}",
        "{\"a\":1e5}",
        "{\"a\":1E5}",
        "{\"a\":1.5e-3}",              /* exponents */
        "{\"a\":1234567890123456789}", /* 19 digits */
        "{\"a\":\"\x01\"}",
        "{\"a\":\"\x1f\"}",
        "{\"a\":\"\t\"}", /* control characters */
        "{\"a\":\"\xff\"}",
        "{\"a\":\"\xc3\"}",
        "{\"a\":\"\xed\xa0\x80\"}", /* not UTF-8 */
        "\xef\xbb\xbf{}",           /* a byte order mark */
        deep,
        wide,
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *ref;
        char *got = compact(cases[i], "/a", &ref);
        if (got)
            fail_msg("case %zu: sure of %s: %s", i, cases[i], got);
    }
    /* a raw NUL inside the given length */
    const char *r;
    size_t rl;
    assert_null(tally_json_object_compact("{\"a\":\"\0\"}", 9, "/a", &r, &rl));
    assert_null(tally_json_object_compact("{}\0", 3, "/a", &r, &rl));
    assert_null(tally_json_object_compact(NULL, 0, "/a", &r, &rl));
    /* one key fewer, one level fewer: decided */
    char ok_deep[200] = "";
    for (int i = 0; i < 32; i++)
        strcat(ok_deep, "{\"a\":");
    strcat(ok_deep, "1");
    for (int i = 0; i < 32; i++)
        strcat(ok_deep, "}");
    char *ref;
    char *got = compact(ok_deep, "/a/a/a", &ref);
    assert_non_null(got);
    assert_string_equal(got, ok_deep);
    free(got);
    free(ref);
    wide[strlen(wide) - strlen(",\"k64\":1}")] = '\0';
    strcat(wide, "}");
    got = compact(wide, "/k63", &ref);
    assert_non_null(got);
    assert_string_equal(ref, "1");
    free(got);
    free(ref);
}

/* The scanner against jansson on documents broken at random: whenever it is sure, jansson
 * loads the original, the compact text is the same value, and the pointer finds the same
 * value (or nothing, as jansson does). */
static void test_agrees_with_jansson_on_mutated_documents(void **state)
{
    (void)state;
    const char *seeds[] = {
        "{\"id\":\"ch_1\",\"amount\":1250,\"currency\":\"eur\",\"status\":\"succeeded\"}",
        "{ \"id\" : 42 , \"data\" : { \"ref\" : [ \"x\" , 1.5 , true , null ] } }",
        "{\"id\":\"a\\\"b\\\\c\\/d\\b\\f\\n\\r\\t\\u00e9\\u20ac\",\"k\":\"\xc3\xa9\"}",
        "{\"a\":{\"b\":{\"c\":{\"d\":[[],[{}],{\"e\":-0.25}]}}},\"id\":false}",
        "{\"list\":[1,2,3,4,5,6,7,8,9,10,11,12],\"0\":\"zero\",\"a/b\":1,\"m~n\":2}",
        "{\"id\":\"\",\"n\":-123456789012345678,\"r\":3.14159265358979323846}",
        "{\"id\":\"r\",\"id2\":\"r\",\"x\":{\"id\":1,\"y\":{\"id\":2}},\"big\":99999999999999999}",
        "{}",
        "{\"id\":[{\"id\":[{\"id\":\"deep\"}]}]}",
    };
    const char *ptrs[] = {"/id",   "/data/ref/1", "/a/b/c/d/2/e", "/list/11", "/a~1b",
                          "/m~0n", "/0",          "/x/y/id",      "",         "/id/0/id/0/id",
                          "/n",    "/r",          "/k",           "/missing", "/list/-"};
    const char alphabet[] = "{}[]\":,\\ \t\n0123456789-+.eEu aftrnlsx/~\x01\x7f";
    const char *bytes[] = {"\xc3\xa9",
                           "\xff",
                           "\xed\xa0\x80",
                           "\\u0000",
                           "\\ud800",
                           "\\udc00",
                           "1e400",
                           "\0",
                           "\\u0061",
                           "\"id\":1,",
                           "99999999999999999999"};
    int sure = 0, jansson_ok = 0, runs = 200000;
    char buf[512];
    for (int it = 0; it < runs; it++) {
        const char *seed = seeds[rng() % (sizeof seeds / sizeof seeds[0])];
        size_t len = strlen(seed);
        memcpy(buf, seed, len);
        int edits = (int)(rng() % 3); /* 0: the seed itself */
        for (int e = 0; e < edits && len > 0; e++) {
            size_t at = rng() % len;
            switch (rng() % 4) {
            case 0: /* replace a byte */
                buf[at] = alphabet[rng() % (sizeof alphabet - 1)];
                break;
            case 1: /* delete a byte */
                memmove(buf + at, buf + at + 1, len - at - 1);
                len--;
                break;
            case 2: { /* insert a piece */
                const char *p = bytes[rng() % (sizeof bytes / sizeof bytes[0])];
                size_t pl = p[0] ? strlen(p) : 1;
                if (len + pl < sizeof buf) {
                    memmove(buf + at + pl, buf + at, len - at);
                    memcpy(buf + at, p, pl);
                    len += pl;
                }
                break;
            }
            default: /* insert a byte */
                if (len + 1 < sizeof buf) {
                    memmove(buf + at + 1, buf + at, len - at);
                    buf[at] = alphabet[rng() % (sizeof alphabet - 1)];
                    len++;
                }
                break;
            }
        }
        const char *ptr = ptrs[rng() % (sizeof ptrs / sizeof ptrs[0])];
        const char *ref = NULL;
        size_t ref_len = 0;
        char *got = tally_json_object_compact(buf, len, ptr, &ref, &ref_len);
        json_t *doc = json_loadb(buf, len, TALLY_JSON_LOAD_FLAGS, NULL);
        if (doc && json_is_object(doc))
            jansson_ok++;
        if (got == NULL) {
            json_decref(doc);
            continue;
        }
        sure++;
        if (doc == NULL || !json_is_object(doc))
            fail_msg("sure of what jansson refuses: %.*s", (int)len, buf);
        json_t *back = json_loads(got, TALLY_JSON_LOAD_FLAGS, NULL);
        if (back == NULL || !json_equal(back, doc))
            fail_msg("%.*s compacted to a different value: %s", (int)len, buf, got);
        json_t *want = tally_json_pointer(doc, ptr);
        if (ref == NULL) {
            if (want)
                fail_msg("%s resolves in %.*s but was not found", ptr, (int)len, buf);
        } else {
            json_t *v = json_loadb(ref, ref_len, JSON_DECODE_ANY, NULL);
            if (v == NULL || want == NULL || !json_equal(v, want))
                fail_msg("%s in %.*s: found %.*s", ptr, (int)len, buf, (int)ref_len, ref);
            char *a = tally_json_scalar_text_of(ref, ref_len), *b = tally_json_scalar_text(want);
            assert_true((a == NULL && b == NULL) || (a && b && strcmp(a, b) == 0));
            free(a);
            free(b);
            json_decref(v);
        }
        json_decref(back);
        json_decref(doc);
        free(got);
    }
    /* Not a test that passes by being unsure of everything: it decides most documents jansson
     * loads (the seeds, and the edits that keep them JSON). */
    print_message("sure of %d of %d documents; jansson loaded %d\n", sure, runs, jansson_ok);
    assert_true(sure > runs / 4);
    assert_true(sure > jansson_ok * 3 / 4);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain_objects_are_compacted_byte_for_byte),
        cmocka_unit_test(test_scalar_text_of_a_ref),
        cmocka_unit_test(test_unsure_of_what_jansson_must_decide),
        cmocka_unit_test(test_agrees_with_jansson_on_mutated_documents),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
