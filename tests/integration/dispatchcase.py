"""Shared fixture of the dispatcher's integration tests (test_dispatch_*.py): the fake tool
service, dispatchers pointed at it, intents, fault rules and the fake's records."""

import json
import os
import re
import time
import urllib.request
import uuid

import tallytest
from invariants import check_invariants
from tallytest import TallyCase, wait_for

SECRET = "whsec_dispatch_tests"


class DispatchCase(TallyCase):
    """A TallyCase with tally-fake-tool running and helpers to drive dispatchers."""

    def setUp(self):
        super().setUp()
        port_file = os.path.join(self.tmp, "fake.port")
        self.fake_url = self.start_fake()

    def start_fake(self, *args, **env):
        """Start a tally-fake-tool; returns its base URL. With "--secret-env", "VAR" in
        args (and VAR in env) it checks every tool request's Tally-Signature."""
        port_file = os.path.join(self.tmp, f"fake-{uuid.uuid4().hex[:6]}.port")
        self.fake = self.start("tally-fake-tool", "--listen", "127.0.0.1:0", "--port-file",
                               port_file, *args, **env)

        def port():
            if not os.path.exists(port_file):
                return None
            with open(port_file) as f:
                return f.read().strip()
        wait_for(lambda: port() or not self.fake.alive(), timeout=20,
                 what="the fake tool's port file")
        self.assertTrue(self.fake.alive(), self.fake.log())
        return "http://127.0.0.1:" + port()

    # --- processes ----------------------------------------------------------------------

    def dispatcher(self, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
                "TALLY_POLL_MS": 200, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start("tally-dispatcher", **base)

    # --- the per-tool in-flight gauges ---------------------------------------------------

    def tool_inflight(self, proc, name):
        """{tool: value} of the per-tool in-flight gauge @name (tally_connector_inflight,
        tally_status_checks_inflight, tally_reverse_calls_inflight) on @proc's /metrics."""
        status, text = proc.http_get("/metrics")
        self.assertEqual(status, 200)
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^' + name + r'\{tool="([^"]+)"\} (\S+)$', text, re.M)}

    def wait_tool_inflight(self, proc, name, tool, value, timeout=30):
        """Wait until @proc's gauge @name shows @value calls to @tool in flight; returns that
        reading, {tool: value}."""
        def seen():
            got = self.tool_inflight(proc, name)
            return got if got.get(tool) == value else None
        return wait_for(seen, timeout=timeout, interval=0.05,
                        what=f"{name}{{tool={tool!r}}} == {value}")

    def assert_inflight_settled(self, proc, name, timeout=10):
        """Once the traffic settled, @proc's gauge @name is back to 0 for every tool of the
        registry (each declared from the start): an unbalanced gauge stays above 0."""
        with open(self.tools_file) as f:
            tools = {t["name"] for t in json.load(f)["tools"]}
        wait_for(lambda: set(self.tool_inflight(proc, name).values()) == {0}, timeout=timeout,
                 interval=0.1, what=f"every {name} back to 0")
        self.assertEqual(self.tool_inflight(proc, name), {t: 0 for t in tools})

    # --- the fake tool -----------------------------------------------------------------

    def fake_get(self, path):
        with urllib.request.urlopen(self.fake_url + path, timeout=10) as r:
            return json.loads(r.read())

    def fake_post(self, path, body):
        req = urllib.request.Request(self.fake_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"},
                                     method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"null")

    def fault(self, fault, key="*", collection="*", op="execute", times=1, **kw):
        rule = {"collection": collection, "op": op, "key": key, "fault": fault, "times": times}
        rule.update(kw)
        return self.fake_post("/_control/faults", rule)

    def records(self, collection=None):
        q = f"?collection={collection}" if collection else ""
        return self.fake_get("/_control/records" + q)["records"]

    def requests(self, key=None, op="execute"):
        reqs = self.fake_get("/_control/requests")
        reqs = reqs["requests"] if isinstance(reqs, dict) else reqs
        return [r for r in reqs if (key is None or r.get("idempotency_key") == key)
                and (op is None or r.get("op") == op)]

    # --- intents and the ledger --------------------------------------------------------

    def publish(self, ce):
        """Publish one CloudEvent (dict) or raw bytes to the intents topic; key = run_id."""
        key = ce["data"]["run_id"] if isinstance(ce, dict) else None
        self.produce("intents", ce, key=key)
        return ce

    def publish_many(self, ces):
        p = self.producer()
        errors = []
        for ce in ces:
            p.produce(self.topic("intents"), value=json.dumps(ce).encode(),
                      key=ce["data"]["run_id"],
                      on_delivery=lambda err, msg: err and errors.append(err))
            p.poll(0)
        p.flush(60)
        self.assertFalse(errors, f"produce failed: {errors[:3]}")

    def effect(self, tool, key):
        rows = self.query("SELECT effect_id::text, status, attempts, receipt, external_ref,"
                          " error_code, error_message FROM effects"
                          " WHERE tool = %s AND operation_key = %s", (tool, key))
        if not rows:
            return None
        cols = ("effect_id", "status", "attempts", "receipt", "external_ref", "error_code",
                "error_message")
        return dict(zip(cols, rows[0]))

    def wait_status(self, tool, key, statuses, timeout=60):
        if isinstance(statuses, str):
            statuses = (statuses,)

        def ok():
            e = self.effect(tool, key)
            return e if e and e["status"] in statuses else None
        return wait_for(ok, timeout=timeout,
                        what=f"{tool} {key!r} to reach {statuses}")

    def wait_count(self, sql, n, params=None, timeout=60):
        return wait_for(lambda: self.scalar(sql, params) == n, timeout=timeout,
                        what=f"{sql!r} = {n}")

    def outcomes_for(self, intent_ids, timeout=60):
        """Read tally.outcomes until every intent id has an answer; {intent_id: [events]}."""
        want = set(intent_ids)

        def done(got):
            seen = {m.get("data", {}).get("intent_id") for m in got}
            return want <= seen
        got = self.read_until("outcomes", done, timeout=timeout)
        out = {}
        for m in got:
            out.setdefault(m.get("data", {}).get("intent_id"), []).append(m)
        return out

    def invariants(self, **kw):
        check_invariants(self, fake_url=self.fake_url, **kw)


def run_id():
    return "run-" + uuid.uuid4().hex[:12]


def main():
    tallytest.main()
