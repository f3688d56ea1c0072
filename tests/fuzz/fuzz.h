/* fuzz.h — what every libFuzzer target of tests/fuzz shares: the entry points and the checks.
 *
 * A check that fails prints what it found and aborts, which libFuzzer reports as a crash and
 * saves the input (docs/hacking.md "Fuzzing"). */
#ifndef TALLY_FUZZ_H
#define TALLY_FUZZ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/json.h"

/* libFuzzer's entry points; LLVMFuzzerInitialize is optional (fuzz_intake.c loads its registry
 * there). */
int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/** Abort with the condition and a printf-style explanation when @p cond is false. */
#define FUZZ_CHECK(cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: invariant failed: %s\n  ", __FILE__, __LINE__, #cond);         \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

/** Check that @p s, written into a buffer of @p bufsz bytes, is a NUL-terminated string
 * within it and valid UTF-8. @returns its length. */
static inline size_t fuzz_check_text(const char *what, const char *s, size_t bufsz)
{
    FUZZ_CHECK(s != NULL, "%s is NULL", what);
    const char *nul = memchr(s, '\0', bufsz);
    FUZZ_CHECK(nul != NULL, "%s has no NUL within its %zu bytes", what, bufsz);
    size_t len = (size_t)(nul - s);
    FUZZ_CHECK(tally_utf8_valid(s, len), "%s is not valid UTF-8: \"%s\"", what, s);
    return len;
}

/** The same for a malloc'd string (no buffer size to hold it to). */
static inline size_t fuzz_check_str(const char *what, const char *s)
{
    FUZZ_CHECK(s != NULL, "%s is NULL", what);
    size_t len = strlen(s);
    FUZZ_CHECK(tally_utf8_valid(s, len), "%s is not valid UTF-8: \"%s\"", what, s);
    return len;
}

/** Whether @p s[0..len) holds a control character (below 0x20, or DEL). */
static inline bool fuzz_has_control(const char *s, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f)
            return true;
    }
    return false;
}

/** A malloc'd, NUL-terminated copy of @p data[0..size) (the NUL is added, not checked). */
static inline char *fuzz_strndup(const uint8_t *data, size_t size)
{
    char *s = malloc(size + 1);
    if (s == NULL)
        abort();
    if (size > 0)
        memcpy(s, data, size);
    s[size] = '\0';
    return s;
}

#endif
