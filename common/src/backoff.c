/* backoff.c — exponential backoff, with or without equal jitter (backoff.h). */
#include "tally/backoff.h"

long long tally_backoff_step_ms(int attempt, int base_ms, int max_ms)
{
    long long base = base_ms > 0 ? base_ms : 1;
    long long cap = max_ms > base ? max_ms : base;
    long long d = base;
    for (int i = 1; i < attempt && d < cap; i++)
        d *= 2;
    return d > cap ? cap : d;
}

long long tally_backoff_ms(int attempt, int base_ms, int max_ms, long retry_after_ms,
                           uint32_t random)
{
    long long d = tally_backoff_step_ms(attempt, base_ms, max_ms);
    long long half = d / 2;
    long long delay = (d - half) + (long long)(random % (uint64_t)(half + 1));
    if (retry_after_ms > delay)
        delay = retry_after_ms;
    return delay > 0 ? delay : 1;
}
