/* The fake tool's records. Everything is guarded by st->mu, which is never held while a request
 * sleeps; JSON sent to clients is serialised under the lock so no jansson value is shared
 * between threads. A record is kept as a small C struct with its raw body and turned into JSON
 * only when answered: a benchmark leaves millions of them. The answers of the hot path (an
 * execute, a status check) and the request log are written as text without a jansson tree: in
 * the benchmark this process shares two cores with what it measures. */
#include "fake_store.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct record {
    char *id, *collection, *key, *run_id, *effect_id, *reversed_by;
    char *raw; /* the raw request body: the idempotency fingerprint, and "body" parsed */
    size_t raw_len;
    json_int_t version;
    char *etag; /* etag_version: the version shown, an opaque string (NULL: `version`) */
    size_t etag_len;
    bool containment;
    char created_at[32], reversed_at[32];
    long long created_ms;         /* created_at; never less than the record's before it */
    size_t pos;                   /* index in st->recs: creation order */
    struct record *same_key_next; /* another record with the same key (apply_twice) */
    struct record *run_next;      /* the next record of the same collection and run id */
    struct record *run_tail;      /* the first of a run's records: its last (for appending) */
} record_t;

enum { LOG_FIELDS = 9 }; /* the strings of fake_request_info_t, in the order log_json shows them */

typedef struct log_entry {
    uint64_t seq;  /* 0: empty slot */
    char *strings; /* the request's strings, NUL-terminated one after the other (owned) */
    const char *field[LOG_FIELDS]; /* into `strings`; NULL where the request had none */
    int signature_ok;
    unsigned status;   /* 0: not answered yet, or the connection was dropped */
    const char *fault; /* a static fault name, NULL for none */
    char at[32];
} log_entry_t;

struct fake_store {
    pthread_mutex_t mu;
    uint64_t next_id;
    record_t **recs; /* creation order, records and containments */
    size_t nrecs, caprecs;
    json_t *by_key;         /* "collection\nkey" -> index of the first record with that key */
    json_t *by_id;          /* record id -> index */
    json_t *by_run;         /* "collection\nrun id" -> index of the run's first record (list) */
    uint64_t generation;    /* bumped by a reset: older list cursors are refused */
    unsigned char salt[16]; /* in every list cursor's check: cursors of another process fail */
    json_t *reversals;      /* array, creation order */
    json_t *rev_by_key;     /* "collection\nreverse key" -> index into reversals */
    log_entry_t *log;       /* ring of FAKE_STORE_LOG_SIZE */
    uint64_t log_next;      /* sequence number of the next request, from 1 */
    uint64_t log_started;   /* log_next at the last reset */
};

static long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000L;
}

/* `ms` (since the epoch, not negative) as RFC 3339 UTC with milliseconds. */
static void format_ms(long long ms, char *buf, size_t bufsz)
{
    struct tm tm;
    time_t sec = (time_t)(ms / 1000);
    gmtime_r(&sec, &tm);
    size_t n = strftime(buf, bufsz, "%Y-%m-%dT%H:%M:%S", &tm);
    if (n > 0 && n < bufsz)
        snprintf(buf + n, bufsz - n, ".%03uZ", (unsigned)(ms % 1000));
}

void fake_now_rfc3339(char *buf, size_t bufsz)
{
    format_ms(now_ms(), buf, bufsz);
}

/* Days from 1970-01-01 to y-m-d of the proleptic Gregorian calendar (Howard Hinnant's
 * days_from_civil), negative before 1970. */
static long long days_from_civil(long long y, unsigned m, unsigned d)
{
    y -= m <= 2;
    long long era = (y >= 0 ? y : y - 399) / 400;
    unsigned yoe = (unsigned)(y - era * 400);
    unsigned doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
    unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (long long)doe - 719468;
}

/* `n` digits at *p as a number (advancing *p); -1 when they are not all digits. */
static int digits(const char **p, int n)
{
    int v = 0;
    for (int i = 0; i < n; i++) {
        char c = (*p)[i];
        if (c < '0' || c > '9')
            return -1;
        v = v * 10 + (c - '0');
    }
    *p += n;
    return v;
}

bool fake_rfc3339_ms(const char *s, long long *ms)
{
    static const unsigned char MDAYS[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    const char *p = s;
    int y = digits(&p, 4);
    if (y < 0 || *p++ != '-')
        return false;
    int mo = digits(&p, 2);
    if (mo < 1 || mo > 12 || *p++ != '-')
        return false;
    int d = digits(&p, 2);
    bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    if (d < 1 || d > MDAYS[mo - 1] + (mo == 2 && leap) || (*p != 'T' && *p != 't'))
        return false;
    p++;
    int h = digits(&p, 2);
    if (h < 0 || h > 23 || *p++ != ':')
        return false;
    int mi = digits(&p, 2);
    if (mi < 0 || mi > 59 || *p++ != ':')
        return false;
    int sec = digits(&p, 2);
    if (sec < 0 || sec > 60)
        return false;
    long long ns = 0;
    if (*p == '.') {
        p++;
        if (*p < '0' || *p > '9')
            return false;
        int n = 0;
        bool beyond = false; /* a non-zero digit past nanoseconds: round up */
        for (; *p >= '0' && *p <= '9'; p++, n++) {
            if (n < 9)
                ns = ns * 10 + (*p - '0');
            else
                beyond |= *p != '0';
        }
        for (; n < 9; n++)
            ns *= 10;
        ns += beyond;
    }
    long long offset = 0;
    if (*p == 'Z' || *p == 'z') {
        p++;
    } else if (*p == '+' || *p == '-') {
        int sign = *p++ == '-' ? -1 : 1;
        int oh = digits(&p, 2);
        if (oh < 0 || oh > 23 || *p++ != ':')
            return false;
        int om = digits(&p, 2);
        if (om < 0 || om > 59)
            return false;
        offset = sign * (oh * 3600LL + om * 60LL);
    } else {
        return false;
    }
    if (*p)
        return false;
    long long t = days_from_civil(y, (unsigned)mo, (unsigned)d) * 86400 + h * 3600LL + mi * 60LL +
                  sec - offset;
    *ms = t * 1000 + (ns + 999999) / 1000000;
    return true;
}

/* A growing JSON text. `ok` turns false at the first failed allocation or string that is not
 * UTF-8 (jansson refuses those too) and stays false. common/ has the like (tally_jtext_*,
 * tally_utf8_valid), but the fake tool stands for an outside service and links no tally code
 * (CMakeLists.txt here). */
typedef struct text {
    char *s;
    size_t len, cap;
    bool ok;
} text_t;

static void text_put(text_t *t, const char *s, size_t n)
{
    if (!t->ok)
        return;
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 512;
        while (cap < t->len + n + 1)
            cap *= 2;
        char *grown = realloc(t->s, cap);
        if (!grown) {
            t->ok = false;
            return;
        }
        t->s = grown;
        t->cap = cap;
    }
    memcpy(t->s + t->len, s, n);
    t->len += n;
    t->s[t->len] = '\0';
}

static void text_lit(text_t *t, const char *s)
{
    text_put(t, s, strlen(s));
}

/* The length of the UTF-8 sequence at p (RFC 3629: no overlongs, surrogates or values past
 * U+10FFFF), 0 when it is not one. */
static size_t utf8_len(const unsigned char *p)
{
    if (p[0] < 0x80)
        return 1;
    size_t n = p[0] >= 0xC2 && p[0] <= 0xDF   ? 2
               : (p[0] & 0xF0) == 0xE0        ? 3
               : p[0] >= 0xF0 && p[0] <= 0xF4 ? 4
                                              : 0;
    for (size_t i = 1; i < n; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    if ((n == 3 && p[0] == 0xE0 && p[1] < 0xA0) || (n == 3 && p[0] == 0xED && p[1] >= 0xA0) ||
        (n == 4 && p[0] == 0xF0 && p[1] < 0x90) || (n == 4 && p[0] == 0xF4 && p[1] >= 0x90))
        return 0;
    return n;
}

bool fake_utf8_valid(const char *s)
{
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        size_t n = utf8_len(p);
        if (n == 0)
            return false;
        p += n;
    }
    return true;
}

/* `s` as a JSON string escaped as jansson escapes it, UTF-8 kept as it is; NULL as null. */
static void text_str(text_t *t, const char *s)
{
    if (!s) {
        text_lit(t, "null");
        return;
    }
    text_put(t, "\"", 1);
    const unsigned char *p = (const unsigned char *)s, *run = p;
    while (*p) {
        size_t n = utf8_len(p);
        if (n == 0) {
            t->ok = false;
            return;
        }
        if (n > 1 || (*p >= 0x20 && *p != '"' && *p != '\\')) {
            p += n;
            continue;
        }
        text_put(t, (const char *)run, (size_t)(p - run));
        /* the short escapes jansson writes, else \u00XX */
        static const char ESC_IN[] = "\"\\\b\f\n\r\t", ESC_OUT[] = "\"\\bfnrt";
        const char *hit = strchr(ESC_IN, *p);
        char esc[8];
        if (hit)
            snprintf(esc, sizeof esc, "\\%c", ESC_OUT[hit - ESC_IN]);
        else
            snprintf(esc, sizeof esc, "\\u%04X", *p);
        text_lit(t, esc);
        run = ++p;
    }
    text_put(t, (const char *)run, (size_t)(p - run));
    text_put(t, "\"", 1);
}

/* `"key":` then `s` as a string, after a comma unless it opens the object. */
static void text_member(text_t *t, const char *key, const char *s)
{
    if (t->ok && t->len && t->s[t->len - 1] != '{')
        text_put(t, ",", 1);
    text_str(t, key);
    text_put(t, ":", 1);
    text_str(t, s);
}

/* Hands the text to `r` as its body, or answers 500 when it could not be written. */
static void reply_text(fake_reply_t *r, unsigned status, text_t *t)
{
    if (!t->ok) {
        free(t->s);
        fake_reply_raw(r, 500, "{\"error\":\"the answer could not be written as JSON\"}");
        return;
    }
    r->status = status;
    r->body = t->s;
    r->len = t->len;
}

static void reply_json(fake_reply_t *r, unsigned status, const json_t *j)
{
    char *text = j ? json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY) : NULL;
    if (!text) {
        fake_reply_raw(r, 500, "{\"error\":\"out of memory\"}");
        return;
    }
    r->status = status;
    r->body = text;
    r->len = strlen(text);
}

void fake_reply_error(fake_reply_t *r, unsigned status, const char *msg)
{
    json_t *j = json_pack("{s:s}", "error", msg);
    reply_json(r, status, j);
    json_decref(j);
}

void fake_reply_raw(fake_reply_t *r, unsigned status, const char *body)
{
    r->status = status;
    r->body = strdup(body);
    r->len = r->body ? strlen(body) : 0;
    if (!r->body)
        r->status = 500;
}

void fake_reply_clear(fake_reply_t *r)
{
    free(r->body);
    memset(r, 0, sizeof *r);
}

/* "a\nb" in a malloc'd string; NUL is impossible in HTTP header values, so is '\n'. */
static char *pair_key(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    char *k = malloc(la + lb + 2);
    if (!k)
        return NULL;
    memcpy(k, a, la);
    k[la] = '\n';
    memcpy(k + la + 1, b, lb + 1);
    return k;
}

static json_t *nullable(const char *s)
{
    return s ? json_string(s) : json_null();
}

static bool index_get(const json_t *map, const char *key, size_t *idx)
{
    json_t *v = json_object_get(map, key);
    if (!json_is_integer(v))
        return false;
    *idx = (size_t)json_integer_value(v);
    return true;
}

static void record_free(record_t *r)
{
    if (!r)
        return;
    free(r->id);
    free(r->collection);
    free(r->key);
    free(r->run_id);
    free(r->effect_id);
    free(r->reversed_by);
    free(r->raw);
    free(r->etag);
    free(r);
}

static char *strdup_or_null(const char *s)
{
    return s ? strdup(s) : NULL;
}

/* The record as answered, appended to `t`. Its "body" is the raw request body, which the
 * server checked is JSON before the record was made. With `tally_headers` (a list answer), also
 * the Tally headers its creating request carried, as received. */
static void record_text(text_t *t, const record_t *r, bool tally_headers)
{
    text_put(t, "{", 1);
    text_member(t, "id", r->id);
    text_member(t, "collection", r->collection);
    text_member(t, "idempotency_key", r->key);
    text_lit(t, ",\"body\":");
    text_put(t, r->raw, r->raw_len);
    text_member(t, "status", r->reversed_by ? "reversed" : "active");
    if (r->etag) {
        text_member(t, "version", r->etag);
    } else {
        char version[32];
        snprintf(version, sizeof version, ",\"version\":%" JSON_INTEGER_FORMAT, r->version);
        text_lit(t, version);
    }
    text_member(t, "created_at", r->created_at);
    text_member(t, "run_id", r->run_id);
    text_member(t, "effect_id", r->effect_id);
    if (r->reversed_by) {
        text_member(t, "reversed_by", r->reversed_by);
        text_member(t, "reversed_at", r->reversed_at);
    }
    if (tally_headers) {
        /* an execute or contain always carries Idempotency-Key; the others when sent */
        text_lit(t, ",\"tally_headers\":{");
        text_member(t, "idempotency-key", r->key);
        if (r->run_id)
            text_member(t, "tally-run-id", r->run_id);
        if (r->effect_id)
            text_member(t, "tally-effect-id", r->effect_id);
        text_put(t, "}", 1);
    }
    text_put(t, "}", 1);
}

/* The record as a new jansson value (NULL when it cannot be made), for the dump. */
static json_t *record_json(const record_t *r)
{
    text_t t = {.ok = true};
    record_text(&t, r, false);
    json_t *j = t.ok ? json_loadb(t.s, t.len, 0, NULL) : NULL;
    free(t.s);
    return j;
}

static void reply_record(fake_reply_t *out, unsigned status, const record_t *r)
{
    text_t t = {.ok = true};
    record_text(&t, r, false);
    reply_text(out, status, &t);
}

static void clear_locked(fake_store_t *st)
{
    for (size_t i = 0; i < st->nrecs; i++)
        record_free(st->recs[i]);
    st->nrecs = 0;
    json_object_clear(st->by_key);
    json_object_clear(st->by_id);
    json_object_clear(st->by_run);
    st->generation++;
    json_array_clear(st->reversals);
    json_object_clear(st->rev_by_key);
    for (size_t i = 0; i < FAKE_STORE_LOG_SIZE; i++) {
        free(st->log[i].strings);
        st->log[i] = (log_entry_t){0};
    }
    st->log_started = st->log_next;
    st->next_id = 1;
}

fake_store_t *fake_store_new(void)
{
    fake_store_t *st = calloc(1, sizeof *st);
    if (!st)
        return NULL;
    pthread_mutex_init(&st->mu, NULL);
    st->by_key = json_object();
    st->by_id = json_object();
    st->by_run = json_object();
    st->reversals = json_array();
    st->rev_by_key = json_object();
    st->log = calloc(FAKE_STORE_LOG_SIZE, sizeof *st->log);
    st->next_id = 1;
    st->log_next = 1;
    st->log_started = 1;
    if (!st->by_key || !st->by_id || !st->by_run || !st->reversals || !st->rev_by_key || !st->log) {
        fake_store_free(st);
        return NULL;
    }
    if (RAND_bytes(st->salt, sizeof st->salt) != 1) {
        long long seed = now_ms();
        memcpy(st->salt, &seed, sizeof seed); /* a weaker salt still tells processes apart */
    }
    return st;
}

void fake_store_free(fake_store_t *st)
{
    if (!st)
        return;
    if (st->log)
        clear_locked(st);
    free(st->recs);
    free(st->log);
    json_decref(st->by_key);
    json_decref(st->by_id);
    json_decref(st->by_run);
    json_decref(st->reversals);
    json_decref(st->rev_by_key);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

void fake_store_reset(fake_store_t *st)
{
    pthread_mutex_lock(&st->mu);
    clear_locked(st);
    pthread_mutex_unlock(&st->mu);
}

/* The opaque version of an etag_version record: the hex SHA-256 of "<id>:<version>", repeated
 * to etag_len bytes, so it changes whenever the version does. Returns false when out of memory. */
static bool etag_update(record_t *r)
{
    char *etag = malloc(r->etag_len + 1);
    char num[32];
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    snprintf(num, sizeof num, ":%" JSON_INTEGER_FORMAT, r->version);
    bool ok = etag && ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1 &&
              EVP_DigestUpdate(ctx, r->id, strlen(r->id)) == 1 &&
              EVP_DigestUpdate(ctx, num, strlen(num)) == 1 &&
              EVP_DigestFinal_ex(ctx, md, &mdlen) == 1 && mdlen > 0;
    EVP_MD_CTX_free(ctx);
    if (!ok) {
        free(etag);
        return false;
    }
    static const char HEX[] = "0123456789abcdef";
    for (size_t i = 0; i < r->etag_len; i++) {
        unsigned char b = md[(i / 2) % mdlen];
        etag[i] = HEX[i % 2 ? b & 0xf : b >> 4];
    }
    etag[r->etag_len] = '\0';
    free(r->etag);
    r->etag = etag;
    return true;
}

/* "<collection>_<n>", padded to id_bytes bytes (when longer) with 'x' and then "-é" to the end:
 * a huge id, still UTF-8, whose last character is two bytes, so that a limit of id_bytes - 1
 * falls inside it. Returns malloc'd text or NULL. */
static char *make_id(const char *collection, uint64_t n, size_t id_bytes)
{
    char base[160];
    int len = snprintf(base, sizeof base, "%s_%llu", collection, (unsigned long long)n);
    size_t blen = len > 0 ? (size_t)len : 0, total = id_bytes > blen ? id_bytes : blen;
    char *id = malloc(total + 1);
    if (!id)
        return NULL;
    memcpy(id, base, blen);
    size_t i = blen;
    while ((total - i) % 3 != 0)
        id[i++] = 'x';
    for (; i < total; i += 3)
        memcpy(id + i, "-\xc3\xa9", 3); /* "-é" */
    id[total] = '\0';
    return id;
}

/* Creates one record and appends it; returns it, or NULL when out of memory. */
static record_t *create_record_locked(fake_store_t *st, const char *collection, bool containment,
                                      const char *key, const char *raw, size_t raw_len,
                                      const char *run_id, const char *effect_id,
                                      const fake_shape_t *shape)
{
    if (st->nrecs == st->caprecs) {
        size_t cap = st->caprecs ? st->caprecs * 2 : 1024;
        record_t **grown = realloc(st->recs, cap * sizeof *grown);
        if (!grown)
            return NULL;
        st->recs = grown;
        st->caprecs = cap;
    }
    record_t *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->id = make_id(collection, st->next_id, shape ? shape->id_bytes : 0);
    r->collection = strdup(collection);
    r->key = strdup(key);
    r->run_id = strdup_or_null(run_id);
    r->effect_id = strdup_or_null(effect_id);
    r->raw = malloc(raw_len ? raw_len : 1);
    r->version = 1;
    r->etag_len = shape ? shape->etag_bytes : 0;
    r->containment = containment;
    r->pos = st->nrecs;
    /* created_at never goes back in creation order, even when the clock does: a list by time
     * finds its first record by binary search */
    r->created_ms = now_ms();
    if (st->nrecs > 0 && r->created_ms < st->recs[st->nrecs - 1]->created_ms)
        r->created_ms = st->recs[st->nrecs - 1]->created_ms;
    format_ms(r->created_ms, r->created_at, sizeof r->created_at);
    char *run_key = run_id ? pair_key(collection, run_id) : NULL;
    size_t first;
    record_t *run_first =
        run_key && index_get(st->by_run, run_key, &first) ? st->recs[first] : NULL;
    if (!r->id || !r->collection || !r->key || (run_id && (!r->run_id || !run_key)) ||
        (effect_id && !r->effect_id) || !r->raw || (r->etag_len && !etag_update(r)) ||
        (run_key && !run_first &&
         json_object_set_new(st->by_run, run_key, json_integer((json_int_t)r->pos)) != 0) ||
        json_object_set_new(st->by_id, r->id, json_integer((json_int_t)r->pos)) != 0) {
        if (run_key && !run_first)
            json_object_del(st->by_run, run_key);
        free(run_key);
        record_free(r);
        return NULL;
    }
    free(run_key);
    if (run_first) {
        run_first->run_tail->run_next = r;
        run_first->run_tail = r;
    } else if (run_id) {
        r->run_tail = r;
    }
    memcpy(r->raw, raw, raw_len);
    r->raw_len = raw_len;
    st->next_id++;
    st->recs[st->nrecs++] = r;
    return r;
}

void fake_store_execute(fake_store_t *st, const char *collection, bool containment, const char *key,
                        const char *raw, size_t raw_len, const char *run_id, const char *effect_id,
                        int copies, const fake_shape_t *shape, fake_reply_t *out)
{
    char *k = pair_key(collection, key);
    if (!k) {
        fake_reply_error(out, 500, "out of memory");
        return;
    }
    pthread_mutex_lock(&st->mu);
    size_t idx;
    if (index_get(st->by_key, k, &idx)) {
        record_t *r = st->recs[idx];
        if (r->raw_len == raw_len && memcmp(r->raw, raw, raw_len) == 0) {
            reply_record(out, 200, r);
            out->replayed = true;
        } else {
            fake_reply_error(out, 422, "idempotency key reused with a different body");
        }
    } else {
        record_t *first = NULL, *prev = NULL;
        size_t first_idx = st->nrecs;
        for (int i = 0; i < copies; i++) {
            record_t *r = create_record_locked(st, collection, containment, key, raw, raw_len,
                                               run_id, effect_id, shape);
            if (!r)
                break;
            if (prev)
                prev->same_key_next = r;
            else
                first = r;
            prev = r;
        }
        if (first && json_object_set_new(st->by_key, k, json_integer((json_int_t)first_idx)) == 0)
            reply_record(out, 201, first);
        else
            fake_reply_error(out, 500, "out of memory");
    }
    pthread_mutex_unlock(&st->mu);
    free(k);
}

void fake_store_status(fake_store_t *st, const char *collection, const char *key, fake_reply_t *out)
{
    char *k = pair_key(collection, key);
    if (!k) {
        fake_reply_error(out, 500, "out of memory");
        return;
    }
    text_t t = {.ok = true};
    text_put(&t, "[", 1);
    pthread_mutex_lock(&st->mu);
    size_t idx;
    if (index_get(st->by_key, k, &idx)) {
        for (record_t *r = st->recs[idx]; r; r = r->same_key_next) {
            if (r != st->recs[idx])
                text_put(&t, ",", 1);
            record_text(&t, r, false);
        }
    }
    pthread_mutex_unlock(&st->mu);
    text_put(&t, "]", 1);
    reply_text(out, 200, &t);
    free(k);
}

/* The check of a list cursor into `hex` (16 hex digits and a NUL): SHA-256 over the store's
 * salt and generation, the position and the query it pages (collection, and since or run id),
 * so that another query, another process or a reset refuses it. False when out of memory. */
static bool cursor_check(const fake_store_t *st, const char *collection, const fake_list_query_t *q,
                         size_t pos, char hex[17])
{
    char head[160];
    snprintf(head, sizeof head, "%llu\n%zu\n%s\n%lld\n", (unsigned long long)st->generation, pos,
             collection, q->by_run ? 0 : q->since_ms);
    const char *run = q->by_run ? q->run_id : "";
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    bool ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1 &&
              EVP_DigestUpdate(ctx, st->salt, sizeof st->salt) == 1 &&
              EVP_DigestUpdate(ctx, head, strlen(head)) == 1 &&
              EVP_DigestUpdate(ctx, q->by_run ? "run " : "since", 5) == 1 &&
              EVP_DigestUpdate(ctx, run, strlen(run)) == 1 &&
              EVP_DigestFinal_ex(ctx, md, &mdlen) == 1 && mdlen >= 8;
    EVP_MD_CTX_free(ctx);
    if (!ok)
        return false;
    static const char HEX[] = "0123456789abcdef";
    for (size_t i = 0; i < 8; i++) {
        hex[2 * i] = HEX[md[i] >> 4];
        hex[2 * i + 1] = HEX[md[i] & 0xf];
    }
    hex[16] = '\0';
    return true;
}

/* A cursor is "<position>.<check>": the index in creation order of the next record to show,
 * and cursor_check's digits. Sets *pos when `cursor` is one this store gave for this query. */
static bool cursor_parse(const fake_store_t *st, const char *collection, const fake_list_query_t *q,
                         size_t *pos)
{
    const char *c = q->cursor;
    size_t nd = strspn(c, "0123456789");
    if (nd == 0 || nd > 19 || c[nd] != '.' || strlen(c + nd + 1) != 16)
        return false;
    unsigned long long v = strtoull(c, NULL, 10);
    char want[17];
    if (v > st->nrecs || !cursor_check(st, collection, q, (size_t)v, want) ||
        CRYPTO_memcmp(want, c + nd + 1, 16) != 0)
        return false;
    *pos = (size_t)v;
    return true;
}

void fake_store_list(fake_store_t *st, const char *collection, const fake_list_query_t *q,
                     fake_reply_t *out)
{
    char *run_key = q->by_run ? pair_key(collection, q->run_id) : NULL;
    if (q->by_run && !run_key) {
        fake_reply_error(out, 500, "out of memory");
        return;
    }
    text_t t = {.ok = true};
    text_lit(&t, "{\"records\":[");
    pthread_mutex_lock(&st->mu);
    size_t pos = 0;
    if (q->cursor && !cursor_parse(st, collection, q, &pos)) {
        pthread_mutex_unlock(&st->mu);
        free(t.s);
        free(run_key);
        fake_reply_error(out, 400,
                         "unknown cursor: not one this service gave for this query (or the "
                         "records were reset since)");
        return;
    }
    unsigned n = 0;
    const record_t *next = NULL; /* the first record of the next page */
    if (q->by_run) {
        size_t first;
        const record_t *r = q->cursor ? (pos < st->nrecs ? st->recs[pos] : NULL)
                            : index_get(st->by_run, run_key, &first) ? st->recs[first]
                                                                     : NULL;
        for (; r; r = r->run_next) {
            if (n == q->limit) {
                next = r;
                break;
            }
            if (n++)
                text_put(&t, ",", 1);
            record_text(&t, r, true);
        }
    } else {
        /* created_ms never decreases along st->recs: find the first at or after since */
        size_t lo = 0, hi = st->nrecs;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (st->recs[mid]->created_ms < q->since_ms)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (size_t i = lo > pos ? lo : pos; i < st->nrecs; i++) {
            const record_t *r = st->recs[i];
            if (strcmp(r->collection, collection) != 0)
                continue;
            if (n == q->limit) {
                next = r;
                break;
            }
            if (n++)
                text_put(&t, ",", 1);
            record_text(&t, r, true);
        }
    }
    char cursor[48], hex[17];
    bool cursor_ok = !next || cursor_check(st, collection, q, next->pos, hex);
    if (next && cursor_ok)
        snprintf(cursor, sizeof cursor, "%zu.%s", next->pos, hex);
    pthread_mutex_unlock(&st->mu);
    free(run_key);
    if (!cursor_ok) {
        free(t.s);
        fake_reply_error(out, 500, "out of memory");
        return;
    }
    text_lit(&t, "],\"next_cursor\":");
    text_str(&t, next ? cursor : NULL);
    text_put(&t, "}", 1);
    reply_text(out, 200, &t);
}

/* The version named by an If-Match header: `2`, `"2"` or `W/"2"`; -1 when it is not a
 * number. `*` matches any version and is returned as -2. */
static long long if_match_version(const char *h)
{
    while (*h == ' ' || *h == '\t')
        h++;
    if (h[0] == '*')
        return -2;
    if (h[0] == 'W' && h[1] == '/')
        h += 2;
    bool quoted = *h == '"';
    if (quoted)
        h++;
    char *end;
    long long v = strtoll(h, &end, 10);
    if (end == h)
        return -1;
    if (quoted && *end++ != '"')
        return -1;
    while (*end == ' ' || *end == '\t')
        end++;
    return *end ? -1 : v;
}

/* Whether an If-Match header names the opaque version `etag`: `E`, `"E"` or `W/"E"`, whole. */
static bool if_match_etag(const char *h, const char *etag)
{
    while (*h == ' ' || *h == '\t')
        h++;
    if (h[0] == '*')
        return true;
    if (h[0] == 'W' && h[1] == '/')
        h += 2;
    size_t n = strlen(h);
    while (n > 0 && (h[n - 1] == ' ' || h[n - 1] == '\t'))
        n--;
    if (n >= 2 && h[0] == '"' && h[n - 1] == '"') {
        h++;
        n -= 2;
    }
    return n == strlen(etag) && memcmp(h, etag, n) == 0;
}

void fake_store_reverse(fake_store_t *st, const char *collection, const char *reverse_key,
                        const char *external_ref, const json_t *request, const char *if_match,
                        const char *run_id, const char *effect_id, fake_reply_t *out)
{
    char *k = pair_key(collection, reverse_key);
    if (!k) {
        fake_reply_error(out, 500, "out of memory");
        return;
    }
    pthread_mutex_lock(&st->mu);
    size_t idx;
    if (index_get(st->rev_by_key, k, &idx)) {
        reply_json(out, 200, json_array_get(st->reversals, idx));
        out->replayed = true;
        goto done;
    }
    record_t *r = index_get(st->by_id, external_ref, &idx) ? st->recs[idx] : NULL;
    if (!r || r->containment || strcmp(r->collection, collection) != 0) {
        fake_reply_error(out, 404, "unknown external_ref");
        goto done;
    }
    if (r->reversed_by) {
        fake_reply_error(out, 404, "already reversed");
        goto done;
    }
    json_int_t version = r->version;
    /* the version as the record shows it: the integer, or an etag_version record's string */
    json_t *shown = r->etag ? json_string(r->etag) : json_integer(version);
    if (if_match) {
        long long want = r->etag ? 0 : if_match_version(if_match);
        bool match = r->etag ? if_match_etag(if_match, r->etag) : want == -2 || want == version;
        if (!match) {
            json_t *e = json_pack("{s:s, s:o?}", "error", "If-Match does not match the version",
                                  "version", shown);
            reply_json(out, 412, e);
            json_decref(e);
            goto done;
        }
    }
    char id[64], now[32];
    snprintf(id, sizeof id, "rev_%llu", (unsigned long long)st->next_id);
    fake_now_rfc3339(now, sizeof now);
    json_t *reason = json_object_get(request, "reason");
    json_t *rev =
        json_pack("{s:s, s:s, s:s, s:s, s:O, s:o?, s:s, s:o, s:o}", "id", id, "collection",
                  collection, "reverses", external_ref, "reverse_key", reverse_key, "reason",
                  reason ? reason : json_null(), "reversed_version", shown, "created_at", now,
                  "run_id", nullable(run_id), "effect_id", nullable(effect_id));
    size_t rev_idx = json_array_size(st->reversals);
    char *reversed_by = strdup(id);
    if (!rev || !reversed_by || json_array_append(st->reversals, rev) != 0 ||
        json_object_set_new(st->rev_by_key, k, json_integer((json_int_t)rev_idx)) != 0) {
        json_decref(rev);
        free(reversed_by);
        fake_reply_error(out, 500, "out of memory");
        goto done;
    }
    st->next_id++;
    r->version = version + 1;
    if (r->etag)
        etag_update(r); /* out of memory: the old string stays, as a version that did not move */
    r->reversed_by = reversed_by;
    snprintf(r->reversed_at, sizeof r->reversed_at, "%s", now);
    reply_json(out, 201, rev);
    json_decref(rev);
done:
    pthread_mutex_unlock(&st->mu);
    free(k);
}

/* Whether something of collection `c` passes the filter `collection` (NULL: everything). */
static bool in_collection(const char *c, const char *collection)
{
    return !collection || (c && strcmp(c, collection) == 0);
}

/* A containment of collection C is recorded under "C_containments"; the filter accepts both. */
static bool containment_in(const char *c, const char *collection)
{
    if (in_collection(c, collection))
        return true;
    size_t n = strlen(collection);
    return strncmp(c, collection, n) == 0 && strcmp(c + n, "_containments") == 0;
}

char *fake_store_dump(fake_store_t *st, const char *collection)
{
    json_t *recs = json_array(), *revs = json_array(), *cont = json_array();
    char *text = NULL;
    pthread_mutex_lock(&st->mu);
    for (size_t i = 0; i < st->nrecs && recs && cont; i++) {
        const record_t *r = st->recs[i];
        if (r->containment ? containment_in(r->collection, collection)
                           : in_collection(r->collection, collection))
            json_array_append_new(r->containment ? cont : recs, record_json(r));
    }
    size_t i;
    json_t *rev;
    json_array_foreach(st->reversals, i, rev)
    {
        if (revs &&
            in_collection(json_string_value(json_object_get(rev, "collection")), collection))
            json_array_append(revs, rev);
    }
    json_t *all =
        json_pack("{s:o?, s:o?, s:o?, s:I}", "records", recs, "reversals", revs, "containments",
                  cont, "requests", (json_int_t)(st->log_next - st->log_started));
    if (all)
        text = json_dumps(all, JSON_COMPACT);
    pthread_mutex_unlock(&st->mu);
    json_decref(all);
    return text;
}

uint64_t fake_store_log_begin(fake_store_t *st, const fake_request_info_t *info)
{
    const char *in[LOG_FIELDS] = {
        info->method, info->path,      info->op,          info->collection, info->idempotency_key,
        info->run_id, info->effect_id, info->traceparent, info->if_match};
    size_t len[LOG_FIELDS], total = 0;
    for (size_t i = 0; i < LOG_FIELDS; i++)
        total += len[i] = in[i] ? strlen(in[i]) + 1 : 0;
    log_entry_t e = {.signature_ok = info->signature_ok, .strings = malloc(total ? total : 1)};
    if (e.strings) {
        char *p = e.strings;
        for (size_t i = 0; i < LOG_FIELDS; i++) {
            if (!in[i])
                continue;
            memcpy(p, in[i], len[i]);
            e.field[i] = p;
            p += len[i];
        }
        fake_now_rfc3339(e.at, sizeof e.at);
    }
    pthread_mutex_lock(&st->mu);
    uint64_t seq = st->log_next++;
    log_entry_t *slot = &st->log[seq % FAKE_STORE_LOG_SIZE];
    free(slot->strings);
    *slot = e;
    slot->seq = e.strings ? seq : 0;
    pthread_mutex_unlock(&st->mu);
    return seq;
}

void fake_store_log_end(fake_store_t *st, uint64_t seq, unsigned status, const char *fault)
{
    pthread_mutex_lock(&st->mu);
    log_entry_t *e = &st->log[seq % FAKE_STORE_LOG_SIZE];
    if (e->seq == seq) {
        e->status = status;
        e->fault = fault;
    }
    pthread_mutex_unlock(&st->mu);
}

/* One logged request as shown by GET /_control/requests; NULL when a string in it is not
 * UTF-8 (such a request is left out, as jansson cannot show it). */
static json_t *log_json(const log_entry_t *e)
{
    const char *const *f = e->field;
    json_t *sig = e->signature_ok < 0 ? json_null() : json_boolean(e->signature_ok);
    return json_pack("{s:s?, s:s?, s:s?, s:s?, s:s?, s:s?, s:s?, s:s?, s:s?, s:o, s:o, s:s?, "
                     "s:s, s:I}",
                     "method", f[0], "path", f[1], "op", f[2], "collection", f[3],
                     "idempotency_key", f[4], "run_id", f[5], "effect_id", f[6], "traceparent",
                     f[7], "if_match", f[8], "signature_ok", sig, "status",
                     e->status ? json_integer(e->status) : json_null(), "fault", e->fault, "at",
                     e->at, "seq", (json_int_t)e->seq);
}

char *fake_store_requests(fake_store_t *st)
{
    json_t *arr = json_array();
    char *text = NULL;
    pthread_mutex_lock(&st->mu);
    uint64_t first = st->log_next - st->log_started > FAKE_STORE_LOG_SIZE
                         ? st->log_next - FAKE_STORE_LOG_SIZE
                         : st->log_started;
    for (uint64_t seq = first; arr && seq < st->log_next; seq++) {
        const log_entry_t *e = &st->log[seq % FAKE_STORE_LOG_SIZE];
        json_t *j = e->seq == seq ? log_json(e) : NULL;
        if (j)
            json_array_append_new(arr, j);
    }
    if (arr)
        text = json_dumps(arr, JSON_COMPACT);
    pthread_mutex_unlock(&st->mu);
    json_decref(arr);
    return text;
}
