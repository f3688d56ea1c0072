/* dev_proc.c — the child processes of `tally dev` (dev.h): spawning them safely next to the
 * mock cluster's threads, waiting for them, and the small helpers the other dev_*.c files use. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dev.h"

extern char **environ;

void dev_say(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tally dev: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

void dev_err(char *errstr, size_t errsz, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errstr, errsz, fmt, ap);
    va_end(ap);
}

long long dev_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void dev_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int dev_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(sa);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 &&
        getsockname(fd, (struct sockaddr *)&sa, &len) == 0)
        port = ntohs(sa.sin_port);
    close(fd);
    return port;
}

bool dev_is_executable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

void dev_tail_file(const char *path, int max_lines)
{
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return;
    char *lines[64] = {0};
    if (max_lines > 64)
        max_lines = 64;
    int n = 0;
    char buf[1024];
    while (fgets(buf, sizeof(buf), f) != NULL) {
        free(lines[n % max_lines]);
        lines[n % max_lines] = strdup(buf);
        n++;
    }
    fclose(f);
    int first = n > max_lines ? n - max_lines : 0;
    if (n > 0)
        fprintf(stderr, "---- last lines of %s ----\n", path);
    for (int i = first; i < n; i++) {
        const char *l = lines[i % max_lines];
        if (l != NULL)
            fprintf(stderr, "  %s%s", l, l[0] != '\0' && l[strlen(l) - 1] == '\n' ? "" : "\n");
    }
    for (int i = 0; i < max_lines; i++)
        free(lines[i]);
}

void dev_describe_status(int status, char *out, size_t outsz)
{
    if (WIFEXITED(status))
        snprintf(out, outsz, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(out, outsz, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(out, outsz, "stopped (status 0x%x)", (unsigned)status);
}

/* Recursive removal without following symlinks (nftw callback). */
static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st;
    (void)flag;
    (void)ftw;
    if (remove(path) != 0 && errno != ENOENT)
        dev_say("could not remove %s: %s", path, strerror(errno));
    return 0;
}

void dev_remove_tree(const char *dir)
{
    nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* ---- child processes ---------------------------------------------------------------------- */

static void child_fail(int errfd, int err)
{
    ssize_t w = write(errfd, &err, sizeof(err));
    (void)w;
    _exit(127);
}

pid_t dev_spawn(const dev_stack_t *s, const dev_spawn_t *sp, char *errstr, size_t errsz)
{
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) != 0) {
        dev_err(errstr, errsz, "pipe: %s", strerror(errno));
        return -1;
    }
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        dev_err(errstr, errsz, "fork: %s", strerror(errno));
        close(pipefd[0]);
        close(pipefd[1]);
        return -1;
    }
    if (pid == 0) {
        close(pipefd[0]);
        if (sp->new_session ? setsid() < 0 : setpgid(0, 0) != 0)
            child_fail(pipefd[1], errno);
        struct sigaction dfl = {.sa_handler = SIG_DFL};
        sigaction(SIGPIPE, &dfl, NULL);
        int devnull = open("/dev/null", O_RDONLY);
        if (devnull < 0 || dup2(devnull, STDIN_FILENO) < 0)
            child_fail(pipefd[1], errno);
        if (devnull > STDERR_FILENO)
            close(devnull);
        if (sp->out_fd >= 0 &&
            (dup2(sp->out_fd, STDOUT_FILENO) < 0 || dup2(sp->out_fd, STDERR_FILENO) < 0))
            child_fail(pipefd[1], errno);
        if (sp->out_fd < 0 && dup2(STDERR_FILENO, STDOUT_FILENO) < 0)
            child_fail(pipefd[1], errno);
        if (sp->as_postgres) {
            if (setgroups((size_t)s->pg_ngroups, s->pg_groups) != 0 || setgid(s->pg_gid) != 0 ||
                setuid(s->pg_uid) != 0)
                child_fail(pipefd[1], errno);
        }
        /* after setuid: changing credentials clears the parent-death signal */
        if (sp->pdeath_signal != 0 && prctl(PR_SET_PDEATHSIG, sp->pdeath_signal) != 0)
            child_fail(pipefd[1], errno);
        if (getppid() != parent)
            _exit(1); /* tally dev died before the parent-death signal was armed */
        if (sp->cwd != NULL && chdir(sp->cwd) != 0)
            child_fail(pipefd[1], errno);
        /* nothing of ours (mock broker sockets, libpq, log files) leaks into the program */
        if (close_range(STDERR_FILENO + 1, ~0U, CLOSE_RANGE_CLOEXEC) != 0)
            for (int fd = STDERR_FILENO + 1; fd < 4096; fd++)
                fcntl(fd, F_SETFD, FD_CLOEXEC);
        execve(sp->path, sp->argv, sp->envp);
        child_fail(pipefd[1], errno);
    }
    close(pipefd[1]);
    int child_errno = 0;
    ssize_t n;
    do {
        n = read(pipefd[0], &child_errno, sizeof(child_errno));
    } while (n < 0 && errno == EINTR);
    close(pipefd[0]);
    if (n == (ssize_t)sizeof(child_errno)) {
        int st;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
            ;
        dev_err(errstr, errsz, "cannot run %s%s: %s", sp->path,
                sp->as_postgres ? " as user postgres" : "", strerror(child_errno));
        return -1;
    }
    return pid;
}

bool dev_wait_child(pid_t pid, int timeout_ms, int *status)
{
    long long deadline = timeout_ms < 0 ? -1 : dev_now_ms() + timeout_ms;
    for (;;) {
        pid_t r = waitpid(pid, status, WNOHANG);
        if (r == pid)
            return true;
        if (r < 0 && errno != EINTR)
            return true; /* not our child any more: nothing to wait for */
        if (deadline >= 0 && dev_now_ms() >= deadline)
            return false;
        dev_sleep_ms(20);
    }
}

bool dev_run_logged(const dev_stack_t *s, char *const *argv, const char *log_path, bool as_postgres,
                    int timeout_ms, char *errstr, size_t errsz)
{
    int fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) {
        dev_err(errstr, errsz, "cannot open %s: %s", log_path, strerror(errno));
        return false;
    }
    dev_spawn_t sp = {.path = argv[0],
                      .argv = argv,
                      .envp = environ,
                      .out_fd = fd,
                      .cwd = s->dir[0] != '\0' ? s->dir : NULL,
                      .as_postgres = as_postgres,
                      .pdeath_signal = SIGKILL};
    pid_t pid = dev_spawn(s, &sp, errstr, errsz);
    close(fd);
    if (pid < 0)
        return false;
    int status = 0;
    if (!dev_wait_child(pid, timeout_ms, &status)) {
        kill(-pid, SIGKILL);
        dev_wait_child(pid, -1, &status);
        dev_err(errstr, errsz, "%s did not finish within %d s (its output: %s)", argv[0],
                timeout_ms / 1000, log_path);
        return false;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        char how[128];
        dev_describe_status(status, how, sizeof(how));
        dev_err(errstr, errsz, "%s %s (its output: %s)", argv[0], how, log_path);
        return false;
    }
    return true;
}
