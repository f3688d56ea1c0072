/* test_recordset.c — the text of a json_to_recordset parameter that the audit and outbox
 * batches build: rows numbered in order, strings escaped, a row that cannot be added taken
 * back out, and the first failure reported by flush; and the bulk column beside it, byte for
 * byte the binary text[] that PostgreSQL's array_recv reads, one element per row. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <stdint.h>
#include <string.h>

#include "tally/recordset.h"

/* The text so far, as flush would send it (flush adds the closing bracket). */
static void assert_text(const tally_recordset_t *rs, const char *want)
{
    assert_int_equal(rs->len, strlen(want));
    assert_memory_equal(rs->text, want, rs->len);
}

/* The bulk parameter's bytes against @p want, built here field by field: (length, bytes) per
 * element, -1 for NULL. */
static void assert_bulk(tally_recordset_t *rs, int32_t dims, int32_t flags, int32_t n,
                        const char *const *values, size_t n_values)
{
    unsigned char want[512];
    size_t at = 0;
    int32_t head[5] = {dims, flags, 25, n, 1};
    for (size_t i = 0; i < (dims ? 5u : 3u); i++) {
        uint32_t be = htonl((uint32_t)head[i]);
        memcpy(want + at, &be, 4);
        at += 4;
    }
    for (size_t i = 0; i < n_values; i++) {
        int32_t len = values[i] ? (int32_t)strlen(values[i]) : -1;
        uint32_t be = htonl((uint32_t)len);
        memcpy(want + at, &be, 4);
        at += 4;
        if (len > 0) {
            memcpy(want + at, values[i], (size_t)len);
            at += (size_t)len;
        }
    }
    int len = -1;
    const char *got = tally_recordset_bulk_param(rs, &len);
    assert_non_null(got);
    assert_int_equal(len, at);
    assert_memory_equal(got, want, at);
}

static void test_the_bulk_column_has_one_element_per_row(void **st)
{
    (void)st;
    tally_recordset_t rs = {0};
    assert_bulk(&rs, 0, 0, 0, NULL, 0); /* no rows: an empty array */

    assert_true(tally_recordset_row_begin(&rs));
    assert_true(tally_recordset_bulk(&rs, "{\"say\":\"hi\\n\"}"));
    assert_false(tally_recordset_bulk(&rs, "twice")); /* one value per row */
    assert_true(tally_recordset_row_end(&rs, true));
    assert_true(tally_recordset_row_begin(&rs)); /* no value: SQL NULL */
    assert_true(tally_recordset_text(&rs, "k", "v"));
    assert_true(tally_recordset_row_end(&rs, true));
    assert_true(tally_recordset_row_begin(&rs)); /* taken back out with its value */
    assert_true(tally_recordset_bulk(&rs, "dropped"));
    assert_false(tally_recordset_row_end(&rs, false));
    assert_true(tally_recordset_row_begin(&rs));
    assert_false(tally_recordset_bulk(&rs, "\xff not UTF-8"));
    assert_false(tally_recordset_row_end(&rs, false));
    assert_true(tally_recordset_row_begin(&rs));
    assert_true(tally_recordset_bulk(&rs, ""));
    assert_true(tally_recordset_row_end(&rs, true));
    assert_int_equal(rs.n, 3);
    const char *const values[] = {"{\"say\":\"hi\\n\"}", NULL, ""};
    assert_bulk(&rs, 1, 1, 3, values, 3);

    /* flush (without a connection here: the batch failed) empties the column too */
    tally_recordset_fail(&rs, "stop");
    tally_error_t err;
    assert_false(tally_recordset_flush(&rs, NULL, "SELECT 1", "audit", &err));
    assert_bulk(&rs, 0, 0, 0, NULL, 0);
    assert_true(tally_recordset_row_begin(&rs)); /* a NULL taken back out leaves no null */
    assert_true(tally_recordset_bulk(&rs, NULL));
    assert_false(tally_recordset_bulk(&rs, "and then a value"));
    assert_false(tally_recordset_row_end(&rs, false));
    assert_true(tally_recordset_row_begin(&rs));
    assert_true(tally_recordset_bulk(&rs, "again"));
    assert_true(tally_recordset_row_end(&rs, true));
    const char *const again[] = {"again"};
    assert_bulk(&rs, 1, 0, 1, again, 1); /* no nulls: flags 0 */
    assert_true(tally_recordset_row_begin(&rs));
    assert_true(tally_recordset_bulk(&rs, NULL));
    assert_true(tally_recordset_row_end(&rs, true));
    const char *const with_null[] = {"again", NULL};
    assert_bulk(&rs, 1, 1, 2, with_null, 2);
    tally_recordset_release(&rs);
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
        cmocka_unit_test(test_the_bulk_column_has_one_element_per_row),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
