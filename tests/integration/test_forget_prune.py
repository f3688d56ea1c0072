"""`tally forget --tenant` (erasure by destroying the tenant's key) and `tally prune
--settled-before` (retention that keeps a settled run's skeleton), DESIGN §12 "Sensitive
fields". What an operator and an auditor check: the key is gone and nothing else of the ledger
moved; nothing is forgotten while the tenant has something open; only settled, old enough,
unpruned runs lose their payloads and keep ids, states, hashes and times; the audit trail is
append-only throughout, every earlier event byte for byte the same, one new event per action.

The ledger rows are made with SQL, each created in a state its machine allows at creation and
moved only by moves the machine has (the triggers refuse anything else), with the transition
events a worker would have written."""

import datetime
import json
import uuid

from tallytest import TallyCase, main, wait_for

PRUNED = {"tally_pruned": True}


def new_id():
    return str(uuid.uuid4())


class LedgerCase(TallyCase):
    """Runs, effects, obligations and tenant keys made by hand."""

    def event(self, kind, from_status, to_status, run=None, effect=None, obligation=None,
              data=None):
        self.query("INSERT INTO events (event_id, run_id, effect_id, obligation_id, kind,"
                   " from_status, to_status, actor, reason, data)"
                   " VALUES (%s, %s, %s, %s, %s, %s, %s, 'test', 'made by the test', %s)",
                   (new_id(), run, effect, obligation, kind, from_status, to_status,
                    json.dumps(data) if data is not None else None))

    def new_run(self, status="COMPLETED", tenant=None, age_days=0):
        """A run created ACTIVE and moved to @status, last changed @age_days ago."""
        run = "r-" + uuid.uuid4().hex[:10]
        self.query("INSERT INTO runs (run_id, tenant) VALUES (%s, %s)", (run, tenant))
        self.event("transition", None, "ACTIVE", run=run)
        path = {"COMPENSATED": ["COMPENSATING", "COMPENSATED"]}.get(
            status, [] if status == "ACTIVE" else [status])
        prev = "ACTIVE"
        for to in path:
            self.query("UPDATE runs SET status = %s WHERE run_id = %s", (to, run))
            self.event("transition", prev, to, run=run)
            prev = to
        self.query("UPDATE runs SET updated_at = now() - make_interval(days => %s)"
                   " WHERE run_id = %s", (age_days, run))
        return run

    def new_effect(self, run, step, status, tenant=None, key=None):
        """An effect of @run created DISPATCHING (under a lease) and moved to @status:
        CONFIRMED (with a receipt), FAILED (with an error) or left DISPATCHING; or created
        PLANNED. Sealed under @key when given."""
        eid = new_id()
        create = "PLANNED" if status == "PLANNED" else "DISPATCHING"
        args = {"amount": 100 + step, "ssn": "078-05-1120"}
        self.query(
            "INSERT INTO effects (effect_id, run_id, step, step_num, tool, effect_class,"
            " operation_key, input_hash, args_canonical, tenant, intent_id, status,"
            " lease_owner, lease_until, seal_key, args_sealed)"
            " VALUES (%s, %s, %s, %s, 'charge_card', 'reversible', %s, %s, %s, %s, %s, %s,"
            "  %s, CASE WHEN %s THEN now() + interval '1 minute' END, %s, %s)",
            (eid, run, str(step), step, f"charge:{eid}", "ab" * 32,
             json.dumps(args, sort_keys=True, separators=(",", ":")), tenant, new_id(), create,
             "dispatcher-t" if create == "DISPATCHING" else None, create == "DISPATCHING", key,
             b"\x01sealed-args" if key else None))
        self.event("transition", None, create, run=run, effect=eid)
        if status in ("CONFIRMED", "FAILED"):
            self.query(
                "UPDATE effects SET status = %s, lease_owner = NULL, lease_until = NULL,"
                " receipt = %s, external_ref = %s, error_code = %s, error_message = %s,"
                " receipt_sealed = %s WHERE effect_id = %s",
                (status,
                 json.dumps({"id": f"ch_{step}", "card": "4111"}) if status == "CONFIRMED"
                 else None,
                 f"ch_{step}" if status == "CONFIRMED" else None,
                 "card_declined" if status == "FAILED" else None,
                 "declined for 4111 1111 1111 1111" if status == "FAILED" else None,
                 b"\x01sealed-receipt" if key and status == "CONFIRMED" else None, eid))
            self.event("transition", create, status, run=run, effect=eid)
        return eid

    def new_obligation(self, run, effect, status):
        """An obligation created PENDING and moved to @status: RESOLVED (through RUNNING, with
        its receipts), STUCK (with an error), or left PENDING."""
        oid = new_id()
        self.query("INSERT INTO obligations (obligation_id, run_id, effect_id, reason,"
                   " external_ref, receipt) VALUES (%s, %s, %s, 'compensate_run', 'ch_1', %s)",
                   (oid, run, effect, json.dumps({"id": "ch_1", "card": "4111"})))
        self.event("obligation", None, "PENDING", run=run, effect=effect, obligation=oid)
        path = {"RESOLVED": ["RUNNING", "RESOLVED"], "STUCK": ["STUCK"], "PENDING": []}[status]
        prev = "PENDING"
        for to in path:
            self.query("UPDATE obligations SET status = %s,"
                       " reverse_receipt = CASE WHEN %s = 'RESOLVED' THEN %s::jsonb END,"
                       " error_code = CASE WHEN %s = 'STUCK' THEN 'reverse_refused' END,"
                       " error_message = CASE WHEN %s = 'STUCK' THEN 'refund of 4111 refused'"
                       " END WHERE obligation_id = %s",
                       (to, to, json.dumps({"refund": "re_1"}), to, to, oid))
            self.event("obligation", prev, to, run=run, effect=effect, obligation=oid)
            prev = to
        return oid

    def new_key(self, tenant):
        kid = new_id()
        self.query("INSERT INTO tenant_keys (key_id, tenant, master_key_id, wrapped)"
                   " VALUES (%s, %s, 'mk-test', %s)", (kid, tenant, b"\x02wrapped-data-key"))
        return kid

    def events_upto(self, seq):
        """A digest of every events row up to @seq, each row whole."""
        return self.scalar("SELECT md5(string_agg(t::text, E'\\n' ORDER BY seq)) FROM events t"
                           " WHERE seq <= %s", (seq,))

    def last_seq(self):
        return self.scalar("SELECT coalesce(max(seq), 0) FROM events")

    def new_events(self, seq):
        return self.query("SELECT kind, run_id, effect_id, obligation_id, from_status,"
                          " to_status, actor, reason, data FROM events WHERE seq > %s"
                          " ORDER BY seq", (seq,))

    def rows(self, table, order):
        return self.query(f"SELECT to_jsonb(t) FROM {table} t ORDER BY {order}")

    def snapshot(self):
        return {t: self.rows(t, o) for t, o in (
            ("runs", "run_id"), ("effects", "effect_id"), ("obligations", "obligation_id"),
            ("tenant_keys", "key_id"), ("events", "seq"))}

    def tally(self, *args):
        out = self.cli(*args)
        self.assertNotIn("permission denied", out.stderr, out.stderr)
        return out


def said(out):
    """stdout and stderr as one line of words (the CLI wraps at 80 columns)."""
    return " ".join((out.stdout + " " + out.stderr).split())


class ForgetTest(LedgerCase):

    def test_refused_while_an_effect_of_the_tenant_is_open(self):
        kid = self.new_key("acme")
        run = self.new_run("ACTIVE", tenant="acme")
        self.new_effect(run, 1, "CONFIRMED", tenant="acme", key=kid)
        self.new_effect(run, 2, "PLANNED", tenant="acme", key=kid)
        self.new_effect(run, 3, "DISPATCHING", tenant="acme", key=kid)
        before = self.snapshot()
        out = self.tally("forget", "--tenant", "acme", "--reason", "erasure request 42")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertEqual(out.stdout, "")
        words = said(out)
        self.assertIn("refused: tenant 'acme' still has 2 open effects (1 PLANNED, "
                      "1 DISPATCHING) and 0 open obligations", words)
        self.assertIn("run this again", words)
        self.assertIn("Nothing was changed", words)
        self.assertEqual(self.snapshot(), before)

    def test_refused_while_an_obligation_of_the_tenant_is_open(self):
        kid = self.new_key("acme")
        run = self.new_run("STUCK", tenant="acme")
        eid = self.new_effect(run, 1, "CONFIRMED", tenant="acme", key=kid)
        self.new_obligation(run, eid, "STUCK")
        before = self.snapshot()
        out = self.tally("forget", "--tenant", "acme", "--reason", "erasure request 42")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("0 open effects and 1 open obligation (1 STUCK)", said(out))
        self.assertIn("Nothing was changed", said(out))
        self.assertEqual(self.snapshot(), before)
        # An obligation of the tenant's run counts even when its effect named no tenant.
        other = self.new_run("COMPENSATING", tenant="acme")
        untenanted = self.new_effect(other, 1, "CONFIRMED")
        self.new_obligation(other, untenanted, "PENDING")
        out = self.tally("forget", "--tenant", "acme", "--reason", "erasure request 42")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("2 open obligations (1 PENDING, 1 STUCK)", said(out))

    def test_destroys_the_key_writes_one_event_and_a_second_time_does_nothing(self):
        kid = self.new_key("acme")
        other_kid = self.new_key("globex")
        run = self.new_run("COMPENSATED", tenant="acme", age_days=3)
        e1 = self.new_effect(run, 1, "CONFIRMED", tenant="acme", key=kid)
        self.new_effect(run, 2, "FAILED", tenant="acme", key=kid)
        self.new_obligation(run, e1, "RESOLVED")
        globex = self.new_run("ACTIVE", tenant="globex")
        self.new_effect(globex, 1, "PLANNED", tenant="globex", key=other_kid)  # another tenant's
        before = self.snapshot()
        seq = self.last_seq()
        digest = self.events_upto(seq)

        out = self.tally("forget", "--tenant", "acme", "--reason", "erasure request 42",
                         "--actor", "dpo")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        words = said(out)
        self.assertIn(f"Forgot tenant 'acme': destroyed 1 data key ({kid})", words)
        self.assertIn("The sealed fields of 2 effects", words)
        self.assertIn("cannot be read from now on", words)
        self.assertIn("The audit trail is untouched", words)

        [(wrapped, forgotten, by)] = self.query(
            "SELECT wrapped, forgotten_at IS NOT NULL, forgotten_by FROM tenant_keys"
            " WHERE key_id = %s", (kid,))
        self.assertEqual((wrapped, forgotten, by), (None, True, "dpo"))
        # Nothing else of the ledger moved: the other tenant's key, every effect, obligation
        # and run (the sealed bytes stay, unreadable without the key).
        after = self.snapshot()
        for table in ("runs", "effects", "obligations"):
            self.assertEqual(after[table], before[table], table)
        self.assertEqual([k for k in after["tenant_keys"] if k[0]["key_id"] != kid],
                         [k for k in before["tenant_keys"] if k[0]["key_id"] != kid])
        # The audit trail: every earlier row byte for byte, and one new event.
        self.assertEqual(self.events_upto(seq), digest)
        [ev] = self.new_events(seq)
        self.assertEqual(ev[:8], ("operator", None, None, None, None, None, "dpo",
                                  "erasure request 42"))
        self.assertEqual(ev[8], {"verb": "forget", "tenant": "acme", "key_ids": [kid],
                                 "sealed_effects": 2})

        # Again: nothing live to forget, nothing written.
        seq = self.last_seq()
        snap = self.snapshot()
        out = self.tally("forget", "--tenant", "acme", "--reason", "erasure request 42")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("Nothing to forget: tenant 'acme' was forgotten already", said(out))
        self.assertIn("by dpo", said(out))
        self.assertEqual(self.snapshot(), snap)
        self.assertEqual(self.new_events(seq), [])

    def test_a_tenant_without_a_key_has_nothing_to_forget(self):
        self.new_effect(self.new_run(tenant="initech"), 1, "CONFIRMED", tenant="initech")
        snap = self.snapshot()
        out = self.tally("forget", "--tenant", "initech", "--reason", "erasure request 7")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("Nothing to forget: tenant 'initech' has no data key", said(out))
        self.assertEqual(self.snapshot(), snap)

    def test_no_tenant_only_when_asked_for_by_name(self):
        kid = self.new_key("")
        run = self.new_run("ACTIVE")
        eid = self.new_effect(run, 1, "DISPATCHING", key=kid)
        snap = self.snapshot()
        out = self.tally("forget", "--tenant", "", "--reason", "r")
        self.assertEqual(out.returncode, 2, out.stdout + out.stderr)
        self.assertIn("--no-tenant", said(out))
        out = self.tally("forget", "--no-tenant", "--reason", "r")
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn("the effects with no tenant still has 1 open effect (1 DISPATCHING)",
                      said(out))
        self.assertEqual(self.snapshot(), snap)
        self.query("UPDATE effects SET status = 'FAILED', lease_owner = NULL,"
                   " lease_until = NULL, error_code = 'declined' WHERE effect_id = %s", (eid,))
        self.event("transition", "DISPATCHING", "FAILED", run=run, effect=eid)
        out = self.tally("forget", "--no-tenant", "--reason", "r")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIsNone(self.scalar("SELECT wrapped FROM tenant_keys WHERE key_id = %s",
                                      (kid,)))

    def test_usage_errors_exit_2_and_change_nothing(self):
        self.new_key("acme")
        snap = self.snapshot()
        for args in (("forget",), ("forget", "--tenant", "acme"),
                     ("forget", "--tenant", "acme", "--reason", " "),
                     ("forget", "--tenant", "acme", "--no-tenant", "--reason", "r"),
                     ("forget", "--tenant", "x" * 201, "--reason", "r"),
                     ("forget", "acme", "--reason", "r")):
            out = self.tally(*args)
            self.assertEqual(out.returncode, 2, (args, out.stderr))
            self.assertTrue(out.stderr.startswith("tally forget: "), out.stderr)
        self.assertEqual(self.snapshot(), snap)
        out = self.tally("forget", "--help")
        self.assertEqual(out.returncode, 0)
        self.assertIn("usage: tally forget --tenant T", out.stdout)


class PruneTest(LedgerCase):

    def ledger(self):
        """One run of each kind: only "old" may be pruned."""
        r = {}
        r["old"] = self.new_run("COMPENSATED", age_days=40)
        r["old_confirmed"] = self.new_effect(r["old"], 1, "CONFIRMED", key=self.new_key("acme"))
        r["old_failed"] = self.new_effect(r["old"], 2, "FAILED")
        r["old_obligation"] = self.new_obligation(r["old"], r["old_confirmed"], "RESOLVED")
        r["recent"] = self.new_run("COMPLETED", age_days=1)
        self.new_effect(r["recent"], 1, "CONFIRMED")
        r["open_run"] = self.new_run("ACTIVE", age_days=40)      # not a final state
        self.new_effect(r["open_run"], 1, "CONFIRMED")
        r["in_flight"] = self.new_run("CANCELLED", age_days=40)  # final, a call still in flight
        self.new_effect(r["in_flight"], 1, "DISPATCHING")
        r["open_obligation"] = self.new_run("COMPLETED", age_days=40)
        self.new_obligation(r["open_obligation"],
                        self.new_effect(r["open_obligation"], 1, "CONFIRMED"), "STUCK")
        return r

    @staticmethod
    def cutoff(days_ago=30):
        return (datetime.datetime.now(datetime.timezone.utc)
                - datetime.timedelta(days=days_ago)).date().isoformat()

    def test_prunes_only_settled_old_runs_and_keeps_their_skeleton(self):
        r = self.ledger()
        before = self.snapshot()
        seq = self.last_seq()
        digest = self.events_upto(seq)

        # --dry-run says what would go and changes nothing.
        out = self.tally("prune", "--settled-before", self.cutoff(), "--dry-run")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("Would prune 1 run settled before", said(out))
        self.assertIn("the payloads of 2 effects and 1 obligation", said(out))
        self.assertEqual(self.snapshot(), before)

        out = self.tally("prune", "--settled-before", self.cutoff(), "--reason",
                         "retention: 30 days", "--actor", "ops")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        words = said(out)
        self.assertIn("Pruned 1 run settled before", words)
        self.assertIn("the payloads of 2 effects and 1 obligation are gone", words)
        self.assertIn("The audit trail is untouched", words)

        after = self.snapshot()
        # Every other run, and everything of it, exactly as it was.
        for table, col in (("runs", "run_id"), ("effects", "run_id"),
                           ("obligations", "run_id")):
            self.assertEqual([x for x in after[table] if x[0][col] != r["old"]],
                             [x for x in before[table] if x[0][col] != r["old"]], table)
        self.assertEqual(after["tenant_keys"], before["tenant_keys"])

        # The pruned run: payloads gone, skeleton kept.
        def by_id(snap, table, key):
            return {x[0][key]: x[0] for x in snap[table] if x[0]["run_id"] == r["old"]}
        [run_before] = by_id(before, "runs", "run_id").values()
        [run_after] = by_id(after, "runs", "run_id").values()
        self.assertIsNotNone(run_after.pop("pruned_at"))
        run_before.pop("pruned_at")
        self.assertEqual(run_after, run_before)
        effects_before, effects_after = (by_id(s, "effects", "effect_id") for s in (before, after))
        self.assertEqual(effects_after.keys(), effects_before.keys())
        for eid, e in effects_after.items():
            was = effects_before[eid]
            self.assertEqual(json.loads(e.pop("args_canonical")), PRUNED)
            self.assertEqual(e.pop("receipt"), PRUNED if was["status"] == "CONFIRMED" else None)
            for col in ("args_sealed", "receipt_sealed", "error_message"):
                self.assertIsNone(e.pop(col), col)
                was.pop(col)
            was.pop("args_canonical")
            was.pop("receipt")
            # ids, states, keys, hashes, refs, error codes, times: all as they were
            self.assertEqual(e, was)
        self.assertEqual(effects_after[r["old_failed"]]["error_code"], "card_declined")
        [ob_before] = by_id(before, "obligations", "obligation_id").values()
        [ob_after] = by_id(after, "obligations", "obligation_id").values()
        for col in ("receipt", "reverse_receipt", "blast_radius", "error_message"):
            self.assertIsNone(ob_after.pop(col), col)
            ob_before.pop(col)
        self.assertEqual(ob_after, ob_before)

        # The audit trail: every earlier row as it was, and one event for the pruned run.
        self.assertEqual(self.events_upto(seq), digest)
        [ev] = self.new_events(seq)
        self.assertEqual(ev[:8], ("operator", r["old"], None, None, None, None, "ops",
                                  "retention: 30 days"))
        self.assertEqual(ev[8]["verb"], "prune")
        self.assertEqual((ev[8]["effects"], ev[8]["obligations"]), (2, 1))
        self.assertTrue(ev[8]["settled_before"].startswith(self.cutoff()), ev[8])

        # Again: nothing left to prune, nothing written.
        seq = self.last_seq()
        snap = self.snapshot()
        out = self.tally("prune", "--settled-before", self.cutoff(), "--reason", "again")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("Nothing to prune", said(out))
        self.assertEqual(self.snapshot(), snap)
        self.assertEqual(self.new_events(seq), [])

    def test_limit_prunes_the_oldest_first(self):
        runs = [self.new_run("COMPLETED", age_days=50 - i) for i in range(4)]
        for run in runs:
            self.new_effect(run, 1, "CONFIRMED")
        out = self.tally("prune", "--settled-before", self.cutoff(), "--limit", "3",
                         "--dry-run")
        self.assertIn("Would prune 3 runs", said(out))
        out = self.tally("prune", "--settled-before", self.cutoff(), "--limit", "3",
                         "--reason", "retention")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("Pruned 3 runs", said(out))
        pruned = [x for (x,) in self.query("SELECT run_id FROM runs WHERE pruned_at IS NOT NULL"
                                           " ORDER BY run_id")]
        self.assertEqual(pruned, sorted(runs[:3]))
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE kind = 'operator'"
                                     " AND data->>'verb' = 'prune'"), 3)
        out = self.tally("prune", "--settled-before", self.cutoff(), "--reason", "retention")
        self.assertIn("Pruned 1 run", said(out))

    def test_dates_in_the_future_or_not_dates_are_refused(self):
        self.ledger()
        snap = self.snapshot()
        tomorrow = (datetime.datetime.now(datetime.timezone.utc)
                    + datetime.timedelta(days=2)).date().isoformat()
        cases = [
            ((tomorrow,), "is in the future"),
            (("2026-13-45",), "is not a date"),          # the shape, not a day
            (("2026-02-30T25:00",), "is not a date"),
            (("yesterday",), "is not a date"),
            (("31/01/2026",), "is not a date"),
            (("",), "is not a date"),
        ]
        for (date,), words in cases:
            for extra in (("--reason", "r"), ("--dry-run",)):
                out = self.tally("prune", "--settled-before", date, *extra)
                self.assertEqual(out.returncode, 2, (date, out.stdout, out.stderr))
                self.assertIn(words, said(out), date)
                self.assertEqual(out.stdout, "")
        for args in (("prune",), ("prune", "--settled-before", self.cutoff()),
                     ("prune", "--settled-before", self.cutoff(), "--limit", "0",
                      "--reason", "r"),
                     ("prune", "--settled-before", self.cutoff(), "--limit", "x", "--dry-run")):
            out = self.tally(*args)
            self.assertEqual(out.returncode, 2, (args, out.stderr))
            self.assertTrue(out.stderr.startswith("tally prune: "), out.stderr)
        self.assertEqual(self.snapshot(), snap)
        # A timestamp with a zone is a date too.
        out = self.tally("prune", "--settled-before", self.cutoff() + "T06:30:00+02:00",
                         "--dry-run")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn(self.cutoff() + " 04:30:00+00", said(out))

    def test_compensating_a_pruned_run_pages_instead_of_sending_the_marker(self):
        """A pruned run's reverse call cannot be built (its args and receipt are gone): the
        compensator sends nothing and the obligation goes STUCK with code pruned."""
        run = self.new_run("COMPLETED", age_days=40)
        self.new_effect(run, 1, "CONFIRMED")
        out = self.tally("prune", "--settled-before", self.cutoff(), "--reason", "retention")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.start("tally-compensator", TALLY_POLL_MS=200, TALLY_SWEEP_MS=200,
                   TALLY_FAKE_TOOL_URL="http://127.0.0.1:9")  # nothing listens: nothing is sent
        out = self.tally("compensate", "--run", run, "--reason", "undo a pruned run")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        row = wait_for(lambda: self.query(
            "SELECT status, error_code, error_message FROM obligations WHERE run_id = %s"
            " AND status = 'STUCK'", (run,)), timeout=60, what="the obligation to go STUCK")
        self.assertEqual(row[0][1], "pruned", row)
        self.assertIn("tally prune", row[0][2])
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE run_id = %s"
                                     " AND kind = 'connector_call'", (run,)), 0)


if __name__ == "__main__":
    main()
