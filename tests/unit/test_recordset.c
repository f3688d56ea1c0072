/* test_recordset.c — the text of a json_to_recordset parameter that the audit and outbox
 * batches build: rows numbered in order, strings escaped, a row that cannot be added taken
 * back out, and the first failure reported by flush. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "tally/recordset.h"

/* The text so far, as flush would send it (flush adds the closing bracket). */
static void assert_text(const tally_recordset_t *rs, const char *want)
{
    assert_int_equal(rs->len, strlen(want));
    assert_memory_equal(rs->text, want, rs->len);
}

static void test_rows_are_numbered_and_strings_escaped(void **st)
{
    (void)st;
    tally_recordset_t rs = {0};
    assert_true(tally_recordset_row_begin(&rs));
    assert_true(tally_recordset_text(&rs, "kind", "say \"hi\"\\\n"));
    assert_true(tally_recordset_text(&rs, "reason", NULL));
    assert_true(tally_recordset_json(&rs, "data", "{\"a\":[1,2]}"));
    assert_true(tally_recordset_row_end(&rs, true));
    assert_true(tally_recordset_row_begin(&rs));
    assert_true(tally_recordset_json(&rs, "data", NULL));
    assert_true(tally_recordset_row_end(&rs, true));
    assert_int_equal(rs.n, 2);
    assert_text(&rs, "[{\"n\":0,\"kind\":\"say \\\"hi\\\"\\\\\\u000a\",\"reason\":null,"
                     "\"data\":{\"a\":[1,2]}},{\"n\":1,\"data\":null}");
    assert_false(rs.failed);
    tally_recordset_release(&rs);
}

static void test_a_row_that_fails_is_taken_back_out(void **st)
{
    (void)st;
    tally_recordset_t rs = {0};
    assert_true(tally_recordset_row_begin(&rs));
    assert_true(tally_recordset_text(&rs, "k", "kept"));
    assert_true(tally_recordset_row_end(&rs, true));
    assert_true(tally_recordset_row_begin(&rs));
    assert_false(tally_recordset_text(&rs, "k", "\xff not UTF-8"));
    assert_false(tally_recordset_row_end(&rs, false));
    assert_int_equal(rs.n, 1);
    assert_text(&rs, "[{\"n\":0,\"k\":\"kept\"}");
    /* no row open: ending one takes nothing out */
    assert_false(tally_recordset_row_end(&rs, false));
    assert_text(&rs, "[{\"n\":0,\"k\":\"kept\"}");
    tally_recordset_release(&rs);
}

static void test_flush_reports_the_first_failure_and_empties_the_batch(void **st)
{
    (void)st;
    tally_recordset_t rs = {0};
    assert_true(tally_recordset_row_begin(&rs));
    assert_true(tally_recordset_row_end(&rs, true));
    tally_recordset_fail(&rs, "the event for topic '%s' has no id", "alerts");
    tally_recordset_fail(&rs, "a later reason");
    tally_error_t err;
    /* a failed batch is not written: no connection is needed to refuse it */
    assert_false(tally_recordset_flush(&rs, NULL, "SELECT 1", "outbox", &err));
    assert_string_equal(err.code, "outbox");
    assert_false(err.retriable);
    assert_string_equal(err.message,
                        "outbox batch not written: the event for topic 'alerts' has no id");
    assert_int_equal(rs.n, 0);
    assert_int_equal(rs.len, 0);
    assert_false(rs.failed);
    /* empty: a no-op that needs no connection either */
    assert_true(tally_recordset_flush(&rs, NULL, "SELECT 1", "outbox", &err));
    tally_recordset_release(&rs);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_are_numbered_and_strings_escaped),
        cmocka_unit_test(test_a_row_that_fails_is_taken_back_out),
        cmocka_unit_test(test_flush_reports_the_first_failure_and_empties_the_batch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
