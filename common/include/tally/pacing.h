/* pacing.h — the per-tool call budget shared by every worker (schemas/sql/012_upstream.sql,
 * table tool_pacing): audits, orphan sweeps and `tally verify --tools` take slots here before
 * calling a tool, so together they never exceed the tool's audit.rate_per_s, however many
 * workers run. UNKNOWN resolution is not paced: it must never wait behind an audit. */
#ifndef TALLY_PACING_H
#define TALLY_PACING_H

#include <stdbool.h>

#include "tally/error.h"
#include "tally/pg.h"

/** The largest number of slots one take may ask for at @p rate_per_s: one second's worth, at
 * least 1. */
int tally_pace_burst(double rate_per_s);

/**
 * @brief Take up to @p want slots (clamped to tally_pace_burst) of @p tool's budget at
 * @p rate_per_s calls per second, by the database clock, in one statement. The bucket refills
 * continuously and holds at most one second's worth (or one slot, when slots are longer).
 * @returns the slots granted (all of them, or 0 when the budget is spent, with the time until
 * it opens again in @p wait_ms), or -1 with @p err.
 */
int tally_pace_take(tally_pg_t *pg, const char *tool, double rate_per_s, int want,
                    long long *wait_ms, tally_error_t *err);

#endif
