/* error.c — the runtime error object: a code, one sentence, and whether a retry may help. */
#include "tally/error.h"
#include "tally/text.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

void tally_error_set(tally_error_t *err, const char *code, bool retriable, const char *fmt, ...)
{
    if (err == NULL)
        return;
    /* An over-long code or message is cut on a character boundary (text.h): both travel into
     * logs, events and the ledger, which take only valid UTF-8. */
    tally_text_copy(err->code, sizeof err->code, code != NULL ? code : "error");
    err->retriable = retriable;
    va_list ap;
    va_start(ap, fmt);
    tally_vfmt(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

void tally_error_clear(tally_error_t *err)
{
    if (err == NULL)
        return;
    memset(err, 0, sizeof *err);
}
