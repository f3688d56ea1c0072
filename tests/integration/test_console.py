"""`tally console`, the read-only web console (docs/operations.md "Web console"), in a real
browser: headless Debian Chromium loads its pages against a stack that the real workers put in
three situations — a compensated run, a STUCK run and an effect awaiting approval — and the test
reads the DOM after the pages' script ran: each item, its state and its exact command. A STUCK
page's console link leads to the run, whose command, run with the CLI, resolves it. Screenshots
are kept under $TALLY_BUILD_DIR/artifacts/console/.

Hostile input too: a run id with markup, quotes and multi-byte characters comes back escaped and
reachable; bad parameters are 400, long addresses 414, other methods 405; and the console cannot
write, even when its role could, because every query runs in a READ ONLY transaction."""

import html.parser
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

from tallytest import BUILD_DIR, Proc, binary, free_port, wait_for
from test_cli_status import CliCase, main, run_id

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = os.path.join(BUILD_DIR, "artifacts", "console")


# --- a small DOM from html.parser --------------------------------------------------------------

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


class Node:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    def text(self):
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self):
        for c in self.children:
            if isinstance(c, Node):
                yield c
                yield from c.iter()

    def find_all(self, tag=None, **attrs):
        out = []
        for n in self.iter():
            if tag is not None and n.tag != tag:
                continue
            ok = True
            for k, v in attrs.items():
                k = k.rstrip("_").replace("_", "-")
                have = n.attrs.get(k)
                if k == "class":
                    ok = ok and have is not None and v in have.split()
                else:
                    ok = ok and have == v
            if ok:
                out.append(n)
        return out

    def find(self, tag=None, **attrs):
        found = self.find_all(tag, **attrs)
        return found[0] if found else None


class DomBuilder(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {}, None)
        self.cur = self.root

    def handle_starttag(self, tag, attrs):
        n = Node(tag, attrs, self.cur)
        self.cur.children.append(n)
        if tag not in VOID:
            self.cur = n

    def handle_startendtag(self, tag, attrs):
        self.cur.children.append(Node(tag, attrs, self.cur))

    def handle_endtag(self, tag):
        n = self.cur
        while n is not None and n.tag != tag:
            n = n.parent
        if n is not None and n.parent is not None:
            self.cur = n.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def parse(markup):
    b = DomBuilder()
    b.feed(markup)
    b.close()
    return b.root


def css_rules(dom):
    """The page's stylesheet as {selector: {property: value}}, each selector of a group on its
    own (the console's <style> is plain, without @-rules or comments)."""
    rules = {}
    for style in dom.find_all("style"):
        for block in style.text().split("}"):
            if "{" not in block:
                continue
            selectors, body = block.split("{", 1)
            decls = dict(d.split(":", 1) for d in body.split(";") if ":" in d)
            for sel in selectors.split(","):
                rules.setdefault(sel.strip(), {}).update(
                    {k.strip(): v.strip() for k, v in decls.items()})
    return rules


class ConsoleCase(CliCase):

    def setUp(self):
        super().setUp()
        if not os.path.exists(CHROMIUM):
            self.fail(f"{CHROMIUM} is not installed (scripts/deps.sh installs Debian's chromium)")
        os.makedirs(ARTIFACTS, exist_ok=True)
        self.profile = tempfile.mkdtemp(prefix="tally-console-chromium-")
        self.console_port = free_port()
        self.console_url = f"http://127.0.0.1:{self.console_port}"

    def tearDown(self):
        super().tearDown()
        shutil.rmtree(self.profile, ignore_errors=True)
        # an ASan/UBSan build reports at exit, after the processes stopped
        for p in self.procs:
            if p.name == "tally-console":
                for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
                    self.assertNotIn(marker, p.log(), f"{p.log_path}")

    # --- the console -------------------------------------------------------------------------

    def console(self, *args, port=None, **env):
        """Start `tally console` on 127.0.0.1:<port>, as the reader (TALLY_PG_READER) unless
        env says otherwise; wait for /healthz."""
        port = port or self.console_port
        base = {"TALLY_PG_READER": self.pg_as("reader")}
        base.update(env)
        e = self.env(**base)
        p = Proc("tally-console", [binary("tally"), "console", "--listen", f"127.0.0.1:{port}",
                                   *args], e, self.tmp)
        self.procs.append(p)
        wait_for(lambda: not p.alive() or self.http(f"http://127.0.0.1:{port}/healthz")[0] == 200,
                 timeout=30, what="tally console /healthz")
        self.assertTrue(p.alive(), p.log())
        return p

    @staticmethod
    def http(url, method="GET"):
        """(status, headers, body) of one request; (0, {}, reason) when it could not be made."""
        req = urllib.request.Request(url, method=method)
        opener = urllib.request.build_opener(NoRedirect)
        try:
            with opener.open(req, timeout=10) as r:
                return r.status, dict(r.headers), r.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read().decode("utf-8", "replace")
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            return 0, {}, str(e)

    def browser(self, url, screenshot=None):
        """The DOM of @url after its scripts ran, in headless Chromium; with @screenshot a
        PNG of the page is kept under ARTIFACTS and its path printed."""
        common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
                  f"--user-data-dir={self.profile}"]
        out = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True,
                             timeout=90)
        self.assertEqual(out.returncode, 0, f"chromium --dump-dom {url}:\n{out.stderr[-3000:]}")
        self.assertIn("</html>", out.stdout, f"no DOM from {url}:\n{out.stderr[-3000:]}")
        if screenshot:
            path = os.path.join(ARTIFACTS, screenshot)
            if os.path.exists(path):
                os.remove(path)
            shot = subprocess.run(common + [f"--screenshot={path}", "--window-size=1280,1600",
                                            "--hide-scrollbars", url],
                                  capture_output=True, text=True, timeout=90)
            self.assertEqual(shot.returncode, 0, shot.stderr[-3000:])
            self.assertTrue(os.path.exists(path) and os.path.getsize(path) > 10000, path)
            print(f"\n  screenshot: {path}", flush=True)
        return parse(out.stdout)

    def assert_script_ran(self, dom):
        """The copy buttons are hidden without JavaScript; the page's script shows them."""
        body = dom.find("body")
        self.assertEqual(body.attrs.get("data-ready"), "1", "the page's script did not run")
        buttons = dom.find_all("button", class_="copy")
        for b in buttons:
            self.assertNotIn("hidden", b.attrs, "a copy button was left hidden")
        return buttons

    def item(self, dom, container_id, item_id):
        box = dom.find(id=container_id)
        self.assertIsNotNone(box, f"no #{container_id} on the page")
        found = [n for n in box.iter() if n.attrs.get("data-id") == item_id]
        self.assertEqual(len(found), 1, f"{item_id} in #{container_id}: {box.text()[:2000]}")
        return found[0]

    def resolve(self, page, a):
        """The address a link of @page leads to."""
        return urllib.parse.urljoin(self.console_url + page, a.attrs["href"])

    def assert_relative(self, dom):
        """Every link and form is relative, so that a proxy may serve the console under a
        path of its own (TALLY_CONSOLE_URL=https://host/console)."""
        for n in dom.find_all("a") + dom.find_all("form"):
            target = n.attrs.get("href", n.attrs.get("action", ""))
            self.assertFalse(target.startswith("/") or "://" in target, target)

    @staticmethod
    def commands(node):
        return [n.text() for n in node.find_all("pre", class_="command")]

    def copy_target(self, node):
        """The command a copy button copies: the element its data-for names."""
        [button] = node.find_all("button", class_="copy")
        [pre] = [n for n in node.find_all("pre") if n.attrs.get("id") == button.attrs["data-for"]]
        return pre.text()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


class ConsoleTest(ConsoleCase):

    def test_three_situations_in_the_browser_and_a_stuck_page_resolved_from_its_link(self):
        self.dispatcher()
        self.reconciler(TALLY_CONSOLE_URL=self.console_url)
        self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                   BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                   TALLY_SWEEP_MS=300, TALLY_CONSOLE_URL=self.console_url)
        alerts = self.reader("alerts")

        # 1. a compensated run: a charge, undone by `tally compensate`
        run_c = "run-compensated-" + uuid.uuid4().hex[:8]
        charge = self.confirmed_charge(run_c)
        out = self.tally("compensate", "--run", run_c, "--reason", "the agent gave up",
                         "--actor", "hank")
        self.assertEqual(out.returncode, 0, out.stderr)
        wait_for(lambda: self.scalar("SELECT status FROM runs WHERE run_id = %s", (run_c,))
                 == "COMPENSATED", timeout=40, what="the compensator to settle the run")
        # 2. a STUCK run: a note applied upstream whose answer timed out, no status endpoint
        run_s = "run-stuck-" + uuid.uuid4().hex[:8]
        stuck, record = self.stuck_note(run_s)
        # 3. a destructive step awaiting approval
        run_a = "run-approval-" + uuid.uuid4().hex[:8]
        self.publish(self.intent(run_a, 1, "delete_account", {"account_id": f"{run_a}-acct"}))
        gated = self.wait_status("delete_account", f"delete_account:{run_a}-acct",
                                 "AWAITING_APPROVAL", timeout=30)["effect_id"]

        self.console()
        before = self.snapshot()

        # The runs, newest first, each with its state.
        dom = self.browser(self.console_url + "/runs", screenshot="console-runs.png")
        self.assert_script_ran(dom)
        rows = dom.find(id="runs").find_all("tr")[1:]
        listed = {r.find("a", class_="run").text(): r for r in rows}
        self.assertEqual(list(listed)[:3], [run_a, run_s, run_c])
        self.assertEqual(listed[run_c].find("span", class_="badge").text(), "COMPENSATED")
        self.assertIn("1 STUCK", listed[run_s].text())
        self.assertIn("1 approval", listed[run_a].text())
        self.assertEqual(self.resolve("/runs", listed[run_s].find("a", class_="run")),
                         f"{self.console_url}/runs/{run_s}")
        self.assert_relative(dom)
        # Filters narrow it.
        dom = self.browser(self.console_url + "/runs?state=COMPENSATED")
        self.assertEqual([a.text() for a in dom.find(id="runs").find_all("a", class_="run")],
                         [run_c])
        dom = self.browser(self.console_url + "/runs?tool=delete_account")
        self.assertEqual([a.text() for a in dom.find(id="runs").find_all("a", class_="run")],
                         [run_a])

        # The queues: the STUCK effect with its page's command, the approval with its own.
        [(page_cmd,)] = self.query("SELECT resolve_command FROM alerts WHERE dedup_key = %s",
                                   (f"effect:{stuck}",))
        dom = self.browser(self.console_url + "/queues", screenshot="console-queues.png")
        buttons = self.assert_script_ran(dom)
        self.assertGreaterEqual(len(buttons), 2)
        it = self.item(dom, "queue-stuck", stuck)
        self.assertEqual(self.copy_target(it), page_cmd)
        self.assertIn(f"tally resolve --effect {stuck} --as confirmed --ref <REF>", page_cmd)
        self.assertEqual(it.find("a", class_="run").text(), run_s)
        it = self.item(dom, "queue-approvals", gated)
        self.assertEqual(self.copy_target(it),
                         f'tally approve --effect {gated} --reason "<why>"  # let it go ahead\n'
                         f'tally deny --effect {gated} --reason "<why>"  # refuse it')
        self.assertIn("STUCK: 1", dom.find(id="queue-stuck").find("h2").text())
        self.assertIn("Awaiting approval: 1", dom.find(id="queue-approvals").find("h2").text())

        # The compensated run: its timeline draws every kind of moment, on one axis.
        dom = self.browser(self.console_url + f"/runs/{run_c}",
                           screenshot="console-run-compensated.png")
        self.assert_script_ran(dom)
        self.assertEqual(dom.find(id="run-header").find("span", class_="badge").text(),
                         "COMPENSATED")
        svg = dom.find("svg", id="timeline")
        self.assertIsNotNone(svg)
        marks = [g.attrs["data-mark"] for g in svg.find_all("g", class_="mark")]
        for kind in ("intake", "dispatch attempt", "answer", "obligation", "reverse / contain",
                     "operator action"):
            self.assertIn(kind, marks)
        titles = [g.find("title").text() for g in svg.find_all("g", class_="mark")]
        self.assertTrue(any("operator" in t and "hank" in t for t in titles), titles)
        lanes = [t.text() for t in svg.find_all("text") if t.text().startswith("step ")]
        self.assertEqual(lanes, ["step 1 · charge_card"])
        [ob_row] = dom.find(id="obligations").find_all("tr")[1:]
        self.assertEqual(ob_row.find("span", class_="badge").text(), "RESOLVED")
        self.assertEqual(self.resolve(f"/runs/{run_c}", ob_row.find("a", class_="effect")),
                         f"{self.console_url}/effects/{charge}")
        self.assert_relative(dom)
        self.assertIn("Nothing here needs a human", dom.find(id="problems").text())

        # The effect page: its receipt, obligations and events.
        dom = self.browser(self.console_url + f"/effects/{charge}")
        self.assertIn('"id"', dom.find(id="receipt").text())
        self.assertGreater(len(dom.find(id="events").find_all("tr")), 4)

        # The approval's run page carries its command.
        dom = self.browser(self.console_url + f"/runs/{run_a}",
                           screenshot="console-run-approval.png")
        it = self.item(dom, "problems", gated)
        self.assertIn(f"tally approve --effect {gated}", self.copy_target(it))

        # The STUCK page, as a pager shows it: its console link leads to the run.
        msgs = self.read_until("alerts", lambda ms: any(
            m.get("type") == "tally.alert.trigger.v1"
            and m["data"].get("dedup_key") == f"effect:{stuck}" for m in ms), reader=alerts)
        [page] = [m for m in msgs if m["data"].get("dedup_key") == f"effect:{stuck}"]
        link = page["data"].get("console_url")
        self.assertEqual(link, f"{self.console_url}/runs/{run_s}", page["data"])
        dom = self.browser(link, screenshot="console-run-stuck.png")
        self.assert_script_ran(dom)
        svg = dom.find("svg", id="timeline")
        self.assertIn("alert", [g.attrs["data-mark"] for g in svg.find_all("g", class_="mark")])
        it = self.item(dom, "problems", stuck)
        cmd = self.copy_target(it)
        self.assertEqual(cmd, page_cmd)
        # Run the command as given: the line for "it happened", with the record's id and a reason.
        line = next(ln for ln in cmd.splitlines() if "--as confirmed" in ln)
        args = shlex.split(line, comments=True)
        self.assertEqual(args[:2], ["tally", "resolve"])
        args = [record["id"] if a == "<REF>" else
                "the note is in the notes admin" if a.startswith("<") else a for a in args]
        out = self.tally(*args[1:], "--actor", "olga")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(self.scalar("SELECT status FROM effects WHERE effect_id = %s",
                                     (stuck,)), "CONFIRMED")
        # ... and the console says so.
        dom = self.browser(link)
        self.assertIn("Nothing here needs a human", dom.find(id="problems").text())
        dom = self.browser(self.console_url + "/queues")
        self.assertIn("STUCK: 0", dom.find(id="queue-stuck").find("h2").text())
        self.assertNotIn(stuck, dom.find(id="queue-stuck").text())

        # Search finds each thing by what an operator holds.
        charge_ref = self.scalar("SELECT external_ref FROM effects WHERE effect_id = %s",
                                 (charge,))
        for q, where in ((run_c, f"/runs/{run_c}"), (charge, f"/effects/{charge}"),
                         (charge_ref, f"/effects/{charge}"),      # its obligation's ref too
                         (f"delete_account:{run_a}-acct", f"/effects/{gated}"),
                         (record["id"], f"/effects/{stuck}")):
            status, headers, _ = self.http(self.console_url + "/search?q="
                                           + urllib.parse.quote(q, safe=""))
            self.assertEqual(status, 302, q)
            self.assertEqual(urllib.parse.urljoin(self.console_url + "/search",
                                                  headers["Location"]),
                             self.console_url + where, q)

        # The console changed nothing (the CLI's resolve aside, which the snapshot predates).
        after = self.snapshot()
        for table in ("runs", "obligations"):
            self.assertEqual(before[table], after[table], table)
        self.invariants()

    def test_ids_never_wrap_and_an_active_run_with_every_effect_settled_says_so(self):
        self.dispatcher()
        run_d = "run-settled-" + uuid.uuid4().hex[:8]
        charges = [self.confirmed_charge(run_d, step) for step in (1, 2)]
        run_a = "run-approval-" + uuid.uuid4().hex[:8]
        self.publish(self.intent(run_a, 1, "delete_account", {"account_id": f"{run_a}-acct"}))
        self.wait_status("delete_account", f"delete_account:{run_a}-acct", "AWAITING_APPROVAL",
                         timeout=30)
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run_d,)),
                         "ACTIVE")
        self.console()
        settled = "all 2 effects settled, not completed"  # tally doctor's header says the same

        # The runs list: the ACTIVE badge, then the words; not for a run still waiting.
        dom = self.browser(self.console_url + "/runs", screenshot="console-runs-settled.png")
        rows = {r.find("a", class_="run").text(): r
                for r in dom.find(id="runs").find_all("tr")[1:]}
        state = rows[run_d].find_all("td")[1]
        self.assertEqual(state.find("span", class_="badge").text(), "ACTIVE")
        self.assertEqual(state.find("span", class_="settled").text(), settled)
        self.assertEqual(" ".join(state.text().split()), f"ACTIVE {settled}")
        self.assertEqual(rows[run_a].find("span", class_="badge").text(), "ACTIVE")
        self.assertIsNone(rows[run_a].find("span", class_="settled"), rows[run_a].text())
        # ... and the run's own page
        dom = self.browser(self.console_url + f"/runs/{run_d}")
        header = dom.find(id="run-header")
        self.assertEqual(header.find("span", class_="badge").text(), "ACTIVE")
        self.assertEqual(header.find("span", class_="settled").text(), settled)
        dom_a = self.browser(self.console_url + f"/runs/{run_a}")
        self.assertIsNone(dom_a.find(id="run-header").find("span", class_="settled"))

        # Ids stand whole: every cell holding an effect id, an operation key or an external
        # ref is an id cell, and the stylesheet keeps id cells and id links from wrapping;
        # a table too wide scrolls in its wrapper instead.
        rules = css_rules(dom)
        for sel in ("td.id", "a.effect", "a.run"):
            self.assertEqual(rules.get(sel, {}).get("white-space"), "nowrap", (sel, rules))
            self.assertNotEqual(rules[sel].get("word-break"), "break-all", sel)
        self.assertNotEqual(rules["pre"].get("word-break"), "break-all")
        self.assertEqual(rules[".wide"].get("overflow-x"), "auto")
        table = dom.find(id="effects")
        self.assertIn("wide", table.parent.attrs.get("class", "").split())
        refs = self.query("SELECT effect_id::text, operation_key, external_ref FROM effects"
                          " WHERE run_id = %s", (run_d,))
        self.assertEqual(sorted(r[0] for r in refs), sorted(charges))
        cells = table.find_all("td")
        for effect, key, ref in refs:
            for value in (effect, key, ref):
                [cell] = [c for c in cells if c.text().strip() == value]
                self.assertIn("id", cell.attrs.get("class", "").split(), value)
        for page in ("/runs", f"/runs/{run_d}"):
            dom = self.browser(self.console_url + page)
            for t in dom.find_all("table"):
                self.assertIn("wide", t.parent.attrs.get("class", "").split(), page)

    def test_hostile_input_is_escaped_refused_and_never_written(self):
        self.dispatcher()
        hostile = "r-<script>alert(\"x\")</script>'&é€😀-" + uuid.uuid4().hex[:6]
        self.publish(self.intent(hostile, 1, "check_balance", {"request_id": f"{hostile}-b"}))
        eid = self.wait_status("check_balance", f"check_balance:{hostile}-b", "CONFIRMED",
                               timeout=30)["effect_id"]
        proc = self.console()
        base = self.console_url

        # Escaped in the list, and the link reaches the run.
        status, _, raw = self.http(base + "/runs")
        self.assertEqual(status, 200)
        self.assertNotIn("<script>alert", raw)
        self.assertIn("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&#39;&amp;é€😀", raw)
        dom = self.browser(base + "/runs")
        [a] = dom.find(id="runs").find_all("a", class_="run")
        self.assertEqual(a.text(), hostile)
        self.assertEqual(len(dom.find_all("script")), 1)          # the console's own only
        self.assertEqual(self.resolve("/runs", a),
                         base + "/runs/" + urllib.parse.quote(hostile, safe=""))
        dom = self.browser(self.resolve("/runs", a), screenshot="console-run-hostile.png")
        self.assertEqual(dom.find("h1").text(), f"Run {hostile}")
        self.assertEqual(len(dom.find_all("script")), 1)
        self.assertEqual(dom.find(id="effects").find("a", class_="effect").text(), eid)
        status, _, _ = self.http(base + "/runs/" + urllib.parse.quote(hostile, safe=""))
        self.assertEqual(status, 200)
        status, headers, _ = self.http(base + "/search?q=" + urllib.parse.quote(hostile, safe=""))
        self.assertEqual(status, 302)
        self.assertEqual(urllib.parse.urljoin(base + "/search", headers["Location"]),
                         base + "/runs/" + urllib.parse.quote(hostile, safe=""))

        # Bad input: a clear 400 page, never a query.
        for path, words in (("/runs?state=NOPE", "not a run state"),
                            ("/runs?since=yesterday", "ISO 8601"),
                            ("/runs?until=2026-13-01", "ISO 8601"),
                            ("/runs?page=0", "page must be"),
                            ("/runs?page=abc", "page must be"),
                            ("/runs?colour=red", "unknown parameter"),
                            ("/runs?state=ACTIVE&state=STUCK", "more than once"),
                            ("/runs?tenant=%FF", "not printable UTF-8"),
                            ("/runs?tool=a%0Ab", "not printable UTF-8"),
                            ("/runs/a%FFb", "not valid UTF-8"),
                            ("/effects/not-a-uuid", "not an effect id"),
                            ("/search", "search for something"),
                            ("/search?q=" + "x" * 500, "at most")):
            status, headers, body = self.http(base + path)
            self.assertEqual(status, 400, (path, body[:300]))
            self.assertIn(words, body, path)
            self.assertTrue(headers.get("Content-Type", "").startswith("text/html"), path)
        # SQL in a search is text.
        status, _, body = self.http(base + "/search?q="
                                    + urllib.parse.quote("x'; DROP TABLE runs; --"))
        self.assertEqual(status, 200)
        self.assertIn("No run, effect", body)
        self.assertEqual(self.scalar("SELECT count(*) FROM runs WHERE run_id = %s", (hostile,)), 1)
        # Unknown pages, other methods, long addresses.
        self.assertEqual(self.http(base + "/nope")[0], 404)
        self.assertEqual(self.http(base + "/runs/no-such-run")[0], 404)
        self.assertEqual(self.http(base + f"/effects/{uuid.uuid4()}")[0], 404)
        status, headers, _ = self.http(base + "/runs", method="POST")
        self.assertEqual((status, headers.get("Allow")), (405, "GET, HEAD"))
        self.assertEqual(self.http(base + "/runs", method="DELETE")[0], 405)
        status, _, body = self.http(base + "/runs", method="HEAD")
        self.assertEqual((status, body), (200, ""))
        self.assertEqual(self.http(base + "/runs?tenant=" + "a" * 5000)[0], 414)
        self.assertIn(self.http(base + "/runs/" + "a" * 100000)[0], (414, 431, 0))
        self.assertEqual(self.http(base + "/healthz")[0], 200)      # still serving
        # Every response forbids scripts but its own (a nonce per response).
        _, headers, _ = self.http(base + "/queues")
        self.assertIn("script-src 'nonce-", headers["Content-Security-Policy"])

        # It reads as the read-only role...
        users = self.query("SELECT DISTINCT usename FROM pg_stat_activity"
                           " WHERE datname = %s AND application_name LIKE 'tally-console/%%'",
                           (self.dbname,))
        self.assertEqual(users, [("tally_reader",)])
        # ... and given a role that may write, its transactions still cannot.
        port = free_port()
        self.console(port=port, TALLY_PG_READER="", TALLY_CONSOLE_TEST_WRITE="1")
        status, _, body = self.http(f"http://127.0.0.1:{port}/_test/write")
        self.assertEqual(status, 403, body[:500])
        self.assertIn("25006", body)          # read_only_sql_transaction
        self.assertIn("read-only transaction", body)
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE kind = 'console_probe'"),
                         0)
        users = self.query("SELECT DISTINCT usename FROM pg_stat_activity"
                           " WHERE datname = %s AND application_name LIKE 'tally-console/%%'"
                           " ORDER BY 1", (self.dbname,))
        self.assertEqual(users, [("tally_operator",), ("tally_reader",)])

        # SIGTERM: exit 0.
        self.assertEqual(proc.terminate(), 0)

    def test_a_non_loopback_address_needs_listen(self):
        # `tally --help` lists it; its own --help says how it reads; no database: exit 3
        out = self.tally("--help")
        self.assertIn("console", out.stdout)
        out = self.tally("console", "--help")
        self.assertEqual(out.returncode, 0)
        self.assertIn("TALLY_PG_READER", out.stdout)
        self.assertIn("READ ONLY", out.stdout)
        out = subprocess.run([binary("tally"), "console", "--listen", "127.0.0.1:0"],
                             env=self.env(TALLY_PG="host=/nonexistent dbname=x"),
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 3, out.stderr)
        env = self.env(TALLY_PG_READER=self.pg_as("reader"),
                       TALLY_CONSOLE_ADDR=f"0.0.0.0:{free_port()}")
        out = subprocess.run([binary("tally"), "console"], env=env, capture_output=True,
                             text=True, timeout=30)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("not a loopback address", out.stderr)
        self.assertIn("--listen", out.stderr)
        # Said explicitly, it serves, with a warning.
        port = free_port()
        p = subprocess.Popen([binary("tally"), "console", "--listen", f"0.0.0.0:{port}"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: self.http(f"http://127.0.0.1:{port}/healthz")[0] == 200
                     or p.poll() is not None, timeout=30, what="the console on 0.0.0.0")
            self.assertIsNone(p.poll())
        finally:
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertIn("no authentication of its own", err)
        self.assertIn(f"serving http://0.0.0.0:{port}/", out)
        # A wrong address is a usage error.
        out = subprocess.run([binary("tally"), "console", "--listen", "nowhere"], env=env,
                             capture_output=True, text=True, timeout=30)
        self.assertEqual(out.returncode, 2)
        self.assertIn("is not an address", out.stderr)


if __name__ == "__main__":
    main()
