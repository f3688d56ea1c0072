/* fake_sig9421.h — the fake tool's RFC 9421 verifier (HMAC-SHA256, label "tally") with the
 * RFC 9530 Content-Digest check, written from the RFCs and sharing no code with tally's
 * signer, so a mistake on one side shows as a refusal on the other. */
#ifndef FAKE_SIG9421_H
#define FAKE_SIG9421_H

#include <stdbool.h>
#include <stddef.h>

/** One key the verifier accepts: its id and its HMAC key (borrowed). */
typedef struct fake_sig_key {
    const char *id;
    const char *value;
    size_t len;
} fake_sig_key_t;

/** The request as received. @p header returns a field's value (NULL when absent). */
typedef struct fake_sig_request {
    const char *method;
    const char *raw_uri; /* the request target as sent: path and query, undecoded */
    const char *body;
    size_t len;
    const char *(*header)(void *ctx, const char *name);
    void *ctx;
} fake_sig_request_t;

/**
 * Verifies the "tally" signature of @p rq against @p keys at time @p now. Required: a
 * Signature-Input and Signature member "tally", alg "hmac-sha256" (when given), a known
 * keyid, created not in the future (60 s leeway) and not older than 300 s, expires not
 * passed, covered components including "@method", "@target-uri", every one of
 * idempotency-key, tally-run-id, tally-effect-id and if-match the request carries, and
 * "content-digest" when there is a body, whose Content-Digest must match the body.
 * @returns NULL when it verifies, else why not (in @p why).
 */
const char *fake_sig9421_verify(const fake_sig_key_t *keys, size_t nkeys,
                                const fake_sig_request_t *rq, long long now, char *why,
                                size_t whysz);

#endif
