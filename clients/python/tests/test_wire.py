"""The client's pure parts, without Kafka: names, headers, matching, when a wait ends, and
the typed answers. `/usr/bin/python3 -m unittest discover -s clients/python/tests`."""

import base64
import os
import struct
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from tally_client import _requests, _wire  # noqa: E402
from tally_client.errors import (EffectCancelled, EffectConflict, EffectFailed,  # noqa: E402
                                 EffectRejected, IntentRefused, OutcomeTimeout)


def answer(kind, **data):
    base = {"effect_id": "e1", "run_id": "r", "step": 1, "tool": "t", "status": kind.upper(),
            "error": None, "intent_id": "i"}
    base.update(data)
    return {"id": _wire.cloudevent("x", "s", "r", {})["id"], "type": f"tally.effect.{kind}.v1",
            "data": base}


def refused(**data):
    d = {"intent_id": "i", "run_id": "r", "step": 1, "tool": "t", "type": _wire.INTENT,
         "status": "REJECTED", "reason": "unknown_tool", "field": "data.tool",
         "detail": "no tool 't'", "dlq": {"topic": "x", "partition": 0, "offset": 3}}
    d.update(data)
    return {"id": "rej-1", "type": _wire.INTENT_REJECTED, "data": d}


class Names(unittest.TestCase):

    def test_private_reply_topic_is_a_topic_name_under_the_prefix(self):
        t = _wire.private_reply_topic("tally.", "bøt ✓/1")
        self.assertRegex(t, r"^tally\.replies\.b_t___1\.[0-9a-f]{16}$")
        self.assertNotEqual(t, _wire.private_reply_topic("tally.", "bøt ✓/1"))
        long = _wire.private_reply_topic("tally.", "a" * 500)
        self.assertEqual(len(long), 249)
        self.assertIsNone(_wire.reply_topic_refusal(long, 0, "tally.replies."))

    def test_reply_topic_refusal(self):
        self.assertIsNone(_wire.reply_topic_refusal("tally.replies.x", None, "tally.replies."))
        self.assertIn("outside", _wire.reply_topic_refusal("other.x", None, "tally.replies."))
        self.assertIn("[A-Za-z0-9._-]",
                      _wire.reply_topic_refusal("tally.replies.ü", None, "tally.replies."))
        self.assertIn("partition",
                      _wire.reply_topic_refusal("tally.replies.x", -1, "tally.replies."))


class Headers(unittest.TestCase):

    def test_reply_headers(self):
        h = dict(_wire.reply_headers("tally.replies.x", 7, b"abc"))
        self.assertEqual(h["kafka_replyTopic"], b"tally.replies.x")
        self.assertEqual(h["kafka_correlationId"], b"abc")
        self.assertEqual(struct.unpack(">i", h["kafka_replyPartition"]), (7,))
        self.assertNotIn("kafka_replyPartition", dict(_wire.reply_headers("t", None, b"a")))

    def test_correlation_header_wins_over_the_attributes(self):
        ev = {"id": "1", "type": "x", "correlationid": "attr"}
        self.assertEqual(_wire.correlation_of([("kafka_correlationId", b"hdr")], ev), b"hdr")
        self.assertEqual(_wire.correlation_of([], ev), b"attr")
        raw = b"\x00\xffbin"
        ev = {"id": "1", "type": "x", "correlationidbase64": base64.b64encode(raw).decode()}
        self.assertEqual(_wire.correlation_of(None, ev), raw)
        self.assertIsNone(_wire.correlation_of([], {"id": "1", "type": "x",
                                                    "correlationidbase64": "!!"}))

    def test_encode_keeps_utf8_and_decode_wants_a_cloudevent(self):
        ev = _wire.intent_event("/a", "r", "étape", "t", {"x": "€😀"})
        self.assertIn("€😀".encode(), _wire.encode(ev))
        self.assertEqual(_wire.decode(_wire.encode(ev)), ev)
        for bad in (b"\xff", b"[]", b'{"id": 1, "type": "x"}', b"null"):
            self.assertIsNone(_wire.decode(bad))


class Waiting(unittest.TestCase):

    def finish(self, request, answers, timeout=1.0):
        index = _requests.first_settling(answers, 0, request.settles)
        return request.finish(answers, index, timeout)

    def call(self, first=False):
        return _requests.call("/a", "r", None, 1, "t", {}, first=first, operation_key=None,
                              traceparent=None)

    def test_a_call_waits_through_unknown_to_the_final_answer(self):
        answers = [answer("unknown"), answer("stuck"), answer("confirmed", replay=True),
                   answer("compensated")]
        o = self.finish(self.call(), answers)
        self.assertEqual((o.status, o.replay), ("CONFIRMED", True))
        self.assertEqual([h.status for h in o.history], ["UNKNOWN", "STUCK", "CONFIRMED"])
        self.assertEqual(self.finish(self.call(first=True), answers).status, "UNKNOWN")

    def test_final_answers_that_are_not_done_raise(self):
        for kind, cls in (("failed", EffectFailed), ("conflict", EffectConflict),
                          ("rejected", EffectRejected), ("cancelled", EffectCancelled)):
            err = {"code": "c-" + kind, "message": "m"}
            with self.assertRaises(cls) as cm:
                self.finish(self.call(), [answer("awaiting_approval"), answer(kind, error=err)])
            self.assertEqual((cm.exception.code, cm.exception.message), ("c-" + kind, "m"))
            self.assertEqual(cm.exception.outcome.status, kind.upper())
        # first=True returns it instead.
        self.assertEqual(self.finish(self.call(first=True), [answer("failed")]).status, "FAILED")

    def test_a_refusal_raises_intent_refused(self):
        with self.assertRaises(IntentRefused) as cm:
            self.finish(self.call(), [refused()])
        e = cm.exception
        self.assertEqual((e.reason, e.field, e.detail), ("unknown_tool", "data.tool",
                                                         "no tool 't'"))
        self.assertEqual(e.dlq["offset"], 3)
        self.assertEqual(e.outcome.status, "REFUSED")

    def test_a_timeout_carries_the_last_answer(self):
        with self.assertRaises(OutcomeTimeout) as cm:
            self.finish(self.call(), [answer("unknown"), answer("awaiting_approval")])
        self.assertEqual(cm.exception.last.status, "AWAITING_APPROVAL")
        self.assertEqual(len(cm.exception.last.history), 2)
        with self.assertRaises(OutcomeTimeout) as cm:
            self.finish(self.call(), [])
        self.assertIsNone(cm.exception.last)

    def test_a_kind_newer_than_the_client_is_judged_by_its_ledger_state(self):
        self.assertFalse(_wire.settles_call(answer("pondering", status="UNKNOWN")))
        self.assertTrue(_wire.settles_call(answer("pondering", status="CONFIRMED")))

    def test_run_messages_wait_for_their_summary(self):
        compensated = {"id": "c", "type": _wire.RUN_COMPENSATED,
                       "data": {"run_id": "r", "status": "PARTIALLY_COMPENSATED",
                                "summary": {"compensated": [{"step": 2}], "skipped": [],
                                            "uncompensatable": [], "failed": []}}}
        cancelled = {"id": "x", "type": _wire.RUN_CANCELLED,
                     "data": {"run_id": "r", "status": "CANCELLED", "effects_cancelled": 2}}
        s = self.finish(_requests.cancel("/a", "r", "why", True), [cancelled, compensated])
        self.assertEqual((s.status, s.compensated), ("PARTIALLY_COMPENSATED", [{"step": 2}]))
        self.assertEqual(len(s.history), 2)
        s = self.finish(_requests.cancel("/a", "r", "why", False), [cancelled, compensated])
        self.assertEqual((s.status, s.effects_cancelled), ("CANCELLED", 2))
        with self.assertRaises(IntentRefused) as cm:
            self.finish(_requests.complete("/a", "r", None),
                        [refused(reason="run_not_active", dlq=None)])
        self.assertEqual(cm.exception.reason, "run_not_active")
        with self.assertRaises(OutcomeTimeout):
            self.finish(_requests.complete("/a", "r", None), [compensated])

    def test_steps_and_arguments_are_checked_for_type_only(self):
        for bad in (True, 1.5, None):
            with self.assertRaises(TypeError):
                _requests.call("/a", "r", None, bad, "t", {}, first=False,
                               operation_key=None, traceparent=None)
        with self.assertRaises(TypeError):
            _requests.call("/a", "r", None, 1, "t", [], first=False, operation_key=None,
                           traceparent=None)
        ev = _requests.compensate("/a", "r", "why").event
        self.assertEqual((ev["type"], ev["data"]), (_wire.COMPENSATE_RUN,
                                                    {"run_id": "r", "reason": "why"}))
        ev = _requests.cancel("/a", "r", "why", False).event
        self.assertNotIn("compensate", ev["data"])


if __name__ == "__main__":
    unittest.main()
