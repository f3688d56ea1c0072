"""`tally dev`: the embedded stack comes up, says where it is, runs the workers and the web
console (every alert linking to it), and on SIGTERM leaves nothing behind — no process, no
temporary directory, no env file.

Plain unittest (not TallyCase): each test starts its OWN `tally dev`, the way a developer does,
and looks at it from the outside with psql, kcat and /proc.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import socket
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tallytest import SOURCE_DIR, TOPICS, binary, wait_for  # noqa: E402

TABLES = ("runs", "effects", "outbox", "obligations", "events", "message_outbox", "message_refs",
          "alerts",
          "tally_migrations")
WORKERS = ("tally-dispatcher", "tally-reconciler", "tally-compensator")
DEMO_TOOLS = os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")


# --- /proc ---------------------------------------------------------------------------------

def _stat(pid):
    """(state, ppid, starttime) of a process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def _pids():
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def children(pid):
    out = []
    for p in _pids():
        st = _stat(p)
        if st and st[1] == pid:
            out.append(p)
    return out


def descendants(pid):
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def identity(pid):
    """A pid plus its start time: survives pid reuse."""
    st = _stat(pid)
    return (pid, st[2]) if st else None


def still_running(ident):
    st = _stat(ident[0])
    return st is not None and st[2] == ident[1] and st[0] != "Z"


def processes_mentioning(text):
    return [p for p in _pids() if p != os.getpid() and any(text in a for a in _cmdline(p))]


# --- one `tally dev` -----------------------------------------------------------------------

class DevStack:
    def __init__(self, *args, tmpdir=None):
        self.root = tempfile.mkdtemp(prefix="tally-test-dev-")
        # TMPDIR of tally dev: its temporary cluster directory must appear here and vanish.
        # As root, PostgreSQL runs as user postgres, which must be able to reach it.
        os.chmod(self.root, 0o755)
        self.tmpdir = tmpdir or os.path.join(self.root, "tmp")
        if tmpdir is None:
            os.mkdir(self.tmpdir, 0o755)
            os.chmod(self.tmpdir, 0o755)
        self.env_file = os.path.join(self.root, "tally.env")
        self.stdout_path = os.path.join(self.root, "stdout")
        self.stderr_path = os.path.join(self.root, "stderr")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        env["TMPDIR"] = self.tmpdir
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [binary("tally"), "dev", *args, "--env-file", self.env_file],
                stdout=out, stderr=err, env=env, start_new_session=True)
        self.values = {}

    def wait_up(self, timeout=120):
        wait_for(lambda: os.path.exists(self.env_file) or self.proc.poll() is not None,
                 timeout=timeout, what="tally dev to write its env file")
        if self.proc.poll() is not None:
            raise AssertionError(f"tally dev exited with {self.proc.returncode}:\n{self.stderr()}")
        with open(self.env_file) as f:
            for line in f:
                m = re.match(r"export (\w+)=(.*)$", line.strip())
                if m:
                    v = m.group(2)
                    if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                        v = v[1:-1]
                    self.values[m.group(1)] = v
        return self.values

    def stderr(self):
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def stdout(self):
        with open(self.stdout_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout=30):
        """SIGTERM; returns (exit code, seconds taken)."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"tally dev did not exit within {timeout}s of SIGTERM:\n"
                                 f"{self.stderr()[-5000:]}")
        return rc, time.monotonic() - start

    def cleanup(self):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for p in processes_mentioning(self.tmpdir):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


class SilentTool:
    """A tool that takes each request and never answers: the call times out after it was sent,
    so its effect goes UNKNOWN, and STUCK at once for a tool without a status endpoint."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held = []
        self.closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self):
        self.closed = True
        self.sock.close()
        for c in self.held:
            c.close()


def http_get(url):
    """(status, body) of a GET; (0, reason) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError as e:
        return 0, str(e)


def run(*args, env=None, timeout=60):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)


class DevTest(unittest.TestCase):
    maxDiff = None

    def start(self, *args, tmpdir=None):
        stack = DevStack(*args, tmpdir=tmpdir)
        self.addCleanup(stack.cleanup)
        self.addCleanup(self._dump_on_failure, stack)
        return stack

    def _dump_on_failure(self, stack):
        outcome = getattr(self, "_outcome", None)
        result = getattr(outcome, "result", None)
        if result is not None and (result.failures or result.errors):
            sys.stderr.write(f"\n----- stderr of tally dev (pid {stack.proc.pid}) -----\n")
            sys.stderr.write(stack.stderr()[-20000:])

    # --- what a user checks ------------------------------------------------------------------

    def assert_ledger_tables(self, conninfo):
        out = run("psql", conninfo, "-X", "-c", r"\dt")
        self.assertEqual(out.returncode, 0, out.stderr)
        listed = set(re.findall(r"^\s*\w+\s*\|\s*(\w+)\s*\|\s*table", out.stdout, re.M))
        for t in TABLES:
            self.assertIn(t, listed, f"table {t} missing from \\dt:\n{out.stdout}")

    def assert_topics(self, brokers, prefix, partitions):
        out = run("kcat", "-b", brokers, "-L", "-m", "10")
        self.assertEqual(out.returncode, 0, out.stderr)
        for t in TOPICS:
            self.assertRegex(out.stdout, rf'topic "{re.escape(prefix + t)}" with {partitions} '
                                         r'partitions', f"kcat -L:\n{out.stdout}")

    def assert_nothing_left(self, stack, recorded):
        for ident in recorded:
            self.assertFalse(still_running(ident),
                             f"pid {ident[0]} ({' '.join(_cmdline(ident[0]))}) outlived tally dev")
        self.assertEqual(processes_mentioning(stack.tmpdir), [],
                         "a process still names the stack's temporary directory")
        self.assertEqual(os.listdir(stack.tmpdir), [], "the temporary directory was left behind")
        self.assertFalse(os.path.exists(stack.env_file), "the env file was left behind")

    def worker_children(self, stack):
        out = {}
        for p in children(stack.proc.pid):
            argv = _cmdline(p)
            if argv and os.path.basename(argv[0]) in WORKERS and _stat(p)[0] != "Z":
                out[os.path.basename(argv[0])] = p
        return out

    def assert_no_sanitizer_report(self, stack):
        """Under ASan/UBSan (CI) tally dev, its console and workers report on this stderr."""
        for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
            self.assertNotIn(marker, stack.stderr())

    def console_children(self, stack):
        return [p for p in children(stack.proc.pid)
                if _cmdline(p)[1:2] == ["console"] and _stat(p)[0] != "Z"]

    # --- tests -------------------------------------------------------------------------------

    def test_help_lists_verbs_and_unknown_verb_exits_2(self):
        out = run(binary("tally"), "--help")
        self.assertEqual(out.returncode, 0, out.stderr)
        for verb in ("migrate", "tools", "publish", "dev", "config", "version"):
            self.assertRegex(out.stdout, rf"(?m)^\s+{verb}\s", out.stdout)

        out = run(binary("tally"), "nosuchverb")
        self.assertEqual(out.returncode, 2)
        self.assertIn("unknown command 'nosuchverb'", out.stderr)

        out = run(binary("tally"), "dve")
        self.assertEqual(out.returncode, 2)
        self.assertIn("did you mean 'tally dev'", out.stderr)

        out = run(binary("tally"), "dev", "--help")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("--no-workers", out.stdout)
        for opt in ("--console-addr HOST:PORT", "--no-console", "TALLY_CONSOLE_URL"):
            self.assertIn(opt, out.stdout)

        # --console-addr places a console that would not run, or is no address: refused
        for args in (["--no-console", "--console-addr", "127.0.0.1:8089"],
                     ["--no-workers", "--console-addr", "127.0.0.1:8089"],
                     ["--no-workers", "--console-addr", "8089"]):
            out = run(binary("tally"), "dev", *args)
            self.assertEqual(out.returncode, 2, (args, out.stderr))
            self.assertIn("--console-addr", out.stderr)

        # the workers need a registry: refuse before starting anything
        env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        out = run(binary("tally"), "dev", env=env)
        self.assertEqual(out.returncode, 2)
        self.assertIn("--tools", out.stderr)

        out = run(binary("tally"), "version")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(out.stdout, r"^tally \d+\.\d+\.\d+")

    def test_no_workers_stack_comes_up_and_goes_away(self):
        stack = self.start("--no-workers", "--partitions", "2")
        values = stack.wait_up()
        self.assertIn("TALLY_PG", values)
        self.assertIn("TALLY_KAFKA_BROKERS", values)
        # TALLY_PG is the operator's role; the other roles' connections follow
        self.assertRegex(values["TALLY_PG"],
                         r"^host=127\.0\.0\.1 port=\d+ user=tally_operator dbname=tally$")
        self.assertRegex(values["TALLY_PG_ADMIN"],
                         r"^host=127\.0\.0\.1 port=\d+ user=tally dbname=postgres$")
        for name, user in (("OWNER", "tally_owner"), ("READER", "tally_reader"),
                           ("DISPATCHER", "tally_dispatcher"),
                           ("RECONCILER", "tally_reconciler"),
                           ("COMPENSATOR", "tally_compensator")):
            self.assertRegex(values[f"TALLY_PG_{name}"],
                             rf"^host=127\.0\.0\.1 port=\d+ user={user} dbname=tally$")
        # the owner is no superuser, and owns the ledger
        out = run("psql", values["TALLY_PG_ADMIN"], "-XAtc",
                  "SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = 'tally_owner'")
        self.assertEqual(out.stdout.strip(), "f|t", out.stderr)
        out = run("psql", values["TALLY_PG"], "-XAtc",
                  "SELECT tableowner FROM pg_tables WHERE tablename = 'events'")
        self.assertEqual(out.stdout.strip(), "tally_owner", out.stderr)
        self.assertRegex(values["TALLY_KAFKA_BROKERS"], r"^127\.0\.0\.1:\d+")
        # the same lines on stdout, for `eval`
        self.assertIn(f"export TALLY_KAFKA_BROKERS={values['TALLY_KAFKA_BROKERS']}",
                      stack.stdout())

        self.assert_ledger_tables(values["TALLY_PG"])
        self.assert_topics(values["TALLY_KAFKA_BROKERS"], values.get("TALLY_TOPIC_PREFIX",
                                                                        "tally."), 2)
        self.assertEqual(self.worker_children(stack), {}, "--no-workers started workers")
        self.assertTrue(os.listdir(stack.tmpdir), "no temporary cluster directory in TMPDIR")

        recorded = [identity(p) for p in descendants(stack.proc.pid)]
        recorded = [r for r in recorded if r]
        self.assertTrue(recorded, "no postgres process under tally dev")

        rc, took = stack.stop()
        self.assertEqual(rc, 0, stack.stderr())
        self.assertLess(took, 30)
        self.assert_nothing_left(stack, recorded)

    def test_after_sigkill_the_server_stops_and_the_next_start_sweeps_the_directory(self):
        first = self.start("--no-workers")
        first.wait_up()
        (cluster_dir,) = os.listdir(first.tmpdir)
        server = [identity(p) for p in children(first.proc.pid)]
        server = [s for s in server if s]
        self.assertTrue(server, "no postgres under tally dev")

        os.kill(first.proc.pid, signal.SIGKILL)  # no chance to clean up
        first.proc.wait()
        wait_for(lambda: not any(still_running(s) for s in server), timeout=30,
                 what="PostgreSQL to stop once its tally dev is gone")
        self.assertEqual(processes_mentioning(first.tmpdir), [])

        second = self.start("--no-workers", tmpdir=first.tmpdir)
        second.wait_up()
        self.assertNotIn(cluster_dir, os.listdir(first.tmpdir),
                         "the directory of the killed tally dev was not swept")
        self.assertIn(f"removing {os.path.join(first.tmpdir, cluster_dir)}", second.stderr())
        rc, _ = second.stop()
        self.assertEqual(rc, 0, second.stderr())
        self.assertEqual(os.listdir(first.tmpdir), [])

    def test_config_says_where_each_value_comes_from_and_which_secrets_are_set(self):
        shell = {k: v for k, v in os.environ.items()
                 if not k.startswith("TALLY_") and k != "BILLING_HMAC_SECRET"}
        shell.update(TALLY_TOOLS=DEMO_TOOLS, TALLY_TOPIC_PREFIX="acme.")
        out = run(binary("tally"), "config", env=shell)
        self.assertEqual(out.returncode, 0, out.stderr)
        text = out.stdout
        words = " ".join(text.split())
        # whose values these are, and how to see the dev workers' own
        self.assertIn("The settings of THIS shell", words)
        self.assertIn("Workers already running read their own environment", words)
        self.assertIn("`source` the env file it writes (tally dev --env-file PATH)", words)
        rows = {line.split()[0]: line.split() for line in text.splitlines()
                if line.startswith("TALLY_")}
        self.assertEqual(rows["TALLY_TOPIC_PREFIX"][1:3], ["acme.", "env"])
        self.assertEqual(rows["TALLY_KAFKA_BROKERS"][2], "default")
        # each tool's secret variable: set or not here, never its value
        self.assertRegex(text, r"charge_card +BILLING_HMAC_SECRET +connector\.secret_env +"
                               r"NOT SET")
        self.assertRegex(text, r"check_balance +\(no secret\)")
        shell["BILLING_HMAC_SECRET"] = "whsec_do_not_print_me"
        out = run(binary("tally"), "config", env=shell)
        self.assertRegex(out.stdout, r"charge_card +BILLING_HMAC_SECRET +connector\.secret_env +"
                                     r"set\n")
        self.assertNotIn("whsec_do_not_print_me", out.stdout)

    def test_full_stack_runs_supervises_and_stops_the_workers(self):
        self.assertTrue(os.path.exists(DEMO_TOOLS), DEMO_TOOLS)
        stack = self.start("--tools", DEMO_TOOLS)
        values = stack.wait_up()
        self.assertIn("TALLY_PG", values)
        self.assertIn("TALLY_KAFKA_BROKERS", values)
        # the env file names the registry the workers use, by its absolute path, so that
        # "another shell" (elsewhere, with only these values) plans with the same tools
        self.assertEqual(values.get("TALLY_TOOLS"), os.path.realpath(DEMO_TOOLS), values)
        self.assertIn(f"export TALLY_TOOLS={values['TALLY_TOOLS']}", stack.stdout())
        shell = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        shell.update(values)
        out = subprocess.run([binary("tally"), "compensate", "--run", str(uuid.uuid4()),
                              "--dry-run"], capture_output=True, text=True, timeout=60,
                             env=shell, cwd=stack.root)
        self.assertNotIn("does not load", out.stderr)
        self.assertNotIn("needs the tool registry", out.stdout + out.stderr)

        self.assert_ledger_tables(values["TALLY_PG"])
        self.assert_topics(values["TALLY_KAFKA_BROKERS"], values.get("TALLY_TOPIC_PREFIX",
                                                                        "tally."), 4)

        workers = wait_for(lambda: (lambda w: w if len(w) == len(WORKERS) else None)(
            self.worker_children(stack)), timeout=30, what="the three workers")
        self.assertEqual(sorted(workers), sorted(WORKERS))

        # each worker connects as its own role
        def sessions():
            out = run("psql", values["TALLY_PG_ADMIN"], "-XAtc",
                      "SELECT DISTINCT split_part(application_name, '/', 1) || ' ' || usename"
                      " FROM pg_stat_activity"
                      " WHERE application_name LIKE 'tally-%'")
            got = set(out.stdout.split("\n")) - {""}
            return got if len(got) >= len(WORKERS) else None
        got = wait_for(sessions, timeout=30, what="the workers' sessions")
        for w in WORKERS:
            self.assertIn(f"{w} {w.replace('-', '_')}", got)

        # the banner names each worker's metrics URL, and it answers
        banner = stack.stderr()
        self.assertIn("Ctrl-C to stop", banner)
        urls = re.findall(r"http://127\.0\.0\.1:\d+/metrics", banner)
        self.assertEqual(len(urls), len(WORKERS), banner)
        for url in urls:
            with urllib.request.urlopen(url, timeout=5) as r:
                self.assertEqual(r.status, 200)

        # a worker that dies is restarted, and tally dev says so
        old = workers["tally-reconciler"]
        os.kill(old, signal.SIGKILL)
        new = wait_for(lambda: (lambda p: p if p and p != old else None)(
            self.worker_children(stack).get("tally-reconciler")), timeout=30,
            what="tally-reconciler to be restarted")
        self.assertNotEqual(new, old)
        self.assertRegex(stack.stderr(), r"tally-reconciler \(pid \d+\) was killed by signal 9.*"
                                         r"restarting it")

        recorded = [identity(p) for p in descendants(stack.proc.pid)]
        recorded = [r for r in recorded if r]
        rc, took = stack.stop()
        self.assertEqual(rc, 0, stack.stderr()[-5000:])
        self.assertLess(took, 30)
        self.assert_nothing_left(stack, recorded)

    def test_the_console_runs_beside_the_workers_and_every_alert_links_to_it(self):
        tool = SilentTool()
        self.addCleanup(tool.close)
        with open(DEMO_TOOLS) as f:
            doc = json.load(f)
        doc["tools"].append({
            "name": "post_note", "owner": "support", "effect_class": "append_only",
            "operation_key": ["note_id"],
            "connector": {"type": "http", "base_url": f"http://127.0.0.1:{tool.port}",
                          "execute": {"method": "POST", "path": "/notes"},
                          "timeout_ms": 800, "receipt_ref": "/id"},
            "retry": {"max_attempts": 2, "backoff_ms": 100, "max_backoff_ms": 200}})
        tools = os.path.join(tempfile.mkdtemp(prefix="tally-test-dev-tools-"), "tools.json")
        self.addCleanup(shutil.rmtree, os.path.dirname(tools), True)
        with open(tools, "w") as f:
            json.dump(doc, f)

        stack = self.start("--tools", tools)
        values = stack.wait_up()
        url = values.get("TALLY_CONSOLE_URL", "")
        self.assertRegex(url, r"^http://127\.0\.0\.1:\d+$", values)
        self.assertIn(f"export TALLY_CONSOLE_URL={url}\n", stack.stdout())
        self.assertRegex(stack.stderr(), rf"(?m)^  console +{re.escape(url)}/ .*tally_reader")

        # it answers where it was printed, reading the ledger as the read-only role
        self.assertEqual(http_get(url + "/healthz")[0], 200)
        status, body = http_get(url + "/runs")
        self.assertEqual(status, 200)
        self.assertIn("<html", body.lower())
        (console,) = self.console_children(stack)
        self.assertEqual(_cmdline(console)[2:], ["--listen", url[len("http://"):]])
        out = run("psql", values["TALLY_PG_ADMIN"], "-XAtc",
                  "SELECT DISTINCT usename FROM pg_stat_activity"
                  " WHERE application_name LIKE 'tally-console/%'")
        self.assertEqual(out.stdout.split(), ["tally_reader"], out.stderr)

        # a STUCK effect raised in this stack: its alert links to its run in this console
        run_id = f"dev-console {uuid.uuid4().hex[:8]}"
        shell = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        shell.update(values)
        out = run(binary("tally"), "publish", "--run", run_id, "--step", "1", "--tool",
                  "post_note", "--args", json.dumps({"note_id": uuid.uuid4().hex, "text": "hi"}),
                  env=shell)
        self.assertEqual(out.returncode, 0, out.stderr)
        topic = values.get("TALLY_TOPIC_PREFIX", "tally.") + "alerts"

        def alert():
            got = run("kcat", "-b", values["TALLY_KAFKA_BROKERS"], "-C", "-t", topic,
                      "-o", "beginning", "-e", "-q", "-m", "10")
            for line in got.stdout.splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("data", {}).get("run_id") == run_id:
                    return ev
            return None
        ev = wait_for(alert, timeout=60, what=f"an alert of run {run_id} on {topic}")
        link = url + "/runs/" + urllib.parse.quote(run_id, safe="")
        self.assertEqual(ev["data"].get("console_url"), link, ev)
        status, body = http_get(link)
        self.assertEqual(status, 200)
        self.assertIn(run_id, body)

        # the console is supervised like a worker: killed, it comes back on the same address
        os.kill(console, signal.SIGKILL)
        new = wait_for(lambda: (lambda c: c[0] if c and c[0] != console else None)(
            self.console_children(stack)), timeout=30, what="the console to be restarted")
        self.assertRegex(stack.stderr(), r"tally console \(pid \d+\) was killed by signal 9.*"
                                         r"restarting it")
        wait_for(lambda: http_get(url + "/healthz")[0] == 200, timeout=30,
                 what="the restarted console to answer")
        self.assertNotEqual(new, console)

        recorded = [identity(p) for p in descendants(stack.proc.pid)]
        recorded = [r for r in recorded if r]
        rc, took = stack.stop()
        self.assertEqual(rc, 0, stack.stderr()[-5000:])
        self.assertLess(took, 30)
        self.assert_nothing_left(stack, recorded)
        self.assert_no_sanitizer_report(stack)

    def test_console_addr_places_the_console(self):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        stack = self.start("--tools", DEMO_TOOLS, "--console-addr", f"127.0.0.1:{port}")
        values = stack.wait_up()
        self.assertEqual(values.get("TALLY_CONSOLE_URL"), f"http://127.0.0.1:{port}", values)
        self.assertEqual(http_get(f"http://127.0.0.1:{port}/healthz")[0], 200)
        workers = wait_for(lambda: (lambda w: w if len(w) == len(WORKERS) else None)(
            self.worker_children(stack)), timeout=30, what="the three workers")
        for pid in workers.values():
            with open(f"/proc/{pid}/environ", "rb") as f:
                self.assertIn(f"TALLY_CONSOLE_URL=http://127.0.0.1:{port}\0".encode(), f.read())
        rc, _ = stack.stop()
        self.assertEqual(rc, 0, stack.stderr()[-5000:])
        self.assert_no_sanitizer_report(stack)

    def test_no_console_starts_none_and_links_nowhere(self):
        stack = self.start("--tools", DEMO_TOOLS, "--no-console")
        values = stack.wait_up()
        self.assertNotIn("TALLY_CONSOLE_URL", values)
        self.assertNotIn("TALLY_CONSOLE_URL", stack.stdout())
        self.assertIn("console     none (--no-console)", stack.stderr())
        workers = wait_for(lambda: (lambda w: w if len(w) == len(WORKERS) else None)(
            self.worker_children(stack)), timeout=30, what="the three workers")
        self.assertEqual(self.console_children(stack), [])
        for pid in workers.values():
            with open(f"/proc/{pid}/environ", "rb") as f:
                self.assertNotIn(b"TALLY_CONSOLE_URL=", f.read())
        rc, _ = stack.stop()
        self.assertEqual(rc, 0, stack.stderr()[-5000:])
        self.assert_no_sanitizer_report(stack)


if __name__ == "__main__":
    unittest.main(verbosity=2)
