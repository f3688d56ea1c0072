/* worker.h — the lifecycle every tally worker shares: config, registry, PostgreSQL, the relay,
 * /metrics and /healthz, the consumer, signals, drain and exit. A worker's main.c supplies
 * the ops and reads like its paragraph in DESIGN.md §2. */
#ifndef TALLY_WORKER_H
#define TALLY_WORKER_H

#include <stdbool.h>
#include <librdkafka/rdkafka.h>

#include "tally/config.h"
#include "tally/consume.h"
#include "tally/metrics.h"
#include "tally/pg.h"
#include "tally/registry.h"
#include "tally/relay.h"

typedef struct tally_worker tally_worker_t;

typedef struct tally_worker_ops {
    const char *name;    /**< "dispatcher": binary tally-dispatcher, group tally-dispatcher */
    const char *summary; /**< one line for --help */
    /** logical topics to consume ("intents"), NULL-terminated; NULL for no consumer */
    const char *const *topics;
    /** after config, registry, PostgreSQL, relay, httpd (and consumer) are up; false exits 1 */
    bool (*init)(tally_worker_t *w, void **state);
    /**
     * one turn of the loop: take work, do it, record it. Returns the amount of work done; when
     * 0 the tick itself should have waited (at most poll_ms) for work to arrive.
     */
    int (*tick)(tally_worker_t *w, void *state);
    /** after the first SIGTERM: stop intake, finish or release in-flight work; called until it
     * returns true or the grace period ends */
    bool (*drain)(tally_worker_t *w, void *state);
    /** last; frees the state. May be NULL. */
    void (*fini)(tally_worker_t *w, void *state);
} tally_worker_ops_t;

/**
 * @brief The whole process: parse argv (--tools FILE, --metrics-addr ADDR, --help, --version),
 * load the environment, refuse to start on an unsafe registry (each problem logged, naming
 * the tool and the rule) or an unmigrated database, run init, loop tick until SIGTERM/SIGINT,
 * drain, fini, close the consumer (leaving the group) and the relay, exit.
 * A second SIGTERM exits at once. @returns the process exit code.
 */
int tally_worker_main(int argc, char **argv, const tally_worker_ops_t *ops);

const tally_config_t *tally_worker_config(tally_worker_t *w);
const tally_registry_t *tally_worker_registry(tally_worker_t *w);
/** @brief The master keys (seal.h); empty when none is configured. */
const struct tally_keyring *tally_worker_keyring(tally_worker_t *w);
/** The worker's main PostgreSQL connection (the relay has its own). */
tally_pg_t *tally_worker_pg(tally_worker_t *w);
tally_metrics_t *tally_worker_metrics(tally_worker_t *w);
/** The worker's relay (it runs on its own thread; tally_relay_hand may be called from any). */
tally_relay_t *tally_worker_relay(tally_worker_t *w);
/** The ledger's schema version, read at start (a feature of a later schema is used only when
 * it is there: docs/hacking.md, "Adding a migration"). */
int tally_worker_schema(const tally_worker_t *w);
/** The consumer, or NULL when ops->topics is NULL. */
rd_kafka_t *tally_worker_consumer(tally_worker_t *w);
/** The consumer's wake-up pipe and offsets (consume.h), created on first use and owned by the
 * worker, which frees it before the consumer leaves its group. NULL when ops->topics is NULL
 * or it cannot be set up (logged). */
tally_consume_t *tally_worker_consume(tally_worker_t *w);
/** A producer (not idempotent-critical) for direct sends, created on first use; NULL (logged)
 * when it cannot be created. Owned by the worker, flushed and closed at exit. */
rd_kafka_t *tally_worker_producer(tally_worker_t *w);
/** "<hostname>:<pid>" unless TALLY_WORKER_ID says otherwise. */
const char *tally_worker_id(const tally_worker_t *w);
/** true once SIGTERM/SIGINT arrived. */
bool tally_worker_stopping(const tally_worker_t *w);
/** The stop flag itself, for loops that take a volatile int pointer. */
volatile const int *tally_worker_stop_flag(const tally_worker_t *w);
/** Mark the loop alive for /healthz (tick calls it; worker_main also does after each tick). */
void tally_worker_heartbeat(tally_worker_t *w);
/** Readiness for /readyz: workers call with false and a reason when PG or Kafka is down. */
void tally_worker_set_ready(tally_worker_t *w, bool ready, const char *why);

#endif
