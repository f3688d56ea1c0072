/* kafka.h — librdkafka producer and consumer set-up from the tally configuration. */
#ifndef TALLY_KAFKA_H
#define TALLY_KAFKA_H

#include <stdbool.h>
#include <stddef.h>
#include <librdkafka/rdkafka.h>

#include "tally/config.h"
#include "tally/metrics.h"

/**
 * @brief A conf with bootstrap.servers, client.id (worker id) and every TALLY_KAFKA_*
 * passthrough applied. @returns NULL with the property and librdkafka's reason in @p errstr.
 * The caller owns the conf until it hands it to rd_kafka_new().
 */
rd_kafka_conf_t *tally_kafka_conf_new(const tally_config_t *cfg, char *errstr,
                                      size_t errsz) TALLY_WUR;

/**
 * @brief A producer. With @p idempotent, enable.idempotence=true (acks=all, ordered, no
 * duplicates from retries). @p dr_msg_cb (may be NULL) receives delivery reports during
 * rd_kafka_poll()/rd_kafka_flush(); @p opaque is passed to it.
 */
rd_kafka_t *tally_kafka_producer_new(const tally_config_t *cfg, bool idempotent,
                                     void (*dr_msg_cb)(rd_kafka_t *, const rd_kafka_message_t *,
                                                       void *),
                                     void *opaque, char *errstr, size_t errsz) TALLY_WUR;

/**
 * @brief A consumer in @p group_id subscribed to @p topics (full names): cooperative-sticky
 * assignment, enable.auto.offset.store=false (the caller stores offsets after its
 * PostgreSQL COMMIT), auto commit of stored offsets, auto.offset.reset=earliest,
 * session.timeout.ms from the config. Each assignment and revocation is logged (INFO: the
 * protocol, the partitions, whether they were lost, the member id) and counted in
 * @p rebalances (a counter with the label kind, "assign" or "revoke"; may be NULL); the
 * assignment itself is librdkafka's own (incremental for cooperative, whole for eager).
 */
rd_kafka_t *tally_kafka_consumer_new(const tally_config_t *cfg, const char *group_id,
                                     const char *const *topics, size_t n_topics,
                                     tally_metric_t *rebalances, char *errstr,
                                     size_t errsz) TALLY_WUR;

/**
 * @brief Refill @p lag (a gauge with the labels partition, topic) from the consumer's
 * assignment: the high watermark (cached from fetches, no broker round trip) minus the
 * position, per assigned partition. Partitions no longer assigned read 0. NULL @p rk is
 * allowed (nothing happens).
 */
void tally_kafka_consumer_lag(rd_kafka_t *rk, tally_metric_t *lag);

/**
 * @brief The documented termination order for a consumer: commit stored offsets
 * synchronously, rd_kafka_consumer_close() (leaves the group), rd_kafka_destroy().
 * NULL is allowed.
 */
void tally_kafka_consumer_close(rd_kafka_t *rk);

/**
 * @brief Ask the cluster for the metadata of each topic (full names). Where the cluster
 * creates topics on demand (the embedded stack does, with 4 partitions) this creates them.
 * @returns true when every topic exists; otherwise false and the missing names in @p errstr.
 */
bool tally_kafka_ensure_topics(rd_kafka_t *rk, const char *const *topics, size_t n_topics,
                               int timeout_ms, char *errstr, size_t errsz) TALLY_WUR;

/** @brief Flush up to @p timeout_ms, then destroy. NULL is allowed. */
void tally_kafka_producer_close(rd_kafka_t *rk, int timeout_ms);

#endif
