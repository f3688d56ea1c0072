/* pacing.c — the per-tool call budget shared by every worker (pacing.h). */
#include "tally/pacing.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <libpq-fe.h>

/* A token bucket kept as one timestamp, next_at: at time t it holds (t - next_at) / slot slots,
 * at most one second's worth (or one slot, when a slot is longer). A take of n slots needs them
 * all: it succeeds when greatest(next_at, t - burst) + n * slot <= t, and moves next_at there.
 * $2 is n * slot in ms, $3 the burst in ms. The upsert makes the first take create the row. */
static const char SQL_TAKE[] =
    "INSERT INTO tool_pacing AS p (tool, next_at)"
    " VALUES ($1, now() - $3::float8 * interval '1 millisecond'"
    "   + $2::float8 * interval '1 millisecond')"
    " ON CONFLICT (tool) DO UPDATE"
    " SET next_at = greatest(p.next_at, now() - $3::float8 * interval '1 millisecond')"
    "   + $2::float8 * interval '1 millisecond'"
    " WHERE greatest(p.next_at, now() - $3::float8 * interval '1 millisecond')"
    "   + $2::float8 * interval '1 millisecond' <= now()"
    " RETURNING 1";

/* How long until a take of the same size would succeed. */
static const char SQL_WAIT[] =
    "SELECT greatest(1, ceil(extract(epoch FROM"
    "   greatest(next_at, now() - $3::float8 * interval '1 millisecond')"
    "   + $2::float8 * interval '1 millisecond' - now()) * 1000))::bigint"
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
    int most = tally_pace_burst(rate_per_s);
    if (want > most) {
        want = most;
    }
    if (want < 1) {
        want = 1;
    }
    double slot_ms = 1000.0 / rate_per_s;
    char cost[64], burst[64]; /* ms */
    snprintf(cost, sizeof cost, "%.3f", (double)want * slot_ms);
    snprintf(burst, sizeof burst, "%.3f", slot_ms > 1000.0 ? slot_ms : 1000.0);
    const char *params[] = {tool, cost, burst};
    PGresult *res = tally_pg_exec(pg, SQL_TAKE, 3, params, err);
    if (res == NULL) {
        return -1;
    }
    int granted = PQntuples(res) > 0 ? want : 0;
    PQclear(res);
    if (granted > 0) {
        return granted;
    }
    res = tally_pg_exec(pg, SQL_WAIT, 3, params, err);
    if (res == NULL) {
        return -1;
    }
    if (PQntuples(res) > 0) {
        *wait_ms = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    }
    PQclear(res);
    return 0;
}
