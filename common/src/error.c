/* error.c — the runtime error object: a typed code from the table in error.h, one sentence,
 * whether a retry may help, and PostgreSQL's SQLSTATE when it gave one. */
#include "tally/error.h"
#include "tally/text.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

typedef struct errc_row {
    const char *name;
    bool retriable;
    bool fatal;
} errc_row_t;

#define TALLY_ERRC_TABLE_ROW(code, name, retriable, fatal, meaning)                                \
    [code] = {name, retriable, fatal},

static const errc_row_t ERRC[TALLY_ERR__COUNT] = {[TALLY_ERR_NONE] = {"none", false, false},
                                                  TALLY_ERRC_TABLE(TALLY_ERRC_TABLE_ROW)};

static const errc_row_t *row_of(tally_errc_t errc)
{
    return (unsigned)errc < TALLY_ERR__COUNT ? &ERRC[errc] : &ERRC[TALLY_ERR_OTHER];
}

const char *tally_errc_name(tally_errc_t errc)
{
    return row_of(errc)->name;
}

bool tally_errc_retriable(tally_errc_t errc)
{
    return row_of(errc)->retriable;
}

bool tally_errc_fatal(tally_errc_t errc)
{
    return row_of(errc)->fatal;
}

bool tally_errc_parse(const char *name, tally_errc_t *out)
{
    if (name == NULL)
        return false;
    for (int e = TALLY_ERR_NONE + 1; e < TALLY_ERR__COUNT; e++) {
        if (strcmp(ERRC[e].name, name) == 0) {
            *out = (tally_errc_t)e;
            return true;
        }
    }
    return false;
}

/* Five characters of [0-9A-Z], as every SQLSTATE is. */
static bool sqlstate_shaped(const char *s)
{
    if (s == NULL || strlen(s) != 5)
        return false;
    for (size_t i = 0; i < 5; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'A' && s[i] <= 'Z')))
            return false;
    return true;
}

/* Connection trouble, whatever the statement: the classes a caller reports as "PostgreSQL could
 * not be reached" (the CLI's exit 3) rather than as a refusal. */
static bool sqlstate_connection(const char *s)
{
    return strncmp(s, "08", 2) == 0 || strncmp(s, "57P0", 4) == 0;
}

bool tally_sqlstate_retriable(const char *sqlstate)
{
    if (sqlstate == NULL)
        return false;
    return strncmp(sqlstate, "08", 2) == 0 || strcmp(sqlstate, "40001") == 0 ||
           strcmp(sqlstate, "40P01") == 0 || strcmp(sqlstate, "57014") == 0 ||
           strcmp(sqlstate, "57P01") == 0 || strcmp(sqlstate, "57P02") == 0 ||
           strcmp(sqlstate, "57P03") == 0;
}

/* Everything but the message; @p code is the text shown (the SQLSTATE, or errc's name). */
static void fill(tally_error_t *err, tally_errc_t errc, const char *sqlstate, const char *code,
                 bool retriable)
{
    err->errc = errc;
    snprintf(err->sqlstate, sizeof err->sqlstate, "%s", sqlstate != NULL ? sqlstate : "");
    /* An over-long code or message is cut on a character boundary (text.h): both travel into
     * logs, events and the ledger, which take only valid UTF-8. */
    tally_text_copy(err->code, sizeof err->code, code);
    err->retriable = retriable;
}

void tally_error_setc(tally_error_t *err, tally_errc_t errc, const char *fmt, ...)
{
    if (err == NULL)
        return;
    fill(err, errc, NULL, tally_errc_name(errc), tally_errc_retriable(errc));
    va_list ap;
    va_start(ap, fmt);
    tally_vfmt(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

void tally_error_setc_retriable(tally_error_t *err, tally_errc_t errc, bool retriable,
                                const char *fmt, ...)
{
    if (err == NULL)
        return;
    fill(err, errc, NULL, tally_errc_name(errc), retriable);
    va_list ap;
    va_start(ap, fmt);
    tally_vfmt(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

void tally_error_set_pg(tally_error_t *err, const char *sqlstate, bool retriable, const char *fmt,
                        ...)
{
    if (err == NULL)
        return;
    if (!sqlstate_shaped(sqlstate))
        sqlstate = "08006";
    fill(err, sqlstate_connection(sqlstate) ? TALLY_ERR_PG_CONNECTION : TALLY_ERR_PG, sqlstate,
         sqlstate, retriable);
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

bool tally_error_retriable(const tally_error_t *err)
{
    return err != NULL && err->errc != TALLY_ERR_NONE && err->retriable;
}

bool tally_error_fatal(const tally_error_t *err)
{
    return err != NULL && tally_errc_fatal(err->errc);
}
