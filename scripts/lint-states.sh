#!/usr/bin/env bash
# No state name is compared as a string in the product's C (issue 22): a status read from
# PostgreSQL is parsed once, at the edge, into the enums of tally/machines.h (generated from
# schemas/machines.json), and decisions switch over those. A strcmp/strncmp/strcasecmp with a
# state's spelling as one of its arguments is what this catches. SQL text is not C: states in
# SQL strings are left alone (the database's triggers check those moves).
# Run from anywhere; exits 1 listing every offending line.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

states=$(/usr/bin/env python3 - <<'PY'
import json
spec = json.load(open("schemas/machines.json"))
print("|".join(sorted({s["name"] for m in spec["machines"] for s in m["states"]})))
PY
)
pattern="str(n?case)?cmp\\([^;]*\"(${states})\""
if grep -rnE "$pattern" --include='*.c' --include='*.h' common dispatcher reconciler compensator cli; then
    echo "lint-states: compare the enums of tally/machines.h, not state names (parse at the edge)" >&2
    exit 1
fi
echo "lint-states: no state name compared as a string"
