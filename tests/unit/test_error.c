/* test_error.c — the error codes' table (names, retriable, fatal), the typed setters, the
 * SQLSTATE kept apart, and the former text setter read into the same codes. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "tally/error.h"

static void test_table_names_unique_and_parse_back(void **state)
{
    (void)state;
    for (int e = TALLY_ERR_NONE + 1; e < TALLY_ERR__COUNT; e++) {
        const char *name = tally_errc_name((tally_errc_t)e);
        assert_non_null(name);
        assert_true(name[0] != '\0');
        assert_true(strlen(name) < sizeof(((tally_error_t *)0)->code));
        tally_errc_t back = TALLY_ERR_NONE;
        assert_true(tally_errc_parse(name, &back));
        assert_int_equal(back, e);
        for (int f = e + 1; f < TALLY_ERR__COUNT; f++)
            assert_string_not_equal(name, tally_errc_name((tally_errc_t)f));
    }
    tally_errc_t x;
    assert_false(tally_errc_parse("no_such_code", &x));
    assert_false(tally_errc_parse(NULL, &x));
    assert_true(tally_errc_parse("oom", &x));
    assert_int_equal(x, TALLY_ERR_OOM);
    assert_false(tally_errc_parse("out_of_memory", &x)); /* the spelling before the table */
    assert_string_equal(tally_errc_name(TALLY_ERR_NONE), "none");
    assert_string_equal(tally_errc_name((tally_errc_t)999), "error");
}

/* The codes whose names other systems read (ledger error_code, audit events, tests) keep the
 * names they had as free text. */
static void test_names_are_the_former_codes(void **state)
{
    (void)state;
    static const struct {
        tally_errc_t errc;
        const char *name;
    } rows[] = {
        {TALLY_ERR_OOM, "oom"},
        {TALLY_ERR_CURL, "curl"},
        {TALLY_ERR_CAPACITY, "capacity"},
        {TALLY_ERR_SECRET_MISSING, "secret_missing"},
        {TALLY_ERR_INVALID_HEADER, "invalid_header"},
        {TALLY_ERR_NO_ENDPOINT, "no_endpoint"},
        {TALLY_ERR_SIGNATURE, "signature"},
        {TALLY_ERR_INVALID_TEXT, "invalid_text"},
        {TALLY_ERR_INVALID_FIELD, "invalid_field"},
        {TALLY_ERR_MISSING_OPERATION_KEY, "missing_operation_key"},
        {TALLY_ERR_SCHEMA_TOO_NEW, "schema_too_new"},
        {TALLY_ERR_PG_CLIENT, "pg_client"},
        {TALLY_ERR_CONFLICT, "conflict"},
        {TALLY_ERR_NOT_FOUND, "not_found"},
        {TALLY_ERR_ALERT, "alert"},
        {TALLY_ERR_AUDIT, "audit"},
        {TALLY_ERR_OUTBOX, "outbox"},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        assert_string_equal(tally_errc_name(rows[i].errc), rows[i].name);
}

static void test_retriable_and_fatal_columns(void **state)
{
    (void)state;
    assert_true(tally_errc_retriable(TALLY_ERR_OOM));
    assert_true(tally_errc_retriable(TALLY_ERR_CAPACITY));
    assert_true(tally_errc_retriable(TALLY_ERR_SECRET_MISSING));
    assert_true(tally_errc_retriable(TALLY_ERR_PG_CONNECTION));
    assert_false(tally_errc_retriable(TALLY_ERR_INVALID_HEADER));
    assert_false(tally_errc_retriable(TALLY_ERR_NO_ENDPOINT));
    assert_false(tally_errc_retriable(TALLY_ERR_NONE));
    assert_true(tally_errc_fatal(TALLY_ERR_SCHEMA_TOO_NEW));
    assert_true(tally_errc_fatal(TALLY_ERR_KAFKA_FATAL));
    assert_false(tally_errc_fatal(TALLY_ERR_OOM));
    /* nothing is both: a fatal error is not worth retrying */
    for (int e = 0; e < TALLY_ERR__COUNT; e++)
        assert_false(tally_errc_fatal((tally_errc_t)e) && tally_errc_retriable((tally_errc_t)e));
}

static void test_setc(void **state)
{
    (void)state;
    tally_error_t err;
    tally_error_clear(&err);
    assert_int_equal(err.errc, TALLY_ERR_NONE);
    assert_false(tally_error_retriable(&err));
    tally_error_setc(&err, TALLY_ERR_CAPACITY, "no room for %d more", 3);
    assert_int_equal(err.errc, TALLY_ERR_CAPACITY);
    assert_string_equal(err.code, "capacity");
    assert_string_equal(err.sqlstate, "");
    assert_string_equal(err.message, "no room for 3 more");
    assert_true(tally_error_retriable(&err));
    assert_false(tally_error_fatal(&err));

    tally_error_setc_retriable(&err, TALLY_ERR_OOM, false, "cannot build %s", "x");
    assert_int_equal(err.errc, TALLY_ERR_OOM);
    assert_string_equal(err.code, "oom");
    assert_false(err.retriable);

    tally_error_setc(&err, TALLY_ERR_SCHEMA_TOO_NEW, "v%d", 9);
    assert_true(tally_error_fatal(&err));
    assert_false(tally_error_retriable(&err));

    /* NULL is allowed and ignored */
    tally_error_setc(NULL, TALLY_ERR_OOM, "x");
    tally_error_set_pg(NULL, "40001", true, "x");
    assert_false(tally_error_retriable(NULL));
    assert_false(tally_error_fatal(NULL));
}

static void test_set_pg_keeps_the_sqlstate(void **state)
{
    (void)state;
    tally_error_t err;
    tally_error_clear(&err);
    tally_error_set_pg(&err, "23505", false, "duplicate key value violates %s", "x_pkey");
    assert_int_equal(err.errc, TALLY_ERR_PG);
    assert_string_equal(err.sqlstate, "23505");
    assert_string_equal(err.code, "23505");
    assert_false(err.retriable);

    tally_error_set_pg(&err, "08006", true, "PostgreSQL connection lost");
    assert_int_equal(err.errc, TALLY_ERR_PG_CONNECTION);
    assert_string_equal(err.sqlstate, "08006");
    assert_true(err.retriable);

    tally_error_set_pg(&err, "57P01", true, "terminating connection due to administrator command");
    assert_int_equal(err.errc, TALLY_ERR_PG_CONNECTION);

    tally_error_set_pg(&err, NULL, true, "no SQLSTATE");
    assert_int_equal(err.errc, TALLY_ERR_PG_CONNECTION);
    assert_string_equal(err.sqlstate, "08006");

    assert_true(tally_sqlstate_retriable("40001"));
    assert_true(tally_sqlstate_retriable("40P01"));
    assert_true(tally_sqlstate_retriable("08001"));
    assert_true(tally_sqlstate_retriable("57P03"));
    assert_false(tally_sqlstate_retriable("57P04"));
    assert_true(tally_sqlstate_retriable("57014")); /* statement_timeout (pg.h) */
    assert_false(tally_sqlstate_retriable("23505"));
    assert_false(tally_sqlstate_retriable(NULL));
}

/* The message quotes outside text: it is cut whole and stays valid UTF-8. */
static void test_message_cut_on_a_character(void **state)
{
    (void)state;
    char big[2000];
    memset(big, 0, sizeof big);
    for (size_t i = 0; i + 2 < sizeof big - 1; i += 2)
        memcpy(big + i, "\xc3\xa9", 2); /* é */
    tally_error_t err;
    tally_error_setc(&err, TALLY_ERR_INVALID_FIELD, "x%s", big);
    size_t n = strlen(err.message);
    assert_true(n < sizeof err.message);
    assert_true(memcmp(err.message + n - 3, "...", 3) == 0);
    /* no lone lead byte before the dots */
    assert_true((unsigned char)err.message[n - 4] != 0xc3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table_names_unique_and_parse_back),
        cmocka_unit_test(test_names_are_the_former_codes),
        cmocka_unit_test(test_retriable_and_fatal_columns),
        cmocka_unit_test(test_setc),
        cmocka_unit_test(test_set_pg_keeps_the_sqlstate),
        cmocka_unit_test(test_message_cut_on_a_character),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
