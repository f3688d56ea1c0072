#!/usr/bin/env bash
# Everything, as CI runs it: install missing dependencies, build, start ONE embedded stack
# (`tally dev --no-workers`: a throwaway PostgreSQL and the mock Kafka) for the whole run,
# run every test with ctest against it, and tear the stack down even when tests fail.
#
#   scripts/test.sh                 build with ASan+UBSan into build-asan/ (RelWithDebInfo, so
#                                   -O2-only warnings fail the build too) and run the suite
#   scripts/test.sh --no-sanitize   the same without sanitizers, built into build/
#   scripts/test.sh [--no-sanitize] -- CTEST-ARGS   e.g. -- -R integration.dev
#
# The libFuzzer targets (tests/fuzz/) are built with clang into build-fuzz/ first; the suite
# runs each for 30 s as fuzz.<target>. Exits with ctest's status; ctest's summary is last.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Every worker, CLI run and fake in the suite runs under AddressSanitizer and UBSan: a memory
# error aborts the process and a leak fails its exit code, which the tests check.
build="build-asan"
cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTALLY_SANITIZE=ON)
ctest_args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    --sanitize) ;; # the default; accepted so older instructions still work
    --no-sanitize)
        build="build"
        cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DTALLY_SANITIZE=OFF)
        ;;
    -h | --help)
        sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    --)
        shift
        ctest_args=("$@")
        break
        ;;
    *)
        echo "scripts/test.sh: unknown argument '$1' (see --help)" >&2
        exit 2
        ;;
    esac
    shift
done

scripts/deps.sh

jobs=$(nproc 2>/dev/null || echo 2)
# libFuzzer comes with clang only: the fuzz targets get a tree of their own, which the suite's
# tree runs them from (TALLY_FUZZ_DIR, tests/fuzz/tests.cmake).
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTALLY_FUZZ=ON -DTALLY_BUILD_TESTS=OFF -DTALLY_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz --target fuzzers -j"$jobs"
cmake_args+=(-DTALLY_FUZZ_DIR="$PWD/build-fuzz")
cmake -S . -B "$build" "${cmake_args[@]}" >/dev/null
cmake --build "$build" -j"$jobs"

stackdir=$(mktemp -d "${TMPDIR:-/tmp}/tally-test-run-XXXXXX")
dev_pid=""

# shellcheck disable=SC2317  # invoked by the EXIT trap
stop_stack() {
    local status=$?
    if [[ -n "$dev_pid" ]] && kill -0 "$dev_pid" 2>/dev/null; then
        kill -TERM "$dev_pid" 2>/dev/null || true
        for _ in $(seq 1 600); do
            kill -0 "$dev_pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$dev_pid" 2>/dev/null; then
            echo "scripts/test.sh: tally dev (pid $dev_pid) did not stop within 60 s; killing it" >&2
            kill -KILL "$dev_pid" 2>/dev/null || true
        fi
        wait "$dev_pid" 2>/dev/null || true
    fi
    if [[ $status -ne 0 && -f "$stackdir/dev.log" ]]; then
        cp "$stackdir/dev.log" "$build/tally-dev.log" 2>/dev/null || true
    fi
    rm -rf "$stackdir"
}
trap stop_stack EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The developer's own TALLY_PG must not redirect the test stack to their database.
env -u TALLY_PG -u TALLY_TOPIC_PREFIX "$build/tally" dev --no-workers \
    --env-file "$stackdir/env" >"$stackdir/dev.log" 2>&1 &
dev_pid=$!

for _ in $(seq 1 1200); do
    [[ -s "$stackdir/env" ]] && break
    if ! kill -0 "$dev_pid" 2>/dev/null; then
        break
    fi
    sleep 0.1
done
if [[ ! -s "$stackdir/env" ]]; then
    echo "scripts/test.sh: tally dev did not start; its output:" >&2
    cat "$stackdir/dev.log" >&2
    exit 1
fi

# The maintenance database as the superuser: tests CREATE DATABASE their own from it, owned by
# the stack's owner role, and run every process under its own role (tallytest.py).
# shellcheck disable=SC1091,SC2153  # the env file tally dev wrote defines these
tally_pg=$(. "$stackdir/env" && printf '%s' "$TALLY_PG_ADMIN")
# shellcheck disable=SC1091
tally_kafka=$(. "$stackdir/env" && printf '%s' "$TALLY_KAFKA_BROKERS")
export TALLY_TEST_PG="$tally_pg"
export TALLY_TEST_KAFKA="$tally_kafka"

status=0
ctest --test-dir "$build" --output-on-failure -j2 "${ctest_args[@]}" || status=$?
exit "$status"
