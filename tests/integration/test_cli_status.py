"""`tally status` (DESIGN §8): what needs a human first, and the verdict as the exit code —
0 clean, 1 an UNKNOWN older than --unknown-age, 2 anything STUCK (STUCK wins), 3 PostgreSQL
unreachable.

The states are made by the real workers: tally-dispatcher calls tally-fake-tool, whose faults
turn calls into UNKNOWNs; tally-reconciler turns an UNKNOWN it cannot check into STUCK and
pages. CliCase is the fixture of every test_cli_*.py module."""

import json
import uuid

from invariants import check_invariants
from tallytest import wait_for
from test_reconcile_resolve import ReconcileCase, main, run_id


class CliCase(ReconcileCase):
    """ReconcileCase plus the operator's command line and ways to make the states it acts
    on, with the real workers where they make them."""

    def env(self, **extra):
        """The workers' environment; the registry's ${TALLY_FAKE_TOOL_URL} resolves for the
        command line too (it loads the registry to explain compensation plans)."""
        if getattr(self, "fake_url", None) and "TALLY_FAKE_TOOL_URL" not in extra:
            extra["TALLY_FAKE_TOOL_URL"] = self.fake_url
        return super().env(**extra)

    def tally(self, *args, env=None):
        """Run `tally ARGS...`; fail the test on any sanitizer report."""
        out = self.cli(*args, env=env)
        for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
            self.assertNotIn(marker, out.stderr, f"tally {' '.join(args)}:\n{out.stderr}")
        return out

    def tally_json(self, *args):
        out = self.tally(*args, "--json")
        try:
            return out.returncode, json.loads(out.stdout)
        except ValueError:
            raise AssertionError(f"tally {' '.join(args)} --json printed no JSON "
                                 f"(exit {out.returncode}):\n{out.stdout}\n{out.stderr}")

    # --- states made by the workers ---------------------------------------------------

    def stuck_note(self, run, step=1):
        """A post_note (append_only, no status endpoint) applied upstream whose answer timed
        out: the dispatcher records UNKNOWN, the reconciler cannot check it and pages (STUCK).
        Needs a dispatcher and a reconciler running. Returns (effect id, the upstream record)."""
        note = f"{run}-n{step}"
        key = f"post_note:{note}"
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        self.publish(self.intent(run, step, "post_note", {"note_id": note, "text": "hello"}))
        row = self.wait_status("post_note", key, "STUCK", timeout=40)
        wait_for(lambda: self.scalar("SELECT count(*) FROM alerts WHERE dedup_key = %s",
                                     (f"effect:{row['effect_id']}",)) == 1,
                 timeout=10, what="the STUCK effect's page")
        [record] = [r for r in self.records("notes") if r["idempotency_key"] == key]
        return row["effect_id"], record

    def unknown_charge(self, run, step=1):
        """A charge applied upstream whose answer timed out, with no reconciler running: it
        stays UNKNOWN. Needs a dispatcher. Returns the effect id."""
        key = f"charge_card:t1:{run}-p{step}"
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        self.charge(run, step)
        return self.wait_status("charge_card", key, "UNKNOWN", timeout=30)["effect_id"]

    def confirmed_charge(self, run, step=1):
        key, _, _ = self.charge(run, step)
        return self.wait_status("charge_card", key, "CONFIRMED", timeout=30)["effect_id"]

    # --- states made with the compensator's SQL ---------------------------------------

    def obligation(self, effect_id, status, reason="compensate_run", error=None,
                   reverse_receipt=None, blast_radius=None, status_reason=None, alert=False):
        """An obligation for a CONFIRMED effect, written as runops.c and the compensator write
        it: the row (with the effect's ref and receipt), its "obligation" event at
        creation and one per move, and for STUCK the page (alerts row, as alert.c raises
        it). Returns the obligation id."""
        oid = str(uuid.uuid4())
        [(run, ref, receipt)] = self.query(
            "SELECT run_id, external_ref, receipt::text FROM effects WHERE effect_id = %s",
            (effect_id,))
        code, message = error or (None, None)
        self.query(
            "INSERT INTO obligations (obligation_id, run_id, effect_id, reason, external_ref,"
            " receipt, status, status_reason, attempts, reverse_receipt, blast_radius,"
            " error_code, error_message, finished_at)"
            " VALUES (%s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s, %s::jsonb, %s::jsonb, %s, %s,"
            "  CASE WHEN %s IN ('PENDING', 'AWAITING_APPROVAL', 'RUNNING') THEN NULL"
            "  ELSE now() END) RETURNING 1",
            (oid, run, effect_id, reason, ref, receipt, "PENDING", status_reason,
             0 if status in ("PENDING", "AWAITING_APPROVAL") else 1,
             json.dumps(reverse_receipt) if reverse_receipt is not None else None,
             json.dumps(blast_radius) if blast_radius is not None else None, code, message,
             status))
        self.audit(run, effect_id, oid, "obligation", None, "PENDING", "runops", reason,
                   {"obligation_id": oid, "run_id": run, "effect_id": effect_id,
                    "reason": reason, "external_ref": ref, "status": "PENDING"})
        path = {"PENDING": [], "AWAITING_APPROVAL": [("PENDING", "AWAITING_APPROVAL")]}.get(
            status, [("PENDING", "RUNNING"), ("RUNNING", status)])
        for frm, to in path:
            # through the moves the compensator makes: the ledger refuses any other
            self.query("UPDATE obligations SET status = %s WHERE obligation_id = %s", (to, oid))
            self.audit(run, effect_id, oid, "obligation", frm, to, "compensator-test",
                       status_reason or code)
        if alert:
            cmd = (f'tally resolve --obligation {oid} --as resolved --reason "<what you did>"'
                   f"  # you reversed it by hand\n"
                   f'tally resolve --obligation {oid} --as skipped --reason "<why>"'
                   f"  # nothing is to be undone")
            self.query("INSERT INTO alerts (dedup_key, severity, summary, run_id, effect_id,"
                       " obligation_id, reason, resolve_command)"
                       " VALUES (%s, 'critical', %s, %s, %s, %s, %s, %s) RETURNING 1",
                       (f"obligation:{oid}", f"compensation of {effect_id} is STUCK", run,
                        effect_id, oid, code or "stuck", cmd))
            self.audit(run, effect_id, oid, "alert", None, "TRIGGERED", "compensator-test",
                       code, {"dedup_key": f"obligation:{oid}"})
        return oid

    def audit(self, run, effect_id, oid, kind, frm, to, actor, reason, data=None):
        self.query("INSERT INTO events (event_id, run_id, effect_id, obligation_id, kind,"
                   " from_status, to_status, actor, reason, data)"
                   " VALUES (gen_random_uuid(), %s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb)"
                   " RETURNING 1",
                   (run, effect_id, oid, kind, frm, to, actor, reason,
                    json.dumps(data) if data is not None else None))

    # --- "nothing changed" ------------------------------------------------------------

    def snapshot(self):
        """Every row a command could change, for before/after comparisons."""
        snap = {}
        for table, order in (("runs", "run_id"), ("effects", "effect_id"),
                             ("obligations", "obligation_id"), ("alerts", "dedup_key"),
                             ("outbox", "effect_id"), ("events", "seq"),
                             ("message_outbox", "id"), ("message_refs", "id")):
            snap[table] = self.query(f"SELECT to_jsonb(t)::text FROM {table} t ORDER BY {order}")
        return snap

    def assertUnchanged(self, before, what):
        after = self.snapshot()
        for table in before:
            self.assertEqual(before[table], after[table], f"{what} changed table {table}")


class StatusTest(CliCase):

    def test_clean_ledger_exits_0_and_counts_by_state_and_tool(self):
        self.dispatcher()
        run = run_id()
        self.confirmed_charge(run, 1)
        self.confirmed_charge(run, 2)
        # a second tool in the same state: the counts by state add up the tools
        self.publish(self.intent(run, 3, "post_note", {"note_id": f"{run}-n3", "text": "hi"}))
        self.wait_status("post_note", f"post_note:{run}-n3", "CONFIRMED", timeout=30)
        out = self.tally("status")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("✓ clean", out.stdout)
        # the states' full names head the columns
        self.assertRegex(out.stdout, r"TOOL\s+TOTAL\s+CONFIRMED\n")
        self.assertRegex(out.stdout, r"charge_card\s+2\s+2")      # TOOL TOTAL CONFIRMED
        for line in out.stdout.splitlines():
            self.assertLessEqual(len(line), 80, line)
        rc, doc = self.tally_json("status")
        self.assertEqual(rc, 0)
        self.assertEqual((doc["verdict"], doc["exit_code"]), ("clean", 0))
        self.assertEqual(doc["counts"]["effects_by_state"], {"CONFIRMED": 3})
        self.assertEqual(doc["counts"]["effects_by_tool"], {"charge_card": {"CONFIRMED": 2},
                                                            "post_note": {"CONFIRMED": 1}})
        self.assertEqual(doc["counts"]["runs_by_state"], {"ACTIVE": 1})
        # the run's state is ACTIVE (it was never completed), but its work is over: say so
        self.assertEqual(doc["counts"]["runs_active_settled"], 1)
        self.assertIn("1 active (1 with every effect settled, not completed)",
                      " ".join(out.stdout.split()))
        self.assertEqual((doc["stuck"], doc["unknown"], doc["alerts"]), ([], [], []))

    def test_unknown_older_than_the_threshold_exits_1(self):
        self.dispatcher()             # no reconciler: the UNKNOWN stays
        run = run_id()
        self.confirmed_charge(run, 1)
        eid = self.unknown_charge(run, 2)
        # Younger than the threshold: clean.
        rc, doc = self.tally_json("status", "--unknown-age", "3600")
        self.assertEqual(rc, 0)
        self.assertEqual((doc["counts"]["unknown"], doc["counts"]["unknown_aging"]), (1, 0))
        [item] = doc["unknown"]
        self.assertEqual((item["effect_id"], item["aging"], item["run_id"], item["step"]),
                         (eid, False, run, "2"))
        # Older than the threshold: exit 1, listed oldest first with its age.
        wait_for(lambda: self.scalar("SELECT now() - unknown_since > interval '1.2 s'"
                                     " FROM effects WHERE effect_id = %s", (eid,)), timeout=10)
        out = self.tally("status", "--unknown-age", "1")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn(eid, out.stdout)
        self.assertIn("UNKNOWN: 1, 1 older than 1s", out.stdout)
        self.assertIn("⚠ 1 UNKNOWN older than 1s", out.stdout)
        rc, doc = self.tally_json("status", "--unknown-age", "1")
        self.assertEqual((rc, doc["verdict"], doc["exit_code"]), (1, "aging_unknown", 1))
        self.assertTrue(doc["unknown"][0]["aging"])
        self.assertGreater(doc["unknown"][0]["age_s"], 1.0)
        # The default threshold comes from TALLY_UNKNOWN_AGE_S.
        out = self.tally("status", env=self.env(TALLY_UNKNOWN_AGE_S="1"))
        self.assertEqual(out.returncode, 1, out.stdout)

    def test_stuck_exits_2_and_shows_the_reason_and_the_resolve_command_first(self):
        self.dispatcher()
        rec = self.reconciler()
        run = run_id()
        eid, _ = self.stuck_note(run)
        self.assertEqual(rec.terminate(), 0)
        self.unknown_charge(run, 2)   # an aging UNKNOWN too (no reconciler now): STUCK wins
        out = self.tally("status", "--unknown-age", "0")
        self.assertEqual(out.returncode, 2, out.stdout + out.stderr)
        text = out.stdout
        self.assertLess(text.index("STUCK: 1 item needs a human"), text.index("UNKNOWN:"))
        self.assertIn(f"✗ effect {eid}", text)
        self.assertIn("no_status_check", text)
        self.assertIn(f"tally resolve --effect {eid} --as confirmed", text)
        self.assertIn(f"tally resolve --effect {eid} --as failed", text)
        self.assertIn(f"effect:{eid} (open)", text)
        self.assertIn("ALERTS OPEN: 1", text)
        # by tool, under the states' full names, none cut short
        self.assertRegex(text, r"TOOL\s+TOTAL\s+UNKNOWN\s+STUCK\n")
        self.assertNotRegex(text, r"\b(CONFIRM|DISPATCH|APPROVAL|REJECT|CANCEL)\b")
        self.assertRegex(text, r"RUNS +1 active, ")            # one still UNKNOWN: going on
        for line in text.splitlines():
            # a word wider than the line (the runbook's URL) stands whole on its own line
            self.assertTrue(len(line) <= 80 or len(line.split()) == 1, line)
        rc, doc = self.tally_json("status", "--unknown-age", "0")
        self.assertEqual((rc, doc["verdict"], doc["exit_code"]), (2, "stuck", 2))
        [item] = doc["stuck"]
        self.assertEqual((item["kind"], item["id"], item["run_id"], item["tool"],
                          item["reason"], item["alert"]),
                         ("effect", eid, run, "post_note", "no_status_check", f"effect:{eid}"))
        self.assertIn(f"tally resolve --effect {eid} --as confirmed --ref <REF>",
                      item["resolve_command"])
        [alert] = doc["alerts"]
        self.assertEqual((alert["dedup_key"], alert["severity"]), (f"effect:{eid}", "critical"))

    def test_a_stuck_obligation_exits_2(self):
        self.dispatcher()
        run = run_id()
        eid = self.confirmed_charge(run)
        oid = self.obligation(eid, "STUCK", error=("stale_state", "412 from the tool"),
                              alert=True)
        rc, doc = self.tally_json("status")
        self.assertEqual(rc, 2)
        [item] = doc["stuck"]
        self.assertEqual((item["kind"], item["id"], item["error"]["code"], item["alert"]),
                         ("obligation", oid, "stale_state", f"obligation:{oid}"))
        self.assertIn(f"tally resolve --obligation {oid} --as resolved", item["resolve_command"])
        check_invariants(self)

    def test_postgresql_unreachable_exits_3_with_libpq_message(self):
        out = self.tally("status", env=self.env(TALLY_PG="host=127.0.0.1 port=1 dbname=x"))
        self.assertEqual(out.returncode, 3)
        self.assertIn("tally status: cannot connect to PostgreSQL", out.stderr)
        self.assertIn("Connection refused", out.stderr)
        self.assertEqual(out.stdout, "")

    def test_usage_errors_exit_2(self):
        for args in (("status", "--unknown-age", "abc"), ("status", "extra"),
                     ("status", "--bogus")):
            out = self.tally(*args)
            self.assertEqual(out.returncode, 2, args)
            self.assertEqual(out.stdout, "")
        out = self.tally("status", "--help")
        self.assertEqual(out.returncode, 0)
        self.assertIn("--unknown-age SECONDS", out.stdout)


if __name__ == "__main__":
    main()
