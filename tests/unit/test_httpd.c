/* test_httpd.c — /metrics, /healthz and /readyz answer even when the process holds more
 * descriptors than select() can watch (a dispatcher with thousands of calls in flight). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tally/httpd.h"
#include "tally/metrics.h"

static bool healthy(void *opaque, char *why, size_t whysz)
{
    (void)opaque;
    (void)why;
    (void)whysz;
    return true;
}

static bool not_ready(void *opaque, char *why, size_t whysz)
{
    (void)opaque;
    snprintf(why, whysz, "waiting for PostgreSQL");
    return false;
}

/* GET @p path on 127.0.0.1:@p port; the whole answer in @p out. */
static void get(int port, const char *path, char *out, size_t outsz)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(s >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(s, (struct sockaddr *)&sa, sizeof sa), 0);
    char req[256];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\nHost: x\r\n\r\n", path);
    assert_int_equal(write(s, req, (size_t)n), n);
    size_t got = 0;
    ssize_t r;
    while (got + 1 < outsz && (r = read(s, out + got, outsz - 1 - got)) > 0)
        got += (size_t)r;
    out[got] = '\0';
    close(s);
}

static void test_probes_answer_above_fd_setsize(void **st)
{
    (void)st;
    struct rlimit rl;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &rl), 0);
    if (rl.rlim_max < FD_SETSIZE + 200)
        skip();
    rl.rlim_cur = rl.rlim_max;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &rl), 0);
    /* fill the table so every socket the server and this test open is above FD_SETSIZE */
    int held[FD_SETSIZE + 100];
    size_t n_held = 0;
    for (; n_held < sizeof held / sizeof held[0]; n_held++) {
        held[n_held] = open("/dev/null", O_RDONLY);
        assert_true(held[n_held] >= 0);
    }

    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *up = tally_metrics_gauge(m, "tally_worker_up", "1 while running", NULL);
    tally_metric_set(up, 1);
    char err[256] = "";
    tally_httpd_t *h =
        tally_httpd_start("127.0.0.1:0", m, healthy, not_ready, NULL, err, sizeof err);
    assert_non_null(h);
    int port = tally_httpd_port(h);
    assert_true(port > 0);

    char body[4096];
    get(port, "/healthz", body, sizeof body);
    assert_non_null(strstr(body, " 200 "));
    get(port, "/readyz", body, sizeof body);
    assert_non_null(strstr(body, " 503 "));
    assert_non_null(strstr(body, "waiting for PostgreSQL"));
    get(port, "/metrics", body, sizeof body);
    assert_non_null(strstr(body, "tally_worker_up 1"));
    get(port, "/nope", body, sizeof body);
    assert_non_null(strstr(body, " 404 "));

    tally_httpd_stop(h);
    tally_metrics_free(m);
    for (size_t i = 0; i < n_held; i++)
        close(held[i]);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_probes_answer_above_fd_setsize),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
