/* test_console_link.c — the console link every alert and page carries (issue 25): a run id
 * percent-encoded as one path segment (RFC 3986, unreserved characters kept), the base's one
 * trailing slash, pages without a run, and TALLY_CONSOLE_URL's check at start-up. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tally/alert.h"
#include "tally/config.h"

static void segment_is(const char *text, const char *want)
{
    char *got = tally_alert_url_segment(text);
    assert_non_null(got);
    if (strcmp(got, want) != 0)
        fail_msg("segment of '%s'\n  got:  %s\n  want: %s", text, got, want);
    free(got);
}

static void test_segment_keeps_unreserved_and_escapes_the_rest(void **state)
{
    (void)state;
    segment_is("", "");
    segment_is("run-2024-05-01_0042.a~b", "run-2024-05-01_0042.a~b");
    segment_is("ABCxyz019", "ABCxyz019");
    /* gen-delims and sub-delims are reserved: a run id is data, so every one is escaped */
    segment_is("a/b", "a%2Fb");
    segment_is("a b", "a%20b");
    segment_is("q?x=1#frag", "q%3Fx%3D1%23frag");
    segment_is("100%", "100%25");
    segment_is(":@!$&'()*+,;=", "%3A%40%21%24%26%27%28%29%2A%2B%2C%3B%3D");
    segment_is("[]<>\"\\^`{|}", "%5B%5D%3C%3E%22%5C%5E%60%7B%7C%7D");
    segment_is("%2F", "%252F"); /* an escape in the id is text, escaped again */
    /* UTF-8: one escape per byte, upper-case hex */
    segment_is("caf\xc3\xa9", "caf%C3%A9");
    segment_is("\xe2\x82\xac-\xf0\x9f\x92\xb3", "%E2%82%AC-%F0%9F%92%B3");
    segment_is("\x7f", "%7F");
}

static void link_is(const char *base, const char *run_id, const char *want)
{
    char *got = tally_alert_link(base, run_id);
    if (want == NULL) {
        if (got != NULL)
            fail_msg("link of (%s, %s): got %s, want none", base ? base : "NULL",
                     run_id ? run_id : "NULL", got);
        return;
    }
    assert_non_null(got);
    if (strcmp(got, want) != 0)
        fail_msg("link of (%s, %s)\n  got:  %s\n  want: %s", base ? base : "NULL",
                 run_id ? run_id : "NULL", got, want);
    free(got);
}

static void test_link_to_a_run(void **state)
{
    (void)state;
    const char *base = "https://tally.example.com/console";
    link_is(base, "run-7", "https://tally.example.com/console/runs/run-7");
    link_is(base, "orders/42 #1?", "https://tally.example.com/console/runs/orders%2F42%20%231%3F");
    link_is(base, "r\xc3\xa9sum\xc3\xa9",
            "https://tally.example.com/console/runs/r%C3%A9sum%C3%A9");
    /* one trailing slash of the base goes, never a second */
    link_is("https://tally.example.com/console/", "run-7",
            "https://tally.example.com/console/runs/run-7");
    link_is("http://127.0.0.1:8088/", "run-7", "http://127.0.0.1:8088/runs/run-7");
    link_is("http://127.0.0.1:8088", "run-7", "http://127.0.0.1:8088/runs/run-7");
    link_is("https://h/c//", "r", "https://h/c//runs/r");
    /* three dots are a name, not a step up the path */
    link_is(base, "...", "https://tally.example.com/console/runs/...");
    link_is(base, ".x", "https://tally.example.com/console/runs/.x");
}

static void test_a_page_without_a_run_links_to_the_queues(void **state)
{
    (void)state;
    const char *base = "https://tally.example.com/console/";
    link_is(base, NULL, "https://tally.example.com/console/queues");
    link_is(base, "", "https://tally.example.com/console/queues");
    /* "." and ".." are dot segments to a browser, escaped or not: no run link can reach them */
    link_is(base, ".", "https://tally.example.com/console/queues");
    link_is(base, "..", "https://tally.example.com/console/queues");
}

static void test_no_console_no_link(void **state)
{
    (void)state;
    link_is(NULL, "run-7", NULL);
    link_is("", "run-7", NULL);
    link_is("", NULL, NULL);
}

static void test_the_process_console(void **state)
{
    (void)state;
    assert_null(tally_alert_console_link("run-7")); /* nothing set: no link */
    assert_true(tally_alert_set_console("https://ops.example.com/tally/"));
    char *link = tally_alert_console_link("a/b");
    assert_string_equal(link, "https://ops.example.com/tally/runs/a%2Fb");
    free(link);
    link = tally_alert_console_link(NULL);
    assert_string_equal(link, "https://ops.example.com/tally/queues");
    free(link);

    /* too long: refused, and the setting before it stays */
    char big[TALLY_CONSOLE_URL_MAX + 2];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    memcpy(big, "https://", 8);
    assert_false(tally_alert_set_console(big));
    link = tally_alert_console_link("r");
    assert_string_equal(link, "https://ops.example.com/tally/runs/r");
    free(link);

    assert_true(tally_alert_set_console(""));
    assert_null(tally_alert_console_link("run-7"));
    assert_true(tally_alert_set_console("https://ops.example.com/tally"));
    assert_true(tally_alert_set_console(NULL));
    assert_null(tally_alert_console_link("run-7"));
}

/* ---- TALLY_CONSOLE_URL at start-up ------------------------------------------------------ */

static tally_config_t *load(const char *entry, char *err, size_t errsz)
{
    char *envp[] = {(char *)entry, NULL};
    tally_config_t *cfg = tally_config_new();
    assert_non_null(cfg);
    err[0] = '\0';
    if (!tally_config_load_env(cfg, envp, err, errsz)) {
        tally_config_free(cfg);
        return NULL;
    }
    return cfg;
}

static void accepted(const char *value)
{
    char entry[1024], err[512];
    snprintf(entry, sizeof entry, "TALLY_CONSOLE_URL=%s", value);
    tally_config_t *cfg = load(entry, err, sizeof err);
    if (cfg == NULL)
        fail_msg("'%s' was refused: %s", value, err);
    assert_string_equal(cfg->console_url, value);
    tally_config_free(cfg);
}

static void refused(const char *value, const char *want)
{
    char entry[1024], err[512];
    snprintf(entry, sizeof entry, "TALLY_CONSOLE_URL=%s", value);
    tally_config_t *cfg = load(entry, err, sizeof err);
    if (cfg != NULL)
        fail_msg("'%s' was accepted", value);
    if (strcmp(err, want) != 0)
        fail_msg("'%s': error\n  got:  %s\n  want: %s", value, err, want);
}

static void test_config_accepts_http_urls(void **state)
{
    (void)state;
    char err[512];
    tally_config_t *cfg = load("TALLY_PG=", err, sizeof err);
    assert_non_null(cfg);
    assert_string_equal(cfg->console_url, ""); /* the default: no link */
    tally_config_free(cfg);
    accepted("");
    accepted("https://tally.example.com/console");
    accepted("https://tally.example.com/console/");
    accepted("http://127.0.0.1:8088");
    accepted("HTTPS://Tally.Example.COM/ops/tally");
    accepted("https://[::1]:8443/c");
    accepted("https://ops.example.com/t%C3%A9am/tally");
    accepted("https://ops.example.com/a;b=c/~x/(y)/!$&'*+,:@");

    char url[TALLY_CONSOLE_URL_MAX + 1];
    memset(url, 'a', sizeof url - 1);
    url[sizeof url - 1] = '\0';
    memcpy(url, "https://h/", 10);
    accepted(url); /* exactly TALLY_CONSOLE_URL_MAX bytes */
}

static void test_config_refuses_what_no_link_can_start_with(void **state)
{
    (void)state;
    refused("ftp://tally.example.com/console",
            "TALLY_CONSOLE_URL: not an http:// or https:// URL: 'ftp://tally.example.com/console'");
    refused("tally.example.com/console", "TALLY_CONSOLE_URL: not an http:// or https:// URL: "
                                         "'tally.example.com/console'");
    refused("javascript:alert(1)",
            "TALLY_CONSOLE_URL: not an http:// or https:// URL: 'javascript:alert(1)'");
    refused("https://", "TALLY_CONSOLE_URL: the URL names no host: 'https://'");
    refused("https:///console", "TALLY_CONSOLE_URL: the URL names no host: 'https:///console'");
    refused("https://ops:hunter2@tally.example.com/console",
            "TALLY_CONSOLE_URL: the URL carries credentials (user@host), which every page would "
            "pass on to its readers: leave sign-on to the proxy in front of the console");
    refused("https://tally.example.com/console?tab=runs",
            "TALLY_CONSOLE_URL: the URL has a query or a fragment, but a run's path (/runs/<id>) "
            "is appended to it: end it with the console's path: "
            "'https://tally.example.com/console?tab=runs'");
    refused("https://tally.example.com/console#top",
            "TALLY_CONSOLE_URL: the URL has a query or a fragment, but a run's path (/runs/<id>) "
            "is appended to it: end it with the console's path: "
            "'https://tally.example.com/console#top'");
    refused("https://tally.example.com/con sole",
            "TALLY_CONSOLE_URL: byte 30 is a space (0x20): a URL has no whitespace or control "
            "characters");
    refused(" https://tally.example.com/console",
            "TALLY_CONSOLE_URL: byte 1 is a space (0x20): a URL has no whitespace or control "
            "characters");
    refused("https://tally.example.com/console\n",
            "TALLY_CONSOLE_URL: byte 34 is a control character (0x0a): a URL has no whitespace "
            "or control characters");
    refused("https://tally.example.com/\tx",
            "TALLY_CONSOLE_URL: byte 27 is a control character (0x09): a URL has no whitespace "
            "or control characters");
    refused("https://tally.example.com/\x7f",
            "TALLY_CONSOLE_URL: byte 27 is a control character (0x7f): a URL has no whitespace "
            "or control characters");
    refused("https://tally.example.com/caf\xc3\xa9",
            "TALLY_CONSOLE_URL: byte 30 is not ASCII (0xc3): percent-encode it (RFC 3986)");
    refused("https://tally.example.com/<script>",
            "TALLY_CONSOLE_URL: '<' (byte 27) may not stand as it is in a URL: percent-encode it "
            "(RFC 3986)");
    refused("https://tally.example.com/\"x",
            "TALLY_CONSOLE_URL: '\"' (byte 27) may not stand as it is in a URL: percent-encode "
            "it (RFC 3986)");
    refused("https://tally.example.com/100%",
            "TALLY_CONSOLE_URL: the '%' at byte 30 does not start a percent-encoded byte (%XX)");
    refused("https://tally.example.com/%zz",
            "TALLY_CONSOLE_URL: the '%' at byte 27 does not start a percent-encoded byte (%XX)");

    char url[TALLY_CONSOLE_URL_MAX + 2];
    memset(url, 'a', sizeof url - 1);
    url[sizeof url - 1] = '\0';
    memcpy(url, "https://h/", 10);
    refused(url, "TALLY_CONSOLE_URL: the URL is 513 bytes, more than the 512 a console URL may "
                 "have");
}

static void test_config_lists_it(void **state)
{
    (void)state;
    char err[512];
    tally_config_t *cfg =
        load("TALLY_CONSOLE_URL=https://tally.example.com/console", err, sizeof err);
    assert_non_null(cfg);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    tally_config_describe(cfg, f);
    fclose(f);
    const char *line = strstr(buf, "\nTALLY_CONSOLE_URL ");
    assert_non_null(line);
    const char *end = strchr(line + 1, '\n');
    assert_non_null(end);
    char row[1024];
    snprintf(row, sizeof row, "%.*s", (int)(end - line - 1), line + 1);
    assert_non_null(strstr(row, "https://tally.example.com/console"));
    assert_non_null(strstr(row, "/runs/<run id>"));
    free(buf);
    tally_config_free(cfg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_segment_keeps_unreserved_and_escapes_the_rest),
        cmocka_unit_test(test_link_to_a_run),
        cmocka_unit_test(test_a_page_without_a_run_links_to_the_queues),
        cmocka_unit_test(test_no_console_no_link),
        cmocka_unit_test(test_the_process_console),
        cmocka_unit_test(test_config_accepts_http_urls),
        cmocka_unit_test(test_config_refuses_what_no_link_can_start_with),
        cmocka_unit_test(test_config_lists_it),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
