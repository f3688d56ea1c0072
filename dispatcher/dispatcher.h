/* dispatcher.h — the dispatcher's state and its parts: intake (intents → ledger, one
 * transaction per Kafka poll batch: intake.c reads and refuses, intake_write.c writes),
 * delivery (deliver.c: claim → connector call → decision, the decisions themselves pure in
 * policy.c), the recorder (record.c: the compare-and-set of each decision, on a thread of its
 * own) and the loop that waits on curl, PostgreSQL and Kafka at once (dispatcher.c). */
#ifndef TALLY_DISPATCHER_H
#define TALLY_DISPATCHER_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <jansson.h>
#include <librdkafka/rdkafka.h>

#include "tally/audit.h"
#include "tally/cloudevent.h"
#include "tally/config.h"
#include "tally/connector.h"
#include "tally/consume.h"
#include "tally/metrics.h"
#include "tally/outbox.h"
#include "tally/pg.h"
#include "tally/registry.h"
#include "tally/seal.h"
#include "tally/worker.h"

#include "policy.h"

/** The worker ops of tally-dispatcher; main.c hands them to tally_worker_main. */
extern const tally_worker_ops_t tally_dispatcher_ops;

/* Lease = the tool's timeout plus this margin (and never less than TALLY_LEASE_MS), so a
 * call that is still legitimately running is not taken over. */
#define DISPATCH_LEASE_MARGIN_MS 5000

/** One message of the current intake batch. */
typedef struct intake_msg {
    rd_kafka_message_t *rkm; /**< owned until the batch is committed */
    bool parsed;
    tally_dlq_reason_t reason; /**< TALLY_DLQ_NONE when the message is valid */
    char detail[256];
    char field[64];    /**< the field at fault, for the refusal's answer ("" when unknown) */
    char *reply;       /**< where its answers go too (replies.destination JSON), or NULL */
    tally_intent_t in; /**< valid when parsed and reason == NONE */
    const tally_tool_t *tool;
    char *op_key;    /**< operation key (intents) */
    char *canonical; /**< canonical args (intents) */
    char input_hash[65];
    char effect_id[37]; /**< the id the effect gets if this intent creates it */
    /* sensitive fields (sensitive.c), set by intake_seal inside the batch's transaction */
    char *stored_args;     /**< the args as the ledger keeps them: redacted; NULL: canonical */
    char *args_sealed;     /**< the canonical args sealed (bytea text), or NULL */
    char seal_key[37];     /**< the tenant key they are sealed under, or "" */
    tally_redactor_t *red; /**< its values, handed to the call when it is claimed */
    char *dlq_original;    /**< a dead letter of a sensitive tool, redacted; or NULL */
    bool dlq_withheld;     /**< a dead letter whose bytes cannot be redacted: not copied */
    bool dispatch;         /**< created as DISPATCHING by this batch: call it after COMMIT */
    long long epoch;       /**< its lease epoch (dispatch) */
    int attempts;          /**< its attempt number (dispatch) */
} intake_msg_t;

/** A claimed effect while its connector call is in flight. */
typedef struct dispatch_call {
    char effect_id[37];
    char *run_id;
    char *step;
    bool step_is_number;
    char *operation_key;
    char *intent_id;
    const tally_tool_t *tool;
    long long epoch;
    int attempts;
    double claimed_at;     /**< monotonic seconds */
    tally_redactor_t *red; /**< a sensitive tool's: the tenant key and the values to redact */
} dispatch_call_t;

/** A finished call waiting to be recorded. */
typedef struct dispatch_done {
    dispatch_call_t *call;
    tally_conn_verdict_t v;
    tally_dispatch_decision_t dec; /**< what the effect becomes (policy.c) */
    char *receipt_text;            /**< CONFIRMED: the receipt as compact JSON text (owned) */
    char *external_ref;            /**< CONFIRMED, may be NULL */
    char *receipt_sealed;          /**< a sensitive tool's whole receipt, sealed, or NULL */
    char *call_record;             /**< the "connector_call" audit data, JSON text (owned) */
    double seconds;                /**< connector latency */
    char transition_id[37];        /**< the id of its "transition" audit event when its outcome
                                        is written by reference (record.c), else "" */
} dispatch_done_t;

typedef struct dispatcher {
    tally_worker_t *w;
    const tally_config_t *cfg;
    const tally_registry_t *reg;
    const tally_keyring_t *keys; /**< master keys (seal.h) */
    bool any_sensitive;          /**< a tool declares sensitive fields */
    tally_pg_t *pg;
    rd_kafka_t *rk;
    tally_consume_t *cs; /**< the consumer's wake-up pipe and offsets (the worker's) */
    tally_connector_t *conn;
    const char *worker_id;
    char source[160]; /**< CloudEvents source of everything this worker publishes */

    /* intake */
    intake_msg_t *batch;
    size_t n_batch, cap_batch;
    bool intake_more;       /**< the last poll filled the batch: more is waiting */
    double intake_retry_at; /**< after a database error: not before this (monotonic s) */
    int intake_failures;    /**< transactions failed in a row (backoff.h's step) */
    int intake_backoff_ms;  /**< the current wait after one, 0 when none failed */
    bool intake_failed;     /**< holding a batch whose transaction failed */
    size_t intake_done;     /**< the batch's first messages, already committed */
    size_t intake_window;   /**< while isolating a refused message: messages per transaction */

    /* delivery */
    bool claim_wanted; /**< a NOTIFY, new intents, freed capacity or the timer */
    bool claim_failed; /**< the last claim failed: the next one that works says ready again */
    bool claim_capped; /**< the last claim was limited by capacity, not by due rows */
    double next_sweep; /**< look for due rows (backoffs that came due) at this time */

    /* recording: its own thread and PostgreSQL connection (record.c). rec_mu guards the
     * queue and the fields after it; rec_pg and the rec_ backoff belong to the thread. */
    pthread_t rec_thread;
    bool rec_init, rec_started;
    pthread_mutex_t rec_mu;
    pthread_cond_t rec_cv;
    int rec_pipe[2]; /**< the thread writes to [1] after each batch; the loop waits on [0] */
    tally_pg_t *rec_pg;
    int rec_failures;      /**< batches failed in a row (backoff.h's step) */
    int rec_backoff_ms;    /**< the current wait after one, 0 when none failed */
    dispatch_done_t *done; /**< finished calls waiting for the thread */
    size_t n_done, cap_done;
    bool rec_busy;       /**< the thread holds a batch */
    bool rec_stop;       /**< exit once the queue is empty */
    size_t rec_recorded; /**< results written since the loop last looked */
    double rec_due;      /**< the earliest retry they scheduled (monotonic s), 0 when none */

    /* backpressure and housekeeping */
    long long backlog; /**< rows in the dispatch outbox, refreshed at most once a second */
    double backlog_at;
    bool paused;
    double paused_at;
    double effects_at; /**< last refresh of tally_effects */
    bool draining;
    double busy_at;    /**< the loop last did work (monotonic s) */
    double trimmed_at; /**< the heap was last trimmed */
    bool trim_wanted;  /**< work was done since then */

    /* metrics */
    tally_metric_t *m_effects;
    tally_metric_t *m_intents;
    tally_metric_t *m_dlq;
    tally_metric_t *m_dispatch_seconds;
    tally_metric_t *m_connector_seconds;
    tally_metric_t *m_calls;
    tally_metric_t *m_inflight;
    tally_metric_t *m_tool_inflight; /**< tally_connector_inflight{tool} */
    tally_metric_t *m_backlog;
    tally_metric_t *m_lease_lost;
    tally_metric_t *m_paused;
    tally_metric_t *m_db_errors;
    tally_metric_t *m_alert_fail; /**< tally_alert_write_failures_total{worker} */
    tally_metric_t *m_seconds;    /**< tally_dispatcher_seconds_total{phase} */
} dispatcher_t;

/* dispatcher.c */
double dispatch_now(void);
/** @brief Add the time since @p since (dispatch_now) to phase @p phase of m_seconds. */
void dispatch_spent(dispatcher_t *d, const char *phase, double since);

/* intake.c */

/**
 * @brief Take what the consumer has (up to batch_size), validate it, and write it in one
 * transaction; store the offsets only after COMMIT. On a database error the batch is kept
 * and retried after a backoff. @returns messages committed, 0 when none, -1 on an error.
 */
int intake_step(dispatcher_t *d);

/** @brief Drop the held batch without storing offsets (Kafka redelivers it). */
void intake_discard(dispatcher_t *d);

/**
 * @brief Dead-letter message @p m (its reason and detail set): its DLQ record on @p ob, and its
 * tally.intent.rejected.v1 answer when its id and run id can be read. @returns false when out
 * of memory.
 */
bool intake_refuse(dispatcher_t *d, tally_outbox_batch_t *ob, intake_msg_t *m) TALLY_WUR;

/**
 * @brief Queue tally.intent.rejected.v1 (docs/agent-protocol.md), the answer to message @p m
 * that tally refuses (m->reason, m->detail), on the outcomes topic and on @p reply (may be
 * NULL). @p step (borrowed) may be NULL; @p dlq: the message was dead-lettered (its position
 * is named). @returns false when out of memory.
 */
bool intake_answer_rejected(dispatcher_t *d, tally_outbox_batch_t *ob, const intake_msg_t *m,
                            const char *id, const char *run_id, json_t *step, const char *tool,
                            const char *type, const char *reply, bool dlq) TALLY_WUR;

/* intake_write.c */

/** What became of the messages of one intake transaction (for the metrics and the log). */
typedef struct intake_counts {
    int created, planned, replay, conflict, dlq, cancel, compensate, complete, not_active;
    int dlq_by_reason[16];
} intake_counts_t;

/**
 * @brief Everything messages [@p lo, @p hi) of the batch say, in one transaction on d->pg,
 * begun here; the caller commits or rolls back. Audit events go to @p ab and messages to
 * @p ob, both flushed here; the messages are leased to this worker's relay and @p handed
 * receives them, for dispatch_hand_messages after COMMIT. Effects claimed at once are marked
 * (intake_msg_t.dispatch) for their calls to start after COMMIT.
 */
bool intake_write(dispatcher_t *d, size_t lo, size_t hi, tally_audit_batch_t *ab,
                  tally_outbox_batch_t *ob, intake_counts_t *c, PGresult **handed,
                  tally_error_t *err) TALLY_WUR;

/* deliver.c */

/** @brief The lease of a call to @p tool: its timeout plus a margin, at least TALLY_LEASE_MS. */
int dispatch_lease_ms(const dispatcher_t *d, const tally_tool_t *tool);

/** @brief Claim due outbox rows within capacity and start their calls. @returns calls started. */
int deliver_claim(dispatcher_t *d);

/**
 * @brief A call context for a claimed effect (strings copied). @returns NULL when out of
 * memory or when @p tool is NULL (not in this worker's registry).
 */
dispatch_call_t *dispatch_call_new(const char *effect_id, const char *run_id, const char *step,
                                   bool step_is_number, const tally_tool_t *tool,
                                   const char *operation_key, const char *intent_id,
                                   long long epoch, int attempts);

/**
 * @brief Start the call of a claimed effect whose claim is committed (takes @p call). A call
 * that cannot start is queued as a result like any other.
 */
void deliver_start(dispatcher_t *d, dispatch_call_t *call, const char *body, size_t body_len,
                   const char *traceparent);

/** @brief The connector's completion callback: classify, decide and queue the result. */
void deliver_on_done(const tally_conn_result_t *res, void *opaque);

/** @brief Free a call context (also for calls abandoned at exit). */
void dispatch_call_free(void *call);

/* sensitive.c */

/** @brief For the sensitive intents of messages [lo, hi), inside the batch's transaction: the
 * tenant keys (made when missing), the args redacted and sealed; dead letters of sensitive
 * tools redacted. */
bool intake_seal(dispatcher_t *d, size_t lo, size_t hi, tally_error_t *err) TALLY_WUR;
void intake_sensitive_clear(intake_msg_t *m);
/** @brief A claimed effect of a sensitive tool: open its tenant key (@p key_id, @p master_id,
 * @p wrapped as the row has them) into call->red and its sealed args (@p sealed, NULL when the
 * args hold nothing sensitive) into @p body (malloc'd; NULL when @p sealed is NULL). */
bool call_open_sealed(dispatcher_t *d, dispatch_call_t *call, const char *key_id,
                      const char *master_id, const char *wrapped, const char *sealed, char **body,
                      size_t *body_len, tally_error_t *err) TALLY_WUR;
void call_sensitive_clear(dispatch_call_t *call);
/* record.c */

/** @brief Start the recorder thread and its connection. false (logged) when it cannot. */
bool recorder_start(dispatcher_t *d);

/** @brief Let the recorder write what it holds, stop it and free what is left. */
void recorder_stop(dispatcher_t *d);

/**
 * @brief Hand a decided result to the recorder, which owns everything @p x points to from
 * then on. @returns false when out of memory (then the caller still owns it).
 */
bool recorder_queue(dispatcher_t *d, const dispatch_done_t *x) TALLY_WUR;

/** @brief On the loop: take the recorder's news (results written, retries due, room freed).
 * @returns results written since the last call. */
int recorder_collect(dispatcher_t *d);

/** @brief Results not yet written (queued or being written). */
size_t recorder_pending(dispatcher_t *d);

/** @brief Free what a result owns (its call included) and zero it. */
void dispatch_done_clear(dispatch_done_t *x);

/* events.c */

/** @brief An effect event to publish (DESIGN §5) and where its answer goes. */
typedef struct effect_view {
    /** What the event says (cloudevent.h; every string may be NULL except status; source and
     * extra are dispatch_publish_effect's). Its id, when set, is the id of the "transition"
     * audit event this outcome reports: the event is one the relay can build again from the
     * ledger (tally_outbox_batch_add_ref), and its message may be a reference to it. */
    tally_effect_event_t ev;
    bool own;             /**< the answer to one message alone: not copied to the effect's
                               replies (a replay, a conflict) */
    const char *reply_to; /**< that message's reply destination, or NULL */
} effect_view_t;

/**
 * @brief Queue tally.effect.<status>.v1 for @p v on topic "outcomes" (key: the run id).
 * @p extra (may be NULL; borrowed): more members of data, written after the standard ones
 * (none of its keys may be one of them). @returns false when out of memory.
 */
bool dispatch_publish_effect(dispatcher_t *d, tally_outbox_batch_t *ob, const effect_view_t *v,
                             const json_t *extra) TALLY_WUR;

/**
 * @brief Write @p ob's messages in the caller's transaction on @p pg, leased to this worker's
 * relay; @p handed receives them, for dispatch_hand_messages once the transaction committed.
 * Without a relay they are written unleased (any relay takes them on its notification).
 */
bool dispatch_flush_messages(dispatcher_t *d, tally_pg_t *pg, tally_outbox_batch_t *ob,
                             PGresult **handed, tally_error_t *err) TALLY_WUR;

/** @brief After COMMIT: hand dispatch_flush_messages' rows to the relay, and clear them. */
void dispatch_hand_messages(dispatcher_t *d, PGresult *handed);

/** @brief Serialise @p v compactly; @returns malloc'd text or NULL. Steals @p v. */
char *dispatch_dump(json_t *v);

#endif
