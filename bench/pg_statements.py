#!/usr/bin/python3
"""Where PostgreSQL's time goes, from a server log written with log_min_duration_statement = 0.

    bench/pg_statements.py POSTGRES_LOG [START_OFFSET] [--top N]

bench/run.sh --pg-statements turns that setting on for the throughput run only and calls this
on the part of the log written meanwhile (from byte START_OFFSET). Each logged duration is
attributed to its statement text (whitespace collapsed, the first 110 characters) and to its
protocol step (simple statement, or parse / bind / execute of the extended protocol), and the
statements are printed by total time: calls, total ms, mean ms, and their share of all
statement time. The durations are the server's own, so they include waiting for locks but
not for the network or for the client between statements.
"""

import argparse
import re
import sys
from collections import defaultdict

# "2026-11-22 00:55:32.123 UTC [1234] LOG:  duration: 0.123 ms  execute <unnamed>: SELECT ..."
START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \S+ \[\d+\] ")
DURATION = re.compile(
    r"LOG:\s+duration: ([0-9.]+) ms\s+(statement|parse|bind|execute)( [^:]*)?: (.*)$")


def records(f):
    """Yield (ms, step, statement) for every duration record; continuation lines join it."""
    cur = None
    for raw in f:
        line = raw.rstrip("\n")
        if START.match(line):
            if cur is not None:
                yield cur
            m = DURATION.search(line)
            cur = [float(m.group(1)), m.group(2), m.group(4)] if m else None
        elif cur is not None:
            cur[2] += " " + line.strip()
    if cur is not None:
        yield cur


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("log")
    ap.add_argument("offset", nargs="?", type=int, default=0)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    calls = defaultdict(int)
    total = defaultdict(float)
    with open(a.log, errors="replace") as f:
        f.seek(a.offset)
        for ms, step, text in records(f):
            key = (step, " ".join(text.split())[:110])
            calls[key] += 1
            total[key] += ms
    grand = sum(total.values())
    if not grand:
        print("no statement durations in the log (was log_min_duration_statement set?)")
        return 1
    print(f"{'calls':>8} {'total ms':>10} {'mean ms':>8} {'share':>6}  step      statement")
    for key in sorted(total, key=total.get, reverse=True)[:a.top]:
        step, text = key
        print(f"{calls[key]:>8} {total[key]:>10.1f} {total[key] / calls[key]:>8.3f} "
              f"{100 * total[key] / grand:>5.1f}%  {step:<9} {text}")
    print(f"{sum(calls.values()):>8} {grand:>10.1f} {'':>8} {'100%':>6}  all statements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
