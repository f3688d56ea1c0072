/* fuzz_canonical.c — tally_json_canonical round trip: for any JSON that jansson loads, the
 * canonical text is valid UTF-8, loads back to an equal value, and is a fixed point (the
 * canonical form of what it loads to is the same text, byte for byte: the strict check for
 * reals, whose shortest form must read back as the same double). */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    json_t *v = json_loadb((const char *)data, size, TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, NULL);
    if (v == NULL)
        return 0;
    char *canon = tally_json_canonical(v);
    FUZZ_CHECK(canon != NULL, "a value jansson loaded has no canonical form");
    size_t len = fuzz_check_str("canonical text", canon);

    json_error_t jerr;
    json_t *back = json_loadb(canon, len, TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, &jerr);
    FUZZ_CHECK(back != NULL, "the canonical text does not load: %s: %s", jerr.text, canon);
    FUZZ_CHECK(json_equal(v, back), "the canonical text is another value: %s", canon);

    char *again = tally_json_canonical(back);
    FUZZ_CHECK(again != NULL && strcmp(again, canon) == 0, "not a fixed point:\n  %s\n  %s", canon,
               again ? again : "(null)");

    char hash[65];
    FUZZ_CHECK(tally_input_hash(v, hash) && strlen(hash) == 64, "no input hash");

    free(again);
    json_decref(back);
    free(canon);
    json_decref(v);
    return 0;
}
