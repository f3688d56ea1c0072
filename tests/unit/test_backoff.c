/* test_backoff.c — the retry delay every worker uses: doubling steps up to the cap, equal
 * jitter inside [step/2, step], the tool's Retry-After as a floor; and the step alone, for a
 * loop's own retries (the PostgreSQL reconnect, the relay, a worker's record). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdint.h>

#include "tally/backoff.h"

static void test_steps_double_up_to_the_cap(void **st)
{
    (void)st;
    /* random 0 gives the lower bound d - d/2, UINT32_MAX-ish values reach d itself */
    assert_int_equal(tally_backoff_ms(1, 200, 60000, -1, 0), 100);
    assert_int_equal(tally_backoff_ms(2, 200, 60000, -1, 0), 200);
    assert_int_equal(tally_backoff_ms(3, 200, 60000, -1, 0), 400);
    assert_int_equal(tally_backoff_ms(3, 200, 60000, -1, 400), 800); /* 400 + 400 % 401 */
    assert_int_equal(tally_backoff_ms(40, 200, 60000, -1, 0), 30000);
    assert_int_equal(tally_backoff_ms(40, 200, 60000, -1, 30000), 60000);
    assert_int_equal(tally_backoff_ms(1000000, 200, 60000, -1, 0), 30000); /* no overflow */
}

static void test_jitter_stays_inside_half_to_full_step(void **st)
{
    (void)st;
    for (uint32_t r = 0; r < 5000; r += 7) {
        long long d = tally_backoff_ms(4, 100, 10000, -1, r * 2654435761u);
        assert_true(d >= 400 && d <= 800);
    }
}

static void test_retry_after_is_a_floor_and_odd_inputs_are_safe(void **st)
{
    (void)st;
    assert_int_equal(tally_backoff_ms(1, 200, 60000, 5000, 0), 5000);
    assert_int_equal(tally_backoff_ms(1, 200, 60000, 10, 0), 100); /* shorter: ignored */
    assert_int_equal(tally_backoff_ms(0, 200, 60000, -1, 0), 100); /* attempt < 1 counts as 1 */
    assert_int_equal(tally_backoff_ms(1, 0, 0, -1, 0), 1);         /* never 0 */
    assert_int_equal(tally_backoff_ms(5, 500, 100, -1, 0), 250);   /* cap below base: base */
}

static void test_the_step_alone_doubles_to_the_cap_without_jitter(void **st)
{
    (void)st;
    assert_int_equal(tally_backoff_step_ms(1, 100, 5000), 100);
    assert_int_equal(tally_backoff_step_ms(2, 100, 5000), 200);
    assert_int_equal(tally_backoff_step_ms(6, 100, 5000), 3200);
    assert_int_equal(tally_backoff_step_ms(7, 100, 5000), 5000); /* 6400 capped */
    assert_int_equal(tally_backoff_step_ms(INT32_MAX, 100, 5000), 5000);
    assert_int_equal(tally_backoff_step_ms(-3, 100, 5000), 100);
    assert_int_equal(tally_backoff_step_ms(3, 100, 50), 100); /* cap below base: base */
    assert_int_equal(tally_backoff_step_ms(3, 0, 0), 1);
    /* the reconciler's record backoff: 200 ms doubling per try, 3.2 s after the fifth */
    for (int tries = 1; tries <= 5; tries++)
        assert_int_equal(tally_backoff_step_ms(tries, 200, 200 << 4), 200LL << (tries - 1));
    /* the jittered delay is drawn inside the same step */
    for (int a = 1; a < 12; a++) {
        long long d = tally_backoff_step_ms(a, 100, 5000);
        assert_int_equal(tally_backoff_ms(a, 100, 5000, -1, 0), d - d / 2);
        assert_int_equal(tally_backoff_ms(a, 100, 5000, -1, (uint32_t)(d / 2)), d);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_steps_double_up_to_the_cap),
        cmocka_unit_test(test_jitter_stays_inside_half_to_full_step),
        cmocka_unit_test(test_retry_after_is_a_floor_and_odd_inputs_are_safe),
        cmocka_unit_test(test_the_step_alone_doubles_to_the_cap_without_jitter),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
