"""`tally publish --wait-outcome` waits for the final answer and says in its exit status what it
was (docs/operations.md, "Exit status of `tally publish --wait-outcome`"): 0 CONFIRMED (or the
run's answer COMPLETED / COMPENSATED / CANCELLED), 1 the command failed, 2 usage, 3 FAILED,
4 CONFLICT, 5 REJECTED or CANCELLED, 6 refused (before publishing, or by tally with
tally.intent.rejected.v1), 7 not final at the timeout (or the first answer with --first),
8 no answer at all. Every answer is printed on stdout as it comes, one JSON event a line.

And the operator's view of runs that finish (docs/agent-protocol.md, "Runs that finish"):
`tally status` counts COMPLETED and COMPLETING runs apart from ACTIVE ones, `tally doctor`
shows a completed run's completion summary.

Real tally-dispatcher, tally-reconciler and tally-fake-tool; the command is the real `tally`."""

import json
import subprocess
import time

from tallytest import binary, wait_for
from test_cli_status import CliCase, main, run_id

EXIT = {"ok": 0, "error": 1, "usage": 2, "failed": 3, "conflict": 4, "rejected": 5,
        "refused": 6, "open": 7, "no_answer": 8}


class WaitCase(CliCase):

    def publish_cli(self, *args, wait=30, first=False, env=None):
        """`tally publish ARGS --wait-outcome WAIT [--first]`: (exit code, [answers], stderr,
        seconds it took)."""
        extra = ["--wait-outcome", str(wait)] + (["--first"] if first else [])
        t0 = time.monotonic()
        out = self.tally("publish", *args, *extra, env=env)
        took = time.monotonic() - t0
        return out.returncode, self.answers(out.stdout), out.stderr, took

    def answers(self, stdout):
        got = []
        for line in stdout.splitlines():
            self.assertTrue(line.strip(), f"an empty line on stdout:\n{stdout}")
            got.append(json.loads(line))  # one JSON event a line, nothing else
        return got

    def charge_args(self, run, step=1, amount=5, payment=None):
        pay = payment or f"{run}-p{step}"
        return ["--run", run, "--step", str(step), "--tool", "charge_card", "--args",
                json.dumps({"tenant_id": "t1", "payment_id": pay, "amount": amount})]

    def intent_id(self, stderr):
        """The event id `tally publish` announces on stderr when it waits."""
        for line in stderr.splitlines():
            if line.startswith("tally publish: published event "):
                return line.split()[4]
        raise AssertionError(f"no 'published event' line on stderr:\n{stderr}")


class PublishWaitTest(WaitCase):
    """What needs only the dispatcher and the reconciler as they were before runs completed."""

    def test_confirmed_exits_0_with_the_answer_on_stdout(self):
        self.dispatcher()
        run = run_id()
        rc, got, err, _ = self.publish_cli(*self.charge_args(run))
        self.assertEqual(rc, EXIT["ok"], err)
        [ev] = got
        self.assertEqual((ev["type"], ev["data"]["status"], ev["data"]["intent_id"]),
                         ("tally.effect.confirmed.v1", "CONFIRMED", self.intent_id(err)))
        self.assertEqual(ev["data"]["run_id"], run)
        eff = self.effect("charge_card", f"charge_card:t1:{run}-p1")
        self.assertEqual((eff["status"], eff["effect_id"]), ("CONFIRMED", ev["data"]["effect_id"]))

    def test_failed_exits_3(self):
        self.dispatcher()
        run = run_id()
        self.fault("error_4xx", key=f"charge_card:t1:{run}-p1", status=422)
        rc, got, err, _ = self.publish_cli(*self.charge_args(run))
        self.assertEqual(rc, EXIT["failed"], err)
        self.assertEqual([(e["type"], e["data"]["status"]) for e in got],
                         [("tally.effect.failed.v1", "FAILED")])
        self.assertEqual(got[0]["data"]["error"]["code"], "http_422")
        self.assertIn("FAILED", err)

    def test_conflict_exits_4(self):
        self.dispatcher()
        run = run_id()
        rc, _, err, _ = self.publish_cli(*self.charge_args(run, 1, amount=5))
        self.assertEqual(rc, EXIT["ok"], err)
        # The same payment (the operation key) with another amount: refused, nothing called.
        rc, got, err, _ = self.publish_cli(*self.charge_args(run, 2, amount=9,
                                                             payment=f"{run}-p1"))
        self.assertEqual(rc, EXIT["conflict"], err)
        [ev] = got
        self.assertEqual((ev["type"], ev["data"]["status"], ev["data"]["intent_id"]),
                         ("tally.effect.conflict.v1", "CONFLICT", self.intent_id(err)))
        self.assertEqual(len(self.requests(f"charge_card:t1:{run}-p1")), 1)

    def test_unknown_resolved_by_the_reconciler_is_waited_through_to_confirmed(self):
        self.dispatcher()
        self.reconciler()
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        self.fault("apply_then_hang", key=key, delay_ms=3000)  # applied, the answer times out
        rc, got, err, _ = self.publish_cli(*self.charge_args(run), wait=60)
        self.assertEqual(rc, EXIT["ok"], err)
        types = [e["type"] for e in got]
        self.assertEqual(types[0], "tally.effect.unknown.v1", types)
        self.assertEqual(types[-1], "tally.effect.confirmed.v1", types)
        self.assertEqual({e["data"]["effect_id"] for e in got}, {got[0]["data"]["effect_id"]})
        self.assertIn("UNKNOWN", err)
        self.assertIn("waiting for the final answer", err)
        self.assertEqual(self.effect("charge_card", key)["status"], "CONFIRMED")
        self.assertEqual(len(self.requests(key)), 1)  # confirmed from upstream, not re-sent

    def test_first_returns_the_unknown_with_7(self):
        self.dispatcher()  # no reconciler: the UNKNOWN stays
        run = run_id()
        self.fault("apply_then_hang", key=f"charge_card:t1:{run}-p1", delay_ms=3000)
        rc, got, err, took = self.publish_cli(*self.charge_args(run), wait=60, first=True)
        self.assertEqual(rc, EXIT["open"], err)
        self.assertEqual([(e["type"], e["data"]["status"]) for e in got],
                         [("tally.effect.unknown.v1", "UNKNOWN")])
        self.assertLess(took, 30, "--first returns at the first answer, not at the timeout")
        # Without --first, the same UNKNOWN is still UNKNOWN at the timeout: 7 too.
        self.fault("apply_then_hang", key=f"charge_card:t1:{run}-p2", delay_ms=3000)
        rc, got, err, took = self.publish_cli(*self.charge_args(run, 2), wait=4)
        self.assertEqual(rc, EXIT["open"], err)
        self.assertEqual([e["data"]["status"] for e in got], ["UNKNOWN"])
        self.assertIn("no final answer", err)
        self.assertGreaterEqual(took, 4)

    def test_approval_denied_exits_5_after_printing_awaiting_approval(self):
        self.dispatcher()
        run = run_id()
        p = subprocess.Popen(
            [binary("tally"), "publish", "--run", run, "--step", "1", "--tool", "delete_account",
             "--args", json.dumps({"account_id": f"{run}-a"}), "--wait-outcome", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env())
        try:
            eid = self.wait_status("delete_account", f"delete_account:{run}-a",
                                   "AWAITING_APPROVAL", timeout=30)["effect_id"]
            time.sleep(0.5)
            self.assertIsNone(p.poll(), "publish returned at AWAITING_APPROVAL")
            out = self.tally("deny", "--effect", eid, "--reason", "not this one")
            self.assertEqual(out.returncode, 0, out.stderr)
            stdout, stderr = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        self.assertEqual(p.returncode, EXIT["rejected"], stderr)
        for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:"):
            self.assertNotIn(marker, stderr)
        self.assertEqual([(e["type"], e["data"]["status"]) for e in self.answers(stdout)],
                         [("tally.effect.awaiting_approval.v1", "AWAITING_APPROVAL"),
                          ("tally.effect.rejected.v1", "REJECTED")])

    def test_no_answer_exits_8(self):
        run = run_id()  # no dispatcher: nothing answers
        rc, got, err, took = self.publish_cli(*self.charge_args(run), wait=2)
        self.assertEqual(rc, EXIT["no_answer"], err)
        self.assertEqual(got, [])
        self.assertIn("no answer for event", err)
        self.assertGreaterEqual(took, 2)

    def test_refused_before_publishing_exits_6_and_sends_nothing(self):
        run = run_id()
        rc, got, err, _ = self.publish_cli("--run", run, "--step", "1", "--tool", "charge_card",
                                           "--args", "[1]")
        self.assertEqual(rc, EXIT["refused"], err)
        self.assertEqual(got, [])
        self.assertIn("refused (invalid_field)", err)
        self.assertIn("nothing was published", err)
        self.assertEqual(self.read_intents(), [])

    def test_usage_and_kafka_errors(self):
        out = self.tally("publish", "--first", *self.charge_args(run_id()))
        self.assertEqual(out.returncode, EXIT["usage"], out.stderr)
        self.assertIn("--first applies to --wait-outcome", out.stderr)
        out = self.tally("publish", *self.charge_args(run_id()), "--wait-outcome", "0")
        self.assertEqual(out.returncode, EXIT["usage"], out.stderr)
        out = self.tally("publish", *self.charge_args(run_id()), "--wait-outcome", "5",
                         env=self.env(TALLY_KAFKA_BROKERS="127.0.0.1:1",
                                      TALLY_KAFKA_MESSAGE_TIMEOUT_MS="1500",
                                      TALLY_KAFKA_SOCKET_TIMEOUT_MS="1500"))
        self.assertEqual(out.returncode, EXIT["error"], out.stderr)
        self.assertEqual(out.stdout, "")

    def test_help_documents_the_exit_status(self):
        out = self.tally("publish", "--help")
        self.assertEqual(out.returncode, 0)
        for line in ("0  published", "1  the command failed", "2  usage error", "3  FAILED",
                     "4  CONFLICT", "5  REJECTED", "6  refused", "7  not final",
                     "8  no answer"):
            self.assertIn(line, out.stdout)
        self.assertIn("--first", out.stdout)
        self.assertIn("complete_run", out.stdout)
        for line in out.stdout.splitlines():
            self.assertLessEqual(len(line), 100, line)

    def read_intents(self, settle=1.0):
        got, c = [], self.reader("intents")
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is not None and not m.error():
                got.append(m.value())
        return got


class RunsFinishTest(WaitCase):
    """Needs the engine's side of docs/agent-protocol.md: tally.intent.rejected.v1,
    tally.complete_run.v1 and COMPLETED runs."""

    def test_unknown_tool_is_refused_with_6_at_once(self):
        self.dispatcher()
        run = run_id()
        self.assertEqual(self.publish_cli(*self.charge_args(run))[0], EXIT["ok"])  # warmed up
        rc, got, err, took = self.publish_cli("--run", run, "--step", "2", "--tool", "no_such_tool",
                                              "--args", "{}", wait=30)
        self.assertEqual(rc, EXIT["refused"], err)
        [ev] = got
        self.assertEqual(ev["type"], "tally.intent.rejected.v1")
        self.assertEqual((ev["data"]["intent_id"], ev["data"]["reason"], ev["data"]["status"]),
                         (self.intent_id(err), "unknown_tool", "REJECTED"))
        self.assertIn("unknown_tool", err)
        # The answer comes as soon as the dispatcher reads the intent, not at the timeout.
        self.assertLess(took, 3, f"took {took:.1f}s")

    def test_complete_run_exits_0_and_a_later_intent_is_refused_with_6(self):
        self.dispatcher()
        run = run_id()
        self.assertEqual(self.publish_cli(*self.charge_args(run))[0], EXIT["ok"])
        rc, got, err, _ = self.publish_cli("--type", "complete_run", "--run", run, "--reason",
                                           "task done")
        self.assertEqual(rc, EXIT["ok"], err)
        [ev] = got
        self.assertEqual((ev["type"], ev["data"]["run_id"], ev["data"]["status"]),
                         ("tally.run.completed.v1", run, "COMPLETED"))
        self.assertEqual(ev["data"]["summary"]["total"], 1)
        self.assertEqual(ev["data"]["summary"]["effects"], {"CONFIRMED": 1})
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "COMPLETED")
        # Completing it again answers with its tally.run.completed.v1 again.
        rc, got, err, _ = self.publish_cli("--type", "complete_run", "--run", run)
        self.assertEqual(rc, EXIT["ok"], err)
        self.assertEqual([e["type"] for e in got], ["tally.run.completed.v1"])
        # A new intent for the run is refused: run_not_active.
        rc, got, err, _ = self.publish_cli(*self.charge_args(run, 2))
        self.assertEqual(rc, EXIT["refused"], err)
        [ev] = got
        self.assertEqual((ev["type"], ev["data"]["reason"], ev["data"]["intent_id"]),
                         ("tally.intent.rejected.v1", "run_not_active", self.intent_id(err)))
        self.assertEqual(self.requests(f"charge_card:t1:{run}-p2"), [])

    def test_cancel_run_without_compensation_exits_0_with_the_run_cancelled(self):
        self.dispatcher()
        run = run_id()
        self.assertEqual(self.publish_cli(*self.charge_args(run))[0], EXIT["ok"])
        rc, got, err, _ = self.publish_cli("--type", "cancel_run", "--run", run, "--reason",
                                           "stop")
        self.assertEqual(rc, EXIT["ok"], err)
        self.assertEqual([(e["type"], e["data"]["status"]) for e in got],
                         [("tally.run.cancelled.v1", "CANCELLED")])
        # Completing a cancelled run is refused.
        rc, got, err, _ = self.publish_cli("--type", "complete_run", "--run", run)
        self.assertEqual(rc, EXIT["refused"], err)
        self.assertEqual([(e["type"], e["data"]["reason"]) for e in got],
                         [("tally.intent.rejected.v1", "run_not_active")])

    def test_a_run_with_an_effect_in_flight_is_completing_until_it_settles(self):
        self.dispatcher()  # no reconciler yet: the UNKNOWN stays
        run = run_id()
        key = f"charge_card:t1:{run}-p1"
        self.fault("apply_then_hang", key=key, delay_ms=3000)
        rc, got, err, _ = self.publish_cli(*self.charge_args(run), first=True)
        self.assertEqual((rc, got[0]["data"]["status"]), (EXIT["open"], "UNKNOWN"), err)
        # Completing it waits for the UNKNOWN: no answer within 3 s.
        rc, got, err, _ = self.publish_cli("--type", "complete_run", "--run", run, wait=3)
        self.assertEqual((rc, got), (EXIT["no_answer"], []), err)
        self.assertEqual(self.scalar("SELECT status FROM runs WHERE run_id = %s", (run,)),
                         "COMPLETING")
        rc, doc = self.tally_json("status")
        self.assertEqual((doc["runs"]["completing"], doc["runs"]["active"]), (1, 0))
        self.assertRegex(self.tally("status").stdout, r"RUNS\s+0 active, 1 completing, 0 completed")
        out = self.tally("doctor", "--run", run)
        self.assertIn(f"RUN {run}  COMPLETING", out.stdout)
        self.assertIn("completed once 1 effect in flight (PLANNED, DISPATCHING, UNKNOWN) settles",
                      " ".join(out.stdout.split()))
        # A new intent is refused already.
        rc, got, err, _ = self.publish_cli(*self.charge_args(run, 2))
        self.assertEqual((rc, got[0]["data"]["reason"]), (EXIT["refused"], "run_not_active"), err)
        # The reconciler confirms the charge, and the run completes: waited for, exit 0.
        self.reconciler()
        rc, got, err, _ = self.publish_cli("--type", "complete_run", "--run", run, wait=60)
        self.assertEqual(rc, EXIT["ok"], err)
        self.assertEqual([(e["type"], e["data"]["status"]) for e in got],
                         [("tally.run.completed.v1", "COMPLETED")])
        self.assertEqual(got[0]["data"]["summary"]["effects"], {"CONFIRMED": 1})
        rc, doc = self.tally_json("status")
        self.assertEqual((doc["runs"]["completing"], doc["runs"]["completed"]), (0, 1))

    def test_status_and_doctor_show_completed_runs_apart(self):
        self.dispatcher()
        active, done = run_id(), run_id()
        self.assertEqual(self.publish_cli(*self.charge_args(active))[0], EXIT["ok"])
        self.assertEqual(self.publish_cli(*self.charge_args(done))[0], EXIT["ok"])
        # An effect waiting for a human does not hold completion: it is left open.
        rc, got, err, _ = self.publish_cli(
            "--run", done, "--step", "2", "--tool", "delete_account", "--args",
            json.dumps({"account_id": f"{done}-a"}), first=True)
        self.assertEqual((rc, got[0]["data"]["status"]), (EXIT["open"], "AWAITING_APPROVAL"))
        gated = got[0]["data"]["effect_id"]
        rc, got, err, _ = self.publish_cli("--type", "complete_run", "--run", done)
        self.assertEqual(rc, EXIT["ok"], err)
        self.assertEqual(got[0]["data"]["summary"]["open_count"], 1)

        rc, doc = self.tally_json("status")
        self.assertEqual(rc, 0)
        self.assertEqual(doc["runs"]["active"], 1)
        self.assertEqual(doc["runs"]["completed"], 1)
        self.assertEqual(doc["runs"]["completing"], 0)
        self.assertEqual(doc["runs"]["total"], 2)
        self.assertEqual(doc["counts"]["runs_by_state"], {"ACTIVE": 1, "COMPLETED": 1})
        out = self.tally("status")
        # the active run's one effect is settled: its work is over, though never completed
        self.assertRegex(out.stdout, r"RUNS\s+1 active \(1 with every effect settled, not"
                                     r"\s+completed\),\s+0 completing,\s+1 completed\n")

        out = self.tally("doctor", "--run", done)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn(f"RUN {done}  COMPLETED", out.stdout)
        words = " ".join(out.stdout.split())  # the line may wrap
        self.assertRegex(words, r"completed \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: 2 effects: "
                                r"[^;]*CONFIRMED 1[^;]*; 1 left open")
        self.assertIn("LEFT OPEN AT COMPLETION: 1", out.stdout)
        self.assertRegex(out.stdout, r"2\s+delete_account\s+AWAITING_APPROVAL\s+" + gated)
        for line in out.stdout.splitlines():
            self.assertLessEqual(len(line), 80, line)
        rc, doc = self.tally_json("doctor", "--run", done)
        self.assertEqual(doc["run"]["status"], "COMPLETED")
        self.assertEqual(doc["run"]["summary"]["open"][0]["effect_id"], gated)
        # `tally summary` of a completed run is not misled by the completion summary.
        out = self.tally("summary", "--run", done)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("COMPENSATION SUMMARY", out.stdout)
        self.assertIn("no compensation was asked for this run", out.stdout)
        self.assertNotIn("The run has no effects", out.stdout)
        # An active run has no completion to show.
        out = self.tally("doctor", "--run", active)
        self.assertIn(f"RUN {active}  ACTIVE", out.stdout)
        self.assertNotIn("LEFT OPEN", out.stdout)


if __name__ == "__main__":
    main()
