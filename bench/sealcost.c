/* sealcost.c — what sealing a sensitive effect costs (issue 23), on the paths an effect takes:
 *   intake    redact the args (two pointers), canonical JSON and input hash of the redacted
 *             args, seal the canonical args (dispatcher/sensitive.c, seal_intent);
 *   delivery  open the tenant key and the sealed args, and remember their values
 *             (tally_sensitive_open), once per attempt;
 *   receipt   seal the receipt, redact it and scrub it of every value (tally_sensitive_receipt);
 * against the same intake without sensitive fields (canonical JSON and input hash alone).
 * Prints one `bench:` line per path: microseconds per effect, the best of five rounds of N
 * (20,000). A figure, not a test. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tally/config.h"
#include "tally/connector.h"
#include "tally/json.h"
#include "tally/registry.h"
#include "tally/seal.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void die(const char *what)
{
    fprintf(stderr, "sealcost: %s\n", what);
    exit(1);
}

typedef struct fixture {
    json_t *args;
    const char *receipt;
    tally_tool_t tool;
    tally_keyring_t *kr;
    tally_tenant_key_t key;
    char *wrapped;
    const char *master;
    char *sealed_args;
} fixture_t;

static void intake_plain(fixture_t *f)
{
    char *canon = tally_json_canonical(f->args);
    char hash[65];
    if (canon == NULL || !tally_sha256_hex(canon, strlen(canon), hash))
        die("canonical");
    free(canon);
}

static void intake_sealed(fixture_t *f)
{
    char *canon = tally_json_canonical(f->args); /* what the tool gets */
    json_t *doc = json_deep_copy(f->args);
    tally_redactor_t r;
    tally_redactor_init(&r, &f->key);
    if (canon == NULL || doc == NULL ||
        tally_redactor_apply(&r, doc, f->tool.sensitive_args, f->tool.n_sensitive_args) != 2)
        die("redact");
    char *stored = tally_json_canonical(doc);
    char hash[65];
    char *sealed =
        tally_seal(&f->key, "01a21804-e3a0-79db-86f5-3c1f9845bdcb/args", canon, strlen(canon));
    if (stored == NULL || sealed == NULL || !tally_sha256_hex(stored, strlen(stored), hash))
        die("seal");
    free(sealed);
    free(stored);
    free(canon);
    json_decref(doc);
    tally_redactor_clear(&r);
}

static void delivery(fixture_t *f)
{
    tally_sealed_row_t row = {.effect_id = "01a21804-e3a0-79db-86f5-3c1f9845bdcb",
                              .key_id = f->key.key_id,
                              .master_id = f->master,
                              .wrapped = f->wrapped,
                              .args_sealed = f->sealed_args};
    tally_redactor_t *red = NULL;
    char *body = NULL;
    size_t len = 0;
    tally_error_t err;
    if (!tally_sensitive_open(f->kr, &f->tool, &row, &red, &body, &len, &err))
        die(err.message);
    free(body);
    tally_redactor_free(red);
}

static void receipt(fixture_t *f)
{
    tally_redactor_t r;
    tally_redactor_init(&r, &f->key);
    json_t *doc = json_deep_copy(f->args);
    if (doc == NULL ||
        tally_redactor_apply(&r, doc, f->tool.sensitive_args, f->tool.n_sensitive_args) != 2)
        die("remember");
    json_decref(doc);
    tally_conn_result_t res = {.tool = &f->tool,
                               .op = TALLY_CONN_EXECUTE,
                               .http_status = 201,
                               .body = f->receipt,
                               .body_len = strlen(f->receipt),
                               .body_total = strlen(f->receipt)};
    char *text = NULL, *ref = NULL, *sealed = NULL;
    if (!tally_sensitive_receipt(&r, &f->tool, "01a21804-e3a0-79db-86f5-3c1f9845bdcb", &res, &text,
                                 &ref, &sealed))
        die("receipt");
    free(text);
    free(ref);
    free(sealed);
    tally_redactor_clear(&r);
}

static double per_effect_us(void (*fn)(fixture_t *), fixture_t *f, int n)
{
    double best = 1e30;
    for (int round = 0; round < 5; round++) {
        double t0 = now_s();
        for (int i = 0; i < n; i++)
            fn(f);
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
    fixture_t f = {0};
    json_error_t jerr;
    /* a typical charge: the args of bench/sigcost.c with a card and an SSN */
    f.args = json_loads("{\"amount\":4200,\"currency\":\"eur\",\"customer\":\"cus_0123456789\","
                        "\"description\":\"order 98765 for tenant t1\",\"payment_id\":"
                        "\"pay_0123456789abcdef\",\"tenant_id\":\"t1\",\"card\":{\"number\":"
                        "\"4111111111111111\",\"exp\":\"12/29\",\"cvc\":\"737\"},\"ssn\":"
                        "\"078-05-1120\"}",
                        0, &jerr);
    f.receipt =
        "{\"id\":\"ch_0123456789\",\"status\":\"succeeded\",\"amount\":4200,"
        "\"payment_method\":{\"card\":{\"last4\":\"1111\",\"number\":\"4111111111111111\"}},"
        "\"echo\":\"charged 4111111111111111 for 078-05-1120\"}";
    static char *args_ptrs[] = {"/card", "/ssn"};
    static char *receipt_ptrs[] = {"/payment_method/card"};
    f.tool = (tally_tool_t){.name = "charge_card",
                            .sensitive_args = args_ptrs,
                            .n_sensitive_args = 2,
                            .sensitive_receipt = receipt_ptrs,
                            .n_sensitive_receipt = 1};
    tally_config_t cfg = {.master_key = "m1:a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2s=",
                          .master_key_file = ""};
    tally_error_t err;
    f.kr = tally_keyring_load(&cfg, &err);
    if (f.args == NULL || f.kr == NULL ||
        !tally_tenant_key_new(f.kr, &f.key, &f.wrapped, &f.master, &err))
        die("fixture");
    char *canon = tally_json_canonical(f.args);
    f.sealed_args =
        tally_seal(&f.key, "01a21804-e3a0-79db-86f5-3c1f9845bdcb/args", canon, strlen(canon));
    free(canon);

    double plain = per_effect_us(intake_plain, &f, n);
    double in = per_effect_us(intake_sealed, &f, n);
    double del = per_effect_us(delivery, &f, n);
    double rec = per_effect_us(receipt, &f, n);
    printf("bench: seal_intake_plain = %.2f us/effect (canonical args and input hash)\n", plain);
    printf("bench: seal_intake = %.2f us/effect (+%.2f: redact 2 fields, hash, AES-256-GCM)\n", in,
           in - plain);
    printf("bench: seal_delivery = %.2f us/attempt (open the tenant key and the args)\n", del);
    printf("bench: seal_receipt = %.2f us/effect (seal, redact and scrub the receipt)\n", rec);
    printf("bench: seal_total = %.2f us/effect (one attempt)\n", in - plain + del + rec);
    free(f.sealed_args);
    free(f.wrapped);
    json_decref(f.args);
    tally_keyring_free(f.kr);
    return 0;
}
