/* connector_classify.c — DESIGN §6: what the ledger does next with a call's answer. Pure: a
 * tally_conn_result_t in, a verdict out; no network, no database (tests/unit/test_connector.c
 * reads it row by row). */
#include "tally/connector.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "tally/json.h"
#include "tally/text.h"

const char *tally_verdict_name(tally_verdict_t v)
{
    switch (v) {
    case TALLY_VERDICT_CONFIRMED:
        return "confirmed";
    case TALLY_VERDICT_FAILED:
        return "failed";
    case TALLY_VERDICT_RETRY:
        return "retry";
    case TALLY_VERDICT_UNKNOWN:
        return "unknown";
    case TALLY_VERDICT_NOT_FOUND:
        return "not_found";
    case TALLY_VERDICT_FOUND:
        return "found";
    case TALLY_VERDICT_DUPLICATE:
        return "duplicate";
    case TALLY_VERDICT_INCONCLUSIVE:
        return "inconclusive";
    case TALLY_VERDICT_RESOLVED:
        return "resolved";
    case TALLY_VERDICT_STUCK:
        return "stuck";
    }
    return "?";
}

static void verdict_set(tally_conn_verdict_t *out, tally_verdict_t v, const char *code,
                        const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static void verdict_set(tally_conn_verdict_t *out, tally_verdict_t v, const char *code,
                        const char *fmt, ...)
{
    out->verdict = v;
    snprintf(out->code, sizeof out->code, "%s", code);
    va_list ap;
    va_start(ap, fmt);
    tally_vfmt(out->message, sizeof out->message, fmt, ap); /* valid UTF-8, cut whole */
    va_end(ap);
}

static void verdict_init(const tally_conn_result_t *res, tally_conn_verdict_t *out)
{
    memset(out, 0, sizeof *out);
    out->retry_after_ms = res->retry_after_ms;
}

static const char *curl_msg(const tally_conn_result_t *res)
{
    if (res->curl_error && res->curl_error[0])
        return res->curl_error;
    return curl_easy_strerror((CURLcode)res->curl_code);
}

/* The request left but no status line came back: name what the transport saw. */
static void verdict_no_answer(const tally_conn_result_t *res, tally_conn_verdict_t *out,
                              tally_verdict_t v)
{
    const char *code = "no_response";
    switch ((CURLcode)res->curl_code) {
    case CURLE_OPERATION_TIMEDOUT:
        code = "timeout";
        break;
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
        code = "connection_reset";
        break;
    case CURLE_GOT_NOTHING:
        code = "empty_reply";
        break;
    default:
        break;
    }
    verdict_set(out, v, code, "%s %s: the request was sent but no answer came back: %s",
                res->method ? res->method : "?", res->url ? res->url : "?", curl_msg(res));
}

static bool status_refused_unprocessed(long s)
{
    return s == 408 || s == 425 || s == 429 || s == 503;
}

void tally_conn_classify_execute(const tally_conn_result_t *res, tally_conn_verdict_t *out)
{
    verdict_init(res, out);
    long s = res->http_status;
    if (!res->sent) {
        verdict_set(out, TALLY_VERDICT_RETRY, "not_sent",
                    "the request was not sent (nothing reached the tool): %s", curl_msg(res));
        return;
    }
    if (s == 0) {
        verdict_no_answer(res, out, TALLY_VERDICT_UNKNOWN);
        return;
    }
    char code[32];
    snprintf(code, sizeof code, "http_%ld", s);
    if (s >= 200 && s < 300) {
        if (res->curl_code != CURLE_OK) {
            verdict_set(out, TALLY_VERDICT_UNKNOWN, "incomplete_body",
                        "HTTP %ld but the response body did not arrive whole (%s): the effect "
                        "happened and its receipt must be fetched with a status check",
                        s, curl_msg(res));
            return;
        }
        verdict_set(out, TALLY_VERDICT_CONFIRMED, code, "HTTP %ld", s);
        return;
    }
    if (status_refused_unprocessed(s)) {
        verdict_set(out, TALLY_VERDICT_RETRY, code,
                    "HTTP %ld: the tool refused the request without applying it", s);
        return;
    }
    if (s == 409) {
        out->in_progress = true;
        verdict_set(out, TALLY_VERDICT_RETRY, code,
                    "HTTP 409: a request with the same idempotency key is still in progress");
        return;
    }
    if (s == 401 || s == 403) {
        out->alert_owner = true;
        verdict_set(out, TALLY_VERDICT_FAILED, code,
                    "HTTP %ld: the tool refused tally's credentials", s);
        return;
    }
    if (s >= 400 && s < 500) {
        verdict_set(out, TALLY_VERDICT_FAILED, code, "HTTP %ld: the tool rejected the request", s);
        return;
    }
    verdict_set(out, TALLY_VERDICT_UNKNOWN, code,
                "HTTP %ld after the request was sent: the effect may or may not have happened", s);
}

void tally_conn_classify_status(const tally_conn_result_t *res, tally_conn_verdict_t *out)
{
    verdict_init(res, out);
    long s = res->http_status;
    if (!res->sent) {
        verdict_set(out, TALLY_VERDICT_INCONCLUSIVE, "not_sent",
                    "the status check was not sent: %s", curl_msg(res));
        return;
    }
    if (s == 0) {
        verdict_no_answer(res, out, TALLY_VERDICT_INCONCLUSIVE);
        return;
    }
    if (s != 200) {
        char code[32];
        snprintf(code, sizeof code, "http_%ld", s);
        verdict_set(out, TALLY_VERDICT_INCONCLUSIVE, code, "status check answered HTTP %ld", s);
        return;
    }
    if (res->curl_code != CURLE_OK || res->body_truncated) {
        verdict_set(out, TALLY_VERDICT_INCONCLUSIVE, "incomplete_body",
                    "status check answered 200 but its body was incomplete or over %zu bytes",
                    res->body_len);
        return;
    }
    json_error_t jerr;
    json_t *doc = json_loadb(res->body ? res->body : "", res->body_len,
                             TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, &jerr);
    if (!doc || !json_is_array(doc)) {
        verdict_set(out, TALLY_VERDICT_INCONCLUSIVE, "not_an_array",
                    "status check answered 200 without a JSON array%s%s", doc ? "" : ": ",
                    doc ? "" : jerr.text);
        json_decref(doc);
        return;
    }
    out->n_records = json_array_size(doc);
    json_decref(doc);
    if (out->n_records == 0)
        verdict_set(out, TALLY_VERDICT_NOT_FOUND, "not_found",
                    "no upstream record carries the key");
    else if (out->n_records == 1)
        verdict_set(out, TALLY_VERDICT_FOUND, "found", "one upstream record carries the key");
    else
        verdict_set(out, TALLY_VERDICT_DUPLICATE, "duplicate", "%zu upstream records carry the key",
                    out->n_records);
}

void tally_conn_classify_compensate(const tally_conn_result_t *res, tally_conn_verdict_t *out)
{
    verdict_init(res, out);
    long s = res->http_status;
    if (!res->sent) {
        verdict_set(out, TALLY_VERDICT_RETRY, "not_sent", "the reverse call was not sent: %s",
                    curl_msg(res));
        return;
    }
    if (s == 0) {
        verdict_no_answer(res, out, TALLY_VERDICT_RETRY);
        return;
    }
    char code[32];
    snprintf(code, sizeof code, "http_%ld", s);
    if (s >= 200 && s < 300) {
        verdict_set(out, TALLY_VERDICT_RESOLVED, code, "HTTP %ld", s);
        return;
    }
    if (s == 404) {
        verdict_set(out, TALLY_VERDICT_RESOLVED, "already_reversed",
                    "HTTP 404: the external ref is already reversed or gone");
        return;
    }
    if (s == 412) {
        verdict_set(out, TALLY_VERDICT_STUCK, "stale_state",
                    "HTTP 412: the resource changed since tally touched it (If-Match failed); "
                    "not overwriting");
        return;
    }
    if (s == 409) {
        out->in_progress = true;
        verdict_set(out, TALLY_VERDICT_RETRY, code,
                    "HTTP 409: the same reverse key is still in progress");
        return;
    }
    if (status_refused_unprocessed(s)) {
        verdict_set(out, TALLY_VERDICT_RETRY, code,
                    "HTTP %ld: the tool refused the reverse call without applying it", s);
        return;
    }
    if (s >= 400 && s < 500) {
        verdict_set(out, TALLY_VERDICT_STUCK, code, "HTTP %ld: the tool rejected the reverse call",
                    s);
        return;
    }
    verdict_set(out, TALLY_VERDICT_RETRY, code, "HTTP %ld from the reverse call", s);
}
