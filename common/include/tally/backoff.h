/* backoff.h — how long to wait before trying the same thing again. */
#ifndef TALLY_BACKOFF_H
#define TALLY_BACKOFF_H

#include <stdint.h>

/**
 * @brief Exponential backoff with equal jitter: d = min(@p max_ms, @p base_ms * 2^(attempt-1)),
 * then a uniform delay in [d/2, d] drawn from @p random, and never shorter than the tool's
 * @p retry_after_ms (-1 when it gave none). Equal rather than full jitter: a retry always
 * waits at least half the step, so a struggling tool gets room, while copies of tally that
 * failed together still spread out.
 * @param attempt 1 for the first retry; values below 1 count as 1.
 * @param base_ms first step (≤ 0: 1 ms); @p max_ms the cap (< base: base).
 * @returns the delay in milliseconds, at least 1.
 */
long long tally_backoff_ms(int attempt, int base_ms, int max_ms, long retry_after_ms,
                           uint32_t random);

#endif
