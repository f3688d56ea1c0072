"""Dispatcher, run-level messages: tally.cancel_run.v1 and tally.compensate_run.v1 (the
ledger side: cancelled effects, obligations and their events; executing obligations is the
compensator's job). Also SIGTERM while calls are in flight."""

import json
import os
import time
import uuid

from dispatchcase import DispatchCase, main, run_id
from tallytest import wait_for


def run_message(case, kind, run, **data):
    d = {"run_id": run, "reason": f"test {kind}"}
    d.update(data)
    return {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/" + case.id(),
            "type": f"tally.{kind}.v1", "datacontenttype": "application/json", "data": d}


class DispatchRunsTest(DispatchCase):

    def test_cancel_run_cancels_pending_effects_and_compensates_when_asked(self):
        self.dispatcher()
        run = run_id()
        self.publish(self.intent(run, 1, "charge_card",
                                 {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 7}))
        charged = self.wait_status("charge_card", f"charge_card:t1:{run}-p", "CONFIRMED")
        gated = self.publish(self.intent(run, 2, "delete_account", {"account_id": f"{run}-a"}))
        self.wait_status("delete_account", f"delete_account:{run}-a", "AWAITING_APPROVAL")
        self.publish(run_message(self, "cancel_run", run, compensate=True))
        self.wait_status("delete_account", f"delete_account:{run}-a", "CANCELLED")
        ob = self.query("SELECT effect_id::text, reason, external_ref, status FROM obligations"
                        " WHERE run_id = %s", (run,))
        self.assertEqual(ob, [(charged["effect_id"], "cancel_run", charged["external_ref"],
                               "PENDING")])
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "COMPENSATING")
        got = self.read_until("outcomes", lambda got: len(
            [m for m in got if m["data"].get("intent_id") == gated["id"]]) >= 2)
        self.assertEqual([m["type"] for m in got if m["data"].get("intent_id") == gated["id"]],
                         ["tally.effect.awaiting_approval.v1", "tally.effect.cancelled.v1"])
        [obl] = self.read_until("obligations", lambda got: len(got) >= 1)
        self.assertEqual(obl["type"], "tally.obligation.v1")
        self.assertEqual(obl["data"]["effect_id"], charged["effect_id"])
        self.assertEqual(obl["data"]["reason"], "cancel_run")
        self.assertEqual(obl["data"]["external_ref"], charged["external_ref"])
        # An intent that arrives after the cancel never runs.
        late = self.publish(self.intent(run, 3, "update_ledger", {"entry_id": f"{run}-late"}))
        self.wait_status("update_ledger", f"update_ledger:{run}-late", "CANCELLED")
        [ev] = self.outcomes_for([late["id"]])[late["id"]]
        self.assertEqual(ev["type"], "tally.effect.cancelled.v1")
        time.sleep(1)
        self.assertEqual(self.records("ledger_entries"), [])
        self.assertEqual(self.records("account_deletions"), [])
        self.invariants()

    def test_cancel_without_compensation_leaves_confirmed_effects_alone(self):
        self.dispatcher()
        run = run_id()
        self.publish(self.intent(run, 1, "update_ledger", {"entry_id": f"{run}-1"}))
        self.wait_status("update_ledger", f"update_ledger:{run}-1", "CONFIRMED")
        self.publish(run_message(self, "cancel_run", run, compensate=False))
        self.wait_count("SELECT count(*) FROM runs WHERE run_id = %s AND status = 'CANCELLED'",
                        1, (run,))
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations"), 0)
        self.assertEqual(self.effect("update_ledger", f"update_ledger:{run}-1")["status"],
                         "CONFIRMED")
        self.invariants()

    def test_compensate_run_twice_creates_each_obligation_once(self):
        self.dispatcher()
        run = run_id()
        for i, (tool, args) in enumerate([
                ("create_hold", {"hold_id": f"{run}-h"}),
                ("charge_card", {"tenant_id": "t1", "payment_id": f"{run}-p"}),
                ("send_email", {"message_id": f"{run}-m"})]):
            self.publish(self.intent(run, i + 1, tool, args))
        self.wait_count("SELECT count(*) FROM effects WHERE run_id = %s AND status = 'CONFIRMED'",
                        3, (run,))
        self.publish(run_message(self, "compensate_run", run))
        self.wait_count("SELECT count(*) FROM obligations WHERE run_id = %s", 3, (run,))
        self.publish(run_message(self, "compensate_run", run))
        marker = self.publish(self.intent(run_id(), 1, "update_ledger", {"entry_id": "marker"}))
        self.outcomes_for([marker["id"]])  # the second request was processed before this
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations WHERE run_id = %s",
                                     (run,)), 3)
        rows = self.query("SELECT o.reason, o.external_ref = e.external_ref, o.receipt = e.receipt"
                          " FROM obligations o JOIN effects e USING (effect_id)")
        self.assertEqual(set(rows), {("compensate_run", True, True)})
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "COMPENSATING")
        obl = self.read_until("obligations", lambda got: len(got) >= 3)
        time.sleep(1)
        self.assertEqual(len(obl), 3)
        self.invariants()

    def test_compensate_run_while_the_only_effect_is_in_flight_still_compensates_it(self):
        # Nothing is CONFIRMED yet when the request arrives: the run must still turn
        # COMPENSATING, so the effect gets its obligation once it is confirmed.
        self.dispatcher()
        run = run_id()
        self.fault("slow", collection="holds", times=1, delay_ms=1500)
        self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h"}))
        self.wait_status("create_hold", f"create_hold:{run}-h", "DISPATCHING")
        self.publish(run_message(self, "compensate_run", run))
        self.wait_count("SELECT count(*) FROM runs WHERE run_id = %s AND status = 'COMPENSATING'",
                        1, (run,))
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations WHERE run_id = %s",
                                     (run,)), 0)
        self.wait_status("create_hold", f"create_hold:{run}-h", "CONFIRMED")
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE run_id = %s"
                                     " AND kind = 'compensate_run'", (run,)), 1)
        self.invariants()

    def test_call_refused_after_its_run_was_cancelled_is_cancelled_not_retried(self):
        # The call is in flight when the run is cancelled; the tool then refuses it (503, not
        # applied). A retry would run an effect of a cancelled run: it must end CANCELLED,
        # with its event published, and never reach the tool again.
        self.dispatcher()
        run = run_id()
        key = f"create_hold:{run}-h"
        # 1.7 s: inside create_hold's 2 s timeout, so the answer (503) arrives
        self.fault("hang_before_apply", collection="holds", times=1, delay_ms=1700, status=503)
        intent = self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h"}))
        self.wait_status("create_hold", key, "DISPATCHING")
        self.publish(run_message(self, "cancel_run", run, compensate=False))
        self.wait_count("SELECT count(*) FROM runs WHERE run_id = %s AND status = 'CANCELLED'",
                        1, (run,))
        row = self.wait_status("create_hold", key, "CANCELLED")
        self.assertEqual(row["error_code"], "run_not_active")
        self.assertEqual(self.scalar("SELECT count(*) FROM outbox o JOIN effects e USING"
                                     " (effect_id) WHERE e.run_id = %s", (run,)), 0)
        events = self.query("SELECT from_status, to_status FROM events WHERE effect_id = %s"
                            " AND kind = 'transition' ORDER BY seq", (row["effect_id"],))
        # the cancel found the call in flight and left it alone; its answer cancelled it
        self.assertEqual(events[-1], ("DISPATCHING", "CANCELLED"))
        got = self.read_until("outcomes", lambda got: any(
            m["data"].get("intent_id") == intent["id"] and m["data"].get("status") == "CANCELLED"
            for m in got))
        [ev] = [m for m in got if m["data"].get("intent_id") == intent["id"]]
        self.assertEqual(ev["type"], "tally.effect.cancelled.v1")
        self.assertEqual(ev["data"]["error"]["code"], "run_not_active")
        time.sleep(1.5)  # the tool's backoff would have come due by now
        self.assertEqual(len(self.requests(key)), 1)
        self.assertEqual(self.records("holds"), [])
        self.invariants()

    def ledger_tool_with_a_status_check(self, **retry):
        """The demo registry, but update_ledger (idempotent) gets a status check, which the
        demo's lacks, and @p retry overrides its retry policy."""
        with open(self.tools_file) as f:
            registry = json.load(f)
        [tool] = [t for t in registry["tools"] if t["name"] == "update_ledger"]
        tool["connector"]["status"] = {"method": "GET", "path": "/ledger_entries"}
        tool["retry"].update(retry)
        self.tools_file = os.path.join(self.tmp, "tools.json")
        with open(self.tools_file, "w") as f:
            json.dump(registry, f)

    def confirmed_by_the_reconciler(self, key):
        """Start a reconciler; the effect must end CONFIRMED with the tool's one record."""
        self.start("tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url, TALLY_SWEEP_MS=200)
        row = self.wait_status("update_ledger", key, "CONFIRMED")
        [rec] = self.records("ledger_entries")
        self.assertEqual(row["external_ref"], rec["id"])
        return row

    def test_idempotent_call_that_may_have_applied_when_its_run_was_cancelled_is_unknown(self):
        # update_ledger is idempotent: a timeout after sending is retried with the same key
        # while the run is ACTIVE. Here the tool applies the entry and hangs past the 2 s
        # timeout, and the run is cancelled meanwhile. The attempt may have happened, so the
        # effect must not be CANCELLED ("not applied") and must not be sent again: it is
        # UNKNOWN, and the reconciler's status check finds the entry.
        self.ledger_tool_with_a_status_check()
        self.dispatcher()
        run = run_id()
        key = f"update_ledger:{run}-le"
        self.fault("apply_then_hang", key=key, times=1, delay_ms=4000)
        intent = self.publish(self.intent(run, 1, "update_ledger",
                                          {"entry_id": f"{run}-le", "amount": -5}))
        self.wait_status("update_ledger", key, "DISPATCHING")
        self.publish(run_message(self, "cancel_run", run, compensate=False))
        self.wait_count("SELECT count(*) FROM runs WHERE run_id = %s AND status = 'CANCELLED'",
                        1, (run,))
        row = self.wait_status("update_ledger", key, ("UNKNOWN", "CANCELLED", "PLANNED"))
        self.assertEqual(row["status"], "UNKNOWN", row)
        self.assertIn("may have been applied", row["error_message"])
        got = self.read_until("outcomes", lambda got: any(
            m["data"].get("intent_id") == intent["id"] for m in got))
        [ev] = [m for m in got if m["data"].get("intent_id") == intent["id"]]
        self.assertEqual(ev["type"], "tally.effect.unknown.v1")
        time.sleep(1.5)  # the tool's backoff would have come due by now
        self.assertEqual(len(self.requests(key)), 1)
        self.confirmed_by_the_reconciler(key)
        self.assertEqual(len(self.requests(key)), 1)  # asked about, never sent again
        self.assertEqual(len(self.requests(key, op="status")), 1)
        self.invariants()

    def test_a_retry_refused_after_the_run_was_cancelled_is_unknown_if_an_earlier_try_applied(
            self):
        # Attempt 1 applies and times out (so it may have happened); attempt 2, with the same
        # key, is in flight when the run is cancelled and is refused (503, not applied). That
        # refusal says nothing of attempt 1: the effect is UNKNOWN, not CANCELLED.
        self.ledger_tool_with_a_status_check()
        self.dispatcher()
        run = run_id()
        key = f"update_ledger:{run}-le"
        self.fault("apply_then_hang", key=key, times=1, delay_ms=4000)
        self.fault("hang_before_apply", key=key, times=1, delay_ms=1700, status=503)
        self.publish(self.intent(run, 1, "update_ledger", {"entry_id": f"{run}-le", "amount": 1}))
        wait_for(lambda: len(self.requests(key)) == 2, timeout=30,
                 what="the second attempt to reach the tool")
        self.publish(run_message(self, "cancel_run", run, compensate=False))
        row = self.wait_status("update_ledger", key, ("UNKNOWN", "CANCELLED"))
        self.assertEqual(row["status"], "UNKNOWN", row)
        self.assertEqual(row["attempts"], 2)
        self.confirmed_by_the_reconciler(key)
        self.assertEqual(len(self.requests(key)), 2)
        self.invariants()

    def test_a_retry_waiting_when_its_run_is_cancelled_goes_out_if_its_try_may_have_applied(
            self):
        # The attempt applies and times out; its retry waits out its backoff (PLANNED) when the
        # run is cancelled. cancel_run must not call it CANCELLED ("never happened"): the retry
        # goes out with the same key, and the idempotent tool answers with the entry it made.
        self.ledger_tool_with_a_status_check(backoff_ms=3000, max_backoff_ms=3000)
        self.dispatcher()
        run = run_id()
        key = f"update_ledger:{run}-le"
        self.fault("apply_then_hang", key=key, times=1, delay_ms=4000)
        intent = self.publish(self.intent(run, 1, "update_ledger",
                                          {"entry_id": f"{run}-le", "amount": 1}))
        self.wait_count("SELECT count(*) FROM effects WHERE operation_key = %s"
                        " AND status = 'PLANNED' AND attempts = 1", 1, (key,))
        self.publish(run_message(self, "cancel_run", run, compensate=False))
        self.wait_count("SELECT count(*) FROM runs WHERE run_id = %s AND status = 'CANCELLED'",
                        1, (run,))
        row = self.wait_status("update_ledger", key, ("CONFIRMED", "CANCELLED", "UNKNOWN"))
        self.assertEqual(row["status"], "CONFIRMED", row)
        self.assertEqual(row["attempts"], 2)
        [rec] = self.records("ledger_entries")
        self.assertEqual(row["external_ref"], rec["id"])
        self.assertEqual(len(self.requests(key)), 2)
        got = self.read_until("outcomes", lambda got: any(
            m["data"].get("intent_id") == intent["id"] for m in got))
        self.assertEqual([m["type"] for m in got if m["data"].get("intent_id") == intent["id"]],
                         ["tally.effect.confirmed.v1"])
        self.invariants()

    def test_sigterm_lets_calls_in_flight_finish_and_records_them(self):
        d = self.dispatcher(TALLY_SHUTDOWN_GRACE_MS=10000)
        run = run_id()
        self.fault("slow", collection="holds", times=-1, delay_ms=1500)
        intents = [self.intent(run, i + 1, "create_hold", {"hold_id": f"{run}-{i}"})
                   for i in range(5)]
        self.publish_many(intents)
        self.wait_count("SELECT count(*) FROM effects WHERE status = 'DISPATCHING'", 5)
        self.assertEqual(d.terminate(timeout=30), 0)
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE status = 'CONFIRMED'"),
                         5)
        self.assertIn("drained", d.log())
        self.invariants()


if __name__ == "__main__":
    main()
