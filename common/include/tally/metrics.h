/* metrics.h — counters, gauges and histograms rendered in the Prometheus text format. */
#ifndef TALLY_METRICS_H
#define TALLY_METRICS_H

#include <stdbool.h>
#include <stddef.h>

#include "tally/error.h"

typedef struct tally_metrics tally_metrics_t;
typedef struct tally_metric tally_metric_t;

/** @brief An empty, thread-safe registry. */
tally_metrics_t *tally_metrics_new(void) TALLY_WUR;

/**
 * @brief Declare a family. @p labels is a comma-separated list of label names ("tool,state")
 * or NULL. Declaring the same name twice returns the first. Borrowed; lives as long as @p m.
 * Names follow Prometheus conventions: tally_ prefix, _total for counters, _seconds for time.
 */
tally_metric_t *tally_metrics_counter(tally_metrics_t *m, const char *name, const char *help,
                                      const char *labels);
tally_metric_t *tally_metrics_gauge(tally_metrics_t *m, const char *name, const char *help,
                                    const char *labels);
/** @p buckets upper bounds in ascending order (seconds for latency); +Inf is implicit. */
tally_metric_t *tally_metrics_histogram(tally_metrics_t *m, const char *name, const char *help,
                                        const char *labels, const double *buckets,
                                        size_t n_buckets);

/** Default latency buckets: 1 ms .. 30 s. */
extern const double tally_latency_buckets[];
extern const size_t tally_n_latency_buckets;

/**
 * @brief Update one series. The label values follow in declaration order, as many as the
 * family has labels. Unknown series are created on first use.
 */
void tally_metric_add(tally_metric_t *mt, double v, ...);     /* counters and gauges */
void tally_metric_set(tally_metric_t *mt, double v, ...);     /* gauges */
void tally_metric_observe(tally_metric_t *mt, double v, ...); /* histograms */

/** @brief Set every series of a gauge family to 0 (before refilling it from a query). */
void tally_metric_reset(tally_metric_t *mt);

/**
 * @brief Call @p collect at the start of every render, on the rendering thread, to set gauges
 * from state another thread owns and cannot update while it waits (tally_db_up during a
 * database stall). Set it before anything renders; one per registry.
 */
void tally_metrics_on_render(tally_metrics_t *m, void (*collect)(void *opaque), void *opaque);

/** @brief The text exposition (version 0.0.4). @returns malloc'd text the caller frees. */
char *tally_metrics_render(tally_metrics_t *m) TALLY_WUR;

void tally_metrics_free(tally_metrics_t *m);

#endif
