/* test_log.c — log lines are whole JSON objects with the fields on-call greps for, values are
 * escaped, levels below the minimum are dropped, and ids are well-formed random UUIDs. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "tally/id.h"
#include "tally/log.h"

/* Run @p fn with stderr sent to a temporary file; returns what was written (malloc'd). */
static char *capture(void (*fn)(void))
{
    fflush(stderr);
    FILE *tmp = tmpfile();
    assert_non_null(tmp);
    int saved = dup(STDERR_FILENO);
    assert_true(saved >= 0);
    assert_true(dup2(fileno(tmp), STDERR_FILENO) >= 0);
    fn();
    fflush(stderr);
    assert_true(dup2(saved, STDERR_FILENO) >= 0);
    close(saved);
    long n = ftell(tmp);
    assert_true(n >= 0);
    char *out = calloc(1, (size_t)n + 1);
    assert_non_null(out);
    rewind(tmp);
    assert_int_equal(fread(out, 1, (size_t)n, tmp), (size_t)n);
    fclose(tmp);
    return out;
}

/* The lines of @p text as parsed JSON objects (a JSON array, new reference). */
static json_t *lines_of(const char *text)
{
    json_t *all = json_array();
    const char *p = text;
    while (*p) {
        const char *nl = strchr(p, '\n');
        assert_non_null(nl); /* every line is terminated */
        json_error_t jerr;
        json_t *obj = json_loadb(p, (size_t)(nl - p), 0, &jerr);
        if (obj == NULL)
            fail_msg("not a JSON line: %.*s (%s)", (int)(nl - p), p, jerr.text);
        assert_true(json_is_object(obj));
        json_array_append_new(all, obj);
        p = nl + 1;
    }
    return all;
}

static void write_some(void)
{
    tally_log_init("dispatcher", "host-a:42", TALLY_LOG_INFO);
    TALLY_DEBUG("dropped below the minimum level");
    TALLY_INFO("claimed %d effects", 3);
    tally_log_ctx_t ctx = {.run_id = "run-1", .effect_id = "e-1", .tool = "charge_card"};
    TALLY_LOG(TALLY_LOG_WARN, &ctx, "quote \" backslash \\ newline \n tab \t done");
    TALLY_ERROR("bad byte \xff kept readable");
}

static void test_lines_are_json_with_fields_and_context(void **st)
{
    (void)st;
    char *text = capture(write_some);
    json_t *lines = lines_of(text);
    assert_int_equal(json_array_size(lines), 3);

    json_t *info = json_array_get(lines, 0);
    assert_string_equal(json_string_value(json_object_get(info, "level")), "info");
    assert_string_equal(json_string_value(json_object_get(info, "component")), "dispatcher");
    assert_string_equal(json_string_value(json_object_get(info, "worker")), "host-a:42");
    assert_string_equal(json_string_value(json_object_get(info, "msg")), "claimed 3 effects");
    assert_string_equal(json_string_value(json_object_get(info, "func")), "write_some");
    assert_true(json_integer_value(json_object_get(info, "line")) > 0);
    const char *ts = json_string_value(json_object_get(info, "ts"));
    assert_non_null(ts); /* 2026-11-22T00:12:43.123Z */
    assert_int_equal(strlen(ts), 24);
    assert_int_equal(ts[10], 'T');
    assert_int_equal(ts[23], 'Z');
    assert_null(json_object_get(info, "run_id"));

    json_t *warn = json_array_get(lines, 1);
    assert_string_equal(json_string_value(json_object_get(warn, "run_id")), "run-1");
    assert_string_equal(json_string_value(json_object_get(warn, "effect_id")), "e-1");
    assert_string_equal(json_string_value(json_object_get(warn, "tool")), "charge_card");
    assert_string_equal(json_string_value(json_object_get(warn, "msg")),
                        "quote \" backslash \\ newline \n tab \t done");

    json_t *err = json_array_get(lines, 2);
    assert_string_equal(json_string_value(json_object_get(err, "level")), "error");
    assert_non_null(strstr(json_string_value(json_object_get(err, "msg")), "kept readable"));
    json_decref(lines);
    free(text);
}

/* A failure that repeats every tick, as a worker sees PostgreSQL down: five in a row. */
static void write_repeating(void)
{
    tally_log_init("compensator", "host-b:7", TALLY_LOG_INFO);
    for (int i = 0; i < 5; i++)
        TALLY_LOG_REPEATING(TALLY_LOG_ERROR, NULL, "leasing obligations: attempt %d failed", i);
    tally_log_write_repeat(TALLY_LOG_WARN, "sweep", 7, NULL, 4, "reading counts failed");
    tally_log_write_repeat(TALLY_LOG_DEBUG, "sweep", 8, NULL, 9, "below the minimum level");
}

static void test_a_repeating_failure_is_written_once_then_with_what_was_left_out(void **st)
{
    (void)st;
    char *text = capture(write_repeating);
    json_t *lines = lines_of(text);
    assert_int_equal(json_array_size(lines), 2);
    json_t *first = json_array_get(lines, 0);
    assert_string_equal(json_string_value(json_object_get(first, "msg")),
                        "leasing obligations: attempt 0 failed");
    assert_string_equal(json_string_value(json_object_get(first, "level")), "error");
    assert_null(json_object_get(first, "left_out"));
    json_t *later = json_array_get(lines, 1);
    assert_string_equal(json_string_value(json_object_get(later, "msg")),
                        "reading counts failed (and 4 more like it since the last such line)");
    assert_int_equal(json_integer_value(json_object_get(later, "left_out")), 4);
    assert_string_equal(json_string_value(json_object_get(later, "func")), "sweep");
    json_decref(lines);
    free(text);
}

static void test_repeat_window_counts_what_it_leaves_out(void **st)
{
    (void)st;
    tally_log_repeat_t r = {0};
    unsigned left_out = 99;
    assert_true(tally_log_repeat_due(&r, 60000, &left_out)); /* the first is always written */
    assert_int_equal(left_out, 0);
    for (int i = 0; i < 3; i++)
        assert_false(tally_log_repeat_due(&r, 60000, &left_out));
    assert_true(tally_log_repeat_due(&r, 0, &left_out)); /* a window of 0 has passed */
    assert_int_equal(left_out, 3);
    assert_false(tally_log_repeat_due(&r, 60000, &left_out));
    assert_true(tally_log_repeat_due(&r, 0, &left_out));
    assert_int_equal(left_out, 1);
}

static void *log_from_thread(void *arg)
{
    for (int i = 0; i < 200; i++)
        TALLY_INFO("thread %ld line %d with some padding to make lines longer than a few bytes",
                   (long)(intptr_t)arg, i);
    return NULL;
}

static void write_from_threads(void)
{
    pthread_t t[8];
    for (long i = 0; i < 8; i++)
        assert_int_equal(pthread_create(&t[i], NULL, log_from_thread, (void *)(intptr_t)i), 0);
    for (int i = 0; i < 8; i++)
        pthread_join(t[i], NULL);
}

static void test_threads_never_interleave_lines(void **st)
{
    (void)st;
    tally_log_init("reconciler", "host-b:7", TALLY_LOG_INFO);
    char *text = capture(write_from_threads);
    json_t *lines = lines_of(text); /* fails on any torn line */
    assert_int_equal(json_array_size(lines), 8 * 200);
    json_decref(lines);
    free(text);
}

static void test_level_names_parse(void **st)
{
    (void)st;
    tally_log_level_t l;
    assert_true(tally_log_level_parse("debug", &l) && l == TALLY_LOG_DEBUG);
    assert_true(tally_log_level_parse("warn", &l) && l == TALLY_LOG_WARN);
    assert_false(tally_log_level_parse("verbose", &l));
    assert_false(tally_log_level_parse(NULL, &l));
}

static void test_uuids_are_random_v4_and_distinct(void **st)
{
    (void)st;
    enum { N = 2000 };
    static char ids[N][37];
    for (int i = 0; i < N; i++) {
        tally_uuid(ids[i]);
        const char *u = ids[i];
        assert_int_equal(strlen(u), 36);
        for (int j = 0; j < 36; j++) {
            if (j == 8 || j == 13 || j == 18 || j == 23)
                assert_int_equal(u[j], '-');
            else
                assert_non_null(strchr("0123456789abcdef", u[j]));
        }
        assert_int_equal(u[14], '4');           /* version 4: random */
        assert_non_null(strchr("89ab", u[19])); /* RFC 4122 variant */
    }
    for (int i = 0; i < N; i++)
        for (int j = i + 1; j < N; j++)
            assert_string_not_equal(ids[i], ids[j]);
}

static void test_time_ordered_uuids_sort_by_creation(void **st)
{
    (void)st;
    char a[37], b[37];
    tally_uuid_v7(a);
    struct timespec pause = {.tv_sec = 0, .tv_nsec = 3 * 1000 * 1000};
    nanosleep(&pause, NULL);
    tally_uuid_v7(b);
    assert_int_equal(strlen(a), 36);
    assert_int_equal(a[14], '7');
    assert_non_null(strchr("89ab", a[19]));
    assert_true(strcmp(a, b) < 0); /* later ids sort after earlier ones */
    assert_string_not_equal(a + 15, b + 15);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lines_are_json_with_fields_and_context),
        cmocka_unit_test(test_threads_never_interleave_lines),
        cmocka_unit_test(test_a_repeating_failure_is_written_once_then_with_what_was_left_out),
        cmocka_unit_test(test_repeat_window_counts_what_it_leaves_out),
        cmocka_unit_test(test_level_names_parse),
        cmocka_unit_test(test_uuids_are_random_v4_and_distinct),
        cmocka_unit_test(test_time_ordered_uuids_sort_by_creation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
