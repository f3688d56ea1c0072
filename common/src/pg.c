/* pg.c — a PostgreSQL connection that reconnects with backoff, and parameterised queries. */
#include "tally/pg.h"

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tally/backoff.h"
#include "tally/log.h"
#include "tally/migrate.h"
#include "tally/text.h"

#ifndef TALLY_VERSION
#define TALLY_VERSION "0"
#endif

#define PG_BACKOFF_MIN_MS 100
#define PG_BACKOFF_MAX_MS 5000
/* Statements with parameters are prepared once per connection (parse and plan once, not per
 * batch); past this many distinct texts they run unprepared. */
#define PG_MAX_PREPARED 64

/* One prepared statement of the current connection. The name is a hash of the text, so the
 * same name always means the same SQL, whoever prepared it on a shared (pooled) backend. */
typedef struct pg_stmt {
    char *sql;
    char name[24];
} pg_stmt_t;

struct tally_pg {
    char *conninfo;
    char *application_name;
    PGconn *conn;
    /* set when a statement saw the connection drop; the next use reconnects */
    bool broken;
    /* BEGIN succeeded and neither COMMIT nor ROLLBACK has run: a lost connection must not be
     * replaced silently, or the caller's next statement would run outside its transaction */
    bool in_tx;
    /* tally_pg_begin was called and BEGIN not yet sent: it travels in one pipeline with the
     * transaction's first statement, which saves a round trip per transaction */
    bool begin_pending;
    /* the last connection attempt failed: warn once per outage, not once per attempt */
    bool failing;
    char **channels;
    size_t n_channels;
    unsigned int seed;
    pg_stmt_t stmts[PG_MAX_PREPARED];
    size_t n_stmts;
    /* a server that lost our prepared statements (a transaction-pooling proxy): stop preparing */
    bool no_prepare;
};

static int64_t now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* libpq messages end with a newline (sometimes several lines); keep the first line only. */
static void copy_message(char *dst, size_t dstsz, const char *src)
{
    if (src == NULL || *src == '\0')
        src = "unknown error";
    size_t n = strcspn(src, "\n");
    char *line = strndup(src, n);
    /* Cut on a character boundary: the message may quote a value from outside. */
    tally_text_copy(dst, dstsz, line != NULL ? line : "out of memory copying an error message");
    free(line);
}

/* Server notices (e.g. "relation already exists, skipping") go to the log, not to stderr. */
static void notice_processor(void *arg, const char *message)
{
    (void)arg;
    char line[512];
    copy_message(line, sizeof(line), message);
    TALLY_DEBUG("postgresql: %s", line);
}

tally_pg_t *tally_pg_new(const char *conninfo, const char *application_name)
{
    tally_pg_t *pg = calloc(1, sizeof(*pg));
    if (pg == NULL)
        return NULL;
    /* "tally-dispatcher/0.1.0 (schema 15-15)": its release and the schemas it runs on, so that
     * `tally migrate --plan` sees which releases are connected (migrate.h) */
    char app[64];
    snprintf(app, sizeof app, "%s/%s (schema %d-%d)", application_name ? application_name : "tally",
             TALLY_VERSION, TALLY_SCHEMA_OLDEST, TALLY_SCHEMA_NEWEST);
    pg->conninfo = strdup(conninfo ? conninfo : "");
    pg->application_name = strdup(app);
    if (pg->conninfo == NULL || pg->application_name == NULL) {
        tally_pg_free(pg);
        return NULL;
    }
    pg->seed = (unsigned int)((uintptr_t)pg ^ (uintptr_t)getpid() ^ (uintptr_t)now_ms());
    return pg;
}

static void forget_statements(tally_pg_t *pg)
{
    for (size_t i = 0; i < pg->n_stmts; i++)
        free(pg->stmts[i].sql);
    pg->n_stmts = 0;
}

static void drop_conn(tally_pg_t *pg)
{
    forget_statements(pg);
    if (pg->conn != NULL)
        PQfinish(pg->conn);
    pg->conn = NULL;
    pg->broken = false;
    pg->in_tx = false;
    pg->begin_pending = false;
}

bool tally_pg_ok(const tally_pg_t *pg)
{
    return pg != NULL && pg->conn != NULL && !pg->broken && PQstatus(pg->conn) == CONNECTION_OK;
}

static bool send_pending_begin(tally_pg_t *pg, tally_error_t *err);

PGconn *tally_pg_conn(tally_pg_t *pg)
{
    /* A caller that talks to libpq directly must find the transaction it asked for open. */
    if (tally_pg_ok(pg) && pg->begin_pending && !send_pending_begin(pg, NULL))
        return NULL;
    return tally_pg_ok(pg) ? pg->conn : NULL;
}

static bool listen_one(PGconn *conn, const char *channel, tally_error_t *err)
{
    char *ident = PQescapeIdentifier(conn, channel, strlen(channel));
    if (ident == NULL) {
        tally_error_set_pg(err, "08006", true, "LISTEN %s: %s", channel, PQerrorMessage(conn));
        return false;
    }
    size_t len = strlen(ident) + sizeof("LISTEN ");
    char *sql = malloc(len);
    if (sql == NULL) {
        PQfreemem(ident);
        tally_error_setc(err, TALLY_ERR_OOM, "LISTEN %s: out of memory", channel);
        return false;
    }
    snprintf(sql, len, "LISTEN %s", ident);
    PQfreemem(ident);
    PGresult *res = PQexec(conn, sql);
    free(sql);
    bool ok = PQresultStatus(res) == PGRES_COMMAND_OK;
    if (!ok) {
        const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
        char msg[400];
        copy_message(msg, sizeof(msg), PQerrorMessage(conn));
        tally_error_set_pg(err, state, state ? tally_sqlstate_retriable(state) : true,
                           "LISTEN %s: %s", channel, msg);
    }
    PQclear(res);
    return ok;
}

/* One connection attempt, including LISTEN for every registered channel. */
static bool connect_once(tally_pg_t *pg, tally_error_t *err)
{
    drop_conn(pg);
    /* Entries before the expanded "dbname" are defaults that the conninfo may override. */
    const char *keys[4];
    const char *vals[4];
    int n = 0;
    keys[n] = "application_name";
    vals[n++] = pg->application_name;
    if (getenv("PGCONNECT_TIMEOUT") == NULL) {
        keys[n] = "connect_timeout";
        vals[n++] = "10";
    }
    keys[n] = "dbname";
    vals[n++] = pg->conninfo;
    keys[n] = NULL;
    vals[n] = NULL;

    PGconn *conn = PQconnectdbParams(keys, vals, 1);
    if (conn == NULL) {
        tally_error_set_pg(err, "08001", true, "cannot connect to PostgreSQL: out of memory");
        return false;
    }
    if (PQstatus(conn) != CONNECTION_OK) {
        char msg[480];
        copy_message(msg, sizeof(msg), PQerrorMessage(conn));
        tally_error_set_pg(err, "08001", true, "cannot connect to PostgreSQL: %s", msg);
        PQfinish(conn);
        return false;
    }
    PQsetNoticeProcessor(conn, notice_processor, NULL);
    for (size_t i = 0; i < pg->n_channels; i++) {
        if (!listen_one(conn, pg->channels[i], err)) {
            PQfinish(conn);
            return false;
        }
    }
    pg->conn = conn;
    return true;
}

/* Sleep @p ms in short slices so a stop request is seen promptly. */
static void sleep_ms(int ms, volatile const int *stop)
{
    while (ms > 0 && !(stop && *stop)) {
        int slice = ms < 50 ? ms : 50;
        struct timespec ts = {slice / 1000, (long)(slice % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        ms -= slice;
    }
}

bool tally_pg_connect(tally_pg_t *pg, int deadline_ms, volatile const int *stop, tally_error_t *err)
{
    if (tally_pg_ok(pg))
        return true;
    int64_t deadline = now_ms() + (deadline_ms > 0 ? deadline_ms : 0);
    int attempt = 0;
    for (;;) {
        attempt++;
        tally_error_t local;
        tally_error_t *e = err ? err : &local;
        if (connect_once(pg, e)) {
            if (pg->failing)
                TALLY_INFO("connected to PostgreSQL again");
            pg->failing = false;
            return true;
        }
        pg->failing = true;
        /* a single attempt is the caller's to report; a retry loop reports its own progress */
        if (deadline_ms == 0 || (stop && *stop))
            return false;
        if (attempt == 1)
            TALLY_WARN("%s; retrying", e->message);
        else
            TALLY_DEBUG("%s (attempt %d)", e->message, attempt);
        /* equal jitter: spreads reconnect storms */
        int delay = (int)tally_backoff_ms(attempt, PG_BACKOFF_MIN_MS, PG_BACKOFF_MAX_MS, -1,
                                          (uint32_t)rand_r(&pg->seed));
        if (deadline_ms > 0) {
            int64_t left = deadline - now_ms();
            if (left <= 0)
                return false;
            if (delay > left)
                delay = (int)left;
        }
        sleep_ms(delay, stop);
        if (stop && *stop)
            return false;
        if (deadline_ms > 0 && now_ms() >= deadline)
            return false;
    }
}

/* Fill @p err from a failed result or the connection, and note a lost connection. */
static void result_error(tally_pg_t *pg, PGresult *res, tally_error_t *err)
{
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    const char *primary = res ? PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY) : NULL;
    char msg[480];
    copy_message(msg, sizeof(msg), primary ? primary : PQerrorMessage(pg->conn));
    bool lost = PQstatus(pg->conn) != CONNECTION_OK;
    if (lost)
        pg->broken = true;
    if (state != NULL && *state != '\0')
        tally_error_set_pg(err, state, lost || tally_sqlstate_retriable(state), "%s", msg);
    else if (lost)
        tally_error_set_pg(err, "08006", true, "PostgreSQL connection lost: %s", msg);
    else /* refused by libpq itself, before reaching the server */
        tally_error_setc(err, TALLY_ERR_PG_CLIENT, "%s", msg);
}

static bool ensure_connected(tally_pg_t *pg, tally_error_t *err)
{
    if (tally_pg_ok(pg))
        return true;
    if (pg->in_tx && !pg->begin_pending) {
        tally_error_set_pg(err, "08006", true,
                           "PostgreSQL connection lost inside a transaction; roll back and retry");
        return false;
    }
    /* nothing of a pending transaction has run yet: a new connection is as good */
    return tally_pg_connect(pg, 0, NULL, err);
}

/* The deferred BEGIN on its own (a caller about to use the raw connection). */
static bool send_pending_begin(tally_pg_t *pg, tally_error_t *err)
{
    pg->begin_pending = false;
    PGresult *res = PQexec(pg->conn, "BEGIN");
    bool ok = PQresultStatus(res) == PGRES_COMMAND_OK;
    if (!ok) {
        tally_error_t local;
        result_error(pg, res, err ? err : &local);
    }
    PQclear(res);
    return ok;
}

/* The name of @p sql prepared on this connection: prepares it the first time. NULL means
 * "run it unprepared" (no parameters, cache full, or the server refused: the unprepared
 * execution then reports any real error itself). */
static const char *prepared_name(tally_pg_t *pg, const char *sql, int nparams)
{
    if (nparams == 0 || pg->no_prepare)
        return NULL;
    for (size_t i = 0; i < pg->n_stmts; i++)
        if (strcmp(pg->stmts[i].sql, sql) == 0)
            return pg->stmts[i].name;
    if (pg->n_stmts == PG_MAX_PREPARED)
        return NULL;
    pg_stmt_t *st = &pg->stmts[pg->n_stmts];
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (const unsigned char *c = (const unsigned char *)sql; *c; c++)
        h = (h ^ *c) * 1099511628211ULL;
    snprintf(st->name, sizeof(st->name), "tally_%016llx", (unsigned long long)h);
    PGresult *res = PQprepare(pg->conn, st->name, sql, nparams, NULL);
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    /* 42P05: a pooled backend has it already — same name, same text */
    bool ok =
        PQresultStatus(res) == PGRES_COMMAND_OK || (state != NULL && strcmp(state, "42P05") == 0);
    PQclear(res);
    if (!ok)
        return NULL;
    st->sql = strdup(sql);
    if (st->sql == NULL)
        return NULL; /* prepared but not remembered: preparing it again answers 42P05 */
    pg->n_stmts++;
    return st->name;
}

/* BEGIN and @p sql in one pipeline: one round trip. @returns the statement's result (or the
 * first error's) like PQexecParams, or NULL when the connection failed. */
static PGresult *exec_with_begin(tally_pg_t *pg, const char *sql, const char *name, int nparams,
                                 const char *const *params, const int *lengths, const int *formats)
{
    PGconn *conn = pg->conn;
    pg->begin_pending = false;
    if (!PQenterPipelineMode(conn))
        return NULL;
    PGresult *out = NULL;
    if (PQsendQueryParams(conn, "BEGIN", 0, NULL, NULL, NULL, NULL, 0) &&
        (name ? PQsendQueryPrepared(conn, name, nparams, params, lengths, formats, 0)
              : PQsendQueryParams(conn, sql, nparams, NULL, params, lengths, formats, 0)) &&
        PQpipelineSync(conn)) {
        /* results: BEGIN's, the statement's, then the sync; keep the first error, or the
         * statement's result */
        int seen = 0;
        for (;;) {
            PGresult *res = PQgetResult(conn);
            if (res == NULL) {
                if (PQstatus(conn) != CONNECTION_OK)
                    break;
                continue; /* the end of one query's results */
            }
            ExecStatusType st = PQresultStatus(res);
            if (st == PGRES_PIPELINE_SYNC) {
                PQclear(res);
                break;
            }
            seen++;
            bool error = st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK;
            if (out == NULL && (error || seen == 2)) {
                out = res;
            } else if (out != NULL && PQresultStatus(out) == PGRES_PIPELINE_ABORTED && error &&
                       st != PGRES_PIPELINE_ABORTED) {
                PQclear(out);
                out = res;
            } else {
                PQclear(res);
            }
        }
    }
    if (PQstatus(conn) == CONNECTION_OK && !PQexitPipelineMode(conn))
        pg->broken = true;
    return out;
}

PGresult *tally_pg_exec(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                        tally_error_t *err)
{
    return tally_pg_exec_bin(pg, sql, nparams, params, NULL, NULL, err);
}

PGresult *tally_pg_exec_bin(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                            const int *lengths, const int *formats, tally_error_t *err)
{
    if (!ensure_connected(pg, err))
        return NULL;
    const char *name = prepared_name(pg, sql, nparams);
    PGresult *res;
    if (pg->begin_pending)
        res = exec_with_begin(pg, sql, name, nparams, params, lengths, formats);
    else if (name != NULL)
        res = PQexecPrepared(pg->conn, name, nparams, params, lengths, formats, 0);
    else
        res = PQexecParams(pg->conn, sql, nparams, NULL, params, lengths, formats, 0);
    ExecStatusType st = PQresultStatus(res);
    if (res != NULL && (st == PGRES_TUPLES_OK || st == PGRES_COMMAND_OK))
        return res;
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    bool replan = name != NULL && state != NULL && strcmp(state, "0A000") == 0;
    if (name != NULL && state != NULL && strcmp(state, "26000") == 0) {
        /* our statement is gone from the backend: a pooler moved us; stop preparing */
        TALLY_WARN("PostgreSQL lost a prepared statement (a transaction-pooling proxy?); "
                   "running statements unprepared from now on");
        forget_statements(pg);
        pg->no_prepare = true;
    }
    result_error(pg, res, err);
    if (replan) {
        /* "cached plan must not change result type" (a migration changed a table under a
         * prepared statement): a new session prepares everything afresh */
        pg->broken = true;
        if (err != NULL)
            err->retriable = true;
    }
    PQclear(res);
    return NULL;
}

PGresult *tally_pg_exec_json(tally_pg_t *pg, const char *sql, const json_t *param,
                             tally_error_t *err)
{
    char *text = json_dumps(param, JSON_COMPACT);
    if (text == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory serialising a statement parameter");
        return NULL;
    }
    const char *params[1] = {text};
    PGresult *res = tally_pg_exec(pg, sql, 1, params, err);
    free(text);
    return res;
}

bool tally_pg_run(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                  tally_error_t *err)
{
    PGresult *res = tally_pg_exec(pg, sql, nparams, params, err);
    if (res == NULL)
        return false;
    PQclear(res);
    return true;
}

bool tally_pg_error_is_data(const tally_error_t *err)
{
    if (err == NULL || err->retriable)
        return false;
    return strncmp(err->sqlstate, "22", 2) == 0 || strncmp(err->sqlstate, "23", 2) == 0 ||
           strncmp(err->sqlstate, "54", 2) == 0 || err->errc == TALLY_ERR_INVALID_TEXT;
}

bool tally_pg_begin(tally_pg_t *pg, tally_error_t *err)
{
    if (pg->in_tx)
        tally_pg_rollback(pg); /* a caller that lost track: never nest silently */
    if (!ensure_connected(pg, err))
        return false;
    /* BEGIN goes out with the transaction's first statement (exec_with_begin) */
    pg->in_tx = true;
    pg->begin_pending = true;
    return true;
}

bool tally_pg_commit(tally_pg_t *pg, tally_error_t *err)
{
    if (pg->begin_pending) { /* nothing ran: nothing to commit */
        pg->begin_pending = false;
        pg->in_tx = false;
        return true;
    }
    if (!tally_pg_ok(pg)) {
        pg->in_tx = false;
        tally_error_set_pg(err, "08006", true, "PostgreSQL connection lost before COMMIT");
        return false;
    }
    PGresult *res = tally_pg_exec(pg, "COMMIT", 0, NULL, err);
    pg->in_tx = false;
    if (res == NULL)
        return false;
    /* COMMIT of a transaction that already failed answers "ROLLBACK", not an error */
    bool rolled_back = strcmp(PQcmdStatus(res), "ROLLBACK") == 0;
    PQclear(res);
    if (rolled_back) {
        tally_error_set_pg(err, "25P02", false,
                           "transaction was aborted by an earlier error; COMMIT rolled it back");
        return false;
    }
    return true;
}

void tally_pg_rollback(tally_pg_t *pg)
{
    if (pg == NULL)
        return;
    pg->in_tx = false;
    pg->begin_pending = false;
    if (!tally_pg_ok(pg))
        return;
    if (PQtransactionStatus(pg->conn) == PQTRANS_IDLE)
        return;
    PGresult *res = PQexec(pg->conn, "ROLLBACK");
    if (PQresultStatus(res) != PGRES_COMMAND_OK && PQstatus(pg->conn) != CONNECTION_OK)
        pg->broken = true;
    PQclear(res);
}

bool tally_pg_listen(tally_pg_t *pg, const char *channel, tally_error_t *err)
{
    bool known = false;
    for (size_t i = 0; i < pg->n_channels; i++)
        if (strcmp(pg->channels[i], channel) == 0)
            known = true;
    if (!known) {
        char **grown = realloc(pg->channels, (pg->n_channels + 1) * sizeof(*grown));
        if (grown == NULL) {
            tally_error_setc(err, TALLY_ERR_OOM, "LISTEN %s: out of memory", channel);
            return false;
        }
        pg->channels = grown;
        pg->channels[pg->n_channels] = strdup(channel);
        if (pg->channels[pg->n_channels] == NULL) {
            tally_error_setc(err, TALLY_ERR_OOM, "LISTEN %s: out of memory", channel);
            return false;
        }
        pg->n_channels++;
    }
    /* A fresh connection LISTENs on every registered channel as it connects. */
    if (!tally_pg_ok(pg))
        return ensure_connected(pg, err);
    if (!listen_one(pg->conn, channel, err)) {
        if (PQstatus(pg->conn) != CONNECTION_OK)
            pg->broken = true;
        return false;
    }
    return true;
}

static int drain_notifies(tally_pg_t *pg)
{
    int n = 0;
    PGnotify *nf;
    while ((nf = PQnotifies(pg->conn)) != NULL) {
        n++;
        PQfreemem(nf);
    }
    return n;
}

int tally_pg_wait_notify(tally_pg_t *pg, int timeout_ms)
{
    if (timeout_ms < 0)
        timeout_ms = 0;
    if (!tally_pg_ok(pg)) {
        tally_error_t err;
        if (pg->in_tx || !tally_pg_connect(pg, 0, NULL, &err)) {
            sleep_ms(timeout_ms, NULL);
            return 0;
        }
    }
    /* notifications may already be buffered from an earlier statement */
    if (!PQconsumeInput(pg->conn)) {
        pg->broken = true;
        return 0;
    }
    int n = drain_notifies(pg);
    int64_t deadline = now_ms() + timeout_ms;
    while (n == 0) {
        int64_t left = deadline - now_ms();
        if (left <= 0)
            break;
        struct pollfd pfd = {.fd = PQsocket(pg->conn), .events = POLLIN};
        if (pfd.fd < 0) {
            pg->broken = true;
            break;
        }
        int rc = poll(&pfd, 1, (int)left);
        if (rc < 0) {
            if (errno == EINTR)
                break; /* a signal: let the caller look at its stop flag */
            pg->broken = true;
            break;
        }
        if (rc == 0)
            break;
        if (!PQconsumeInput(pg->conn)) {
            char msg[400];
            copy_message(msg, sizeof(msg), PQerrorMessage(pg->conn));
            TALLY_WARN("PostgreSQL connection lost while waiting for notifications: %s", msg);
            pg->broken = true;
            break;
        }
        n = drain_notifies(pg);
    }
    return n;
}

void tally_pg_free(tally_pg_t *pg)
{
    if (pg == NULL)
        return;
    forget_statements(pg);
    if (pg->conn != NULL)
        PQfinish(pg->conn);
    for (size_t i = 0; i < pg->n_channels; i++)
        free(pg->channels[i]);
    free(pg->channels);
    free(pg->conninfo);
    free(pg->application_name);
    free(pg);
}

char *tally_pg_text_array(const char *const *items, size_t n)
{
    size_t cap = 3;
    for (size_t i = 0; i < n; i++)
        cap += 3 + 2 * strlen(items[i]);
    char *s = malloc(cap);
    if (s == NULL)
        return NULL;
    size_t k = 0;
    s[k++] = '{';
    for (size_t i = 0; i < n; i++) {
        if (i > 0)
            s[k++] = ',';
        s[k++] = '"';
        for (const char *p = items[i]; *p; p++) {
            if (*p == '"' || *p == '\\')
                s[k++] = '\\';
            s[k++] = *p;
        }
        s[k++] = '"';
    }
    s[k++] = '}';
    s[k] = '\0';
    return s;
}
