"""When a compensation cannot finish (DESIGN §6 compensate, §7; issue 5): a reverse that keeps
failing is retried with the same key and then STUCK — one alert on <prefix>alerts and one
PagerDuty Events API v2 trigger, then a resolve when an operator settles it; a 412 is STUCK
stale_state at once, never retried; a 409 is retried; manual_runbook goes STUCK at once and holds
every earlier step; destructive is escalated; approval_required waits for `approve`."""

import json
import os
import time
import uuid

import tallytest
from tallytest import wait_for
from test_compensate_flow import CompensateCase, PagerReceiver, new_run_id

ROUTING_KEY = "R0UT1NGKEY0000000000000000000000"


class CompensateFailureTest(CompensateCase):

    def charge_run(self, with_read=True):
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        steps = []
        if with_read:
            steps.append(self.add_effect(run_id, 1, "check_balance", {"request_id": f"rq-{tag}"}))
        steps.append(self.add_effect(run_id, 2, "charge_card", {"tenant_id": "t9",
                                                                "payment_id": f"p-{tag}",
                                                                "amount": 700}))
        return run_id, steps

    def alerts_for(self, msgs, key):
        return [m for m in msgs if m.get("data", {}).get("dedup_key") == key]

    def test_reverse_failing_forever_goes_stuck_with_one_alert_and_one_page(self):
        pager = PagerReceiver()
        self.addCleanup(pager.close)
        self.fault("reverse_500", collection="charges", op="reverse", times=-1)
        run_id, steps = self.charge_run()
        self.compensate(run_id)
        alerts = self.reader("alerts")
        outcomes = self.reader("outcomes")
        comp = self.compensator(TALLY_PAGER_URL=pager.url, TALLY_PAGER_ROUTING_KEY=ROUTING_KEY)
        ob = self.wait_obligation(run_id, "charge_card", "STUCK")
        run = self.wait_run(run_id, "STUCK")

        # retried up to the tool's max_attempts (5), always with the same reverse key
        reqs = self.fake_requests(op="reverse", collection="charges")
        self.assertEqual(len(reqs), 5)
        self.assertEqual({r["idempotency_key"] for r in reqs}, {f"reverse:{ob['obligation_id']}"})
        self.assertTrue(all(r["status"] == 500 for r in reqs))
        self.assertEqual((ob["error_code"], ob["attempts"]), ("attempts_exhausted", 5))
        self.assertEqual(self.reversals(), [])
        # the earlier read step is held behind the STUCK one
        self.assertEqual(self.obligation_of(run_id, "check_balance")["status"], "PENDING")

        # exactly one alert on the topic, exactly one page
        key = f"obligation:{ob['obligation_id']}"
        got = self.read_until("alerts", lambda ms: self.alerts_for(ms, key), reader=alerts)
        wait_for(lambda: pager.bodies(), timeout=30, what="a PagerDuty event")
        got += self.read_for(alerts, 3.0)  # a second alert would arrive now
        mine = self.alerts_for(got, key)
        self.assertEqual(len(mine), 1, mine)
        a = mine[0]
        self.assertEqual(a["type"], "tally.alert.trigger.v1")
        self.assertEqual((a["data"]["severity"], a["data"]["reason"], a["data"]["run_id"]),
                         ("critical", "attempts_exhausted", run_id))
        self.assertIn("tally resolve --obligation " + ob["obligation_id"],
                      a["data"]["resolve_command"])
        self.assertEqual(a["data"]["runbook"], "https://wiki.example.com/runbooks/refunds")
        pages = pager.bodies()
        self.assertEqual(len(pages), 1, pages)
        p = pages[0]
        self.assertEqual((p["routing_key"], p["event_action"], p["dedup_key"]),
                         (ROUTING_KEY, "trigger", key))
        self.assertEqual(p["payload"]["severity"], "critical")
        self.assertIn(run_id, p["payload"]["summary"])
        self.assertTrue(p["payload"]["source"])
        self.assertEqual(p["payload"]["custom_details"]["obligation_id"], ob["obligation_id"])
        self.assertIn("tally resolve", p["payload"]["custom_details"]["resolve_command"])
        self.assertEqual(p["links"], [{"href": "https://wiki.example.com/runbooks/refunds",
                                       "text": "runbook"}])
        self.assertEqual(pager.events[0]["content_type"], "application/json")
        self.assertEqual(self.scalar("SELECT pager_state FROM alerts WHERE dedup_key = %s",
                                     (key,)), "sent")

        # the run stopped and says what a human must do
        s = run["summary"]
        self.assertEqual(s["counts"]["failed"], 1)
        [stuck] = s["failed"]
        self.assertEqual(stuck["tool"], "charge_card")
        self.assertEqual(stuck["error"]["code"], "attempts_exhausted")
        self.assertEqual(stuck["receipt"]["id"], steps[1]["ref"])
        self.assertIn("tally resolve --obligation", stuck["action_required"])
        # the read held behind it needs nothing from anyone: skipped, not failed
        read = next(f for f in s["skipped"] if f["tool"] == "check_balance")
        self.assertEqual(read["status"], "PENDING")
        self.assertIn("nothing to undo (read)", read["reason"])
        got = self.read_until("outcomes", lambda ms: any(
            m.get("type") == "tally.run.stuck.v1" for m in ms), reader=outcomes)
        got += self.read_for(outcomes, 1.0)
        self.assertEqual(len([m for m in got if m.get("type") == "tally.run.stuck.v1"]), 1)

        # an operator settles it (what `tally resolve --obligation` does): the page resolves
        self.query("UPDATE obligations SET status = 'RESOLVED', status_reason = 'refunded by hand'"
                   " WHERE obligation_id = %s", (ob["obligation_id"],))
        self.assertEqual(self.driver("resolve-alert", key), {"resolved": 1})
        wait_for(lambda: len(pager.bodies()) == 2, timeout=30, what="the PagerDuty resolve")
        r = pager.bodies()[1]
        self.assertEqual((r["event_action"], r["dedup_key"], r["routing_key"]),
                         ("resolve", key, ROUTING_KEY))
        self.assertNotIn("payload", r)
        wait_for(lambda: self.scalar("SELECT pager_state || '/' || pager_last_action FROM alerts"
                                     " WHERE dedup_key = %s", (key,)) == "sent/resolve",
                 timeout=10, what="the resolve recorded as sent")
        # the held step runs now, and the run settles with its new outcome
        run = self.wait_run(run_id, "COMPENSATED")
        self.assertEqual(run["summary"]["counts"]["skipped"], 1)
        metrics = self.metrics(comp)
        self.assertEqual(self.metric_value(metrics, "tally_alerts_sent_total",
                                           channel="pagerduty"), 2)
        self.assertEqual(self.metric_value(metrics, "tally_alerts_sent_total", channel="kafka"), 1)
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)

    def test_pager_outage_never_blocks_compensation(self):
        pager = PagerReceiver(status=503)
        self.addCleanup(pager.close)
        self.fault("reverse_412", collection="charges", op="reverse", times=1)
        stuck_run, _ = self.charge_run(with_read=False)
        self.compensate(stuck_run)
        # a pager URL that carries credentials: they reach the pager, never a log or the ledger
        url = pager.url.replace("http://", "http://ops:pagerpw@") + "?token=PAGERTOKEN&x=1"
        comp = self.compensator(TALLY_PAGER_URL=url, TALLY_PAGER_ROUTING_KEY=ROUTING_KEY)
        ob = self.wait_obligation(stuck_run, "charge_card", "STUCK")
        key = f"obligation:{ob['obligation_id']}"
        wait_for(lambda: len(pager.bodies()) >= 2, timeout=30, what="the pager retrying")
        row = self.query("SELECT pager_state, pager_attempts, pager_last_error FROM alerts"
                         " WHERE dedup_key = %s", (key,))[0]
        self.assertEqual(row[0], "pending")
        self.assertGreaterEqual(row[1], 2)
        self.assertIn("HTTP 503", row[2])
        self.assertIn("ops:***@", row[2])
        self.assertIn("token=***&x=1", row[2])
        shown = self.cli("config", env=self.env(TALLY_PAGER_URL=url)).stdout
        for text in (row[2], comp.log(), shown):
            self.assertNotIn("pagerpw", text)
            self.assertNotIn("PAGERTOKEN", text)
        # meanwhile another run is compensated as if nothing happened
        other = new_run_id()
        self.add_effect(other, 1, "create_hold", {"hold_id": uuid.uuid4().hex[:8], "amount": 1})
        self.compensate(other)
        self.wait_run(other, "COMPENSATED", timeout=20)
        # the pager comes back: the page goes out, once more, and is recorded
        pager.status = 202
        wait_for(lambda: self.scalar("SELECT pager_state FROM alerts WHERE dedup_key = %s",
                                     (key,)) == "sent", timeout=60, what="the page sent")
        bodies = pager.bodies()
        self.assertTrue(all(b["dedup_key"] == key and b["event_action"] == "trigger"
                            for b in bodies))
        n = len(bodies)
        time.sleep(2.0)
        self.assertEqual(len(pager.bodies()), n)  # nothing after the success
        metrics = self.metrics(comp)
        self.assertEqual(self.metric_value(metrics, "tally_alerts_sent_total",
                                           channel="pagerduty"), 1)
        # every failed post is counted as retried (TallyPagerFailing); none was given up
        self.assertEqual(self.metric_value(metrics, "tally_pager_failures_total",
                                           outcome="retry"), n - 1)
        self.assertEqual(self.metric_value(metrics, "tally_pager_failures_total",
                                           outcome="failed"), 0)
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)

    def test_a_page_the_pager_refuses_is_given_up_and_counted(self):
        pager = PagerReceiver(status=400)  # a bad event or key: retrying cannot fix it
        self.addCleanup(pager.close)
        self.fault("reverse_412", collection="charges", op="reverse", times=1)
        stuck_run, _ = self.charge_run(with_read=False)
        comp = self.compensator(TALLY_PAGER_URL=pager.url, TALLY_PAGER_ROUTING_KEY=ROUTING_KEY)
        # both series exist at 0 before anything failed
        before = self.metrics(comp)
        self.assertEqual(self.metric_value(before, "tally_pager_failures_total",
                                           outcome="failed"), 0)
        self.assertEqual(self.metric_value(before, "tally_pager_failures_total",
                                           outcome="retry"), 0)
        self.compensate(stuck_run)
        self.wait_obligation(stuck_run, "charge_card", "STUCK")
        wait_for(lambda: self.metric_value(self.metrics(comp), "tally_pager_failures_total",
                                           outcome="failed") == 1,
                 timeout=30, what="the refused page given up and counted")
        time.sleep(1.0)  # nothing more is posted for it
        self.assertEqual(len(pager.bodies()), 1)
        metrics = self.metrics(comp)
        self.assertEqual(self.metric_value(metrics, "tally_pager_failures_total",
                                           outcome="retry"), 0)
        self.assertEqual(self.metric_value(metrics, "tally_alerts_sent_total",
                                           channel="pagerduty"), 0)
        self.assertIn("failed for good", comp.log())
        self.assertEqual(comp.terminate(), 0)

    def test_reverse_412_is_stuck_stale_state_without_retry(self):
        self.fault("reverse_412", collection="charges", op="reverse", times=1)
        run_id, steps = self.charge_run(with_read=False)
        self.compensate(run_id)
        comp = self.compensator()  # no pager configured
        ob = self.wait_obligation(run_id, "charge_card", "STUCK")
        self.assertEqual(ob["error_code"], "stale_state")
        self.assertIn("stale_state", ob["status_reason"])
        run = self.wait_run(run_id, "STUCK")
        time.sleep(2.0)  # a retry would have happened by now
        reqs = self.fake_requests(op="reverse")
        self.assertEqual(len(reqs), 1)
        self.assertEqual((reqs[0]["status"], reqs[0]["if_match"]), (412, "1"))
        self.assertEqual(self.fake_get("/_control/records?collection=charges")["records"][0]
                         ["status"], "active")
        key = f"obligation:{ob['obligation_id']}"
        self.assertEqual(self.scalar("SELECT reason FROM alerts WHERE dedup_key = %s", (key,)),
                         "stale_state")
        wait_for(lambda: self.scalar("SELECT pager_state FROM alerts WHERE dedup_key = %s",
                                     (key,)) == "not_configured", timeout=10,
                 what="the alert marked not_configured")
        self.assertIn("If-Match", run["summary"]["failed"][0]["action_required"])
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)

    def test_reverse_409_in_progress_is_retried_with_the_same_key(self):
        self.fault("reverse_409", collection="charges", op="reverse", times=2)
        run_id, steps = self.charge_run(with_read=False)
        self.compensate(run_id)
        comp = self.compensator()
        self.wait_run(run_id, "COMPENSATED")
        reqs = self.fake_requests(op="reverse")
        self.assertEqual([r["status"] for r in reqs], [409, 409, 201])
        self.assertEqual(len({r["idempotency_key"] for r in reqs}), 1)
        self.assertEqual(len(self.reversals()), 1)
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_manual_runbook_is_stuck_at_once_and_destructive_is_escalated(self):
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        gone = self.add_effect(run_id, 1, "delete_account", {"account_id": f"acct-{tag}"})
        manual = self.add_effect(run_id, 2, "refund_manual", {"refund_id": f"rf-{tag}"})
        self.compensate(run_id)
        alerts = self.reader("alerts")
        comp = self.compensator()
        ob = self.wait_obligation(run_id, "refund_manual", "STUCK")
        self.assertEqual(ob["error_code"], "manual_runbook")
        self.assertIn("https://wiki.example.com/runbooks/manual-refunds", ob["status_reason"])
        run = self.wait_run(run_id, "STUCK")
        # the destructive step waits behind the STUCK later one: saga order holds
        self.assertEqual(self.obligation_of(run_id, "delete_account")["status"], "PENDING")
        self.assertEqual(self.fake_requests(op="reverse"), [])
        got = self.read_until("alerts", lambda ms: len(ms) >= 1, reader=alerts)
        self.assertEqual([m["data"]["reason"] for m in got], ["manual_runbook"])
        self.assertEqual(got[0]["data"]["runbook"],
                         "https://wiki.example.com/runbooks/manual-refunds")
        self.assertEqual([f["tool"] for f in run["summary"]["failed"]],
                         ["refund_manual", "delete_account"])

        # closing the page of a STUCK item is refused: resolving the item closes it
        refused = self.cli("resolve", "--alert", f"obligation:{ob['obligation_id']}",
                           "--reason", "looked at it")
        self.assertEqual(refused.returncode, 1, refused.stderr)
        self.assertIn("STUCK", refused.stderr)
        self.assertIn(f"--obligation {ob['obligation_id']}", refused.stderr)

        # the human refunded it by hand; the destructive step is now escalated
        self.query("UPDATE obligations SET status = 'RESOLVED' WHERE obligation_id = %s",
                   (ob["obligation_id"],))
        d = self.wait_obligation(run_id, "delete_account", "UNCOMPENSATABLE")
        self.assertEqual(d["blast_radius"]["target"], {"field": "account_id",
                                                       "value": f"acct-{tag}"})
        got = self.read_until("alerts", lambda ms: len(ms) >= 1, reader=alerts)
        esc = got[0]["data"]
        self.assertEqual((esc["reason"], esc["severity"], esc["obligation_id"]),
                         ("destructive", "critical", d["obligation_id"]))
        run = self.wait_run(run_id, "PARTIALLY_COMPENSATED")
        self.assertEqual(run["summary"]["counts"], {"compensated": 1, "uncompensatable": 1,
                                                    "skipped": 0, "failed": 0})
        self.assertEqual(self.fake_requests(op="reverse"), [])

        # the escalation's own command closes the page: the obligation stays UNCOMPENSATABLE
        key = f"obligation:{d['obligation_id']}"
        self.assertIn(f"tally resolve --alert {key}", esc["resolve_command"])
        closed = self.cli("resolve", "--alert", key, "--reason", "account restored from backup",
                          "--actor", "oncall")
        self.assertEqual(closed.returncode, 0, closed.stderr)
        self.assertEqual(self.query("SELECT status FROM alerts WHERE dedup_key = %s", (key,)),
                         [("RESOLVED",)])
        self.assertEqual(self.query("SELECT actor, reason FROM events WHERE kind = 'operator'"
                                    " AND data->>'dedup_key' = %s", (key,)),
                         [("oncall", "account restored from backup")])
        got = self.read_until("alerts", lambda ms: any(
            m["type"] == "tally.alert.resolve.v1" for m in ms), reader=alerts)
        self.assertEqual([m["data"]["dedup_key"] for m in got
                          if m["type"] == "tally.alert.resolve.v1"], [key])
        self.assertEqual(self.obligation_of(run_id, "delete_account")["status"],
                         "UNCOMPENSATABLE")
        again = self.cli("resolve", "--alert", key, "--reason", "twice")
        self.assertEqual(again.returncode, 1, again.stderr)
        self.assertIn("already RESOLVED", again.stderr)
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)

    def test_a_failed_containment_is_recorded_and_never_stuck(self):
        self.fault("error_4xx", collection="emails", op="contain", times=1, status=422)
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        self.add_effect(run_id, 1, "send_email", {"message_id": f"m-{tag}",
                                                  "recipient": f"bob+{tag}@example.com"})
        self.compensate(run_id)
        comp = self.compensator()
        run = self.wait_run(run_id, "PARTIALLY_COMPENSATED")
        ob = self.obligation_of(run_id, "send_email")
        self.assertEqual(ob["status"], "UNCOMPENSATABLE")
        c = ob["blast_radius"]["containment"]
        self.assertEqual((c["status"], c["http_status"], c["code"]), ("failed", 422, "http_422"))
        self.assertEqual(ob["blast_radius"]["target"]["field"], "recipient")
        self.assertEqual(len(self.fake_requests(op="contain")), 1)
        self.assertEqual(self.scalar("SELECT count(*) FROM alerts"), 0)
        self.assertEqual(run["summary"]["uncompensatable"][0]["blast_radius"]["containment"]
                         ["status"], "failed")
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)

    def test_approval_required_waits_for_approve(self):
        with open(self.tools_file) as f:
            doc = json.load(f)
        for t in doc["tools"]:
            if t["name"] == "create_hold":
                t["compensation"] = {"mode": "approval_required"}
        self.tools_file = os.path.join(self.tmp, "tools.json")
        with open(self.tools_file, "w") as f:
            json.dump(doc, f)
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1", "payment_id": f"p-{tag}",
                                                   "amount": 5})
        self.add_effect(run_id, 2, "create_hold", {"hold_id": f"h-{tag}", "amount": 5})
        plan = self.driver("plan", "compensate", run_id)
        self.assertEqual(plan[0]["action"], "await_approval")
        self.compensate(run_id)
        comp = self.compensator()
        ob = self.wait_obligation(run_id, "create_hold", "AWAITING_APPROVAL")
        time.sleep(1.5)
        self.assertEqual(self.fake_requests(op="reverse"), [])
        self.assertEqual(self.obligation_of(run_id, "charge_card")["status"], "PENDING")
        self.assertEqual(self.run_row(run_id)["status"], "COMPENSATING")
        self.assertEqual(self.driver("approve", ob["obligation_id"]), {"changed": 1})
        self.assertEqual(self.driver("approve", ob["obligation_id"]), {"changed": 0})
        self.wait_run(run_id, "COMPENSATED")
        self.assertEqual([r["collection"] for r in self.fake_requests(op="reverse")],
                         ["holds", "charges"])
        self.assertEqual(self.scalar("SELECT approved_by FROM obligations"
                                     " WHERE obligation_id = %s", (ob["obligation_id"],)),
                         "test-driver")
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()


if __name__ == "__main__":
    tallytest.main()
