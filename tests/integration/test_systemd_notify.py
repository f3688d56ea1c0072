"""systemd's Type=notify protocol, spoken by a real worker to a socket the test binds where
systemd's would be ($NOTIFY_SOCKET): EXTEND_TIMEOUT_USEC while starting, READY=1 once started,
WATCHDOG=1 often enough for WatchdogSec= and no more often than half of it, STOPPING=1 when
SIGTERM begins the drain. Every datagram comes from the worker's own pid, which is what
NotifyAccess=main (deploy/systemd/*.service) lets through.
"""

import os
import re
import signal
import socket
import struct
import time
import uuid

import tallytest
from tallytest import TallyCase, wait_for

WATCHDOG_USEC = 2_000_000  # 2 s: pings every 1 s


class NotifySocket:
    """An AF_UNIX datagram socket bound like systemd's notify socket, with SO_PASSCRED so each
    message carries its sender's pid. @name: a path, or '@abstract'."""

    def __init__(self, name):
        self.name = name
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + name[1:] if name.startswith("@") else name)
        self.messages = []  # (monotonic time, sender pid, text)

    def receive(self, timeout):
        """Read what arrives within @timeout seconds into self.messages."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            self.sock.settimeout(left)
            try:
                data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
            except socket.timeout:
                return
            pid = None
            for level, typ, cdata in anc:
                if level == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("iII", cdata[:12])[0]
            self.messages.append((time.monotonic(), pid, data.decode()))

    def wait_for(self, predicate, timeout, what):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = [m for m in self.messages if predicate(m[2])]
            if hit:
                return hit[0]
            self.receive(0.2)
        raise AssertionError(f"no {what} within {timeout} s; got "
                             f"{[m[2] for m in self.messages]}")

    def close(self):
        self.sock.close()


class SystemdNotifyTest(TallyCase):

    def notify_socket(self, name):
        s = NotifySocket(name)
        self.addCleanup(s.close)
        return s

    def test_ready_watchdog_and_stopping_on_a_path_socket(self):
        sock = self.notify_socket(os.path.join(self.tmp, "notify"))
        p = self.start("tally-dispatcher", wait_ready=False, NOTIFY_SOCKET=sock.name,
                       WATCHDOG_USEC=WATCHDOG_USEC)
        t_ready, pid, ready = sock.wait_for(lambda m: m.startswith("READY=1"), 60, "READY=1")
        lines = ready.split("\n")
        self.assertEqual(lines[0], "READY=1")
        self.assertRegex(lines[1], r"^STATUS=running: schema version \d+, topics \S+intents$")
        # READY=1 only once started: the "started:" line was written before it
        self.assertTrue(any(l.get("msg", "").startswith("started:") for l in p.log_lines()),
                        p.log())
        # start-up asked for more time in watchdog periods before it was ready, not after
        before = [m for t, _, m in sock.messages if t < t_ready]
        self.assertTrue(before, "EXTEND_TIMEOUT_USEC while starting")
        self.assertEqual(set(before), {f"EXTEND_TIMEOUT_USEC={WATCHDOG_USEC}"})

        sock.receive(5.5)
        pings = [t for t, _, m in sock.messages if t > t_ready and m == "WATCHDOG=1"]
        self.assertGreaterEqual(len(pings), 4, sock.messages)
        gaps = [b - a for a, b in zip([t_ready] + pings, pings)]
        # within the watchdog period (systemd would kill it otherwise), and not more often
        # than half of it (one ping per heartbeat would flood the socket)
        self.assertLess(max(gaps), WATCHDOG_USEC / 1e6 * 0.9, gaps)
        self.assertGreater(min(gaps[1:]), WATCHDOG_USEC / 2e6 * 0.8, gaps)
        self.assertEqual({m for t, _, m in sock.messages if t > t_ready}, {"WATCHDOG=1"})

        p.popen.send_signal(signal.SIGTERM)
        _, _, stopping = sock.wait_for(lambda m: m.startswith("STOPPING=1"), 30, "STOPPING=1")
        self.assertEqual(stopping, "STOPPING=1\nSTATUS=draining: up to 20000 ms")
        self.assertEqual(p.popen.wait(30), 0)
        # NotifyAccess=main: every message from the worker's own pid
        self.assertEqual({pid for _, pid, _ in sock.messages}, {p.pid})
        self.assertEqual(sum(m.startswith("READY=1") for _, _, m in sock.messages), 1)

    def test_abstract_socket_and_a_watchdog_meant_for_another_process(self):
        """'@name' is Linux's abstract namespace; WATCHDOG_PID naming another process (the
        variables were inherited) means no pings, while READY and STOPPING still go."""
        sock = self.notify_socket(f"@tally-test-{uuid.uuid4().hex}")
        p = self.start("tally-reconciler", wait_ready=False, NOTIFY_SOCKET=sock.name,
                       WATCHDOG_USEC=WATCHDOG_USEC, WATCHDOG_PID=os.getpid())
        sock.wait_for(lambda m: m.startswith("READY=1"), 60, "READY=1")
        sock.receive(2.5)
        self.assertEqual([m.split("\n")[0] for _, _, m in sock.messages], ["READY=1"])
        p.popen.send_signal(signal.SIGTERM)
        sock.wait_for(lambda m: m.startswith("STOPPING=1"), 30, "STOPPING=1")
        self.assertEqual(p.popen.wait(30), 0)
        self.assertEqual({pid for _, pid, _ in sock.messages}, {p.pid})

    def test_no_listener_is_logged_once_and_the_worker_runs_on(self):
        """A notify socket nobody reads (systemd gone, a stale variable): one warning, and the
        worker starts and stops as usual."""
        p = self.start("tally-compensator", NOTIFY_SOCKET=os.path.join(self.tmp, "nobody"),
                       WATCHDOG_USEC=WATCHDOG_USEC)
        wait_for(lambda: p.http_get("/readyz")[0] == 200, timeout=30, what="/readyz")
        time.sleep(2.5)
        self.assertEqual(p.terminate(), 0)
        warnings = [l for l in p.log_lines() if "cannot notify systemd" in l.get("msg", "")]
        self.assertEqual(len(warnings), 1, p.log())
        self.assertRegex(warnings[0]["msg"], re.escape(os.path.join(self.tmp, "nobody")))


if __name__ == "__main__":
    tallytest.main()
