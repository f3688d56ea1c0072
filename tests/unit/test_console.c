/* test_console.c — the pure parts of `tally console` (cli/console.h): what it accepts as input
 * (times, text, parameters), how it escapes a value for HTML and for a URL, which mark an audit
 * event gets on the timeline, and that the timeline draws every event with its title escaped.
 * The pages against a real ledger and browser: tests/integration/test_console.py. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "console.h"

/* cli/main.c's, which format.c calls for --actor defaults. */
const char *tally_cli_default_actor(void)
{
    return "test";
}

static char *take(con_req_t *rq)
{
    char *s = tally_strbuf_take(&rq->body);
    assert_non_null(s);
    return s;
}

static void test_times(void **state)
{
    (void)state;
    static const char *const good[] = {
        "2026-11-27",
        "2026-11-27T02:30",
        "2026-11-27 02:30",
        "2026-11-27T02:30:05",
        "2026-11-27T02:30:05.123456",
        "2026-11-27T02:30:05Z",
        "2026-11-27T02:30+01:00",
        "2026-11-27T02:30:05.5-05:30",
    };
    static const char *const bad[] = {
        "",
        "yesterday",
        "2026-13-01",
        "2026-11-32",
        "2026-11-2",
        "2026-11-27T24:00",
        "2026-11-27T02:60",
        "2026-11-27T02:30:05.",
        "2026-11-27T02:30:05.1234567",
        "2026-11-27T02:30Z+1",
        "2026-11-27T02:30+1:00",
        "1969-12-31",
        "2026-11-27'; --",
        "2026-11-27T02:30:05Zjunk",
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        assert_true(con_valid_time(good[i]));
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_false(con_valid_time(bad[i]));
}

static void test_text(void **state)
{
    (void)state;
    assert_true(con_valid_text("run-1 <b>\"quoted\"</b> é€😀"));
    assert_false(con_valid_text("a\nb"));
    assert_false(con_valid_text("a\x7f"));
    assert_false(con_valid_text("\xff\xfe"));
    assert_false(con_valid_text("\xe2\x82")); /* a character cut short */
    char big[CON_MAX_PARAM + 2];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    assert_false(con_valid_text(big));
    big[CON_MAX_PARAM] = '\0';
    assert_true(con_valid_text(big));
}

static void test_escaping(void **state)
{
    (void)state;
    con_req_t rq = {0};
    con_esc(&rq, "<script>alert(\"x\")</script>'&é");
    char *s = take(&rq);
    assert_string_equal(s, "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&#39;&amp;é");
    free(s);
    con_esc(&rq, NULL);
    s = take(&rq);
    assert_string_equal(s, "–");
    free(s);
    con_url(&rq, "a b/c?d#e%f&g=h.~_-é");
    s = take(&rq);
    assert_string_equal(s, "a%20b%2Fc%3Fd%23e%25f%26g%3Dh.~_-%C3%A9");
    free(s);
    /* a run link: relative, encoded in the address and escaped in the text */
    rq.root = "../";
    con_run_link(&rq, "r<1>/\"2\"");
    s = take(&rq);
    assert_string_equal(s, "<a class=\"run\" href=\"../runs/r%3C1%3E%2F%222%22\">"
                           "r&lt;1&gt;/&quot;2&quot;</a>");
    free(s);
}

static void test_params(void **state)
{
    (void)state;
    static const char *const allowed[] = {"state", "page", NULL};
    con_req_t rq = {.root = "./", .nonce = "n"};
    rq.params[0] = (con_param_t){"state", "ACTIVE"};
    rq.params[1] = (con_param_t){"page", ""};
    rq.n_params = 2;
    assert_true(con_check_params(&rq, allowed));
    assert_string_equal(con_param(&rq, "state"), "ACTIVE");
    assert_null(con_param(&rq, "page")); /* "" is absent */
    assert_null(con_param(&rq, "tenant"));
    rq.params[1] = (con_param_t){"state", "STUCK"};
    assert_false(con_check_params(&rq, allowed));
    assert_int_equal(rq.status, 400);
    char *s = take(&rq);
    assert_non_null(strstr(s, "parameter &#39;state&#39; is given more than once"));
    free(s);
    rq.status = 0;
    rq.params[1] = (con_param_t){"<colour>", "red"};
    assert_false(con_check_params(&rq, allowed));
    s = take(&rq);
    assert_non_null(strstr(s, "unknown parameter &#39;&lt;colour&gt;&#39;"));
    assert_null(strstr(s, "<colour>"));
    free(s);
}

static void test_marks(void **state)
{
    (void)state;
    assert_int_equal(con_mark_of("intent", NULL, NULL, NULL), CON_MARK_INTAKE);
    assert_int_equal(con_mark_of("transition", NULL, "PLANNED", NULL), CON_MARK_INTAKE);
    assert_int_equal(con_mark_of("transition", "DISPATCHING", "CONFIRMED", NULL), CON_MARK_ANSWER);
    assert_int_equal(con_mark_of("transition", "UNKNOWN", "STUCK", NULL), CON_MARK_ANSWER);
    assert_int_equal(con_mark_of("transition", "PLANNED", "DISPATCHING", NULL), CON_MARK_OTHER);
    assert_int_equal(con_mark_of("transition", "COMPENSATING", "COMPENSATED", NULL),
                     CON_MARK_ANSWER);
    assert_int_equal(con_mark_of("connector_call", NULL, NULL, "execute"), CON_MARK_DISPATCH);
    assert_int_equal(con_mark_of("connector_call", NULL, NULL, "status"), CON_MARK_STATUS);
    assert_int_equal(con_mark_of("connector_call", NULL, NULL, "compensate"), CON_MARK_REVERSE);
    assert_int_equal(con_mark_of("connector_call", NULL, NULL, "contain"), CON_MARK_REVERSE);
    assert_int_equal(con_mark_of("obligation", "PENDING", "RUNNING", NULL), CON_MARK_OBLIGATION);
    assert_int_equal(con_mark_of("alert", NULL, "TRIGGERED", NULL), CON_MARK_ALERT);
    assert_int_equal(con_mark_of("operator", "STUCK", "CONFIRMED", NULL), CON_MARK_OPERATOR);
    assert_int_equal(con_mark_of("lease", NULL, NULL, NULL), CON_MARK_OTHER);
    assert_int_equal(con_mark_of(NULL, NULL, NULL, NULL), CON_MARK_OTHER);
}

static size_t count(const char *s, const char *what)
{
    size_t n = 0;
    for (const char *p = strstr(s, what); p != NULL; p = strstr(p + 1, what))
        n++;
    return n;
}

static void test_timeline(void **state)
{
    (void)state;
    json_t *effects =
        json_pack("[{s:s, s:s, s:s}, {s:s, s:s, s:s}]", "effect_id", "e1", "step", "1", "tool",
                  "charge_card", "effect_id", "e2", "step", "2", "tool", "<b>tool</b>");
    json_t *events =
        json_pack("[{s:f, s:s, s:s, s:s, s:s, s:s},"
                  " {s:f, s:s, s:s, s:s, s:s, s:s, s:s},"
                  " {s:f, s:s, s:s, s:s, s:s, s:s},"
                  " {s:f, s:s, s:s, s:s, s:s, s:s}]",
                  "occurred_at_ms", 1000.0, "lane", "e1", "kind", "transition", "to_status",
                  "PLANNED", "actor", "d", "occurred_at", "t0", /* */
                  "occurred_at_ms", 1100.0, "lane", "e1", "kind", "connector_call", "op", "execute",
                  "actor", "d", "reason", "<script>x</script>", "occurred_at", "t1", /* */
                  "occurred_at_ms", 1500.0, "lane", "e2", "kind", "alert", "to_status", "TRIGGERED",
                  "actor", "r", "occurred_at", "t2", /* */
                  "occurred_at_ms", 2000.0, "kind", "operator", "to_status", "COMPENSATING",
                  "actor", "hank", "run_id", "r1", "occurred_at", "t3");
    assert_non_null(effects);
    assert_non_null(events);
    con_req_t rq = {0};
    con_timeline(&rq, effects, events);
    char *svg = take(&rq);
    assert_int_equal(count(svg, "<g class=\"mark\""), 4);
    assert_int_equal(count(svg, "data-mark=\"intake\""), 1);
    assert_int_equal(count(svg, "data-mark=\"dispatch attempt\""), 1);
    assert_int_equal(count(svg, "data-mark=\"alert\""), 1);
    assert_int_equal(count(svg, "data-mark=\"operator action\""), 1);
    assert_int_equal(count(svg, "<g class=\"lane\""), 3); /* the run's, then one per effect */
    assert_null(strstr(svg, "<script>"));
    assert_null(strstr(svg, "<b>"));
    assert_non_null(strstr(svg, "&lt;script&gt;x&lt;/script&gt;"));
    assert_non_null(strstr(svg, "step 2 · &lt;b&gt;tool&lt;/b&gt;"));
    assert_non_null(strstr(svg, "+1.0 s")); /* the axis spans the run's second */
    free(svg);
    json_decref(effects);
    json_decref(events);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_times),    cmocka_unit_test(test_text),
        cmocka_unit_test(test_escaping), cmocka_unit_test(test_params),
        cmocka_unit_test(test_marks),    cmocka_unit_test(test_timeline),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
