/* notify.c — systemd's service notifications without libsystemd (see notify.h).
 *
 * The protocol is one datagram of NAME=value lines to $NOTIFY_SOCKET (sd_notify(3)); systemd
 * learns the sender's pid from the kernel (SO_PASSCRED on its side), which NotifyAccess=main
 * compares with the service's main pid. One socket is opened at start and kept. */
#include "tally/notify.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tally/log.h"

/* What the heartbeat sends: nothing, start-up extensions, then watchdog pings. */
typedef enum tally_notify_phase {
    TALLY_NOTIFY_STARTING,
    TALLY_NOTIFY_RUNNING, /* READY=1 sent; STOPPING=1 keeps pinging through the drain */
} tally_notify_phase_t;

struct tally_notify {
    int fd;
    struct sockaddr_un sa;
    socklen_t salen;
    char name[sizeof(((struct sockaddr_un *)0)->sun_path) + 1]; /* $NOTIFY_SOCKET, for logs */
    unsigned long long watchdog_usec;                           /* 0: off */
    long long interval_ms;                                      /* half the watchdog period */
    _Atomic long long due_ms; /* the next heartbeat at or after this sends; LLONG_MAX: never */
    _Atomic int phase;        /* tally_notify_phase_t */
    atomic_bool warned;       /* a failed send was logged */
};

bool tally_notify_address(const char *value, struct sockaddr_un *sa, socklen_t *salen, char *errstr,
                          size_t errsz)
{
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    size_t n = value != NULL ? strlen(value) : 0;
    if (n < 2 || (value[0] != '/' && value[0] != '@')) {
        snprintf(errstr, errsz, "'%s' is neither a socket path nor an abstract socket '@name'",
                 value != NULL ? value : "");
        return false;
    }
    /* A path needs room for its NUL; an abstract name is counted by the length alone. */
    if (n + (value[0] == '/' ? 1 : 0) > sizeof sa->sun_path) {
        snprintf(errstr, errsz, "the socket name is %zu bytes long, more than %zu", n,
                 sizeof sa->sun_path - (value[0] == '/' ? 1 : 0));
        return false;
    }
    memcpy(sa->sun_path, value, n);
    if (value[0] == '@') {
        sa->sun_path[0] = '\0';
        *salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
    } else {
        *salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + 1);
    }
    return true;
}

/* A decimal number without sign, spaces or trailing bytes; false when it is not one. */
static bool parse_unsigned(const char *s, unsigned long long *out)
{
    if (s[0] < '0' || s[0] > '9') {
        return false;
    }
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0') {
        return false;
    }
    *out = v;
    return true;
}

unsigned long long tally_notify_watchdog_period(const char *usec, const char *pid, pid_t self,
                                                char *errstr, size_t errsz)
{
    errstr[0] = '\0';
    if (usec == NULL || usec[0] == '\0') {
        return 0;
    }
    unsigned long long period = 0;
    if (!parse_unsigned(usec, &period) || period == 0) {
        snprintf(errstr, errsz, "WATCHDOG_USEC='%s' is not a positive number of microseconds",
                 usec);
        return 0;
    }
    if (pid != NULL && pid[0] != '\0') {
        unsigned long long p = 0;
        if (!parse_unsigned(pid, &p) || p == 0) {
            snprintf(errstr, errsz, "WATCHDOG_PID='%s' is not a process id", pid);
            return 0;
        }
        if (p != (unsigned long long)self) {
            return 0; /* another process's watchdog (ours were inherited through an exec) */
        }
    }
    return period;
}

tally_notify_t *tally_notify_new(void)
{
    const char *value = getenv("NOTIFY_SOCKET");
    if (value == NULL || value[0] == '\0') {
        return NULL;
    }
    char errstr[256];
    tally_notify_t *n = calloc(1, sizeof *n);
    if (n == NULL) {
        TALLY_ERROR("out of memory setting up systemd notifications");
        return NULL;
    }
    n->fd = -1;
    if (!tally_notify_address(value, &n->sa, &n->salen, errstr, sizeof errstr)) {
        TALLY_WARN("NOTIFY_SOCKET: %s; not notifying systemd", errstr);
        free(n);
        return NULL;
    }
    snprintf(n->name, sizeof n->name, "%s", value);
    n->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (n->fd < 0) {
        TALLY_WARN("cannot open a socket to notify systemd on %s: %s", n->name, strerror(errno));
        free(n);
        return NULL;
    }
    n->watchdog_usec = tally_notify_watchdog_period(getenv("WATCHDOG_USEC"), getenv("WATCHDOG_PID"),
                                                    getpid(), errstr, sizeof errstr);
    if (errstr[0] != '\0') {
        TALLY_WARN("%s; not sending watchdog pings", errstr);
    }
    if (n->watchdog_usec > 0) {
        /* sd_watchdog_enabled(3): ping at least every half period. */
        n->interval_ms = (long long)(n->watchdog_usec / 2000);
        if (n->interval_ms < 1) {
            n->interval_ms = 1;
        }
        atomic_store(&n->due_ms, 0); /* the first heartbeat sends at once */
    } else {
        atomic_store(&n->due_ms, LLONG_MAX);
    }
    atomic_store(&n->phase, TALLY_NOTIFY_STARTING);
    atomic_store(&n->warned, false);
    TALLY_DEBUG("notifying systemd on %s (watchdog %llu us)", n->name, n->watchdog_usec);
    return n;
}

void tally_notify_free(tally_notify_t *n)
{
    if (n == NULL) {
        return;
    }
    if (n->fd >= 0) {
        close(n->fd);
    }
    free(n);
}

/* Failures are logged once and otherwise ignored: systemd not hearing is no reason for a
 * worker to stop working (the watchdog then restarts it, which is the point). */
static bool send_datagram(tally_notify_t *n, const char *msg)
{
    ssize_t r = sendto(n->fd, msg, strlen(msg), MSG_DONTWAIT | MSG_NOSIGNAL,
                       (const struct sockaddr *)&n->sa, n->salen);
    if (r == (ssize_t)strlen(msg)) {
        return true;
    }
    int e = r < 0 ? errno : EMSGSIZE;
    if (!atomic_exchange(&n->warned, true)) {
        TALLY_WARN("cannot notify systemd on %s (%s): %s; further failures are not logged", n->name,
                   msg, strerror(e));
    }
    return false;
}

bool tally_notify_send(tally_notify_t *n, const char *msg)
{
    return n == NULL || send_datagram(n, msg);
}

/* @p head, then "\nSTATUS=" and @p status when there is one, as one datagram. */
static void send_with_status(tally_notify_t *n, const char *head, const char *status)
{
    char msg[1024];
    if (status != NULL && status[0] != '\0') {
        snprintf(msg, sizeof msg, "%s\nSTATUS=%s", head, status);
    } else {
        snprintf(msg, sizeof msg, "%s", head);
    }
    send_datagram(n, msg);
}

void tally_notify_ready(tally_notify_t *n, const char *status)
{
    if (n == NULL) {
        return;
    }
    atomic_store(&n->phase, TALLY_NOTIFY_RUNNING);
    send_with_status(n, "READY=1", status);
}

void tally_notify_stopping(tally_notify_t *n, const char *status)
{
    if (n == NULL) {
        return;
    }
    send_with_status(n, "STOPPING=1", status);
}

void tally_notify_heartbeat(tally_notify_t *n, long long now_ms)
{
    if (n == NULL) {
        return;
    }
    long long due = atomic_load_explicit(&n->due_ms, memory_order_relaxed);
    if (now_ms < due) {
        return;
    }
    /* One thread wins the slot; the others return. */
    if (!atomic_compare_exchange_strong(&n->due_ms, &due, now_ms + n->interval_ms)) {
        return;
    }
    switch ((tally_notify_phase_t)atomic_load(&n->phase)) {
    case TALLY_NOTIFY_STARTING: {
        /* Each turn of start-up buys one more watchdog period beyond TimeoutStartSec=. */
        char msg[64];
        snprintf(msg, sizeof msg, "EXTEND_TIMEOUT_USEC=%llu", n->watchdog_usec);
        send_datagram(n, msg);
        break;
    }
    case TALLY_NOTIFY_RUNNING:
        send_datagram(n, "WATCHDOG=1");
        break;
    }
}

unsigned long long tally_notify_watchdog_usec(const tally_notify_t *n)
{
    return n != NULL ? n->watchdog_usec : 0;
}
