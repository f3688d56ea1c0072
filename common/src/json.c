/* json.c — canonical JSON, the input hash, UTF-8 checks and JSON pointers.
 *
 * The canonical form is written here rather than with json_dumps(JSON_SORT_KEYS|JSON_COMPACT)
 * because jansson prints reals with 17 significant digits (0.1 -> 0.10000000000000001), which
 * would make the body sent to a tool differ from what the agent wrote. The rules:
 *   - objects: members sorted by key, compared bytewise on the UTF-8 bytes (memcmp, shorter
 *     first on a common prefix) — the same order as strcmp for keys without NUL;
 *   - arrays in order; no whitespace anywhere;
 *   - strings: '"', '\\' and the control characters below 0x20 escaped (\b \f \n \r \t, the
 *     rest as \u00xx in lowercase hex); '/', DEL and all non-ASCII UTF-8 written raw;
 *   - integers in decimal;
 *   - reals in the shortest of %.15g/%.16g/%.17g that reads back as the same double; a real
 *     with an integral value keeps a ".0" so it stays a real (1.0 -> "1.0", -0.0 -> "-0.0",
 *     the sign of zero is kept); exponents as printf writes them (1e300 -> "1e+300");
 *     NaN and infinities have no JSON form and make the result NULL;
 *   - true, false, null.
 */
#include "tally/json.h"

#include <inttypes.h>
#include <locale.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

/* jansson's own parser stops at 2048 levels; a deeper built value is refused, not overflowed. */
#define CANON_MAX_DEPTH 2048

void tally_json_put_string(tally_strbuf_t *b, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    tally_strbuf_putc(b, '"');
    size_t run = 0; /* start of the pending run of bytes that need no escape */
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[7];
        switch (c) {
        case '"':
            esc = "\\\"";
            break;
        case '\\':
            esc = "\\\\";
            break;
        case '\b':
            esc = "\\b";
            break;
        case '\f':
            esc = "\\f";
            break;
        case '\n':
            esc = "\\n";
            break;
        case '\r':
            esc = "\\r";
            break;
        case '\t':
            esc = "\\t";
            break;
        default:
            if (c < 0x20) {
                u[0] = '\\', u[1] = 'u', u[2] = '0', u[3] = '0';
                u[4] = hex[c >> 4], u[5] = hex[c & 0xf], u[6] = '\0';
                esc = u;
            }
            break;
        }
        if (esc != NULL) {
            tally_strbuf_put(b, s + run, i - run);
            tally_strbuf_puts(b, esc);
            run = i + 1;
        }
    }
    tally_strbuf_put(b, s + run, len - run);
    tally_strbuf_putc(b, '"');
}

/* The shortest round-tripping text of a finite double, with ".0" added when it would
 * otherwise read back as an integer. @returns false for NaN and infinities. */
static bool format_real(double d, char *out, size_t outsz)
{
    if (!isfinite(d))
        return false;
    static const int precisions[] = {15, 16, 17};
    for (size_t i = 0; i < sizeof precisions / sizeof precisions[0]; i++) {
        snprintf(out, outsz, "%.*g", precisions[i], d);
        if (strtod(out, NULL) == d && signbit(strtod(out, NULL)) == signbit(d))
            break;
    }
    /* printf and strtod agree on the locale's decimal point; JSON wants '.'. */
    const char *dp = localeconv()->decimal_point;
    if (dp != NULL && dp[0] != '.' && dp[0] != '\0') {
        char *p = strchr(out, dp[0]);
        if (p != NULL)
            *p = '.';
    }
    if (strpbrk(out, ".eE") == NULL) {
        size_t n = strlen(out);
        if (n + 3 > outsz)
            return false;
        memcpy(out + n, ".0", 3);
    }
    return true;
}

typedef struct member {
    const char *key;
    size_t keylen;
    const json_t *value;
} member_t;

static int member_cmp(const void *a, const void *b)
{
    const member_t *x = a, *y = b;
    size_t n = x->keylen < y->keylen ? x->keylen : y->keylen;
    int c = memcmp(x->key, y->key, n);
    if (c != 0)
        return c;
    return (x->keylen > y->keylen) - (x->keylen < y->keylen);
}

static void put_value(tally_strbuf_t *b, const json_t *v, int depth)
{
    if (b->failed)
        return;
    if (v == NULL || depth > CANON_MAX_DEPTH) {
        b->failed = true;
        return;
    }
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        size_t n = json_object_size(v);
        member_t *m = n ? calloc(n, sizeof *m) : NULL;
        if (n && m == NULL) {
            b->failed = true;
            return;
        }
        size_t i = 0;
        const char *key;
        size_t keylen;
        json_t *val;
        json_object_keylen_foreach((json_t *)v, key, keylen, val)
        {
            m[i].key = key;
            m[i].keylen = keylen;
            m[i].value = val;
            i++;
        }
        if (n > 1)
            qsort(m, n, sizeof *m, member_cmp);
        tally_strbuf_putc(b, '{');
        for (i = 0; i < n; i++) {
            if (i > 0)
                tally_strbuf_putc(b, ',');
            tally_json_put_string(b, m[i].key, m[i].keylen);
            tally_strbuf_putc(b, ':');
            put_value(b, m[i].value, depth + 1);
        }
        tally_strbuf_putc(b, '}');
        free(m);
        return;
    }
    case JSON_ARRAY: {
        tally_strbuf_putc(b, '[');
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i > 0)
                tally_strbuf_putc(b, ',');
            put_value(b, json_array_get(v, i), depth + 1);
        }
        tally_strbuf_putc(b, ']');
        return;
    }
    default:
        tally_json_put_scalar(b, v);
        return;
    }
}

bool tally_json_put_scalar(tally_strbuf_t *b, const json_t *v)
{
    char num[40];
    switch (v != NULL ? json_typeof(v) : JSON_OBJECT) {
    case JSON_STRING:
        tally_json_put_string(b, json_string_value(v), json_string_length(v));
        return true;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        tally_strbuf_puts(b, num);
        return true;
    case JSON_REAL:
        if (!format_real(json_real_value(v), num, sizeof num))
            break;
        tally_strbuf_puts(b, num);
        return true;
    case JSON_TRUE:
        tally_strbuf_puts(b, "true");
        return true;
    case JSON_FALSE:
        tally_strbuf_puts(b, "false");
        return true;
    case JSON_NULL:
        tally_strbuf_puts(b, "null");
        return true;
    case JSON_OBJECT:
    case JSON_ARRAY:
        break;
    }
    b->failed = true;
    return false;
}

char *tally_json_canonical(const json_t *v)
{
    tally_strbuf_t b = {0};
    put_value(&b, v, 0);
    return tally_strbuf_take(&b);
}

bool tally_sha256_hex(const void *data, size_t len, char out[65])
{
    static const char hex[] = "0123456789abcdef";
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    if (EVP_Digest(data, len, md, &mdlen, EVP_sha256(), NULL) != 1 || mdlen != 32)
        return false;
    for (unsigned int i = 0; i < mdlen; i++) {
        out[2 * i] = hex[md[i] >> 4];
        out[2 * i + 1] = hex[md[i] & 0xf];
    }
    out[64] = '\0';
    return true;
}

bool tally_input_hash(const json_t *args, char out[65])
{
    char *canon = tally_json_canonical(args);
    if (canon == NULL)
        return false;
    bool ok = tally_sha256_hex(canon, strlen(canon), out);
    free(canon);
    return ok;
}

/* Unicode 15, Table 3-7 (well-formed UTF-8 byte sequences). */
bool tally_utf8_valid(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        unsigned char c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n;
        unsigned char lo = 0x80, hi = 0xbf; /* range of the second byte */
        if (c >= 0xc2 && c <= 0xdf) {
            n = 2;
        } else if (c >= 0xe0 && c <= 0xef) {
            n = 3;
            if (c == 0xe0)
                lo = 0xa0; /* overlong */
            else if (c == 0xed)
                hi = 0x9f; /* surrogates U+D800..DFFF */
        } else if (c >= 0xf0 && c <= 0xf4) {
            n = 4;
            if (c == 0xf0)
                lo = 0x90; /* overlong */
            else if (c == 0xf4)
                hi = 0x8f; /* above U+10FFFF */
        } else {
            return false; /* continuation byte, C0/C1 overlong lead, or F5..FF */
        }
        if (len - i < n)
            return false;
        if (p[i + 1] < lo || p[i + 1] > hi)
            return false;
        for (size_t k = 2; k < n; k++) {
            if (p[i + k] < 0x80 || p[i + k] > 0xbf)
                return false;
        }
        i += n;
    }
    return true;
}

/* An RFC 6901 array index: "0" or digits without a leading zero, within size_t. */
static bool parse_index(const char *tok, size_t *out)
{
    if (tok[0] == '\0' || (tok[0] == '0' && tok[1] != '\0'))
        return false;
    size_t v = 0;
    for (const char *p = tok; *p; p++) {
        if (*p < '0' || *p > '9')
            return false;
        size_t d = (size_t)(*p - '0');
        if (v > (SIZE_MAX - d) / 10)
            return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

json_t *tally_json_pointer(const json_t *doc, const char *ptr)
{
    if (doc == NULL || ptr == NULL)
        return NULL;
    json_t *cur = (json_t *)doc;
    if (ptr[0] == '\0')
        return cur;
    if (ptr[0] != '/')
        return NULL;
    size_t plen = strlen(ptr);
    char *tok = malloc(plen + 1);
    if (tok == NULL)
        return NULL;
    const char *p = ptr;
    while (cur != NULL && *p == '/') {
        p++;
        size_t n = 0;
        while (*p != '\0' && *p != '/') {
            if (*p == '~') {
                if (p[1] == '0')
                    tok[n++] = '~';
                else if (p[1] == '1')
                    tok[n++] = '/';
                else {
                    cur = NULL; /* "~" must be followed by 0 or 1 */
                    break;
                }
                p += 2;
            } else {
                tok[n++] = *p++;
            }
        }
        if (cur == NULL)
            break;
        tok[n] = '\0';
        if (json_is_object(cur)) {
            cur = json_object_getn(cur, tok, n);
        } else if (json_is_array(cur)) {
            size_t idx;
            cur = parse_index(tok, &idx) ? json_array_get(cur, idx) : NULL;
        } else {
            cur = NULL;
        }
    }
    free(tok);
    return cur;
}

char *tally_json_scalar_text(const json_t *v)
{
    char num[40];
    if (v == NULL)
        return NULL;
    switch (json_typeof(v)) {
    case JSON_STRING: {
        size_t n = json_string_length(v);
        char *s = malloc(n + 1);
        if (s == NULL)
            return NULL;
        memcpy(s, json_string_value(v), n);
        s[n] = '\0';
        return s;
    }
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        return strdup(num);
    case JSON_REAL:
        /* the same text as in the canonical form, so a ref and the body agree */
        if (!format_real(json_real_value(v), num, sizeof num))
            return NULL;
        return strdup(num);
    case JSON_TRUE:
        return strdup("true");
    case JSON_FALSE:
        return strdup("false");
    case JSON_NULL:
    case JSON_OBJECT:
    case JSON_ARRAY:
        break;
    }
    return NULL;
}

/* ---- JSON text, member by member -------------------------------------------------------- */

static bool jtext_reserve(tally_jtext_t *j, size_t more)
{
    if (j->failed)
        return false;
    if (more > SIZE_MAX - j->len - 1 || !tally_text_reserve(&j->s, &j->cap, j->len + more + 1, 256))
        j->failed = true;
    return !j->failed;
}

static void jtext_put(tally_jtext_t *j, const char *s, size_t n)
{
    if (!jtext_reserve(j, n))
        return;
    memcpy(j->s + j->len, s, n);
    j->len += n;
    j->s[j->len] = '\0';
}

static void jtext_string(tally_jtext_t *j, const char *s, size_t n)
{
    static const char hex[] = "0123456789ABCDEF"; /* as jansson writes it */
    if (!tally_utf8_valid(s, n)) {
        j->failed = true;
        return;
    }
    if (!jtext_reserve(j, 6 * n + 2))
        return;
    char *p = j->s + j->len;
    *p++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *p++ = (char)c;
            continue;
        }
        const char *esc = c == '"'    ? "\\\""
                          : c == '\\' ? "\\\\"
                          : c == '\b' ? "\\b"
                          : c == '\f' ? "\\f"
                          : c == '\n' ? "\\n"
                          : c == '\r' ? "\\r"
                          : c == '\t' ? "\\t"
                                      : NULL;
        if (esc) {
            *p++ = esc[0];
            *p++ = esc[1];
        } else { /* another control character */
            memcpy(p, "\\u00", 4);
            p[4] = hex[c >> 4];
            p[5] = hex[c & 0x0f];
            p += 6;
        }
    }
    *p++ = '"';
    *p = '\0';
    j->len = (size_t)(p - j->s);
}

/* `,"key":` (no comma right after the object's `{`); nothing for a NULL key */
static void jtext_key(tally_jtext_t *j, const char *key)
{
    if (key == NULL || j->failed)
        return;
    if (j->len > 0 && j->s[j->len - 1] != '{')
        jtext_put(j, ",", 1);
    jtext_string(j, key, strlen(key));
    jtext_put(j, ":", 1);
}

void tally_jtext_begin(tally_jtext_t *j, const char *key)
{
    jtext_key(j, key);
    jtext_put(j, "{", 1);
}

void tally_jtext_end(tally_jtext_t *j)
{
    jtext_put(j, "}", 1);
}

void tally_jtext_str(tally_jtext_t *j, const char *key, const char *s)
{
    jtext_key(j, key);
    if (s)
        jtext_string(j, s, strlen(s));
    else
        jtext_put(j, "null", 4);
}

void tally_jtext_strn(tally_jtext_t *j, const char *key, const char *s, size_t n)
{
    if (n > 0 && memchr(s, '\0', n) != NULL) {
        j->failed = true;
        return;
    }
    jtext_key(j, key);
    jtext_string(j, n ? s : "", n);
}

void tally_jtext_raw(tally_jtext_t *j, const char *key, const char *json)
{
    jtext_key(j, key);
    jtext_put(j, json ? json : "null", json ? strlen(json) : 4);
}

void tally_jtext_value(tally_jtext_t *j, const char *key, const json_t *v)
{
    char *text = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    if (v && !text)
        j->failed = true;
    tally_jtext_raw(j, key, text);
    free(text);
}

void tally_jtext_int(tally_jtext_t *j, const char *key, long long v)
{
    char buf[24];
    int n = snprintf(buf, sizeof buf, "%lld", v);
    jtext_key(j, key);
    jtext_put(j, buf, (size_t)n);
}

void tally_jtext_bool(tally_jtext_t *j, const char *key, bool v)
{
    jtext_key(j, key);
    jtext_put(j, v ? "true" : "false", v ? 4 : 5);
}

void tally_jtext_real(tally_jtext_t *j, const char *key, double v, int decimals)
{
    char buf[64];
    /* "C" numbers whatever the locale: tally never calls setlocale, so printf uses '.' */
    int n = isfinite(v) ? snprintf(buf, sizeof buf, "%.*f", decimals, v) : -1;
    if (n <= 0 || (size_t)n >= sizeof buf) {
        tally_jtext_raw(j, key, NULL);
        return;
    }
    jtext_key(j, key);
    jtext_put(j, buf, (size_t)n);
}

char *tally_jtext_take(tally_jtext_t *j)
{
    char *s = j->failed ? NULL : j->s;
    if (j->failed)
        free(j->s);
    else if (s == NULL)
        s = strdup("");
    *j = (tally_jtext_t){0};
    return s;
}
