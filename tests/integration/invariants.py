"""The ledger's invariants (DESIGN §3, §11), checked in SQL after a scenario, and the fake
tool's own records compared with the ledger one for one.

    from invariants import check_invariants
    check_invariants(self)                               # SQL only
    check_invariants(self, fake_url=url)                 # and the fake's records
    check_invariants(self, fake_url=url, allow_unknown_applied=True, obligations_settled=False)

Each check names what a user would look at; a failure lists every violation, not just the
first. Reusable by every scenario test (dispatcher, reconciler, compensator).
"""

import json
import os
import urllib.request

# (what is checked, SQL returning the offending rows)
SQL_CHECKS = [
    ("every CONFIRMED effect has a receipt",
     "SELECT effect_id FROM effects WHERE status = 'CONFIRMED' AND receipt IS NULL"),
    ("every DISPATCHING effect holds a lease",
     "SELECT effect_id FROM effects WHERE status = 'DISPATCHING'"
     " AND (lease_owner IS NULL OR lease_until IS NULL)"),
    ("no effect outside DISPATCHING holds a lease",
     "SELECT effect_id, status FROM effects WHERE status <> 'DISPATCHING'"
     " AND status <> 'UNKNOWN' AND lease_owner IS NOT NULL"),
    ("every dispatch outbox row belongs to a PLANNED effect",
     "SELECT o.effect_id, e.status FROM outbox o JOIN effects e USING (effect_id)"
     " WHERE e.status <> 'PLANNED'"),
    ("every PLANNED effect has its dispatch outbox row",
     "SELECT e.effect_id FROM effects e WHERE e.status = 'PLANNED'"
     " AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.effect_id = e.effect_id)"),
    ("every UNKNOWN effect says since when",
     "SELECT effect_id FROM effects WHERE status = 'UNKNOWN' AND unknown_since IS NULL"),
    ("every FAILED effect says why",
     "SELECT effect_id FROM effects WHERE status = 'FAILED' AND error_code IS NULL"),
    ("every effect's run exists",
     "SELECT e.effect_id FROM effects e LEFT JOIN runs r USING (run_id) WHERE r.run_id IS NULL"),
    # The events index (schema 8) and `tally doctor` find an effect's transitions and
    # connector calls through its run alone.
    ("every transition and connector call of an effect names the effect's run",
     "SELECT v.event_id, v.kind, v.run_id, e.run_id FROM events v JOIN effects e USING (effect_id)"
     " WHERE v.kind IN ('transition', 'connector_call') AND v.run_id IS DISTINCT FROM e.run_id"),
    # The receipt is stored once, on the effect: the call that stored it keeps its SHA-256
    # as the effect holds it (a pruned run's receipts are gone on purpose; a receipt taken
    # away by hand is the check above's).
    ("every connector call that refers to its effect's receipt keeps that receipt's hash",
     "SELECT v.event_id, v.data -> 'receipt', e.effect_id FROM events v"
     " JOIN effects e ON e.run_id = v.run_id AND e.effect_id = v.effect_id"
     " JOIN runs r ON r.run_id = e.run_id"
     " WHERE v.kind = 'connector_call' AND v.data #>> '{receipt,on}' = 'effect'"
     "   AND r.pruned_at IS NULL AND e.receipt IS NOT NULL"
     "   AND (v.data #>> '{receipt,sha256}'"
     "       IS DISTINCT FROM encode(sha256(convert_to(e.receipt::text, 'UTF8')), 'hex')"
     "     OR (v.data #> '{receipt,sealed_sha256}' IS NOT NULL"
     "       AND v.data #>> '{receipt,sealed_sha256}'"
     "         IS DISTINCT FROM encode(sha256(e.receipt_sealed), 'hex')))"),
    ("every effect has the event of its creation",
     "SELECT e.effect_id FROM effects e WHERE NOT EXISTS (SELECT 1 FROM events v"
     " WHERE v.run_id = e.run_id AND v.effect_id = e.effect_id AND v.kind = 'transition'"
     "   AND v.from_status IS NULL)"),
    ("every effect's current state is the target of its last transition event",
     "SELECT e.effect_id, e.status, t.to_status FROM effects e"
     " JOIN LATERAL (SELECT to_status FROM events v WHERE v.run_id = e.run_id"
     "   AND v.effect_id = e.effect_id AND v.kind = 'transition' ORDER BY v.seq DESC LIMIT 1) t"
     "   ON true"
     " WHERE t.to_status IS DISTINCT FROM e.status"),
    ("attempts stay within the tool's cap plus one",
     "SELECT effect_id, attempts FROM effects WHERE attempts > 100"),
]

# Every status change the audit trail records is a move of its machine (schemas/machines.json,
# installed as tally_machine_moves()): the database refuses the others, so one here means an
# event that lies about the move it records. The machine is the event's subject: an alert's
# (kind 'alert', or TRIGGERED at either end: an operator closing a page names the alert's
# effect or obligation too), else its obligation, else its effect, else its run. An event from
# a state to itself (a summary re-published, a lease taken over) is no move.
SQL_TRANSITIONS = (
    "every audit transition is a move of its machine",
    "WITH v AS (SELECT seq, kind, from_status, to_status,"
    "   CASE WHEN kind = 'alert' OR 'TRIGGERED' IN (from_status, to_status) THEN 'alert'"
    "     WHEN obligation_id IS NOT NULL THEN 'obligation'"
    "     WHEN effect_id IS NOT NULL THEN 'effect' ELSE 'run' END AS machine"
    " FROM events WHERE to_status IS NOT NULL AND from_status IS DISTINCT FROM to_status)"
    " SELECT v.seq, v.kind, v.machine, v.from_status, v.to_status FROM v"
    " WHERE NOT EXISTS (SELECT 1 FROM tally_machine_moves() m WHERE m.machine = v.machine"
    "   AND m.from_status IS NOT DISTINCT FROM v.from_status AND m.to_status = v.to_status)"
    " ORDER BY v.seq")


def check_transitions(case):
    """SQL_TRANSITIONS on @case's database; an AssertionError listing every offending event.
    tallytest.TallyCase runs it after every test, so every scenario checks it."""
    if case.scalar("SELECT to_regprocedure('tally_machine_moves()') IS NOT NULL") is not True:
        return  # a test of an empty or older schema
    what, sql = SQL_TRANSITIONS
    rows = case.query(sql)
    if rows:
        raise AssertionError(f"{what}: {len(rows)} event(s) record moves outside the machines:\n"
                             + "\n".join(f"  seq {r[0]} kind {r[1]}: {r[2]} {r[3]} -> {r[4]}"
                                          for r in rows[:20]))


SQL_OBLIGATIONS_SETTLED = (
    "every obligation is terminal or leased",
    "SELECT obligation_id, status FROM obligations WHERE NOT ("
    " status IN ('RESOLVED', 'SKIPPED', 'UNCOMPENSATABLE', 'STUCK', 'CANCELLED')"
    " OR (status = 'RUNNING' AND lease_owner IS NOT NULL AND lease_until IS NOT NULL))")


def _http_json(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def tool_collections(tools_file):
    """{collection: tool name} from each tool's execute path ("/charges" -> "charges")."""
    with open(tools_file) as f:
        doc = json.load(f)
    out = {}
    for t in doc["tools"]:
        path = t["connector"]["execute"]["path"]
        out[path.strip("/").split("/")[0].split("?")[0]] = t["name"]
    return out


def fake_vs_ledger(case, fake_url, allow_unknown_applied=False, allow_duplicates=False,
                   reversed_extras=()):
    """Problems between the fake tool's records and the ledger: every upstream record is the
    receipt of exactly one CONFIRMED effect with the same key (or, when allowed, belongs to an
    effect still UNKNOWN), and every CONFIRMED effect of a faked tool has its record. For the
    tools in @reversed_extras (audited and swept, issue 24) a record that is not a CONFIRMED
    effect's receipt is allowed only reversed: an extra record of a CONFIRMED effect, or a record
    of an effect that did not happen (FAILED, CANCELLED, REJECTED)."""
    problems = []
    colls = tool_collections(case.tools_file)
    records = _http_json(fake_url + "/_control/records")["records"]
    effects = {}
    for eid, tool, key, status, ref in case.query(
            "SELECT effect_id::text, tool, operation_key, status, external_ref FROM effects"):
        effects[(tool, key)] = (eid, status, ref)
    by_key = {}
    for rec in records:
        tool = colls.get(rec["collection"])
        if tool is None:
            continue
        by_key.setdefault((tool, rec["idempotency_key"]), []).append(rec)
    for (tool, key), recs in by_key.items():
        eff = effects.get((tool, key))
        if eff is None:
            problems.append(f"upstream record(s) {[r['id'] for r in recs]} of {tool} key {key!r}"
                            " belong to no effect")
            continue
        eid, status, ref = eff
        if tool in reversed_extras:
            loose = [r["id"] for r in recs if r.get("status") != "reversed"
                     and not (status == "CONFIRMED" and r["id"] == ref)]
            if loose:
                problems.append(f"effect {eid} ({tool} {key!r}) is {status}: upstream records "
                                f"{loose} are neither its receipt nor reversed")
            if status in ("FAILED", "CANCELLED", "REJECTED"):
                continue
        if len(recs) > 1 and not allow_duplicates:
            problems.append(f"effect {eid} ({tool} {key!r}) has {len(recs)} upstream records:"
                            f" {[r['id'] for r in recs]}")
        if status == "CONFIRMED":
            if ref not in [r["id"] for r in recs]:
                problems.append(f"effect {eid} is CONFIRMED with ref {ref!r} but upstream has "
                                f"{[r['id'] for r in recs]}")
        elif status == "UNKNOWN" and allow_unknown_applied:
            pass
        else:
            problems.append(f"effect {eid} ({tool} {key!r}) is {status} but upstream has "
                            f"{[r['id'] for r in recs]}")
    for (tool, key), (eid, status, ref) in effects.items():
        if status == "CONFIRMED" and tool in colls.values() and (tool, key) not in by_key:
            problems.append(f"effect {eid} ({tool} {key!r}) is CONFIRMED with ref {ref!r} but "
                            "the tool has no record for its key")
    return problems


def check_invariants(case, fake_url=None, allow_unknown_applied=False, allow_duplicates=False,
                     obligations_settled=False, reversed_extras=()):
    """Fail the test case with every violation found."""
    problems = []
    checks = list(SQL_CHECKS)
    if obligations_settled:
        checks.append(SQL_OBLIGATIONS_SETTLED)
    for what, sql in checks:
        rows = case.query(sql)
        if rows:
            problems.append(f"{what}: violated by {rows[:10]}"
                            + (f" and {len(rows) - 10} more" if len(rows) > 10 else ""))
    if fake_url:
        problems.extend(fake_vs_ledger(case, fake_url, allow_unknown_applied, allow_duplicates,
                                       reversed_extras))
    if problems:
        case.fail("ledger invariants violated:\n  " + "\n  ".join(problems))


if __name__ == "__main__":
    print(os.path.basename(__file__), "is a library for the integration tests")
