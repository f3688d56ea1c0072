/* tally-dispatcher — DESIGN.md §2: consumes tally.intents; for each poll batch validates every
 * message and, in ONE PostgreSQL transaction, records the effects, their dispatch outbox rows,
 * their audit events and the dead letters; stores the Kafka offsets only after that COMMIT.
 * It then claims due outbox rows with leases, calls the tools' connectors concurrently and
 * records each outcome with a compare-and-set on status and lease epoch.
 * Intake is in intake.c, delivery in deliver.c, the events they publish in events.c. */
#include "dispatcher.h"

int main(int argc, char **argv)
{
    return tally_worker_main(argc, argv, &tally_dispatcher_ops);
}
