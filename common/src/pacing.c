/* pacing.c — the per-tool call budget shared by every worker (pacing.h). */
#include "tally/pacing.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <libpq-fe.h>

/* A token bucket kept as one timestamp: the bucket is full when next_at is a second or more in
 * the past, and each slot moves next_at on by 1/rate seconds. A take succeeds when next_at has
 * come; taking from a full bucket starts from one second ago, so a burst is at most one second's
 * worth. The upsert makes the first take for a tool create its row. */
static const char SQL_TAKE[] =
    "INSERT INTO tool_pacing AS p (tool, next_at)"
    " VALUES ($1, now() - interval '1 second' + $2::float8 * interval '1 millisecond')"
    " ON CONFLICT (tool) DO UPDATE SET next_at = greatest(p.next_at, now() - interval '1 second')"
    "   + $2::float8 * interval '1 millisecond'"
    " WHERE p.next_at <= now()"
    " RETURNING 1";

static const char SQL_WAIT[] =
    "SELECT greatest(0, ceil(extract(epoch FROM next_at - now()) * 1000))::bigint"
    " FROM tool_pacing WHERE tool = $1";

int tally_pace_burst(double rate_per_s)
{
    if (!(rate_per_s > 0)) {
        return 1;
    }
    double burst = floor(rate_per_s);
    return burst < 1 ? 1 : burst > 10000 ? 10000 : (int)burst;
}

int tally_pace_take(tally_pg_t *pg, const char *tool, double rate_per_s, int want,
                    long long *wait_ms, tally_error_t *err)
{
    *wait_ms = 0;
    int burst = tally_pace_burst(rate_per_s);
    if (want > burst) {
        want = burst;
    }
    if (want < 1) {
        want = 1;
    }
    char cost[64];
    snprintf(cost, sizeof cost, "%.3f", (double)want * 1000.0 / rate_per_s);
    const char *params[] = {tool, cost};
    PGresult *res = tally_pg_exec(pg, SQL_TAKE, 2, params, err);
    if (res == NULL) {
        return -1;
    }
    int granted = PQntuples(res) > 0 ? want : 0;
    PQclear(res);
    if (granted > 0) {
        return granted;
    }
    res = tally_pg_exec(pg, SQL_WAIT, 1, params, err);
    if (res == NULL) {
        return -1;
    }
    if (PQntuples(res) > 0) {
        *wait_ms = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    }
    PQclear(res);
    return 0;
}
