#!/usr/bin/env bash
# Install what building and testing tally needs on Debian 12, and nothing that is already
# there. Idempotent: with everything present it only checks and exits 0.
set -euo pipefail

packages=(
    build-essential cmake pkg-config clang-format
    librdkafka-dev libpq-dev libjansson-dev uuid-dev libcurl4-openssl-dev
    libmicrohttpd-dev libcmocka-dev libssl-dev
    postgresql kcat
    python3 python3-psycopg2 python3-confluent-kafka python3-jsonschema python3-yaml
    python3-kubernetes systemd
    # gdb reads the debug symbols deploy/split-debug.sh splits off (tests/integration/test_deploy.py)
    gdb
    prometheus
    # headless Chromium and a font for the web console's browser test (tests/integration/test_console.py)
    chromium fonts-dejavu-core
    # clang with libFuzzer and its sanitizer runtimes: the fuzz targets (tests/fuzz/)
    clang libfuzzer-14-dev libclang-rt-14-dev
)

# Node.js and npm build and run the TypeScript example agent in its test (examples/agent-ts).
# A machine that has them from elsewhere keeps them (NodeSource's nodejs package bundles npm,
# and Debian's npm package would conflict with it).
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    packages+=(nodejs npm)
fi

missing=()
for p in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    if [[ "$status" != "install ok installed" ]]; then
        missing+=("$p")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "scripts/deps.sh: these packages are missing: ${missing[*]}" >&2
    echo "scripts/deps.sh: installing them needs root; run: sudo $0" >&2
    echo "                 (or: sudo apt-get install ${missing[*]})" >&2
    exit 1
fi

echo "scripts/deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
