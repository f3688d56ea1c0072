/* tally-reconciler — DESIGN.md §2: consumes tally.outcomes, acting on UNKNOWN effects, and
 * sweeps PostgreSQL for due work. It resolves UNKNOWN effects with the connector's status
 * check (one record: CONFIRMED; several: DUPLICATE plus an obligation per extra record; none
 * after the settle window: PLANNED again with the same key), turns expired dispatch leases
 * into UNKNOWN, and pages (STUCK) when the evidence never becomes conclusive.
 * The loop is in reconcile.c, the decisions in policy.c, the SQL in store.c. */
#include "reconciler.h"

int main(int argc, char **argv)
{
    return tally_worker_main(argc, argv, &tally_reconciler_ops);
}
