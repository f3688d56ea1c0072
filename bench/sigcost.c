/* sigcost.c — what signing one tool request costs, by scheme (issue 23): the headers of a
 * typical execute call (a 200-byte JSON body) built N times with no signature, with the legacy
 * Tally-Signature, and with RFC 9421 + Content-Digest (both as tally builds them for a call,
 * tally_conn_headers_signed). Prints one `bench:` line per scheme: microseconds per request,
 * the best of five rounds. A figure, not a test. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <curl/curl.h>

#include "tally/connector.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double per_request_us(const tally_conn_request_t *req, const tally_conn_signing_t *sign,
                             int n)
{
    double best = 1e30;
    for (int round = 0; round < 5; round++) {
        double t0 = now_s();
        for (int i = 0; i < n; i++) {
            tally_error_t err;
            struct curl_slist *h = tally_conn_headers_signed(
                req, "POST", "https://billing.internal/charges", sign, 1700000000LL + i, &err);
            if (h == NULL) {
                fprintf(stderr, "sigcost: %s\n", err.message);
                exit(1);
            }
            curl_slist_free_all(h);
        }
        double us = (now_s() - t0) / n * 1e6;
        best = us < best ? us : best;
    }
    return best;
}

int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 20000;
    if (n <= 0)
        n = 20000;
    static const char body[] =
        "{\"amount\":4200,\"currency\":\"eur\",\"customer\":\"cus_0123456789\","
        "\"description\":\"order 98765 for tenant t1\",\"payment_id\":"
        "\"pay_0123456789abcdef\",\"tenant_id\":\"t1\",\"metadata\":{\"run\":"
        "\"run-0123456789ab\"}}";
    tally_conn_request_t req = {.op = TALLY_CONN_EXECUTE,
                                .idempotency_key = "charge_card:t1:pay_0123456789abcdef",
                                .run_id = "run-0123456789ab",
                                .effect_id = "01a21804-e3a0-79db-86f5-3c1f9845bdcb",
                                .traceparent =
                                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                .body = body,
                                .body_len = sizeof body - 1};
    tally_conn_signing_t none = {0};
    tally_conn_signing_t legacy = {.legacy_secret = "whsec_0123456789abcdef0123456789abcdef"};
    tally_conn_signing_t rfc = {.key_id = "billing-2026-11",
                                .key = "whsec_0123456789abcdef0123456789abcdef",
                                .window_s = 300};
    double base = per_request_us(&req, &none, n);
    double l = per_request_us(&req, &legacy, n);
    double r = per_request_us(&req, &rfc, n);
    printf("bench: sig_headers_unsigned = %.2f us/request\n", base);
    printf("bench: sig_legacy = %.2f us/request (+%.2f: Tally-Signature)\n", l, l - base);
    printf("bench: sig_rfc9421 = %.2f us/request (+%.2f: Content-Digest, Signature-Input, "
           "Signature)\n",
           r, r - base);
    return 0;
}
