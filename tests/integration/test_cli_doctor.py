"""`tally doctor --run R` and `tally summary --run R` (DESIGN §7, §8): the run's whole
timeline — every event of the events table, in order, transitions with their actor and reason
— then each effect's and obligation's current row; and the compensation summary with its
✓ ⚠ ○ ✗ entries. Scenario runs are made by the real dispatcher, reconciler and compensator."""

import re

from tallytest import wait_for
from test_cli_status import CliCase, main, run_id


class DoctorTest(CliCase):

    def compensator(self):
        return self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                          BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                          TALLY_SWEEP_MS=300)

    def test_doctor_shows_every_event_of_a_scenario_run_in_order(self):
        self.dispatcher()
        self.reconciler()
        run = run_id()
        first = self.confirmed_charge(run, 1)
        # Step 2 times out after the tool applied it: UNKNOWN, then the reconciler confirms.
        key2 = f"charge_card:t1:{run}-p2"
        self.fault("apply_then_hang", key=key2, delay_ms=5000)
        self.charge(run, 2)
        second = self.wait_status("charge_card", key2, "CONFIRMED", timeout=30)["effect_id"]
        # Step 3 goes STUCK and an operator settles it.
        third, record = self.stuck_note(run, 3)
        out = self.tally("resolve", "--effect", third, "--as", "confirmed", "--ref",
                         record["id"], "--reason", "seen upstream", "--actor", "ivy")
        self.assertEqual(out.returncode, 0, out.stderr)

        out = self.tally("doctor", "--run", run)
        self.assertEqual(out.returncode, 0, out.stderr)
        text = out.stdout
        for line in text.splitlines():
            self.assertLessEqual(len(line), 80, line)
        events = self.query(
            "SELECT seq, kind, from_status, to_status, actor, reason FROM events"
            " WHERE run_id = %s ORDER BY seq", (run,))
        self.assertGreater(len(events), 15)
        # Every event, each with its number, in order; every transition with its move and
        # who made it.
        heads = [m for m in re.finditer(r"^#(\d+) \S+ (\S+)", text, re.M)]
        self.assertEqual([int(m.group(1)) for m in heads], [e[0] for e in events])
        for (seq, kind, frm, to, actor, reason), m in zip(events, heads):
            self.assertEqual(m.group(2), kind)
            block = text[m.start():text.find("\n#", m.start() + 1)]
            flat = " ".join(block.split())
            if frm is not None or to is not None:
                self.assertIn(f"{frm or 'new'} → {to or '-'}", flat, block)
            self.assertIn(f"by {actor}", flat, block)
            if reason:
                self.assertIn(" ".join(reason.split())[:60], flat, block)
        transitions = [(f, t) for _, k, f, t, _, _ in events if k == "transition"]
        for move in [(None, "PLANNED"), ("PLANNED", "DISPATCHING"), ("DISPATCHING", "CONFIRMED"),
                     ("DISPATCHING", "UNKNOWN"), ("UNKNOWN", "CONFIRMED"), ("UNKNOWN", "STUCK"),
                     ("STUCK", "CONFIRMED")]:
            self.assertIn(move, transitions)
        self.assertIn("STUCK → CONFIRMED", text)
        self.assertIn("by ivy", text)
        # Then each effect as it is now.
        effects_at = text.index("EFFECTS: 3, in step order")
        for eid in (first, second, third):
            self.assertIn(eid, text[effects_at:])
        self.assertIn(f"external ref   {record['id']}", text)
        self.assertIn("lease          none (epoch", text)
        # --json: the same events, with every column.
        rc, doc = self.tally_json("doctor", "--run", run)
        self.assertEqual(rc, 0)
        self.assertEqual([(e["seq"], e["kind"], e["from_status"], e["to_status"], e["actor"],
                           e["reason"]) for e in doc["events"]], events)
        self.assertEqual([e["effect_id"] for e in doc["effects"]], [first, second, third])
        self.assertEqual(doc["effects"][2]["status"], "CONFIRMED")
        self.assertEqual(doc["run"]["run_id"], run)
        self.assertEqual([a["status"] for a in doc["alerts"]], ["RESOLVED"])
        # No such run.
        out = self.tally("doctor", "--run", "no-such-run")
        self.assertEqual(out.returncode, 1)
        self.assertIn("no run 'no-such-run'", out.stderr)

    def test_doctor_shows_events_of_its_effects_written_for_another_run(self):
        # The timeline is read in three parts, each through its own index (schema 8): the
        # run's events, other runs' events that name its effects, and events that name only
        # its obligations. Each part has an event here that no other part finds.
        self.dispatcher()
        run, other = run_id(), run_id()
        effect = self.confirmed_charge(run, 1)
        args = {"tenant_id": "t1", "payment_id": f"{run}-p1", "amount": 5}
        self.publish(self.intent(other, 1, "charge_card", args))  # a replay, from another run
        self.publish(self.intent(other, 2, "charge_card", dict(args, amount=7)))  # a conflict
        wait_for(lambda: self.scalar("SELECT count(*) FROM events WHERE run_id = %s"
                                     " AND effect_id = %s AND kind IN ('intent', 'conflict')",
                                     (other, effect)) == 2,
                 timeout=30, what="the replay's and the conflict's events")
        oid = self.obligation(effect, "RESOLVED")
        self.audit(None, None, oid, "operator", None, None, "ivy", "checked upstream by hand")

        expected = self.query(
            "SELECT event_id::text, kind, run_id FROM events WHERE run_id = %s"
            " OR effect_id = %s OR obligation_id = %s ORDER BY seq", (run, effect, oid))
        found = {(k, r) for _, k, r in expected}
        self.assertTrue({("intent", other), ("conflict", other), ("operator", None),
                         ("transition", run), ("connector_call", run)} <= found, found)
        rc, doc = self.tally_json("doctor", "--run", run)
        self.assertEqual(rc, 0)
        self.assertEqual([(e["event_id"], e["kind"], e["run_id"]) for e in doc["events"]],
                         [tuple(e) for e in expected])
        out = self.tally("doctor", "--run", run)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("checked upstream by hand", out.stdout)
        # The other run's timeline has the two events under its own id.
        rc, doc = self.tally_json("doctor", "--run", other)
        self.assertEqual(rc, 0)
        self.assertEqual(sorted(e["kind"] for e in doc["events"] if e["effect_id"] == effect),
                         ["conflict", "intent"])

    def test_summary_of_a_settled_run_has_each_kind_of_entry(self):
        self.dispatcher()
        self.compensator()
        run = run_id()
        # Step 1's reverse will be refused (412): STUCK, after the later steps are settled.
        self.fault("reverse_412", collection="charges", op="reverse", times=-1)
        charge = self.confirmed_charge(run, 1)
        intents = [(2, "check_balance", {"request_id": f"{run}-b"}, f"check_balance:{run}-b"),
                   (3, "send_email", {"message_id": f"{run}-m", "to": "ann@example.com"},
                    f"send_email:{run}-m"),
                   (4, "create_hold", {"hold_id": f"{run}-h", "amount": 2},
                    f"create_hold:{run}-h")]
        ids = {1: charge}
        for step, tool, args, key in intents:
            self.publish(self.intent(run, step, tool, args))
            ids[step] = self.wait_status(tool, key, "CONFIRMED", timeout=30)["effect_id"]

        # Before compensation: computed from the ledger.
        rc, doc = self.tally_json("summary", "--run", run)
        self.assertEqual((rc, doc["source"], doc["run_status"]), (0, "ledger", "ACTIVE"))
        # no compensation asked: what is CONFIRMED is done and stands, not in progress
        self.assertEqual((len(doc["done"]), doc["pending"]), (4, []))

        out = self.tally("compensate", "--run", run, "--reason", "roll back")
        self.assertEqual(out.returncode, 0, out.stderr)
        wait_for(lambda: self.scalar("SELECT summary IS NOT NULL AND status = 'STUCK'"
                                     " FROM runs WHERE run_id = %s", (run,)), timeout=40,
                 what="the compensator to settle the run as STUCK")
        rc, doc = self.tally_json("summary", "--run", run)
        self.assertEqual((rc, doc["source"], doc["run_status"]), (0, "compensator", "STUCK"))
        self.assertEqual([e["effect_id"] for e in doc["compensated"]], [ids[4]])
        self.assertIsNotNone(doc["compensated"][0]["reverse_receipt"])
        self.assertEqual([e["effect_id"] for e in doc["uncompensatable"]], [ids[3]])
        self.assertEqual(doc["uncompensatable"][0]["blast_radius"]["target"]["value"],
                         "ann@example.com")
        self.assertEqual([e["effect_id"] for e in doc["skipped"]], [ids[2]])
        [failed] = doc["failed"]
        self.assertEqual((failed["effect_id"], failed["error"]["code"]), (ids[1], "stale_state"))
        self.assertIsNotNone(failed["receipt"])

        out = self.tally("summary", "--run", run)
        self.assertEqual(out.returncode, 0, out.stderr)
        text = out.stdout
        for line in text.splitlines():
            self.assertLessEqual(len(line), 80, line)
        self.assertIn("✓ compensated: 1", text)
        self.assertIn("✓ step 4  create_hold", text)
        self.assertIn("reverse rcpt", text)
        self.assertIn("⚠ uncompensatable: 1", text)
        self.assertIn("⚠ step 3  send_email", text)
        self.assertIn("to = ann@example.com", text)
        self.assertIn("○ skipped: 1", text)
        self.assertIn("○ step 2  check_balance", text)
        self.assertIn("✗ failed / STUCK: action required: 1", text)
        self.assertIn("✗ step 1  charge_card", text)
        self.assertIn("stale_state", text)
        self.assertIn("tally resolve --obligation", text)

        # Settling the STUCK step by hand: the summary is computed again until the compensator
        # writes the new one.
        [(oid,)] = self.query("SELECT obligation_id::text FROM obligations"
                              " WHERE effect_id = %s", (charge,))
        out = self.tally("resolve", "--obligation", oid, "--as", "resolved", "--ref", "re_9",
                         "--reason", "refunded by hand")
        self.assertEqual(out.returncode, 0, out.stderr)
        rc, doc = self.tally_json("summary", "--run", run)
        self.assertEqual(doc["failed"], [])
        self.assertEqual(sorted(e["effect_id"] for e in doc["compensated"]),
                         sorted([ids[1], ids[4]]))
        wait_for(lambda: self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,))
                 == "PARTIALLY_COMPENSATED", timeout=30, what="the run to settle again")

    def test_summary_usage_and_missing_run(self):
        out = self.tally("summary", "--run", "no-such-run")
        self.assertEqual(out.returncode, 1)
        self.assertIn("no run 'no-such-run'", out.stderr)
        self.assertEqual(self.tally("summary").returncode, 2)
        self.assertEqual(self.tally("doctor", "--run").returncode, 2)


if __name__ == "__main__":
    main()
