/* test_dispatch_policy.c — the dispatcher's decisions (dispatcher/policy.c) against DESIGN §3:
 * every verdict × effect class × attempt cap, the backoff of a retry, which decisions the
 * one-statement record path takes, and how the record statement's one override (the run
 * stopped while the call was in flight) maps back. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "policy.h"
#include "tally/backoff.h"
#include "tally/ledger.h"
#include "tally/text.h"

#define MAX_ATTEMPTS 5
#define BACKOFF_MS   200
#define MAX_BACKOFF  60000
#define RANDOM       12345u

static const tally_verdict_t all_verdicts[] = {
    TALLY_VERDICT_CONFIRMED, TALLY_VERDICT_FAILED,       TALLY_VERDICT_RETRY,
    TALLY_VERDICT_UNKNOWN,   TALLY_VERDICT_NOT_FOUND,    TALLY_VERDICT_FOUND,
    TALLY_VERDICT_DUPLICATE, TALLY_VERDICT_INCONCLUSIVE, TALLY_VERDICT_RESOLVED,
    TALLY_VERDICT_STUCK,
};
#define N_VERDICTS (sizeof all_verdicts / sizeof all_verdicts[0])

static const tally_effect_class_t all_classes[] = {
    TALLY_CLASS_READ,        TALLY_CLASS_IDEMPOTENT,  TALLY_CLASS_REVERSIBLE,
    TALLY_CLASS_APPEND_ONLY, TALLY_CLASS_DESTRUCTIVE,
};
#define N_CLASSES (sizeof all_classes / sizeof all_classes[0])

static const char *class_name(tally_effect_class_t c)
{
    static const char *const names[] = {"read", "idempotent", "reversible", "append_only",
                                        "destructive"};
    return (size_t)c < sizeof names / sizeof names[0] ? names[c] : "?";
}

static tally_conn_verdict_t verdict(tally_verdict_t v)
{
    tally_conn_verdict_t out = {.verdict = v, .retry_after_ms = -1};
    snprintf(out.code, sizeof out.code, "http_503");
    snprintf(out.message, sizeof out.message, "HTTP 503: the tool is busy");
    return out;
}

static tally_dispatch_decision_t decide(const tally_conn_verdict_t *v, tally_effect_class_t cls,
                                        int attempts)
{
    tally_dispatch_input_t in = {.v = v,
                                 .effect_class = cls,
                                 .attempts = attempts,
                                 .max_attempts = MAX_ATTEMPTS,
                                 .backoff_ms = BACKOFF_MS,
                                 .max_backoff_ms = MAX_BACKOFF,
                                 .random = RANDOM};
    tally_dispatch_decision_t dec;
    memset(&dec, 0x5a, sizeof dec); /* nothing of a previous decision may survive */
    tally_dispatch_decide(&in, &dec);
    return dec;
}

/* What the error of a decision says. */
typedef enum {
    ERR_NONE,       /* no error */
    ERR_VERDICT,    /* the verdict's code and message */
    ERR_EXHAUSTED,  /* attempts_exhausted: "gave up after N attempts; last: ..." */
    ERR_CAP,        /* the verdict's code: "attempt cap N reached; last: ..." */
    ERR_UNEXPECTED, /* unexpected_verdict: the verdict's name */
} err_kind_t;

/* DESIGN §3 for the four execute verdicts, written out as its table: below the cap (attempts 1
 * and 2 of 5) and at it (attempt 5 of 5, and 6: a cap lowered meanwhile). */
#define V(S)        TALLY_VERDICT_##S
#define READ        TALLY_CLASS_READ
#define IDEMPOTENT  TALLY_CLASS_IDEMPOTENT
#define REVERSIBLE  TALLY_CLASS_REVERSIBLE
#define APPEND_ONLY TALLY_CLASS_APPEND_ONLY
#define DESTRUCTIVE TALLY_CLASS_DESTRUCTIVE
#define TO(S)       TALLY_EFFECT_##S
// clang-format off
static const struct row {
    tally_verdict_t verdict;
    tally_effect_class_t cls;
    bool at_cap;
    tally_effect_state_t want;
    err_kind_t err;
    bool maybe_applied;
} table[] = {
    /* 2xx: it happened, whatever the class and however many tries it took */
    {V(CONFIRMED), READ,        false, TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), READ,        true,  TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), IDEMPOTENT,  false, TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), IDEMPOTENT,  true,  TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), REVERSIBLE,  false, TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), REVERSIBLE,  true,  TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), APPEND_ONLY, false, TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), APPEND_ONLY, true,  TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), DESTRUCTIVE, false, TO(CONFIRMED), ERR_NONE,      false},
    {V(CONFIRMED), DESTRUCTIVE, true,  TO(CONFIRMED), ERR_NONE,      false},
    /* a definite failure: FAILED with the tool's error, never retried */
    {V(FAILED),    READ,        false, TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    READ,        true,  TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    IDEMPOTENT,  false, TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    IDEMPOTENT,  true,  TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    REVERSIBLE,  false, TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    REVERSIBLE,  true,  TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    APPEND_ONLY, false, TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    APPEND_ONLY, true,  TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    DESTRUCTIVE, false, TO(FAILED),    ERR_VERDICT,   false},
    {V(FAILED),    DESTRUCTIVE, true,  TO(FAILED),    ERR_VERDICT,   false},
    /* not applied: PLANNED again with the same key while attempts remain, then FAILED */
    {V(RETRY),     READ,        false, TO(PLANNED),   ERR_VERDICT,   false},
    {V(RETRY),     READ,        true,  TO(FAILED),    ERR_EXHAUSTED, false},
    {V(RETRY),     IDEMPOTENT,  false, TO(PLANNED),   ERR_VERDICT,   false},
    {V(RETRY),     IDEMPOTENT,  true,  TO(FAILED),    ERR_EXHAUSTED, false},
    {V(RETRY),     REVERSIBLE,  false, TO(PLANNED),   ERR_VERDICT,   false},
    {V(RETRY),     REVERSIBLE,  true,  TO(FAILED),    ERR_EXHAUSTED, false},
    {V(RETRY),     APPEND_ONLY, false, TO(PLANNED),   ERR_VERDICT,   false},
    {V(RETRY),     APPEND_ONLY, true,  TO(FAILED),    ERR_EXHAUSTED, false},
    {V(RETRY),     DESTRUCTIVE, false, TO(PLANNED),   ERR_VERDICT,   false},
    {V(RETRY),     DESTRUCTIVE, true,  TO(FAILED),    ERR_EXHAUSTED, false},
    /* maybe applied: rule 2 retries a read (nothing to apply) and an idempotent tool (the same
     * key is safe: but it may have applied, so the retry is maybe_applied, and at the cap only
     * the reconciler can tell); every other class is UNKNOWN at once */
    {V(UNKNOWN),   READ,        false, TO(PLANNED),   ERR_VERDICT,   false},
    {V(UNKNOWN),   READ,        true,  TO(FAILED),    ERR_EXHAUSTED, false},
    {V(UNKNOWN),   IDEMPOTENT,  false, TO(PLANNED),   ERR_VERDICT,   true},
    {V(UNKNOWN),   IDEMPOTENT,  true,  TO(UNKNOWN),   ERR_CAP,       false},
    {V(UNKNOWN),   REVERSIBLE,  false, TO(UNKNOWN),   ERR_VERDICT,   false},
    {V(UNKNOWN),   REVERSIBLE,  true,  TO(UNKNOWN),   ERR_VERDICT,   false},
    {V(UNKNOWN),   APPEND_ONLY, false, TO(UNKNOWN),   ERR_VERDICT,   false},
    {V(UNKNOWN),   APPEND_ONLY, true,  TO(UNKNOWN),   ERR_VERDICT,   false},
    {V(UNKNOWN),   DESTRUCTIVE, false, TO(UNKNOWN),   ERR_VERDICT,   false},
    {V(UNKNOWN),   DESTRUCTIVE, true,  TO(UNKNOWN),   ERR_VERDICT,   false},
};
// clang-format on

static void check(const tally_dispatch_decision_t *dec, const tally_conn_verdict_t *v,
                  tally_effect_state_t want, err_kind_t err, bool maybe, int attempts,
                  const char *what)
{
    char msg[600];
    const char *code = "";
    msg[0] = '\0';
    switch (err) {
    case ERR_NONE:
        break;
    case ERR_VERDICT:
        code = v->code;
        snprintf(msg, sizeof msg, "%s", v->message);
        break;
    case ERR_EXHAUSTED:
        code = "attempts_exhausted";
        snprintf(msg, sizeof msg, "gave up after %d attempts; last: %s", attempts, v->message);
        break;
    case ERR_CAP:
        code = v->code;
        snprintf(msg, sizeof msg, "attempt cap %d reached; last: %s", MAX_ATTEMPTS, v->message);
        break;
    case ERR_UNEXPECTED:
        code = "unexpected_verdict";
        snprintf(msg, sizeof msg, "%s", tally_verdict_name(v->verdict));
        break;
    }
    long long delay =
        want == TALLY_EFFECT_PLANNED
            ? tally_backoff_ms(attempts, BACKOFF_MS, MAX_BACKOFF, v->retry_after_ms, RANDOM)
            : 0;
    if (dec->state != want || strcmp(dec->error_code, code) != 0 ||
        (err != ERR_NONE && strcmp(dec->error_message, msg) != 0) || dec->maybe_applied != maybe ||
        dec->delay_ms != delay || dec->page_owner) {
        fail_msg("%s: got %s (%s: %s) maybe=%d delay=%lld page=%d; want %s (%s: %s) maybe=%d "
                 "delay=%lld",
                 what, tally_effect_state_name(dec->state), dec->error_code, dec->error_message,
                 dec->maybe_applied, dec->delay_ms, dec->page_owner, tally_effect_state_name(want),
                 code, msg, maybe, delay);
    }
    /* every decision is a move the dispatcher may make from DISPATCHING (the ledger's table) */
    assert_true(tally_effect_transition_allowed(TALLY_EFFECT_DISPATCHING, dec->state));
}

static void test_execute_verdicts_by_class_and_attempt_cap(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        const struct row *r = &table[i];
        /* at the cap: the cap-th attempt, and one past it (a cap lowered meanwhile) */
        int tries[2] = {r->at_cap ? MAX_ATTEMPTS : 1, r->at_cap ? MAX_ATTEMPTS + 1 : 2};
        for (int k = 0; k < 2; k++) {
            tally_conn_verdict_t v = verdict(r->verdict);
            tally_dispatch_decision_t dec = decide(&v, r->cls, tries[k]);
            char what[160];
            snprintf(what, sizeof what, "%s, %s, attempt %d of %d", tally_verdict_name(r->verdict),
                     class_name(r->cls), tries[k], MAX_ATTEMPTS);
            check(&dec, &v, r->want, r->err, r->maybe_applied, tries[k], what);
        }
    }
}

static void test_the_table_covers_every_execute_verdict_and_class(void **state)
{
    (void)state;
    static const tally_verdict_t execute[] = {TALLY_VERDICT_CONFIRMED, TALLY_VERDICT_FAILED,
                                              TALLY_VERDICT_RETRY, TALLY_VERDICT_UNKNOWN};
    for (size_t e = 0; e < 4; e++)
        for (size_t c = 0; c < N_CLASSES; c++)
            for (int cap = 0; cap < 2; cap++) {
                int found = 0;
                for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
                    found += table[i].verdict == execute[e] && table[i].cls == all_classes[c] &&
                             table[i].at_cap == (cap == 1);
                assert_int_equal(found, 1);
            }
}

static void test_other_verdicts_are_unexpected_and_unknown(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_VERDICTS; i++) {
        tally_verdict_t vv = all_verdicts[i];
        if (vv == TALLY_VERDICT_CONFIRMED || vv == TALLY_VERDICT_FAILED ||
            vv == TALLY_VERDICT_RETRY || vv == TALLY_VERDICT_UNKNOWN)
            continue;
        for (size_t c = 0; c < N_CLASSES; c++)
            for (int attempts = 1; attempts <= MAX_ATTEMPTS + 1; attempts += MAX_ATTEMPTS) {
                tally_conn_verdict_t v = verdict(vv);
                tally_dispatch_decision_t dec = decide(&v, all_classes[c], attempts);
                check(&dec, &v, TALLY_EFFECT_UNKNOWN, ERR_UNEXPECTED, false, attempts,
                      tally_verdict_name(vv));
            }
    }
}

static void test_refused_credentials_page_the_owner(void **state)
{
    (void)state;
    for (size_t c = 0; c < N_CLASSES; c++) {
        tally_conn_verdict_t v = verdict(TALLY_VERDICT_FAILED);
        v.alert_owner = true;
        snprintf(v.code, sizeof v.code, "http_401");
        tally_dispatch_decision_t dec = decide(&v, all_classes[c], 1);
        assert_int_equal(dec.state, TALLY_EFFECT_FAILED);
        assert_true(dec.page_owner);
        assert_string_equal(dec.error_code, "http_401");
        /* a page needs the general record path */
        assert_false(tally_dispatch_final(&dec));
    }
}

static void test_retry_backs_off_honouring_retry_after(void **state)
{
    (void)state;
    tally_conn_verdict_t v = verdict(TALLY_VERDICT_RETRY);
    for (int attempts = 1; attempts < MAX_ATTEMPTS; attempts++) {
        tally_dispatch_decision_t dec = decide(&v, TALLY_CLASS_REVERSIBLE, attempts);
        long long step = (long long)BACKOFF_MS << (attempts - 1);
        assert_int_equal(dec.state, TALLY_EFFECT_PLANNED);
        assert_in_range(dec.delay_ms, step / 2, step);
    }
    v.retry_after_ms = 30000; /* the tool's Retry-After is a floor */
    tally_dispatch_decision_t dec = decide(&v, TALLY_CLASS_REVERSIBLE, 1);
    assert_true(dec.delay_ms >= 30000);
}

static void test_long_tool_text_is_cut_on_a_character(void **state)
{
    (void)state;
    /* "é" (two bytes) past both buffers: neither cut may split one */
    char text[2001];
    for (size_t n = 0; n + 1 < sizeof text; n += 2) {
        text[n] = (char)0xc3;
        text[n + 1] = (char)0xa9;
    }
    text[sizeof text - 1] = '\0';
    tally_dispatch_decision_t dec = {0};
    tally_dispatch_set_error(&dec, text, "the tool said: %s", text);
    /* each is cut to its buffer on a character boundary, and says so with "..." */
    const char *cut[2] = {dec.error_code, dec.error_message};
    size_t room[2] = {sizeof dec.error_code, sizeof dec.error_message};
    for (int i = 0; i < 2; i++) {
        size_t len = strlen(cut[i]);
        assert_true(len > 4 && len < room[i]);
        assert_string_equal(cut[i] + len - 3, "...");
        assert_int_equal((unsigned char)cut[i][len - 4], 0xa9);
        assert_int_equal(tally_utf8_prefix(cut[i], len, len), len);
    }
    assert_memory_equal(dec.error_message, "the tool said: ", 15);
}

static void test_final_decisions_skip_the_run_check(void **state)
{
    (void)state;
    tally_dispatch_decision_t dec = {.state = TALLY_EFFECT_CONFIRMED};
    assert_true(tally_dispatch_final(&dec));
    dec.state = TALLY_EFFECT_UNKNOWN;
    assert_true(tally_dispatch_final(&dec));
    dec.state = TALLY_EFFECT_FAILED;
    assert_true(tally_dispatch_final(&dec));
    dec.page_owner = true;
    assert_false(tally_dispatch_final(&dec));
    dec = (tally_dispatch_decision_t){.state = TALLY_EFFECT_PLANNED};
    assert_false(tally_dispatch_final(&dec)); /* its run may have stopped meanwhile */
}

static void test_only_a_retry_is_overridden_to_cancelled_or_unknown(void **state)
{
    (void)state;
    static const tally_effect_state_t decided[] = {TALLY_EFFECT_CONFIRMED, TALLY_EFFECT_FAILED,
                                                   TALLY_EFFECT_PLANNED, TALLY_EFFECT_UNKNOWN};
    for (size_t i = 0; i < sizeof decided / sizeof decided[0]; i++)
        for (int b = 0; b < TALLY_EFFECT__COUNT; b++) {
            tally_effect_state_t became = (tally_effect_state_t)b;
            tally_dispatch_decision_t dec = {.state = decided[i],
                                             .maybe_applied = true,
                                             .delay_ms = 400,
                                             .error_code = "http_503",
                                             .error_message = "busy"};
            tally_dispatch_decision_t before = dec;
            bool ok = tally_dispatch_overridden(&dec, became, "run_not_active",
                                                "the run is CANCELLED; the last attempt was not "
                                                "applied: busy");
            bool as_decided = became == decided[i];
            bool override = decided[i] == TALLY_EFFECT_PLANNED &&
                            (became == TALLY_EFFECT_CANCELLED || became == TALLY_EFFECT_UNKNOWN);
            assert_int_equal(ok, as_decided || override);
            if (override) {
                assert_int_equal(dec.state, became);
                assert_string_equal(dec.error_code, "run_not_active");
                assert_non_null(strstr(dec.error_message, "the run is CANCELLED"));
                assert_false(dec.maybe_applied); /* not tried again */
                assert_int_equal(dec.delay_ms, 0);
                assert_true(tally_dispatch_final(&dec));
                assert_true(tally_effect_transition_allowed(TALLY_EFFECT_DISPATCHING, became));
            } else {
                assert_memory_equal(&dec, &before, sizeof dec);
            }
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_execute_verdicts_by_class_and_attempt_cap),
        cmocka_unit_test(test_the_table_covers_every_execute_verdict_and_class),
        cmocka_unit_test(test_other_verdicts_are_unexpected_and_unknown),
        cmocka_unit_test(test_refused_credentials_page_the_owner),
        cmocka_unit_test(test_retry_backs_off_honouring_retry_after),
        cmocka_unit_test(test_long_tool_text_is_cut_on_a_character),
        cmocka_unit_test(test_final_decisions_skip_the_run_check),
        cmocka_unit_test(test_only_a_retry_is_overridden_to_cancelled_or_unknown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
