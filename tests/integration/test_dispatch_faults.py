"""Dispatcher against a misbehaving tool: every DESIGN §6 answer lands in the right state,
UNKNOWN is never retried blindly, and a lease that was taken over cannot be written."""

import shlex
import time

from dispatchcase import DispatchCase, main, run_id
from invariants import check_invariants
from tallytest import wait_for


class DispatchFaultsTest(DispatchCase):

    def test_4xx_is_failed(self):
        d = self.dispatcher()
        run = run_id()
        key = f"create_hold:{run}-h"
        self.fault("error_4xx", key=key, status=422)
        ce = self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h"}))
        row = self.wait_status("create_hold", key, "FAILED")
        self.assertEqual(row["error_code"], "http_422")
        [ev] = self.outcomes_for([ce["id"]])[ce["id"]]
        self.assertEqual(ev["type"], "tally.effect.failed.v1")
        self.assertEqual(ev["data"]["error"]["code"], "http_422")
        time.sleep(1)
        self.assertEqual(len(self.requests(key)), 1)
        self.assert_inflight_settled(d, "tally_connector_inflight")  # answered with an error
        self.invariants()

    def test_503_is_retried_then_confirmed(self):
        self.dispatcher()
        run = run_id()
        key = f"create_hold:{run}-h"
        self.fault("refuse_503", key=key, times=2)
        ce = self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h"}))
        row = self.wait_status("create_hold", key, "CONFIRMED", timeout=30)
        self.assertEqual(row["attempts"], 3)
        statuses = [r["status"] for r in self.requests(key)]
        self.assertEqual(statuses, [503, 503, 201])
        [ev] = self.outcomes_for([ce["id"]])[ce["id"]]
        self.assertEqual(ev["type"], "tally.effect.confirmed.v1")
        self.assertEqual(ev["data"]["attempts"], 3)
        # Retry-After: 1 was honoured: the attempts are at least a second apart.
        times = self.query("SELECT occurred_at FROM events WHERE effect_id = %s"
                           " AND kind = 'connector_call' ORDER BY seq", (row["effect_id"],))
        self.assertGreaterEqual((times[1][0] - times[0][0]).total_seconds(), 0.9)
        self.invariants()

    def test_attempt_cap_fails_with_attempts_exhausted(self):
        self.dispatcher()
        run = run_id()
        key = f"create_hold:{run}-h"
        self.fault("refuse_429", key=key, times=-1)
        self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h"}))
        row = self.wait_status("create_hold", key, "FAILED", timeout=60)
        self.assertEqual(row["error_code"], "attempts_exhausted")
        self.assertEqual(row["attempts"], 5)
        self.assertEqual(len(self.requests(key)), 5)
        self.assertEqual(self.records("holds"), [])
        self.invariants()

    def test_5xx_after_apply_is_unknown_and_not_called_again(self):
        self.dispatcher()
        run = run_id()
        key = f"charge_card:t1:{run}-p"
        self.fault("fail_after_apply", key=key, status=500)
        ce = self.publish(self.intent(run, 1, "charge_card",
                                      {"tenant_id": "t1", "payment_id": f"{run}-p", "amount": 5}))
        row = self.wait_status("charge_card", key, "UNKNOWN")
        self.assertEqual(row["error_code"], "http_500")
        [ev] = self.outcomes_for([ce["id"]])[ce["id"]]
        self.assertEqual(ev["type"], "tally.effect.unknown.v1")
        time.sleep(2)
        self.assertEqual(len(self.requests(key)), 1)
        self.assertEqual(len(self.records("charges")), 1)  # it did apply upstream
        self.assertIsNotNone(self.scalar("SELECT unknown_since FROM effects WHERE effect_id = %s",
                                         (row["effect_id"],)))
        self.invariants(allow_unknown_applied=True)

    def test_timeout_after_apply_is_unknown_and_not_called_again(self):
        d = self.dispatcher()
        self.assert_inflight_settled(d, "tally_connector_inflight")
        run = run_id()
        key = f"send_email:{run}-m"
        # The tool's timeout is 2 s; it applies and then answers after 4 s.
        self.fault("apply_then_hang", key=key, delay_ms=4000)
        ce = self.publish(self.intent(run, 1, "send_email", {"message_id": f"{run}-m"}))
        # the held call is in flight for its tool alone, until it times out
        held = self.wait_tool_inflight(d, "tally_connector_inflight", "send_email", 1)
        self.assertEqual(sum(held.values()), 1, held)
        row = self.wait_status("send_email", key, "UNKNOWN", timeout=30)
        self.assertEqual(row["error_code"], "timeout")
        [ev] = self.outcomes_for([ce["id"]])[ce["id"]]
        self.assertEqual(ev["type"], "tally.effect.unknown.v1")
        time.sleep(3)
        self.assertEqual(len(self.requests(key)), 1)
        self.assertEqual(self.effect("send_email", key)["status"], "UNKNOWN")
        self.assert_inflight_settled(d, "tally_connector_inflight")  # timed out
        self.invariants(allow_unknown_applied=True)

    def test_connection_dropped_after_apply_is_unknown_and_sent_once(self):
        d = self.dispatcher()
        run = run_id()
        # Warm the dispatcher's connection pool first: a dropped *reused* connection is the
        # case where curl would silently send the request again.
        self.publish(self.intent(run, 1, "update_ledger", {"entry_id": f"{run}-warm"}))
        self.wait_status("update_ledger", f"update_ledger:{run}-warm", "CONFIRMED")
        key = f"create_hold:{run}-h"
        self.fault("drop_connection", key=key)
        self.publish(self.intent(run, 2, "create_hold", {"hold_id": f"{run}-h"}))
        row = self.wait_status("create_hold", key, "UNKNOWN")
        self.assertIn(row["error_code"], ("empty_reply", "connection_reset"))
        time.sleep(1)
        self.assertEqual(len(self.requests(key)), 1)
        self.assert_inflight_settled(d, "tally_connector_inflight")  # the connection dropped
        self.invariants(allow_unknown_applied=True)

    def test_timeout_of_an_idempotent_tool_is_retried_with_the_same_key(self):
        self.dispatcher()
        run = run_id()
        key = f"update_ledger:{run}-e"
        self.fault("apply_then_hang", key=key, delay_ms=3000)
        self.publish(self.intent(run, 1, "update_ledger", {"entry_id": f"{run}-e"}))
        row = self.wait_status("update_ledger", key, "CONFIRMED", timeout=30)
        self.assertEqual(row["attempts"], 2)
        reqs = self.requests(key)
        self.assertEqual(len(reqs), 2)
        self.assertEqual(len(self.records("ledger_entries")), 1)  # the tool deduplicated
        self.invariants()

    def test_refused_credentials_fail_and_page_the_owner(self):
        self.dispatcher()
        run = run_id()
        key = f"charge_card:t1:{run}-p"
        self.fault("error_4xx", key=key, status=401)
        self.publish(self.intent(run, 1, "charge_card",
                                 {"tenant_id": "t1", "payment_id": f"{run}-p"}))
        row = self.wait_status("charge_card", key, "FAILED")
        self.assertEqual(row["error_code"], "http_401")
        alert = self.query("SELECT status, reason, effect_id::text FROM alerts"
                           " WHERE dedup_key = 'auth:charge_card'")
        self.assertEqual(alert, [("TRIGGERED", "auth_failed", row["effect_id"])])
        [ev] = self.read_until("alerts", lambda got: len(got) >= 1)
        self.assertEqual(ev["type"], "tally.alert.trigger.v1")
        self.assertEqual(ev["data"]["dedup_key"], "auth:charge_card")
        self.assertIn("billing", ev["data"]["summary"])
        # the page's own command closes it, run exactly as given; the effect stays FAILED
        command = ev["data"]["resolve_command"]
        argv = shlex.split(command, comments=True)
        self.assertEqual(argv[:4], ["tally", "resolve", "--alert", "auth:charge_card"], command)
        closed = self.cli(*argv[1:])
        self.assertEqual(closed.returncode, 0, closed.stderr)
        self.assertEqual(self.query("SELECT status FROM alerts"
                                    " WHERE dedup_key = 'auth:charge_card'"), [("RESOLVED",)])
        self.assertEqual(self.effect("charge_card", key)["status"], "FAILED")
        self.invariants()

    def test_a_taken_over_lease_cannot_write_its_late_result(self):
        d = self.dispatcher()
        run = run_id()
        key = f"create_hold:{run}-h"
        self.fault("slow", key=key, delay_ms=1500)
        self.publish(self.intent(run, 1, "create_hold", {"hold_id": f"{run}-h"}))
        row = self.wait_status("create_hold", key, "DISPATCHING", timeout=30)
        self.wait_tool_inflight(d, "tally_connector_inflight", "create_hold", 1)
        # Another worker takes the effect over while the call is still running.
        self.query("UPDATE effects SET lease_epoch = lease_epoch + 1, lease_owner = 'takeover',"
                   " lease_until = now() + interval '1 hour' WHERE effect_id = %s",
                   (row["effect_id"],))
        wait_for(lambda: any(r["status"] for r in self.requests(key)), timeout=20,
                 what="the slow call to finish")
        time.sleep(1.5)
        after = self.query("SELECT status, lease_owner, receipt FROM effects"
                           " WHERE effect_id = %s", (row["effect_id"],))
        self.assertEqual(after, [("DISPATCHING", "takeover", None)])
        self.assertEqual(self.scalar("SELECT count(*) FROM events WHERE effect_id = %s"
                                     " AND kind = 'connector_call'", (row["effect_id"],)), 0)
        status, text = d.http_get("/metrics")
        self.assertIn("tally_lease_lost_total 1", text)
        self.assert_inflight_settled(d, "tally_connector_inflight")  # its result dropped
        # SQL only: the upstream record belongs to the lease the takeover now holds.
        check_invariants(self)


if __name__ == "__main__":
    main()
