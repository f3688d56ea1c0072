/* columns_decode.h — a columns parameter (columns.h) read back as PostgreSQL's array_recv
 * reads it, for the unit tests: the header checked field by field, every element taken out. */
#ifndef TEST_COLUMNS_DECODE_H
#define TEST_COLUMNS_DECODE_H

#include <arpa/inet.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct decoded_columns {
    size_t n_cols, n_rows;
    char **v; /* v[col * n_rows + row], NULL for SQL NULL */
} decoded_columns_t;

static int32_t decoded_be32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return (int32_t)ntohl(v);
}

/* Decode @p len bytes at @p param, which must be a text[] of @p n_cols columns (or the empty
 * array of a batch without rows), into @p out (free it with decoded_columns_free). */
static void decode_columns(const char *param, int len, size_t n_cols, decoded_columns_t *out)
{
    const unsigned char *p = (const unsigned char *)param;
    memset(out, 0, sizeof *out);
    out->n_cols = n_cols;
    assert_non_null(p);
    assert_true(len >= 12);
    int32_t ndim = decoded_be32(p), flags = decoded_be32(p + 4);
    assert_int_equal(decoded_be32(p + 8), 25); /* text */
    if (ndim == 0) {
        assert_int_equal(len, 12);
        assert_int_equal(flags, 0);
        return;
    }
    assert_int_equal(ndim, 2);
    assert_true(len >= 28);
    assert_int_equal(decoded_be32(p + 12), (int32_t)n_cols);
    assert_int_equal(decoded_be32(p + 16), 1); /* lower bound */
    int32_t rows = decoded_be32(p + 20);
    assert_true(rows > 0);
    assert_int_equal(decoded_be32(p + 24), 1);
    out->n_rows = (size_t)rows;
    out->v = calloc(n_cols * out->n_rows, sizeof *out->v);
    assert_non_null(out->v);
    size_t at = 28;
    bool nulls = false;
    for (size_t i = 0; i < n_cols * out->n_rows; i++) {
        assert_true(at + 4 <= (size_t)len);
        int32_t n = decoded_be32(p + at);
        at += 4;
        if (n == -1) {
            nulls = true;
            continue;
        }
        assert_true(n >= 0 && at + (size_t)n <= (size_t)len);
        out->v[i] = strndup((const char *)p + at, (size_t)n);
        at += (size_t)n;
    }
    assert_int_equal(at, len); /* nothing after the last element */
    assert_int_equal(flags, nulls ? 1 : 0);
}

static const char *decoded_value(const decoded_columns_t *d, size_t col, size_t row)
{
    return d->v[col * d->n_rows + row];
}

static void decoded_columns_free(decoded_columns_t *d)
{
    for (size_t i = 0; i < d->n_cols * d->n_rows; i++)
        free(d->v[i]);
    free(d->v);
    memset(d, 0, sizeof *d);
}

#endif
