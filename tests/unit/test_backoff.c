/* test_backoff.c — the retry delay every worker uses: doubling steps up to the cap, equal
 * jitter inside [step/2, step], the tool's Retry-After as a floor. */
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_steps_double_up_to_the_cap),
        cmocka_unit_test(test_jitter_stays_inside_half_to_full_step),
        cmocka_unit_test(test_retry_after_is_a_floor_and_odd_inputs_are_safe),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
