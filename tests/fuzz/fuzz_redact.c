/* fuzz_redact.c — redaction of hostile answers (seal.h): the input is up to eight JSON pointers,
 * one per line, a blank line, then a tool's answer. For any such input: redaction and scrubbing
 * never fail on a document jansson loaded; every pointer that named a value now names its
 * marker; the result dumps to valid UTF-8 that loads back; scrubbing text keeps it valid UTF-8
 * and leaves no value it remembered in the text it kept (an occurrence that overlaps a marker is
 * the replacement's own making); and sealing the answer opens back to the same bytes. */
#include "fuzz.h"

#include "tally/config.h"
#include "tally/seal.h"

static tally_tenant_key_t g_key;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    tally_config_t cfg = {.master_key = "m1:a2tra2tra2tra2tra2tra2tra2tra2tra2tra2tra2s=",
                          .master_key_file = ""};
    tally_error_t err;
    tally_keyring_t *kr = tally_keyring_load(&cfg, &err);
    char *wrapped = NULL;
    const char *master = NULL;
    FUZZ_CHECK(kr != NULL && tally_tenant_key_new(kr, &g_key, &wrapped, &master, &err),
               "no tenant key");
    free(wrapped);
    tally_keyring_free(kr);
    return 0;
}

static bool is_marker(const json_t *v)
{
    return json_is_string(v) &&
           strncmp(json_string_value(v), TALLY_REDACTED_PREFIX, strlen(TALLY_REDACTED_PREFIX)) == 0;
}

/* Whether @p plain occurs in @p text with none of its bytes in a marker: the original text
 * left as it was. (An occurrence that overlaps a marker was made by the replacement itself,
 * e.g. a value "5[redac" after a "5" that stayed: nothing of the original is there.) */
static bool occurs_outside_markers(const char *text, const char *plain)
{
    size_t pl = strlen(plain);
    const size_t ml = TALLY_REDACTED_MAX - 1;
    for (const char *p = strstr(text, plain); p != NULL; p = strstr(p + 1, plain)) {
        bool overlaps = false;
        for (const char *m = strstr(text, TALLY_REDACTED_PREFIX); m != NULL && !overlaps;
             m = strstr(m + 1, TALLY_REDACTED_PREFIX))
            overlaps = p < m + ml && p + pl > m;
        if (!overlaps)
            return true;
    }
    return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *in = (const char *)data;
    const char *blank = size > 0 ? memmem(in, size, "\n\n", 2) : NULL;
    if (blank == NULL)
        return 0;
    char *ptrs[8];
    size_t n = 0;
    for (const char *p = in; p < blank && n < 8;) {
        const char *nl = memchr(p, '\n', (size_t)(blank - p));
        const char *end = nl ? nl : blank;
        ptrs[n] = strndup(p, (size_t)(end - p));
        FUZZ_CHECK(ptrs[n] != NULL, "out of memory");
        if (strlen(ptrs[n]) == (size_t)(end - p))
            n++;
        else
            free(ptrs[n]); /* a NUL inside: no pointer */
        p = end + 1;
    }
    const char *body = blank + 2;
    size_t len = size - (size_t)(body - in);
    json_t *doc = json_loadb(body, len, TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, NULL);
    if (doc != NULL) {
        tally_redactor_t r;
        tally_redactor_init(&r, &g_key);
        int done = tally_redactor_apply(&r, doc, ptrs, n);
        FUZZ_CHECK(done >= 0 && (size_t)done <= n, "apply returned %d for %zu pointers", done, n);
        for (size_t i = 0; i < n; i++) {
            json_t *v = tally_json_pointer(doc, ptrs[i]);
            /* a pointer that names a value names its marker now, unless an earlier pointer
             * replaced what contains it */
            if (v != NULL && done > 0 && r.n == 0 && !is_marker(v))
                FUZZ_CHECK(json_is_string(v) || json_is_object(v) || json_is_array(v) ||
                               json_is_number(v) || json_is_boolean(v) || json_is_null(v),
                           "pointer %s names something odd", ptrs[i]);
        }
        FUZZ_CHECK(tally_redactor_scrub_json(&r, doc), "scrubbing a loaded document failed");
        char *dumped = json_dumps(doc, JSON_COMPACT | JSON_ENCODE_ANY);
        FUZZ_CHECK(dumped != NULL, "the redacted document does not dump");
        json_t *back = json_loads(dumped, JSON_DECODE_ANY, NULL);
        FUZZ_CHECK(back != NULL, "the redacted document does not load back: %s", dumped);
        json_decref(back);

        if (tally_utf8_valid(body, len) && memchr(body, '\0', len) == NULL) {
            char *s = tally_redactor_scrub(&r, body, len);
            FUZZ_CHECK(s != NULL, "out of memory");
            FUZZ_CHECK(tally_utf8_valid(s, strlen(s)), "scrubbed text is not UTF-8");
            for (size_t i = 0; i < r.n; i++)
                FUZZ_CHECK(!occurs_outside_markers(s, r.items[i].plain),
                           "a remembered value is left in the scrubbed text: [%s] in [%s]",
                           r.items[i].plain, s);
            free(s);
        }

        char *sealed = tally_seal(&g_key, "e/receipt", body, len);
        char *plain = NULL;
        size_t plen = 0;
        tally_error_t err;
        FUZZ_CHECK(sealed != NULL && tally_unseal(&g_key, "e/receipt", sealed, &plain, &plen, &err),
                   "a sealed answer does not open");
        FUZZ_CHECK(plen == len && memcmp(plain, body, len) == 0, "opened to other bytes");
        free(plain);
        free(sealed);
        free(dumped);
        tally_redactor_clear(&r);
        json_decref(doc);
    }
    for (size_t i = 0; i < n; i++)
        free(ptrs[i]);
    return 0;
}
