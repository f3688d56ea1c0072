/* log.h — one JSON object per line on stderr, with the worker id and the effect's context. */
#ifndef TALLY_LOG_H
#define TALLY_LOG_H

#include <stdbool.h>

typedef enum {
    TALLY_LOG_DEBUG = 0,
    TALLY_LOG_INFO = 1,
    TALLY_LOG_WARN = 2,
    TALLY_LOG_ERROR = 3,
} tally_log_level_t;

/** @brief Optional context fields of a log line; any member may be NULL. */
typedef struct tally_log_ctx {
    const char *run_id;
    const char *effect_id;
    const char *obligation_id;
    const char *tool;
} tally_log_ctx_t;

/**
 * @brief Set the process-wide component ("dispatcher"), worker id and minimum level.
 * @remark Thread-safe to log from any thread after this; lines are written whole.
 */
void tally_log_init(const char *component, const char *worker_id, tally_log_level_t min_level);

/** @brief Parse "debug|info|warn|error"; false when unknown. */
bool tally_log_level_parse(const char *s, tally_log_level_t *out);

/** @brief Write one line: {"ts","level","component","worker","msg","func","line",ctx...}. */
void tally_log_write(tally_log_level_t level, const char *func, int line,
                     const tally_log_ctx_t *ctx, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#define TALLY_LOG(level, ctx, ...) tally_log_write((level), __func__, __LINE__, (ctx), __VA_ARGS__)
#define TALLY_DEBUG(...)           TALLY_LOG(TALLY_LOG_DEBUG, NULL, __VA_ARGS__)
#define TALLY_INFO(...)            TALLY_LOG(TALLY_LOG_INFO, NULL, __VA_ARGS__)
#define TALLY_WARN(...)            TALLY_LOG(TALLY_LOG_WARN, NULL, __VA_ARGS__)
#define TALLY_ERROR(...)           TALLY_LOG(TALLY_LOG_ERROR, NULL, __VA_ARGS__)

#endif
