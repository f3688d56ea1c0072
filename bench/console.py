#!/usr/bin/python3
"""How fast `tally console` answers with a large ledger (issue 25: every page under 200 ms with
100,000 runs).

    bench/console.py [RUNS]          # TALLY_BUILD_DIR defaults to ./build; RUNS 100000

Starts the embedded stack's PostgreSQL and migrates a fresh database (the integration tests'
harness), bulk-inserts RUNS runs over 30 days with SQL — 3 effects each (six tools, one rare; mostly
CONFIRMED; some STUCK, aging UNKNOWN and awaiting approval), 3 events per effect, an obligation
for every 20th run, 100 tenants — runs ANALYZE, starts `tally console` as the read-only role,
and times each page over HTTP: 3 warm-up requests, then N, one at a time. Prints `bench:` lines
with the median, p95 and max in milliseconds; a figure, not a test (no assertion), but a page
whose p95 is over 200 ms is marked SLOW.
"""
import os
import statistics
import sys
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
os.environ.setdefault("TALLY_BUILD_DIR", os.path.join(HERE, "..", "build"))
os.environ.setdefault("TALLY_SOURCE_DIR", os.path.join(HERE, ".."))
import tallytest  # noqa: E402
from tallytest import Proc, TallyCase, binary, free_port, wait_for  # noqa: E402

RUNS = int(sys.argv.pop(1)) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 100000
N = 30
TARGET_MS = 200

# One statement per table, every value computed from the run's number i: states spread so that
# each queue has work (STUCK every 997th effect, UNKNOWN every 499th, approvals every 331st),
# times over the last 30 days, the newest run last.
FILL = f"""
INSERT INTO runs (run_id, tenant, status, created_at, updated_at)
SELECT 'bench-run-' || i, 't' || (i % 100),
       CASE WHEN i % 50 = 0 THEN 'COMPENSATED' WHEN i % 97 = 0 THEN 'STUCK'
            WHEN i % 3 = 0 THEN 'COMPLETED' ELSE 'ACTIVE' END,
       now() - interval '30 days' + i * (interval '30 days' / {RUNS}),
       now() - interval '30 days' + i * (interval '30 days' / {RUNS})
FROM generate_series(1, {RUNS}) i;

INSERT INTO effects (effect_id, run_id, step, step_num, tool, effect_class, operation_key,
                     input_hash, args_canonical, tenant, intent_id, status, attempts, receipt,
                     external_ref, unknown_since, created_at, updated_at)
SELECT md5('e' || i || '.' || s)::uuid, 'bench-run-' || i, s::text, s,
       (ARRAY['charge_card','send_email','create_hold','check_balance','delete_account',
              'update_ledger'])[k],
       (ARRAY['reversible','append_only','reversible','read','destructive','idempotent'])[k],
       (ARRAY['charge_card','send_email','create_hold','check_balance','delete_account',
              'update_ledger'])[k]
         || ':bench-' || i || '-' || s,
       md5('h' || i || s) || md5('x' || i || s), '{{"n":' || i || '}}', 't' || (i % 100),
       'intent-' || i || '-' || s, st,
       1, CASE WHEN st = 'CONFIRMED' THEN jsonb_build_object('id', 'rec_' || i || '_' || s) END,
       CASE WHEN st = 'CONFIRMED' THEN 'rec_' || i || '_' || s END,
       CASE WHEN st = 'UNKNOWN' THEN t END, t, t
FROM generate_series(1, {RUNS}) i, generate_series(1, 3) s,
     LATERAL (SELECT CASE WHEN s = 3 AND i % 7 = 0 THEN 5 WHEN s = 2 AND i % 5000 = 0 THEN 6
                          ELSE 1 + (i + s) % 4 END AS k,
                     now() - interval '30 days' + i * (interval '30 days' / {RUNS})
                       + s * interval '1 second' AS t) x,
     LATERAL (SELECT CASE WHEN (i * 3 + s) % 997 = 0 THEN 'STUCK'
                          WHEN (i * 3 + s) % 499 = 0 THEN 'UNKNOWN'
                          WHEN k = 5 AND i % 331 = 0 THEN 'AWAITING_APPROVAL'
                          WHEN k = 5 THEN 'REJECTED'
                          ELSE 'CONFIRMED' END AS st) y;

INSERT INTO events (event_id, occurred_at, run_id, effect_id, kind, from_status, to_status,
                    actor, reason, data)
SELECT md5('ev' || e.effect_id || n)::uuid, e.created_at + n * interval '40 milliseconds',
       e.run_id, e.effect_id,
       (ARRAY['transition','connector_call','transition'])[n],
       (ARRAY[NULL,NULL,'DISPATCHING'])[n], (ARRAY['PLANNED',NULL,e.status])[n],
       'bench', NULL,
       CASE WHEN n = 2 THEN '{{"op":"execute","status_code":201}}'::jsonb END
FROM effects e, generate_series(1, 3) n;

INSERT INTO obligations (obligation_id, run_id, effect_id, reason, external_ref, status,
                         attempts, created_at, updated_at)
SELECT md5('o' || e.effect_id)::uuid, e.run_id, e.effect_id, 'compensate_run', e.external_ref,
       'RESOLVED', 1, e.updated_at, e.updated_at
FROM effects e JOIN runs r USING (run_id)
WHERE r.status = 'COMPENSATED' AND e.status = 'CONFIRMED';
"""


def get(url):
    t0 = time.perf_counter()
    req = urllib.request.Request(url)
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=30) as r:
            status, n = r.status, len(r.read())
    except urllib.error.HTTPError as e:
        status, n = e.code, len(e.read())
    except (urllib.error.URLError, OSError):
        status, n = 0, 0
    return (time.perf_counter() - t0) * 1000, status, n


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


class Bench(TallyCase):
    def _check_transitions(self, failed):
        """The rows were written whole, not moved through the machines: nothing to check."""

    def test_bench(self):
        t0 = time.monotonic()
        self.force(FILL)
        self.query("ANALYZE")
        counts = {t: self.scalar(f"SELECT count(*) FROM {t}")
                  for t in ("runs", "effects", "events", "obligations")}
        print(f"\nbench: ledger filled in {time.monotonic() - t0:.0f} s: "
              + ", ".join(f"{n} {t}" for t, n in counts.items()), flush=True)

        port = free_port()
        env = self.env(TALLY_PG_READER=self.pg_as("reader"), TALLY_LOG_LEVEL="warn")
        p = Proc("tally-console", [binary("tally"), "console", "--listen",
                                   f"127.0.0.1:{port}"], env, self.tmp)
        self.procs.append(p)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: not p.alive() or get(base + "/healthz")[1] == 200, timeout=30,
                 what="tally console")
        self.assertTrue(p.alive(), p.log())

        mid = RUNS // 2
        stuck_run, stuck_effect = self.query(
            "SELECT run_id, effect_id::text FROM effects WHERE status = 'STUCK' LIMIT 1")[0]
        [(ref, key, eff)] = self.query(
            "SELECT external_ref, operation_key, effect_id::text FROM effects"
            " WHERE run_id = %s AND external_ref IS NOT NULL LIMIT 1", (f"bench-run-{mid}",))
        q = urllib.parse.quote
        pages = [
            ("runs, newest first", "/"),
            ("runs, page 1000 (deepest)", "/runs?page=1000"),
            ("runs, state=STUCK", "/runs?state=STUCK"),
            ("runs, state=ACTIVE", "/runs?state=ACTIVE"),
            ("runs, tenant=t42", "/runs?tenant=t42"),
            ("runs, tool=send_email", "/runs?tool=send_email"),
            ("runs, tool=delete_account", "/runs?tool=delete_account"),
            ("runs, tool=update_ledger (rare)", "/runs?tool=update_ledger"),
            ("runs, a day (since/until)", "/runs?since=" + q(self.scalar(
                "SELECT to_char(now() - interval '10 days', 'YYYY-MM-DD')")) + "&until="
             + q(self.scalar("SELECT to_char(now() - interval '9 days', 'YYYY-MM-DD')"))),
            ("runs, tenant+tool+state", "/runs?tenant=t7&tool=charge_card&state=ACTIVE"),
            ("run page (3 effects)", f"/runs/bench-run-{mid}"),
            ("run page, STUCK run", f"/runs/{stuck_run}"),
            ("effect page", f"/effects/{eff}"),
            ("queues", "/queues"),
            ("search: run id", f"/search?q=bench-run-{mid}"),
            ("search: effect id", f"/search?q={stuck_effect}"),
            ("search: operation key", "/search?q=" + q(key)),
            ("search: external ref", "/search?q=" + q(ref)),
            ("search: no match", "/search?q=nothing-like-this"),
        ]
        print(f"bench: {N} requests a page after 3 warm-ups, one at a time; milliseconds",
              flush=True)
        print(f"bench: {'page':32} {'status':>6} {'bytes':>8} {'median':>8} {'p95':>8} "
              f"{'max':>8}", flush=True)
        slow = 0
        for name, path in pages:
            for _ in range(3):
                get(base + path)
            times = []
            for _ in range(N):
                ms, status, size = get(base + path)
                times.append(ms)
            times.sort()
            p95 = times[int(round(0.95 * (len(times) - 1)))]
            flag = "" if p95 < TARGET_MS else "  SLOW"
            slow += bool(flag)
            print(f"bench: {name:32} {status:>6} {size:>8} {statistics.median(times):8.1f} "
                  f"{p95:8.1f} {times[-1]:8.1f}{flag}", flush=True)
        print(f"bench: {len(pages) - slow} of {len(pages)} pages under {TARGET_MS} ms at p95 "
              f"with {RUNS} runs", flush=True)


if __name__ == "__main__":
    import unittest
    unittest.main(argv=[sys.argv[0], "Bench.test_bench"], verbosity=1)
