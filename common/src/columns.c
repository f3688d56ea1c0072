/* columns.c — a batch of rows as one binary two-dimensional text[] parameter (columns.h).
 *
 * PostgreSQL's binary array format (array_recv): int32 number of dimensions, int32 has-nulls
 * flag, the element type's OID, then per dimension int32 size and int32 lower bound, then
 * each element as an int32 length (-1 for NULL) and its bytes; all integers big-endian. The
 * elements of a [column][row] array run column by column, so each column is kept in a buffer
 * of its own and the parameter is their concatenation behind the header. */
#include "tally/columns.h"

#include <arpa/inet.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/json.h"

#define TEXT_OID     25
#define HEADER_EMPTY 12 /* ndim 0, flags, OID: an empty array, for no rows */
#define HEADER_2D    28
#define FIRST_BLOCK  4096

void tally_columns_init(tally_columns_t *c, size_t n_cols)
{
    tally_columns_reset(c);
    c->n_cols = n_cols <= TALLY_COLUMNS_MAX ? n_cols : 0;
    if (n_cols > TALLY_COLUMNS_MAX)
        tally_columns_fail(c, "too many columns for one batch");
}

void tally_columns_fail(tally_columns_t *c, const char *fmt, ...)
{
    if (!c->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->why, sizeof c->why, fmt, ap);
        va_end(ap);
    }
    c->failed = true;
}

bool tally_columns_row_begin(tally_columns_t *c)
{
    if (c->failed || c->n_cols == 0)
        return false;
    for (size_t k = 0; k < c->n_cols; k++)
        c->col[k].row_start = c->col[k].len;
    c->at = 0;
    c->row_nulls = false;
    return true;
}

static bool put(struct tally_column *col, const void *p, size_t n)
{
    if (!tally_text_reserve(&col->buf, &col->cap, col->len + n, FIRST_BLOCK))
        return false;
    memcpy(col->buf + col->len, p, n);
    col->len += n;
    return true;
}

static bool put32(struct tally_column *col, int32_t v)
{
    uint32_t be = htonl((uint32_t)v);
    return put(col, &be, 4);
}

bool tally_columns_text(tally_columns_t *c, const char *s)
{
    if (c->failed || c->at >= c->n_cols)
        return false;
    struct tally_column *col = &c->col[c->at];
    if (s == NULL) {
        if (!put32(col, -1))
            return false;
        c->row_nulls = true;
    } else {
        size_t n = strlen(s);
        if (!tally_utf8_valid(s, n)) {
            /* Named, so that the caller can tell refused text from memory running out. */
            tally_columns_fail(c, "column %zu of row %zu is not valid UTF-8", c->at + 1, c->n + 1);
            c->bad_text = true;
            return false;
        }
        if (n > INT32_MAX || !put32(col, (int32_t)n) || !put(col, s, n))
            return false;
    }
    c->at++;
    return true;
}

bool tally_columns_row_end(tally_columns_t *c, bool ok)
{
    if (c->at == SIZE_MAX)
        return false;
    ok = ok && c->at == c->n_cols;
    if (ok) {
        c->n++;
        c->nulls = c->nulls || c->row_nulls;
    } else {
        for (size_t k = 0; k < c->n_cols; k++)
            c->col[k].len = c->col[k].row_start;
    }
    c->at = SIZE_MAX;
    return ok;
}

const char *tally_columns_param(tally_columns_t *c, int *len)
{
    *len = 0;
    if (c->failed || c->at != SIZE_MAX)
        return NULL;
    size_t total = c->n ? HEADER_2D : HEADER_EMPTY;
    for (size_t k = 0; k < c->n_cols; k++)
        total += c->col[k].len;
    if (total > INT_MAX || c->n > INT32_MAX ||
        !tally_text_reserve(&c->param, &c->param_cap, total, FIRST_BLOCK))
        return NULL;
    uint32_t header[7] = {htonl(c->n ? 2 : 0),
                          htonl(c->nulls ? 1 : 0),
                          htonl(TEXT_OID),
                          htonl((uint32_t)c->n_cols),
                          htonl(1),
                          htonl((uint32_t)c->n),
                          htonl(1)};
    size_t at = c->n ? HEADER_2D : HEADER_EMPTY;
    memcpy(c->param, header, at);
    for (size_t k = 0; c->n && k < c->n_cols; k++) {
        memcpy(c->param + at, c->col[k].buf, c->col[k].len);
        at += c->col[k].len;
    }
    *len = (int)at;
    return c->param;
}

void tally_columns_reset(tally_columns_t *c)
{
    for (size_t k = 0; k < TALLY_COLUMNS_MAX; k++)
        c->col[k].len = c->col[k].row_start = 0;
    c->n = 0;
    c->at = SIZE_MAX;
    c->nulls = c->row_nulls = c->failed = c->bad_text = false;
    c->why[0] = '\0';
}

void tally_columns_release(tally_columns_t *c)
{
    for (size_t k = 0; k < TALLY_COLUMNS_MAX; k++)
        free(c->col[k].buf);
    free(c->param);
    memset(c, 0, sizeof *c);
    c->at = SIZE_MAX;
}

/* ---- result rows back to the batch ---------------------------------------------------- */

typedef struct keyed {
    const char *key;
    size_t pos;
} keyed_t;

static int cmp_keyed(const void *a, const void *b)
{
    return strcmp(((const keyed_t *)a)->key, ((const keyed_t *)b)->key);
}

/* A place written by the statement: digits only, below @p n. */
static size_t parse_place(const char *s, size_t n)
{
    if (*s == '\0')
        return SIZE_MAX;
    size_t v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || v > (SIZE_MAX - 9) / 10)
            return SIZE_MAX;
        v = v * 10 + (size_t)(*s - '0');
    }
    return v < n ? v : SIZE_MAX;
}

size_t *tally_columns_positions(const PGresult *res, int col, const char *const *keys, size_t n)
{
    int rows = res != NULL ? PQntuples(res) : 0;
    size_t *pos = malloc(((size_t)rows + 1) * sizeof *pos);
    if (pos == NULL)
        return NULL;
    keyed_t *index = NULL;
    size_t n_index = 0;
    if (keys != NULL) {
        index = malloc((n + 1) * sizeof *index);
        if (index == NULL) {
            free(pos);
            return NULL;
        }
        for (size_t i = 0; i < n; i++)
            if (keys[i] != NULL)
                index[n_index++] = (keyed_t){keys[i], i};
        qsort(index, n_index, sizeof *index, cmp_keyed);
    }
    for (int r = 0; r < rows; r++) {
        pos[r] = SIZE_MAX;
        if (col < 0 || col >= PQnfields(res) || PQgetisnull(res, r, col))
            continue;
        const char *v = PQgetvalue(res, r, col);
        if (keys == NULL) {
            pos[r] = parse_place(v, n);
            continue;
        }
        keyed_t want = {v, 0};
        const keyed_t *hit = bsearch(&want, index, n_index, sizeof *index, cmp_keyed);
        if (hit != NULL)
            pos[r] = hit->pos;
    }
    free(index);
    return pos;
}
