/* connector.h — the HTTP connector of DESIGN §6: many concurrent calls in one thread (libcurl
 * multi; the caller's, or a thread of the engine's own), request building (idempotency key,
 * run/effect ids, traceparent, HMAC signature) and the classification of every answer into
 * what the ledger does next. Three files behind one header: connector_classify.c and
 * connector_receipt.c (answers: pure), connector_request.c (what is sent), connector.c (the
 * curl engine). */
#ifndef TALLY_CONNECTOR_H
#define TALLY_CONNECTOR_H

#include <stdbool.h>
#include <stddef.h>
#include <time.h>
#include <curl/curl.h>
#include <jansson.h>

#include "tally/error.h"
#include "tally/json.h"
#include "tally/metrics.h"
#include "tally/registry.h"
#include "tally/text.h"

/** Default cap on a response body kept in memory; the rest is read and dropped. */
#define TALLY_CONN_MAX_BODY (1024 * 1024)

typedef enum {
    TALLY_CONN_EXECUTE = 0, /**< POST base_url+execute.path, body = canonical args */
    TALLY_CONN_STATUS,      /**< GET base_url+status.path?idempotency_key=<key>, no body */
    TALLY_CONN_COMPENSATE,  /**< POST base_url+compensate.path, the reverse body */
    TALLY_CONN_CONTAIN,     /**< append_only containment action (connector.contain) */
    TALLY_CONN_LIST,        /**< GET base_url+list.path?<query>: the records a tool holds */
} tally_conn_op_t;

const char *tally_conn_op_name(tally_conn_op_t op);

/** @brief One call to make. Every string is copied by tally_connector_submit. */
typedef struct tally_conn_request {
    const tally_tool_t *tool; /**< borrowed; must outlive the call (the registry does) */
    tally_conn_op_t op;
    const char *idempotency_key; /**< operation key, or "reverse:<obligation id>" */
    const char *run_id;          /**< Tally-Run-Id; may be NULL */
    const char *effect_id;       /**< Tally-Effect-Id; may be NULL */
    const char *traceparent;     /**< W3C traceparent; may be NULL */
    const char *if_match;        /**< If-Match (compensate stale-state guard); may be NULL */
    const char *query; /**< list: the query string without '?', percent-encoded by the caller */
    const char *body;  /**< JSON body; NULL for status */
    size_t body_len;
    void *opaque; /**< handed back in the result */
} tally_conn_request_t;

/**
 * @brief What happened to one call, as the transport saw it. Handed to the completion
 * callback; every pointer is valid only during the callback.
 *
 * @remark How `sent` is decided. A request counts as "not sent" only when curl failed before
 * any request byte could have left: name resolution failed (CURLE_COULDNT_RESOLVE_*), the
 * connection was refused or could not be made (CURLE_COULDNT_CONNECT), the TLS handshake
 * failed, or the transfer timed out while still connecting — CURLINFO_PRETRANSFER_TIME_T is 0
 * (curl never reached the point of writing the request) and CURLINFO_REQUEST_SIZE is 0 (no
 * request byte was written). Everything else — a timeout after the request went out, a reset,
 * an empty reply, any answer — is "sent". The bias is deliberate: calling a sent request "not
 * sent" would retry it blindly, calling an unsent one "sent" only costs a status check.
 * @remark curl itself re-sends a request, without telling, when a *reused* keep-alive
 * connection dies before a single response byte arrives (there is no option to turn it off).
 * For a call with side effects that re-send would turn "reset after sending" (UNKNOWN) into a
 * blind retry. Such calls (tally_conn_no_replay) still ride kept-alive connections, but curl's
 * pre-request callback refuses a second request within one call: the re-send never leaves,
 * and the call ends as sent with no answer (curl_code CURLE_GOT_NOTHING, `sent` true, so
 * UNKNOWN for the reconciler to settle). Read and idempotent tools, status checks and reverse
 * calls (retried with the same key anyway) let curl re-send.
 */
typedef struct tally_conn_result {
    void *opaque;
    const tally_tool_t *tool;
    tally_conn_op_t op;
    const char *method;
    const char *url;
    int curl_code;          /**< CURLcode; 0 (CURLE_OK) when an answer arrived whole */
    const char *curl_error; /**< curl's message, "" when none */
    bool sent;              /**< see the remark above */
    long http_status;       /**< 0 when no status line arrived */
    long retry_after_ms;    /**< Retry-After (seconds or HTTP date) in ms; -1 when absent */
    double seconds;         /**< submit to completion */
    const char *body;       /**< response body, NUL-terminated, at most the body cap */
    size_t body_len;        /**< bytes in @p body */
    size_t body_total;      /**< bytes the tool sent (larger than body_len when truncated) */
    bool body_truncated;
} tally_conn_result_t;

/* ---------------------------------------------------------------------------------------- */
/* Answers: verdicts (connector_classify.c), receipts and excerpts (connector_receipt.c)    */

/** @brief What the ledger does next with a call's answer. */
typedef enum {
    TALLY_VERDICT_CONFIRMED = 0, /**< execute 2xx: the effect happened */
    TALLY_VERDICT_FAILED,        /**< execute definite failure: it did not and will not happen */
    TALLY_VERDICT_RETRY,         /**< not applied / in progress / transient: same key, later */
    TALLY_VERDICT_UNKNOWN,       /**< execute: it may or may not have happened */
    TALLY_VERDICT_NOT_FOUND,     /**< status: 200 [] */
    TALLY_VERDICT_FOUND,         /**< status: 200 [one record] */
    TALLY_VERDICT_DUPLICATE,     /**< status: 200 [two or more records] */
    TALLY_VERDICT_INCONCLUSIVE,  /**< status: anything else */
    TALLY_VERDICT_RESOLVED,      /**< compensate 2xx, or 404 (already reversed) */
    TALLY_VERDICT_STUCK,         /**< compensate 412 (stale_state) or another 4xx */
} tally_verdict_t;

const char *tally_verdict_name(tally_verdict_t v);

typedef struct tally_conn_verdict {
    tally_verdict_t verdict;
    bool alert_owner;    /**< 401/403: the tool refused tally's credentials; page its owner */
    bool in_progress;    /**< 409: the same key is still being processed upstream */
    long retry_after_ms; /**< the tool's Retry-After, -1 when it gave none */
    size_t n_records;    /**< status: the number of upstream records */
    char code[32];       /**< "http_404", "not_sent", "timeout", "no_response", "stale_state" */
    char message[256];   /**< one sentence for error_message and the audit trail */
} tally_conn_verdict_t;

/**
 * @brief DESIGN §6 execute. 2xx CONFIRMED (a 2xx whose body did not arrive whole is UNKNOWN:
 * the effect happened but the receipt is missing, so the reconciler fetches it); 408, 425,
 * 429, 503 RETRY honouring Retry-After; 409 RETRY (in progress); 401/403 FAILED with
 * alert_owner; other 4xx FAILED; not sent RETRY; sent without an answer, 3xx and other 5xx
 * UNKNOWN.
 */
void tally_conn_classify_execute(const tally_conn_result_t *res, tally_conn_verdict_t *out);

/**
 * @brief DESIGN §6 status. 200 with a JSON array: NOT_FOUND, FOUND or DUPLICATE by its
 * length (n_records); anything else INCONCLUSIVE.
 */
void tally_conn_classify_status(const tally_conn_result_t *res, tally_conn_verdict_t *out);

/**
 * @brief DESIGN §6 compensate (also used for containment actions). 2xx and 404 RESOLVED;
 * 412 STUCK (code "stale_state"); 409 RETRY (in progress); 408, 425, 429 RETRY (the tool
 * refused the request unprocessed, Retry-After honoured); other 4xx STUCK; not sent, no
 * answer, 3xx and 5xx RETRY (same reverse key; the caller goes STUCK when attempts run out).
 */
void tally_conn_classify_compensate(const tally_conn_result_t *res, tally_conn_verdict_t *out);

/**
 * @brief The receipt of a call: the response body when it is a JSON object; otherwise an
 * object describing what came back ({"http_status", "bytes", "truncated", and "body" (a
 * JSON value that is not an object) or "excerpt" (tally_conn_excerpt)}). Never contains U+0000, so
 * it fits jsonb.
 * @returns a new reference, or NULL when out of memory.
 */
json_t *tally_conn_receipt(const tally_conn_result_t *res) TALLY_WUR;

/**
 * @brief The external ref: tool->receipt_ref resolved in @p receipt, as text.
 * @returns malloc'd text, or NULL when the pointer does not resolve to a scalar.
 */
char *tally_conn_external_ref(const tally_tool_t *tool, const json_t *receipt) TALLY_WUR;

/**
 * @brief @p ref when it is at most TALLY_LIMIT_EXTERNAL_REF bytes (text.h), the one size the
 * ledger's indexes and the obligations take. A longer one is freed and NULL returned, its
 * length in @p *over (0 otherwise): a tool's answer over a limit is evidence, kept in the
 * receipt, never an index key.
 */
char *tally_conn_ref_within_limit(char *ref, size_t *over) TALLY_WUR;

/**
 * @brief tally_conn_receipt as compact JSON text in @p receipt, and tally_conn_external_ref of
 * it in @p external_ref (NULL when it does not resolve), both malloc'd. A body that is a plain
 * JSON object (tally_json_object_compact) is kept as text without a jansson tree; anything
 * else goes through tally_conn_receipt. false, with both NULL, when out of memory.
 */
bool tally_conn_receipt_text(const tally_conn_result_t *res, const tally_tool_t *tool,
                             char **receipt, char **external_ref) TALLY_WUR;

/**
 * @brief At most @p max bytes of the body for logs and the audit trail: {"text": ...} when it
 * is valid UTF-8 without U+0000 (cut at a character boundary), else {"base64": ...}; plus
 * "truncated" when shortened. @returns a new reference, or NULL when out of memory.
 */
json_t *tally_conn_excerpt(const char *body, size_t len, size_t max) TALLY_WUR;

/** @brief The same excerpt written as the member @p key of the object open in @p j. */
void tally_conn_excerpt_text(tally_jtext_t *j, const char *key, const char *body, size_t len,
                             size_t max);

/**
 * @brief In the audit data of a call whose answer is its effect's receipt, the member
 * `"receipt":{"on":"effect"}` in place of the answer (ledger.h, TALLY_RECEIPT_ON_EFFECT): the
 * statement that writes the event adds the receipt's "sha256" as the effect row holds it.
 */
void tally_conn_receipt_ref_text(tally_jtext_t *j);

/** @brief What a "connector_call" event's "receipt" member says of its effect's receipt. */
typedef enum {
    TALLY_RECEIPT_REF_NONE,       /**< no reference: the event holds the answer itself (0.2.0
                                       and every attempt whose answer is not the receipt) */
    TALLY_RECEIPT_REF_MATCH,      /**< the effect's receipt is the one the call stored */
    TALLY_RECEIPT_REF_MISMATCH,   /**< the effect's receipt changed after the call stored it */
    TALLY_RECEIPT_REF_UNVERIFIED, /**< a reference, but no hash to compare (either side) */
} tally_receipt_ref_t;

/**
 * @brief What the "receipt" member @p ref of a "connector_call" event's data (NULL when it has
 * none) says of the effect's receipt, whose hex SHA-256 as stored is @p receipt_sha256 (NULL
 * when not known; TALLY_SQL_RECEIPT_SHA256).
 */
tally_receipt_ref_t tally_conn_receipt_ref_check(const json_t *ref, const char *receipt_sha256);

/* ---------------------------------------------------------------------------------------- */
/* Requests (connector_request.c)                                                           */

/**
 * @brief Tally-Signature value "t=<t>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>" in @p out.
 * @returns false when @p outsz is too small or OpenSSL fails.
 */
bool tally_conn_signature(const char *secret, long long t, const char *body, size_t body_len,
                          char *out, size_t outsz) TALLY_WUR;

/**
 * @brief RFC 9530 Content-Digest of @p body: "sha-256=:<base64 of SHA-256>:".
 * @returns malloc'd value, or NULL when out of memory or OpenSSL fails.
 */
char *tally_conn_content_digest(const char *body, size_t body_len) TALLY_WUR;

/** @brief What an RFC 9421 signature (label "tally", alg "hmac-sha256") is made with. */
typedef struct tally_conn_sig_params {
    const char *key_id; /**< keyid parameter; printable ASCII without '"' or '\\' */
    long long created;  /**< unix seconds */
    long long expires;  /**< unix seconds */
} tally_conn_sig_params_t;

/**
 * @brief The RFC 9421 §2.5 signature base of a request and its Signature-Input member value.
 * Covered, in this order and only when present: "@method", "@target-uri", "content-digest"
 * (when @p content_digest is not NULL), "idempotency-key", "tally-run-id", "tally-effect-id",
 * "if-match" (the values of @p req, leading and trailing spaces and tabs removed as §2.1
 * says); then the "@signature-params" line. Values are copied whole, never cut.
 * @param input receives the malloc'd inner list with parameters,
 * `("@method" ...);created=..;expires=..;keyid="..";alg="hmac-sha256"`.
 * @returns the malloc'd base (lines joined by "\n", no trailing newline), or NULL when out
 * of memory or when the key id cannot be a structured-field string.
 */
char *tally_conn_sig_base(const tally_conn_request_t *req, const char *method, const char *url,
                          const char *content_digest, const tally_conn_sig_params_t *params,
                          char **input) TALLY_WUR;

/**
 * @brief Base64 of HMAC-SHA256(@p key, @p base) in @p out (44 characters and a NUL).
 * @returns false when @p outsz is too small or OpenSSL fails.
 */
bool tally_conn_sig_hmac(const char *key, const char *base, char *out, size_t outsz) TALLY_WUR;

/** @brief How to sign one request; every member may be NULL (no such signature). */
typedef struct tally_conn_signing {
    const char *legacy_secret; /**< Tally-Signature (t=,v1=) with this secret */
    const char *key_id;        /**< RFC 9421 key id, with @p key */
    const char *key;           /**< RFC 9421 HMAC key; NULL for no RFC 9421 signature */
    int window_s;              /**< expires = created + window_s */
} tally_conn_signing_t;

/**
 * @brief The URL of @p op for @p tool: base_url + path, and for status
 * "?idempotency_key=<percent-encoded key>" (or "&..." when the path has a query); for list,
 * @p idempotency_key is the query itself, already percent-encoded, appended after '?'.
 * @returns malloc'd URL, or NULL with the reason in @p err (the tool has no such endpoint).
 */
char *tally_conn_url(const tally_tool_t *tool, tally_conn_op_t op, const char *idempotency_key,
                     tally_error_t *err) TALLY_WUR;

/**
 * @brief The request headers: Idempotency-Key, Tally-Run-Id, Tally-Effect-Id, traceparent,
 * If-Match (each when given), Content-Type: application/json and an empty Expect (when there
 * is a body), Accept: application/json, and Tally-Signature at time @p now when @p secret is
 * not NULL. Header values are refused (NULL, TALLY_ERR_INVALID_HEADER) when they hold a
 * control character, so an argument can never inject a header.
 * @returns a list the caller frees with curl_slist_free_all, or NULL with @p err set.
 */
struct curl_slist *tally_conn_headers(const tally_conn_request_t *req, const char *secret,
                                      long long now, tally_error_t *err) TALLY_WUR;

/**
 * @brief tally_conn_headers with every signature @p sign asks for: Tally-Signature (legacy)
 * and, with an RFC 9421 key, Content-Digest (when there is a body), Signature-Input and
 * Signature (label "tally") over @p method and @p url as sent (tally_conn_sig_base).
 */
struct curl_slist *tally_conn_headers_signed(const tally_conn_request_t *req, const char *method,
                                             const char *url, const tally_conn_signing_t *sign,
                                             long long now, tally_error_t *err) TALLY_WUR;

/**
 * @brief true when curl may not send a call's request a second time on its own (see the
 * remark on tally_conn_result_t): execute and contain calls of tools that are neither read
 * nor idempotent.
 */
bool tally_conn_no_replay(const tally_tool_t *tool, tally_conn_op_t op);

/** @brief The HTTP method of @p op for @p tool ("GET" for status when undeclared). */
const char *tally_conn_method(const tally_tool_t *tool, tally_conn_op_t op);

/* ---------------------------------------------------------------------------------------- */
/* The engine (connector.c)                                                                 */

typedef struct tally_connector tally_connector_t;

/** @brief Receives each finished call. Runs inside tally_connector_poll, or on the engine's
 * thread after tally_connector_start. The call still counts as in flight until it returns. */
typedef void (*tally_conn_done_fn)(const tally_conn_result_t *res, void *opaque);

/**
 * @brief An engine for at most @p max_inflight concurrent calls (and, per tool, at most
 * tool->max_concurrency), keeping at most @p max_body bytes of each response (0: the default
 * TALLY_CONN_MAX_BODY). @returns NULL with the reason in @p errstr.
 */
tally_connector_t *tally_connector_new(int max_inflight, size_t max_body, char *errstr,
                                       size_t errsz) TALLY_WUR;

/**
 * @brief Start one call (timeout = tool->timeout_ms). The signing secrets are read from the
 * environment variables tool->secret_env (Tally-Signature) and tool->signing.secret_env
 * (RFC 9421) at submit time.
 * @returns false with @p err when the call could not be started, and nothing was sent:
 * TALLY_ERR_CAPACITY (global or per-tool cap reached; retriable), TALLY_ERR_SECRET_MISSING (a
 * secret variable of the tool is unset or empty; retriable once an operator sets it),
 * TALLY_ERR_INVALID_HEADER, TALLY_ERR_NO_ENDPOINT, TALLY_ERR_SIGNATURE, TALLY_ERR_CURL or
 * TALLY_ERR_OOM.
 */
bool tally_connector_submit(tally_connector_t *c, const tally_conn_request_t *req,
                            tally_error_t *err) TALLY_WUR;

/** @brief How many more calls to @p tool may start now: min(per-tool room, global room). */
int tally_connector_capacity(const tally_connector_t *c, const tally_tool_t *tool);

/** @brief Calls in flight, in total and for one tool. */
int tally_connector_inflight(const tally_connector_t *c);
int tally_connector_tool_inflight(const tally_connector_t *c, const tally_tool_t *tool);

/**
 * @brief Set @p gauge{tool} (a gauge family labelled "tool") to the calls in flight of each tool
 * whose count moved since the last publish: a count goes up when a call is submitted and down
 * when it leaves by any path (answer, timeout, error) once its callback has returned. A tool
 * never called is not written: declare its series at 0. Call it where the worker refreshes its
 * other gauges (once per loop turn), from the thread that submits.
 */
void tally_connector_publish_inflight(tally_connector_t *c, tally_metric_t *gauge);

/**
 * @brief Drive the calls: perform, wait up to @p timeout_ms (curl_multi_poll) for curl's
 * sockets or any of @p extra (their revents are filled in; @p extra may be NULL), perform
 * again, and hand every finished call to @p done. Returns at once when a call finishes or an
 * extra fd is ready. @returns the number of calls finished, or -1 with @p err on a curl error.
 */
int tally_connector_poll(tally_connector_t *c, struct curl_waitfd *extra, unsigned n_extra,
                         int timeout_ms, tally_conn_done_fn done, void *opaque, tally_error_t *err);

/** @brief Make a poll in progress return early (safe from any thread). */
void tally_connector_wakeup(tally_connector_t *c);

/**
 * @brief Drive the calls on a thread of the engine's own, handing each finished call to
 * @p done there. From then on tally_connector_poll must not be called; submit, capacity and
 * the in-flight counts may be used from one other thread (the one that submits), and calls
 * progress while that thread is busy elsewhere (a database round trip, say).
 * @returns false with the reason in @p errstr when the thread cannot start.
 */
bool tally_connector_start(tally_connector_t *c, tally_conn_done_fn done, void *opaque,
                           char *errstr, size_t errsz) TALLY_WUR;

/** @brief Stop and join the engine's thread (calls in flight stay; NULL is allowed). */
void tally_connector_stop(tally_connector_t *c);

/**
 * @brief Free the engine (stopping its thread first). Calls still in flight are abandoned
 * without a result (their connections are closed; the ledger's leases say what happens to
 * them). NULL is allowed.
 * @param abandoned when not NULL, receives the opaque pointer of each abandoned call so the
 * caller can free its context.
 */
void tally_connector_free(tally_connector_t *c, void (*abandoned)(void *opaque));

#endif
