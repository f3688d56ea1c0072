/* test_notify.c — the sd_notify protocol as a worker speaks it: $NOTIFY_SOCKET as a path or an
 * abstract '@name', $WATCHDOG_USEC and $WATCHDOG_PID as sd_watchdog_enabled(3) reads them, and
 * the datagrams each phase sends (EXTEND_TIMEOUT_USEC while starting, READY=1, WATCHDOG=1 at
 * most every half period, STOPPING=1), received on an AF_UNIX socket the test binds. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "tally/log.h"
#include "tally/notify.h"

static int setup(void **state)
{
    (void)state;
    tally_log_init("test", "test:1", TALLY_LOG_ERROR);
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
    return 0;
}

/* --- the address ---------------------------------------------------------------------------- */

static void test_a_path_is_a_file_socket_with_its_nul(void **state)
{
    (void)state;
    struct sockaddr_un sa;
    socklen_t len = 0;
    char err[256];
    assert_true(tally_notify_address("/run/systemd/notify", &sa, &len, err, sizeof err));
    assert_int_equal(sa.sun_family, AF_UNIX);
    assert_string_equal(sa.sun_path, "/run/systemd/notify");
    assert_int_equal(len,
                     offsetof(struct sockaddr_un, sun_path) + strlen("/run/systemd/notify") + 1);
}

static void test_an_at_sign_is_the_abstract_namespace(void **state)
{
    (void)state;
    struct sockaddr_un sa;
    socklen_t len = 0;
    char err[256];
    assert_true(tally_notify_address("@tally/notify", &sa, &len, err, sizeof err));
    assert_int_equal(sa.sun_path[0], '\0');
    assert_memory_equal(sa.sun_path + 1, "tally/notify", strlen("tally/notify"));
    /* counted by its length: no trailing NUL is part of an abstract name */
    assert_int_equal(len, offsetof(struct sockaddr_un, sun_path) + strlen("@tally/notify"));
}

static void test_other_forms_and_long_names_are_refused(void **state)
{
    (void)state;
    struct sockaddr_un sa;
    socklen_t len = 0;
    char err[256];
    const char *bad[] = {"", "/", "@", "run/notify", "vsock:2:9999", NULL};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        assert_false(tally_notify_address(bad[i], &sa, &len, err, sizeof err));
        assert_non_null(strstr(err, "neither a socket path nor an abstract socket"));
    }
    char name[sizeof sa.sun_path + 2];
    /* a path fills sun_path with its NUL; an abstract name may use every byte */
    name[0] = '/';
    memset(name + 1, 'a', sizeof sa.sun_path - 2);
    name[sizeof sa.sun_path - 1] = '\0';
    assert_true(tally_notify_address(name, &sa, &len, err, sizeof err));
    name[sizeof sa.sun_path - 1] = 'a';
    name[sizeof sa.sun_path] = '\0';
    assert_false(tally_notify_address(name, &sa, &len, err, sizeof err));
    assert_non_null(strstr(err, "more than 107"));
    name[0] = '@';
    assert_true(tally_notify_address(name, &sa, &len, err, sizeof err));
    assert_int_equal(len, sizeof sa);
    name[sizeof sa.sun_path] = 'a';
    name[sizeof sa.sun_path + 1] = '\0';
    assert_false(tally_notify_address(name, &sa, &len, err, sizeof err));
}

/* --- the watchdog's period ------------------------------------------------------------------ */

static void test_watchdog_period(void **state)
{
    (void)state;
    char err[256];
    assert_int_equal(tally_notify_watchdog_period(NULL, NULL, 42, err, sizeof err), 0);
    assert_string_equal(err, "");
    assert_int_equal(tally_notify_watchdog_period("", NULL, 42, err, sizeof err), 0);
    assert_string_equal(err, "");
    assert_int_equal(tally_notify_watchdog_period("30000000", NULL, 42, err, sizeof err), 30000000);
    assert_string_equal(err, "");
    /* WATCHDOG_PID: ours, or the watchdog belongs to another process */
    assert_int_equal(tally_notify_watchdog_period("30000000", "42", 42, err, sizeof err), 30000000);
    assert_int_equal(tally_notify_watchdog_period("30000000", "41", 42, err, sizeof err), 0);
    assert_string_equal(err, "");
    assert_int_equal(tally_notify_watchdog_period("30000000", "", 42, err, sizeof err), 30000000);
    const char *bad_usec[] = {"0", "-5", " 5", "5s", "abc", "99999999999999999999999"};
    for (size_t i = 0; i < sizeof bad_usec / sizeof bad_usec[0]; i++) {
        assert_int_equal(tally_notify_watchdog_period(bad_usec[i], NULL, 42, err, sizeof err), 0);
        assert_non_null(strstr(err, "WATCHDOG_USEC="));
    }
    assert_int_equal(tally_notify_watchdog_period("30000000", "x42", 42, err, sizeof err), 0);
    assert_non_null(strstr(err, "WATCHDOG_PID='x42'"));
}

/* --- the datagrams -------------------------------------------------------------------------- */

/* A datagram socket bound at @p name ("/path" or "@abstract"), as systemd's would be. */
static int bind_listener(const char *name)
{
    struct sockaddr_un sa;
    socklen_t len = 0;
    char err[256];
    assert_true(tally_notify_address(name, &sa, &len, err, sizeof err));
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, len), 0);
    return fd;
}

/* The next datagram, or "" when none is waiting. */
static const char *next_message(int fd)
{
    static char buf[2048];
    ssize_t n = recv(fd, buf, sizeof buf - 1, MSG_DONTWAIT);
    buf[n > 0 ? n : 0] = '\0';
    return buf;
}

static void run_the_phases(const char *name)
{
    int fd = bind_listener(name);
    setenv("NOTIFY_SOCKET", name, 1);
    setenv("WATCHDOG_USEC", "2000000", 1);
    tally_notify_t *n = tally_notify_new();
    assert_non_null(n);
    assert_int_equal(tally_notify_watchdog_usec(n), 2000000);

    /* starting: each heartbeat due extends the start timeout by one period */
    tally_notify_heartbeat(n, 10000);
    assert_string_equal(next_message(fd), "EXTEND_TIMEOUT_USEC=2000000");
    tally_notify_heartbeat(n, 10999);
    assert_string_equal(next_message(fd), "");
    tally_notify_heartbeat(n, 11000);
    assert_string_equal(next_message(fd), "EXTEND_TIMEOUT_USEC=2000000");

    tally_notify_ready(n, "running: schema version 9");
    assert_string_equal(next_message(fd), "READY=1\nSTATUS=running: schema version 9");
    /* running: WATCHDOG=1 at most every half period, however often the loop turns */
    for (long long t = 11001; t < 12000; t += 7) {
        tally_notify_heartbeat(n, t);
    }
    assert_string_equal(next_message(fd), "");
    tally_notify_heartbeat(n, 12000);
    assert_string_equal(next_message(fd), "WATCHDOG=1");
    tally_notify_heartbeat(n, 12500);
    assert_string_equal(next_message(fd), "");
    tally_notify_heartbeat(n, 15000); /* late: one ping, then half a period from now */
    assert_string_equal(next_message(fd), "WATCHDOG=1");
    tally_notify_heartbeat(n, 15999);
    assert_string_equal(next_message(fd), "");

    /* draining keeps pinging */
    tally_notify_stopping(n, NULL);
    assert_string_equal(next_message(fd), "STOPPING=1");
    tally_notify_heartbeat(n, 16000);
    assert_string_equal(next_message(fd), "WATCHDOG=1");

    assert_true(tally_notify_send(n, "STATUS=a\nERRNO=5"));
    assert_string_equal(next_message(fd), "STATUS=a\nERRNO=5");
    tally_notify_free(n);
    close(fd);
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
}

static void test_phases_on_a_path_socket(void **state)
{
    (void)state;
    char dir[] = "/tmp/tally-notify-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128];
    snprintf(path, sizeof path, "%s/notify", dir);
    run_the_phases(path);
    unlink(path);
    rmdir(dir);
}

static void test_phases_on_an_abstract_socket(void **state)
{
    (void)state;
    char name[64];
    snprintf(name, sizeof name, "@tally-test-notify-%ld", (long)getpid());
    run_the_phases(name);
}

static void test_without_a_watchdog_only_the_phases_are_sent(void **state)
{
    (void)state;
    char name[64];
    snprintf(name, sizeof name, "@tally-test-nowd-%ld", (long)getpid());
    int fd = bind_listener(name);
    setenv("NOTIFY_SOCKET", name, 1);
    /* WATCHDOG_USEC meant for another process (WATCHDOG_PID): not ours to ping */
    setenv("WATCHDOG_USEC", "2000000", 1);
    char other[32];
    snprintf(other, sizeof other, "%ld", (long)getpid() + 1);
    setenv("WATCHDOG_PID", other, 1);
    tally_notify_t *n = tally_notify_new();
    assert_non_null(n);
    assert_int_equal(tally_notify_watchdog_usec(n), 0);
    tally_notify_heartbeat(n, 1);
    tally_notify_ready(n, NULL);
    tally_notify_heartbeat(n, 1000000);
    assert_string_equal(next_message(fd), "READY=1");
    assert_string_equal(next_message(fd), "");
    tally_notify_free(n);
    close(fd);
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
}

static void test_unset_is_a_no_op(void **state)
{
    (void)state;
    assert_null(tally_notify_new());
    setenv("NOTIFY_SOCKET", "", 1);
    assert_null(tally_notify_new());
    setenv("NOTIFY_SOCKET", "relative/path", 1);
    assert_null(tally_notify_new()); /* logged, not fatal */
    unsetenv("NOTIFY_SOCKET");
    tally_notify_heartbeat(NULL, 1);
    tally_notify_ready(NULL, "x");
    tally_notify_stopping(NULL, "x");
    assert_true(tally_notify_send(NULL, "READY=1"));
    assert_int_equal(tally_notify_watchdog_usec(NULL), 0);
    tally_notify_free(NULL);
}

static void test_nobody_listening_fails_without_blocking_or_crashing(void **state)
{
    (void)state;
    char name[64];
    snprintf(name, sizeof name, "@tally-test-nobody-%ld", (long)getpid());
    setenv("NOTIFY_SOCKET", name, 1);
    tally_notify_t *n = tally_notify_new();
    assert_non_null(n);
    assert_false(tally_notify_send(n, "READY=1"));
    assert_false(tally_notify_send(n, "READY=1")); /* logged the first time only */
    tally_notify_ready(n, "x");
    tally_notify_free(n);
    unsetenv("NOTIFY_SOCKET");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_a_path_is_a_file_socket_with_its_nul, setup),
        cmocka_unit_test_setup(test_an_at_sign_is_the_abstract_namespace, setup),
        cmocka_unit_test_setup(test_other_forms_and_long_names_are_refused, setup),
        cmocka_unit_test_setup(test_watchdog_period, setup),
        cmocka_unit_test_setup(test_phases_on_a_path_socket, setup),
        cmocka_unit_test_setup(test_phases_on_an_abstract_socket, setup),
        cmocka_unit_test_setup(test_without_a_watchdog_only_the_phases_are_sent, setup),
        cmocka_unit_test_setup(test_unset_is_a_no_op, setup),
        cmocka_unit_test_setup(test_nobody_listening_fails_without_blocking_or_crashing, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
