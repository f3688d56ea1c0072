"""The reconciler resolves UNKNOWN effects to the truth upstream (DESIGN §3, §6): a timeout after
the tool applied the call is CONFIRMED with the tool's record as the receipt; a timeout before it
applied is re-dispatched once, with the same key, after the settle window; a key applied twice
upstream is a DUPLICATE with one compensation obligation for the extra record.

Real processes throughout: tally-dispatcher makes the UNKNOWNs by calling tally-fake-tool with
faults, tally-reconciler resolves them. ReconcileCase is the fixture of every
test_reconcile_*.py module."""

import json
import os
import tempfile
import time
import urllib.request

from dispatchcase import SECRET, DispatchCase, main, run_id
from tallytest import SOURCE_DIR, wait_for
from test_dispatch_runs import run_message

DEMO_TOOLS = os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")
TIMEOUT_MS = 800   # every tool's connector timeout in these tests
SETTLE_MS = 1500   # the settle window of the tools with a status endpoint


def canonical(args):
    """The canonical JSON body the connector sends (keys sorted, compact)."""
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class ReconcileCase(DispatchCase):
    """DispatchCase with short tool timeouts (so calls go UNKNOWN fast), an append_only tool
    without a status endpoint, and helpers for the reconciler, the audit trail and topics."""

    def setUp(self):
        with open(DEMO_TOOLS) as f:
            doc = json.load(f)
        for tool in doc["tools"]:
            tool["connector"]["timeout_ms"] = TIMEOUT_MS
            if "status" in tool["connector"]:
                tool["settle_ms"] = SETTLE_MS
        doc["tools"].append({
            "name": "post_note", "owner": "support", "effect_class": "append_only",
            "operation_key": ["note_id"],
            "connector": {"type": "http", "base_url": "${TALLY_FAKE_TOOL_URL}",
                          "execute": {"method": "POST", "path": "/notes"},
                          "timeout_ms": TIMEOUT_MS, "receipt_ref": "/id"},
            "retry": {"max_attempts": 5, "backoff_ms": 100, "max_backoff_ms": 2000}})
        self.tools_file = os.path.join(tempfile.mkdtemp(prefix="tally-reconcile-tools-"),
                                       "tools.json")
        with open(self.tools_file, "w") as f:
            json.dump(doc, f)
        super().setUp()

    # --- processes ----------------------------------------------------------------------

    def reconciler(self, wait_ready=True, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
                "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 300, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start("tally-reconciler", wait_ready=wait_ready, **base)

    # --- intents ------------------------------------------------------------------------

    def charge(self, run, step=1, amount=5):
        """Publish a charge_card intent; returns (operation key, args, CloudEvent)."""
        args = {"tenant_id": "t1", "payment_id": f"{run}-p{step}", "amount": amount}
        ce = self.publish(self.intent(run, step, "charge_card", args))
        return f"charge_card:t1:{run}-p{step}", args, ce

    def charge_timing_out_before_applying(self, run, step=1):
        """charge(), with the tool holding the call past its timeout without applying it;
        returns the operation key."""
        self.fault("hang_before_apply", key=f"charge_card:t1:{run}-p{step}", delay_ms=3000)
        return self.charge(run, step)[0]

    # --- the ledger ---------------------------------------------------------------------

    def transitions(self, effect_id):
        """[(from, to, actor, reason)] of the effect's transition events, in order."""
        return self.query("SELECT from_status, to_status, actor, reason FROM events"
                          " WHERE effect_id = %s AND kind = 'transition' ORDER BY seq",
                          (effect_id,))

    def events_of(self, effect_id, kind):
        return self.query("SELECT data, reason, actor FROM events WHERE effect_id = %s"
                          " AND kind = %s ORDER BY seq", (effect_id, kind))

    def messages(self, logical, predicate, timeout=30, settle=1.0):
        """Every message on a topic once predicate(messages) holds, plus any that arrive in the
        next `settle` seconds (to catch duplicates)."""
        reader = self.reader(logical)
        got = self.read_until(logical, predicate, timeout=timeout, reader=reader)
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            m = reader.poll(0.1)
            if m is not None and not m.error():
                got.append(json.loads(m.value()))
        return got

    def status_requests(self, key):
        return self.requests(key, op="status")

    def metric(self, proc, name, labels=""):
        """The value of one series on a process's /metrics, or None."""
        status, body = proc.http_get("/metrics")
        self.assertEqual(status, 200)
        for line in body.splitlines():
            if line.startswith(name + labels + " ") or line.startswith(name + labels + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None


class ReconcileResolveTest(ReconcileCase):

    def test_applied_then_timed_out_is_confirmed_with_the_tools_record(self):
        self.dispatcher()
        # The sweep runs once at start-up and then not for a minute: the UNKNOWN is found by
        # its wake-up (NOTIFY tally_unknown, or the tally.effect.unknown.v1 outcome).
        rec = self.reconciler(TALLY_SWEEP_MS=60000)
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        key, args, ce = self.charge(run)
        row = self.wait_status("charge_card", key, "CONFIRMED", timeout=30)

        [record] = self.records("charges")
        self.assertEqual(record["idempotency_key"], key)
        self.assertEqual(row["receipt"], record)          # the tool's record is the receipt
        self.assertEqual(row["external_ref"], record["id"])
        self.assertEqual(row["attempts"], 1)
        self.assertEqual(
            [(f, t) for f, t, _, _ in self.transitions(row["effect_id"])],
            [(None, "PLANNED"), ("PLANNED", "DISPATCHING"), ("DISPATCHING", "UNKNOWN"),
             ("UNKNOWN", "CONFIRMED")])
        last = self.transitions(row["effect_id"])[-1]
        self.assertIn("one upstream record", last[3])
        self.assertEqual(len(self.requests(key)), 1)      # never re-sent
        self.assertGreaterEqual(len(self.status_requests(key)), 1)

        got = self.messages("outcomes", lambda ms: any(
            m["type"] == "tally.effect.confirmed.v1" and m["data"]["effect_id"] == row["effect_id"]
            for m in ms))
        confirmed = [m for m in got if m["type"] == "tally.effect.confirmed.v1"]
        self.assertEqual(len(confirmed), 1)
        data = confirmed[0]["data"]
        self.assertEqual((data["run_id"], data["step"], data["status"], data["external_ref"],
                          data["intent_id"], data["receipt"]),
                         (run, 1, "CONFIRMED", record["id"], ce["id"], record))
        self.assertTrue(confirmed[0]["source"].startswith("/tally/reconciler/"))
        self.assertEqual(self.metric(rec, "tally_reconciler_resolutions_total",
                                     '{outcome="confirmed"}'), 1)
        self.invariants()

    def test_a_held_status_check_is_in_flight_for_its_tool(self):
        self.dispatcher()
        rec = self.reconciler(TALLY_SWEEP_MS=60000)
        self.assert_inflight_settled(rec, "tally_status_checks_inflight")
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        self.fault("slow", key=key, op="status", delay_ms=600)  # under the 800 ms timeout
        self.charge(run)
        held = self.wait_tool_inflight(rec, "tally_status_checks_inflight", "charge_card", 1)
        self.assertEqual(sum(held.values()), 1, held)
        self.wait_status("charge_card", key, "CONFIRMED", timeout=30)
        self.assert_inflight_settled(rec, "tally_status_checks_inflight")
        self.invariants()

    def test_every_answer_carries_the_step_exactly_as_the_intent_had_it(self):
        # DESIGN §5: the dispatcher's answers and the reconciler's alike. A string of digits
        # stays a string ("03", not 3) though it orders numerically; a number stays a number.
        self.dispatcher()
        self.reconciler()
        run = run_id()
        steps = {"03": "p03", 7: "p7", "charge-1": "pc"}
        keys = {}
        for step, pid in steps.items():
            key = f"charge_card:t1:{run}-{pid}"
            if step == "03":
                self.fault("apply_then_hang", key=key, delay_ms=5000)  # answered by the reconciler
            self.publish(self.intent(run, step, "charge_card",
                                     {"tenant_id": "t1", "payment_id": f"{run}-{pid}", "amount": 3}))
            keys[step] = key
        rows = {step: self.wait_status("charge_card", key, "CONFIRMED", timeout=40)
                for step, key in keys.items()}
        got = self.messages("outcomes", lambda ms: len({
            m["data"]["effect_id"] for m in ms if m["type"] == "tally.effect.confirmed.v1"}) >= 3)
        for step, row in rows.items():
            answers = [m for m in got if m["data"].get("effect_id") == row["effect_id"]]
            self.assertTrue(answers, step)
            for m in answers:
                self.assertEqual(m["data"]["step"], step, (m["type"], m["source"]))
                self.assertIs(type(m["data"]["step"]), type(step), (m["type"], m["source"]))
        confirmed_03 = [m for m in got if m["data"].get("effect_id") == rows["03"]["effect_id"]
                        and m["type"] == "tally.effect.confirmed.v1"]
        self.assertTrue(confirmed_03[0]["source"].startswith("/tally/reconciler/"))
        # and "03" still orders as 3: before 7, in the ledger's compensation order
        self.assertEqual(self.scalar("SELECT step_num FROM effects WHERE effect_id = %s",
                                     (rows["03"]["effect_id"],)), 3)

    def test_timed_out_before_applying_is_redispatched_once_with_the_same_key(self):
        self.dispatcher()
        self.reconciler()
        run = run_id()
        key = self.charge_timing_out_before_applying(run)
        row = self.wait_status("charge_card", key, "CONFIRMED", timeout=40)

        records = self.records("charges")
        self.assertEqual(len(records), 1)                 # exactly one upstream record
        self.assertEqual(row["external_ref"], records[0]["id"])
        self.assertEqual(row["attempts"], 2)
        executes = self.requests(key)
        self.assertEqual(len(executes), 2)
        self.assertEqual({r["idempotency_key"] for r in executes}, {key})
        moves = [(f, t) for f, t, _, _ in self.transitions(row["effect_id"])]
        self.assertEqual(moves, [(None, "PLANNED"), ("PLANNED", "DISPATCHING"),
                                 ("DISPATCHING", "UNKNOWN"), ("UNKNOWN", "PLANNED"),
                                 ("PLANNED", "DISPATCHING"), ("DISPATCHING", "CONFIRMED")])
        # The re-dispatch waited for the settle window, measured on the database clock.
        [(unknown_at,)] = self.query(
            "SELECT occurred_at FROM events WHERE effect_id = %s AND kind = 'transition'"
            " AND to_status = 'UNKNOWN'", (row["effect_id"],))
        [(planned_at,)] = self.query(
            "SELECT occurred_at FROM events WHERE effect_id = %s AND kind = 'transition'"
            " AND from_status = 'UNKNOWN' AND to_status = 'PLANNED'", (row["effect_id"],))
        self.assertGreaterEqual((planned_at - unknown_at).total_seconds(), SETTLE_MS / 1000.0)
        # Every status check before the re-dispatch found nothing; the one after the window
        # decided.
        checks = self.events_of(row["effect_id"], "connector_call")
        status_checks = [d for d, _, actor in checks if d.get("op") == "status"]
        self.assertGreaterEqual(len(status_checks), 1)
        self.assertTrue(all(d["verdict"] == "not_found" for d in status_checks), status_checks)
        self.assertEqual(status_checks[-1]["decision"], "redispatched")
        self.invariants()

    def test_not_applied_and_its_run_cancelled_meanwhile_is_cancelled_not_sent_again(self):
        # The call timed out before the tool applied it (UNKNOWN), and the run was cancelled
        # before the reconciler could look. The status check finds nothing after the settle
        # window: the effect never happened, and a cancelled run's retry is not sent.
        self.dispatcher()
        run = run_id()
        key = self.charge_timing_out_before_applying(run)
        row = self.wait_status("charge_card", key, "UNKNOWN", timeout=40)
        self.publish(run_message(self, "cancel_run", run, compensate=False))
        self.wait_count("SELECT count(*) FROM runs WHERE run_id = %s AND status = 'CANCELLED'",
                        1, (run,))
        self.assertEqual(self.effect("charge_card", key)["status"], "UNKNOWN")
        rec = self.reconciler()
        row = self.wait_status("charge_card", key, ("CANCELLED", "CONFIRMED"), timeout=40)
        self.assertEqual(row["status"], "CANCELLED", row)
        self.assertEqual(row["error_code"], "run_not_active")
        moves = [(f, t) for f, t, _, _ in self.transitions(row["effect_id"])]
        # one move, as the row made it (the effect was never PLANNED again)
        self.assertEqual(moves[-2:], [("DISPATCHING", "UNKNOWN"), ("UNKNOWN", "CANCELLED")])
        self.assertEqual(self.scalar("SELECT count(*) FROM outbox WHERE effect_id = %s",
                                     (row["effect_id"],)), 0)
        got = self.messages("outcomes", lambda got: any(
            m["data"].get("effect_id") == row["effect_id"] and m["data"]["status"] == "CANCELLED"
            for m in got))
        [ev] = [m for m in got if m["data"].get("effect_id") == row["effect_id"]
                and m["data"]["status"] == "CANCELLED"]
        self.assertEqual(ev["type"], "tally.effect.cancelled.v1")
        self.assertEqual(ev["data"]["error"]["code"], "run_not_active")
        time.sleep(1.5)  # a re-dispatch would have gone out by now
        self.assertEqual(len(self.requests(key)), 1)
        self.assertEqual(self.records("charges"), [])
        self.assertEqual(self.metric(rec, "tally_reconciler_resolutions_total",
                                     '{outcome="cancelled"}'), 1)
        self.invariants()

    def test_compensated_run_whose_unknown_step_never_happened_skips_it(self):
        # Step 1 is confirmed; step 2 times out before the tool applies it (UNKNOWN) when the
        # run is sent to compensation. The reconciler finds nothing, so step 2 is CANCELLED
        # rather than sent; the compensator reverses step 1 and lists step 2 as skipped.
        self.dispatcher()
        run = run_id()
        self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h1"}))
        self.wait_status("create_hold", f"create_hold:{run}-h1", "CONFIRMED")
        key = self.charge_timing_out_before_applying(run, step=2)
        self.wait_status("charge_card", key, "UNKNOWN", timeout=40)
        self.publish(run_message(self, "compensate_run", run))
        self.wait_count("SELECT count(*) FROM runs WHERE run_id = %s"
                        " AND status = 'COMPENSATING'", 1, (run,))
        self.reconciler()
        self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                   BILLING_HMAC_SECRET=SECRET, TALLY_SWEEP_MS=200)
        summary = wait_for(lambda: self.scalar(
            "SELECT summary FROM runs WHERE run_id = %s AND status = 'COMPENSATED'", (run,)),
            timeout=60, what="the run to be compensated")
        self.assertEqual(self.effect("charge_card", key)["status"], "CANCELLED")
        self.assertEqual([(c["step"], c["tool"]) for c in summary["compensated"]],
                         [(1, "create_hold")])
        self.assertEqual([(c["step"], c["tool"], c["reason"]) for c in summary["skipped"]],
                         [(2, "charge_card",
                           "the effect was cancelled and never took effect (CANCELLED)")])
        self.assertEqual(len(self.requests(key)), 1)
        self.assertEqual(self.records("charges"), [])
        self.invariants(obligations_settled=True)

    def test_applied_twice_upstream_is_a_duplicate_with_one_obligation(self):
        self.dispatcher()
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        args = {"tenant_id": "t1", "payment_id": f"{run}-p1", "amount": 5}
        # Upstream applies the key twice (a replica bug), then the dispatcher's own call
        # times out after the tool replayed it: the effect goes UNKNOWN with two records.
        self.fault("apply_twice", key=key)
        req = urllib.request.Request(self.fake_url + "/charges", data=canonical(args).encode(),
                                     headers={"Idempotency-Key": key}, method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            self.assertEqual(r.status, 201)
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        ce = self.publish(self.intent(run, 1, "charge_card", args))
        unknown = self.wait_status("charge_card", key, "UNKNOWN", timeout=30)
        rec = self.reconciler()
        row = self.wait_status("charge_card", key, "CONFIRMED", timeout=30)

        first, second = self.records("charges")
        self.assertEqual(row["receipt"], first)          # the earliest record is kept
        self.assertEqual(row["external_ref"], first["id"])
        obligations = self.query(
            "SELECT obligation_id::text, run_id, reason, external_ref, receipt, status"
            " FROM obligations WHERE effect_id = %s", (unknown["effect_id"],))
        self.assertEqual(len(obligations), 1)            # one for the extra, none for the kept
        oid, orun, reason, ref, receipt, status = obligations[0]
        self.assertEqual((orun, reason, ref, receipt, status),
                         (run, "duplicate", second["id"], second, "PENDING"))

        [(dup_data, _, _)] = self.events_of(row["effect_id"], "duplicate")
        self.assertEqual([r["id"] for r in dup_data["records"]], [first["id"], second["id"]])
        self.assertEqual([r["external_ref"] for r in dup_data["external_refs"]],
                         [first["id"], second["id"]])
        self.assertEqual(len(self.events_of(row["effect_id"], "obligation")), 1)

        outs = self.messages("outcomes", lambda ms: any(
            m["type"] == "tally.effect.duplicate.v1" for m in ms))
        [dup] = [m for m in outs if m["type"] == "tally.effect.duplicate.v1"]
        self.assertEqual(dup["data"]["effect_id"], row["effect_id"])
        self.assertEqual(dup["data"]["intent_id"], ce["id"])
        self.assertEqual(dup["data"]["records"], 2)
        self.assertEqual(dup["data"]["obligations"],
                         [{"obligation_id": oid, "external_ref": second["id"]}])
        self.assertEqual(len([m for m in outs if m["type"] == "tally.effect.confirmed.v1"]), 1)
        obls = self.messages("obligations", lambda ms: len(ms) >= 1)
        self.assertEqual([(m["type"], m["data"]["obligation_id"], m["data"]["effect_id"],
                           m["data"]["reason"], m["data"]["external_ref"]) for m in obls],
                         [("tally.obligation.v1", oid, row["effect_id"], "duplicate",
                           second["id"])])
        self.assertEqual(self.metric(rec, "tally_reconciler_resolutions_total",
                                     '{outcome="duplicate"}'), 1)
        self.invariants(allow_duplicates=True)

        # A second detection of the same extra record creates nothing: put the effect back to
        # UNKNOWN (as an operator's mistaken reset would) and let the reconciler look again.
        # (CONFIRMED -> UNKNOWN is no move of the effect machine: forced past the ledger's
        # triggers, and kept out of the audit trail's transitions)
        self.force("UPDATE effects SET status = 'UNKNOWN', unknown_since = now(),"
                   " next_attempt_at = now() WHERE effect_id = %s RETURNING 1",
                   (row["effect_id"],))
        self.query("INSERT INTO events (event_id, run_id, effect_id, kind, actor, reason, data)"
                   " VALUES (gen_random_uuid(), %s, %s, 'test_reset', 'test', 'reset by the test',"
                   " '{\"from\": \"CONFIRMED\", \"to\": \"UNKNOWN\"}') RETURNING 1",
                   (run, row["effect_id"]))
        self.wait_status("charge_card", key, "CONFIRMED", timeout=30)
        wait_for(lambda: self.metric(rec, "tally_reconciler_resolutions_total",
                                     '{outcome="duplicate"}') == 2, timeout=10,
                 what="the second detection to be recorded")
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations"), 1)
        self.assertEqual(len(self.events_of(row["effect_id"], "obligation")), 1)
        time.sleep(1)
        obls = self.messages("obligations", lambda ms: len(ms) >= 1)
        self.assertEqual(len(obls), 1)                   # no second tally.obligation.v1
        self.invariants(allow_duplicates=True)


if __name__ == "__main__":
    main()
