/* fuzz_json_scan.c — tally_json_object_compact and tally_json_scalar_text_of against jansson.
 *
 * The input is a JSON pointer, a newline, and the text (no newline: the whole input is the
 * text and there is no pointer). The scanner may always say "unsure" (NULL); whenever it says
 * yes, json.h promises what is checked here:
 *   - json_loadb(TALLY_JSON_LOAD_FLAGS) loads the text, as an object;
 *   - the compacted text loads too, to an equal value, and is no longer than the text;
 *   - ref is NULL when there is no pointer or it does not resolve (tally_json_pointer on
 *     jansson's value), else it lies inside the returned text and loads to the value there;
 *   - tally_json_scalar_text_of(ref) is tally_json_scalar_text of that value. */
#include "fuzz.h"

static void check_ref(const json_t *doc, const char *ptr, const char *out, const char *ref,
                      size_t ref_len)
{
    json_t *want = tally_json_pointer(doc, ptr);
    if (want == NULL) {
        FUZZ_CHECK(ref == NULL && ref_len == 0, "pointer \"%s\" does not resolve, yet a ref", ptr);
        return;
    }
    FUZZ_CHECK(ref != NULL, "pointer \"%s\" resolves, yet no ref", ptr);
    size_t out_len = strlen(out);
    FUZZ_CHECK(ref >= out && ref_len <= out_len && (size_t)(ref - out) <= out_len - ref_len,
               "the ref of \"%s\" is outside the returned text", ptr);
    json_error_t jerr;
    json_t *got = json_loadb(ref, ref_len, TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, &jerr);
    FUZZ_CHECK(got != NULL, "the ref of \"%s\" (\"%.*s\") does not load: %s", ptr, (int)ref_len,
               ref, jerr.text);
    FUZZ_CHECK(json_equal(got, want), "the ref of \"%s\" (\"%.*s\") is another value", ptr,
               (int)ref_len, ref);
    json_decref(got);

    char *text_of = tally_json_scalar_text_of(ref, ref_len);
    char *text = tally_json_scalar_text(want);
    FUZZ_CHECK((text_of == NULL) == (text == NULL) && (text == NULL || strcmp(text_of, text) == 0),
               "scalar text of \"%.*s\": \"%s\", of its value: \"%s\"", (int)ref_len, ref,
               text_of ? text_of : "(null)", text ? text : "(null)");
    free(text_of);
    free(text);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nl = memchr(data, '\n', size);
    char *ptr = NULL;
    const char *text = (const char *)data;
    size_t len = size;
    if (nl != NULL) {
        ptr = fuzz_strndup(data, (size_t)(nl - data));
        text = (const char *)nl + 1;
        len = size - (size_t)(nl - data) - 1;
        if (strlen(ptr) != (size_t)(nl - data)) { /* a NUL in it: a C string cannot hold it */
            free(ptr);
            return 0;
        }
    }

    const char *ref = (const char *)data; /* anything: must be reset */
    size_t ref_len = 12345;
    char *out = tally_json_object_compact(text, len, ptr, &ref, &ref_len);
    if (out == NULL) {
        FUZZ_CHECK(ref == NULL && ref_len == 0, "NULL with a ref");
    } else {
        json_error_t jerr;
        json_t *doc = json_loadb(text, len, TALLY_JSON_LOAD_FLAGS, &jerr);
        FUZZ_CHECK(doc != NULL, "the scanner took text that jansson refuses: %s", jerr.text);
        FUZZ_CHECK(json_is_object(doc), "the scanner took text that is not an object");
        size_t out_len = fuzz_check_str("compacted text", out);
        FUZZ_CHECK(out_len <= len, "compacted %zu bytes into %zu", len, out_len);
        json_t *again = json_loadb(out, out_len, TALLY_JSON_LOAD_FLAGS, &jerr);
        FUZZ_CHECK(again != NULL, "the compacted text does not load: %s", jerr.text);
        FUZZ_CHECK(json_equal(doc, again), "the compacted text is another value: %s", out);
        json_decref(again);
        if (ptr == NULL)
            FUZZ_CHECK(ref == NULL && ref_len == 0, "a ref without a pointer");
        else
            check_ref(doc, ptr, out, ref, ref_len);
        json_decref(doc);
        free(out);
    }

    /* Any text at all: no contract but memory safety (json.h gives it a ref). */
    free(tally_json_scalar_text_of(text, len));
    free(ptr);
    return 0;
}
