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
 * @brief The client-side deadline, in ms, of every statement and connection attempt from now
 * on (TALLY_PG_DEADLINE_MS; 30000 until set). A statement PostgreSQL has not answered by then
 * fails with SQLSTATE 08006, retriable, "PostgreSQL did not answer within N ms", and the
 * connection is closed (never cancelled: a stalled server would not answer the cancel either);
 * the next use reconnects. A connection attempt has libpq's connect_timeout per host (10 s
 * unless the conninfo or PGCONNECT_TIMEOUT says; the deadline when that is 0).
 * @remark Connections made afterwards also get statement_timeout just under the deadline
 * (tally_pg_statement_timeout_ms), unless TALLY_PG sets one (tally_pg_keywords).
 */
void tally_pg_set_deadline(tally_pg_t *pg, int deadline_ms);

/** @brief The server's statement_timeout tally asks for under a client deadline: 5/6 of it
 * (25 s for 30 s), so that the server cancels a slow statement cleanly first. */
int tally_pg_statement_timeout_ms(int deadline_ms);

/**
 * @brief Whether @p pg is waiting on PostgreSQL right now (a statement or a connection
 * attempt), and since when and until when, in CLOCK_MONOTONIC milliseconds. Safe to call
 * from any thread while the owner works (atomics): /healthz and /readyz read it while the
 * main loop waits. false when no wait is in progress (or @p pg is NULL).
 */
bool tally_pg_waiting(const tally_pg_t *pg, long long *since_ms, long long *deadline_ms);

/** @brief When the last wait on PostgreSQL ended (answered, failed or given up at its
 * deadline), in CLOCK_MONOTONIC ms; 0 before the first. Any thread, like tally_pg_waiting. */
long long tally_pg_last_wait_end_ms(const tally_pg_t *pg);

/** @brief The most keywords tally_pg_keywords fills, with the NULL that ends them. */
#define TALLY_PG_MAX_KEYWORDS 12

/** @brief Connection keywords for PQconnectStartParams (expand_dbname 1). */
typedef struct tally_pg_keywords {
    const char *keys[TALLY_PG_MAX_KEYWORDS];
    const char *vals[TALLY_PG_MAX_KEYWORDS];
    char *options; /**< owned: the merged "options" value, or NULL */
} tally_pg_keywords_t;

/**
 * @brief The keywords tally connects with: @p conninfo (key=value or URI, expanded as
 * "dbname"), @p application_name, and defaults for whatever the conninfo does not set:
 * connect_timeout=10 (unless PGCONNECT_TIMEOUT is set), tcp_user_timeout=10000, keepalives=1,
 * keepalives_idle=10, keepalives_interval=5, keepalives_count=3, and in "options"
 * `-c statement_timeout=` tally_pg_statement_timeout_ms(@p deadline_ms), appended to the
 * conninfo's own options (or @p env_options, PGOPTIONS, when it has none) unless those mention
 * statement_timeout, or the conninfo sets options to '' (no options at all: a connection pooler
 * that refuses the startup parameter). Pure apart from reading PGCONNECT_TIMEOUT. The strings
 * borrow
 * @p conninfo and @p application_name; free with tally_pg_keywords_clear.
 * @returns false when out of memory.
 */
bool tally_pg_keywords(tally_pg_keywords_t *kw, const char *conninfo, const char *application_name,
                       int deadline_ms, const char *env_options) TALLY_WUR;
void tally_pg_keywords_clear(tally_pg_keywords_t *kw);

/**
 * @brief Connect now, or reconnect when the connection is bad. Retries with exponential
 * backoff (100 ms doubling to 5 s) until connected, until @p deadline_ms has passed
 * (0: try once), or until *@p stop becomes true (@p stop may be NULL).
 */
bool tally_pg_connect(tally_pg_t *pg, int deadline_ms, volatile const int *stop,
                      tally_error_t *err) TALLY_WUR;

/** @brief The libpq connection, or NULL when not connected. Borrowed, and non-blocking: use it
 * to poll its socket or read notifications, and send statements through tally_pg_exec (a
 * deadline closes it, so do not keep it across one). */
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

/**
 * @brief Several statements in one text by the simple-query protocol (a migration), within the
 * deadline. @returns like PQexec: the first error's result, else the last one's (the caller
 * checks the status and frees it), or NULL with @p err filled when the connection was lost,
 * the deadline passed, or there was no connection.
 */
PGresult *tally_pg_exec_script(tally_pg_t *pg, const char *sql, tally_error_t *err) TALLY_WUR;

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
