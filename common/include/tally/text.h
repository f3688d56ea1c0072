/* text.h — text for people and for other systems: cut on character boundaries, always valid
 * UTF-8, and the limits every field that crosses tally's edge is held to. */
#ifndef TALLY_TEXT_H
#define TALLY_TEXT_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tally/error.h"

/* ---------------------------------------------------------------------------------------- */
/* Limits (schemas/README.md "Limits" is the table of these; tests/unit/test_text.c reads both) */

/* All in bytes of UTF-8. A value over its limit is refused where it enters: an intent goes to
 * the DLQ (invalid_field), a CLI argument is an error, a tool's answer is a protocol error. */
#define TALLY_LIMIT_RUN_ID          200    /**< data.run_id */
#define TALLY_LIMIT_STEP            100    /**< data.step as text */
#define TALLY_LIMIT_TOOL            200    /**< data.tool, and a registered tool's name */
#define TALLY_LIMIT_OPERATION_KEY   500    /**< explicit or derived from args; an HTTP header */
#define TALLY_LIMIT_EVENT_ID        200    /**< the CloudEvents id of a message on intents */
#define TALLY_LIMIT_TENANT          200    /**< data.tenant */
#define TALLY_LIMIT_REASON          4096   /**< data.reason of compensate/cancel, --reason */
#define TALLY_LIMIT_ACTOR           200    /**< --actor */
#define TALLY_LIMIT_EXTERNAL_REF    512    /**< a receipt's external ref (an index key) */
#define TALLY_LIMIT_RECEIPT_VERSION 256    /**< a receipt's "version" (the If-Match header) */
#define TALLY_LIMIT_EVENT_BYTES     900000 /**< one published event, whole */
#define TALLY_LIMIT_REPLY_TOPIC     249    /**< a reply topic (Kafka's own limit) */
#define TALLY_LIMIT_CORRELATION     256    /**< a reply's correlation id, in bytes */

/** @brief One row of the limits table. */
typedef struct tally_limit {
    const char *name;  /**< as in schemas/README.md: "run_id", "operation_key", ... */
    size_t bytes;      /**< the largest accepted size */
    const char *where; /**< what holds it: "intent data.run_id", ... */
} tally_limit_t;

/** @brief The limits table, in the order of schemas/README.md; @p n receives its length. */
const tally_limit_t *tally_limits(size_t *n);

/* ---------------------------------------------------------------------------------------- */
/* UTF-8                                                                                      */

/**
 * @brief Length (1..4) of the well-formed UTF-8 sequence at @p s[0..avail), or 0 when the
 * bytes there are not one (Unicode 15, Table 3-7: no overlongs, surrogates, > U+10FFFF).
 */
size_t tally_utf8_seq(const unsigned char *s, size_t avail);

/**
 * @brief The length of the longest prefix of @p s[0..len) of at most @p max bytes that does not
 * end inside a character. For valid UTF-8 the prefix is valid UTF-8.
 */
size_t tally_utf8_prefix(const char *s, size_t len, size_t max);

/**
 * @brief Copy @p s into @p out (@p outsz bytes with the NUL) as valid UTF-8: each byte that does
 * not start a well-formed sequence becomes '?', and text that does not fit is cut on a
 * character boundary and ends with "...". NULL copies as "".
 * @returns true when @p s was copied whole and unchanged.
 */
bool tally_text_copy(char *out, size_t outsz, const char *s);

/**
 * @brief snprintf that never cuts a character and always writes valid UTF-8: the result of
 * vsnprintf, with each malformed byte as '?' and, when it did not fit, cut on a character
 * boundary ending with "...". Use it for every sentence that quotes text from outside
 * (messages, logs, alerts, events); never "%.Ns" on such text.
 * @returns true when the whole text fitted.
 */
bool tally_fmt(char *out, size_t outsz, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
bool tally_vfmt(char *out, size_t outsz, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

/**
 * @brief A malloc'd copy of @p s of at most @p max bytes (plus the NUL), made valid UTF-8 and
 * cut as tally_text_copy cuts. NULL when out of memory or @p s is NULL; the caller frees it.
 */
char *tally_text_dup(const char *s, size_t max) __attribute__((warn_unused_result));

/**
 * @brief Grow the text buffer *@p buf of *@p cap bytes (realloc) to hold at least @p need
 * bytes, doubling from its capacity, or from @p first when it has none. The one growth rule of
 * every text builder (JSON text, batch columns, registry messages). false, the buffer
 * left as it was, when out of memory.
 */
bool tally_text_reserve(char **buf, size_t *cap, size_t need, size_t first) TALLY_WUR;

/** @brief A growing string with a sticky failure flag, checked once at the end. Zero-init it. */
typedef struct tally_strbuf {
    char *s; /**< NUL-terminated once anything was put; NULL before */
    size_t len, cap;
    bool failed; /**< an append ran out of memory: everything after it was dropped */
} tally_strbuf_t;

/** @brief Append @p n bytes of @p s (nothing once failed). Inline: canonical JSON puts
 * characters one at a time on every intent. */
static inline void tally_strbuf_put(tally_strbuf_t *b, const char *s, size_t n)
{
    if (b->failed)
        return;
    if (n > SIZE_MAX - b->len - 1 || !tally_text_reserve(&b->s, &b->cap, b->len + n + 1, 64)) {
        b->failed = true;
        return;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

/** @brief Append the string @p s. */
static inline void tally_strbuf_puts(tally_strbuf_t *b, const char *s)
{
    tally_strbuf_put(b, s, strlen(s));
}

/** @brief Append the character @p c. */
static inline void tally_strbuf_putc(tally_strbuf_t *b, char c)
{
    tally_strbuf_put(b, &c, 1);
}

/** @brief The built string (the caller frees; "" when nothing was put), or NULL when an append
 * failed or out of memory; @p b is empty afterwards either way. */
char *tally_strbuf_take(tally_strbuf_t *b) TALLY_WUR;

#endif
