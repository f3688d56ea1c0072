#!/usr/bin/env python3
"""What the state machines' triggers cost PostgreSQL (issue 22), measured apart from the rest.

    bench/machines_cost.py [--build-dir build] [--rows 20000] [--flips 10] [--rounds 5]

Starts the embedded stack's PostgreSQL (`tally dev --no-workers`), migrates a fresh database,
creates --rows effects (one INSERT ... SELECT, PLANNED) and then moves all of them back and
forth, PLANNED -> DISPATCHING (with a lease) and DISPATCHING -> PLANNED, one UPDATE statement
for all the rows each time, --flips times — once with the machine's triggers enabled and once
disabled (ALTER TABLE ... DISABLE TRIGGER effects_machine_insert / _update only; every other
trigger stays). Set-based statements with synchronous_commit off, so that what is measured is
the per-row work of the executor, of which the triggers' WHEN clause is part, and not the
commits. Within each round the two modes run one after the other (the order alternates from
round to round) on the same rows, so they see the same table, the same cache and the same
machine load; the figure is the median of the rounds' paired differences. Prints `bench:`
lines; a figure, not a test: no assertion.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--flips", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    os.environ["TALLY_BUILD_DIR"] = os.path.abspath(a.build_dir)
    os.environ.setdefault("TALLY_SOURCE_DIR", os.path.join(HERE, ".."))
    import psycopg2
    import tallytest

    stack = tallytest.Stack.get()
    dbname = "machines_cost_" + uuid.uuid4().hex[:8]
    admin = psycopg2.connect(stack.pg)
    admin.autocommit = True
    admin.cursor().execute(f'CREATE DATABASE "{dbname}"')
    admin.close()
    dsn = psycopg2.extensions.make_dsn(stack.pg, dbname=dbname)
    subprocess.run([tallytest.binary("tally"), "migrate"], env=dict(os.environ, TALLY_PG=dsn),
                   check=True, capture_output=True)
    db = psycopg2.connect(dsn)
    db.autocommit = True
    cur = db.cursor()
    cur.execute("SET synchronous_commit = off")
    cur.execute("INSERT INTO runs (run_id) VALUES ('bench')")

    def triggers(on):
        verb = "ENABLE" if on else "DISABLE"
        cur.execute(f"ALTER TABLE effects {verb} TRIGGER effects_machine_insert")
        cur.execute(f"ALTER TABLE effects {verb} TRIGGER effects_machine_update")

    def timed(sql, params=None):
        t0 = time.perf_counter()
        cur.execute(sql, params)
        return (time.perf_counter() - t0) / a.rows * 1e6

    insert = ("INSERT INTO effects (effect_id, run_id, step, tool, effect_class, operation_key,"
              " input_hash, args_canonical, intent_id, status)"
              " SELECT gen_random_uuid(), 'bench', %(tag)s || g, 'bench_charge', 'reversible',"
              "  %(tag)s || g, repeat('a', 64), '{}', %(tag)s || g, 'PLANNED'"
              " FROM generate_series(1, %(n)s) g")
    claim = ("UPDATE effects SET status = 'DISPATCHING', lease_owner = 'bench',"
             " lease_until = now() + interval '1 minute', lease_epoch = lease_epoch + 1"
             " WHERE status = 'PLANNED'")
    back = ("UPDATE effects SET status = 'PLANNED', lease_owner = NULL, lease_until = NULL"
            " WHERE status = 'DISPATCHING'")
    figures = {(k, on): [] for k in ("insert", "update") for on in (True, False)}
    for r in range(a.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            triggers(on)
            cur.execute("TRUNCATE effects CASCADE")
            figures[("insert", on)].append(timed(insert, {"tag": f"r{r}-", "n": a.rows}))
            cur.execute("VACUUM ANALYZE effects")
            flips = []
            for _ in range(a.flips):
                flips.append(timed(claim))
                flips.append(timed(back))
            figures[("update", on)].append(statistics.median(flips))
    triggers(True)
    for k, what in (("insert", "INSERT as PLANNED"),
                    ("update", "UPDATE PLANNED <-> DISPATCHING")):
        on = figures[(k, True)]
        off = figures[(k, False)]
        diffs = [x - y for x, y in zip(on, off)]
        print(f"bench: machines.{k}.triggers_on = {statistics.median(on):.3f} us/row ({what})")
        print(f"bench: machines.{k}.triggers_off = {statistics.median(off):.3f} us/row")
        print(f"bench: machines.{k}.trigger_cost = {statistics.median(diffs):+.3f} us/row"
              f" (median of {len(diffs)} paired rounds, min {min(diffs):+.3f},"
              f" max {max(diffs):+.3f}; {statistics.median(diffs) / statistics.median(off) * 100:+.1f} %)")
    db.close()
    stack.stop()


if __name__ == "__main__":
    main()
