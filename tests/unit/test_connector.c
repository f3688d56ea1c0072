/* test_connector.c — DESIGN §6 classification row by row, the signature vector, header and
 * URL building, receipts, and the engine against a local HTTP responder (no services). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tally/connector.h"

static tally_tool_t demo_tool(void)
{
    tally_tool_t t = {0};
    t.name = (char *)"charge_card";
    t.owner = (char *)"billing";
    t.effect_class = TALLY_CLASS_REVERSIBLE;
    t.base_url = (char *)"http://127.0.0.1:9";
    t.execute = (tally_endpoint_t){(char *)"POST", (char *)"/charges"};
    t.status = (tally_endpoint_t){(char *)"GET", (char *)"/charges"};
    t.compensate = (tally_endpoint_t){(char *)"POST", (char *)"/refunds"};
    t.timeout_ms = 2000;
    t.receipt_ref = (char *)"/id";
    t.max_concurrency = 2;
    return t;
}

/* ---------------------------------------------------------------------------------------- */
/* Classification tables: one row per line of DESIGN §6                                    */

typedef struct row {
    const char *what;
    bool sent;
    int curl_code;
    long status;
    const char *body;
    bool truncated;
    tally_verdict_t want;
    bool alert;
    bool in_progress;
    const char *code;
} row_t;

static tally_conn_result_t result_of(const row_t *r)
{
    tally_conn_result_t res = {
        .method = "POST",
        .url = "http://tool/x",
        .curl_code = r->curl_code,
        .curl_error = "",
        .sent = r->sent,
        .http_status = r->status,
        .retry_after_ms = -1,
        .body = r->body ? r->body : "",
        .body_len = r->body ? strlen(r->body) : 0,
        .body_total = r->body ? strlen(r->body) : 0,
        .body_truncated = r->truncated,
    };
    return res;
}

static void check_rows(const row_t *rows, size_t n,
                       void (*classify)(const tally_conn_result_t *, tally_conn_verdict_t *))
{
    for (size_t i = 0; i < n; i++) {
        tally_conn_result_t res = result_of(&rows[i]);
        tally_conn_verdict_t v;
        classify(&res, &v);
        if (v.verdict != rows[i].want || v.alert_owner != rows[i].alert ||
            v.in_progress != rows[i].in_progress ||
            (rows[i].code && strcmp(v.code, rows[i].code) != 0))
            fail_msg("row '%s': got %s (code %s, alert %d, in_progress %d), want %s (code %s)",
                     rows[i].what, tally_verdict_name(v.verdict), v.code, v.alert_owner,
                     v.in_progress, tally_verdict_name(rows[i].want),
                     rows[i].code ? rows[i].code : "any");
        assert_true(v.message[0] != '\0');
    }
}

static void test_execute_table(void **state)
{
    (void)state;
    static const row_t rows[] = {
        {"200", true, CURLE_OK, 200, "{\"id\":\"ch_1\"}", false, TALLY_VERDICT_CONFIRMED, false,
         false, "http_200"},
        {"201", true, CURLE_OK, 201, "{}", false, TALLY_VERDICT_CONFIRMED, false, false, NULL},
        {"204", true, CURLE_OK, 204, "", false, TALLY_VERDICT_CONFIRMED, false, false, NULL},
        {"2xx over the body cap", true, CURLE_OK, 200, "{\"id\"", true, TALLY_VERDICT_CONFIRMED,
         false, false, NULL},
        {"2xx body cut by a timeout", true, CURLE_OPERATION_TIMEDOUT, 200, "{", false,
         TALLY_VERDICT_UNKNOWN, false, false, "incomplete_body"},
        {"400", true, CURLE_OK, 400, "", false, TALLY_VERDICT_FAILED, false, false, "http_400"},
        {"401", true, CURLE_OK, 401, "", false, TALLY_VERDICT_FAILED, true, false, "http_401"},
        {"403", true, CURLE_OK, 403, "", false, TALLY_VERDICT_FAILED, true, false, "http_403"},
        {"404", true, CURLE_OK, 404, "", false, TALLY_VERDICT_FAILED, false, false, "http_404"},
        {"422", true, CURLE_OK, 422, "", false, TALLY_VERDICT_FAILED, false, false, "http_422"},
        {"410 (other 4xx)", true, CURLE_OK, 410, "", false, TALLY_VERDICT_FAILED, false, false,
         NULL},
        {"412 (other 4xx)", true, CURLE_OK, 412, "", false, TALLY_VERDICT_FAILED, false, false,
         NULL},
        {"408", true, CURLE_OK, 408, "", false, TALLY_VERDICT_RETRY, false, false, "http_408"},
        {"425", true, CURLE_OK, 425, "", false, TALLY_VERDICT_RETRY, false, false, "http_425"},
        {"429", true, CURLE_OK, 429, "", false, TALLY_VERDICT_RETRY, false, false, "http_429"},
        {"503", true, CURLE_OK, 503, "", false, TALLY_VERDICT_RETRY, false, false, "http_503"},
        {"409 in progress", true, CURLE_OK, 409, "", false, TALLY_VERDICT_RETRY, false, true,
         "http_409"},
        {"connection refused", false, CURLE_COULDNT_CONNECT, 0, NULL, false, TALLY_VERDICT_RETRY,
         false, false, "not_sent"},
        {"DNS failure", false, CURLE_COULDNT_RESOLVE_HOST, 0, NULL, false, TALLY_VERDICT_RETRY,
         false, false, "not_sent"},
        {"connect timeout", false, CURLE_OPERATION_TIMEDOUT, 0, NULL, false, TALLY_VERDICT_RETRY,
         false, false, "not_sent"},
        {"timeout after send", true, CURLE_OPERATION_TIMEDOUT, 0, NULL, false,
         TALLY_VERDICT_UNKNOWN, false, false, "timeout"},
        {"reset after send", true, CURLE_RECV_ERROR, 0, NULL, false, TALLY_VERDICT_UNKNOWN, false,
         false, "connection_reset"},
        {"empty reply", true, CURLE_GOT_NOTHING, 0, NULL, false, TALLY_VERDICT_UNKNOWN, false,
         false, "empty_reply"},
        {"500", true, CURLE_OK, 500, "", false, TALLY_VERDICT_UNKNOWN, false, false, "http_500"},
        {"502", true, CURLE_OK, 502, "", false, TALLY_VERDICT_UNKNOWN, false, false, "http_502"},
        {"504", true, CURLE_OK, 504, "", false, TALLY_VERDICT_UNKNOWN, false, false, "http_504"},
        {"303 (not a definite answer)", true, CURLE_OK, 303, "", false, TALLY_VERDICT_UNKNOWN,
         false, false, NULL},
    };
    check_rows(rows, sizeof rows / sizeof rows[0], tally_conn_classify_execute);
}

static void test_status_table(void **state)
{
    (void)state;
    static const row_t rows[] = {
        {"200 []", true, CURLE_OK, 200, "[]", false, TALLY_VERDICT_NOT_FOUND, false, false, NULL},
        {"200 [one]", true, CURLE_OK, 200, "[{\"id\":\"a\"}]", false, TALLY_VERDICT_FOUND, false,
         false, NULL},
        {"200 [two]", true, CURLE_OK, 200, "[{\"id\":\"a\"},{\"id\":\"b\"}]", false,
         TALLY_VERDICT_DUPLICATE, false, false, NULL},
        {"200 object", true, CURLE_OK, 200, "{\"id\":\"a\"}", false, TALLY_VERDICT_INCONCLUSIVE,
         false, false, "not_an_array"},
        {"200 not JSON", true, CURLE_OK, 200, "<html>", false, TALLY_VERDICT_INCONCLUSIVE, false,
         false, "not_an_array"},
        {"200 truncated", true, CURLE_OK, 200, "[{}", true, TALLY_VERDICT_INCONCLUSIVE, false,
         false, "incomplete_body"},
        {"404", true, CURLE_OK, 404, "[]", false, TALLY_VERDICT_INCONCLUSIVE, false, false,
         "http_404"},
        {"500", true, CURLE_OK, 500, "", false, TALLY_VERDICT_INCONCLUSIVE, false, false, NULL},
        {"timeout", true, CURLE_OPERATION_TIMEDOUT, 0, NULL, false, TALLY_VERDICT_INCONCLUSIVE,
         false, false, "timeout"},
        {"refused", false, CURLE_COULDNT_CONNECT, 0, NULL, false, TALLY_VERDICT_INCONCLUSIVE, false,
         false, "not_sent"},
    };
    check_rows(rows, sizeof rows / sizeof rows[0], tally_conn_classify_status);

    row_t two = rows[2];
    tally_conn_result_t res = result_of(&two);
    tally_conn_verdict_t v;
    tally_conn_classify_status(&res, &v);
    assert_int_equal(v.n_records, 2);
}

static void test_compensate_table(void **state)
{
    (void)state;
    static const row_t rows[] = {
        {"200", true, CURLE_OK, 200, "{\"id\":\"re_1\"}", false, TALLY_VERDICT_RESOLVED, false,
         false, NULL},
        {"202", true, CURLE_OK, 202, "", false, TALLY_VERDICT_RESOLVED, false, false, NULL},
        {"404 already reversed", true, CURLE_OK, 404, "", false, TALLY_VERDICT_RESOLVED, false,
         false, "already_reversed"},
        {"412 stale state", true, CURLE_OK, 412, "", false, TALLY_VERDICT_STUCK, false, false,
         "stale_state"},
        {"409 in progress", true, CURLE_OK, 409, "", false, TALLY_VERDICT_RETRY, false, true, NULL},
        {"400", true, CURLE_OK, 400, "", false, TALLY_VERDICT_STUCK, false, false, "http_400"},
        {"403", true, CURLE_OK, 403, "", false, TALLY_VERDICT_STUCK, false, false, "http_403"},
        {"422", true, CURLE_OK, 422, "", false, TALLY_VERDICT_STUCK, false, false, "http_422"},
        {"429", true, CURLE_OK, 429, "", false, TALLY_VERDICT_RETRY, false, false, NULL},
        {"500", true, CURLE_OK, 500, "", false, TALLY_VERDICT_RETRY, false, false, NULL},
        {"503", true, CURLE_OK, 503, "", false, TALLY_VERDICT_RETRY, false, false, NULL},
        {"timeout", true, CURLE_OPERATION_TIMEDOUT, 0, NULL, false, TALLY_VERDICT_RETRY, false,
         false, "timeout"},
        {"refused", false, CURLE_COULDNT_CONNECT, 0, NULL, false, TALLY_VERDICT_RETRY, false, false,
         "not_sent"},
    };
    check_rows(rows, sizeof rows / sizeof rows[0], tally_conn_classify_compensate);
}

static void test_retry_after_passed_through(void **state)
{
    (void)state;
    row_t r = {"429", true, CURLE_OK, 429, "", false, TALLY_VERDICT_RETRY, false, false, NULL};
    tally_conn_result_t res = result_of(&r);
    res.retry_after_ms = 7000;
    tally_conn_verdict_t v;
    tally_conn_classify_execute(&res, &v);
    assert_int_equal(v.retry_after_ms, 7000);
}

/* ---------------------------------------------------------------------------------------- */
/* Signature, headers, URL, receipts                                                        */

static void test_signature_vector(void **state)
{
    (void)state;
    const char *body = "{\"amount\":100,\"currency\":\"EUR\"}";
    char sig[128];
    assert_true(
        tally_conn_signature("whsec_test", 1700000000LL, body, strlen(body), sig, sizeof sig));
    /* printf '%s' '1700000000.{"amount":100,"currency":"EUR"}' \
     *   | openssl dgst -sha256 -hmac 'whsec_test' */
    assert_string_equal(
        sig, "t=1700000000,v1=7b1d5cfbd71e00e6b466b43e4c055c9d97b08c3c50955fb2e4b324bc1153ce6b");
    /* printf '%s' '1700000000.' | openssl dgst -sha256 -hmac 'whsec_test' (no body: status) */
    assert_true(tally_conn_signature("whsec_test", 1700000000LL, "", 0, sig, sizeof sig));
    assert_string_equal(
        sig, "t=1700000000,v1=5967f3c560522fa40cf2876ebc3c3a08551dd6959aaade3b413460591895bdcc");
    char small[16];
    assert_false(tally_conn_signature("k", 1, "x", 1, small, sizeof small));
}

static bool has_header(const struct curl_slist *l, const char *line)
{
    for (; l; l = l->next)
        if (strcmp(l->data, line) == 0)
            return true;
    return false;
}

static bool has_header_prefix(const struct curl_slist *l, const char *prefix)
{
    for (; l; l = l->next)
        if (strncmp(l->data, prefix, strlen(prefix)) == 0)
            return true;
    return false;
}

static void test_headers(void **state)
{
    (void)state;
    tally_tool_t tool = demo_tool();
    const char *body = "{\"amount\":100,\"currency\":\"EUR\"}";
    tally_conn_request_t req = {
        .tool = &tool,
        .op = TALLY_CONN_EXECUTE,
        .idempotency_key = "charge_card:t1:pay_42",
        .run_id = "run-1",
        .effect_id = "6f1c1a52-5f5e-4a53-9d43-0c6d1d3a2b11",
        .traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        .body = body,
        .body_len = strlen(body),
    };
    tally_error_t err;
    struct curl_slist *h = tally_conn_headers(&req, "whsec_test", 1700000000LL, &err);
    assert_non_null(h);
    assert_true(has_header(h, "Idempotency-Key: charge_card:t1:pay_42"));
    assert_true(has_header(h, "Tally-Run-Id: run-1"));
    assert_true(has_header(h, "Tally-Effect-Id: 6f1c1a52-5f5e-4a53-9d43-0c6d1d3a2b11"));
    assert_true(
        has_header(h, "traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    assert_true(has_header(h, "Content-Type: application/json"));
    assert_false(has_header_prefix(h, "Connection")); /* kept alive, see test_no_silent_replay */
    assert_true(has_header(h, "Tally-Signature: t=1700000000,v1="
                              "7b1d5cfbd71e00e6b466b43e4c055c9d97b08c3c50955fb2e4b324bc1153ce6b"));
    assert_false(has_header_prefix(h, "If-Match"));
    curl_slist_free_all(h);

    /* No secret, no traceparent: neither header; If-Match when given. */
    req.traceparent = NULL;
    req.if_match = "7";
    h = tally_conn_headers(&req, NULL, 1700000000LL, &err);
    assert_non_null(h);
    assert_false(has_header_prefix(h, "Tally-Signature"));
    assert_false(has_header_prefix(h, "traceparent"));
    assert_true(has_header(h, "If-Match: 7"));
    curl_slist_free_all(h);

    /* A key with CR LF would inject a header: refused. */
    req.idempotency_key = "k\r\nX-Evil: 1";
    h = tally_conn_headers(&req, NULL, 1, &err);
    assert_null(h);
    assert_int_equal(err.errc, TALLY_ERR_INVALID_HEADER);
    assert_false(err.retriable);
}

/* RFC 9421 vectors. The expected values were computed independently of this code with
 * /usr/bin/python3 (hashlib, hmac, base64), building the signature base by hand from
 * RFC 9421 §2.5: one line `"<component>": <value>` per covered component, then
 * `"@signature-params": <inner list with parameters>`, lines joined by "\n" without a
 * trailing one; the signature is base64(HMAC-SHA256(key, base)). The script:
 *   body = b'{"amount":100,"currency":"EUR"}'
 *   dig = "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
 *   comps = [("@method", "POST"), ("@target-uri", "http://127.0.0.1:9/charges"),
 *            ("content-digest", dig), ("idempotency-key", "charge_card:t1:pay_42"),
 *            ("tally-run-id", "run-1"), ("tally-effect-id", EFFECT)]
 *   params = "(" + " ".join('"%s"' % n for n, _ in comps) + ");created=1700000000;"
 *            'expires=1700000300;keyid="k-2026-11";alg="hmac-sha256"'
 *   base = "".join('"%s": %s\n' % c for c in comps) + '"@signature-params": ' + params
 *   base64.b64encode(hmac.new(b"whsec_test", base.encode(), hashlib.sha256).digest()) */
#define VEC_EFFECT "6f1c1a52-5f5e-4a53-9d43-0c6d1d3a2b11"
#define VEC_DIGEST "sha-256=:9Q02wXOUY+Vx2o6Sn96zvDXFv4YFHGU9amHe7csQlE4=:"
#define VEC_PARAMS_TAIL                                                                            \
    ";created=1700000000;expires=1700000300;keyid=\"k-2026-11\";alg=\"hmac-sha256\""

static void test_rfc9421_vector(void **state)
{
    (void)state;
    tally_tool_t tool = demo_tool();
    const char *body = "{\"amount\":100,\"currency\":\"EUR\"}";
    char *digest = tally_conn_content_digest(body, strlen(body));
    assert_string_equal(digest, VEC_DIGEST);
    tally_conn_request_t req = {
        .tool = &tool,
        .op = TALLY_CONN_EXECUTE,
        .idempotency_key = "charge_card:t1:pay_42",
        .run_id = "run-1",
        .effect_id = VEC_EFFECT,
        .traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        .body = body,
        .body_len = strlen(body),
    };
    tally_conn_sig_params_t p = {"k-2026-11", 1700000000LL, 1700000300LL};
    char *input = NULL;
    char *base =
        tally_conn_sig_base(&req, "POST", "http://127.0.0.1:9/charges", digest, &p, &input);
    const char *want_input = "(\"@method\" \"@target-uri\" \"content-digest\" \"idempotency-key\" "
                             "\"tally-run-id\" \"tally-effect-id\")" VEC_PARAMS_TAIL;
    assert_string_equal(input, want_input);
    char want_base[1024];
    snprintf(want_base, sizeof want_base,
             "\"@method\": POST\n"
             "\"@target-uri\": http://127.0.0.1:9/charges\n"
             "\"content-digest\": " VEC_DIGEST "\n"
             "\"idempotency-key\": charge_card:t1:pay_42\n"
             "\"tally-run-id\": run-1\n"
             "\"tally-effect-id\": " VEC_EFFECT "\n"
             "\"@signature-params\": %s",
             want_input);
    assert_string_equal(base, want_base);
    char sig[64];
    assert_true(tally_conn_sig_hmac("whsec_test", base, sig, sizeof sig));
    assert_string_equal(sig, "k7Gs+FWjrqvmTS+WECOeFjL6PE8kUCMdHHgNp0ehPWo=");
    char small[16];
    assert_false(tally_conn_sig_hmac("whsec_test", base, small, sizeof small));
    free(base);
    free(input);

    /* Every header on the wire, through the same path the engine uses. */
    tally_conn_signing_t sign = {.key_id = "k-2026-11", .key = "whsec_test", .window_s = 300};
    tally_error_t err;
    struct curl_slist *h = tally_conn_headers_signed(&req, "POST", "http://127.0.0.1:9/charges",
                                                     &sign, 1700000000LL, &err);
    assert_non_null(h);
    assert_true(has_header(h, "Content-Digest: " VEC_DIGEST));
    assert_true(has_header(h, "Signature-Input: tally=(\"@method\" \"@target-uri\" "
                              "\"content-digest\" \"idempotency-key\" \"tally-run-id\" "
                              "\"tally-effect-id\")" VEC_PARAMS_TAIL));
    assert_true(has_header(h, "Signature: tally=:k7Gs+FWjrqvmTS+WECOeFjL6PE8kUCMdHHgNp0ehPWo=:"));
    assert_true(has_header(h, "Idempotency-Key: charge_card:t1:pay_42"));
    assert_false(has_header_prefix(h, "Tally-Signature")); /* no legacy secret configured */
    curl_slist_free_all(h);

    /* Both at once (a receiver moving from the legacy scheme): both headers. */
    sign.legacy_secret = "whsec_test";
    h = tally_conn_headers_signed(&req, "POST", "http://127.0.0.1:9/charges", &sign, 1700000000LL,
                                  &err);
    assert_non_null(h);
    assert_true(has_header(h, "Tally-Signature: t=1700000000,v1="
                              "7b1d5cfbd71e00e6b466b43e4c055c9d97b08c3c50955fb2e4b324bc1153ce6b"));
    assert_true(has_header(h, "Signature: tally=:k7Gs+FWjrqvmTS+WECOeFjL6PE8kUCMdHHgNp0ehPWo=:"));
    curl_slist_free_all(h);

    /* If-Match (compensate) is covered when sent. */
    req.if_match = "3";
    sign.legacy_secret = NULL;
    h = tally_conn_headers_signed(&req, "POST", "http://127.0.0.1:9/refunds", &sign, 1700000000LL,
                                  &err);
    assert_non_null(h);
    assert_true(has_header_prefix(h, "Signature-Input: tally=(\"@method\" \"@target-uri\" "
                                     "\"content-digest\" \"idempotency-key\" \"tally-run-id\" "
                                     "\"tally-effect-id\" \"if-match\");created="));
    curl_slist_free_all(h);

    /* A key id that cannot be an sf-string is refused, not escaped into something else. */
    sign.key_id = "bad\"id";
    h = tally_conn_headers_signed(&req, "POST", "http://127.0.0.1:9/refunds", &sign, 1, &err);
    assert_null(h);
    assert_int_equal(err.errc, TALLY_ERR_SIGNATURE);
    free(digest);
}

/* The worked example of docs/connectors.md ("Signatures: RFC 9421"), so the page stays a
 * usable test vector; values from the same Python script with that request. */
static void test_rfc9421_doc_example(void **state)
{
    (void)state;
    tally_tool_t tool = demo_tool();
    const char *body = "{\"amount\":1200,\"currency\":\"EUR\",\"payment_id\":\"pay_42\","
                       "\"tenant_id\":\"t1\"}";
    tally_conn_request_t req = {
        .tool = &tool,
        .op = TALLY_CONN_EXECUTE,
        .idempotency_key = "charge_card:t1:pay_42",
        .run_id = "run-42",
        .effect_id = "6e1f3c2a-9b8d-4c7e-a1f0-2d3c4b5a6978",
        .body = body,
        .body_len = strlen(body),
    };
    tally_conn_signing_t sign = {
        .key_id = "billing-2026-11", .key = "whsec_example", .window_s = 300};
    tally_error_t err;
    struct curl_slist *h = tally_conn_headers_signed(
        &req, "POST", "https://billing.internal/charges", &sign, 1714564800LL, &err);
    assert_non_null(h);
    assert_true(
        has_header(h, "Content-Digest: sha-256=:/tvFIa6QclG/xLLkazdfJqGq3Sq4PCsBwCAfV1+iitQ=:"));
    assert_true(has_header(h, "Signature-Input: tally=(\"@method\" \"@target-uri\" "
                              "\"content-digest\" \"idempotency-key\" \"tally-run-id\" "
                              "\"tally-effect-id\");created=1714564800;expires=1714565100;"
                              "keyid=\"billing-2026-11\";alg=\"hmac-sha256\""));
    assert_true(has_header(h, "Signature: tally=:04gJy9I9tAq0xd+NOtpK1/hHhygN88uB62qM/jHQXng=:"));
    curl_slist_free_all(h);
}

/* The status GET: no body, so no Content-Digest and no "content-digest" component; the key
 * is covered twice, in the query of @target-uri and as idempotency-key. Expected signature
 * from the same script with the components below. */
static void test_rfc9421_status_get(void **state)
{
    (void)state;
    tally_tool_t tool = demo_tool();
    tally_conn_request_t req = {
        .tool = &tool,
        .op = TALLY_CONN_STATUS,
        .idempotency_key = "charge_card:t1:pay_42",
        .run_id = "run-1",
        .effect_id = VEC_EFFECT,
    };
    tally_error_t err;
    char *url = tally_conn_url(&tool, TALLY_CONN_STATUS, req.idempotency_key, &err);
    assert_string_equal(url,
                        "http://127.0.0.1:9/charges?idempotency_key=charge_card%3At1%3Apay_42");
    tally_conn_signing_t sign = {.key_id = "k-2026-11", .key = "whsec_test", .window_s = 300};
    struct curl_slist *h = tally_conn_headers_signed(&req, tally_conn_method(&tool, req.op), url,
                                                     &sign, 1700000000LL, &err);
    assert_non_null(h);
    assert_false(has_header_prefix(h, "Content-Digest"));
    assert_true(
        has_header(h, "Signature-Input: tally=(\"@method\" \"@target-uri\" "
                      "\"idempotency-key\" \"tally-run-id\" \"tally-effect-id\")" VEC_PARAMS_TAIL));
    assert_true(has_header(h, "Signature: tally=:QPbAy4zBB2z2eqqKrfZPza53BTwNsTnwXsEh9CJ+ax0=:"));
    curl_slist_free_all(h);
    /* Without the method and URL there is nothing to sign: refused, never sent unsigned. */
    h = tally_conn_headers_signed(&req, NULL, NULL, &sign, 1700000000LL, &err);
    assert_null(h);
    assert_int_equal(err.errc, TALLY_ERR_SIGNATURE);
    free(url);
}

/* A long non-ASCII key goes into the base whole (621 bytes of base, no fixed buffer cuts
 * it); the expected signature comes from the same script with
 * key = "clé:" + "é" * 200 and components @method, @target-uri, idempotency-key. Leading
 * and trailing spaces of a value are not part of it (RFC 9421 §2.1). */
static void test_rfc9421_bytes_whole(void **state)
{
    (void)state;
    tally_tool_t tool = demo_tool();
    char key[512] = "cl\xc3\xa9:";
    for (int i = 0; i < 200; i++)
        strcat(key, "\xc3\xa9");
    tally_conn_request_t req = {.tool = &tool, .op = TALLY_CONN_STATUS, .idempotency_key = key};
    tally_conn_sig_params_t p = {"k-2026-11", 1700000000LL, 1700000300LL};
    char *input = NULL;
    char *base = tally_conn_sig_base(&req, "POST", "http://127.0.0.1:9/charges", NULL, &p, &input);
    assert_non_null(base);
    assert_int_equal(strlen(base), 621);
    assert_non_null(strstr(base, key));
    char sig[64];
    assert_true(tally_conn_sig_hmac("whsec_test", base, sig, sizeof sig));
    assert_string_equal(sig, "B9vcTsYz4mgPddKNpLfICbbRsK2gOGhNblJfU42/kEs=");
    free(base);
    free(input);

    char padded[600];
    snprintf(padded, sizeof padded, "  %s\t", key);
    req.idempotency_key = padded;
    base = tally_conn_sig_base(&req, "POST", "http://127.0.0.1:9/charges", NULL, &p, &input);
    assert_true(tally_conn_sig_hmac("whsec_test", base, sig, sizeof sig));
    assert_string_equal(sig, "B9vcTsYz4mgPddKNpLfICbbRsK2gOGhNblJfU42/kEs=");
    free(base);
    free(input);
}

static void test_url(void **state)
{
    (void)state;
    tally_tool_t tool = demo_tool();
    tally_error_t err;
    char *u = tally_conn_url(&tool, TALLY_CONN_EXECUTE, "k", &err);
    assert_string_equal(u, "http://127.0.0.1:9/charges");
    free(u);
    u = tally_conn_url(&tool, TALLY_CONN_STATUS, "charge_card:t 1/&x", &err);
    assert_string_equal(u, "http://127.0.0.1:9/charges?idempotency_key=charge_card%3At%201%2F%26x");
    free(u);
    tool.contain = (tally_endpoint_t){NULL, NULL};
    u = tally_conn_url(&tool, TALLY_CONN_CONTAIN, "k", &err);
    assert_null(u);
    assert_int_equal(err.errc, TALLY_ERR_NO_ENDPOINT);
    assert_false(err.retriable);
    assert_string_equal(tally_conn_method(&tool, TALLY_CONN_STATUS), "GET");
}

static void test_receipt_and_ref(void **state)
{
    (void)state;
    tally_tool_t tool = demo_tool();
    row_t r = {"200", true, CURLE_OK, 200, "{\"id\":\"ch_9\",\"amount\":5}", false, 0, 0, 0, NULL};
    tally_conn_result_t res = result_of(&r);
    json_t *rc = tally_conn_receipt(&res);
    assert_non_null(rc);
    assert_string_equal(json_string_value(json_object_get(rc, "id")), "ch_9");
    char *ref = tally_conn_external_ref(&tool, rc);
    assert_string_equal(ref, "ch_9");
    free(ref);
    json_decref(rc);

    /* Numeric ref, nested pointer. */
    tool.receipt_ref = (char *)"/data/n";
    r.body = "{\"data\":{\"n\":42}}";
    res = result_of(&r);
    rc = tally_conn_receipt(&res);
    ref = tally_conn_external_ref(&tool, rc);
    assert_string_equal(ref, "42");
    free(ref);
    json_decref(rc);

    /* Not JSON: a note with an excerpt, no ref. */
    r.body = "accepted";
    res = result_of(&r);
    rc = tally_conn_receipt(&res);
    assert_non_null(rc);
    assert_int_equal(json_integer_value(json_object_get(rc, "http_status")), 200);
    assert_string_equal(json_string_value(json_object_get(json_object_get(rc, "excerpt"), "text")),
                        "accepted");
    assert_null(tally_conn_external_ref(&tool, rc));
    json_decref(rc);

    /* Truncated: kept as a note that says so. */
    r.body = "{\"id\":\"ch_1\",\"pad\":\"xxxx";
    r.truncated = true;
    res = result_of(&r);
    res.body_total = 5000000;
    rc = tally_conn_receipt(&res);
    assert_true(json_is_true(json_object_get(rc, "truncated")));
    assert_int_equal(json_integer_value(json_object_get(rc, "bytes")), 5000000);
    json_decref(rc);

    /* U+0000 cannot go into jsonb: excerpt instead. */
    r.body = "{\"id\":\"a\\u0000b\"}";
    r.truncated = false;
    res = result_of(&r);
    rc = tally_conn_receipt(&res);
    assert_null(json_object_get(rc, "id"));
    assert_non_null(json_object_get(rc, "excerpt"));
    json_decref(rc);
}

/* The receipt as text: the body itself, compacted, when it is a plain object; what the tree
 * path gives for everything else. Either way the same value and ref as tally_conn_receipt
 * and tally_conn_external_ref. */
static void test_receipt_text(void **state)
{
    (void)state;
    const struct {
        const char *body, *ptr;
        bool truncated;
        const char *want_text, *want_ref;
    } cases[] = {
        /* plain objects: the body without whitespace, 12.50 as the tool wrote it */
        {"{ \"id\": \"ch_9\", \"amount\": 12.50 }\n", NULL, false,
         "{\"id\":\"ch_9\",\"amount\":12.50}", "ch_9"},
        {"{\"data\":{\"n\":[1,{\"ref\":42}]}}", "/data/n/1/ref", false,
         "{\"data\":{\"n\":[1,{\"ref\":42}]}}", "42"},
        {"{\"id\":\"a\\\"b\"}", NULL, false, "{\"id\":\"a\\\"b\"}", "a\"b"},
        {"{\"amount\":5}", NULL, false, "{\"amount\":5}", NULL},
        /* the scanner is unsure, jansson decides: its compact form */
        {"{\"id\":\"x\",\"e\":1e2}", NULL, false, "{\"id\": \"x\", \"e\": 100.0}", "x"},
        {"{\"\\u0069d\":\"esc\"}", NULL, false, "{\"id\": \"esc\"}", "esc"},
        {"{\"id\":\"\\ud83d\\ude00\"}", NULL, false, "{\"id\": \"\xf0\x9f\x98\x80\"}",
         "\xf0\x9f\x98\x80"},
        /* not an object, not JSON, cut, or holding U+0000: a note */
        {"[1,2]", NULL, false,
         "{\"http_status\": 200, \"bytes\": 5, \"truncated\": false, \"body\": [1, 2]}", NULL},
        {"accepted", NULL, false, NULL, NULL},
        {"{\"id\":\"ch_1\"", NULL, true, NULL, NULL},
        {"{\"id\":\"a\\u0000b\"}", NULL, false, NULL, NULL},
        {"{\"id\":1,\"id\":2}", NULL, false, NULL, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tally_tool_t tool = demo_tool();
        if (cases[i].ptr)
            tool.receipt_ref = (char *)cases[i].ptr;
        row_t r = {"200", true, CURLE_OK, 200, cases[i].body, cases[i].truncated, 0, 0, 0, NULL};
        tally_conn_result_t res = result_of(&r);
        char *text = NULL, *ref = NULL;
        assert_true(tally_conn_receipt_text(&res, &tool, &text, &ref));
        assert_non_null(text);
        /* the same value and ref as the tree */
        json_t *tree = tally_conn_receipt(&res);
        json_t *back = json_loads(text, TALLY_JSON_LOAD_FLAGS, NULL);
        if (back == NULL || !json_equal(back, tree))
            fail_msg("case %zu: %s is not the receipt", i, text);
        char *tree_ref = tally_conn_external_ref(&tool, tree);
        assert_true((ref == NULL && tree_ref == NULL) ||
                    (ref && tree_ref && strcmp(ref, tree_ref) == 0));
        if (cases[i].want_text) {
            json_t *want = json_loads(cases[i].want_text, 0, NULL);
            assert_true(json_equal(want, back));
            json_decref(want);
            if (strchr(cases[i].want_text, ' ') == NULL) /* kept as text: byte for byte */
                assert_string_equal(text, cases[i].want_text);
        } else {
            assert_non_null(json_object_get(back, "http_status")); /* a note */
        }
        if (cases[i].want_ref)
            assert_string_equal(ref, cases[i].want_ref);
        else
            assert_null(ref);
        free(tree_ref);
        json_decref(back);
        json_decref(tree);
        free(text);
        free(ref);
    }
}

static void test_excerpt(void **state)
{
    (void)state;
    json_t *e = tally_conn_excerpt("h\xc3\xa9llo", 6, 2); /* cut inside é: back to "h" */
    assert_string_equal(json_string_value(json_object_get(e, "text")), "h");
    assert_true(json_is_true(json_object_get(e, "truncated")));
    json_decref(e);
    e = tally_conn_excerpt("a\xff\x00z", 4, 100);
    assert_string_equal(json_string_value(json_object_get(e, "base64")), "Yf8Aeg==");
    assert_null(json_object_get(e, "truncated"));
    json_decref(e);

    /* the text form is the same document: cut, truncated, escapes, binary, empty */
    static const struct {
        const char *body;
        size_t len, max;
    } cases[] = {
        {"h\xc3\xa9llo", 6, 2}, {"a\xff\x00z", 4, 100}, {"{\"q\":\"\n\\\"\"}", 10, 2048},
        {"", 0, 2048},          {NULL, 5, 2048},        {"abc", 3, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        json_t *want = tally_conn_excerpt(cases[i].body, cases[i].len, cases[i].max);
        char *want_text = json_dumps(want, JSON_COMPACT);
        tally_jtext_t j = {0};
        tally_conn_excerpt_text(&j, NULL, cases[i].body, cases[i].len, cases[i].max);
        char *got = tally_jtext_take(&j);
        assert_non_null(got);
        assert_string_equal(got, want_text);
        free(got);
        free(want_text);
        json_decref(want);
    }
}

/* The receipt stored once (ledger.h): the reference a confirmed call's audit data keeps, and
 * what a reader concludes from it. */
static void test_receipt_ref(void **state)
{
    (void)state;
    tally_jtext_t j = {0};
    tally_jtext_begin(&j, NULL);
    tally_jtext_str(&j, "op", "execute");
    tally_conn_receipt_ref_text(&j);
    tally_jtext_end(&j);
    char *text = tally_jtext_take(&j);
    assert_non_null(text);
    assert_string_equal(text, "{\"op\":\"execute\",\"receipt\":{\"on\":\"effect\"}}");
    json_t *doc = json_loads(text, 0, NULL);
    free(text);
    assert_non_null(doc);
    /* as written by the dispatcher: the statement has not added the hash yet */
    const json_t *ref = json_object_get(doc, "receipt");
    assert_int_equal(tally_conn_receipt_ref_check(ref, "ab"), TALLY_RECEIPT_REF_UNVERIFIED);

    static const char H1[] = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    static const char H2[] = "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752";
    json_t *hashed = json_pack("{s:s, s:s}", "on", "effect", "sha256", H1);
    assert_int_equal(tally_conn_receipt_ref_check(hashed, H1), TALLY_RECEIPT_REF_MATCH);
    assert_int_equal(tally_conn_receipt_ref_check(hashed, H2), TALLY_RECEIPT_REF_MISMATCH);
    assert_int_equal(tally_conn_receipt_ref_check(hashed, NULL), TALLY_RECEIPT_REF_UNVERIFIED);
    json_decref(hashed);

    /* no reference: 0.2.0's inline answer, an answer that is no receipt, junk */
    static const char *const none[] = {
        "null",        "\"effect\"",
        "{}",          "{\"on\": \"obligation\", \"sha256\": \"ab\"}",
        "{\"on\": 1}", "{\"text\": \"{\\\"id\\\": 1}\"}",
    };
    for (size_t i = 0; i < sizeof none / sizeof none[0]; i++) {
        json_t *v = json_loads(none[i], JSON_DECODE_ANY, NULL);
        assert_non_null(v);
        assert_int_equal(tally_conn_receipt_ref_check(v, H1), TALLY_RECEIPT_REF_NONE);
        json_decref(v);
    }
    assert_int_equal(tally_conn_receipt_ref_check(NULL, H1), TALLY_RECEIPT_REF_NONE);
    assert_int_equal(tally_conn_receipt_ref_check(json_object_get(doc, "response"), H1),
                     TALLY_RECEIPT_REF_NONE);
    json_decref(doc);
}

/* ---------------------------------------------------------------------------------------- */
/* The engine against a local responder                                                     */

typedef struct responder {
    int fd;
    int port;
    pthread_mutex_t mu;
    char last_request[8192];
    int requests;
    int last_on_conn; /* the last request was the Nth on its connection */
} responder_t;

static responder_t rsp;

/* Read one request (headers and Content-Length body) into buf. @returns false on EOF. */
static bool read_request(int fd, char *buf, size_t cap)
{
    size_t len = 0;
    for (;;) {
        ssize_t n = read(fd, buf + len, cap - 1 - len);
        if (n <= 0)
            return false;
        len += (size_t)n;
        buf[len] = '\0';
        char *end = strstr(buf, "\r\n\r\n");
        if (!end)
            continue;
        char *cl = strcasestr(buf, "Content-Length:");
        size_t need = (size_t)(end + 4 - buf) + (cl && cl < end ? strtoul(cl + 15, NULL, 10) : 0);
        if (len >= need)
            return true;
    }
}

static void write_all(int fd, const char *s, size_t n)
{
    size_t off = 0;
    while (off < n) {
        ssize_t w = write(fd, s + off, n - off);
        if (w <= 0)
            return;
        off += (size_t)w;
    }
}

/* One connection: "/ka/ok" answers and keeps the connection open for the next request,
 * "/ka/drop" reads the request and closes without an answer (as a tool that crashed after
 * reading it); the other paths answer once and close. */
static void *serve_conn(void *arg)
{
    int fd = (int)(intptr_t)arg;
    char buf[8192];
    char big[4096];
    int on_conn = 0;
    while (read_request(fd, buf, sizeof buf)) {
        pthread_mutex_lock(&rsp.mu);
        snprintf(rsp.last_request, sizeof rsp.last_request, "%s", buf);
        rsp.requests++;
        rsp.last_on_conn = ++on_conn;
        pthread_mutex_unlock(&rsp.mu);
        const char *reply = NULL;
        bool keep = false;
        if (strncmp(buf, "POST /ok ", 9) == 0 || strncmp(buf, "GET /ok?", 8) == 0) {
            reply = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n"
                    "Connection: close\r\n\r\n{\"id\":\"ch_1\"}";
        } else if (strncmp(buf, "POST /ka/ok ", 12) == 0) {
            reply = "HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{\"id\":\"ch_2\"}";
            keep = true;
        } else if (strncmp(buf, "POST /busy ", 11) == 0) {
            reply = "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 3\r\nContent-Length: 0\r\n"
                    "Connection: close\r\n\r\n";
        } else if (strncmp(buf, "POST /big ", 10) == 0) {
            int hl =
                snprintf(big, sizeof big,
                         "HTTP/1.1 200 OK\r\nContent-Length: 3000\r\nConnection: close\r\n\r\n");
            memset(big + hl, 'x', 3000);
            big[hl + 3000] = '\0';
            reply = big;
        } else if (strncmp(buf, "POST /hang ", 11) == 0) {
            sleep(2);
        }
        /* "/close", "/ka/drop" and anything else: close without an answer. */
        if (reply)
            write_all(fd, reply, strlen(reply));
        if (!keep)
            break;
    }
    close(fd);
    return NULL;
}

static void *serve(void *arg)
{
    (void)arg;
    for (;;) {
        int cfd = accept(rsp.fd, NULL, NULL);
        if (cfd < 0)
            return NULL;
        pthread_t t;
        if (pthread_create(&t, NULL, serve_conn, (void *)(intptr_t)cfd) == 0)
            pthread_detach(t);
        else
            close(cfd);
    }
}

static int closed_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    bind(fd, (struct sockaddr *)&a, sizeof a);
    socklen_t al = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &al);
    close(fd); /* nothing listens there now */
    return ntohs(a.sin_port);
}

static int start_responder(void **state)
{
    (void)state;
    pthread_mutex_init(&rsp.mu, NULL);
    rsp.fd = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(rsp.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(rsp.fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(rsp.fd, 64) != 0)
        return -1;
    socklen_t al = sizeof a;
    getsockname(rsp.fd, (struct sockaddr *)&a, &al);
    rsp.port = ntohs(a.sin_port);
    pthread_t t;
    if (pthread_create(&t, NULL, serve, NULL) != 0)
        return -1;
    pthread_detach(t);
    return 0;
}

typedef struct got {
    int n;
    tally_conn_verdict_t v[8];
    long status[8];
    bool sent[8];
    bool truncated[8];
    size_t body_len[8];
    size_t body_total[8];
    char *ref[8];
    void *opaque[8];
} got_t;

static void on_done(const tally_conn_result_t *res, void *opaque)
{
    got_t *g = opaque;
    int i = g->n++;
    tally_conn_classify_execute(res, &g->v[i]);
    g->status[i] = res->http_status;
    g->sent[i] = res->sent;
    g->truncated[i] = res->body_truncated;
    g->body_len[i] = res->body_len;
    g->body_total[i] = res->body_total;
    g->opaque[i] = res->opaque;
    json_t *rc = tally_conn_receipt(res);
    g->ref[i] = tally_conn_external_ref(res->tool, rc);
    json_decref(rc);
}

static got_t run_one(tally_connector_t *c, tally_tool_t *tool, const char *path)
{
    tool->execute.path = (char *)path;
    const char *body = "{\"a\":1}";
    tally_conn_request_t req = {.tool = tool,
                                .op = TALLY_CONN_EXECUTE,
                                .idempotency_key = "k1",
                                .run_id = "r1",
                                .effect_id = "e1",
                                .body = body,
                                .body_len = strlen(body),
                                .opaque = (void *)path};
    tally_error_t err;
    got_t g = {0};
    if (!tally_connector_submit(c, &req, &err))
        fail_msg("submit %s: %s", path, err.message);
    assert_int_equal(tally_connector_inflight(c), 1);
    for (int i = 0; i < 100 && g.n == 0; i++)
        assert_true(tally_connector_poll(c, NULL, 0, 100, on_done, &g, &err) >= 0);
    assert_int_equal(g.n, 1);
    assert_ptr_equal(g.opaque[0], path);
    assert_int_equal(tally_connector_inflight(c), 0);
    return g;
}

static void test_engine(void **state)
{
    (void)state;
    char err_s[256];
    tally_connector_t *c = tally_connector_new(4, 1024, err_s, sizeof err_s);
    assert_non_null(c);
    tally_tool_t tool = demo_tool();
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%d", rsp.port);
    tool.base_url = base;
    tool.timeout_ms = 400;
    tool.secret_env = (char *)"TALLY_TEST_CONNECTOR_SECRET";
    tally_error_t err;

    /* The secret's variable is unset: nothing is sent. */
    unsetenv("TALLY_TEST_CONNECTOR_SECRET");
    tally_conn_request_t req = {.tool = &tool, .op = TALLY_CONN_EXECUTE, .idempotency_key = "k"};
    assert_false(tally_connector_submit(c, &req, &err));
    assert_int_equal(err.errc, TALLY_ERR_SECRET_MISSING);
    assert_true(err.retriable); /* once an operator sets it */
    setenv("TALLY_TEST_CONNECTOR_SECRET", "whsec_test", 1);

    got_t g = run_one(c, &tool, "/ok");
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_CONFIRMED);
    assert_string_equal(g.ref[0], "ch_1");
    free(g.ref[0]);
    pthread_mutex_lock(&rsp.mu);
    assert_non_null(strstr(rsp.last_request, "POST /ok HTTP/1.1\r\n"));
    assert_non_null(strstr(rsp.last_request, "Idempotency-Key: k1\r\n"));
    assert_non_null(strstr(rsp.last_request, "Tally-Run-Id: r1\r\n"));
    assert_non_null(strstr(rsp.last_request, "Tally-Effect-Id: e1\r\n"));
    assert_non_null(strstr(rsp.last_request, "Content-Type: application/json\r\n"));
    assert_non_null(strstr(rsp.last_request, "Tally-Signature: t="));
    assert_non_null(strstr(rsp.last_request, "\r\n\r\n{\"a\":1}"));
    /* The signature in the request verifies against its own timestamp and body. */
    char *sig = strstr(rsp.last_request, "Tally-Signature: t=") + strlen("Tally-Signature: t=");
    long long t = strtoll(sig, NULL, 10);
    char want[128];
    assert_true(tally_conn_signature("whsec_test", t, "{\"a\":1}", 7, want, sizeof want));
    char line[160];
    snprintf(line, sizeof line, "Tally-Signature: %s\r\n", want);
    assert_non_null(strstr(rsp.last_request, line));
    pthread_mutex_unlock(&rsp.mu);

    g = run_one(c, &tool, "/busy");
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_RETRY);
    assert_int_equal(g.v[0].retry_after_ms, 3000);
    free(g.ref[0]);

    g = run_one(c, &tool, "/big");
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_CONFIRMED);
    assert_true(g.truncated[0]);
    assert_int_equal(g.body_len[0], 1024);
    assert_int_equal(g.body_total[0], 3000);
    free(g.ref[0]);

    g = run_one(c, &tool, "/hang");
    assert_true(g.sent[0]);
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_UNKNOWN);
    assert_string_equal(g.v[0].code, "timeout");
    free(g.ref[0]);

    g = run_one(c, &tool, "/close");
    assert_true(g.sent[0]);
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_UNKNOWN);
    free(g.ref[0]);

    char refused[64];
    snprintf(refused, sizeof refused, "http://127.0.0.1:%d", closed_port());
    tool.base_url = refused;
    g = run_one(c, &tool, "/ok");
    assert_false(g.sent[0]);
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_RETRY);
    assert_string_equal(g.v[0].code, "not_sent");
    free(g.ref[0]);

    tally_connector_free(c, NULL);
}

static int requests_seen(void)
{
    pthread_mutex_lock(&rsp.mu);
    int n = rsp.requests;
    pthread_mutex_unlock(&rsp.mu);
    return n;
}

/* curl silently re-sends a request whose reused connection died before any answer. For an
 * idempotent tool that is harmless (and allowed); for a reversible one it would be a blind
 * retry: such a call still rides the reused connection, but the re-send is refused, and the
 * drop is UNKNOWN after exactly one request. */
static void test_no_silent_replay_of_side_effects(void **state)
{
    (void)state;
    char err_s[256];
    tally_connector_t *c = tally_connector_new(4, 0, err_s, sizeof err_s);
    assert_non_null(c);
    tally_tool_t tool = demo_tool();
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%d", rsp.port);
    tool.base_url = base;
    tool.timeout_ms = 2000;

    tool.effect_class = TALLY_CLASS_IDEMPOTENT;
    assert_false(tally_conn_no_replay(&tool, TALLY_CONN_EXECUTE));
    got_t g = run_one(c, &tool, "/ka/ok"); /* leaves a keep-alive connection in the pool */
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_CONFIRMED);
    free(g.ref[0]);
    int before = requests_seen();
    g = run_one(c, &tool, "/ka/drop");
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_UNKNOWN);
    assert_int_equal(requests_seen() - before, 2); /* curl's own replay on a new connection */
    free(g.ref[0]);

    tool.effect_class = TALLY_CLASS_REVERSIBLE;
    assert_true(tally_conn_no_replay(&tool, TALLY_CONN_EXECUTE));
    assert_true(tally_conn_no_replay(&tool, TALLY_CONN_CONTAIN));
    assert_false(tally_conn_no_replay(&tool, TALLY_CONN_STATUS));
    assert_false(tally_conn_no_replay(&tool, TALLY_CONN_COMPENSATE));
    tool.effect_class = TALLY_CLASS_IDEMPOTENT;
    g = run_one(c, &tool, "/ka/ok");
    free(g.ref[0]);
    tool.effect_class = TALLY_CLASS_REVERSIBLE;
    before = requests_seen();
    g = run_one(c, &tool, "/ka/drop");
    assert_true(g.sent[0]);
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_UNKNOWN);
    assert_string_equal(g.v[0].code, "empty_reply");
    assert_int_equal(requests_seen() - before, 1);
    pthread_mutex_lock(&rsp.mu);
    assert_int_equal(rsp.last_on_conn, 2); /* it did ride the kept-alive connection */
    pthread_mutex_unlock(&rsp.mu);
    free(g.ref[0]);

    /* And a reversible call that is answered leaves its connection for the next one. */
    g = run_one(c, &tool, "/ka/ok");
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_CONFIRMED);
    free(g.ref[0]);
    g = run_one(c, &tool, "/ka/ok");
    assert_int_equal(g.v[0].verdict, TALLY_VERDICT_CONFIRMED);
    pthread_mutex_lock(&rsp.mu);
    assert_int_equal(rsp.last_on_conn, 2);
    pthread_mutex_unlock(&rsp.mu);
    free(g.ref[0]);
    tally_connector_free(c, NULL);
}

static int abandoned_count;
static void count_abandoned(void *opaque)
{
    (void)opaque;
    abandoned_count++;
}

static void test_capacity(void **state)
{
    (void)state;
    char err_s[256];
    tally_connector_t *c = tally_connector_new(3, 0, err_s, sizeof err_s);
    assert_non_null(c);
    tally_tool_t a = demo_tool(), b = demo_tool();
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%d", rsp.port);
    a.base_url = b.base_url = base;
    a.execute.path = b.execute.path = (char *)"/hang";
    a.timeout_ms = b.timeout_ms = 5000;
    a.max_concurrency = 2;
    b.max_concurrency = 10;
    assert_int_equal(tally_connector_capacity(c, &a), 2);
    assert_int_equal(tally_connector_capacity(c, &b), 3);
    tally_error_t err;
    tally_conn_request_t req = {.tool = &a,
                                .op = TALLY_CONN_EXECUTE,
                                .idempotency_key = "k",
                                .body = "{}",
                                .body_len = 2,
                                .opaque = &a};
    assert_true(tally_connector_submit(c, &req, &err));
    assert_true(tally_connector_submit(c, &req, &err));
    assert_false(tally_connector_submit(c, &req, &err)); /* per-tool cap */
    assert_int_equal(err.errc, TALLY_ERR_CAPACITY);
    assert_true(err.retriable);
    assert_int_equal(tally_connector_capacity(c, &a), 0);
    assert_int_equal(tally_connector_capacity(c, &b), 1);
    req.tool = &b;
    assert_true(tally_connector_submit(c, &req, &err));
    assert_false(tally_connector_submit(c, &req, &err)); /* global cap */
    assert_int_equal(tally_connector_inflight(c), 3);
    assert_int_equal(tally_connector_tool_inflight(c, &a), 2);
    /* Extra fds are reported: a pipe with a byte in it ends the wait at once. */
    int p[2];
    assert_int_equal(pipe(p), 0);
    assert_int_equal(write(p[1], "x", 1), 1);
    struct curl_waitfd w = {.fd = p[0], .events = CURL_WAIT_POLLIN};
    assert_int_equal(tally_connector_poll(c, &w, 1, 5000, NULL, NULL, &err), 0);
    assert_true(w.revents & CURL_WAIT_POLLIN);
    close(p[0]);
    close(p[1]);
    abandoned_count = 0;
    tally_connector_free(c, count_abandoned);
    assert_int_equal(abandoned_count, 3);
}

/* tally_connector_start: calls progress and finish on the engine's thread while the thread
 * that submitted them does something else (here: sleeps); a call counts as in flight until
 * its callback returns; freeing the engine stops its thread and abandons what is left. */
typedef struct threaded_got {
    pthread_mutex_t mu;
    tally_connector_t *c;
    pthread_t submitter;
    int n, confirmed, on_submitter, inflight_in_callback;
} threaded_got_t;

static void on_threaded_done(const tally_conn_result_t *res, void *opaque)
{
    threaded_got_t *g = opaque;
    tally_conn_verdict_t v;
    tally_conn_classify_execute(res, &v);
    int inflight = tally_connector_inflight(g->c);
    pthread_mutex_lock(&g->mu);
    g->n++;
    g->confirmed += v.verdict == TALLY_VERDICT_CONFIRMED;
    g->on_submitter += pthread_equal(pthread_self(), g->submitter) != 0;
    g->inflight_in_callback += inflight >= 1;
    pthread_mutex_unlock(&g->mu);
}

static void test_engine_thread(void **state)
{
    (void)state;
    char err_s[256];
    tally_connector_t *c = tally_connector_new(8, 0, err_s, sizeof err_s);
    assert_non_null(c);
    threaded_got_t g = {.mu = PTHREAD_MUTEX_INITIALIZER, .c = c, .submitter = pthread_self()};
    assert_true(tally_connector_start(c, on_threaded_done, &g, err_s, sizeof err_s));
    assert_false(tally_connector_start(c, on_threaded_done, &g, err_s, sizeof err_s));
    tally_tool_t tool = demo_tool();
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%d", rsp.port);
    tool.base_url = base;
    tool.timeout_ms = 3000;
    tool.max_concurrency = 8;
    tool.execute.path = (char *)"/ok";
    tally_error_t err;
    tally_conn_request_t req = {.tool = &tool,
                                .op = TALLY_CONN_EXECUTE,
                                .idempotency_key = "k",
                                .body = "{}",
                                .body_len = 2};
    for (int i = 0; i < 5; i++)
        assert_true(tally_connector_submit(c, &req, &err));
    int n = 0;
    for (int i = 0; i < 500 && n < 5; i++) {
        usleep(10000); /* no poll from this thread: the engine's thread does the work */
        pthread_mutex_lock(&g.mu);
        n = g.n;
        pthread_mutex_unlock(&g.mu);
    }
    assert_int_equal(n, 5);
    assert_int_equal(g.confirmed, 5);
    assert_int_equal(g.on_submitter, 0);
    assert_int_equal(g.inflight_in_callback, 5);
    assert_int_equal(tally_connector_inflight(c), 0);
    assert_int_equal(tally_connector_capacity(c, &tool), 8);

    /* Two calls that hang: still in flight when the engine is freed, and abandoned. */
    tool.execute.path = (char *)"/hang";
    req.opaque = &g;
    assert_true(tally_connector_submit(c, &req, &err));
    assert_true(tally_connector_submit(c, &req, &err));
    assert_int_equal(tally_connector_inflight(c), 2);
    usleep(50000);
    abandoned_count = 0;
    tally_connector_free(c, count_abandoned);
    assert_int_equal(abandoned_count, 2);
    assert_int_equal(g.n, 5);
}

/* The per-tool in-flight gauge: up at submit, back to 0 whichever way each call leaves (an
 * answer, a timeout, a refused connection, a submit refused for capacity). */
static bool has_line(const char *text, const char *line)
{
    size_t n = strlen(line);
    for (const char *p = strstr(text, line); p != NULL; p = strstr(p + 1, line))
        if ((p == text || p[-1] == '\n') && p[n] == '\n')
            return true;
    return false;
}

static void assert_gauge(tally_metrics_t *m, const char *line)
{
    char *text = tally_metrics_render(m);
    assert_non_null(text);
    if (!has_line(text, line))
        fail_msg("no line '%s' in:\n%s", line, text);
    free(text);
}

static void test_publish_inflight(void **state)
{
    (void)state;
    char err_s[256];
    tally_connector_t *c = tally_connector_new(8, 0, err_s, sizeof err_s);
    assert_non_null(c);
    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *gauge = tally_metrics_gauge(m, "t_inflight", "calls in flight", "tool");
    tally_tool_t a = demo_tool(), b = demo_tool();
    a.name = (char *)"a";
    b.name = (char *)"b";
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%d", rsp.port);
    char refused[64];
    snprintf(refused, sizeof refused, "http://127.0.0.1:%d", closed_port());
    a.base_url = base;
    b.base_url = refused;
    a.timeout_ms = 300;
    a.max_concurrency = 3;
    a.execute.path = (char *)"/hang";
    b.execute.path = (char *)"/ok";
    tally_metric_set(gauge, 0, "a");
    tally_metric_set(gauge, 0, "b");
    tally_metric_set(gauge, 0, "idle"); /* a registry tool never called */
    tally_connector_publish_inflight(c, gauge);
    assert_gauge(m, "t_inflight{tool=\"a\"} 0");

    tally_error_t err;
    tally_conn_request_t req = {
        .tool = &a, .op = TALLY_CONN_EXECUTE, .idempotency_key = "k", .body = "{}", .body_len = 2};
    assert_true(tally_connector_submit(c, &req, &err));
    assert_true(tally_connector_submit(c, &req, &err));
    a.execute.path = (char *)"/ok";
    assert_true(tally_connector_submit(c, &req, &err));
    assert_false(tally_connector_submit(c, &req, &err)); /* a's own cap: never in flight */
    req.tool = &b;
    assert_true(tally_connector_submit(c, &req, &err));
    tally_connector_publish_inflight(c, gauge);
    assert_gauge(m, "t_inflight{tool=\"a\"} 3");
    assert_gauge(m, "t_inflight{tool=\"b\"} 1");
    assert_gauge(m, "t_inflight{tool=\"idle\"} 0");

    got_t g = {0};
    for (int i = 0; i < 100 && g.n < 4; i++) {
        assert_true(tally_connector_poll(c, NULL, 0, 100, on_done, &g, &err) >= 0);
        if (g.n == 2) { /* the answered one and the refused one; the two hangs remain */
            tally_connector_publish_inflight(c, gauge);
            assert_gauge(m, "t_inflight{tool=\"a\"} 2");
            assert_gauge(m, "t_inflight{tool=\"b\"} 0");
        }
    }
    assert_int_equal(g.n, 4);
    for (int i = 0; i < g.n; i++)
        free(g.ref[i]);
    tally_connector_publish_inflight(c, gauge);
    assert_gauge(m, "t_inflight{tool=\"a\"} 0");
    assert_gauge(m, "t_inflight{tool=\"b\"} 0");
    assert_gauge(m, "t_inflight{tool=\"idle\"} 0");
    tally_connector_free(c, NULL);
    tally_metrics_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_execute_table),
        cmocka_unit_test(test_status_table),
        cmocka_unit_test(test_compensate_table),
        cmocka_unit_test(test_retry_after_passed_through),
        cmocka_unit_test(test_signature_vector),
        cmocka_unit_test(test_headers),
        cmocka_unit_test(test_rfc9421_vector),
        cmocka_unit_test(test_rfc9421_doc_example),
        cmocka_unit_test(test_rfc9421_status_get),
        cmocka_unit_test(test_rfc9421_bytes_whole),
        cmocka_unit_test(test_url),
        cmocka_unit_test(test_receipt_and_ref),
        cmocka_unit_test(test_receipt_text),
        cmocka_unit_test(test_excerpt),
        cmocka_unit_test(test_receipt_ref),
        cmocka_unit_test(test_engine),
        cmocka_unit_test(test_engine_thread),
        cmocka_unit_test(test_no_silent_replay_of_side_effects),
        cmocka_unit_test(test_capacity),
        cmocka_unit_test(test_publish_inflight),
    };
    return cmocka_run_group_tests(tests, start_responder, NULL);
}
