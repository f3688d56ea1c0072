/* notify.h — systemd's service notifications (the sd_notify protocol) without libsystemd: one
 * datagram per message on the AF_UNIX socket that $NOTIFY_SOCKET names, for Type=notify units
 * with WatchdogSec= (deploy/systemd/).
 *
 * A worker tells systemd three things: READY=1 once it has started, STOPPING=1 when the first
 * SIGTERM begins the drain, and WATCHDOG=1 while it is alive by the rule /healthz follows (worker.c
 * calls tally_notify_heartbeat from a thread of its own). Before READY=1 the
 * heartbeat sends EXTEND_TIMEOUT_USEC instead, so a start-up that keeps turning (waiting for
 * PostgreSQL in bounded rounds) outlasts TimeoutStartSec=, and one that stops turning is
 * killed after the watchdog period, as a hung running worker would be.
 *
 * Without $NOTIFY_SOCKET (not under systemd, or a unit that is not Type=notify) tally_notify_new
 * returns NULL and every verb is a no-op on NULL. Sends never block (MSG_DONTWAIT) and never
 * fail the caller: the first failure is logged, later ones are not. */
#ifndef TALLY_NOTIFY_H
#define TALLY_NOTIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

typedef struct tally_notify tally_notify_t;

/**
 * @brief The notifier systemd's environment describes: $NOTIFY_SOCKET (a path, or an abstract
 * socket when it starts with '@'), $WATCHDOG_USEC and $WATCHDOG_PID.
 * @returns NULL when $NOTIFY_SOCKET is unset or empty, or names no usable socket (logged);
 * else a handle the caller frees with tally_notify_free.
 */
tally_notify_t *tally_notify_new(void);

/** @brief Close the socket and free. Accepts NULL. */
void tally_notify_free(tally_notify_t *n);

/**
 * @brief Send one message ("READY=1", "STATUS=...", several joined by '\n') as one datagram.
 * @returns false when it could not be sent; the first failure is logged. Never blocks.
 */
__attribute__((warn_unused_result)) bool tally_notify_send(tally_notify_t *n, const char *msg);

/** @brief READY=1 with STATUS=@p status (may be NULL); heartbeats then send WATCHDOG=1. */
void tally_notify_ready(tally_notify_t *n, const char *status);

/** @brief STOPPING=1 with STATUS=@p status (may be NULL). */
void tally_notify_stopping(tally_notify_t *n, const char *status);

/**
 * @brief The worker is alive at @p now_ms (CLOCK_MONOTONIC, ms): when the watchdog is on and
 * half its period has passed since the last ping, send WATCHDOG=1 (EXTEND_TIMEOUT_USEC before
 * READY=1). One atomic load and compare when nothing is due; safe from any thread.
 */
void tally_notify_heartbeat(tally_notify_t *n, long long now_ms);

/** @brief The watchdog period in microseconds; 0 when the watchdog is off. */
unsigned long long tally_notify_watchdog_usec(const tally_notify_t *n);

/* --- pure parts, for the unit tests ------------------------------------------------------- */

/**
 * @brief $NOTIFY_SOCKET's value as a socket address: "/path" (a file) or "@name" (Linux's
 * abstract namespace, the '@' becoming a leading NUL).
 * @returns false, with the reason in @p errstr, for another form or a name too long.
 */
__attribute__((warn_unused_result)) bool tally_notify_address(const char *value,
                                                              struct sockaddr_un *sa,
                                                              socklen_t *salen, char *errstr,
                                                              size_t errsz);

/**
 * @brief The watchdog period sd_watchdog_enabled(3) would report: @p usec ($WATCHDOG_USEC) as a
 * positive integer, unless @p pid ($WATCHDOG_PID) is set and is not @p self (the watchdog is
 * then another process's). @returns 0 when off; @p errstr says why when a value is malformed
 * (empty when it is simply unset or meant for another process).
 */
unsigned long long tally_notify_watchdog_period(const char *usec, const char *pid, pid_t self,
                                                char *errstr, size_t errsz);

#endif
