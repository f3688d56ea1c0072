"""The compensator end to end (issue 5, DESIGN §4, §6, §7): a run's confirmed effects are
compensated last step first — reads skipped, reversible tools reversed with their own
idempotency key and If-Match, append-only effects recorded with their blast radius and
contained — and the run's summary says so. Also: compensate asked twice, the --dry-run plan,
cancel, and an effect confirmed after compensation began.

Runs are made of real upstream records: each step is executed against tally-fake-tool first,
and the ledger rows the dispatcher would have written (effect CONFIRMED with the fake's
receipt, its transition events) are inserted. Compensation is asked through
common/src/runops.c (tests/unit/test_compensate_driver.c), the module `tally compensate` and the
dispatcher's tally.compensate_run.v1 share.

CompensateCase is imported by the other test_compensate_*.py modules.
"""

import hashlib
import http.server
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
import uuid

import tallytest
from dispatchcase import SECRET, DispatchCase
from tallytest import BUILD_DIR, wait_for

TERMINAL = ("RESOLVED", "SKIPPED", "UNCOMPENSATABLE", "CANCELLED")


def canonical(args):
    return json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def new_run_id(prefix="run"):
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class PagerReceiver:
    """A local PagerDuty Events API v2 endpoint: records every POST body, answers 202."""

    def __init__(self, status=202):
        self.events = []
        self.status = status
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                with receiver.lock:
                    receiver.events.append({"path": self.path,
                                            "content_type": self.headers.get("Content-Type"),
                                            "body": json.loads(body)})
                    status = receiver.status
                out = json.dumps({"status": "success", "message": "Event processed"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v2/enqueue"

    def bodies(self):
        with self.lock:
            return [e["body"] for e in self.events]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class CompensateCase(DispatchCase):
    """DispatchCase (the fake tool, its records) plus confirmed runs, runops and compensators."""

    def setUp(self):
        super().setUp()
        with open(self.tools_file) as f:
            self.registry = {t["name"]: t for t in json.load(f)["tools"]}

    # --- runs made of real upstream records ---------------------------------------------

    def op_key(self, tool, args):
        fields = self.registry[tool]["operation_key"]
        return ":".join([tool] + [str(args[f]) for f in fields])

    def collection(self, tool):
        return self.registry[tool]["connector"]["execute"]["path"].strip("/")

    def execute_upstream(self, tool, key, body, run_id, effect_id):
        headers = {"Content-Type": "application/json", "Idempotency-Key": key,
                   "Tally-Run-Id": run_id, "Tally-Effect-Id": effect_id}
        req = urllib.request.Request(self.fake_url + "/" + self.collection(tool),
                                     data=body.encode(), method="POST", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            self.assertIn(r.status, (200, 201))
            return json.loads(r.read())

    def add_effect(self, run_id, step, tool, args, status="CONFIRMED", execute=None):
        """One effect as the dispatcher records it. CONFIRMED (and, with execute=True, any
        status) effects are executed against the fake first; their receipt is its record."""
        effect_id = str(uuid.uuid4())
        key = self.op_key(tool, args)
        body = canonical(args)
        if execute is None:
            execute = status == "CONFIRMED"
        receipt = self.execute_upstream(tool, key, body, run_id, effect_id) if execute else None
        cls = self.registry[tool]["effect_class"]
        ref = receipt["id"] if receipt and status == "CONFIRMED" else None
        self.query("INSERT INTO runs (run_id) VALUES (%s) ON CONFLICT DO NOTHING", (run_id,))
        self.query(
            "INSERT INTO effects (effect_id, run_id, step, step_num, tool, effect_class,"
            " operation_key, input_hash, args_canonical, intent_id, status, receipt,"
            " external_ref, attempts, unknown_since, lease_owner, lease_until)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,"
            "  CASE WHEN %s = 'UNKNOWN' THEN now() END,"
            "  CASE WHEN %s = 'DISPATCHING' THEN 'test' END,"
            "  CASE WHEN %s = 'DISPATCHING' THEN now() + interval '1 hour' END)",
            (effect_id, run_id, str(step), step if isinstance(step, int) else None, tool, cls,
             key, hashlib.sha256(body.encode()).hexdigest(), body, str(uuid.uuid4()),
             "DISPATCHING" if status != "PLANNED" else "PLANNED",
             json.dumps(receipt) if status == "CONFIRMED" else None, ref,
             1 if execute else 0, status, "DISPATCHING", "DISPATCHING"))
        path = ["PLANNED"]
        if status != "PLANNED":
            path.append("DISPATCHING")
            if status != "DISPATCHING":
                path.append(status)
        if status not in ("PLANNED", "DISPATCHING"):
            # created as the dispatcher creates it, then moved as it moves it: the ledger
            # refuses a row made in a state it cannot be created in
            self.query("UPDATE effects SET status = %s, lease_owner = NULL, lease_until = NULL"
                       " WHERE effect_id = %s", (status, effect_id))
        prev = None
        for to in path:
            self.query("INSERT INTO events (event_id, run_id, effect_id, kind, from_status,"
                       " to_status, actor, reason) VALUES (%s, %s, %s, 'transition', %s, %s,"
                       " 'test', 'made by the test')",
                       (str(uuid.uuid4()), run_id, effect_id, prev, to))
            prev = to
        if status == "PLANNED":
            self.query("INSERT INTO outbox (effect_id, tool) VALUES (%s, %s)", (effect_id, tool))
        return {"effect_id": effect_id, "key": key, "receipt": receipt, "ref": ref,
                "tool": tool, "step": step, "args": args}

    def confirm_late(self, eff, run_id, from_status="UNKNOWN"):
        """An effect DISPATCHING/UNKNOWN becomes CONFIRMED, as the reconciler (or the
        dispatcher, from DISPATCHING) would do it."""
        receipt = eff["receipt"] or self.execute_upstream(
            eff["tool"], eff["key"], canonical(eff["args"]), run_id, eff["effect_id"])
        self.query("UPDATE effects SET status = 'CONFIRMED', receipt = %s, external_ref = %s,"
                   " lease_owner = NULL, lease_until = NULL, updated_at = now()"
                   " WHERE effect_id = %s",
                   (json.dumps(receipt), receipt["id"], eff["effect_id"]))
        self.query("INSERT INTO events (event_id, run_id, effect_id, kind, from_status,"
                   " to_status, actor) VALUES (%s, %s, %s, 'transition', %s,"
                   " 'CONFIRMED', 'test')", (str(uuid.uuid4()), run_id, eff["effect_id"],
                                             from_status))
        eff["receipt"], eff["ref"] = receipt, receipt["id"]

    def four_step_run(self, run_id=None, n=1):
        """The run of issue 5: check_balance, charge_card, send_email, create_hold."""
        run_id = run_id or new_run_id()
        tag = uuid.uuid4().hex[:8]
        steps = [
            self.add_effect(run_id, 1, "check_balance", {"request_id": f"rq-{tag}",
                                                         "account_id": "acct-7"}),
            self.add_effect(run_id, 2, "charge_card", {"tenant_id": "t1",
                                                       "payment_id": f"pay-{tag}",
                                                       "amount": 1250, "currency": "EUR"}),
            self.add_effect(run_id, 3, "send_email", {"message_id": f"msg-{tag}",
                                                      "to": f"ann+{tag}@example.com",
                                                      "subject": "Your order"}),
            self.add_effect(run_id, 4, "create_hold", {"hold_id": f"hold-{tag}",
                                                       "amount": 1250}),
        ]
        return run_id, steps

    # --- runops (what `tally compensate|cancel|approve` will call) -----------------------

    def driver(self, *args, expect=0):
        path = os.path.join(BUILD_DIR, "tests", "test_compensate_driver")
        env = self.env()
        out = subprocess.run([path, *args], capture_output=True, text=True, env=env, timeout=60)
        self.assertEqual(out.returncode, expect, f"driver {args}: {out.stderr}")
        return json.loads(out.stdout) if out.stdout.strip() else None

    def compensate(self, run_id, reason="the agent gave up"):
        return self.driver("compensate", run_id, "--reason", reason)[0]

    # --- processes ---------------------------------------------------------------------

    def compensator(self, **env):
        base = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
                "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 200, "TALLY_SHUTDOWN_GRACE_MS": 5000}
        base.update(env)
        return self.start("tally-compensator", **base)

    # --- the ledger ----------------------------------------------------------------------

    def obligations(self, run_id):
        rows = self.query(
            "SELECT o.obligation_id::text, e.step, e.tool, o.status, o.status_reason,"
            " o.attempts, o.error_code, o.reverse_receipt, o.blast_radius, o.reason"
            " FROM obligations o JOIN effects e USING (effect_id) WHERE o.run_id = %s"
            " ORDER BY e.step_num DESC NULLS FIRST, e.seq DESC", (run_id,))
        cols = ("obligation_id", "step", "tool", "status", "status_reason", "attempts",
                "error_code", "reverse_receipt", "blast_radius", "reason")
        return [dict(zip(cols, r)) for r in rows]

    def obligation_of(self, run_id, tool):
        return next(o for o in self.obligations(run_id) if o["tool"] == tool)

    def run_row(self, run_id):
        rows = self.query("SELECT status, summary, summary_status FROM runs WHERE run_id = %s",
                          (run_id,))
        return dict(zip(("status", "summary", "summary_status"), rows[0])) if rows else None

    def wait_run(self, run_id, statuses, timeout=60):
        if isinstance(statuses, str):
            statuses = (statuses,)

        def ok():
            r = self.run_row(run_id)
            return r if r and r["status"] in statuses and r["summary"] is not None else None
        return wait_for(ok, timeout=timeout, what=f"run {run_id} to settle as {statuses}")

    def wait_obligation(self, run_id, tool, statuses, timeout=60):
        if isinstance(statuses, str):
            statuses = (statuses,)

        def ok():
            o = [o for o in self.obligations(run_id) if o["tool"] == tool]
            return o[0] if o and o[0]["status"] in statuses else None
        return wait_for(ok, timeout=timeout, what=f"{tool} obligation of {run_id} in {statuses}")

    def fake_requests(self, op=None, collection=None):
        reqs = self.fake_get("/_control/requests")
        reqs = reqs["requests"] if isinstance(reqs, dict) else reqs
        return [r for r in reqs if (op is None or r.get("op") == op)
                and (collection is None or r.get("collection") == collection)]

    def reversals(self):
        return self.fake_get("/_control/records")["reversals"]

    def read_for(self, reader, seconds):
        """Every message a reader gets within @seconds (to prove nothing more arrives)."""
        got = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            m = reader.poll(0.2)
            if m is not None and not m.error():
                got.append(json.loads(m.value()))
        return got

    def metrics(self, proc):
        return proc.http_get("/metrics")[1]

    def metric_value(self, text, name, **labels):
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pat = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
        m = re.search(r"^" + pat + r"$", text, re.M)
        return float(m.group(1)) if m else None

    def compensation_invariants(self):
        """Each reversal upstream is one RESOLVED obligation's (its key is reverse:<id>); no
        obligation reversed twice; every containment names one UNCOMPENSATABLE obligation."""
        problems = []
        recs = self.fake_get("/_control/records")
        by_key = {}
        for rev in recs["reversals"]:
            by_key.setdefault(rev["reverse_key"], []).append(rev)
        for key, revs in by_key.items():
            if len(revs) != 1:
                problems.append(f"{key}: {len(revs)} reversals")
            oid = key.split(":", 1)[1]
            st = self.scalar("SELECT status FROM obligations WHERE obligation_id = %s", (oid,))
            if st != "RESOLVED":
                problems.append(f"reversal {revs[0]['id']} by {key}: obligation is {st}")
        for oid, in self.query("SELECT obligation_id::text FROM obligations o JOIN effects e"
                               " USING (effect_id) WHERE o.status = 'RESOLVED'"
                               " AND e.effect_class = 'reversible'"):
            if f"reverse:{oid}" not in by_key:
                problems.append(f"obligation {oid} is RESOLVED without its reversal upstream")
        for c in recs.get("containments", []):
            oid = c["idempotency_key"].split(":", 1)[1]
            st = self.scalar("SELECT status FROM obligations WHERE obligation_id = %s", (oid,))
            if st != "UNCOMPENSATABLE":
                problems.append(f"containment {c['id']} for obligation {oid} which is {st}")
        if problems:
            self.fail("compensation invariants violated:\n  " + "\n  ".join(problems))


class CompensateFlowTest(CompensateCase):

    def test_run_is_compensated_last_step_first(self):
        run_id, steps = self.four_step_run()
        # The blast radius's time is when the effect was confirmed, from its transition event,
        # not the row's last update: move that away so the two cannot be confused.
        email = steps[2]["effect_id"]
        self.query("UPDATE effects SET updated_at = updated_at + interval '1 hour'"
                   " WHERE effect_id = %s RETURNING 1", (email,))
        confirmed_at = self.scalar(
            "SELECT to_char(max(occurred_at) AT TIME ZONE 'UTC',"
            " 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') FROM events"
            " WHERE effect_id = %s AND to_status = 'CONFIRMED'", (email,))
        res = self.compensate(run_id)
        self.assertEqual((res["found"], res["obligations_created"], res["status_after"]),
                         (True, 4, "COMPENSATING"))
        outcomes = self.reader("outcomes")
        comp = self.compensator()
        run = self.wait_run(run_id, "PARTIALLY_COMPENSATED")

        # the reverses reached the tool in reverse step order, the containment between them
        reqs = [r for r in self.fake_requests() if r["op"] in ("reverse", "contain")]
        self.assertEqual([(r["collection"], r["op"]) for r in reqs],
                         [("holds", "reverse"), ("emails", "contain"), ("charges", "reverse")])
        obs = {o["tool"]: o for o in self.obligations(run_id)}
        for r in reqs:
            tool = {"holds": "create_hold", "emails": "send_email", "charges": "charge_card"}[
                r["collection"]]
            kind = "contain" if r["op"] == "contain" else "reverse"
            self.assertEqual(r["idempotency_key"], f"{kind}:{obs[tool]['obligation_id']}")
            self.assertEqual(r["run_id"], run_id)
            self.assertEqual(r["status"], 201)
        self.assertEqual([r["if_match"] for r in reqs if r["op"] == "reverse"], ["1", "1"])
        revs = {r["reverses"] for r in self.reversals()}
        self.assertEqual(revs, {steps[1]["ref"], steps[3]["ref"]})

        # the ledger: one outcome per class
        self.assertEqual({t: o["status"] for t, o in obs.items()},
                         {"create_hold": "RESOLVED", "send_email": "UNCOMPENSATABLE",
                          "charge_card": "RESOLVED", "check_balance": "SKIPPED"})
        self.assertIn("read_only", obs["check_balance"]["status_reason"])
        self.assertEqual(obs["charge_card"]["reverse_receipt"]["reverses"], steps[1]["ref"])
        br = obs["send_email"]["blast_radius"]
        self.assertEqual(br["target"], {"field": "to", "value": steps[2]["args"]["to"]})
        self.assertEqual(br["receipt"]["id"], steps[2]["ref"])
        self.assertEqual(br["containment"]["status"], "done")
        self.assertEqual(br["time"], confirmed_at)

        # the summary (runs.summary and tally.run.compensated.v1)
        s = run["summary"]
        self.assertEqual(s["counts"], {"compensated": 2, "uncompensatable": 1, "skipped": 1,
                                       "failed": 0})
        self.assertEqual([(c["step"], c["tool"]) for c in s["compensated"]],
                         [(4, "create_hold"), (2, "charge_card")])
        self.assertTrue(all(c["reverse_receipt"]["id"].startswith("rev_")
                            for c in s["compensated"]))
        u = s["uncompensatable"][0]
        self.assertEqual((u["step"], u["tool"]), (3, "send_email"))
        self.assertEqual(u["blast_radius"]["target"]["value"], steps[2]["args"]["to"])
        self.assertRegex(u["blast_radius"]["time"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
        self.assertEqual((s["skipped"][0]["tool"], s["skipped"][0]["effect_id"]),
                         ("check_balance", steps[0]["effect_id"]))
        self.assertEqual(run["summary_status"], "PARTIALLY_COMPENSATED")

        got = self.read_until("outcomes", lambda ms: any(
            m.get("type") == "tally.run.compensated.v1" for m in ms), reader=outcomes)
        ev = [m for m in got if m.get("type") == "tally.run.compensated.v1"]
        self.assertEqual(len(ev), 1)
        self.assertEqual(ev[0]["data"]["status"], "PARTIALLY_COMPENSATED")
        self.assertEqual(ev[0]["data"]["summary"]["counts"], s["counts"])
        self.assertEqual(ev[0]["data"]["run_id"], run_id)
        compensated = [m for m in got if m.get("type") == "tally.effect.compensated.v1"]
        self.assertEqual(sorted(m["data"]["tool"] for m in compensated),
                         ["charge_card", "create_hold"])

        # The terminal states are counted again within 10 s of the live counts moving.
        wait_for(lambda: self.metric_value(self.metrics(comp), "tally_obligations",
                                           state="RESOLVED") == 2,
                 timeout=20, interval=0.5, what="the gauge to count the two RESOLVED")
        metrics = self.metrics(comp)
        self.assertEqual(self.metric_value(metrics, "tally_obligations", state="RESOLVED"), 2)
        self.assertEqual(self.metric_value(metrics, "tally_obligations", state="PENDING"), 0)
        self.assertEqual(self.metric_value(metrics, "tally_stuck_obligations"), 0)
        self.assertEqual(self.metric_value(metrics, "tally_obligation_drain_seconds_count"), 4)
        self.assertIsNotNone(self.metric_value(
            metrics, "tally_reverse_call_seconds_count", tool="charge_card"))

        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_steps_that_are_not_numbers_are_reversed_first_latest_arrival_first(self):
        # A step that is not a number sorts after every numbered step, and such steps among
        # themselves by arrival: here 1, "zeta", 2, "alpha" arrive in that order, so the
        # reverses go alpha, zeta, 2, 1 — not by name, and not with the named steps last.
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        order = [1, "zeta", 2, "alpha"]
        for i, step in enumerate(order):
            self.add_effect(run_id, step, "create_hold", {"hold_id": f"hold-{tag}-{i}",
                                                          "amount": 100 + i})
        res = self.compensate(run_id)
        self.assertEqual(res["obligations_created"], 4)
        comp = self.compensator()
        run = self.wait_run(run_id, "COMPENSATED")

        step_of = {f"reverse:{o['obligation_id']}": o["step"] for o in self.obligations(run_id)}
        reqs = [r for r in self.fake_requests() if r["op"] == "reverse"]
        self.assertEqual([step_of[r["idempotency_key"]] for r in reqs],
                         ["alpha", "zeta", "2", "1"])
        self.assertEqual([c["step"] for c in run["summary"]["compensated"]],
                         ["alpha", "zeta", 2, 1])
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_a_held_reverse_is_in_flight_for_its_tool(self):
        run_id, _ = self.four_step_run()
        # the hold's release (step 4, reversed first) waits 1.2 s, under the 2 s timeout
        self.fault("slow", collection="holds", op="reverse", delay_ms=1200)
        comp = self.compensator()
        self.assert_inflight_settled(comp, "tally_reverse_calls_inflight")
        self.compensate(run_id)
        held = self.wait_tool_inflight(comp, "tally_reverse_calls_inflight", "create_hold", 1)
        self.assertEqual(sum(held.values()), 1, held)
        self.wait_run(run_id, "PARTIALLY_COMPENSATED")
        self.assert_inflight_settled(comp, "tally_reverse_calls_inflight")
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_compensate_asked_twice_creates_no_second_obligation(self):
        run_id, _ = self.four_step_run()
        first = self.compensate(run_id)
        second = self.compensate(run_id, reason="asked again")
        self.assertEqual((first["obligations_created"], first["obligations_existing"]), (4, 0))
        self.assertEqual((second["obligations_created"], second["obligations_existing"]), (0, 4))
        self.assertEqual(second["status_before"], "COMPENSATING")
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations WHERE run_id = %s",
                                     (run_id,)), 4)
        comp = self.compensator()
        self.wait_run(run_id, "PARTIALLY_COMPENSATED")
        # once settled, asking again still creates nothing and runs nothing
        third = self.compensate(run_id, reason="and again")
        self.assertEqual((third["obligations_created"], third["status_after"]),
                         (0, "PARTIALLY_COMPENSATED"))
        time.sleep(1.0)
        self.assertEqual(len(self.fake_requests(op="reverse")), 2)
        self.assertEqual(len(self.reversals()), 2)
        # the wake-ups: one tally.obligation.v1 per obligation, none for the repeats
        msgs = self.read_until("obligations", lambda ms: len(ms) >= 4, timeout=30)
        time.sleep(1.0)
        self.assertEqual(len({m["data"]["obligation_id"] for m in msgs}), 4)
        self.assertEqual({m["data"]["reason"] for m in msgs}, {"compensate_run"})
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_dry_run_plan_changes_nothing(self):
        run_id, steps = self.four_step_run()
        planned = self.add_effect(run_id, 5, "charge_card", {"tenant_id": "t1",
                                                             "payment_id": "later",
                                                             "amount": 1}, status="PLANNED")
        plan = self.driver("plan", "compensate", run_id)
        self.assertEqual([p["step"] for p in plan], [5, 4, 3, 2, 1])
        by_tool = {(p["tool"], p["step"]): p for p in plan}
        self.assertEqual(by_tool[("create_hold", 4)]["action"], "reverse")
        self.assertIn("/holds/reverse", by_tool[("create_hold", 4)]["will"])
        self.assertIn("If-Match: 1", by_tool[("create_hold", 4)]["will"])
        self.assertEqual(by_tool[("send_email", 3)]["action"], "contain")
        self.assertEqual(by_tool[("send_email", 3)]["effect_class"], "append_only")
        self.assertEqual(by_tool[("check_balance", 1)]["action"], "skip")
        self.assertEqual(by_tool[("charge_card", 2)]["compensation_mode"], "automatic")
        self.assertEqual(by_tool[("charge_card", 5)]["action"], "none")
        self.assertEqual(by_tool[("charge_card", 5)]["effect_status"], "PLANNED")
        for p in plan:
            self.assertTrue(p["why"], p)
        cancel_plan = self.driver("plan", "cancel", run_id)
        self.assertEqual({p["action"] for p in cancel_plan}, {"cancel", "keep"})
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations"), 0)
        self.assertEqual(self.run_row(run_id)["status"], "ACTIVE")
        self.assertEqual(self.scalar("SELECT status FROM effects WHERE effect_id = %s",
                                     (planned["effect_id"],)), "PLANNED")
        self.driver("plan", "compensate", "no-such-run", expect=3)

    def test_cancel_run(self):
        run_id, steps = self.four_step_run()
        pending = self.add_effect(run_id, 5, "charge_card", {"tenant_id": "t1",
                                                             "payment_id": "p-later",
                                                             "amount": 3}, status="PLANNED")
        res = self.driver("cancel", run_id, "--reason", "user cancelled")[0]
        self.assertEqual((res["effects_cancelled"], res["obligations_created"],
                          res["status_after"]), (1, 0, "CANCELLED"))
        self.assertEqual(self.scalar("SELECT status FROM effects WHERE effect_id = %s",
                                     (pending["effect_id"],)), "CANCELLED")
        self.assertEqual(self.scalar("SELECT count(*) FROM outbox"), 0)
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations"), 0)
        # a cancelled run compensated after all: its confirmed effects are undone
        res = self.driver("cancel", run_id, "--compensate", "--reason", "undo it too")[0]
        self.assertEqual((res["obligations_created"], res["status_after"]), (4, "COMPENSATING"))
        self.assertEqual({o["reason"] for o in self.obligations(run_id)}, {"cancel_run"})
        comp = self.compensator()
        run = self.wait_run(run_id, "PARTIALLY_COMPENSATED")
        self.assertEqual(run["summary"]["counts"]["compensated"], 2)
        # the cancelled step is listed as skipped, never dispatched
        skipped = {(s["tool"], s["step"]) for s in run["summary"]["skipped"]}
        self.assertIn(("charge_card", 5), skipped)
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_effect_confirmed_after_compensation_began_is_waited_for(self):
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        first = self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1",
                                                           "payment_id": f"a-{tag}",
                                                           "amount": 10})
        later = self.add_effect(run_id, 2, "create_hold", {"hold_id": f"h-{tag}", "amount": 10},
                                status="UNKNOWN", execute=True)
        res = self.compensate(run_id)
        self.assertEqual((res["obligations_created"], res["effects_waiting"]), (1, 1))
        comp = self.compensator()
        # step 1 must wait: step 2 may have happened and is undone first
        time.sleep(2.0)
        self.assertEqual(self.fake_requests(op="reverse"), [])
        self.assertEqual(self.obligation_of(run_id, "charge_card")["status"], "PENDING")
        self.assertEqual(self.run_row(run_id)["status"], "COMPENSATING")
        self.confirm_late(later, run_id)
        run = self.wait_run(run_id, "COMPENSATED")
        reqs = self.fake_requests(op="reverse")
        self.assertEqual([r["collection"] for r in reqs], ["holds", "charges"])
        self.assertEqual(run["summary"]["counts"]["compensated"], 2)
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_effect_confirmed_after_the_run_settled_is_compensated_too(self):
        """compensate_run leaves a PLANNED effect to its dispatcher (cancel_run would cancel
        it), so it can be confirmed after the run settled. Settled runs are not read on every
        sweep (there are as many as runs ever compensated), but on one in 30: the effect gets
        its obligation then, and the run is compensated again."""
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:8]
        self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1", "payment_id": f"s-{tag}",
                                                   "amount": 10})
        later = self.add_effect(run_id, 2, "create_hold", {"hold_id": f"s-{tag}", "amount": 10},
                                status="PLANNED")
        self.assertEqual(self.compensate(run_id)["obligations_created"], 1)
        comp = self.compensator()
        run = self.wait_run(run_id, "COMPENSATED")
        self.assertEqual(run["summary"]["counts"]["compensated"], 1)

        # the dispatcher claims it and its call is answered, after the settlement
        self.query("DELETE FROM outbox WHERE effect_id = %s", (later["effect_id"],))
        self.query("UPDATE effects SET status = 'DISPATCHING', lease_owner = 'test',"
                   " lease_until = now() + interval '1 hour', lease_epoch = lease_epoch + 1,"
                   " attempts = attempts + 1, updated_at = now() WHERE effect_id = %s",
                   (later["effect_id"],))
        self.query("INSERT INTO events (event_id, run_id, effect_id, kind, from_status,"
                   " to_status, actor) VALUES (%s, %s, %s, 'transition', 'PLANNED',"
                   " 'DISPATCHING', 'test')", (str(uuid.uuid4()), run_id, later["effect_id"]))
        self.confirm_late(later, run_id, from_status="DISPATCHING")

        self.wait_obligation(run_id, "create_hold", "RESOLVED", timeout=60)

        def settled_again():
            r = self.run_row(run_id)
            return r["status"] == "COMPENSATED" and r["summary"]["counts"]["compensated"] == 2
        wait_for(settled_again, timeout=60, what=f"run {run_id} to settle again")
        self.assertEqual(self.scalar(
            "SELECT count(*) FROM events WHERE run_id = %s AND kind = 'transition'"
            " AND effect_id IS NULL AND from_status = 'COMPENSATED'"
            " AND to_status = 'COMPENSATING'", (run_id,)), 1)
        self.assertEqual([r["collection"] for r in self.fake_requests(op="reverse")],
                         ["charges", "holds"])
        self.assertEqual(comp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_agent_run_through_the_dispatcher_then_compensate_run(self):
        """The whole path: intents on Kafka -> dispatcher -> tool; tally.compensate_run.v1 on
        the intents topic -> obligations -> the compensator reverses, last step first."""
        run_id = new_run_id("agent")
        tag = uuid.uuid4().hex[:8]
        steps = [(1, "check_balance", {"request_id": f"rq-{tag}", "account_id": "a1"}),
                 (2, "charge_card", {"tenant_id": "t1", "payment_id": f"p-{tag}",
                                     "amount": 500}),
                 (3, "send_email", {"message_id": f"m-{tag}", "to": f"c+{tag}@example.com"}),
                 (4, "create_hold", {"hold_id": f"h-{tag}", "amount": 500})]
        disp = self.dispatcher()
        for step, tool, args in steps:
            self.publish(self.intent(run_id, step, tool, args))
        for step, tool, args in steps:
            self.wait_status(tool, self.op_key(tool, args), "CONFIRMED", timeout=60)
        comp = self.compensator()
        self.publish({"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/agent",
                      "type": "tally.compensate_run.v1", "datacontenttype": "application/json",
                      "data": {"run_id": run_id, "reason": "the agent gave up"}})
        run = self.wait_run(run_id, "PARTIALLY_COMPENSATED", timeout=90)
        self.assertEqual(run["summary"]["counts"], {"compensated": 2, "uncompensatable": 1,
                                                    "skipped": 1, "failed": 0})
        reqs = [r for r in self.fake_requests() if r["op"] in ("reverse", "contain")]
        self.assertEqual([r["collection"] for r in reqs], ["holds", "emails", "charges"])
        self.assertEqual(comp.terminate(), 0)
        self.assertEqual(disp.terminate(), 0)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_tally_compensate_uses_the_same_runops(self):
        """The operator's `tally compensate --run` (cli/cmd_run.c) over runops.h."""
        run_id, _ = self.four_step_run()
        dry = self.cli("compensate", "--run", run_id, "--dry-run", "--json")
        self.assertEqual(dry.returncode, 0, dry.stderr)
        self.assertIn("reverse", dry.stdout)
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations"), 0)
        for reason in ("the agent gave up", "asked again"):
            out = self.cli("compensate", "--run", run_id, "--reason", reason, "--json")
            self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(self.scalar("SELECT count(*) FROM obligations WHERE run_id = %s",
                                     (run_id,)), 4)
        self.assertEqual(self.run_row(run_id)["status"], "COMPENSATING")
        comp = self.compensator()
        run = self.wait_run(run_id, "PARTIALLY_COMPENSATED")
        self.assertEqual(run["summary"]["counts"]["compensated"], 2)
        self.assertEqual(comp.terminate(), 0)
        missing = self.cli("compensate", "--run", "no-such-run", "--reason", "x")
        self.assertEqual(missing.returncode, 1, missing.stderr)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    def test_duplicate_found_by_the_reconciler_is_reversed(self):
        """DESIGN §11: applied twice upstream -> DUPLICATE -> the extra record compensated."""
        run_id = new_run_id()
        args = {"tenant_id": "t1", "payment_id": uuid.uuid4().hex[:10], "amount": 99}
        self.fault("apply_twice", collection="charges", op="execute",
                   key=self.op_key("charge_card", args))
        eff = self.add_effect(run_id, 1, "charge_card", args, status="UNKNOWN", execute=True)
        recon = self.start("tally-reconciler", TALLY_FAKE_TOOL_URL=self.fake_url,
                           BILLING_HMAC_SECRET=SECRET, TALLY_POLL_MS=200, TALLY_SWEEP_MS=200)
        comp = self.compensator()
        ob = wait_for(lambda: next((o for o in self.obligations(run_id)
                                    if o["reason"] == "duplicate"
                                    and o["status"] in TERMINAL + ("STUCK",)), None),
                      timeout=60, what="the duplicate's obligation to finish")
        self.assertEqual(ob["status"], "RESOLVED")
        effect = self.effect("charge_card", eff["key"])
        self.assertEqual(effect["status"], "CONFIRMED")
        recs = self.fake_get("/_control/records?collection=charges")["records"]
        self.assertEqual(len(recs), 2)
        extra = [r for r in recs if r["id"] != effect["external_ref"]]
        self.assertEqual([r["status"] for r in extra], ["reversed"])
        self.assertEqual(next(r for r in recs if r["id"] == effect["external_ref"])["status"],
                         "active")
        self.assertEqual([r["reverses"] for r in self.reversals()], [extra[0]["id"]])
        # a duplicate is not a run compensation: the run carries on
        self.assertEqual(self.run_row(run_id)["status"], "ACTIVE")
        self.assertEqual(comp.terminate(), 0)
        self.assertEqual(recon.terminate(), 0)
        self.invariants(obligations_settled=True, allow_duplicates=True)
        self.compensation_invariants()


if __name__ == "__main__":
    tallytest.main()
