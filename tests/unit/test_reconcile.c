/* test_reconcile.c — the reconciler's decisions against DESIGN §3, its backoff, the choice of
 * the kept record among duplicates, and the alert helpers every STUCK page carries. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "reconciler.h"
#include "tally/alert.h"
#include "tally/ledger.h"

/* A reversible tool with a status endpoint, checked once, inside nothing in particular. */
static tally_recon_input_t base(tally_verdict_t v)
{
    tally_recon_input_t in = {
        .has_status = true,
        .verdict = v,
        .effect_class = TALLY_CLASS_REVERSIBLE,
        .attempts = 1,
        .max_attempts = 5,
        .settled = true,
        .inconclusive_checks = 0,
        .unknown_ms = 1000,
        .backoff_ms = 200,
        .max_backoff_ms = 60000,
        .random = 12345,
    };
    return in;
}

static void test_found_confirms_and_several_is_a_duplicate(void **state)
{
    (void)state;
    tally_recon_input_t in = base(TALLY_VERDICT_FOUND);
    assert_int_equal(tally_recon_decide(&in).action, TALLY_RECON_CONFIRM);
    in.settled = false; /* evidence of the effect needs no settle window */
    in.attempts = 99;   /* nor attempts left */
    assert_int_equal(tally_recon_decide(&in).action, TALLY_RECON_CONFIRM);
    in = base(TALLY_VERDICT_DUPLICATE);
    tally_recon_decision_t d = tally_recon_decide(&in);
    assert_int_equal(d.action, TALLY_RECON_DUPLICATE);
    assert_null(d.stuck_reason);
}

static void test_not_found_waits_for_the_settle_window(void **state)
{
    (void)state;
    tally_recon_input_t in = base(TALLY_VERDICT_NOT_FOUND);
    in.settled = false;
    assert_int_equal(tally_recon_decide(&in).action, TALLY_RECON_WAIT_SETTLE);
    in.attempts = 5; /* even with no attempts left: the record may still appear */
    assert_int_equal(tally_recon_decide(&in).action, TALLY_RECON_WAIT_SETTLE);

    in = base(TALLY_VERDICT_NOT_FOUND);
    assert_int_equal(tally_recon_decide(&in).action, TALLY_RECON_REDISPATCH);
    in.attempts = 4;
    assert_int_equal(tally_recon_decide(&in).action, TALLY_RECON_REDISPATCH);
    in.attempts = 5;
    tally_recon_decision_t d = tally_recon_decide(&in);
    assert_int_equal(d.action, TALLY_RECON_STUCK);
    assert_string_equal(d.stuck_reason, "attempts_exhausted");
}

static void test_inconclusive_backs_off_then_pages(void **state)
{
    (void)state;
    tally_recon_input_t in = base(TALLY_VERDICT_INCONCLUSIVE);
    for (int before = 0; before < 4; before++) {
        in.inconclusive_checks = before;
        tally_recon_decision_t d = tally_recon_decide(&in);
        assert_int_equal(d.action, TALLY_RECON_RETRY_CHECK);
        long long full = 200LL << before;
        assert_true(d.delay_ms >= full / 2 && d.delay_ms <= full);
    }
    in.inconclusive_checks = 4; /* this is the 5th inconclusive check of max_attempts 5 */
    tally_recon_decision_t d = tally_recon_decide(&in);
    assert_int_equal(d.action, TALLY_RECON_STUCK);
    assert_string_equal(d.stuck_reason, "status_inconclusive");

    /* past the deadline (10 × max_backoff_ms) it pages however few checks were made */
    in = base(TALLY_VERDICT_INCONCLUSIVE);
    in.unknown_ms = (long long)TALLY_RECON_DEADLINE_FACTOR * in.max_backoff_ms;
    d = tally_recon_decide(&in);
    assert_int_equal(d.action, TALLY_RECON_STUCK);
    assert_string_equal(d.stuck_reason, "status_inconclusive");
    in.unknown_ms -= 1;
    assert_int_equal(tally_recon_decide(&in).action, TALLY_RECON_RETRY_CHECK);
}

static void test_no_status_endpoint(void **state)
{
    (void)state;
    tally_recon_input_t in = base(TALLY_VERDICT_INCONCLUSIVE);
    in.has_status = false;
    static const tally_effect_class_t unsafe[] = {TALLY_CLASS_REVERSIBLE, TALLY_CLASS_APPEND_ONLY,
                                                  TALLY_CLASS_DESTRUCTIVE};
    for (size_t i = 0; i < sizeof unsafe / sizeof unsafe[0]; i++) {
        in.effect_class = unsafe[i];
        tally_recon_decision_t d = tally_recon_decide(&in);
        assert_int_equal(d.action, TALLY_RECON_STUCK);
        assert_string_equal(d.stuck_reason, "no_status_check");
    }
    /* read and idempotent: retry is safe by definition, within the attempt cap */
    static const tally_effect_class_t safe[] = {TALLY_CLASS_READ, TALLY_CLASS_IDEMPOTENT};
    for (size_t i = 0; i < 2; i++) {
        in.effect_class = safe[i];
        in.attempts = 1;
        assert_int_equal(tally_recon_decide(&in).action, TALLY_RECON_REDISPATCH);
        in.attempts = 5;
        tally_recon_decision_t d = tally_recon_decide(&in);
        assert_int_equal(d.action, TALLY_RECON_STUCK);
        assert_string_equal(d.stuck_reason, "attempts_exhausted");
    }
}

/* Every move a decision makes is in the DESIGN §3 table, made by the reconciler. */
static void test_decisions_are_allowed_transitions(void **state)
{
    (void)state;
    static const struct {
        tally_recon_action_t action;
        tally_effect_state_t to;
    } moves[] = {
        {TALLY_RECON_CONFIRM, TALLY_EFFECT_CONFIRMED},
        {TALLY_RECON_DUPLICATE, TALLY_EFFECT_CONFIRMED},
        {TALLY_RECON_REDISPATCH, TALLY_EFFECT_PLANNED},
        {TALLY_RECON_STUCK, TALLY_EFFECT_STUCK},
    };
    for (size_t i = 0; i < sizeof moves / sizeof moves[0]; i++) {
        bool by_reconciler = false;
        for (const tally_transition_t *t = tally_effect_transitions; t->by != NULL; t++) {
            if (t->from == TALLY_EFFECT_UNKNOWN && t->to == (int)moves[i].to &&
                strcmp(t->by, "reconciler") == 0) {
                by_reconciler = true;
            }
        }
        assert_true(by_reconciler);
        assert_true(tally_effect_transition_allowed(TALLY_EFFECT_UNKNOWN, moves[i].to));
    }
    bool lease_expiry = false;
    for (const tally_transition_t *t = tally_effect_transitions; t->by != NULL; t++) {
        if (t->from == TALLY_EFFECT_DISPATCHING && t->to == TALLY_EFFECT_UNKNOWN &&
            strcmp(t->by, "reconciler") == 0) {
            lease_expiry = true;
        }
    }
    assert_true(lease_expiry);
}

/* An inconclusive check is looked at again after the tool's backoff (backoff.h), the n-th
 * inconclusive check of the episode taking the n-th step: doubling to max_backoff_ms, with
 * equal jitter. */
static void test_inconclusive_backs_off_by_the_tools_steps_with_bounded_jitter(void **state)
{
    (void)state;
    for (int n = 1; n <= 12; n++) {
        long long full = 100LL << (n - 1);
        if (full > 2000) {
            full = 2000;
        }
        tally_recon_input_t in = base(TALLY_VERDICT_INCONCLUSIVE);
        in.max_attempts = 100;
        in.unknown_ms = 0;
        in.backoff_ms = 100;
        in.max_backoff_ms = 2000;
        in.inconclusive_checks = n - 1;
        in.random = 0;
        tally_recon_decision_t d = tally_recon_decide(&in);
        assert_int_equal(d.action, TALLY_RECON_RETRY_CHECK);
        assert_int_equal(d.delay_ms, full - full / 2);
        for (uint32_t r = 0; r < 1000; r += 7) {
            in.random = r * 2654435761u;
            d = tally_recon_decide(&in);
            assert_true(d.delay_ms >= full - full / 2 && d.delay_ms <= full);
        }
    }
}

static void test_parse_time(void **state)
{
    (void)state;
    long long us = 0;
    assert_true(tally_recon_parse_time("1970-01-01T00:00:00Z", &us));
    assert_int_equal(us, 0);
    assert_true(tally_recon_parse_time("2024-05-01T12:34:56.789Z", &us));
    assert_int_equal(us, 1714566896789000LL);
    assert_true(tally_recon_parse_time("2024-05-01T14:34:56.789+02:00", &us));
    assert_int_equal(us, 1714566896789000LL);
    assert_true(tally_recon_parse_time("2024-05-01t12:34:56.7891234z", &us));
    assert_int_equal(us, 1714566896789123LL);
    assert_true(tally_recon_parse_time("2000-02-29T00:00:00-00:30", &us));
    assert_int_equal(us, (951782400LL + 1800) * 1000000LL);

    static const char *const bad[] = {
        "",
        "2024-05-01",
        "2024-05-01T12:34:56",
        "2024-13-01T00:00:00Z",
        "2024-05-01T24:00:00Z",
        "2024-05-01T12:34:56.Z",
        "2024-05-01T12:34:56Zjunk",
        "24-05-01T12:34:56Z",
        "2024-05-01T12:34:56+0200",
        "2024-02-30T00:00:00Z",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_false(tally_recon_parse_time(bad[i], &us));
    }
    assert_false(tally_recon_parse_time(NULL, &us));
}

static void test_earliest_record(void **state)
{
    (void)state;
    json_t *recs = json_loads("[{\"id\":\"b\",\"created_at\":\"2024-05-01T12:00:00.500Z\"},"
                              "{\"id\":\"a\",\"created_at\":\"2024-05-01T14:00:00.100+02:00\"},"
                              "{\"id\":\"c\",\"created_at\":\"2024-05-01T12:00:00.100Z\"}]",
                              0, NULL);
    assert_non_null(recs);
    /* a and c are the same instant: the earlier position wins the tie */
    assert_int_equal(tally_recon_earliest(recs), 1);
    json_decref(recs);

    /* one record without a parseable created_at: the tool's order decides */
    recs = json_loads("[{\"id\":\"x\",\"created_at\":\"2024-05-01T12:00:00Z\"},"
                      "{\"id\":\"y\",\"created_at\":\"yesterday\"},"
                      "{\"id\":\"z\",\"created_at\":\"2000-01-01T00:00:00Z\"}]",
                      0, NULL);
    assert_int_equal(tally_recon_earliest(recs), 0);
    json_decref(recs);

    recs = json_loads("[{\"id\":\"x\"},{\"id\":\"y\"}]", 0, NULL);
    assert_int_equal(tally_recon_earliest(recs), 0);
    json_decref(recs);
    recs = json_array();
    assert_int_equal(tally_recon_earliest(recs), 0);
    json_decref(recs);
}

static void test_records_usable(void **state)
{
    (void)state;
    char why[200];
    json_t *ok = json_loads("[{\"id\":1},{\"id\":2}]", 0, NULL);
    assert_true(tally_recon_records_usable(ok, why, sizeof why));
    json_decref(ok);
    json_t *bad = json_loads("[{\"id\":1},\"charges_2\"]", 0, NULL);
    assert_false(tally_recon_records_usable(bad, why, sizeof why));
    assert_non_null(strstr(why, "record 1"));
    json_decref(bad);
    json_t *obj = json_object();
    assert_false(tally_recon_records_usable(obj, why, sizeof why));
    json_decref(obj);
    /* U+0000 never reaches the ledger: jansson refuses it without JSON_ALLOW_NUL */
    assert_null(json_loads("[{\"id\":\"a\\u0000b\"}]", 0, NULL));
}

static void test_alert_helpers(void **state)
{
    (void)state;
    const char *id = "0b0e3a52-4f1c-4b7e-9a55-0d6c1c1f2a10";
    char *key = tally_alert_effect_key(id);
    assert_string_equal(key, "effect:0b0e3a52-4f1c-4b7e-9a55-0d6c1c1f2a10");
    free(key);
    key = tally_alert_obligation_key(id);
    assert_string_equal(key, "obligation:0b0e3a52-4f1c-4b7e-9a55-0d6c1c1f2a10");
    free(key);

    char *cmd = tally_alert_effect_command(id);
    assert_non_null(strstr(cmd, "tally resolve --effect 0b0e3a52-4f1c-4b7e-9a55-0d6c1c1f2a10 "
                                "--as confirmed --ref <REF> --reason \""));
    assert_non_null(strstr(cmd, "\ntally resolve --effect 0b0e3a52-4f1c-4b7e-9a55-0d6c1c1f2a10 "
                                "--as failed --reason \""));
    free(cmd);
    cmd = tally_alert_obligation_command(id);
    assert_non_null(strstr(cmd, "tally resolve --obligation " /* */
                                "0b0e3a52-4f1c-4b7e-9a55-0d6c1c1f2a10 --as resolved"));
    assert_non_null(strstr(cmd, "--as skipped"));
    free(cmd);
}

static void test_alert_batch_refuses_incomplete_alerts(void **state)
{
    (void)state;
    tally_alert_batch_t *b = tally_alert_batch_new();
    assert_non_null(b);
    tally_alert_t a = {.dedup_key = "effect:x",
                       .summary = "s",
                       .reason = "r",
                       .resolve_command = "tally resolve",
                       .effect_id = NULL};
    tally_alert_batch_add(b, &a); /* names neither an effect nor an obligation */
    assert_int_equal(tally_alert_batch_len(b), 0);
    tally_error_t err;
    tally_error_clear(&err);
    assert_false(tally_alert_batch_flush(b, NULL, "test", "/test", NULL, NULL, NULL, &err));
    assert_int_equal(err.errc, TALLY_ERR_ALERT);
    assert_non_null(strstr(err.message, "dedup key"));
    /* the failure is reported once; the batch is usable again */
    a.effect_id = "0b0e3a52-4f1c-4b7e-9a55-0d6c1c1f2a10";
    tally_alert_batch_add(b, &a);
    assert_int_equal(tally_alert_batch_len(b), 1);
    tally_alert_batch_free(b);
    tally_alert_batch_free(NULL);
}

/* ---- audits and sweeps (DESIGN §12) ----------------------------------------------------- */

static tally_audit_input_t audit_in(tally_verdict_t v)
{
    tally_audit_input_t in = {.verdict = v,
                              .kept_matches = true,
                              .passes = 0,
                              .again_ms = 0,
                              .failures = 0,
                              .max_attempts = 3,
                              .backoff_ms = 200,
                              .max_backoff_ms = 2000,
                              .random = 7};
    return in;
}

static void test_audit_decisions(void **state)
{
    (void)state;
    tally_audit_input_t in = audit_in(TALLY_VERDICT_FOUND);
    tally_audit_decision_t d = tally_audit_decide(&in);
    assert_int_equal(d.result, TALLY_AUDIT_CLEAN);
    assert_true(d.counted);
    assert_int_equal(d.next_in_ms, -1);
    in.kept_matches = false;
    assert_int_equal(tally_audit_decide(&in).result, TALLY_AUDIT_MISMATCH);
    in = audit_in(TALLY_VERDICT_DUPLICATE);
    assert_int_equal(tally_audit_decide(&in).result, TALLY_AUDIT_DUPLICATE);
    in = audit_in(TALLY_VERDICT_NOT_FOUND);
    assert_int_equal(tally_audit_decide(&in).result, TALLY_AUDIT_MISSING);
    /* a second pass follows the first only */
    in = audit_in(TALLY_VERDICT_FOUND);
    in.again_ms = 3600000;
    assert_int_equal(tally_audit_decide(&in).next_in_ms, 3600000);
    in.passes = 1;
    assert_int_equal(tally_audit_decide(&in).next_in_ms, -1);
    /* inconclusive: retried within the tool's backoff, given up at max_attempts in a row */
    in = audit_in(TALLY_VERDICT_INCONCLUSIVE);
    d = tally_audit_decide(&in);
    assert_int_equal(d.result, TALLY_AUDIT_RETRY);
    assert_false(d.counted);
    assert_in_range(d.next_in_ms, 100, 200);
    in.failures = 2;
    d = tally_audit_decide(&in);
    assert_int_equal(d.result, TALLY_AUDIT_GIVE_UP);
    assert_int_equal(d.next_in_ms, -1);
    assert_string_equal(tally_audit_result_name(TALLY_AUDIT_GIVE_UP), "gave_up");
}

static void test_sweep_classification(void **state)
{
    (void)state;
    tally_sweep_record_t r = {.ours = true,
                              .known = true,
                              .status = TALLY_EFFECT_CONFIRMED,
                              .ledger_ref = "ch_1",
                              .ref = "ch_1",
                              .can_compensate = true};
    assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_OURS);
    r.ref = "ch_2";
    assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_DUPLICATE);
    r.has_obligation = true;
    assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_OURS);
    r.has_obligation = false;
    r.can_compensate = false;
    assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_FINDING);
    r.ledger_ref = NULL; /* a receipt without a ref cannot be told from an extra */
    r.can_compensate = true;
    assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_DUPLICATE);
    tally_effect_state_t settled[] = {TALLY_EFFECT_FAILED, TALLY_EFFECT_CANCELLED,
                                      TALLY_EFFECT_REJECTED};
    for (size_t i = 0; i < sizeof settled / sizeof settled[0]; i++) {
        r.status = settled[i];
        r.can_compensate = true;
        assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_ORPHAN);
        r.can_compensate = false;
        assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_FINDING);
    }
    tally_effect_state_t open[] = {TALLY_EFFECT_PLANNED, TALLY_EFFECT_AWAITING_APPROVAL,
                                   TALLY_EFFECT_DISPATCHING, TALLY_EFFECT_UNKNOWN,
                                   TALLY_EFFECT_STUCK};
    for (size_t i = 0; i < sizeof open / sizeof open[0]; i++) {
        r.status = open[i];
        assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_UNSETTLED);
    }
    r.known = false;
    assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_FINDING);
    r.ours = false;
    assert_int_equal(tally_sweep_classify(&r), TALLY_SWEEP_FOREIGN);
}

static void test_sweep_uuid_and_page(void **state)
{
    (void)state;
    assert_true(tally_sweep_uuid_valid("01a218f1-6236-7e8d-8bd9-7f1744a708be"));
    assert_true(tally_sweep_uuid_valid("01A218F1-6236-7E8D-8BD9-7F1744A708BE"));
    assert_false(tally_sweep_uuid_valid(NULL));
    assert_false(tally_sweep_uuid_valid(""));
    assert_false(tally_sweep_uuid_valid("01a218f1-6236-7e8d-8bd9-7f1744a708be0"));
    assert_false(tally_sweep_uuid_valid("01a218f1x6236-7e8d-8bd9-7f1744a708be"));
    assert_false(tally_sweep_uuid_valid("01a218f1-6236-7e8d-8bd9-7f1744a708bg"));
    assert_false(tally_sweep_uuid_valid("'; DROP TABLE effects; --00000000000"));

    json_t *recs = NULL;
    char *next = NULL;
    char why[200];
    const char ok[] = "{\"records\":[{\"id\":\"a\"},{\"id\":\"b\"}],\"next_cursor\":\"c2\"}";
    assert_true(tally_sweep_page(ok, strlen(ok), &recs, &next, why, sizeof why));
    assert_int_equal(json_array_size(recs), 2);
    assert_string_equal(next, "c2");
    json_decref(recs);
    free(next);
    const char last[] = "{\"records\":[],\"next_cursor\":null}";
    assert_true(tally_sweep_page(last, strlen(last), &recs, &next, why, sizeof why));
    assert_null(next);
    json_decref(recs);
    const char *bad[] = {
        "",
        "[]",
        "{\"records\":{}}",
        "{\"records\":[1]}",
        "{\"records\":[],\"next_cursor\":5}",
        "{\"records\":[],\"next_cursor\":\"\"}",
        "{\"records\":[{\"id\":\"\\u0000\"}]}",
        "{\"records\":[{\"id\":\"a\"}]",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        why[0] = '\0';
        assert_false(tally_sweep_page(bad[i], strlen(bad[i]), &recs, &next, why, sizeof why));
        assert_null(recs);
        assert_null(next);
        assert_true(why[0] != '\0');
    }
    /* a cursor at and over its limit */
    char *big = malloc(TALLY_SWEEP_CURSOR_MAX + 64);
    assert_non_null(big);
    int n = snprintf(big, 64, "{\"records\":[],\"next_cursor\":\"");
    memset(big + n, 'x', TALLY_SWEEP_CURSOR_MAX);
    snprintf(big + n + TALLY_SWEEP_CURSOR_MAX, 8, "\"}");
    assert_true(tally_sweep_page(big, strlen(big), &recs, &next, why, sizeof why));
    assert_int_equal(strlen(next), TALLY_SWEEP_CURSOR_MAX);
    json_decref(recs);
    free(next);
    memset(big + n, 'x', TALLY_SWEEP_CURSOR_MAX + 1);
    snprintf(big + n + TALLY_SWEEP_CURSOR_MAX + 1, 8, "\"}");
    assert_false(tally_sweep_page(big, strlen(big), &recs, &next, why, sizeof why));
    free(big);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_found_confirms_and_several_is_a_duplicate),
        cmocka_unit_test(test_not_found_waits_for_the_settle_window),
        cmocka_unit_test(test_inconclusive_backs_off_then_pages),
        cmocka_unit_test(test_no_status_endpoint),
        cmocka_unit_test(test_decisions_are_allowed_transitions),
        cmocka_unit_test(test_inconclusive_backs_off_by_the_tools_steps_with_bounded_jitter),
        cmocka_unit_test(test_parse_time),
        cmocka_unit_test(test_earliest_record),
        cmocka_unit_test(test_records_usable),
        cmocka_unit_test(test_alert_helpers),
        cmocka_unit_test(test_alert_batch_refuses_incomplete_alerts),
        cmocka_unit_test(test_audit_decisions),
        cmocka_unit_test(test_sweep_classification),
        cmocka_unit_test(test_sweep_uuid_and_page),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
