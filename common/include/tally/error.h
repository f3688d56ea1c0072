/* error.h — a small error object for runtime paths (code, message, retriable). */
#ifndef TALLY_ERROR_H
#define TALLY_ERROR_H

#include <stdbool.h>
#include <stddef.h>

#define TALLY_WUR __attribute__((warn_unused_result))

/**
 * @brief What went wrong on a runtime path, in the style of rd_kafka_error_t.
 * @remark Lives on the caller's stack; no allocation, nothing to free.
 */
typedef struct tally_error {
    char code[32];     /**< machine-readable: an SQLSTATE, "kafka", "http_503", "timeout", ... */
    char message[512]; /**< one human sentence */
    bool retriable;    /**< true when trying the same thing later may succeed */
} tally_error_t;

/** @brief Fill @p err (NULL is allowed and ignored); printf-style message. */
void tally_error_set(tally_error_t *err, const char *code, bool retriable, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/** @brief Reset @p err to "no error". */
void tally_error_clear(tally_error_t *err);

#endif
