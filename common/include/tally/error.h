/* error.h — a small error object for runtime paths: a typed code (with whether a retry may help
 * and whether the process can go on), one sentence, and PostgreSQL's SQLSTATE when it gave one. */
#ifndef TALLY_ERROR_H
#define TALLY_ERROR_H

#include <stdbool.h>
#include <stddef.h>

#define TALLY_WUR __attribute__((warn_unused_result))

/*
 * The error codes, one row each: X(code, name, retriable, fatal, meaning).
 *   name       the code as text: what logs, events and the ledger's error_code columns show
 *              (a PostgreSQL error shows its SQLSTATE instead, see tally_error_t.code)
 *   retriable  the default of tally_error_setc: trying the same thing later may succeed
 *   fatal      the process cannot do its work until its setup or its binary changes: neither
 *              a retry nor skipping the item helps (as rd_kafka_error_is_fatal)
 * A caller that knows better than the table says so with tally_error_setc_retriable.
 */
#define TALLY_ERRC_TABLE(X)                                                                        \
    X(TALLY_ERR_OOM, "oom", true, false, "out of memory")                                          \
    X(TALLY_ERR_PG_CONNECTION, "pg_connection", true, false,                                       \
      "PostgreSQL could not be reached or the connection was lost (SQLSTATE class 08, 57P0x)")     \
    X(TALLY_ERR_PG, "pg", false, false,                                                            \
      "PostgreSQL refused a statement; the SQLSTATE says why (retriable for serialization "        \
      "failures and deadlocks, tally_sqlstate_retriable)")                                         \
    X(TALLY_ERR_PG_CLIENT, "pg_client", false, false,                                              \
      "libpq refused the request before it reached the server")                                    \
    X(TALLY_ERR_SCHEMA_TOO_NEW, "schema_too_new", false, true,                                     \
      "the ledger's schema is newer than this binary")                                             \
    X(TALLY_ERR_KAFKA, "kafka", true, false, "a Kafka call failed; the client retries")            \
    X(TALLY_ERR_KAFKA_FATAL, "kafka_fatal", false, true,                                           \
      "librdkafka raised a fatal error: the client instance is unusable")                          \
    X(TALLY_ERR_CURL, "curl", true, false, "libcurl failed to start or drive a call")              \
    X(TALLY_ERR_INVALID, "invalid", false, false, "a request or a row tally cannot act on")        \
    X(TALLY_ERR_INVALID_TEXT, "invalid_text", false, false,                                        \
      "text that PostgreSQL or JSON cannot take (not UTF-8, U+0000)")                              \
    X(TALLY_ERR_INVALID_FIELD, "invalid_field", false, false,                                      \
      "a field's value is malformed or over its limit")                                            \
    X(TALLY_ERR_MISSING_OPERATION_KEY, "missing_operation_key", false, false,                      \
      "the intent has no operation key and the registry cannot build one")                         \
    X(TALLY_ERR_INVALID_HEADER, "invalid_header", false, false,                                    \
      "a header value is empty or holds a control character")                                      \
    X(TALLY_ERR_NO_ENDPOINT, "no_endpoint", false, false,                                          \
      "the tool declares no endpoint for the operation")                                           \
    X(TALLY_ERR_SIGNATURE, "signature", false, false, "the request signature could not be made")   \
    X(TALLY_ERR_SECRET_MISSING, "secret_missing", true, false,                                     \
      "the tool signs its requests but its secret is not set (retriable once it is)")              \
    X(TALLY_ERR_SEALED, "sealed_unreadable", false, false,                                         \
      "a sealed sensitive value cannot be opened: its tenant key was forgotten or is missing")     \
    X(TALLY_ERR_PRUNED, "pruned", false, false,                                                    \
      "the run's payloads were pruned (tally prune): what a call needs is gone")                   \
    X(TALLY_ERR_CAPACITY, "capacity", true, false,                                                 \
      "no room for another call (global or per-tool cap)")                                         \
    X(TALLY_ERR_CONFLICT, "conflict", true, false, "a row changed under its lock; try again")      \
    X(TALLY_ERR_RACE, "race", true, false,                                                         \
      "a concurrent transaction rolled back what this one read; try again")                        \
    X(TALLY_ERR_NOT_FOUND, "not_found", false, false, "the ledger has no such item")               \
    X(TALLY_ERR_NO_ROW, "no_row", false, false, "a query returned no row, or more than one")       \
    X(TALLY_ERR_JSON, "json", false, false, "JSON from the database does not parse")               \
    X(TALLY_ERR_AUDIT, "audit", false, false, "audit events could not be built")                   \
    X(TALLY_ERR_OUTBOX, "outbox", false, false, "outbox messages could not be built")              \
    X(TALLY_ERR_ALERT, "alert", false, false, "alerts could not be built")                         \
    X(TALLY_ERR_OTHER, "error", false, false, "a code out of the table's range")

#define TALLY_ERRC_ENUM_ROW(code, name, retriable, fatal, meaning) code,

/** @brief What went wrong, by kind. TALLY_ERR_NONE (0) is "no error". */
typedef enum {
    TALLY_ERR_NONE = 0,
    TALLY_ERRC_TABLE(TALLY_ERRC_ENUM_ROW) TALLY_ERR__COUNT
} tally_errc_t;

/** @brief The code's name as in the table ("oom", ...); "none" for TALLY_ERR_NONE. */
const char *tally_errc_name(tally_errc_t errc);

/** @brief The table's retriable and fatal columns (false for TALLY_ERR_NONE). */
bool tally_errc_retriable(tally_errc_t errc);
bool tally_errc_fatal(tally_errc_t errc);

/** @brief The code named @p name (a name of the table). */
bool tally_errc_parse(const char *name, tally_errc_t *out);

/**
 * @brief true for a SQLSTATE where the same statement may succeed later: class 08 (connection),
 * 40001 (serialization failure), 40P01 (deadlock), 57P01..57P03 (shutdown, cannot connect now),
 * 57014 (cancelled: statement_timeout, which pg.h sets under its deadline, or an operator's
 * pg_cancel_backend; it says nothing about the statement's data).
 */
bool tally_sqlstate_retriable(const char *sqlstate);

/**
 * @brief What went wrong on a runtime path, in the style of rd_kafka_error_t.
 * @remark Lives on the caller's stack; no allocation, nothing to free. Decide on errc (and on
 * sqlstate for PostgreSQL's own codes), never on the text in code.
 */
typedef struct tally_error {
    tally_errc_t errc; /**< the kind; TALLY_ERR_NONE after tally_error_clear */
    char sqlstate[6];  /**< PostgreSQL's SQLSTATE when there is one (tally_error_set_pg), else "" */
    bool retriable;    /**< true when trying the same thing later may succeed */
    char code[32];     /**< errc as text, for logs, events and error_code columns: the SQLSTATE
                            when there is one, else tally_errc_name(errc) */
    char message[512]; /**< one human sentence */
} tally_error_t;

/** @brief Fill @p err (NULL is allowed and ignored) with @p errc, the table's retriable flag and
 * a printf-style message. */
void tally_error_setc(tally_error_t *err, tally_errc_t errc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/** @brief tally_error_setc with @p retriable given instead of the table's: for a call site that
 * knows this case differs from the code's usual one. */
void tally_error_setc_retriable(tally_error_t *err, tally_errc_t errc, bool retriable,
                                const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/**
 * @brief A PostgreSQL error: @p sqlstate (five characters, as PQresultErrorField gives it, or
 * the class 08 code tally reports for a connection it could not make or lost) goes into
 * err->sqlstate and err->code; errc is TALLY_ERR_PG_CONNECTION for class 08 and 57P0x, else
 * TALLY_ERR_PG. A NULL or malformed @p sqlstate is taken as "08006" (connection failure).
 */
void tally_error_set_pg(tally_error_t *err, const char *sqlstate, bool retriable, const char *fmt,
                        ...) __attribute__((format(printf, 4, 5)));

/** @brief Reset @p err to "no error". */
void tally_error_clear(tally_error_t *err);

/** @brief Whether trying the same thing later may succeed (false for NULL). */
bool tally_error_retriable(const tally_error_t *err);

/** @brief Whether the process cannot go on (the table's fatal column; false for NULL). */
bool tally_error_fatal(const tally_error_t *err);

#endif
