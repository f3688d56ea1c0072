#!/usr/bin/env bash
# The demo: install what is missing, build, run the whole system on the embedded stack and
# let the example agent (examples/agent/agent.py, on clients/python) tell tally's story:
#   1. a run that succeeds (a replay, a conflict, an unknown tool refused), then is completed
#   2. a timeout resolved by the reconciler
#   3. a duplicate detected and reversed
#   4. a failed run compensated, with its summary
#   5. a reverse that fails, goes STUCK, pages, and is resolved with `tally resolve`
#   6. `tally status` at the end
#
#   scripts/demo.sh                  everything (as root on a fresh Debian 12: apt-get too)
#   scripts/demo.sh --no-build       use what is in build/ as it is
#   scripts/demo.sh --scenarios 1,2  only some parts of the story
#   scripts/demo.sh --verbose        also stream the workers' JSON logs to the terminal
#
# Quiet by default: the build output and the workers' JSON logs go to files under a
# temporary directory whose path is printed. Everything started here is stopped on exit,
# also on Ctrl-C or failure. Exits 0 when the story ends as told.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

build=build
do_build=1
verbose=0
scenarios=1,2,3,4,5
while [[ $# -gt 0 ]]; do
    case "$1" in
    --no-build) do_build=0 ;;
    --verbose) verbose=1 ;;
    --scenarios)
        [[ $# -ge 2 ]] || { echo "scripts/demo.sh: --scenarios needs a value, e.g. 1,2" >&2; exit 2; }
        scenarios=$2
        shift
        ;;
    --build-dir)
        [[ $# -ge 2 ]] || { echo "scripts/demo.sh: --build-dir needs a directory" >&2; exit 2; }
        build=$2
        shift
        ;;
    -h | --help)
        sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "scripts/demo.sh: unknown argument '$1' (see --help)" >&2
        exit 2
        ;;
    esac
    shift
done

if [[ -t 1 && -z "${NO_COLOR:-}" ]]; then
    b=$'\033[1m' d=$'\033[2m' g=$'\033[32m' r=$'\033[31m' z=$'\033[0m'
else
    b='' d='' g='' r='' z=''
fi
say() { printf '%s==>%s %s\n' "$b" "$z" "$*"; }
fail() {
    printf '%s✗ %s%s\n' "$r" "$*" "$z" >&2
    exit 1
}

# Debian's interpreter: it sees python3-confluent-kafka (another python3 first on PATH may not).
python=/usr/bin/python3

workdir=$(mktemp -d "${TMPDIR:-/tmp}/tally-demo-XXXXXX")
chmod 755 "$workdir"
dev_log=$workdir/tally-dev.log      # tally dev and the three workers (JSON lines)
fake_log=$workdir/fake-tool.log
build_log=$workdir/build.log
env_file=$workdir/env
dev_pid=""
fake_pid=""
tail_pid=""
agent_pid=""

# Stop what we started, in reverse order, each with one SIGTERM (tally dev drains its workers,
# stops PostgreSQL and the mock Kafka, and removes its cluster directory).
stop_pid() { # pid name seconds
    local pid=$1 name=$2 secs=$3
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < secs * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "scripts/demo.sh: $name (pid $pid) did not stop within $secs s; killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}
cleanup() {
    local status=$?
    # A second Ctrl-C must not cut the teardown short and leave the stack running.
    trap - EXIT
    trap '' INT TERM
    set +e
    stop_pid "$agent_pid" "the example agent" 5
    if [[ -n "$dev_pid$fake_pid" ]]; then
        say "stopping tally dev and the fake tool service"
    fi
    stop_pid "$dev_pid" "tally dev" 60
    stop_pid "$fake_pid" "tally-fake-tool" 10
    if [[ -n "$tail_pid" ]]; then
        kill "$tail_pid" 2>/dev/null
        wait "$tail_pid" 2>/dev/null
    fi
    if [[ $status -eq 130 || $status -eq 143 ]]; then
        printf '%s✗ interrupted; everything it started is stopped.%s Logs: %s\n' "$r" "$z" \
            "$workdir" >&2
    elif [[ $status -ne 0 ]]; then
        printf '%s✗ the demo failed (exit %d).%s Logs: %s\n' "$r" "$status" "$z" "$workdir" >&2
    else
        printf '%sLogs of this run: %s%s\n' "$d" "$workdir" "$z"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

printf '%stally demo%s %s(logs: %s)%s\n' "$b" "$z" "$d" "$workdir" "$z"

# ---- dependencies and build ----------------------------------------------------------------

say "checking dependencies (scripts/deps.sh)"
scripts/deps.sh || fail "scripts/deps.sh could not install what is missing"

if [[ $do_build -eq 1 ]]; then
    say "building into $build/ (output: $build_log)"
    jobs=$(nproc 2>/dev/null || echo 2)
    if ! { cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
        cmake --build "$build" -j"$jobs"; } >"$build_log" 2>&1; then
        tail -n 30 "$build_log" >&2
        fail "the build failed (whole output: $build_log)"
    fi
fi
case $build in
/*) bindir=$build ;;
*) bindir=$root/$build ;;
esac
tally=$bindir/tally
fake=$bindir/tests/fakes/tally-fake-tool
for bin in "$tally" "$fake" "$bindir/tally-dispatcher" "$bindir/tally-reconciler" \
    "$bindir/tally-compensator"; do
    [[ -x "$bin" ]] || fail "$bin is not built"
done

# ---- the tool service ------------------------------------------------------------------------

# The workers sign charge_card requests (connector.secret_env in examples/tools/demo.json) and
# refuse to call it without the secret. The fake is not given it: with a secret it would
# demand a signature on every collection, and the demo registry signs only charge_card.
export BILLING_HMAC_SECRET=${BILLING_HMAC_SECRET:-demo-billing-secret}
say "starting the fake tool service (tests/fakes/tally-fake-tool)"
setsid "$fake" --listen 127.0.0.1:0 --port-file "$workdir/fake.port" --verbose \
    >"$fake_log" 2>&1 </dev/null &
fake_pid=$!
for _ in $(seq 1 100); do
    [[ -s "$workdir/fake.port" ]] && break
    kill -0 "$fake_pid" 2>/dev/null || break
    sleep 0.1
done
[[ -s "$workdir/fake.port" ]] || { cat "$fake_log" >&2; fail "the fake tool service did not start"; }
TALLY_FAKE_TOOL_URL="http://127.0.0.1:$(cat "$workdir/fake.port")"
export TALLY_FAKE_TOOL_URL
printf '    %s%s%s\n' "$d" "$TALLY_FAKE_TOOL_URL" "$z"

# ---- the embedded stack ----------------------------------------------------------------------

say "starting tally dev: PostgreSQL, the mock Kafka cluster and the three workers"
# Our own throwaway stack: a TALLY_PG or topic prefix from the caller's shell must not
# redirect it. The workers inherit TALLY_FAKE_TOOL_URL (the registry's base_url) and the secret.
env -u TALLY_PG -u TALLY_TOPIC_PREFIX -u TALLY_TOOLS \
    setsid "$tally" dev --tools examples/tools/demo.json --env-file "$env_file" \
    >"$dev_log" 2>&1 </dev/null &
dev_pid=$!
if [[ $verbose -eq 1 ]]; then
    tail -n +1 -F "$dev_log" 2>/dev/null &
    tail_pid=$!
fi
for _ in $(seq 1 1800); do # tally dev writes the env file once the workers answer /healthz
    [[ -s "$env_file" ]] && break
    kill -0 "$dev_pid" 2>/dev/null || break
    sleep 0.1
done
if [[ ! -s "$env_file" ]]; then
    tail -n 40 "$dev_log" >&2
    fail "tally dev did not come up within 180 s (whole log: $dev_log)"
fi
set -a
# shellcheck disable=SC1090
. "$env_file"
set +a

# Readiness, as a load balancer would check it: every worker's /healthz answers 200.
mapfile -t ports < <(sed -n 's/^ *tally-[a-z]* *pid [0-9]* *http:\/\/127\.0\.0\.1:\([0-9]*\)\/metrics.*/\1/p' "$dev_log")
[[ ${#ports[@]} -eq 3 ]] || { tail -n 40 "$dev_log" >&2; fail "could not find the three workers' metrics ports in $dev_log"; }
"$python" - "${ports[@]}" <<'EOF' || fail "a worker's /healthz did not answer 200 within 60 s (log: $dev_log)"
import sys, time, urllib.request
deadline = time.monotonic() + 60
for port in sys.argv[1:]:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.2)
EOF
printf '    %sPostgreSQL %s%s\n' "$d" "$TALLY_PG" "$z"
printf '    %sKafka      %s (topics %s*)%s\n' "$d" "$TALLY_KAFKA_BROKERS" "$TALLY_TOPIC_PREFIX" "$z"
printf '    %sworkers    /metrics on 127.0.0.1:%s, :%s, :%s; logs %s%s\n' "$d" "${ports[0]}" \
    "${ports[1]}" "${ports[2]}" "$dev_log" "$z"

# ---- the story -------------------------------------------------------------------------------

say "running the example agent (examples/agent/agent.py)"
agent_args=(--tally "$tally" --scenarios "$scenarios")
if [[ -t 1 && -z "${NO_COLOR:-}" ]]; then agent_args+=(--color always); fi
# In the background with `wait`, so Ctrl-C or SIGTERM reaches our trap at once (bash runs
# traps only between foreground commands); the cleanup stops the agent too.
"$python" examples/agent/agent.py "${agent_args[@]}" &
agent_pid=$!
agent_rc=0
wait "$agent_pid" || agent_rc=$?
agent_pid=""
[[ $agent_rc -eq 0 ]] || fail "the example agent stopped (the workers' logs: $dev_log)"

echo
say "tally status"
status_rc=0
"$tally" status || status_rc=$?
case $status_rc in
0) printf '%s✓ the ledger is clean: nothing STUCK, no UNKNOWN aging%s\n' "$g" "$z" ;;
1) fail "tally status: an UNKNOWN effect is aging (exit 1)" ;;
2) fail "tally status: something is STUCK (exit 2)" ;;
*) fail "tally status exited with $status_rc" ;;
esac
echo
