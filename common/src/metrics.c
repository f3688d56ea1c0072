/* metrics.c — counters, gauges and histograms rendered in the Prometheus text format 0.0.4.
 *
 * One mutex per registry guards everything: updates are a lookup and an add, far cheaper
 * than the PostgreSQL and HTTP work they measure, so contention is not worth more machinery.
 * Each family keeps its series in an array sorted by label values, which gives binary-search
 * lookup and the sorted exposition order for free. */
#include "tally/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    METRIC_COUNTER,
    METRIC_GAUGE,
    METRIC_HISTOGRAM,
} metric_type_t;

typedef struct series {
    char **values;    /* one per label of the family */
    double value;     /* counters and gauges */
    uint64_t *counts; /* histograms: per bucket, not cumulative; [n_buckets] is +Inf */
    double sum;
    uint64_t count;
} series_t;

struct tally_metric {
    tally_metrics_t *owner;
    metric_type_t type;
    char *name;
    char *help;
    char **labels;
    size_t n_labels;
    double *buckets;
    size_t n_buckets;
    series_t **series; /* sorted by label values */
    size_t n_series;
    size_t cap_series;
    tally_metric_t *next; /* declaration order */
};

struct tally_metrics {
    pthread_mutex_t mu;
    tally_metric_t *head;
    tally_metric_t *tail;
    /* tally_metrics_on_render: set before the HTTP thread starts, read by it */
    void (*collect)(void *opaque);
    void *collect_opaque;
};

const double tally_latency_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                        0.25,  0.5,    1,     2.5,  5,     10,   30};
const size_t tally_n_latency_buckets =
    sizeof tally_latency_buckets / sizeof tally_latency_buckets[0];

tally_metrics_t *tally_metrics_new(void)
{
    tally_metrics_t *m = calloc(1, sizeof *m);
    if (m == NULL) {
        return NULL;
    }
    if (pthread_mutex_init(&m->mu, NULL) != 0) {
        free(m);
        return NULL;
    }
    return m;
}

static void series_free(series_t *s, size_t n_labels)
{
    if (s == NULL) {
        return;
    }
    for (size_t i = 0; i < n_labels; i++) {
        free(s->values[i]);
    }
    free(s->values);
    free(s->counts);
    free(s);
}

static void metric_free(tally_metric_t *mt)
{
    for (size_t i = 0; i < mt->n_series; i++) {
        series_free(mt->series[i], mt->n_labels);
    }
    free(mt->series);
    for (size_t i = 0; i < mt->n_labels; i++) {
        free(mt->labels[i]);
    }
    free(mt->labels);
    free(mt->buckets);
    free(mt->name);
    free(mt->help);
    free(mt);
}

void tally_metrics_free(tally_metrics_t *m)
{
    if (m == NULL) {
        return;
    }
    tally_metric_t *mt = m->head;
    while (mt != NULL) {
        tally_metric_t *next = mt->next;
        metric_free(mt);
        mt = next;
    }
    pthread_mutex_destroy(&m->mu);
    free(m);
}

/* Split "tool, state" into trimmed names. false when out of memory or a name is empty. */
static bool parse_labels(const char *labels, char ***out, size_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    if (labels == NULL || labels[0] == '\0') {
        return true;
    }
    size_t n = 1;
    for (const char *p = labels; *p != '\0'; p++) {
        n += *p == ',';
    }
    char **names = calloc(n, sizeof *names);
    if (names == NULL) {
        return false;
    }
    const char *p = labels;
    for (size_t i = 0; i < n; i++) {
        const char *end = strchr(p, ',');
        if (end == NULL) {
            end = p + strlen(p);
        }
        const char *b = p;
        const char *e = end;
        while (b < e && (*b == ' ' || *b == '\t')) {
            b++;
        }
        while (e > b && (e[-1] == ' ' || e[-1] == '\t')) {
            e--;
        }
        if (b == e || (names[i] = strndup(b, (size_t)(e - b))) == NULL) {
            for (size_t j = 0; j < i; j++) {
                free(names[j]);
            }
            free(names);
            return false;
        }
        p = *end == ',' ? end + 1 : end;
    }
    *out = names;
    *n_out = n;
    return true;
}

static series_t *series_get(tally_metric_t *mt, const char *const *values);

static tally_metric_t *declare(tally_metrics_t *m, metric_type_t type, const char *name,
                               const char *help, const char *labels, const double *buckets,
                               size_t n_buckets)
{
    if (m == NULL || name == NULL) {
        return NULL;
    }
    pthread_mutex_lock(&m->mu);
    for (tally_metric_t *mt = m->head; mt != NULL; mt = mt->next) {
        if (strcmp(mt->name, name) == 0) {
            pthread_mutex_unlock(&m->mu);
            return mt;
        }
    }
    tally_metric_t *mt = calloc(1, sizeof *mt);
    if (mt == NULL) {
        goto fail;
    }
    mt->owner = m;
    mt->type = type;
    mt->name = strdup(name);
    mt->help = strdup(help != NULL ? help : "");
    if (mt->name == NULL || mt->help == NULL || !parse_labels(labels, &mt->labels, &mt->n_labels)) {
        goto fail;
    }
    if (type == METRIC_HISTOGRAM && n_buckets > 0) {
        mt->buckets = malloc(n_buckets * sizeof *mt->buckets);
        if (mt->buckets == NULL) {
            goto fail;
        }
        memcpy(mt->buckets, buckets, n_buckets * sizeof *mt->buckets);
        mt->n_buckets = n_buckets;
    }
    /* A family without labels has exactly one series: expose it (at 0) from the start, so
     * rate() and increase() see the first event instead of a series that appears with it. */
    if (mt->n_labels == 0 && series_get(mt, NULL) == NULL) {
        goto fail;
    }
    if (m->tail == NULL) {
        m->head = mt;
    } else {
        m->tail->next = mt;
    }
    m->tail = mt;
    pthread_mutex_unlock(&m->mu);
    return mt;
fail:
    pthread_mutex_unlock(&m->mu);
    if (mt != NULL) {
        metric_free(mt);
    }
    return NULL;
}

tally_metric_t *tally_metrics_counter(tally_metrics_t *m, const char *name, const char *help,
                                      const char *labels)
{
    return declare(m, METRIC_COUNTER, name, help, labels, NULL, 0);
}

tally_metric_t *tally_metrics_gauge(tally_metrics_t *m, const char *name, const char *help,
                                    const char *labels)
{
    return declare(m, METRIC_GAUGE, name, help, labels, NULL, 0);
}

tally_metric_t *tally_metrics_histogram(tally_metrics_t *m, const char *name, const char *help,
                                        const char *labels, const double *buckets, size_t n_buckets)
{
    return declare(m, METRIC_HISTOGRAM, name, help, labels, buckets, n_buckets);
}

/* Compare label values in declaration order. */
static int values_cmp(char *const *a, const char *const *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int c = strcmp(a[i], b[i]);
        if (c != 0) {
            return c;
        }
    }
    return 0;
}

/* The series for @p values, created on first use. Caller holds the lock. NULL when OOM. */
static series_t *series_get(tally_metric_t *mt, const char *const *values)
{
    size_t lo = 0;
    size_t hi = mt->n_series;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = values_cmp(mt->series[mid]->values, values, mt->n_labels);
        if (c == 0) {
            return mt->series[mid];
        }
        if (c < 0) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if (mt->n_series == mt->cap_series) {
        size_t cap = mt->cap_series != 0 ? mt->cap_series * 2 : 4;
        series_t **grown = realloc(mt->series, cap * sizeof *grown);
        if (grown == NULL) {
            return NULL;
        }
        mt->series = grown;
        mt->cap_series = cap;
    }
    series_t *s = calloc(1, sizeof *s);
    if (s == NULL) {
        return NULL;
    }
    s->values = calloc(mt->n_labels != 0 ? mt->n_labels : 1, sizeof *s->values);
    if (s->values == NULL) {
        free(s);
        return NULL;
    }
    for (size_t i = 0; i < mt->n_labels; i++) {
        if ((s->values[i] = strdup(values[i])) == NULL) {
            series_free(s, i);
            return NULL;
        }
    }
    if (mt->type == METRIC_HISTOGRAM) {
        s->counts = calloc(mt->n_buckets + 1, sizeof *s->counts);
        if (s->counts == NULL) {
            series_free(s, mt->n_labels);
            return NULL;
        }
    }
    memmove(&mt->series[lo + 1], &mt->series[lo], (mt->n_series - lo) * sizeof *mt->series);
    mt->series[lo] = s;
    mt->n_series++;
    return s;
}

typedef enum {
    OP_ADD,
    OP_SET,
    OP_OBSERVE,
} metric_op_t;

static void update(tally_metric_t *mt, metric_op_t op, double v, va_list ap)
{
    /* Label values are read before taking the lock; families have a handful of labels. */
    const char *values_buf[16] = {0};
    const char **values = values_buf;
    if (mt->n_labels > sizeof values_buf / sizeof values_buf[0]) {
        values = malloc(mt->n_labels * sizeof *values);
        if (values == NULL) {
            return;
        }
    }
    for (size_t i = 0; i < mt->n_labels; i++) {
        const char *s = va_arg(ap, const char *);
        values[i] = s != NULL ? s : "";
    }
    pthread_mutex_lock(&mt->owner->mu);
    series_t *s = series_get(mt, values);
    if (s != NULL) {
        switch (op) {
        case OP_ADD:
            s->value += v;
            break;
        case OP_SET:
            s->value = v;
            break;
        case OP_OBSERVE: {
            size_t i = 0;
            while (i < mt->n_buckets && !(v <= mt->buckets[i])) {
                i++;
            }
            s->counts[i]++;
            s->sum += v;
            s->count++;
            break;
        }
        }
    }
    pthread_mutex_unlock(&mt->owner->mu);
    if (values != values_buf) {
        free(values);
    }
}

void tally_metric_add(tally_metric_t *mt, double v, ...)
{
    /* A counter only goes up: a negative add would read as a counter reset to Prometheus. */
    if (mt == NULL || mt->type == METRIC_HISTOGRAM || (mt->type == METRIC_COUNTER && v < 0)) {
        return;
    }
    va_list ap;
    va_start(ap, v);
    update(mt, OP_ADD, v, ap);
    va_end(ap);
}

void tally_metric_set(tally_metric_t *mt, double v, ...)
{
    if (mt == NULL || mt->type != METRIC_GAUGE) {
        return;
    }
    va_list ap;
    va_start(ap, v);
    update(mt, OP_SET, v, ap);
    va_end(ap);
}

void tally_metric_observe(tally_metric_t *mt, double v, ...)
{
    if (mt == NULL || mt->type != METRIC_HISTOGRAM) {
        return;
    }
    va_list ap;
    va_start(ap, v);
    update(mt, OP_OBSERVE, v, ap);
    va_end(ap);
}

void tally_metric_reset(tally_metric_t *mt)
{
    if (mt == NULL) {
        return;
    }
    pthread_mutex_lock(&mt->owner->mu);
    for (size_t i = 0; i < mt->n_series; i++) {
        series_t *s = mt->series[i];
        s->value = 0;
        s->sum = 0;
        s->count = 0;
        if (s->counts != NULL) {
            memset(s->counts, 0, (mt->n_buckets + 1) * sizeof *s->counts);
        }
    }
    pthread_mutex_unlock(&mt->owner->mu);
}

/* A growing text buffer with a sticky failure flag, checked once at the end. */
typedef struct buf {
    char *data;
    size_t len;
    size_t cap;
    bool failed;
} buf_t;

static void buf_reserve(buf_t *b, size_t more)
{
    if (b->failed || b->len + more + 1 <= b->cap) {
        return;
    }
    size_t cap = b->cap != 0 ? b->cap : 1024;
    while (cap < b->len + more + 1) {
        cap *= 2;
    }
    char *grown = realloc(b->data, cap);
    if (grown == NULL) {
        b->failed = true;
        return;
    }
    b->data = grown;
    b->cap = cap;
    b->data[b->len] = '\0';
}

static void buf_putn(buf_t *b, const char *s, size_t n)
{
    buf_reserve(b, n);
    if (b->failed) {
        return;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void buf_puts(buf_t *b, const char *s)
{
    buf_putn(b, s, strlen(s));
}

static void buf_putc(buf_t *b, char c)
{
    buf_putn(b, &c, 1);
}

/* HELP text escapes backslash and newline; label values also escape the double quote. */
static void buf_escaped(buf_t *b, const char *s, bool quote)
{
    for (; *s != '\0'; s++) {
        switch (*s) {
        case '\\':
            buf_puts(b, "\\\\");
            break;
        case '\n':
            buf_puts(b, "\\n");
            break;
        case '"':
            buf_puts(b, quote ? "\\\"" : "\"");
            break;
        default:
            buf_putc(b, *s);
        }
    }
}

/* The shortest decimal that reads back as the same double; integers without exponent. */
static void format_double(double v, char *out, size_t outsz)
{
    if (isnan(v)) {
        snprintf(out, outsz, "NaN");
        return;
    }
    if (isinf(v)) {
        snprintf(out, outsz, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    if (v == floor(v) && fabs(v) < 1e15) {
        snprintf(out, outsz, "%.0f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(out, outsz, "%.*g", prec, v);
        if (strtod(out, NULL) == v) {
            return;
        }
    }
}

static void buf_double(buf_t *b, double v)
{
    char num[64];
    format_double(v, num, sizeof num);
    buf_puts(b, num);
}

static void buf_u64(buf_t *b, uint64_t v)
{
    char num[32];
    snprintf(num, sizeof num, "%llu", (unsigned long long)v);
    buf_puts(b, num);
}

/* {a="x",b="y"} plus an optional le="...", or nothing when there are no labels at all. */
static void buf_labels(buf_t *b, const tally_metric_t *mt, const series_t *s, const char *le)
{
    if (mt->n_labels == 0 && le == NULL) {
        return;
    }
    buf_putc(b, '{');
    for (size_t i = 0; i < mt->n_labels; i++) {
        if (i > 0) {
            buf_putc(b, ',');
        }
        buf_puts(b, mt->labels[i]);
        buf_puts(b, "=\"");
        buf_escaped(b, s->values[i], true);
        buf_putc(b, '"');
    }
    if (le != NULL) {
        if (mt->n_labels > 0) {
            buf_putc(b, ',');
        }
        buf_puts(b, "le=\"");
        buf_puts(b, le);
        buf_putc(b, '"');
    }
    buf_putc(b, '}');
}

static void render_family(buf_t *b, const tally_metric_t *mt)
{
    static const char *const type_names[] = {"counter", "gauge", "histogram"};
    buf_puts(b, "# HELP ");
    buf_puts(b, mt->name);
    buf_putc(b, ' ');
    buf_escaped(b, mt->help, false);
    buf_puts(b, "\n# TYPE ");
    buf_puts(b, mt->name);
    buf_putc(b, ' ');
    buf_puts(b, type_names[mt->type]);
    buf_putc(b, '\n');
    for (size_t i = 0; i < mt->n_series; i++) {
        const series_t *s = mt->series[i];
        if (mt->type != METRIC_HISTOGRAM) {
            buf_puts(b, mt->name);
            buf_labels(b, mt, s, NULL);
            buf_putc(b, ' ');
            buf_double(b, s->value);
            buf_putc(b, '\n');
            continue;
        }
        uint64_t cumulative = 0;
        for (size_t k = 0; k <= mt->n_buckets; k++) {
            char le[64];
            if (k < mt->n_buckets) {
                format_double(mt->buckets[k], le, sizeof le);
            } else {
                snprintf(le, sizeof le, "+Inf");
            }
            cumulative += s->counts[k];
            buf_puts(b, mt->name);
            buf_puts(b, "_bucket");
            buf_labels(b, mt, s, le);
            buf_putc(b, ' ');
            buf_u64(b, cumulative);
            buf_putc(b, '\n');
        }
        buf_puts(b, mt->name);
        buf_puts(b, "_sum");
        buf_labels(b, mt, s, NULL);
        buf_putc(b, ' ');
        buf_double(b, s->sum);
        buf_putc(b, '\n');
        buf_puts(b, mt->name);
        buf_puts(b, "_count");
        buf_labels(b, mt, s, NULL);
        buf_putc(b, ' ');
        buf_u64(b, s->count);
        buf_putc(b, '\n');
    }
}

void tally_metrics_on_render(tally_metrics_t *m, void (*collect)(void *opaque), void *opaque)
{
    m->collect = collect;
    m->collect_opaque = opaque;
}

char *tally_metrics_render(tally_metrics_t *m)
{
    if (m == NULL) {
        return NULL;
    }
    if (m->collect != NULL) {
        m->collect(m->collect_opaque); /* before the lock: it sets gauges, which take it */
    }
    buf_t b = {0};
    buf_reserve(&b, 0);
    pthread_mutex_lock(&m->mu);
    for (const tally_metric_t *mt = m->head; mt != NULL; mt = mt->next) {
        render_family(&b, mt);
    }
    pthread_mutex_unlock(&m->mu);
    if (b.failed) {
        free(b.data);
        return NULL;
    }
    return b.data;
}
