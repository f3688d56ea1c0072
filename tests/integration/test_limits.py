"""No input can stop a worker (issue 20): the cases found by trying tally as an attacker would.

Each test is one of those cases, with the good work around it that must go on: a text cut in the
middle of a multi-byte character, a value over its limit, an answer from a tool that does not fit
the ledger, a write PostgreSQL refuses. Before the fix, each of them stopped a worker for good
(the intake paused, the run never answered, the page never raised, the guard silently dropped);
after it, the bad input is refused or recorded with a reason and everything else goes through.
"""

import json
import time
import uuid

from tallytest import wait_for
from test_compensate_flow import CompensateCase, new_run_id
from test_schemas import validator

U2 = "\u00fc"  # ü, 2 bytes of UTF-8


def text_with_char_at(n, char=U2, prefix="x", tail="-tail"):
    """A string whose multi-byte @char starts at byte n - 1 and ends at byte n: a cut at n
    bytes falls in its middle."""
    return prefix * (n - 1) + char + tail


class LimitsTest(CompensateCase):

    # --- helpers ----------------------------------------------------------------------------

    def execute_upstream(self, tool, key, body, run_id, effect_id):
        # http.client sends header values as Latin-1: hand it the UTF-8 bytes of the run id
        # that way, so that the fake (and tally) see the run id as tally sends it
        return super().execute_upstream(tool, key, body,
                                        run_id.encode("utf-8").decode("latin-1"), effect_id)

    def metric(self, proc, name):
        return self.metric_value(self.metrics(proc), name)

    def assert_ready(self, proc):
        status, body = proc.http_get("/readyz")
        self.assertEqual(status, 200, body)

    def dlq_by_intent(self, n, timeout=60):
        """The first n DLQ records, {intent id: data} (the id read from the original), each
        checked against schemas/dlq.schema.json."""
        got = self.read_until("dlq", lambda ms: len(ms) >= n, timeout=timeout)
        out = {}
        for m in got:
            validator("dlq").validate(m)
            data = m["data"]
            try:
                out[json.loads(data["original"])["id"]] = data
            except (KeyError, ValueError):
                out[f"offset-{data['offset']}"] = data
        return out

    def assert_valid_text(self, s):
        self.assertIsInstance(s, str)
        s.encode("utf-8")  # a lone surrogate (a cut character decoded leniently) would raise

    # --- the intake --------------------------------------------------------------------------

    def test_text_cut_mid_character_never_stops_the_intake(self):
        d = self.dispatcher()
        run = new_run_id()
        tag = uuid.uuid4().hex[:6]
        good = [self.intent(run, i, "update_ledger", {"entry_id": f"{tag}-{i}"})
                for i in range(1, 4)]
        # an unknown tool whose name is cut for the DLQ sentence: at the limit, and over it
        unknown_at_limit = self.intent(run, 10, "x" * 198 + U2, {"id": 1})
        unknown_over = self.intent(run, 11, text_with_char_at(200, tail=""), {"id": 1})
        # a CONFLICT whose operation key has a 2-byte character at byte 150
        key = text_with_char_at(150, prefix="k")
        first = self.intent(run, 20, "update_ledger", {"entry_id": f"{tag}-c"},
                            operation_key=key)
        conflict = self.intent(run, 21, "update_ledger", {"entry_id": f"{tag}-d"},
                               operation_key=key)
        # a step conflict in a run whose id has one at byte 150, and a step with one at 100
        run2 = text_with_char_at(150, prefix="r")
        step = "s" * 98 + U2  # 100 bytes, at the limit
        self.assertEqual(len(step.encode()), 100)
        taken = self.intent(run2, step, "update_ledger", {"entry_id": f"{tag}-e"})
        step_conflict = self.intent(run2, step, "update_ledger", {"entry_id": f"{tag}-f"})
        self.publish_many([good[0], unknown_at_limit, first, unknown_over, good[1], taken])
        self.wait_status("update_ledger", key, "CONFIRMED")
        self.publish_many([conflict, step_conflict, good[2]])

        answers = self.outcomes_for([g["id"] for g in good] + [conflict["id"],
                                                                step_conflict["id"]])
        for g in good:
            self.assertIn("CONFIRMED", [m["data"]["status"] for m in answers[g["id"]]])
        for c in (conflict, step_conflict):
            ev = answers[c["id"]][0]["data"]
            self.assertEqual((ev["status"], ev["error"]["code"]), ("CONFLICT", "conflict"))
            self.assert_valid_text(ev["error"]["message"])
        dlq = self.dlq_by_intent(2)
        self.assertEqual(dlq[unknown_at_limit["id"]]["reason"], "unknown_tool")
        self.assertIn("x" * 198 + U2, dlq[unknown_at_limit["id"]]["detail"])
        self.assertEqual(dlq[unknown_over["id"]]["reason"], "invalid_field")
        self.assertIn("data.tool", dlq[unknown_over["id"]]["detail"])
        self.assertIn("201 bytes", dlq[unknown_over["id"]]["detail"])
        conflicts = self.query("SELECT reason FROM events WHERE kind = 'conflict'")
        self.assertEqual(len(conflicts), 2)
        for (reason,) in conflicts:
            self.assert_valid_text(reason)
        self.assert_ready(d)
        self.assertEqual(self.metric(d, "tally_intake_paused"), 0)
        self.invariants()

    def test_a_derived_operation_key_over_its_limit_is_refused(self):
        d = self.dispatcher()
        run = new_run_id()
        tag = uuid.uuid4().hex[:6]
        # update_ledger's key is "update_ledger:<entry_id>": 14 bytes and the entry id
        at_limit = self.intent(run, 1, "update_ledger",
                               {"entry_id": tag + "a" * (500 - 14 - len(tag) - 2) + U2})
        over = self.intent(run, 2, "update_ledger", {"entry_id": "b" * 10000})
        ctl = self.intent(run, 3, "update_ledger", {"entry_id": "c\r\nX-Injected: 1"})
        after = self.intent(run, 4, "update_ledger", {"entry_id": tag + "-after"})
        self.publish_many([at_limit, over, ctl, after])
        answers = self.outcomes_for([at_limit["id"], after["id"]])
        self.assertIn("CONFIRMED", [m["data"]["status"] for m in answers[after["id"]]])
        confirmed = [m["data"] for m in answers[at_limit["id"]]
                     if m["data"]["status"] == "CONFIRMED"]
        self.assertEqual(len(confirmed[0]["operation_key"].encode()), 500)
        dlq = self.dlq_by_intent(2)
        self.assertEqual(dlq[over["id"]]["reason"], "invalid_field")
        self.assertIn("above the limit of 500 bytes", dlq[over["id"]]["detail"])
        self.assertEqual(dlq[ctl["id"]]["reason"], "invalid_field")
        self.assertIn("control characters", dlq[ctl["id"]]["detail"])
        self.assert_ready(d)

    def test_a_huge_kafka_key_is_cut_in_its_dead_letter(self):
        # a key may be as large as the message: the DLQ record keeps its first 1024 bytes
        d = self.dispatcher()
        big_key = ("k" * 1023 + U2) * 800  # 819,200 bytes, a 2-byte character at every cut
        self.produce("intents", b"{not json", key=big_key.encode())
        tag = uuid.uuid4().hex[:6]
        after = self.intent(new_run_id(), 1, "update_ledger", {"entry_id": tag})
        self.publish(after)
        self.assertIn("CONFIRMED", [m["data"]["status"]
                                    for m in self.outcomes_for([after["id"]])[after["id"]]])
        rec = list(self.dlq_by_intent(1).values())[0]
        self.assertEqual((rec["reason"], rec["key_bytes"]), ("not_json", len(big_key.encode())))
        self.assertEqual(rec["original_key"], "k" * 1023)  # the ü at 1023-1024 left out whole
        self.assertEqual(rec["original_key"], rec["key"])
        self.assert_ready(d)

    def test_a_write_postgres_refuses_is_isolated_and_dead_lettered(self):
        # A constraint the intents cannot know about (as a later migration might add): it
        # refuses the effect of one run. Only that intent is dead-lettered; the others of its
        # batch are written.
        self.query("CREATE FUNCTION refuse_some() RETURNS trigger LANGUAGE plpgsql AS $$"
                   " BEGIN RAISE EXCEPTION USING ERRCODE = 'check_violation',"
                   " MESSAGE = 'refused by the test''s constraint'; END $$")
        self.query("CREATE TRIGGER refuse_some BEFORE INSERT ON effects FOR EACH ROW"
                   " WHEN (NEW.run_id LIKE 'refuse-%') EXECUTE FUNCTION refuse_some()")
        run = new_run_id()
        tag = uuid.uuid4().hex[:6]
        good = [self.intent(run, i, "update_ledger", {"entry_id": f"{tag}-{i}"})
                for i in range(1, 9)]
        bad = self.intent("refuse-" + tag, 1, "update_ledger", {"entry_id": f"{tag}-bad"})
        batch = good[:5] + [bad] + good[5:]
        # one partition (one Kafka key), published before the dispatcher starts: one batch
        p = self.producer()
        for ce in batch:
            p.produce(self.topic("intents"), value=json.dumps(ce).encode(), key=run.encode())
        p.flush(30)
        d = self.dispatcher()
        answers = self.outcomes_for([g["id"] for g in good])
        for g in good:
            self.assertIn("CONFIRMED", [m["data"]["status"] for m in answers[g["id"]]])
        dlq = self.dlq_by_intent(1)
        self.assertEqual(dlq[bad["id"]]["reason"], "ledger_refused")
        self.assertIn("refused by the test's constraint", dlq[bad["id"]]["detail"])
        self.assertIn("23514", dlq[bad["id"]]["detail"])
        self.assertEqual(self.scalar("SELECT count(*) FROM effects WHERE run_id LIKE 'refuse-%'"),
                         0)
        self.assert_ready(d)
        self.assertEqual(self.metric(d, "tally_intake_paused"), 0)

    def test_a_tool_answer_postgres_refuses_is_kept_as_a_note(self):
        # A tool's answer the ledger cannot hold (here: a test constraint on receipts, as
        # jsonb refuses some JSON): that result is written with a note in place of the answer,
        # and the results recorded with it are not held up.
        self.query("CREATE FUNCTION refuse_receipt() RETURNS trigger LANGUAGE plpgsql AS $$"
                   " BEGIN RAISE EXCEPTION USING ERRCODE = 'invalid_text_representation',"
                   " MESSAGE = 'refused by the test''s receipt constraint'; END $$")
        self.query("CREATE TRIGGER refuse_receipt BEFORE UPDATE ON effects FOR EACH ROW"
                   " WHEN (NEW.receipt -> 'body' ->> 'refuse' IS NOT NULL)"
                   " EXECUTE FUNCTION refuse_receipt()")
        run = new_run_id()
        tag = uuid.uuid4().hex[:6]
        good = [self.intent(run, i, "update_ledger", {"entry_id": f"{tag}-{i}"})
                for i in range(1, 6)]
        bad = self.intent(run, 9, "update_ledger", {"entry_id": f"{tag}-bad", "refuse": 1})
        p = self.producer()
        for ce in good[:2] + [bad] + good[2:]:
            p.produce(self.topic("intents"), value=json.dumps(ce).encode(), key=run.encode())
        p.flush(30)
        d = self.dispatcher()
        answers = self.outcomes_for([ce["id"] for ce in good + [bad]])
        for ce in good:
            self.assertIn("CONFIRMED", [m["data"]["status"] for m in answers[ce["id"]]])
        ev = [m["data"] for m in answers[bad["id"]] if m["data"]["status"] == "CONFIRMED"][0]
        self.assertEqual(ev["error"]["code"], "protocol_error")
        self.assertIn("refused by the test's receipt constraint", ev["error"]["message"])
        eff = self.effect("update_ledger", f"update_ledger:{tag}-bad")
        self.assertIn("refused by the test's receipt constraint",
                      eff["receipt"]["refused_by_ledger"])
        self.assertIn(f"{tag}-bad", eff["receipt"]["excerpt"])
        self.assertIsNone(eff["external_ref"])
        wait_for(lambda: d.http_get("/readyz")[0] == 200, timeout=30, what="/readyz 200")

    # --- run-level requests ------------------------------------------------------------------

    def test_run_reasons_cut_mid_character_and_over_their_limit(self):
        d = self.dispatcher()
        comp = self.compensator()
        tag = uuid.uuid4().hex[:6]
        runs = []
        for i in range(3):
            run_id = new_run_id()
            self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1",
                                                       "payment_id": f"p-{tag}-{i}",
                                                       "amount": 5})
            runs.append(run_id)
        reason = text_with_char_at(200, prefix="r")
        # through the intents topic
        ce = {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/limits",
              "type": "tally.compensate_run.v1", "data": {"run_id": runs[0], "reason": reason}}
        self.publish(ce)
        # through the CLI, compensate and cancel
        out = self.cli("compensate", "--run", runs[1], "--reason", reason, "--actor", "oncall")
        self.assertEqual(out.returncode, 0, out.stderr)
        out = self.cli("cancel", "--run", runs[2], "--compensate", "--reason", reason,
                       "--actor", "oncall")
        self.assertEqual(out.returncode, 0, out.stderr)
        for run_id in runs:
            self.wait_run(run_id, "COMPENSATED")
            status_reason = self.scalar("SELECT status_reason FROM runs WHERE run_id = %s",
                                        (run_id,))
            self.assert_valid_text(status_reason)
        # a reason of 4096 bytes is accepted; 4097, from either door, refused with a reason
        over = {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "tests/limits",
                "type": "tally.compensate_run.v1",
                "data": {"run_id": runs[0], "reason": "y" * 4095 + U2}}
        huge = dict(over, id=str(uuid.uuid4()),
                    data={"run_id": runs[0], "reason": "z" * 800000})
        self.publish(over)
        self.publish(huge)
        dlq = self.dlq_by_intent(2)
        for ce in (over, huge):
            self.assertEqual(dlq[ce["id"]]["reason"], "invalid_field")
            self.assertIn("data.reason must be a string of at most 4096 bytes",
                          dlq[ce["id"]]["detail"])
        out = self.cli("compensate", "--run", runs[0], "--reason", "w" * 4097)
        self.assertEqual(out.returncode, 2)
        self.assertIn("--reason is 4097 bytes, above its limit of 4096 bytes", out.stderr)
        out = self.cli("compensate", "--run", "", "--reason", "ok")
        self.assertEqual(out.returncode, 2)
        self.assertIn("--run is empty; give the run id", out.stderr)
        self.assertNotIn("audit trail", out.stderr)
        self.assert_ready(d)
        self.assert_ready(comp)

    # --- events that would not fit the broker -------------------------------------------------

    def confirmed_event(self, ce, timeout=60):
        """The raw bytes and the JSON of the confirmed answer to intent @ce."""
        c = self.reader("outcomes")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = c.poll(0.2)
            if m is None or m.error():
                continue
            ev = json.loads(m.value())
            if ev.get("data", {}).get("intent_id") == ce["id"] and \
                    ev["type"] == "tally.effect.confirmed.v1":
                return m.value(), ev
        self.fail(f"no confirmed answer to {ce['id']}")

    def test_an_event_over_the_broker_limit_is_published_cut(self):
        # update_ledger's receipt is the fake's record, which holds the request body: a
        # 950 kB argument makes a confirmed event of about 1.9 MB (the receipt, and its text)
        d = self.dispatcher()
        tag = uuid.uuid4().hex[:6]
        ce = self.intent(new_run_id(), 1, "update_ledger",
                         {"entry_id": tag, "pad": ("p" * 99 + U2) * 9400})
        self.assertLess(len(json.dumps(ce)), 1048576)
        self.publish(ce)
        raw, ev = self.confirmed_event(ce)
        self.assertLessEqual(len(raw), 900000)
        tr = ev["data"]["truncated"]
        self.assertGreater(tr["original_bytes"], 900000)
        self.assertTrue(tr["cut"])
        self.assertEqual(tr["full"], f"tally doctor --run '{ce['data']['run_id']}'")
        self.assertEqual((ev["data"]["status"], ev["data"]["operation_key"]),
                         ("CONFIRMED", f"update_ledger:{tag}"))
        # the ledger keeps the receipt whole
        eff = self.effect("update_ledger", f"update_ledger:{tag}")
        self.assertIn(("p" * 99 + U2) * 9400, json.dumps(eff["receipt"], ensure_ascii=False))
        self.assertRegex(d.log(), "published cut to")

    def test_an_event_over_the_producers_message_max_bytes_is_cut_by_the_relay(self):
        # a deployment whose brokers take less than tally's 900 kB: the relay cuts the event
        # again rather than retrying it forever
        d = self.dispatcher(TALLY_KAFKA_MESSAGE_MAX_BYTES=200000)
        tag = uuid.uuid4().hex[:6]
        ce = self.intent(new_run_id(), 1, "update_ledger", {"entry_id": tag, "pad": "q" * 300000})
        self.publish(ce)
        raw, ev = self.confirmed_event(ce)
        self.assertLessEqual(len(raw), 200000)
        self.assertGreater(ev["data"]["truncated"]["original_bytes"], 300000)
        self.assertRegex(d.log(), "above the producer's message.max.bytes")
        self.assert_ready(d)

    def test_an_outcome_postgres_refuses_does_not_hold_the_others(self):
        # The compensator records the outcomes of a round in one transaction: one that
        # PostgreSQL refuses (a test constraint on one run's obligations) is kept and retried
        # alone, and the others are written.
        self.query("CREATE FUNCTION refuse_outcome() RETURNS trigger LANGUAGE plpgsql AS $$"
                   " BEGIN RAISE EXCEPTION USING ERRCODE = 'check_violation',"
                   " MESSAGE = 'refused by the test''s obligation constraint'; END $$")
        self.query("CREATE TRIGGER refuse_outcome BEFORE UPDATE ON obligations FOR EACH ROW"
                   " WHEN (NEW.run_id LIKE 'refuse-%' AND NEW.status = 'RESOLVED')"
                   " EXECUTE FUNCTION refuse_outcome()")
        tag = uuid.uuid4().hex[:6]
        runs = [new_run_id() for _ in range(5)] + [f"refuse-{tag}"]
        for i, run_id in enumerate(runs):
            self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1",
                                                       "payment_id": f"p-{tag}-{i}",
                                                       "amount": 5})
            self.compensate(run_id)
        comp = self.compensator()
        for run_id in runs[:5]:
            self.wait_run(run_id, "COMPENSATED")
        self.assertIn(self.obligation_of(runs[5], "charge_card")["status"],
                      ("RUNNING", "PENDING"))
        self.assert_ready(comp)

    # --- pages --------------------------------------------------------------------------------

    def test_a_stuck_obligation_pages_whatever_its_run_id(self):
        # the alert summary quotes the run id cut at 80 bytes: a 2-byte character there
        run_id = text_with_char_at(80, prefix="r")
        tag = uuid.uuid4().hex[:6]
        self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1", "payment_id": f"p-{tag}",
                                                   "amount": 5})
        self.fault("reverse_412", collection="charges", op="reverse", times=1)
        self.compensate(run_id)
        comp = self.compensator()
        ob = self.wait_obligation(run_id, "charge_card", "STUCK")
        key = f"obligation:{ob['obligation_id']}"
        summary = wait_for(lambda: self.scalar(
            "SELECT summary FROM alerts WHERE dedup_key = %s AND status = 'TRIGGERED'", (key,)),
            timeout=30, what="the page of the STUCK obligation")
        self.assert_valid_text(summary)
        self.assertIn("r" * 40, summary)
        wait_for(lambda: self.metric(comp, "tally_stuck_obligations") == 1, timeout=30,
                 what="tally_stuck_obligations = 1")
        self.assertEqual(self.metric_value(self.metrics(comp), "tally_alert_write_failures_total",
                                           worker="compensator"), 0)
        alerts = self.read_until("alerts", lambda ms: any(
            m["data"]["dedup_key"] == key for m in ms))
        self.assertEqual([m["data"]["run_id"] for m in alerts if m["data"]["dedup_key"] == key],
                         [run_id])

    # --- a tool's answers ----------------------------------------------------------------------

    def receipt_version(self, eff, version):
        self.query("UPDATE effects SET receipt = receipt || jsonb_build_object('version', %s::text)"
                   " WHERE effect_id = %s", (version, eff["effect_id"]))

    def test_a_sha256_etag_is_sent_whole_as_if_match(self):
        tag = uuid.uuid4().hex[:6]
        run_id = new_run_id()
        eff = self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1",
                                                         "payment_id": f"p-{tag}", "amount": 5})
        etag = '"' + "ab12" * 16 + '"'  # a quoted SHA-256 hex: 66 bytes
        self.receipt_version(eff, etag)
        self.compensate(run_id)
        self.compensator()
        # the fake's record has version 1, so this guard fails: STUCK stale_state, never
        # overwritten (before the fix the header was dropped and the reverse went through)
        ob = self.wait_obligation(run_id, "charge_card", "STUCK")
        self.assertEqual(ob["error_code"], "stale_state")
        reqs = self.fake_requests(op="reverse", collection="charges")
        self.assertEqual([r["if_match"] for r in reqs], [etag])
        self.assertEqual(self.reversals(), [])

    def test_a_version_too_long_for_if_match_is_stuck_not_sent_without_it(self):
        tag = uuid.uuid4().hex[:6]
        runs = []
        for version in ("v" * 257, "7\r\nX-Injected: 1"):
            run_id = new_run_id()
            eff = self.add_effect(run_id, 1, "charge_card", {"tenant_id": "t1",
                                                             "payment_id": f"p-{tag}-{len(runs)}",
                                                             "amount": 5})
            self.receipt_version(eff, version)
            self.compensate(run_id)
            runs.append(run_id)
        self.compensator()
        for run_id in runs:
            ob = self.wait_obligation(run_id, "charge_card", "STUCK")
            self.assertEqual(ob["error_code"], "protocol_error")
            self.assertIsNotNone(self.scalar(
                "SELECT 1 FROM alerts WHERE dedup_key = %s AND status = 'TRIGGERED'",
                (f"obligation:{ob['obligation_id']}",)))
        self.assertEqual(self.fake_requests(op="reverse"), [])

    def test_a_receipt_id_over_its_limit_is_evidence_not_a_ref(self):
        d = self.dispatcher()
        comp = self.compensator()
        run_id = new_run_id()
        tag = uuid.uuid4().hex[:6]
        key = f"charge_card:t1:p-{tag}"
        self.fault("huge_id", key=key, collection="charges", op="execute", size=10240)
        ce = self.intent(run_id, 1, "charge_card", {"tenant_id": "t1", "payment_id": f"p-{tag}",
                                                    "amount": 5})
        self.publish(ce)
        eff = self.wait_status("charge_card", key, "CONFIRMED")
        self.assertIsNone(eff["external_ref"])
        self.assertEqual(eff["error_code"], "protocol_error")
        self.assertIn("above the limit of 512 bytes", eff["error_message"])
        self.assertGreaterEqual(len(eff["receipt"]["id"].encode()), 10240)
        answer = [m["data"] for m in self.outcomes_for([ce["id"]])[ce["id"]]
                  if m["data"]["status"] == "CONFIRMED"][0]
        self.assertEqual(answer["error"]["code"], "protocol_error")
        self.assertIsNone(answer["external_ref"])
        # the run can still be compensated: the obligation is written (its ref null), and the
        # run settles with a summary, whatever the tool then says about a null ref
        res = self.compensate(run_id)
        self.assertEqual(res["obligations_created"], 1)
        self.wait_run(run_id, ("COMPENSATED", "PARTIALLY_COMPENSATED", "STUCK"))
        self.assert_ready(d)
        self.assert_ready(comp)


if __name__ == "__main__":
    import tallytest
    tallytest.main()
