/* test_rng.h — xorshift64*, the tests' reproducible random inputs: the same sequence on every
 * run, so a failure can be replayed. */
#ifndef TEST_RNG_H
#define TEST_RNG_H

#include <stdint.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint64_t rng(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

#endif
