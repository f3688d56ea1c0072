#!/usr/bin/python3
"""What the trigger that queues audits (issue 24, schemas/sql/012_upstream.sql) costs the
statements that confirm effects, measured apart from the rest.

    bench/audit_trigger.py            # TALLY_BUILD_DIR defaults to ./build

Starts the embedded stack's PostgreSQL and migrates a fresh database (the integration tests'
harness), then per round and per variant inserts 5,000 DISPATCHING effects and times two
phases, 500 rows a statement as the dispatcher writes them: a lease update (no status change)
and the UPDATE ... SET status = 'CONFIRMED' of its record statement. Variants, interleaved round
by round: no trigger; a row trigger (FOR EACH ROW ... WHEN status became CONFIRMED, one plpgsql
call a row: the first design); the statement trigger of migration 012 (one call a statement,
over the transition tables), without an audit policy and with one that audits every effect of
the tool (so each confirmed row also inserts its audit). Prints `bench:` lines with the median,
min and max over the rounds; a figure, not a test: no assertion.
"""
import json
import os
import statistics
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))
os.environ.setdefault("TALLY_BUILD_DIR", os.path.join(HERE, "..", "build"))
os.environ.setdefault("TALLY_SOURCE_DIR", os.path.join(HERE, ".."))
import tallytest  # noqa: E402
from tallytest import TallyCase  # noqa: E402

N, BATCH, ROUNDS = 5000, 500, 12

ROW_TRIGGER = """
CREATE OR REPLACE FUNCTION bench_queue_audit() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    INSERT INTO audits (effect_id, tool, due_at)
    SELECT NEW.effect_id, p.tool, now() + p.delay_ms * interval '1 millisecond'
    FROM audit_policies p
    WHERE p.tool = NEW.tool
      AND p.sample_rate >= ((hashtext(NEW.effect_id::text)::bigint + 2147483648) + 1) / 4294967296.0
    ON CONFLICT (effect_id) DO NOTHING;
    RETURN NULL;
END $$;
CREATE TRIGGER bench_row AFTER UPDATE OF status ON effects
    FOR EACH ROW WHEN (NEW.status = 'CONFIRMED' AND OLD.status IS DISTINCT FROM 'CONFIRMED')
    EXECUTE FUNCTION bench_queue_audit();
"""


class Bench(TallyCase):
    def test_bench(self):
        results = {"no trigger": [], "row trigger": [], "statement trigger (012)": [],
                   "012, tool audited": []}
        leases = {k: [] for k in results}
        names = list(results)
        for rnd in range(ROUNDS):
            for variant in names[rnd % len(names):] + names[:rnd % len(names)]:
                self.query("DROP TRIGGER IF EXISTS effects_queue_audits ON effects")
                self.query("DROP TRIGGER IF EXISTS bench_row ON effects")
                self.query("DELETE FROM audit_policies")
                if variant == "012, tool audited":
                    self.query("INSERT INTO audit_policies (tool, delay_ms, again_ms, sample_rate,"
                               " updated_by) VALUES ('charge_card', 60000, 0, 1.0, 'bench')")
                if variant == "row trigger":
                    self.query(ROW_TRIGGER)
                elif variant in ("statement trigger (012)", "012, tool audited"):
                    self.query("CREATE TRIGGER effects_queue_audits AFTER UPDATE ON effects"
                               " REFERENCING OLD TABLE AS tally_confirmed_old NEW TABLE AS"
                               " tally_confirmed_new FOR EACH STATEMENT EXECUTE FUNCTION"
                               " tally_queue_audits()")
                tag = uuid.uuid4().hex[:8]
                self.query("INSERT INTO runs (run_id) VALUES (%s)", ("bench-" + tag,))
                self.query(
                    "INSERT INTO effects (effect_id, run_id, step, step_num, tool, effect_class,"
                    " operation_key, input_hash, args_canonical, intent_id, status, attempts,"
                    " lease_owner, lease_until)"
                    " SELECT gen_random_uuid(), %s, g::text, g, 'charge_card', 'reversible',"
                    " %s || g, encode(sha256(g::text::bytea), 'hex'), '{}', gen_random_uuid()::text, 'DISPATCHING', 1,"
                    " 'bench', now() + interval '1 hour' FROM generate_series(1, %s) g",
                    ("bench-" + tag, f"k{tag}-", N))
                ids = [r[0] for r in self.query(
                    "SELECT effect_id::text FROM effects WHERE operation_key LIKE %s",
                    (f"k{tag}-%",))]
                conn = self.db
                cur = conn.cursor()
                t0 = time.perf_counter()
                for i in range(0, len(ids), BATCH):
                    cur.execute("UPDATE effects SET lease_until = now() + interval '2 hours',"
                                " lease_epoch = lease_epoch + 1 WHERE effect_id = ANY(%s::uuid[])",
                                (ids[i:i + BATCH],))
                leases[variant].append((time.perf_counter() - t0) / N * 1e6)
                t0 = time.perf_counter()
                for i in range(0, len(ids), BATCH):
                    rows = [{"effect_id": e, "receipt": {"id": "r" + e[:8]}, "ref": "r" + e[:8]}
                            for e in ids[i:i + BATCH]]
                    cur.execute(
                        "UPDATE effects e SET status = 'CONFIRMED', receipt = r.receipt,"
                        " external_ref = r.ref, lease_owner = NULL, lease_until = NULL,"
                        " updated_at = now() FROM json_to_recordset(%s::json) AS"
                        " r(effect_id uuid, receipt jsonb, ref text) WHERE e.effect_id = r.effect_id",
                        (json.dumps(rows),))
                elapsed = time.perf_counter() - t0
                results[variant].append(elapsed / N * 1e6)
        for phase, table in (("confirmed", results), ("leased", leases)):
            base = table["no trigger"]
            for v, xs in table.items():
                diffs = [x - b for x, b in zip(xs, base)]
                print(f"bench: {phase:9s} {v:24s} µs/row: median {statistics.median(xs):6.2f}"
                      f" (min {min(xs):6.2f}, max {max(xs):6.2f}); against no trigger, median"
                      f" of the rounds' paired differences {statistics.median(diffs):+6.2f}")
        print(f"bench: {ROUNDS} rounds of {N} rows, {BATCH} a statement, variants in a"
              " rotating order")

if __name__ == "__main__":
    tallytest.main()
