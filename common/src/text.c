/* text.c — text cut on character boundaries, made valid UTF-8, and the limits table. */
#include "tally/text.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const tally_limit_t LIMITS[] = {
    {"run_id", TALLY_LIMIT_RUN_ID, "intent data.run_id (every message on the intents topic)"},
    {"step", TALLY_LIMIT_STEP, "intent data.step, as text"},
    {"tool", TALLY_LIMIT_TOOL, "intent data.tool; a tool name in the registry"},
    {"operation_key", TALLY_LIMIT_OPERATION_KEY,
     "intent data.operation_key, or the key derived from args"},
    {"event_id", TALLY_LIMIT_EVENT_ID, "the CloudEvents id of a message on the intents topic"},
    {"tenant", TALLY_LIMIT_TENANT, "intent data.tenant"},
    {"reason", TALLY_LIMIT_REASON, "data.reason of compensate_run and cancel_run; --reason"},
    {"actor", TALLY_LIMIT_ACTOR, "--actor"},
    {"external_ref", TALLY_LIMIT_EXTERNAL_REF,
     "the receipt_ref value of a tool's receipt or upstream record"},
    {"receipt_version", TALLY_LIMIT_RECEIPT_VERSION,
     "the \"version\" of a tool's receipt (sent as If-Match)"},
    {"event", TALLY_LIMIT_EVENT_BYTES, "one event tally publishes, whole"},
    {"reply_topic", TALLY_LIMIT_REPLY_TOPIC, "kafka_replyTopic header; replytopic attribute"},
    {"correlation_id", TALLY_LIMIT_CORRELATION,
     "kafka_correlationId header; correlationid attribute"},
};

const tally_limit_t *tally_limits(size_t *n)
{
    *n = sizeof LIMITS / sizeof LIMITS[0];
    return LIMITS;
}

size_t tally_utf8_seq(const unsigned char *s, size_t avail)
{
    if (avail == 0)
        return 0;
    unsigned char c = s[0];
    if (c < 0x80)
        return 1;
    size_t n;
    unsigned char lo = 0x80, hi = 0xbf; /* the range of the second byte */
    if (c >= 0xc2 && c <= 0xdf) {
        n = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        lo = c == 0xe0 ? 0xa0 : 0x80; /* overlong */
        hi = c == 0xed ? 0x9f : 0xbf; /* surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        lo = c == 0xf0 ? 0x90 : 0x80; /* overlong */
        hi = c == 0xf4 ? 0x8f : 0xbf; /* above U+10FFFF */
    } else {
        return 0;
    }
    if (avail < n || s[1] < lo || s[1] > hi)
        return 0;
    for (size_t k = 2; k < n; k++)
        if (s[k] < 0x80 || s[k] > 0xbf)
            return 0;
    return n;
}

size_t tally_utf8_prefix(const char *s, size_t len, size_t max)
{
    if (len <= max)
        return len;
    size_t n = max;
    /* s[n] is the first byte left out: while it continues a character, that character
     * started inside the prefix, so leave it out whole. */
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
        n--;
    return n;
}

/* Copy s[0..len) into out[0..outsz) as valid UTF-8 ('?' for each malformed byte), cut with
 * "..." when it does not fit. */
static bool copy_valid(char *out, size_t outsz, const char *s, size_t len)
{
    if (outsz == 0)
        return false;
    const unsigned char *u = (const unsigned char *)s;
    bool whole = true;
    size_t o = 0, i = 0;
    /* First pass: does all of it fit? Then no room is kept for the "...". */
    size_t room = outsz - 1;
    if (len > room) {
        room = outsz > 4 ? outsz - 4 : 0;
        whole = false;
    }
    while (i < len) {
        size_t n = tally_utf8_seq(u + i, len - i);
        size_t put = n ? n : 1;
        if (o + put > room) {
            whole = false;
            break;
        }
        if (n) {
            memcpy(out + o, s + i, n);
        } else {
            out[o] = '?';
            whole = false;
        }
        o += put;
        i += put;
    }
    if (i < len && outsz > 4) {
        /* room was outsz - 4 when len > outsz - 1, but a malformed tail can make i < len with
         * room outsz - 1: make sure the "..." fits. */
        while (o + 4 > outsz) {
            do
                o--;
            while (o > 0 && ((unsigned char)out[o] & 0xC0) == 0x80);
        }
        memcpy(out + o, "...", 3);
        o += 3;
    }
    out[o] = '\0';
    return whole && i == len;
}

bool tally_text_copy(char *out, size_t outsz, const char *s)
{
    if (s == NULL)
        s = "";
    return copy_valid(out, outsz, s, strlen(s));
}

bool tally_vfmt(char *out, size_t outsz, const char *fmt, va_list ap)
{
    if (outsz == 0)
        return false;
    char small[1024];
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(small, sizeof small, fmt, ap2);
    va_end(ap2);
    if (n < 0) {
        out[0] = '\0';
        return false;
    }
    if ((size_t)n < sizeof small)
        return copy_valid(out, outsz, small, (size_t)n);
    /* Longer than the stack buffer: format it whole so the cut is ours, not vsnprintf's. */
    char *big = malloc((size_t)n + 1);
    if (big == NULL) {
        /* Out of memory: the part that fitted, made valid and marked as cut. */
        copy_valid(out, outsz, small, sizeof small - 1);
        return false;
    }
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    bool whole = copy_valid(out, outsz, big, (size_t)n);
    free(big);
    return whole;
}

bool tally_fmt(char *out, size_t outsz, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    bool whole = tally_vfmt(out, outsz, fmt, ap);
    va_end(ap);
    return whole;
}

char *tally_text_dup(const char *s, size_t max)
{
    if (s == NULL)
        return NULL;
    size_t len = strlen(s);
    size_t sz = (len < max ? len : max) + 1;
    char *out = malloc(sz);
    if (out == NULL)
        return NULL;
    copy_valid(out, sz, s, len);
    return out;
}

bool tally_text_reserve(char **buf, size_t *cap, size_t need, size_t first)
{
    if (need <= *cap)
        return true;
    size_t c = *cap ? *cap : first;
    while (c < need)
        c = c > SIZE_MAX / 2 ? need : c * 2;
    char *grown = realloc(*buf, c);
    if (grown == NULL)
        return false;
    *buf = grown;
    *cap = c;
    return true;
}

char *tally_strbuf_take(tally_strbuf_t *b)
{
    char *s = b->s;
    bool failed = b->failed;
    *b = (tally_strbuf_t){0};
    if (failed) {
        free(s);
        return NULL;
    }
    return s != NULL ? s : strdup("");
}
