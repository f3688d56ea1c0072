/* columns.h — the rows of a batch as ONE binary parameter: a two-dimensional text[] holding a
 * row of the array per column, built row by row, and the SQL that takes it apart.
 *
 * Values are text; the SQL casts the columns that are not. Read without lexing, it costs
 * PostgreSQL under a third of json_to_recordset's time a row (bench/README.md, "columns.h").
 * Where a plan hinges on the batch size, zip the columns with generate_series(1, n) in a ROWS
 * FROM, which the planner guesses at 1,000 (dispatcher/record.c, RECORDED_ROWS). */
#ifndef TALLY_COLUMNS_H
#define TALLY_COLUMNS_H

#include <stdbool.h>
#include <stddef.h>
#include <libpq-fe.h>

#include "tally/error.h"

#define TALLY_COLUMNS_MAX 20

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

/**
 * @brief Where each row of a statement's result belongs in the batch it was sent with: the one
 * way RETURNING rows (and the rows a query answers about a batch) find their batch items.
 * Column @p col of each row of @p res names an item of the @p n in the batch by
 * - its key, when @p keys is given: keys[i] is item i's id (ids are unique in a batch; a NULL
 *   key is never matched), found in an index sorted once (O((n + rows) log n));
 * - its place, when @p keys is NULL: the statement returns the place the batch gave it, from 0
 *   (an "ord" column the rows carry, or WITH ORDINALITY's n - 1).
 * @returns a malloc'd array of PQntuples(@p res) places, which the caller frees: SIZE_MAX for a
 * row that names no item (SQL NULL, an unknown key, a place outside [0, n)). NULL when out of
 * memory.
 */
size_t *tally_columns_positions(const PGresult *res, int col, const char *const *keys,
                                size_t n) TALLY_WUR;

#endif
