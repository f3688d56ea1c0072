"""The receipt is stored once, on the effect (issue 27): the `connector_call` event of the call
whose answer became the effect's receipt keeps a reference and the receipt's SHA-256 instead of
the answer; every other attempt keeps its answer, the event being its only copy. Readers (the
doctor's timeline, `tally verify`) read the receipt from the effect, check the hash, and still
read the events 0.2.0 wrote with the answer inline.

Real processes: tally-dispatcher calls tally-fake-tool; the test reads the ledger as the
superuser, changes a receipt by hand as someone with the owner's rights could, and runs the
`tally` command line as an operator would."""

import hashlib
import json
import re

from test_verify import VerifyCase, main, run_id


def sha256_hex(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def times_printed(record_id, text):
    """How often a JSON object with this "id" is printed in @text (compact or not)."""
    return len(re.findall(r'"id": ?"' + re.escape(record_id) + '"', text))


class ReceiptOnceTest(VerifyCase):

    def calls(self, effect_id):
        """The effect's connector_call events' data, in order (read through its run, as the
        events index wants)."""
        return [d for (d,) in self.query(
            "SELECT data FROM events WHERE run_id = (SELECT run_id FROM effects"
            " WHERE effect_id = %s) AND effect_id = %s AND kind = 'connector_call' ORDER BY seq",
            (effect_id, effect_id))]

    def doctor_full(self, run):
        out = self.cli("doctor", "--run", run, "--full", env=self.env(COLUMNS="400"))
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        return " ".join(out.stdout.split())

    def test_the_confirmed_call_keeps_a_reference_and_the_hash_the_others_their_answer(self):
        self.dispatcher()
        run = run_id()
        key = f"create_hold:{run}-h"
        # attempt 1 is refused (503: not applied, retried), attempt 2 is applied
        self.fault("refuse_503", key=key, times=1)
        self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h"}))
        row = self.wait_status("create_hold", key, "CONFIRMED")
        eid = row["effect_id"]
        self.assertEqual(row["attempts"], 2)

        # The effect holds the receipt: the tool's own record.
        [record] = [r for r in self.records("holds") if r["idempotency_key"] == key]
        self.assertEqual(row["receipt"], record)
        [(stored,)] = self.query("SELECT receipt::text FROM effects WHERE effect_id = %s",
                                 (eid,))

        refused, confirmed = self.calls(eid)
        # The refused attempt's answer is in its event, its only copy.
        self.assertEqual((refused["verdict"], refused["status_code"]), ("retry", 503))
        self.assertIn("text", refused["response"])
        self.assertNotIn("receipt", refused)
        # The confirmed one keeps where the receipt is and the SHA-256 of the receipt as the
        # effect stores it, not the receipt again.
        self.assertEqual(confirmed["verdict"], "confirmed")
        self.assertNotIn("response", confirmed)
        self.assertEqual(confirmed["receipt"], {"on": "effect", "sha256": sha256_hex(stored)})
        self.assertNotIn(record["id"], json.dumps(confirmed))

        # The timeline shows the receipt once, under the effect, and says the hash matches.
        text = self.doctor_full(run)
        self.assertEqual(times_printed(record["id"], text), 1, text)
        self.assertIn('"receipt": "the receipt of its effect, under DETAILS (sha256 matches)"',
                      text)
        self.assertEqual(self.verify("--run", run).returncode, 0)

        # Someone changes the receipt: verify names it, the doctor says so at the call.
        self.query("UPDATE effects SET receipt = receipt || '{\"amount\": 1000}'"
                   " WHERE effect_id = %s", (eid,))
        [(changed,)] = self.query("SELECT receipt::text FROM effects WHERE effect_id = %s",
                                  (eid,))
        rc, doc = self.verify_json("--run", run)
        self.assertEqual((rc, [f["check"] for f in doc["findings"]]),
                         (1, ["effect_receipt_changed"]), json.dumps(doc, indent=1))
        [finding] = doc["findings"]
        self.assertEqual(finding["id"], eid)
        self.assertIn(f"stored a receipt with sha256 {sha256_hex(stored)}", finding["detail"])
        self.assertIn(f"now has sha256 {sha256_hex(changed)}", finding["detail"])
        self.assertIn("NOT the receipt its effect holds now", self.doctor_full(run))

        # A pruned run's receipts are gone on purpose: nothing to report.
        self.query("UPDATE runs SET pruned_at = now() WHERE run_id = %s", (run,))
        self.assertEqual(self.verify("--run", run).returncode, 0)

    def test_results_recorded_together_with_retries_keep_the_hash_too(self):
        # Retries and confirmations finishing together are recorded in one batch by the
        # general path (record.c), whose events are written after the effects: the hash is
        # the one of the receipt each effect holds all the same (the invariant checks it).
        self.dispatcher()
        run = run_id()
        keys = [f"create_hold:{run}-h{i}" for i in range(12)]
        for key in keys[::2]:
            self.fault("refuse_503", key=key, times=1)
        for i in range(12):
            self.publish(self.intent(run, i + 1, "create_hold", {"hold_id": f"{run}-h{i}"}))
        rows = [self.wait_status("create_hold", key, "CONFIRMED") for key in keys]
        for row in rows:
            [(stored,)] = self.query("SELECT receipt::text FROM effects WHERE effect_id = %s",
                                     (row["effect_id"],))
            calls = self.calls(row["effect_id"])
            self.assertEqual(calls[-1]["receipt"], {"on": "effect", "sha256": sha256_hex(stored)})
            self.assertTrue(all("response" in c and "receipt" not in c for c in calls[:-1]))
        self.invariants()

    def test_events_written_by_0_2_0_with_the_receipt_inline_still_read(self):
        self.dispatcher()
        run = run_id()
        [eid] = self.confirmed_charges(run)
        [(stored,)] = self.query("SELECT receipt::text FROM effects WHERE effect_id = %s",
                                 (eid,))
        # The event as 0.2.0 wrote it: the answer inline, no reference. The audit trail is
        # append-only; the superuser lifts that for this one rewrite.
        self.query("ALTER TABLE events DISABLE TRIGGER USER")
        self.query("UPDATE events SET data = (data - 'receipt') || jsonb_build_object("
                   "'response', jsonb_build_object('text', %s::text))"
                   " WHERE effect_id = %s AND kind = 'connector_call'", (stored, eid))
        self.query("ALTER TABLE events ENABLE TRIGGER USER")
        [call] = self.calls(eid)
        self.assertEqual(call["response"]["text"], stored)
        text = self.doctor_full(run)
        self.assertIn('"response": "the receipt of its effect, under DETAILS"', text)
        self.assertEqual(times_printed(json.loads(stored)["id"], text), 1, text)
        self.assertEqual(self.verify("--run", run).returncode, 0)


if __name__ == "__main__":
    main()
