/* cloudevent.h — CloudEvents 1.0 structured JSON: build tally events, parse intents. */
#ifndef TALLY_CLOUDEVENT_H
#define TALLY_CLOUDEVENT_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/error.h"
#include "tally/json.h"

/**
 * @brief A CloudEvent {specversion "1.0", id (fresh UUID), source, type, time (RFC 3339 UTC),
 * datacontenttype "application/json", subject (may be NULL), data}.
 * Takes ownership of @p data (it is decref'd even on failure).
 * @param id_out when not NULL, receives the event id.
 * @returns a new reference, or NULL when out of memory.
 */
json_t *tally_ce_new(const char *type, const char *source, const char *subject, json_t *data,
                     char id_out[37]) TALLY_WUR;

/**
 * @brief The envelope of the same CloudEvent as text: writes its members (specversion, id,
 * source, type, time, datacontenttype, subject) into the object open in @p j; the caller adds
 * "data" and closes the object. For events written once per effect (tally_jtext_t).
 * @param id_out receives the event id.
 * @returns false when the clock could not be read (@p j is marked failed).
 */
bool tally_ce_envelope_text(tally_jtext_t *j, const char *type, const char *source,
                            const char *subject, char id_out[37]);

/**
 * @brief tally_ce_envelope_text with the event's id and time given: @p id, and @p time (RFC
 * 3339 UTC with milliseconds, as tally_ce_envelope_text writes it). For an event built again
 * from the ledger, which must come out byte for byte the same every time.
 */
bool tally_ce_envelope_text_at(tally_jtext_t *j, const char *type, const char *source,
                               const char *subject, const char *id, const char *time);

/** The source of the events a dispatcher publishes: its worker id after this. */
#define TALLY_CE_DISPATCHER_SOURCE "/tally/dispatcher/"

/** @brief What an effect event (tally.effect.<status>.v1, DESIGN §5) says. Every string may be
 * NULL except source and status. */
typedef struct tally_effect_event {
    const char *source;
    const char *id;   /**< the CloudEvent id, or NULL for a fresh one */
    const char *time; /**< RFC 3339 UTC with milliseconds, or NULL for now */
    const char *effect_id;
    const char *run_id;
    const char *step;
    bool step_is_number;
    const char *tool;
    const char *operation_key;
    const char *status; /**< "CONFIRMED", ..., or "CONFLICT" */
    const json_t *receipt;
    const char *receipt_text; /**< the receipt as JSON text; when set, used instead of receipt */
    const char *external_ref;
    const char *error_code;
    const char *error_message;
    long long attempts;
    const char *intent_id;
    const json_t *extra; /**< more members of data, after the standard ones (borrowed) */
} tally_effect_event_t;

/**
 * @brief The effect event @p e as compact JSON text: the one builder of these events, used by
 * the dispatcher when it writes one and by the relay when it builds one from the ledger
 * (message_refs), so both come out the same for the same inputs.
 * @param id_out receives the event id.
 * @returns malloc'd text, or NULL when out of memory (or the clock could not be read).
 */
char *tally_ce_effect_text(const tally_effect_event_t *e, char id_out[37]) TALLY_WUR;

/**
 * @brief The CloudEvent @p payload (JSON text) cut to at most @p limit bytes, for one that
 * would not fit the broker's message limit. The envelope is kept; in data, the largest values
 * are cut first (a string on a character boundary, an array to its first elements, what
 * cannot be cut to null) until the event fits, and data.truncated says so: {"original_bytes",
 * "cut": ["summary.compensated: 120 of 5000 items", ...], "full": the command that shows the
 * whole from the ledger}. The ledger keeps every value whole (runs.summary, effects.receipt,
 * alerts, events): only the published copy is bounded.
 * @returns malloc'd JSON text, or NULL when @p payload is not a JSON object, when even the
 * envelope and the note do not fit @p limit, or when memory ran out.
 */
char *tally_ce_bounded(const char *payload, size_t limit) TALLY_WUR;

/** Why an intent message was refused; the names are the DLQ's machine-readable reasons. */
typedef enum {
    TALLY_DLQ_NONE = 0,
    TALLY_DLQ_TOO_LARGE,      /* "too_large" */
    TALLY_DLQ_INVALID_UTF8,   /* "invalid_utf8" */
    TALLY_DLQ_NOT_JSON,       /* "not_json" */
    TALLY_DLQ_NOT_CLOUDEVENT, /* "not_cloudevent": missing/invalid specversion, id, source, type */
    TALLY_DLQ_UNKNOWN_TYPE,   /* "unknown_type" */
    TALLY_DLQ_MISSING_FIELD,  /* "missing_field" */
    TALLY_DLQ_INVALID_FIELD,  /* "invalid_field" */
    TALLY_DLQ_UNKNOWN_TOOL,   /* "unknown_tool" */
    TALLY_DLQ_MISSING_OPERATION_KEY, /* "missing_operation_key" */
    TALLY_DLQ_LEDGER_REFUSED,   /* "ledger_refused": valid, but PostgreSQL refuses to store it */
    TALLY_DLQ_INVALID_REPLY_TO, /* "invalid_reply_to": a reply destination tally may not use */
    TALLY_DLQ_RUN_NOT_ACTIVE,   /* "run_not_active": the run is completed (not dead-lettered) */
} tally_dlq_reason_t;

const char *tally_dlq_reason_name(tally_dlq_reason_t r);

typedef enum {
    TALLY_MSG_INTENT = 1,     /* tally.intent.v1 */
    TALLY_MSG_COMPENSATE_RUN, /* tally.compensate_run.v1 */
    TALLY_MSG_CANCEL_RUN,     /* tally.cancel_run.v1 */
    TALLY_MSG_COMPLETE_RUN,   /* tally.complete_run.v1 */
} tally_msg_type_t;

/** @brief A parsed message from the intents topic. Strings point into @p doc. */
typedef struct tally_intent {
    json_t *doc; /**< the whole CloudEvent (owned) */
    tally_msg_type_t type;
    const char *id; /**< CloudEvents id */
    const char *run_id;
    char step[128];            /**< step as text ("3" for integer 3) */
    bool step_is_number;       /**< it came as a JSON number: answers echo it as one (DESIGN §5) */
    bool step_is_digits;       /**< digits alone (a number, or a string such as "03"): it orders
                                    numerically for compensation (effects.step_num) */
    const char *tool;          /**< intents only */
    json_t *args;              /**< intents only; borrowed from doc */
    const char *operation_key; /**< optional */
    const char *tenant;        /**< optional */
    const char *traceparent;   /**< optional; validated as W3C when present */
    const char *reason;        /**< compensate/cancel */
    bool compensate;           /**< cancel_run only */
    int deadline_ms;           /**< compensate_run only: data.deadline_ms (1000 to
                                    TALLY_RUNOP_DEADLINE_MS_MAX), 0 when absent */
} tally_intent_t;

/**
 * @brief Validate and parse one message value of the intents topic: size limit, UTF-8, JSON
 * (duplicate keys refused), CloudEvents 1.0 attributes, known type, required data fields and
 * their types (run_id a non-empty string ≤ 200 bytes, step a string or integer, tool a
 * string, args an object). Does not look at the registry.
 * @returns TALLY_DLQ_NONE and fills @p out (free with tally_intent_clear), or the reason with
 * a sentence in @p detail.
 */
tally_dlq_reason_t tally_intent_parse(const void *buf, size_t len, size_t max_bytes,
                                      tally_intent_t *out, char *detail, size_t detailsz);

void tally_intent_clear(tally_intent_t *in);

/** The most of a refused message tally reads to answer it (larger ones go to the DLQ alone). */
#define TALLY_PEEK_MAX_BYTES (16u * 1024 * 1024)

/** @brief What can be read of a refused message to answer it (docs/agent-protocol.md). */
typedef struct tally_intent_peek {
    json_t *doc;        /**< owned */
    const char *id;     /**< the CloudEvents id: 1-200 bytes, no control characters */
    const char *run_id; /**< data.run_id, the same rules */
    const char *type;   /**< or NULL */
    const char *tool;   /**< or NULL */
    json_t *step;       /**< an integer or a plain string, or NULL; borrowed from doc */
} tally_intent_peek_t;

/**
 * @brief Read the id and run id of a message tally refuses, and its type, tool and step when
 * they are usable, so that the refusal can be answered. @returns false (nothing to free) when
 * they cannot be read: not UTF-8, not a JSON object, over TALLY_PEEK_MAX_BYTES, no usable id
 * or run id. Free with tally_intent_peek_clear.
 */
bool tally_intent_peek(const void *buf, size_t len, tally_intent_peek_t *out);

void tally_intent_peek_clear(tally_intent_peek_t *p);

/**
 * @brief The step as the intent had it (DESIGN §5): a JSON integer when it came as a number,
 * the string otherwise ("03" stays "03"). NULL only out of memory. Every answer that names a
 * step builds it here.
 */
json_t *tally_step_json(const char *step, bool is_number);

/** @brief The same written into @p j as member @p key (the per-effect events, tally_jtext_t). */
void tally_step_jtext(tally_jtext_t *j, const char *key, const char *step, bool is_number);

/**
 * SQL: whether the effect row aliased @p E had its step as a JSON number (step_num holds the
 * digits of a string too, for ordering; step_quoted says it was a string, migration 10).
 */
#define TALLY_SQL_STEP_IS_NUMBER(E) "(" E ".step_num IS NOT NULL AND NOT " E ".step_quoted)"

#endif
