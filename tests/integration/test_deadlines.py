"""Compensation deadlines (issue 24, DESIGN §12; docs/operations.md "Compensation deadlines"):
an obligation not RESOLVED, SKIPPED, UNCOMPENSATABLE or CANCELLED by its deadline — the earlier
of its creation + its tool's compensation.deadline_ms and its run's deadline (a compensate_run's
data.deadline_ms, `tally compensate --deadline`) — pages whatever state it is in: a warning
once TALLY_DEADLINE_WARN_SHARE of its time has passed, critical at the deadline, each once
(dedup keys deadline-warning:<id> and deadline:<id>), even with two compensators, a killed one
and PostgreSQL connections cut; both pages resolve as soon as the obligation closes, whoever
closes it. An obligation that finishes in time never pages.
"""

import json
import os
import re
import time
import urllib.request
import uuid

import tallytest
from tallytest import wait_for
from test_compensate_flow import CompensateCase, new_run_id

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
CHARGE_RUNBOOK = "https://wiki.example.com/runbooks/refunds"


def compensate_run(case, run, **data):
    d = {"run_id": run, "reason": "the agent gave up"}
    d.update(data)
    return {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/" + case.id(),
            "type": "tally.compensate_run.v1", "datacontenttype": "application/json", "data": d}


class DeadlineTest(CompensateCase):

    def setUp(self):
        super().setUp()
        with open(self.tools_file) as f:
            doc = json.load(f)
        for t in doc["tools"]:
            if t["name"] == "charge_card":
                # waits for an approval that does not come: it cannot finish on its own
                t["compensation"] = {"mode": "approval_required", "runbook": CHARGE_RUNBOOK,
                                     "deadline_ms": 5000}
            elif t["name"] == "create_hold":
                # finishes at once, well within its deadline; keeps retrying a failing reverse
                t["compensation"] = {"mode": "automatic", "deadline_ms": 60000}
                t["retry"] = {"max_attempts": 100, "backoff_ms": 200, "max_backoff_ms": 300}
        self.tools_file = os.path.join(self.tmp, "tools.json")
        with open(self.tools_file, "w") as f:
            json.dump(doc, f)
        self.registry = {t["name"]: t for t in doc["tools"]}

    # --- helpers -------------------------------------------------------------------------

    def alert_rows(self, obligation_id=None):
        rows = self.query(
            "SELECT dedup_key, status, severity, reason, obligation_id::text, run_id,"
            " effect_id::text, summary, runbook, resolve_command FROM alerts"
            + (" WHERE obligation_id = %s" if obligation_id else "") + " ORDER BY created_at",
            (obligation_id,) if obligation_id else None)
        cols = ("dedup_key", "status", "severity", "reason", "obligation_id", "run_id",
                "effect_id", "summary", "runbook", "resolve_command")
        return [dict(zip(cols, r)) for r in rows]

    def wait_alert(self, key, status="TRIGGERED", timeout=30):
        return wait_for(lambda: [a for a in self.alert_rows() if a["dedup_key"] == key
                                 and a["status"] == status],
                        timeout=timeout, what=f"alert {key} {status}")[0]

    @staticmethod
    def events_for(msgs, key, kind):
        return [m for m in msgs if m.get("type") == f"tally.alert.{kind}.v1"
                and m.get("data", {}).get("dedup_key") == key]

    def seconds_after_filing(self, key, oid):
        """How long after its obligation was filed the page was raised (database clock)."""
        return float(self.scalar(
            "SELECT extract(epoch FROM a.created_at - o.created_at) FROM alerts a, obligations o"
            " WHERE a.dedup_key = %s AND o.obligation_id = %s", (key, oid)))

    def gauge(self, proc, name):
        return self.metric_value(self.metrics(proc), name)

    # --- tests ---------------------------------------------------------------------------

    def test_a_tool_deadline_pages_warning_then_critical_once_each_and_resolves_on_close(self):
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1", "payment_id": f"p-{tag}",
                                                   "amount": 700})
        self.add_effect(run_id, 2, "create_hold", {"hold_id": f"h-{tag}", "amount": 700})
        alerts = self.reader("alerts")
        self.compensate(run_id)
        one = self.compensator()
        two = self.compensator()
        charge = self.wait_obligation(run_id, "charge_card", "AWAITING_APPROVAL")
        oid = charge["obligation_id"]
        hold = self.wait_obligation(run_id, "create_hold", "RESOLVED")

        # the warning: at 80 % (TALLY_DEADLINE_WARN_SHARE's default) of its 5 s, not before
        warn_key = f"deadline-warning:{oid}"
        warn = self.wait_alert(warn_key, timeout=20)
        self.assertGreaterEqual(self.seconds_after_filing(warn_key, oid), 4.0)
        self.assertEqual((warn["severity"], warn["reason"], warn["run_id"], warn["obligation_id"]),
                         ("warning", "deadline_near", run_id, oid))
        self.assertIn(run_id, warn["summary"])
        self.assertIn("80% of its time", warn["summary"])
        self.assertIn("AWAITING_APPROVAL", warn["summary"])
        self.assertEqual(warn["runbook"], CHARGE_RUNBOOK)
        # awaiting approval, the operator's move is approve or deny (resolve would be refused)
        self.assertIn(f"tally approve --obligation {oid}", warn["resolve_command"])
        self.assertIn(f"tally deny --obligation {oid}", warn["resolve_command"])

        # the on-call closes the warning by hand: it is never raised again while the obligation
        # stays open
        out = self.cli("resolve", "--alert", warn_key, "--reason", "seen, asking billing")
        self.assertEqual(out.returncode, 0, out.stderr)

        # a compensator killed and every connection to PostgreSQL cut: the critical page still
        # goes out, once
        one.kill()
        self.terminate_backends()
        crit_key = f"deadline:{oid}"
        crit = self.wait_alert(crit_key, timeout=30)
        self.assertGreaterEqual(self.seconds_after_filing(crit_key, oid), 5.0)
        charge_effect = self.scalar("SELECT effect_id::text FROM obligations"
                                    " WHERE obligation_id = %s", (oid,))
        self.assertEqual((crit["severity"], crit["reason"], crit["effect_id"]),
                         ("critical", "deadline_passed", charge_effect))
        self.assertIn("past its deadline", crit["summary"])

        # one trigger per key on the alerts topic, with what a pager needs
        got = self.read_until("alerts", lambda ms: self.events_for(ms, crit_key, "trigger"),
                              reader=alerts)
        time.sleep(1.5)  # a few more sweeps: a second page would come now
        got += self.read_for(alerts, 1.5)
        for key, severity in ((warn_key, "warning"), (crit_key, "critical")):
            trig = self.events_for(got, key, "trigger")
            self.assertEqual(len(trig), 1, trig)
            d = trig[0]["data"]
            self.assertEqual((d["severity"], d["run_id"], d["effect_id"], d["obligation_id"],
                              d["tool"], d["obligation_status"], d["deadline_source"]),
                             (severity, run_id, charge_effect, oid, "charge_card",
                              "AWAITING_APPROVAL", "tool"))
            self.assertRegex(d["deadline"], RFC3339)
            self.assertEqual(d["tool_deadline_ms"], 5000)
            self.assertIsNone(d["run_deadline"])
            self.assertEqual(d["runbook"], CHARGE_RUNBOOK)
            self.assertIn(f"tally deny --obligation {oid}", d["resolve_command"])
        self.assertEqual(self.events_for(got, warn_key, "trigger")[0]["data"]["deadline"],
                         self.events_for(got, crit_key, "trigger")[0]["data"]["deadline"])
        # the deadline is the obligation's filing + 5 s, as the page says
        self.assertEqual(self.scalar(
            "SELECT to_char((created_at + interval '5 seconds') AT TIME ZONE 'UTC',"
            " 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') FROM obligations WHERE obligation_id = %s",
            (oid,)), self.events_for(got, crit_key, "trigger")[0]["data"]["deadline"])
        self.assertEqual(sorted((a["dedup_key"], a["status"]) for a in self.alert_rows(oid)),
                         sorted([(crit_key, "TRIGGERED"), (warn_key, "RESOLVED")]))
        # the hold finished in time: never paged
        self.assertEqual(self.alert_rows(hold["obligation_id"]), [])
        wait_for(lambda: self.gauge(two, "tally_obligations_past_deadline") == 1, timeout=10,
                 what="the past-deadline gauge")
        self.assertEqual(self.gauge(two, "tally_obligations_near_deadline"), 0)

        # the operator decides: nothing is to be undone; the open page resolves, once, and
        # neither is raised again
        out = self.cli("deny", "--obligation", oid, "--reason", "the customer kept the charge",
                       "--actor", "oncall")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.wait_alert(crit_key, "RESOLVED", timeout=10)
        got += self.read_until("alerts", lambda ms: self.events_for(ms, crit_key, "resolve"),
                               reader=alerts)
        time.sleep(1.0)
        got += self.read_for(alerts, 1.5)
        for key in (warn_key, crit_key):
            self.assertEqual(len(self.events_for(got, key, "trigger")), 1, key)
            self.assertEqual(len(self.events_for(got, key, "resolve")), 1, key)
        wait_for(lambda: self.gauge(two, "tally_obligations_past_deadline") == 0, timeout=10,
                 what="the past-deadline gauge back to 0")
        self.assertEqual(self.scalar("SELECT count(*) FROM alerts WHERE status = 'TRIGGERED'"), 0)
        self.assertEqual(two.terminate(), 0)
        self.invariants(obligations_settled=True)

    def test_a_compensate_run_deadline_pages_whatever_the_state_and_the_compensator_closes_it(
            self):
        # create_hold's reverse fails until the fault is lifted; its tool deadline (60 s) is far,
        # the run's (2.5 s) is what pages. TALLY_DEADLINE_WARN_SHARE=1: no warning page.
        self.fault("reverse_500", collection="holds", op="reverse", times=-1)
        run_id = new_run_id()
        self.add_effect(run_id, 1, "create_hold", {"hold_id": uuid.uuid4().hex[:8], "amount": 3})
        alerts = self.reader("alerts")
        dlq = self.reader("dlq")
        disp = self.dispatcher()
        # a deadline out of bounds is refused, and names the field
        bad = compensate_run(self, run_id, deadline_ms=500)
        self.publish(bad)
        refused = self.read_until("dlq", lambda ms: len(ms) >= 1, reader=dlq)
        self.assertEqual([m["data"]["reason"] for m in refused], ["invalid_field"])
        self.assertIn("data.deadline_ms", refused[0]["data"]["detail"])
        self.assertEqual(self.run_row(run_id)["status"], "ACTIVE")  # nothing was done

        self.publish(compensate_run(self, run_id, deadline_ms=2500))
        ob = self.wait_obligation(run_id, "create_hold", ("PENDING", "RUNNING"))
        oid = ob["obligation_id"]
        # the run's deadline is the request's time + 2.5 s (the obligation was filed with it)
        self.assertEqual(self.scalar(
            "SELECT extract(epoch FROM r.compensation_deadline_at - o.created_at)"
            " FROM runs r JOIN obligations o USING (run_id) WHERE o.obligation_id = %s", (oid,)),
            2.5)
        self.assertEqual(self.scalar(
            "SELECT data->>'deadline_ms' FROM events WHERE run_id = %s"
            " AND kind = 'compensate_run'", (run_id,)), "2500")
        comp = self.compensator(TALLY_DEADLINE_WARN_SHARE=1)
        crit_key = f"deadline:{oid}"
        crit = self.wait_alert(crit_key, timeout=30)
        self.assertGreaterEqual(self.seconds_after_filing(crit_key, oid), 2.5)
        self.assertIn(crit["resolve_command"].splitlines()[0],
                      (f"tally doctor --run '{run_id}'  # why the compensator has not finished "
                       "it yet",))
        self.assertIn(f"tally resolve --obligation {oid} --as resolved", crit["resolve_command"])
        self.assertIsNone(crit["runbook"])  # create_hold declares none
        got = self.read_until("alerts", lambda ms: self.events_for(ms, crit_key, "trigger"),
                              reader=alerts)
        d = self.events_for(got, crit_key, "trigger")[0]["data"]
        self.assertEqual((d["deadline_source"], d["tool_deadline_ms"]), ("run", 60000))
        self.assertEqual(d["deadline"], d["run_deadline"])
        self.assertEqual(d["deadline"], self.scalar(
            "SELECT to_char(compensation_deadline_at AT TIME ZONE 'UTC',"
            " 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') FROM runs WHERE run_id = %s", (run_id,)))
        self.assertIn(d["obligation_status"], ("PENDING", "RUNNING"))
        wait_for(lambda: self.gauge(comp, "tally_obligations_past_deadline") == 1, timeout=10,
                 what="the past-deadline gauge")

        # the tool recovers; the compensator's own RESOLVED closes the page
        req = urllib.request.Request(self.fake_url + "/_control/faults", method="DELETE")
        with urllib.request.urlopen(req, timeout=10) as r:
            self.assertEqual(r.status, 200)
        self.wait_obligation(run_id, "create_hold", "RESOLVED")
        self.wait_alert(crit_key, "RESOLVED", timeout=10)
        got = self.read_until("alerts", lambda ms: self.events_for(ms, crit_key, "resolve"),
                              reader=alerts)
        got += self.read_for(alerts, 2.0)
        self.assertEqual(len(self.events_for(got, crit_key, "resolve")), 1)
        self.assertEqual(self.events_for(got, crit_key, "trigger"), [])
        # no warning page was ever raised (share 1)
        self.assertEqual([a["dedup_key"] for a in self.alert_rows(oid)], [crit_key])
        actor = self.scalar("SELECT actor FROM events WHERE kind = 'alert' AND to_status ="
                            " 'RESOLVED' AND data->>'dedup_key' = %s", (crit_key,))
        self.assertRegex(actor, r":\d+$")  # the compensator's worker id, host:pid
        wait_for(lambda: self.gauge(comp, "tally_obligations_past_deadline") == 0, timeout=10,
                 what="the past-deadline gauge back to 0")
        self.wait_run(run_id, "COMPENSATED")
        self.assertEqual(comp.terminate(), 0)
        self.assertEqual(disp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_a_compensation_done_in_time_never_pages(self):
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        self.add_effect(run_id, 1, "check_balance", {"request_id": f"rq-{tag}"})
        self.add_effect(run_id, 2, "create_hold", {"hold_id": f"h-{tag}", "amount": 1})
        comp = self.compensator()
        out = self.cli("compensate", "--run", run_id, "--reason", "undo it", "--deadline", "2s",
                       "--json")
        self.assertEqual(out.returncode, 0, out.stderr)
        res = json.loads(out.stdout)
        self.assertRegex(res["compensation_deadline_at"], RFC3339)
        self.wait_run(run_id, "COMPENSATED")
        # well past the deadline: nothing was paged, nothing is counted
        wait_for(lambda: self.scalar("SELECT now() > compensation_deadline_at + interval"
                                     " '1 second' FROM runs WHERE run_id = %s", (run_id,)),
                 timeout=10, what="the deadline to pass")
        time.sleep(0.6)  # a sweep or two after it
        self.assertEqual(self.alert_rows(), [])
        self.assertEqual(self.gauge(comp, "tally_obligations_past_deadline"), 0)
        self.assertEqual(self.gauge(comp, "tally_obligations_near_deadline"), 0)
        self.assertEqual(comp.terminate(), 0)

        # the text form names the deadline; an earlier one still running is kept, one that has
        # passed is replaced, a shorter one moves it earlier
        other = new_run_id()
        self.add_effect(other, 1, "check_balance", {"request_id": f"rq2-{tag}"})
        out = self.cli("compensate", "--run", other, "--reason", "undo", "--deadline", "1h")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(out.stdout, r"deadline +\d{4}-\d\d-\d\dT")
        out = self.cli("doctor", "--run", other)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertRegex(out.stdout, r"deadline +\d{4}-\d\d-\d\dT")
        first = self.scalar("SELECT compensation_deadline_at FROM runs WHERE run_id = %s",
                            (other,))
        out = self.cli("compensate", "--run", other, "--reason", "again", "--deadline", "2h")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(self.scalar("SELECT compensation_deadline_at FROM runs WHERE run_id = %s",
                                     (other,)), first)
        out = self.cli("compensate", "--run", other, "--reason", "sooner", "--deadline", "600000")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(self.scalar(
            "SELECT compensation_deadline_at < %s FROM runs WHERE run_id = %s", (first, other)),
            True)
        self.assertEqual(self.scalar(
            "SELECT count(*) FROM events WHERE run_id = %s AND kind = 'compensate_run'"
            " AND data ? 'compensation_deadline_at'", (other,)), 3)
        self.query("UPDATE runs SET compensation_deadline_at = now() - interval '1 minute'"
                   " WHERE run_id = %s", (other,))
        out = self.cli("compensate", "--run", other, "--reason", "anew", "--deadline", "1d")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(self.scalar(
            "SELECT compensation_deadline_at - now() > interval '23 hours' FROM runs"
            " WHERE run_id = %s", (other,)), True)

        # what --deadline takes
        for bad, why in (("500ms", "out of range"), ("25d", "out of range"),
                         ("soon", "not a duration"), ("1.5h", "not a duration"),
                         ("-5s", "not a duration")):
            out = self.cli("compensate", "--run", other, "--reason", "x", "--deadline", bad)
            self.assertEqual(out.returncode, 2, (bad, out.stderr))
            self.assertIn(why, out.stderr)
        out = self.cli("cancel", "--run", other, "--reason", "x", "--deadline", "5s")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("--compensate", out.stderr)


if __name__ == "__main__":
    tallytest.main()
