#!/bin/sh
# split-debug.sh BIN_DIR DEBUG_DIR — keep each program's debug symbols apart from it: for every
# file in BIN_DIR, DEBUG_DIR/<name>.debug gets its DWARF (compressed), and the program is
# stripped and names that file in its .gnu_debuglink section (with a CRC), where gdb, eu-stack
# and systemd-coredump look it up: installed as /usr/lib/debug/<program's path>.debug, e.g.
# /usr/lib/debug/usr/local/bin/tally-dispatcher.debug.
#
# The image build runs it (deploy/Dockerfile: the runtime image carries the stripped programs,
# the debug target the symbols); tests/integration/test_deploy.py runs it on this tree's
# programs and checks both halves.
set -eu
if [ $# -ne 2 ]; then
    echo "usage: $0 BIN_DIR DEBUG_DIR" >&2
    exit 2
fi
bin=$1
debug=$2
mkdir -p "$debug"
for f in "$bin"/*; do
    [ -f "$f" ] || continue
    name=$(basename "$f")
    objcopy --only-keep-debug --compress-debug-sections=zlib "$f" "$debug/$name.debug"
    chmod 0644 "$debug/$name.debug"
    strip --strip-unneeded "$f"
    objcopy --add-gnu-debuglink="$debug/$name.debug" "$f"
done
