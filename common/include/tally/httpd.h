/* httpd.h — /metrics, /healthz and /readyz over libmicrohttpd. */
#ifndef TALLY_HTTPD_H
#define TALLY_HTTPD_H

#include <stdbool.h>
#include <stddef.h>

#include "tally/metrics.h"

typedef struct tally_httpd tally_httpd_t;

/** @brief Answers /readyz: true when ready, else false with a short reason. */
typedef bool (*tally_ready_fn)(void *opaque, char *why, size_t whysz);
/** @brief Answers /healthz: false when the main loop is wedged. */
typedef bool (*tally_health_fn)(void *opaque, char *why, size_t whysz);

/**
 * @brief Serve /metrics, /healthz and /readyz on @p addr ("host:port"; port 0 picks a free
 * one) in libmicrohttpd's own thread: at most 64 connections, 8 from one client address,
 * each closed after 10 s idle. @returns NULL with the reason in @p errstr.
 */
tally_httpd_t *tally_httpd_start(const char *addr, tally_metrics_t *metrics, tally_health_fn health,
                                 tally_ready_fn ready, void *opaque, char *errstr,
                                 size_t errsz) TALLY_WUR;

/**
 * @brief Serve /healthz and /readyz alone on @p addr (TALLY_HEALTH_ADDR), a listener of its own
 * (16 connections, 4 from one client address) that scrapers and anyone holding the metrics
 * port's connections cannot starve: the liveness probe that restarts a worker looks here.
 */
tally_httpd_t *tally_httpd_start_health(const char *addr, tally_health_fn health,
                                        tally_ready_fn ready, void *opaque, char *errstr,
                                        size_t errsz) TALLY_WUR;

/** @brief The port actually bound. */
int tally_httpd_port(const tally_httpd_t *h);

/** @brief Stop serving and free. NULL is allowed. */
void tally_httpd_stop(tally_httpd_t *h);

#endif
