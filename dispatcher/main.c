/* tally-dispatcher — DESIGN.md §2: consumes tally.intents; for each poll batch validates every
 * message and, in ONE PostgreSQL transaction, records the effects, their dispatch outbox rows,
 * their audit events and the dead letters; stores the Kafka offsets only after that COMMIT.
 * Effects whose tools have room are claimed in that same statement and called at once; the
 * rest are claimed from the dispatch outbox with leases. Calls run concurrently; a thread of
 * its own records each outcome with a compare-and-set on status and lease epoch.
 * Intake is in intake.c, delivery in deliver.c, the events they publish in events.c. */
#include <malloc.h>
#include <stdlib.h>

#include "dispatcher.h"

int main(int argc, char **argv)
{
    /* Memory stays proportional to the calls in flight. glibc's default mmap threshold rises
     * after the first large batch is freed, so later batch texts come from the heap and leave
     * it fragmented; a fixed threshold keeps large buffers in mmap (returned on free), a fixed
     * trim threshold gives freed heap back, and two arenas stop each of librdkafka's threads
     * from keeping its own. Whoever sets GLIBC_TUNABLES chooses for themselves. */
    if (!getenv("GLIBC_TUNABLES")) {
        mallopt(M_MMAP_THRESHOLD, 128 * 1024);
        mallopt(M_TRIM_THRESHOLD, 256 * 1024);
        mallopt(M_ARENA_MAX, 2);
    }
    return tally_worker_main(argc, argv, &tally_dispatcher_ops);
}
