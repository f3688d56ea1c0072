/* cmd_console.c — `tally console`: the read-only web console. It serves server-rendered pages
 * (console_pages.c) over libmicrohttpd from a few threads, each request reading the ledger
 * through one of a small pool of PostgreSQL sessions, as the read-only role when
 * TALLY_PG_READER names one, and always inside a READ ONLY transaction: the console cannot
 * change the ledger whatever role it is given. It has no authentication of its own, so it binds
 * 127.0.0.1 unless --listen says otherwise (docs/operations.md "Web console": behind a proxy
 * with single sign-on). Every input is checked here or by its page before it reaches a query,
 * and every query takes its values as parameters. */
#include <errno.h>
#include <getopt.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <microhttpd.h>

#include "cli.h"
#include "console.h"
#include "format.h"
#include "tally/id.h"
#include "tally/log.h"

#define VERB         "console"
#define DEFAULT_ADDR "127.0.0.1:8089"
/* Sessions in the pool and threads serving: a page waits for a free session. */
#define POOL_SIZE 4
/* Connections in all, from one address, and how long an idle one stays. */
#define CONNECTIONS 128
#define PER_CLIENT  32
#define IDLE_S      30
/* A page that takes longer than this is cancelled by PostgreSQL, not left to hang. */
#define STATEMENT_TIMEOUT "5s"

static const char USAGE[] =
    "usage: tally console [--listen HOST:PORT]\n"
    "\n"
    "Serve the read-only web console: runs with filters, a run's timeline drawn as a\n"
    "picture, effects, the queues of STUCK, aging UNKNOWN and approvals with the exact\n"
    "command for each, and search by run id, effect id, operation key or external ref.\n"
    "\n"
    "It reads the ledger as TALLY_PG_READER when set (the read-only role), else TALLY_PG,\n"
    "and runs every query in a READ ONLY transaction. It has no authentication of its own:\n"
    "it binds 127.0.0.1, and belongs behind a reverse proxy with single sign-on\n"
    "(docs/operations.md, \"Web console\").\n"
    "\n"
    "  --listen HOST:PORT  where to serve (default TALLY_CONSOLE_ADDR, else " DEFAULT_ADDR ");\n"
    "                      a non-loopback address is served only when given here\n"
    "  -h, --help          this text\n"
    "\n"
    "SIGINT or SIGTERM stops it (exit 0). Exit status: 2 usage error or an address it\n"
    "refuses; 3 PostgreSQL could not be reached at start; 1 it could not serve.\n";

/* ---------------------------------------------------------------------------------------- */
/* The pool of read-only sessions                                                           */

typedef struct con_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    tally_pg_t *pg[POOL_SIZE];
    bool busy[POOL_SIZE];
    long unknown_age_s;
} con_pool_t;

/* The session settings every page relies on: UTC times, a bound on each statement, READ ONLY
 * as the session's default too (belt and braces beside each BEGIN READ ONLY), and a plan made
 * for each request's values: tally_pg prepares statements, and a generic plan of the runs
 * list's optional filters ("$3 IS NULL OR ...") reads every run where a custom one reads 20. */
static bool session_setup(tally_pg_t *pg, tally_error_t *err)
{
    return tally_pg_run(pg,
                        "SELECT set_config('TimeZone', 'UTC', false),"
                        " set_config('statement_timeout', '" STATEMENT_TIMEOUT "', false),"
                        " set_config('default_transaction_read_only', 'on', false),"
                        " set_config('plan_cache_mode', 'force_custom_plan', false)",
                        0, NULL, err);
}

static tally_pg_t *pool_take(con_pool_t *pool, size_t *slot)
{
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        for (size_t i = 0; i < POOL_SIZE; i++) {
            if (!pool->busy[i]) {
                pool->busy[i] = true;
                pthread_mutex_unlock(&pool->mu);
                *slot = i;
                return pool->pg[i];
            }
        }
        pthread_cond_wait(&pool->cv, &pool->mu);
    }
}

static void pool_give(con_pool_t *pool, size_t slot)
{
    pthread_mutex_lock(&pool->mu);
    pool->busy[slot] = false;
    pthread_cond_signal(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
}

/* ---------------------------------------------------------------------------------------- */
/* Inputs                                                                                   */

const char *con_param(const con_req_t *rq, const char *key)
{
    for (size_t i = 0; i < rq->n_params; i++)
        if (strcmp(rq->params[i].key, key) == 0)
            return rq->params[i].value[0] != '\0' ? rq->params[i].value : NULL;
    return NULL;
}

bool con_check_params(con_req_t *rq, const char *const *allowed)
{
    for (size_t i = 0; i < rq->n_params; i++) {
        bool known = false;
        for (const char *const *a = allowed; *a != NULL; a++)
            known = known || strcmp(*a, rq->params[i].key) == 0;
        if (!known) {
            con_error(rq, 400, "unknown parameter '%s' for this page", rq->params[i].key);
            return false;
        }
        for (size_t j = 0; j < i; j++) {
            if (strcmp(rq->params[j].key, rq->params[i].key) == 0) {
                con_error(rq, 400, "parameter '%s' is given more than once", rq->params[i].key);
                return false;
            }
        }
    }
    return true;
}

/* Valid UTF-8 without control characters. */
static bool printable(const char *s)
{
    size_t len = strlen(s);
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f)
            return false;
        size_t n = tally_utf8_seq((const unsigned char *)s + i, len - i);
        if (n == 0)
            return false;
        i += n;
    }
    return true;
}

bool con_valid_text(const char *s)
{
    return strlen(s) <= CON_MAX_PARAM && printable(s);
}

static bool digits(const char *s, size_t n, int lo, int hi)
{
    int v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return false;
        v = v * 10 + (s[i] - '0');
    }
    return v >= lo && v <= hi;
}

bool con_valid_time(const char *s)
{
    /* YYYY-MM-DD */
    if (strlen(s) < 10 || !digits(s, 4, 1970, 9999) || s[4] != '-' || !digits(s + 5, 2, 1, 12) ||
        s[7] != '-' || !digits(s + 8, 2, 1, 31))
        return false;
    const char *p = s + 10;
    if (*p == '\0')
        return true;
    /* [T ]HH:MM[:SS[.f{1,6}]] */
    if ((*p != 'T' && *p != ' ') || !digits(p + 1, 2, 0, 23) || p[3] != ':' ||
        !digits(p + 4, 2, 0, 59))
        return false;
    p += 6;
    if (*p == ':') {
        if (!digits(p + 1, 2, 0, 60))
            return false;
        p += 3;
        if (*p == '.') {
            size_t n = strspn(p + 1, "0123456789");
            if (n < 1 || n > 6)
                return false;
            p += 1 + n;
        }
    }
    /* [Z | ±HH:MM] */
    if (*p == 'Z')
        p++;
    else if (*p == '+' || *p == '-') {
        if (!digits(p + 1, 2, 0, 14) || p[3] != ':' || !digits(p + 4, 2, 0, 59))
            return false;
        p += 6;
    }
    return *p == '\0';
}

bool con_page_number(con_req_t *rq, long *page)
{
    const char *v = con_param(rq, "page");
    *page = 1;
    if (v == NULL)
        return true;
    if (strlen(v) > 4 || strspn(v, "0123456789") != strlen(v) || atol(v) < 1 ||
        atol(v) > CON_MAX_PAGE) {
        con_error(rq, 400,
                  "page must be a number from 1 to %d (narrow the list with the filters "
                  "to go further)",
                  CON_MAX_PAGE);
        return false;
    }
    *page = atol(v);
    return true;
}

json_t *con_query(con_req_t *rq, const char *sql, int nparams, const char *const *params)
{
    tally_error_t err;
    json_t *doc = cli_query_json(rq->pg, sql, nparams, params, &err);
    if (doc != NULL)
        return doc;
    TALLY_WARN("console query failed: %s (SQLSTATE %s)", err.message, err.sqlstate);
    if (err.errc == TALLY_ERR_PG_CONNECTION)
        con_error(rq, 503, "PostgreSQL could not be reached: %s", err.message);
    else if (strncmp(err.sqlstate, "22", 2) == 0)
        con_error(rq, 400, "the database refused a value of the request: %s", err.message);
    else
        con_error(rq, 500, "the query failed (SQLSTATE %s): %s", err.sqlstate, err.message);
    return NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* Serving                                                                                  */

typedef struct collect {
    con_req_t *rq;
    size_t bytes;
    bool too_many;
} collect_t;

static enum MHD_Result collect_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                                   const char *value)
{
    (void)kind;
    collect_t *c = cls;
    c->bytes += strlen(key) + (value != NULL ? strlen(value) : 0) + 2;
    if (c->rq->n_params >= CON_MAX_PARAMS) {
        c->too_many = true;
        return MHD_YES;
    }
    c->rq->params[c->rq->n_params].key = key;
    c->rq->params[c->rq->n_params].value = value != NULL ? value : "";
    c->rq->n_params++;
    return MHD_YES;
}

static unsigned route(con_req_t *rq)
{
    const char *p = rq->path;
    if (strcmp(p, "/") == 0 || strcmp(p, "/runs") == 0 || strcmp(p, "/runs/") == 0)
        return con_page_runs(rq);
    if (strncmp(p, "/runs/", 6) == 0)
        return con_page_run(rq, p + 6);
    if (strncmp(p, "/effects/", 9) == 0)
        return con_page_effect(rq, p + 9);
    if (strcmp(p, "/queues") == 0)
        return con_page_queues(rq);
    if (strcmp(p, "/search") == 0)
        return con_page_search(rq);
#ifdef TALLY_CRASH_POINTS
    /* Test builds only, and only when asked: a write through the pages' own transaction, which
     * READ ONLY must refuse (tests/integration/test_console.py). */
    if (strcmp(p, "/_test/write") == 0 && getenv("TALLY_CONSOLE_TEST_WRITE") != NULL) {
        tally_error_t err;
        if (tally_pg_run(rq->pg,
                         "INSERT INTO events (event_id, kind, actor, reason)"
                         " VALUES (gen_random_uuid(), 'console_probe', 'tally-console', $1)",
                         1, (const char *[]){"a console write"}, &err))
            return con_error(rq, 200, "the write succeeded");
        return con_error(rq, 403, "the write was refused (SQLSTATE %s): %s", err.sqlstate,
                         err.message);
    }
#endif
    return con_error(rq, 404, "there is no page at this address");
}

static enum MHD_Result send_page(struct MHD_Connection *conn, con_req_t *rq)
{
    char *body = tally_strbuf_take(&rq->body);
    if (body == NULL) {
        static const char oom[] = "out of memory\n";
        struct MHD_Response *r =
            MHD_create_response_from_buffer(strlen(oom), (void *)oom, MHD_RESPMEM_PERSISTENT);
        if (r == NULL)
            return MHD_NO;
        enum MHD_Result ret = MHD_queue_response(conn, 500, r);
        MHD_destroy_response(r);
        return ret;
    }
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (resp == NULL) {
        free(body);
        return MHD_NO;
    }
    char csp[256];
    snprintf(csp, sizeof csp,
             "default-src 'none'; style-src 'nonce-%s'; script-src 'nonce-%s'; "
             "img-src 'self' data:; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
             rq->nonce, rq->nonce);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/html; charset=utf-8");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    MHD_add_response_header(resp, "Content-Security-Policy", csp);
    MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(resp, "X-Frame-Options", "DENY");
    MHD_add_response_header(resp, "Referrer-Policy", "no-referrer");
    if (rq->status == 405)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    if (rq->location != NULL)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_LOCATION, rq->location);
    enum MHD_Result ret = MHD_queue_response(conn, rq->status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result send_text(struct MHD_Connection *conn, unsigned status, const char *text)
{
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY);
    if (r == NULL)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/plain; charset=utf-8");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_data_size, void **con_cls)
{
    (void)version;
    (void)upload_data;
    (void)con_cls;
    con_pool_t *pool = cls;
    /* a page below a directory (runs/<id>, effects/<id>) reaches the root one step up */
    con_req_t rq = {.path = url,
                    .root = strchr(url + (url[0] == '/'), '/') != NULL ? "../" : "./",
                    .status = 200,
                    .unknown_age_s = pool->unknown_age_s};
    char uuid[37];
    tally_uuid(uuid);
    size_t n = 0;
    for (const char *c = uuid; *c != '\0'; c++)
        if (*c != '-')
            rq.nonce[n++] = *c;
    rq.nonce[n] = '\0';

    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
        *upload_data_size = 0;
        con_error(&rq, 405, "the console only reads: GET and HEAD are the methods it answers");
        return send_page(conn, &rq);
    }
    if (strcmp(url, "/healthz") == 0)
        return send_text(conn, 200, "ok\n");

    collect_t c = {.rq = &rq};
    MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, collect_arg, &c);
    if (strlen(url) + c.bytes > CON_MAX_URL) {
        con_error(&rq, 414, "the address is longer than %d bytes", CON_MAX_URL);
        return send_page(conn, &rq);
    }
    if (c.too_many) {
        con_error(&rq, 400, "more than %d query parameters", CON_MAX_PARAMS);
        return send_page(conn, &rq);
    }
    if (!printable(url)) {
        con_error(&rq, 400, "the address is not valid UTF-8 text");
        return send_page(conn, &rq);
    }
    for (size_t i = 0; i < rq.n_params; i++) {
        if (!con_valid_text(rq.params[i].key) || !con_valid_text(rq.params[i].value)) {
            con_error(&rq, 400, "a query parameter is not printable UTF-8 text of at most %d bytes",
                      CON_MAX_PARAM);
            return send_page(conn, &rq);
        }
    }

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    size_t slot;
    rq.pg = pool_take(pool, &slot);
    tally_error_t err;
    if (!tally_pg_ok(rq.pg) &&
        (!tally_pg_connect(rq.pg, 0, NULL, &err) || !session_setup(rq.pg, &err))) {
        con_error(&rq, 503, "PostgreSQL could not be reached: %s", err.message);
    } else if (!cli_begin_snapshot(rq.pg, &err)) {
        con_error(&rq, err.errc == TALLY_ERR_PG_CONNECTION ? 503 : 500,
                  "could not start a read-only transaction: %s", err.message);
    } else {
        route(&rq);
        tally_pg_rollback(rq.pg); /* it read; there is nothing to commit */
    }
    pool_give(pool, slot);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    if (rq.status >= 500)
        TALLY_WARN("console: %s %s: %u in %.1f ms", method, url, rq.status, ms);
    else
        TALLY_DEBUG("console: %s %s: %u in %.1f ms", method, url, rq.status, ms);
    enum MHD_Result ret = send_page(conn, &rq);
    free(rq.location);
    return ret;
}

/* ---------------------------------------------------------------------------------------- */
/* The address                                                                              */

/* "host:port" or "[v6]:port" into @p host and @p port; false with the reason. */
static bool split_addr(const char *addr, char *host, size_t hostsz, char *port, size_t portsz)
{
    const char *hb = addr, *he, *colon;
    if (addr[0] == '[') {
        const char *close = strchr(addr, ']');
        if (close == NULL || close[1] != ':')
            return false;
        hb = addr + 1;
        he = close;
        colon = close + 1;
    } else {
        colon = strrchr(addr, ':');
        if (colon == NULL)
            return false;
        he = colon;
    }
    const char *p = colon + 1;
    if (*p == '\0' || strlen(p) > 5 || strspn(p, "0123456789") != strlen(p) || atoi(p) > 65535 ||
        (size_t)(he - hb) >= hostsz)
        return false;
    memcpy(host, hb, (size_t)(he - hb));
    host[he - hb] = '\0';
    snprintf(port, portsz, "%s", p);
    return true;
}

static bool is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
    }
    return false;
}

/* ---------------------------------------------------------------------------------------- */

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char msg[512];
    tally_vfmt(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    TALLY_WARN("console http server: %s", msg);
}

int tally_cmd_console(int argc, char **argv, tally_config_t *cfg)
{
    static const struct option opts[] = {{"listen", required_argument, NULL, 'l'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *listen = NULL;
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option(VERB, USAGE, argc, argv, opts, &rc)) != -1) {
        if (c == 'l')
            listen = optarg;
    }
    if (rc != -1)
        return rc;
    bool explicit_listen = listen != NULL;
    const char *addr = listen;
    if (addr == NULL)
        addr = cfg->console_addr;
    if (addr == NULL || addr[0] == '\0')
        addr = DEFAULT_ADDR;

    char host[256], port[8];
    if (!split_addr(addr, host, sizeof host, port, sizeof port))
        return cli_usage_error(VERB, "'%s' is not an address: expected HOST:PORT or [IPV6]:PORT",
                               addr);
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
    struct addrinfo *ai = NULL;
    int gai = getaddrinfo(host[0] != '\0' ? host : NULL, port, &hints, &ai);
    if (gai != 0)
        return cli_usage_error(VERB, "address '%s': %s", addr, gai_strerror(gai));
    if (!is_loopback(ai->ai_addr)) {
        if (!explicit_listen) {
            freeaddrinfo(ai);
            fprintf(stderr,
                    "tally console: refusing to serve on %s, which is not a loopback address: "
                    "the console has no authentication of its own. Put it behind a reverse proxy "
                    "with single sign-on, or say --listen %s to serve there anyway.\n",
                    addr, addr);
            return CLI_EXIT_USAGE;
        }
        fprintf(stderr,
                "tally console: warning: serving on %s, which is not a loopback address. The "
                "console has no authentication of its own: anyone who reaches this address "
                "reads the ledger. It belongs behind a reverse proxy with single sign-on "
                "(docs/operations.md, \"Web console\").\n",
                addr);
    }

    const char *reader = getenv("TALLY_PG_READER");
    const char *conninfo = reader != NULL && reader[0] != '\0' ? reader
                           : cfg->pg != NULL                   ? cfg->pg
                                                               : "";
    con_pool_t pool = {.unknown_age_s = cfg->unknown_age_s};
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    rc = CLI_EXIT_OK;
    for (size_t i = 0; i < POOL_SIZE; i++) {
        pool.pg[i] = tally_pg_new(conninfo, "tally-console");
        if (pool.pg[i] == NULL) {
            fprintf(stderr, "tally console: out of memory\n");
            rc = CLI_EXIT_REFUSED;
        } else {
            tally_pg_set_deadline(pool.pg[i], cfg->pg_deadline_ms);
        }
    }
    /* The first session connects now, so that a wrong TALLY_PG fails at start, not on the
     * first page; the others connect when first needed. */
    tally_error_t err;
    if (rc == CLI_EXIT_OK &&
        (!tally_pg_connect(pool.pg[0], 0, NULL, &err) || !session_setup(pool.pg[0], &err))) {
        fprintf(stderr, "tally console: %s\n", err.message);
        rc = CLI_EXIT_INFRA;
    }

    /* The signals stay blocked in the server's threads; this one waits for them. */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    pthread_sigmask(SIG_BLOCK, &block, &old);

    struct MHD_Daemon *d = NULL;
    if (rc == CLI_EXIT_OK) {
        unsigned int flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
        if (ai->ai_family == AF_INET6)
            flags |= MHD_USE_IPv6;
        errno = 0;
        d = MHD_start_daemon(
            flags, 0, NULL, NULL, handle, &pool, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
            MHD_OPTION_SOCK_ADDR, ai->ai_addr, MHD_OPTION_THREAD_POOL_SIZE, (unsigned int)POOL_SIZE,
            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)IDLE_S, MHD_OPTION_CONNECTION_LIMIT,
            (unsigned int)CONNECTIONS, MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned int)PER_CLIENT,
            MHD_OPTION_END);
        if (d == NULL) {
            fprintf(stderr, "tally console: cannot serve on %s: %s\n", addr,
                    errno != 0 ? strerror(errno) : "libmicrohttpd could not start");
            rc = CLI_EXIT_REFUSED;
        }
    }
    freeaddrinfo(ai);
    if (d != NULL) {
        const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
        char shown[300];
        snprintf(shown, sizeof shown, "%s", host[0] != '\0' ? host : "0.0.0.0");
        printf("tally console: serving http://%s%s%s:%d/ (read-only, as %s)\n",
               strchr(shown, ':') ? "[" : "", shown, strchr(shown, ':') ? "]" : "",
               info != NULL ? (int)info->port : atoi(port),
               reader != NULL && reader[0] != '\0' ? "TALLY_PG_READER" : "TALLY_PG");
        fflush(stdout);
        sigset_t wait = old;
        sigdelset(&wait, SIGINT);
        sigdelset(&wait, SIGTERM);
        while (!stop_flag)
            sigsuspend(&wait);
        MHD_stop_daemon(d);
        printf("tally console: stopped\n");
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    for (size_t i = 0; i < POOL_SIZE; i++)
        tally_pg_free(pool.pg[i]);
    pthread_cond_destroy(&pool.cv);
    pthread_mutex_destroy(&pool.mu);
    return rc;
}
