"""PostgreSQL stops answering under running workers without closing anything (issue 26): the
server frozen by SIGSTOP, a lock held past the statement timeout, a network path that drops
everything silently. Every worker stays alive (/healthz 200: a liveness probe must not restart
them all together), says it is not ready (/readyz 503 naming PostgreSQL, tally_db_up 0) once a
statement has waited past TALLY_PG_STALL_MS, and recovers by itself when the server answers
again: ready, tally_db_up 1, and the intent that waited answered, without a restart.

This module freezes the whole cluster, so it runs on a PostgreSQL of its own (a private
`tally dev --no-workers`), never on the stack a suite run shares between modules."""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import psycopg2
import psycopg2.extensions

import tallytest
from dispatchcase import DispatchCase, main, run_id
from tallytest import wait_for
from test_systemd_notify import NotifySocket

STALL_MS = 2000   # TALLY_PG_STALL_MS for these workers
MARGIN_S = 10.0   # how long after the stall threshold every worker must have said so
WORKERS = ("tally-dispatcher", "tally-reconciler", "tally-compensator")


class BlackholeProxy:
    """A TCP proxy to PostgreSQL that can be switched to drop everything silently: it stops
    reading and forwarding in both directions (and accepting) without closing anything, which
    the client cannot tell from packets lost on the way. Daemon threads; close() at cleanup."""

    def __init__(self, port):
        self.target = port
        self.open = threading.Event()
        self.open.set()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            self.open.wait()
            try:
                c, _ = self.sock.accept()
                up = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                continue
            for a, b in ((c, up), (up, c)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while True:
                self.open.wait()
                data = src.recv(65536)
                if not data:
                    break
                self.open.wait()  # read just before the switch: held, never forwarded late
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def blackhole(self):
        self.open.clear()

    def restore(self):
        self.open.set()

    def close(self):
        self.closed = True
        self.open.set()
        self.sock.close()


class PostgresStallTest(DispatchCase):

    @classmethod
    def setUpClass(cls):
        # A PostgreSQL of this module's own: freezing the suite's shared one would stall every
        # module that runs beside this one.
        saved = {k: os.environ.pop(k) for k in ("TALLY_TEST_PG", "TALLY_TEST_KAFKA")
                 if k in os.environ}
        try:
            tallytest.Stack._instance = tallytest.Stack()
        finally:
            os.environ.update(saved)
        super().setUpClass()

    # --- the workers and what they say ------------------------------------------------------

    def start_workers(self, dispatcher_env=None, **env):
        env = {"TALLY_PG_STALL_MS": STALL_MS, "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 500,
               **env}
        workers = [self.dispatcher(**env, **(dispatcher_env or {})),
                   self.start("tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url, **env),
                   self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url, **env)]
        for p in workers:
            wait_for(lambda: p.http_get("/readyz")[0] == 200, timeout=60,
                     what=f"{p.name} /readyz before the stall")
            self.assertEqual(self.db_up(p), 1.0, p.name)
        return workers

    @staticmethod
    def db_up(p):
        status, text = p.http_get("/metrics")
        m = re.search(r"^tally_db_up (\S+)$", text, re.M) if status == 200 else None
        return float(m.group(1)) if m else None

    def ride_out(self, workers, seconds, must_be_unready=True):
        """Watch @workers for @seconds while PostgreSQL does not answer: each stays the same
        live process with /healthz 200 throughout and, when @must_be_unready, says within
        TALLY_PG_STALL_MS + MARGIN_S that it is not ready because of PostgreSQL, with
        tally_db_up 0. Returns {name: (seconds to the first 503, its reason)}."""
        pids = {p.name: p.pid for p in workers}
        start = time.monotonic()
        unready = {}
        while time.monotonic() - start < seconds:
            for p in workers:
                self.assertTrue(p.alive(), f"{p.name} exited during the stall:\n{p.log()[-5000:]}")
                self.assertEqual(p.pid, pids[p.name])
                status, body = p.http_get("/healthz")
                self.assertEqual((status, body.strip()), (200, "ok"),
                                 f"{p.name} /healthz after {time.monotonic() - start:.1f} s")
                if p.name not in unready:
                    status, body = p.http_get("/readyz")
                    if status == 503 and self.db_up(p) == 0.0:
                        unready[p.name] = (time.monotonic() - start, body.strip())
            time.sleep(0.3)
        if must_be_unready:
            for p in workers:
                self.assertIn(p.name, unready, f"{p.name} stayed ready through the stall")
                after, why = unready[p.name]
                self.assertLessEqual(after, STALL_MS / 1000 + MARGIN_S, (p.name, why))
                self.assertIn("PostgreSQL", why, p.name)
        return unready

    def recovered(self, workers, pids):
        for p in workers:
            try:
                wait_for(lambda: p.http_get("/readyz")[0] == 200 and self.db_up(p) == 1.0,
                         timeout=60, what=f"{p.name} ready with tally_db_up 1 after the stall")
            except AssertionError as e:
                raise AssertionError(f"{e}: /readyz {p.http_get('/readyz')}, tally_db_up "
                                     f"{self.db_up(p)}") from None
            self.assertTrue(p.alive(), p.name)
            self.assertEqual(p.pid, pids[p.name])
            self.assertEqual(p.http_get("/healthz")[0], 200)
            started = [ln for ln in p.log_lines() if str(ln.get("msg", "")).startswith("started:")]
            self.assertEqual(len(started), 1, f"{p.name} started more than once")

    def waiting_intent(self):
        """An intent published while PostgreSQL does not answer: the dispatcher takes it from
        Kafka and can write nothing of it yet."""
        run = run_id()
        ce = self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h"})
        self.publish(ce)
        return ce

    def answered(self, ce):
        answers = self.outcomes_for([ce["id"]], timeout=90)
        self.assertEqual({ev["type"] for ev in answers[ce["id"]]}, {"tally.effect.confirmed.v1"})
        key = f"create_hold:{ce['data']['args']['hold_id']}"
        self.assertEqual(self.wait_status("create_hold", key, "CONFIRMED", timeout=60)["status"],
                         "CONFIRMED")
        self.assertEqual(len(self.requests(key)), 1)

    # --- ways for PostgreSQL to stop answering -----------------------------------------------

    def cluster_pids(self):
        """The postmaster (the parent of the test's own backend) and all its children."""
        backend = self.db.get_backend_pid()
        with open(f"/proc/{backend}/status") as f:
            postmaster = int(next(ln for ln in f if ln.startswith("PPid:")).split()[1])
        kids = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True,
                              text=True).stdout.split()
        return postmaster, [int(k) for k in kids]

    @contextlib.contextmanager
    def frozen(self):
        """Every process of the cluster stopped (SIGSTOP): connections stay open, the kernel
        acknowledges what is sent, nothing answers."""
        postmaster, kids = self.cluster_pids()
        self.assertTrue(kids, "no backends under the postmaster")
        os.kill(postmaster, signal.SIGSTOP)  # first: no new backend is forked meanwhile
        pids = [postmaster] + self.cluster_pids()[1]
        for pid in pids[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in reversed(pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    # --- the tests ---------------------------------------------------------------------------

    @staticmethod
    def db_up_alerts(base):
        """The jobs TallyDatabaseUnreachable is pending or firing for; None before the rules
        are loaded."""
        import json
        import urllib.request
        try:
            with urllib.request.urlopen(base + "/api/v1/rules?type=alert", timeout=5) as r:
                groups = json.load(r)["data"]["groups"]
        except OSError:
            return None
        rules = [rule for g in groups for rule in g["rules"]
                 if rule["name"] == "TallyDatabaseUnreachable"]
        if not rules or rules[0].get("lastEvaluation", "").startswith("0001"):
            return None
        return {a["labels"]["job"] for a in rules[0].get("alerts", [])}

    @contextlib.contextmanager
    def listening(self, notify):
        """@notify's datagrams collected on a thread meanwhile."""
        stop = threading.Event()
        def collect():
            while not stop.is_set():
                notify.receive(0.2)
        t = threading.Thread(target=collect, daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(5)

    def test_a_frozen_server_makes_workers_unready_not_dead_and_they_recover(self):
        # the dispatcher also speaks to a systemd of the test's, with a 2 s watchdog: systemd
        # must not kill what /healthz keeps
        notify = NotifySocket(os.path.join(self.tmp, "notify.sock"))
        self.addCleanup(notify.close)
        workers = self.start_workers(dispatcher_env={
            "NOTIFY_SOCKET": notify.name, "WATCHDOG_USEC": 2_000_000})
        pids = {p.name: p.pid for p in workers}
        notify.wait_for(lambda m: "READY=1" in m, 30, "READY=1")
        # and the page: Prometheus with the shipped rules scrapes the three
        prom, base = self.start_prometheus(
            {p.name: f"127.0.0.1:{p.metrics_port}" for p in workers},
            rule_files=[os.path.join(tallytest.SOURCE_DIR, "deploy", "prometheus", "alerts.yml")])
        wait_for(lambda: self.db_up_alerts(base) == set(), timeout=60, interval=0.5,
                 what="Prometheus evaluating the rules, TallyDatabaseUnreachable quiet")
        with self.frozen(), self.listening(notify):
            t0 = time.monotonic()
            ce = self.waiting_intent()
            unready = self.ride_out(workers, 20)
            t1 = time.monotonic()
            # its expression holds for every worker kind (pending: it fires after 1 min)
            alerting = self.db_up_alerts(base)
        self.assertEqual(alerting, set(WORKERS), "TallyDatabaseUnreachable during the stall")
        pings = [t for t, _, m in notify.messages if m == "WATCHDOG=1" and t0 <= t <= t1]
        gaps = [b - a for a, b in zip([t0] + pings, pings + [t1])]
        self.assertGreaterEqual(len(pings), 8, "no watchdog pings through the stall")
        self.assertLess(max(gaps), 2.0, f"a gap systemd's watchdog (2 s) would kill on: {gaps}")
        self.recovered(workers, pids)
        self.answered(ce)
        # nothing waited long enough (30 s deadline) to be given up
        for p in workers:
            self.assertNotIn("did not answer within", p.log(), p.name)
        print("first 503 after (s):", {k: round(v[0], 1) for k, v in unready.items()},
              "reasons:", sorted({v[1] for v in unready.values()}))

    def test_past_the_deadline_the_connection_is_given_up_and_made_again(self):
        workers = self.start_workers(TALLY_PG_DEADLINE_MS=4000)
        pids = {p.name: p.pid for p in workers}
        with self.frozen():
            ce = self.waiting_intent()
            self.ride_out(workers, 15)
            for p in workers:
                # a wait past the deadline closed the connection; a new one cannot be made
                self.assertIn("PostgreSQL did not answer within 4000 ms", p.log(), p.name)
                self.assertEqual(p.http_get("/healthz")[0], 200)
        self.recovered(workers, pids)
        self.answered(ce)

    def test_a_lock_held_past_the_statement_timeout(self):
        """A session holds an ACCESS EXCLUSIVE lock on effects: the dispatcher's write of an
        intent waits; the server cancels it at statement_timeout (5/6 of the deadline); the
        dispatcher retries, and writes it once the lock is gone."""
        d = self.dispatcher(TALLY_PG_DEADLINE_MS=3000, TALLY_PG_STALL_MS=STALL_MS)
        wait_for(lambda: d.http_get("/readyz")[0] == 200, timeout=60, what="dispatcher ready")
        locker = psycopg2.connect(self.pg)
        try:
            with locker.cursor() as cur:
                cur.execute("LOCK TABLE effects IN ACCESS EXCLUSIVE MODE")
            ce = self.waiting_intent()
            wait_for(lambda: "canceling statement due to statement timeout" in d.log(),
                     timeout=60, what="the dispatcher's statement cancelled by statement_timeout")
            self.assertTrue(d.alive())
            self.assertEqual(d.http_get("/healthz")[0], 200)
            time.sleep(3)  # a few more rounds of waiting and retrying
            self.assertTrue(d.alive())
        finally:
            locker.rollback()
            locker.close()
        self.answered(ce)
        wait_for(lambda: d.http_get("/readyz")[0] == 200 and self.db_up(d) == 1.0, timeout=30,
                 what="the dispatcher ready again")
        self.assertNotIn("did not answer within", d.log())  # the server answered, in time

    def test_a_silently_dropping_path_through_a_proxy(self):
        """Between the workers and PostgreSQL, a proxy that stops forwarding and reading
        without closing: the client's deadline is all that notices."""
        port = int(psycopg2.extensions.parse_dsn(self.pg).get("port", 5432))
        proxy = BlackholeProxy(port)
        self.addCleanup(proxy.close)

        def via_proxy(role):
            return psycopg2.extensions.make_dsn(self.pg_as(role), host="127.0.0.1",
                                                port=proxy.port)
        env = {"TALLY_PG_STALL_MS": STALL_MS, "TALLY_PG_DEADLINE_MS": 5000,
               "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 500}
        workers = [self.dispatcher(TALLY_PG=via_proxy("dispatcher"), **env),
                   self.start("tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url,
                              TALLY_PG=via_proxy("reconciler"), **env),
                   self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                              TALLY_PG=via_proxy("compensator"), **env)]
        for p in workers:
            wait_for(lambda: p.http_get("/readyz")[0] == 200, timeout=60,
                     what=f"{p.name} ready through the proxy")
        pids = {p.name: p.pid for p in workers}
        proxy.blackhole()
        try:
            ce = self.waiting_intent()
            self.ride_out(workers, 15)
            for p in workers:
                self.assertIn("PostgreSQL did not answer within 5000 ms", p.log(), p.name)
        finally:
            proxy.restore()
        self.recovered(workers, pids)
        self.answered(ce)

    @staticmethod
    def _can_drop():
        if os.geteuid() != 0 or shutil.which("iptables") is None:
            return False
        return subprocess.run(["iptables", "-L", "INPUT", "-n"], capture_output=True).returncode == 0

    def test_packets_dropped_on_the_way(self):
        """Real packet loss: netfilter drops every packet to and from this module's PostgreSQL
        port (root and iptables needed; skipped otherwise). A connection with unacknowledged
        data is ended by the kernel at tcp_user_timeout (10 s); new ones cannot be made (the
        SYN is dropped) until connect_timeout."""
        if not self._can_drop():
            self.skipTest("needs root and a working iptables to drop packets")
        port = int(psycopg2.extensions.parse_dsn(self.pg).get("port", 5432))
        workers = self.start_workers()
        pids = {p.name: p.pid for p in workers}
        rules = [["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
                 ["INPUT", "-i", "lo", "-p", "tcp", "--sport", str(port), "-j", "DROP"]]
        added = []
        try:
            for r in rules:
                subprocess.run(["iptables", "-I", *r], check=True, capture_output=True)
                added.append(r)
            ce = self.waiting_intent()
            self.ride_out(workers, 25)
        finally:
            for r in added:
                subprocess.run(["iptables", "-D", *r], capture_output=True)
        self.recovered(workers, pids)
        # the test's own connection went through the same loss
        with contextlib.suppress(psycopg2.Error):
            self.db.close()
        self.db = psycopg2.connect(self.pg)
        self.db.autocommit = True
        self.answered(ce)


if __name__ == "__main__":
    main()
