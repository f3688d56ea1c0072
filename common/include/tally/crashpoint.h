/* crashpoint.h — named crash points for the crash tests (DESIGN §11): a test build kills its own
 * process with SIGKILL at one exact step boundary, so a test proves what a crash there leaves
 * behind instead of hoping that a kill from outside lands in the right window.
 *
 * Only builds configured with -DTALLY_CRASH_POINTS=ON have them (the default when
 * TALLY_BUILD_TESTS is ON; production builds pass -DTALLY_BUILD_TESTS=OFF, which turns it off).
 * Without it TALLY_CRASHPOINT() compiles to nothing. With it, a worker arms at most one point at
 * start (tally_worker_main) from its environment — deliberately not the configuration table: it
 * is no setting of a production build.
 *
 *   TALLY_CRASH_AT=<point>   the point's name, below
 *   TALLY_CRASH_AFTER=<n>    crash on the point's n-th hit (default 1)
 *
 * The points, and the state a crash there leaves (tests/integration/test_crash_points.py):
 *
 *   dispatch.after_intake_commit     intake batch committed (effects PLANNED), Kafka offsets not
 *                                    stored: the intents come again and are answered as replays.
 *   dispatch.after_claim_commit      effects claimed (DISPATCHING, leased), no call sent: the
 *                                    lease expires, UNKNOWN, status finds nothing, re-sent once.
 *   dispatch.after_call_answer       a call's answer arrived, nothing recorded: DISPATCHING and
 *                                    applied; the lease expires and the status check confirms.
 *   dispatch.after_record_commit     outcomes committed, their events still in message_outbox:
 *                                    another worker's relay publishes them.
 *   relay.after_delivery             a relay round (or a handed-over batch) acknowledged by
 *                                    Kafka, its DELETE not committed: the rows come back and go
 *                                    out again, same ids, byte for byte the same — a reference
 *                                    (message_refs) built again from the ledger included.
 *   reconcile.after_lease_commit     UNKNOWN effects leased, no status call made.
 *   reconcile.after_status_answer    a status answer arrived, its verdict not recorded.
 *   compensate.after_lease_commit    obligations leased (RUNNING), no reverse call made.
 *   compensate.after_reverse_answer  a reverse (or containment) answer arrived, not recorded.
 */
#ifndef TALLY_CRASHPOINT_H
#define TALLY_CRASHPOINT_H

#ifdef TALLY_CRASH_POINTS

/** @brief Read TALLY_CRASH_AT and TALLY_CRASH_AFTER once; call before any thread starts. */
void tally_crashpoint_init(void);

/**
 * @brief A point reached: when it is the armed one and this is its n-th hit, log one line (with
 * the caller's @p func and @p line) and raise SIGKILL. Thread-safe.
 */
void tally_crashpoint_hit(const char *name, const char *func, int line);

#define TALLY_CRASHPOINT(name) tally_crashpoint_hit((name), __func__, __LINE__)

#else

static inline void tally_crashpoint_init(void)
{
}

#define TALLY_CRASHPOINT(name) ((void)0)

#endif

#endif
