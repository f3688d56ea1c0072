/* The fake tool's own records: executed operations, reversals, containments and the request
 * log, behind one mutex. Tests compare these records with tally's ledger. */
#ifndef TALLY_FAKE_STORE_H
#define TALLY_FAKE_STORE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct fake_store fake_store_t;

/* An HTTP answer built by the store. `body` is malloc'd JSON text owned by the reply; pass the
 * reply to the HTTP layer (which takes the body) or free it with fake_reply_clear(). */
typedef struct fake_reply {
    unsigned status;
    char *body;
    size_t len;
    bool replayed;            /* answer with `Idempotent-Replayed: true` */
    bool retry_after;         /* answer with `Retry-After: 1` */
    const char *content_type; /* a static string; NULL: application/json */
} fake_reply_t;

/* Sets `r` to `status` with the body {"error": msg}. */
void fake_reply_error(fake_reply_t *r, unsigned status, const char *msg);
/* Sets `r` to `status` with `body` taken verbatim (copied). */
void fake_reply_raw(fake_reply_t *r, unsigned status, const char *body);
void fake_reply_clear(fake_reply_t *r);

/* What the store remembers about one tool request (any field may be NULL). */
typedef struct fake_request_info {
    const char *method;
    const char *path;
    const char *op;
    const char *collection;
    const char *idempotency_key;
    const char *run_id;
    const char *effect_id;
    const char *traceparent;
    const char *if_match;
    int signature_ok; /* 1, 0, or -1 when no secret is configured */
} fake_request_info_t;

/* Returns NULL only when out of memory. */
fake_store_t *fake_store_new(void);
/* Accepts NULL. */
void fake_store_free(fake_store_t *st);
/* Forgets every record, reversal, containment and logged request; ids restart at 1. */
void fake_store_reset(fake_store_t *st);

/* How the records an execute creates look (the hostile answers of README.md); zero is the
 * ordinary "<collection>_<n>" id and integer version. */
typedef struct fake_shape {
    size_t id_bytes;   /* > 0: the id is padded to this many bytes (huge_id) */
    size_t etag_bytes; /* > 0: "version" is an opaque string this long (etag_version) */
} fake_shape_t;

/* Execute (or, with `containment`, a containment action): the first request with `key` in
 * `collection` creates `copies` records (2 models an upstream duplicate) shaped by `shape`
 * (NULL: ordinary) and answers 201 with the first; the same key with byte-identical `raw`
 * answers 200 with that record, replayed; with other bytes 422. `raw` must be valid JSON (the
 * record's "body" is `raw` parsed). */
void fake_store_execute(fake_store_t *st, const char *collection, bool containment, const char *key,
                        const char *raw, size_t raw_len, const char *run_id, const char *effect_id,
                        int copies, const fake_shape_t *shape, fake_reply_t *out);

/* Status check: 200 with the JSON array of every record carrying `key` in `collection`. */
void fake_store_status(fake_store_t *st, const char *collection, const char *key,
                       fake_reply_t *out);

/* A list query (GET /<c>/list), already checked by the HTTP layer: `by_run` selects the
 * records whose creating request carried Tally-Run-Id `run_id`, else those created at or after
 * `since_ms`. Strings are borrowed. */
typedef struct fake_list_query {
    bool by_run;
    const char *run_id; /* by_run: UTF-8, not empty */
    long long since_ms; /* !by_run: ms since the epoch, rounded up (fake_rfc3339_ms) */
    unsigned limit;     /* 1..FAKE_LIST_MAX */
    const char *cursor; /* NULL: the first page */
} fake_list_query_t;

#define FAKE_LIST_DEFAULT 100
#define FAKE_LIST_MAX     1000

/* List: 200 with {"records":[...],"next_cursor":"..."|null}, the records of `collection` (a
 * containment collection "C_containments" too) oldest first, at most q->limit of them, each as
 * the status check shows it plus "tally_headers" (the Idempotency-Key, Tally-Run-Id and
 * Tally-Effect-Id it was created with, those sent). A cursor that is not one this store gave
 * for this query since the last reset: 400. */
void fake_store_list(fake_store_t *st, const char *collection, const fake_list_query_t *q,
                     fake_reply_t *out);

/* Reads an RFC 3339 date-time ("2026-11-26T23:32:27.123Z", "...+01:00"; any number of
 * fraction digits, leap second 60 allowed) into ms since the epoch, rounded up so that a record
 * whose created_at (ms) is at or after the time passes `>=`. Returns false when malformed. */
bool fake_rfc3339_ms(const char *s, long long *ms);

/* Reverse `external_ref` of `collection` under `reverse_key` (see README for the answers).
 * `if_match` is the raw If-Match header or NULL. Does not take ownership of `request`. */
void fake_store_reverse(fake_store_t *st, const char *collection, const char *reverse_key,
                        const char *external_ref, const json_t *request, const char *if_match,
                        const char *run_id, const char *effect_id, fake_reply_t *out);

/* {"records":[...],"reversals":[...],"containments":[...],"requests":N}, optionally limited
 * to one collection (NULL: all). Returns malloc'd JSON text the caller frees, NULL on OOM. */
char *fake_store_dump(fake_store_t *st, const char *collection);

/* Appends a request to the log (the last FAKE_STORE_LOG_SIZE are kept) and returns its
 * sequence number, to pass to fake_store_log_end() once the answer is known. */
uint64_t fake_store_log_begin(fake_store_t *st, const fake_request_info_t *info);
/* Records the answer of request `seq` (status 0: the connection was dropped) and the fault
 * injected into it (NULL for none). */
void fake_store_log_end(fake_store_t *st, uint64_t seq, unsigned status, const char *fault);
/* The logged requests as a JSON array, oldest first. Returns malloc'd text the caller frees. */
char *fake_store_requests(fake_store_t *st);

#define FAKE_STORE_LOG_SIZE 10000

/* Whether `s` is UTF-8 (RFC 3629). */
bool fake_utf8_valid(const char *s);

/* RFC 3339 UTC time with milliseconds of now into buf (at least 32 bytes). */
void fake_now_rfc3339(char *buf, size_t bufsz);

#endif
