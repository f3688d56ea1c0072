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

/**
 * @brief Where a failure that repeats on every tick (PostgreSQL down, say) is logged from:
 * once, then at most once a window, with the number of lines left out meanwhile.
 */
typedef struct tally_log_repeat {
    long long last_ms; /**< monotonic time of the last line written, 0 before the first */
    unsigned left_out; /**< lines not written since then */
} tally_log_repeat_t;

/** @brief The window of TALLY_LOG_REPEATING: one line per call site per 30 s. */
#define TALLY_LOG_REPEAT_MS 30000

/**
 * @brief Whether @p r may write a line now (the first time, or @p window_ms after the last).
 * @param left_out set, when true, to the lines left out since the last one; else counted.
 * @remark Thread-safe.
 */
bool tally_log_repeat_due(tally_log_repeat_t *r, int window_ms, unsigned *left_out);

/** @brief tally_log_write, saying how many like lines were left out before this one. */
void tally_log_write_repeat(tally_log_level_t level, const char *func, int line,
                            const tally_log_ctx_t *ctx, unsigned left_out, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

#define TALLY_LOG(level, ctx, ...) tally_log_write((level), __func__, __LINE__, (ctx), __VA_ARGS__)
#define TALLY_DEBUG(...)           TALLY_LOG(TALLY_LOG_DEBUG, NULL, __VA_ARGS__)
#define TALLY_INFO(...)            TALLY_LOG(TALLY_LOG_INFO, NULL, __VA_ARGS__)
#define TALLY_WARN(...)            TALLY_LOG(TALLY_LOG_WARN, NULL, __VA_ARGS__)
#define TALLY_ERROR(...)           TALLY_LOG(TALLY_LOG_ERROR, NULL, __VA_ARGS__)

/** @brief TALLY_LOG for a failure that repeats each tick: at most one line per 30 s from
 * this call site, which says how many like lines it stands for ("left_out"). */
#define TALLY_LOG_REPEATING(level, ctx, ...)                                                       \
    do {                                                                                           \
        static tally_log_repeat_t repeat_;                                                         \
        unsigned left_out_;                                                                        \
        if (tally_log_repeat_due(&repeat_, TALLY_LOG_REPEAT_MS, &left_out_))                       \
            tally_log_write_repeat((level), __func__, __LINE__, (ctx), left_out_, __VA_ARGS__);    \
    } while (0)

#endif
