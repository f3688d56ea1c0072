"""The fixture of tally's integration tests: real binaries as separate processes, a real
PostgreSQL and the embedded Kafka (librdkafka's mock cluster over localhost TCP).

Each test case gets its own database and its own topic prefix, so test modules can run in
parallel against one stack. scripts/test.sh starts that stack once (`tally dev --no-workers`)
and exports TALLY_TEST_PG (a conninfo for the maintenance database, as the superuser) and
TALLY_TEST_KAFKA. A module run on its own starts a stack for itself and stops it at exit.

Every process runs under its own database role, as in production (docs/operations.md,
"Database roles"): the test's database is owned by the stack's owner role, which runs
`tally migrate`; each worker connects as its role, and `tally VERB` as the operator when the
verb changes the ledger, as the reader otherwise. Only the test itself (self.db, query, force)
connects as the superuser, to look and to break things on purpose.
"""

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request
import uuid

import psycopg2
import psycopg2.extensions
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

import invariants

SOURCE_DIR = os.environ.get(
    "TALLY_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
BUILD_DIR = os.environ.get("TALLY_BUILD_DIR", os.path.join(SOURCE_DIR, "build"))

TOPICS = ("intents", "outcomes", "obligations", "alerts", "dlq")

# The roles `tally dev` and `tally migrate` create (their default names).
OWNER_ROLE = "tally_owner"
ROLES = {"dispatcher": "tally_dispatcher", "reconciler": "tally_reconciler",
         "compensator": "tally_compensator", "operator": "tally_operator",
         "reader": "tally_reader"}
# The role each program runs as; a tally verb not named here runs as the reader, so a verb
# that changes the ledger and was forgotten here fails loudly.
PROGRAM_ROLES = {"tally-dispatcher": "dispatcher", "tally-reconciler": "reconciler",
                 "tally-compensator": "compensator"}
# verify: --tools takes slots of the tools' budget (tool_pacing) and --file-findings writes
OPERATOR_VERBS = {"resolve", "approve", "deny", "compensate", "cancel", "forget", "prune",
                  "run", "verify"}
OWNER_VERBS = {"migrate"}


def binary(name):
    """Path of a built program: tally, tally-dispatcher, ..., or a fake under tests/fakes."""
    for cand in (os.path.join(BUILD_DIR, name), os.path.join(BUILD_DIR, "tests", "fakes", name)):
        if os.path.exists(cand):
            return cand
    raise FileNotFoundError(f"{name} is not built under {BUILD_DIR}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout=30.0, interval=0.05, what="condition"):
    """Poll predicate() until it returns a truthy value; return it, or fail after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Stack:
    """The shared PostgreSQL server and Kafka cluster."""

    _instance = None

    def __init__(self):
        self.proc = None
        self.pg = os.environ.get("TALLY_TEST_PG")
        self.kafka = os.environ.get("TALLY_TEST_KAFKA")
        if not (self.pg and self.kafka):
            self._start_own()

    @classmethod
    def get(cls):
        if cls._instance is None:
            cls._instance = Stack()
        return cls._instance

    def _start_own(self):
        self.tmp = tempfile.mkdtemp(prefix="tally-test-stack-")
        env_file = os.path.join(self.tmp, "env")
        log = open(os.path.join(self.tmp, "dev.log"), "w")
        env = dict(os.environ)
        env.pop("TALLY_PG", None)
        self.proc = subprocess.Popen(
            [binary("tally"), "dev", "--no-workers", "--env-file", env_file],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        atexit.register(self.stop)
        wait_for(lambda: os.path.exists(env_file) and os.path.getsize(env_file) > 0
                 or self.proc.poll() is not None, timeout=120, what="tally dev to start")
        if self.proc.poll() is not None:
            raise RuntimeError("tally dev exited early:\n" + open(log.name).read())
        time.sleep(0.1)
        values = {}
        with open(env_file) as f:
            for line in f:
                line = line.strip()
                if line.startswith("export "):
                    k, _, v = line[len("export "):].partition("=")
                    values[k] = _unquote(v)
        self.pg = values["TALLY_PG_ADMIN"]
        self.kafka = values["TALLY_KAFKA_BROKERS"]

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _unquote(v):
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
        return v[1:-1]
    return v


class Proc:
    """A tally process started by a test; its stderr (JSON lines) is kept in a log file."""

    def __init__(self, name, args, env, logdir):
        self.name = name
        self.log_path = os.path.join(logdir, f"{name}-{uuid.uuid4().hex[:6]}.log")
        self._log = open(self.log_path, "w")
        self.popen = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.metrics_port = None

    @property
    def pid(self):
        return self.popen.pid

    def alive(self):
        return self.popen.poll() is None

    def terminate(self, timeout=30):
        """SIGTERM and wait; returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"{self.name} did not exit within {timeout}s of SIGTERM")

    def kill(self):
        """SIGKILL, as a crash would."""
        if self.alive():
            self.popen.kill()
        self.popen.wait()

    def close(self):
        if not self._log.closed:
            self._log.close()

    def log(self):
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_lines(self):
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def http_get(self, path, timeout=5):
        """(status, body) of GET http://127.0.0.1:<metrics port><path>."""
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


class TallyCase(unittest.TestCase):
    """A test case with its own database, topic prefix, processes and Kafka clients."""

    tools_file = os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")
    migrate = True

    def setUp(self):
        self.stack = Stack.get()
        self.tmp = tempfile.mkdtemp(prefix=f"tally-{self._testMethodName[:20]}-")
        self.dbname = "t_" + uuid.uuid4().hex[:12]
        # Not `with connect(...)`: psycopg2 wraps that block in a transaction, and CREATE
        # DATABASE cannot run inside one.
        admin = psycopg2.connect(self.stack.pg)
        try:
            admin.autocommit = True
            with admin.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{self.dbname}" OWNER {OWNER_ROLE}')
        finally:
            admin.close()
        self.pg = psycopg2.extensions.make_dsn(self.stack.pg, dbname=self.dbname)
        self.prefix = f"t{uuid.uuid4().hex[:8]}."
        self.procs = []
        self._consumers = []
        self._producer = None
        self.db = psycopg2.connect(self.pg)
        self.db.autocommit = True
        if self.migrate:
            out = self.cli("migrate")
            self.assertEqual(out.returncode, 0, out.stderr)
        self.ensure_topics()

    def tearDown(self):
        failed = self._outcome_failed()
        try:
            self._check_transitions(failed)
        finally:
            self._stop_all(failed)

    def _check_transitions(self, failed):
        """Every test checks the audit trail's moves against the machines (invariants.py);
        after its processes stop, so that nothing is written behind the check."""
        if failed:
            return
        self._terminate_all()
        try:
            if self.db.closed:
                self.db = psycopg2.connect(self.pg)
                self.db.autocommit = True
            invariants.check_transitions(self)
        except psycopg2.Error:
            # a test that stopped PostgreSQL or dropped its database: reconnect once
            try:
                self.db.close()
                self.db = psycopg2.connect(self.pg)
                self.db.autocommit = True
            except psycopg2.Error:
                return  # the database is gone on purpose: nothing to check
            invariants.check_transitions(self)

    def _terminate_all(self):
        for p in self.procs:
            if p.alive():
                try:
                    p.terminate(timeout=30)
                except AssertionError:
                    pass

    def _stop_all(self, failed):
        self._terminate_all()
        for p in self.procs:
            if failed:
                sys.stderr.write(f"\n----- log of {p.name} (pid {p.pid}) -----\n")
                sys.stderr.write(p.log()[-20000:])
            p.close()
        for c in self._consumers:
            c.close()
        if self._producer is not None:
            self._producer.flush(5)
        self.db.close()

    def _outcome_failed(self):
        outcome = getattr(self, "_outcome", None)
        if outcome is None:
            return False
        result = getattr(outcome, "result", None)
        if result is not None:
            return bool(result.failures or result.errors)
        return any(err for _, err in getattr(outcome, "errors", []))

    # --- processes -------------------------------------------------------------------

    def pg_as(self, role):
        """A conninfo for the test's database as @role: "owner", a component ("dispatcher",
        "operator", ...), or "admin" (the superuser, as self.db)."""
        if role == "admin":
            return self.pg
        user = OWNER_ROLE if role == "owner" else ROLES[role]
        return psycopg2.extensions.make_dsn(self.pg, user=user)

    def env(self, **extra):
        """The environment a tally process of this test runs with. TALLY_PG is the operator's
        conninfo; cli() and start() put the verb's or the program's role in its place unless
        the caller set TALLY_PG itself."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        env.update({
            "TALLY_PG": self.pg_as("operator"),
            "TALLY_KAFKA_BROKERS": self.stack.kafka,
            "TALLY_TOPIC_PREFIX": self.prefix,
            "TALLY_TOOLS": self.tools_file,
            "TALLY_SESSION_TIMEOUT_MS": "6000",
            "TALLY_KAFKA_HEARTBEAT_INTERVAL_MS": "500",
            # the mock broker holds an empty fetch for the whole fetch.wait.max.ms (500 ms by
            # default) even when data arrives meanwhile; keep the embedded stack's latency low
            "TALLY_KAFKA_FETCH_WAIT_MAX_MS": "10",
            "TALLY_LOG_LEVEL": "debug",
        })
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def _as_role(self, env, role):
        """@env with TALLY_PG as @role, unless the caller chose another TALLY_PG."""
        if env.get("TALLY_PG") == self.pg_as("operator"):
            env = dict(env, TALLY_PG=self.pg_as(role))
        return env

    @staticmethod
    def verb_role(args):
        """The role `tally ARGS...` runs as: the owner migrates, the operator changes the
        ledger, the reader does the rest (an unknown verb too: a forgotten mapping fails)."""
        verb = next((a for a in args if not a.startswith("-")), "")
        if verb in OWNER_VERBS:
            return "owner"
        return "operator" if verb in OPERATOR_VERBS else "reader"

    def start_prometheus(self, targets, **config):
        """Debian's prometheus scraping {job: host:port} every second, with @config added to
        its configuration's top level (rule_files=[...]); its log is prometheus.log in the
        test's directory. Returns (process, base URL); stopped at cleanup."""
        import yaml  # Debian's python3-yaml; only the tests that run Prometheus need it
        port = free_port()
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
               "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]}
                                  for job, t in targets.items()],
               **config}
        path = os.path.join(self.tmp, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        log = open(os.path.join(self.tmp, "prometheus.log"), "w")
        proc = subprocess.Popen(
            ["prometheus", f"--config.file={path}",
             f"--storage.tsdb.path={os.path.join(self.tmp, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT)

        def stop():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            log.close()
        self.addCleanup(stop)
        return proc, f"http://127.0.0.1:{port}"

    def cli(self, *args, input=None, env=None, timeout=120):
        """Run `tally ARGS...` under its verb's role (verb_role); returns the CompletedProcess
        (text)."""
        env = self._as_role(env or self.env(), self.verb_role(args))
        return subprocess.run([binary("tally"), *args], input=input, capture_output=True,
                              text=True, env=env, timeout=timeout)

    def start(self, name, *args, wait_ready=True, **extra_env):
        """Start a binary (tally-dispatcher, tally-fake-tool, ...) with this test's env; a
        worker connects as its own role."""
        port = free_port()
        env = self.env(TALLY_METRICS_ADDR=f"127.0.0.1:{port}", **extra_env)
        if name in PROGRAM_ROLES:
            env = self._as_role(env, PROGRAM_ROLES[name])
        p = Proc(name, [binary(name), *args], env, self.tmp)
        p.metrics_port = port
        self.procs.append(p)
        if wait_ready and name.startswith("tally-") and not name.startswith("tally-fake"):
            wait_for(lambda: not p.alive() or self._healthy(p), timeout=60,
                     what=f"{name} /healthz")
            self.assertTrue(p.alive(), f"{name} exited early:\n{p.log()}")
        return p

    @staticmethod
    def _healthy(p):
        try:
            return p.http_get("/healthz", timeout=1)[0] == 200
        except OSError:
            return False

    # --- PostgreSQL ------------------------------------------------------------------

    def query(self, sql, params=None):
        with self.db.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def scalar(self, sql, params=None):
        rows = self.query(sql, params)
        return rows[0][0] if rows else None

    def force(self, sql, params=None):
        """Run @sql with the ledger's triggers off (session_replication_role = replica; the
        test's own connection is the superuser's, no tally process's): a move the state machines refuse, made on purpose to see
        how the workers take a ledger someone broke by hand. The NOTIFY triggers are off too.
        Record such a move in the audit trail, if at all, with kind 'test_reset' and the
        states in data: it is no move of any machine."""
        with self.db.cursor() as cur:
            cur.execute("SET session_replication_role = replica")
            try:
                cur.execute(sql, params)
                return cur.fetchall() if cur.description else []
            finally:
                cur.execute("SET session_replication_role = origin")

    def admin(self, sql, params=None):
        """Run SQL on the server's maintenance database, outside the test's own (which
        PostgreSQL will not, for one, close to connections while connected to it)."""
        admin = psycopg2.connect(self.stack.pg)
        try:
            admin.autocommit = True
            with admin.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall() if cur.description else []
        finally:
            admin.close()

    def terminate_backends(self):
        """Terminate every connection to the test's database but the test's own, as a
        database restart would; returns how many there were."""
        return len(self.admin(
            "WITH workers AS MATERIALIZED (SELECT pid FROM pg_stat_activity"
            "  WHERE datname = %s AND pid <> %s)"
            " SELECT pid FROM workers WHERE pg_terminate_backend(pid)",
            (self.dbname, self.db.get_backend_pid())))

    # --- Kafka -----------------------------------------------------------------------

    def topic(self, logical):
        return self.prefix + logical

    def ensure_topics(self):
        p = self.producer()
        for t in TOPICS:
            md = p.list_topics(topic=self.topic(t), timeout=10)
            err = md.topics[self.topic(t)].error
            if err is not None and err.code() != KafkaError.LEADER_NOT_AVAILABLE:
                raise AssertionError(f"topic {self.topic(t)}: {err}")

    def producer(self):
        if self._producer is None:
            self._producer = Producer({"bootstrap.servers": self.stack.kafka,
                                       "enable.idempotence": True})
        return self._producer

    def produce(self, logical, value, key=None):
        """Produce raw bytes (or a dict, as JSON) to a topic and wait for the ack."""
        if isinstance(value, (dict, list)):
            value = json.dumps(value).encode()
        elif isinstance(value, str):
            value = value.encode()
        errors = []
        self.producer().produce(self.topic(logical), value=value, key=key,
                                on_delivery=lambda err, msg: err and errors.append(err))
        self.producer().flush(10)
        self.assertFalse(errors, f"produce failed: {errors}")

    def intent(self, run_id, step, tool, args, **data):
        """A tally.intent.v1 CloudEvent as a dict."""
        d = {"run_id": run_id, "step": step, "tool": tool, "args": args}
        d.update(data)
        return {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/" + self.id(),
                "type": "tally.intent.v1", "datacontenttype": "application/json", "data": d}

    def reader(self, logical):
        """A consumer that reads a topic from the beginning, outside any group tally uses."""
        c = Consumer({"bootstrap.servers": self.stack.kafka,
                      "group.id": "test-reader-" + uuid.uuid4().hex,
                      "enable.auto.commit": False})
        md = c.list_topics(topic=self.topic(logical), timeout=10)
        parts = md.topics[self.topic(logical)].partitions
        c.assign([TopicPartition(self.topic(logical), p, 0) for p in parts])
        self._consumers.append(c)
        return c

    def read_until(self, logical, predicate, timeout=30, reader=None):
        """Read JSON messages from a topic until predicate(list_of_values) is true."""
        c = reader or self.reader(logical)
        got = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None or m.error():
                if predicate(got):
                    return got
                continue
            try:
                got.append(json.loads(m.value()))
            except ValueError:
                got.append({"_raw": m.value()})
            if predicate(got):
                return got
        raise AssertionError(f"timed out reading {self.topic(logical)}; got {len(got)}: "
                             f"{json.dumps(got)[:2000]}")


def main():
    unittest.main(verbosity=2)
