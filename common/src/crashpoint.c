/* crashpoint.c — the armed crash point of a test build (see crashpoint.h). */
#include "tally/crashpoint.h"

#ifdef TALLY_CRASH_POINTS

#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/log.h"

/* Written once by tally_crashpoint_init before any thread starts, read-only afterwards. */
static char armed[64]; /* the armed point's name; empty: none */
static long crash_after = 1;
static atomic_long hits;

void tally_crashpoint_init(void)
{
    const char *at = getenv("TALLY_CRASH_AT");
    const char *after = getenv("TALLY_CRASH_AFTER");
    armed[0] = '\0';
    crash_after = 1;
    atomic_store(&hits, 0);
    if (at == NULL || at[0] == '\0') {
        return;
    }
    snprintf(armed, sizeof armed, "%s", at);
    if (after != NULL && after[0] != '\0') {
        char *end = NULL;
        long n = strtol(after, &end, 10);
        if (*end != '\0' || n < 1) {
            TALLY_WARN("TALLY_CRASH_AFTER=%s is not a positive integer; using 1", after);
            n = 1;
        }
        crash_after = n;
    }
    TALLY_WARN("crash point %s armed: SIGKILL on hit %ld", armed, crash_after);
}

void tally_crashpoint_hit(const char *name, const char *func, int line)
{
    if (armed[0] == '\0' || strcmp(name, armed) != 0) {
        return;
    }
    long n = atomic_fetch_add(&hits, 1) + 1;
    if (n != crash_after) {
        return;
    }
    tally_log_write(TALLY_LOG_ERROR, func, line, NULL,
                    "crash point %s reached (hit %ld): raising SIGKILL", name, n);
    raise(SIGKILL);
}

#endif
