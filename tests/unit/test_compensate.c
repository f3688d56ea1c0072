/* test_compensate.c — the compensator's pure logic: the per-class decision table (runops.c),
 * the blast radius and its target, the reverse call's body and If-Match, the retry backoff, the
 * run summary of DESIGN §7 and the PagerDuty Events API v2 body. No services. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compensator.h"
#include "tally/runops.h"

/* ---------------------------------------------------------------- helpers */

static tally_tool_t tool_of(const char *name, tally_effect_class_t cls, tally_comp_mode_t mode)
{
    tally_tool_t t;
    memset(&t, 0, sizeof t);
    t.name = (char *)name;
    t.effect_class = cls;
    t.comp_mode = mode;
    t.base_url = (char *)"http://127.0.0.1:9000";
    t.compensate.method = (char *)"POST";
    t.compensate.path = cls == TALLY_CLASS_REVERSIBLE ? (char *)"/charges/reverse" : NULL;
    t.runbook = (char *)"https://wiki.example.com/runbooks/x";
    t.max_attempts = 5;
    t.backoff_ms = 100;
    t.max_backoff_ms = 2000;
    return t;
}

static tally_comp_action_t decide(tally_effect_class_t cls, tally_comp_mode_t mode, bool approved,
                                  bool contain)
{
    tally_tool_t t = tool_of("t", cls, mode);
    if (contain) {
        t.contain.method = (char *)"POST";
        t.contain.path = (char *)"/emails/contain";
    }
    tally_comp_decision_t d;
    tally_comp_decide(&t, "t", cls, approved, &d);
    assert_non_null(d.to_status);
    assert_non_null(d.code);
    assert_true(strlen(d.why) > 10);
    return d.action;
}

static json_t *load(const char *text)
{
    json_error_t jerr;
    json_t *v = json_loads(text, 0, &jerr);
    if (v == NULL) {
        fail_msg("bad test JSON: %s (%s)", jerr.text, text);
    }
    return v;
}

/* ---------------------------------------------------------------- the decision table */

static void test_decide_read_and_idempotent_skip(void **state)
{
    (void)state;
    for (int mode = TALLY_COMP_AUTOMATIC; mode <= TALLY_COMP_NOT_SUPPORTED; mode++) {
        assert_int_equal(decide(TALLY_CLASS_READ, mode, false, false), TALLY_COMP_ACT_SKIP);
        assert_int_equal(decide(TALLY_CLASS_IDEMPOTENT, mode, false, true), TALLY_COMP_ACT_SKIP);
    }
    tally_comp_decision_t d;
    tally_comp_decide(NULL, "gone", TALLY_CLASS_READ, false, &d);
    assert_string_equal(d.to_status, "SKIPPED");
    assert_string_equal(d.code, "read_only");
    assert_non_null(strstr(d.why, "gone"));
}

static void test_decide_reversible(void **state)
{
    (void)state;
    assert_int_equal(decide(TALLY_CLASS_REVERSIBLE, TALLY_COMP_AUTOMATIC, false, false),
                     TALLY_COMP_ACT_REVERSE);
    assert_int_equal(decide(TALLY_CLASS_REVERSIBLE, TALLY_COMP_APPROVAL_REQUIRED, false, false),
                     TALLY_COMP_ACT_AWAIT_APPROVAL);
    assert_int_equal(decide(TALLY_CLASS_REVERSIBLE, TALLY_COMP_APPROVAL_REQUIRED, true, false),
                     TALLY_COMP_ACT_REVERSE);
    assert_int_equal(decide(TALLY_CLASS_REVERSIBLE, TALLY_COMP_MANUAL_RUNBOOK, true, false),
                     TALLY_COMP_ACT_RUNBOOK);
    assert_int_equal(decide(TALLY_CLASS_REVERSIBLE, TALLY_COMP_NOT_SUPPORTED, false, false),
                     TALLY_COMP_ACT_NOT_SUPPORTED);

    tally_tool_t t = tool_of("charge_card", TALLY_CLASS_REVERSIBLE, TALLY_COMP_AUTOMATIC);
    tally_comp_decision_t d;
    tally_comp_decide(&t, "charge_card", TALLY_CLASS_REVERSIBLE, false, &d);
    assert_string_equal(d.to_status, "RUNNING");
    assert_non_null(strstr(d.why, "/charges/reverse"));

    t.comp_mode = TALLY_COMP_MANUAL_RUNBOOK;
    tally_comp_decide(&t, "charge_card", TALLY_CLASS_REVERSIBLE, false, &d);
    assert_string_equal(d.to_status, "STUCK");
    assert_string_equal(d.code, "manual_runbook");
    assert_non_null(strstr(d.why, "https://wiki.example.com/runbooks/x"));

    /* a reversible tool that left the registry, or lost its endpoint: a human decides */
    tally_comp_decide(NULL, "charge_card", TALLY_CLASS_REVERSIBLE, false, &d);
    assert_int_equal(d.action, TALLY_COMP_ACT_NO_TOOL);
    assert_string_equal(d.code, "unknown_tool");
    t.comp_mode = TALLY_COMP_AUTOMATIC;
    t.compensate.path = NULL;
    tally_comp_decide(&t, "charge_card", TALLY_CLASS_REVERSIBLE, false, &d);
    assert_int_equal(d.action, TALLY_COMP_ACT_NO_TOOL);
    assert_string_equal(d.code, "no_compensate_endpoint");
}

static void test_decide_append_only(void **state)
{
    (void)state;
    assert_int_equal(decide(TALLY_CLASS_APPEND_ONLY, TALLY_COMP_AUTOMATIC, false, false),
                     TALLY_COMP_ACT_RECORD);
    assert_int_equal(decide(TALLY_CLASS_APPEND_ONLY, TALLY_COMP_AUTOMATIC, false, true),
                     TALLY_COMP_ACT_CONTAIN);
    assert_int_equal(decide(TALLY_CLASS_APPEND_ONLY, TALLY_COMP_APPROVAL_REQUIRED, false, true),
                     TALLY_COMP_ACT_AWAIT_APPROVAL);
    assert_int_equal(decide(TALLY_CLASS_APPEND_ONLY, TALLY_COMP_APPROVAL_REQUIRED, true, true),
                     TALLY_COMP_ACT_CONTAIN);
    /* nothing to approve without a containment action */
    assert_int_equal(decide(TALLY_CLASS_APPEND_ONLY, TALLY_COMP_APPROVAL_REQUIRED, false, false),
                     TALLY_COMP_ACT_RECORD);
    assert_int_equal(decide(TALLY_CLASS_APPEND_ONLY, TALLY_COMP_NOT_SUPPORTED, false, true),
                     TALLY_COMP_ACT_RECORD);
    assert_int_equal(decide(TALLY_CLASS_APPEND_ONLY, TALLY_COMP_MANUAL_RUNBOOK, false, true),
                     TALLY_COMP_ACT_RUNBOOK);
    tally_comp_decision_t d;
    tally_comp_decide(NULL, "send_email", TALLY_CLASS_APPEND_ONLY, false, &d);
    assert_string_equal(d.to_status, "UNCOMPENSATABLE");
}

static void test_decide_destructive_always_escalates(void **state)
{
    (void)state;
    for (int mode = TALLY_COMP_AUTOMATIC; mode <= TALLY_COMP_NOT_SUPPORTED; mode++) {
        assert_int_equal(decide(TALLY_CLASS_DESTRUCTIVE, mode, true, false),
                         TALLY_COMP_ACT_ESCALATE);
    }
    tally_comp_decision_t d;
    tally_comp_decide(NULL, "delete_account", TALLY_CLASS_DESTRUCTIVE, false, &d);
    assert_string_equal(d.to_status, "UNCOMPENSATABLE");
    assert_string_equal(d.code, "destructive");
    assert_string_equal(tally_comp_action_name(d.action), "escalate");
}

/* ---------------------------------------------------------------- blast radius */

static void test_target_field(void **state)
{
    (void)state;
    json_t *a = load("{\"subject\":\"hi\",\"to\":\"ann@example.com\",\"account_id\":\"a1\"}");
    assert_string_equal(comp_target_field(a), "to");
    json_decref(a);
    a = load("{\"account_id\":\"a1\",\"email\":\"bob@example.com\"}");
    assert_string_equal(comp_target_field(a), "email");
    json_decref(a);
    a = load("{\"to\":null,\"recipient\":\"+15550100\"}");
    assert_string_equal(comp_target_field(a), "recipient");
    json_decref(a);
    a = load("{\"amount\":5}");
    assert_null(comp_target_field(a));
    json_decref(a);
    assert_null(comp_target_field(NULL));
}

static void test_blast_radius(void **state)
{
    (void)state;
    json_t *args = load("{\"message_id\":\"m1\",\"to\":\"ann@example.com\"}");
    json_t *receipt = load("{\"id\":\"emails_3\",\"version\":1}");
    json_t *b = comp_blast_radius("send_email", "send_email:m1", args, receipt, "emails_3",
                                  "2026-11-22T00:00:01.000Z");
    assert_non_null(b);
    assert_string_equal(json_string_value(json_object_get(b, "tool")), "send_email");
    json_t *target = json_object_get(b, "target");
    assert_string_equal(json_string_value(json_object_get(target, "field")), "to");
    assert_string_equal(json_string_value(json_object_get(target, "value")), "ann@example.com");
    assert_string_equal(json_string_value(json_object_get(b, "operation_key")), "send_email:m1");
    assert_string_equal(json_string_value(json_object_get(b, "external_ref")), "emails_3");
    assert_true(json_equal(json_object_get(b, "args"), args));
    assert_true(json_equal(json_object_get(b, "receipt"), receipt));
    assert_string_equal(json_string_value(json_object_get(b, "time")), "2026-11-22T00:00:01.000Z");
    const char *rec = json_string_value(json_object_get(b, "recorded_at"));
    assert_non_null(rec);
    assert_int_equal(strlen(rec), strlen("2026-11-22T00:00:01.000Z"));
    assert_int_equal(rec[strlen(rec) - 1], 'Z');
    json_decref(b);

    /* no target among the args, no receipt: still a record of what happened */
    json_t *args2 = load("{\"amount\":5}");
    b = comp_blast_radius("delete_account", "k", args2, NULL, NULL, NULL);
    assert_true(json_is_null(json_object_get(b, "target")));
    assert_true(json_is_null(json_object_get(b, "receipt")));
    assert_true(json_is_null(json_object_get(b, "time")));
    json_decref(b);
    json_decref(args2);
    json_decref(args);
    json_decref(receipt);
}

/* ---------------------------------------------------------------- the reverse call */

static void test_reverse_body_and_if_match(void **state)
{
    (void)state;
    json_t *args = load("{\"payment_id\":\"p1\",\"amount\":5}");
    json_t *receipt = load("{\"id\":\"charges_1\",\"version\":3}");
    json_t *body = comp_reverse_body("charges_1", receipt, args, "compensate_run");
    assert_string_equal(json_string_value(json_object_get(body, "external_ref")), "charges_1");
    assert_true(json_equal(json_object_get(body, "receipt"), receipt));
    assert_true(json_equal(json_object_get(body, "args"), args));
    assert_string_equal(json_string_value(json_object_get(body, "reason")), "compensate_run");
    assert_int_equal(json_object_size(body), 4);
    json_decref(body);

    char im[COMP_IF_MATCH_SIZE];
    assert_int_equal(comp_if_match(receipt, im), COMP_VERSION_OK);
    assert_string_equal(im, "3");
    json_t *r2 = load("{\"id\":\"x\",\"version\":\"W/\\\"7\\\"\"}");
    assert_int_equal(comp_if_match(r2, im), COMP_VERSION_OK);
    assert_string_equal(im, "W/\"7\"");
    json_t *r3 = load("{\"id\":\"x\"}");
    assert_int_equal(comp_if_match(r3, im), COMP_VERSION_NONE);
    assert_int_equal(comp_if_match(NULL, im), COMP_VERSION_NONE);
    json_t *r4 = load("{\"version\":\"\"}");
    assert_int_equal(comp_if_match(r4, im), COMP_VERSION_NONE);
    /* a SHA-256 ETag (64 hex digits, quoted) and a version at the limit travel whole; one over
     * it, or one with CR/LF, is unusable, never cut */
    char etag[80], at_limit[TALLY_LIMIT_RECEIPT_VERSION + 1], over[TALLY_LIMIT_RECEIPT_VERSION + 2];
    memset(etag, 'a', sizeof etag);
    etag[0] = '"';
    etag[65] = '"';
    etag[66] = '\0';
    memset(at_limit, 'v', sizeof at_limit);
    at_limit[TALLY_LIMIT_RECEIPT_VERSION] = '\0';
    memset(over, 'v', sizeof over);
    over[TALLY_LIMIT_RECEIPT_VERSION + 1] = '\0';
    const char *whole[] = {etag, at_limit};
    for (size_t i = 0; i < 2; i++) {
        json_t *r = json_pack("{s:s}", "version", whole[i]);
        assert_int_equal(comp_if_match(r, im), COMP_VERSION_OK);
        assert_string_equal(im, whole[i]);
        json_decref(r);
    }
    const char *bad[] = {over, "7\r\nX-Injected: 1"};
    for (size_t i = 0; i < 2; i++) {
        json_t *r = json_pack("{s:s}", "version", bad[i]);
        assert_int_equal(comp_if_match(r, im), COMP_VERSION_UNUSABLE);
        json_decref(r);
    }
    json_decref(r2);
    json_decref(r3);
    json_decref(r4);
    json_decref(args);
    json_decref(receipt);
}

static void test_backoff(void **state)
{
    (void)state;
    tally_tool_t t = tool_of("t", TALLY_CLASS_REVERSIBLE, TALLY_COMP_AUTOMATIC);
    unsigned seed = 42;
    for (int i = 0; i < 200; i++) {
        long long d1 = comp_backoff_ms(&t, 1, -1, &seed);
        assert_in_range(d1, 50, 100);
        long long d3 = comp_backoff_ms(&t, 3, -1, &seed);
        assert_in_range(d3, 200, 400);
        long long d20 = comp_backoff_ms(&t, 20, -1, &seed); /* capped at max_backoff_ms */
        assert_in_range(d20, 1000, 2000);
    }
    /* jitter: not every retry waits the same */
    long long first = comp_backoff_ms(&t, 5, -1, &seed);
    bool differs = false;
    for (int i = 0; i < 50 && !differs; i++) {
        differs = comp_backoff_ms(&t, 5, -1, &seed) != first;
    }
    assert_true(differs);
    /* the tool's Retry-After wins when it asks for longer */
    assert_int_equal(comp_backoff_ms(&t, 1, 5000, &seed), 5000);
    assert_in_range(comp_backoff_ms(&t, 1, 10, &seed), 50, 100);
    assert_in_range(comp_backoff_ms(NULL, 1, -1, &seed), 100, 200);
}

/* ---------------------------------------------------------------- the run summary */

/* The four-step run of issue 5, compensated: read skipped, two reversed, the email out. */
static const char RUN_ITEMS[] =
    "["
    "{\"effect_id\":\"00000000-0000-0000-0000-000000000004\",\"step\":\"4\",\"step_is_number\":"
    "true,\"tool\":\"create_hold\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":"
    "\"holds_4\"},\"external_ref\":\"holds_4\",\"obligation_id\":"
    "\"10000000-0000-0000-0000-000000000004\",\"obligation_status\":\"RESOLVED\","
    "\"status_reason\":\"http_201: HTTP 201\",\"reverse_receipt\":{\"id\":\"rev_5\"}},"
    "{\"effect_id\":\"00000000-0000-0000-0000-000000000003\",\"step\":\"3\",\"step_is_number\":"
    "true,\"tool\":\"send_email\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":"
    "\"emails_3\"},\"external_ref\":\"emails_3\",\"obligation_id\":"
    "\"10000000-0000-0000-0000-000000000003\",\"obligation_status\":\"UNCOMPENSATABLE\","
    "\"status_reason\":\"append_only: cannot be undone\",\"blast_radius\":{\"tool\":"
    "\"send_email\",\"target\":{\"field\":\"to\",\"value\":\"ann@example.com\"},\"time\":"
    "\"2026-11-22T00:00:01.000Z\"}},"
    "{\"effect_id\":\"00000000-0000-0000-0000-000000000002\",\"step\":\"2\",\"step_is_number\":"
    "true,\"tool\":\"charge_card\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":"
    "\"charges_2\"},\"external_ref\":\"charges_2\",\"obligation_id\":"
    "\"10000000-0000-0000-0000-000000000002\",\"obligation_status\":\"RESOLVED\","
    "\"status_reason\":\"http_201: HTTP 201\",\"reverse_receipt\":{\"id\":\"rev_6\"}},"
    "{\"effect_id\":\"00000000-0000-0000-0000-000000000001\",\"step\":\"1\",\"step_is_number\":"
    "true,\"tool\":\"check_balance\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":"
    "\"balance_checks_1\"},\"external_ref\":\"balance_checks_1\",\"obligation_id\":"
    "\"10000000-0000-0000-0000-000000000001\",\"obligation_status\":\"SKIPPED\","
    "\"status_reason\":\"read_only: a read changed nothing\"}"
    "]";

static json_t *counts_of(const json_t *summary)
{
    return json_object_get(summary, "counts");
}

static json_int_t count(const json_t *summary, const char *list)
{
    json_int_t n = json_integer_value(json_object_get(counts_of(summary), list));
    assert_int_equal((size_t)n, json_array_size(json_object_get(summary, list)));
    return n;
}

static void test_summary_partially_compensated(void **state)
{
    (void)state;
    json_t *items = load(RUN_ITEMS);
    const char *status = NULL;
    json_t *s = comp_run_summary("run-1", "compensate_run: agent gave up", items, &status);
    assert_non_null(s);
    assert_string_equal(status, "PARTIALLY_COMPENSATED");
    assert_string_equal(json_string_value(json_object_get(s, "status")), status);
    assert_string_equal(json_string_value(json_object_get(s, "run_id")), "run-1");
    assert_int_equal(count(s, "compensated"), 2);
    assert_int_equal(count(s, "uncompensatable"), 1);
    assert_int_equal(count(s, "skipped"), 1);
    assert_int_equal(count(s, "failed"), 0);

    /* reversed last step first, each with its reverse receipt and an integer step */
    json_t *comp = json_object_get(s, "compensated");
    assert_string_equal(json_string_value(json_object_get(json_array_get(comp, 0), "tool")),
                        "create_hold");
    assert_int_equal(json_integer_value(json_object_get(json_array_get(comp, 0), "step")), 4);
    assert_string_equal(json_string_value(json_object_get(
                            json_object_get(json_array_get(comp, 1), "reverse_receipt"), "id")),
                        "rev_6");
    json_t *un = json_array_get(json_object_get(s, "uncompensatable"), 0);
    json_t *br = json_object_get(un, "blast_radius");
    assert_string_equal(json_string_value(json_object_get(json_object_get(br, "target"), "value")),
                        "ann@example.com");
    assert_non_null(json_string_value(json_object_get(br, "time")));
    json_t *sk = json_array_get(json_object_get(s, "skipped"), 0);
    assert_non_null(strstr(json_string_value(json_object_get(sk, "reason")), "read_only"));
    assert_string_equal(json_string_value(json_object_get(sk, "effect_id")),
                        "00000000-0000-0000-0000-000000000001");
    json_decref(s);
    json_decref(items);
}

static void test_summary_stuck(void **state)
{
    (void)state;
    json_t *items =
        load("[{\"effect_id\":\"e2\",\"step\":\"charge\",\"step_is_number\":false,\"tool\":"
             "\"charge_card\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":\"charges_2\","
             "\"version\":1},\"external_ref\":\"charges_2\",\"obligation_id\":\"o2\","
             "\"obligation_status\":\"STUCK\",\"error_code\":\"stale_state\",\"error_message\":"
             "\"HTTP 412\",\"attempts\":1,\"resolve_command\":\"tally resolve --obligation o2 --as "
             "resolved\",\"runbook\":\"https://wiki/refunds\"},"
             "{\"effect_id\":\"e1\",\"step\":\"hold\",\"step_is_number\":false,\"tool\":"
             "\"create_hold\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":\"holds_1\"},"
             "\"external_ref\":\"holds_1\",\"obligation_id\":\"o1\",\"obligation_status\":"
             "\"PENDING\",\"blocked\":true,\"attempts\":0},"
             "{\"effect_id\":\"e0\",\"step\":\"prep\",\"step_is_number\":false,\"tool\":"
             "\"charge_card\",\"effect_status\":\"FAILED\",\"effect_error\":{\"code\":\"http_422\","
             "\"message\":\"no\"}}]");
    const char *status = NULL;
    json_t *s = comp_run_summary("run-2", NULL, items, &status);
    assert_string_equal(status, "STUCK");
    assert_int_equal(count(s, "failed"), 2);
    assert_int_equal(count(s, "skipped"), 1);
    json_t *f0 = json_array_get(json_object_get(s, "failed"), 0);
    assert_string_equal(json_string_value(json_object_get(f0, "step")), "charge");
    assert_string_equal(json_string_value(json_object_get(json_object_get(f0, "error"), "code")),
                        "stale_state");
    assert_string_equal(json_string_value(json_object_get(json_object_get(f0, "receipt"), "id")),
                        "charges_2");
    const char *action = json_string_value(json_object_get(f0, "action_required"));
    assert_non_null(strstr(action, "If-Match"));
    assert_non_null(strstr(action, "tally resolve --obligation o2"));
    assert_non_null(strstr(action, "https://wiki/refunds"));
    json_t *f1 = json_array_get(json_object_get(s, "failed"), 1);
    assert_string_equal(json_string_value(json_object_get(json_object_get(f1, "error"), "code")),
                        "blocked");
    json_t *sk = json_array_get(json_object_get(s, "skipped"), 0);
    assert_non_null(strstr(json_string_value(json_object_get(sk, "reason")), "FAILED"));
    json_decref(s);
    json_decref(items);
}

static void test_summary_compensated_and_stuck_effect(void **state)
{
    (void)state;
    json_t *items = load("[{\"effect_id\":\"e1\",\"step\":\"1\",\"step_is_number\":true,"
                         "\"tool\":\"charge_card\",\"effect_status\":\"CONFIRMED\","
                         "\"obligation_id\":\"o1\",\"obligation_status\":\"RESOLVED\","
                         "\"reverse_receipt\":{\"id\":\"rev_1\"}},"
                         "{\"effect_id\":\"e0\",\"step\":\"0\",\"step_is_number\":true,"
                         "\"tool\":\"update_ledger\",\"effect_status\":\"CONFIRMED\","
                         "\"obligation_id\":\"o0\",\"obligation_status\":\"SKIPPED\","
                         "\"status_reason\":\"idempotent\"}]");
    const char *status = NULL;
    json_t *s = comp_run_summary("run-3", "compensate_run", items, &status);
    assert_string_equal(status, "COMPENSATED");
    assert_int_equal(count(s, "compensated"), 1);
    assert_int_equal(count(s, "skipped"), 1);
    json_decref(s);
    json_decref(items);

    /* an effect STUCK upstream-unknown: the run cannot be called compensated */
    items = load("[{\"effect_id\":\"e9\",\"step\":\"9\",\"step_is_number\":true,\"tool\":"
                 "\"charge_card\",\"effect_status\":\"STUCK\",\"effect_error\":{\"code\":"
                 "\"status_inconclusive\",\"message\":\"status checks failed\"}}]");
    s = comp_run_summary("run-4", NULL, items, &status);
    assert_string_equal(status, "STUCK");
    json_t *f = json_array_get(json_object_get(s, "failed"), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(f, "error"), "code")),
                        "status_inconclusive");
    assert_non_null(strstr(json_string_value(json_object_get(f, "action_required")),
                           "tally resolve --effect e9"));
    json_decref(s);
    json_decref(items);

    /* no effects at all: nothing to undo */
    items = json_array();
    s = comp_run_summary("run-5", NULL, items, &status);
    assert_string_equal(status, "COMPENSATED");
    json_decref(s);
    json_decref(items);
}

/* ---------------------------------------------------------------- PagerDuty */

static void test_pager_trigger_body(void **state)
{
    (void)state;
    json_t *details = load("{\"run_id\":\"r1\",\"obligation_id\":\"o1\"}");
    json_t *b = comp_pager_body("rk-123", "trigger", "obligation:o1", "run r1 is STUCK",
                                "tally/run/r1", "critical", details, "https://wiki/refunds");
    assert_non_null(b);
    assert_string_equal(json_string_value(json_object_get(b, "routing_key")), "rk-123");
    assert_string_equal(json_string_value(json_object_get(b, "event_action")), "trigger");
    assert_string_equal(json_string_value(json_object_get(b, "dedup_key")), "obligation:o1");
    json_t *p = json_object_get(b, "payload");
    assert_string_equal(json_string_value(json_object_get(p, "summary")), "run r1 is STUCK");
    assert_string_equal(json_string_value(json_object_get(p, "source")), "tally/run/r1");
    assert_string_equal(json_string_value(json_object_get(p, "severity")), "critical");
    assert_true(json_equal(json_object_get(p, "custom_details"), details));
    json_t *link = json_array_get(json_object_get(b, "links"), 0);
    assert_string_equal(json_string_value(json_object_get(link, "href")), "https://wiki/refunds");
    json_decref(b);

    /* no runbook: no links; an unknown severity is paged as critical */
    b = comp_pager_body("rk", "trigger", "k", "s", "src", "loud", NULL, NULL);
    assert_null(json_object_get(b, "links"));
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(b, "payload"), "severity")), "critical");
    assert_true(json_is_object(json_object_get(json_object_get(b, "payload"), "custom_details")));
    json_decref(b);
    json_decref(details);
}

static void test_pager_resolve_and_long_summary(void **state)
{
    (void)state;
    json_t *b = comp_pager_body("rk", "resolve", "obligation:o1", "x", "src", "critical", NULL,
                                "https://wiki");
    assert_string_equal(json_string_value(json_object_get(b, "event_action")), "resolve");
    assert_null(json_object_get(b, "payload"));
    assert_null(json_object_get(b, "links"));
    assert_int_equal(json_object_size(b), 3);
    json_decref(b);

    /* 1024 bytes at most, cut between characters, not inside one ("é" is 2 bytes) */
    char summary[2100];
    summary[0] = 'a';
    size_t o = 1;
    while (o + 2 < sizeof summary - 1) {
        summary[o++] = (char)0xC3;
        summary[o++] = (char)0xA9;
    }
    summary[o] = '\0';
    b = comp_pager_body("rk", "trigger", "k", summary, "src", "error", NULL, NULL);
    const char *cut = json_string_value(json_object_get(json_object_get(b, "payload"), "summary"));
    assert_non_null(cut);
    assert_true(strlen(cut) <= 1024);
    assert_true(strlen(cut) >= 1022);
    assert_int_equal(strlen(cut) % 2, 1); /* 'a' then whole 2-byte characters */
    json_decref(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decide_read_and_idempotent_skip),
        cmocka_unit_test(test_decide_reversible),
        cmocka_unit_test(test_decide_append_only),
        cmocka_unit_test(test_decide_destructive_always_escalates),
        cmocka_unit_test(test_target_field),
        cmocka_unit_test(test_blast_radius),
        cmocka_unit_test(test_reverse_body_and_if_match),
        cmocka_unit_test(test_backoff),
        cmocka_unit_test(test_summary_partially_compensated),
        cmocka_unit_test(test_summary_stuck),
        cmocka_unit_test(test_summary_compensated_and_stuck_effect),
        cmocka_unit_test(test_pager_trigger_body),
        cmocka_unit_test(test_pager_resolve_and_long_summary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
