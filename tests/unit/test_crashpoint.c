/* test_crashpoint.c — a crash point kills its process with SIGKILL only when it is the armed one,
 * on the armed hit, after one log line; TALLY_CRASH_AT is read once, at init. Each case runs in
 * a child process, since a case that works ends it. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tally/crashpoint.h"
#include "tally/log.h"

/* What a child run of one case did: its wait status and what it wrote on stderr. */
typedef struct child_run {
    int status;
    char err[4096];
} child_run_t;

/* Fork, set the environment (NULL: unset) and init in the child, run @p body, exit 0. */
static void in_child(const char *at, const char *after, void (*body)(void), child_run_t *out)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    fflush(stderr);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], STDERR_FILENO);
        unsetenv("TALLY_CRASH_AT");
        unsetenv("TALLY_CRASH_AFTER");
        if (at != NULL)
            setenv("TALLY_CRASH_AT", at, 1);
        if (after != NULL)
            setenv("TALLY_CRASH_AFTER", after, 1);
        tally_log_init("test", "test:1", TALLY_LOG_DEBUG);
        tally_crashpoint_init();
        body();
        fflush(stderr);
        _exit(0);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t r;
    while (n < sizeof out->err - 1 && (r = read(fds[0], out->err + n, sizeof out->err - 1 - n)) > 0)
        n += (size_t)r;
    out->err[n] = '\0';
    close(fds[0]);
    assert_int_equal(waitpid(pid, &out->status, 0), pid);
}

static bool killed(const child_run_t *run)
{
    return WIFSIGNALED(run->status) && WTERMSIG(run->status) == SIGKILL;
}

static bool exited_0(const child_run_t *run)
{
    return WIFEXITED(run->status) && WEXITSTATUS(run->status) == 0;
}

static void hit_once(void)
{
    TALLY_CRASHPOINT("dispatch.after_claim_commit");
}

static void hit_twice_then_mark_then_hit(void)
{
    TALLY_CRASHPOINT("dispatch.after_claim_commit");
    TALLY_CRASHPOINT("dispatch.after_claim_commit");
    fprintf(stderr, "survived two hits\n");
    TALLY_CRASHPOINT("dispatch.after_claim_commit");
}

static void arm_after_init_then_hit(void)
{
    setenv("TALLY_CRASH_AT", "dispatch.after_claim_commit", 1);
    TALLY_CRASHPOINT("dispatch.after_claim_commit");
}

static void test_unarmed_is_a_no_op(void **state)
{
    (void)state;
    child_run_t run;
    in_child(NULL, NULL, hit_once, &run);
    assert_true(exited_0(&run));
    assert_null(strstr(run.err, "crash point"));
    in_child("", NULL, hit_once, &run);
    assert_true(exited_0(&run));
}

static void test_another_point_is_a_no_op(void **state)
{
    (void)state;
    child_run_t run;
    in_child("dispatch.after_record_commit", NULL, hit_once, &run);
    assert_true(exited_0(&run));
    assert_non_null(strstr(run.err, "crash point dispatch.after_record_commit armed"));
    assert_null(strstr(run.err, "raising SIGKILL"));
}

static void test_the_armed_point_logs_one_line_and_sigkills(void **state)
{
    (void)state;
    child_run_t run;
    in_child("dispatch.after_claim_commit", NULL, hit_once, &run);
    assert_true(killed(&run));
    const char *line = strstr(run.err, "crash point dispatch.after_claim_commit reached (hit 1)");
    assert_non_null(line);
    assert_null(strstr(line + 1, "crash point dispatch.after_claim_commit reached"));
    assert_non_null(strstr(run.err, "\"func\":\"hit_once\""));
    assert_non_null(strstr(run.err, "\"level\":\"error\""));
}

static void test_crash_after_counts_hits(void **state)
{
    (void)state;
    child_run_t run;
    in_child("dispatch.after_claim_commit", "3", hit_twice_then_mark_then_hit, &run);
    assert_true(killed(&run));
    assert_non_null(strstr(run.err, "survived two hits"));
    assert_non_null(strstr(run.err, "reached (hit 3)"));
    /* not a positive integer: the first hit */
    in_child("dispatch.after_claim_commit", "0", hit_twice_then_mark_then_hit, &run);
    assert_true(killed(&run));
    assert_null(strstr(run.err, "survived two hits"));
    assert_non_null(strstr(run.err, "TALLY_CRASH_AFTER=0 is not a positive integer"));
}

static void test_the_environment_is_read_once_at_init(void **state)
{
    (void)state;
    child_run_t run;
    in_child(NULL, NULL, arm_after_init_then_hit, &run);
    assert_true(exited_0(&run));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unarmed_is_a_no_op),
        cmocka_unit_test(test_another_point_is_a_no_op),
        cmocka_unit_test(test_the_armed_point_logs_one_line_and_sigkills),
        cmocka_unit_test(test_crash_after_counts_hits),
        cmocka_unit_test(test_the_environment_is_read_once_at_init),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
