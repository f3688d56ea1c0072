"""deploy/grafana/dashboards/tally.json, the Grafana dashboard (issue 25).

Grafana itself is not packaged for Debian, so it does not run here; what a panel shows is its
PromQL, and that is tested against a real Prometheus:

- DashboardFileTest (no services): every panel has a title, a unique id, the data source
  variable and at least one target; every variable a query uses is defined or a Grafana
  built-in; the core panels exist.
- DashboardQueriesTest: the three workers on the embedded stack with the fake tool; traffic
  that makes each kind of data (confirmed calls, a failed call, an UNKNOWN the reconciler
  resolves, a STUCK effect, a compensated run, a STUCK obligation, a dead letter); Debian's
  Prometheus scraping the workers every second. Every metric the dashboard names is on some
  worker's /metrics, the tool variable lists the tools; every target, with Grafana's
  variables substituted, is evaluated through /api/v1/query and must parse, and the core
  panels must return data that shows the traffic. A failure names the panel and the query.
  With Debian's chromium installed, the core panels' queries are drawn by Prometheus' own
  graph page and screenshotted into $TALLY_BUILD_DIR/artifacts/dashboard/.
"""

import calendar
import json
import math
import os
import re
import shutil
import subprocess
import time
import unittest
import urllib.parse
import urllib.request

from tallytest import BUILD_DIR, SOURCE_DIR, wait_for
from test_cli_status import CliCase, main, run_id

DASHBOARD = os.path.join(SOURCE_DIR, "deploy", "grafana", "dashboards", "tally.json")
ARTIFACTS = os.path.join(BUILD_DIR, "artifacts", "dashboard")
WORKERS = ("dispatcher", "reconciler", "compensator")

# The panels an on-call engineer reads first: each must return data on a stack with traffic.
CORE = (
    "STUCK effects", "STUCK obligations", "Oldest STUCK", "UNKNOWN effects", "Oldest UNKNOWN",
    "Obligations past deadline",
    "Intake per second, by result", "Answers per second, by tool and outcome",
    "Live effects by state",
    "Answer latency (connector call), by tool", "Dispatch latency (claim to recorded outcome)",
    "Calls in flight, by tool", "Calls in flight, by worker",
    "Obligations by state", "Obligations past and near their deadline",
    "Relay lag (age of the oldest outbox row)", "Consumer lag (messages not yet read), by worker",
)
# Panels whose values are quantiles: data means at least one number, not only NaN.
QUANTILES = ("Answer latency (connector call), by tool",
             "Dispatch latency (claim to recorded outcome)", "Obligation drain time")

# Grafana's built-in variables, as the test substitutes them (a 1 s scrape interval here;
# Grafana makes $__rate_interval at least four scrape intervals).
BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m",
            "__range_s": "300", "__interval_ms": "15000"}


def load_dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def query_panels(dash):
    """Every panel that queries (rows hold none), including those inside collapsed rows."""
    out = []
    for p in dash["panels"]:
        if p.get("type") == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def variables(dash):
    """{name: value the test substitutes}: a multi-value variable with "All" is its allValue."""
    out = {}
    for v in dash["templating"]["list"]:
        out[v["name"]] = v.get("allValue") or ".*"
    return out


def substitute(expr, values):
    """@expr with $name, ${name} and ${name:fmt} replaced; KeyError for an unknown one."""
    def repl(m):
        return values[m.group(1) or m.group(2)]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def rfc3339(stamp):
    """Seconds since the epoch of Prometheus' time stamps (nanoseconds, Z or an offset)."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|([+-])(\d\d):(\d\d))",
                     stamp)
    t = calendar.timegm(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) + float(m.group(2) or 0)
    if m.group(4):
        t -= (1 if m.group(4) == "+" else -1) * (int(m.group(5)) * 3600 + int(m.group(6)) * 60)
    return t


def metric_names(expr):
    """The tally_* metric names a PromQL expression reads."""
    return set(re.findall(r"\btally_[a-z0-9_]+", expr))


class DashboardFileTest(unittest.TestCase):

    def test_panels_are_well_formed(self):
        dash = load_dashboard()
        self.assertEqual(dash["schemaVersion"], 39, "Grafana 10.4's dashboard schema")
        self.assertTrue(dash["uid"] and dash["title"])
        ds_vars = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
        self.assertEqual([(v["name"], v["query"]) for v in ds_vars],
                         [("DS_PROMETHEUS", "prometheus")])
        ids = [p["id"] for p in dash["panels"]] + [
            c["id"] for p in dash["panels"] if p.get("type") == "row" for c in p["panels"]]
        self.assertEqual(len(ids), len(set(ids)), "panel ids are unique")
        values = dict(variables(dash), **BUILTINS)
        panels = query_panels(dash)
        self.assertGreaterEqual(len(panels), len(CORE))
        titles = [p.get("title") for p in panels]
        self.assertEqual(len(titles), len(set(titles)), "panel titles are unique")
        for title in CORE:
            self.assertIn(title, titles)
        for p in panels:
            with self.subTest(panel=p.get("title")):
                self.assertTrue(p.get("title"), f"panel {p['id']} has no title")
                self.assertIn(p["type"], ("stat", "timeseries", "gauge", "table", "bargauge"))
                self.assertEqual(p.get("datasource"),
                                 {"type": "prometheus", "uid": "${DS_PROMETHEUS}"})
                self.assertTrue(p.get("targets"), "at least one target")
                g = p["gridPos"]
                self.assertLessEqual(g["x"] + g["w"], 24)
                self.assertTrue(p.get("description"), "a description for the on-call")
                refs = [t["refId"] for t in p["targets"]]
                self.assertEqual(len(refs), len(set(refs)))
                for t in p["targets"]:
                    self.assertTrue(t.get("expr"))
                    self.assertEqual(t.get("datasource"), p["datasource"])
                    substitute(t["expr"], values)  # KeyError: an undefined variable
                    self.assertTrue(metric_names(t["expr"]) or "up{" in t["expr"], t["expr"])


class DashboardQueriesTest(CliCase):

    def compensator(self):
        return self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                          BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                          TALLY_SWEEP_MS=300)

    def http_json(self, url):
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)

    def scraped_after(self, base, t):
        """Every target's last scrape started after @t (seconds since the epoch) and was up."""
        try:
            targets = self.http_json(base + "/api/v1/targets")["data"]["activeTargets"]
        except OSError:
            return False  # not listening yet
        for x in targets:
            last = x.get("lastScrape", "")
            if x["health"] != "up" or not last.startswith("20"):
                return False
            if rfc3339(last) <= t:
                return False
        return bool(targets)

    def wait_two_scrapes(self, base):
        for _ in range(2):
            t = time.time()
            wait_for(lambda: self.scraped_after(base, t), timeout=20, interval=0.2,
                     what="a scrape of every worker")

    def evaluate(self, base, expr):
        url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            return self.http_json(url)
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"{}") or {"status": "error", "error": str(e)}

    def wait_prometheus(self, base, expr, timeout=30):
        """Wait until Prometheus answers @expr with a series whose value is above 0, as a
        dashboard would show it."""
        def ok():
            r = self.evaluate(base, expr)
            return r.get("status") == "success" and any(
                float(x["value"][1]) > 0 for x in r["data"]["result"])
        wait_for(ok, timeout=timeout, interval=0.5, what=f"Prometheus to answer {expr} > 0")

    def warm_up(self, base):
        """A first call of each tool the traffic uses, scraped before the traffic: a tool's
        latency histogram appears with its first call, which rate() cannot see (it needs a
        sample before the increase), as on any stack that has run a while."""
        run = run_id()
        key = self.charge(run, 1)[0]
        self.publish(self.intent(run, 2, "post_note", {"note_id": f"{run}-n", "text": "hi"}))
        self.wait_status("charge_card", key, "CONFIRMED", timeout=30)
        self.wait_status("post_note", f"post_note:{run}-n", "CONFIRMED", timeout=30)
        self.wait_two_scrapes(base)

    def drive_traffic(self):
        """Each kind of data the dashboard shows, made by the real workers."""
        confirmed_run, failing_run, unknown_run, comp_run, stuck_run = (run_id()
                                                                         for _ in range(5))
        keys = [self.charge(confirmed_run, s)[0] for s in (1, 2, 3)]
        self.fault("error_4xx", key=f"charge_card:t1:{failing_run}-p1", status=422)
        failed_key = self.charge(failing_run, 1)[0]
        self.fault("apply_then_hang", key=f"charge_card:t1:{unknown_run}-p1", delay_ms=3000)
        unknown_key = self.charge(unknown_run, 1)[0]
        comp_key = self.charge(comp_run, 1)[0]
        # a hold whose release the tool refuses (412): its obligation goes STUCK
        self.fault("reverse_412", collection="holds", op="reverse", times=-1)
        self.publish(self.intent(stuck_run, 1, "create_hold", {"hold_id": f"{stuck_run}-h",
                                                               "amount": 2}))
        self.produce("intents", b"this is not a CloudEvent")           # a dead letter
        stuck_effect, _ = self.stuck_note(run_id())                     # UNKNOWN, then STUCK
        for k in keys:
            self.wait_status("charge_card", k, "CONFIRMED", timeout=30)
        self.wait_status("charge_card", failed_key, "FAILED", timeout=30)
        self.wait_status("charge_card", unknown_key, "CONFIRMED", timeout=40)
        self.wait_status("charge_card", comp_key, "CONFIRMED", timeout=30)
        self.wait_status("create_hold", f"create_hold:{stuck_run}-h", "CONFIRMED", timeout=30)
        for run in (comp_run, stuck_run):
            self.publish({"specversion": "1.0", "id": run_id(), "source": "tests/" + self.id(),
                          "type": "tally.compensate_run.v1",
                          "datacontenttype": "application/json",
                          "data": {"run_id": run, "reason": "the dashboard test"}})
        wait_for(lambda: self.scalar("SELECT status FROM obligations WHERE run_id = %s",
                                     (comp_run,)) == "RESOLVED",
                 timeout=40, what="the compensated run's obligation RESOLVED")
        wait_for(lambda: self.scalar("SELECT status FROM runs WHERE run_id = %s",
                                     (comp_run,)) == "COMPENSATED",
                 timeout=30, what="the run COMPENSATED")
        wait_for(lambda: self.scalar("SELECT status FROM obligations WHERE run_id = %s",
                                     (stuck_run,)) == "STUCK",
                 timeout=40, what="the refused release's obligation STUCK")
        self.assertEqual(self.scalar("SELECT status FROM effects WHERE effect_id = %s",
                                     (stuck_effect,)), "STUCK")
        return stuck_effect

    def test_every_panel_query_runs_and_the_core_panels_show_the_traffic(self):
        dash = load_dashboard()
        self.dispatcher()
        self.reconciler()
        self.compensator()
        workers = {p.name: p for p in self.procs if p.name.startswith("tally-")
                   and not p.name.startswith("tally-fake")}
        self.assertEqual(set(workers), {f"tally-{w}" for w in WORKERS})
        # The counters the traffic panels rate exist at 0 before the first event, which
        # rate() could not see otherwise (a tool's first failure since the start). A worker
        # answers /healthz before its loop declares its metrics: wait for them.
        d, r, c = (workers[f"tally-{w}"] for w in WORKERS)
        zeros = [(d, "tally_connector_calls_total", f'{{tool="{tool}",outcome="{outcome}"}}')
                 for tool in ("charge_card", "post_note")
                 for outcome in ("confirmed", "failed", "retry", "unknown", "not_started")]
        zeros += [(d, "tally_intents_total", '{result="created"}'),
                  (d, "tally_dlq_total", '{reason="not_json"}'),
                  (r, "tally_reconciler_resolutions_total", '{outcome="confirmed"}'),
                  (c, "tally_compensations_total", '{tool="charge_card",outcome="RESOLVED"}'),
                  (c, "tally_runs_settled_total", '{status="COMPENSATED"}')]
        # and so do the per-tool in-flight gauges, for every tool of the registry
        zeros += [(p, name, f'{{tool="{tool}"}}') for p, name in (
                      (d, "tally_connector_inflight"), (r, "tally_status_checks_inflight"),
                      (c, "tally_reverse_calls_inflight"))
                  for tool in ("charge_card", "create_hold", "post_note")]
        def missing():
            return [f"{p.name} {n}{l}" for p, n, l in zeros if self.metric(p, n, l) is None]
        try:
            wait_for(lambda: not missing(), timeout=30, interval=0.2,
                     what="the workers' metrics declared")
        except AssertionError:
            self.fail(f"not declared: {missing()}")
        for p, name, labels in zeros:
            self.assertEqual(self.metric(p, name, labels), 0, f"{p.name} {name}{labels}")
        self.prom_log = os.path.join(self.tmp, "prometheus.log")
        self.prom, base = self.start_prometheus(
            {name: f"127.0.0.1:{p.metrics_port}" for name, p in workers.items()},
            rule_files=[os.path.join(SOURCE_DIR, "deploy", "prometheus", "alerts.yml")])
        wait_for(lambda: self.prom.poll() is None and self.scraped_after(base, 0), timeout=60,
                 interval=0.5, what="prometheus scraping the three workers")
        self.warm_up(base)
        self.drive_traffic()
        # The gauges the workers refresh every few seconds (effects by state every 5 s,
        # consumer lag every 10 s) show it.
        self.wait_prometheus(base, 'tally_effects{state="STUCK"}')
        self.wait_prometheus(base, "tally_stuck_oldest_age_seconds")
        self.wait_prometheus(base, "tally_stuck_obligations_oldest_age_seconds")
        self.wait_prometheus(base, "count(tally_kafka_consumer_lag) + 1")
        self.wait_two_scrapes(base)

        # Every metric the dashboard reads is exported by some worker (catches typos); a
        # histogram's series are its _bucket, _sum and _count.
        exported = set()
        for p in workers.values():
            status, body = p.http_get("/metrics")
            self.assertEqual(status, 200)
            for line in body.splitlines():
                m = re.match(r"# TYPE (tally_\w+) (\w+)", line)
                if m:
                    exported.add(m.group(1))
                    if m.group(2) == "histogram":
                        exported |= {m.group(1) + s for s in ("_bucket", "_sum", "_count")}
                elif line.startswith("tally_"):
                    exported.add(re.match(r"[a-z_0-9]+", line).group(0))
        panels = query_panels(dash)
        used = set()
        for p in panels:
            for t in p["targets"]:
                used |= {(n, p["title"]) for n in metric_names(t["expr"])}
        unknown = sorted(f"{n} (panel {title!r})" for n, title in used if n not in exported)
        self.assertFalse(unknown, "the dashboard reads metrics no worker exports: " +
                         ", ".join(unknown))

        # The query variables' values (Grafana's label_values(metric, label)) exist.
        options = {}
        for v in dash["templating"]["list"]:
            if v["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", v["query"])
            self.assertTrue(m, f"variable {v['name']}: {v['query']}")
            options[v["name"]] = self.http_json(
                f"{base}/api/v1/label/{m.group(2)}/values?" +
                urllib.parse.urlencode({"match[]": m.group(1)}))["data"]
            self.assertTrue(options[v["name"]], f"variable {v['name']} has no values")
        self.assertIn("charge_card", options["tool"])

        # Every target parses and runs; the core panels have data.
        values = dict(variables(dash), **BUILTINS)
        results, problems = {}, []
        for p in panels:
            series = []
            for t in p["targets"]:
                expr = substitute(t["expr"], values)
                r = self.evaluate(base, expr)
                results[f"{p['title']} [{t['refId']}]"] = {"expr": expr, "response": r}
                if r.get("status") != "success":
                    problems.append(f"panel {p['title']!r}: {expr}\n    {r.get('error')}")
                    continue
                series += r["data"]["result"]
            if p["title"] in CORE and not series:
                problems.append(f"core panel {p['title']!r} returned no data: " +
                                " | ".join(substitute(t["expr"], values) for t in p["targets"]))
            if p["title"] in QUANTILES and not any(
                    math.isfinite(float(s["value"][1])) for s in series):
                problems.append(f"latency panel {p['title']!r} has only NaN: {series}")
        os.makedirs(ARTIFACTS, exist_ok=True)
        with open(os.path.join(ARTIFACTS, "queries.json"), "w") as f:
            json.dump(results, f, indent=1)
        self.assertFalse(problems, "\n".join(problems))

        # The numbers the on-call engineer would read off the core panels.
        def val(title, ref="A", **labels):
            got = results[f"{title} [{ref}]"]["response"]["data"]["result"]
            return sum(float(s["value"][1]) for s in got
                       if all(s["metric"].get(k) == v for k, v in labels.items()))
        self.assertEqual(val("STUCK effects"), 1)
        self.assertGreater(val("Oldest STUCK", "A"), 0)
        self.assertEqual(val("STUCK obligations"), 1)
        self.assertGreater(val("Oldest STUCK", "B"), 0)
        self.assertEqual(val("UNKNOWN effects"), 0, "the UNKNOWN was resolved")
        self.assertGreater(val("Intake per second, by result", result="created"), 0)
        self.assertGreater(val("Answers per second, by tool and outcome", tool="charge_card",
                               outcome="confirmed"), 0)
        self.assertGreater(val("Answers per second, by tool and outcome", tool="charge_card",
                               outcome="failed"), 0)
        self.assertGreater(val("Error rate by tool (share of calls not confirmed)",
                               tool="charge_card"), 0)
        self.assertEqual(val("Live effects by state", state="STUCK"), 1)
        self.assertTrue(math.isfinite(val("Obligation drain time")), "the compensated run")
        self.assertGreater(val("Compensations per second, by tool and outcome",
                               tool="charge_card", outcome="RESOLVED"), 0)
        self.assertGreater(val("Runs compensated, by final status", status="COMPENSATED"), 0)
        self.assertGreater(val("Dead letters (DLQ) per second, by reason"), 0)
        self.assertGreater(val("Status check verdicts per second", outcome="confirmed"), 0)
        # the traffic settled: nothing in flight, for any tool or worker; every tool the
        # traffic called has its three series (execute, status check, reverse)
        for title in ("Calls in flight, by tool", "Calls in flight, by worker"):
            for ref in ("A", "B", "C"):
                self.assertEqual(val(title, ref), 0, f"{title} [{ref}]")
        for ref in ("A", "B", "C"):
            got = results[f"Calls in flight, by tool [{ref}]"]["response"]["data"]["result"]
            self.assertLessEqual({"charge_card", "create_hold", "post_note"},
                                 {s["metric"]["tool"] for s in got}, ref)

        # The alert rules evaluate against the same live data without an error: every rule
        # evaluated since the traffic, healthy. (What each fires on is alerts.test.yml's.)
        t = time.time()

        def rules():
            groups = self.http_json(base + "/api/v1/rules")["data"]["groups"]
            got = [r for g in groups for r in g["rules"]]
            return got if got and all(r.get("lastEvaluation", "").startswith("20") and
                                      rfc3339(r["lastEvaluation"]) > t for r in got) else None
        got = wait_for(rules, timeout=30, interval=0.5, what="the alert rules evaluated")
        self.assertFalse([f"{r['name']}: {r.get('lastError')}" for r in got
                          if r["health"] != "ok"])
        # the traffic paged what it should: the STUCK effect and obligation are pending or
        # firing, and the workers' kinds are all discovered
        states = {r["name"]: r["state"] for r in got}
        self.assertNotEqual(states["TallyEffectStuck"], "inactive")
        self.assertNotEqual(states["TallyObligationStuck"], "inactive")
        self.assertEqual(states["TallyWorkerKindAbsent"], "inactive")

        self.screenshot(base, panels, values)

    def screenshot(self, base, panels, values):
        """The core time series panels' queries drawn by Prometheus' own graph page (Grafana
        cannot run here): one headless-Chromium screenshot per panel, put side by side under
        the panels' titles in dashboard-panels.png."""
        chromium = shutil.which("chromium")
        if chromium is None:
            print("chromium is not installed: no screenshot", flush=True)
            return
        os.makedirs(ARTIFACTS, exist_ok=True)
        shown = [p for p in panels if p["title"] in CORE and p["type"] == "timeseries"]
        cells, shots = [], []
        for i, p in enumerate(shown):
            exprs = [substitute(t["expr"], values) for t in p["targets"]]
            # the panel's targets as one graph, each series labelled with its target's legend
            # (what of it is not a {{label}})
            expr = exprs[0] if len(exprs) == 1 else " or ".join(
                'label_replace({}, "series", "{}", "", "")'.format(
                    e, re.sub(r"\{\{\w+\}\}", "", t["legendFormat"]).strip() or t["refId"])
                for e, t in zip(exprs, p["targets"]))
            url = f"{base}/graph?" + urllib.parse.urlencode(
                {"g0.expr": expr, "g0.tab": "0", "g0.range_input": "1m", "g0.stacked": "0"})
            png = os.path.join(ARTIFACTS, f"panel-{i:02d}.png")
            shots.append((url, png))
            cells.append(f'<figure><figcaption>{p["title"]}</figcaption>'
                         f'<img src="{os.path.basename(png)}"></figure>')
        for k in range(0, len(shots), 3):  # three browsers at a time
            self.chromium(chromium, shots[k:k + 3], 1400, 760)
        page = os.path.join(ARTIFACTS, "dashboard-panels.html")
        with open(page, "w") as f:
            f.write("<!doctype html><meta charset=utf-8><style>"
                    "body{margin:0;font:600 22px sans-serif;background:#fff}"
                    "main{display:grid;grid-template-columns:1fr 1fr;gap:8px;padding:8px}"
                    "figure{margin:0;border:1px solid #ccc}figcaption{padding:6px 10px}"
                    "img{width:100%;display:block}</style><main>" + "".join(cells) + "</main>")
        rows = (len(cells) + 1) // 2
        self.chromium(chromium, [("file://" + page,
                                  os.path.join(ARTIFACTS, "dashboard-panels.png"))],
                      1400, rows * 420 + 16)

    def chromium(self, chromium, shots, width, height):
        """Screenshots [(url, png)] of @width x @height, one headless Chromium each, at once."""
        procs = []
        for n, (url, out) in enumerate(shots):
            if os.path.exists(out):
                os.unlink(out)
            procs.append(subprocess.Popen(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 f"--user-data-dir={os.path.join(self.tmp, f'chromium-{n}')}",
                 "--virtual-time-budget=3000", f"--screenshot={out}",
                 f"--window-size={width},{height}", url],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for (url, out), proc in zip(shots, procs):
            log = proc.communicate(timeout=120)[0]
            self.assertTrue(os.path.exists(out) and os.path.getsize(out) > 10000,
                            f"chromium made no screenshot of {url}:\n{log[-3000:]}")

if __name__ == "__main__":
    main()
