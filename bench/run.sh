#!/usr/bin/env bash
# tally's benchmark (bench/README.md): the embedded stack, the fake tool service and D
# dispatchers, then five measurements in one run:
#   1. throughput   N intents as fast as a C producer can publish them; effects/s from the first
#                   publish to the last outcome, publish→outcome latency, outbox backlog
#   2. ceiling      pgbench on the same PostgreSQL server: 4 clients claim 100 rows of a
#                   one-table queue with FOR UPDATE SKIP LOCKED and complete them, then the same
#                   with a receipt row per job; tally's rate as a ratio of it
#   3. latency      R intents/s for S seconds: publish→outcome p50/p99/max, first vs last minute
#   4. slow tool    an agent keeps 5,000 effects in flight against a tool answering in 200 ms:
#                   effects/s, calls in flight, memory, the answers' p99
#   5. memory       dispatcher VmRSS/VmHWM while it holds ~5,000 calls to a slow tool
# and prints `bench: <name> = <value> <unit>` lines at the end, with the steady counters of the
# throughput and latency runs per effect (WAL, rows, transactions, statements, Kafka bytes;
# bench/README.md, "Steady counters"). Everything it starts is stopped
# by the EXIT trap, also on failure or Ctrl-C.
#
#   bench/run.sh [--intents N] [--runs R] [--dispatchers D] [--rate R] [--duration S]
#                [--partitions P] [--skip-ceiling] [--inflight N] [--pgbench-seconds S] [--pgbench-rows N]
#                [--slow-tool-seconds S] [--slow-tool-inflight N] [--slow-tool-ms MS]
#                [--fetch-wait-ms MS] [--build-dir DIR] [--no-build] [--log-dir DIR] [--perf]
#                [--pg-statements] [--sensitive]
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="$root/build-bench"
do_build=1
intents=50000
runs=1000
dispatchers=1
partitions=""
rate=1000
duration=180
skip_ceiling=0
inflight=5000
pgbench_seconds=10
pgbench_rows=1500000
fetch_wait_ms=1
slow_delay_ms=120000
slow_seconds=60
slow_inflight=5000
slow_ms=200
log_dir=""
use_perf=0
pg_statements=0
sensitive=0

usage() {
    cat <<EOF
usage: bench/run.sh [options]

  --intents N          intents of the throughput run (default $intents)
  --runs R             agent runs they are spread over (default $runs)
  --dispatchers D      tally-dispatcher processes (default $dispatchers)
  --partitions P       partitions of each topic of the mock cluster (default: D, one per
                       dispatcher; see bench/README.md, "The mock broker", for why not more)
  --rate R             intents/s of the latency run (default $rate)
  --duration S         seconds of the latency run (default $duration: long enough to compare
                       its first and last minute, the drift; shorter runs compare thirds)
  --skip-ceiling       do not run the pgbench ceiling
  --inflight N         slow calls held for the memory figure (default $inflight; 0 skips)
  --pgbench-seconds S  length of the ceiling run (default $pgbench_seconds)
  --pgbench-rows N     rows prefilled into the pgbench queue (default $pgbench_rows)
  --slow-tool-seconds S  length of the slow-tool run (default $slow_seconds; 0 skips it)
  --slow-tool-inflight N effects the agent keeps in flight in it (default $slow_inflight)
  --slow-tool-ms MS    how long the slow tool takes to answer (default $slow_ms)
  --fetch-wait-ms MS   fetch.wait.max.ms of every Kafka consumer (default $fetch_wait_ms;
                       see bench/README.md: the mock broker holds empty fetches this long)
  --build-dir DIR      build to use (default build-bench, RelWithDebInfo)
  --no-build           use the build as it is
  --log-dir DIR        keep the processes' logs here (default: a temporary directory,
                       removed at exit)
  --pg-statements      log every statement's duration during the throughput run (it slows
                       the run down) and print where PostgreSQL's time went, by statement
  --perf               profile tally's processes (perf record, cpu-clock) during the
                       throughput run; the reports go to the log directory (use --log-dir)
  --sensitive          the fast tools declare sensitive fields (args /amount and /currency,
                       receipts /body) and sign with RFC 9421: run it against a run without
                       to see what sealing and signing cost an effect (docs/security.md)
EOF
}

need_value() {
    if [[ $# -lt 2 || -z "$2" ]]; then
        echo "bench/run.sh: $1 needs a value" >&2
        exit 2
    fi
}
positive() {
    if ! [[ "$2" =~ ^[0-9]+$ ]] || { [[ "$3" == pos ]] && [[ "$2" -eq 0 ]]; }; then
        echo "bench/run.sh: $1 must be a ${3/pos/positive} integer, not '$2'" >&2
        exit 2
    fi
}

while [[ $# -gt 0 ]]; do
    case "$1" in
    --intents) need_value "$@"; positive "$1" "$2" pos; intents=$2; shift ;;
    --runs) need_value "$@"; positive "$1" "$2" pos; runs=$2; shift ;;
    --dispatchers) need_value "$@"; positive "$1" "$2" pos; dispatchers=$2; shift ;;
    --partitions) need_value "$@"; positive "$1" "$2" pos; partitions=$2; shift ;;
    --rate) need_value "$@"; positive "$1" "$2" pos; rate=$2; shift ;;
    --duration) need_value "$@"; positive "$1" "$2" pos; duration=$2; shift ;;
    --skip-ceiling) skip_ceiling=1 ;;
    --inflight) need_value "$@"; positive "$1" "$2" non-negative; inflight=$2; shift ;;
    --pgbench-seconds) need_value "$@"; positive "$1" "$2" pos; pgbench_seconds=$2; shift ;;
    --pgbench-rows) need_value "$@"; positive "$1" "$2" pos; pgbench_rows=$2; shift ;;
    --slow-tool-seconds) need_value "$@"; positive "$1" "$2" non-negative; slow_seconds=$2; shift ;;
    --slow-tool-inflight) need_value "$@"; positive "$1" "$2" pos; slow_inflight=$2; shift ;;
    --slow-tool-ms) need_value "$@"; positive "$1" "$2" pos; slow_ms=$2; shift ;;
    --fetch-wait-ms) need_value "$@"; positive "$1" "$2" non-negative; fetch_wait_ms=$2; shift ;;
    --build-dir) need_value "$@"; build=$(realpath -m "$2"); shift ;;
    --no-build) do_build=0 ;;
    --log-dir) need_value "$@"; log_dir=$(realpath -m "$2"); shift ;;
    --perf) use_perf=1 ;;
    --pg-statements) pg_statements=1 ;;
    --sensitive) sensitive=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "bench/run.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
partitions=${partitions:-$dispatchers}
if [[ $partitions -lt $dispatchers ]]; then
    echo "bench/run.sh: --partitions $partitions leaves dispatchers without a partition (--dispatchers $dispatchers)" >&2
    exit 2
fi

say() { echo "bench/run.sh: $*" >&2; }
die() {
    say "$*"
    exit 1
}

if [[ $use_perf -eq 1 ]] && ! perf record -q -e cpu-clock -o /dev/null -- true 2>/dev/null; then
    die "--perf: perf cannot record cpu-clock samples here"
fi
for tool in curl psql python3; do
    command -v "$tool" >/dev/null || die "$tool is required (scripts/deps.sh installs it)"
done
pgbench=/usr/lib/postgresql/15/bin/pgbench
[[ -x "$pgbench" ]] || pgbench=$(command -v pgbench || true)
if [[ $skip_ceiling -eq 0 && -z "$pgbench" ]]; then
    die "pgbench is not installed (Debian: postgresql-contrib / postgresql-15); or use --skip-ceiling"
fi

# ---- build --------------------------------------------------------------------------------
targets=(tally tally-dispatcher tally-fake-tool tally-bench-client tally-bench-connmem
    tally-bench-pqcount)
if [[ $do_build -eq 1 ]]; then
    if [[ ! -f "$build/CMakeCache.txt" ]]; then
        cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
    fi
    cmake --build "$build" -j"$(nproc 2>/dev/null || echo 2)" --target "${targets[@]}" >&2
fi
tally_bin="$build/tally"
dispatcher_bin="$build/tally-dispatcher"
fake_bin="$build/tests/fakes/tally-fake-tool"
client_bin="$build/bench/tally-bench-client"
connmem_bin="$build/bench/tally-bench-connmem"
pqcount_lib="$build/bench/libtally-bench-pqcount.so"
for b in "$tally_bin" "$dispatcher_bin" "$fake_bin" "$client_bin" "$connmem_bin"; do
    [[ -x "$b" ]] || die "$b is not built (run without --no-build, or build ${targets[*]})"
done
build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null || true)

# ---- processes and teardown ---------------------------------------------------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/tally-bench-XXXXXX")
[[ -n "$log_dir" ]] || log_dir="$work/logs"
mkdir -p "$log_dir"
dev_pid=""
fake_pid=""
sampler_pid=""
sampler_psql_pid=""
perf_pid=""
dispatcher_pids=()
metrics_ports=()

# SIGTERM one process we started and wait for it; SIGKILL after $2 seconds.
stop_pid() {
    local pid=$1 grace=${2:-20}
    [[ -n "$pid" ]] || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 $((grace * 10))); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        say "pid $pid did not stop within ${grace}s; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

teardown() {
    local status=$?
    set +e
    stop_pid "$sampler_pid" 5
    stop_pid "$sampler_psql_pid" 5
    stop_pid "$perf_pid" 30
    # the fake tool first: its sleeping requests wake up, so the dispatchers have nothing to wait for
    stop_pid "$fake_pid" 20
    for pid in "${dispatcher_pids[@]}"; do
        stop_pid "$pid" 30
    done
    stop_pid "$dev_pid" 60
    if [[ $status -ne 0 ]]; then
        say "failed (status $status); last lines of the logs:"
        for f in "$log_dir"/*.log; do
            [[ -f "$f" ]] || continue
            echo "---- $f ----" >&2
            tail -n 15 "$f" >&2
        done
    fi
    if [[ "$log_dir" == "$work/logs" ]]; then
        rm -rf "$work"
    else
        rm -rf "$work"
        say "logs kept in $log_dir"
    fi
    exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# wait_until SECONDS WHAT COMMAND...: poll COMMAND every 0.1 s
wait_until() {
    local seconds=$1 what=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    until "$@"; do
        ((SECONDS < deadline)) || die "timed out after ${seconds}s waiting for $what"
        sleep 0.1
    done
}

# CPU seconds (user+system) a process and its reaped children have used so far.
cpu_seconds() {
    local pid=$1
    [[ -r /proc/$pid/stat ]] || {
        echo 0
        return
    }
    # fields after the ") " that ends comm: 12=utime 13=stime 14=cutime 15=cstime (1-based)
    awk -v hz="$(getconf CLK_TCK)" '{ sub(/^.*\) /, ""); printf "%.2f\n", ($12 + $13 + $14 + $15) / hz }' "/proc/$pid/stat"
}

# CPU seconds of the PostgreSQL server: the postmaster, its reaped children, its live children.
pg_cpu_seconds() {
    local total
    total=$(cpu_seconds "$pg_pid")
    for child in $(ps -o pid= --ppid "$pg_pid" 2>/dev/null); do
        total=$(awk -v a="$total" -v b="$(cpu_seconds "$child")" 'BEGIN { printf "%.2f", a + b }')
    done
    echo "$total"
}

status_kb() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }
cpu_diff() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
cpu_snapshot() { # one line: dispatchers postgres kafka-mock fake-tool
    local d=0
    for pid in "${dispatcher_pids[@]}"; do
        d=$(awk -v a="$d" -v b="$(cpu_seconds "$pid")" 'BEGIN { printf "%.2f", a + b }')
    done
    echo "$d $(pg_cpu_seconds) $(cpu_seconds "$dev_pid") $(cpu_seconds "$fake_pid")"
}

say "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GB", $2 / 1048576}' /proc/meminfo), load average $(cut -d' ' -f1-3 /proc/loadavg)"
say "build: $build ($build_type); logs in $log_dir"

# ---- the embedded stack -------------------------------------------------------------------
# The developer's own TALLY_PG must not redirect the benchmark to their database.
env -u TALLY_PG -u TALLY_TOPIC_PREFIX "$tally_bin" dev --no-workers --partitions "$partitions" \
    --env-file "$work/env" \
    >"$log_dir/dev.log" 2>&1 &
dev_pid=$!
env_ready() {
    kill -0 "$dev_pid" 2>/dev/null || die "tally dev exited: $(tail -n 20 "$log_dir/dev.log")"
    [[ -s "$work/env" ]]
}
wait_until 120 "tally dev to start" env_ready
# shellcheck disable=SC1091
. "$work/env"
# Each process as its own role, as in production (docs/operations.md, "Database roles"): the
# dispatchers as tally_dispatcher, migrate as the owner; this script's own queries, ALTER
# SYSTEM and the pgbench database as the superuser, on the ledger's database.
pg_admin="$TALLY_PG_ADMIN dbname=tally" # a later dbname wins in a conninfo string
TALLY_PG=$TALLY_PG_DISPATCHER
export TALLY_PG TALLY_KAFKA_BROKERS TALLY_TOPIC_PREFIX
wait_until 10 "tally dev's summary" grep -q 'running as user\|PostgreSQL  ' "$log_dir/dev.log"
pg_log=$(sed -n 's/.*server log \(.*\)$/\1/p' "$log_dir/dev.log" | head -n 1)
pg_pid=$(sed -n 's/.*PostgreSQL .*(.*, pid \([0-9]*\),.*/\1/p' "$log_dir/dev.log" | head -n 1)
[[ -n "$pg_pid" ]] || die "cannot find the PostgreSQL server's pid in $log_dir/dev.log"
TALLY_PG=$TALLY_PG_OWNER "$tally_bin" migrate >>"$log_dir/dev.log" 2>&1 || die "tally migrate failed"
# The messages waiting for the relay: message_outbox, and from schema 17 on message_refs (the
# outcomes written by reference, docs/hacking.md)
msg_waiting="(SELECT count(*) FROM message_outbox)"
if [[ $(psql "$pg_admin" -XAtqc "SELECT to_regclass('message_refs') IS NOT NULL") == t ]]; then
    msg_waiting="($msg_waiting + (SELECT count(*) FROM message_refs))"
fi
pg_settings=$(psql "$pg_admin" -Atc "SELECT current_setting('fsync') || ' fsync, synchronous_commit ' || current_setting('synchronous_commit') || ', shared_buffers ' || current_setting('shared_buffers') || ', wal_init_zero ' || current_setting('wal_init_zero')")
say "PostgreSQL: $pg_settings; Kafka (mock): $TALLY_KAFKA_BROKERS, topics ${TALLY_TOPIC_PREFIX}* with $partitions partition(s) each"

# ---- the fake tool service ----------------------------------------------------------------
"$fake_bin" --listen 127.0.0.1:0 --port-file "$work/fake.port" >"$log_dir/fake-tool.log" 2>&1 &
fake_pid=$!
fake_ready() {
    kill -0 "$fake_pid" 2>/dev/null || die "tally-fake-tool exited: $(tail -n 20 "$log_dir/fake-tool.log")"
    [[ -s "$work/fake.port" ]]
}
wait_until 30 "tally-fake-tool" fake_ready
TALLY_FAKE_TOOL_URL="http://127.0.0.1:$(cat "$work/fake.port")"
export TALLY_FAKE_TOOL_URL

# ---- the dispatchers ----------------------------------------------------------------------
export TALLY_TOOLS="$root/bench/tools.json"
if [[ $sensitive -eq 1 ]]; then
    # the same tools, their args and receipts sealed per tenant and their requests signed
    TALLY_TOOLS="$work/tools-sensitive.json"
    python3 - "$root/bench/tools.json" "$TALLY_TOOLS" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for tool in doc["tools"]:
    if tool["name"] in ("bench_ledger", "bench_charge"):
        tool["sensitive"] = {"args": ["/amount", "/currency"], "receipt": ["/body"]}
        tool["connector"]["signing"] = {"scheme": "rfc9421", "key_id": "bench-1",
                                        "secret_env": "BENCH_SIGNING_KEY"}
json.dump(doc, open(sys.argv[2], "w"), indent=2)
PY
    TALLY_MASTER_KEY="bench:$(head -c 32 /dev/urandom | base64)"
    BENCH_SIGNING_KEY=$(head -c 32 /dev/urandom | base64)
    export TALLY_MASTER_KEY BENCH_SIGNING_KEY
fi
export TALLY_SESSION_TIMEOUT_MS=6000
export TALLY_KAFKA_HEARTBEAT_INTERVAL_MS=500
export TALLY_KAFKA_FETCH_WAIT_MAX_MS=$fetch_wait_ms
max_held=$((inflight > slow_inflight ? inflight : slow_inflight))
export TALLY_MAX_INFLIGHT=$((max_held > 5000 ? max_held + 1000 : 6000))
export TALLY_SHUTDOWN_GRACE_MS=5000
"$tally_bin" tools check "$TALLY_TOOLS" >/dev/null || die "bench/tools.json does not pass tally tools check"
# Statements are counted by wrapping libpq in the dispatchers (pqcount.c, preloaded), unless the
# build has AddressSanitizer, whose runtime must come first in the list of libraries.
pq_dispatchers="$work/pqcount-dispatchers"
pq_pgbench="$work/pqcount-pgbench"
pq_env=() # the environment that makes a process count its statements into $TALLY_BENCH_PQCOUNT
if [[ -f "$pqcount_lib" ]] && ! ldd "$dispatcher_bin" 2>/dev/null | grep -q libasan; then
    pq_env=("LD_PRELOAD=$pqcount_lib${LD_PRELOAD:+:$LD_PRELOAD}")
fi
for i in $(seq 1 "$dispatchers"); do
    port=$(free_port)
    env "${pq_env[@]}" TALLY_BENCH_PQCOUNT="$pq_dispatchers" \
        TALLY_METRICS_ADDR="127.0.0.1:$port" TALLY_WORKER_ID="bench-dispatcher-$i" \
        "$dispatcher_bin" >"$log_dir/dispatcher-$i.log" 2>&1 &
    dispatcher_pids+=($!)
    metrics_ports+=("$port")
done
dispatcher_ready() {
    local i=$1
    kill -0 "${dispatcher_pids[$i]}" 2>/dev/null ||
        die "tally-dispatcher $((i + 1)) exited: $(tail -n 20 "$log_dir/dispatcher-$((i + 1)).log")"
    [[ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:${metrics_ports[$i]}/readyz")" == 200 ]]
}
for i in "${!dispatcher_pids[@]}"; do
    wait_until 60 "tally-dispatcher $((i + 1)) /readyz" dispatcher_ready "$i"
done
say "$dispatchers dispatcher(s) ready (pids ${dispatcher_pids[*]}), fake tool at $TALLY_FAKE_TOOL_URL"

# ---- the client -----------------------------------------------------------------------------
# kv LINE KEY: the value of key=value in a bench-client line
kv() { sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"; }

# client LABEL ARGS...: run tally-bench-client; its figures line goes to $client_line
client_line=""
client() {
    local label=$1
    shift
    local out
    if ! out=$("$client_bin" --brokers "$TALLY_KAFKA_BROKERS" \
        --intents-topic "${TALLY_TOPIC_PREFIX}intents" \
        --outcomes-topic "${TALLY_TOPIC_PREFIX}outcomes" --label "$label" \
        --fetch-wait-ms "$fetch_wait_ms" "$@" 2> >(tee -a "$log_dir/client.log" >&2)); then
        echo "$out" >&2
        die "the $label run did not complete (see above)"
    fi
    client_line=$(grep '^bench-client:' <<<"$out" | tail -n 1)
    echo "$client_line" >>"$log_dir/client.log"
    [[ -n "$client_line" ]] || die "the $label run printed no figures"
}
fast_tools=(--tool bench_ledger:entry_id --tool "bench_charge:tenant_id,payment_id")

# Warm-up: the consumer group has settled and every connection is open before anything is timed.
client warmup --count 1000 --runs 50 "${fast_tools[@]}" --timeout 180
say "warm-up: $(kv "$client_line" received) outcomes in $(kv "$client_line" window_s) s"

# hist_sums NAME: "<sum> <count>" of a histogram over all its label sets and every dispatcher
hist_sums() {
    local port ps pc
    local s=0 c=0
    for port in "${metrics_ports[@]}"; do
        read -r ps pc < <({ curl -s --max-time 5 "http://127.0.0.1:$port/metrics" || true; } |
            awk -v n="$1" '$1 ~ "^" n "_sum" { s += $NF } $1 ~ "^" n "_count" { c += $NF }
                           END { printf "%.6f %d\n", s, c }')
        s=$(awk -v a="$s" -v b="$ps" 'BEGIN { printf "%.6f", a + b }')
        c=$((c + pc))
    done
    echo "$s $c"
}
# mean_ms "SUM0 COUNT0" "SUM1 COUNT1": the mean in ms of what was observed in between
mean_ms() {
    awk -v a="$1" -v b="$2" 'BEGIN { split(a, x, " "); split(b, y, " "); n = y[2] - x[2];
        if (n > 0) printf "%.2f", (y[1] - x[1]) / n * 1000; else printf "n/a" }'
}
save_metrics() {
    local i
    for i in "${!metrics_ports[@]}"; do
        curl -s --max-time 5 "http://127.0.0.1:${metrics_ports[$i]}/metrics" \
            >"$log_dir/metrics-$1-dispatcher-$((i + 1)).txt" 2>/dev/null || true
    done
}

# ---- steady counters (bench/README.md, "Steady counters") --------------------------------------
# What a run cost PostgreSQL and Kafka, in units that do not move with the machine's noise.
# The exact ones are read at any moment: WAL bytes (pg_current_wal_lsn), transaction ids
# assigned (txid_current_snapshot's xmax: write transactions), statements sent (pqcount.c).
# The pg_stat ones (transactions, rows, WAL records) arrive late: a backend flushes its
# counts at the end of a transaction at most once a second, and one that then goes idle only
# after PGSTAT_IDLE_INTERVAL (10 s), so they are read 11 s after the work ended. Each reading
# is a new session: no cached statistics snapshot.
stats_delay=11
pq_read() { # pq_read FILE: "statements prepares" counted into FILE so far
    local a b
    read -r a b < <(od -An -t u8 -N 16 -v "$1" 2>/dev/null | tr -s ' \n' '  ' || true)
    echo "${a:-0} ${b:-0}"
}
counters_exact() { # counters_exact PQFILE: key=value ...
    local g pq
    g=$(psql "$TALLY_PG_ADMIN dbname=postgres" -XAtq -F ' ' -c \
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint,
                txid_snapshot_xmax(txid_current_snapshot())")
    read -r -a pq <<<"$(pq_read "$1")"
    echo "wal=${g% *} xids=${g#* } statements=${pq[0]} prepares=${pq[1]} t_exact=$(date +%s.%N)"
}
# counters_stats DB: key=value ... of the pg_stat views. The transactions are read from the
# postgres database first, then the rows from DB: that session's own transaction counts in
# DB after this reading, never in it (a reading at the start of a run adds exactly one).
counters_stats() {
    local g t
    g=$(psql "$TALLY_PG_ADMIN dbname=postgres" -XAtq -F ' ' -c \
        "SELECT d.xact_commit + d.xact_rollback, w.wal_records, w.wal_fpi,
                b.checkpoints_timed + b.checkpoints_req
           FROM pg_stat_database d, pg_stat_wal w, pg_stat_bgwriter b WHERE d.datname = '$1'")
    t=$(psql "$TALLY_PG_ADMIN dbname=$1" -XAtq -F ' ' -c \
        "SELECT coalesce(sum(n_tup_ins), 0), coalesce(sum(n_tup_upd), 0),
                coalesce(sum(n_tup_del), 0), coalesce(sum(n_tup_hot_upd), 0)
           FROM pg_stat_user_tables")
    read -r -a a <<<"$g"
    read -r -a b <<<"$t"
    echo "xacts=${a[0]} wal_records=${a[1]} wal_fpi=${a[2]} checkpoints=${a[3]} ins=${b[0]} upd=${b[1]} del=${b[2]} hot=${b[3]} t_stats=$(date +%s.%N)"
}
# counters_diff "BEFORE" "AFTER": key=value ... of AFTER - BEFORE (t_* in seconds)
counters_diff() {
    awk -v a="$1" -v b="$2" 'BEGIN { n = split(a, x, " "); for (i = 1; i <= n; i++) {
            split(x[i], kv, "="); v[kv[1]] = kv[2] }
        n = split(b, y, " "); for (i = 1; i <= n; i++) { split(y[i], kv, "=");
            printf "%s%s=%s", (i > 1 ? " " : ""), kv[1],
                (kv[1] ~ /^t_/ ? sprintf("%.1f", kv[2] - v[kv[1]]) : sprintf("%.0f", kv[2] - v[kv[1]])) }
        print "" }'
}
cv() { sed -n "s/.*\(^\| \)$2=\([^ ]*\).*/\2/p" <<<"$1"; } # cv "k=v ..." KEY
# settle: wait until tally has finished the work of a run (no dispatch outbox, message outbox
# or pending effect left); settle_polls = the transactions that cost in the tally database
settle() {
    local left=""
    settle_polls=0
    for _ in $(seq 1 600); do
        left=$(psql "$pg_admin" -XAtqc "SELECT (SELECT count(*) FROM outbox) + $msg_waiting
            + (SELECT count(*) FROM effects WHERE status IN ('PLANNED', 'DISPATCHING'))")
        settle_polls=$((settle_polls + 1))
        [[ "$left" == 0 ]] && return 0
        sleep 0.2
    done
    say "tally still had $left rows of work 120 s after the run; the counters include it"
}
# window_start: the counters at the start of a tally run (after the work before it settled)
window_start() {
    settle
    # a checkpoint first: no run has one fall inside it (checkpoint_timeout is 5 min), and
    # each starts the same way, its first change to a page written whole (a full-page image)
    psql "$pg_admin" -qc "CHECKPOINT"
    sleep "$stats_delay"
    w_stats0=$(counters_stats tally)
    w_exact0=$(counters_exact "$pq_dispatchers")
}
# window_end LABEL OUTCOMES CLIENT_LINE HARNESS_XACTS: the run's counters into counters_LABEL
# and per-effect figures into steady_LABEL. HARNESS_XACTS are transactions this script ran in
# the tally database during the run (the sampler's); the window's own readings and polls,
# and the dispatchers' idle polling while the statistics arrive, are taken out here.
window_end() {
    local label=$1 n=$2 line=$3 harness=$4 exact stats d xacts idle_x
    settle
    exact=$(counters_diff "$w_exact0" "$(counters_exact "$pq_dispatchers")")
    sleep "$stats_delay"
    stats=$(counters_diff "$w_stats0" "$(counters_stats tally)")
    # the idle dispatchers' read-only polling over the stats delay, at the idle rate
    idle_x=$(awk -v r="$idle_xact_rate" -v t="$(cv "$stats" t_stats)" -v e="$(cv "$exact" t_exact)" \
        'BEGIN { printf "%.0f", r * (t - e) }')
    xacts=$(($(cv "$stats" xacts) - 1 - settle_polls - harness - idle_x))
    d="outcomes=$n $exact $stats xacts_net=$xacts subtracted_xacts=$((1 + settle_polls + harness + idle_x))"
    d+=" kafka_in=$(kv "$line" in_bytes) kafka_in_messages=$(kv "$line" in_messages)"
    d+=" kafka_out=$(kv "$line" out_bytes) kafka_out_messages=$(kv "$line" out_messages)"
    printf -v "counters_$label" '%s' "$d"
    echo "$label $d" >>"$log_dir/counters.txt"
}
per_effect() { awk -v a="$1" -v n="$2" -v p="${3:-2}" 'BEGIN { if (n > 0 && a != "") printf "%.*f", p, a / n; else printf "n/a" }'; }
# steady_lines VAR NAME UNIT [SUFFIX]: the bench lines of the counters in $VAR, per UNIT
# (effect or job): NAME_wal_per_UNIT[SUFFIX] = ...
steady_lines() {
    local c=${!1} name=$2 unit=$3 suffix=${4:-} n stm
    n=$(cv "$c" outcomes)
    if [[ ${#pq_env[@]} -gt 0 ]]; then
        stm="$(per_effect "$(cv "$c" statements)" "$n" 3) statements (sent through libpq, counted by pqcount.c; prepares $(per_effect "$(cv "$c" prepares)" "$n" 4))"
    else
        stm="not counted (a sanitizer build: pqcount.c cannot be preloaded)"
    fi
    echo "bench: ${name}_wal_per_$unit$suffix = $(per_effect "$(cv "$c" wal)" "$n" 0) bytes (WAL, pg_current_wal_lsn; $(per_effect "$(cv "$c" wal_records)" "$n" 2) records, $(per_effect "$(cv "$c" wal_fpi)" "$n" 3) full-page images; checkpoints during the run: $(cv "$c" checkpoints))"
    echo "bench: ${name}_rows_per_$unit$suffix = $(per_effect "$(($(cv "$c" ins) + $(cv "$c" upd) + $(cv "$c" del)))" "$n" 2) rows (inserted $(per_effect "$(cv "$c" ins)" "$n" 2), updated $(per_effect "$(cv "$c" upd)" "$n" 2) of which HOT $(per_effect "$(cv "$c" hot)" "$n" 2), deleted $(per_effect "$(cv "$c" del)" "$n" 2))"
    echo "bench: ${name}_xacts_per_$unit$suffix = $(per_effect "$(cv "$c" xacts_net)" "$n" 3) transactions (commits + rollbacks; writing ones, by transaction id: $(per_effect "$(cv "$c" xids)" "$n" 3))"
    echo "bench: ${name}_statements_per_$unit$suffix = $stm"
    if [[ -n "$(cv "$c" kafka_in)" ]]; then
        echo "bench: ${name}_kafka_in_per_$unit$suffix = $(per_effect "$(cv "$c" kafka_in)" "$n" 0) bytes (intents delivered: key + value)"
        echo "bench: ${name}_kafka_out_per_$unit$suffix = $(per_effect "$(cv "$c" kafka_out)" "$n" 0) bytes (outcomes topic: key + value + headers, $(per_effect "$(cv "$c" kafka_out_messages)" "$n" 3) messages)"
    fi
    echo "bench: ${name}_counters$suffix = $c"
}

counters_throughput="" # window_end sets counters_LABEL

# ---- 1. throughput --------------------------------------------------------------------------
# The counters' starting point, and what the idle dispatchers do to them: their polling runs
# read-only transactions, whose share over the statistics delay window_end takes out.
window_start
sleep 10
idle_stats=$(counters_diff "$w_stats0" "$(counters_stats tally)")
idle_exact=$(counters_diff "$w_exact0" "$(counters_exact "$pq_dispatchers")")
idle_xact_rate=$(awk -v x="$(cv "$idle_stats" xacts)" -v t="$(cv "$idle_stats" t_stats)" \
    'BEGIN { printf "%.2f", (t > 0 ? (x - 1) / t : 0) }')
idle_line="$idle_xact_rate transactions/s, $(awk -v x="$(cv "$idle_exact" statements)" -v t="$(cv "$idle_exact" t_exact)" 'BEGIN { printf "%.1f", (t > 0 ? x / t : 0) }') statements/s, $(cv "$idle_exact" wal) WAL bytes and $(cv "$idle_stats" ins) rows inserted in $(cv "$idle_exact" t_exact) s"
say "idle dispatchers: $idle_line"
w_stats0=$(counters_stats tally)
w_exact0=$(counters_exact "$pq_dispatchers")
# One psql session for the whole run, fed through a FIFO: a psql per sample would cost more
# CPU (a process and a backend each) than the measurement is worth on two cores. Once a second
# it counts the backlogs ("B|outbox|message_outbox|pending effects"); five times a second it
# samples what each tally connection is doing ("W|app:state,..."; idle = waiting for its
# worker, idle_in_transaction = inside a transaction waiting for its worker, WALSync/WALWrite =
# waiting for the commit to reach the disk, CPU = executing), which says whether a slow
# dispatcher waits for PostgreSQL or PostgreSQL waits for it.
mkfifo "$work/sampler.fifo"
psql "$pg_admin" -At -F '|' <"$work/sampler.fifo" >"$work/samples.txt" 2>/dev/null &
sampler_psql_pid=$!
(
    tick=0
    while :; do
        if ((tick % 5 == 0)); then
            echo "SELECT 'B', (SELECT count(*) FROM outbox), $msg_waiting,
                         (SELECT count(*) FROM effects WHERE status IN ('PLANNED', 'DISPATCHING'));"
        fi
        echo "SELECT 'W', coalesce(string_agg(split_part(application_name, '/', 1) || ':' || CASE WHEN state = 'active'
                      THEN coalesce(wait_event, 'CPU') ELSE replace(state, ' ', '_') END, ','), '')
                FROM pg_stat_activity
               WHERE application_name LIKE 'tally-%' AND pid <> pg_backend_pid();"
        tick=$((tick + 1))
        sleep 0.2
    done
) >"$work/sampler.fifo" &
sampler_pid=$!
if [[ $use_perf -eq 1 ]]; then
    # only our processes (other work on the machine would otherwise blur the picture):
    # PostgreSQL (postmaster and backends), the dispatchers, tally dev (the mock Kafka
    # cluster) and the fake tool
    perf_pids="$(ps -o pid= --ppid "$pg_pid" | awk '{ printf "%s,", $1 }')"
    perf_pids+=$(printf '%s,' "$pg_pid" "${dispatcher_pids[@]}" "$dev_pid" "$fake_pid")
    perf record -q -g -e cpu-clock -F 499 -p "${perf_pids%,}" -o "$log_dir/perf.data" \
        2>"$log_dir/perf.log" &
    perf_pid=$!
fi
if [[ $pg_statements -eq 1 ]]; then
    psql "$pg_admin" -qc "ALTER SYSTEM SET log_min_duration_statement = 0" -c "SELECT pg_reload_conf()" \
        >/dev/null || die "--pg-statements: cannot change log_min_duration_statement"
    sleep 0.5
    pg_log_offset=$(stat -c %s "$pg_log")
fi
cpu_before=$(cpu_snapshot)
dispatch_before=$(hist_sums tally_dispatch_seconds)
connector_before=$(hist_sums tally_connector_seconds)
# The mock broker keeps at most 5 MB of each partition and drops the oldest messages past it,
# read or not, so a burst larger than the partitions hold loses intents ("offset out of range"
# in the dispatcher's log). The burst is published ahead of the outcomes by at most 10,000
# intents a partition (about 3.7 MB of the bench's intents): the dispatchers always have a
# backlog of many batches, and nothing is dropped (bench/README.md, "The mock broker").
burst_window=$((partitions * 10000))
client throughput --count "$intents" --runs "$runs" "${fast_tools[@]}" --timeout 900 \
    --window "$burst_window"
cpu_after=$(cpu_snapshot)
dispatch_mean=$(mean_ms "$dispatch_before" "$(hist_sums tally_dispatch_seconds)")
connector_mean=$(mean_ms "$connector_before" "$(hist_sums tally_connector_seconds)")
save_metrics throughput
if [[ $pg_statements -eq 1 ]]; then
    psql "$pg_admin" -qc "ALTER SYSTEM RESET log_min_duration_statement" -c "SELECT pg_reload_conf()" \
        >/dev/null || true
    python3 "$root/bench/pg_statements.py" "$pg_log" "$pg_log_offset" --top 15 \
        >"$log_dir/pg-statements.txt" || true
    say "PostgreSQL statements during the throughput run, by total time:"
    cat "$log_dir/pg-statements.txt" >&2
fi
if [[ -n "$perf_pid" ]]; then
    kill -INT "$perf_pid" 2>/dev/null || true
    wait "$perf_pid" 2>/dev/null || true
    perf_pid=""
    perf report -i "$log_dir/perf.data" --stdio --no-children --sort comm -g none \
        >"$log_dir/perf-by-process.txt" 2>/dev/null || true
    perf report -i "$log_dir/perf.data" --stdio --no-children --sort comm,dso,symbol -g none \
        >"$log_dir/perf-by-symbol.txt" 2>/dev/null || true
    say "perf: reports in $log_dir/perf-by-process.txt and perf-by-symbol.txt"
fi
stop_pid "$sampler_pid" 5
sampler_pid=""
for _ in $(seq 1 50); do # it exits at the end of its input, writing what it buffered
    kill -0 "$sampler_psql_pid" 2>/dev/null || break
    sleep 0.1
done
stop_pid "$sampler_psql_pid" 5
sampler_psql_pid=""
tp_line=$client_line
tp_rate=$(kv "$tp_line" effects_per_s)
# the sampler ran one transaction per query, one line of output each; --pg-statements two
# psql sessions of two statements each
window_end throughput "$(kv "$tp_line" received)" "$tp_line" \
    $(($(wc -l <"$work/samples.txt") + (pg_statements == 1 ? 4 : 0)))
grep '^B|' "$work/samples.txt" | cut -d'|' -f2- >"$work/backlog.txt" || true
grep '^W|' "$work/samples.txt" | cut -d'|' -f2- >"$work/waits.txt" || true
outbox_max=$(awk -F'|' 'BEGIN { m = 0 } $1 + 0 > m { m = $1 + 0 } END { print m }' "$work/backlog.txt")
msg_outbox_max=$(awk -F'|' 'BEGIN { m = 0 } $2 + 0 > m { m = $2 + 0 } END { print m }' "$work/backlog.txt")
pending_max=$(awk -F'|' 'BEGIN { m = 0 } $3 + 0 > m { m = $3 + 0 } END { print m }' "$work/backlog.txt")
backlog_samples=$(wc -l <"$work/backlog.txt")
cp "$work/samples.txt" "$log_dir/pg-samples.txt"
# "tally-dispatcher: idle 61%, WALSync 22%, ..." per application, over every sample
pg_waits=$(awk -F'|' '
    { n++; split($1, conns, ","); for (i in conns) if (conns[i] != "") {
          split(conns[i], kv, ":"); c[kv[1]] += 1; w[kv[1] SUBSEP kv[2]] += 1 } }
    END { for (aw in w) { split(aw, k, SUBSEP); printf "%s\t%d\t%s\n", k[1], w[aw], k[2] } }' \
    "$work/waits.txt" | sort -k1,1 -k2,2nr | awk -F'\t' '
    { tot[$1] += $2; line[$1] = line[$1] sprintf("%s%s %d", (line[$1] == "" ? "" : ", "), $3, $2) }
    END { for (a in tot) { n = split(line[a], parts, ", "); out = "";
              for (i = 1; i <= n; i++) { split(parts[i], p, " ");
                  out = out sprintf("%s%s %.0f%%", (i > 1 ? ", " : ""), p[1], 100 * p[2] / tot[a]) }
              printf "%s%s: %s", (r++ ? "; " : ""), a, out } }')
read -r -a cb <<<"$cpu_before"
read -r -a ca <<<"$cpu_after"
cpu_dispatcher=$(cpu_diff "${cb[0]}" "${ca[0]}")
cpu_postgres=$(cpu_diff "${cb[1]}" "${ca[1]}")
cpu_kafka=$(cpu_diff "${cb[2]}" "${ca[2]}")
cpu_fake=$(cpu_diff "${cb[3]}" "${ca[3]}")
# tally's own CPU (dispatchers and PostgreSQL) per outcome, apart from the other processes on
# the same cores
cpu_per_effect=$(awk -v d="$cpu_dispatcher" -v p="$cpu_postgres" -v n="$(kv "$tp_line" received)" \
    'BEGIN { if (n > 0) printf "%.0f", (d + p) * 1e6 / n; else printf "0" }')
say "throughput: $tp_rate effects/s; outbox max $outbox_max, message_outbox max $msg_outbox_max ($backlog_samples samples)"

# ---- 2. the raw PostgreSQL ceiling --------------------------------------------------------------
# ceiling_run LABEL SCRIPT: a fresh queue in its own database, pgbench runs SCRIPT on it; sets
# ceiling_LABEL (jobs/s), ceiling_note_LABEL and counters_LABEL (as the tally runs': WAL,
# rows, transactions and statements, pgbench's statements counted by pqcount.c)
ceiling_run() {
    local label=$1 script=$2 qconn ready_after tps done_rows s0 e0 exact stats note=""
    psql "$pg_admin" -qc "DROP DATABASE IF EXISTS tally_bench_queue" 2>/dev/null
    psql "$pg_admin" -qc "CREATE DATABASE tally_bench_queue"
    qconn="$TALLY_PG_ADMIN dbname=tally_bench_queue" # a later dbname wins in a conninfo string
    # a checkpoint first, so a run starts as far from the next one as the tally runs do
    psql "$pg_admin" -qc "CHECKPOINT"
    say "ceiling ($script): prefilling $pgbench_rows queue rows"
    psql "$qconn" -q -v ON_ERROR_STOP=1 -v rows="$pgbench_rows" -f "$root/bench/queue_setup.sql"
    s0=$(counters_stats tally_bench_queue) # its own transaction in tally_bench_queue: 1
    e0=$(counters_exact "$pq_pgbench")
    env "${pq_env[@]}" TALLY_BENCH_PQCOUNT="$pq_pgbench" \
        "$pgbench" -n -c 4 -j 2 -T "$pgbench_seconds" -f "$root/bench/$script" "$qconn" \
        >"$log_dir/pgbench-$label.log" 2>&1 || die "pgbench failed: $(tail -n 5 "$log_dir/pgbench-$label.log")"
    exact=$(counters_diff "$e0" "$(counters_exact "$pq_pgbench")")
    # pgbench's sessions flushed their statistics as they ended (a backend does at exit)
    sleep 1
    stats=$(counters_diff "$s0" "$(counters_stats tally_bench_queue)")
    ready_after=$(psql "$qconn" -Atc "SELECT count(*) FROM bench_queue WHERE state = 'ready'")
    tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' "$log_dir/pgbench-$label.log")
    # jobs completed = rows marked done; a batch claimed but not completed when the run ended
    # is not counted
    done_rows=$(psql "$qconn" -Atc "SELECT count(*) FROM bench_queue WHERE state = 'done'")
    printf -v "ceiling_$label" '%s' "$(awk -v n="$done_rows" -v s="$pgbench_seconds" 'BEGIN { printf "%.0f", n / s }')"
    if [[ "$ready_after" -eq 0 ]]; then
        note=" (the queue ran dry: a lower bound; raise --pgbench-rows)"
    fi
    printf -v "ceiling_note_$label" '%s' "$note"
    printf -v "counters_$label" '%s' "outcomes=$done_rows $exact $stats xacts_net=$(($(cv "$stats" xacts) - 1)) subtracted_xacts=1"
    local var="counters_$label"
    echo "$label ${!var}" >>"$log_dir/counters.txt"
    say "ceiling ($script): $done_rows jobs in ${pgbench_seconds}s (pgbench tps $tps x 100)$note"
    psql "$pg_admin" -qc "DROP DATABASE IF EXISTS tally_bench_queue" 2>/dev/null || true
}
ceiling_plain=""
ceiling_receipt=""
ceiling_note_plain=""
ceiling_note_receipt=""
counters_receipt="" # ceiling_run sets counters_LABEL
if [[ $skip_ceiling -eq 0 ]]; then
    ceiling_run plain pgbench_queue.sql
    ceiling_run receipt pgbench_queue_receipt.sql
fi

# ---- 3. latency at a fixed rate -------------------------------------------------------------
lat_count=$((rate * duration))
window_start
lat_started=$(psql "$pg_admin" -Atc "SELECT now()")
lat_dispatch_before=$(hist_sums tally_dispatch_seconds)
lat_connector_before=$(hist_sums tally_connector_seconds)
lat_cpu_before=$(cpu_snapshot)
client latency --count "$lat_count" --rate "$rate" --runs 100 "${fast_tools[@]}" --timeout 600 \
    --dump "$log_dir/latency_times.txt"
lat_cpu_after=$(cpu_snapshot)
read -r -a lb <<<"$lat_cpu_before"
read -r -a la <<<"$lat_cpu_after"
lat_cpu="dispatcher $(cpu_diff "${lb[0]}" "${la[0]}") s, postgres $(cpu_diff "${lb[1]}" "${la[1]}") s, kafka-mock $(cpu_diff "${lb[2]}" "${la[2]}") s, fake-tool $(cpu_diff "${lb[3]}" "${la[3]}") s"
lat_dispatch_mean=$(mean_ms "$lat_dispatch_before" "$(hist_sums tally_dispatch_seconds)")
lat_connector_mean=$(mean_ms "$lat_connector_before" "$(hist_sums tally_connector_seconds)")
lat_line=$client_line
window_end latency "$(kv "$lat_line" received)" "$lat_line" 1 # 1: lat_started's SELECT now()
save_metrics latency
say "latency at $rate/s: p50 $(kv "$lat_line" p50_ms) ms, p99 $(kv "$lat_line" p99_ms) ms"
# The ledger's share of it, by the database clock: from the intake transaction that created
# the effect to the transaction that recorded its outcome (both now() of their transaction).
# The rest of publish->outcome is Kafka in, waiting for intake, the relay and Kafka out.
lat_ledger=$(psql "$pg_admin" -At -F ' ' -c "
    WITH x AS (SELECT extract(epoch FROM v.occurred_at - e.created_at) * 1000 AS ms
               FROM effects e JOIN events v ON v.effect_id = e.effect_id
               WHERE e.created_at >= '$lat_started' AND v.kind = 'transition'
                 AND v.to_status = 'CONFIRMED')
    SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ms)::numeric, 2),
           round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ms)::numeric, 2) FROM x")
# The whole interval in three parts, per intent, with the client's clock readings (the same
# machine's CLOCK_REALTIME): publish -> intake transaction (Kafka in and the wait for intake),
# intake -> recorded outcome (the ledger), recorded -> arrival (the relay and Kafka out).
lat_parts=$(psql "$pg_admin" -qAt -F ' ' -v ON_ERROR_STOP=1 <<SQL 2>>"$log_dir/psql.log" || true
CREATE TEMP TABLE t (intent_id text, sent_ns bigint, arrival_ns bigint);
\\copy t FROM '$log_dir/latency_times.txt' WITH (DELIMITER ' ')
WITH x AS (SELECT extract(epoch FROM e.created_at) * 1000 - t.sent_ns / 1e6 AS kin,
                  extract(epoch FROM v.occurred_at - e.created_at) * 1000 AS ledger,
                  t.arrival_ns / 1e6 - extract(epoch FROM v.occurred_at) * 1000 AS kout
           FROM t JOIN effects e ON e.intent_id = t.intent_id
           JOIN events v ON v.effect_id = e.effect_id
           WHERE v.kind = 'transition' AND v.to_status = 'CONFIRMED')
SELECT round(percentile_cont(0.5) WITHIN GROUP (ORDER BY kin)::numeric, 2),
       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY kin)::numeric, 2),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ledger)::numeric, 2),
       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY ledger)::numeric, 2),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY kout)::numeric, 2),
       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY kout)::numeric, 2) FROM x;
SQL
)
# The same parts second by second of the run, into the log directory (latency_by_second.txt):
# whether the latency holds steady at this rate or grows as the run goes on, and in which part.
echo "second intents p50_ms p99_ms in_p50_ms ledger_p50_ms out_p50_ms" >"$log_dir/latency_by_second.txt"
psql "$pg_admin" -qAt -F ' ' -v ON_ERROR_STOP=1 >>"$log_dir/latency_by_second.txt" <<SQL 2>>"$log_dir/psql.log" || true
CREATE TEMP TABLE t (intent_id text, sent_ns bigint, arrival_ns bigint);
\\copy t FROM '$log_dir/latency_times.txt' WITH (DELIMITER ' ')
WITH x AS (SELECT (t.sent_ns - min(t.sent_ns) OVER ()) / 1000000000 AS second,
                  (t.arrival_ns - t.sent_ns) / 1e6 AS total,
                  extract(epoch FROM e.created_at) * 1000 - t.sent_ns / 1e6 AS kin,
                  extract(epoch FROM v.occurred_at - e.created_at) * 1000 AS ledger,
                  t.arrival_ns / 1e6 - extract(epoch FROM v.occurred_at) * 1000 AS kout
           FROM t JOIN effects e ON e.intent_id = t.intent_id
           JOIN events v ON v.effect_id = e.effect_id
           WHERE v.kind = 'transition' AND v.to_status = 'CONFIRMED')
SELECT second, count(*),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY total)::numeric, 1),
       round(percentile_cont(0.99) WITHIN GROUP (ORDER BY total)::numeric, 1),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY kin)::numeric, 1),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY ledger)::numeric, 1),
       round(percentile_cont(0.5) WITHIN GROUP (ORDER BY kout)::numeric, 1)
FROM x GROUP BY second ORDER BY second;
SQL
# ... and intent by intent (latency_parts.txt: sent_ns total_ms in_ms ledger_ms out_ms), to
# look at one slow moment of the run.
psql "$pg_admin" -qAt -v ON_ERROR_STOP=1 <<SQL 2>>"$log_dir/psql.log" || true
CREATE TEMP TABLE t (intent_id text, sent_ns bigint, arrival_ns bigint);
\\copy t FROM '$log_dir/latency_times.txt' WITH (DELIMITER ' ')
CREATE TEMP TABLE p AS
SELECT t.sent_ns, round((t.arrival_ns - t.sent_ns) / 1e6, 2) AS total_ms,
       round(extract(epoch FROM e.created_at) * 1000 - t.sent_ns / 1e6, 2) AS in_ms,
       round(extract(epoch FROM v.occurred_at - e.created_at) * 1000, 2) AS ledger_ms,
       round(t.arrival_ns / 1e6 - extract(epoch FROM v.occurred_at) * 1000, 2) AS out_ms
FROM t JOIN effects e ON e.intent_id = t.intent_id
JOIN events v ON v.effect_id = e.effect_id
WHERE v.kind = 'transition' AND v.to_status = 'CONFIRMED' ORDER BY t.sent_ns;
\\copy p TO '$log_dir/latency_parts.txt' WITH (DELIMITER ' ')
SQL

# Drift: the first and the last minute of the run set side by side (intents by send time;
# publish -> outcome by the client's clock, from latency_times.txt). A run shorter than two
# minutes compares its first and last third instead, and the lines say so.
lat_drift=$(python3 - "$log_dir/latency_times.txt" <<'PY' 2>>"$log_dir/psql.log" || true
import sys
rows = []
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) == 3:
        rows.append((int(p[1]), (int(p[2]) - int(p[1])) / 1e6))
if not rows:
    sys.exit(0)
t0 = min(r[0] for r in rows)
t1 = max(r[0] for r in rows)
span = (t1 - t0) / 1e9
w = 60.0 if span >= 120 else span / 3
def pct(v, p):  # nearest rank, as tally-bench-client
    v = sorted(v)
    if not v:
        return float("nan")
    k = max(1, min(len(v), int(p / 100 * len(v) + 0.999999)))
    return v[k - 1]
first = [ms for t, ms in rows if (t - t0) / 1e9 < w]
last = [ms for t, ms in rows if (t1 - t) / 1e9 < w]
print("%.1f %.1f %.2f %.2f %d %.2f %.2f %d" % (span, w, pct(first, 50), pct(first, 99), len(first),
                                               pct(last, 50), pct(last, 99), len(last)))
PY
)

# ---- 4. a slow tool ---------------------------------------------------------------------------
# conn_hist TOOL: tally_connector_seconds of TOOL summed over the dispatchers, one line:
# "LE=COUNT ... sum=S count=N" (cumulative buckets, as exposed)
conn_hist() {
    local port
    for port in "${metrics_ports[@]}"; do
        curl -s --max-time 5 "http://127.0.0.1:$port/metrics" || true
    done | awk -v t="tool=\"$1\"" '
        index($1, "tally_connector_seconds_bucket{" t ",le=\"") == 1 {
            le = substr($1, length("tally_connector_seconds_bucket{" t ",le=\"") + 1); sub(/"}$/, "", le)
            if (!(le in c)) order[n++] = le
            c[le] += $2 }
        $1 == "tally_connector_seconds_sum{" t "}" { s += $2 }
        $1 == "tally_connector_seconds_count{" t "}" { k += $2 }
        END { for (i = 0; i < n; i++) printf "%s=%s ", order[i], c[order[i]]; printf "sum=%.6f count=%d\n", s, k }'
}
slow_line=""
if [[ $slow_seconds -gt 0 ]]; then
    curl -s -f -X POST "$TALLY_FAKE_TOOL_URL/_control/faults" \
        -d "{\"collection\":\"bench_slow\",\"op\":\"execute\",\"fault\":\"slow\",\"delay_ms\":$slow_ms,\"times\":-1}" \
        >/dev/null || die "cannot arm the slow fault on the fake tool"
    slow_hist0=$(conn_hist bench_slow)
    # once a second: the calls the dispatchers hold (tally_inflight_calls, summed) and the
    # first dispatcher's VmRSS in kB
    (
        while :; do
            n=0
            for port in "${metrics_ports[@]}"; do
                v=$({ curl -s --max-time 1 "http://127.0.0.1:$port/metrics" || true; } |
                    awk '$1 == "tally_inflight_calls" { sub(/\..*/, "", $2); print $2; exit }')
                n=$((n + ${v:-0}))
            done
            echo "$n $(awk '$1 == "VmRSS:" { print $2 }' "/proc/${dispatcher_pids[0]}/status" 2>/dev/null)"
            sleep 1
        done
    ) >"$work/slow-samples.txt" &
    sampler_pid=$!
    client slow --count $((30000 * slow_seconds)) --window "$slow_inflight" --duration "$slow_seconds" \
        --runs 100 --tool bench_slow:job_id --timeout $((slow_seconds + 600))
    stop_pid "$sampler_pid" 5
    sampler_pid=""
    slow_line=$client_line
    slow_hist1=$(conn_hist bench_slow)
    curl -s -X DELETE "$TALLY_FAKE_TOOL_URL/_control/faults" >/dev/null || true
    slow_hwm_kb=$(status_kb "${dispatcher_pids[0]}" VmHWM)
    cp "$work/slow-samples.txt" "$log_dir/slow-tool-samples.txt"
    # in flight and memory over the seconds the agent was publishing (its window kept full)
    read -r slow_held_mean slow_held_max slow_rss_max < <(awk -v s="$slow_seconds" '
        NR <= s { n++; h += $1; if ($1 > hm) hm = $1; if ($2 > rm) rm = $2 }
        END { printf "%.0f %d %d\n", (n ? h / n : 0), hm, rm }' "$work/slow-samples.txt")
    # the answers' time: the histogram's new observations; its buckets are 100, 250, 500 ms...
    # around 200 ms, so the 99th percentile is known to lie in one bucket, and the share at or
    # under the bucket bound nearest below the target is exact
    slow_target_ms=$((slow_ms + 50))
    read -r slow_p99_lo slow_p99_hi slow_le slow_le_share slow_n slow_mean < <(awk \
        -v a="$slow_hist0" -v b="$slow_hist1" -v target="$slow_target_ms" 'BEGIN {
            n = split(a, x, " "); for (i = 1; i <= n; i++) { split(x[i], kv, "="); v0[kv[1]] = kv[2] }
            m = split(b, y, " ")
            for (i = 1; i <= m; i++) { split(y[i], kv, "="); d[kv[1]] = kv[2] - v0[kv[1]]; if (kv[1] != "sum" && kv[1] != "count") o[k++] = kv[1] }
            total = d["count"]; lo = 0; hi = "?"; le = 0; share = 0
            for (i = 0; i < k; i++) {
                if (hi == "?" && total > 0 && d[o[i]] >= 0.99 * total) hi = o[i]
                if (hi == "?") lo = o[i]
                if (o[i] != "+Inf" && o[i] * 1000 <= target + 1e-9) { le = o[i]; share = (total > 0 ? d[o[i]] / total : 0) }
            }
            printf "%s %s %s %.4f %d %.1f\n", lo * 1000, (hi == "+Inf" ? "inf" : hi * 1000), le * 1000, share * 100, total,
                (total > 0 ? d["sum"] / total * 1000 : 0) }')
    say "slow tool: $(kv "$slow_line" steady_effects_per_s) effects/s, $slow_held_mean calls held on average (max $slow_held_max), answers' p99 in ($slow_p99_lo, $slow_p99_hi] ms"
fi

# ---- 5. dispatcher memory with slow calls in flight -------------------------------------------
metric() { # metric PORT NAME: the value of an unlabelled sample, or empty when unreadable
    { curl -s --max-time 2 "http://127.0.0.1:$1/metrics" || true; } |
        awk -v n="$2" '$1 == n { sub(/\..*/, "", $2); print $2; exit }'
}
# Requests the fake tool is holding open right now: its request log has status null while a
# request is in progress. The tool's own count, independent of the dispatcher's metrics.
tool_holding() {
    { curl -s --max-time 10 "$TALLY_FAKE_TOOL_URL/_control/requests" || true; } | python3 -c '
import json, sys
try:
    log = json.load(sys.stdin)
    log = log["requests"] if isinstance(log, dict) else log
    print(sum(1 for r in log if r.get("collection") == "bench_slow" and r.get("status") is None))
except Exception:
    print(0)'
}
rss_target=""
if [[ $inflight -gt 0 ]]; then
    # one dispatcher holds them all: stop the others (their partitions move to the first)
    while [[ ${#dispatcher_pids[@]} -gt 1 ]]; do
        stop_pid "${dispatcher_pids[-1]}" 30
        unset 'dispatcher_pids[-1]' 'metrics_ports[-1]'
    done
    dpid=${dispatcher_pids[0]}
    dport=${metrics_ports[0]}
    sleep 2 # idle: the dispatcher gives a burst's freed heap back after a second without work
    rss_idle_kb=$(status_kb "$dpid" VmRSS)
    curl -s -f -X POST "$TALLY_FAKE_TOOL_URL/_control/faults" \
        -d "{\"collection\":\"bench_slow\",\"op\":\"execute\",\"fault\":\"slow\",\"delay_ms\":$slow_delay_ms,\"times\":-1}" \
        >/dev/null || die "cannot arm the slow fault on the fake tool"
    client memory --count "$inflight" --runs 50 --tool bench_slow:job_id --no-wait
    rss_target=$((inflight * 99 / 100))
    held=0
    deadline=$((SECONDS + 120))
    while ((SECONDS < deadline)); do
        kill -0 "$dpid" 2>/dev/null || die "tally-dispatcher exited while holding slow calls"
        held=$(tool_holding)
        ((held >= rss_target)) && break
        sleep 0.5
    done
    sleep 1 # let the last claims settle before reading
    kill -0 "$dpid" 2>/dev/null || die "tally-dispatcher exited while holding slow calls"
    held=$(tool_holding)
    held_metric=$(metric "$dport" tally_inflight_calls)
    rss_kb=$(status_kb "$dpid" VmRSS)
    hwm_kb=$(status_kb "$dpid" VmHWM)
    threads=$(status_kb "$dpid" Threads)
    fds=$(find "/proc/$dpid/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
    # where the resident memory is: the mappings by Rss (the malloc heap, thread stacks, ...)
    awk '/^[0-9a-f]+-[0-9a-f]+ / { name = ($6 == "" ? "[anon]" : $6) }
         /^Rss:/ { rss[name] += $2 } END { for (n in rss) printf "%8d kB  %s\n", rss[n], n }' \
        "/proc/$dpid/smaps" 2>/dev/null | sort -rn | head -n 15 >"$log_dir/dispatcher-smaps.txt" || true
    curl -s -X DELETE "$TALLY_FAKE_TOOL_URL/_control/faults" >/dev/null || true
    say "memory: $held calls in flight, VmRSS $rss_kb kB, VmHWM $hwm_kb kB (idle before: $rss_idle_kb kB)"
    if ((${held:-0} < rss_target)); then
        say "memory: the dispatcher held only ${held:-0} of $inflight calls within 120 s"
    fi
fi

# ---- figures ----------------------------------------------------------------------------------
mb() { awk -v k="$1" 'BEGIN { printf "%.1f", k / 1024 }'; }
echo
echo "bench: date = $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "bench: commit = $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$root" status --porcelain 2>/dev/null | grep -q . && echo '+dirty')"
echo "bench: build = ${build_type:-unknown}"
echo "bench: machine = $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GB", $2 / 1048576}' /proc/meminfo), load $(cut -d' ' -f1 /proc/loadavg) at end"
echo "bench: postgresql = $pg_settings"
echo "bench: dispatchers = $dispatchers"
if [[ $sensitive -eq 1 ]]; then
    echo "bench: sensitive = on (bench_ledger, bench_charge: args /amount and /currency sealed, receipts /body redacted; requests signed RFC 9421)"
else
    echo "bench: sensitive = off"
fi
if [[ $pg_statements -eq 1 || $use_perf -eq 1 ]]; then
    echo "bench: note = the throughput run was profiled (--pg-statements / --perf): its figures are lower than an unprofiled run's"
fi
echo "bench: throughput_intents = $(kv "$tp_line" received) of $intents intents over $runs runs (confirmed $(kv "$tp_line" confirmed), failed $(kv "$tp_line" failed), unknown $(kv "$tp_line" unknown), other $(kv "$tp_line" other))"
echo "bench: publish_rate = $(kv "$tp_line" publish_rate) intents/s"
echo "bench: throughput = $tp_rate effects/s"
echo "bench: throughput_latency_p50 = $(kv "$tp_line" p50_ms) ms"
echo "bench: throughput_latency_p99 = $(kv "$tp_line" p99_ms) ms"
echo "bench: throughput_latency_max = $(kv "$tp_line" max_ms) ms"
echo "bench: outbox_backlog_max = $outbox_max rows"
echo "bench: message_outbox_backlog_max = $msg_outbox_max rows"
echo "bench: pending_effects_max = $pending_max effects (PLANNED or DISPATCHING, sampled once a second)"
echo "bench: throughput_dispatch_mean = $dispatch_mean ms (claim to recorded outcome, tally_dispatch_seconds)"
echo "bench: throughput_connector_mean = $connector_mean ms (HTTP call, tally_connector_seconds)"
echo "bench: throughput_pg_waits = ${pg_waits:-no samples}"
echo "bench: throughput_cpu = dispatcher $cpu_dispatcher s, postgres $cpu_postgres s, kafka-mock $cpu_kafka s, fake-tool $cpu_fake s"
echo "bench: throughput_cpu_per_effect = $cpu_per_effect us (dispatchers and PostgreSQL)"
steady_lines counters_throughput throughput effect
echo "bench: idle_dispatchers = $idle_line (taken out of the runs' transactions over the ${stats_delay} s statistics delay)"
if [[ -n "$ceiling_plain" ]]; then
    echo "bench: pg_ceiling = $ceiling_plain rows/s$ceiling_note_plain"
    echo "bench: ceiling_ratio = $(awk -v a="$tp_rate" -v b="$ceiling_plain" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }') x (target >= 0.15)"
    echo "bench: pg_ceiling_receipt = $ceiling_receipt jobs/s (with a receipt row per job)$ceiling_note_receipt"
    echo "bench: ceiling_ratio_receipt = $(awk -v a="$tp_rate" -v b="$ceiling_receipt" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }') x (throughput / pg_ceiling_receipt)"
    steady_lines counters_plain ceiling job
    steady_lines counters_receipt ceiling job _receipt
    echo "bench: wal_ratio = $(awk -v a="$(per_effect "$(cv "$counters_throughput" wal)" "$(cv "$counters_throughput" outcomes)" 4)" \
        -v b="$(per_effect "$(cv "$counters_receipt" wal)" "$(cv "$counters_receipt" outcomes)" 4)" \
        'BEGIN { if (b > 0) printf "%.2f", a / b; else printf "n/a" }') x (throughput_wal_per_effect / ceiling_wal_per_job_receipt; target <= 3)"
else
    echo "bench: pg_ceiling = not measured (--skip-ceiling)"
fi
echo "bench: latency_rate = $(kv "$lat_line" publish_rate) intents/s for ${duration} s ($(kv "$lat_line" received) outcomes)"
echo "bench: latency_p50 = $(kv "$lat_line" p50_ms) ms (target <= 10)"
echo "bench: latency_p99 = $(kv "$lat_line" p99_ms) ms (target <= 50)"
echo "bench: latency_max = $(kv "$lat_line" max_ms) ms"
echo "bench: latency_ledger = p50 ${lat_ledger%% *} ms, p99 ${lat_ledger##* } ms (intake transaction to recorded outcome, by the database clock)"
read -r kin50 kin99 led50 led99 kout50 kout99 <<<"${lat_parts:-}"
echo "bench: latency_parts = in p50 ${kin50:-?} / p99 ${kin99:-?} ms, ledger ${led50:-?} / ${led99:-?} ms, out ${kout50:-?} / ${kout99:-?} ms (publish -> intake transaction -> recorded outcome -> arrival)"
echo "bench: latency_dispatch_mean = $lat_dispatch_mean ms, connector $lat_connector_mean ms (claim to recorded outcome; the HTTP call)"
echo "bench: latency_cpu = $lat_cpu (CPU used during the fixed-rate run)"
if [[ -n "$lat_drift" ]]; then
    read -r d_span d_w d_f50 d_f99 d_fn d_l50 d_l99 d_ln <<<"$lat_drift"
    if awk -v w="$d_w" 'BEGIN { exit !(w == 60) }'; then
        d_what="minute"
    else
        d_what="third of the run: ${d_w} s of ${d_span} s, shorter than two minutes"
    fi
    echo "bench: latency_first_minute_p50 = $d_f50 ms (intents sent in the first $d_what; $d_fn of them)"
    echo "bench: latency_first_minute_p99 = $d_f99 ms"
    echo "bench: latency_last_minute_p50 = $d_l50 ms (intents sent in the last $d_what; $d_ln of them)"
    echo "bench: latency_last_minute_p99 = $d_l99 ms"
    echo "bench: latency_drift_p50 = $(awk -v a="$d_f50" -v b="$d_l50" 'BEGIN { printf "%+.2f", b - a }') ms (last minus first $d_what)"
    echo "bench: latency_drift_p99 = $(awk -v a="$d_f99" -v b="$d_l99" 'BEGIN { printf "%+.2f", b - a }') ms (last minus first $d_what)"
else
    echo "bench: latency_drift_p50 = not measured (no per-intent times: see psql.log)"
fi
steady_lines counters_latency latency effect
if [[ -n "$slow_line" ]]; then
    echo "bench: slow_tool_effects = $(kv "$slow_line" steady_effects_per_s) effects/s ($(kv "$slow_line" steady_outcomes) outcomes in $(kv "$slow_line" steady_s) s while the agent kept up to $slow_inflight effects without an outcome (most at once: $(kv "$slow_line" window_max)); tool answering in $slow_ms ms)"
    echo "bench: slow_tool_inflight = $slow_held_mean calls (mean of the dispatchers' tally_inflight_calls, once a second; max $slow_held_max; $slow_inflight would need $((slow_inflight * 1000 / slow_ms)) effects/s)"
    if [[ "$slow_p99_hi" == inf || "$slow_p99_hi" == "?" ]]; then
        slow_verdict="above every bucket"
    elif awk -v h="$slow_p99_hi" -v t="$slow_target_ms" 'BEGIN { exit !(h <= t) }'; then
        slow_verdict="met"
    else
        slow_verdict="not shown: the bucket reaches past the target"
    fi
    echo "bench: slow_tool_answer_p99 = $slow_p99_hi ms (at most: tally_connector_seconds of bench_slow puts the 99th percentile of $slow_n answers in its bucket ($slow_p99_lo, $slow_p99_hi] ms; $slow_le_share % took <= $slow_le ms; target <= $slow_target_ms: $slow_verdict)"
    echo "bench: slow_tool_answer_mean = $slow_mean ms (tally_connector_seconds _sum / _count)"
    echo "bench: slow_tool_dispatcher_rss = $(mb "$slow_rss_max") MB (the first dispatcher's VmRSS, highest of the samples; VmHWM $(mb "$slow_hwm_kb") MB)"
else
    echo "bench: slow_tool_effects = not measured (--slow-tool-seconds 0)"
fi
if [[ -n "$rss_target" ]]; then
    echo "bench: inflight_held = ${held:-0} calls (asked $inflight; held open at the tool; the dispatcher's tally_inflight_calls said ${held_metric:-nothing: /metrics did not answer})"
    echo "bench: dispatcher_rss = $(mb "$rss_kb") MB (target <= 64)"
    echo "bench: dispatcher_hwm = $(mb "$hwm_kb") MB (peak over the whole run)"
    echo "bench: dispatcher_rss_idle = $(mb "$rss_idle_kb") MB (before the slow calls)"
    echo "bench: dispatcher_threads = $threads threads, $fds fds"
    # The same number of calls through the connector alone (connmem.c): libcurl's share.
    "$connmem_bin" --calls "$inflight" 2>>"$log_dir/connmem.log" ||
        echo "bench: connmem = failed (see $log_dir/connmem.log)"
else
    echo "bench: dispatcher_rss = not measured (--inflight 0)"
fi
