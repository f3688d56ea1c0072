/* test_id.c — ids are well-formed RFC 9562 UUIDs (version 4 random, version 7 time-ordered)
 * and never repeat: not across 100,000 of them, not across threads, not between a process and
 * the child it forks (which starts with a copy of its parent's memory). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tally/id.h"

typedef char uuid_text_t[37];

static const char HEX[] = "0123456789abcdef";

static void assert_well_formed(const char *u, char version)
{
    assert_int_equal(strlen(u), 36);
    for (int j = 0; j < 36; j++) {
        if (j == 8 || j == 13 || j == 18 || j == 23)
            assert_int_equal(u[j], '-');
        else
            assert_non_null(strchr(HEX, u[j]));
    }
    assert_int_equal(u[14], version);
    assert_non_null(strchr("89ab", u[19])); /* RFC 9562 variant: 10xx */
}

static int cmp_id(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

/* Sorts @p ids and fails on the first two that are equal. */
static void assert_all_distinct(uuid_text_t *ids, size_t n)
{
    qsort(ids, n, sizeof *ids, cmp_id);
    for (size_t i = 1; i < n; i++)
        if (strcmp(ids[i - 1], ids[i]) == 0)
            fail_msg("id %s made twice", ids[i]);
}

static unsigned long long now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000ULL + (unsigned long long)ts.tv_nsec / 1000000ULL;
}

enum { MANY = 100000 };

static void test_many_random_ids_are_well_formed_and_distinct(void **st)
{
    (void)st;
    uuid_text_t *ids = calloc(MANY, sizeof *ids);
    assert_non_null(ids);
    unsigned seen[36] = {0}; /* per place, a bit for each hex digit that appeared there */
    for (size_t i = 0; i < MANY; i++) {
        tally_uuid(ids[i]);
        assert_well_formed(ids[i], '4');
        for (int j = 0; j < 36; j++)
            if (ids[i][j] != '-')
                seen[j] |= 1u << (strchr(HEX, ids[i][j]) - HEX);
    }
    /* The random places take every digit (a missing one in 100,000 draws would be a bit stuck
     * at 0 or 1); the variant's place takes exactly 8, 9, a and b. */
    for (int j = 0; j < 36; j++) {
        if (j == 8 || j == 13 || j == 14 || j == 18 || j == 23)
            continue;
        assert_int_equal(seen[j], j == 19 ? 0x0f00u : 0xffffu);
    }
    assert_all_distinct(ids, MANY);
    free(ids);
}

static void test_many_time_ordered_ids_carry_the_time_and_are_distinct(void **st)
{
    (void)st;
    uuid_text_t *ids = calloc(MANY, sizeof *ids);
    assert_non_null(ids);
    unsigned long long before = now_ms();
    for (size_t i = 0; i < MANY; i++)
        tally_uuid_v7(ids[i]);
    unsigned long long after = now_ms();
    for (size_t i = 0; i < MANY; i++) {
        assert_well_formed(ids[i], '7');
        char hex[13];
        memcpy(hex, ids[i], 8);
        memcpy(hex + 8, ids[i] + 9, 4);
        hex[12] = '\0';
        unsigned long long ms = strtoull(hex, NULL, 16);
        assert_in_range(ms, before, after);
        if (i > 0) /* ids of a later millisecond sort after */
            assert_true(memcmp(ids[i - 1], ids[i], 13) <= 0);
    }
    assert_all_distinct(ids, MANY);
    free(ids);
}

enum { THREADS = 4, PER_THREAD = 20000 };

static void *make_ids(void *arg)
{
    uuid_text_t *ids = arg;
    for (int i = 0; i < PER_THREAD; i++) {
        if (i % 2)
            tally_uuid(ids[i]);
        else
            tally_uuid_v7(ids[i]);
    }
    return NULL;
}

static void test_threads_make_distinct_ids(void **st)
{
    (void)st;
    uuid_text_t *ids = calloc(THREADS * PER_THREAD, sizeof *ids);
    assert_non_null(ids);
    pthread_t t[THREADS];
    for (int k = 0; k < THREADS; k++)
        assert_int_equal(pthread_create(&t[k], NULL, make_ids, ids + k * PER_THREAD), 0);
    for (int k = 0; k < THREADS; k++)
        assert_int_equal(pthread_join(t[k], NULL), 0);
    for (int i = 0; i < THREADS * PER_THREAD; i++)
        assert_well_formed(ids[i], i % 2 ? '4' : '7');
    assert_all_distinct(ids, THREADS * PER_THREAD);
    free(ids);
}

enum { AFTER_FORK = 32 };

static void test_a_forked_child_does_not_repeat_its_parents_ids(void **st)
{
    (void)st;
    uuid_text_t ids[2 * AFTER_FORK + 1];
    tally_uuid(ids[2 * AFTER_FORK]); /* the parent's pool now holds bytes the child copies */
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        uuid_text_t mine[AFTER_FORK];
        for (int i = 0; i < AFTER_FORK; i++)
            tally_uuid(mine[i]);
        ssize_t w = write(fds[1], mine, sizeof mine);
        _exit(w == (ssize_t)sizeof mine ? 0 : 1);
    }
    close(fds[1]);
    for (int i = 0; i < AFTER_FORK; i++)
        tally_uuid(ids[i]);
    size_t got = 0;
    while (got < AFTER_FORK * sizeof ids[0]) {
        ssize_t r = read(fds[0], (char *)ids[AFTER_FORK] + got, AFTER_FORK * sizeof ids[0] - got);
        assert_true(r > 0);
        got += (size_t)r;
    }
    close(fds[0]);
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    for (int i = 0; i < 2 * AFTER_FORK + 1; i++)
        assert_well_formed(ids[i], '4');
    assert_all_distinct(ids, 2 * AFTER_FORK + 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_random_ids_are_well_formed_and_distinct),
        cmocka_unit_test(test_many_time_ordered_ids_carry_the_time_and_are_distinct),
        cmocka_unit_test(test_threads_make_distinct_ids),
        cmocka_unit_test(test_a_forked_child_does_not_repeat_its_parents_ids),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
