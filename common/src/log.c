/* log.c — one JSON object per line on stderr.
 *
 * Each line is built with jansson (so every value is escaped correctly) and written with a
 * single fwrite under a mutex, then flushed, so lines from different threads never interleave
 * and a crash loses at most the line being written. */
#include "tally/log.h"

#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "tally/text.h"

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_component[64] = "tally"; /* before tally_log_init the process is just "tally" */
static char log_worker[256] = "";
static tally_log_level_t log_min_level = TALLY_LOG_INFO;

static const char *const level_names[] = {
    [TALLY_LOG_DEBUG] = "debug",
    [TALLY_LOG_INFO] = "info",
    [TALLY_LOG_WARN] = "warn",
    [TALLY_LOG_ERROR] = "error",
};

void tally_log_init(const char *component, const char *worker_id, tally_log_level_t min_level)
{
    pthread_mutex_lock(&log_lock);
    snprintf(log_component, sizeof log_component, "%s",
             component != NULL && component[0] ? component : "tally");
    snprintf(log_worker, sizeof log_worker, "%s", worker_id != NULL ? worker_id : "");
    log_min_level = min_level;
    pthread_mutex_unlock(&log_lock);
}

bool tally_log_level_parse(const char *s, tally_log_level_t *out)
{
    if (s == NULL)
        return false;
    for (int i = TALLY_LOG_DEBUG; i <= TALLY_LOG_ERROR; i++) {
        if (strcmp(s, level_names[i]) == 0) {
            *out = (tally_log_level_t)i;
            return true;
        }
    }
    return false;
}

/* A JSON string for text that may not be valid UTF-8 (a message quoting a malformed intent):
 * each bad byte becomes U+FFFD instead of the whole line being lost. */
static json_t *text_value(const char *s)
{
    json_t *v = json_string(s);
    if (v != NULL)
        return v;
    size_t len = strlen(s);
    char *fixed = malloc(len * 3 + 1);
    if (fixed == NULL)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        size_t n = tally_utf8_seq((const unsigned char *)s + i, len - i);
        if (n == 0) {
            memcpy(fixed + o, "\xef\xbf\xbd", 3);
            o += 3;
            i++;
        } else {
            memcpy(fixed + o, s + i, n);
            o += n;
            i += n;
        }
    }
    fixed[o] = '\0';
    v = json_string(fixed);
    free(fixed);
    return v;
}

static void set_text(json_t *obj, const char *key, const char *s)
{
    if (s != NULL)
        json_object_set_new(obj, key, text_value(s));
}

static long long monotonic_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

bool tally_log_repeat_due(tally_log_repeat_t *r, int window_ms, unsigned *left_out)
{
    long long now = monotonic_ms();
    bool due;
    pthread_mutex_lock(&log_lock);
    due = r->last_ms == 0 || now - r->last_ms >= window_ms;
    if (due) {
        *left_out = r->left_out;
        r->left_out = 0;
        r->last_ms = now > 0 ? now : 1;
    } else if (r->left_out < UINT_MAX) {
        r->left_out++;
    }
    pthread_mutex_unlock(&log_lock);
    return due;
}

/* One line; @p left_out > 0 says how many like lines were not written before it. */
static void log_vwrite(tally_log_level_t level, const char *func, int line,
                       const tally_log_ctx_t *ctx, unsigned left_out, const char *fmt, va_list ap)
{
    if (level < TALLY_LOG_DEBUG || level > TALLY_LOG_ERROR)
        level = TALLY_LOG_ERROR;

    pthread_mutex_lock(&log_lock);
    if (level < log_min_level) {
        pthread_mutex_unlock(&log_lock);
        return;
    }

    char *msg = NULL;
    if (vasprintf(&msg, fmt, ap) < 0)
        msg = NULL;
    if (msg != NULL && left_out > 0) {
        char *longer = NULL;
        if (asprintf(&longer, "%s (and %u more like it since the last such line)", msg, left_out) >=
            0) {
            free(msg);
            msg = longer;
        }
    }

    /* RFC 3339 in UTC with milliseconds: 2026-11-22T00:12:43.123Z */
    struct timespec now;
    struct tm tm;
    char date[32], ts[48];
    clock_gettime(CLOCK_REALTIME, &now);
    gmtime_r(&now.tv_sec, &tm);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(ts, sizeof ts, "%s.%03uZ", date, (unsigned)(now.tv_nsec / 1000000L) % 1000u);

    json_t *obj = json_object();
    char *out = NULL;
    if (obj != NULL) {
        set_text(obj, "ts", ts);
        set_text(obj, "level", level_names[level]);
        set_text(obj, "component", log_component);
        if (log_worker[0])
            set_text(obj, "worker", log_worker);
        set_text(obj, "msg", msg != NULL ? msg : "(log message could not be formatted)");
        set_text(obj, "func", func);
        json_object_set_new(obj, "line", json_integer(line));
        if (left_out > 0)
            json_object_set_new(obj, "left_out", json_integer(left_out));
        if (ctx != NULL) {
            set_text(obj, "run_id", ctx->run_id);
            set_text(obj, "effect_id", ctx->effect_id);
            set_text(obj, "obligation_id", ctx->obligation_id);
            set_text(obj, "tool", ctx->tool);
        }
        out = json_dumps(obj, JSON_COMPACT | JSON_PRESERVE_ORDER);
        json_decref(obj);
    }

    if (out != NULL) {
        size_t n = strlen(out);
        char *lineb = realloc(out, n + 2);
        if (lineb != NULL) {
            out = lineb;
            out[n] = '\n';
            out[n + 1] = '\0';
            fwrite(out, 1, n + 1, stderr);
        } else {
            fprintf(stderr, "%s\n", out);
        }
    } else {
        /* Out of memory: still say something, without the message that could not be built. */
        fprintf(stderr,
                "{\"ts\":\"%s\",\"level\":\"%s\",\"msg\":\"log line lost: out of memory\"}\n", ts,
                level_names[level]);
    }
    fflush(stderr);
    pthread_mutex_unlock(&log_lock);

    free(out);
    free(msg);
}

void tally_log_write(tally_log_level_t level, const char *func, int line,
                     const tally_log_ctx_t *ctx, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(level, func, line, ctx, 0, fmt, ap);
    va_end(ap);
}

void tally_log_write_repeat(tally_log_level_t level, const char *func, int line,
                            const tally_log_ctx_t *ctx, unsigned left_out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(level, func, line, ctx, left_out, fmt, ap);
    va_end(ap);
}
