"""Everything at once (DESIGN §11): two dispatchers, a reconciler and a compensator work
through a few hundred intents while workers are killed (SIGKILL) and restarted, the
database drops every connection, runs are cancelled or sent to compensation mid-flight, and a quarter
of the keys meet a fault at the tool (refusals, 5xx after applying, hangs past the
timeout, dropped connections, double applies). When it settles, the ledger must agree with
the tool one for one, every obligation must be finished, no reversal may be made twice,
and every event must have left the outbox.

The audit and the orphan sweep (issue 24) run through it all for the tools with a status
endpoint: double applies that answered 201, and 4xx answers to calls that were in fact applied,
are found only by them; when it settles every upstream record of the reversible ones that is not
a CONFIRMED effect's receipt must be reversed, and `tally verify --tools` must find nothing.

The schedule is drawn from a seeded generator: TALLY_CHAOS_SEED picks another one (the
seed is printed, so a failure can be replayed), TALLY_CHAOS_RUNS and TALLY_CHAOS_SECONDS
make it larger."""

import json
import os
import random
import tempfile
import time

from dispatchcase import main
from tallytest import wait_for
from test_compensate_flow import CompensateCase
from test_dispatch_runs import run_message

SEED = int(os.environ.get("TALLY_CHAOS_SEED", "20261126"))
RUNS = int(os.environ.get("TALLY_CHAOS_RUNS", "120"))
CHAOS_S = float(os.environ.get("TALLY_CHAOS_SECONDS", "20"))

TOOLS = [
    ("create_hold", "create_hold:{hold_id}", lambda tag: {"hold_id": tag, "amount": 5}),
    ("charge_card", "charge_card:t1:{payment_id}",
     lambda tag: {"tenant_id": "t1", "payment_id": tag, "amount": 5, "currency": "EUR"}),
    ("update_ledger", "update_ledger:{entry_id}", lambda tag: {"entry_id": tag, "amount": -5}),
    ("send_email", "send_email:{message_id}",
     lambda tag: {"message_id": tag, "to": "a@example.com", "subject": "x"}),
]
# every tool's timeout is 2 s: the hangs outlast it
FAULTS = [("refuse_503", {}), ("fail_after_apply", {}), ("apply_then_hang", {"delay_ms": 3000}),
          ("slow", {"delay_ms": 600}), ("drop_connection", {}), ("apply_twice", {}),
          ("hang_before_apply", {"delay_ms": 3000})]
# audited and swept: the tools with a status endpoint; their reversible ones must end with every
# record that is not a receipt reversed
AUDITED = ("create_hold", "charge_card", "send_email")
REVERSIBLE = ("create_hold", "charge_card")
# what only the audit and the sweep find: a double apply answered 201, an applied call answered
# 4xx (the ledger has it FAILED); only for the reversible tools (send_email's would be findings
# for a human, test_upstream's subject)
AUDITED_FAULTS = [("apply_twice", {"status": 201}), ("fail_after_apply", {"status": 422})]
BUSY_EFFECTS = ("PLANNED", "DISPATCHING", "UNKNOWN")
BUSY_OBLIGATIONS = ("PENDING", "RUNNING")


class ChaosTest(CompensateCase):

    def setUp(self):
        with open(self.tools_file) as f:
            doc = json.load(f)
        for tool in doc["tools"]:
            if tool["name"] in AUDITED:
                path = tool["connector"]["execute"]["path"]
                tool["connector"]["list"] = {"method": "GET", "path": path + "/list"}
                tool["audit"] = {"delay_ms": 500, "rate_per_s": 100, "sweep_ms": 2000,
                                 "lookback_ms": 3600000}
        self.tools_file = os.path.join(tempfile.mkdtemp(prefix="tally-chaos-tools-"),
                                       "tools.json")
        with open(self.tools_file, "w") as f:
            json.dump(doc, f)
        super().setUp()

    def test_the_ledger_agrees_with_the_tool_after_crashes_disconnects_and_faults(self):
        rnd = random.Random(SEED)
        print(f"chaos: seed {SEED}, {RUNS} runs, {CHAOS_S:.0f} s of chaos")
        env = {"TALLY_LEASE_MS": 1000, "TALLY_SHUTDOWN_GRACE_MS": 2000}
        starters = {
            "dispatcher-1": lambda: self.dispatcher(**env),
            "dispatcher-2": lambda: self.dispatcher(**env),
            "reconciler": lambda: self.start(
                "tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url,
                BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                TALLY_SWEEP_MS=200, **env),
            "compensator": lambda: self.compensator(**env),
        }
        workers = {name: start() for name, start in starters.items()}

        intents, runs = [], []
        for i in range(RUNS):
            run = f"chaos-{SEED}-{i}"
            runs.append(run)
            for step in range(1, rnd.randint(2, 5)):
                tool, key, make = rnd.choice(TOOLS)
                args = make(f"{run}-{step}")
                if rnd.random() < 0.25:
                    fault, kw = rnd.choice(FAULTS + (AUDITED_FAULTS if tool in REVERSIBLE
                                                     else []))
                    self.fault(fault, key=key.format(**args), **kw)
                intents.append(self.intent(run, step, tool, args))
        rnd.shuffle(intents)

        story = []
        t0 = time.monotonic()
        sent = 0
        stopped = set()
        while time.monotonic() - t0 < CHAOS_S or sent < len(intents):
            if sent < len(intents):
                self.publish_many(intents[sent:sent + 40])
                sent += 40
            at = f"{time.monotonic() - t0:5.1f} s"
            if time.monotonic() - t0 < CHAOS_S:
                act = rnd.choice(["kill", "kill", "disconnect", "compensate", "cancel",
                                  "nothing"])
                if act == "kill":
                    name = rnd.choice(sorted(workers))
                    workers[name].kill()
                    workers[name] = starters[name]()
                    story.append(f"{at}: SIGKILL {name}, started again")
                elif act == "disconnect":
                    story.append(f"{at}: {self.terminate_backends()} connections terminated")
                elif act == "compensate":
                    run = rnd.choice(runs)
                    if run not in stopped:
                        stopped.add(run)
                        self.publish(run_message(self, "compensate_run", run))
                        story.append(f"{at}: compensate_run {run}")
                elif act == "cancel":
                    run = rnd.choice(runs)
                    if run not in stopped:
                        stopped.add(run)
                        undo = rnd.random() < 0.5
                        self.publish(run_message(self, "cancel_run", run, compensate=undo))
                        story.append(f"{at}: cancel_run {run}, compensate {undo}")
            time.sleep(rnd.uniform(0.5, 2.0))
        told = "\n  ".join([f"seed {SEED}:"] + story)
        print(told)

        def settled():
            effects = dict(self.query("SELECT status, count(*) FROM effects GROUP BY 1"))
            obligations = dict(self.query("SELECT status, count(*) FROM obligations GROUP BY 1"))
            busy = any(s in effects for s in BUSY_EFFECTS) or \
                any(s in obligations for s in BUSY_OBLIGATIONS) or \
                self.scalar("SELECT count(*) FROM audits") > 0
            if busy or sum(effects.values()) < len(intents):
                return None
            return effects, obligations

        def swept_since(at):
            """Every audited tool swept to the end, without an error, by a sweep begun after
            @at."""
            rows = self.query("SELECT tool, swept_at, ended_at, last_error FROM sweep_cursors")
            done = {t for t, began, ended, err in rows
                    if began and began > at and ended and ended >= began and err is None}
            return set(AUDITED) <= done
        try:
            wait_for(settled, timeout=240, interval=1, what="the ledger to settle")
            # the sweeps see every record made so far, and what they file settles too
            at = self.scalar("SELECT now()")
            wait_for(lambda: swept_since(at), timeout=60, interval=1, what="a sweep of each tool")
            time.sleep(2)
            effects, obligations = wait_for(settled, timeout=240, interval=1,
                                            what="the ledger to settle after the sweeps")
        except AssertionError:
            self.fail(f"not settled:\n  {told}\n  effects"
                      f" {self.query('SELECT status, count(*) FROM effects GROUP BY 1')}"
                      f"\n  obligations"
                      f" {self.query('SELECT status, count(*) FROM obligations GROUP BY 1')}")
        print(f"chaos: effects {effects}, obligations {obligations}")
        reasons = dict(self.query("SELECT reason, count(*) FROM obligations GROUP BY 1"))
        audits = dict(self.query("SELECT data->>'found', count(*) FROM events"
                                 " WHERE kind = 'audit' GROUP BY 1"))
        findings = self.scalar("SELECT count(*) FROM findings")
        print(f"chaos: obligations by reason {reasons}, audits {audits}, findings {findings}")
        for name, p in workers.items():
            self.assertTrue(p.alive(), f"{name} exited:\n{p.log()[-5000:]}")
        wait_for(lambda: self.scalar("SELECT (SELECT count(*) FROM message_outbox)"
                                     " + (SELECT count(*) FROM message_refs)") == 0, timeout=60,
                 what="every event to leave the outbox")
        self.assertEqual(self.scalar("SELECT count(*) FROM effects"), len(intents))
        # Double applies upstream may stay (their obligations are compensated or, for tools
        # that cannot be reversed, recorded); every other upstream record is one effect's.
        self.invariants(allow_duplicates=True, obligations_settled=True,
                        reversed_extras=REVERSIBLE)
        self.compensation_invariants()
        # tally verify is an oracle too: the ledger's invariants, and every tool asked about
        # every effect (status and list), find nothing
        out = self.cli("verify", "--tools", "--since", "1h", "--limit", "10000",
                       env=self.env(TALLY_FAKE_TOOL_URL=self.fake_url,
                                    BILLING_HMAC_SECRET="whsec_dispatch_tests"))
        self.assertEqual(out.returncode, 0, f"tally verify --tools:\n{out.stdout}\n{out.stderr}")


if __name__ == "__main__":
    main()
