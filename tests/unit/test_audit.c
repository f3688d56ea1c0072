/* test_audit.c — the audit batch's parameter: an event's data given as members is the same
 * object its jansson form would be, strings escaped, absent members left out, numbers kept as
 * numbers; data that cannot be queued fails the batch with a reason. The rows are read back
 * from the statement's $1 (tally_audit_batch_param) as PostgreSQL's array_recv reads it. */
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

#include "columns_decode.h"

/* TALLY_AUDIT_INSERT's columns, in order */
static const char *const COLUMNS[] = {"event_id", "run_id",      "effect_id", "obligation_id",
                                      "kind",     "from_status", "to_status", "actor",
                                      "reason",   "data"};
#define N_COLUMNS (sizeof COLUMNS / sizeof COLUMNS[0])

static char *sent_data[8]; /* each row's data, as the parameter carries it (NULL: SQL NULL) */
static size_t n_sent_data;

static void clear_sent_data(void)
{
    for (size_t i = 0; i < n_sent_data; i++)
        free(sent_data[i]);
    n_sent_data = 0;
}

/* The batch's rows as objects of their columns, the data parsed (the caller decrefs). */
static json_t *flushed_rows(tally_audit_batch_t *b)
{
    clear_sent_data();
    const char *why = NULL;
    int len = -1;
    const char *param = tally_audit_batch_param(b, &len, &why);
    if (param == NULL)
        fail_msg("no parameter: %s", why);
    decoded_columns_t d;
    decode_columns(param, len, N_COLUMNS, &d);
    json_t *rows = json_array();
    for (size_t r = 0; r < d.n_rows; r++) {
        json_t *row = json_object();
        for (size_t c = 0; c + 1 < N_COLUMNS; c++) {
            const char *v = decoded_value(&d, c, r);
            json_object_set_new(row, COLUMNS[c], v ? json_string(v) : json_null());
        }
        const char *text = decoded_value(&d, N_COLUMNS - 1, r);
        assert_true(n_sent_data < sizeof sent_data / sizeof sent_data[0]);
        sent_data[n_sent_data++] = text ? strdup(text) : NULL;
        json_error_t jerr;
        json_t *data = json_null();
        if (text && (data = json_loads(text, JSON_DECODE_ANY, &jerr)) == NULL)
            fail_msg("data not JSON (%s): %s", jerr.text, text);
        json_object_set_new(row, "data", data);
        json_array_append_new(rows, row);
    }
    decoded_columns_free(&d);
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

/* tally_audit_move spells the move from the generated table and says whether the machine has
 * it; the event is queued either way (the database refuses the statement, not the event). */
static void test_a_move_is_checked_against_its_machine(void **st)
{
    (void)st;
    tally_audit_batch_t *b = tally_audit_batch_new();
    assert_non_null(b);
    tally_audit_event_t ev = {.run_id = "r", .effect_id = NULL, .actor = "test"};
    assert_true(tally_audit_move(b, TALLY_MACHINE_EFFECT, TALLY_EFFECT_DISPATCHING,
                                 TALLY_EFFECT_CONFIRMED, &ev));
    assert_true(tally_audit_move(b, TALLY_MACHINE_EFFECT, -1, TALLY_EFFECT_PLANNED, &ev));
    assert_true(tally_audit_move(b, TALLY_MACHINE_RUN, TALLY_RUN_COMPENSATED, TALLY_RUN_COMPENSATED,
                                 &ev)); /* a summary again: no move */
    assert_false(tally_audit_move(b, TALLY_MACHINE_EFFECT, TALLY_EFFECT_CONFIRMED,
                                  TALLY_EFFECT_PLANNED, &ev));
    assert_false(tally_audit_move(b, TALLY_MACHINE_EFFECT, -1, TALLY_EFFECT_CONFIRMED, &ev));
    assert_false(tally_audit_move(b, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_RESOLVED,
                                  TALLY_OBLIGATION_PENDING, &ev));
    assert_false(tally_audit_move(b, TALLY_MACHINE_RUN, TALLY_RUN__COUNT, TALLY_RUN_STUCK, &ev));
    assert_false(tally_audit_move(b, TALLY_MACHINE_ALERT, -1, TALLY_ALERT_RESOLVED, &ev));
    assert_int_equal(tally_audit_batch_len(b), 8);

    /* the rows say the move, spelled as the status columns are */
    int len = 0;
    const char *why = NULL;
    assert_non_null(tally_audit_batch_param(b, &len, &why));
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
    assert_int_equal(err.errc, TALLY_ERR_AUDIT);
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
        cmocka_unit_test(test_a_move_is_checked_against_its_machine),
        cmocka_unit_test(test_long_members_grow_the_scratch_space),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
