"""tally-fake-tool on its own: the connector protocol (DESIGN.md §6) as a tool service speaks
it (list included: docs/connectors.md), every switchable fault, request signatures and the
control API the other tests rely on.
No PostgreSQL or Kafka: the binary is started directly and spoken to with urllib."""

import concurrent.futures
import datetime
import hashlib
import hmac
import http.client
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.parse
import urllib.request

import tallytest

NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, ConnectionError,
                  TimeoutError, OSError)


class FakeTool:
    """One tally-fake-tool process on a free port."""

    def __init__(self, *args, env=None):
        self.tmp = tempfile.mkdtemp(prefix="tally-fake-tool-")
        port_file = os.path.join(self.tmp, "port")
        self.log_path = os.path.join(self.tmp, "stderr.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [tallytest.binary("tally-fake-tool"), "--listen", "127.0.0.1:0",
             "--port-file", port_file, *args],
            stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=dict(os.environ, **(env or {})))
        self.banner = self.proc.stdout.readline().strip()
        tallytest.wait_for(lambda: os.path.exists(port_file) or self.proc.poll() is not None,
                           timeout=10, what="the port file")
        if self.proc.poll() is not None:
            raise RuntimeError(f"tally-fake-tool exited: {self.log()}")
        with open(port_file) as f:
            self.port = int(f.read())
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def request(self, method, path, body=None, headers=None, timeout=5):
        """(status, headers, parsed JSON or raw text) of one request; HTTP errors included."""
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            body = body.encode()
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, hdrs, raw = r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            status, hdrs, raw = e.code, e.headers, e.read()
        try:
            return status, hdrs, json.loads(raw)
        except ValueError:
            return status, hdrs, raw.decode(errors="replace")

    def execute(self, collection, key, body, timeout=5, **headers):
        return self.request("POST", f"/{collection}", body,
                            {"Idempotency-Key": key, **headers}, timeout=timeout)

    def status_of(self, collection, key):
        return self.request("GET", f"/{collection}?idempotency_key={key}")

    def reverse(self, collection, reverse_key, ref, **headers):
        body = {"external_ref": ref, "receipt": {"id": ref}, "args": {}, "reason": "test"}
        return self.request("POST", f"/{collection}/reverse", body,
                            {"Idempotency-Key": reverse_key, **headers})

    def list_records(self, collection, headers=None, **params):
        """GET /<collection>/list with `params` percent-encoded, as tally sends it."""
        query = urllib.parse.urlencode(params, quote_via=urllib.parse.quote)
        return self.request("GET", f"/{collection}/list?{query}", headers=headers)

    def list_all(self, collection, **params):
        """Every page of a list, followed by next_cursor: (records, number of pages)."""
        records, pages, cursor = [], 0, None
        while True:
            extra = {"cursor": cursor} if cursor else {}
            status, _, page = self.list_records(collection, **params, **extra)
            assert status == 200, (status, page)
            records += page["records"]
            pages += 1
            cursor = page["next_cursor"]
            if cursor is None:
                return records, pages
            assert pages < 10000, "next_cursor never ends"

    def fault(self, **rule):
        """Adds a fault rule (tests/fakes/README.md): fault, collection, op (execute, status,
        reverse, contain, list), key, times, delay_ms, status, size. For example
        fault(fault="apply_twice", key=K) applies K's execute twice and answers 201 with the
        first record (a duplicate behind a success; status=200..299 for another 2xx,
        4xx/5xx for an error answer instead), and fault(fault="fail_after_apply", status=422)
        applies once and answers 422 (a record for an effect tally holds as FAILED)."""
        status, _, body = self.request("POST", "/_control/faults", rule)
        assert status == 201, (status, body)
        return body

    def records(self, collection=None):
        path = "/_control/records" + (f"?collection={collection}" if collection else "")
        status, _, body = self.request("GET", path)
        assert status == 200, (status, body)
        return body

    def requests(self):
        status, _, body = self.request("GET", "/_control/requests")
        assert status == 200, (status, body)
        return body

    def stop(self, timeout=10):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self._log.close()


class FakeToolCase(unittest.TestCase):
    tool_args = ()
    tool_env = None

    @classmethod
    def setUpClass(cls):
        cls.tool = FakeTool(*cls.tool_args, env=cls.tool_env)

    @classmethod
    def tearDownClass(cls):
        rc = cls.tool.stop()
        if rc != 0:
            raise AssertionError(f"tally-fake-tool exited {rc}: {cls.tool.log()}")

    def setUp(self):
        status, _, _ = self.tool.request("POST", "/_control/reset", b"")
        self.assertEqual(status, 200)


class ProtocolTest(FakeToolCase):

    def test_banner_and_port_file_agree(self):
        self.assertEqual(self.tool.banner, f"listening on http://127.0.0.1:{self.tool.port}")

    def test_execute_creates_a_record_and_replays_it(self):
        body = b'{"amount":500,"payment_id":"p1"}'
        status, hdrs, rec = self.tool.execute("charges", "charge:p1", body,
                                              **{"Tally-Run-Id": "run-1",
                                                 "Tally-Effect-Id": "eff-1"})
        self.assertEqual(status, 201)
        self.assertIsNone(hdrs.get("Idempotent-Replayed"))
        self.assertRegex(rec["id"], r"^charges_\d+$")
        self.assertEqual(rec["collection"], "charges")
        self.assertEqual(rec["idempotency_key"], "charge:p1")
        self.assertEqual(rec["body"], {"amount": 500, "payment_id": "p1"})
        self.assertEqual((rec["status"], rec["version"]), ("active", 1))
        self.assertEqual((rec["run_id"], rec["effect_id"]), ("run-1", "eff-1"))
        self.assertRegex(rec["created_at"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")

        status, hdrs, again = self.tool.execute("charges", "charge:p1", body)
        self.assertEqual(status, 200)
        self.assertEqual(hdrs.get("Idempotent-Replayed"), "true")
        self.assertEqual(again, rec)
        self.assertEqual(len(self.tool.records()["records"]), 1)

    def test_records_show_strings_and_bodies_as_sent(self):
        # The answer is written as text: quotes and backslashes escaped, UTF-8 kept (http.client
        # sends header values as Latin-1, so "Ã©" goes out as the UTF-8 bytes of "é"), the body
        # as it came, whitespace and all.
        key = 'k"\\1'
        status, _, rec = self.tool.execute("charges", key, b'{ "n" : 1,\n "s": "\\u00e9" }',
                                           **{"Tally-Run-Id": "run-\u00c3\u00a9"})
        self.assertEqual(status, 201, rec)
        self.assertEqual(rec["idempotency_key"], key)
        self.assertEqual(rec["run_id"], "run-\u00e9")
        self.assertEqual(rec["body"], {"n": 1, "s": "\u00e9"})
        status, _, found = self.tool.status_of("charges", urllib.parse.quote(key))
        self.assertEqual((status, found), (200, [rec]))
        self.assertEqual(self.tool.requests()[-1]["idempotency_key"], key)

        # A key, run id or effect id that is not UTF-8 could not be shown as JSON: refused
        # (byte 0xFF: http.client sends "\u00ff" as that one byte), and nothing is applied.
        for bad_key, headers, name in [("k\u00ff", {}, "Idempotency-Key"),
                                       ("k2", {"Tally-Run-Id": "\u00ff"}, "Tally-Run-Id"),
                                       ("k3", {"Tally-Effect-Id": "e\u00ff"}, "Tally-Effect-Id")]:
            status, _, body = self.tool.execute("charges", bad_key, b"{}", **headers)
            self.assertEqual(status, 400, body)
            self.assertEqual(body, {"error": f"the {name} header must be UTF-8"})
        status, _, body = self.tool.status_of("charges", "k%FF")
        self.assertEqual((status, body),
                         (400, {"error": "the idempotency_key query parameter must be UTF-8"}))
        self.assertEqual([r["idempotency_key"] for r in self.tool.records()["records"]], [key])

    def test_same_key_with_other_bytes_is_422(self):
        self.assertEqual(self.tool.execute("charges", "k", b'{"a":1,"b":2}')[0], 201)
        status, _, body = self.tool.execute("charges", "k", b'{"b":2,"a":1}')
        self.assertEqual(status, 422)
        self.assertEqual(body, {"error": "idempotency key reused with a different body"})
        # The same key in another collection is another operation.
        self.assertEqual(self.tool.execute("emails", "k", b'{"b":2,"a":1}')[0], 201)

    def test_bad_requests(self):
        self.assertEqual(self.tool.request("POST", "/charges", b'{"a":1}')[0], 400)
        self.assertEqual(self.tool.execute("charges", "k", b"not json")[0], 400)
        self.assertEqual(self.tool.execute("charges", "k", b"")[0], 400)
        self.assertEqual(self.tool.request("GET", "/charges")[0], 400)
        self.assertEqual(self.tool.request("POST", "/Charges", b"{}")[0], 404)
        self.assertEqual(self.tool.request("POST", "/charges/other", b"{}")[0], 404)
        status, hdrs, _ = self.tool.request("PUT", "/charges", b"{}")
        self.assertEqual(status, 405)
        self.assertIn("POST", hdrs.get("Allow"))
        status, _, _ = self.tool.reverse("charges", "reverse:o1", None)
        self.assertEqual(status, 400)
        self.assertEqual(self.tool.records()["records"], [])

    def test_status_finds_zero_one_or_two_records(self):
        self.assertEqual(self.tool.status_of("charges", "s1")[:3:2], (200, []))
        _, _, rec = self.tool.execute("charges", "s1", {"x": 1})
        self.assertEqual(self.tool.status_of("charges", "s1")[2], [rec])
        self.tool.fault(collection="charges", op="execute", key="s2", fault="apply_twice")
        status, _, first = self.tool.execute("charges", "s2", {"x": 2})
        self.assertEqual(status, 201)
        found = self.tool.status_of("charges", "s2")[2]
        self.assertEqual(len(found), 2)
        self.assertEqual(found[0], first)
        self.assertNotEqual(found[0]["id"], found[1]["id"])
        self.assertEqual({r["idempotency_key"] for r in found}, {"s2"})
        # With a status: applied twice, and the answer is an error (the duplicate goes unseen).
        self.tool.fault(collection="charges", op="execute", key="s3", fault="apply_twice",
                        status=500)
        self.assertEqual(self.tool.execute("charges", "s3", {"x": 3})[0], 500)
        self.assertEqual(len(self.tool.status_of("charges", "s3")[2]), 2)

    def test_reverse_happy_path_and_replay(self):
        _, _, rec = self.tool.execute("charges", "r1", {"x": 1})
        status, hdrs, rev = self.tool.reverse("charges", "reverse:o1", rec["id"],
                                              **{"If-Match": "1"})
        self.assertEqual(status, 201, rev)
        self.assertRegex(rev["id"], r"^rev_\d+$")
        self.assertEqual((rev["reverses"], rev["reverse_key"]), (rec["id"], "reverse:o1"))
        now = self.tool.status_of("charges", "r1")[2][0]
        self.assertEqual((now["status"], now["version"]), ("reversed", 2))

        status, hdrs, again = self.tool.reverse("charges", "reverse:o1", rec["id"])
        self.assertEqual(status, 200)
        self.assertEqual(hdrs.get("Idempotent-Replayed"), "true")
        self.assertEqual(again, rev)
        records = self.tool.records()
        self.assertEqual(records["reversals"], [rev])

    def test_reverse_refusals(self):
        status, _, body = self.tool.reverse("charges", "reverse:o1", "charges_999")
        self.assertEqual((status, body), (404, {"error": "unknown external_ref"}))
        _, _, rec = self.tool.execute("charges", "r2", {"x": 1})
        # A ref of another collection is unknown here.
        self.assertEqual(self.tool.reverse("refunds", "reverse:o1", rec["id"])[0], 404)

        status, _, body = self.tool.reverse("charges", "reverse:o2", rec["id"],
                                            **{"If-Match": '"7"'})
        self.assertEqual(status, 412, body)
        self.assertEqual(self.tool.status_of("charges", "r2")[2][0]["status"], "active")

        self.assertEqual(self.tool.reverse("charges", "reverse:o3", rec["id"],
                                           **{"If-Match": '"1"'})[0], 201)
        status, _, body = self.tool.reverse("charges", "reverse:o4", rec["id"])
        self.assertEqual((status, body), (404, {"error": "already reversed"}))
        self.assertEqual(len(self.tool.records()["reversals"]), 1)

    def test_contain_records_a_containment(self):
        status, _, c = self.tool.request("POST", "/emails/contain", {"to": "a@b", "why": "oops"},
                                         {"Idempotency-Key": "contain:o1"})
        self.assertEqual(status, 201)
        self.assertEqual(c["collection"], "emails_containments")
        self.assertEqual(self.tool.request("POST", "/emails/contain", {"to": "a@b", "why": "oops"},
                                           {"Idempotency-Key": "contain:o1"})[0], 200)
        records = self.tool.records()
        self.assertEqual(records["records"], [])
        self.assertEqual(records["containments"], [c])
        self.assertEqual(self.tool.records("emails")["containments"], [c])
        self.assertEqual(self.tool.records("charges")["containments"], [])

    def test_control_records_and_requests(self):
        _, _, a = self.tool.execute("charges", "c1", {"n": 1},
                                    traceparent="00-0af7651916cd43dd8448eb211c80319c-"
                                                "b7ad6b7169203331-01",
                                    **{"Tally-Run-Id": "run-9", "Tally-Effect-Id": "e-1"})
        _, _, b = self.tool.execute("emails", "m1", {"n": 2})
        self.tool.reverse("charges", "reverse:x", a["id"])
        records = self.tool.records()
        self.assertEqual([r["id"] for r in records["records"]], [a["id"], b["id"]])
        self.assertEqual(records["requests"], 3)
        self.assertEqual([r["id"] for r in self.tool.records("emails")["records"]], [b["id"]])
        self.assertEqual(self.tool.records("emails")["reversals"], [])

        reqs = self.tool.requests()
        self.assertEqual([(r["method"], r["path"], r["status"]) for r in reqs],
                         [("POST", "/charges", 201), ("POST", "/emails", 201),
                          ("POST", "/charges/reverse", 201)])
        first = reqs[0]
        self.assertEqual(first["idempotency_key"], "c1")
        self.assertEqual((first["run_id"], first["effect_id"]), ("run-9", "e-1"))
        self.assertTrue(first["traceparent"].startswith("00-0af7651916cd43dd"))
        self.assertIsNone(first["signature_ok"])
        self.assertEqual(reqs[2]["idempotency_key"], "reverse:x")

        self.assertEqual(self.tool.request("POST", "/_control/reset", b"")[0], 200)
        self.assertEqual(self.tool.records(),
                         {"records": [], "reversals": [], "containments": [], "requests": 0})
        self.assertEqual(self.tool.requests(), [])

    def test_many_slow_requests_at_once(self):
        """Each slow request holds only its own connection: 300 of 400 ms finish together."""
        self.tool.fault(fault="slow", delay_ms=400, times=-1)
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=300) as pool:
            statuses = list(pool.map(
                lambda i: self.tool.execute("charges", f"slow{i}", {"i": i}, timeout=20)[0],
                range(300)))
        self.assertEqual(statuses, [201] * 300)
        self.assertLess(time.monotonic() - start, 6)
        self.assertEqual(len(self.tool.records()["records"]), 300)


class FaultTest(FakeToolCase):

    def assert_no_records(self):
        self.assertEqual(self.tool.records()["records"], [])

    def test_slow(self):
        self.tool.fault(fault="slow", delay_ms=300)
        start = time.monotonic()
        self.assertEqual(self.tool.execute("charges", "k", {})[0], 201)
        self.assertGreaterEqual(time.monotonic() - start, 0.29)

    def test_refusals_are_not_applied(self):
        for fault, code in (("refuse_503", 503), ("refuse_429", 429)):
            self.tool.fault(fault=fault)
            status, hdrs, _ = self.tool.execute("charges", "k", {})
            self.assertEqual((status, hdrs.get("Retry-After")), (code, "1"), fault)
            self.assert_no_records()
        self.tool.fault(fault="error_4xx")
        self.assertEqual(self.tool.execute("charges", "k", {})[0], 400)
        self.tool.fault(fault="error_4xx", status=403)
        self.assertEqual(self.tool.execute("charges", "k", {})[0], 403)
        self.assert_no_records()
        self.assertEqual(self.tool.execute("charges", "k", {})[0], 201)

    def test_fail_after_apply(self):
        self.tool.fault(fault="fail_after_apply")
        self.assertEqual(self.tool.execute("charges", "k", {"a": 1})[0], 500)
        self.assertEqual(len(self.tool.status_of("charges", "k")[2]), 1)
        self.tool.fault(fault="fail_after_apply", status=502)
        self.assertEqual(self.tool.execute("charges", "k2", {"a": 1})[0], 502)
        self.assertEqual(len(self.tool.records()["records"]), 2)

    def test_fail_after_apply_with_a_4xx_leaves_a_record(self):
        """A call applied but answered 4xx: tally holds the effect FAILED, the tool holds a
        record for it — the orphan the sweep must find."""
        self.tool.fault(fault="fail_after_apply", status=422, key="k4")
        status, _, body = self.tool.execute("charges", "k4", {"a": 1},
                                            **{"Tally-Run-Id": "run-4", "Tally-Effect-Id": "e4"})
        self.assertEqual(status, 422, body)
        self.assertIn("error", body)
        found = self.tool.status_of("charges", "k4")[2]
        self.assertEqual(len(found), 1)
        listed = self.tool.list_records("charges", run_id="run-4")[2]["records"]
        self.assertEqual([r["id"] for r in listed], [found[0]["id"]])
        self.assertEqual(listed[0]["tally_headers"],
                         {"idempotency-key": "k4", "tally-run-id": "run-4",
                          "tally-effect-id": "e4"})
        self.assertEqual(self.tool.requests()[0]["fault"], "fail_after_apply")

    def test_apply_twice_answering_success(self):
        """Applied twice, answered 2xx once with the first record: the duplicate only an audit
        of a CONFIRMED effect can find."""
        headers = {"Tally-Run-Id": "run-2x", "Tally-Effect-Id": "eff-2x"}
        rule = self.tool.fault(fault="apply_twice", collection="charges", key="d1")
        self.assertEqual(rule["status"], 201)
        status, hdrs, answer = self.tool.execute("charges", "d1", {"a": 1}, **headers)
        self.assertEqual(status, 201, answer)
        self.assertIsNone(hdrs.get("Idempotent-Replayed"))
        found = self.tool.status_of("charges", "d1")[2]
        self.assertEqual(len(found), 2)
        self.assertEqual(answer, found[0])
        self.assertNotEqual(found[0]["id"], found[1]["id"])
        listed = self.tool.list_records("charges", run_id="run-2x")[2]["records"]
        self.assertEqual([r["id"] for r in listed], [r["id"] for r in found])
        want = {"idempotency-key": "d1", "tally-run-id": "run-2x", "tally-effect-id": "eff-2x"}
        self.assertEqual([r["tally_headers"] for r in listed], [want, want])
        self.assertEqual({(r["run_id"], r["effect_id"]) for r in listed}, {("run-2x", "eff-2x")})
        log = self.tool.requests()[0]
        self.assertEqual((log["fault"], log["status"]), ("apply_twice", 201))
        # The same key again is an ordinary replay of the first record.
        status, hdrs, again = self.tool.execute("charges", "d1", {"a": 1}, **headers)
        self.assertEqual((status, hdrs.get("Idempotent-Replayed"), again["id"]),
                         (200, "true", found[0]["id"]))
        self.assertEqual(len(self.tool.records()["records"]), 2)

        # Another 2xx is answered as given, with the first record.
        self.tool.fault(fault="apply_twice", key="d2", status=200)
        status, hdrs, answer = self.tool.execute("charges", "d2", {"a": 2})
        self.assertEqual(status, 200, answer)
        self.assertIsNone(hdrs.get("Idempotent-Replayed"))
        self.assertEqual(answer, self.tool.status_of("charges", "d2")[2][0])
        self.assertEqual(len(self.tool.status_of("charges", "d2")[2]), 2)
        # A 4xx: applied twice, answered as a definite failure.
        self.tool.fault(fault="apply_twice", key="d3", status=409)
        self.assertEqual(self.tool.execute("charges", "d3", {"a": 3})[0], 409)
        self.assertEqual(len(self.tool.status_of("charges", "d3")[2]), 2)
        # Containments too.
        self.tool.fault(fault="apply_twice", op="contain", status=202)
        status, _, c = self.tool.request("POST", "/emails/contain", {"x": 1},
                                         {"Idempotency-Key": "contain:o1"})
        self.assertEqual((status, c["collection"]), (202, "emails_containments"))
        self.assertEqual(len(self.tool.records()["containments"]), 2)
        # A redirect is no answer apply_twice gives.
        status, _, body = self.tool.request("POST", "/_control/faults",
                                            {"fault": "apply_twice", "status": 302})
        self.assertEqual(status, 400, body)

    def test_apply_then_hang_times_the_caller_out_after_applying(self):
        self.tool.fault(fault="apply_then_hang", delay_ms=2000)
        with self.assertRaises(NETWORK_ERRORS):
            self.tool.execute("charges", "hang", {"a": 1}, timeout=0.3)
        found = self.tool.status_of("charges", "hang")[2]
        self.assertEqual(len(found), 1)
        self.assertEqual(found[0]["idempotency_key"], "hang")

    def test_hang_before_apply_times_out_without_applying(self):
        self.tool.fault(fault="hang_before_apply", delay_ms=500)
        with self.assertRaises(NETWORK_ERRORS):
            self.tool.execute("charges", "hang", {"a": 1}, timeout=0.2)
        tallytest.wait_for(lambda: self.tool.requests()[0]["status"] == 503, timeout=5,
                           what="the hung request to answer 503")
        self.assertEqual(self.tool.requests()[0]["fault"], "hang_before_apply")
        self.assert_no_records()
        self.tool.fault(fault="hang_before_apply", delay_ms=50)
        self.assertEqual(self.tool.execute("charges", "hang", {"a": 1})[0], 503)
        self.assert_no_records()

    def test_drop_connection_applies_then_closes(self):
        self.tool.fault(fault="drop_connection")
        with self.assertRaises(NETWORK_ERRORS):
            self.tool.execute("charges", "drop", {"a": 1})
        self.assertEqual(len(self.tool.status_of("charges", "drop")[2]), 1)
        last = self.tool.requests()[0]
        self.assertEqual((last["fault"], last["status"]), ("drop_connection", None))

    def test_reverse_faults_are_not_applied(self):
        _, _, rec = self.tool.execute("charges", "k", {"a": 1})
        for fault, code in (("reverse_412", 412), ("reverse_500", 500), ("reverse_409", 409)):
            self.tool.fault(op="reverse", fault=fault)
            self.assertEqual(self.tool.reverse("charges", "reverse:o1", rec["id"])[0], code)
            self.assertEqual(self.tool.status_of("charges", "k")[2][0]["status"], "active")
        self.assertEqual(self.tool.records()["reversals"], [])
        self.assertEqual(self.tool.reverse("charges", "reverse:o1", rec["id"])[0], 201)

    def test_status_faults(self):
        self.tool.execute("charges", "k", {"a": 1})
        self.tool.fault(op="status", fault="status_500")
        self.assertEqual(self.tool.status_of("charges", "k")[0], 500)
        self.tool.fault(op="status", fault="status_garbage")
        status, _, body = self.tool.status_of("charges", "k")
        self.assertEqual(status, 200)
        self.assertIsInstance(body, str)
        with self.assertRaises(ValueError):
            json.loads(body)
        self.assertEqual(len(self.tool.status_of("charges", "k")[2]), 1)

    def test_rules_match_in_order_and_are_consumed(self):
        self.tool.fault(collection="charges", op="execute", key="a", fault="refuse_503", times=2)
        self.tool.fault(collection="*", op="*", key="*", fault="error_4xx", status=409)
        self.tool.fault(collection="emails", fault="refuse_429", times=-1)
        # The first rule matches only key "a"; the catch-all matches once.
        self.assertEqual(self.tool.execute("charges", "b", {})[0], 409)
        self.assertEqual(self.tool.execute("charges", "b", {})[0], 201)
        self.assertEqual(self.tool.execute("charges", "a", {})[0], 503)
        self.assertEqual(self.tool.execute("charges", "a", {})[0], 503)
        self.assertEqual(self.tool.execute("charges", "a", {})[0], 201)
        for _ in range(3):
            self.assertEqual(self.tool.execute("emails", "e", {})[0], 429)
        status, _, listed = self.tool.request("GET", "/_control/faults")
        self.assertEqual([r["fault"] for r in listed["faults"]], ["refuse_429"])
        self.assertEqual(self.tool.request("DELETE", "/_control/faults")[0], 200)
        self.assertEqual(self.tool.execute("emails", "e", {})[0], 201)

    def test_bad_rules_are_refused(self):
        for rule in ({"fault": "explode"}, {"op": "delete", "fault": "slow"},
                     {"fault": "slow", "times": 0}, {"fault": "error_4xx", "status": 500},
                     {"collection": "Bad", "fault": "slow"}, {}):
            status, _, body = self.tool.request("POST", "/_control/faults", rule)
            self.assertEqual(status, 400, rule)
            self.assertIn("error", body)

def as_header(text):
    """A str whose Latin-1 encoding (what http.client sends) is the UTF-8 of `text`."""
    return text.encode().decode("latin-1")


def rfc3339(dt):
    """A datetime with tzinfo as RFC 3339 with milliseconds and a numeric offset."""
    return dt.isoformat(timespec="milliseconds")


def parse_created(text):
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


class ListTest(FakeToolCase):
    """GET /<collection>/list: the records a tool holds for a run or since a time, with the Tally
    headers each was created with (docs/connectors.md, "list")."""

    def make(self, collection, key, run=None, effect=None, pause=0.003):
        headers = {}
        if run is not None:
            headers["Tally-Run-Id"] = as_header(run)
        if effect is not None:
            headers["Tally-Effect-Id"] = effect
        status, _, rec = self.tool.execute(collection, key, {"k": key}, **headers)
        self.assertEqual(status, 201, rec)
        time.sleep(pause)  # distinct created_at milliseconds, so since can fall between them
        return rec

    def with_headers(self, rec):
        h = {"idempotency-key": rec["idempotency_key"]}
        if rec["run_id"] is not None:
            h["tally-run-id"] = rec["run_id"]
        if rec["effect_id"] is not None:
            h["tally-effect-id"] = rec["effect_id"]
        return dict(rec, tally_headers=h)

    def test_list_since_a_time(self):
        a = self.make("charges", "a", run="r1", effect="e-a")
        other = self.make("emails", "m", run="r1")
        b = self.make("charges", "b")
        self.tool.request("POST", "/charges/contain", {"c": 1}, {"Idempotency-Key": "contain:1"})
        c = self.make("charges", "c", run="r2", effect="e-c")
        self.tool.reverse("charges", "reverse:x", b["id"])
        b = self.tool.status_of("charges", "b")[2][0]  # now reversed, version 2

        since = parse_created(a["created_at"])
        status, _, page = self.tool.list_records("charges", since=a["created_at"])
        self.assertEqual(status, 200, page)
        # Oldest first, only this collection, each as status shows it plus tally_headers.
        self.assertEqual(page, {"records": [self.with_headers(r) for r in (a, b, c)],
                                "next_cursor": None})
        self.assertEqual(page["records"][1]["status"], "reversed")
        # "At or after": the same instant in another offset, and the boundaries around b.
        same = rfc3339(since.astimezone(datetime.timezone(datetime.timedelta(hours=-5, minutes=-30))))
        self.assertEqual(self.tool.list_records("charges", since=same)[2], page)
        self.assertEqual([r["id"] for r in self.tool.list_records(
            "charges", since=b["created_at"])[2]["records"]], [b["id"], c["id"]])
        just_after_b = b["created_at"].replace("Z", "0001Z")  # 100 ns later
        self.assertEqual([r["id"] for r in self.tool.list_records(
            "charges", since=just_after_b)[2]["records"]], [c["id"]])
        later = rfc3339(parse_created(c["created_at"]) + datetime.timedelta(milliseconds=1))
        self.assertEqual(self.tool.list_records("charges", since=later)[2],
                         {"records": [], "next_cursor": None})
        self.assertEqual(self.tool.list_records("charges", since="1970-01-01T00:00:00Z")[2],
                         page)
        # The other collections list their own: emails, and charges' containments.
        self.assertEqual(self.tool.list_records("emails", since=a["created_at"])[2]["records"],
                         [self.with_headers(other)])
        conts = self.tool.list_records("charges_containments", since="2000-01-01T00:00:00Z")
        self.assertEqual([r["idempotency_key"] for r in conts[2]["records"]], ["contain:1"])
        self.assertEqual(self.tool.list_records("refunds", since="2000-01-01T00:00:00Z")[:3:2],
                         (200, {"records": [], "next_cursor": None}))
        self.assertEqual([r["op"] for r in self.tool.requests() if r["path"].endswith("/list")],
                         ["list"] * 9)

    def test_list_for_a_run(self):
        run = "run-\u00e9\u00df-\u65e5\u672c-\U0001F600"  # two-, three- and four-byte UTF-8
        a = self.make("charges", "a", run=run, effect="e1")
        self.make("charges", "x", run=run + "-other", effect="e2")
        self.make("charges", "y", run="run-")  # a prefix of the others
        self.make("charges", "z")
        m = self.make("emails", "m", run=run)
        b = self.make("charges", "b", run=run)
        status, _, page = self.tool.list_records("charges", run_id=run)
        self.assertEqual(status, 200, page)
        self.assertEqual(page, {"records": [self.with_headers(a), self.with_headers(b)],
                                "next_cursor": None})
        self.assertEqual(page["records"][0]["tally_headers"],
                         {"idempotency-key": "a", "tally-run-id": run, "tally-effect-id": "e1"})
        self.assertEqual(page["records"][1]["tally_headers"],
                         {"idempotency-key": "b", "tally-run-id": run})
        self.assertEqual(self.tool.list_records("emails", run_id=run)[2]["records"],
                         [self.with_headers(m)])
        self.assertEqual(self.tool.list_records("charges", run_id="no-such-run")[2],
                         {"records": [], "next_cursor": None})
        self.assertEqual(self.tool.list_records("charges", run_id="run")[2]["records"], [])

    def test_paging_with_cursors(self):
        mine = [self.make("charges", f"p{i}", run="paged", pause=0)["id"] for i in range(7)]
        self.make("charges", "noise", run="other", pause=0)
        mine += [self.make("charges", f"p{i}", run="paged", pause=0)["id"] for i in range(7, 9)]
        everything = [r["id"] for r in self.tool.records("charges")["records"]]
        self.assertEqual(len(everything), 10)
        for params, want in (({"run_id": "paged"}, mine),
                             ({"since": "2000-01-01T00:00:00Z"}, everything)):
            for limit in (1, 2, 3, 4, 9, 10, 11):
                records, pages = self.tool.list_all("charges", limit=limit, **params)
                self.assertEqual([r["id"] for r in records], want, (params, limit))
                self.assertEqual(pages, max(1, -(-len(want) // limit)), (params, limit))
            status, _, first = self.tool.list_records("charges", limit=3, **params)
            self.assertEqual((status, len(first["records"])), (200, 3))
            self.assertIsInstance(first["next_cursor"], str)
            # A cursor belongs to its query: another since or run, or a reset, refuses it.
            cursor = first["next_cursor"]
            for other in ({"run_id": "other"}, {"since": "2000-01-01T00:00:00.001Z"}):
                status, _, body = self.tool.list_records("charges", cursor=cursor, **other)
                self.assertEqual(status, 400, (other, body))
                self.assertIn("cursor", body["error"])
            self.assertEqual(self.tool.list_records("emails", cursor=cursor, **params)[0], 400)

        # A record created between pages shows on a later page.
        status, _, first = self.tool.list_records("charges", run_id="paged", limit=8)
        late = self.make("charges", "late", run="paged")["id"]
        status, _, rest = self.tool.list_records("charges", run_id="paged", limit=8,
                                                 cursor=first["next_cursor"])
        self.assertEqual([r["id"] for r in first["records"] + rest["records"]], mine + [late])
        self.assertIsNone(rest["next_cursor"])

        cursor = first["next_cursor"]
        self.assertEqual(self.tool.request("POST", "/_control/reset", b"")[0], 200)
        self.make("charges", "p0", run="paged")
        self.assertEqual(self.tool.list_records("charges", run_id="paged", cursor=cursor)[0], 400)

    def test_default_and_maximum_page(self):
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            statuses = list(pool.map(
                lambda i: self.tool.execute("charges", f"m{i}", {"i": i},
                                            **{"Tally-Run-Id": "big"})[0], range(1003)))
        self.assertEqual(statuses, [201] * 1003)
        status, _, page = self.tool.list_records("charges", run_id="big")
        self.assertEqual((status, len(page["records"])), (200, 100))  # the default limit
        # A limit above 1000, however large, is served as 1000.
        for limit in ("1000", "1001", "99999999999999999999999999999999"):
            status, _, page = self.tool.list_records("charges", since="2000-01-01T00:00:00Z",
                                                     limit=limit)
            self.assertEqual((status, len(page["records"])), (200, 1000), limit)
            self.assertIsNotNone(page["next_cursor"])
        records, pages = self.tool.list_all("charges", run_id="big", limit=10 ** 40)
        self.assertEqual((len(records), pages), (1003, 2))
        self.assertEqual(len({r["id"] for r in records}), 1003)
        ids = [int(r["id"].split("_")[1]) for r in records]
        self.assertEqual(ids, sorted(ids))

    def test_bad_parameters_are_400_and_the_service_keeps_serving(self):
        rec = self.make("charges", "k", run="r")
        since = "2000-01-01T00:00:00Z"
        bad = [
            "", "limit=5", "since=", "since", "run_id=", "run_id",
            "since=yesterday", "since=1764200000", "since=2026-11-26",
            "since=2026-11-26T23:32:27", "since=2026-11-26%2023:32:27Z",
            "since=2026-11-26T23:32:27+00:00",  # '+' unencoded arrives as a space
            "since=2026-11-26T23:32:27.Z", "since=2026-13-01T00:00:00Z",
            "since=2026-02-29T00:00:00Z", "since=2026-11-26T24:00:00Z",
            "since=2026-11-26T23:32:27%2B24:00", "since=2026-11-26T23:32:27Zjunk",
            "since=%C3%A9", "since=2026-11-26T23:32:27%00Z",
            "run_id=%FF", "run_id=r%00x", f"run_id=r&since={since}", "run_id=r&run_id=r",
            f"since={since}&since={since}", "run_id=r&extra=1", "run_id=r&%C3%A9=1",
            "run_id=r&idempotency_key=k", "run_id=r&Limit=5",
            "run_id=r&limit=", "run_id=r&limit=0", "run_id=r&limit=-1", "run_id=r&limit=abc",
            "run_id=r&limit=1e3", "run_id=r&limit=%2B5", "run_id=r&limit=5.0",
            "run_id=r&cursor=", "run_id=r&cursor=garbage", "run_id=r&cursor=1.",
            "run_id=r&cursor=0.0000000000000000", "run_id=r&cursor=-1.0123456789abcdef",
            "run_id=r&cursor=99999999999999999999.0123456789abcdef",
            "run_id=r&cursor=%C3%A9", "run_id=r&cursor=%00", "run_id=r&cursor=" + "9" * 5000,
        ]
        for query in bad:
            status, hdrs, body = self.tool.request("GET", "/charges/list?" + query)
            self.assertEqual(status, 400, (query, body))
            self.assertIsInstance(body, dict, query)
            self.assertIsInstance(body.get("error"), str, query)
            self.assertEqual(hdrs.get("Content-Type"), "application/json")
        self.assertEqual(self.tool.request("GET", "/charges/list?foo=1")[2]["error"],
                         'unknown query parameter "foo" (list takes since or run_id, limit, '
                         'cursor)')
        status, hdrs, _ = self.tool.request("POST", "/charges/list", b"{}")
        self.assertEqual((status, hdrs.get("Allow")), (405, "GET"))
        self.assertEqual(self.tool.request("GET", "/charges/list/more?run_id=r")[0], 404)
        # Still serving, and nothing was created or changed by any of it.
        self.assertIsNone(self.tool.proc.poll())
        self.assertEqual(self.tool.list_records("charges", run_id="r")[2]["records"],
                         [self.with_headers(rec)])
        self.assertEqual(self.tool.execute("charges", "k2", {})[0], 201)
        self.assertEqual(self.tool.status_of("charges", "k")[2], [rec])
        self.assertEqual(len(self.tool.records()["records"]), 2)
        logged = [r for r in self.tool.requests() if r["op"] == "list"]
        self.assertGreaterEqual(len(logged), len(bad))
        self.assertEqual({r["status"] for r in logged}, {400, 200})

    def test_list_faults(self):
        self.make("charges", "k", run="r")
        self.tool.fault(op="list", fault="status_500")
        self.assertEqual(self.tool.list_records("charges", run_id="r")[0], 500)
        self.tool.fault(op="list", fault="status_garbage")
        status, _, body = self.tool.list_records("charges", run_id="r")
        self.assertEqual(status, 200)
        self.assertIsInstance(body, str)
        self.tool.fault(op="list", fault="refuse_429")
        self.assertEqual(self.tool.list_records("charges", run_id="r")[0], 429)
        self.tool.fault(op="list", fault="slow", delay_ms=200)
        start = time.monotonic()
        status, _, body = self.tool.list_records("charges", run_id="r")
        self.assertEqual((status, len(body["records"])), (200, 1))
        self.assertGreaterEqual(time.monotonic() - start, 0.19)
        # A rule for another op leaves list alone, and a list does not consume it.
        self.tool.fault(op="execute", fault="error_4xx")
        self.assertEqual(self.tool.list_records("charges", run_id="r")[0], 200)
        self.assertEqual(self.tool.execute("charges", "k2", {})[0], 400)


SECRET = "s3cret-for-tests"


def signature(body, secret=SECRET, t=None):
    t = int(time.time()) if t is None else t
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


class SignatureTest(FakeToolCase):
    tool_args = ("--secret-env", "FAKE_TOOL_TEST_SECRET")
    tool_env = {"FAKE_TOOL_TEST_SECRET": SECRET}

    def test_valid_signature_is_accepted(self):
        body = b'{"amount":1}'
        status, _, _ = self.tool.execute("charges", "k", body,
                                         **{"Tally-Signature": signature(body)})
        self.assertEqual(status, 201)
        status, _, found = self.tool.request("GET", "/charges?idempotency_key=k",
                                             headers={"Tally-Signature": signature(b"")})
        self.assertEqual((status, len(found)), (200, 1))
        # A list is a GET like status: it signs the empty body.
        status, _, page = self.tool.request("GET", "/charges/list?since=2000-01-01T00:00:00Z",
                                            headers={"Tally-Signature": signature(b"")})
        self.assertEqual((status, len(page["records"])), (200, 1))
        self.assertEqual([r["signature_ok"] for r in self.tool.requests()], [True, True, True])

    def test_missing_bad_or_stale_signature_is_401(self):
        body = b'{"amount":1}'
        cases = {
            "missing": None,
            "garbage": "nonsense",
            "wrong secret": signature(body, secret="other"),
            "other body": signature(b'{"amount":2}'),
            "stale": signature(body, t=int(time.time()) - 301),
            "future": signature(body, t=int(time.time()) + 400),
        }
        for name, sig in cases.items():
            headers = {"Tally-Signature": sig} if sig else {}
            status, _, err = self.tool.execute("charges", "k", body, **headers)
            self.assertEqual(status, 401, name)
            self.assertIn("error", err)
        self.assertEqual(self.tool.records()["records"], [])
        for sig in (None, signature(b"", secret="other"), signature(b"", t=int(time.time()) - 301)):
            status, _, err = self.tool.request("GET", "/charges/list?run_id=r",
                                               headers={"Tally-Signature": sig} if sig else {})
            self.assertEqual(status, 401, sig)
            self.assertIn("error", err)
        self.assertEqual({r["signature_ok"] for r in self.tool.requests()}, {False})
        # The control API is for tests and is not signed.
        self.assertEqual(self.tool.request("GET", "/_control/faults")[0], 200)


class LifecycleTest(unittest.TestCase):

    def test_sigterm_interrupts_a_hang_and_exits_zero(self):
        tool = FakeTool()
        try:
            tool.fault(fault="apply_then_hang", delay_ms=60000)
            def call():
                try:
                    tool.execute("charges", "k", {}, timeout=30)
                except NETWORK_ERRORS:
                    pass  # the connection closes as the server stops

            t = threading.Thread(target=call)
            t.start()
            tallytest.wait_for(lambda: tool.records()["records"], timeout=5,
                               what="the hung request to apply")
            start = time.monotonic()
            self.assertEqual(tool.stop(timeout=10), 0)
            self.assertLess(time.monotonic() - start, 5)
            t.join(10)
        finally:
            if tool.proc.poll() is None:
                tool.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
