"""Crash points (DESIGN §11): a worker killed by SIGKILL at each step boundary of the dispatch,
relay, reconciliation and compensation paths loses no intent and causes no second external
effect; its leases expire and the right next step happens.

The kill is exact, not timed from outside: a test build has crash points
(common/include/tally/crashpoint.h) and the victim is started with TALLY_CRASH_AT naming one, so
it raises SIGKILL on itself at that very statement. For each point, in a world of its own (its
database, topics and fake tool): start the victim, give it a batch of work, see it die by
SIGKILL, look at the state it left, start fresh copies without the crash point (and the
reconciler where the next step is its job), and check the end state:

- every intent has exactly one effect, and every effect (obligation, run) the state it should;
- the fake tool holds exactly one record per operation key and one reversal (or containment) per
  obligation, and a call whose effect was already applied upstream was never sent again to a
  tool with a status check (only read/idempotent tools may be re-sent, by definition);
- every outcome event committed to message_outbox or, by reference, to message_refs (a trigger
  of this test logs them) reached the outcomes topic, exactly once — or, for the relay point
  only, more than once as the very same message, byte for byte, with the same CloudEvents id;
  the relay point's repeated messages include events the relay built from the ledger
  (message_refs): once from what the dispatcher's statement returned, once from the tables;
- the ledger invariants (invariants.py) hold.
"""

import collections
import json
import os
import signal
import sys
import tempfile
import time
import unittest
import uuid

import tallytest
from dispatchcase import SECRET, run_id
from tallytest import SOURCE_DIR, wait_for
from test_compensate_flow import CompensateCase, new_run_id

TIMEOUT_MS = 1000  # every tool's connector timeout: dispatch leases are 6 s, the others 3 s
LEASE_MS = 1500    # TALLY_LEASE_MS: the floor; each worker leases for timeout + its margin
STATUS_TOOLS = ("charge_card", "create_hold", "send_email")


class Point:
    """One crash point: its name, the worker that dies there, the scenario that reaches it, and
    the workers that take over."""

    def __init__(self, name, victim, scenario, recover):
        self.name, self.victim, self.scenario, self.recover = name, victim, scenario, recover


POINTS = [
    Point("dispatch.after_intake_commit", "dispatcher", "dispatch", ("dispatcher", "reconciler")),
    Point("dispatch.after_claim_commit", "dispatcher", "dispatch", ("dispatcher", "reconciler")),
    Point("dispatch.after_call_answer", "dispatcher", "dispatch", ("dispatcher", "reconciler")),
    Point("dispatch.after_record_commit", "dispatcher", "dispatch", ("dispatcher", "reconciler")),
    Point("relay.after_delivery", "dispatcher", "dispatch", ("dispatcher", "reconciler")),
    Point("reconcile.after_lease_commit", "reconciler", "unknown", ("reconciler",)),
    Point("reconcile.after_status_answer", "reconciler", "unknown", ("reconciler",)),
    Point("compensate.after_lease_commit", "compensator", "compensate", ("compensator",)),
    Point("compensate.after_reverse_answer", "compensator", "compensate", ("compensator",)),
]

# Every row committed to message_outbox or message_refs, kept after the relay deletes it: what
# must be published (a reference with no payload: the relay builds it). SECURITY DEFINER: the
# workers' roles may not write the test's table; the trigger writes it as the superuser that
# made it.
SQL_OUTBOX_LOG = """
CREATE TABLE crash_test_outbox_log (topic text, event_id text, payload text);
CREATE FUNCTION crash_test_log_outbox() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO crash_test_outbox_log VALUES (NEW.topic, NEW.event_id, NEW.payload);
    RETURN NULL;
END $$;
CREATE TRIGGER crash_test_log_outbox AFTER INSERT ON message_outbox
    FOR EACH ROW EXECUTE FUNCTION crash_test_log_outbox();
CREATE FUNCTION crash_test_log_ref() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO crash_test_outbox_log VALUES ('outcomes', NEW.event_id::text, NULL);
    RETURN NULL;
END $$;
CREATE TRIGGER crash_test_log_ref AFTER INSERT ON message_refs
    FOR EACH ROW EXECUTE FUNCTION crash_test_log_ref();
"""

# The messages waiting for the relay, in both tables.
SQL_WAITING = "SELECT (SELECT count(*) FROM message_outbox) + (SELECT count(*) FROM message_refs)"

# What the relay builds a reference's event from, as the event must say it: the transition's
# id, time (RFC 3339, milliseconds), actor and state, and its effect.
SQL_REF_SOURCES = """
SELECT ev.event_id::text, to_char(ev.occurred_at AT TIME ZONE 'UTC',
       'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'), ev.actor, ev.to_status, ev.effect_id::text, ev.kind
FROM crash_test_outbox_log l JOIN events ev ON ev.event_id::text = l.event_id
WHERE l.payload IS NULL
"""


class CrashPointTest(CompensateCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with open(tallytest.binary("tally-dispatcher"), "rb") as f:
            if b"TALLY_CRASH_AT" not in f.read():
                raise unittest.SkipTest("built without crash points (-DTALLY_CRASH_POINTS=OFF)")

    def setUp(self):
        with open(os.path.join(SOURCE_DIR, "examples", "tools", "demo.json")) as f:
            doc = json.load(f)
        for tool in doc["tools"]:
            tool["connector"]["timeout_ms"] = TIMEOUT_MS
        self.tools_file = os.path.join(tempfile.mkdtemp(prefix="tally-crash-tools-"),
                                       "tools.json")
        with open(self.tools_file, "w") as f:
            json.dump(doc, f)
        super().setUp()
        self.query(SQL_OUTBOX_LOG)

    def fresh_world(self):
        """Stop this world's processes and clients; a new database, topics and fake tool."""
        for p in self.procs:
            p.kill()
            p.close()
        for c in self._consumers:
            c.close()
        self.procs, self._consumers = [], []
        self.db.close()
        self.setUp()

    def dump_logs(self):
        for p in self.procs:
            sys.stderr.write(f"\n----- log of {p.name} (pid {p.pid}) -----\n{p.log()[-15000:]}")

    # --- processes -------------------------------------------------------------------------

    def worker(self, kind, crash_at=None):
        env = {"TALLY_FAKE_TOOL_URL": self.fake_url, "BILLING_HMAC_SECRET": SECRET,
               "TALLY_LEASE_MS": LEASE_MS, "TALLY_POLL_MS": 200, "TALLY_SWEEP_MS": 300,
               "TALLY_SHUTDOWN_GRACE_MS": 5000}
        if crash_at:
            env["TALLY_CRASH_AT"] = crash_at
        # a victim may die before it serves /healthz
        return self.start(f"tally-{kind}", wait_ready=not crash_at, **env)

    def wait_killed(self, victim, point):
        wait_for(lambda: not victim.alive(), timeout=60,
                 what=f"{victim.name} to reach {point.name}")
        self.assertEqual(victim.popen.returncode, -signal.SIGKILL, victim.log()[-3000:])
        self.assertIn(f"crash point {point.name} reached (hit 1): raising SIGKILL", victim.log())

    # --- the fake tool and the ledger ------------------------------------------------------

    def calls(self, op):
        """{idempotency key: number of requests} of one op at the fake tool."""
        return collections.Counter(r["idempotency_key"] for r in self.requests(op=op))

    def snapshot(self):
        """What a crash left: effects and obligations by state, upstream records and calls."""
        recs = self.fake_get("/_control/records")
        return {
            "effects": dict(self.query("SELECT status, count(*) FROM effects GROUP BY status")),
            "intents": {r[0] for r in self.query("SELECT intent_id FROM effects")},
            "dispatching": {r[0] for r in self.query("SELECT effect_id::text FROM effects"
                                                     " WHERE status = 'DISPATCHING'")},
            "running": {r[0] for r in self.query("SELECT obligation_id::text FROM obligations"
                                                 " WHERE status = 'RUNNING'")},
            "obligations": dict(self.query("SELECT status, count(*) FROM obligations"
                                           " GROUP BY status")),
            "applied": {r["idempotency_key"] for r in recs["records"]},
            "reversed": {r["reverse_key"]: r["id"] for r in recs["reversals"]},
            "executes": self.calls("execute"),
            "statuses": self.calls("status"),
            "reverses": self.calls("reverse") + self.calls("contain"),
            "answered": {r["idempotency_key"] for r in self.requests(op=None)
                         if r["status"] is not None},
            "unpublished": self.scalar("SELECT count(*) FROM message_outbox"
                                       " WHERE topic = 'outcomes'")
            + self.scalar("SELECT count(*) FROM message_refs"),
        }

    # --- the test --------------------------------------------------------------------------

    def test_sigkill_at_each_crash_point(self):
        for i, point in enumerate(POINTS):
            with self.subTest(point=point.name):
                if i > 0:
                    self.fresh_world()
                started = time.monotonic()
                try:
                    getattr(self, "scenario_" + point.scenario)(point)
                except BaseException:
                    self.dump_logs()
                    raise
                sys.stderr.write(f"\n  {point.name}: {time.monotonic() - started:.1f} s ")

    # --- scenario: intents through the dispatcher (and the relay) --------------------------

    def scenario_dispatch(self, point):
        intents = []
        for r in range(3):
            run = run_id()
            for i, (tool, args) in enumerate([
                    ("charge_card", {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 5}),
                    ("create_hold", {"hold_id": f"{run}-h", "amount": 7}),
                    ("send_email", {"message_id": f"{run}-m", "to": "ann@example.com"}),
                    ("update_ledger", {"entry_id": f"{run}-e", "amount": 9})]):
                intents.append(self.intent(run, i + 1, tool, args))
        keys = {ce["id"]: (ce["data"]["tool"], self.op_key(ce["data"]["tool"], ce["data"]["args"]))
                for ce in intents}
        self.publish_many(intents)
        victim = self.worker("dispatcher", crash_at=point.name)
        self.wait_killed(victim, point)
        # a statement the victim sent before it died (a record's COMMIT, say) still runs on its
        # backend: the snapshot is what the crash left once those backends have ended too
        wait_for(lambda: self.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE 'tally-dispatcher%%'") == 0, timeout=30,
            what="the victim's database sessions to end")
        s = self.snapshot()
        st = s["effects"]
        if point.name == "dispatch.after_intake_commit":
            # the batch is in, claimed with it where its tools had room; nothing sent
            self.assertLessEqual(set(st), {"PLANNED", "DISPATCHING"}, s)
            self.assertEqual(s["executes"], {}, s)
        elif point.name == "dispatch.after_claim_commit":
            self.assertGreater(st.get("DISPATCHING", 0), 0, s)
            self.assertEqual(s["executes"], {}, s)         # claimed, nothing sent
        elif point.name == "dispatch.after_call_answer":
            self.assertGreater(st.get("DISPATCHING", 0), 0, s)
            self.assertNotIn("CONFIRMED", st, s)           # answered, nothing recorded
            self.assertTrue(s["answered"], s)
        elif point.name == "dispatch.after_record_commit":
            self.assertGreater(st.get("CONFIRMED", 0), 0, s)
            self.assertGreater(s["unpublished"], 0, s)     # recorded, not yet published
        else:  # relay.after_delivery: published, their rows not deleted
            self.assertGreater(st.get("CONFIRMED", 0), 0, s)
            self.assertGreater(s["unpublished"], 0, s)

        for kind in point.recover:
            self.worker(kind)
        self.wait_count("SELECT count(*) FROM effects WHERE status = 'CONFIRMED'", len(intents),
                        timeout=60)

        # every intent has exactly one effect, created by it, CONFIRMED with its record
        rows = self.query("SELECT intent_id, tool, operation_key, status FROM effects")
        self.assertEqual(len(rows), len(intents))
        self.assertEqual({r[0]: (r[1], r[2]) for r in rows}, keys)
        self.assert_one_effect_upstream(s, {k for _, k in keys.values()},
                                        {k: t for t, k in keys.values()})
        if point.name in ("dispatch.after_intake_commit", "dispatch.after_claim_commit"):
            self.assertEqual(set(self.calls("execute").values()), {1})   # sent once, ever
        if point.name == "dispatch.after_intake_commit":
            # offsets were never stored: the recorded intents come again (once the group has
            # dropped the dead member), answered as replays of their effects
            def replayed():
                return {m["data"]["intent_id"] for m in self.logged_outcomes()
                        if m["data"].get("replay")}
            wait_for(lambda: replayed() == s["intents"], timeout=30,
                     what="the victim's intents to be answered as replays")
            self.assertEqual(self.scalar("SELECT count(*) FROM effects"), len(intents))
        for eid in s["dispatching"]:
            # the victim's leases expired: UNKNOWN, then the reconciler's verdict
            moves = self.query("SELECT from_status, to_status, reason FROM events"
                               " WHERE effect_id = %s AND kind = 'transition' ORDER BY seq",
                               (eid,))
            self.assertIn("lease expired", dict(((f, t), r) for f, t, r in moves)[
                ("DISPATCHING", "UNKNOWN")])
        self.assert_outcomes_published(duplicates=point.name == "relay.after_delivery")
        self.invariants()

    def assert_one_effect_upstream(self, at_crash, keys, tool_of):
        """One record per key; a call applied before the crash was re-sent only to a tool
        without a status check (read/idempotent, where a retry is safe by definition)."""
        per_key = collections.Counter(r["idempotency_key"] for r in self.records())
        self.assertEqual(dict(per_key), {k: 1 for k in keys})
        executes = self.calls("execute")
        for key in keys:
            if key in at_crash["applied"] and tool_of[key] in STATUS_TOOLS:
                self.assertEqual(executes[key], at_crash["executes"][key],
                                 f"{key} was applied before the crash and sent again")
            self.assertLessEqual(executes[key], 2, key)

    # --- scenario: UNKNOWN effects for the reconciler --------------------------------------

    def scenario_unknown(self, point):
        self.worker("dispatcher")
        run = run_id()
        intents, keys, applied = [], {}, set()
        for i in range(8):
            tool = STATUS_TOOLS[i % 3]
            args = {"charge_card": {"tenant_id": "t1", "payment_id": f"{run}-{i}", "amount": i},
                    "create_hold": {"hold_id": f"{run}-{i}", "amount": i},
                    "send_email": {"message_id": f"{run}-{i}", "to": "bob@example.com"}}[tool]
            key = self.op_key(tool, args)
            # timed out after the tool applied it, or before (then nothing happened upstream)
            fault = "apply_then_hang" if i % 2 == 0 else "hang_before_apply"
            self.fault(fault, key=key, delay_ms=TIMEOUT_MS + 1500)
            if fault == "apply_then_hang":
                applied.add(key)
            keys[key] = tool
            intents.append(self.intent(run, i + 1, tool, args))
        self.publish_many(intents)
        self.wait_count("SELECT count(*) FROM effects WHERE status = 'UNKNOWN'", len(intents),
                        timeout=60)
        # the UNKNOWN outcomes are out, so the victim's relay has nothing in flight when it dies
        self.wait_count(SQL_WAITING, 0)

        victim = self.worker("reconciler", crash_at=point.name)
        self.wait_killed(victim, point)
        s = self.snapshot()
        self.assertEqual(s["effects"], {"UNKNOWN": len(intents)}, s)   # nothing recorded
        self.assertGreater(self.scalar("SELECT count(*) FROM effects WHERE lease_owner IS NOT NULL"
                                      " AND lease_until > now()"), 0)
        if point.name == "reconcile.after_lease_commit":
            self.assertEqual(s["statuses"], {}, s)                      # leased, nothing asked
        else:
            self.assertTrue(set(s["statuses"]) & s["answered"], s)     # an answer arrived

        self.worker("reconciler")
        self.wait_count("SELECT count(*) FROM effects WHERE status = 'CONFIRMED'", len(intents),
                        timeout=60)
        self.assertEqual(s["applied"], applied)
        self.assert_one_effect_upstream(s, set(keys), keys)
        executes = self.calls("execute")
        for key in keys:  # applied: confirmed by its status; not applied: re-sent once
            self.assertEqual(executes[key], 1 if key in applied else 2, key)
        self.assert_outcomes_published(duplicates=False)
        self.invariants()

    # --- scenario: runs to compensate ------------------------------------------------------

    def scenario_compensate(self, point):
        runs = []
        for _ in range(4):
            run, tag = new_run_id(), uuid.uuid4().hex[:8]
            self.add_effect(run, 1, "check_balance", {"request_id": f"rq-{tag}",
                                                      "account_id": "acct-1"})
            self.add_effect(run, 2, "send_email", {"message_id": f"m-{tag}",
                                                   "to": f"ann+{tag}@example.com"})
            self.add_effect(run, 3, "charge_card", {"tenant_id": "t1", "payment_id": f"p-{tag}",
                                                    "amount": 1250})
            self.add_effect(run, 4, "create_hold", {"hold_id": f"h-{tag}", "amount": 1250})
            self.assertEqual(self.compensate(run)["obligations_created"], 4)
            runs.append(run)

        victim = self.worker("compensator", crash_at=point.name)
        self.wait_killed(victim, point)
        s = self.snapshot()
        self.assertGreater(s["obligations"].get("RUNNING", 0), 0, s)
        self.assertEqual(set(s["obligations"]) - {"RUNNING", "PENDING"}, set(), s)  # none recorded
        if point.name == "compensate.after_lease_commit":
            self.assertEqual(s["reverses"], {}, s)                      # leased, nothing called
        else:
            self.assertTrue(s["reversed"], s)                           # reversed upstream

        self.worker("compensator")
        for run in runs:
            self.wait_run(run, "PARTIALLY_COMPENSATED", timeout=60)
        obs = self.query("SELECT obligation_id::text, e.tool, o.status, o.reverse_receipt"
                         " FROM obligations o JOIN effects e USING (effect_id)")
        self.assertEqual(len(obs), 16)
        want = {"check_balance": "SKIPPED", "send_email": "UNCOMPENSATABLE",
                "charge_card": "RESOLVED", "create_hold": "RESOLVED"}
        reverses = self.calls("reverse") + self.calls("contain")
        recs = self.fake_get("/_control/records")
        reversed_by = {r["reverse_key"]: r for r in recs["reversals"]}
        contained = collections.Counter(c["idempotency_key"] for c in recs["containments"])
        for oid, tool, status, receipt in obs:
            self.assertEqual(status, want[tool], (oid, tool))
            if tool in ("charge_card", "create_hold"):
                key = f"reverse:{oid}"
                # one reversal, the one the receipt names; a reverse applied before the crash
                # was repeated with the same key and answered with that same reversal
                self.assertEqual(receipt["id"], reversed_by[key]["id"])
                if key in s["reversed"]:
                    self.assertEqual(receipt["id"], s["reversed"][key])
                self.assertLessEqual(reverses[key], 2)
                if point.name == "compensate.after_lease_commit":
                    self.assertEqual(reverses[key], 1)
            elif tool == "send_email":
                self.assertEqual(contained[f"contain:{oid}"], 1)
        self.assertEqual(len(recs["reversals"]), 8)
        for oid in s["running"]:  # the victim's leases expired and were taken over
            leases = [r[0] for r in self.query(
                "SELECT reason FROM events WHERE obligation_id = %s AND kind = 'lease'"
                " ORDER BY seq", (oid,))]
            self.assertEqual(leases, ["leased", "expired lease taken over"], oid)
        self.assert_outcomes_published(duplicates=False)
        self.invariants(obligations_settled=True)
        self.compensation_invariants()

    # --- outcomes --------------------------------------------------------------------------

    def logged_outcomes(self):
        """Every outcome event committed to message_outbox so far (CloudEvents, as dicts)."""
        return [json.loads(p) for p, in self.query(
            "SELECT payload FROM crash_test_outbox_log WHERE topic = 'outcomes'"
            " AND payload IS NOT NULL")]

    def logged_refs(self):
        """{event id: (time, actor, state, effect id, kind)} of every reference committed to
        message_refs so far: the audit event each names."""
        return {r[0]: tuple(r[1:]) for r in self.query(SQL_REF_SOURCES)}

    def read_raw(self, reader, ids, timeout):
        """The outcomes topic's messages as bytes, until every id in @ids is there, then one
        second more: [(CloudEvents id, bytes)]."""
        got, seen = [], set()
        deadline = time.monotonic() + timeout
        quiet_until = None
        while time.monotonic() < (quiet_until or deadline):
            m = reader.poll(0.2)
            if m is None or m.error():
                continue
            raw = bytes(m.value())
            got.append((json.loads(raw)["id"], raw))
            seen.add(got[-1][0])
            if quiet_until is None and ids <= seen:
                quiet_until = time.monotonic() + 1.0
        self.assertLessEqual(ids, seen, "every committed message was published")
        return got

    def assert_outcomes_published(self, duplicates):
        """Every outcome event committed to message_outbox reached the topic, and every copy on
        the topic is the very same message (same CloudEvents id, same content): delivery is at
        least once (DESIGN §5). A killed worker's own relay thread may have been between its
        delivery reports and its COMMIT at any crash point, so a copy may go out again
        wherever a worker dies; where the relay itself is the victim (duplicates=True) at
        least one must."""
        self.wait_count(SQL_WAITING, 0, timeout=30)
        logged = {m["id"]: m for m in self.logged_outcomes()}
        refs = self.logged_refs()
        self.assertTrue(logged or refs)
        reader = self.reader("outcomes")
        raw = self.read_raw(reader, set(logged) | set(refs), timeout=30)
        by_id = collections.defaultdict(list)
        for eid, b in raw:
            by_id[eid].append(b)
        # Read the log again: a redelivered intent may have been answered as a replay after the
        # first read, and its outcome published since; it must have been committed all the same.
        logged = {m["id"]: m for m in self.logged_outcomes()}
        refs = self.logged_refs()
        extra = {eid: by_id[eid][0] for eid in set(by_id) - set(logged) - set(refs)}
        self.assertLessEqual(set(by_id), set(logged) | set(refs),
                             f"every message on the topic was committed; not logged: {extra}")
        dup = {eid: bs for eid, bs in by_id.items() if len(bs) > 1}
        if duplicates:
            self.assertTrue(dup, "the relay died after publishing: some rows went out again")
            # the victim's relay published references it was handed (built from what the
            # record statement returned); a survivor's took them again from the tables and
            # built them anew: the same bytes
            self.assertTrue(set(dup) & set(refs),
                            f"no reference went out twice: {sorted(dup)[:5]}")
        for eid, bs in by_id.items():
            for b in bs:
                self.assertEqual(b, bs[0], f"two deliveries of {eid} differ")
            m = json.loads(bs[0])
            if eid in logged:
                self.assertEqual(m, logged[eid])
                continue
            # built by the relay from the transition it names and that transition's effect
            time_, actor, state, effect_id, kind = refs[eid]
            self.assertEqual(kind, "transition")
            self.assertEqual((m["time"], m["source"], m["type"], m["subject"], m["data"]["status"],
                              m["data"]["effect_id"]),
                             (time_, "/tally/dispatcher/" + actor,
                              f"tally.effect.{state.lower()}.v1", effect_id, state, effect_id))
            effect = self.query("SELECT run_id, tool, operation_key, intent_id, receipt"
                                " FROM effects WHERE effect_id = %s", (effect_id,))[0]
            self.assertEqual((m["data"]["run_id"], m["data"]["tool"], m["data"]["operation_key"],
                              m["data"]["intent_id"]), tuple(effect[:4]))
            if state == "CONFIRMED":
                self.assertEqual(m["data"]["receipt"], effect[4])
        logged.update({eid: json.loads(by_id[eid][0]) for eid in refs if eid in by_id})
        # one outcome per state an effect reached: no transition was published under two ids
        firsts = collections.Counter(
            (m["type"], m["data"].get("effect_id"), m["data"].get("run_id"))
            for m in logged.values() if not m["data"].get("replay"))
        self.assertEqual(max(firsts.values()), 1, firsts.most_common(3))


if __name__ == "__main__":
    tallytest.main()
