"""deploy/: what can be checked without a Docker engine or a Kubernetes cluster.

- Prometheus: `promtool check rules`, `promtool test rules` (every rule, firing and quiet),
  `promtool check config`; and a real Prometheus scraping the three workers on the embedded
  stack, finding every metric of the documented metrics table on the workers it names and
  loading the alert rules.
- systemd: `systemd-analyze verify` of the units exactly as shipped, against a scratch root
  holding the built binaries, and `systemd-analyze security --offline`; their structure.
- Kubernetes: every manifest parses and is checked against the API models of Debian's
  python3-kubernetes; images, probes, resources, security contexts, secrets by reference,
  grace periods, PDB/Service/ScaledObject selectors, KEDA caps = partition counts.
- Compose: `docker-compose config` (Debian's Compose 1.29) and the structure; the grafana
  service's provisioning (data source, dashboards provider, the mounted dashboard files).
- Dockerfile: stages, runtime packages = the Debian packages of the binaries' DT_NEEDED
  libraries, build packages = the -dev packages of CMake's pkg_check_modules, non-root USER.

Only RealPrometheusTest needs PostgreSQL and Kafka (the embedded stack); the rest read files
and run Debian's tools.
"""

import base64
import fnmatch
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request
import zlib

import yaml

import tallytest
from tallytest import SOURCE_DIR, binary, wait_for

DEPLOY = os.path.join(SOURCE_DIR, "deploy")
PROM_DIR = os.path.join(DEPLOY, "prometheus")
K8S_DIR = os.path.join(DEPLOY, "kubernetes")
COMPOSE_FILE = os.path.join(DEPLOY, "compose", "compose.yaml")
DOCKERFILE = os.path.join(DEPLOY, "Dockerfile")
WORKERS = ("dispatcher", "reconciler", "compensator")
PROGRAMS = ("tally", "tally-dispatcher", "tally-reconciler", "tally-compensator")


def read(path):
    with open(path) as f:
        return f.read()


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kw)


def cmake_version():
    """project(tally VERSION x.y.z) of CMakeLists.txt."""
    m = re.search(r"project\(tally VERSION (\d+\.\d+\.\d+)",
                  read(os.path.join(SOURCE_DIR, "CMakeLists.txt")))
    assert m, "no project(tally VERSION ...) in CMakeLists.txt"
    return m.group(1)


def load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def known_settings():
    """Every TALLY_* variable of the configuration table in common/src/config.c."""
    with open(os.path.join(SOURCE_DIR, "common", "src", "config.c")) as f:
        src = f.read()
    names = set(re.findall(r'\b(?:STR|INT|BOOL)\(\s*[\w\[\]]+\s*,\s*"(TALLY_[A-Z0-9_]+)"', src))
    assert "TALLY_PG" in names and "TALLY_SHUTDOWN_GRACE_MS" in names, names
    return names


def registry_vars():
    """Variables the demo registry's base_urls expand (${NAME} or ${NAME:-default})."""
    with open(os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")) as f:
        return set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", f.read()))


def assert_known_tally_vars(case, names, where):
    settings = known_settings() | registry_vars()
    for n in names:
        if n.startswith("TALLY_") and n not in settings:
            case.assertTrue(n.startswith("TALLY_KAFKA_"),
                            f"{where}: {n} is not a tally setting (common/src/config.c), "
                            "a variable of the registry, nor a TALLY_KAFKA_* passthrough")


def registered_metrics():
    """{name: (type, labels, workers)} of every tally_metrics_<type>() call in the C sources;
    workers from where the call is: common/src serves all three, <worker>/ its own."""
    pat = re.compile(r'tally_metrics_(counter|gauge|histogram)\s*\(\s*[^,]+,\s*"([a-z_:]+)"\s*,'
                     r'\s*((?:"(?:[^"\\]|\\.)*"\s*)+),\s*(NULL|"[^"]*")', re.S)
    out = {}
    for d, workers in (("common/src", WORKERS), *((w, (w,)) for w in WORKERS)):
        for f in glob.glob(os.path.join(SOURCE_DIR, d, "*.[ch]")):
            with open(f) as fh:
                for m in pat.finditer(fh.read()):
                    labels = () if m.group(4) == "NULL" else tuple(
                        x.strip() for x in m.group(4).strip('"').split(",") if x.strip())
                    prev = out.get(m.group(2), (None, None, ()))[2]
                    out[m.group(2)] = (m.group(1), labels,
                                       tuple(w for w in WORKERS if w in prev or w in workers))
    return out


def documented_metrics():
    """The metrics table: {name: {"type", "labels", "workers"}} and the file it came from.

    docs/operations.md's table when it has rows (a table under a heading containing "Metrics"
    whose first column is `tally_...`), else deploy/README.md's "## Metrics" table.
    Columns by header: metric, type, labels, and optionally workers (comma-separated); without
    a workers column, the workers are those whose sources register the metric.
    """
    for rel in ("docs/operations.md", "deploy/README.md"):
        path = os.path.join(SOURCE_DIR, rel)
        if not os.path.exists(path):
            continue
        table = _metrics_table(read(path))
        if table:
            code = registered_metrics()
            for name, row in table.items():
                if row["workers"] is None:
                    row["workers"] = code[name][2] if name in code else WORKERS
            return table, rel
    raise AssertionError("no metrics table in docs/operations.md or deploy/README.md")


def _metrics_table(text):
    lines = text.splitlines()
    in_section = False
    header = None
    rows = {}
    for line in lines:
        if line.startswith("#"):
            if rows:
                break
            in_section = "metrics" in line.lower()
            header = None
            continue
        if not in_section:
            continue
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        m = re.fullmatch(r"`(tally_[a-z0-9_]+)`", cells[0])
        if not m:
            continue
        row = dict(zip(header, cells))
        rows[m.group(1)] = {
            "type": row.get("type", ""),
            "labels": tuple(re.findall(r"`([a-z_]+)`", row.get("labels", ""))),
            "workers": (tuple(w.strip() for w in row["workers"].split(",") if w.strip())
                        if "workers" in row else None),
        }
    return rows


# --- Prometheus ------------------------------------------------------------------------------

# The runbook base the rules use when Prometheus has no external label runbook_base.
DEFAULT_RUNBOOK_BASE = "https://git.example.com/tally/blob/main/"


def operations_slugs():
    """The GitHub anchors of docs/operations.md's headings: lower case, punctuation other than
    "-" and "_" dropped, spaces as "-"."""
    slugs = set()
    for line in read(os.path.join(SOURCE_DIR, "docs", "operations.md")).splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            slugs.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return slugs


class PrometheusFilesTest(unittest.TestCase):

    def test_promtool_check_rules(self):
        r = run(["promtool", "check", "rules", os.path.join(PROM_DIR, "alerts.yml")])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("SUCCESS", r.stdout)

    def test_promtool_test_rules(self):
        r = run(["promtool", "test", "rules", os.path.join(PROM_DIR, "alerts.test.yml")])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("SUCCESS", r.stdout)

    def test_promtool_check_config(self):
        r = run(["promtool", "check", "config", os.path.join(PROM_DIR, "prometheus.yml")])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def rules(self):
        doc = load_yaml_docs(os.path.join(PROM_DIR, "alerts.yml"))[0]
        return [r for g in doc["groups"] for r in g["rules"]]

    def test_every_rule_is_documented_and_linked(self):
        rules = self.rules()
        names = [r["alert"] for r in rules]
        self.assertEqual(len(names), len(set(names)), "duplicate alert names")
        with open(os.path.join(DEPLOY, "README.md")) as f:
            readme = f.read()
        for r in rules:
            name = r["alert"]
            with self.subTest(alert=name):
                self.assertIn(r["labels"]["severity"], ("critical", "warning"))
                ann = r["annotations"]
                self.assertTrue(ann.get("summary"), "summary")
                self.assertTrue(ann.get("description"), "description")
                self.assertEqual(
                    ann.get("runbook_url"),
                    '{{ or $externalLabels.runbook_base "' + DEFAULT_RUNBOOK_BASE +
                    '" }}docs/operations.md#' + name.lower())
                self.assertRegex(readme, rf"\| `{name}` \| {r['labels']['severity']} \|")

    def runbook_urls(self, rules, base=None):
        """{alert: runbook_url as Prometheus renders it} with the external label runbook_base
        set to @base (None: unset), by Go's `or`: the label when not empty, else the default."""
        out = {}
        for r in rules:
            url = r["annotations"]["runbook_url"]
            m = re.fullmatch(r'\{\{ or \$externalLabels\.runbook_base "([^"]*)" \}\}(.*)', url)
            out[r["alert"]] = (base or m.group(1)) + m.group(2) if m else url
        return out

    def assert_absolute_and_anchored(self, urls, base):
        slugs = operations_slugs()
        for name, url in urls.items():
            with self.subTest(alert=name):
                u = urllib.parse.urlsplit(url)
                self.assertIn(u.scheme, ("http", "https"), url)
                self.assertTrue(u.netloc, url)
                self.assertTrue(url.startswith(base + "docs/operations.md#"), url)
                self.assertEqual(u.fragment, name.lower())
                self.assertIn(u.fragment, slugs,
                              f"docs/operations.md has no heading for the anchor of {url}")

    def test_every_runbook_url_is_absolute_and_its_anchor_exists(self):
        rules = self.rules()
        # without the external label, on the default base; with it, on the label's base
        self.assertRegex(DEFAULT_RUNBOOK_BASE, r"^https://[^/]+/.*/$")
        self.assert_absolute_and_anchored(self.runbook_urls(rules), DEFAULT_RUNBOOK_BASE)
        base = "https://wiki.example.net/ops/tally/"
        self.assert_absolute_and_anchored(self.runbook_urls(rules, base), base)

    def test_set_runbook_base_writes_a_copy_with_absolute_links(self):
        script = os.path.join(PROM_DIR, "set-runbook-base")
        src = os.path.join(PROM_DIR, "alerts.yml")
        base = "https://git.example.com/platform/tally&co/blob/v1.4/"
        with open(src) as f:
            r = subprocess.run([script, base], stdin=f, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "alerts.yml")
            with open(out, "w") as f:
                f.write(r.stdout)
            check = run(["promtool", "check", "rules", out])
            self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
            rules = [x for g in load_yaml_docs(out)[0]["groups"] for x in g["rules"]]
        self.assertEqual([x["alert"] for x in rules], [x["alert"] for x in self.rules()])
        urls = {x["alert"]: x["annotations"]["runbook_url"] for x in rules}
        self.assertFalse([u for u in urls.values() if "{{" in u], urls)
        self.assert_absolute_and_anchored(urls, base)
        # everything but the links is the same
        strip = lambda text: [ln for ln in text.splitlines() if "runbook_url:" not in ln]
        self.assertEqual(strip(r.stdout), strip(read(src)))
        for bad in ("docs/", "https://x.example/no-slash", "ftp://x.example/", "https://a b/",
                    "https://x.example/{{ $labels.job }}/"):
            with open(src) as f:
                r = subprocess.run([script, bad], stdin=f, capture_output=True, text=True)
            self.assertEqual(r.returncode, 2, bad)
            self.assertEqual(r.stdout, "", bad)
        r = subprocess.run([script, base], input="groups: []\n", capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, "an input without links to rewrite")

    def test_every_aggregation_keeps_the_installation(self):
        """Two installations in one Prometheus must not add up or hide each other: every
        `by (...)` keeps `installation`, and every `without (...)` leaves it."""
        for r in self.rules():
            with self.subTest(alert=r["alert"]):
                expr = r["expr"]
                for m in re.finditer(r"\b(sum|max|min|count|avg)\s*(by|without)?\s*\(", expr):
                    self.assertTrue(m.group(2), f"{m.group(0)} without by/without: {expr}")
                for m in re.finditer(r"\b(by|without|on)\s*\(([^)]*)\)", expr):
                    names = {x.strip() for x in m.group(2).split(",")}
                    if m.group(1) == "without":
                        self.assertNotIn("installation", names, expr)
                    else:
                        self.assertIn("installation", names, expr)

    def test_runbook_anchors_exist_in_operations_doc(self):
        slugs = operations_slugs()
        for r in self.rules():
            self.assertIn(r["alert"].lower(), slugs,
                          f"docs/operations.md has no heading for {r['alert']}")

    def test_every_rule_fires_and_stays_quiet_in_the_unit_tests(self):
        tests = load_yaml_docs(os.path.join(PROM_DIR, "alerts.test.yml"))[0]["tests"]
        fired, quiet = set(), set()
        for t in tests:
            for a in t.get("alert_rule_test", []):
                (fired if a.get("exp_alerts") else quiet).add(a["alertname"])
        for r in self.rules():
            self.assertIn(r["alert"], fired, f"no test where {r['alert']} fires")
            self.assertIn(r["alert"], quiet, f"no test where {r['alert']} stays quiet")

    def test_rules_use_documented_registered_metrics(self):
        doc, where = documented_metrics()
        code = registered_metrics()
        used = set()
        for r in self.rules():
            used |= set(re.findall(r"\btally_[a-z0-9_]+", r["expr"]))
        self.assertTrue(used)
        for name in sorted(used):
            self.assertIn(name, doc, f"alert rules use {name}, which {where} does not document")
            self.assertIn(name, code, f"alert rules use {name}, which no worker registers")

    def test_documented_metrics_match_the_code(self):
        doc, where = documented_metrics()
        code = registered_metrics()
        missing = sorted(set(doc) - set(code))
        self.assertFalse(missing, f"documented in {where} but registered nowhere in the C "
                                  f"sources: {missing}")
        undocumented = sorted(set(code) - set(doc))
        self.assertFalse(undocumented, f"registered but not documented in {where}: {undocumented}")
        for name, d in doc.items():
            with self.subTest(metric=name):
                self.assertEqual(d["type"], code[name][0])
                self.assertEqual(d["labels"], code[name][1])
                self.assertEqual(d["workers"], code[name][2], "workers exporting it")
                if d["type"] == "counter":
                    self.assertTrue(name.endswith("_total"), "counters end in _total")

    def test_scrape_config_matches_the_compose_services(self):
        cfg = load_yaml_docs(os.path.join(PROM_DIR, "prometheus.yml"))[0]
        compose = load_yaml_docs(COMPOSE_FILE)[0]
        self.assertEqual(cfg["rule_files"], ["alerts.yml"])
        jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
        for w in WORKERS:
            job = jobs[f"tally-{w}"]
            sd = job["dns_sd_configs"][0]
            self.assertEqual(sd["names"], [f"tally-{w}"])
            self.assertIn(f"tally-{w}", compose["services"])
            self.assertEqual(sd["port"], 9464)
            # every target names its installation, as the rules aggregate by it
            self.assertIn({"target_label": "installation", "replacement": "compose"},
                          job.get("relabel_configs", []), job)


# --- systemd ---------------------------------------------------------------------------------


def parse_unit(path):
    """[(section, key, value)] in file order; systemd allows a key more than once."""
    out, section = [], None
    for raw in read(path).splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        k, _, v = line.partition("=")
        out.append((section, k.strip(), v.strip()))
    return out


def parse_env_file(path):
    env = {}
    for raw in read(path).splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            env[k] = v
    return env


class SystemdUnitsTest(unittest.TestCase):
    units = [os.path.join(DEPLOY, "systemd", f"tally-{w}.service") for w in WORKERS]

    def scratch_root(self):
        """A root with the system's units and the built binaries where the units expect them."""
        root = tempfile.mkdtemp(prefix="tally-systemd-root-")
        self.addCleanup(shutil.rmtree, root, True)
        for src in ("/lib/systemd/system", "/usr/lib/systemd/system"):
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(root, "usr/lib/systemd/system"),
                                symlinks=True, dirs_exist_ok=True)
                break
        os.makedirs(os.path.join(root, "usr/local/bin"))
        os.makedirs(os.path.join(root, "etc/systemd/system"))
        for w in WORKERS:
            shutil.copy(binary(f"tally-{w}"), os.path.join(root, "usr/local/bin"))
        for u in self.units:
            shutil.copy(u, os.path.join(root, "etc/systemd/system"))
        return root

    def test_systemd_analyze_verify(self):
        if not shutil.which("systemd-analyze"):
            self.fail("systemd-analyze is missing (Debian package systemd)")
        root = self.scratch_root()
        names = [os.path.basename(u) for u in self.units]
        r = run(["systemd-analyze", "verify", f"--root={root}", *names])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # Unknown keys and unparsable values are only warnings: none may be printed.
        self.assertEqual(r.stderr.strip(), "", r.stderr)

    def test_systemd_analyze_security_exposure(self):
        root = self.scratch_root()
        for u in self.units:
            name = os.path.basename(u)
            r = run(["systemd-analyze", "security", "--offline=yes", f"--root={root}",
                     "--no-pager", name])
            m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
            self.assertTrue(m, r.stdout + r.stderr)
            self.assertLessEqual(float(m.group(1)), 2.0, f"{name}:\n{r.stdout}")

    def test_unit_structure(self):
        env = parse_env_file(os.path.join(DEPLOY, "systemd", "tally.env.example"))
        grace_ms = int(env["TALLY_SHUTDOWN_GRACE_MS"])
        ports = set()
        must = {
            "Type": "notify", "NotifyAccess": "main", "Restart": "on-failure",
            "KillSignal": "SIGTERM",
            "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
            "PrivateTmp": "yes", "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
            "ProtectKernelLogs": "yes", "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
            "MemoryDenyWriteExecute": "yes", "LockPersonality": "yes",
            "CapabilityBoundingSet": "", "DynamicUser": "yes",
        }
        for u, w in zip(self.units, WORKERS):
            with self.subTest(unit=os.path.basename(u)):
                kv = parse_unit(u)
                svc = {}
                for section, k, v in kv:
                    if section == "Service":
                        svc.setdefault(k, []).append(v)
                for k, v in must.items():
                    self.assertIn(v, svc.get(k, []), f"{k}={v}")
                self.assertIn("@system-service", svc["SystemCallFilter"])
                self.assertEqual(svc["ExecStart"], [f"/usr/local/bin/tally-{w}"])
                self.assertIn("/etc/tally/tally.env", svc["EnvironmentFile"])
                self.assertIn("2", svc["RestartPreventExitStatus"][0].split())
                stop = svc["TimeoutStopSec"][0]
                self.assertRegex(stop, r"^\d+s$")
                self.assertGreaterEqual(int(stop[:-1]) * 1000, grace_ms + 10000,
                                        "TimeoutStopSec must exceed the drain grace")
                addr = [v for v in svc["Environment"] if v.startswith("TALLY_METRICS_ADDR=")]
                self.assertEqual(len(addr), 1)
                ports.add(addr[0].rsplit(":", 1)[1])
                # The watchdog: the worker pings every half period (common/src/notify.c);
                # a period shorter than /healthz's window would kill a worker the probes
                # still call alive.
                wd = svc["WatchdogSec"][0]
                self.assertRegex(wd, r"^\d+s$")
                self.assertGreaterEqual(int(wd[:-1]), 10, "WatchdogSec above /healthz's 10 s")
                start = svc["TimeoutStartSec"][0]
                self.assertRegex(start, r"^\d+s$")
                self.assertGreaterEqual(int(start[:-1]), 30, "room before the first heartbeat")
        self.assertEqual(len(ports), 3, "each worker on a host needs its own metrics port")
        # cmake --install puts the programs where ExecStart looks (default prefix /usr/local).
        with open(os.path.join(SOURCE_DIR, "CMakeLists.txt")) as f:
            self.assertRegex(f.read(), r"install\(TARGETS[^)]*tally-dispatcher[^)]*DESTINATION bin")

    def test_env_example_names_real_settings(self):
        env = parse_env_file(os.path.join(DEPLOY, "systemd", "tally.env.example"))
        assert_known_tally_vars(self, env, "tally.env.example")
        self.assertNotIn("TALLY_METRICS_ADDR", env, "set per unit, not in the shared file")
        for w in WORKERS:
            for _, k, v in parse_unit(os.path.join(DEPLOY, "systemd", f"tally-{w}.service")):
                if k == "Environment":
                    assert_known_tally_vars(self, [v.split("=", 1)[0]], f"tally-{w}.service")


    def test_each_worker_has_its_own_database_credential(self):
        """A credential per component (docs/operations.md, "Database roles"): the shared file
        names no TALLY_PG; each unit requires its own file, which connects as its role; the
        migrate file connects as the owner and sets every role's password."""
        shared = parse_env_file(os.path.join(DEPLOY, "systemd", "tally.env.example"))
        self.assertNotIn("TALLY_PG", shared, "TALLY_PG is per worker, not shared")
        users = {}
        for u, w in zip(self.units, WORKERS):
            files = [v for _, k, v in parse_unit(u) if k == "EnvironmentFile"]
            self.assertIn("/etc/tally/%N.env", files, f"{w}: its own file, required (no '-')")
            env = parse_env_file(os.path.join(DEPLOY, "systemd", f"tally-{w}.env.example"))
            assert_known_tally_vars(self, env, f"tally-{w}.env.example")
            users[w] = urllib.parse.urlparse(env["TALLY_PG"]).username
            self.assertEqual(users[w], f"tally_{w}")
        self.assertEqual(len(set(users.values())), len(WORKERS))
        migrate = parse_env_file(os.path.join(DEPLOY, "systemd", "tally-migrate.env.example"))
        assert_known_tally_vars(self, migrate, "tally-migrate.env.example")
        self.assertEqual(urllib.parse.urlparse(migrate["TALLY_PG"]).username, "tally_owner")
        for c in (*WORKERS, "operator", "reader"):
            self.assertIn(f"TALLY_ROLE_PASSWORD_{c.upper()}", migrate)


# --- the install build: no test hooks ---------------------------------------------------------


def markdown_section(text, heading):
    """The lines of the "## heading" section of a Markdown text."""
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            inside = line[3:].strip() == heading
            continue
        if inside:
            out.append(line)
    return out


def documented_install_configure():
    """The `cmake -S . -B build ...` line of deploy/README.md's systemd section, as argv."""
    lines = [l.strip() for l in markdown_section(read(os.path.join(DEPLOY, "README.md")),
                                                 "systemd")
             if l.strip().startswith("cmake -S ")]
    assert len(lines) == 1, f"one configure line in deploy/README.md, systemd: {lines}"
    return shlex.split(lines[0])


# What a test build has and an install must not: the crash points (crashpoint.h), the variable
# that arms them, and the console's test-only write route (cli/cmd_console.c).
TEST_HOOK_SYMBOLS = ("tally_crashpoint_hit", "tally_crashpoint_init")
TEST_HOOK_STRINGS = (b"TALLY_CRASH_AT", b"/_test/write", b"TALLY_CONSOLE_TEST_WRITE")


def test_hooks_in(path):
    """The test hooks a binary carries: symbols (nm) and strings."""
    syms = set(run(["nm", path]).stdout.split())
    with open(path, "rb") as f:
        data = f.read()
    return sorted({s for s in TEST_HOOK_SYMBOLS if s in syms} |
                  {s.decode() for s in TEST_HOOK_STRINGS if s in data})


class InstallBuildTest(unittest.TestCase):
    """The documented build for installs (deploy/README.md, systemd; the units; the
    Dockerfile) has the test hooks off, and a build made that way carries none of them."""

    def test_the_documented_commands_turn_the_tests_off(self):
        argv = documented_install_configure()
        self.assertEqual(argv[:5], ["cmake", "-S", ".", "-B", "build"])
        self.assertIn("-DTALLY_BUILD_TESTS=OFF", argv)
        self.assertNotIn("-DTALLY_CRASH_POINTS=ON", argv)
        for w in WORKERS:
            unit = read(os.path.join(DEPLOY, "systemd", f"tally-{w}.service"))
            cmake = [l.lstrip("# ").strip() for l in unit.splitlines()
                     if l.lstrip("# ").startswith("cmake -S ")]
            self.assertEqual([shlex.split(c) for c in cmake], [argv], f"tally-{w}.service")
        # the Dockerfile's build of the four programs (the tool's tree is a build of its own)
        text = read(DOCKERFILE).replace("\\\n", " ")
        builds = re.findall(r"cmake -S \. -B (\S+)((?:\s+-D\S+)+)", text)
        flags = dict((b, f.split()) for b, f in builds)
        self.assertIn("-DTALLY_BUILD_TESTS=OFF", flags["/build"])
        self.assertNotIn("-DTALLY_CRASH_POINTS=ON", flags["/build"])
        self.assertIn("-DTALLY_CRASH_POINTS=OFF", flags["/build-tool"])

    def test_an_install_build_has_no_test_hooks(self):
        """The documented configure line in a tree of its own (kept in the test build's
        directory, so a second run only rebuilds what changed), the four programs only."""
        tree = os.path.join(tallytest.BUILD_DIR, "install-build")
        argv = documented_install_configure()
        argv[argv.index("build")] = tree
        env = dict(os.environ)
        if shutil.which("ccache"):
            argv.append("-DCMAKE_C_COMPILER_LAUNCHER=ccache")
            env.setdefault("CCACHE_BASEDIR", "/")
        r = run(argv, cwd=SOURCE_DIR, env=env)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        cache = read(os.path.join(tree, "CMakeCache.txt"))
        self.assertIn("TALLY_BUILD_TESTS:BOOL=OFF", cache)
        r = subprocess.run(["cmake", "--build", tree, "-j2", "--target", *PROGRAMS],
                           capture_output=True, text=True, timeout=1800, env=env)
        self.assertEqual(r.returncode, 0, r.stdout[-4000:] + r.stderr)
        for prog in PROGRAMS:
            with self.subTest(program=prog):
                self.assertEqual(test_hooks_in(os.path.join(tree, prog)), [])
        # The check can fail: the test build (crash points on) carries them.
        if "TALLY_CRASH_POINTS:BOOL=ON" in read(os.path.join(tallytest.BUILD_DIR,
                                                              "CMakeCache.txt")):
            self.assertIn("tally_crashpoint_hit", test_hooks_in(binary("tally-dispatcher")))
            self.assertIn("/_test/write", test_hooks_in(binary("tally")))


# --- Kubernetes ------------------------------------------------------------------------------


def k8s_docs():
    docs = []
    for path in sorted(glob.glob(os.path.join(K8S_DIR, "*.yaml"))):
        if os.path.basename(path) == "kustomization.yaml":
            continue
        for d in load_yaml_docs(path):
            docs.append((os.path.basename(path), d))
    return docs


def compose_partitions():
    """{topic: partitions} from the compose stack's kafka-topics command."""
    compose = load_yaml_docs(COMPOSE_FILE)[0]
    script = "\n".join(compose["services"]["kafka-topics"]["command"])
    return {t: int(n) for t, n in re.findall(r"\b(tally\.[a-z]+):(\d+)\b", script)}


class KubernetesManifestsTest(unittest.TestCase):
    MODELS = {
        ("apps/v1", "Deployment"): "V1Deployment",
        ("v1", "Service"): "V1Service",
        ("v1", "ConfigMap"): "V1ConfigMap",
        ("v1", "Namespace"): "V1Namespace",
        ("batch/v1", "Job"): "V1Job",
        ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
        ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
        ("v1", "ServiceAccount"): "V1ServiceAccount",
    }
    # Fields newer than Debian's python3-kubernetes (22.6, the Kubernetes 1.22 API): checked
    # here against their documented values instead. PodDisruptionBudget's
    # unhealthyPodEvictionPolicy: beta and on by default since Kubernetes 1.27, GA in 1.31.
    NEWER_FIELDS = {
        ("V1PodDisruptionBudgetSpec", "unhealthyPodEvictionPolicy"): {"IfHealthyBudget",
                                                                      "AlwaysAllow"},
    }

    @classmethod
    def setUpClass(cls):
        cls.docs = k8s_docs()
        cls.by_kind = {}
        for f, d in cls.docs:
            cls.by_kind.setdefault(d["kind"], []).append(d)
        cls.env_cm = next(d for d in cls.by_kind["ConfigMap"] if d["metadata"]["name"] == "tally-env")

    def deployments(self):
        return {d["metadata"]["name"]: d for d in self.by_kind["Deployment"]}

    def test_every_document_has_kind_name_and_api_version(self):
        self.assertTrue(self.docs)
        for f, d in self.docs:
            with self.subTest(file=f, kind=d.get("kind")):
                self.assertTrue(d.get("apiVersion") and d.get("kind") and d["metadata"]["name"])
                self.assertNotEqual(d["kind"], "Secret", "secrets are referenced, never shipped")

    def test_core_kinds_match_the_kubernetes_api_models(self):
        import kubernetes.client as kc
        api = kc.ApiClient()
        checked = 0
        for f, d in self.docs:
            model = self.MODELS.get((d["apiVersion"], d["kind"]))
            if model is None:
                self.assertEqual((d["apiVersion"], d["kind"]), ("keda.sh/v1alpha1", "ScaledObject"),
                                 f"{f}: no model to check {d['kind']} against")
                continue
            with self.subTest(file=f, name=d["metadata"]["name"]):
                self._check_fields(kc, d, model, d["kind"])
                # Builds the objects, which raises on missing required fields.
                api._ApiClient__deserialize(d, model)
                checked += 1
        self.assertGreaterEqual(checked, 10)

    def _check_fields(self, kc, value, typ, path):
        if typ.startswith("list["):
            self.assertIsInstance(value, list, path)
            for i, v in enumerate(value):
                self._check_fields(kc, v, typ[5:-1], f"{path}[{i}]")
            return
        if typ.startswith("dict("):
            self.assertIsInstance(value, dict, path)
            inner = typ[5:-1].split(",", 1)[1].strip()
            for k, v in value.items():
                self._check_fields(kc, v, inner, f"{path}.{k}")
            return
        if typ in ("str", "int", "bool", "float", "object", "datetime", "date"):
            allowed = {"str": (str,), "int": (int,), "bool": (bool,), "float": (int, float),
                       "object": (str, int, dict, list), "datetime": (str,), "date": (str,)}[typ]
            self.assertIsInstance(value, allowed, f"{path}: expected {typ}, got {value!r}")
            return
        cls = getattr(kc, typ)
        self.assertIsInstance(value, dict, f"{path}: expected {typ}")
        by_json = {j: a for a, j in cls.attribute_map.items()}
        for k, v in value.items():
            if (typ, k) in self.NEWER_FIELDS:
                self.assertIn(v, self.NEWER_FIELDS[(typ, k)], f"{path}.{k}")
                continue
            self.assertIn(k, by_json, f"{path}: unknown field {k!r} in {typ}")
            self._check_fields(kc, v, cls.openapi_types[by_json[k]], f"{path}.{k}")

    def test_workers(self):
        grace_ms = int(self.env_cm["data"]["TALLY_SHUTDOWN_GRACE_MS"])
        metrics_port = int(self.env_cm["data"]["TALLY_METRICS_ADDR"].rsplit(":", 1)[1])
        health_port = int(self.env_cm["data"]["TALLY_HEALTH_ADDR"].rsplit(":", 1)[1])
        self.assertNotEqual(health_port, metrics_port)
        tools = json.loads(next(d for d in self.by_kind["ConfigMap"]
                                if d["metadata"]["name"] == "tally-tools")["data"]["tools.json"])
        secret_envs = {t["connector"]["secret_env"] for t in tools["tools"]
                       if "secret_env" in t["connector"]}
        deps = self.deployments()
        for w in WORKERS:
            with self.subTest(worker=w):
                pod = deps[f"tally-{w}"]["spec"]["template"]["spec"]
                self.assertGreaterEqual(pod["terminationGracePeriodSeconds"] * 1000,
                                        grace_ms + 10000)
                self.assertTrue(pod["securityContext"]["runAsNonRoot"])
                self.assertNotEqual(pod["securityContext"].get("runAsUser"), 0)
                c = pod["containers"][0]
                self.assertEqual(c["command"], [f"tally-{w}"])
                port = next(p for p in c["ports"] if p["name"] == "metrics")
                self.assertEqual(port["containerPort"], metrics_port)
                hport = next(p for p in c["ports"] if p["name"] == "health")
                self.assertEqual(hport["containerPort"], health_port)
                self.assertEqual(c["livenessProbe"]["httpGet"]["path"], "/healthz")
                self.assertEqual(c["readinessProbe"]["httpGet"]["path"], "/readyz")
                # the probes use the health listener, which the metrics port cannot starve
                for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                    self.assertIn(c[probe]["httpGet"]["port"], ("health", health_port))
                sc = c["securityContext"]
                self.assertTrue(sc["readOnlyRootFilesystem"])
                self.assertFalse(sc["allowPrivilegeEscalation"])
                self.assertEqual(sc["capabilities"]["drop"], ["ALL"])
                env = {e["name"]: e for e in c.get("env", [])}
                self.assertIn("secretKeyRef", env["TALLY_PG"]["valueFrom"])
                for s in secret_envs:
                    self.assertIn("secretKeyRef", env[s]["valueFrom"], f"{s} from a Secret")
                self.assertEqual([r["configMapRef"]["name"] for r in c["envFrom"]], ["tally-env"])
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                tools_dir = os.path.dirname(self.env_cm["data"]["TALLY_TOOLS"])
                vol = next(v for v in pod["volumes"] if v["name"] == mounts[tools_dir])
                self.assertEqual(vol["configMap"]["name"], "tally-tools")
        assert_known_tally_vars(self, self.env_cm["data"], "kubernetes/config.yaml")

    def test_each_worker_has_its_own_database_credential(self):
        """Every container of a worker's pod (the wait-for-schema init container too) reads
        TALLY_PG from that worker's own Secret; the migrate Job from the owner's, and sets
        each role's password from that role's Secret."""
        deps = self.deployments()
        secrets = {}
        for w in WORKERS:
            pod = deps[f"tally-{w}"]["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:
                env = {e["name"]: e for e in c.get("env", [])}
                if "TALLY_PG" not in env:
                    continue
                ref = env["TALLY_PG"]["valueFrom"]["secretKeyRef"]
                self.assertEqual(ref["name"], f"tally-postgres-{w}", f"{w}/{c['name']}")
                secrets.setdefault(w, set()).add(ref["name"])
            self.assertIn(w, secrets, f"{w}: no TALLY_PG")
        self.assertEqual(len(set().union(*secrets.values())), len(WORKERS))
        [job] = self.by_kind["Job"]
        env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        self.assertEqual(env["TALLY_PG"]["valueFrom"]["secretKeyRef"]["name"],
                         "tally-postgres-owner")
        for c in (*WORKERS, "operator", "reader"):
            ref = env[f"TALLY_ROLE_PASSWORD_{c.upper()}"]["valueFrom"]["secretKeyRef"]
            self.assertEqual(ref["name"], f"tally-postgres-{c}")
        assert_known_tally_vars(self, env, "kubernetes/migrate-job.yaml")

    def test_network_policy_admits_only_the_scraper_and_the_probes(self):
        [pol] = [d for d in self.by_kind["NetworkPolicy"]
                 if d["metadata"]["name"] == "tally-workers"]
        spec = pol["spec"]
        self.assertEqual(spec["policyTypes"], ["Ingress"])
        [expr] = spec["podSelector"]["matchExpressions"]
        self.assertEqual((expr["key"], expr["operator"], sorted(expr["values"])),
                         ("app.kubernetes.io/component", "In", sorted(WORKERS)))
        ports = {p["port"] for rule in spec["ingress"] for p in rule["ports"]}
        self.assertEqual(ports, {"metrics", "health"})
        for rule in spec["ingress"]:
            self.assertTrue(rule["from"], "every ingress rule names who may connect")
            if [p["port"] for p in rule["ports"]] == ["metrics"]:
                self.assertIn("podSelector", rule["from"][0])  # Prometheus' pods, not anyone

    def test_every_container_names_image_and_resources(self):
        pods = [(d["metadata"]["name"], d["spec"]["template"]["spec"])
                for d in self.by_kind["Deployment"] + self.by_kind["Job"]]
        for name, pod in pods:
            for c in pod.get("initContainers", []) + pod["containers"]:
                with self.subTest(workload=name, container=c["name"]):
                    self.assertRegex(c["image"], r"^[a-z0-9./-]+:[A-Za-z0-9._-]+$")
                    for kind in ("requests", "limits"):
                        self.assertIn("cpu", c["resources"][kind])
                        self.assertIn("memory", c["resources"][kind])
                    for e in c.get("env", []):
                        if re.search(r"PG|SECRET|PASSWORD|KEY|TOKEN", e["name"]):
                            self.assertNotIn("value", e, f"{e['name']} must come from a Secret")
        for d in self.by_kind["Deployment"]:
            for c in d["spec"]["template"]["spec"]["containers"]:
                with self.subTest(deployment=d["metadata"]["name"], container=c["name"]):
                    self.assertIn("livenessProbe", c)
                    self.assertIn("readinessProbe", c)

    def test_selectors_point_at_deployments(self):
        pod_labels = {n: d["spec"]["template"]["metadata"]["labels"]
                      for n, d in self.deployments().items()}
        for d in self.deployments().values():
            sel = d["spec"]["selector"]["matchLabels"]
            self.assertTrue(sel.items() <= d["spec"]["template"]["metadata"]["labels"].items())

        def selects(sel):
            return [n for n, labels in pod_labels.items() if sel.items() <= labels.items()]

        for pdb in self.by_kind["PodDisruptionBudget"]:
            self.assertEqual(len(selects(pdb["spec"]["selector"]["matchLabels"])), 1,
                             pdb["metadata"]["name"])
            self.assertEqual(pdb["spec"].get("maxUnavailable"), 1)
        for svc in self.by_kind["Service"]:
            targets = selects(svc["spec"]["selector"])
            self.assertEqual(len(targets), 1, svc["metadata"]["name"])
            ports = {p["name"] for c in self.deployments()[targets[0]]["spec"]["template"]["spec"]
                     ["containers"] for p in c.get("ports", [])}
            for p in svc["spec"]["ports"]:
                self.assertIn(p["targetPort"], ports)
        covered = {selects(p["spec"]["selector"]["matchLabels"])[0]
                   for p in self.by_kind["PodDisruptionBudget"]}
        self.assertTrue({f"tally-{w}" for w in WORKERS} <= covered, "a PDB per worker")

    def test_keda_scaled_objects(self):
        parts = compose_partitions()
        prefix = self.env_cm["data"]["TALLY_TOPIC_PREFIX"]
        brokers = self.env_cm["data"]["TALLY_KAFKA_BROKERS"]
        expect = {"tally-dispatcher": "intents", "tally-compensator": "obligations"}
        scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in self.by_kind["ScaledObject"]}
        self.assertEqual(set(scaled), set(expect))
        deps = self.deployments()
        for target, logical in expect.items():
            with self.subTest(target=target):
                s = scaled[target]["spec"]
                self.assertIn(target, deps)
                self.assertNotIn("replicas", deps[target]["spec"], "KEDA owns the count")
                trig = s["triggers"][0]
                self.assertEqual(trig["type"], "kafka")
                md = trig["metadata"]
                self.assertEqual(md["topic"], prefix + logical)
                # The worker's default group: TALLY_CONSUMER_GROUP = "tally-<worker>".
                self.assertEqual(md["consumerGroup"], target)
                self.assertEqual(md["bootstrapServers"], brokers)
                self.assertEqual(s["maxReplicaCount"], parts[prefix + logical],
                                 "maxReplicaCount = the topic's partition count")
                self.assertGreaterEqual(s["minReplicaCount"], 1, "workers also sweep PostgreSQL")
                # KEDA applies cooldownPeriod only when scaling to zero (ScaledObject spec)
                if "idleReplicaCount" not in s:
                    self.assertNotIn("cooldownPeriod", s, "ignored without scaling to zero")

    def test_pod_disruption_budgets_let_unhealthy_pods_go(self):
        """A pod that runs but is not ready does no work; with the default policy one such pod
        blocks every drain of its node."""
        for pdb in self.by_kind["PodDisruptionBudget"]:
            with self.subTest(pdb=pdb["metadata"]["name"]):
                self.assertEqual(pdb["spec"].get("unhealthyPodEvictionPolicy"), "AlwaysAllow")

    def test_workers_spread_over_zones_and_nodes(self):
        deps = self.deployments()
        for w in WORKERS:
            with self.subTest(worker=w):
                tmpl = deps[f"tally-{w}"]["spec"]["template"]
                spread = {c["topologyKey"]: c for c in tmpl["spec"]["topologySpreadConstraints"]}
                self.assertEqual(set(spread), {"topology.kubernetes.io/zone",
                                               "kubernetes.io/hostname"})
                for c in spread.values():
                    # a preference: a single-zone cluster must still schedule every replica
                    self.assertEqual(c["whenUnsatisfiable"], "ScheduleAnyway")
                    self.assertEqual(c["maxSkew"], 1)
                    sel = c["labelSelector"]["matchLabels"]
                    self.assertTrue(sel.items() <= tmpl["metadata"]["labels"].items(), sel)
                    self.assertEqual(sel, deps[f"tally-{w}"]["spec"]["selector"]["matchLabels"])

    def test_each_workload_has_its_own_service_account_without_a_token(self):
        accounts = {d["metadata"]["name"]: d for d in self.by_kind["ServiceAccount"]}
        pods = {f"tally-{w}": d["spec"]["template"]["spec"]
                for w, d in ((w, self.deployments()[f"tally-{w}"]) for w in WORKERS)}
        [job] = self.by_kind["Job"]
        pods["tally-migrate"] = job["spec"]["template"]["spec"]
        used = []
        for name, pod in pods.items():
            with self.subTest(workload=name):
                sa = pod.get("serviceAccountName")
                self.assertEqual(sa, name)
                self.assertIn(sa, accounts, f"no ServiceAccount {sa}")
                self.assertIs(accounts[sa]["automountServiceAccountToken"], False)
                self.assertIs(pod["automountServiceAccountToken"], False)
                used.append(sa)
        self.assertEqual(len(set(used)), len(used), "one account each")
        self.assertEqual(set(accounts), set(used), "no account nothing uses")
        self.assertNotIn("RoleBinding", self.by_kind, "tally calls no Kubernetes API")
        self.assertNotIn("ClusterRoleBinding", self.by_kind)

    def test_migration_job_and_images_are_this_release(self):
        """The Job is named by release (its pod template cannot change, so each release
        creates its own and the old one ages out), and it, every image and the kustomization
        say CMakeLists.txt's version: a version bump that forgets the kit fails here."""
        version = cmake_version()
        [job] = self.by_kind["Job"]
        self.assertEqual(job["metadata"]["name"], "tally-migrate-" + version.replace(".", "-"))
        self.assertEqual(job["metadata"]["labels"]["app.kubernetes.io/version"], version)
        self.assertEqual(job["spec"]["template"]["metadata"]["labels"]
                         ["app.kubernetes.io/version"], version)
        ttl = job["spec"]["ttlSecondsAfterFinished"]
        self.assertGreaterEqual(ttl, 3600, "time to read a failed migration's logs")
        self.assertLessEqual(ttl, 7 * 86400, "old releases' Jobs age out")
        k = load_yaml_docs(os.path.join(K8S_DIR, "kustomization.yaml"))[0]
        [img] = k["images"]
        self.assertEqual(img["newTag"], version)
        images = set()
        for f, d in k8s_docs() + [("demo-tool.yaml", d) for d in
                                  load_yaml_docs(os.path.join(K8S_DIR, "demo-tool.yaml"))]:
            spec = d.get("spec", {}).get("template", {}).get("spec")
            for c in (spec or {}).get("initContainers", []) + (spec or {}).get("containers", []):
                images.add(c["image"])
        self.assertEqual(images, {f"tally:{version}", f"tally-fake-tool:{version}"})
        # the README's image commands build the same tag
        readme = read(os.path.join(DEPLOY, "README.md"))
        for tag in re.findall(r"-t (tally(?:-fake-tool)?):(\S+)", readme):
            self.assertEqual(tag[1], version, tag)

    def test_tools_configmap_is_the_demo_registry(self):
        cm = next(d for d in self.by_kind["ConfigMap"] if d["metadata"]["name"] == "tally-tools")
        with open(os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")) as f:
            self.assertEqual(json.loads(cm["data"]["tools.json"]), json.load(f))
        self.assertEqual(os.path.basename(self.env_cm["data"]["TALLY_TOOLS"]), "tools.json")

    def test_kustomization_lists_the_manifests(self):
        k = load_yaml_docs(os.path.join(K8S_DIR, "kustomization.yaml"))[0]
        files = {os.path.basename(p) for p in glob.glob(os.path.join(K8S_DIR, "*.yaml"))}
        files -= {"kustomization.yaml", "demo-tool.yaml"}  # the demo tool is applied by hand
        self.assertEqual(set(k["resources"]), files)
        self.assertEqual([i["name"] for i in k["images"]], ["tally"])

    def test_kubectl_kustomize_builds(self):
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            self.skipTest("kubectl is not installed (Debian 12's kubernetes-client is optional); "
                          "the kustomization's file list is checked by the test above")
        r = run([kubectl, "kustomize", K8S_DIR])
        self.assertEqual(r.returncode, 0, r.stderr)
        built = [d for d in yaml.safe_load_all(r.stdout) if d]
        listed = sum(len(load_yaml_docs(os.path.join(K8S_DIR, f))) for f in
                     load_yaml_docs(os.path.join(K8S_DIR, "kustomization.yaml"))[0]["resources"])
        self.assertEqual(len(built), listed)
        for d in built:
            if d["kind"] != "Namespace":
                self.assertEqual(d["metadata"]["namespace"], "tally")


# --- every YAML file, compose, Dockerfile ------------------------------------------------------


class YamlComposeDockerfileTest(unittest.TestCase):

    def test_every_yaml_file_under_deploy_parses(self):
        paths = [p for ext in ("yaml", "yml")
                 for p in glob.glob(os.path.join(DEPLOY, "**", f"*.{ext}"), recursive=True)]
        self.assertGreaterEqual(len(paths), 10)
        for p in paths:
            with self.subTest(file=os.path.relpath(p, SOURCE_DIR)):
                self.assertTrue(load_yaml_docs(p))

    def dockerfile_stages(self):
        """{stage: [(instruction, args)]} with line continuations joined."""
        text = read(DOCKERFILE).replace("\\\n", " ")
        args, stages, cur = {}, {}, None
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            instr, _, rest = line.partition(" ")
            instr = instr.upper()
            if instr == "ARG" and cur is None:
                k, _, v = rest.partition("=")
                args[k] = v
            elif instr == "FROM":
                m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.I)
                image = re.sub(r"\$\{(\w+)\}", lambda mm: args[mm.group(1)], m.group(1))
                cur = m.group(2)
                stages[cur] = [("FROM", image)]
            else:
                stages[cur].append((instr, rest.strip()))
        return stages

    @staticmethod
    def apt_packages(stage):
        pkgs = []
        for instr, rest in stage:
            if instr == "RUN" and "apt-get install" in rest:
                seg = rest.split("apt-get install", 1)[1].split("&&", 1)[0]
                pkgs += [w for w in shlex.split(seg) if not w.startswith("-")]
        return pkgs

    # The sanitizer runtimes of a -DTALLY_SANITIZE=ON build dir; the image never builds so.
    SANITIZER_PACKAGES = re.compile(r"^lib(asan|ubsan|lsan|tsan)\d+$")

    @classmethod
    def needed_packages(cls, path):
        """Debian packages holding the DT_NEEDED libraries of a binary (direct ones only:
        apt installs what those depend on)."""
        sonames = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                             run(["readelf", "-d", path]).stdout)
        resolved = dict(re.findall(r"^\s*(\S+) => (/\S+)", run(["ldd", path]).stdout, re.M))
        pkgs = set()
        for soname in sonames:
            lib = resolved.get(soname)
            assert lib, f"{path}: ldd does not resolve {soname}"
            cands = {lib, os.path.realpath(lib)}
            cands |= {c[len("/usr"):] if c.startswith("/usr/") else "/usr" + c for c in set(cands)}
            owners = set()
            for c in sorted(cands):
                q = run(["dpkg", "-S", c])
                if q.returncode == 0:
                    owners |= {o.strip().split(":")[0] for o in
                               q.stdout.split(":", 1)[0].split(",")}
            assert owners, f"no Debian package holds {lib} ({soname})"
            pkgs |= {o for o in owners if not cls.SANITIZER_PACKAGES.match(o)}
        return pkgs

    def test_dockerfile_stages_and_users(self):
        st = self.dockerfile_stages()
        self.assertEqual(list(st), ["build", "tool", "debug", "runtime"],
                         "runtime last: the default target")
        for name in ("tool", "runtime"):
            with self.subTest(stage=name):
                self.assertEqual(st[name][0][1], st["build"][0][1], "one base image")
                users = [a for i, a in st[name] if i == "USER"]
                self.assertTrue(users, "a USER")
                uid = users[-1].split(":")[0]
                self.assertRegex(uid, r"^\d+$", "numeric, for runAsNonRoot")
                self.assertNotEqual(int(uid), 0)
                for pkg in self.apt_packages(st[name]):
                    self.assertFalse(pkg.endswith("-dev") or pkg in ("build-essential", "cmake"),
                                     f"{pkg} is a build dependency")
        copied = " ".join(a for i, a in st["runtime"] if i == "COPY")
        for prog in PROGRAMS:
            self.assertIn(f"/out/bin/{prog} ", copied + " ")
        env = " ".join(a for i, a in st["runtime"] if i == "ENV")
        self.assertIn("TALLY_METRICS_ADDR=0.0.0.0:9464", env)
        assert_known_tally_vars(self, re.findall(r"(TALLY_[A-Z_]+)=", env), "Dockerfile")
        self.assertIn("9464", [a for i, a in st["runtime"] if i == "EXPOSE"])

    def test_base_images_are_pinned_by_date_and_digest(self):
        """Every FROM names a dated Debian tag and the digest of its index, so a rebuild of
        the same sources starts from the same bytes (a floating debian:12 moves weekly)."""
        st = self.dockerfile_stages()
        for name, stage in st.items():
            image = stage[0][1]
            with self.subTest(stage=name):
                if image == "scratch":
                    continue
                self.assertRegex(image, r"^debian:bookworm-(\d{8})-slim@sha256:[0-9a-f]{64}$")

    def test_oci_labels(self):
        """The published images say what they are, which version and which commit
        (org.opencontainers.image.*, from build arguments); the version is CMake's."""
        text = read(DOCKERFILE).replace("\\\n", " ")
        top = dict(re.findall(r"^ARG (\w+)=(\S*)$", text.split("\nFROM ", 1)[0], re.M))
        self.assertEqual(top["TALLY_VERSION"], cmake_version())
        st = self.dockerfile_stages()
        keys = ("title", "description", "version", "revision", "source", "licenses", "created")
        for name, title in (("runtime", "tally"), ("tool", "tally-fake-tool")):
            with self.subTest(stage=name):
                label = " ".join(a for i, a in st[name] if i == "LABEL")
                labels = dict(re.findall(r'org\.opencontainers\.image\.(\w+)="([^"]*)"', label))
                self.assertEqual(sorted(labels), sorted(keys))
                self.assertEqual(labels["title"], title)
                declared = {a for i, a in st[name] if i == "ARG"}
                for key in ("version", "revision", "source", "licenses", "created"):
                    arg = re.fullmatch(r"\$\{(\w+)\}", labels[key])
                    self.assertTrue(arg, f"{key} comes from a build argument")
                    self.assertIn(arg.group(1), top, f"{key}: a default at the top")
                    self.assertIn(arg.group(1), declared, f"{key}: ARG in the stage")
        # the documented release build passes the ones only the builder knows
        readme = "\n".join(markdown_section(read(os.path.join(DEPLOY, "README.md")),
                                             "Container image"))
        for arg in ("TALLY_REVISION", "TALLY_CREATED", "TALLY_SOURCE", "TALLY_LICENSES"):
            self.assertIn(f"--build-arg {arg}=", readme)
        self.assertIn(f"tally:{cmake_version()}", readme)

    def test_debug_symbols_are_kept_apart(self):
        """The build splits the symbols off (deploy/split-debug.sh) to where gdb looks for
        the runtime image's programs; the runtime image copies only the stripped programs,
        the debug target only the symbols."""
        st = self.dockerfile_stages()
        build = " ".join(a for i, a in st["build"] if i == "RUN")
        m = re.search(r"sh deploy/split-debug\.sh /out/bin (\S+)", build)
        self.assertTrue(m, "the build runs deploy/split-debug.sh")
        self.assertEqual(m.group(1), "/out/debug/usr/lib/debug/usr/local/bin",
                         "the symbols of /usr/local/bin/<program> under /usr/lib/debug")
        self.assertLess(build.index("split-debug.sh"), build.index("grep -l TALLY_CRASH_AT"))
        self.assertEqual(st["debug"][0][1], "scratch")
        self.assertEqual([(i, a) for i, a in st["debug"][1:]],
                         [("COPY", "--from=build /out/debug/ /")])
        for name in ("runtime", "tool"):
            for a in [a for i, a in st[name] if i == "COPY"]:
                self.assertNotIn("/out/debug", a, f"{name} carries no debug symbols")
                self.assertEqual(a.split()[-1], "/usr/local/bin/", a)

    def test_split_debug_script(self):
        """deploy/split-debug.sh on this tree's programs: each is stripped of DWARF and names
        its symbols file with the right CRC; the file holds the DWARF; gdb finds it in the
        /usr/lib/debug layout; the stripped program still runs."""
        tmp = tempfile.mkdtemp(prefix="tally-split-debug-")
        self.addCleanup(shutil.rmtree, tmp, True)
        bindir, debugdir = os.path.join(tmp, "bin"), os.path.join(tmp, "debug")
        os.makedirs(bindir)
        for prog in PROGRAMS:
            shutil.copy(binary(prog), bindir)
        r = run(["sh", os.path.join(DEPLOY, "split-debug.sh"), bindir, debugdir])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for prog in PROGRAMS:
            with self.subTest(program=prog):
                exe, dbg = os.path.join(bindir, prog), os.path.join(debugdir, prog + ".debug")
                sections = run(["readelf", "-S", "-W", exe]).stdout
                self.assertNotIn(".debug_info", sections)
                self.assertNotIn(".symtab", sections)
                dump = os.path.join(tmp, prog + ".debuglink")
                r = run(["objcopy", "--dump-section", f".gnu_debuglink={dump}", exe,
                         os.path.join(tmp, "scratch")])
                self.assertEqual(r.returncode, 0, r.stderr)
                with open(dump, "rb") as f:
                    link = f.read()
                name, _, rest = link.partition(b"\0")
                self.assertEqual(name.decode(), prog + ".debug")
                crc = int.from_bytes(link[-4:], "little")
                with open(dbg, "rb") as f:
                    self.assertEqual(crc, zlib.crc32(f.read()), "the debuglink CRC")
                self.assertIn(".debug_info", run(["readelf", "-S", "-W", dbg]).stdout)
                v = run([exe, "--version"])
                self.assertIn(cmake_version(), v.stdout + v.stderr)
        if shutil.which("gdb"):
            # /usr/lib/debug/<the program's directory>/<program>.debug, as the image lays out
            root = os.path.join(tmp, "usr-lib-debug")
            os.makedirs(root + bindir)
            shutil.copy(os.path.join(debugdir, "tally-dispatcher.debug"), root + bindir)
            exe = os.path.join(bindir, "tally-dispatcher")
            g = run(["gdb", "-nx", "-batch", "-iex", f"set debug-file-directory {root}",
                     "-ex", "info line tally_worker_main", exe])
            self.assertRegex(g.stdout, r'Line \d+ of ".*common/src/worker\.c"', g.stderr)

    def test_runtime_packages_are_exactly_what_the_binaries_link(self):
        st = self.dockerfile_stages()
        base = {"libc6"}  # in debian:12-slim
        for stage, progs in (("runtime", PROGRAMS), ("tool", ("tally-fake-tool",))):
            with self.subTest(stage=stage):
                installed = set(self.apt_packages(st[stage])) - {"ca-certificates"}
                needed = set()
                for p in progs:
                    needed |= self.needed_packages(binary(p))
                self.assertEqual(needed - base - installed, set(), "needed but not installed")
                self.assertEqual(installed - needed, set(), "installed but needed by no binary")

    def test_build_stage_has_every_pkg_config_module(self):
        st = self.dockerfile_stages()
        installed = set(self.apt_packages(st["build"]))
        cmake = ""
        for f in ("CMakeLists.txt", "tests/CMakeLists.txt"):
            cmake += read(os.path.join(SOURCE_DIR, f))
        modules = re.findall(r"pkg_check_modules\(\w+ REQUIRED IMPORTED_TARGET (\S+)\)", cmake)
        self.assertGreaterEqual(len(modules), 8)
        for mod in modules:
            q = run(["dpkg", "-S", f"*/pkgconfig/{mod}.pc"])
            self.assertEqual(q.returncode, 0, f"{mod}.pc: {q.stderr}")
            pkg = q.stdout.split(":", 1)[0].strip()
            self.assertIn(pkg, installed, f"pkg-config module {mod} needs {pkg}")

    def test_dockerignore_keeps_the_sources(self):
        path = os.path.join(SOURCE_DIR, ".dockerignore")
        patterns = [l.strip() for l in read(path).splitlines()
                    if l.strip() and not l.startswith("#")]
        self.assertIn(".git", patterns)
        self.assertTrue(any(fnmatch.fnmatch("build-h1", p) for p in patterns))
        needed = ["CMakeLists.txt", "cmake/embed_sql.cmake", "common/src/worker.c",
                  "cli/main.c", "dispatcher/main.c", "reconciler/main.c", "compensator/main.c",
                  "schemas/sql/001_ledger.sql", "tests/CMakeLists.txt", "tests/fakes/fake_tool.c"]
        for rel in needed:
            for p in patterns:
                parts = rel.split("/")
                hit = any(fnmatch.fnmatch("/".join(parts[:i]), p.strip("/"))
                          for i in range(1, len(parts) + 1))
                self.assertFalse(hit, f".dockerignore pattern {p!r} drops {rel}")

    def test_compose_structure(self):
        compose = load_yaml_docs(COMPOSE_FILE)[0]
        stages = self.dockerfile_stages()
        svcs = compose["services"]
        base = os.path.dirname(COMPOSE_FILE)
        for name, s in svcs.items():
            with self.subTest(service=name):
                self.assertTrue(s.get("image") or s.get("build"))
                if "build" in s:
                    b = s["build"]
                    self.assertEqual(os.path.realpath(os.path.join(base, b["context"],
                                                                   b["dockerfile"])),
                                     os.path.realpath(DOCKERFILE))
                    self.assertIn(b["target"], stages)
                for v in s.get("volumes", []):
                    src = v.split(":")[0]
                    if src.startswith("."):
                        self.assertTrue(os.path.exists(os.path.join(base, src)), src)
                assert_known_tally_vars(self, s.get("environment", {}), f"compose {name}")
        self.assertEqual(svcs["kafka"]["image"].split(":")[0], "apache/kafka")
        self.assertEqual(svcs["kafka"]["environment"]["KAFKA_PROCESS_ROLES"], "broker,controller")
        self.assertEqual(svcs["postgres"]["image"].split(":")[0], "postgres")
        self.assertEqual(svcs["tally-migrate"]["command"][:2], ["tally", "migrate"])
        self.assertEqual(svcs["tool"]["build"]["target"], "tool")
        tool_port = 9000
        for w in WORKERS:
            s = svcs[f"tally-{w}"]
            with self.subTest(worker=w):
                self.assertEqual(s["command"], [f"tally-{w}"])
                self.assertEqual(s["build"]["target"], "runtime")
                self.assertNotIn("ports", s, "fixed host ports would stop --scale")
                self.assertNotIn("container_name", s, "a fixed name would stop --scale")
                env = s["environment"]
                grace = int(s["stop_grace_period"].rstrip("s"))
                self.assertGreaterEqual(grace * 1000, int(env["TALLY_SHUTDOWN_GRACE_MS"]) + 10000)
                url = urllib.parse.urlparse(env["TALLY_FAKE_TOOL_URL"])
                self.assertIn(url.hostname, svcs)
                self.assertEqual(url.port, tool_port)
                self.assertEqual(s["depends_on"]["tally-migrate"]["condition"],
                                 "service_completed_successfully")
                self.assertIn("/etc/tally/tools.json", " ".join(s["volumes"]))
        self.assertEqual(set(compose_partitions()),
                         {f"tally.{t}" for t in tallytest.TOPICS})
        prom = svcs["prometheus"]
        mounts = " ".join(prom["volumes"])
        self.assertIn("../prometheus/prometheus.yml:", mounts)
        self.assertIn("../prometheus/alerts.yml:", mounts)

    def test_compose_images_are_pinned_and_kafka_has_a_cluster_id(self):
        """Every pulled image names an exact release (no latest, no bare major version); the
        images built here pass the OCI labels' build arguments; the KRaft broker's cluster id
        is fixed (so its volume survives restarts) and is a real one: a UUID, base64url."""
        svcs = load_yaml_docs(COMPOSE_FILE)[0]["services"]
        for name, svc in svcs.items():
            with self.subTest(service=name):
                if "build" in svc:
                    args = svc["build"].get("args", {})
                    self.assertEqual(set(args), {"TALLY_REVISION", "TALLY_CREATED"})
                    top = re.findall(r"^ARG (\w+)=", read(DOCKERFILE), re.M)
                    self.assertTrue(set(args) <= set(top), "build arguments of the Dockerfile")
                    continue
                self.assertRegex(svc["image"], r"^[a-z0-9./-]+:v?\d+\.\d+(\.\d+)?$",
                                 "an exact release")
        cid = svcs["kafka"]["environment"]["CLUSTER_ID"]
        self.assertRegex(cid, r"^[A-Za-z0-9_][A-Za-z0-9_-]{21}$")
        raw = base64.urlsafe_b64decode(cid + "==")
        self.assertEqual(len(raw), 16)
        self.assertNotIn(raw, (bytes(16), bytes(15) + b"\x01"), "Kafka's reserved ids")
        self.assertIn("`CLUSTER_ID`", read(os.path.join(DEPLOY, "compose", "README.md")),
                      "documented")

    def test_compose_grafana_is_provisioned_with_the_dashboard(self):
        """The grafana service: a pinned image, and mounted provisioning that names the compose
        Prometheus as its data source and loads deploy/grafana/dashboards from where it is
        mounted (Grafana itself does not run here: no Docker engine, no Debian package)."""
        svcs = load_yaml_docs(COMPOSE_FILE)[0]["services"]
        base = os.path.dirname(COMPOSE_FILE)
        g = svcs["grafana"]
        self.assertRegex(g["image"], r"^grafana/grafana-oss:\d+\.\d+\.\d+$", "pinned by tag")
        mounts = {}  # container path -> host path
        for v in g["volumes"]:
            src, dst = v.split(":")[:2]
            if src.startswith("."):
                mounts[dst] = os.path.realpath(os.path.join(base, src))
                self.assertTrue(os.path.exists(mounts[dst]), v)
        grafana_dir = os.path.join(DEPLOY, "grafana")
        self.assertEqual(mounts.get("/etc/grafana/provisioning/datasources"),
                         os.path.join(grafana_dir, "provisioning", "datasources"))
        self.assertEqual(mounts.get("/etc/grafana/provisioning/dashboards"),
                         os.path.join(grafana_dir, "provisioning", "dashboards"))
        # data sources: the compose Prometheus, by service name and container port
        [ds_file] = glob.glob(os.path.join(grafana_dir, "provisioning", "datasources", "*.yaml"))
        ds = load_yaml_docs(ds_file)[0]
        self.assertEqual(ds["apiVersion"], 1)
        [prom] = [d for d in ds["datasources"] if d["type"] == "prometheus"]
        self.assertTrue(prom["isDefault"])
        url = urllib.parse.urlparse(prom["url"])
        self.assertIn(url.hostname, svcs)
        self.assertIn(f":{url.port}", " ".join(svcs[url.hostname]["ports"]))
        self.assertIn(url.hostname, g["depends_on"])
        # dashboards: the provider's path is where deploy/grafana/dashboards is mounted
        [prov_file] = glob.glob(os.path.join(grafana_dir, "provisioning", "dashboards", "*.yaml"))
        prov = load_yaml_docs(prov_file)[0]
        self.assertEqual(prov["apiVersion"], 1)
        [provider] = prov["providers"]
        self.assertEqual(provider["type"], "file")
        path = provider["options"]["path"]
        self.assertEqual(mounts.get(path), os.path.join(grafana_dir, "dashboards"))
        dashboards = glob.glob(os.path.join(grafana_dir, "dashboards", "*.json"))
        self.assertTrue(dashboards)
        uids = []
        for f in dashboards:
            with open(f) as fh:
                d = json.load(fh)
            self.assertTrue(d["panels"], f)
            uids.append(d["uid"])
        self.assertEqual(len(uids), len(set(uids)))
        home = g["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
        self.assertTrue(home.startswith(path + "/"), home)
        self.assertTrue(os.path.exists(os.path.join(mounts[path], home[len(path) + 1:])), home)

    def test_compose_gives_each_component_its_own_credential(self):
        svcs = load_yaml_docs(COMPOSE_FILE)[0]["services"]

        def pg_user(service):
            return urllib.parse.urlparse(svcs[service]["environment"]["TALLY_PG"]).username

        self.assertEqual(pg_user("tally-migrate"), "tally_owner")
        for w in WORKERS:
            self.assertEqual(pg_user(f"tally-{w}"), f"tally_{w}")
        self.assertEqual(pg_user("tally"), "tally_operator")
        env = svcs["tally-migrate"]["environment"]
        for c in (*WORKERS, "operator", "reader"):
            self.assertIn(f"TALLY_ROLE_PASSWORD_{c.upper()}", env)
        # the superuser is the database's administrator only
        self.assertNotIn(svcs["postgres"]["environment"]["POSTGRES_USER"],
                         {pg_user(s) for s in ("tally-migrate", "tally", *(f"tally-{w}"
                                                                          for w in WORKERS))})
        init = [v for v in svcs["postgres"]["volumes"] if "docker-entrypoint-initdb.d" in v]
        self.assertEqual(len(init), 1, svcs["postgres"]["volumes"])
        script = os.path.join(os.path.dirname(COMPOSE_FILE), init[0].split(":")[0])
        self.assertIn("CREATE ROLE tally_owner LOGIN CREATEROLE", read(script))
        self.assertIn("CREATE DATABASE tally OWNER tally_owner", read(script))

    def test_docker_compose_config_validates(self):
        dc = shutil.which("docker-compose")
        if dc is None:
            self.skipTest("docker-compose (Debian package docker-compose) is not installed")
        r = run([dc, "-f", COMPOSE_FILE, "config", "-q"], cwd=os.path.dirname(COMPOSE_FILE))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)


# --- a real Prometheus scraping the real workers -----------------------------------------------


class RealPrometheusTest(tallytest.TallyCase):
    """Debian's Prometheus scrapes the three workers on the embedded stack, finds every
    documented metric on the workers the table names, and loads the alert rules."""

    def http_json(self, url):
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)

    def start_prometheus(self, targets):
        return super().start_prometheus(targets, rule_files=[os.path.join(PROM_DIR, "alerts.yml")])

    def test_prometheus_finds_every_documented_metric(self):
        doc, where = documented_metrics()
        workers = {w: self.start(f"tally-{w}", BILLING_HMAC_SECRET="deploy-test")
                   for w in WORKERS}
        proc, base = self.start_prometheus(
            {f"tally-{w}": f"127.0.0.1:{p.metrics_port}" for w, p in workers.items()})

        def targets_up():
            if proc.poll() is not None:
                raise AssertionError("prometheus exited:\n" +
                                     read(os.path.join(self.tmp, "prometheus.log")))
            try:
                t = self.http_json(base + "/api/v1/targets")["data"]["activeTargets"]
            except OSError:
                return False
            up = {x["labels"]["job"] for x in t if x["health"] == "up"}
            return up >= {f"tally-{w}" for w in WORKERS} and up
        wait_for(targets_up, timeout=60, interval=0.5, what="all three workers scraped")

        # Metadata (# HELP / # TYPE) is known per target even for a labelled family that has
        # no series yet, e.g. tally_dispatcher_db_errors_total before the first failed stage.
        def metadata(job):
            sel = urllib.parse.quote(f'{{job="{job}"}}')
            data = self.http_json(f"{base}/api/v1/targets/metadata?match_target={sel}")["data"]
            return {m["metric"]: m["type"] for m in data}

        def all_seen():
            meta = {w: metadata(f"tally-{w}") for w in WORKERS}
            return meta if all(d["type"] == meta[w].get(n)
                               for n, d in doc.items() for w in d["workers"]) else None
        try:
            meta = wait_for(all_seen, timeout=15, interval=1, what="every documented metric")
        except AssertionError:
            meta = {w: metadata(f"tally-{w}") for w in WORKERS}
        problems = []
        for name, d in sorted(doc.items()):
            for w in d["workers"]:
                got = meta[w].get(name)
                if got is None:
                    problems.append(f"{name} ({d['type']}) not exposed by tally-{w}")
                elif got != d["type"]:
                    problems.append(f"{name}: tally-{w} says {got}, {where} says {d['type']}")
        self.assertFalse(problems, "\n".join(problems))

        # A family without labels has exactly one series, which must exist from the start:
        # rate() and increase() miss the first event of a counter that appears at 1.
        names = set(self.http_json(base + "/api/v1/label/__name__/values")["data"])
        unlabelled = sorted(n for n, d in doc.items() if not d["labels"])
        missing = [n for n in unlabelled
                   if not ({n, n + "_count"} & names)]
        self.assertFalse(missing, "label-less metrics with no sample (they should start at 0): "
                                  f"{missing}")

        # The alert rules load and evaluate against real data without errors.
        def rules_evaluated():
            groups = self.http_json(base + "/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if rules and all(r.get("lastEvaluation", "").startswith("20")
                                          for r in rules) else None
        rules = wait_for(rules_evaluated, timeout=30, interval=0.5, what="rule evaluation")
        expected = {r["alert"] for g in load_yaml_docs(os.path.join(PROM_DIR, "alerts.yml"))[0]
                    ["groups"] for r in g["rules"]}
        self.assertEqual({r["name"] for r in rules}, expected)
        for r in rules:
            self.assertEqual(r["health"], "ok", f"{r['name']}: {r.get('lastError')}")
        # The rules of issue 26 read real series here (the three workers' db error counters,
        # rebalances, pager failures, the outbox, every kind discovered): once an evaluation
        # has seen every target's first scrape, none is even pending.
        quiet = ("TallyWorkerKindAbsent", "TallyDatabaseUnreachable", "TallyDatabaseErrors",
                 "TallyPagerFailing", "TallyOutboxGrowing", "TallyRebalancesFrequent",
                 "TallyConsumerLag")

        def active():
            groups = self.http_json(base + "/api/v1/rules")["data"]["groups"]
            return [r for g in groups for r in g["rules"]
                    if r["name"] in quiet and r["state"] != "inactive"]
        try:
            wait_for(lambda: not active(), timeout=30, interval=0.5, what="the new rules quiet")
        except AssertionError:
            self.fail(f"active on healthy workers: {active()}")
        # Healthy, freshly started workers: nothing fires.
        alerts = self.http_json(base + "/api/v1/alerts")["data"]["alerts"]
        self.assertEqual([a for a in alerts if a["state"] == "firing"], [])
        for p in workers.values():
            self.assertEqual(p.terminate(), 0)


if __name__ == "__main__":
    tallytest.main()
