/* test_columns.c — the columns parameter (columns.h) is the two-dimensional text[] PostgreSQL's
 * array_recv reads: [column][row], NULLs flagged, an empty array for no rows; a row that is
 * not whole, or holds text that is not UTF-8, is taken back out; the memory is kept across
 * batches. And the rows a statement returns find their batch items, by id or by place. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/columns.h"

#include "columns_decode.h"

static void add_row(tally_columns_t *c, const char *a, const char *b, const char *x)
{
    assert_true(tally_columns_row_begin(c));
    assert_true(tally_columns_text(c, a));
    assert_true(tally_columns_text(c, b));
    assert_true(tally_columns_text(c, x));
    assert_true(tally_columns_row_end(c, true));
}

static void test_rows_become_columns(void **st)
{
    (void)st;
    tally_columns_t c = {0};
    tally_columns_init(&c, 3);
    add_row(&c, "a1", "b1", "");
    add_row(&c, "a2", NULL, "caf\xc3\xa9 \"quoted\" \\ \n");
    assert_int_equal(c.n, 2);
    int len = 0;
    const char *p = tally_columns_param(&c, &len);
    /* byte for byte: the header, then column 1 of both rows, column 2, column 3 */
    const char want[] = "\0\0\0\2"
                        "\0\0\0\1"   /* has nulls */
                        "\0\0\0\x19" /* text */
                        "\0\0\0\3\0\0\0\1"
                        "\0\0\0\2\0\0\0\1"
                        "\0\0\0\2a1\0\0\0\2a2"
                        "\0\0\0\2b1\xff\xff\xff\xff"
                        "\0\0\0\0\0\0\0\x12"
                        "caf\xc3\xa9 \"quoted\" \\ \n";
    assert_int_equal(len, sizeof want - 1);
    assert_memory_equal(p, want, sizeof want - 1);
    decoded_columns_t d;
    decode_columns(p, len, 3, &d);
    assert_int_equal(d.n_rows, 2);
    assert_string_equal(decoded_value(&d, 0, 1), "a2");
    assert_null(decoded_value(&d, 1, 1));
    assert_string_equal(decoded_value(&d, 2, 0), "");
    decoded_columns_free(&d);
    tally_columns_release(&c);
}

static void test_no_rows_is_an_empty_array(void **st)
{
    (void)st;
    tally_columns_t c = {0};
    tally_columns_init(&c, 4);
    int len = -1;
    const char *p = tally_columns_param(&c, &len);
    assert_int_equal(len, 12);
    assert_memory_equal(p, "\0\0\0\0\0\0\0\0\0\0\0\x19", 12);
    /* a row taken back out leaves the batch as it was, nulls flag included */
    assert_true(tally_columns_row_begin(&c));
    assert_true(tally_columns_text(&c, NULL));
    assert_false(tally_columns_row_end(&c, false));
    p = tally_columns_param(&c, &len);
    assert_int_equal(len, 12);
    assert_memory_equal(p, "\0\0\0\0\0\0\0\0\0\0\0\x19", 12);
    tally_columns_release(&c);
}

/* Text that is not UTF-8 fails the batch, naming the value, so that a caller can tell text
 * PostgreSQL would refuse from memory running out. */
static void test_text_that_is_not_utf8_fails_the_batch_saying_so(void **st)
{
    (void)st;
    tally_columns_t c = {0};
    tally_columns_init(&c, 2);
    assert_true(tally_columns_row_begin(&c));
    assert_true(tally_columns_text(&c, "fine"));
    assert_true(tally_columns_text(&c, "fine"));
    assert_true(tally_columns_row_end(&c, true));
    assert_true(tally_columns_row_begin(&c));
    assert_true(tally_columns_text(&c, "fine"));
    assert_false(tally_columns_text(&c, "caf\xc3")); /* a cut character */
    assert_false(tally_columns_row_end(&c, false));
    assert_true(c.failed);
    assert_string_equal(c.why, "column 2 of row 2 is not valid UTF-8");
    int len = 0;
    assert_null(tally_columns_param(&c, &len));
    tally_columns_release(&c);
}

static void test_a_row_must_be_whole_and_utf8(void **st)
{
    (void)st;
    tally_columns_t c = {0};
    tally_columns_init(&c, 2);
    assert_true(tally_columns_row_begin(&c));
    assert_true(tally_columns_text(&c, "kept"));
    assert_true(tally_columns_text(&c, "kept"));
    assert_false(tally_columns_text(&c, "a third value")); /* the row is full */
    assert_true(tally_columns_row_end(&c, true));
    /* too short: taken back out */
    assert_true(tally_columns_row_begin(&c));
    assert_true(tally_columns_text(&c, "short"));
    assert_false(tally_columns_row_end(&c, true));
    /* the caller's failure of a row it could not finish */
    assert_true(tally_columns_row_begin(&c));
    assert_true(tally_columns_text(&c, NULL));
    assert_false(tally_columns_row_end(&c, false));
    assert_int_equal(c.n, 1);
    int len = 0;
    decoded_columns_t d;
    const char *p = tally_columns_param(&c, &len);
    decode_columns(p, len, 2, &d);
    assert_int_equal(d.n_rows, 1);
    assert_string_equal(decoded_value(&d, 0, 0), "kept");
    assert_string_equal(decoded_value(&d, 1, 0), "kept");
    decoded_columns_free(&d);
    /* a value outside a row, or a row end without a row, changes nothing */
    assert_false(tally_columns_text(&c, "stray"));
    assert_false(tally_columns_row_end(&c, true));
    assert_int_equal(c.n, 1);
    /* once failed, nothing more goes in and there is no parameter */
    tally_columns_fail(&c, "first reason");
    tally_columns_fail(&c, "second reason");
    assert_string_equal(c.why, "first reason");
    assert_false(tally_columns_row_begin(&c));
    assert_null(tally_columns_param(&c, &len));
    assert_int_equal(len, 0);
    /* reset: a new batch, the failure gone, the memory kept */
    size_t cap = c.col[0].cap;
    tally_columns_reset(&c);
    assert_int_equal(c.n, 0);
    assert_false(c.failed);
    assert_true(cap > 0);
    assert_int_equal(c.col[0].cap, cap);
    assert_true(tally_columns_row_begin(&c));
    assert_true(tally_columns_text(&c, "again"));
    assert_true(tally_columns_text(&c, NULL));
    assert_true(tally_columns_row_end(&c, true));
    p = tally_columns_param(&c, &len);
    decode_columns(p, len, 2, &d);
    assert_int_equal(d.n_rows, 1);
    assert_string_equal(decoded_value(&d, 0, 0), "again");
    assert_null(decoded_value(&d, 1, 0));
    decoded_columns_free(&d);
    tally_columns_release(&c);
}

/* A result as libpq would hand it back: @p n_cols text columns (at most 2), @p rows rows,
 * values[row][col] (NULL for SQL NULL). */
static PGresult *fake_result(int n_cols, int rows, const char *const values[][2])
{
    PGresult *res = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);
    assert_non_null(res);
    PGresAttDesc attrs[2];
    memset(attrs, 0, sizeof attrs);
    attrs[0].name = (char *)"id";
    attrs[1].name = (char *)"other";
    for (int k = 0; k < n_cols; k++)
        attrs[k].typid = 25;
    assert_true(PQsetResultAttrs(res, n_cols, attrs));
    for (int r = 0; r < rows; r++)
        for (int k = 0; k < n_cols; k++)
            assert_true(PQsetvalue(res, r, k, (char *)values[r][k],
                                   values[r][k] ? (int)strlen(values[r][k]) : -1));
    return res;
}

static void test_returned_rows_find_their_items_by_id(void **st)
{
    (void)st;
    /* the batch in its own order; the statement answers in another, skips one (a lost
     * compare-and-set), and names what is not in the batch */
    const char *keys[] = {"c-3", "a-1", NULL, "b-2", "d-4"};
    const char *const values[][2] = {{"b-2", "x"}, {"d-4", "x"}, {"zz", "x"},
                                     {NULL, "x"},  {"c-3", "x"}, {"", "x"}};
    PGresult *res = fake_result(2, 6, values);
    size_t *pos = tally_columns_positions(res, 0, keys, 5);
    assert_non_null(pos);
    assert_int_equal(pos[0], 3);
    assert_int_equal(pos[1], 4);
    assert_int_equal(pos[2], SIZE_MAX); /* not in the batch */
    assert_int_equal(pos[3], SIZE_MAX); /* SQL NULL */
    assert_int_equal(pos[4], 0);
    assert_int_equal(pos[5], SIZE_MAX); /* "" is not the NULL key of item 2 */
    free(pos);
    /* a column the result does not have names nothing */
    pos = tally_columns_positions(res, 7, keys, 5);
    assert_non_null(pos);
    for (int r = 0; r < 6; r++)
        assert_int_equal(pos[r], SIZE_MAX);
    free(pos);
    PQclear(res);
}

static void test_returned_rows_find_their_items_by_place(void **st)
{
    (void)st;
    const char *const values[][2] = {{"2", "x"},  {"0", "x"},  {"3", "x"},
                                     {"-1", "x"}, {"1a", "x"}, {"18446744073709551617", "x"},
                                     {NULL, "x"}};
    PGresult *res = fake_result(2, 7, values);
    size_t *pos = tally_columns_positions(res, 0, NULL, 3);
    assert_non_null(pos);
    assert_int_equal(pos[0], 2);
    assert_int_equal(pos[1], 0);
    for (int r = 2; r < 7; r++)
        assert_int_equal(pos[r], SIZE_MAX); /* outside the batch, not a place, or NULL */
    free(pos);
    PQclear(res);
    /* no rows: an empty answer, still something to free */
    res = PQmakeEmptyPGresult(NULL, PGRES_TUPLES_OK);
    pos = tally_columns_positions(res, 0, NULL, 3);
    assert_non_null(pos);
    free(pos);
    PQclear(res);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_become_columns),
        cmocka_unit_test(test_no_rows_is_an_empty_array),
        cmocka_unit_test(test_a_row_must_be_whole_and_utf8),
        cmocka_unit_test(test_text_that_is_not_utf8_fails_the_batch_saying_so),
        cmocka_unit_test(test_returned_rows_find_their_items_by_id),
        cmocka_unit_test(test_returned_rows_find_their_items_by_place),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
