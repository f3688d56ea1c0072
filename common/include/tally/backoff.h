/* backoff.h — how long to wait before trying the same thing again: the one home of the
 * doubling-with-a-cap rule, for a tool's retries and a loop's own. */
#ifndef TALLY_BACKOFF_H
#define TALLY_BACKOFF_H

#include <stdint.h>

/**
 * @brief The step alone: min(@p max_ms, @p base_ms * 2^(attempt-1)), no jitter. For a loop
 * backing off from its own trouble (its database, its engine, its batch), where there is no
 * crowd of peers to spread out.
 * @param attempt 1 for the first retry; values below 1 count as 1 (and no overflow however
 * large).
 * @param base_ms first step (≤ 0: 1 ms); @p max_ms the cap (< base: base).
 * @returns the delay in milliseconds, at least 1.
 */
long long tally_backoff_step_ms(int attempt, int base_ms, int max_ms);

/**
 * @brief Exponential backoff with equal jitter: d = tally_backoff_step_ms(attempt, base_ms,
 * max_ms), then a uniform delay in [d/2, d] drawn from @p random, and never shorter than the
 * tool's @p retry_after_ms (-1 when it gave none). Equal rather than full jitter: a retry
 * always waits at least half the step, so a struggling tool (or database) gets room, while
 * copies of tally that failed together still spread out.
 * @returns the delay in milliseconds, at least 1.
 */
long long tally_backoff_ms(int attempt, int base_ms, int max_ms, long retry_after_ms,
                           uint32_t random);

#endif
