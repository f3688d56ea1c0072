/* json_scan.c — a JSON object taken as text, without a jansson tree (json.h).
 *
 * A tool's receipt is kept as text: stored as jsonb, sent on in the outcome event. Loading it
 * into a jansson tree only to check it, find one value and print it again was a tenth of the
 * dispatcher's CPU. This scanner checks the text and copies it without its whitespace in one
 * pass, and notes where the value at a JSON pointer lies.
 *
 * It answers "yes" only for text that json_loadb(TALLY_JSON_LOAD_FLAGS) certainly loads as an
 * object, and "unsure" for anything it does not decide itself; the caller then loads the text
 * with jansson as before, which accepts or refuses it. So the scanner never has to be
 * jansson's equal, only never more lenient. Unsure:
 *   - text that is not UTF-8, control characters in strings, any syntax error;
 *   - keys with a backslash (duplicate keys are compared byte for byte, and an escape could
 *     hide one), more than 64 keys in one object, more than 32 levels;
 *   - \u escapes of U+0000 (jsonb refuses it) and of surrogates (jansson pairs them, or refuses
 *     a lone one, and so does jsonb);
 *   - numbers with an exponent, integers of more than 18 digits (jansson refuses what does not
 *     fit in a long long), and numbers longer than 300 characters (jansson refuses a real that
 *     overflows a double; without an exponent 300 characters cannot).
 */
#include "tally/json.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SCAN_MAX_DEPTH 32
#define SCAN_MAX_KEYS  64  /* keys of one object compared for duplicates */
#define SCAN_MAX_PTR   16  /* pointer tokens followed */
#define SCAN_MAX_NUM   300 /* characters of a number without an exponent */

typedef struct {
    const char *s;
    size_t n, i;
    char *out;
    size_t o;
    /* the pointer, as tokens (~0 and ~1 decoded) and, where a token is an array index, its
     * value (SIZE_MAX otherwise) */
    const char *tok[SCAN_MAX_PTR];
    size_t tok_len[SCAN_MAX_PTR], tok_idx[SCAN_MAX_PTR], n_tok;
    bool ref_found;
    size_t ref_off, ref_len;
} scan_t;

static void skip_ws(scan_t *c)
{
    while (c->i < c->n) {
        char ch = c->s[c->i];
        if (ch != ' ' && ch != '\t' && ch != '\n' && ch != '\r')
            return;
        c->i++;
    }
}

static int hex_digit(char ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

/* A string from its opening quote, copied as it is; @p escaped says whether it held a
 * backslash. The text was checked as UTF-8 as a whole. */
static bool scan_string(scan_t *c, bool *escaped)
{
    size_t start = c->i++;
    *escaped = false;
    while (c->i < c->n) {
        unsigned char ch = (unsigned char)c->s[c->i];
        if (ch == '"') {
            c->i++;
            size_t len = c->i - start;
            memcpy(c->out + c->o, c->s + start, len);
            c->o += len;
            return true;
        }
        if (ch < 0x20)
            return false;
        if (ch != '\\') {
            c->i++;
            continue;
        }
        *escaped = true;
        if (c->i + 1 >= c->n)
            return false;
        char e = c->s[c->i + 1];
        if (e == 'u') {
            if (c->i + 6 > c->n)
                return false;
            unsigned v = 0;
            for (size_t k = 2; k < 6; k++) {
                int d = hex_digit(c->s[c->i + k]);
                if (d < 0)
                    return false;
                v = v * 16 + (unsigned)d;
            }
            if (v == 0 || (v >= 0xd800 && v <= 0xdfff))
                return false;
            c->i += 6;
        } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' ||
                   e == 'r' || e == 't') {
            c->i += 2;
        } else {
            return false;
        }
    }
    return false;
}

static bool is_digit(char ch)
{
    return ch >= '0' && ch <= '9';
}

static bool scan_number(scan_t *c)
{
    size_t start = c->i;
    if (c->s[c->i] == '-')
        c->i++;
    if (c->i >= c->n || !is_digit(c->s[c->i]))
        return false;
    if (c->s[c->i] == '0') {
        c->i++;
    } else {
        while (c->i < c->n && is_digit(c->s[c->i]))
            c->i++;
    }
    size_t int_digits = c->i - start - (c->s[start] == '-');
    bool real = false;
    if (c->i < c->n && c->s[c->i] == '.') {
        real = true;
        c->i++;
        if (c->i >= c->n || !is_digit(c->s[c->i]))
            return false;
        while (c->i < c->n && is_digit(c->s[c->i]))
            c->i++;
    }
    if (c->i < c->n && (c->s[c->i] == 'e' || c->s[c->i] == 'E'))
        return false;
    size_t len = c->i - start;
    if (real ? len > SCAN_MAX_NUM : int_digits > 18)
        return false;
    memcpy(c->out + c->o, c->s + start, len);
    c->o += len;
    return true;
}

static bool scan_word(scan_t *c, const char *word)
{
    size_t len = strlen(word);
    if (c->n - c->i < len || memcmp(c->s + c->i, word, len) != 0)
        return false;
    memcpy(c->out + c->o, word, len);
    c->o += len;
    c->i += len;
    return true;
}

static bool scan_value(scan_t *c, size_t depth, bool on_path);

/* Whether the member of the current level named by @p key (raw, without escapes) or at index
 * @p idx continues the pointer's path, which the level itself is on at @p depth. */
static bool path_goes_on(const scan_t *c, size_t depth, const char *key, size_t key_len, size_t idx)
{
    if (depth >= c->n_tok)
        return false;
    if (key)
        return key_len == c->tok_len[depth] && memcmp(key, c->tok[depth], key_len) == 0;
    return c->tok_idx[depth] == idx;
}

/* An object's or array's opening @p open, copied; whether @p close follows at once (copied too:
 * the value is empty). */
static bool open_empty(scan_t *c, char open, char close)
{
    c->out[c->o++] = open;
    c->i++;
    skip_ws(c);
    if (c->i < c->n && c->s[c->i] == close) {
        c->out[c->o++] = close;
        c->i++;
        return true;
    }
    return false;
}

/* After a member or an element: ',' (0: another follows) or @p close (1: the end), copied;
 * -1 for anything else. */
static int after_item(scan_t *c, char close)
{
    skip_ws(c);
    if (c->i >= c->n)
        return -1;
    char ch = c->s[c->i++];
    c->out[c->o++] = ch;
    if (ch == close)
        return 1;
    if (ch != ',')
        return -1;
    skip_ws(c);
    return 0;
}

static bool scan_object(scan_t *c, size_t depth, bool on_path)
{
    size_t key_off[SCAN_MAX_KEYS], key_len[SCAN_MAX_KEYS], n_keys = 0;
    if (open_empty(c, '{', '}'))
        return true;
    for (;;) {
        if (c->i >= c->n || c->s[c->i] != '"' || n_keys == SCAN_MAX_KEYS)
            return false;
        size_t koff = c->i + 1;
        bool escaped;
        if (!scan_string(c, &escaped) || escaped)
            return false;
        size_t klen = c->i - 1 - koff;
        for (size_t k = 0; k < n_keys; k++)
            if (key_len[k] == klen && memcmp(c->s + key_off[k], c->s + koff, klen) == 0)
                return false; /* a duplicate key: jansson refuses it */
        key_off[n_keys] = koff;
        key_len[n_keys++] = klen;
        skip_ws(c);
        if (c->i >= c->n || c->s[c->i] != ':')
            return false;
        c->out[c->o++] = ':';
        c->i++;
        skip_ws(c);
        bool next_on = on_path && path_goes_on(c, depth, c->s + koff, klen, 0);
        if (!scan_value(c, depth + 1, next_on))
            return false;
        int end = after_item(c, '}');
        if (end != 0)
            return end == 1;
    }
}

static bool scan_array(scan_t *c, size_t depth, bool on_path)
{
    if (open_empty(c, '[', ']'))
        return true;
    for (size_t idx = 0;; idx++) {
        bool next_on = on_path && path_goes_on(c, depth, NULL, 0, idx);
        if (!scan_value(c, depth + 1, next_on))
            return false;
        int end = after_item(c, ']');
        if (end != 0)
            return end == 1;
    }
}

static bool scan_value(scan_t *c, size_t depth, bool on_path)
{
    if (c->i >= c->n || depth > SCAN_MAX_DEPTH)
        return false;
    size_t start = c->o;
    bool ok, escaped;
    switch (c->s[c->i]) {
    case '{':
        ok = scan_object(c, depth, on_path);
        break;
    case '[':
        ok = scan_array(c, depth, on_path);
        break;
    case '"':
        ok = scan_string(c, &escaped);
        break;
    case 't':
        ok = scan_word(c, "true");
        break;
    case 'f':
        ok = scan_word(c, "false");
        break;
    case 'n':
        ok = scan_word(c, "null");
        break;
    default:
        ok = scan_number(c);
        break;
    }
    if (ok && on_path && depth == c->n_tok) {
        c->ref_found = true;
        c->ref_off = start;
        c->ref_len = c->o - start;
    }
    return ok;
}

/* An RFC 6901 array index: "0" or digits without a leading zero; SIZE_MAX otherwise. */
static size_t token_index(const char *tok, size_t len)
{
    if (len == 0 || (tok[0] == '0' && len > 1))
        return SIZE_MAX;
    size_t v = 0;
    for (size_t k = 0; k < len; k++) {
        if (!is_digit(tok[k]))
            return SIZE_MAX;
        size_t d = (size_t)(tok[k] - '0');
        if (v > (SIZE_MAX - 1 - d) / 10)
            return SIZE_MAX;
        v = v * 10 + d;
    }
    return v;
}

/* Split @p ptr into c's tokens, decoded into @p buf (as long as ptr). false when it is not a
 * pointer this scanner follows: then it does not resolve, as tally_json_pointer says of a
 * malformed one, or it is longer than SCAN_MAX_PTR tokens (unsure). */
static bool split_pointer(scan_t *c, const char *ptr, char *buf, bool *resolvable)
{
    *resolvable = true;
    c->n_tok = 0;
    if (ptr[0] == '\0')
        return true;
    if (ptr[0] != '/') {
        *resolvable = false;
        return true;
    }
    const char *p = ptr;
    size_t b = 0;
    while (*p == '/') {
        if (c->n_tok == SCAN_MAX_PTR)
            return false;
        p++;
        size_t t = b;
        while (*p != '\0' && *p != '/') {
            if (*p == '~') {
                if (p[1] != '0' && p[1] != '1') {
                    *resolvable = false;
                    return true;
                }
                buf[b++] = p[1] == '0' ? '~' : '/';
                p += 2;
            } else {
                buf[b++] = *p++;
            }
        }
        c->tok[c->n_tok] = buf + t;
        c->tok_len[c->n_tok] = b - t;
        c->tok_idx[c->n_tok] = token_index(buf + t, b - t);
        c->n_tok++;
    }
    return true;
}

char *tally_json_object_compact(const char *s, size_t len, const char *ptr, const char **ref,
                                size_t *ref_len)
{
    *ref = NULL;
    *ref_len = 0;
    if (s == NULL || !tally_utf8_valid(s, len))
        return NULL;
    scan_t c = {.s = s, .n = len};
    size_t plen = ptr ? strlen(ptr) : 0;
    char *toks = malloc(plen + 1);
    c.out = malloc(len + 1);
    bool resolvable = false;
    bool ok = toks && c.out && (ptr == NULL || split_pointer(&c, ptr, toks, &resolvable));
    if (ok) {
        skip_ws(&c);
        ok = c.i < c.n && s[c.i] == '{' && scan_object(&c, 0, ptr && resolvable);
        skip_ws(&c);
        ok = ok && c.i == c.n;
    }
    free(toks);
    if (!ok) {
        free(c.out);
        return NULL;
    }
    c.out[c.o] = '\0';
    if (ptr && resolvable && c.n_tok == 0) {
        c.ref_found = true; /* "" is the whole object */
        c.ref_off = 0;
        c.ref_len = c.o;
    }
    if (c.ref_found) {
        *ref = c.out + c.ref_off;
        *ref_len = c.ref_len;
    }
    return c.out;
}

char *tally_json_scalar_text_of(const char *text, size_t len)
{
    if (len >= 2 && text[0] == '"' && memchr(text, '\\', len) == NULL) {
        char *s = malloc(len - 1);
        if (s == NULL)
            return NULL;
        memcpy(s, text + 1, len - 2);
        s[len - 2] = '\0';
        return s;
    }
    json_t *v = json_loadb(text, len, JSON_DECODE_ANY, NULL);
    char *s = tally_json_scalar_text(v);
    json_decref(v);
    return s;
}
