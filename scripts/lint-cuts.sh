#!/usr/bin/env bash
# No printf precision on text: "%.40s" cuts at a byte count, in the middle of a multi-byte
# character, and the invalid UTF-8 it leaves makes PostgreSQL, JSON and Kafka refuse the whole
# message (issue 20). Cut text with tally_fmt / tally_text_copy (common/include/tally/text.h).
#
# "%.*s" is allowed where it prints a slice of known length rather than cutting (a name up to
# its '=', the first 8 hex digits of a UUID): the line, or one of the three before it, must
# say "lint: slice". The product's C is checked (tests print slices in their failure messages).
# Run from anywhere; exits 1 listing every offending line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

status=0
while IFS= read -r -d '' f; do
    out=$(awk -v file="$f" '
        { line[NR] = $0 }
        /%\.[0-9]+[sS]/ {
            printf "%s:%d: a fixed precision cuts text mid-character: %s\n", file, NR, $0
            bad = 1
        }
        /%\.\*[sS]/ {
            ok = 0
            for (k = NR - 3; k <= NR; k++) if (k > 0 && line[k] ~ /lint: slice/) ok = 1
            if (!ok) {
                printf "%s:%d: %%.*s without a \"lint: slice\" note: %s\n", file, NR, $0
                bad = 1
            }
        }
        END { exit bad }' "$f") || {
        printf '%s\n' "$out" >&2
        status=1
    }
done < <(find common dispatcher reconciler compensator cli bench examples -name '*.[ch]' -print0)

if [[ $status -ne 0 ]]; then
    echo "scripts/lint-cuts.sh: cut text with tally_fmt or tally_text_copy (tally/text.h)" >&2
else
    echo "scripts/lint-cuts.sh: no printf precision cuts text"
fi
exit $status
