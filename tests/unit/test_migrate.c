/* test_migrate.c — the schema window: which binaries start on which ledger, and what the
 * refusal tells the operator to run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "tally/migrate.h"

static tally_schema_window_t window(int version, int serves_from, const char *release)
{
    tally_schema_window_t w;
    memset(&w, 0, sizeof w);
    w.version = version;
    w.serves_from = serves_from;
    snprintf(w.serves_from_release, sizeof w.serves_from_release, "%s", release);
    return w;
}

static void test_a_binary_runs_on_its_own_schema(void **state)
{
    (void)state;
    char msg[600];
    tally_schema_window_t w = window(16, 15, "0.1.0");
    assert_int_equal(tally_schema_fit(&w, 15, 16, "0.2.0", msg, sizeof msg), TALLY_SCHEMA_FITS);
}

static void test_a_new_binary_runs_on_the_previous_schema_inside_its_window(void **state)
{
    (void)state;
    char msg[600];
    tally_schema_window_t w = window(15, 15, "0.1.0");
    assert_int_equal(tally_schema_fit(&w, 15, 16, "0.2.0", msg, sizeof msg),
                     TALLY_SCHEMA_FITS_OLDER);
    assert_non_null(strstr(msg, "run `tally migrate` to finish the upgrade"));
}

static void test_an_old_binary_runs_on_a_newer_schema_that_still_serves_it(void **state)
{
    (void)state;
    char msg[600];
    tally_schema_window_t w = window(16, 15, "0.1.0");
    assert_int_equal(tally_schema_fit(&w, 15, 15, "0.1.0", msg, sizeof msg),
                     TALLY_SCHEMA_FITS_NEWER);
    assert_non_null(strstr(msg, "still serves this one"));
}

static void test_an_old_binary_outside_the_window_is_told_which_release_to_run(void **state)
{
    (void)state;
    char msg[600];
    tally_schema_window_t w = window(18, 17, "0.3.0");
    assert_int_equal(tally_schema_fit(&w, 15, 15, "0.1.0", msg, sizeof msg), TALLY_SCHEMA_TOO_NEW);
    assert_non_null(strstr(msg, "deploy tally 0.3.0 or newer"));
    assert_non_null(strstr(msg, "this is tally 0.1.0 (schema 15)"));
}

static void test_a_newer_schema_without_a_window_refuses(void **state)
{
    (void)state;
    char msg[600];
    tally_schema_window_t w = window(40, 0, "");
    assert_int_equal(tally_schema_fit(&w, 15, 16, "0.2.0", msg, sizeof msg), TALLY_SCHEMA_TOO_NEW);
    assert_non_null(strstr(msg, "records no window"));
}

static void test_a_schema_older_than_the_window_asks_for_migrate(void **state)
{
    (void)state;
    char msg[600];
    tally_schema_window_t w = window(14, 0, "");
    assert_int_equal(tally_schema_fit(&w, 15, 16, "0.2.0", msg, sizeof msg), TALLY_SCHEMA_TOO_OLD);
    assert_non_null(strstr(msg, "run `tally migrate` of tally 0.2.0 first"));
    w = window(0, 0, "");
    assert_int_equal(tally_schema_fit(&w, 15, 16, "0.2.0", msg, sizeof msg), TALLY_SCHEMA_TOO_OLD);
}

static void test_the_message_fits_any_buffer(void **state)
{
    (void)state;
    char msg[16];
    tally_schema_window_t w = window(18, 17, "0.3.0");
    assert_int_equal(tally_schema_fit(&w, 15, 15, "0.1.0", msg, sizeof msg), TALLY_SCHEMA_TOO_NEW);
    assert_int_equal(strlen(msg), sizeof msg - 1);
}

static void test_contract_steps_raise_the_window_and_expand_steps_do_not(void **state)
{
    (void)state;
    static const tally_migration_t list[] = {
        {15, "schema_window", "", 0}, {16, "add_column", "", 0}, {17, "drop_old_column", "", 16},
        {18, "add_index", "", 0},     {0, NULL, NULL, 0},
    };
    assert_int_equal(tally_migrations_serves_from_after(list, 15, 15), 15 + 1);
    assert_int_equal(tally_migrations_serves_from_after(list, 16, 15), 16);
    assert_int_equal(tally_migrations_serves_from_after(list, 17, 16), 16);
    assert_int_equal(tally_migrations_serves_from_after(list, 18, 16), 16);
    /* a window already raised further is never lowered */
    assert_int_equal(tally_migrations_serves_from_after(list, 15, 17), 17);
}

static void test_connected_processes_are_served_by_their_newest_schema(void **state)
{
    (void)state;
    tally_schema_session_t s;
    memset(&s, 0, sizeof s);
    assert_true(tally_migrate_parse_app_name("tally-dispatcher/0.1.0 (schema 15-15)", s.release,
                                             sizeof s.release, &s.oldest, &s.newest));
    assert_string_equal(s.release, "0.1.0");
    assert_int_equal(s.oldest, 15);
    assert_int_equal(s.newest, 15);
    assert_true(tally_schema_session_served(&s, 15));
    assert_false(tally_schema_session_served(&s, 16));
    /* a process of a release before the window is served by nothing it did not start on */
    s.newest = 0;
    assert_false(tally_schema_session_served(&s, 15));
}

static void test_application_names_parse_only_when_whole(void **state)
{
    (void)state;
    char rel[32];
    int lo = 0, hi = 0;
    assert_true(tally_migrate_parse_app_name("tally-compensator-pager/0.2.0 (schema 15-16)", rel,
                                             sizeof rel, &lo, &hi));
    assert_string_equal(rel, "0.2.0");
    assert_int_equal(lo, 15);
    assert_int_equal(hi, 16);
    static const char *const bad[] = {
        "tally-dispatcher",
        "tally-dispatcher/0.2.0",
        "tally-dispatcher/0.2.0 (schema 16-15)",
        "tally-dispatcher/0.2.0 (schema 15-16) extra",
        "tally-dispatcher/ (schema 15-16)",
        "psql/0.2.0 (schema 15-16)",
        "tally-dispatcher/0.2.0 (schema x-16)",
        "tally-dispatcher/0123456789012345678901234567890123456789 (schema 15-16)",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_false(tally_migrate_parse_app_name(bad[i], rel, sizeof rel, &lo, &hi));
}

static void test_the_last_release_is_this_binary(void **state)
{
    (void)state;
    const tally_release_t *last = NULL;
    int schema = 0;
    for (const tally_release_t *r = tally_releases; r->name != NULL; r++) {
        assert_true(r->schema >= schema); /* oldest first */
        schema = r->schema;
        last = r;
    }
    assert_non_null(last);
    assert_string_equal(last->name, TALLY_VERSION);
    assert_int_equal(last->schema, tally_migrate_latest());
    assert_int_equal(TALLY_SCHEMA_NEWEST, tally_migrate_latest());
    assert_true(TALLY_SCHEMA_OLDEST <= TALLY_SCHEMA_NEWEST);
    assert_string_equal(tally_migrate_release_of(15), "0.1.0");
    assert_null(tally_migrate_release_of(tally_migrate_latest() + 1));
    /* no step this binary ships stops serving the oldest schema it runs on itself */
    assert_true(tally_migrate_serves_from_after(0, 0) <= tally_migrate_latest());
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_binary_runs_on_its_own_schema),
        cmocka_unit_test(test_a_new_binary_runs_on_the_previous_schema_inside_its_window),
        cmocka_unit_test(test_an_old_binary_runs_on_a_newer_schema_that_still_serves_it),
        cmocka_unit_test(test_an_old_binary_outside_the_window_is_told_which_release_to_run),
        cmocka_unit_test(test_a_newer_schema_without_a_window_refuses),
        cmocka_unit_test(test_a_schema_older_than_the_window_asks_for_migrate),
        cmocka_unit_test(test_the_message_fits_any_buffer),
        cmocka_unit_test(test_contract_steps_raise_the_window_and_expand_steps_do_not),
        cmocka_unit_test(test_connected_processes_are_served_by_their_newest_schema),
        cmocka_unit_test(test_application_names_parse_only_when_whole),
        cmocka_unit_test(test_the_last_release_is_this_binary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
