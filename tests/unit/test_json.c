/* test_json.c — canonical JSON, the input hash, UTF-8 validation, JSON pointers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tally/json.h"

static json_t *parse(const char *text)
{
    json_error_t jerr;
    json_t *v = json_loads(text, TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, &jerr);
    if (v == NULL)
        fail_msg("test input does not parse: %s: %s", text, jerr.text);
    return v;
}

/* The canonical text of @p text, checked to be stable: canonicalising it again gives itself. */
static char *canon_of(const char *text)
{
    json_t *v = parse(text);
    char *c = tally_json_canonical(v);
    json_decref(v);
    assert_non_null(c);
    json_t *again = parse(c);
    char *c2 = tally_json_canonical(again);
    json_decref(again);
    assert_non_null(c2);
    assert_string_equal(c, c2);
    free(c2);
    return c;
}

#define assert_canon(in, want)                                                                     \
    do {                                                                                           \
        char *got_ = canon_of(in);                                                                 \
        assert_string_equal(got_, want);                                                           \
        free(got_);                                                                                \
    } while (0)

static void hash_of(const char *text, char out[65])
{
    json_t *v = parse(text);
    assert_true(tally_input_hash(v, out));
    json_decref(v);
}

static void test_key_order_does_not_matter(void **state)
{
    (void)state;
    const char *a = "{\"tenant_id\":\"t1\",\"payment_id\":\"pay_42\",\"amount\":0.1,"
                    "\"meta\":{\"z\":1,\"y\":[3,2,1]}}";
    const char *b = "{ \"meta\" : { \"y\" : [3, 2, 1], \"z\" : 1 },\n \"amount\": 0.1,"
                    " \"payment_id\": \"pay_42\", \"tenant_id\": \"t1\" }";
    char *ca = canon_of(a), *cb = canon_of(b);
    assert_string_equal(ca, cb);
    assert_string_equal(ca, "{\"amount\":0.1,\"meta\":{\"y\":[3,2,1],\"z\":1},"
                            "\"payment_id\":\"pay_42\",\"tenant_id\":\"t1\"}");
    free(ca);
    free(cb);

    char ha[65], hb[65];
    hash_of(a, ha);
    hash_of(b, hb);
    assert_string_equal(ha, hb);

    /* and a different value is a different hash */
    hash_of("{\"tenant_id\":\"t1\",\"payment_id\":\"pay_43\",\"amount\":0.1,"
            "\"meta\":{\"z\":1,\"y\":[3,2,1]}}",
            hb);
    assert_string_not_equal(ha, hb);
}

static void test_nesting_and_arrays(void **state)
{
    (void)state;
    assert_canon("{\"z\":{\"b\":{\"d\":1,\"c\":2},\"a\":[{\"y\":1,\"x\":2},[]]}}",
                 "{\"z\":{\"a\":[{\"x\":2,\"y\":1},[]],\"b\":{\"c\":2,\"d\":1}}}");
    assert_canon("[3,1,2]", "[3,1,2]"); /* arrays are never sorted */
    assert_canon("[\"b\",\"a\",{\"b\":1,\"a\":0}]", "[\"b\",\"a\",{\"a\":0,\"b\":1}]");
    assert_canon("{}", "{}");
    assert_canon("[]", "[]");
    assert_canon(" { \"a\" : [ 1 , 2 , { } ] } ", "{\"a\":[1,2,{}]}");
    assert_canon("\"just a string\"", "\"just a string\"");
    assert_canon("true", "true");
    assert_canon("false", "false");
    assert_canon("null", "null");
    assert_canon("{\"n\":null,\"t\":true,\"f\":false}", "{\"f\":false,\"n\":null,\"t\":true}");
}

/* Keys sort by their UTF-8 bytes: "" < "B" (0x42) < "_" (0x5f) < "a" < "aa" < "é" (0xc3). */
static void test_keys_sort_bytewise(void **state)
{
    (void)state;
    assert_canon("{\"\\u00e9\":6,\"aa\":5,\"a\":4,\"_\":3,\"B\":2,\"\":1}",
                 "{\"\":1,\"B\":2,\"_\":3,\"a\":4,\"aa\":5,\"\xc3\xa9\":6}");
    /* a key with an embedded NUL sorts after its prefix and is escaped */
    json_t *o = json_object();
    json_object_setn_new(o, "a\0b", 3, json_integer(2));
    json_object_set_new(o, "a", json_integer(1));
    char *c = tally_json_canonical(o);
    assert_non_null(c);
    assert_string_equal(c, "{\"a\":1,\"a\\u0000b\":2}");
    free(c);
    json_decref(o);
}

static void test_unicode_is_raw(void **state)
{
    (void)state;
    assert_canon("\"\\u00e9\"", "\"\xc3\xa9\"");                    /* é from an escape */
    assert_canon("\"\xc3\xa9t\xc3\xa9\"", "\"\xc3\xa9t\xc3\xa9\""); /* été, raw in, raw out */
    assert_canon("\"\\ud83d\\ude00\"", "\"\xf0\x9f\x98\x80\"");     /* U+1F600 via surrogates */
    assert_canon("\"\xf0\x9f\x98\x80\"", "\"\xf0\x9f\x98\x80\"");
    assert_canon("\"\\u20ac \\u4e2d\"", "\"\xe2\x82\xac \xe4\xb8\xad\"");
    assert_canon("\"a\\/b\"", "\"a/b\"");    /* solidus needs no escape */
    assert_canon("\"\\u007f\"", "\"\x7f\""); /* DEL is not a control character for JSON */
    assert_canon("\"\\u2028\"", "\"\xe2\x80\xa8\"");
}

static void test_control_characters_are_escaped(void **state)
{
    (void)state;
    assert_canon("\"q\\\"b\\\\\"", "\"q\\\"b\\\\\"");
    assert_canon("\"\\b\\f\\n\\r\\t\"", "\"\\b\\f\\n\\r\\t\"");
    assert_canon("\"\\u0001\\u001f\\u000b\\u001B\"", "\"\\u0001\\u001f\\u000b\\u001b\"");
    /* NUL inside a value (jansson keeps it with JSON_ALLOW_NUL) */
    json_error_t jerr;
    json_t *v = json_loads("\"a\\u0000b\"", JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
    assert_non_null(v);
    char *c = tally_json_canonical(v);
    assert_string_equal(c, "\"a\\u0000b\"");
    free(c);
    json_decref(v);
}

static void test_reals_shortest_round_trip(void **state)
{
    (void)state;
    assert_canon("0.1", "0.1"); /* json_dumps would write 0.10000000000000001 */
    assert_canon("[0.1,0.2,0.3]", "[0.1,0.2,0.3]");
    assert_canon("0.30000000000000004", "0.30000000000000004"); /* 0.1 + 0.2 needs 17 */
    assert_canon("2.5", "2.5");
    assert_canon("123456.789", "123456.789");
    assert_canon("1.5e-7", "1.5e-07");
    assert_canon("1e300", "1e+300");
    assert_canon("-1.7976931348623157e308", "-1.7976931348623157e+308");
    /* Subnormals carry fewer bits, so 15 digits already read back even though fewer would:
     * the form is fixed by the %.15g/%.16g/%.17g rule, not by the fewest digits. */
    assert_canon("5e-324", "4.94065645841247e-324");
    /* integral reals stay reals */
    assert_canon("1.0", "1.0");
    assert_canon("100.00", "100.0");
    assert_canon("1E2", "100.0");
    /* -0.0 keeps its sign: the tool receives what the agent sent */
    assert_canon("-0.0", "-0.0");
    assert_canon("0.0", "0.0");

    /* 1 and 1.0 are different arguments */
    char hi[65], hr[65];
    hash_of("{\"a\":1}", hi);
    hash_of("{\"a\":1.0}", hr);
    assert_string_not_equal(hi, hr);

    /* the text reads back as exactly the same double */
    const double samples[] = {0.1, 1.0 / 3.0, 2.0 / 3.0, 1e21, 1e-21, 6.02214076e23, 0.5e-300};
    for (size_t i = 0; i < sizeof samples / sizeof samples[0]; i++) {
        json_t *r = json_real(samples[i]);
        char *c = tally_json_canonical(r);
        assert_non_null(c);
        json_t *back = parse(c);
        assert_true(json_is_real(back));
        assert_true(json_real_value(back) == samples[i]);
        json_decref(back);
        json_decref(r);
        free(c);
    }
}

static void test_integers(void **state)
{
    (void)state;
    assert_canon("0", "0");
    assert_canon("-7", "-7");
    assert_canon("9223372036854775807", "9223372036854775807");
    assert_canon("-9223372036854775808", "-9223372036854775808");
    assert_canon("[12345678901234]", "[12345678901234]");
    /* beyond 64 bits jansson refuses the document, so it never reaches the ledger */
    json_error_t jerr;
    assert_null(json_loads("12345678901234567890", JSON_DECODE_ANY, &jerr));
}

/* Known vectors, computed with: printf '%s' '<canonical>' | sha256sum */
static void test_sha256_vectors(void **state)
{
    (void)state;
    char hex[65];
    assert_true(tally_sha256_hex("", 0, hex));
    assert_string_equal(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");

    char *c = canon_of("{\"b\":1,\"a\":[true,null]}");
    assert_string_equal(c, "{\"a\":[true,null],\"b\":1}");
    free(c);
    hash_of("{\"b\":1,\"a\":[true,null]}", hex);
    assert_string_equal(hex, "51705a2c9eb3e7e410a58f696a770c3ac3885a0cf43eb7fc88f5e47c11d4d30d");

    hash_of("{\"tenant_id\":\"t1\",\"payment_id\":\"pay_42\",\"currency\":\"EUR\",\"amount\":0.1}",
            hex);
    assert_string_equal(hex, "7e336882dc2700ced62d24eb6d2b4e576707c5d9cfbe8ab319020be02eb80e6d");
}

static void test_canonical_refuses_what_it_cannot_write(void **state)
{
    (void)state;
    assert_null(tally_json_canonical(NULL));
    char hex[65];
    assert_false(tally_input_hash(NULL, hex));

    /* nesting deeper than any parser accepts is refused rather than overflowing the stack */
    json_t *root = json_array(), *cur = root;
    for (int i = 0; i < 3000; i++) {
        json_t *inner = json_array();
        json_array_append_new(cur, inner);
        cur = inner;
    }
    assert_null(tally_json_canonical(root));
    json_decref(root);
}

static void test_utf8_valid(void **state)
{
    (void)state;
    static const struct {
        const char *s;
        size_t len;
    } good[] = {
        {"", 0},
        {"plain ascii", 11},
        {"a\0b", 3},
        {"\xc3\xa9", 2},         /* é */
        {"\xe2\x82\xac", 3},     /* € */
        {"\xed\x9f\xbf", 3},     /* U+D7FF, just below the surrogates */
        {"\xee\x80\x80", 3},     /* U+E000, just above */
        {"\xef\xbf\xbf", 3},     /* U+FFFF */
        {"\xf0\x9f\x98\x80", 4}, /* U+1F600 */
        {"\xf4\x8f\xbf\xbf", 4}, /* U+10FFFF, the last code point */
        {"\xc2\x80", 2},         /* U+0080, the first two-byte one */
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        if (!tally_utf8_valid(good[i].s, good[i].len))
            fail_msg("good case %zu refused", i);
    }
    static const struct {
        const char *s;
        size_t len;
    } bad[] = {
        {"\xc0\x80", 2},         /* overlong NUL */
        {"\xc1\xbf", 2},         /* overlong */
        {"\xe0\x80\x80", 3},     /* overlong */
        {"\xe0\x9f\xbf", 3},     /* overlong U+07FF */
        {"\xf0\x8f\xbf\xbf", 4}, /* overlong U+FFFF */
        {"\xed\xa0\x80", 3},     /* U+D800 */
        {"\xed\xbf\xbf", 3},     /* U+DFFF */
        {"\xf4\x90\x80\x80", 4}, /* U+110000 */
        {"\xf5\x80\x80\x80", 4}, /* lead byte out of range */
        {"\xff", 1},
        {"\xfe", 1},
        {"\x80", 1}, /* lone continuation */
        {"a\xbf", 2},
        {"\xc3", 1},         /* truncated */
        {"\xe2\x82", 2},     /* truncated */
        {"\xf0\x9f\x98", 3}, /* truncated */
        {"\xc3\xa9", 1},     /* cut by the length */
        {"\xc3\x28", 2},     /* bad continuation */
        {"\xe2\x28\xa1", 3},
        {"\xf0\x9f\x28\x80", 4},
        {"ok\xed\xa0\x80ok", 7}, /* a surrogate in the middle */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (tally_utf8_valid(bad[i].s, bad[i].len))
            fail_msg("bad case %zu accepted", i);
    }
}

static void test_json_pointer(void **state)
{
    (void)state;
    /* RFC 6901 §5, plus a key that needs ~01 */
    json_t *doc = parse("{\"foo\":[\"bar\",\"baz\"],\"\":0,\"a/b\":1,\"c%d\":2,\"e^f\":3,"
                        "\"g|h\":4,\"i\\\\j\":5,\"k\\\"l\":6,\" \":7,\"m~n\":8,\"~1\":9,"
                        "\"x\":{\"y\":[{\"z\":\"deep\"}]}}");
    assert_ptr_equal(tally_json_pointer(doc, ""), doc);
    json_t *foo = tally_json_pointer(doc, "/foo");
    assert_true(json_is_array(foo));
    assert_string_equal(json_string_value(tally_json_pointer(doc, "/foo/0")), "bar");
    assert_string_equal(json_string_value(tally_json_pointer(doc, "/foo/1")), "baz");
    static const struct {
        const char *ptr;
        json_int_t want;
    } ints[] = {
        {"/", 0},     {"/a~1b", 1}, {"/c%d", 2}, {"/e^f", 3},  {"/g|h", 4},
        {"/i\\j", 5}, {"/k\"l", 6}, {"/ ", 7},   {"/m~0n", 8}, {"/~01", 9},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        json_t *v = tally_json_pointer(doc, ints[i].ptr);
        if (!json_is_integer(v) || json_integer_value(v) != ints[i].want)
            fail_msg("pointer %s did not resolve to %lld", ints[i].ptr, (long long)ints[i].want);
    }
    assert_string_equal(json_string_value(tally_json_pointer(doc, "/x/y/0/z")), "deep");

    static const char *const unresolved[] = {
        "foo",                  /* must start with '/' */
        "/missing",   "/foo/2", /* past the end */
        "/foo/-",               /* the element after the last never exists */
        "/foo/01",              /* leading zero */
        "/foo/-1",    "/foo/+1",
        "/foo/1x",    "/foo/",
        "/foo/0/x",           /* into a string */
        "/m~2n",              /* bad escape */
        "/m~",        "/a/b", /* "a/b" needs ~1 */
        "/x/y/0/z/0", "/foo/18446744073709551616",
        "/x/y/0/",
    };
    for (size_t i = 0; i < sizeof unresolved / sizeof unresolved[0]; i++) {
        if (tally_json_pointer(doc, unresolved[i]) != NULL)
            fail_msg("pointer %s resolved but must not", unresolved[i]);
    }
    assert_null(tally_json_pointer(NULL, "/a"));
    assert_null(tally_json_pointer(doc, NULL));
    json_decref(doc);

    /* the receipt_ref use: the charge id of a receipt */
    json_t *receipt = parse("{\"id\":\"ch_1\",\"version\":3}");
    assert_string_equal(json_string_value(tally_json_pointer(receipt, "/id")), "ch_1");
    json_decref(receipt);
}

static void test_scalar_text(void **state)
{
    (void)state;
    static const struct {
        const char *json;
        const char *want; /* NULL: not a scalar */
    } cases[] = {
        {"\"pay_42\"", "pay_42"},
        {"\"\"", ""},
        {"42", "42"},
        {"-7", "-7"},
        {"9223372036854775807", "9223372036854775807"},
        {"2.5", "2.5"},
        {"0.1", "0.1"},
        {"3.0", "3.0"},
        {"true", "true"},
        {"false", "false"},
        {"null", NULL},
        {"{}", NULL},
        {"[1]", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        json_t *v = parse(cases[i].json);
        char *t = tally_json_scalar_text(v);
        if (cases[i].want == NULL) {
            assert_null(t);
        } else {
            assert_non_null(t);
            assert_string_equal(t, cases[i].want);
        }
        free(t);
        json_decref(v);
    }
    assert_null(tally_json_scalar_text(NULL));
}

/* tally_jtext writes what jansson's compact dump of the same object would: every kind of member,
 * nesting, null, escaping; and refuses text that is not UTF-8. */
static void test_jtext_matches_jansson(void **state)
{
    (void)state;
    const char *tricky = "q\"b\\ \b\f\n\r\t \x01 \x1f caf\xc3\xa9 /";
    json_t *nested = json_pack("{s:[i,s,n]}", "a", 1, "b");
    tally_jtext_t j = {0};
    tally_jtext_begin(&j, NULL);
    tally_jtext_str(&j, "s", tricky);
    tally_jtext_str(&j, "none", NULL);
    tally_jtext_int(&j, "i", -42);
    tally_jtext_bool(&j, "t", true);
    tally_jtext_bool(&j, "f", false);
    tally_jtext_real(&j, "r", 1.5, 1);
    tally_jtext_begin(&j, "o");
    tally_jtext_str(&j, "k", "v");
    tally_jtext_begin(&j, "empty");
    tally_jtext_end(&j);
    tally_jtext_end(&j);
    tally_jtext_raw(&j, "raw", "[1,2]");
    tally_jtext_raw(&j, "rawnull", NULL);
    tally_jtext_value(&j, "value", nested);
    tally_jtext_end(&j);
    char *got = tally_jtext_take(&j);
    assert_non_null(got);

    json_t *want = json_pack("{s:s, s:n, s:i, s:b, s:b, s:f, s:{s:s, s:{}}, s:[i,i], s:n, s:O}",
                             "s", tricky, "none", "i", -42, "t", 1, "f", 0, "r", 1.5, "o", "k", "v",
                             "empty", "raw", 1, 2, "rawnull", "value", nested);
    assert_non_null(want);
    char *want_text = json_dumps(want, JSON_COMPACT);
    assert_string_equal(got, want_text);
    json_t *back = json_loads(got, 0, NULL); /* and it is JSON */
    assert_non_null(back);
    assert_true(json_equal(back, want));
    json_decref(back);
    free(want_text);
    json_decref(want);
    json_decref(nested);
    free(got);
    /* the builder is empty again after take */
    assert_null(j.s);

    tally_jtext_begin(&j, NULL);
    tally_jtext_str(&j, "bad", "\xff\xfe");
    tally_jtext_end(&j);
    assert_null(tally_jtext_take(&j));
    assert_null(j.s);
    assert_false(j.failed);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_order_does_not_matter),
        cmocka_unit_test(test_nesting_and_arrays),
        cmocka_unit_test(test_keys_sort_bytewise),
        cmocka_unit_test(test_unicode_is_raw),
        cmocka_unit_test(test_control_characters_are_escaped),
        cmocka_unit_test(test_reals_shortest_round_trip),
        cmocka_unit_test(test_integers),
        cmocka_unit_test(test_sha256_vectors),
        cmocka_unit_test(test_canonical_refuses_what_it_cannot_write),
        cmocka_unit_test(test_utf8_valid),
        cmocka_unit_test(test_json_pointer),
        cmocka_unit_test(test_scalar_text),
        cmocka_unit_test(test_jtext_matches_jansson),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
