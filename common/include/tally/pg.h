/* pg.h — a PostgreSQL connection that reconnects with backoff, and parameterised queries. */
#ifndef TALLY_PG_H
#define TALLY_PG_H

#include <stdbool.h>
#include <jansson.h>
#include <libpq-fe.h>

#include "tally/error.h"

typedef struct tally_pg tally_pg_t;

/**
 * @brief A handle for @p conninfo (libpq conninfo or URI; "" uses the PG* variables).
 * Does not connect. @p application_name is set on the session ("tally-dispatcher").
 */
tally_pg_t *tally_pg_new(const char *conninfo, const char *application_name) TALLY_WUR;

/**
 * @brief Connect now, or reconnect when the connection is bad. Retries with exponential
 * backoff (100 ms doubling to 5 s) until connected, until @p deadline_ms has passed
 * (0: try once), or until *@p stop becomes true (@p stop may be NULL).
 */
bool tally_pg_connect(tally_pg_t *pg, int deadline_ms, volatile const int *stop,
                      tally_error_t *err) TALLY_WUR;

/** @brief The libpq connection, or NULL when not connected. Borrowed. */
PGconn *tally_pg_conn(tally_pg_t *pg);

/** @brief true while the connection is up. */
bool tally_pg_ok(const tally_pg_t *pg);

/**
 * @brief PQexecParams with text parameters (NULL entries are SQL NULL).
 * Connects first if needed (one attempt). On failure returns NULL, fills @p err with the
 * SQLSTATE and message (retriable for connection loss, serialization failure, deadlock),
 * and marks the connection for reconnect when it was lost.
 * @returns a PGresult the caller frees with PQclear (status TUPLES_OK or COMMAND_OK).
 */
PGresult *tally_pg_exec(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                        tally_error_t *err) TALLY_WUR;

/**
 * @brief tally_pg_exec with some parameters in binary format: @p formats[i] 1 for binary (its
 * length in @p lengths[i]), 0 for text (lengths[i] is ignored). NULL arrays: all text.
 */
PGresult *tally_pg_exec_bin(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                            const int *lengths, const int *formats, tally_error_t *err) TALLY_WUR;

/**
 * @brief tally_pg_exec with one parameter, @p param serialised as compact JSON (for statements
 * that take a batch as json_to_recordset($1::json) or json_array_elements_text($1::json)).
 * Running out of memory serialising it is code "oom", retriable: it is this process's own
 * allocation failing, not anything about the data or the database, and may succeed later.
 */
PGresult *tally_pg_exec_json(tally_pg_t *pg, const char *sql, const json_t *param,
                             tally_error_t *err) TALLY_WUR;

/** @brief Run a statement and discard its result. */
bool tally_pg_run(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                  tally_error_t *err) TALLY_WUR;

/**
 * @brief true when @p err says PostgreSQL refused the statement's data, so that the same data
 * can never be written however often it is tried: a data exception (SQLSTATE class 22: not
 * UTF-8, value too long, a number out of range), an integrity constraint (23), a program
 * limit (54: an index row too large), or a batch whose text was not UTF-8 before it was sent
 * (code "invalid_text", columns.h). Connection, serialization, lock and resource errors are
 * not: those are retried.
 */
bool tally_pg_error_is_data(const tally_error_t *err);

/**
 * @brief A text[] literal of @p n strings for a statement parameter ("{\"a\",\"b\"}"):
 * every element quoted, '"' and '\\' escaped. @returns malloc'd text, or NULL when out of
 * memory.
 */
char *tally_pg_text_array(const char *const *items, size_t n);

/**
 * @brief BEGIN / COMMIT / ROLLBACK. Rollback is safe to call on a broken connection.
 * @remark BEGIN is sent in one pipeline with the transaction's first statement (one round
 * trip less per transaction), so a failure to start the transaction surfaces there;
 * tally_pg_conn() sends it at once for callers that use the libpq connection directly.
 */
bool tally_pg_begin(tally_pg_t *pg, tally_error_t *err) TALLY_WUR;
bool tally_pg_commit(tally_pg_t *pg, tally_error_t *err) TALLY_WUR;
void tally_pg_rollback(tally_pg_t *pg);

/** @brief LISTEN on @p channel (re-issued automatically after a reconnect). */
bool tally_pg_listen(tally_pg_t *pg, const char *channel, tally_error_t *err) TALLY_WUR;

/**
 * @brief Wait up to @p timeout_ms for a NOTIFY on any listened channel (or for the socket
 * to report a problem). @returns the number of notifications consumed (0 on timeout).
 */
int tally_pg_wait_notify(tally_pg_t *pg, int timeout_ms);

/** @brief Closes the connection and frees. NULL is allowed. */
void tally_pg_free(tally_pg_t *pg);

#endif
