/* test_metrics.c — the Prometheus text exposition (format 0.0.4) and thread safety. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/metrics.h"

static void assert_render(tally_metrics_t *m, const char *expected)
{
    char *text = tally_metrics_render(m);
    assert_non_null(text);
    assert_string_equal(text, expected);
    free(text);
}

static void test_empty_registry_renders_nothing(void **st)
{
    (void)st;
    tally_metrics_t *m = tally_metrics_new();
    assert_non_null(m);
    assert_render(m, "");
    tally_metrics_free(m);
}

static void test_counter_and_gauge_without_labels(void **st)
{
    (void)st;
    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *c = tally_metrics_counter(m, "tally_ticks_total", "Loop turns", NULL);
    tally_metric_t *g = tally_metrics_gauge(m, "tally_backlog", "Outbox rows", NULL);
    tally_metric_add(c, 1);
    tally_metric_add(c, 2);
    tally_metric_add(c, -5); /* ignored: counters never go down */
    tally_metric_set(g, 7);
    tally_metric_add(g, -2.5);
    assert_render(m, "# HELP tally_ticks_total Loop turns\n"
                     "# TYPE tally_ticks_total counter\n"
                     "tally_ticks_total 3\n"
                     "# HELP tally_backlog Outbox rows\n"
                     "# TYPE tally_backlog gauge\n"
                     "tally_backlog 4.5\n");
    tally_metrics_free(m);
}

static void test_declared_family_without_series_has_only_header(void **st)
{
    (void)st;
    tally_metrics_t *m = tally_metrics_new();
    (void)tally_metrics_counter(m, "tally_effects_total", "Effects", "tool,state");
    assert_render(m, "# HELP tally_effects_total Effects\n"
                     "# TYPE tally_effects_total counter\n");
    tally_metrics_free(m);
}

/* rate() and increase() only see the first failure if the series existed before it. */
static void test_label_less_families_start_at_zero(void **st)
{
    (void)st;
    tally_metrics_t *m = tally_metrics_new();
    assert_non_null(tally_metrics_counter(m, "tally_relay_failures_total", "Failures", NULL));
    assert_non_null(tally_metrics_gauge(m, "tally_outbox_backlog", "Rows", NULL));
    assert_render(m, "# HELP tally_relay_failures_total Failures\n"
                     "# TYPE tally_relay_failures_total counter\n"
                     "tally_relay_failures_total 0\n"
                     "# HELP tally_outbox_backlog Rows\n"
                     "# TYPE tally_outbox_backlog gauge\n"
                     "tally_outbox_backlog 0\n");
    tally_metrics_free(m);
}

static void test_redeclaring_returns_the_first(void **st)
{
    (void)st;
    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *a = tally_metrics_counter(m, "tally_x_total", "first", "tool");
    tally_metric_t *b = tally_metrics_counter(m, "tally_x_total", "second", NULL);
    assert_ptr_equal(a, b);
    tally_metric_add(b, 1, "t");
    assert_render(m, "# HELP tally_x_total first\n"
                     "# TYPE tally_x_total counter\n"
                     "tally_x_total{tool=\"t\"} 1\n");
    tally_metrics_free(m);
}

static void test_series_sorted_and_families_in_declaration_order(void **st)
{
    (void)st;
    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *z = tally_metrics_gauge(m, "tally_z", "declared first", "tool, state");
    tally_metric_t *a = tally_metrics_counter(m, "tally_a_total", "declared second", NULL);
    tally_metric_set(z, 1, "refund", "UNKNOWN");
    tally_metric_set(z, 2, "charge", "PLANNED");
    tally_metric_set(z, 3, "refund", "CONFIRMED");
    tally_metric_set(z, 4, "charge", "CONFIRMED");
    tally_metric_add(a, 0.25);
    assert_render(m, "# HELP tally_z declared first\n"
                     "# TYPE tally_z gauge\n"
                     "tally_z{tool=\"charge\",state=\"CONFIRMED\"} 4\n"
                     "tally_z{tool=\"charge\",state=\"PLANNED\"} 2\n"
                     "tally_z{tool=\"refund\",state=\"CONFIRMED\"} 3\n"
                     "tally_z{tool=\"refund\",state=\"UNKNOWN\"} 1\n"
                     "# HELP tally_a_total declared second\n"
                     "# TYPE tally_a_total counter\n"
                     "tally_a_total 0.25\n");
    tally_metric_reset(z);
    char *text = tally_metrics_render(m);
    assert_non_null(strstr(text, "tally_z{tool=\"charge\",state=\"CONFIRMED\"} 0\n"));
    assert_non_null(strstr(text, "tally_z{tool=\"refund\",state=\"UNKNOWN\"} 0\n"));
    free(text);
    tally_metrics_free(m);
}

static void test_label_values_and_help_are_escaped(void **st)
{
    (void)st;
    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *c = tally_metrics_counter(m, "tally_odd_total",
                                              "Help with \\ and\nnewline and \"quotes\"", "tool");
    tally_metric_add(c, 1, "a\\b\"c\nd");
    tally_metric_add(c, 1, (const char *)NULL); /* a NULL value is the empty string */
    assert_render(m, "# HELP tally_odd_total Help with \\\\ and\\nnewline and \"quotes\"\n"
                     "# TYPE tally_odd_total counter\n"
                     "tally_odd_total{tool=\"\"} 1\n"
                     "tally_odd_total{tool=\"a\\\\b\\\"c\\nd\"} 1\n");
    tally_metrics_free(m);
}

static void test_histogram_buckets_are_cumulative(void **st)
{
    (void)st;
    static const double buckets[] = {0.1, 0.5, 2.5};
    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *h =
        tally_metrics_histogram(m, "tally_call_seconds", "Connector latency", "tool", buckets, 3);
    tally_metric_observe(h, 0.05, "refund"); /* le 0.1 */
    tally_metric_observe(h, 0.1, "refund");  /* le 0.1: the bound is inclusive */
    tally_metric_observe(h, 0.3, "refund");  /* le 0.5 */
    tally_metric_observe(h, 7, "refund");    /* only +Inf */
    tally_metric_observe(h, 1, "charge");
    assert_render(m, "# HELP tally_call_seconds Connector latency\n"
                     "# TYPE tally_call_seconds histogram\n"
                     "tally_call_seconds_bucket{tool=\"charge\",le=\"0.1\"} 0\n"
                     "tally_call_seconds_bucket{tool=\"charge\",le=\"0.5\"} 0\n"
                     "tally_call_seconds_bucket{tool=\"charge\",le=\"2.5\"} 1\n"
                     "tally_call_seconds_bucket{tool=\"charge\",le=\"+Inf\"} 1\n"
                     "tally_call_seconds_sum{tool=\"charge\"} 1\n"
                     "tally_call_seconds_count{tool=\"charge\"} 1\n"
                     "tally_call_seconds_bucket{tool=\"refund\",le=\"0.1\"} 2\n"
                     "tally_call_seconds_bucket{tool=\"refund\",le=\"0.5\"} 3\n"
                     "tally_call_seconds_bucket{tool=\"refund\",le=\"2.5\"} 3\n"
                     "tally_call_seconds_bucket{tool=\"refund\",le=\"+Inf\"} 4\n"
                     "tally_call_seconds_sum{tool=\"refund\"} 7.45\n"
                     "tally_call_seconds_count{tool=\"refund\"} 4\n");
    tally_metrics_free(m);
}

static void test_latency_buckets_render_without_noise(void **st)
{
    (void)st;
    assert_int_equal(tally_n_latency_buckets, 14);
    assert_true(tally_latency_buckets[0] == 0.001);
    assert_true(tally_latency_buckets[13] == 30);
    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *h = tally_metrics_histogram(m, "tally_lat_seconds", "Latency", NULL,
                                                tally_latency_buckets, tally_n_latency_buckets);
    tally_metric_observe(h, 0.003);
    char *text = tally_metrics_render(m);
    assert_non_null(text);
    assert_non_null(strstr(text, "tally_lat_seconds_bucket{le=\"0.001\"} 0\n"
                                 "tally_lat_seconds_bucket{le=\"0.0025\"} 0\n"
                                 "tally_lat_seconds_bucket{le=\"0.005\"} 1\n"));
    assert_non_null(strstr(text, "tally_lat_seconds_bucket{le=\"30\"} 1\n"
                                 "tally_lat_seconds_bucket{le=\"+Inf\"} 1\n"
                                 "tally_lat_seconds_sum 0.003\n"
                                 "tally_lat_seconds_count 1\n"));
    free(text);
    tally_metrics_free(m);
}

#define THREADS    8
#define ITERATIONS 20000

typedef struct {
    tally_metric_t *counter;
    tally_metric_t *hist;
    tally_metrics_t *m;
    int index;
} worker_arg_t;

static void *hammer(void *p)
{
    worker_arg_t *a = p;
    char tool[16];
    for (int i = 0; i < ITERATIONS; i++) {
        /* Spread over a few series so several are created concurrently. */
        snprintf(tool, sizeof tool, "t%d", (i + a->index) % 5);
        tally_metric_add(a->counter, 1, tool);
        tally_metric_observe(a->hist, 0.01, tool);
        if (i % 5000 == 0) {
            free(tally_metrics_render(a->m)); /* rendering while others write */
        }
    }
    return NULL;
}

static void test_concurrent_updates_are_exact(void **st)
{
    (void)st;
    tally_metrics_t *m = tally_metrics_new();
    tally_metric_t *c = tally_metrics_counter(m, "tally_hits_total", "Hits", "tool");
    tally_metric_t *h = tally_metrics_histogram(m, "tally_hit_seconds", "Hit latency", "tool",
                                                tally_latency_buckets, tally_n_latency_buckets);
    pthread_t th[THREADS];
    worker_arg_t args[THREADS];
    for (int i = 0; i < THREADS; i++) {
        args[i] = (worker_arg_t){c, h, m, i};
        assert_int_equal(pthread_create(&th[i], NULL, hammer, &args[i]), 0);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
    }
    char *text = tally_metrics_render(m);
    assert_non_null(text);
    /* Sum every counter series and every histogram _count: both must be exact. */
    long long total = 0;
    long long count = 0;
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (strncmp(line, "tally_hits_total{", 17) == 0) {
            total += atoll(strrchr(line, ' ') + 1);
        } else if (strncmp(line, "tally_hit_seconds_count{", 24) == 0) {
            count += atoll(strrchr(line, ' ') + 1);
        }
    }
    assert_int_equal(total, (long long)THREADS * ITERATIONS);
    assert_int_equal(count, (long long)THREADS * ITERATIONS);
    free(text);
    tally_metrics_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_empty_registry_renders_nothing),
        cmocka_unit_test(test_counter_and_gauge_without_labels),
        cmocka_unit_test(test_declared_family_without_series_has_only_header),
        cmocka_unit_test(test_label_less_families_start_at_zero),
        cmocka_unit_test(test_redeclaring_returns_the_first),
        cmocka_unit_test(test_series_sorted_and_families_in_declaration_order),
        cmocka_unit_test(test_label_values_and_help_are_escaped),
        cmocka_unit_test(test_histogram_buckets_are_cumulative),
        cmocka_unit_test(test_latency_buckets_render_without_noise),
        cmocka_unit_test(test_concurrent_updates_are_exact),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
