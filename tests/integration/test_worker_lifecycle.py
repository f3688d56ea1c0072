"""The lifecycle every worker shares: it starts, answers /healthz, /readyz and /metrics, stops
cleanly on SIGTERM, and refuses to start on an unsafe tool registry, an unmigrated database or
a bad environment."""

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request

import tallytest
from tallytest import SOURCE_DIR, TallyCase, binary, free_port, wait_for

WORKERS = {
    "tally-dispatcher": ("dispatcher", "intents"),
    "tally-reconciler": ("reconciler", "outcomes"),
    "tally-compensator": ("compensator", "obligations"),
}

UNSAFE_REGISTRY = os.path.join(SOURCE_DIR, "examples", "tools", "invalid",
                               "reversible-without-compensate.json")


def json_lines(text):
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def messages(lines, level=None):
    return [l.get("msg", "") for l in lines if level is None or l.get("level") == level]


class WorkerLifecycleTest(TallyCase):

    def run_worker(self, name, *args, timeout=60, **extra_env):
        """Run a worker to completion (it is expected to refuse to start)."""
        return subprocess.run([binary(name), *args], capture_output=True, text=True,
                              env=self.env(**extra_env), timeout=timeout)

    def test_workers_start_serve_probes_and_stop_on_sigterm(self):
        procs = {name: self.start(name) for name in WORKERS}
        for name, p in procs.items():
            worker, topic = WORKERS[name]
            with self.subTest(worker=name):
                wait_for(lambda: p.http_get("/readyz")[0] == 200, timeout=30,
                         what=f"{name} /readyz")
                self.assertEqual(p.http_get("/healthz"), (200, "ok"))
                self.assertEqual(p.http_get("/readyz"), (200, "ready"))

                status, metrics = p.http_get("/metrics")
                self.assertEqual(status, 200)
                self.assertIn("# TYPE tally_worker_up gauge", metrics)
                self.assertRegex(metrics, r"(?m)^tally_worker_up 1$")
                self.assertRegex(metrics, r'(?m)^tally_build_info\{version="[0-9][^"]*",worker="'
                                 + worker + r'"\} 1$')
                # the loop turns (a tick waits at most TALLY_POLL_MS for work)
                wait_for(lambda: re.search(r"(?m)^tally_worker_ticks_total [1-9][0-9]*$",
                                           p.http_get("/metrics")[1]),
                         timeout=10, what=f"{name} to complete a tick")
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{p.metrics_port}/metrics", timeout=5) as r:
                    self.assertTrue(r.headers["Content-Type"].startswith(
                        "text/plain; version=0.0.4"), r.headers["Content-Type"])

                self.assertEqual(p.http_get("/nothing-here")[0], 404)
                req = urllib.request.Request(f"http://127.0.0.1:{p.metrics_port}/metrics",
                                             data=b"x=1", method="POST")
                with self.assertRaises(urllib.error.HTTPError) as cm:
                    urllib.request.urlopen(req, timeout=5)
                self.assertEqual(cm.exception.code, 405)

                started = [l for l in p.log_lines() if l.get("msg", "").startswith("started")]
                self.assertTrue(started, p.log())
                self.assertIn(self.topic(topic), started[0]["msg"])
                # the default consumer group is named after the topic prefix
                self.assertIn(f"group {self.prefix.rstrip('.')}-{worker}", started[0]["msg"])
                self.assertEqual(started[0].get("component"), worker)

        for name, p in procs.items():
            with self.subTest(worker=name):
                t0 = time.monotonic()
                code = p.terminate(timeout=20)
                took = time.monotonic() - t0
                self.assertEqual(code, 0, p.log())
                self.assertLess(took, 10, f"{name} took {took:.1f}s to stop")
                msgs = messages(p.log_lines())
                self.assertTrue(any(m.startswith("stopping") for m in msgs), p.log())
                self.assertTrue(any(m.startswith("stopped") for m in msgs), p.log())
                self.assertEqual(messages(p.log_lines(), "error"), [], p.log())

    def test_an_idle_worker_waits_instead_of_spinning(self):
        # With no work and no tool that audits or lists, each worker's loop must sleep until
        # its next timer: a round that forgets to move its timer made the reconciler tick
        # ~100,000 times a second while idle. A slow machine ticks fewer times, never more.
        poll_ms = 200
        procs = {name: self.start(name, TALLY_POLL_MS=poll_ms, TALLY_SWEEP_MS=poll_ms)
                 for name in WORKERS}

        def ticks(p):
            m = re.search(r"(?m)^tally_worker_ticks_total ([0-9]+)$", p.http_get("/metrics")[1])
            return int(m.group(1)) if m else None
        for name, p in procs.items():
            wait_for(lambda: (ticks(p) or 0) > 0, timeout=30, what=f"{name} to tick")
        before = {name: ticks(p) for name, p in procs.items()}
        t0 = time.monotonic()
        time.sleep(3)
        elapsed_ms = (time.monotonic() - t0) * 1000
        for name, p in procs.items():
            with self.subTest(worker=name):
                n = ticks(p) - before[name]
                # a tick per poll at most, a few more for timers and scrapes
                self.assertLessEqual(n, 4 * elapsed_ms / poll_ms + 50,
                                     f"{name} ticked {n} times in {elapsed_ms:.0f} ms idle")

    def test_held_metrics_connections_cannot_starve_the_health_listener(self):
        # 64 idle connections used to fill the metrics listener, and the liveness probe on it
        # failed: the kubelet restarted a healthy worker. Now one client gets 8 of them, and
        # the probes have a listener of their own (TALLY_HEALTH_ADDR).
        health_port = free_port()
        p = self.start("tally-reconciler", TALLY_HEALTH_ADDR=f"127.0.0.1:{health_port}")
        wait_for(lambda: f"on port {health_port}" in p.log(), timeout=10,
                 what="the health listener's log line")

        def get(port, path):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()
            except OSError as e:
                return None, str(e)

        self.assertEqual(get(health_port, "/healthz"), (200, "ok"))
        wait_for(lambda: get(health_port, "/readyz")[0] == 200, timeout=30,
                 what="/readyz on the health listener")
        self.assertEqual(get(health_port, "/metrics")[0], 404)  # scrapers go elsewhere
        held = []
        try:
            for _ in range(64):
                s = socket.create_connection(("127.0.0.1", p.metrics_port), timeout=3)
                held.append(s)
            time.sleep(0.5)
            # this client has used up its share of the metrics listener...
            self.assertIsNone(get(p.metrics_port, "/metrics")[0])
            # ...and the probes do not care
            for _ in range(5):
                self.assertEqual(get(health_port, "/healthz"), (200, "ok"))
            self.assertTrue(p.alive())
        finally:
            for s in held:
                s.close()
        wait_for(lambda: get(p.metrics_port, "/metrics")[0] == 200, timeout=15,
                 what="the metrics listener to serve again once the connections are gone")

    def test_unsafe_registry_refuses_to_start(self):
        with open(UNSAFE_REGISTRY) as f:
            doc = json.load(f)
        rule = doc["expect_rule"]
        tool = doc["tools"][0]["name"]
        for name in WORKERS:
            with self.subTest(worker=name):
                out = self.run_worker(name, TALLY_TOOLS=UNSAFE_REGISTRY,
                                      TALLY_METRICS_ADDR="127.0.0.1:0")
                self.assertEqual(out.returncode, 1, out.stderr)
                errors = messages(json_lines(out.stderr), "error")
                self.assertTrue(any(tool in m and rule in m for m in errors),
                                f"no error line names tool {tool!r} and rule {rule!r}:\n"
                                + out.stderr)
                self.assertTrue(any("refusing to start" in m for m in errors), out.stderr)

    def test_tools_flag_overrides_environment(self):
        # TALLY_TOOLS points at the safe registry; --tools at the unsafe one wins.
        out = self.run_worker("tally-dispatcher", "--tools", UNSAFE_REGISTRY,
                              TALLY_METRICS_ADDR="")
        self.assertEqual(out.returncode, 1, out.stderr)
        self.assertIn("refusing to start", out.stderr)

    def test_bad_environment_exits_2_naming_the_variable(self):
        out = self.run_worker("tally-reconciler", TALLY_POLL_MS="soon")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("TALLY_POLL_MS", out.stderr)

    def test_help_and_version(self):
        out = self.run_worker("tally-compensator", "--help")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("Usage: tally-compensator", out.stdout)
        self.assertIn("TALLY_PG", out.stdout)
        self.assertIn("TALLY_METRICS_ADDR", out.stdout)
        out = self.run_worker("tally-compensator", "--version")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(out.stdout, r"^tally-compensator [0-9]+\.[0-9]+")
        out = self.run_worker("tally-compensator", "--no-such-flag")
        self.assertEqual(out.returncode, 2)


class UnmigratedDatabaseTest(TallyCase):
    migrate = False

    def test_workers_refuse_an_unmigrated_database(self):
        for name in WORKERS:
            with self.subTest(worker=name):
                out = subprocess.run([binary(name)], capture_output=True, text=True,
                                     env=self.env(TALLY_METRICS_ADDR=""), timeout=60)
                self.assertEqual(out.returncode, 1, out.stderr)
                errors = messages(json_lines(out.stderr), "error")
                self.assertTrue(
                    any("schema is at version 0" in m and "run `tally migrate`" in m
                        for m in errors), out.stderr)


if __name__ == "__main__":
    tallytest.main()
