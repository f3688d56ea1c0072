/* test_audit.c — the audit batch's parameter: an event's data given as members is the same
 * object its jansson form would be, strings escaped, absent members left out, numbers kept as
 * numbers; data that cannot be queued fails the batch with a reason. The rows are read as the
 * text of the statement's $1 (tally_audit_batch_text) and parsed back, with each row's data
 * from the bulk column (tally_audit_batch_bulk) decoded as PostgreSQL's array_recv reads it. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "tally/audit.h"

static const char *sent;   /* the text of $1, as the batch would send it */
static char *sent_data[8]; /* each row's data, as the bulk column carries it (NULL: SQL NULL) */
static size_t n_sent_data;

static int32_t be32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return (int32_t)ntohl(v);
}

static void clear_sent_data(void)
{
    for (size_t i = 0; i < n_sent_data; i++)
        free(sent_data[i]);
    n_sent_data = 0;
}

/* The bulk column: a one-dimensional text[] of one element per row, in array_recv's format. */
static void decode_bulk(tally_audit_batch_t *b, size_t rows)
{
    clear_sent_data();
    int len = -1;
    const unsigned char *p = (const unsigned char *)tally_audit_batch_bulk(b, &len);
    assert_non_null(p);
    assert_true(len >= 20);
    assert_int_equal(be32(p), 1);      /* dimensions */
    int32_t flags = be32(p + 4);       /* has nulls */
    assert_int_equal(be32(p + 8), 25); /* text */
    assert_int_equal(be32(p + 12), rows);
    assert_int_equal(be32(p + 16), 1); /* lower bound */
    size_t at = 20;
    bool nulls = false;
    for (size_t i = 0; i < rows; i++) {
        assert_true(at + 4 <= (size_t)len);
        int32_t n = be32(p + at);
        at += 4;
        assert_true(i < sizeof sent_data / sizeof sent_data[0]);
        if (n == -1) {
            nulls = true;
            sent_data[n_sent_data++] = NULL;
            continue;
        }
        assert_true(n >= 0 && at + (size_t)n <= (size_t)len);
        sent_data[n_sent_data++] = strndup((const char *)p + at, (size_t)n);
        at += (size_t)n;
    }
    assert_int_equal(at, len);
    assert_int_equal(flags, nulls ? 1 : 0);
}

/* The batch's rows, parsed, each with its data from the bulk column (the caller decrefs). */
static json_t *flushed_rows(tally_audit_batch_t *b)
{
    const char *why = NULL;
    sent = tally_audit_batch_text(b, &why);
    if (sent == NULL)
        fail_msg("no rows: %s", why);
    json_error_t jerr;
    json_t *rows = json_loads(sent, 0, &jerr);
    if (rows == NULL)
        fail_msg("not JSON (%s): %s", jerr.text, sent);
    assert_null(json_object_get(json_array_get(rows, 0), "data")); /* not in the JSON */
    decode_bulk(b, json_array_size(rows));
    for (size_t i = 0; i < json_array_size(rows); i++) {
        json_t *data = json_null();
        if (sent_data[i] && (data = json_loads(sent_data[i], JSON_DECODE_ANY, &jerr)) == NULL)
            fail_msg("data not JSON (%s): %s", jerr.text, sent_data[i]);
        json_object_set_new(json_array_get(rows, i), "data", data);
    }
    return rows;
}

static void test_members_are_the_object_jansson_would_build(void **st)
{
    (void)st;
    tally_audit_batch_t *b = tally_audit_batch_new();
    assert_non_null(b);
    const char *odd = "say \"hi\"\\\n\x01 caf\xc3\xa9 \xe2\x80\xa8/";
    const tally_audit_member_t members[] = {
        {"intent_id", odd, false},   {"traceparent", NULL, false}, /* absent: left out */
        {"lease_epoch", "42", true}, {"attempt", "1", true},       {"tool", "fake.charge", false},
    };
    tally_audit_event_t ev = {.kind = "transition",
                              .actor = "w1",
                              .to_status = "PLANNED",
                              .members = members,
                              .n_members = sizeof members / sizeof members[0]};
    tally_audit_batch_add(b, &ev);
    /* the same data as jansson: the form every other caller uses */
    json_t *data = json_pack("{s:s, s:I, s:i, s:s}", "intent_id", odd, "lease_epoch",
                             (json_int_t)42, "attempt", 1, "tool", "fake.charge");
    assert_non_null(data);
    tally_audit_event_t ev2 = {.kind = "transition", .actor = "w1", .data = data};
    tally_audit_batch_add(b, &ev2);
    /* no data at all, and an empty member list */
    tally_audit_event_t ev3 = {.kind = "lease", .actor = "w1"};
    tally_audit_batch_add(b, &ev3);
    tally_audit_event_t ev4 = {.kind = "lease", .actor = "w1", .members = members, .n_members = 0};
    tally_audit_batch_add(b, &ev4);
    assert_int_equal(tally_audit_batch_len(b), 4);

    json_t *rows = flushed_rows(b);
    assert_int_equal(json_array_size(rows), 4);
    json_t *got = json_object_get(json_array_get(rows, 0), "data");
    assert_true(json_equal(got, data));
    assert_true(json_equal(json_object_get(json_array_get(rows, 1), "data"), data));
    assert_true(json_is_null(json_object_get(json_array_get(rows, 2), "data")));
    json_t *empty = json_object_get(json_array_get(rows, 3), "data");
    assert_true(json_is_object(empty) && json_object_size(empty) == 0);
    /* in the order given, compact, and escaped as jansson escapes (a newline as \n) */
    assert_string_equal(sent_data[0], "{\"intent_id\":\"say \\\"hi\\\"\\\\\\n\\u0001 caf"
                                      "\xc3\xa9 \xe2\x80\xa8/\",\"lease_epoch\":42,\"attempt\":1,"
                                      "\"tool\":\"fake.charge\"}");
    assert_null(sent_data[2]);
    assert_string_equal(json_string_value(json_object_get(json_array_get(rows, 0), "kind")),
                        "transition");
    json_decref(rows);
    json_decref(data);
    clear_sent_data();
    tally_audit_batch_free(b);
}

static void test_members_that_are_not_utf8_fail_the_batch(void **st)
{
    (void)st;
    tally_audit_batch_t *b = tally_audit_batch_new();
    assert_non_null(b);
    const tally_audit_member_t members[] = {{"intent_id", "\xff\xfe", false}};
    tally_audit_event_t ev = {
        .kind = "transition", .actor = "w1", .members = members, .n_members = 1};
    tally_audit_batch_add(b, &ev);
    tally_error_t err;
    assert_false(tally_audit_batch_flush(b, NULL, &err));
    assert_string_equal(err.code, "audit");
    assert_non_null(strstr(err.message, "not UTF-8"));
    tally_audit_batch_free(b);
}

static void test_long_members_grow_the_scratch_space(void **st)
{
    (void)st;
    tally_audit_batch_t *b = tally_audit_batch_new();
    assert_non_null(b);
    size_t n = 20000;
    char *big = malloc(n + 1);
    assert_non_null(big);
    for (size_t i = 0; i < n; i++)
        big[i] = i % 7 == 0 ? '"' : (char)('a' + i % 26);
    big[n] = '\0';
    const tally_audit_member_t members[] = {{"big", big, false}};
    tally_audit_event_t ev = {
        .kind = "transition", .actor = "w1", .members = members, .n_members = 1};
    tally_audit_batch_add(b, &ev);
    json_t *rows = flushed_rows(b);
    json_t *data = json_object_get(json_array_get(rows, 0), "data");
    assert_string_equal(json_string_value(json_object_get(data, "big")), big);
    json_decref(rows);
    clear_sent_data();
    free(big);
    tally_audit_batch_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_members_are_the_object_jansson_would_build),
        cmocka_unit_test(test_members_that_are_not_utf8_fail_the_batch),
        cmocka_unit_test(test_long_members_grow_the_scratch_space),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
