/* test_consume.c — the consumer side every worker shares (consume.h), against librdkafka's
 * in-process mock cluster: the pipe becomes readable when messages arrive, offsets are
 * stored only when the round says so (the highest per partition), forgotten ones never
 * reach the group, and a message read with next counts only once noted. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>

#include "tally/consume.h"

#define TOPIC "tally.test.wakeups"

typedef struct fixture {
    rd_kafka_t *producer; /* owns the mock cluster */
    rd_kafka_t *consumer;
    tally_consume_t *cs;
} fixture_t;

static void set(rd_kafka_conf_t *conf, const char *name, const char *value)
{
    char errstr[256];
    if (rd_kafka_conf_set(conf, name, value, errstr, sizeof errstr) != RD_KAFKA_CONF_OK)
        fail_msg("%s: %s", name, errstr);
}

static void produce(fixture_t *f, int partition, int n)
{
    for (int i = 0; i < n; i++) {
        char payload[64];
        snprintf(payload, sizeof payload, "{\"type\":\"wake\",\"n\":%d}", i);
        assert_int_equal(
            rd_kafka_producev(f->producer, RD_KAFKA_V_TOPIC(TOPIC), RD_KAFKA_V_PARTITION(partition),
                              RD_KAFKA_V_VALUE(payload, strlen(payload)),
                              RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_END),
            RD_KAFKA_RESP_ERR_NO_ERROR);
    }
    assert_int_equal(rd_kafka_flush(f->producer, 10000), RD_KAFKA_RESP_ERR_NO_ERROR);
}

static int setup(void **state)
{
    static fixture_t f;
    memset(&f, 0, sizeof f);
    char errstr[512];
    rd_kafka_conf_t *pconf = rd_kafka_conf_new();
    set(pconf, "test.mock.num.brokers", "1");
    set(pconf, "log_level", "3");
    f.producer = rd_kafka_new(RD_KAFKA_PRODUCER, pconf, errstr, sizeof errstr);
    assert_non_null(f.producer);
    rd_kafka_mock_cluster_t *mc = rd_kafka_handle_mock_cluster(f.producer);
    assert_non_null(mc);
    assert_int_equal(rd_kafka_mock_topic_create(mc, TOPIC, 2, 1), RD_KAFKA_RESP_ERR_NO_ERROR);

    rd_kafka_conf_t *cconf = rd_kafka_conf_new();
    set(cconf, "bootstrap.servers", rd_kafka_mock_cluster_bootstraps(mc));
    set(cconf, "group.id", "test-consume");
    set(cconf, "enable.auto.offset.store", "false");
    set(cconf, "enable.auto.commit", "false");
    set(cconf, "auto.offset.reset", "earliest");
    set(cconf, "log_level", "3");
    f.consumer = rd_kafka_new(RD_KAFKA_CONSUMER, cconf, errstr, sizeof errstr);
    assert_non_null(f.consumer);
    rd_kafka_poll_set_consumer(f.consumer);
    rd_kafka_topic_partition_list_t *subs = rd_kafka_topic_partition_list_new(1);
    rd_kafka_topic_partition_list_add(subs, TOPIC, RD_KAFKA_PARTITION_UA);
    assert_int_equal(rd_kafka_subscribe(f.consumer, subs), RD_KAFKA_RESP_ERR_NO_ERROR);
    rd_kafka_topic_partition_list_destroy(subs);
    f.cs = tally_consume_new(f.consumer, errstr, sizeof errstr);
    assert_non_null(f.cs);
    *state = &f;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *f = *state;
    tally_consume_free(f->cs);
    rd_kafka_consumer_close(f->consumer);
    rd_kafka_destroy(f->consumer);
    rd_kafka_destroy(f->producer);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void count(void *opaque, const rd_kafka_message_t *msg)
{
    (void)msg;
    (*(int *)opaque)++;
}

/* Wait on the pipe, as a worker's loop does, and read wake-ups until @p want have come. */
static int read_until(fixture_t *f, int want)
{
    int seen = 0;
    double deadline = now_s() + 60;
    while (seen < want && now_s() < deadline) {
        struct pollfd pfd = {.fd = tally_consume_fd(f->cs), .events = POLLIN};
        if (!tally_consume_ready(f->cs))
            (void)poll(&pfd, 1, 200);
        int n = tally_consume_wakeups(f->cs, 2, count, &seen);
        assert_true(n >= 0 && n <= 2);
    }
    return seen;
}

/* The committed offset of @p partition in the group, -1001 (RD_KAFKA_OFFSET_INVALID) for none. */
static int64_t committed(fixture_t *f, int partition)
{
    rd_kafka_topic_partition_list_t *l = rd_kafka_topic_partition_list_new(1);
    rd_kafka_topic_partition_list_add(l, TOPIC, partition);
    assert_int_equal(rd_kafka_committed(f->consumer, l, 10000), RD_KAFKA_RESP_ERR_NO_ERROR);
    int64_t off = l->elems[0].offset;
    rd_kafka_topic_partition_list_destroy(l);
    return off;
}

static void commit(fixture_t *f)
{
    rd_kafka_resp_err_t e = rd_kafka_commit(f->consumer, NULL, 0);
    assert_true(e == RD_KAFKA_RESP_ERR_NO_ERROR || e == RD_KAFKA_RESP_ERR__NO_OFFSET);
}

static void test_offsets_are_stored_only_after_the_round(void **state)
{
    fixture_t *f = *state;
    produce(f, 0, 3);
    produce(f, 1, 2);
    assert_int_equal(read_until(f, 5), 5);
    assert_int_equal(tally_consume_noted(f->cs), 2); /* one entry per partition */
    /* read, noted, not stored: the group has nothing yet */
    commit(f);
    assert_int_equal(committed(f, 0), RD_KAFKA_OFFSET_INVALID);
    /* the round committed: the next offset to read, per partition */
    tally_consume_store(f->cs);
    assert_int_equal(tally_consume_noted(f->cs), 0);
    commit(f);
    assert_int_equal(committed(f, 0), 3);
    assert_int_equal(committed(f, 1), 2);
}

static void test_forgotten_offsets_never_reach_the_group(void **state)
{
    fixture_t *f = *state;
    produce(f, 0, 1);
    assert_int_equal(read_until(f, 1), 1);
    assert_int_equal(tally_consume_noted(f->cs), 1);
    tally_consume_forget(f->cs);
    assert_int_equal(tally_consume_noted(f->cs), 0);
    tally_consume_store(f->cs); /* nothing to store */
    commit(f);
    assert_int_equal(committed(f, 0), 3);
}

static void test_a_message_taken_with_next_counts_once_noted(void **state)
{
    fixture_t *f = *state;
    produce(f, 0, 1);
    rd_kafka_message_t *msg = NULL;
    double deadline = now_s() + 60;
    while (msg == NULL && now_s() < deadline) {
        struct pollfd pfd = {.fd = tally_consume_fd(f->cs), .events = POLLIN};
        if (!tally_consume_ready(f->cs))
            (void)poll(&pfd, 1, 200);
        msg = tally_consume_next(f->cs);
    }
    assert_non_null(msg);
    assert_int_equal(msg->partition, 0);
    assert_int_equal(msg->offset, 4); /* after the forgotten one, which is not read again */
    tally_consume_store(f->cs);       /* not noted yet: nothing */
    commit(f);
    assert_int_equal(committed(f, 0), 3);
    tally_consume_note(f->cs, msg);
    rd_kafka_message_destroy(msg);
    tally_consume_store(f->cs);
    commit(f);
    assert_int_equal(committed(f, 0), 5);
    /* nothing queued: serving while draining takes nothing and stores nothing */
    tally_consume_serve(f->cs);
    assert_int_equal(tally_consume_noted(f->cs), 0);
}

static void test_a_client_without_a_consumer_queue_is_refused(void **state)
{
    (void)state;
    char errstr[256] = "";
    assert_null(tally_consume_new(NULL, errstr, sizeof errstr));
    assert_true(errstr[0] != '\0');
    tally_consume_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_offsets_are_stored_only_after_the_round),
        cmocka_unit_test(test_forgotten_offsets_never_reach_the_group),
        cmocka_unit_test(test_a_message_taken_with_next_counts_once_noted),
        cmocka_unit_test(test_a_client_without_a_consumer_queue_is_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
