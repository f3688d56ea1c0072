/* json.h — canonical JSON, the input hash, UTF-8 checks and JSON pointers. */
#ifndef TALLY_JSON_H
#define TALLY_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/error.h"
#include "tally/text.h"

/** Flags for every json_loads of outside input: duplicate keys are an error. */
#define TALLY_JSON_LOAD_FLAGS (JSON_REJECT_DUPLICATES)

/**
 * @brief The canonical form of @p v: object keys sorted (bytewise UTF-8), no whitespace,
 * UTF-8 emitted as is (not \u-escaped). This is the body sent to tools and what is hashed.
 * Reals are written in the shortest of %.15g/%.16g/%.17g that reads back exactly, with ".0"
 * kept on integral values (1.0 stays "1.0"); see json.c for every rule.
 * @returns a malloc'd NUL-terminated string the caller frees, or NULL when out of memory, for a
 * NULL @p v, a NaN or infinite real, or nesting deeper than 2048 levels.
 */
char *tally_json_canonical(const json_t *v) TALLY_WUR;

/** @brief Append @p s[0..len) to @p b as a JSON string: '"', '\\' and the control characters
 * escaped, everything else (UTF-8 included) as it is. */
void tally_json_put_string(tally_strbuf_t *b, const char *s, size_t len);

/**
 * @brief Append @p v, a string, number, true, false or null, to @p b as tally_json_canonical
 * writes it (the CLI's writers use it too, so what they print and what is sent agree).
 * @returns false, with b->failed set, for NULL, an object or array, or a NaN or infinite real.
 */
bool tally_json_put_scalar(tally_strbuf_t *b, const json_t *v);

/** @brief SHA-256 of @p len bytes as 64 lowercase hex characters and a NUL (OpenSSL EVP). */
bool tally_sha256_hex(const void *data, size_t len, char out[65]) TALLY_WUR;

/** @brief The input hash: SHA-256 of tally_json_canonical(@p args). */
bool tally_input_hash(const json_t *args, char out[65]) TALLY_WUR;

/** @brief true when @p s[0..len) is well-formed UTF-8 (no overlongs, surrogates, > U+10FFFF). */
bool tally_utf8_valid(const char *s, size_t len);

/**
 * @brief Resolve RFC 6901 pointer @p ptr ("" is the whole document, "/id", "/a/0/b",
 * with ~0 and ~1 escapes) in @p doc.
 * @returns a borrowed reference, or NULL when the pointer does not resolve.
 */
json_t *tally_json_pointer(const json_t *doc, const char *ptr);

/** @brief A scalar as text for keys and refs: strings as is, integers and reals in decimal,
 * true/false. @returns malloc'd string, or NULL for null, objects and arrays. */
char *tally_json_scalar_text(const json_t *v) TALLY_WUR;

/**
 * @brief A JSON object received as text (a tool's receipt), checked and compacted without a
 * jansson tree (json_scan.c).
 *
 * When @p s[0..len) is an object that json_loadb(TALLY_JSON_LOAD_FLAGS) certainly loads,
 * returns it without the whitespace between tokens (strings, numbers and escapes byte for
 * byte, so it is the same JSON value), malloc'd, and points @p ref at the text of the value
 * of RFC 6901 pointer @p ptr within it, @p ref_len bytes long (NULL and 0 when @p ptr is
 * NULL or does not resolve).
 *
 * NULL when unsure, or out of memory: the caller then loads @p s with jansson, which decides.
 * It is unsure of anything it does not decide itself — see json_scan.c: keys with escapes,
 * \\u escapes of U+0000 or of surrogates, exponents, integers of more than 18 digits, more
 * than 32 levels or 64 keys in an object, and of course anything that is not JSON.
 */
char *tally_json_object_compact(const char *s, size_t len, const char *ptr, const char **ref,
                                size_t *ref_len) TALLY_WUR;

/** @brief tally_json_scalar_text of the value written as the JSON text @p text[0..len) (a
 * @p ref of tally_json_object_compact); NULL also when it is not JSON. */
char *tally_json_scalar_text_of(const char *text, size_t len) TALLY_WUR;

/**
 * @brief A JSON object written as text member by member, with no jansson value in between:
 * for the documents written once per effect (audit data, outcome events, the rows of a
 * statement). Zero-initialise, then tally_jtext_begin. Strings are escaped as jansson's
 * compact output escapes them (\" \\ \b \f \n \r \t, \u00XX for other control
 * characters, UTF-8 as is). Sticky failure (out of memory, text that is not UTF-8):
 * tally_jtext_take then returns NULL.
 */
typedef struct tally_jtext {
    char *s;
    size_t len, cap;
    bool failed;
} tally_jtext_t;

/** @brief Open an object: `{` at the top (@p key NULL), or `"key":{` inside one. */
void tally_jtext_begin(tally_jtext_t *j, const char *key);
/** @brief Close the innermost open object. */
void tally_jtext_end(tally_jtext_t *j);
/** @brief `"key":"s"`, or null for NULL. */
void tally_jtext_str(tally_jtext_t *j, const char *key, const char *s);
/** @brief `"key":"s"` of the @p n bytes at @p s (which must not hold U+0000). */
void tally_jtext_strn(tally_jtext_t *j, const char *key, const char *s, size_t n);
/** @brief `"key":` and @p json, text that already is JSON (copied as is), or null for NULL. */
void tally_jtext_raw(tally_jtext_t *j, const char *key, const char *json);
/** @brief `"key":` and the value of @p v (jansson's compact form), or null for NULL. */
void tally_jtext_value(tally_jtext_t *j, const char *key, const json_t *v);
void tally_jtext_int(tally_jtext_t *j, const char *key, long long v);
void tally_jtext_bool(tally_jtext_t *j, const char *key, bool v);
/** @brief A real with @p decimals digits after the point (finite values only; else null). */
void tally_jtext_real(tally_jtext_t *j, const char *key, double v, int decimals);
/**
 * @brief The text built (malloc'd, the caller frees it), or NULL when anything failed; @p j is
 * empty again either way.
 */
char *tally_jtext_take(tally_jtext_t *j) TALLY_WUR;

#endif
