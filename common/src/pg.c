/* pg.c — a PostgreSQL connection that reconnects with backoff, and parameterised queries. */
#include "tally/pg.h"

#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
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
/* The client-side deadline until tally_pg_set_deadline says otherwise: TALLY_PG_DEADLINE_MS's
 * default (config.c), for handles made without a configuration (tests, `tally dev`). */
#define PG_DEADLINE_DEFAULT_MS 30000
/* libpq's connect_timeout, in seconds, unless the conninfo or PGCONNECT_TIMEOUT says */
#define PG_CONNECT_TIMEOUT_S "10"
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
    /* the client-side deadline of a statement or a connection attempt (tally_pg_set_deadline) */
    int deadline_ms;
    /* The wait in progress, for other threads (tally_pg_waiting): when it started and when it
     * gives up, CLOCK_MONOTONIC ms; since 0 when none. The owner writes the deadline first. */
    _Atomic int64_t wait_since;
    _Atomic int64_t wait_until;
    /* when the last wait ended, answered or given up */
    _Atomic int64_t wait_ended;
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
    pg->deadline_ms = PG_DEADLINE_DEFAULT_MS;
    atomic_init(&pg->wait_since, 0);
    atomic_init(&pg->wait_until, 0);
    atomic_init(&pg->wait_ended, 0);
    return pg;
}

void tally_pg_set_deadline(tally_pg_t *pg, int deadline_ms)
{
    pg->deadline_ms = deadline_ms > 0 ? deadline_ms : PG_DEADLINE_DEFAULT_MS;
}

int tally_pg_statement_timeout_ms(int deadline_ms)
{
    return deadline_ms - deadline_ms / 6;
}

bool tally_pg_waiting(const tally_pg_t *pg, long long *since_ms, long long *deadline_ms)
{
    if (pg == NULL)
        return false;
    /* since, deadline, since again: an unchanged since means the deadline is that wait's */
    int64_t since = atomic_load(&pg->wait_since);
    int64_t until = atomic_load(&pg->wait_until);
    if (since == 0 || atomic_load(&pg->wait_since) != since)
        return false;
    if (since_ms != NULL)
        *since_ms = since;
    if (deadline_ms != NULL)
        *deadline_ms = until;
    return true;
}

/* A wait on the server starts: it may last @p ms. */
static void wait_start(tally_pg_t *pg, int ms)
{
    int64_t now = now_ms();
    atomic_store(&pg->wait_until, now + ms);
    atomic_store(&pg->wait_since, now);
}

static void wait_done(tally_pg_t *pg)
{
    atomic_store(&pg->wait_ended, now_ms());
    atomic_store(&pg->wait_since, 0);
}

long long tally_pg_last_wait_end_ms(const tally_pg_t *pg)
{
    return pg != NULL ? (long long)atomic_load(&pg->wait_ended) : 0;
}

static void forget_statements(tally_pg_t *pg)
{
    for (size_t i = 0; i < pg->n_stmts; i++)
        free(pg->stmts[i].sql);
    pg->n_stmts = 0;
}

/* Close the connection but keep the transaction flags: a caller inside a transaction is told
 * it was lost (ensure_connected) until it rolls back. The connection is non-blocking, so the
 * goodbye PQfinish sends cannot hang on a server that stopped reading. */
static void close_conn(tally_pg_t *pg)
{
    forget_statements(pg);
    if (pg->conn != NULL)
        PQfinish(pg->conn);
    pg->conn = NULL;
    pg->broken = false;
}

static void drop_conn(tally_pg_t *pg)
{
    close_conn(pg);
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

/* ---- waiting for the server ------------------------------------------------------------ */

/* The connection failed under a statement: fill @p err, and make the next use reconnect. */
static void lost(tally_pg_t *pg, tally_error_t *err)
{
    char msg[400];
    copy_message(msg, sizeof(msg), PQerrorMessage(pg->conn));
    tally_error_set_pg(err, "08006", true, "PostgreSQL connection lost: %s", msg);
    pg->broken = true;
}

/* The deadline passed with no answer. A stalled server (SIGSTOP, a dead host whose TCP peer
 * still acknowledges, a black-holed path) gives no other sign, and PQcancel would itself
 * wait on it: the connection is given up, so that no late answer is taken for another
 * statement's, and the next use connects afresh. */
static void timed_out(tally_pg_t *pg, const char *what, tally_error_t *err)
{
    long long budget = (long long)(atomic_load(&pg->wait_until) - atomic_load(&pg->wait_since));
    TALLY_WARN("PostgreSQL did not answer within %lld ms%s; closing the connection", budget, what);
    tally_error_set_pg(err, "08006", true, "PostgreSQL did not answer within %lld ms%s", budget,
                       what);
    close_conn(pg);
}

/* Send what libpq holds and read until it has a whole result (or the end of one) to hand
 * out, waiting on the socket until the current wait's deadline: one poll() per round trip.
 * false when the connection was lost or the deadline passed (@p err says which; after a
 * deadline pg->conn is NULL). */
static bool await_result(tally_pg_t *pg, tally_error_t *err)
{
    PGconn *conn = pg->conn;
    for (;;) {
        int unsent = PQflush(conn);
        if (unsent < 0) {
            lost(pg, err);
            return false;
        }
        if (unsent == 0 && !PQisBusy(conn))
            return true;
        int64_t left = atomic_load(&pg->wait_until) - now_ms();
        if (left <= 0) {
            timed_out(pg, "", err);
            return false;
        }
        struct pollfd pfd = {.fd = PQsocket(conn), .events = POLLIN | (unsent ? POLLOUT : 0)};
        if (pfd.fd < 0) {
            lost(pg, err);
            return false;
        }
        int rc = poll(&pfd, 1, left > INT32_MAX ? INT32_MAX : (int)left);
        if (rc < 0 && errno != EINTR) {
            lost(pg, err);
            return false;
        }
        if (rc > 0 && (pfd.revents & (POLLIN | POLLERR | POLLHUP)) && !PQconsumeInput(conn)) {
            lost(pg, err);
            return false;
        }
    }
}

/* Every result of what was sent, until PQgetResult says there are no more, kept as PQexec
 * keeps them: the first error, or else the last result. NULL when the connection was lost or
 * the deadline passed (@p err says which). */
static PGresult *collect(tally_pg_t *pg, tally_error_t *err)
{
    PGresult *out = NULL;
    bool out_failed = false;
    for (;;) {
        if (!await_result(pg, err)) {
            PQclear(out);
            return NULL;
        }
        PGresult *res = PQgetResult(pg->conn);
        if (res == NULL)
            break;
        ExecStatusType st = PQresultStatus(res);
        bool failed = st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK;
        if (out_failed) {
            PQclear(res);
            continue;
        }
        PQclear(out);
        out = res;
        out_failed = failed;
    }
    if (out == NULL)
        lost(pg, err); /* the server sent nothing back: only a broken connection does that */
    return out;
}

/* @p sql by the simple-query protocol (several statements allowed), within the deadline. */
static PGresult *exec_simple(tally_pg_t *pg, const char *sql, tally_error_t *err)
{
    if (!PQsendQuery(pg->conn, sql)) {
        lost(pg, err);
        return NULL;
    }
    return collect(pg, err);
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

/* ---- connecting ------------------------------------------------------------------------- */

static bool listen_one(tally_pg_t *pg, const char *channel, tally_error_t *err)
{
    char *ident = PQescapeIdentifier(pg->conn, channel, strlen(channel));
    if (ident == NULL) {
        tally_error_set_pg(err, "08006", true, "LISTEN %s: %s", channel, PQerrorMessage(pg->conn));
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
    wait_start(pg, pg->deadline_ms);
    tally_error_t local;
    PGresult *res = exec_simple(pg, sql, &local);
    wait_done(pg);
    free(sql);
    if (res == NULL) {
        tally_error_set_pg(err, local.sqlstate, true, "LISTEN %s: %s", channel, local.message);
        return false;
    }
    bool ok = PQresultStatus(res) == PGRES_COMMAND_OK;
    if (!ok) {
        const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
        char msg[400];
        copy_message(msg, sizeof(msg), PQerrorMessage(pg->conn));
        tally_error_set_pg(err, state, state ? tally_sqlstate_retriable(state) : true,
                           "LISTEN %s: %s", channel, msg);
    }
    PQclear(res);
    return ok;
}

/* Whether libpq options text (-c name=value, --name=value) sets @p setting. */
static bool options_mention(const char *options, const char *setting)
{
    if (options == NULL)
        return false;
    char dashed[64];
    snprintf(dashed, sizeof dashed, "%s", setting);
    for (char *c = dashed; *c; c++)
        if (*c == '_')
            *c = '-';
    return strstr(options, setting) != NULL || strstr(options, dashed) != NULL;
}

bool tally_pg_keywords(tally_pg_keywords_t *kw, const char *conninfo, const char *application_name,
                       int deadline_ms, const char *env_options)
{
    memset(kw, 0, sizeof *kw);
    /* What the conninfo itself says (key=value or URI). A bare database name does not parse:
     * it sets nothing of ours, and libpq takes it as the dbname. */
    const char *user_options = NULL;
    bool no_options = false; /* options='' said: send none (a pooler that refuses them) */
    PQconninfoOption *parsed = PQconninfoParse(conninfo != NULL ? conninfo : "", NULL);
    for (PQconninfoOption *o = parsed; o != NULL && o->keyword != NULL; o++) {
        if (strcmp(o->keyword, "options") == 0 && o->val != NULL) {
            user_options = o->val[0] != '\0' ? o->val : NULL;
            no_options = o->val[0] == '\0';
        }
    }
    if (user_options == NULL && !no_options && env_options != NULL && env_options[0] != '\0')
        user_options = env_options; /* PGOPTIONS: passing options would override it */

    size_t n = 0;
    /* Entries before the expanded "dbname" are defaults that the conninfo may override. */
    kw->keys[n] = "application_name";
    kw->vals[n++] = application_name;
    if (getenv("PGCONNECT_TIMEOUT") == NULL) {
        kw->keys[n] = "connect_timeout";
        kw->vals[n++] = PG_CONNECT_TIMEOUT_S;
    }
    /* A peer that vanished without a word: the kernel gives up on unacknowledged data after
     * tcp_user_timeout, and on a silent idle connection after idle + interval * count. */
    kw->keys[n] = "tcp_user_timeout";
    kw->vals[n++] = "10000";
    kw->keys[n] = "keepalives";
    kw->vals[n++] = "1";
    kw->keys[n] = "keepalives_idle";
    kw->vals[n++] = "10";
    kw->keys[n] = "keepalives_interval";
    kw->vals[n++] = "5";
    kw->keys[n] = "keepalives_count";
    kw->vals[n++] = "3";
    kw->keys[n] = "dbname";
    kw->vals[n++] = conninfo != NULL ? conninfo : "";
    /* After it: the user's own options, with the server's statement_timeout just under the
     * client's deadline (the server cancels cleanly first; the deadline is for a server that
     * cannot) unless they set one, or asked for no options at all. */
    bool ok = true;
    if (!no_options && !options_mention(user_options, "statement_timeout")) {
        int st =
            tally_pg_statement_timeout_ms(deadline_ms > 0 ? deadline_ms : PG_DEADLINE_DEFAULT_MS);
        ok = asprintf(&kw->options, "%s%s-c statement_timeout=%d",
                      user_options != NULL ? user_options : "", user_options != NULL ? " " : "",
                      st) >= 0;
        if (!ok)
            kw->options = NULL;
        else {
            kw->keys[n] = "options";
            kw->vals[n++] = kw->options;
        }
    }
    kw->keys[n] = NULL;
    kw->vals[n] = NULL;
    PQconninfoFree(parsed);
    return ok;
}

void tally_pg_keywords_clear(tally_pg_keywords_t *kw)
{
    free(kw->options);
    kw->options = NULL;
}

/* How long a connection attempt may take: libpq's connect_timeout (the conninfo's, else
 * PGCONNECT_TIMEOUT, else ours) for each host named, as libpq counts it, or the statement
 * deadline when it is 0 (libpq: wait forever). */
static int connect_budget_ms(const tally_pg_t *pg, PGconn *conn)
{
    long secs = 0;
    int hosts = 1;
    PQconninfoOption *opts = PQconninfo(conn);
    for (PQconninfoOption *o = opts; o != NULL && o->keyword != NULL; o++) {
        if (o->val == NULL)
            continue;
        if (strcmp(o->keyword, "connect_timeout") == 0)
            secs = strtol(o->val, NULL, 10);
        else if (strcmp(o->keyword, "host") == 0 || strcmp(o->keyword, "hostaddr") == 0) {
            int k = 1;
            for (const char *c = o->val; *c; c++)
                k += *c == ',';
            if (k > hosts)
                hosts = k;
        }
    }
    PQconninfoFree(opts);
    if (secs <= 0)
        return pg->deadline_ms;
    if (secs < 2)
        secs = 2; /* as libpq */
    long long ms = (long long)secs * 1000 * hosts;
    return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

/* Drive PQconnectPoll until connected, failed, or out of time. */
static bool await_connected(tally_pg_t *pg, PGconn *conn, tally_error_t *err)
{
    /* libpq: act as if PQconnectPoll had last asked to write */
    PostgresPollingStatusType st = PGRES_POLLING_WRITING;
    for (;;) {
        if (st == PGRES_POLLING_OK)
            return true;
        if (st == PGRES_POLLING_FAILED || PQstatus(conn) == CONNECTION_BAD)
            break;
        int64_t left = atomic_load(&pg->wait_until) - now_ms();
        if (left <= 0) {
            long long budget =
                (long long)(atomic_load(&pg->wait_until) - atomic_load(&pg->wait_since));
            tally_error_set_pg(err, "08001", true,
                               "cannot connect to PostgreSQL: PostgreSQL did not answer within "
                               "%lld ms (connect_timeout)",
                               budget);
            return false;
        }
        struct pollfd pfd = {.fd = PQsocket(conn),
                             .events = st == PGRES_POLLING_READING ? POLLIN : POLLOUT};
        if (pfd.fd < 0)
            break;
        int rc = poll(&pfd, 1, left > INT32_MAX ? INT32_MAX : (int)left);
        if (rc < 0 && errno != EINTR)
            break;
        if (rc > 0)
            st = PQconnectPoll(conn);
    }
    char msg[480];
    copy_message(msg, sizeof(msg), PQerrorMessage(conn));
    tally_error_set_pg(err, "08001", true, "cannot connect to PostgreSQL: %s", msg);
    return false;
}

/* One connection attempt, including LISTEN for every registered channel. */
static bool connect_once(tally_pg_t *pg, tally_error_t *err)
{
    drop_conn(pg);
    tally_pg_keywords_t kw;
    if (!tally_pg_keywords(&kw, pg->conninfo, pg->application_name, pg->deadline_ms,
                           getenv("PGOPTIONS"))) {
        tally_error_set_pg(err, "08001", true, "cannot connect to PostgreSQL: out of memory");
        return false;
    }
    PGconn *conn = PQconnectStartParams(kw.keys, kw.vals, 1);
    tally_pg_keywords_clear(&kw);
    if (conn == NULL) {
        tally_error_set_pg(err, "08001", true, "cannot connect to PostgreSQL: out of memory");
        return false;
    }
    wait_start(pg, connect_budget_ms(pg, conn));
    bool ok = await_connected(pg, conn, err);
    wait_done(pg);
    /* Non-blocking from here on: statements wait in poll() with a deadline (await_result),
     * never inside libpq. */
    if (ok && PQsetnonblocking(conn, 1) != 0) {
        char msg[480];
        copy_message(msg, sizeof(msg), PQerrorMessage(conn));
        tally_error_set_pg(err, "08001", true, "cannot connect to PostgreSQL: %s", msg);
        ok = false;
    }
    if (!ok) {
        PQfinish(conn);
        return false;
    }
    PQsetNoticeProcessor(conn, notice_processor, NULL);
    pg->conn = conn;
    for (size_t i = 0; i < pg->n_channels; i++) {
        if (!listen_one(pg, pg->channels[i], err)) {
            drop_conn(pg);
            return false;
        }
    }
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

static bool ensure_connected(tally_pg_t *pg, tally_error_t *err)
{
    if (tally_pg_ok(pg))
        return true;
    if (pg->in_tx && !pg->begin_pending) {
        tally_error_set_pg(err, "08006", true,
                           "PostgreSQL connection lost inside a transaction; roll back and retry");
        return false;
    }
    /* nothing of a pending transaction has run yet: a new connection is as good, and the
     * BEGIN still goes out with the first statement */
    bool pending = pg->begin_pending;
    if (!tally_pg_connect(pg, 0, NULL, err))
        return false;
    pg->in_tx = pg->begin_pending = pending;
    return true;
}

/* The deferred BEGIN on its own (a caller about to use the raw connection). */
static bool send_pending_begin(tally_pg_t *pg, tally_error_t *err)
{
    pg->begin_pending = false;
    tally_error_t local;
    if (err == NULL)
        err = &local;
    wait_start(pg, pg->deadline_ms);
    PGresult *res = exec_simple(pg, "BEGIN", err);
    wait_done(pg);
    if (res == NULL)
        return false;
    bool ok = PQresultStatus(res) == PGRES_COMMAND_OK;
    if (!ok)
        result_error(pg, res, err);
    PQclear(res);
    return ok;
}

/* The name of @p sql prepared on this connection, in *@p name: prepares it the first time.
 * NULL means "run it unprepared" (no parameters, cache full, or the server refused: the
 * unprepared execution then reports any real error itself). false when the connection was
 * lost or the deadline passed on the way (@p err says which). */
static bool prepared_name(tally_pg_t *pg, const char *sql, int nparams, const char **name,
                          tally_error_t *err)
{
    *name = NULL;
    if (nparams == 0 || pg->no_prepare)
        return true;
    for (size_t i = 0; i < pg->n_stmts; i++) {
        if (strcmp(pg->stmts[i].sql, sql) == 0) {
            *name = pg->stmts[i].name;
            return true;
        }
    }
    if (pg->n_stmts == PG_MAX_PREPARED)
        return true;
    pg_stmt_t *st = &pg->stmts[pg->n_stmts];
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (const unsigned char *c = (const unsigned char *)sql; *c; c++)
        h = (h ^ *c) * 1099511628211ULL;
    snprintf(st->name, sizeof(st->name), "tally_%016llx", (unsigned long long)h);
    if (!PQsendPrepare(pg->conn, st->name, sql, nparams, NULL)) {
        lost(pg, err);
        return false;
    }
    PGresult *res = collect(pg, err);
    if (res == NULL)
        return false;
    if (PQstatus(pg->conn) != CONNECTION_OK) {
        result_error(pg, res, err);
        PQclear(res);
        return false;
    }
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    /* 42P05: a pooled backend has it already — same name, same text */
    bool ok =
        PQresultStatus(res) == PGRES_COMMAND_OK || (state != NULL && strcmp(state, "42P05") == 0);
    PQclear(res);
    if (!ok)
        return true;
    st->sql = strdup(sql);
    if (st->sql == NULL)
        return true; /* prepared but not remembered: preparing it again answers 42P05 */
    pg->n_stmts++;
    *name = st->name;
    return true;
}

/* BEGIN and @p sql in one pipeline: one round trip. @returns the statement's result (or the
 * first error's) like PQexecParams, or NULL when the connection failed or the deadline passed
 * (@p err says which, or is left to result_error when the pipeline could not be sent). */
static PGresult *exec_with_begin(tally_pg_t *pg, const char *sql, const char *name, int nparams,
                                 const char *const *params, const int *lengths, const int *formats,
                                 tally_error_t *err)
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
            if (!await_result(pg, err)) {
                PQclear(out);
                return NULL; /* lost, or closed at the deadline */
            }
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

/* One statement (with the deferred BEGIN, if any) inside the current wait. NULL with @p err
 * filled when it failed. */
static PGresult *exec_bounded(tally_pg_t *pg, const char *sql, int nparams,
                              const char *const *params, const int *lengths, const int *formats,
                              tally_error_t *err)
{
    const char *name = NULL;
    if (!prepared_name(pg, sql, nparams, &name, err))
        return NULL;
    tally_error_t waited; /* a deadline or a loss seen while waiting, already described */
    tally_error_clear(&waited);
    PGresult *res = NULL;
    if (pg->begin_pending)
        res = exec_with_begin(pg, sql, name, nparams, params, lengths, formats, &waited);
    else if (name != NULL
                 ? PQsendQueryPrepared(pg->conn, name, nparams, params, lengths, formats, 0)
                 : PQsendQueryParams(pg->conn, sql, nparams, NULL, params, lengths, formats, 0))
        res = collect(pg, &waited);
    if (res == NULL && waited.errc != TALLY_ERR_NONE) {
        if (err != NULL)
            *err = waited;
        return NULL;
    }
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

PGresult *tally_pg_exec_bin(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                            const int *lengths, const int *formats, tally_error_t *err)
{
    if (!ensure_connected(pg, err))
        return NULL;
    wait_start(pg, pg->deadline_ms);
    PGresult *res = exec_bounded(pg, sql, nparams, params, lengths, formats, err);
    wait_done(pg);
    return res;
}

PGresult *tally_pg_exec_script(tally_pg_t *pg, const char *sql, tally_error_t *err)
{
    if (!ensure_connected(pg, err))
        return NULL;
    wait_start(pg, pg->deadline_ms);
    PGresult *res = exec_simple(pg, sql, err);
    wait_done(pg);
    return res;
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
    tally_error_t err;
    wait_start(pg, pg->deadline_ms);
    PGresult *res = exec_simple(pg, "ROLLBACK", &err); /* at the deadline: closed */
    wait_done(pg);
    if (res != NULL && PQresultStatus(res) != PGRES_COMMAND_OK &&
        PQstatus(pg->conn) != CONNECTION_OK)
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
    if (!listen_one(pg, channel, err)) {
        if (pg->conn != NULL && PQstatus(pg->conn) != CONNECTION_OK)
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
