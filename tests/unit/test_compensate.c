/* test_compensate.c — the compensator's pure logic: the per-class decision table (runops.c),
 * what a leased obligation, an unsent call and a call's answer make of it (policy.c), the blast
 * radius and its target, the reverse call's body and If-Match (body.c), the retry backoff, what
 * a settled run publishes, the PagerDuty Events API v2 body, and the text of deadline pages
 * (their commands by the obligation's state). The run summary of DESIGN §7
 * is tests/unit/test_runsummary.c's. No services. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compensator.h"
#include "tally/alert.h"
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

static uint32_t rnd(unsigned *seed)
{
    return (uint32_t)rand_r(seed);
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
        long long d1 = comp_backoff_ms(&t, 1, -1, rnd(&seed));
        assert_in_range(d1, 50, 100);
        long long d3 = comp_backoff_ms(&t, 3, -1, rnd(&seed));
        assert_in_range(d3, 200, 400);
        long long d20 = comp_backoff_ms(&t, 20, -1, rnd(&seed)); /* capped at max_backoff_ms */
        assert_in_range(d20, 1000, 2000);
    }
    /* jitter: not every retry waits the same */
    long long first = comp_backoff_ms(&t, 5, -1, rnd(&seed));
    bool differs = false;
    for (int i = 0; i < 50 && !differs; i++) {
        differs = comp_backoff_ms(&t, 5, -1, rnd(&seed)) != first;
    }
    assert_true(differs);
    /* the tool's Retry-After wins when it asks for longer */
    assert_int_equal(comp_backoff_ms(&t, 1, 5000, rnd(&seed)), 5000);
    assert_in_range(comp_backoff_ms(&t, 1, 10, rnd(&seed)), 50, 100);
    assert_in_range(comp_backoff_ms(NULL, 1, -1, rnd(&seed)), 100, 200);
}

/* ---------------------------------------------------------------- policy: a leased obligation */

static comp_policy_in_t in_of(const tally_tool_t *t, int attempts)
{
    return (comp_policy_in_t){.tool = t,
                              .tool_name = t != NULL ? t->name : "gone",
                              .cls_known = true,
                              .cls = t != NULL ? t->effect_class : TALLY_CLASS_REVERSIBLE,
                              .approved = false,
                              .attempts = attempts,
                              .version = COMP_VERSION_OK,
                              .hold_ms = 1000,
                              .random = 7};
}

/* The decision and the move for a freshly leased obligation (@p can_contain: its blast radius
 * was built). */
static comp_move_t lease(const comp_policy_in_t *in, bool can_contain, tally_comp_decision_t *d)
{
    comp_policy_decide(in, d);
    comp_move_t mv;
    comp_policy_lease(in, d, can_contain, &mv);
    return mv;
}

static void assert_record(const comp_move_t *mv, tally_obligation_state_t to, const char *code,
                          const char *page)
{
    assert_int_equal(mv->kind, COMP_MOVE_RECORD);
    assert_int_equal(mv->to, to);
    assert_string_equal(mv->code, code);
    assert_true(strlen(mv->message) > 0);
    if (page == NULL) {
        assert_null(mv->page);
    } else {
        assert_non_null(mv->page);
        assert_string_equal(mv->page, page);
    }
}

static void test_policy_lease_by_class(void **state)
{
    (void)state;
    tally_comp_decision_t d;
    tally_tool_t read = tool_of("check_balance", TALLY_CLASS_READ, TALLY_COMP_AUTOMATIC);
    comp_policy_in_t in = in_of(&read, 1);
    comp_move_t mv = lease(&in, true, &d);
    assert_record(&mv, TALLY_OBLIGATION_SKIPPED, "read_only", NULL);
    assert_false(mv.is_error);
    assert_false(comp_policy_wants_blast_radius(d.action));

    tally_tool_t rev = tool_of("charge_card", TALLY_CLASS_REVERSIBLE, TALLY_COMP_AUTOMATIC);
    in = in_of(&rev, 1);
    mv = lease(&in, false, &d);
    assert_int_equal(mv.kind, COMP_MOVE_CALL);
    assert_int_equal(mv.op, TALLY_CONN_COMPENSATE);
    assert_false(comp_policy_wants_blast_radius(d.action));

    /* append_only without a containment action: recorded, not paged */
    tally_tool_t email = tool_of("send_email", TALLY_CLASS_APPEND_ONLY, TALLY_COMP_AUTOMATIC);
    in = in_of(&email, 1);
    mv = lease(&in, true, &d);
    assert_true(comp_policy_wants_blast_radius(d.action));
    assert_record(&mv, TALLY_OBLIGATION_UNCOMPENSATABLE, "append_only", NULL);
    assert_false(mv.is_error);
    assert_int_equal(mv.containment, COMP_CONTAIN_NONE);

    /* destructive: recorded and paged, whatever the mode */
    tally_tool_t del = tool_of("delete_account", TALLY_CLASS_DESTRUCTIVE, TALLY_COMP_AUTOMATIC);
    in = in_of(&del, 1);
    mv = lease(&in, true, &d);
    assert_true(comp_policy_wants_blast_radius(d.action));
    assert_record(&mv, TALLY_OBLIGATION_UNCOMPENSATABLE, "destructive", "destructive");

    /* not_supported: recorded with the reason */
    rev.comp_mode = TALLY_COMP_NOT_SUPPORTED;
    in = in_of(&rev, 1);
    mv = lease(&in, true, &d);
    assert_record(&mv, TALLY_OBLIGATION_UNCOMPENSATABLE, "not_supported", NULL);

    /* manual_runbook, and a tool that left the registry: STUCK at once, paged, as an error */
    rev.comp_mode = TALLY_COMP_MANUAL_RUNBOOK;
    in = in_of(&rev, 1);
    mv = lease(&in, true, &d);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "manual_runbook", "manual_runbook");
    assert_true(mv.is_error);
    in = in_of(NULL, 1);
    mv = lease(&in, true, &d);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "unknown_tool", "unknown_tool");
    assert_true(mv.is_error);
}

static void test_policy_lease_reverse_guards(void **state)
{
    (void)state;
    tally_comp_decision_t d;
    tally_tool_t rev = tool_of("charge_card", TALLY_CLASS_REVERSIBLE, TALLY_COMP_AUTOMATIC);
    /* the fifth start is still a call; a sixth means leases kept expiring mid-call */
    comp_policy_in_t in = in_of(&rev, 5);
    assert_int_equal(lease(&in, false, &d).kind, COMP_MOVE_CALL);
    in = in_of(&rev, 6);
    comp_move_t mv = lease(&in, false, &d);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "attempts_exhausted", "attempts_exhausted");
    assert_true(mv.is_error);
    /* without a tool max_attempts is 5 */
    assert_int_equal(comp_max_attempts(NULL), 5);
    rev.max_attempts = 0;
    assert_int_equal(comp_max_attempts(&rev), 5);
    rev.max_attempts = 2;
    in = in_of(&rev, 3);
    assert_int_equal(lease(&in, false, &d).to, TALLY_OBLIGATION_STUCK);

    /* a version that cannot travel as If-Match: no call without the stale-state guard */
    rev.max_attempts = 5;
    in = in_of(&rev, 1);
    in.version = COMP_VERSION_UNUSABLE;
    mv = lease(&in, false, &d);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "protocol_error", "protocol_error");
    assert_true(mv.is_error);
    assert_non_null(strstr(mv.message, "If-Match"));
    in.version = COMP_VERSION_NONE;
    assert_int_equal(lease(&in, false, &d).kind, COMP_MOVE_CALL);
}

static void test_policy_lease_containment(void **state)
{
    (void)state;
    tally_comp_decision_t d;
    tally_tool_t email = tool_of("send_email", TALLY_CLASS_APPEND_ONLY, TALLY_COMP_AUTOMATIC);
    email.contain.method = (char *)"POST";
    email.contain.path = (char *)"/emails/contain";
    comp_policy_in_t in = in_of(&email, 1);
    comp_move_t mv = lease(&in, true, &d);
    assert_int_equal(d.action, TALLY_COMP_ACT_CONTAIN);
    assert_true(comp_policy_wants_blast_radius(d.action));
    assert_int_equal(mv.kind, COMP_MOVE_CALL);
    assert_int_equal(mv.op, TALLY_CONN_CONTAIN);

    /* the blast radius the call carries could not be built: recorded without containing */
    mv = lease(&in, false, &d);
    assert_record(&mv, TALLY_OBLIGATION_UNCOMPENSATABLE, "append_only", NULL);
    assert_int_equal(mv.containment, COMP_CONTAIN_NONE);

    /* the containment kept losing its lease: recorded as failed, never STUCK */
    in = in_of(&email, 6);
    mv = lease(&in, true, &d);
    assert_record(&mv, TALLY_OBLIGATION_UNCOMPENSATABLE, "append_only", NULL);
    assert_int_equal(mv.containment, COMP_CONTAIN_FAILED);
    assert_string_equal(mv.containment_code, "attempts_exhausted");
    assert_non_null(strstr(mv.containment_message, "max_attempts"));
}

static void test_policy_lease_approval_and_unknown_class(void **state)
{
    (void)state;
    tally_comp_decision_t d;
    tally_tool_t rev = tool_of("refund", TALLY_CLASS_REVERSIBLE, TALLY_COMP_APPROVAL_REQUIRED);
    assert_true(comp_needs_approval(&rev));
    assert_false(comp_needs_approval(NULL));
    tally_tool_t auto_rev = tool_of("x", TALLY_CLASS_REVERSIBLE, TALLY_COMP_AUTOMATIC);
    assert_false(comp_needs_approval(&auto_rev));

    /* leased without approval (the registry changed under the lease): given back untouched */
    comp_policy_in_t in = in_of(&rev, 1);
    comp_move_t mv = lease(&in, false, &d);
    assert_record(&mv, TALLY_OBLIGATION_PENDING, "approval_required", NULL);
    assert_true(mv.refund_attempt);
    assert_int_equal(mv.delay_ms, 1000);
    assert_false(mv.is_error);
    in.approved = true;
    assert_int_equal(lease(&in, false, &d).kind, COMP_MOVE_CALL);

    /* an effect class tally does not know: STUCK, paged */
    in = in_of(&auto_rev, 1);
    in.cls_known = false;
    mv = lease(&in, true, &d);
    assert_int_equal(d.action, TALLY_COMP_ACT_NO_TOOL);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "unknown_class", "unknown_class");
}

/* ---------------------------------------------------------------- policy: calls */

static void test_policy_unsent(void **state)
{
    (void)state;
    tally_comp_decision_t d;
    tally_tool_t rev = tool_of("charge_card", TALLY_CLASS_REVERSIBLE, TALLY_COMP_AUTOMATIC);
    comp_policy_in_t in = in_of(&rev, 5);
    comp_policy_decide(&in, &d);
    tally_error_t err;
    comp_move_t mv;

    /* no room: not the tool's fault, the attempt is given back, even at max_attempts */
    tally_error_setc(&err, TALLY_ERR_CAPACITY, "per-tool cap reached");
    comp_policy_unsent(&in, &d, TALLY_CONN_COMPENSATE, true, &err, &mv);
    assert_record(&mv, TALLY_OBLIGATION_PENDING, "capacity", NULL);
    assert_true(mv.refund_attempt);
    assert_true(mv.is_error);
    assert_int_equal(mv.delay_ms, 200);

    /* retriable with attempts left: the tool's backoff */
    tally_error_setc(&err, TALLY_ERR_SECRET_MISSING, "BILLING_HMAC_SECRET is not set");
    in.attempts = 2;
    comp_policy_unsent(&in, &d, TALLY_CONN_COMPENSATE, false, &err, &mv);
    assert_record(&mv, TALLY_OBLIGATION_PENDING, "secret_missing", NULL);
    assert_false(mv.refund_attempt);
    assert_in_range(mv.delay_ms, 100, 200);
    /* ... and at max_attempts: STUCK */
    in.attempts = 5;
    comp_policy_unsent(&in, &d, TALLY_CONN_COMPENSATE, false, &err, &mv);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "attempts_exhausted", "attempts_exhausted");
    assert_string_equal(mv.message, "BILLING_HMAC_SECRET is not set");

    /* not retriable: STUCK with its own code */
    tally_error_setc(&err, TALLY_ERR_NO_ENDPOINT, "no compensate endpoint");
    in.attempts = 1;
    comp_policy_unsent(&in, &d, TALLY_CONN_COMPENSATE, false, &err, &mv);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "no_endpoint", "no_endpoint");
    assert_true(mv.is_error);

    /* a containment that cannot be made is recorded, never STUCK */
    tally_tool_t email = tool_of("send_email", TALLY_CLASS_APPEND_ONLY, TALLY_COMP_AUTOMATIC);
    email.contain.method = (char *)"POST";
    email.contain.path = (char *)"/emails/contain";
    in = in_of(&email, 1);
    comp_policy_decide(&in, &d);
    comp_policy_unsent(&in, &d, TALLY_CONN_CONTAIN, false, &err, &mv);
    assert_record(&mv, TALLY_OBLIGATION_UNCOMPENSATABLE, "append_only", NULL);
    assert_false(mv.is_error);
    assert_int_equal(mv.containment, COMP_CONTAIN_FAILED);
    assert_string_equal(mv.containment_code, "no_endpoint");

    /* out of memory building the body: given back in a second */
    comp_policy_no_body(&mv);
    assert_record(&mv, TALLY_OBLIGATION_PENDING, "oom", NULL);
    assert_true(mv.refund_attempt);
    assert_int_equal(mv.delay_ms, 1000);
}

static tally_conn_verdict_t verdict(tally_verdict_t v, const char *code, long retry_after_ms)
{
    tally_conn_verdict_t out;
    memset(&out, 0, sizeof out);
    out.verdict = v;
    out.retry_after_ms = retry_after_ms;
    snprintf(out.code, sizeof out.code, "%s", code);
    snprintf(out.message, sizeof out.message, "the tool said %s", code);
    return out;
}

static void test_policy_answer_reverse(void **state)
{
    (void)state;
    tally_comp_decision_t d;
    tally_tool_t rev = tool_of("charge_card", TALLY_CLASS_REVERSIBLE, TALLY_COMP_AUTOMATIC);
    comp_policy_in_t in = in_of(&rev, 1);
    comp_policy_decide(&in, &d);
    comp_move_t mv;

    tally_conn_verdict_t v = verdict(TALLY_VERDICT_RESOLVED, "http_201", -1);
    comp_policy_answer(&in, &d, TALLY_CONN_COMPENSATE, &v, &mv);
    assert_record(&mv, TALLY_OBLIGATION_RESOLVED, "http_201", NULL);
    assert_false(mv.is_error);

    /* transient: retried after the backoff, or the tool's Retry-After when longer */
    v = verdict(TALLY_VERDICT_RETRY, "http_503", -1);
    comp_policy_answer(&in, &d, TALLY_CONN_COMPENSATE, &v, &mv);
    assert_record(&mv, TALLY_OBLIGATION_PENDING, "http_503", NULL);
    assert_true(mv.is_error);
    assert_in_range(mv.delay_ms, 50, 100);
    v = verdict(TALLY_VERDICT_RETRY, "http_429", 30000);
    comp_policy_answer(&in, &d, TALLY_CONN_COMPENSATE, &v, &mv);
    assert_int_equal(mv.delay_ms, 30000);
    /* ... until max_attempts: STUCK, saying how often and what came last */
    in.attempts = 5;
    v = verdict(TALLY_VERDICT_RETRY, "http_503", -1);
    comp_policy_answer(&in, &d, TALLY_CONN_COMPENSATE, &v, &mv);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "attempts_exhausted", "attempts_exhausted");
    assert_non_null(strstr(mv.message, "5 times"));
    assert_non_null(strstr(mv.message, "'charge_card'"));
    assert_non_null(strstr(mv.message, "the tool said http_503"));

    /* 412: the record changed upstream, never retried */
    in.attempts = 1;
    v = verdict(TALLY_VERDICT_STUCK, "stale_state", -1);
    comp_policy_answer(&in, &d, TALLY_CONN_COMPENSATE, &v, &mv);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "stale_state", "stale_state");
    assert_true(mv.is_error);
    v = verdict(TALLY_VERDICT_STUCK, "http_422", -1);
    comp_policy_answer(&in, &d, TALLY_CONN_COMPENSATE, &v, &mv);
    assert_record(&mv, TALLY_OBLIGATION_STUCK, "http_422", "reverse_failed");
    assert_int_equal(mv.containment, COMP_CONTAIN_NONE);
}

static void test_policy_answer_containment(void **state)
{
    (void)state;
    tally_comp_decision_t d;
    tally_tool_t email = tool_of("send_email", TALLY_CLASS_APPEND_ONLY, TALLY_COMP_AUTOMATIC);
    email.contain.method = (char *)"POST";
    email.contain.path = (char *)"/emails/contain";
    comp_policy_in_t in = in_of(&email, 1);
    comp_policy_decide(&in, &d);
    comp_move_t mv;

    tally_conn_verdict_t v = verdict(TALLY_VERDICT_RESOLVED, "http_200", -1);
    comp_policy_answer(&in, &d, TALLY_CONN_CONTAIN, &v, &mv);
    assert_record(&mv, TALLY_OBLIGATION_UNCOMPENSATABLE, "append_only", NULL);
    assert_int_equal(mv.containment, COMP_CONTAIN_DONE);
    assert_string_equal(mv.containment_code, "http_200");
    assert_false(mv.is_error);

    v = verdict(TALLY_VERDICT_RETRY, "timeout", -1);
    comp_policy_answer(&in, &d, TALLY_CONN_CONTAIN, &v, &mv);
    assert_record(&mv, TALLY_OBLIGATION_PENDING, "timeout", NULL);
    assert_true(mv.is_error);
    assert_int_equal(mv.containment, COMP_CONTAIN_NONE);

    in.attempts = 5;
    comp_policy_answer(&in, &d, TALLY_CONN_CONTAIN, &v, &mv);
    assert_record(&mv, TALLY_OBLIGATION_UNCOMPENSATABLE, "append_only", NULL);
    assert_int_equal(mv.containment, COMP_CONTAIN_FAILED);
    assert_string_equal(mv.containment_code, "attempts_exhausted");

    /* refused: recorded as failed with the tool's code, still never STUCK */
    in.attempts = 1;
    v = verdict(TALLY_VERDICT_STUCK, "http_400", -1);
    comp_policy_answer(&in, &d, TALLY_CONN_CONTAIN, &v, &mv);
    assert_int_equal(mv.to, TALLY_OBLIGATION_UNCOMPENSATABLE);
    assert_int_equal(mv.containment, COMP_CONTAIN_FAILED);
    assert_string_equal(mv.containment_code, "http_400");
    assert_null(mv.page);
}

/* ---------------------------------------------------------------- policy: runs, gauges */

static void test_policy_settle(void **state)
{
    (void)state;
    tally_run_state_t stuck = TALLY_RUN_STUCK, compensated = TALLY_RUN_COMPENSATED;
    /* a run under compensation settles into its outcome */
    assert_int_equal(comp_policy_settle(TALLY_RUN_COMPENSATING, NULL, TALLY_RUN_COMPENSATED),
                     COMP_SETTLE_TRANSITION);
    assert_int_equal(comp_policy_settle(TALLY_RUN_COMPENSATING, NULL, TALLY_RUN_STUCK),
                     COMP_SETTLE_TRANSITION);
    /* a STUCK run stays STUCK: its STUCK outcome goes out once */
    assert_int_equal(comp_policy_settle(TALLY_RUN_STUCK, NULL, TALLY_RUN_STUCK),
                     COMP_SETTLE_SUMMARY);
    assert_int_equal(comp_policy_settle(TALLY_RUN_STUCK, &stuck, TALLY_RUN_STUCK),
                     COMP_SETTLE_NONE);
    assert_int_equal(comp_policy_settle(TALLY_RUN_STUCK, &compensated, TALLY_RUN_STUCK),
                     COMP_SETTLE_SUMMARY);
    /* ... until a human settles what held it */
    assert_int_equal(comp_policy_settle(TALLY_RUN_STUCK, &stuck, TALLY_RUN_COMPENSATED),
                     COMP_SETTLE_TRANSITION);
    assert_string_equal(comp_policy_run_event(TALLY_RUN_STUCK), "tally.run.stuck.v1");
    assert_string_equal(comp_policy_run_event(TALLY_RUN_COMPENSATED), "tally.run.compensated.v1");
    assert_string_equal(comp_policy_run_event(TALLY_RUN_PARTIALLY_COMPENSATED),
                        "tally.run.compensated.v1");
}

static void test_policy_count_terminal(void **state)
{
    (void)state;
    assert_true(comp_policy_count_terminal(100.0, 0, false)); /* never counted */
    assert_false(comp_policy_count_terminal(105.0, 100.0, true));
    assert_false(comp_policy_count_terminal(120.0, 100.0, false));
    assert_true(comp_policy_count_terminal(110.0, 100.0, true));
    assert_true(comp_policy_count_terminal(160.0, 100.0, false));
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

/* ---------------------------------------------------------------- deadline pages (body.c) */

static void test_deadline_command_by_state(void **state)
{
    (void)state;
    const char *oid = "0b6c3a52-7f7e-4c55-9d2e-1f0f3e6b8a11";
    /* STUCK: the resolve an operator can run now, both ways */
    char *cmd = comp_deadline_command(TALLY_OBLIGATION_STUCK, oid, "run-1");
    assert_non_null(cmd);
    assert_non_null(strstr(cmd, "tally resolve --obligation 0b6c3a52-7f7e-4c55-9d2e-1f0f3e6b8a11 "
                                "--as resolved --reason"));
    assert_non_null(strstr(cmd, "--as skipped"));
    assert_null(strstr(cmd, "doctor"));
    free(cmd);
    /* AWAITING_APPROVAL: resolve would be refused; approve or deny is the move */
    cmd = comp_deadline_command(TALLY_OBLIGATION_AWAITING_APPROVAL, oid, "run-1");
    assert_non_null(strstr(cmd, "tally approve --obligation 0b6c3a52-7f7e-4c55-9d2e-1f0f3e6b8a11 "
                                "--reason"));
    assert_non_null(strstr(cmd, "tally deny --obligation 0b6c3a52-7f7e-4c55-9d2e-1f0f3e6b8a11"));
    assert_null(strstr(cmd, "tally resolve"));
    free(cmd);
    /* PENDING and RUNNING: the compensator is still at it: look, and resolve once STUCK; the run
     * id is quoted for the shell whatever it holds */
    tally_obligation_state_t open[] = {TALLY_OBLIGATION_PENDING, TALLY_OBLIGATION_RUNNING};
    for (size_t i = 0; i < 2; i++) {
        cmd = comp_deadline_command(open[i], oid, "run 'x'; rm -rf /");
        assert_non_null(cmd);
        assert_non_null(strstr(cmd, "tally doctor --run 'run '\\''x'\\''; rm -rf /'  #"));
        assert_non_null(strstr(cmd,
                               "tally resolve --obligation 0b6c3a52-7f7e-4c55-9d2e-1f0f3e6b8a11"
                               " --as resolved"));
        assert_non_null(strstr(cmd, "once it is STUCK"));
        free(cmd);
    }
}

static void test_deadline_summary(void **state)
{
    (void)state;
    char out[TALLY_ALERT_SUMMARY_MAX];
    comp_deadline_summary(out, sizeof out, true, 0.8, "run-7", "2", "charge_card", "o-1", "STUCK",
                          "2026-11-27T10:00:00.000Z");
    assert_string_equal(out, "run run-7 step 2: compensation of charge_card is past its deadline "
                             "2026-11-27T10:00:00.000Z (obligation o-1 is STUCK)");
    comp_deadline_summary(out, sizeof out, false, 0.8, "run-7", "2", "charge_card", "o-1",
                          "AWAITING_APPROVAL", "2026-11-27T10:00:00.000Z");
    assert_string_equal(out, "run run-7 step 2: compensation of charge_card has used 80% of its "
                             "time to its deadline 2026-11-27T10:00:00.000Z (obligation o-1 is "
                             "AWAITING_APPROVAL)");
    /* a long run id is cut between characters, and the deadline still fits */
    char run[400];
    size_t o = 0;
    while (o + 2 < sizeof run) {
        run[o++] = (char)0xC3;
        run[o++] = (char)0xA9;
    }
    run[o] = '\0';
    comp_deadline_summary(out, sizeof out, true, 0.8, run, "2", "charge_card", "o-1", "PENDING",
                          "2026-11-27T10:00:00.000Z");
    assert_non_null(strstr(out, "past its deadline 2026-11-27T10:00:00.000Z"));
    const char *cut = out + strlen("run ");
    size_t n = (size_t)(strchr(cut, ' ') - cut);
    assert_true(n > 3 && n < 84);
    assert_memory_equal(cut + n - 3, "...", 3); /* said to be cut, */
    assert_int_equal((n - 3) % 2, 0);           /* after whole 2-byte characters */
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
        cmocka_unit_test(test_policy_lease_by_class),
        cmocka_unit_test(test_policy_lease_reverse_guards),
        cmocka_unit_test(test_policy_lease_containment),
        cmocka_unit_test(test_policy_lease_approval_and_unknown_class),
        cmocka_unit_test(test_policy_unsent),
        cmocka_unit_test(test_policy_answer_reverse),
        cmocka_unit_test(test_policy_answer_containment),
        cmocka_unit_test(test_policy_settle),
        cmocka_unit_test(test_policy_count_terminal),
        cmocka_unit_test(test_pager_trigger_body),
        cmocka_unit_test(test_pager_resolve_and_long_summary),
        cmocka_unit_test(test_deadline_command_by_state),
        cmocka_unit_test(test_deadline_summary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
