"""`tally verify` (DESIGN §12, issue 24): the ledger checked against its own invariants and,
with --tools, against the tools' own records; and `tally resolve --finding`, the lever that
closes what it files.

Real processes: tally-dispatcher makes the ledger by calling tally-fake-tool (which offers the
connector's `list` endpoint); the test then breaks rows by hand (as the superuser), or makes
records straight at the fake tool that tally never asked for, and runs `tally verify` as a
separate process, as an operator would: as the read-only role for the ledger checks, as the
operator role when it paces tool calls or files findings. What a user checks: the exit code
(0 clean, 1 findings, 2 could not check), the finding named with the command that acts on it,
and the findings table."""

import json
from datetime import datetime
import os
import subprocess
import tempfile
import urllib.request
import uuid

from dispatchcase import SECRET, DispatchCase, main, run_id
from tallytest import SOURCE_DIR, binary, free_port, wait_for

DEMO_TOOLS = os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")
RATE = 4  # charge_card's audit.rate_per_s in these tests


class VerifyCase(DispatchCase):
    """DispatchCase with a registry whose charge_card and create_hold declare connector.list
    (the fake tool serves it at /<collection>/list) and a known call rate."""

    def setUp(self):
        with open(DEMO_TOOLS) as f:
            doc = json.load(f)
        for tool in doc["tools"]:
            if tool["name"] in ("charge_card", "create_hold"):
                path = tool["connector"]["execute"]["path"]
                tool["connector"]["list"] = {"method": "GET", "path": path + "/list"}
                # no reconciler runs here: the policy only gives verify its rate
                tool["audit"] = {"enabled": False, "rate_per_s": RATE}
        self.tools_file = os.path.join(tempfile.mkdtemp(prefix="tally-verify-tools-"),
                                       "tools.json")
        with open(self.tools_file, "w") as f:
            json.dump(doc, f)
        super().setUp()

    # --- the command ------------------------------------------------------------------

    def verify(self, *args, role="reader", **env):
        """Run `tally verify ARGS...` as @role ("reader" or "operator"); the CompletedProcess."""
        e = self.env(TALLY_FAKE_TOOL_URL=self.fake_url, BILLING_HMAC_SECRET=SECRET)
        e.update({k: str(v) for k, v in env.items()})
        e["TALLY_PG"] = self.pg_as(role)
        out = subprocess.run([binary("tally"), "verify", *args], capture_output=True, text=True,
                             env=e, timeout=180)
        for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
            self.assertNotIn(marker, out.stderr, f"tally verify {args}:\n{out.stderr}")
        return out

    def verify_json(self, *args, **kw):
        out = self.verify(*args, "--json", **kw)
        try:
            return out.returncode, json.loads(out.stdout)
        except ValueError:
            raise AssertionError(f"tally verify {args} --json printed no JSON (exit "
                                 f"{out.returncode}):\n{out.stdout}\n{out.stderr}")

    def resolve(self, *args):
        out = self.cli("resolve", *args)
        self.assertNotIn("runtime error:", out.stderr)
        return out

    # --- the ledger and the tool --------------------------------------------------------

    def charge(self, run, step=1, amount=5):
        args = {"tenant_id": "t1", "payment_id": f"{run}-p{step}", "amount": amount}
        self.publish(self.intent(run, step, "charge_card", args))
        return f"charge_card:t1:{run}-p{step}"

    def confirmed_charges(self, run, n=1):
        """n charges of one run, CONFIRMED by a running dispatcher; their effect ids."""
        keys = [self.charge(run, step) for step in range(1, n + 1)]
        return [self.wait_status("charge_card", k, "CONFIRMED")["effect_id"] for k in keys]

    def post_upstream(self, collection, key, run, effect_id, body=None):
        """A record made straight at the fake tool, with the Tally headers as if tally had sent
        it (which it never did); the record as the tool answered."""
        req = urllib.request.Request(
            f"{self.fake_url}/{collection}", data=json.dumps(body or {"amount": 7}).encode(),
            method="POST", headers={"Content-Type": "application/json", "Idempotency-Key": key,
                                    "Tally-Run-Id": run, "Tally-Effect-Id": effect_id})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def findings(self):
        return self.query("SELECT finding_id::text, kind, tool, external_ref, run_id,"
                          " effect_id::text, status, found_by, resolved_by, resolution, summary,"
                          " evidence FROM findings ORDER BY created_at, finding_id")

    def of_check(self, doc, check):
        return [f for f in doc["findings"] if f["check"] == check]


class VerifyTest(VerifyCase):

    def test_a_clean_ledger_verifies_clean(self):
        self.dispatcher()
        run = run_id()
        self.confirmed_charges(run, 2)

        for args in ((), ("--run", run), ("--since", "90m"), ("--since", "7d"),
                     ("--since", "2020-01-01T00:00:00Z")):
            out = self.verify(*args)
            self.assertEqual(out.returncode, 0, f"verify {args}:\n{out.stdout}\n{out.stderr}")
            self.assertIn("clean", out.stdout)
        rc, doc = self.verify_json("--run", run)
        self.assertEqual((rc, doc["verdict"], doc["findings"], doc["incomplete"]),
                         (0, "clean", [], []))
        self.assertGreaterEqual(len([c for c in doc["checks"] if c["source"] == "ledger"]), 10)

        # The tools agree: two status checks, one list page holding the run's two records.
        rc, doc = self.verify_json("--tools", "--run", run, role="operator")
        self.assertEqual((rc, doc["verdict"]), (0, "clean"), json.dumps(doc, indent=1))
        [charges] = [t for t in doc["tools"] if t["tool"] == "charge_card"]
        self.assertEqual((charges["status_checks"], charges["list_pages"],
                          charges["records_listed"]), (2, 1, 2))
        # The calls were paid for from the tool's shared budget.
        self.assertEqual(self.scalar("SELECT count(*) FROM tool_pacing WHERE tool = %s",
                                     ("charge_card",)), 1)
        self.assertEqual(len(self.requests(op="status")), 2)
        # Read-only: verify itself wrote nothing but its pacing row.
        self.assertEqual(self.scalar("SELECT count(*) FROM findings"), 0)

    def test_usage_errors_exit_2_and_say_why(self):
        cases = [(("--since", "bogus"), "neither a time"),
                 (("--since", "2026-13-45T00:00:00Z"), "is not a time"),
                 (("--tools",), "give --run R or --since T"),
                 (("--run", "r", "--since", "1h"), "not both"),
                 (("--limit", "5"), "give --tools"),
                 (("--stale-after", "soon"), "not a duration"),
                 (("--since", "9999-01-01T00:00:00Z"), "in the future")]
        for args, words in cases:
            out = self.verify(*args)
            self.assertEqual(out.returncode, 2, f"{args}: {out.stdout}{out.stderr}")
            self.assertIn(words, out.stderr, args)
            self.assertEqual(out.stdout, "", args)

    def test_hand_broken_rows_are_named_with_the_command_that_acts_on_them(self):
        self.dispatcher()
        run_a, run_b = run_id(), run_id()
        [e_null] = self.confirmed_charges(run_a)
        [e_leased, e_paged] = self.confirmed_charges(run_b, 2)
        self.assertEqual(self.verify().returncode, 0)

        # A receipt gone: the schema refuses a CONFIRMED effect without one, so break that too,
        # as someone with the owner's rights could.
        self.query("ALTER TABLE effects DROP CONSTRAINT confirmed_has_receipt")
        self.query("UPDATE effects SET receipt = NULL WHERE effect_id = %s", (e_null,))
        # A lease left on a settled effect, and a page left open for a settled one.
        self.query("UPDATE effects SET lease_owner = 'dispatcher-x', lease_until = now()"
                   " WHERE effect_id = %s", (e_leased,))
        self.query("INSERT INTO alerts (dedup_key, severity, summary, run_id, effect_id, reason,"
                   " resolve_command) VALUES (%s, 'critical', 'stuck once', %s, %s,"
                   " 'attempts_exhausted', 'tally resolve ...')",
                   (f"effect:{e_paged}", run_b, e_paged))

        out = self.verify()
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        text = out.stdout
        for words in ("effect_receipt_missing", e_null, "CONFIRMED without a receipt",
                      f"tally doctor --run {run_a}",
                      "effect_lease_invalid", e_leased, "yet leased by dispatcher-x",
                      f"tally doctor --run {run_b}",
                      "alert_page_settled", f"tally resolve --alert effect:{e_paged}",
                      "3 findings (3 ledger"):
            self.assertIn(words, text)

        rc, doc = self.verify_json()
        self.assertEqual((rc, doc["verdict"]), (1, "findings"))
        [missing] = self.of_check(doc, "effect_receipt_missing")
        self.assertEqual((missing["id"], missing["run_id"], missing["tool"], missing["command"]),
                         (e_null, run_a, "charge_card", f"tally doctor --run {run_a}"))
        # --run narrows every check to one run.
        rc, doc = self.verify_json("--run", run_a)
        self.assertEqual((rc, [f["check"] for f in doc["findings"]]),
                         (1, ["effect_receipt_missing"]))

        # --file-findings files each once, with an audit event; the resolve lever closes one.
        out = self.verify("--file-findings", "--actor", "alice", role="operator")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("Filed: 3 new findings, 0 already on file.", out.stdout)
        rows = self.findings()
        self.assertEqual(sorted((r[1], r[3], r[6], r[7]) for r in rows),
                         sorted([("ledger", f"effect_receipt_missing:{e_null}", "OPEN", "alice"),
                                 ("ledger", f"effect_lease_invalid:{e_leased}", "OPEN", "alice"),
                                 ("ledger", f"alert_page_settled:effect:{e_paged}", "OPEN",
                                  "alice")]))
        [fid] = [r[0] for r in rows if r[3] == f"effect_receipt_missing:{e_null}"]
        self.assertIn(f"tally resolve --finding {fid}", out.stdout)
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE kind = 'finding'"
                                     " AND actor = 'alice'"), 3)
        # Filing again files nothing new.
        out = self.verify("--file-findings", role="operator")
        self.assertIn("Filed: 0 new findings, 3 already on file.", out.stdout)
        self.assertEqual(len(self.findings()), 3)
        # The read-only role may not file: nothing is filed, and verify says it could not.
        self.query("DELETE FROM findings WHERE finding_id <> %s", (fid,))
        out = self.verify("--file-findings")
        self.assertEqual(out.returncode, 2, out.stdout + out.stderr)
        self.assertIn("needs the operator role", out.stdout)
        self.assertEqual(len(self.findings()), 1)

        out = self.resolve("--finding", fid, "--as", "resolved", "--reason",
                           "receipt restored from the tool's dashboard", "--actor", "bob")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(f"finding {fid}: OPEN → RESOLVED, by bob", out.stdout)
        [row] = [r for r in self.findings() if r[0] == fid]
        self.assertEqual((row[6], row[8], row[9]),
                         ("RESOLVED", "bob", "receipt restored from the tool's dashboard"))
        [(kind, actor, reason, data)] = self.query(
            "SELECT kind, actor, reason, data FROM events WHERE kind = 'operator'"
            " AND data ->> 'finding_id' = %s", (fid,))
        self.assertEqual((kind, actor, data["from"], data["to"]),
                         ("operator", "bob", "OPEN", "RESOLVED"))

    def test_each_ledger_check_finds_the_breakage_it_names(self):
        """One row broken per check, each in a run of its own, with no worker running: each
        check names its row, and only its row."""
        self.dispatcher()
        runs = {name: run_id() for name in (
            "ref", "receipt", "unknown", "planned", "outbox", "overdue", "ob_lease", "ob_overdue", "dup",
            "not_stuck", "cancelled", "not_settled", "page_resolved", "page_escalated")}
        eff = {name: self.confirmed_charges(run)[0] for name, run in runs.items()}
        self._terminate_all()  # nothing may repair what is broken below
        ref_of = dict(self.query("SELECT effect_id::text, external_ref FROM effects"))

        def obligation(name, status, **cols):
            oid = str(uuid.uuid4())
            self.force("INSERT INTO obligations (obligation_id, run_id, effect_id, reason,"
                       " external_ref, status, lease_owner, lease_until, next_attempt_at,"
                       " finished_at, updated_at)"
                       " VALUES (%s, %s, %s, 'compensate_run', %s, %s, %s, %s,"
                       " now() - %s * interval '1 second', now() - %s * interval '1 second',"
                       " now() - %s * interval '1 second')",
                       (oid, runs[name], eff[name], ref_of[eff[name]], status,
                        cols.get("lease_owner"), cols.get("lease_until"), cols.get("age_s", 0),
                        cols.get("age_s", 0), cols.get("age_s", 0)))
            return oid

        def page(key, name, oid):
            self.query("INSERT INTO alerts (dedup_key, severity, summary, run_id, effect_id,"
                       " obligation_id, reason, resolve_command) VALUES (%s, 'critical', 'p',"
                       " %s, %s, %s, 'r', 'tally resolve ...')", (key, runs[name], eff[name], oid))

        self.query("UPDATE effects SET external_ref = NULL WHERE effect_id = %s", (eff["ref"],))
        self.query("UPDATE effects SET receipt = receipt || '{\"amount\": 9}'"
                   " WHERE effect_id = %s", (eff["receipt"],))
        self.force("UPDATE effects SET status = 'UNKNOWN', unknown_since = NULL"
                   " WHERE effect_id = %s", (eff["unknown"],))
        self.force("UPDATE effects SET status = 'PLANNED' WHERE effect_id = %s",
                   (eff["planned"],))
        self.query("INSERT INTO outbox (effect_id, tool) VALUES (%s, 'charge_card')",
                   (eff["outbox"],))
        self.force("UPDATE effects SET status = 'PLANNED' WHERE effect_id = %s",
                   (eff["overdue"],))
        self.force("INSERT INTO outbox (effect_id, tool, due_at) VALUES (%s, 'charge_card',"
                   " now() - interval '1 hour')", (eff["overdue"],))
        ob_lease = obligation("ob_lease", "RUNNING")
        ob_overdue = obligation("ob_overdue", "PENDING", age_s=3600)
        self.query("INSERT INTO events (event_id, run_id, effect_id, kind, actor, reason, data)"
                   " VALUES (%s, %s, %s, 'duplicate', 'test', 'by hand', %s)",
                   (str(uuid.uuid4()), runs["dup"], eff["dup"], json.dumps(
                       {"records": 2, "external_refs": [
                           {"external_ref": ref_of[eff["dup"]], "kept": True,
                            "same_as_kept": False},
                           {"external_ref": "charges_999", "kept": False,
                            "same_as_kept": False}]})))
        obligation("not_stuck", "STUCK")
        self.force("UPDATE effects SET status = 'AWAITING_APPROVAL' WHERE effect_id = %s",
                   (eff["cancelled"],))
        self.force("UPDATE runs SET status = 'CANCELLED' WHERE run_id = %s", (runs["cancelled"],))
        obligation("not_settled", "RESOLVED")
        self.force("UPDATE runs SET status = 'COMPENSATING', updated_at = now() - interval"
                   " '1 hour' WHERE run_id = %s", (runs["not_settled"],))
        # Pages left open: a reversed obligation's own page, and a deadline page of an
        # UNCOMPENSATABLE one (whose own page, the escalation, stays open until closed by hand).
        ob_done = obligation("page_resolved", "RESOLVED", age_s=3600)
        page(f"obligation:{ob_done}", "page_resolved", ob_done)
        ob_esc = obligation("page_escalated", "UNCOMPENSATABLE", age_s=3600)
        page(f"obligation:{ob_esc}", "page_escalated", ob_esc)
        page(f"deadline:{ob_esc}", "page_escalated", ob_esc)

        rc, doc = self.verify_json()
        self.assertEqual((rc, doc["verdict"], doc["incomplete"]), (1, "findings", []))
        got = sorted((f["check"], f["id"]) for f in doc["findings"])
        want = sorted([
            ("effect_ref_missing", eff["ref"]),
            ("effect_receipt_changed", eff["receipt"]),
            ("effect_incomplete", eff["unknown"]),
            ("effect_not_queued", eff["planned"]),
            ("outbox_not_dispatchable", eff["outbox"]),
            ("effect_overdue", eff["overdue"]),
            ("obligation_lease_invalid", ob_lease),
            ("obligation_overdue", ob_overdue),
            ("duplicate_without_obligation", eff["dup"]),
            ("run_not_stuck", runs["not_stuck"]),
            ("run_settled_with_open_work", runs["cancelled"]),
            ("run_not_settled", runs["not_settled"]),
            ("alert_page_settled", f"obligation:{ob_done}"),
            ("alert_page_settled", f"deadline:{ob_esc}"),
        ])
        self.assertEqual(got, want, json.dumps(doc["findings"], indent=1))
        by_check = {f["check"]: f for f in doc["findings"]}
        self.assertIn(f"tally resolve --alert deadline:{ob_esc}",
                      [f["command"] for f in doc["findings"]
                       if f["id"] == f"deadline:{ob_esc}"][0])
        self.assertIn("charges_999", by_check["duplicate_without_obligation"]["detail"])
        self.assertIn("tally status  # is tally-compensator running",
                      by_check["obligation_overdue"]["command"])
        self.assertIn("tally resolve --obligation", by_check["run_not_stuck"]["command"])
        # --stale-after decides what is overdue.
        rc, doc = self.verify_json("--stale-after", "2h")
        self.assertNotIn("effect_overdue", {f["check"] for f in doc["findings"]})
        self.assertNotIn("run_not_settled", {f["check"] for f in doc["findings"]})
        self.assertNotIn("alert_page_settled", {f["check"] for f in doc["findings"]})
        # Without the registry there is no receipt_ref to read: that check says it did not run.
        e = self.env(TALLY_TOOLS="")
        e["TALLY_PG"] = self.pg_as("reader")
        out = subprocess.run([binary("tally"), "verify", "--json"], capture_output=True,
                             text=True, env=e, timeout=60)
        doc = json.loads(out.stdout)
        [ref_check] = [c for c in doc["checks"] if c["name"] == "effect_ref_missing"]
        self.assertIn("TALLY_TOOLS", ref_check["skipped"])

    def test_orphans_and_duplicates_upstream_are_found_by_the_tools_check(self):
        self.dispatcher()
        run = run_id()
        [ok_effect] = self.confirmed_charges(run)
        # A record tally never asked for, carrying an effect id the ledger never had.
        ghost = str(uuid.uuid4())
        orphan = self.post_upstream("charges", f"charge_card:t1:{run}-ghost", run, ghost)
        # A call the tool applied although it answered 400: FAILED here, a record there.
        failed_key = f"charge_card:t1:{run}-p2"
        self.fault("fail_after_apply", key=failed_key, status=400)
        self.charge(run, 2)
        failed = self.wait_status("charge_card", failed_key, "FAILED")
        # A call the tool applied twice and answered 201 once: CONFIRMED with one receipt.
        dup_key = f"charge_card:t1:{run}-p3"
        self.fault("apply_twice", key=dup_key)
        self.charge(run, 3)
        dup = self.wait_status("charge_card", dup_key, "CONFIRMED")
        recs = {r["idempotency_key"]: r for r in self.records("charges")}
        extra = [r["id"] for r in self.records("charges")
                 if r["idempotency_key"] == dup_key and r["id"] != dup["external_ref"]]
        self.assertEqual(len(extra), 1)

        # The ledger alone sees nothing wrong.
        self.assertEqual(self.verify("--run", run).returncode, 0)

        rc, doc = self.verify_json("--tools", "--run", run, role="operator")
        self.assertEqual((rc, doc["verdict"]), (1, "findings"), json.dumps(doc, indent=1))
        orphans = {f["external_ref"]: f for f in self.of_check(doc, "upstream_orphan")}
        self.assertEqual(set(orphans), {orphan["id"], recs[failed_key]["id"]})
        self.assertIn("never had", orphans[orphan["id"]]["detail"])
        self.assertEqual(orphans[orphan["id"]]["effect_id"], ghost)
        self.assertIn("FAILED", orphans[recs[failed_key]["id"]]["detail"])
        self.assertEqual(orphans[recs[failed_key]["id"]]["effect_id"], failed["effect_id"])
        [d] = self.of_check(doc, "upstream_duplicate")
        self.assertEqual((d["external_ref"], d["effect_id"]), (extra[0], dup["effect_id"]))
        self.assertNotIn(ok_effect, json.dumps(doc["findings"]))
        self.assertIn(f"tally verify --tools --run {run} --file-findings", d["command"])

        out = self.verify("--tools", "--run", run, role="operator")
        self.assertEqual(out.returncode, 1)
        for words in ("upstream_orphan", orphan["id"], "upstream_duplicate", extra[0]):
            self.assertIn(words, out.stdout)

        # Filed: kind orphan / duplicate, keyed by the tool's record.
        out = self.verify("--tools", "--run", run, "--file-findings", "--actor", "carol",
                          role="operator")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        rows = {r[3]: r for r in self.findings()}
        self.assertEqual({ref: (r[1], r[2], r[7]) for ref, r in rows.items()},
                         {orphan["id"]: ("orphan", "charge_card", "carol"),
                          recs[failed_key]["id"]: ("orphan", "charge_card", "carol"),
                          extra[0]: ("duplicate", "charge_card", "carol")})
        ghost_row = rows[orphan["id"]]
        self.assertEqual((ghost_row[4], ghost_row[5]), (run, ghost))
        self.assertEqual(ghost_row[11]["tally_headers"]["tally-effect-id"], ghost)

        # Its page (the reconciler pages what it files) closes with it.
        fid = ghost_row[0]
        self.query("INSERT INTO alerts (dedup_key, severity, summary, run_id, reason,"
                   " resolve_command) VALUES (%s, 'error', 'orphan', %s, 'orphan', 'x')",
                   (f"finding:{fid}", run))
        out = self.resolve("--finding", fid, "--as", "resolved", "--reason",
                           "refunded charges by hand", "--actor", "dave")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(f"finding:{fid} resolved", out.stdout)
        self.assertEqual(self.scalar("SELECT status FROM alerts WHERE dedup_key = %s",
                                     (f"finding:{fid}",)), "RESOLVED")
        self.assertEqual(self.scalar("SELECT status FROM findings WHERE finding_id = %s",
                                     (fid,)), "RESOLVED")
        # A resolved finding is not filed again, and says it came back.
        rc, doc = self.verify_json("--tools", "--run", run, "--file-findings", role="operator")
        [again] = [f for f in doc["findings"] if f["external_ref"] == orphan["id"]]
        self.assertEqual((rc, again["finding_id"], again["filed"]), (1, fid, "resolved_before"))
        self.assertEqual(doc["filed"], {"new": 0, "on_file": 3})
        self.assertEqual(len(self.findings()), 3)

        # Clear errors for what cannot be resolved.
        out = self.resolve("--finding", fid, "--as", "resolved", "--reason", "again")
        self.assertEqual(out.returncode, 1)
        self.assertIn("already resolved", out.stderr)
        self.assertIn("dave", out.stderr)
        out = self.resolve("--finding", str(uuid.uuid4()), "--as", "resolved", "--reason", "x")
        self.assertEqual(out.returncode, 1)
        self.assertIn("no finding", out.stderr)
        out = self.resolve("--finding", fid, "--as", "skipped", "--reason", "x")
        self.assertEqual(out.returncode, 2)
        self.assertIn("--as resolved", out.stderr)

    def test_a_tool_that_cannot_answer_makes_the_check_incomplete(self):
        self.dispatcher()
        run = run_id()
        self.confirmed_charges(run)
        dead = f"http://127.0.0.1:{free_port()}"
        rc, doc = self.verify_json("--tools", "--run", run, role="operator",
                                   TALLY_FAKE_TOOL_URL=dead)
        self.assertEqual((rc, doc["verdict"]), (2, "incomplete"), json.dumps(doc, indent=1))
        whats = {(x["what"], x["tool"]) for x in doc["incomplete"]}
        self.assertIn(("status", "charge_card"), whats)
        self.assertIn(("list", "charge_card"), whats)
        out = self.verify("--tools", "--run", run, role="operator", TALLY_FAKE_TOOL_URL=dead)
        self.assertEqual(out.returncode, 2)
        self.assertIn("COULD NOT CHECK", out.stdout)
        self.assertIn("(exit 2)", out.stdout)
        # An answer that is not the protocol's is as inconclusive as none.
        self.fault("status_garbage", op="status", collection="charges")
        rc, doc = self.verify_json("--tools", "--run", run, role="operator")
        self.assertEqual(rc, 2, json.dumps(doc, indent=1))
        # The read-only role may not take slots of a tool's budget: it calls nothing.
        before = len(self.requests(op=None))
        out = self.verify("--tools", "--run", run)
        self.assertEqual(out.returncode, 2)
        self.assertIn("operator role", out.stdout)
        self.assertEqual(len(self.requests(op=None)), before)
        # PostgreSQL unreachable: could not check.
        e = self.env(TALLY_PG=f"postgresql://127.0.0.1:{free_port()}/none?connect_timeout=2")
        out = subprocess.run([binary("tally"), "verify"], capture_output=True, text=True, env=e,
                             timeout=60)
        self.assertEqual(out.returncode, 2, out.stderr)

    def test_calls_keep_to_the_tools_rate(self):
        self.dispatcher()
        run = run_id()
        n = 2 * RATE + 2
        self.confirmed_charges(run, n)
        rc, doc = self.verify_json("--tools", "--run", run, role="operator")
        self.assertEqual(rc, 0, json.dumps(doc, indent=1))
        ats = sorted(r["at"] for r in self.requests(op=None)
                     if r["op"] in ("status", "list") and r["collection"] == "charges")
        self.assertEqual(len(ats), n + 1)  # n status checks and one list page

        def secs(at):
            return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
        # A burst of one second's worth, then RATE a second: n + 1 calls take at least
        # (n + 1 - RATE) / RATE seconds.
        span = secs(ats[-1]) - secs(ats[0])
        self.assertGreaterEqual(span, (n + 1 - RATE) / RATE - 0.3, ats)


if __name__ == "__main__":
    main()
