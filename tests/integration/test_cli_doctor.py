"""`tally doctor` and `tally summary --run R` (DESIGN §7, §8). The doctor fits a screen for an
ordinary run: the run, its problems first (each with the command that handles it), then one
line per effect and per obligation; --full adds the whole timeline — every event of the events
table, in order, transitions with their actor and reason — and each row whole, every receipt and
body once. It finds its run by --run, --effect, --obligation, --ref or --key, wraps only between
words (ids copy whole at any COLUMNS) and prints reals in their shortest form. The summary has
its ✓ ⚠ ○ ✗ entries. Scenario runs are made by the real dispatcher, reconciler and compensator."""

import json
import re
import shlex
import uuid

from tallytest import wait_for
from test_cli_status import CliCase, main, run_id


def significant_digits(number):
    """Significant digits of a JSON number's text: 0.00037641600000000002 has 17."""
    mantissa = re.split(r"[eE]", number.lstrip("-"))[0].replace(".", "").lstrip("0")
    return len(mantissa)


def long_reals(text):
    """The numbers with a fraction in @text that have more than 15 significant digits."""
    return [n for n in re.findall(r"-?\d+\.\d+(?:[eE][-+]?\d+)?", text)
            if significant_digits(n) > 15]


def commands_in(text, start):
    """The first block of commands printed after the line at @start (each "tally ..." line with
    its " \\" continuations joined, the "# comment" lines skipped), each as one line."""
    out, current, started = [], None, False
    for line in text[start:].splitlines()[1:]:
        stripped = line.strip()
        if current is not None:
            current += " " + stripped.rstrip("\\").strip()
            if not stripped.endswith("\\"):
                out.append(current)
                current = None
            continue
        if stripped.startswith("tally "):
            started = True
            if stripped.endswith("\\"):
                current = stripped.rstrip("\\").strip()
            else:
                out.append(stripped)
        elif stripped.startswith("#"):
            started = True
        elif started:
            break
    return out


class DoctorTest(CliCase):

    def compensator(self):
        return self.start("tally-compensator", TALLY_FAKE_TOOL_URL=self.fake_url,
                          BILLING_HMAC_SECRET="whsec_dispatch_tests", TALLY_POLL_MS=200,
                          TALLY_SWEEP_MS=300)

    def test_doctor_full_shows_every_event_of_a_scenario_run_in_order(self):
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

        out = self.tally("doctor", "--run", run, "--full")
        self.assertEqual(out.returncode, 0, out.stderr)
        text = out.stdout
        for line in text.splitlines():
            # a word wider than the line (a JSON string without spaces) stands whole on its own
            self.assertTrue(len(line) <= 80 or len(line.split()) == 1, line)
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
        # Then each effect as it is now, whole.
        effects_at = text.index("DETAILS OF THE EFFECTS: 3, in step order")
        for eid in (first, second, third):
            self.assertIn(eid, text[effects_at:])
        self.assertIn(f"external ref   {record['id']}", text)
        self.assertIn("lease          none (epoch", text)
        # Each receipt once: step 1's answer is its receipt, printed under DETAILS only.
        [(ref1,)] = self.query("SELECT external_ref FROM effects WHERE effect_id = %s", (first,))
        self.assertEqual(text.count(f'"id": "{ref1}"'), 1, text)
        # Its call keeps a reference and the receipt's hash (the receipt is stored once, on
        # the effect), shown as where the receipt is and that the hash still matches.
        self.assertIn('"receipt": "the receipt of its effect, under DETAILS (sha256 matches)"',
                      " ".join(text.split()))
        # The default view has none of it.
        out = self.tally("doctor", "--run", run)
        self.assertNotIn("TIMELINE", out.stdout)
        self.assertNotIn(f'"id": "{ref1}"', out.stdout)
        # --json --full: the same events, with every column.
        rc, doc = self.tally_json("doctor", "--run", run, "--full")
        self.assertEqual(rc, 0)
        self.assertEqual([(e["seq"], e["kind"], e["from_status"], e["to_status"], e["actor"],
                           e["reason"]) for e in doc["events"]], events)
        self.assertEqual([e["effect_id"] for e in doc["effects"]], [first, second, third])
        self.assertEqual(doc["effects"][2]["status"], "CONFIRMED")
        self.assertEqual(doc["run"]["run_id"], run)
        self.assertEqual([a["status"] for a in doc["alerts"]], ["RESOLVED"])
        rc, doc = self.tally_json("doctor", "--run", run)
        self.assertEqual((rc, "events" in doc, doc["problems"]), (0, False, []))
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
        self.audit(run, None, None, "operator", None, None, "ivy", "a long note",
                   {"note": "wörd " * 600})  # 3,000 characters: cut in the text, whole in JSON

        expected = self.query(
            "SELECT event_id::text, kind, run_id FROM events WHERE run_id = %s"
            " OR effect_id = %s OR obligation_id = %s ORDER BY seq", (run, effect, oid))
        found = {(k, r) for _, k, r in expected}
        self.assertTrue({("intent", other), ("conflict", other), ("operator", None),
                         ("transition", run), ("connector_call", run)} <= found, found)
        rc, doc = self.tally_json("doctor", "--run", run, "--full")
        self.assertEqual(rc, 0)
        self.assertEqual([(e["event_id"], e["kind"], e["run_id"]) for e in doc["events"]],
                         [tuple(e) for e in expected])
        self.assertIn({"note": "wörd " * 600}, [e["data"] for e in doc["events"]])
        out = self.tally("doctor", "--run", run, "--full")
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("checked upstream by hand", out.stdout)
        self.assertRegex(" ".join(out.stdout.split()),
                         r'\{"note": "(wörd )+\w* …\(\d+ bytes; --full --json has it all\)')
        # The other run's timeline has the two events under its own id.
        rc, doc = self.tally_json("doctor", "--run", other, "--full")
        self.assertEqual(rc, 0)
        self.assertEqual(sorted(e["kind"] for e in doc["events"] if e["effect_id"] == effect),
                         ["conflict", "intent"])

    def test_doctor_fits_a_screen_problems_first_and_ids_copy_whole(self):
        self.dispatcher()
        self.reconciler()
        run = run_id()
        first = self.confirmed_charge(run, 1)
        key2 = f"charge_card:t1:{run}-p2"
        self.fault("apply_then_hang", key=key2, delay_ms=5000)   # UNKNOWN, then CONFIRMED
        self.charge(run, 2)
        second = self.wait_status("charge_card", key2, "CONFIRMED", timeout=30)["effect_id"]
        third, record = self.stuck_note(run, 3)                   # STUCK, paged

        out = self.tally("doctor", "--run", run)
        self.assertEqual(out.returncode, 0, out.stderr)
        text = out.stdout
        lines = text.splitlines()
        self.assertLessEqual(len(lines), 40, text)
        self.assertTrue(lines[0].startswith(f"RUN {run}  ACTIVE"), text)
        self.assertNotIn("settled", lines[0])  # a STUCK effect waits for a human
        # The problem first, with the commands that handle it; then one line per effect.
        problems, effects = text.index("PROBLEMS: 1"), text.index("EFFECTS: 3")
        self.assertLess(problems, effects)
        self.assertRegex(text[problems:effects], r"✗ STUCK\s+effect, step 3 post_note")
        self.assertIn(f"alert effect:{third} is open", " ".join(text[problems:effects].split()))
        commands = commands_in(text, problems)
        self.assertEqual(len(commands), 2, text)
        confirm = [c for c in commands if "--as confirmed" in c]
        self.assertEqual(len(confirm), 1, commands)
        self.assertTrue(confirm[0].startswith(f"tally resolve --effect {third} --as confirmed"))
        for eid, step in ((first, "1"), (second, "2"), (third, "3")):
            [entry] = [i for i, line in enumerate(lines) if re.match(rf"\s+{step}  \S", line)]
            self.assertIn(eid, " ".join(lines[entry:entry + 3]))
        self.assertRegex(text[effects:], r"3  post_note  STUCK  1 attempt")
        self.assertIn(f"key post_note:{run}-n3", text[effects:])  # no ref yet: the key
        [(ref1,)] = self.query("SELECT external_ref FROM effects WHERE effect_id = %s", (first,))
        self.assertIn(f"ref {ref1}", text[effects:])
        rc, doc = self.tally_json("doctor", "--run", run)
        self.assertEqual(rc, 0)
        [p] = doc["problems"]
        self.assertEqual((p["kind"], p["subject"], p["id"], p["state"], p["alert"]),
                         ("stuck", "effect", third, "STUCK", f"effect:{third}"))
        self.assertEqual(p["commands"][0], confirm[0].replace(" \\", ""))
        self.assertEqual(doc["counts"]["effects"], {"CONFIRMED": 2, "STUCK": 1})

        # tally status keeps "pager <state>" on one line at any width.
        for cols in ("60", "80", "100"):
            out = self.tally("status", env=self.env(COLUMNS=cols))
            self.assertRegex(out.stdout, r"pager (pending|sent|not_configured|failed)\n",
                             out.stdout)

        # The command, as printed, settles it; then the run has no problem left.
        args = shlex.split(confirm[0].replace("<REF>", record["id"])
                           .replace("<what you verified upstream>", "seen upstream"))
        out = self.tally(*args[1:], "--actor", "ivy")
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        out = self.tally("doctor", "--run", run)
        self.assertIn("PROBLEMS: none", out.stdout)
        self.assertIn(f"ref {record['id']}", out.stdout)
        # ACTIVE, as the ledger has it, but its work is over: the header says so
        self.assertEqual(out.stdout.splitlines()[0],
                         f"RUN {run}  ACTIVE · all 3 effects settled, not completed", out.stdout)

        # Compensation asked: one line per obligation too, still a screen.
        out = self.tally("compensate", "--run", run, "--reason", "roll back")
        self.assertEqual(out.returncode, 0, out.stderr)
        obligations = [oid for (oid,) in self.query(
            "SELECT obligation_id::text FROM obligations WHERE run_id = %s", (run,))]
        self.assertEqual(len(obligations), 3)
        out = self.tally("doctor", "--run", run)
        self.assertLessEqual(len(out.stdout.splitlines()), 40, out.stdout)
        self.assertIn("OBLIGATIONS: 3, in compensation order", out.stdout)
        # --full prints each receipt once: on its effect, not again on its obligation or as
        # the connector call's answer.
        full = self.tally("doctor", "--run", run, "--full").stdout
        self.assertEqual(full.count(f'"idempotency_key": "charge_card:t1:{run}-p1"'), 1, full)
        self.assertEqual(full.count("receipt        its effect's (above)"), 3, full)
        rc, doc = self.tally_json("doctor", "--run", run)
        self.assertEqual([("receipt" in o, o["receipt_same_as_effect"])
                          for o in doc["obligations"]], [(False, True)] * 3)

        # Every id whole on one line, at any width; lines fit unless one word is wider.
        ids = [first, second, third] + obligations
        for cols in (40, 60, 80, 200):
            out = self.tally("doctor", "--run", run, env=self.env(COLUMNS=str(cols)))
            self.assertEqual(out.returncode, 0, out.stderr)
            lines = out.stdout.splitlines()
            for i in ids:
                self.assertTrue(any(i in line for line in lines), f"{i} at {cols}:\n{out.stdout}")
            for line in lines:
                self.assertTrue(len(line) <= cols or len(line.split()) <= 2, f"{cols}: {line}")
            if cols == 200:  # wide enough: one line an effect
                self.assertTrue(any(first in line and ref1 in line for line in lines))
            full = self.tally("doctor", "--run", run, "--full", env=self.env(COLUMNS=str(cols)))
            for i in ids:
                self.assertTrue(any(i in line for line in full.stdout.splitlines()), i)

        # Reals in their shortest form: the connector calls' latency_ms among them.
        out = self.tally("doctor", "--run", run, "--full", "--json")
        doc = json.loads(out.stdout)
        self.assertTrue(any(isinstance((e["data"] or {}).get("latency_ms"), float)
                            for e in doc["events"]))
        self.assertEqual(long_reals(out.stdout), [])
        for args in (("--json",), ("--full",)):
            out = self.tally("doctor", "--run", run, *args)
            self.assertEqual(long_reals(out.stdout), [], args)
        out = self.tally("summary", "--run", run, "--json")
        self.assertEqual(long_reals(out.stdout), [])

    def test_doctor_finds_the_run_by_effect_obligation_ref_and_key(self):
        self.dispatcher()
        run, other = run_id(), run_id()
        first = self.confirmed_charge(run, 1)
        second = self.confirmed_charge(run, 2)
        self.confirmed_charge(other, 1)
        oid = self.obligation(second, "PENDING")
        [(ref2, key2)] = self.query("SELECT external_ref, operation_key FROM effects"
                                    " WHERE effect_id = %s", (second,))
        for flag, value, kind, marked in (("--effect", second.upper(), "effect", second),
                                          ("--obligation", oid, "obligation", oid),
                                          ("--ref", ref2, "effect", second),
                                          ("--key", key2, "effect", second)):
            out = self.tally("doctor", flag, value)
            self.assertEqual(out.returncode, 0, f"{flag}: {out.stderr}")
            self.assertTrue(out.stdout.startswith(f"RUN {run}  ACTIVE"), out.stdout)
            self.assertIn(f"▶ the {kind} {marked} ({flag})", " ".join(out.stdout.split()))
            [line] = [line for line in out.stdout.splitlines() if line.startswith(" ▶ ")]
            self.assertRegex(line, r" ▶ 2  charge_card  " + ("PENDING" if kind == "obligation"
                                                              else "CONFIRMED"))
            self.assertNotIn(first, line)
            rc, doc = self.tally_json("doctor", flag, value)
            self.assertEqual((rc, doc["run"]["run_id"]), (0, run))
            self.assertEqual((doc["match"]["by"], doc["match"]["kind"], doc["match"]["id"]),
                             (flag[2:], kind, marked))

        # Not found: said, exit 1, nothing on stdout.
        for flag, value, said in (("--effect", str(uuid.uuid4()), "no effect with id"),
                                  ("--obligation", str(uuid.uuid4()), "no obligation with id"),
                                  ("--ref", "no-such-ref", "with external ref 'no-such-ref'"),
                                  ("--key", "no-such-key", "with operation key 'no-such-key'"),
                                  ("--run", "no-such-run", "no run 'no-such-run'")):
            out = self.tally("doctor", flag, value)
            self.assertEqual((out.returncode, out.stdout), (1, ""), f"{flag} {value}")
            self.assertIn(said, out.stderr)

        # Checked before any query: a UUID for the ids, the limits, one handle.
        for args in (("--effect", "not-a-uuid"), ("--obligation", "1234"),
                     ("--key", "k" * 501), ("--ref", "r" * 513), ("--ref", "a\x01b"),
                     ("--key", " "), ("--run", run, "--effect", second), ()):
            out = self.tally("doctor", *args)
            self.assertEqual((out.returncode, out.stdout), (2, ""), args)
            self.assertIn("tally doctor:", out.stderr)

    def test_a_key_of_several_effects_lists_them_with_their_commands(self):
        self.dispatcher()
        run, other = run_id(), run_id()
        key = f"order-{run}"
        self.publish(self.intent(run, 1, "charge_card",
                                 {"tenant_id": "t1", "payment_id": f"{run}-p1", "amount": 5},
                                 operation_key=key))
        self.publish(self.intent(other, 1, "post_note", {"note_id": f"{other}-n1", "text": "x"},
                                 operation_key=key))
        a = self.wait_status("charge_card", key, "CONFIRMED", timeout=30)["effect_id"]
        b = self.wait_status("post_note", key, "CONFIRMED", timeout=30)["effect_id"]
        out = self.tally("doctor", "--key", key)
        self.assertEqual(out.returncode, 1, out.stdout + out.stderr)
        self.assertIn(f"--key '{key}' matches 2 items", out.stderr)
        self.assertIn(f"effect of run {run}, step 1 charge_card", out.stdout)
        self.assertIn(f"effect of run {other}, step 1 post_note", out.stdout)
        commands = [line.strip() for line in out.stdout.splitlines()
                    if line.strip().startswith("tally doctor")]
        self.assertEqual(sorted(commands),
                         sorted([f"tally doctor --effect {a}", f"tally doctor --effect {b}"]))
        for command, owner in ((f"tally doctor --effect {a}", run),
                               (f"tally doctor --effect {b}", other)):
            out = self.tally(*shlex.split(command)[1:])
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertTrue(out.stdout.startswith(f"RUN {owner}  "), out.stdout)
        out = self.tally("doctor", "--key", key, "--json")
        self.assertEqual(out.returncode, 1)
        doc = json.loads(out.stdout)
        self.assertEqual(doc["error"], "ambiguous")
        self.assertEqual(sorted(c["id"] for c in doc["candidates"]), sorted([a, b]))
        self.assertEqual(sorted(c["command"] for c in doc["candidates"]), sorted(commands))

    def test_doctor_lists_every_kind_of_problem_most_urgent_first(self):
        self.dispatcher()            # no reconciler: the UNKNOWN stays
        run = run_id()
        eid = self.unknown_charge(run, 1)
        confirmed = self.confirmed_charge(run, 2)
        oid = self.obligation(confirmed, "AWAITING_APPROVAL")
        third = self.confirmed_charge(run, 3)
        late = self.obligation(third, "PENDING")
        self.query("UPDATE runs SET compensation_deadline_at = now() - interval '1 minute'"
                   " WHERE run_id = %s RETURNING 1", (run,))
        self.query("INSERT INTO alerts (dedup_key, severity, summary, run_id, reason,"
                   " resolve_command) VALUES (%s, 'warning', 'a page of the run', %s, 'test',"
                   " %s) RETURNING 1",
                   (f"test:{run}", run, f'tally resolve --alert test:{run} --reason "<why>"'))
        finding = str(uuid.uuid4())
        self.query("INSERT INTO findings (finding_id, kind, tool, external_ref, run_id,"
                   " effect_id, summary, evidence, found_by) VALUES (%s, 'orphan',"
                   " 'charge_card', %s, %s, %s, 'an extra charge upstream', '{}', 'test')"
                   " RETURNING 1", (finding, f"ch-{run}", run, confirmed))
        wait_for(lambda: self.scalar("SELECT now() - unknown_since > interval '1.2 s'"
                                     " FROM effects WHERE effect_id = %s", (eid,)), timeout=10)
        out = self.tally("doctor", "--run", run, env=self.env(TALLY_UNKNOWN_AGE_S="1"))
        self.assertEqual(out.returncode, 0, out.stderr)
        text = out.stdout
        unknown = text.index("✗ UNKNOWN too long")
        approval = text.index("⚠ awaiting approval")
        self.assertLess(unknown, approval)
        deadline = text.index("⚠ past its deadline")
        alert = text.index("⚠ open alert")
        found = text.index("⚠ open finding")
        self.assertLess(approval, deadline)
        self.assertLess(deadline, alert)
        self.assertLess(alert, found)
        self.assertLess(found, text.index("EFFECTS: 3"))
        self.assertIn(f"tally resolve --effect {eid} --as failed", " ".join(
            text[unknown:approval].split()))
        self.assertEqual(commands_in(text, approval),
                         [f'tally approve --obligation {oid} --reason "<why>"',
                          f'tally deny --obligation {oid} --reason "<why>"'])
        out = self.tally("doctor", "--run", run, "--json", env=self.env(TALLY_UNKNOWN_AGE_S="1"))
        doc = json.loads(out.stdout)
        self.assertEqual([(p["kind"], p["id"]) for p in doc["problems"]],
                         [("unknown_aging", eid), ("approval", oid), ("deadline_passed", late),
                          ("alert", f"test:{run}"), ("finding", finding)])
        self.assertEqual(doc["problems"][3]["commands"],
                         [f'tally resolve --alert test:{run} --reason "<why>"'])
        self.assertEqual(commands_in(text, deadline), [f"tally summary --run {run}"])
        # The finding's command, as printed, closes it.
        [close] = commands_in(text, found)
        self.assertTrue(close.startswith(f"tally resolve --finding {finding} --as resolved"))
        out = self.tally(*shlex.split(close.replace("<what you did>", "refunded"))[1:])
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        rc, doc = self.tally_json("doctor", "--run", run)
        self.assertNotIn("finding", [p["kind"] for p in doc["problems"]])
        # Under the threshold, an UNKNOWN is no problem yet.
        out = self.tally("doctor", "--run", run, env=self.env(TALLY_UNKNOWN_AGE_S="3600"))
        self.assertNotIn("UNKNOWN too long", out.stdout)

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
        # what its containment action did, from the ledger, not that it "runs"
        self.assertRegex(doc["uncompensatable"][0]["reason"],
                         r"; the containment action: done \(HTTP 2\d\d\)$")
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
