#!/usr/bin/env bash
# The benchmark's smoke test (ctest -R bench.smoke): bench/run.sh at a tiny size, against the
# given build, completes and prints every figure line. It checks no figure: timing is never
# part of the test gate.
#
#   bench/smoke.sh BUILD_DIR
set -euo pipefail

build=${1:?usage: bench/smoke.sh BUILD_DIR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=$(mktemp "${TMPDIR:-/tmp}/tally-bench-smoke-XXXXXX")
trap 'rm -f "$out"' EXIT

status=0
"$here/run.sh" --build-dir "$build" --no-build --intents 300 --runs 20 --rate 100 --duration 2 \
    --inflight 50 --pgbench-seconds 1 --pgbench-rows 20000 --slow-tool-seconds 3 \
    --slow-tool-inflight 50 >"$out" || status=$?
cat "$out"
if [[ $status -ne 0 ]]; then
    echo "bench/smoke.sh: bench/run.sh exited with status $status" >&2
    exit 1
fi

missing=0
for name in throughput throughput_cpu_per_effect throughput_latency_p50 throughput_latency_p99 \
    throughput_latency_max outbox_backlog_max pg_ceiling ceiling_ratio latency_p50 latency_p99 \
    latency_max inflight_held dispatcher_rss dispatcher_hwm connmem_call \
    throughput_wal_per_effect throughput_rows_per_effect throughput_xacts_per_effect \
    throughput_kafka_in_per_effect throughput_kafka_out_per_effect latency_wal_per_effect \
    latency_rows_per_effect latency_xacts_per_effect latency_kafka_in_per_effect \
    latency_kafka_out_per_effect pg_ceiling_receipt ceiling_wal_per_job ceiling_rows_per_job \
    ceiling_xacts_per_job ceiling_wal_per_job_receipt ceiling_rows_per_job_receipt \
    ceiling_xacts_per_job_receipt wal_ratio latency_first_minute_p50 latency_first_minute_p99 \
    latency_last_minute_p50 latency_last_minute_p99 slow_tool_effects slow_tool_inflight \
    slow_tool_answer_p99 slow_tool_answer_mean slow_tool_dispatcher_rss; do
    if ! grep -Eq "^bench: $name = [0-9][0-9.]* " "$out"; then
        echo "bench/smoke.sh: no figure line 'bench: $name = <number> ...'" >&2
        missing=1
    fi
done
# the drift is signed; at this size it compares thirds of the run, and says so
for name in latency_drift_p50 latency_drift_p99; do
    if ! grep -Eq "^bench: $name = [-+][0-9][0-9.]* ms \(last minus first third" "$out"; then
        echo "bench/smoke.sh: no line 'bench: $name = <signed number> ms (last minus first third ...'" >&2
        missing=1
    fi
done
# statements are counted only where pqcount.c can be preloaded (not in a sanitizer build)
for name in throughput_statements_per_effect latency_statements_per_effect; do
    if ! grep -Eq "^bench: $name = ([0-9][0-9.]* |not counted)" "$out"; then
        echo "bench/smoke.sh: no line 'bench: $name = <number> ...' or '... = not counted ...'" >&2
        missing=1
    fi
done
if ! grep -Eq "^bench: throughput_intents = 300 of 300 " "$out"; then
    echo "bench/smoke.sh: not every intent of the throughput run got its outcome" >&2
    missing=1
fi
exit $missing
