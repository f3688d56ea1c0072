/* config.h — configuration from the environment, driven by one declarative table. */
#ifndef TALLY_CONFIG_H
#define TALLY_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "tally/error.h"

/** @brief The longest TALLY_CONSOLE_URL, in bytes. */
#define TALLY_CONSOLE_URL_MAX 512

/** @brief One `TALLY_KAFKA_<property>` passed through to librdkafka. */
typedef struct tally_kv {
    char *name;  /**< librdkafka property, e.g. "security.protocol" */
    char *value; /**< as given */
} tally_kv_t;

/**
 * @brief Every setting of every tally process. Fields are filled from the table in config.c
 * (name, env var, type, default, help); add a setting by adding a field and a table row.
 * Strings are owned by the config and freed by tally_config_free().
 */
typedef struct tally_config {
    char *pg;                /**< TALLY_PG: libpq conninfo or URI; "" lets PG* variables decide */
    char *kafka_brokers;     /**< TALLY_KAFKA_BROKERS: bootstrap.servers */
    char *tools_path;        /**< TALLY_TOOLS: the tool registry JSON file */
    char *topic_prefix;      /**< TALLY_TOPIC_PREFIX: default "tally." */
    char *metrics_addr;      /**< TALLY_METRICS_ADDR: host:port for /metrics, /healthz, /readyz;
                                  "" disables; port 0 picks a free port */
    char *health_addr;       /**< TALLY_HEALTH_ADDR: host:port for /healthz and /readyz alone;
                                  "" for none (the metrics address serves them too) */
    char *worker_id;         /**< TALLY_WORKER_ID: default <hostname>:<pid> */
    char *log_level;         /**< TALLY_LOG_LEVEL: debug, info, warn, error */
    char *consumer_group;    /**< TALLY_CONSUMER_GROUP: default "tally-<worker>" */
    char *pager_url;         /**< TALLY_PAGER_URL: PagerDuty Events API v2 endpoint, or "" */
    char *pager_routing_key; /**< TALLY_PAGER_ROUTING_KEY */
    char *console_url;       /**< TALLY_CONSOLE_URL: where operators reach `tally console`
                                  (http:// or https://, checked); every alert and page links to
                                  <it>/runs/<run id> (alert.h); "" for no link */
    char *console_addr;      /**< TALLY_CONSOLE_ADDR: where `tally console` listens unless
                                  --listen says; a loopback address (cmd_console.c) */
    char *reply_prefix;      /**< TALLY_REPLY_TOPIC_PREFIX: reply topics must start with it;
                                  "" means "<topic_prefix>replies." (tally_config_reply_prefix) */
    char *master_key;        /**< TALLY_MASTER_KEY: "ID:BASE64[,ID:BASE64]" master keys (seal.h) */
    char *master_key_file;   /**< TALLY_MASTER_KEY_FILE: the same, read from a file */
    char *role_dispatcher;   /**< TALLY_ROLE_DISPATCHER: the dispatcher's database role */
    char *role_reconciler;   /**< TALLY_ROLE_RECONCILER */
    char *role_compensator;  /**< TALLY_ROLE_COMPENSATOR */
    char *role_operator;     /**< TALLY_ROLE_OPERATOR: the CLI verbs that change the ledger */
    char *role_reader;       /**< TALLY_ROLE_READER: read-only (status, doctor, dashboards) */
    char *role_password[5];  /**< TALLY_ROLE_PASSWORD_<ROLE>, in tally_role_t order: set by
                                  `tally migrate` as the role's password when not "" */
    char *allow_owner_role;  /**< TALLY_ALLOW_OWNER_ROLE: "1" lets a worker run as a superuser
                                  or the ledger's owner, warned at every start; "0" refuses */
    int pg_deadline_ms;      /**< TALLY_PG_DEADLINE_MS: the client-side deadline of every
                                  PostgreSQL statement and connection attempt (pg.h) */
    int pg_stall_ms;         /**< TALLY_PG_STALL_MS: a statement unanswered this long makes a
                                  worker not ready and tally_db_up 0 */
    int batch_size;          /**< TALLY_BATCH_SIZE: messages / rows per poll batch */
    int lease_ms;            /**< TALLY_LEASE_MS: how long a claim is held (database clock) */
    int poll_ms;             /**< TALLY_POLL_MS: longest idle wait before sweeping again */
    int sweep_ms;            /**< TALLY_SWEEP_MS: interval of the PostgreSQL sweep for due work */
    int max_message_bytes;   /**< TALLY_MAX_MESSAGE_BYTES: larger intents go to the DLQ */
    int backlog_limit;     /**< TALLY_BACKLOG_LIMIT: stop fetching intents above this outbox size */
    int max_inflight;      /**< TALLY_MAX_INFLIGHT: connector calls in flight per dispatcher */
    int relay_batch;       /**< TALLY_RELAY_BATCH: message outbox rows per relay round */
    int shutdown_grace_ms; /**< TALLY_SHUTDOWN_GRACE_MS: how long SIGTERM waits for in-flight work
                            */
    int unknown_age_s;     /**< TALLY_UNKNOWN_AGE_S: an UNKNOWN older than this is "aging" */
    int session_timeout_ms;     /**< TALLY_SESSION_TIMEOUT_MS: Kafka consumer session timeout */
    int run_idle_timeout_ms;    /**< TALLY_RUN_IDLE_TIMEOUT_MS: complete ACTIVE runs idle this long
                                     (reconciler); 0 is off */
    double deadline_warn_share; /**< TALLY_DEADLINE_WARN_SHARE: the share (0, 1] of an
                                     obligation's time to its compensation deadline after which
                                     the compensator pages a warning; 1: no warning page */
    tally_kv_t *kafka_props;    /**< TALLY_KAFKA_<PROPERTY> passthrough, in environment order */
    size_t n_kafka_props;
    char **unknown_vars; /**< TALLY_* names that are neither settings nor Kafka properties;
                              ignored, but listed as warnings by tally_config_describe */
    size_t n_unknown_vars;
} tally_config_t;

/** @brief The prefix every reply topic must start with: TALLY_REPLY_TOPIC_PREFIX, or
 * "<TALLY_TOPIC_PREFIX>replies." when it is empty, written into @p out. */
const char *tally_config_reply_prefix(const tally_config_t *cfg, char *out, size_t outsz);

/** @brief A config holding every default. Returns NULL only when out of memory. */
tally_config_t *tally_config_new(void) TALLY_WUR;

/**
 * @brief Overlay settings from @p envp (a NULL-terminated "NAME=value" array, like environ).
 * @returns false with a sentence in @p errstr naming the variable when a value is invalid
 * (e.g. "TALLY_LEASE_MS: 'abc' is not an integer").
 * @remark TALLY_KAFKA_BROKERS is bootstrap.servers, not a passthrough; any other
 * TALLY_KAFKA_FOO_BAR becomes librdkafka property "foo.bar".
 */
bool tally_config_load_env(tally_config_t *cfg, char *const *envp, char *errstr,
                           size_t errsz) TALLY_WUR;

/** @brief Write the table (variable, current value, default, help) for --help / `tally config`,
 * then the Kafka passthrough properties, then a warning per unknown TALLY_* variable.
 * Secrets are shown as "***": values of variables whose name holds PASSWORD, SECRET, KEY, TOKEN
 * or CREDENTIAL, and the password inside TALLY_PG. */
void tally_config_describe(const tally_config_t *cfg, FILE *out);

/** @brief `tally config`: tally_config_describe with a FROM column ("env" when @p envp sets the
 * variable, else "default"), after a note that these are this environment's values, not those
 * of workers already running (for `tally dev`: source its env file first). */
void tally_config_describe_env(const tally_config_t *cfg, char *const *envp, FILE *out);

/** @brief "<prefix><logical>", e.g. ("intents") -> "tally.intents". Never truncates silently:
 * returns false when @p outsz is too small. */
bool tally_config_topic(const tally_config_t *cfg, const char *logical, char *out,
                        size_t outsz) TALLY_WUR;

/** @brief Frees the config and every string it owns. NULL is allowed. */
void tally_config_free(tally_config_t *cfg);

/**
 * @brief A copy of a setting's value fit for logs and `tally config`: in a URL, the userinfo's
 * password, every credential-looking query parameter (password, token, key, secret, auth,
 * signature, session, ...) and any fragment become "***". Other text is copied as is. NULL out
 * of memory (or for NULL); the caller frees.
 */
char *tally_config_mask(const char *value);

#endif
