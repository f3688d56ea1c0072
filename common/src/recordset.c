/* recordset.c — the text of a json_to_recordset($1::json) parameter, built row by row, and the
 * one statement that writes it (the batches of audit.h and outbox.h). */
#include "tally/recordset.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/json.h"

static bool put(tally_recordset_t *rs, const char *s, size_t n)
{
    if (rs->len + n + 2 > rs->cap) { /* room for "]" and the terminator at flush */
        size_t cap = rs->cap ? rs->cap : 4096;
        while (rs->len + n + 2 > cap)
            cap *= 2;
        char *grown = realloc(rs->text, cap);
        if (grown == NULL)
            return false;
        rs->text = grown;
        rs->cap = cap;
    }
    memcpy(rs->text + rs->len, s, n);
    rs->len += n;
    return true;
}

static bool put_key(tally_recordset_t *rs, const char *key)
{
    return put(rs, ",\"", 2) && put(rs, key, strlen(key)) && put(rs, "\":", 2);
}

bool tally_recordset_row_begin(tally_recordset_t *rs)
{
    rs->row_start = rs->len;
    char head[48];
    int k = snprintf(head, sizeof(head), "%s{\"n\":%zu", rs->n ? "," : "[", rs->n);
    return put(rs, head, (size_t)k);
}

bool tally_recordset_text(tally_recordset_t *rs, const char *key, const char *s)
{
    if (!put_key(rs, key))
        return false;
    if (s == NULL)
        return put(rs, "null", 4);
    size_t n = strlen(s);
    if (!tally_utf8_valid(s, n) || !put(rs, "\"", 1))
        return false;
    size_t from = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\')
            continue;
        char esc[8];
        int k = c == '"'    ? snprintf(esc, sizeof(esc), "\\\"")
                : c == '\\' ? snprintf(esc, sizeof(esc), "\\\\")
                            : snprintf(esc, sizeof(esc), "\\u%04x", c);
        if (!put(rs, s + from, i - from) || !put(rs, esc, (size_t)k))
            return false;
        from = i + 1;
    }
    return put(rs, s + from, n - from) && put(rs, "\"", 1);
}

bool tally_recordset_json(tally_recordset_t *rs, const char *key, const char *json)
{
    if (!put_key(rs, key))
        return false;
    return json ? put(rs, json, strlen(json)) : put(rs, "null", 4);
}

bool tally_recordset_row_end(tally_recordset_t *rs, bool ok)
{
    ok = ok && put(rs, "}", 1);
    if (ok)
        rs->n++;
    else
        rs->len = rs->row_start;
    rs->row_start = rs->len;
    return ok;
}

void tally_recordset_fail(tally_recordset_t *rs, const char *fmt, ...)
{
    if (!rs->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(rs->why, sizeof(rs->why), fmt, ap);
        va_end(ap);
    }
    rs->failed = true;
}

static void reset(tally_recordset_t *rs)
{
    rs->len = 0;
    rs->row_start = 0;
    rs->n = 0;
    rs->failed = false;
    rs->why[0] = '\0';
}

const char *tally_recordset_close(tally_recordset_t *rs)
{
    if (rs->failed || rs->n == 0)
        return NULL;
    rs->text[rs->len] = ']'; /* put() always leaves room for these two */
    rs->text[rs->len + 1] = '\0';
    return rs->text;
}

bool tally_recordset_flush(tally_recordset_t *rs, tally_pg_t *pg, const char *sql, const char *what,
                           tally_error_t *err)
{
    if (rs->failed) {
        tally_error_set(err, what, false, "%s batch not written: %s", what, rs->why);
        reset(rs);
        return false;
    }
    if (rs->n == 0)
        return true;
    const char *params[1] = {tally_recordset_close(rs)};
    bool ok = tally_pg_run(pg, sql, 1, params, err);
    reset(rs);
    return ok;
}

void tally_recordset_release(tally_recordset_t *rs)
{
    free(rs->text);
    rs->text = NULL;
    rs->len = rs->cap = 0;
    reset(rs);
}
