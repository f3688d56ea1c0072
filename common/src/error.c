/* error.c — the runtime error object: a code, one sentence, and whether a retry may help. */
#include "tally/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void tally_error_set(tally_error_t *err, const char *code, bool retriable, const char *fmt, ...)
{
    if (err == NULL)
        return;
    /* snprintf truncates an over-long code rather than overflowing the fixed field. */
    snprintf(err->code, sizeof err->code, "%s", code != NULL ? code : "error");
    err->retriable = retriable;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

void tally_error_clear(tally_error_t *err)
{
    if (err == NULL)
        return;
    memset(err, 0, sizeof *err);
}
