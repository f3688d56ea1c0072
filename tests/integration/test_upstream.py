"""The ledger against the tools' own records (DESIGN §12, issue 24).

- The audit asks about CONFIRMED effects again once the tool's audit.delay_ms has passed: a call
  the tool applied twice and answered 201 once is found, the extra record is reversed once, and
  the receipt is kept; a clean effect is counted clean.
- The orphan sweep lists the tool's records (connector.list): a record of a FAILED effect (a 4xx
  that was in fact applied) is reversed by an 'orphan' obligation, a record for an effect id the
  ledger never had is a finding, paged once with the command that closes it.
- Audits and sweeps together never call a tool above its audit.rate_per_s, however many
  reconcilers run.

Real processes throughout: tally-dispatcher, tally-reconciler and tally-compensator against
tally-fake-tool."""

import datetime
import json
import time
import urllib.request
import uuid

from dispatchcase import SECRET, main, run_id
from tallytest import wait_for
from test_reconcile_resolve import ReconcileCase

AUDIT_DELAY_MS = 1500


def parse_at(text):
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


class UpstreamCase(ReconcileCase):
    """ReconcileCase whose charge_card and create_hold tools are audited and swept."""

    AUDIT = {"delay_ms": AUDIT_DELAY_MS, "rate_per_s": 50, "sweep_ms": 1000,
             "lookback_ms": 600000}

    def setUp(self):
        super().setUp()
        with open(self.tools_file) as f:
            doc = json.load(f)
        for tool in doc["tools"]:
            if tool["name"] in ("charge_card", "create_hold"):
                tool["audit"] = dict(self.AUDIT)
                path = tool["connector"]["execute"]["path"]
                tool["connector"]["list"] = {"method": "GET", "path": path + "/list"}
        with open(self.tools_file, "w") as f:
            json.dump(doc, f)

    def compensator(self, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
                "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 300, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start("tally-compensator", **base)

    def workers(self, reconcilers=1):
        self.dispatcher()
        recs = [self.reconciler() for _ in range(reconcilers)]
        self.compensator()
        return recs

    def metric(self, proc, line_prefix):
        status, text = proc.http_get("/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(line_prefix):
                total += float(line.split()[-1])
        return total

    def hand_made_record(self, path, key, run, effect_id, body):
        """A record made straight at the tool, as a stale replay or someone else's call would
        make it: the Tally headers name @effect_id."""
        req = urllib.request.Request(
            self.fake_url + path, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "Idempotency-Key": key,
                     "Tally-Run-Id": run, "Tally-Effect-Id": effect_id})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())


class AuditTest(UpstreamCase):

    def test_a_call_applied_twice_that_answered_201_is_found_and_the_extra_reversed_once(self):
        run = run_id()
        twice_key = f"charge_card:t1:{run}-p1"
        self.fault("apply_twice", key=twice_key, status=201)
        self.workers()
        self.charge(run, 1)
        clean_key = self.charge(run, 2)[0]
        effect = self.wait_status("charge_card", twice_key, ["CONFIRMED"])
        confirmed_ref = effect["external_ref"]
        self.assertEqual(len([r for r in self.records("charges")
                              if r["idempotency_key"] == twice_key]), 2)

        # the audit finds the extra record: one obligation, reversed by the compensator
        self.wait_count("SELECT count(*) FROM obligations WHERE effect_id = %s"
                        " AND reason = 'duplicate' AND status = 'RESOLVED'", 1,
                        (effect["effect_id"],))
        obligation = self.query("SELECT external_ref, created_at FROM obligations"
                                " WHERE effect_id = %s", (effect["effect_id"],))
        self.assertEqual(len(obligation), 1)
        self.assertNotEqual(obligation[0][0], confirmed_ref)
        upstream = {r["id"]: r for r in self.records("charges")
                    if r["idempotency_key"] == twice_key}
        self.assertEqual(upstream[obligation[0][0]]["status"], "reversed")
        self.assertEqual(upstream[confirmed_ref]["status"], "active")
        # the receipt is kept: still CONFIRMED with the same ref
        again = self.effect("charge_card", twice_key)
        self.assertEqual((again["status"], again["external_ref"]), ("CONFIRMED", confirmed_ref))
        # not before the configured delay
        confirmed_at = self.scalar("SELECT max(occurred_at) FROM events WHERE effect_id = %s"
                                   " AND to_status = 'CONFIRMED'", (effect["effect_id"],))
        self.assertGreaterEqual((obligation[0][1] - confirmed_at).total_seconds() * 1000,
                                AUDIT_DELAY_MS - 50)
        # the agent hears of it
        got = self.read_until("outcomes", lambda got: any(
            ev.get("type") == "tally.effect.duplicate.v1"
            and ev["data"]["effect_id"] == effect["effect_id"] for ev in got))
        # the clean one is audited clean, once
        clean = self.effect("charge_card", clean_key)
        wait_for(lambda: self.scalar("SELECT count(*) FROM events WHERE effect_id = %s"
                                     " AND kind = 'audit'", (clean["effect_id"],)) == 1,
                 timeout=30, what="the clean effect's audit")
        data = self.scalar("SELECT data FROM events WHERE effect_id = %s AND kind = 'audit'",
                           (clean["effect_id"],))
        self.assertEqual(data["found"], "clean")
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations WHERE effect_id = %s",
                                     (clean["effect_id"],)), 0)
        self.assertEqual(self.scalar("SELECT count(*) FROM audits"), 0)
        # a second look finds nothing new: still one obligation, one reversal upstream
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations"), 1)
        self.assertEqual(len([r for r in self.records("charges") if r["status"] == "reversed"]),
                         1)
        self.invariants(allow_duplicates=True)


class SampleTest(UpstreamCase):

    AUDIT = {"delay_ms": 600000, "sample_rate": 0.5}  # queued, not yet due

    def test_a_sample_rate_audits_that_share_of_the_effects_chosen_by_id(self):
        run = run_id()
        self.workers()
        keys = [self.charge(run, i + 1)[0] for i in range(40)]
        for key in keys:
            self.wait_status("charge_card", key, ["CONFIRMED"])
        # the effects whose id hashes into the sample, by the trigger's own rule
        chosen = {r[0] for r in self.query(
            "SELECT effect_id::text FROM effects WHERE 0.5 >="
            " ((hashtext(effect_id::text)::bigint + 2147483648) + 1) / 4294967296.0")}
        queued = {r[0] for r in self.query("SELECT effect_id::text FROM audits")}
        self.assertEqual(queued, chosen)
        self.assertTrue(5 <= len(queued) <= 35, f"{len(queued)} of 40 sampled at 0.5")
        due = self.scalar("SELECT min(due_at - e.updated_at) FROM audits a"
                          " JOIN effects e USING (effect_id)")
        self.assertGreater(due.total_seconds(), 590)


class MissingTest(UpstreamCase):

    AUDIT = {"delay_ms": AUDIT_DELAY_MS, "rate_per_s": 50}  # swept once, at the start

    def test_a_confirmed_effect_the_tool_no_longer_holds_is_a_finding(self):
        run = run_id()
        self.workers()
        key = self.charge(run, 1)[0]
        effect = self.wait_status("charge_card", key, ["CONFIRMED"])
        # the tool loses its records (a restore from an old backup, a purge) before the audit
        self.fake_post("/_control/reset", {})
        wait_for(lambda: self.scalar("SELECT count(*) FROM findings WHERE effect_id = %s",
                                     (effect["effect_id"],)) == 1, timeout=30,
                 what="the audit's finding")
        kind, ref, summary = self.query("SELECT kind, external_ref, summary FROM findings"
                                        " WHERE effect_id = %s", (effect["effect_id"],))[0]
        self.assertEqual((kind, ref), ("ledger", effect["external_ref"]))
        self.assertIn("holds no record for CONFIRMED effect", summary)
        self.assertEqual(self.scalar("SELECT reason FROM alerts WHERE effect_id = %s",
                                     (effect["effect_id"],)), "upstream_mismatch")
        self.assertEqual(self.scalar("SELECT data->>'found' FROM events WHERE effect_id = %s"
                                     " AND kind = 'audit'", (effect["effect_id"],)), "missing")
        # nothing is reversed, the effect stays as it was
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations"), 0)
        self.assertEqual(self.effect("charge_card", key)["status"], "CONFIRMED")


class SweepTest(UpstreamCase):

    def test_records_of_a_failed_effect_and_of_an_unknown_effect_are_found(self):
        run = run_id()
        failed_key = f"charge_card:t1:{run}-p1"
        # a 4xx that was in fact applied: FAILED in the ledger, a record upstream
        self.fault("fail_after_apply", key=failed_key, status=422)
        self.workers()
        self.charge(run, 1)
        failed = self.wait_status("charge_card", failed_key, ["FAILED"])
        stranger = str(uuid.uuid4())
        made = self.hand_made_record("/holds", "create_hold:stale-replay", run, stranger,
                                     {"hold_id": "stale-replay", "amount": 7})
        # a hold naming the charge's effect is no record of that charge: reversing it through
        # the charge's obligation would call the wrong tool
        borrowed = self.hand_made_record("/holds", "create_hold:borrowed", run,
                                         failed["effect_id"], {"hold_id": "borrowed"})

        # the FAILED effect's record: an orphan obligation, reversed
        self.wait_count("SELECT count(*) FROM obligations WHERE effect_id = %s"
                        " AND reason = 'orphan' AND status = 'RESOLVED'", 1,
                        (failed["effect_id"],), timeout=60)
        upstream = [r for r in self.records("charges") if r["idempotency_key"] == failed_key]
        self.assertEqual([r["status"] for r in upstream], ["reversed"])
        self.assertEqual(self.effect("charge_card", failed_key)["status"], "FAILED")

        # the unknown effect id: a finding, paged once with the command that closes it
        wait_for(lambda: self.scalar("SELECT count(*) FROM findings WHERE effect_id = %s",
                                     (stranger,)) == 1, timeout=60, what="the orphan finding")
        finding_id, kind, status, ref = self.query(
            "SELECT finding_id::text, kind, status, external_ref FROM findings"
            " WHERE effect_id = %s", (stranger,))[0]
        self.assertEqual((kind, status, ref), ("orphan", "OPEN", made["id"]))
        alerts = self.read_until("alerts", lambda got: any(
            ev["data"].get("dedup_key") == f"finding:{finding_id}" for ev in got))
        page = [ev for ev in alerts if ev["data"].get("dedup_key") == f"finding:{finding_id}"]
        self.assertEqual(len(page), 1)
        self.assertIn(f"tally resolve --finding {finding_id}", page[0]["data"]["resolve_command"])

        wait_for(lambda: self.scalar("SELECT count(*) FROM findings WHERE external_ref = %s",
                                     (borrowed["id"],)) == 1, timeout=60,
                 what="the finding for the hold that names a charge")
        self.assertEqual(self.scalar("SELECT tool FROM findings WHERE external_ref = %s",
                                     (borrowed["id"],)), "create_hold")
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations WHERE external_ref = %s",
                                     (borrowed["id"],)), 0)

        # later sweeps find the same records and file nothing new
        swept = self.scalar("SELECT swept_at FROM sweep_cursors WHERE tool = 'create_hold'")
        wait_for(lambda: self.scalar("SELECT swept_at FROM sweep_cursors"
                                     " WHERE tool = 'create_hold'") > swept,
                 timeout=30, what="another sweep")
        self.assertEqual(self.scalar("SELECT count(*) FROM findings"), 2)
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations"), 1)
        self.assertEqual(self.scalar("SELECT count(*) FROM alerts WHERE dedup_key LIKE"
                                     " 'finding:%%'"), 2)
        # the on-call engineer sees them in tally status, with the pages that close them
        out = self.cli("status")
        self.assertIn("FINDINGS    2 open", out.stdout)
        self.assertIn(f"finding:{finding_id}", out.stdout)
        self.assertIn(f"holds record {borrowed['id']} for effect {failed['effect_id']}, which the"
                      " ledger has for tool 'charge_card'", " ".join(out.stdout.split()))
        self.assertEqual(json.loads(self.cli("status", "--json").stdout)["counts"]
                         ["findings_open"], 2)


class OutageTest(UpstreamCase):

    AUDIT = {"delay_ms": AUDIT_DELAY_MS, "rate_per_s": 50}  # swept once, at the start

    def test_an_audit_answered_during_a_postgres_outage_is_recorded_after_it(self):
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        self.fault("apply_twice", key=key, status=201)
        # the audit's status check is held (within the tool's timeout) until the database has
        # gone away
        self.fault("slow", key=key, op="status", delay_ms=600, times=1)
        self.dispatcher()
        rec = self.reconciler()
        self.charge(run, 1)
        effect = self.wait_status("charge_card", key, ["CONFIRMED"])
        wait_for(lambda: self.metric(rec, "tally_reconciler_inflight_checks") >= 1, timeout=30,
                 what="the audit's status check in flight")
        self.admin(f'ALTER DATABASE "{self.dbname}" ALLOW_CONNECTIONS false')
        try:
            self.assertTrue(self.terminate_backends())
            time.sleep(4)
            self.assertTrue(rec.alive(), rec.log()[-3000:])
        finally:
            self.admin(f'ALTER DATABASE "{self.dbname}" ALLOW_CONNECTIONS true')
        self.wait_count("SELECT count(*) FROM obligations WHERE effect_id = %s"
                        " AND reason = 'duplicate'", 1, (effect["effect_id"],))
        wait_for(lambda: self.scalar("SELECT count(*) FROM audits") == 0, timeout=30,
                 what="the audit to be done")
        # the slow answer was the only status call: recorded after the outage, not asked again
        self.assertEqual(len([r for r in self.requests(key=key, op="status")]), 1)
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE effect_id = %s"
                                     " AND kind = 'audit'", (effect["effect_id"],)), 1)


class HostileListTest(UpstreamCase):

    def test_broken_list_answers_stop_the_sweep_and_the_next_period_goes_on(self):
        run = run_id()
        stranger = str(uuid.uuid4())
        self.hand_made_record("/holds", "create_hold:garbled", run, stranger, {"hold_id": "g"})
        # two truncated answers, then a 500, for the holds' list; the charges' list is fine
        self.fault("status_garbage", collection="holds", op="list", times=2)
        self.fault("status_500", collection="holds", op="list", times=1)
        rec = self.reconciler()
        wait_for(lambda: (self.query("SELECT last_error FROM sweep_cursors"
                                     " WHERE tool = 'create_hold'") or [[None]])[0][0],
                 timeout=30, what="a failed sweep of create_hold")
        error = self.scalar("SELECT last_error FROM sweep_cursors WHERE tool = 'create_hold'")
        self.assertTrue("not JSON" in error or "answered 500" in error, error)
        # the worker goes on, and once the tool answers, the sweep finds the orphan
        wait_for(lambda: self.scalar("SELECT count(*) FROM findings WHERE effect_id = %s",
                                     (stranger,)) == 1, timeout=60, what="the orphan finding")
        self.assertIsNone(self.scalar("SELECT last_error FROM sweep_cursors"
                                      " WHERE tool = 'create_hold'"))
        self.assertTrue(rec.alive())
        self.assertGreaterEqual(self.metric(rec, 'tally_orphan_sweeps_total{tool="create_hold",'
                                                 'result="failed"}'), 1)


class PacingTest(UpstreamCase):

    AUDIT = {"delay_ms": 200, "rate_per_s": 4}

    def test_two_reconcilers_together_stay_within_the_tools_rate(self):
        run = run_id()
        self.workers(reconcilers=2)
        keys = [self.charge(run, i + 1)[0] for i in range(16)]
        for key in keys:
            self.wait_status("charge_card", key, ["CONFIRMED"])
        wait_for(lambda: self.scalar("SELECT count(*) FROM events WHERE kind = 'audit'") == 16,
                 timeout=60, what="every effect audited")
        audits = sorted(parse_at(r["at"]) for r in self.requests(op="status")
                        if r.get("collection") == "charges")
        self.assertEqual(len(audits), 16)
        # a token bucket of 4 per second holding one second's worth: in any window of w
        # seconds, at most 4 * (w + 1) calls
        for i in range(len(audits)):
            for j in range(i + 1, len(audits)):
                window = (audits[j] - audits[i]).total_seconds()
                self.assertLessEqual(j - i + 1, 4 * (window + 1) + 1,
                                     f"{j - i + 1} audit calls within {window:.2f} s")


if __name__ == "__main__":
    main()
