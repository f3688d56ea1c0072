/* recordset.h — the text of a json_to_recordset($1::json) parameter, built row by row, with
 * one bulk column beside it as a binary text[] parameter, and a statement that writes them.
 * For the statements whose plan needs json_to_recordset's guess of 100 rows (the dispatcher's
 * record statements); the others take their rows as columns (columns.h), which PostgreSQL
 * reads without lexing them. */
#ifndef TALLY_RECORDSET_H
#define TALLY_RECORDSET_H

#include <stdbool.h>
#include <stddef.h>

#include "tally/error.h"
#include "tally/pg.h"

/**
 * @brief Rows kept as the text of their JSON parameter, built as they are added: each value is
 * serialised once, with no jansson object kept in between. Every row starts with "n", its place
 * in the batch, for the statement to ORDER BY.
 * @remark Embedded in the batch that uses it and zeroed to start (calloc); callers read @c n
 * and @c failed, the rest is this module's. Sticky failure, as in pgbouncer's pktbuf: a row
 * that could not be added is taken back out, and flush reports the first reason.
 */
typedef struct tally_recordset {
    char *text; /* "[{...},{...}" — the closing bracket is added by flush */
    size_t len, cap;
    size_t row_start; /* where the open row began; == len when no row is open */
    size_t n;         /* complete rows */
    bool failed;
    char why[200];
    /* The bulk column: one element per complete row, in PostgreSQL's binary array format
     * after a header written by tally_recordset_bulk_param. */
    char *bulk;
    size_t bulk_len, bulk_cap;
    size_t bulk_row_start; /* bulk_len when the open row began */
    bool bulk_in_row;      /* the open row has its bulk value */
    bool bulk_row_null;    /* ... and it is NULL */
    bool bulk_nulls;       /* a complete row's value is NULL */
} tally_recordset_t;

/**
 * @brief The rows of a batch as the relation @p ROW, for a FROM clause: the json_to_recordset
 * of the parameter @p PARAM with the columns @p COLS (as in its column definition list),
 * zipped row by row (ROWS FROM, no join) with the bulk column, the binary text[] parameter
 * @p BULK, whose value is @p ROW.unnest (text).
 */
#define TALLY_RECORDSET_ROWS(PARAM, BULK, COLS, ROW)                                               \
    " ROWS FROM (json_to_recordset(" PARAM "::json) AS (" COLS "), unnest(" BULK "::text[]))"      \
    " AS " ROW

/** @brief Open a row: `{"n":<n>` after "[" or ",". false when out of memory. */
bool tally_recordset_row_begin(tally_recordset_t *rs) TALLY_WUR;

/** @brief Add `,"key":` and @p s as a JSON string, or null for NULL. false when out of memory
 * or @p s is not UTF-8. */
bool tally_recordset_text(tally_recordset_t *rs, const char *key, const char *s) TALLY_WUR;

/** @brief Add `,"key":` and @p json, text that already is JSON (copied as is), or null for
 * NULL. false when out of memory. */
bool tally_recordset_json(tally_recordset_t *rs, const char *key, const char *json) TALLY_WUR;

/**
 * @brief The open row's value of the bulk column, @p s, or SQL NULL for NULL (the value of a
 * row that sets none). For long text (a message, an event's data, a receipt): it reaches
 * PostgreSQL as an element of a binary text[] parameter, which it neither lexes nor unescapes,
 * where PostgreSQL 15 would copy a JSON string out of the recordset one character at a time
 * and lex nested JSON once more to store it as jsonb. Once per row. false when out of memory,
 * when @p s is not UTF-8, or when the row has its value already.
 */
bool tally_recordset_bulk(tally_recordset_t *rs, const char *s) TALLY_WUR;

/** @brief Close the open row when @p ok, counting it; otherwise (or when out of memory) take
 * it back out, which is a no-op when no row is open. @returns whether the row was kept. */
bool tally_recordset_row_end(tally_recordset_t *rs, bool ok);

/** @brief Mark the batch failed; printf-style reason. Only the first reason is kept. */
void tally_recordset_fail(tally_recordset_t *rs, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/**
 * @brief The rows as the text of a json_to_recordset parameter ("[{...},...]"), for a statement
 * that needs more than flush offers (more parameters, its result). NULL when the batch failed
 * or has no rows. Valid until @p rs changes; adding a row afterwards continues the batch.
 */
const char *tally_recordset_close(tally_recordset_t *rs);

/**
 * @brief The bulk column as the bytes of a binary text[] parameter (format 1), one element per
 * complete row, their length in @p len; an empty array when there are no rows. NULL when out of
 * memory. Valid until @p rs changes.
 */
const char *tally_recordset_bulk_param(tally_recordset_t *rs, int *len);

/**
 * @brief Run @p sql with the rows as $1 and the bulk column as $2 (one statement), then empty
 * the batch. No rows is a
 * no-op. A failed batch is not written: the error has code @p what and says
 * "<what> batch not written: <reason>"; the batch is emptied all the same.
 */
bool tally_recordset_flush(tally_recordset_t *rs, tally_pg_t *pg, const char *sql, const char *what,
                           tally_error_t *err) TALLY_WUR;

/** @brief Free the text; @p rs itself belongs to the caller. */
void tally_recordset_release(tally_recordset_t *rs);

#endif
