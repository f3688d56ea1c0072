#!/usr/bin/env bash
# One fuzz.<target> test: replay tests/fuzz/regressions/<target>/ (every input a fuzzer once
# failed on), then fuzz for SECONDS from a copy of corpus/<target>/ in a temporary directory,
# so the corpus in the repository is left as it is. Fails on any crash, leak, timeout or
# out-of-memory; the input that failed is kept in $TALLY_FUZZ_ARTIFACTS (default: the
# current directory, ctest's tests/ of the build tree) as fuzz-<target>-crash-<sha1>.
#
#   tests/fuzz/run.sh FUZZER TARGET SECONDS
set -euo pipefail

fuzzer=$1 target=$2 seconds=$3
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
keep="${TALLY_FUZZ_ARTIFACTS:-$PWD}"

if [[ ! -x "$fuzzer" ]]; then
    echo "run.sh: $fuzzer is not built (cmake --build build-fuzz --target fuzzers)" >&2
    exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/tally-fuzz-$target-XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/corpus" "$work/artifacts"
cp -R "$here/corpus/$target/." "$work/corpus/"

opts=(-rss_limit_mb=2048 -timeout=25 -artifact_prefix="$work/artifacts/")
if [[ -f "$here/dict/$target.dict" ]]; then
    opts+=(-dict="$here/dict/$target.dict")
fi

status=0
if compgen -G "$here/regressions/$target/*" >/dev/null; then
    "$fuzzer" "${opts[@]}" "$here/regressions/$target"/* || status=$?
fi
if [[ $status -eq 0 ]]; then
    "$fuzzer" "${opts[@]}" -max_total_time="$seconds" -print_final_stats=1 "$work/corpus" ||
        status=$?
fi

if [[ $status -ne 0 ]]; then
    for f in "$work/artifacts"/*; do
        [[ -e "$f" ]] || continue
        cp "$f" "$keep/fuzz-$target-$(basename "$f")"
        echo "run.sh: the failing input is $keep/fuzz-$target-$(basename "$f")" >&2
    done
fi
exit "$status"
