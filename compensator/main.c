/* tally-compensator — DESIGN.md §2: consumes tally.obligations and sweeps PostgreSQL. It
 * leases obligations (a run's in reverse step order), runs each reverse action with its own
 * idempotency key, and marks each RESOLVED, SKIPPED, UNCOMPENSATABLE or STUCK; STUCK raises an
 * alert, and every alert is sent to the pager (TALLY_PAGER_URL). compensator.h has the parts. */
#include "compensator.h"

int main(int argc, char **argv)
{
    return tally_worker_main(argc, argv, &tally_compensator_ops);
}
