"""Dispatcher, the forward path: a run across tools, replays, approval gating, conflicts
(issue 3, "Done when")."""

import json

from dispatchcase import SECRET, DispatchCase, main, run_id


class DispatchFlowTest(DispatchCase):

    def test_multi_step_run_confirms_with_the_tools_own_receipts(self):
        d = self.dispatcher()
        run = run_id()
        steps = [
            ("check_balance", {"request_id": f"{run}-bal", "account": "acc_1"}),
            ("create_hold", {"hold_id": f"{run}-hold", "amount": 500}),
            ("charge_card", {"tenant_id": "t1", "payment_id": f"{run}-pay", "amount": 500,
                             "currency": "EUR"}),
            ("update_ledger", {"entry_id": f"{run}-le", "amount": -500}),
            ("send_email", {"message_id": f"{run}-mail", "to": "a@example.com",
                            "subject": "Paid"}),
        ]
        intents = [self.intent(run, i + 1, tool, args) for i, (tool, args) in enumerate(steps)]
        intents[2]["data"]["traceparent"] = \
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        for ce in intents:
            self.publish(ce)
        self.wait_count("SELECT count(*) FROM effects WHERE run_id = %s AND status = 'CONFIRMED'",
                        len(steps), (run,))

        answers = self.outcomes_for([ce["id"] for ce in intents])
        records = {r["id"]: r for r in self.records()}
        for ce, (tool, args) in zip(intents, steps):
            [ev] = answers[ce["id"]]
            self.assertEqual(ev["type"], "tally.effect.confirmed.v1")
            data = ev["data"]
            self.assertEqual(data["run_id"], run)
            self.assertEqual(data["step"], ce["data"]["step"])
            self.assertEqual(data["tool"], tool)
            self.assertEqual(data["status"], "CONFIRMED")
            self.assertIsNone(data["error"])
            self.assertEqual(data["attempts"], 1)
            rec = records[data["external_ref"]]
            # The receipt is the tool's own record; the body it got is the canonical args.
            self.assertEqual(data["receipt"], rec)
            self.assertEqual(rec["body"], args)
            self.assertEqual(rec["effect_id"], data["effect_id"])
            self.assertEqual(rec["run_id"], run)
            row = self.effect(tool, data["operation_key"])
            self.assertEqual(row["receipt"], rec)
            self.assertEqual(row["external_ref"], rec["id"])
        # Headers: the traceparent arrived, and every request carried the operation key.
        reqs = self.requests(op="execute")
        charge = [r for r in reqs if r["collection"] == "charges"]
        self.assertEqual(len(charge), 1)
        self.assertEqual(charge[0]["traceparent"], intents[2]["data"]["traceparent"])
        self.assertEqual(charge[0]["idempotency_key"], f"charge_card:t1:{run}-pay")
        # The audit trail holds the connector exchange, without the secret.
        calls = self.query("SELECT data FROM events WHERE run_id = %s AND kind = 'connector_call'",
                           (run,))
        self.assertEqual(len(calls), len(steps))
        for (data,) in calls:
            self.assertIn(data["status_code"], (200, 201))
            self.assertNotIn("whsec", json.dumps(data))
        # Metrics the on-call engineer looks at.
        status, text = d.http_get("/metrics")
        self.assertEqual(status, 200)
        self.assertIn('tally_connector_calls_total{tool="charge_card",outcome="confirmed"} 1',
                      text)
        self.assertIn("tally_dispatch_seconds_count", text)
        self.invariants()

    def test_signed_tool_requests_carry_a_valid_signature(self):
        # A second fake that checks signatures with the secret the dispatcher signs with.
        self.fake_url = self.start_fake("--secret-env", "BILLING_HMAC_SECRET",
                                        BILLING_HMAC_SECRET=SECRET)
        self.dispatcher()
        run = run_id()
        self.publish(self.intent(run, 1, "charge_card",
                                 {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 1}))
        self.wait_status("charge_card", f"charge_card:t1:{run}-p", "CONFIRMED")
        [req] = self.requests(f"charge_card:t1:{run}-p")
        self.assertTrue(req["signature_ok"])
        self.assertEqual(req["status"], 201)
        self.invariants()

    def test_a_wrong_secret_fails_and_pages_the_owner(self):
        self.fake_url = self.start_fake("--secret-env", "BILLING_HMAC_SECRET",
                                        BILLING_HMAC_SECRET="not-" + SECRET)
        self.dispatcher()
        run = run_id()
        key = f"charge_card:t1:{run}-p"
        self.publish(self.intent(run, 1, "charge_card",
                                 {"tenant_id": "t1", "payment_id": f"{run}-p"}))
        row = self.wait_status("charge_card", key, "FAILED")
        self.assertEqual(row["error_code"], "http_401")
        alert = self.query("SELECT status, reason, effect_id::text FROM alerts"
                           " WHERE dedup_key = 'auth:charge_card'")
        self.assertEqual(alert, [("TRIGGERED", "auth_failed", row["effect_id"])])
        [ev] = self.read_until("alerts", lambda got: len(got) >= 1)
        self.assertEqual(ev["type"], "tally.alert.trigger.v1")
        self.assertEqual(ev["data"]["dedup_key"], "auth:charge_card")
        self.assertEqual(ev["data"]["effect_id"], row["effect_id"])
        self.assertIn("billing", ev["data"]["summary"])
        # the effect is FAILED already: the command closes the page (test_dispatch_faults runs it)
        self.assertTrue(ev["data"]["resolve_command"].startswith(
            "tally resolve --alert auth:charge_card --reason "), ev["data"]["resolve_command"])
        self.invariants()

    def test_same_intent_three_times_is_one_upstream_record(self):
        self.dispatcher()
        run = run_id()
        ce = self.intent(run, 1, "charge_card",
                         {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 10})
        self.publish(ce)
        first = self.wait_status("charge_card", f"charge_card:t1:{run}-p", "CONFIRMED")
        # The agent retries twice with the same intent (a new CloudEvents id each time).
        again = []
        for _ in range(2):
            retry = json.loads(json.dumps(ce))
            retry["id"] = ce["id"][:-4] + "%04d" % len(again)
            again.append(retry)
            self.publish(retry)
        answers = self.outcomes_for([ce["id"]] + [r["id"] for r in again])
        for r in again:
            [ev] = answers[r["id"]]
            self.assertEqual(ev["type"], "tally.effect.confirmed.v1")
            self.assertEqual(ev["data"]["effect_id"], first["effect_id"])
            self.assertEqual(ev["data"]["external_ref"], first["external_ref"])
            self.assertEqual(ev["data"]["receipt"], first["receipt"])
            self.assertTrue(ev["data"]["replay"])
        self.assertEqual(len(self.records("charges")), 1)
        self.assertEqual(len(self.requests(f"charge_card:t1:{run}-p")), 1)
        self.assertEqual(self.scalar("SELECT count(*) FROM effects"), 1)
        self.invariants()

    def test_three_copies_in_one_batch_are_one_effect(self):
        self.dispatcher()
        run = run_id()
        ce = self.intent(run, 1, "update_ledger", {"entry_id": f"{run}-e", "amount": 3})
        copies = []
        for i in range(3):
            c = json.loads(json.dumps(ce))
            c["id"] = f"{ce['id']}-{i}"
            copies.append(c)
        self.publish_many(copies)
        self.wait_status("update_ledger", f"update_ledger:{run}-e", "CONFIRMED")
        answers = self.outcomes_for([c["id"] for c in copies])
        self.assertEqual(len(answers), 3)
        self.assertEqual(len(self.records("ledger_entries")), 1)
        self.assertEqual(self.scalar("SELECT count(*) FROM effects"), 1)
        self.invariants()

    def test_destructive_tool_waits_for_approval_and_is_not_called(self):
        self.dispatcher()
        run = run_id()
        ce = self.publish(self.intent(run, 1, "delete_account", {"account_id": f"{run}-acc"}))
        row = self.wait_status("delete_account", f"delete_account:{run}-acc",
                               "AWAITING_APPROVAL")
        [ev] = self.outcomes_for([ce["id"]])[ce["id"]]
        self.assertEqual(ev["type"], "tally.effect.awaiting_approval.v1")
        self.assertEqual(ev["data"]["effect_id"], row["effect_id"])
        self.assertEqual(self.scalar("SELECT count(*) FROM outbox"), 0)
        # Something else gets through meanwhile, so the dispatcher is demonstrably working.
        self.publish(self.intent(run, 2, "update_ledger", {"entry_id": f"{run}-x"}))
        self.wait_status("update_ledger", f"update_ledger:{run}-x", "CONFIRMED")
        self.assertEqual(self.records("account_deletions"), [])
        self.assertEqual(self.effect("delete_account", f"delete_account:{run}-acc")["status"],
                         "AWAITING_APPROVAL")
        self.invariants()

    def test_same_key_different_args_is_a_conflict_and_not_called(self):
        self.dispatcher()
        run = run_id()
        key = f"charge_card:t1:{run}-p"
        self.publish(self.intent(run, 1, "charge_card",
                                 {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 10}))
        first = self.wait_status("charge_card", key, "CONFIRMED")
        other_run = run_id()
        bad = self.publish(self.intent(other_run, 1, "charge_card",
                                       {"tenant_id": "t1", "payment_id": f"{run}-p",
                                        "amount": 99}))
        # The same step of the first run reused for another key is a conflict too.
        step_reuse = self.publish(self.intent(run, 1, "update_ledger", {"entry_id": f"{run}-z"}))
        answers = self.outcomes_for([bad["id"], step_reuse["id"]])
        [ev] = answers[bad["id"]]
        self.assertEqual(ev["type"], "tally.effect.conflict.v1")
        self.assertEqual(ev["data"]["run_id"], other_run)
        self.assertEqual(ev["data"]["status"], "CONFLICT")
        self.assertEqual(ev["data"]["error"]["code"], "conflict")
        self.assertIn(first["effect_id"], ev["data"]["error"]["message"])
        self.assertEqual(ev["data"]["effect_id"], first["effect_id"])
        [ev2] = answers[step_reuse["id"]]
        self.assertEqual(ev2["data"]["effect_id"], first["effect_id"])
        self.assertEqual(ev2["type"], "tally.effect.conflict.v1")
        self.assertIn(first["effect_id"], ev2["data"]["error"]["message"])
        self.assertEqual(len(self.requests(key)), 1)
        self.assertEqual(self.records("ledger_entries"), [])
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE kind = 'conflict'"), 2)
        self.assertEqual(self.scalar("SELECT count(*) FROM effects"), 1)
        self.invariants()


if __name__ == "__main__":
    main()
