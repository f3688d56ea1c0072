/* Switchable faults of the fake tool: an ordered list of rules set through the control API,
 * each consumed by the requests it matches. */
#ifndef TALLY_FAKE_FAULTS_H
#define TALLY_FAKE_FAULTS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

typedef enum fake_fault_kind {
    FAKE_FAULT_NONE = 0,
    FAKE_FAULT_SLOW,              /* sleep delay_ms, then behave normally */
    FAKE_FAULT_REFUSE_503,        /* 503 + Retry-After, not applied */
    FAKE_FAULT_REFUSE_429,        /* 429 + Retry-After, not applied */
    FAKE_FAULT_ERROR_4XX,         /* answer `status` (400), not applied */
    FAKE_FAULT_FAIL_AFTER_APPLY,  /* apply, then answer `status` (500) */
    FAKE_FAULT_APPLY_THEN_HANG,   /* apply, sleep delay_ms (30000), then answer */
    FAKE_FAULT_HANG_BEFORE_APPLY, /* sleep delay_ms (30000), answer 503, not applied */
    FAKE_FAULT_APPLY_TWICE,       /* create two records for one key; answer `status`: 2xx (201)
                                     with the first record (a duplicate behind a success), 4xx or
                                     5xx with an error (a duplicate whose answer is lost) */
    FAKE_FAULT_REVERSE_412,       /* 412, not applied */
    FAKE_FAULT_REVERSE_500,       /* 500, not applied */
    FAKE_FAULT_REVERSE_409,       /* 409 (same key in progress), not applied */
    FAKE_FAULT_STATUS_500,        /* 500 */
    FAKE_FAULT_STATUS_GARBAGE,    /* 200 with a body that is not JSON */
    FAKE_FAULT_DROP_CONNECTION,   /* apply, then close the connection without an answer */
    /* Hostile answers: the operation is applied, and what comes back is hard to digest. */
    FAKE_FAULT_HUGE_ID,          /* the new record's id is `size` bytes long (10240) */
    FAKE_FAULT_ETAG_VERSION,     /* the new record's version is an opaque `size`-byte string
                                    (64: a SHA-256 in hex), If-Match must name it whole */
    FAKE_FAULT_RECEIPT_NOT_UTF8, /* a 2xx answer whose JSON holds bytes that are not UTF-8 */
    FAKE_FAULT_RECEIPT_NOT_JSON, /* a 2xx answer whose body is not JSON (text/html) */
} fake_fault_kind_t;

/* The fault a request gets: kind, and its delay, status and size with the defaults applied. */
typedef struct fake_fault {
    fake_fault_kind_t kind;
    unsigned delay_ms;
    unsigned status;
    size_t size; /* bytes, for huge_id and etag_version; 0 for the others */
} fake_fault_t;

typedef struct fake_faults fake_faults_t;

/* Returns NULL only when out of memory. */
fake_faults_t *fake_faults_new(void);
/* Accepts NULL. */
void fake_faults_free(fake_faults_t *ff);

/* Adds the rule described by `rule` (see README) at the end of the list. On success returns
 * the rule as stored (a new reference the caller decrefs); on a bad rule returns NULL with
 * the reason in errstr. */
json_t *fake_faults_add(fake_faults_t *ff, const json_t *rule, char *errstr, size_t errsz)
    __attribute__((warn_unused_result));
void fake_faults_clear(fake_faults_t *ff);
/* The rules still active, in match order (a new reference the caller decrefs). */
json_t *fake_faults_list(fake_faults_t *ff);

/* The first rule matching (collection, op, key) is consumed once and its fault returned;
 * kind FAKE_FAULT_NONE when no rule matches. `key` may be NULL (only "*" matches it). */
fake_fault_t fake_faults_take(fake_faults_t *ff, const char *collection, const char *op,
                              const char *key);

/* The name used in rules and logs ("refuse_503"), NULL for FAKE_FAULT_NONE. */
const char *fake_fault_name(fake_fault_kind_t kind);

#endif
