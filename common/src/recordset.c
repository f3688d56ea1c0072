/* recordset.c — the text of a json_to_recordset($1::json) parameter, built row by row, with
 * one bulk column beside it as a binary text[] parameter, and the one statement that writes
 * them (the batches of audit.h and outbox.h). */
#include "tally/recordset.h"

#include <arpa/inet.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/json.h"

static bool put(tally_recordset_t *rs, const char *s, size_t n)
{
    /* room for "]" and the terminator at flush */
    if (!tally_text_reserve(&rs->text, &rs->cap, rs->len + n + 2, 4096))
        return false;
    memcpy(rs->text + rs->len, s, n);
    rs->len += n;
    return true;
}

static bool put_key(tally_recordset_t *rs, const char *key)
{
    return put(rs, ",\"", 2) && put(rs, key, strlen(key)) && put(rs, "\":", 2);
}

/* The bulk column's header: ndim, flags (has nulls), element type, then size and lower bound
 * of the one dimension (array_recv). Written by tally_recordset_bulk_param. */
#define BULK_HEADER 20
#define TEXT_OID    25

static bool bulk_put(tally_recordset_t *rs, const void *p, size_t n)
{
    if (rs->bulk_cap == 0)
        rs->bulk_len = BULK_HEADER;
    if (!tally_text_reserve(&rs->bulk, &rs->bulk_cap, rs->bulk_len + n, 4096))
        return false;
    memcpy(rs->bulk + rs->bulk_len, p, n);
    rs->bulk_len += n;
    return true;
}

static bool bulk_put32(tally_recordset_t *rs, int32_t v)
{
    uint32_t be = htonl((uint32_t)v);
    return bulk_put(rs, &be, 4);
}

bool tally_recordset_bulk(tally_recordset_t *rs, const char *s)
{
    if (rs->bulk_in_row)
        return false;
    if (s == NULL) {
        if (!bulk_put32(rs, -1))
            return false;
        rs->bulk_row_null = true;
    } else {
        size_t n = strlen(s);
        if (n > INT32_MAX || !tally_utf8_valid(s, n) || !bulk_put32(rs, (int32_t)n) ||
            !bulk_put(rs, s, n))
            return false;
    }
    rs->bulk_in_row = true;
    return true;
}

const char *tally_recordset_bulk_param(tally_recordset_t *rs, int *len)
{
    if (rs->bulk_cap == 0 && !bulk_put(rs, "", 0))
        return NULL;
    uint32_t head[5] = {htonl(1), htonl(rs->bulk_nulls ? 1 : 0), htonl(TEXT_OID),
                        htonl((uint32_t)rs->n), htonl(1)};
    size_t head_len = sizeof head;
    if (rs->n == 0) {
        head[0] = htonl(0); /* an empty array has no dimensions */
        head_len = 12;
    }
    if (rs->bulk_len > INT_MAX)
        return NULL;
    memcpy(rs->bulk, head, head_len);
    *len = rs->n == 0 ? (int)head_len : (int)rs->bulk_len;
    return rs->bulk;
}

bool tally_recordset_row_begin(tally_recordset_t *rs)
{
    rs->row_start = rs->len;
    if (rs->bulk_cap == 0 && !bulk_put(rs, "", 0))
        return false;
    rs->bulk_row_start = rs->bulk_len;
    rs->bulk_in_row = rs->bulk_row_null = false;
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
    /* a row that set no bulk value has SQL NULL there, so element i is always row i */
    ok = ok && (rs->bulk_in_row || bulk_put32(rs, -1)) && put(rs, "}", 1);
    if (ok) {
        rs->bulk_nulls = rs->bulk_nulls || !rs->bulk_in_row || rs->bulk_row_null;
        rs->n++;
    } else {
        rs->len = rs->row_start;
        rs->bulk_len = rs->bulk_row_start;
    }
    rs->row_start = rs->len;
    rs->bulk_row_start = rs->bulk_len;
    rs->bulk_in_row = rs->bulk_row_null = false;
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
    rs->bulk_len = rs->bulk_row_start = rs->bulk_cap ? BULK_HEADER : 0;
    rs->bulk_in_row = rs->bulk_row_null = false;
    rs->bulk_nulls = false;
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
    int lengths[2] = {0, 0}, formats[2] = {0, 1};
    const char *params[2] = {tally_recordset_close(rs),
                             tally_recordset_bulk_param(rs, &lengths[1])};
    bool ok = false;
    if (params[1] == NULL) {
        tally_error_set(err, "oom", true, "%s batch not written: out of memory", what);
    } else {
        PGresult *res = tally_pg_exec_bin(pg, sql, 2, params, lengths, formats, err);
        ok = res != NULL;
        PQclear(res);
    }
    reset(rs);
    return ok;
}

void tally_recordset_release(tally_recordset_t *rs)
{
    free(rs->text);
    rs->text = NULL;
    rs->len = rs->cap = 0;
    free(rs->bulk);
    rs->bulk = NULL;
    rs->bulk_cap = 0;
    reset(rs);
}
