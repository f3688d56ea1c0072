/* fuzz_intake.c — the dispatcher's intake validation of one message (dispatcher/intake.c
 * parse_msg): tally_intent_parse, then the registry lookup and the operation key, then the
 * canonical arguments, against a small registry loaded once.
 *
 * Invariants: every sentence that reaches the DLQ (the 256-byte detail, the error message it
 * is copied from) is valid UTF-8 within its buffer; a key is what the intent carried, or
 * "<tool>:..." built from its args, at most TALLY_LIMIT_OPERATION_KEY bytes and without a
 * control character (it is sent as the Idempotency-Key header). */
#include "fuzz.h"

#include "tally/cloudevent.h"
#include "tally/registry.h"
#include "tally/text.h"

#define DETAIL_BYTES 256     /* dispatcher/dispatcher.h intake_msg_t.detail */
#define MAX_MESSAGE  1048576 /* TALLY_MAX_MESSAGE_BYTES default */
#define TOOLS_PATH   "/etc/tally/tools.json"

/* The tools of examples/tools/demo.json that intents name most, one that needs an explicit
 * key, and three whose key argument has a long name of 2-, 3- and 4-byte characters: their
 * error messages are cut at the 512 bytes of tally_error_t.message, inside a character. */
static const char REGISTRY[] =
    "{\"tools\": ["
    "{\"name\": \"check_balance\", \"effect_class\": \"read\", \"operation_key\": [\"request_id\"],"
    " \"connector\": {\"type\": \"http\", \"base_url\": \"http://127.0.0.1:9000\","
    " \"execute\": {\"method\": \"POST\", \"path\": \"/balance_checks\"}}},"
    "{\"name\": \"charge_card\", \"effect_class\": \"reversible\","
    " \"operation_key\": [\"tenant_id\", \"payment_id\"],"
    " \"connector\": {\"type\": \"http\", \"base_url\": \"http://127.0.0.1:9000\","
    " \"execute\": {\"method\": \"POST\", \"path\": \"/charges\"},"
    " \"status\": {\"method\": \"GET\", \"path\": \"/charges\"},"
    " \"compensate\": {\"method\": \"POST\", \"path\": \"/charges/reverse\"}}},"
    "{\"name\": \"send_email\", \"effect_class\": \"append_only\","
    " \"operation_key\": [\"message_id\"],"
    " \"connector\": {\"type\": \"http\", \"base_url\": \"http://127.0.0.1:9000\","
    " \"execute\": {\"method\": \"POST\", \"path\": \"/emails\"}}},"
    "{\"name\": \"update_ledger\", \"effect_class\": \"idempotent\","
    " \"connector\": {\"type\": \"http\", \"base_url\": \"http://127.0.0.1:9000\","
    " \"execute\": {\"method\": \"PUT\", \"path\": \"/ledger\"}}}"
    "]}";

static const struct {
    const char *tool;
    const char *ch; /* the character the key argument's name is made of */
    size_t count;
} WIDE[] = {
    {"wide_two", "\xc3\xa9", 240},          /* é: 480 bytes */
    {"wide_three", "\xe2\x82\xac", 160},    /* €: 480 bytes */
    {"wide_four", "\xf0\x9f\x98\x80", 120}, /* 😀: 480 bytes */
};

static tally_registry_t *reg;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    json_t *doc = json_loads(REGISTRY, TALLY_JSON_LOAD_FLAGS, NULL);
    FUZZ_CHECK(doc != NULL, "the registry of fuzz_intake.c is not JSON");
    for (size_t i = 0; i < sizeof WIDE / sizeof WIDE[0]; i++) {
        size_t w = strlen(WIDE[i].ch);
        char *field = malloc(1 + w * WIDE[i].count + 1);
        FUZZ_CHECK(field != NULL, "out of memory");
        field[0] = 'k';
        for (size_t k = 0; k < WIDE[i].count; k++)
            memcpy(field + 1 + k * w, WIDE[i].ch, w);
        field[1 + w * WIDE[i].count] = '\0';
        json_t *tool = json_pack("{s:s, s:s, s:[s], s:{s:s, s:s, s:{s:s, s:s}}}", "name",
                                 WIDE[i].tool, "effect_class", "idempotent", "operation_key", field,
                                 "connector", "type", "http", "base_url", "http://127.0.0.1:9000",
                                 "execute", "method", "POST", "path", "/wide");
        FUZZ_CHECK(tool != NULL, "cannot build tool %s", WIDE[i].tool);
        json_array_append_new(json_object_get(doc, "tools"), tool);
        free(field);
    }
    tally_problems_t problems = {0};
    reg = tally_registry_load_json(doc, &problems);
    for (size_t i = 0; i < problems.n; i++)
        fprintf(stderr, "fuzz_intake: %s\n", problems.lines[i]);
    FUZZ_CHECK(reg != NULL, "the registry of fuzz_intake.c does not load");
    tally_problems_clear(&problems);
    json_decref(doc);
    return 0;
}

static void check_key(const tally_tool_t *tool, const tally_intent_t *in, const char *key)
{
    size_t len = fuzz_check_str("operation key", key);
    FUZZ_CHECK(len > 0 && len <= TALLY_LIMIT_OPERATION_KEY, "the key is %zu bytes", len);
    FUZZ_CHECK(!fuzz_has_control(key, len), "the key holds a control character: \"%s\"", key);
    if (in->operation_key != NULL) {
        FUZZ_CHECK(strcmp(key, in->operation_key) == 0, "key \"%s\" for explicit \"%s\"", key,
                   in->operation_key);
    } else {
        size_t n = strlen(tool->name);
        FUZZ_CHECK(tool->n_operation_key > 0, "tool %s has no key fields, yet a key", tool->name);
        FUZZ_CHECK(len > n && memcmp(key, tool->name, n) == 0 && key[n] == ':',
                   "derived key \"%s\" of tool %s", key, tool->name);
    }
}

static void check_key_error(const tally_error_t *err, char *detail)
{
    fuzz_check_text("error code", err->code, sizeof err->code);
    size_t len = fuzz_check_text("error message", err->message, sizeof err->message);
    FUZZ_CHECK(len > 0, "no error message (code %s)", err->code);
    FUZZ_CHECK(err->errc == TALLY_ERR_MISSING_OPERATION_KEY || err->errc == TALLY_ERR_INVALID_FIELD,
               "error code %s", err->code);
    tally_text_copy(detail, DETAIL_BYTES, err->message);
    fuzz_check_text("detail (from the error message)", detail, DETAIL_BYTES);
}

static void intake(tally_intent_t *in, char *detail)
{
    FUZZ_CHECK(!fuzz_has_control(in->run_id, strlen(in->run_id)),
               "run_id with a control character passed the parser");
    if (in->type != TALLY_MSG_INTENT)
        return;
    const tally_tool_t *tool = tally_registry_find(reg, in->tool);
    bool named = false;
    for (size_t i = 0; i < tally_registry_count(reg); i++)
        named = named || strcmp(tally_registry_at(reg, i)->name, in->tool) == 0;
    FUZZ_CHECK((tool != NULL) == named, "tally_registry_find(\"%s\") answered %p", in->tool,
               (const void *)tool);
    if (tool == NULL) {
        tally_fmt(detail, DETAIL_BYTES, "tool '%s' is not in the registry (%s)", in->tool,
                  TOOLS_PATH);
        fuzz_check_text("detail (unknown tool)", detail, DETAIL_BYTES);
        return;
    }
    FUZZ_CHECK(strcmp(tool->name, in->tool) == 0, "found %s for %s", tool->name, in->tool);

    tally_error_t err;
    tally_error_clear(&err);
    char *key = tally_registry_operation_key(tool, in->args, in->operation_key, &err);
    if (key == NULL) {
        check_key_error(&err, detail);
        return;
    }
    check_key(tool, in, key);
    free(key);

    char *canonical = tally_json_canonical(in->args);
    FUZZ_CHECK(canonical != NULL, "args that jansson loaded have no canonical form");
    fuzz_check_str("canonical args", canonical);
    char hash[65];
    FUZZ_CHECK(tally_sha256_hex(canonical, strlen(canonical), hash), "no input hash");
    free(canonical);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *detail = malloc(DETAIL_BYTES);
    FUZZ_CHECK(detail != NULL, "out of memory");
    tally_intent_t in;
    tally_dlq_reason_t r = tally_intent_parse(data, size, MAX_MESSAGE, &in, detail, DETAIL_BYTES);
    if (r == TALLY_DLQ_NONE) {
        intake(&in, detail);
        tally_intent_clear(&in);
    } else {
        fuzz_check_text("detail", detail, DETAIL_BYTES);
    }
    free(detail);
    return 0;
}
