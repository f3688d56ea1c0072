"""`tally compensate --run R [--dry-run]` and `tally cancel --run R [--compensate]` (DESIGN §7,
§8): the plan step by step (class, compensation mode, what will happen and why), a dry run
that changes nothing at all, and the real thing — obligations last step first, the run's new
status, the operator's audit event — which asked twice creates nothing new. Effects are
dispatched by the real tally-dispatcher against tally-fake-tool."""

import urllib.request

from invariants import check_invariants
from tallytest import wait_for
from test_cli_status import CliCase, main, run_id
from test_reconcile_resolve import canonical


class CompensateTest(CliCase):

    def mixed_run(self):
        """A run with a read (1), a reversible charge (2) and an append-only email (3), all
        CONFIRMED. Returns (run, {step: effect id})."""
        run = run_id()
        ids = {}
        intents = [(1, "check_balance", {"request_id": f"{run}-b"}, f"check_balance:{run}-b"),
                   (2, "charge_card", {"tenant_id": "t1", "payment_id": f"{run}-p2",
                                       "amount": 7}, f"charge_card:t1:{run}-p2"),
                   (3, "send_email", {"message_id": f"{run}-m", "to": "ann@example.com",
                                      "body": "receipt"}, f"send_email:{run}-m")]
        for step, tool, args, key in intents:
            self.publish(self.intent(run, step, tool, args))
            ids[step] = self.wait_status(tool, key, "CONFIRMED", timeout=30)["effect_id"]
        return run, ids

    def compensator(self):
        return self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                          BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                          TALLY_SWEEP_MS=300)

    def duplicated_charge(self, run):
        """A charge applied twice upstream (the reconciler keeps the first record, CONFIRMED,
        and finds the second: DUPLICATE), whose extra copy the compensator has reversed.
        Needs a dispatcher, a reconciler and a compensator. Returns (effect id, kept record,
        extra record)."""
        key = f"charge_card:t1:{run}-p1"
        args = {"tenant_id": "t1", "payment_id": f"{run}-p1", "amount": 5}
        self.fault("apply_twice", key=key)
        req = urllib.request.Request(self.fake_url + "/charges", data=canonical(args).encode(),
                                     headers={"Idempotency-Key": key}, method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            self.assertEqual(r.status, 201)
        self.fault("apply_then_hang", key=key, delay_ms=5000)
        self.publish(self.intent(run, 1, "charge_card", args))
        eid = self.wait_status("charge_card", key, "CONFIRMED", timeout=40)["effect_id"]
        kept, extra = self.records("charges")
        wait_for(lambda: self.query("SELECT external_ref, status FROM obligations"
                                    " WHERE effect_id = %s", (eid,))
                 == [(extra["id"], "RESOLVED")], timeout=40,
                 what="the duplicate's extra copy to be reversed")
        return eid, kept, extra

    def test_dry_run_after_a_duplicate_plans_what_the_compensation_does(self):
        self.dispatcher()
        self.reconciler()
        self.compensator()
        run = run_id()
        eid, kept, extra = self.duplicated_charge(run)
        # The plan: the kept record is reversed; the extra copy's obligation (RESOLVED) is not
        # the one the compensation acts on.
        rc, doc = self.tally_json("compensate", "--run", run, "--dry-run")
        self.assertEqual(rc, 0)
        [step] = doc["plan"]
        self.assertEqual((step["effect_id"], step["external_ref"], step["action"],
                          step["obligation"]), (eid, kept["id"], "reverse", None))
        self.assertEqual([(d["external_ref"], d["status"], d["reason"])
                          for d in step["duplicates"]], [(extra["id"], "RESOLVED", "duplicate")])
        self.assertIn("/charges/reverse", step["will"])
        self.assertNotIn("nothing", step["will"])
        out = self.tally("compensate", "--run", run, "--dry-run")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("step 1  charge_card  CONFIRMED  → reverse", out.stdout)
        self.assertNotIn("already RESOLVED", out.stdout)
        self.assertIn(f"the extra copy {extra['id']} (a DUPLICATE)", " ".join(out.stdout.split()))
        # The summary of the run, never compensated, says what happened: the extra copy was
        # reversed as a duplicate; the kept record stands, done and not compensated.
        rc, doc = self.tally_json("summary", "--run", run)
        self.assertEqual((rc, doc["source"], doc["run_status"]), (0, "ledger", "ACTIVE"))
        self.assertEqual((doc["compensated"], doc["pending"]), ([], []))
        [done] = doc["done"]
        self.assertEqual((done["effect_id"], done["external_ref"], done["status"]),
                         (eid, kept["id"], "CONFIRMED"))
        self.assertIn("not compensated", done["reason"])
        [copy] = doc["duplicates"]
        self.assertEqual((copy["effect_id"], copy["external_ref"], copy["duplicate_copy"]),
                         (eid, extra["id"], True))
        self.assertIn(f"the kept record {kept['id']} still stands", copy["reason"])
        self.assertEqual(doc["effects"], {"total": 1, "settled": 1})
        out = self.tally("summary", "--run", run)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertNotIn("✓ compensated:", out.stdout)
        self.assertIn(f"run {run}: ACTIVE · its 1 effect settled", out.stdout)
        self.assertIn("✓ done and standing: not compensated: 1", out.stdout)
        self.assertIn("step 1  charge_card  extra copy (DUPLICATE)", out.stdout)
        self.assertIn("was reversed", out.stdout)
        for line in out.stdout.splitlines():
            self.assertLessEqual(len(line), 80, line)
        # The real compensation does what the plan said: it reverses the kept record.
        out = self.tally("compensate", "--run", run, "--reason", "roll back")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("1 created", out.stdout)
        wait_for(lambda: self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,))
                 == "COMPENSATED", timeout=40, what="the run to be compensated")
        self.assertEqual({r["id"]: r["status"] for r in self.records("charges")},
                         {kept["id"]: "reversed", extra["id"]: "reversed"})
        self.assertEqual(self.query("SELECT external_ref, reason, status FROM obligations"
                                    " WHERE effect_id = %s ORDER BY created_at", (eid,)),
                         [(extra["id"], "duplicate", "RESOLVED"),
                          (kept["id"], "compensate_run", "RESOLVED")])
        # Its summary, the compensator's: the kept record compensated, the copy apart.
        rc, doc = self.tally_json("summary", "--run", run)
        self.assertEqual((rc, doc["source"]), (0, "compensator"))
        self.assertEqual([e["external_ref"] for e in doc["compensated"]], [kept["id"]])
        self.assertEqual([e["external_ref"] for e in doc["duplicates"]], [extra["id"]])

    def test_dry_run_prints_each_step_and_changes_nothing(self):
        self.dispatcher()
        run, ids = self.mixed_run()
        before = self.snapshot()
        out = self.tally("compensate", "--run", run, "--dry-run")
        self.assertEqual(out.returncode, 0, out.stderr)
        text = out.stdout
        self.assertIn("DRY RUN", text)
        self.assertIn("Nothing was changed", text)
        # Last step first, each with its class, its mode, what will happen and why.
        self.assertLess(text.index("step 3  send_email"), text.index("step 2  charge_card"))
        self.assertLess(text.index("step 2  charge_card"), text.index("step 1  check_balance"))
        self.assertIn("step 3  send_email  CONFIRMED  → contain", text)
        self.assertIn("append_only, compensation automatic", text)
        self.assertIn("step 2  charge_card  CONFIRMED  → reverse", text)
        self.assertIn("reversible, compensation automatic", text)
        self.assertIn("/charges/reverse", text)
        self.assertIn("step 1  check_balance  CONFIRMED  → skip", text)
        self.assertIn("is a read", text)
        for line in text.splitlines():
            self.assertLessEqual(len(line), 80, line)
        rc, doc = self.tally_json("compensate", "--run", run, "--dry-run")
        self.assertEqual((rc, doc["dry_run"], doc["status_before"], doc["status_after"]),
                         (0, True, "ACTIVE", "ACTIVE"))
        self.assertEqual([(p["step"], p["effect_id"], p["action"]) for p in doc["plan"]],
                         [(3, ids[3], "contain"), (2, ids[2], "reverse"), (1, ids[1], "skip")])
        for p in doc["plan"]:
            self.assertTrue(p["will"] and p["why"], p)
        out = self.tally("cancel", "--run", run, "--compensate", "--dry-run")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("cancel and compensate run", out.stdout)
        self.assertUnchanged(before, "compensate --dry-run")

    def test_compensate_creates_one_obligation_per_confirmed_effect_once(self):
        self.dispatcher()
        run, ids = self.mixed_run()
        out = self.tally("compensate", "--run", run, "--reason", "the agent's plan failed",
                         "--actor", "hank")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(f"run {run}: ACTIVE → COMPENSATING, by hank", out.stdout)
        self.assertIn("3 created", out.stdout)
        self.assertIn("→ reverse", out.stdout)                # the plan follows
        rows = self.query("SELECT effect_id::text, reason, status FROM obligations"
                          " WHERE run_id = %s ORDER BY created_at", (run,))
        self.assertEqual(sorted(r[0] for r in rows), sorted(ids.values()))
        self.assertEqual({(r[1], r[2]) for r in rows}, {("compensate_run", "PENDING")})
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "COMPENSATING")
        self.assertEqual(self.query("SELECT from_status, to_status, actor, reason FROM events"
                                    " WHERE run_id = %s AND kind = 'operator'", (run,)),
                         [("ACTIVE", "COMPENSATING", "hank", "the agent's plan failed")])
        msgs = self.read_until("obligations", lambda ms: len(ms) >= 3)
        self.assertEqual(sorted(m["data"]["effect_id"] for m in msgs), sorted(ids.values()))
        # Asking again creates nothing new.
        rc, doc = self.tally_json("compensate", "--run", run, "--reason", "again")
        self.assertEqual((rc, doc["obligations_created"], doc["obligations_existing"]),
                         (0, 0, 3))
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations WHERE run_id = %s",
                                     (run,)), 3)
        check_invariants(self)

    def test_cancel_stops_pending_effects_and_leaves_confirmed_ones(self):
        self.dispatcher()
        run = run_id()
        charge = self.confirmed_charge(run, 1)
        self.publish(self.intent(run, 2, "delete_account", {"account_id": f"{run}-a"}))
        gated = self.wait_status("delete_account", f"delete_account:{run}-a",
                                 "AWAITING_APPROVAL")["effect_id"]
        out = self.tally("cancel", "--run", run, "--reason", "user closed the chat")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("1 effect CANCELLED", out.stdout)
        self.assertEqual(self.query("SELECT effect_id::text, status FROM effects"
                                    " WHERE run_id = %s ORDER BY step", (run,)),
                         [(charge, "CONFIRMED"), (gated, "CANCELLED")])
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "CANCELLED")
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations WHERE run_id = %s",
                                     (run,)), 0)
        # A cancelled effect can no longer be approved.
        approve = self.tally("approve", "--effect", gated, "--reason", "too late")
        self.assertEqual(approve.returncode, 1)
        self.assertIn("is CANCELLED", approve.stderr)
        # --compensate undoes what was done.
        out = self.tally("cancel", "--run", run, "--compensate", "--reason", "undo it too")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(self.query("SELECT effect_id::text, reason FROM obligations"
                                    " WHERE run_id = %s", (run,)), [(charge, "cancel_run")])
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "COMPENSATING")
        check_invariants(self)

    def test_refusals_and_usage_errors(self):
        before = self.snapshot()
        out = self.tally("compensate", "--run", "no-such-run", "--reason", "x")
        self.assertEqual(out.returncode, 1)
        self.assertIn("no run 'no-such-run'", out.stderr)
        out = self.tally("cancel", "--run", "no-such-run", "--dry-run")
        self.assertEqual(out.returncode, 1)
        for args in (("compensate", "--run", "r"),                  # no --reason
                     ("compensate", "--reason", "x"),               # no --run
                     ("compensate", "--run", "r", "--compensate", "--reason", "x"),
                     ("cancel", "--run", "r", "extra", "--reason", "x")):
            out = self.tally(*args)
            self.assertEqual(out.returncode, 2, (args, out.stderr))
        # A dry run explains the plan from the registry, so it needs one that loads.
        out = self.tally("compensate", "--run", "r", "--dry-run",
                         env=self.env(TALLY_TOOLS="/nonexistent/tools.json"))
        self.assertEqual(out.returncode, 1)
        self.assertIn("/nonexistent/tools.json (TALLY_TOOLS) does not load", out.stderr)
        self.assertUnchanged(before, "a refused compensate")


if __name__ == "__main__":
    main()
