/* columns.h — the rows of a batch as ONE binary parameter: a two-dimensional text[] holding a
 * row of the array per column, built row by row, and the SQL that takes it apart.
 *
 * json_to_recordset costs PostgreSQL 15 about 3 µs for a row of ten fields: the parameter is
 * lexed once to check it is JSON and again to read it, every string is copied one character
 * at a time, and each row's fields go through a hash table. A binary array is read with no
 * lexing: each element is a length and its bytes. Sliced by its first dimension
 * ((p)[k:k] is column k, every row) and zipped by unnest, the same batch costs under 1 µs a
 * row. Values are text; the SQL casts the columns that are not.
 *
 * The planner cannot count the rows of a prepared statement's parameter: its generic plan,
 * used after five executions, guesses 10 for an unnest of one (json_to_recordset: 100). Where
 * a plan hinges on the batch size, zip the columns with generate_series(1, n) in a ROWS FROM,
 * which it guesses at 1,000 (dispatcher/deliver.c, RECORDED_ROWS). */
#ifndef TALLY_COLUMNS_H
#define TALLY_COLUMNS_H

#include <stdbool.h>
#include <stddef.h>

#include "tally/error.h"

#define TALLY_COLUMNS_MAX 16

/**
 * @brief A batch of rows of text values, kept column by column. Zero-initialise, then
 * tally_columns_init. Sticky failure (out of memory, text that is not UTF-8, a row of the
 * wrong width): the row is taken back out, @c failed is set with the first reason in @c why,
 * and tally_columns_param returns NULL until tally_columns_reset.
 */
typedef struct tally_columns {
    size_t n_cols;
    struct tally_column {
        char *buf; /* the elements: a big-endian int32 length (-1 for NULL), then the bytes */
        size_t len, cap, row_start;
    } col[TALLY_COLUMNS_MAX];
    size_t n;       /* complete rows */
    size_t at;      /* the column the open row's next value goes to; SIZE_MAX: no open row */
    bool nulls;     /* a complete row holds a NULL */
    bool row_nulls; /* the open row holds one */
    bool failed;
    bool bad_text; /* it failed on text that is not UTF-8 (PostgreSQL would refuse it) */
    char why[200];
    char *param; /* the parameter, assembled by tally_columns_param */
    size_t param_cap;
} tally_columns_t;

/** @brief Rows of @p n_cols values (at most TALLY_COLUMNS_MAX). */
void tally_columns_init(tally_columns_t *c, size_t n_cols);

/** @brief Open a row; false when the batch has failed. */
bool tally_columns_row_begin(tally_columns_t *c) TALLY_WUR;

/** @brief The open row's next value, @p s, or SQL NULL for NULL. false when out of memory,
 * @p s is not UTF-8, or the row has all its values already. */
bool tally_columns_text(tally_columns_t *c, const char *s) TALLY_WUR;

/**
 * @brief Close the open row: kept when @p ok and it has a value for every column, taken back
 * out otherwise (the batch is not failed for it: the caller says why with tally_columns_fail
 * when it should be). Returns whether the row was kept.
 */
bool tally_columns_row_end(tally_columns_t *c, bool ok);

/** @brief Fail the batch, saying why (printf-style; the first reason is kept). */
void tally_columns_fail(tally_columns_t *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/**
 * @brief The batch as the bytes of a binary text[] parameter (format 1), @p len bytes: the
 * array [column][row], or an empty array when there are no rows. NULL when the batch failed,
 * a row is still open, or out of memory. Valid until the batch changes.
 */
const char *tally_columns_param(tally_columns_t *c, int *len) TALLY_WUR;

/** @brief Drop the rows and the failure, keeping the memory for the next batch. */
void tally_columns_reset(tally_columns_t *c);

/** @brief Free the memory; the batch is empty and must be initialised again. */
void tally_columns_release(tally_columns_t *c);

/**
 * @brief Column @p K (a number from 1, written as such) of the columns parameter @p PARAM, every
 * row: "unnest(" TALLY_COLUMN("$2", 1) "," TALLY_COLUMN("$2", 2) ") WITH ORDINALITY AS u(a, b, n)"
 * gives the rows, their values as text, and their place in the batch (bigint, from 1).
 */
#define TALLY_COLUMN(PARAM, K) " (" PARAM "::text[])[" #K ":" #K "]"

#endif
