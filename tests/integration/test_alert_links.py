"""Every alert and page links to its run in the web console (issue 25).

With TALLY_CONSOLE_URL set, a STUCK effect's tally.alert.trigger.v1 carries data.console_url:
TALLY_CONSOLE_URL without one trailing slash, then /runs/ and the run id percent-encoded as one
path segment (RFC 3986, unreserved characters kept); its PagerDuty trigger carries the same link
first in `links`, as `client_url` and in `custom_details`; the resolve event carries it too. The
auth:<tool> page links to the run whose call met the refusal. Without TALLY_CONSOLE_URL the
payloads are as they were. A bad TALLY_CONSOLE_URL stops every worker and the CLI at start-up
(exit 2), naming the variable and the rule. Real processes throughout."""

import shlex
import urllib.parse
import uuid

from invariants import check_invariants
from tallytest import wait_for
from test_compensate_flow import PagerReceiver
from test_reconcile_resolve import SECRET, ReconcileCase, main
from test_schemas import errors as schema_errors

CONSOLE = "https://tally.example.com/console/"  # one trailing slash, dropped in the links
ROUTING_KEY = "R0UT1NGKEY0000000000000000000000"
RUNBOOK = "docs/operations.md#effects-no_status_check-attempts_exhausted-status_inconclusive"


def awkward_run_id():
    """A run id as agents may send one (1-200 bytes of UTF-8 without control characters) with
    every kind of character that may not stand in a URL path segment."""
    return f"ops/run 42?x=1&y=2#frag%2F+\u00e9\u20ac-{uuid.uuid4().hex[:8]}"


def run_link(run, base="https://tally.example.com/console"):
    return base + "/runs/" + urllib.parse.quote(run, safe="")


class AlertLinksTest(ReconcileCase):

    def compensator(self, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
                "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 200, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start("tally-compensator", **base)

    def stuck_note(self, run):
        """A post_note call (append_only, no status endpoint) that applies, then times out:
        UNKNOWN, then STUCK at once (no_status_check). Returns its effect row."""
        tag = uuid.uuid4().hex[:12]
        key = f"post_note:{tag}"
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        self.publish(self.intent(run, 1, "post_note", {"note_id": tag, "text": "hi"}))
        return self.wait_status("post_note", key, "STUCK", timeout=30)

    def page_for(self, pager, key, action="trigger"):
        def found():
            return [b for b in pager.bodies()
                    if b["dedup_key"] == key and b["event_action"] == action]
        return wait_for(found, timeout=30, what=f"the PagerDuty {action} of {key}")

    def test_a_stuck_page_and_its_pager_post_link_to_the_run(self):
        pager = PagerReceiver()
        self.addCleanup(pager.close)
        console = {"TALLY_CONSOLE_URL": CONSOLE}
        self.dispatcher(**console)
        self.reconciler(**console)
        self.compensator(TALLY_PAGER_URL=pager.url, TALLY_PAGER_ROUTING_KEY=ROUTING_KEY,
                         **console)
        run = awkward_run_id()
        link = run_link(run)
        # what RFC 3986 makes of it, spelled out: only A-Z a-z 0-9 - . _ ~ stay as they are
        self.assertTrue(link.startswith(
            "https://tally.example.com/console/runs/"
            "ops%2Frun%2042%3Fx%3D1%26y%3D2%23frag%252F%2B%C3%A9%E2%82%AC-"), link)
        row = self.stuck_note(run)
        key = f"effect:{row['effect_id']}"

        # the event on <prefix>alerts
        [trigger] = self.messages("alerts", lambda ms: len(ms) >= 1)
        self.assertEqual(trigger["type"], "tally.alert.trigger.v1")
        d = trigger["data"]
        self.assertEqual((d["dedup_key"], d["run_id"], d["reason"]),
                         (key, run, "no_status_check"))
        self.assertEqual(d["console_url"], link)
        self.assertEqual(schema_errors("alert", trigger), [])

        # the page: the console link first, the runbook after it
        [page] = self.page_for(pager, key)
        self.assertEqual(page["links"], [
            {"href": link, "text": f"run {run} in the tally console"},
            {"href": RUNBOOK, "text": "runbook"}])
        self.assertEqual((page["client"], page["client_url"]), ("tally console", link))
        self.assertEqual(page["payload"]["custom_details"]["console_url"], link)
        self.assertEqual(page["payload"]["custom_details"]["run_id"], run)

        # the operator settles it with the page's command; the resolve carries the link too
        [record] = self.records("notes")
        line = d["resolve_command"].splitlines()[0].split("  #")[0]
        line = line.replace("<REF>", record["id"]).replace(
            "<what you verified upstream>", "the note is in the tool")
        argv = shlex.split(line)
        self.assertEqual(argv[:2], ["tally", "resolve"])
        out = self.cli(*argv[1:], env=self.env(**console))
        self.assertEqual(out.returncode, 0, out.stderr + out.stdout)
        msgs = self.messages("alerts", lambda ms: len(ms) >= 2)
        self.assertEqual([m["type"] for m in msgs],
                         ["tally.alert.trigger.v1", "tally.alert.resolve.v1"])
        self.assertEqual(msgs[1]["data"]["console_url"], link)
        self.assertEqual(schema_errors("alert", msgs[1]), [])
        [resolve] = self.page_for(pager, key, "resolve")
        self.assertNotIn("links", resolve)  # PagerDuty's resolve takes no links
        check_invariants(self, fake_url=self.fake_url)

    def test_without_a_console_url_nothing_links(self):
        pager = PagerReceiver()
        self.addCleanup(pager.close)
        self.dispatcher()
        self.reconciler()
        self.compensator(TALLY_PAGER_URL=pager.url, TALLY_PAGER_ROUTING_KEY=ROUTING_KEY)
        run = awkward_run_id()
        row = self.stuck_note(run)
        key = f"effect:{row['effect_id']}"
        [trigger] = self.messages("alerts", lambda ms: len(ms) >= 1)
        self.assertEqual(trigger["data"]["run_id"], run)
        self.assertNotIn("console_url", trigger["data"])
        self.assertEqual(schema_errors("alert", trigger), [])
        [page] = self.page_for(pager, key)
        self.assertEqual(page["links"], [{"href": RUNBOOK, "text": "runbook"}])
        self.assertNotIn("client_url", page)
        self.assertNotIn("client", page)
        self.assertNotIn("console_url", page["payload"]["custom_details"])

    def test_the_auth_page_links_to_the_run_that_met_the_refusal(self):
        base = "http://127.0.0.1:8088"  # a console reached directly, no path, no slash
        self.dispatcher(TALLY_CONSOLE_URL=base)
        run = awkward_run_id()
        tag = uuid.uuid4().hex[:12]
        key = f"charge_card:t1:{tag}"
        self.fault("error_4xx", key=key, status=401)
        self.publish(self.intent(run, 1, "charge_card", {"tenant_id": "t1", "payment_id": tag}))
        self.wait_status("charge_card", key, "FAILED")
        [ev] = self.read_until("alerts", lambda got: len(got) >= 1)
        self.assertEqual(ev["data"]["dedup_key"], "auth:charge_card")
        self.assertEqual(ev["data"]["console_url"], run_link(run, base))
        self.assertEqual(schema_errors("alert", ev), [])

    def test_a_bad_console_url_stops_every_worker_and_the_cli(self):
        cases = [
            ("tally-dispatcher", "ftp://tally.example.com/console",
             "invalid configuration: TALLY_CONSOLE_URL: not an http:// or https:// URL: "
             "'ftp://tally.example.com/console'"),
            ("tally-reconciler", "https://tally.example.com/con sole",
             "invalid configuration: TALLY_CONSOLE_URL: byte 30 is a space (0x20): a URL has no "
             "whitespace or control characters"),
            ("tally-compensator", "https://ops:hunter2@tally.example.com/console",
             "invalid configuration: TALLY_CONSOLE_URL: the URL carries credentials"),
            ("tally-compensator", "https://tally.example.com/console?tab=runs",
             "invalid configuration: TALLY_CONSOLE_URL: the URL has a query or a fragment"),
            ("tally-dispatcher", "https://tally.example.com/" + "a" * 600,
             "invalid configuration: TALLY_CONSOLE_URL: the URL is 626 bytes, more than the "
             "512 a console URL may have"),
        ]
        for name, value, want in cases:
            with self.subTest(worker=name, value=value):
                p = self.start(name, wait_ready=False, TALLY_CONSOLE_URL=value)
                wait_for(lambda: not p.alive(), timeout=30, what=f"{name} to exit")
                log = p.log()
                self.assertEqual(p.popen.returncode, 2, log)
                self.assertIn(want, log)
                self.assertNotIn("hunter2", log)
        # the CLI, which publishes alert resolves, refuses it the same way
        out = self.cli("config", env=self.env(TALLY_CONSOLE_URL="https://x/c\nd"))
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertEqual(out.stderr.strip(),
                         "tally: invalid configuration: TALLY_CONSOLE_URL: byte 12 is a control "
                         "character (0x0a): a URL has no whitespace or control characters")
        # and `tally config` lists a good one with its help
        out = self.cli("config", env=self.env(TALLY_CONSOLE_URL=CONSOLE))
        self.assertEqual(out.returncode, 0, out.stderr)
        [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("TALLY_CONSOLE_URL ")]
        self.assertIn(CONSOLE, line)
        self.assertIn("/runs/<run id>", line)


if __name__ == "__main__":
    main()
