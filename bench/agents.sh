#!/usr/bin/env bash
# tally's agents benchmark (bench/README.md, "Issue 21"): N agent processes at R intents/s in
# total, read amplification and latency of the Python client (clients/python) beside today's
# reading of <prefix>outcomes. bench/agents.py does the work; this runs it with Debian's
# /usr/bin/python3, which has python3-confluent-kafka (the python3 first on PATH may not).
#
#   bench/agents.sh [--agents N] [--rate R] [--duration S] [--outcomes-agents K]
#                   [--dispatchers D] [--api asyncio|threads] [--agent-fetch-wait-ms MS]
#                   [--fetch-wait-ms MS] [--build-dir DIR] [--no-build] [--log-dir DIR]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${TALLY_BENCH_PYTHON:-/usr/bin/python3}
if ! "$python" -c 'import confluent_kafka' 2>/dev/null; then
    echo "bench/agents.sh: $python cannot import confluent_kafka (Debian: python3-confluent-kafka)" >&2
    exit 1
fi
exec "$python" "$here/agents.py" "$@"
