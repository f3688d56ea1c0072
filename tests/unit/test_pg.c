/* test_pg.c — the connection keywords tally adds to TALLY_PG (timeouts and keepalives as
 * defaults, statement_timeout appended to the user's own options), read back as libpq resolves
 * them; and the client-side deadline against a server that accepts and then never answers
 * (a thread in this test: TCP up, nothing behind it). The deadline against a real stalled
 * PostgreSQL is tests/integration/test_pg_stall.py's. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <poll.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "tally/pg.h"

/* A host no connection attempt can reach, so that PQconnectStartParams fails at once and
 * PQconninfo still shows what libpq would have used. */
#define NOWHERE "/nonexistent-tally-test-dir"

/* The value libpq resolves for @p keyword from @p kw (malloc'd; NULL for none). */
static char *effective(const tally_pg_keywords_t *kw, const char *keyword)
{
    PGconn *conn = PQconnectStartParams(kw->keys, kw->vals, 1);
    assert_non_null(conn);
    char *out = NULL;
    PQconninfoOption *opts = PQconninfo(conn);
    for (PQconninfoOption *o = opts; o != NULL && o->keyword != NULL; o++)
        if (strcmp(o->keyword, keyword) == 0 && o->val != NULL)
            out = strdup(o->val);
    PQconninfoFree(opts);
    PQfinish(conn);
    return out;
}

static void assert_effective(const tally_pg_keywords_t *kw, const char *keyword, const char *want)
{
    char *got = effective(kw, keyword);
    if (got == NULL || strcmp(got, want) != 0)
        fail_msg("%s: got '%s', want '%s'", keyword, got ? got : "(none)", want);
    free(got);
}

static int setup(void **state)
{
    (void)state;
    unsetenv("PGCONNECT_TIMEOUT");
    return 0;
}

static void test_defaults_fill_what_the_conninfo_leaves_unset(void **state)
{
    (void)state;
    tally_pg_keywords_t kw;
    assert_true(
        tally_pg_keywords(&kw, "host=" NOWHERE " dbname=ledger", "tally-dispatcher", 30000, NULL));
    assert_effective(&kw, "dbname", "ledger");
    assert_effective(&kw, "application_name", "tally-dispatcher");
    assert_effective(&kw, "connect_timeout", "10");
    assert_effective(&kw, "tcp_user_timeout", "10000");
    assert_effective(&kw, "keepalives", "1");
    assert_effective(&kw, "keepalives_idle", "10");
    assert_effective(&kw, "keepalives_interval", "5");
    assert_effective(&kw, "keepalives_count", "3");
    /* the server cancels at 5/6 of the client's deadline */
    assert_effective(&kw, "options", "-c statement_timeout=25000");
    tally_pg_keywords_clear(&kw);

    assert_true(tally_pg_keywords(&kw, "host=" NOWHERE, "tally", 6000, NULL));
    assert_effective(&kw, "options", "-c statement_timeout=5000");
    tally_pg_keywords_clear(&kw);
    assert_int_equal(tally_pg_statement_timeout_ms(30000), 25000);
}

static void test_what_the_conninfo_sets_wins(void **state)
{
    (void)state;
    tally_pg_keywords_t kw;
    assert_true(tally_pg_keywords(&kw,
                                  "host=" NOWHERE " tcp_user_timeout=2500 keepalives_idle=60"
                                  " connect_timeout=3 application_name=mine"
                                  " options='-c work_mem=8MB'",
                                  "tally-relay", 30000, NULL));
    assert_effective(&kw, "tcp_user_timeout", "2500");
    assert_effective(&kw, "keepalives_idle", "60");
    assert_effective(&kw, "keepalives_interval", "5");
    assert_effective(&kw, "connect_timeout", "3");
    assert_effective(&kw, "application_name", "mine");
    /* the user's options are kept; ours is appended */
    assert_effective(&kw, "options", "-c work_mem=8MB -c statement_timeout=25000");
    tally_pg_keywords_clear(&kw);

    /* keepalives=0 turns them off, as the user asked */
    assert_true(tally_pg_keywords(&kw, "host=" NOWHERE " keepalives=0", "tally", 30000, NULL));
    assert_effective(&kw, "keepalives", "0");
    tally_pg_keywords_clear(&kw);
}

static void test_uri_form(void **state)
{
    (void)state;
    tally_pg_keywords_t kw;
    assert_true(tally_pg_keywords(&kw,
                                  "postgresql://app@%2Fnonexistent-tally-test-dir/ledger"
                                  "?keepalives_count=9&options=-c%20search_path%3Dtally",
                                  "tally", 30000, NULL));
    assert_effective(&kw, "user", "app");
    assert_effective(&kw, "dbname", "ledger");
    assert_effective(&kw, "keepalives_count", "9");
    assert_effective(&kw, "tcp_user_timeout", "10000");
    assert_effective(&kw, "options", "-c search_path=tally -c statement_timeout=25000");
    tally_pg_keywords_clear(&kw);

    /* a URI without options: ours alone */
    assert_true(tally_pg_keywords(&kw, "postgres:///ledger?host=" NOWHERE, "tally", 12000, NULL));
    assert_effective(&kw, "options", "-c statement_timeout=10000");
    tally_pg_keywords_clear(&kw);
}

static void test_a_statement_timeout_of_the_users_own_is_left_alone(void **state)
{
    (void)state;
    tally_pg_keywords_t kw;
    assert_true(tally_pg_keywords(&kw, "host=" NOWHERE " options='-c statement_timeout=0'", "tally",
                                  30000, NULL));
    assert_null(kw.options);
    assert_effective(&kw, "options", "-c statement_timeout=0");
    tally_pg_keywords_clear(&kw);

    /* --name=value and dashes count too; in a URI as well */
    assert_true(tally_pg_keywords(
        &kw, "postgresql:///ledger?host=" NOWHERE "&options=--statement-timeout%3D1min", "tally",
        30000, NULL));
    assert_effective(&kw, "options", "--statement-timeout=1min");
    tally_pg_keywords_clear(&kw);
}

static void test_pgoptions_is_kept_when_the_conninfo_has_none(void **state)
{
    (void)state;
    tally_pg_keywords_t kw;
    assert_true(tally_pg_keywords(&kw, "host=" NOWHERE, "tally", 30000, "-c search_path=ledger"));
    assert_effective(&kw, "options", "-c search_path=ledger -c statement_timeout=25000");
    tally_pg_keywords_clear(&kw);
    /* the conninfo's own options win over PGOPTIONS, as in libpq */
    assert_true(tally_pg_keywords(&kw, "host=" NOWHERE " options=-cwork_mem=1MB", "tally", 30000,
                                  "-c search_path=ledger"));
    assert_effective(&kw, "options", "-cwork_mem=1MB -c statement_timeout=25000");
    tally_pg_keywords_clear(&kw);
    assert_true(tally_pg_keywords(&kw, "host=" NOWHERE, "tally", 30000, "-c statement_timeout=7s"));
    assert_null(kw.options);
    tally_pg_keywords_clear(&kw);
}

/* options='' asks for no startup options at all (PgBouncer refuses "options" unless told to
 * ignore it): tally adds none, and PGOPTIONS is not sent either. */
static void test_empty_options_send_none(void **state)
{
    (void)state;
    tally_pg_keywords_t kw;
    assert_true(tally_pg_keywords(&kw, "host=" NOWHERE " options=''", "tally", 30000,
                                  "-c search_path=ledger"));
    assert_null(kw.options);
    for (size_t i = 0; kw.keys[i] != NULL; i++)
        assert_string_not_equal(kw.keys[i], "options");
    char *got = effective(&kw, "options");
    assert_true(got == NULL || got[0] == '\0');
    free(got);
    assert_effective(&kw, "tcp_user_timeout", "10000"); /* the rest still applies */
    tally_pg_keywords_clear(&kw);

    assert_true(tally_pg_keywords(&kw, "postgresql:///ledger?host=" NOWHERE "&options=", "tally",
                                  30000, NULL));
    assert_null(kw.options);
    tally_pg_keywords_clear(&kw);
}

static void test_a_bare_database_name_still_connects_with_the_defaults(void **state)
{
    (void)state;
    tally_pg_keywords_t kw;
    assert_true(tally_pg_keywords(&kw, "ledger", "tally", 30000, NULL));
    assert_effective(&kw, "dbname", "ledger");
    assert_effective(&kw, "tcp_user_timeout", "10000");
    assert_effective(&kw, "options", "-c statement_timeout=25000");
    tally_pg_keywords_clear(&kw);
}

static void test_pgconnect_timeout_is_left_to_libpq(void **state)
{
    (void)state;
    setenv("PGCONNECT_TIMEOUT", "4", 1);
    tally_pg_keywords_t kw;
    assert_true(tally_pg_keywords(&kw, "host=" NOWHERE, "tally", 30000, NULL));
    assert_effective(&kw, "connect_timeout", "4");
    tally_pg_keywords_clear(&kw);
    unsetenv("PGCONNECT_TIMEOUT");
}

/* ---- a server that accepts and never answers -------------------------------------------- */

#define MUTE_CONNS 4

/* Accepts connections and answers each one's start-up when @c greet (AuthenticationOk,
 * ReadyForQuery), then nothing more: what the client sends is only recorded, as a stalled
 * server's kernel would take it in. */
typedef struct mute_server {
    int listen_fd;
    int port;
    bool greet;
    atomic_bool stop;
    int fds[MUTE_CONNS];
    char got[MUTE_CONNS][4096]; /* bytes received after the start-up ('\0' kept as '.') */
    size_t n_got[MUTE_CONNS];
    atomic_int n_conns;
    pthread_t thread;
} mute_server_t;

static bool mute_hello(int fd)
{
    unsigned char len4[4]; /* the start-up packet: its length, then the rest */
    if (recv(fd, len4, 4, MSG_WAITALL) != 4)
        return false;
    uint32_t len = ((uint32_t)len4[0] << 24) | ((uint32_t)len4[1] << 16) |
                   ((uint32_t)len4[2] << 8) | (uint32_t)len4[3];
    char rest[1024];
    if (len < 8 || len - 4 > sizeof rest || recv(fd, rest, len - 4, MSG_WAITALL) < 0)
        return false;
    static const unsigned char hello[] = {'R', 0, 0, 0, 8, 0, 0, 0, 0, 'Z', 0, 0, 0, 5, 'I'};
    return send(fd, hello, sizeof hello, 0) == (ssize_t)sizeof hello;
}

static void *mute_main(void *arg)
{
    mute_server_t *s = arg;
    while (!atomic_load(&s->stop)) {
        int n = atomic_load(&s->n_conns);
        struct pollfd pfds[MUTE_CONNS + 1];
        pfds[0] = (struct pollfd){.fd = s->listen_fd, .events = POLLIN};
        for (int i = 0; i < n; i++)
            pfds[i + 1] = (struct pollfd){.fd = s->fds[i], .events = POLLIN};
        if (poll(pfds, (nfds_t)n + 1, 50) <= 0)
            continue;
        if ((pfds[0].revents & POLLIN) && n < MUTE_CONNS) {
            int fd = accept(s->listen_fd, NULL, NULL);
            if (fd >= 0) {
                s->fds[n] = fd;
                atomic_store(&s->n_conns, n + 1);
                if (s->greet)
                    (void)mute_hello(fd);
            }
        }
        for (int i = 0; i < n; i++) {
            if (!(pfds[i + 1].revents & POLLIN))
                continue;
            char buf[1024];
            ssize_t r = recv(s->fds[i], buf, sizeof buf, MSG_DONTWAIT);
            for (ssize_t k = 0; k < r && s->n_got[i] + 1 < sizeof s->got[i]; k++)
                s->got[i][s->n_got[i]++] = buf[k] != '\0' ? buf[k] : '.';
        }
    }
    return NULL;
}

static void mute_start(mute_server_t *s, bool greet)
{
    memset(s, 0, sizeof *s);
    s->greet = greet;
    s->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(s->listen_fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(s->listen_fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(s->listen_fd, 4), 0);
    socklen_t alen = sizeof a;
    assert_int_equal(getsockname(s->listen_fd, (struct sockaddr *)&a, &alen), 0);
    s->port = ntohs(a.sin_port);
    assert_int_equal(pthread_create(&s->thread, NULL, mute_main, s), 0);
}

static void mute_stop(mute_server_t *s)
{
    atomic_store(&s->stop, true);
    pthread_join(s->thread, NULL);
    for (int i = 0; i < atomic_load(&s->n_conns); i++)
        close(s->fds[i]);
    close(s->listen_fd);
}

static long long mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

typedef struct watcher {
    tally_pg_t *pg;
    atomic_bool stop;
    atomic_bool saw_wait;
    pthread_t thread;
} watcher_t;

/* Another thread, as /healthz would: does it see the wait, with its deadline? */
static void *watch_main(void *arg)
{
    watcher_t *w = arg;
    while (!atomic_load(&w->stop)) {
        long long since = 0;
        long long until = 0;
        if (tally_pg_waiting(w->pg, &since, &until) && since > 0 && until > since)
            atomic_store(&w->saw_wait, true);
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void test_a_connection_attempt_that_gets_no_answer_ends_at_connect_timeout(void **state)
{
    (void)state;
    mute_server_t s;
    mute_start(&s, false);
    char conninfo[200];
    snprintf(conninfo, sizeof conninfo,
             "host=127.0.0.1 port=%d user=t dbname=t sslmode=disable gssencmode=disable "
             "connect_timeout=2",
             s.port);
    tally_pg_t *pg = tally_pg_new(conninfo, "tally-test");
    assert_non_null(pg);
    watcher_t w = {.pg = pg};
    assert_int_equal(pthread_create(&w.thread, NULL, watch_main, &w), 0);
    tally_error_t err;
    tally_error_clear(&err);
    long long t0 = mono_ms();
    assert_false(tally_pg_connect(pg, 0, NULL, &err));
    long long took = mono_ms() - t0;
    atomic_store(&w.stop, true);
    pthread_join(w.thread, NULL);
    assert_true(took >= 1500 && took < 15000);
    assert_string_equal(err.sqlstate, "08001");
    assert_true(err.retriable);
    assert_non_null(strstr(err.message, "did not answer within 2000 ms"));
    assert_true(atomic_load(&w.saw_wait));
    assert_false(tally_pg_waiting(pg, NULL, NULL));
    assert_true(tally_pg_last_wait_end_ms(pg) > 0);
    tally_pg_free(pg);
    mute_stop(&s);
}

static void test_a_statement_that_gets_no_answer_ends_at_the_deadline(void **state)
{
    (void)state;
    mute_server_t s;
    mute_start(&s, true);
    char conninfo[200];
    snprintf(conninfo, sizeof conninfo,
             "host=127.0.0.1 port=%d user=t dbname=t sslmode=disable gssencmode=disable", s.port);
    tally_pg_t *pg = tally_pg_new(conninfo, "tally-test");
    assert_non_null(pg);
    tally_pg_set_deadline(pg, 500);
    tally_error_t err;
    tally_error_clear(&err);
    if (!tally_pg_connect(pg, 0, NULL, &err))
        fail_msg("connecting to the test's server: %s", err.message);
    assert_true(tally_pg_ok(pg));
    watcher_t w = {.pg = pg};
    assert_int_equal(pthread_create(&w.thread, NULL, watch_main, &w), 0);
    assert_true(tally_pg_begin(pg, &err));
    long long t0 = mono_ms();
    /* no parameters: not prepared, so BEGIN and the statement go out in one pipeline */
    PGresult *res = tally_pg_exec(pg, "SELECT 1", 0, NULL, &err);
    long long took = mono_ms() - t0;
    atomic_store(&w.stop, true);
    pthread_join(w.thread, NULL);
    assert_null(res);
    assert_true(took >= 400 && took < 10000);
    assert_string_equal(err.sqlstate, "08006");
    assert_true(err.retriable);
    assert_string_equal(err.message, "PostgreSQL did not answer within 500 ms");
    assert_true(atomic_load(&w.saw_wait));
    /* given up: the next use reconnects */
    assert_false(tally_pg_ok(pg));
    assert_null(tally_pg_conn(pg));
    assert_false(tally_pg_waiting(pg, NULL, NULL));

    /* inside a transaction, the loss is reported (no silent reconnect) until a rollback */
    res = tally_pg_exec(pg, "SELECT 1", 0, NULL, &err);
    assert_null(res);
    if (strstr(err.message, "inside a transaction") == NULL)
        fail_msg("after the deadline: %s", err.message);
    tally_pg_rollback(pg);
    mute_stop(&s);
    tally_pg_free(pg);
}

/* A deadline that closed the connection before anything of a transaction ran (here: preparing
 * its first statement) leaves the transaction pending: the next statement reconnects and
 * still sends BEGIN with it, never running outside the transaction the caller opened. */
static void test_a_pending_transaction_survives_a_reconnect(void **state)
{
    (void)state;
    mute_server_t s;
    mute_start(&s, true);
    char conninfo[200];
    snprintf(conninfo, sizeof conninfo,
             "host=127.0.0.1 port=%d user=t dbname=t sslmode=disable gssencmode=disable", s.port);
    tally_pg_t *pg = tally_pg_new(conninfo, "tally-test");
    assert_non_null(pg);
    tally_pg_set_deadline(pg, 300);
    tally_error_t err;
    tally_error_clear(&err);
    assert_true(tally_pg_begin(pg, &err));
    const char *params[1] = {"1"};
    assert_null(tally_pg_exec(pg, "SELECT $1::int", 1, params, &err)); /* Parse: no answer */
    assert_string_equal(err.message, "PostgreSQL did not answer within 300 ms");
    assert_null(tally_pg_exec(pg, "SELECT 2", 0, NULL, &err)); /* a new connection */
    assert_string_equal(err.message, "PostgreSQL did not answer within 300 ms");
    mute_stop(&s);
    assert_int_equal(atomic_load(&s.n_conns), 2);
    const char *sent = s.got[1];
    const char *begin = strstr(sent, "BEGIN");
    const char *stmt = strstr(sent, "SELECT 2");
    if (begin == NULL || stmt == NULL || begin > stmt)
        fail_msg("the second connection got '%s', not BEGIN then the statement", sent);
    assert_null(strstr(s.got[0], "SELECT 2"));
    tally_pg_free(pg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_defaults_fill_what_the_conninfo_leaves_unset, setup),
        cmocka_unit_test_setup(test_what_the_conninfo_sets_wins, setup),
        cmocka_unit_test_setup(test_uri_form, setup),
        cmocka_unit_test_setup(test_a_statement_timeout_of_the_users_own_is_left_alone, setup),
        cmocka_unit_test_setup(test_pgoptions_is_kept_when_the_conninfo_has_none, setup),
        cmocka_unit_test_setup(test_empty_options_send_none, setup),
        cmocka_unit_test_setup(test_a_bare_database_name_still_connects_with_the_defaults, setup),
        cmocka_unit_test_setup(test_pgconnect_timeout_is_left_to_libpq, setup),
        cmocka_unit_test_setup(
            test_a_connection_attempt_that_gets_no_answer_ends_at_connect_timeout, setup),
        cmocka_unit_test_setup(test_a_statement_that_gets_no_answer_ends_at_the_deadline, setup),
        cmocka_unit_test_setup(test_a_pending_transaction_survives_a_reconnect, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
