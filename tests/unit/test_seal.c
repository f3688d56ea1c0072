/* test_seal.c — sensitive fields (seal.h): master keys are read strictly and never quoted;
 * tenant keys wrap and open only under their master key and id; sealed values open only with
 * their key and their row and field; tampering is detected; markers are equal for equal
 * values under one key and unlinkable across keys; redaction follows RFC 6901 pointers and
 * scrubbing finds echoed values, multi-byte UTF-8 included. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tally/config.h"
#include "tally/seal.h"

/* 32 bytes of 'k' and of 'm', in base64 */
#define KEY_K "a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2s="
#define KEY_M "bW1tbW1tbW1tbW1tbW1tbW1tbW1tbW1tbW1tbW1tbW0="

static tally_keyring_t *ring(const char *value, tally_error_t *err)
{
    tally_config_t cfg = {0};
    cfg.master_key = (char *)value;
    cfg.master_key_file = (char *)"";
    tally_error_clear(err);
    return tally_keyring_load(&cfg, err);
}

static void test_master_keys(void **state)
{
    (void)state;
    tally_error_t err;
    tally_keyring_t *kr = ring("", &err);
    assert_non_null(kr);
    assert_false(tally_keyring_ready(kr));
    tally_keyring_free(kr);

    kr = ring(" m1:" KEY_K " , m0:" KEY_M, &err);
    assert_non_null(kr);
    assert_true(tally_keyring_ready(kr));
    tally_keyring_free(kr);

    static const char *const bad[] = {
        "m1",                                                 /* no colon */
        ":" KEY_K,                                            /* no id */
        "m 1:" KEY_K,                                         /* a space in the id */
        "m1:a2tra2tra2s=",                                    /* 8 bytes */
        "m1:" KEY_K "AAAA",                                   /* too long */
        "m1:" KEY_K ",m1:" KEY_M,                             /* the same id twice */
        "m1:a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2t", /* 44 characters, no padding */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kr = ring(bad[i], &err);
        if (kr != NULL)
            fail_msg("accepted master key value %zu: %s", i, bad[i]);
        assert_int_equal(err.errc, TALLY_ERR_INVALID);
        assert_non_null(strstr(err.message, "TALLY_MASTER_KEY"));
        /* never the key itself */
        assert_null(strstr(err.message, "a2tra2tr"));
    }
}

static void test_key_file(void **state)
{
    (void)state;
    char path[] = "/tmp/tally-test-seal-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char line[] = "m1:" KEY_K "\n";
    assert_int_equal(write(fd, line, strlen(line)), (ssize_t)strlen(line));
    close(fd);
    tally_config_t cfg = {0};
    cfg.master_key = (char *)"ignored:not-a-key";
    cfg.master_key_file = path;
    tally_error_t err;
    tally_error_clear(&err);
    tally_keyring_t *kr = tally_keyring_load(&cfg, &err);
    assert_non_null(kr);
    assert_true(tally_keyring_ready(kr));
    tally_keyring_free(kr);
    unlink(path);
    kr = tally_keyring_load(&cfg, &err);
    assert_null(kr);
    assert_non_null(strstr(err.message, "TALLY_MASTER_KEY_FILE"));
}

static void test_tenant_keys_and_sealing(void **state)
{
    (void)state;
    tally_error_t err;
    tally_keyring_t *kr = ring("m2:" KEY_M ",m1:" KEY_K, &err);
    tally_tenant_key_t key, opened, other;
    char *wrapped = NULL;
    const char *master = NULL;
    assert_true(tally_tenant_key_new(kr, &key, &wrapped, &master, &err));
    assert_string_equal(master, "m2");
    assert_memory_equal(wrapped, "\\x", 2);
    assert_true(tally_tenant_key_open(kr, key.key_id, master, wrapped, &opened, &err));
    assert_memory_equal(opened.dek, key.dek, sizeof key.dek);
    assert_memory_equal(opened.hash_key, key.hash_key, sizeof key.hash_key);

    /* only under its master key, its own id, and intact */
    assert_false(tally_tenant_key_open(kr, key.key_id, "m1", wrapped, &other, &err));
    assert_int_equal(err.errc, TALLY_ERR_SEALED);
    assert_false(tally_tenant_key_open(kr, key.key_id, "m9", wrapped, &other, &err));
    assert_non_null(strstr(err.message, "'m9'"));
    assert_false(tally_tenant_key_open(kr, "01a21804-0000-7000-8000-000000000000", master, wrapped,
                                       &other, &err));
    assert_false(tally_tenant_key_open(kr, key.key_id, master, NULL, &other, &err));
    assert_non_null(strstr(err.message, "forgotten"));
    char *tampered = strdup(wrapped);
    tampered[10] = tampered[10] == '0' ? '1' : '0';
    assert_false(tally_tenant_key_open(kr, key.key_id, master, tampered, &other, &err));
    free(tampered);

    /* sealing: bytes back exactly, NUL and multi-byte included; bound to the aad */
    const char data[] =
        "{\"ssn\":\"078-05-1120\",\"name\":\"J\xc3\xa9r\xc3\xb4me \xf0\x9f\x98\x80\"}";
    char *sealed = tally_seal(&key, "e1/args", data, sizeof data);
    assert_non_null(sealed);
    /* the plaintext's own bytes (as bytea hex) are nowhere in the sealed text; a short
     * substring such as "078" would turn up in random ciphertext now and then */
    assert_null(strstr(sealed, "3037382d30352d31313230"));
    char *plain = NULL;
    size_t len = 0;
    assert_true(tally_unseal(&opened, "e1/args", sealed, &plain, &len, &err));
    assert_int_equal(len, sizeof data);
    assert_memory_equal(plain, data, sizeof data);
    free(plain);
    assert_false(tally_unseal(&opened, "e2/args", sealed, &plain, &len, &err));
    assert_false(tally_unseal(&opened, "e1/receipt", sealed, &plain, &len, &err));
    assert_false(tally_unseal(&opened, "e1/args", "\\x01", &plain, &len, &err));
    assert_false(tally_unseal(&opened, "e1/args", "not bytea", &plain, &len, &err));
    char *again = tally_seal(&key, "e1/args", data, sizeof data);
    assert_string_not_equal(again, sealed); /* a fresh nonce each time */
    sealed[strlen(sealed) - 1] = sealed[strlen(sealed) - 1] == 'a' ? 'b' : 'a';
    assert_false(tally_unseal(&opened, "e1/args", sealed, &plain, &len, &err));
    free(again);
    free(sealed);

    /* an empty value seals too */
    sealed = tally_seal(&key, "e1/args", "", 0);
    assert_true(tally_unseal(&opened, "e1/args", sealed, &plain, &len, &err));
    assert_int_equal(len, 0);
    free(plain);
    free(sealed);

    free(wrapped);
    tally_tenant_key_clear(&key);
    tally_keyring_free(kr);
}

static void new_key(tally_tenant_key_t *key)
{
    tally_error_t err;
    tally_keyring_t *kr = ring("m1:" KEY_K, &err);
    char *wrapped = NULL;
    const char *master = NULL;
    assert_true(tally_tenant_key_new(kr, key, &wrapped, &master, &err));
    free(wrapped);
    tally_keyring_free(kr);
}

static void test_markers(void **state)
{
    (void)state;
    tally_tenant_key_t a, b;
    new_key(&a);
    new_key(&b);
    json_t *v1 = json_string("078-05-1120"), *v2 = json_string("078-05-1120");
    json_t *n = json_integer(78051120);
    char m1[TALLY_REDACTED_MAX], m2[TALLY_REDACTED_MAX], m3[TALLY_REDACTED_MAX],
        m4[TALLY_REDACTED_MAX];
    assert_true(tally_redaction_marker(&a, v1, m1));
    assert_true(tally_redaction_marker(&a, v2, m2));
    assert_true(tally_redaction_marker(&b, v1, m3));
    assert_true(tally_redaction_marker(&a, n, m4));
    assert_string_equal(m1, m2);
    assert_string_not_equal(m1, m3);
    assert_string_not_equal(m1, m4);
    assert_int_equal(strncmp(m1, TALLY_REDACTED_PREFIX, strlen(TALLY_REDACTED_PREFIX)), 0);
    assert_int_equal(strlen(m1), strlen(TALLY_REDACTED_PREFIX) + 33);
    json_decref(v1);
    json_decref(v2);
    json_decref(n);
}

static void test_redact_and_scrub(void **state)
{
    (void)state;
    tally_tenant_key_t key;
    new_key(&key);
    tally_redactor_t r;
    tally_redactor_init(&r, &key);
    json_error_t jerr;
    json_t *doc = json_loads("{\"ssn\":\"078-05-1120\",\"card\":{\"number\":\"4111111111111111\","
                             "\"cvc\":\"737\"},\"a/b\":\"sl\xc3\xa4sh\",\"t~\":\"tilde-value\","
                             "\"list\":[\"zero-item\",\"one-item\"],\"n\":12,\"keep\":\"x\"}",
                             0, &jerr);
    assert_non_null(doc);
    char *const ptrs[] = {"/ssn", "/card/number", "/a~1b",   "/t~0",     "/list/1",
                          "/n",   "/missing",     "/list/7", "/list/01", "/card/cvc/x"};
    int n = tally_redactor_apply(&r, doc, ptrs, sizeof ptrs / sizeof ptrs[0]);
    assert_int_equal(n, 6);
    const char *ssn = json_string_value(json_object_get(doc, "ssn"));
    assert_int_equal(strncmp(ssn, TALLY_REDACTED_PREFIX, strlen(TALLY_REDACTED_PREFIX)), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(doc, "card"), "cvc")),
                        "737");
    assert_string_equal(json_string_value(json_array_get(json_object_get(doc, "list"), 0)),
                        "zero-item");
    assert_true(json_is_string(json_array_get(json_object_get(doc, "list"), 1)));
    assert_true(json_is_string(json_object_get(doc, "n")));
    assert_string_equal(json_string_value(json_object_get(doc, "keep")), "x");
    /* a marker is never redacted again */
    char *first = strdup(ssn);
    assert_int_equal(tally_redactor_apply(&r, doc, ptrs, 1), 0);
    assert_string_equal(json_string_value(json_object_get(doc, "ssn")), first);

    /* scrubbing: every remembered value of 4 bytes or more, wherever it is echoed */
    const char echo[] = "declined: card 4111111111111111 for 078-05-1120 (sl\xc3\xa4sh); 12 items";
    char *s = tally_redactor_scrub(&r, echo, strlen(echo));
    assert_null(strstr(s, "4111111111111111"));
    assert_null(strstr(s, "078-05-1120"));
    assert_null(strstr(s, "sl\xc3\xa4sh"));
    assert_non_null(strstr(s, first));
    assert_non_null(strstr(s, "12 items")); /* "12" is too short to scrub */
    free(s);
    json_t *answer = json_pack("{s:[s, {s:s}], s:s}", "echo", "ssn=078-05-1120", "deep",
                               "4111111111111111", "plain", "nothing here");
    assert_true(tally_redactor_scrub_json(&r, answer));
    char *dumped = json_dumps(answer, JSON_COMPACT);
    assert_null(strstr(dumped, "078-05-1120"));
    assert_null(strstr(dumped, "4111111111111111"));
    assert_non_null(strstr(dumped, "nothing here"));
    free(dumped);
    json_decref(answer);
    /* a sensitive number echoed as a number elsewhere: replaced whole, never as digits inside
     * another number */
    json_t *amount = json_pack("{s:i}", "amount", 4200);
    char *const amount_ptr[] = {"/amount"};
    assert_int_equal(tally_redactor_apply(&r, amount, amount_ptr, 1), 1);
    json_t *echoed = json_pack("{s:i, s:i, s:[i], s:s}", "charged", 4200, "other", 42000, "list",
                               4200, "text", "charged 4200 EUR");
    assert_true(tally_redactor_scrub_json(&r, echoed));
    assert_true(json_is_string(json_object_get(echoed, "charged")));
    assert_string_equal(json_string_value(json_object_get(echoed, "charged")),
                        json_string_value(json_object_get(amount, "amount")));
    assert_int_equal(json_integer_value(json_object_get(echoed, "other")), 42000);
    assert_true(json_is_string(json_array_get(json_object_get(echoed, "list"), 0)));
    assert_null(strstr(json_string_value(json_object_get(echoed, "text")), "4200"));
    json_decref(echoed);
    json_decref(amount);
    free(first);
    json_decref(doc);
    tally_redactor_clear(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_master_keys),
        cmocka_unit_test(test_key_file),
        cmocka_unit_test(test_tenant_keys_and_sealing),
        cmocka_unit_test(test_markers),
        cmocka_unit_test(test_redact_and_scrub),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
