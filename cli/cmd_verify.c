/* cmd_verify.c — `tally verify`: is the ledger consistent with itself and, asked, with the
 * tools' own records (DESIGN §12, docs/operations.md "tally verify")?
 *
 * Three parts, in this order:
 * - the ledger checks: one SQL statement each, all in one READ ONLY snapshot, each naming the
 *   rows that break an invariant of the machines (schemas/machines.json) with the command that
 *   acts on them;
 * - with --tools, the tools' records (verify_tools.c): each CONFIRMED (or FAILED/CANCELLED
 *   after an attempt) effect in range is asked about with its tool's status check, and each
 *   tool that offers a `list` endpoint lists the records it holds for the run (or since the
 *   time); records the ledger cannot place are orphans, extra records no obligation reverses
 *   are duplicates. Every call is paced at the tool's audit.rate_per_s (pacing.h);
 * - with --file-findings, every finding is filed in the findings table (ON CONFLICT DO
 *   NOTHING, so filing twice files once) with a "finding" audit event, in one transaction.
 *
 * Nothing else is written: the checks read one snapshot; the tool calls are GETs; pacing
 * writes only its own bucket row. The exit code is the verdict: 0 clean, 1 findings, 2 could
 * not check (PostgreSQL unreachable, a check that failed, or any tool answer inconclusive —
 * what was found is printed all the same). */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "format.h"
#include "tally/audit.h"
#include "tally/id.h"
#include "tally/ledger.h"
#include "tally/registry.h"
#include "tally/text.h"
#include "verify.h"

#define VERB "verify"

/* The verdicts are verify's own exit codes (cli.h allows a verb its own). */
#define VERIFY_CLEAN      0
#define VERIFY_FINDINGS   1
#define VERIFY_INCOMPLETE 2

#define ROWS_PER_CHECK  200  /* rows listed per ledger check; the count is exact */
#define DEFAULT_LIMIT   1000 /* effects asked about, and records listed per tool */
#define DEFAULT_STALE_S 600  /* how long work may wait before it counts as overdue */
#define SINCE_MAX_S     (10LL * 366 * 86400)

static const char USAGE[] =
    "usage: tally verify [--run R | --since T] [--tools [--limit N]] [--stale-after D]\n"
    "                    [--file-findings [--actor NAME]] [--json]\n"
    "\n"
    "Check the ledger (TALLY_PG) against its own invariants and, with --tools, against the\n"
    "tools' own records. Read-only and safe against production at any time: the ledger\n"
    "checks read one snapshot; --tools only asks (status checks and list calls, at each\n"
    "tool's audit.rate_per_s, shared with the reconcilers); only --file-findings writes.\n"
    "Every finding is printed with the command that acts on it.\n"
    "\n"
    "  --run R            only run R\n"
    "  --since T          only what changed since T: an RFC 3339 time (2026-01-31T12:00:00Z)\n"
    "                     or a duration back from now (90m, 24h, 7d; s m h d w)\n"
    "  --tools            also ask the tools (needs --run or --since, and TALLY_TOOLS): each\n"
    "                     CONFIRMED effect's status (no record, another record, extra records\n"
    "                     no obligation reverses) and, for tools with connector.list, every\n"
    "                     record they hold for the range (orphans)\n"
    "  --limit N          effects asked about, and records listed per tool (default 1000)\n"
    "  --stale-after D    work waiting longer than this counts as overdue (default 10m)\n"
    "  --file-findings    file each finding in the findings table (kind ledger, orphan or\n"
    "                     duplicate), with an audit event; `tally resolve --finding ID`\n"
    "                     closes one. Needs the operator role\n"
    "  --actor NAME       who files them (default: the OS user)\n"
    "  --json             one JSON document instead of text\n"
    "  -h, --help         this text\n"
    "\n"
    "Without --run or --since the ledger checks read whole tables: on a large ledger give\n"
    "--since. --tools takes slots of each tool's call budget (table tool_pacing), which the\n"
    "operator role may do and the read-only role may not.\n"
    "\n"
    "Exit status: 0 clean; 1 findings; 2 could not check (PostgreSQL unreachable, a check\n"
    "failed, or a tool's answer was inconclusive: what was found is printed all the same),\n"
    "or a usage error.\n";

/* ---------------------------------------------------------------------------------------- */
/* The ledger checks                                                                        */

/*
 * Every check is given the same parameters. Only the states it compares are named, as the
 * generated machines spell them (STATE_PARAMS below fills them from tally/machines.h), so no
 * SQL here spells a state. The checks use them as plain parameters, which the planner sees as
 * constants: a check on a live state reads the live-states index, not the whole table.
 */
#define P_RUN          "$1" /* text: --run, or NULL */
#define P_SINCE        "$2" /* timestamptz: --since, or NULL */
#define P_STALE        "$3" /* float8: --stale-after in seconds */
#define P_REFS         "$4" /* jsonb: {tool: {"pointer", "path"}} of the registry's receipt_ref */
#define P_O_OPEN       "$5" /* text[]: the obligation states that are not terminal */
#define E_PLANNED      "$6"
#define E_AWAITING     "$7"
#define E_DISPATCHING  "$8"
#define E_CONFIRMED    "$9"
#define E_FAILED       "$10"
#define E_UNKNOWN      "$11"
#define E_STUCK        "$12"
#define O_PENDING      "$13"
#define O_AWAITING     "$14"
#define O_RUNNING      "$15"
#define O_RESOLVED     "$16"
#define O_SKIPPED      "$17"
#define O_STUCK        "$18"
#define O_CANCELLED    "$19"
#define R_COMPENSATING "$20"
#define R_COMPENSATED  "$21"
#define R_PARTIAL      "$22"
#define R_STUCK        "$23"
#define R_CANCELLED    "$24"
#define A_TRIGGERED    "$25"
#define N_FIXED_PARAMS 5

static const struct state_param {
    const char *param; /* its place, as the checks name it */
    tally_machine_t machine;
    int state;
} STATE_PARAMS[] = {
    {E_PLANNED, TALLY_MACHINE_EFFECT, TALLY_EFFECT_PLANNED},
    {E_AWAITING, TALLY_MACHINE_EFFECT, TALLY_EFFECT_AWAITING_APPROVAL},
    {E_DISPATCHING, TALLY_MACHINE_EFFECT, TALLY_EFFECT_DISPATCHING},
    {E_CONFIRMED, TALLY_MACHINE_EFFECT, TALLY_EFFECT_CONFIRMED},
    {E_FAILED, TALLY_MACHINE_EFFECT, TALLY_EFFECT_FAILED},
    {E_UNKNOWN, TALLY_MACHINE_EFFECT, TALLY_EFFECT_UNKNOWN},
    {E_STUCK, TALLY_MACHINE_EFFECT, TALLY_EFFECT_STUCK},
    {O_PENDING, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_PENDING},
    {O_AWAITING, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_AWAITING_APPROVAL},
    {O_RUNNING, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_RUNNING},
    {O_RESOLVED, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_RESOLVED},
    {O_SKIPPED, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_SKIPPED},
    {O_STUCK, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_STUCK},
    {O_CANCELLED, TALLY_MACHINE_OBLIGATION, TALLY_OBLIGATION_CANCELLED},
    {R_COMPENSATING, TALLY_MACHINE_RUN, TALLY_RUN_COMPENSATING},
    {R_COMPENSATED, TALLY_MACHINE_RUN, TALLY_RUN_COMPENSATED},
    {R_PARTIAL, TALLY_MACHINE_RUN, TALLY_RUN_PARTIALLY_COMPENSATED},
    {R_STUCK, TALLY_MACHINE_RUN, TALLY_RUN_STUCK},
    {R_CANCELLED, TALLY_MACHINE_RUN, TALLY_RUN_CANCELLED},
    {A_TRIGGERED, TALLY_MACHINE_ALERT, TALLY_ALERT_TRIGGERED},
};
#define N_STATE_PARAMS (sizeof STATE_PARAMS / sizeof STATE_PARAMS[0])
#define N_PARAMS       (N_FIXED_PARAMS + N_STATE_PARAMS)

/* Every check's statement starts by typing every parameter (a check uses only some, and
 * PostgreSQL refuses a parameter it cannot type); the unused CTE is never run. Then x holds
 * the check's rows, and one JSON object comes back: the exact count and the first rows. */
#define CHECK_HEAD                                                                                 \
    "WITH params AS (SELECT $1::text, $2::timestamptz, $3::float8, $4::jsonb, $5::text[],"         \
    " $6::text, $7::text, $8::text, $9::text, $10::text, $11::text, $12::text, $13::text,"         \
    " $14::text, $15::text, $16::text, $17::text, $18::text, $19::text, $20::text, $21::text,"     \
    " $22::text, $23::text, $24::text, $25::text),"                                                \
    " x(subject_id, run_id, tool, effect_id, obligation_id, alert_key, detail) AS MATERIALIZED ("
#define CHECK_TAIL                                                                                 \
    ") SELECT json_build_object('total', (SELECT count(*) FROM x), 'rows',"                        \
    " coalesce((SELECT json_agg(y) FROM (SELECT * FROM x ORDER BY run_id, subject_id "             \
    "LIMIT " TALLY_STR(ROWS_PER_CHECK) ") y), '[]'))"
#define TALLY_STR(x)  TALLY_STR_(x)
#define TALLY_STR_(x) #x

/* The rows of alias @p a in range: its run, and changed since --since (column @p ts). */
#define IN_RANGE(a, ts)                                                                            \
    " (" P_RUN "::text IS NULL OR " a ".run_id = " P_RUN ")"                                       \
    " AND (" P_SINCE "::timestamptz IS NULL OR " a "." ts " >= " P_SINCE ")"
#define STALE_BEFORE " (now() - " P_STALE " * interval '1 second')"
#define TS(col)      " to_char(" col ", 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
/* An effect's place in its run's saga order (compensator.h's COMP_SQL_STEP_KEY). */
#define STEP_KEY(e) "(" e ".step_num IS NULL, coalesce(" e ".step_num, 0), " e ".seq)"
#define PRUNED      "'" TALLY_PRUNED_MARKER "'::jsonb"

/* What an operator does about a finding. */
typedef enum {
    ACT_DOCTOR,      /* look at the run: tally doctor --run R */
    ACT_WORKERS,     /* a worker is not moving it: tally status, then doctor */
    ACT_OBLIGATION,  /* doctor, then resolve the STUCK obligation */
    ACT_CLOSE_ALERT, /* tally resolve --alert KEY */
    ACT_TOOL_RECORD, /* a record upstream: doctor, then track it as a finding */
} act_t;

typedef struct check {
    const char *name;
    const char *meaning; /* one line: what a finding of it says */
    const char *subject; /* "effect", "obligation", "run", "alert", "record" */
    const char *kind;    /* the findings table's kind: ledger, orphan, duplicate */
    act_t act;
    const char *hint; /* the comment of ACT_WORKERS' first command */
    const char *sql;  /* NULL for the tool checks */
} check_t;

// clang-format off
static const check_t CHECKS[] = {
    {"effect_receipt_missing",
     "a CONFIRMED effect has no usable receipt (its run was not pruned)",
     "effect", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT e.effect_id::text, e.run_id, e.tool, e.effect_id::text, NULL, NULL,"
     "  CASE WHEN e.receipt IS NULL THEN 'CONFIRMED without a receipt'"
     "    WHEN e.receipt = " PRUNED " THEN 'CONFIRMED, its receipt pruned though its run was not'"
     "    ELSE 'CONFIRMED, but its receipt is a JSON ' || jsonb_typeof(e.receipt)"
     "      || ', not the tool''s answer' END"
     " FROM effects e JOIN runs r ON r.run_id = e.run_id"
     " WHERE e.status = " E_CONFIRMED " AND" IN_RANGE("e", "updated_at")
     "   AND r.pruned_at IS NULL AND e.receipt_sealed IS NULL"
     "   AND (e.receipt IS NULL OR jsonb_typeof(e.receipt) <> 'object' OR e.receipt = " PRUNED ")"
     CHECK_TAIL},
    {"effect_ref_missing",
     "a CONFIRMED effect has no external ref, though its receipt holds one at the tool's "
     "receipt_ref",
     "effect", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT e.effect_id::text, e.run_id, e.tool, e.effect_id::text, NULL, NULL,"
     "  'CONFIRMED without an external ref; its receipt has ' || (" P_REFS " -> e.tool ->> 'pointer')"
     "    || ' = ' || (e.receipt #>> ptr.path)"
     " FROM effects e CROSS JOIN LATERAL (SELECT ARRAY(SELECT jsonb_array_elements_text("
     "   " P_REFS " -> e.tool -> 'path')) AS path) ptr"
     " WHERE e.status = " E_CONFIRMED " AND e.external_ref IS NULL AND" IN_RANGE("e", "updated_at")
     "   AND " P_REFS " ? e.tool AND e.receipt <> " PRUNED
     "   AND jsonb_typeof(e.receipt #> ptr.path) IN ('string', 'number', 'boolean')"
     "   AND length(e.receipt #>> ptr.path) BETWEEN 1 AND " TALLY_STR(TALLY_LIMIT_EXTERNAL_REF)
     CHECK_TAIL},
    {"effect_receipt_changed",
     "a CONFIRMED effect's receipt is not the one its call stored: its SHA-256 differs from "
     "the one the connector_call event keeps",
     "effect", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT e.effect_id::text, e.run_id, e.tool, e.effect_id::text, NULL, NULL,"
     "  CASE WHEN v.data #>> '{receipt,sha256}' IS NULL"
     "      THEN 'the call of ' || " TS("v.occurred_at") " || ' refers to the effect''s receipt'"
     "        || ' but keeps no hash of it'"
     "    WHEN v.data #>> '{receipt,sha256}' IS DISTINCT FROM " TALLY_SQL_RECEIPT_SHA256("e")
     "      THEN 'the call of ' || " TS("v.occurred_at") " || ' stored a receipt with sha256 '"
     "        || (v.data #>> '{receipt,sha256}') || '; the effect''s receipt now has sha256 '"
     "        || " TALLY_SQL_RECEIPT_SHA256("e") ""
     "    ELSE 'the call of ' || " TS("v.occurred_at") " || ' sealed a receipt with sha256 '"
     "      || (v.data #>> '{receipt,sealed_sha256}') || '; the effect''s sealed receipt now has '"
     "      || coalesce('sha256 ' || " TALLY_SQL_SEALED_SHA256("e") ", 'none') END"
     " FROM effects e JOIN runs r ON r.run_id = e.run_id"
     /* an effect's connector calls are read through its run (schema 8) */
     " JOIN events v ON v.run_id = e.run_id AND v.effect_id = e.effect_id"
     "   AND v.kind = 'connector_call'"
     " WHERE" IN_RANGE("e", "updated_at")
     /* no receipt, or the prune marker: effect_receipt_missing's, or pruned on purpose */
     "   AND r.pruned_at IS NULL AND e.receipt IS NOT NULL AND e.receipt <> " PRUNED
     "   AND v.data #>> '{receipt,on}' = '" TALLY_RECEIPT_ON_EFFECT "'"
     "   AND (v.data #>> '{receipt,sha256}' IS DISTINCT FROM " TALLY_SQL_RECEIPT_SHA256("e")
     "     OR (v.data #> '{receipt,sealed_sha256}' IS NOT NULL"
     "       AND v.data #>> '{receipt,sealed_sha256}' IS DISTINCT FROM "
     TALLY_SQL_SEALED_SHA256("e") "))"
     CHECK_TAIL},
    {"effect_lease_invalid",
     "a DISPATCHING effect holds no lease, or a settled or waiting one still holds one",
     "effect", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT e.effect_id::text, e.run_id, e.tool, e.effect_id::text, NULL, NULL,"
     "  CASE WHEN e.status = " E_DISPATCHING " THEN 'DISPATCHING without a lease (owner '"
     "      || coalesce(e.lease_owner, 'none') || ', until ' || coalesce(" TS("e.lease_until") ", 'none') || ')'"
     "    ELSE e.status || ' yet leased by ' || coalesce(e.lease_owner, 'nobody') || ' until '"
     "      || coalesce(" TS("e.lease_until") ", 'never') END"
     " FROM effects e"
     " WHERE" IN_RANGE("e", "updated_at")
     "   AND ((e.status = " E_DISPATCHING " AND (e.lease_owner IS NULL OR e.lease_until IS NULL))"
     "     OR (e.status <> " E_DISPATCHING " AND e.status <> " E_UNKNOWN
     "       AND (e.lease_owner IS NOT NULL OR e.lease_until IS NOT NULL)))"
     CHECK_TAIL},
    {"effect_incomplete",
     "an UNKNOWN effect does not say since when, or a FAILED one does not say why",
     "effect", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT e.effect_id::text, e.run_id, e.tool, e.effect_id::text, NULL, NULL,"
     "  CASE WHEN e.status = " E_UNKNOWN " THEN 'UNKNOWN without unknown_since: nobody can tell"
     " how long it has waited' ELSE 'FAILED without an error code: nobody can tell why' END"
     " FROM effects e"
     " WHERE ((e.status = " E_UNKNOWN " AND e.unknown_since IS NULL)"
     "     OR (e.status = " E_FAILED " AND e.error_code IS NULL)) AND" IN_RANGE("e", "updated_at")
     CHECK_TAIL},
    {"effect_not_queued",
     "a PLANNED effect has no dispatch outbox row: no dispatcher will ever claim it",
     "effect", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT e.effect_id::text, e.run_id, e.tool, e.effect_id::text, NULL, NULL,"
     "  'PLANNED since ' || " TS("e.updated_at") " || ' without a dispatch outbox row'"
     " FROM effects e"
     " WHERE e.status = " E_PLANNED " AND" IN_RANGE("e", "updated_at")
     "   AND NOT EXISTS (SELECT 1 FROM outbox ob WHERE ob.effect_id = e.effect_id)"
     CHECK_TAIL},
    {"outbox_not_dispatchable",
     "a dispatch outbox row names an effect that is not PLANNED, so it can never be sent",
     "effect", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT e.effect_id::text, e.run_id, e.tool, e.effect_id::text, NULL, NULL,"
     "  'a dispatch outbox row (due ' || " TS("ob.due_at") " || ') for an effect that is ' || e.status"
     " FROM outbox ob JOIN effects e ON e.effect_id = ob.effect_id"
     " WHERE e.status <> " E_PLANNED " AND" IN_RANGE("e", "updated_at")
     CHECK_TAIL},
    {"effect_overdue",
     "an effect has waited longer than --stale-after for a worker that does not come",
     "effect", "ledger", ACT_WORKERS,
     "are tally-dispatcher and tally-reconciler running, and can they reach PostgreSQL?",
     CHECK_HEAD
     "SELECT e.effect_id::text, e.run_id, e.tool, e.effect_id::text, NULL, NULL,"
     "  CASE WHEN e.status = " E_PLANNED " THEN 'PLANNED and due since ' || " TS("ob.due_at")
     "      || ', claimed by no dispatcher'"
     "    WHEN e.status = " E_DISPATCHING " THEN 'DISPATCHING under a lease of '"
     "      || coalesce(e.lease_owner, '?') || ' that ended ' || " TS("e.lease_until")
     "      || ': the reconciler turns such an effect UNKNOWN'"
     "    ELSE 'UNKNOWN and due for a status check since ' || " TS("e.next_attempt_at")
     "      || ', checked by no reconciler' END"
     " FROM effects e LEFT JOIN outbox ob ON ob.effect_id = e.effect_id"
     " WHERE" IN_RANGE("e", "updated_at")
     "   AND ((e.status = " E_PLANNED " AND ob.due_at <" STALE_BEFORE ")"
     "     OR (e.status = " E_DISPATCHING " AND e.lease_until <" STALE_BEFORE ")"
     "     OR (e.status = " E_UNKNOWN " AND e.next_attempt_at <" STALE_BEFORE
     "       AND (e.lease_until IS NULL OR e.lease_until <" STALE_BEFORE ")))"
     CHECK_TAIL},
    {"obligation_lease_invalid",
     "a RUNNING obligation holds no lease, or one in another state still holds one",
     "obligation", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT o.obligation_id::text, o.run_id, e.tool, o.effect_id::text, o.obligation_id::text,"
     "  NULL,"
     "  CASE WHEN o.status = " O_RUNNING " THEN 'RUNNING without a lease (owner '"
     "      || coalesce(o.lease_owner, 'none') || ', until ' || coalesce(" TS("o.lease_until") ", 'none') || ')'"
     "    ELSE o.status || ' yet leased by ' || coalesce(o.lease_owner, 'nobody') || ' until '"
     "      || coalesce(" TS("o.lease_until") ", 'never') END"
     " FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
     " WHERE" IN_RANGE("o", "updated_at")
     "   AND ((o.status = " O_RUNNING " AND (o.lease_owner IS NULL OR o.lease_until IS NULL))"
     "     OR (o.status <> " O_RUNNING " AND (o.lease_owner IS NOT NULL OR o.lease_until IS NOT NULL)))"
     CHECK_TAIL},
    {"obligation_overdue",
     "an obligation free to run has waited longer than --stale-after for a compensator",
     "obligation", "ledger", ACT_WORKERS,
     "is tally-compensator running, and can it reach PostgreSQL?",
     CHECK_HEAD
     "SELECT o.obligation_id::text, o.run_id, e.tool, o.effect_id::text, o.obligation_id::text,"
     "  NULL,"
     "  CASE WHEN o.status = " O_PENDING " THEN 'PENDING and due since ' || " TS("o.next_attempt_at")
     "      || ', taken by no compensator'"
     "    ELSE 'RUNNING under a lease of ' || coalesce(o.lease_owner, '?') || ' that ended '"
     "      || " TS("o.lease_until") " || ', taken over by no compensator' END"
     " FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
     " WHERE" IN_RANGE("o", "updated_at")
     "   AND ((o.status = " O_PENDING " AND o.next_attempt_at <" STALE_BEFORE ")"
     "     OR (o.status = " O_RUNNING " AND o.lease_until <" STALE_BEFORE "))"
     "   AND e.status <> " E_DISPATCHING " AND e.status <> " E_UNKNOWN
     /* saga order: a later step still open holds it back, as the compensator's lease does */
     "   AND NOT EXISTS (SELECT 1 FROM obligations ob JOIN effects eb ON eb.effect_id = ob.effect_id"
     "     WHERE ob.run_id = o.run_id AND ob.status = ANY (" P_O_OPEN "::text[])"
     "       AND " STEP_KEY("eb") " > " STEP_KEY("e") ")"
     "   AND (o.reason IN ('duplicate', 'orphan') OR NOT EXISTS (SELECT 1 FROM effects eb"
     "     WHERE eb.run_id = o.run_id AND " STEP_KEY("eb") " > " STEP_KEY("e")
     "       AND (eb.status IN (" E_DISPATCHING ", " E_UNKNOWN ", " E_STUCK ")"
     "         OR (eb.status = " E_CONFIRMED " AND NOT EXISTS (SELECT 1 FROM obligations o3"
     "           WHERE o3.effect_id = eb.effect_id"
     "             AND o3.external_ref IS NOT DISTINCT FROM eb.external_ref)))))"
     CHECK_TAIL},
    {"duplicate_without_obligation",
     "a DUPLICATE was recorded, but an extra upstream record it names has no obligation",
     "effect", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT v.effect_id::text, v.run_id, e.tool, v.effect_id::text, NULL, NULL,"
     "  'the duplicate recorded ' || " TS("v.occurred_at") " || ' names the extra record '"
     "    || coalesce(r.x ->> 'external_ref', '(a ref over the limit)')"
     "    || ', which no obligation reverses'"
     " FROM events v JOIN effects e ON e.effect_id = v.effect_id"
     " CROSS JOIN LATERAL jsonb_array_elements(CASE WHEN jsonb_typeof(v.data -> 'external_refs')"
     "   = 'array' THEN v.data -> 'external_refs' ELSE '[]'::jsonb END) AS r(x)"
     " WHERE v.kind = 'duplicate' AND" IN_RANGE("v", "occurred_at")
     "   AND jsonb_typeof(r.x) = 'object'"
     "   AND r.x -> 'kept' IS DISTINCT FROM 'true'::jsonb"
     "   AND r.x -> 'same_as_kept' IS DISTINCT FROM 'true'::jsonb"
     "   AND NOT EXISTS (SELECT 1 FROM obligations o WHERE o.effect_id = v.effect_id"
     "     AND o.external_ref IS NOT DISTINCT FROM r.x ->> 'external_ref')"
     CHECK_TAIL},
    {"run_not_stuck",
     "an obligation is STUCK but its run does not say so (the compensator marks the run STUCK "
     "in the same transaction)",
     "run", "ledger", ACT_OBLIGATION, NULL,
     CHECK_HEAD
     "SELECT r.run_id, r.run_id, e.tool, o.effect_id::text, o.obligation_id::text, NULL,"
     "  'the run is ' || r.status || ' but its obligation ' || o.obligation_id || ' ('"
     "    || o.reason || ', step ' || e.step || ') is STUCK'"
     " FROM runs r JOIN obligations o ON o.run_id = r.run_id AND o.status = " O_STUCK
     " JOIN effects e ON e.effect_id = o.effect_id"
     " WHERE r.status <> " R_STUCK " AND r.status <> " R_COMPENSATING " AND" IN_RANGE("r", "updated_at")
     CHECK_TAIL},
    {"run_settled_with_open_work",
     "a run that settled its compensation, or was cancelled, still has work open",
     "run", "ledger", ACT_DOCTOR, NULL,
     CHECK_HEAD
     "SELECT r.run_id, r.run_id, w.tool, w.effect_id, w.obligation_id, NULL,"
     "  'the run is ' || r.status || ' but ' || w.what"
     " FROM runs r CROSS JOIN LATERAL ("
     "   SELECT e.tool, e.effect_id::text AS effect_id, NULL::text AS obligation_id,"
     "     'its effect ' || e.effect_id || ' (step ' || e.step || ') is ' || e.status AS what"
     "   FROM effects e WHERE e.run_id = r.run_id"
     "     AND ((r.status IN (" R_COMPENSATED ", " R_PARTIAL ") AND e.status IN (" E_PLANNED ", "
     E_AWAITING ", " E_DISPATCHING ", " E_UNKNOWN ", " E_STUCK "))"
     "       OR (r.status = " R_CANCELLED " AND e.status IN (" E_PLANNED ", " E_AWAITING ")))"
     "   UNION ALL"
     "   SELECT e.tool, o.effect_id::text, o.obligation_id::text,"
     "     'its obligation ' || o.obligation_id || ' (' || o.reason || ', step ' || e.step"
     "       || ') is ' || o.status"
     "   FROM obligations o JOIN effects e ON e.effect_id = o.effect_id"
     "   WHERE o.run_id = r.run_id AND r.status IN (" R_COMPENSATED ", " R_PARTIAL ")"
     "     AND o.reason IN ('compensate_run', 'cancel_run')"
     "     AND o.status = ANY (" P_O_OPEN "::text[]) AND o.status <> " O_STUCK ") w"
     " WHERE r.status IN (" R_COMPENSATED ", " R_PARTIAL ", " R_CANCELLED ") AND" IN_RANGE("r", "updated_at")
     CHECK_TAIL},
    {"run_not_settled",
     "a run under compensation has nothing left to do, yet has not settled for longer than "
     "--stale-after",
     "run", "ledger", ACT_WORKERS, "is tally-compensator running, and can it reach PostgreSQL?",
     CHECK_HEAD
     "SELECT r.run_id, r.run_id, NULL, NULL, NULL, NULL,"
     "  'the run is ' || r.status || ' since ' || " TS("r.updated_at")
     "    || ' with nothing of it open: the compensator settles such a run on its sweep'"
     " FROM runs r"
     " WHERE" IN_RANGE("r", "updated_at") " AND r.updated_at <" STALE_BEFORE
     "   AND (r.status = " R_COMPENSATING " OR (r.status = " R_STUCK
     "     AND EXISTS (SELECT 1 FROM obligations o WHERE o.run_id = r.run_id"
     "       AND o.reason IN ('compensate_run', 'cancel_run'))"
     "     AND NOT EXISTS (SELECT 1 FROM obligations o WHERE o.run_id = r.run_id"
     "       AND o.status = " O_STUCK ")"
     "     AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.run_id = r.run_id"
     "       AND e.status = " E_STUCK ")))"
     "   AND NOT EXISTS (SELECT 1 FROM obligations o WHERE o.run_id = r.run_id"
     "     AND o.status IN (" O_PENDING ", " O_RUNNING ", " O_AWAITING "))"
     "   AND NOT EXISTS (SELECT 1 FROM effects e WHERE e.run_id = r.run_id"
     "     AND (e.status IN (" E_PLANNED ", " E_DISPATCHING ", " E_UNKNOWN ")"
     "       OR (e.status = " E_CONFIRMED " AND NOT EXISTS (SELECT 1 FROM obligations o"
     "         WHERE o.effect_id = e.effect_id"
     "           AND o.external_ref IS NOT DISTINCT FROM e.external_ref))))"
     CHECK_TAIL},
    {"alert_page_settled",
     "a page is still open although what it paged for was settled (an obligation's, for longer "
     "than --stale-after)",
     "alert", "ledger", ACT_CLOSE_ALERT, NULL,
     CHECK_HEAD
     "SELECT a.dedup_key, a.run_id, e.tool, a.effect_id::text, a.obligation_id::text, a.dedup_key,"
     "  CASE WHEN f.finding_id IS NOT NULL THEN 'open page for finding ' || f.finding_id"
     "      || ', resolved ' || coalesce(" TS("f.resolved_at") ", '?') || ' by '"
     "      || coalesce(f.resolved_by, '?')"
     "    WHEN o.obligation_id IS NOT NULL THEN 'open page for obligation ' || o.obligation_id"
     "      || ', which is ' || o.status"
     "    ELSE 'open page for effect ' || e.effect_id || ', which is ' || e.status END"
     " FROM alerts a"
     " LEFT JOIN obligations o ON o.obligation_id = a.obligation_id"
     " LEFT JOIN effects e ON e.effect_id = a.effect_id"
     " LEFT JOIN findings f ON f.finding_id = CASE WHEN a.dedup_key ~ '^finding:[0-9a-f-]{36}$'"
     "   THEN substr(a.dedup_key, 9)::uuid END"
     " WHERE a.status = " A_TRIGGERED " AND" IN_RANGE("a", "created_at")
     "   AND ((f.finding_id IS NOT NULL AND f.status <> 'OPEN')"
     /* an obligation's own page (obligation:<id>) stays open on an UNCOMPENSATABLE one (an
      * escalation an operator closes); any other page of it (a deadline's) closes when it
      * settles, which the compensator does after the settling transaction: hence the wait */
     "     OR (f.finding_id IS NULL AND o.obligation_id IS NOT NULL"
     "       AND NOT o.status = ANY (" P_O_OPEN "::text[])"
     "       AND (o.status IN (" O_RESOLVED ", " O_SKIPPED ", " O_CANCELLED ")"
     "         OR a.dedup_key <> 'obligation:' || o.obligation_id::text)"
     "       AND coalesce(o.finished_at, o.updated_at) <" STALE_BEFORE ")"
     "     OR (f.finding_id IS NULL AND a.obligation_id IS NULL AND e.effect_id IS NOT NULL"
     "       AND a.dedup_key = 'effect:' || a.effect_id::text AND e.status <> " E_STUCK "))"
     CHECK_TAIL},
    /* --tools: what the tools hold (no SQL; the rows come from their answers) */
    {"upstream_missing",
     "the tool holds no record for a CONFIRMED effect (reversed or lost upstream?)",
     "effect", "ledger", ACT_DOCTOR, NULL, NULL},
    {"upstream_ref_mismatch",
     "the tool's record for a CONFIRMED effect is not the one the ledger keeps",
     "effect", "ledger", ACT_DOCTOR, NULL, NULL},
    {"upstream_duplicate",
     "the tool holds an extra record for an effect, and no obligation reverses it",
     "record", "duplicate", ACT_TOOL_RECORD, NULL, NULL},
    {"upstream_orphan",
     "the tool holds a record the ledger cannot place: no such effect, or one that did not "
     "happen, and no obligation reverses it",
     "record", "orphan", ACT_TOOL_RECORD, NULL, NULL},
};
// clang-format on
#define N_CHECKS (sizeof CHECKS / sizeof CHECKS[0])

/* The checks the code names: the one that needs the registry, and the tools' (verify.h), last. */
enum { CHECK_REF_MISSING = 1, CHECK_UPSTREAM = N_CHECKS - VERIFY_UPSTREAM__COUNT };

/* The effects --tools asks about: CONFIRMED ones, and FAILED or CANCELLED ones that were sent
 * at least once (a record for those is an orphan), of the tools that have a status check. $1
 * run, $2 since, $3 tools (text[]), $4 CONFIRMED, $5 FAILED, $6 CANCELLED, $7 limit + 1. */
static const char SQL_TOOL_EFFECTS[] =
    "SELECT coalesce(json_agg(x ORDER BY x.updated_at, x.effect_id), '[]') FROM ("
    " SELECT e.effect_id::text AS effect_id, e.run_id, e.step, e.tool, e.status,"
    "   e.operation_key, e.external_ref, e.traceparent, e.updated_at,"
    "   (SELECT coalesce(json_agg(o.external_ref), '[]') FROM obligations o"
    "     WHERE o.effect_id = e.effect_id) AS obligation_refs"
    " FROM effects e"
    " WHERE ($1::text IS NULL OR e.run_id = $1) AND ($2::timestamptz IS NULL OR e.updated_at >= $2)"
    "   AND e.tool = ANY ($3::text[])"
    "   AND (e.status = $4 OR (e.status IN ($5, $6) AND e.attempts > 0))"
    " ORDER BY e.updated_at, e.effect_id LIMIT $7::bigint) x";

/* --since as the time it names, in RFC 3339 (UTC), and whether it is still to come: $1 a
 * timestamp, or NULL with $2 a number of seconds back from now. */
static const char SQL_SINCE[] =
    "SELECT to_char(t AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), t > now(),"
    " to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"
    " FROM (SELECT CASE WHEN $1::text IS NULL THEN now() - $2::float8 * interval '1 second'"
    "   ELSE $1::text::timestamptz END AS t) s";

static const char SQL_NOW[] =
    "SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')";

/* --file-findings: $1 [{n, finding_id, kind, tool, external_ref, run_id, effect_id,
 * obligation_id, summary, evidence}], $2 the actor. Each row comes back with the id it is
 * filed under: new, or the one already on file for its (kind, tool, external_ref). */
static const char SQL_FILE[] =
    "WITH f AS (SELECT * FROM json_to_recordset($1::json) AS f(n int, finding_id uuid, kind text,"
    "   tool text, external_ref text, run_id text, effect_id uuid, obligation_id uuid,"
    "   summary text, evidence jsonb)),"
    " ins AS (INSERT INTO findings (finding_id, kind, tool, external_ref, run_id, effect_id,"
    "   obligation_id, summary, evidence, found_by)"
    "   SELECT finding_id, kind, tool, external_ref, run_id, effect_id, obligation_id, summary,"
    "     evidence, $2 FROM f ORDER BY n"
    "   ON CONFLICT DO NOTHING RETURNING finding_id)"
    " SELECT f.n, coalesce(i.finding_id, g.finding_id)::text, i.finding_id IS NOT NULL,"
    "   g.status = 'OPEN', g.resolved_by"
    " FROM f LEFT JOIN ins i ON i.finding_id = f.finding_id"
    " LEFT JOIN findings g ON i.finding_id IS NULL AND g.kind = f.kind"
    "   AND g.tool IS NOT DISTINCT FROM f.tool AND g.external_ref IS NOT DISTINCT FROM "
    "f.external_ref"
    " ORDER BY f.n";

/* ---------------------------------------------------------------------------------------- */
/* Options                                                                                  */

/**
 * A duration as an operator writes one: digits and one unit, s m h d or w ("90m", "24h",
 * "7d"). @returns false for anything else, or for more than ten years.
 */
static bool parse_duration(const char *s, long long *seconds)
{
    if (s == NULL || s[0] < '0' || s[0] > '9')
        return false;
    long long n = 0;
    size_t i = 0;
    for (; s[i] >= '0' && s[i] <= '9'; i++) {
        n = n * 10 + (s[i] - '0');
        if (n > SINCE_MAX_S)
            return false;
    }
    if (s[i] == '\0' || s[i + 1] != '\0')
        return false;
    static const struct {
        char unit;
        long long s;
    } units[] = {{'s', 1}, {'m', 60}, {'h', 3600}, {'d', 86400}, {'w', 7 * 86400}};
    for (size_t u = 0; u < sizeof units / sizeof units[0]; u++) {
        if (s[i] == units[u].unit) {
            if (n > SINCE_MAX_S / units[u].s)
                return false;
            *seconds = n * units[u].s;
            return true;
        }
    }
    return false;
}

/* An RFC 3339 time, or a date, by its shape: PostgreSQL reads the value itself. */
static bool time_shaped(const char *s)
{
    if (strlen(s) < 10 || strlen(s) > 64)
        return false;
    for (size_t i = 0; i < 10; i++)
        if (i == 4 || i == 7 ? s[i] != '-' : (s[i] < '0' || s[i] > '9'))
            return false;
    for (const char *c = s; *c != '\0'; c++)
        if ((unsigned char)*c < 0x20 || (unsigned char)*c >= 0x7f)
            return false;
    return true;
}

static int parse_options(verify_opts_t *o, int argc, char **argv)
{
    enum { O_RUN = 256, O_SINCE, O_TOOLS, O_LIMIT, O_STALE, O_FILE, O_ACTOR, O_JSON };
    static const struct option opts[] = {
        {"run", required_argument, NULL, O_RUN},
        {"since", required_argument, NULL, O_SINCE},
        {"tools", no_argument, NULL, O_TOOLS},
        {"limit", required_argument, NULL, O_LIMIT},
        {"stale-after", required_argument, NULL, O_STALE},
        {"file-findings", no_argument, NULL, O_FILE},
        {"actor", required_argument, NULL, O_ACTOR},
        {"json", no_argument, NULL, O_JSON},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *limit = NULL, *stale = NULL;
    int c, rc;
    cli_options_begin();
    while ((c = cli_next_option(VERB, USAGE, argc, argv, opts, &rc)) != -1) {
        switch (c) {
        case O_RUN:
            o->run = optarg;
            break;
        case O_SINCE:
            o->since_text = optarg;
            break;
        case O_TOOLS:
            o->tools = true;
            break;
        case O_LIMIT:
            limit = optarg;
            break;
        case O_STALE:
            stale = optarg;
            break;
        case O_FILE:
            o->file_findings = true;
            break;
        case O_ACTOR:
            o->actor = optarg;
            break;
        case O_JSON:
            o->as_json = true;
            break;
        }
    }
    if (rc >= 0)
        return rc;
    if (o->run != NULL && o->since_text != NULL)
        return cli_usage_error(VERB, "give --run or --since, not both");
    if (o->run != NULL && !cli_check_text(VERB, "--run", o->run))
        return CLI_EXIT_USAGE;
    o->since_s = -1;
    if (o->since_text != NULL && !parse_duration(o->since_text, &o->since_s) &&
        !time_shaped(o->since_text))
        return cli_usage_error(VERB,
                               "--since '%s' is neither a time (2026-01-31T12:00:00Z) nor a "
                               "duration back from now (90m, 24h, 7d)",
                               o->since_text);
    if (o->tools && o->run == NULL && o->since_text == NULL)
        return cli_usage_error(VERB, "--tools asks the tools about a range: give --run R or "
                                     "--since T");
    o->limit = DEFAULT_LIMIT;
    if (limit != NULL) {
        char *end = NULL;
        errno = 0;
        o->limit = strtoll(limit, &end, 10);
        if (end == limit || *end != '\0' || errno != 0 || o->limit < 1 || o->limit > 1000000)
            return cli_usage_error(VERB, "--limit '%s' is not a number from 1 to 1000000", limit);
        if (!o->tools)
            return cli_usage_error(VERB, "--limit bounds what --tools asks about: give --tools");
    }
    o->stale_s = DEFAULT_STALE_S;
    if (stale != NULL && !parse_duration(stale, &o->stale_s))
        return cli_usage_error(VERB, "--stale-after '%s' is not a duration (10m, 2h, 1d)", stale);
    if (o->actor != NULL && !o->file_findings)
        return cli_usage_error(VERB, "--actor names who files the findings: give "
                                     "--file-findings");
    char source[300];
    return cli_check_decision(VERB, NULL, false, &o->actor, source, sizeof source) ? -1
                                                                                   : CLI_EXIT_USAGE;
}

/* ---------------------------------------------------------------------------------------- */
/* Findings                                                                                 */

void verify_incomplete(verify_t *v, const char *what, const char *tool, const char *effect_id,
                       const char *why)
{
    json_t *row = json_pack("{s:s, s:s?, s:s?, s:s}", "what", what, "tool", tool, "effect_id",
                            effect_id, "why", why);
    if (row == NULL || json_array_append_new(v->incomplete, row) != 0)
        fprintf(stderr, "tally verify: out of memory noting: %s\n", why);
}

static void incomplete_err(verify_t *v, const char *what, const tally_error_t *err)
{
    char why[600];
    tally_fmt(why, sizeof why, "%s", err->message);
    size_t n = strlen(why);
    while (n > 0 && why[n - 1] == '\n')
        why[--n] = '\0';
    verify_incomplete(v, what, NULL, NULL, why);
}

/* A word the shell takes as it is, or the word in double quotes. */
static void shell_word(char *out, size_t outsz, const char *s)
{
    bool plain = s[0] != '\0';
    for (const char *c = s; *c != '\0' && plain; c++)
        plain = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
                strchr("_-.:/@+=,%", *c) != NULL;
    if (plain) {
        tally_text_copy(out, outsz, s);
        return;
    }
    size_t n = 0;
    if (outsz < 3) {
        out[0] = '\0';
        return;
    }
    out[n++] = '"';
    for (const char *c = s; *c != '\0' && n + 3 < outsz; c++) {
        if (strchr("\"\\$`", *c) != NULL)
            out[n++] = '\\';
        out[n++] = (unsigned char)*c < 0x20 ? ' ' : *c;
    }
    out[n++] = '"';
    out[n] = '\0';
}

/* The commands that act on finding @p f of check @p c (malloc'd; NULL when out of memory). */
static char *finding_command(const verify_t *v, const check_t *c, const json_t *f)
{
    char run[600] = "", line[1400];
    const char *run_id = cli_str(f, "run_id", NULL);
    bool run_known = json_is_true(json_object_get(f, "run_in_ledger"));
    if (run_id != NULL)
        shell_word(run, sizeof run, run_id);
    tally_strbuf_t b = {0};
    switch (c->act) {
    case ACT_WORKERS:
        snprintf(line, sizeof line, "tally status  # %s\n", c->hint);
        tally_strbuf_puts(&b, line);
        /* fall through */
    case ACT_DOCTOR:
        if (run_id != NULL) {
            snprintf(line, sizeof line, "tally doctor --run %s", run);
            tally_strbuf_puts(&b, line);
        }
        break;
    case ACT_OBLIGATION: {
        snprintf(line, sizeof line, "tally doctor --run %s\n", run);
        tally_strbuf_puts(&b, line);
        const char *ob = cli_str(f, "obligation_id", "?");
        snprintf(line, sizeof line,
                 "tally resolve --obligation %s --as resolved --reason \"<what you did>\"  # you "
                 "reversed it by hand\n"
                 "tally resolve --obligation %s --as skipped --reason \"<why>\"  # nothing is to "
                 "be undone",
                 ob, ob);
        tally_strbuf_puts(&b, line);
        break;
    }
    case ACT_CLOSE_ALERT: {
        char key[600];
        shell_word(key, sizeof key, cli_str(f, "alert_key", "?"));
        snprintf(line, sizeof line,
                 "tally resolve --alert %s --reason \"<why nothing waits any more>\"  # close the "
                 "page",
                 key);
        tally_strbuf_puts(&b, line);
        break;
    }
    case ACT_TOOL_RECORD:
        if (run_id != NULL && run_known) {
            snprintf(line, sizeof line, "tally doctor --run %s\n", run);
            tally_strbuf_puts(&b, line);
        }
        break;
    }
    const char *finding_id = cli_str(f, "finding_id", NULL);
    if (finding_id != NULL) {
        if (b.len > 0 && b.s[b.len - 1] != '\n')
            tally_strbuf_putc(&b, '\n');
        snprintf(line, sizeof line,
                 "tally resolve --finding %s --as resolved --reason \"<what you did>\"  # once "
                 "it is dealt with",
                 finding_id);
        tally_strbuf_puts(&b, line);
    } else if (c->act == ACT_TOOL_RECORD) {
        /* nothing in the ledger acts on a record upstream: filing it keeps it in view until an
         * operator says it was dealt with */
        if (b.len > 0 && b.s[b.len - 1] != '\n')
            tally_strbuf_putc(&b, '\n');
        if (run_id != NULL)
            snprintf(line, sizeof line,
                     "tally verify --tools --run %s --file-findings  # file it, then `tally "
                     "resolve --finding ID` once it is dealt with",
                     run);
        else
            snprintf(line, sizeof line,
                     "tally verify --tools --since %s --file-findings  # file it, then `tally "
                     "resolve --finding ID` once it is dealt with",
                     v->since[0] != '\0' ? v->since : "24h");
        tally_strbuf_puts(&b, line);
    }
    if (b.len == 0)
        tally_strbuf_puts(&b, "tally status");
    return tally_strbuf_take(&b);
}

/* Add a finding of check @p ci: @p f (stolen) with at least subject_id and detail. */
static void add_finding(verify_t *v, size_t ci, json_t *f)
{
    const check_t *c = &CHECKS[ci];
    bool ok = f != NULL && json_object_set_new(f, "check", json_string(c->name)) == 0 &&
              json_object_set_new(f, "check_index", json_integer((json_int_t)ci)) == 0 &&
              json_object_set_new(f, "kind", json_string(c->kind)) == 0 &&
              json_object_set_new(f, "subject", json_string(c->subject)) == 0 &&
              json_array_append(v->findings, f) == 0;
    if (!ok)
        fprintf(stderr, "tally verify: out of memory keeping a finding of %s\n", c->name);
    json_decref(f);
}

static json_t *check_entry(verify_t *v, size_t ci)
{
    return json_array_get(v->checks, ci);
}

void verify_tool_finding(verify_t *v, verify_tool_check_t c, const tally_tool_t *tool,
                         const char *key, json_t *f)
{
    size_t ci = CHECK_UPSTREAM + (size_t)c;
    char seen[1024];
    tally_fmt(seen, sizeof seen, "%s\x1f%s\x1f%s", CHECKS[ci].name, tool->name, key);
    if (json_object_get(v->seen, seen) != NULL) {
        json_decref(f);
        return;
    }
    json_object_set_new(v->seen, seen, json_true());
    json_t *e = check_entry(v, ci);
    json_object_set_new(e, "total",
                        json_integer(json_integer_value(json_object_get(e, "total")) + 1));
    json_object_set_new(e, "listed",
                        json_integer(json_integer_value(json_object_get(e, "listed")) + 1));
    if (f != NULL && json_object_get(f, "tool") == NULL)
        json_object_set_new(f, "tool", json_string(tool->name));
    add_finding(v, ci, f);
}

/* ---------------------------------------------------------------------------------------- */
/* The ledger checks                                                                        */

/* {tool: {"pointer": "/id", "path": ["id"]}} for every tool of the registry whose receipt_ref is
 * a well-formed JSON pointer (RFC 6901: "/a/b", "~1" for '/', "~0" for '~'). */
static json_t *ref_pointers(const tally_registry_t *reg)
{
    json_t *out = json_object();
    for (size_t i = 0; out != NULL && reg != NULL && i < tally_registry_count(reg); i++) {
        const tally_tool_t *t = tally_registry_at(reg, i);
        const char *p = t->receipt_ref != NULL ? t->receipt_ref : "/id";
        if (p[0] != '/')
            continue;
        json_t *path = json_array();
        char seg[512];
        size_t n = 0;
        bool ok = path != NULL;
        for (const char *c = p + 1;; c++) {
            if (*c == '/' || *c == '\0') {
                seg[n] = '\0';
                ok = ok && json_array_append_new(path, json_string(seg)) == 0;
                n = 0;
                if (*c == '\0')
                    break;
                continue;
            }
            char ch = *c;
            if (ch == '~') {
                ch = c[1] == '1' ? '/' : c[1] == '0' ? '~' : '\0';
                ok = ok && ch != '\0';
                c++;
            }
            ok = ok && n + 1 < sizeof seg;
            if (!ok)
                break;
            seg[n++] = ch;
        }
        if (ok)
            ok = json_object_set_new(out, t->name,
                                     json_pack("{s:s, s:O}", "pointer", p, "path", path)) == 0;
        json_decref(path);
    }
    return out;
}

/* Run every ledger check in one READ ONLY snapshot, then read the effects --tools asks about
 * (into *@p to_ask) in the same snapshot. @returns false when the database failed. */
static bool ledger_checks(verify_t *v, json_t **to_ask)
{
    const verify_opts_t *o = v->o;
    char stale[32];
    snprintf(stale, sizeof stale, "%lld", o->stale_s);
    json_t *refs = ref_pointers(v->reg);
    char *refs_text = refs != NULL ? json_dumps(refs, JSON_COMPACT) : NULL;
    json_decref(refs);
    char *o_open = cli_open_states(TALLY_MACHINE_OBLIGATION);
    const char *params[N_PARAMS];
    params[0] = o->run;
    params[1] = v->since[0] != '\0' ? v->since : NULL;
    params[2] = stale;
    params[3] = refs_text;
    params[4] = o_open;
    bool ok = refs_text != NULL && o_open != NULL;
    for (size_t i = 0; ok && i < N_STATE_PARAMS; i++) {
        char want[8];
        snprintf(want, sizeof want, "$%zu", N_FIXED_PARAMS + i + 1);
        params[N_FIXED_PARAMS + i] =
            tally_machine_state_name(STATE_PARAMS[i].machine, STATE_PARAMS[i].state);
        /* the table and the numbered placeholders of the checks must agree */
        if (strcmp(want, STATE_PARAMS[i].param) != 0 || params[N_FIXED_PARAMS + i] == NULL) {
            fprintf(stderr, "tally verify: parameter %s is out of place (a bug)\n", want);
            ok = false;
        }
    }
    if (!ok) {
        verify_incomplete(v, "ledger", NULL, NULL, "out of memory preparing the checks");
        free(refs_text);
        free(o_open);
        return false;
    }

    tally_error_t err;
    bool db_ok = cli_begin_snapshot(v->pg, &err);
    if (!db_ok)
        incomplete_err(v, "ledger", &err);
    for (size_t ci = 0; db_ok && ci < N_CHECKS; ci++) {
        const check_t *c = &CHECKS[ci];
        if (c->sql == NULL)
            continue;
        json_t *entry = check_entry(v, ci);
        if (ci == CHECK_REF_MISSING && v->reg == NULL) {
            json_object_set_new(entry, "skipped",
                                json_string("needs the tool registry (TALLY_TOOLS) for each "
                                            "tool's receipt_ref"));
            continue;
        }
        json_t *res = cli_query_json(v->pg, c->sql, (int)N_PARAMS, params, &err);
        if (res == NULL) {
            char what[128];
            snprintf(what, sizeof what, "check %s", c->name);
            incomplete_err(v, what, &err);
            db_ok = false;
            break;
        }
        json_object_set(entry, "total", json_object_get(res, "total"));
        size_t i;
        json_t *row;
        json_t *rows = json_object_get(res, "rows");
        json_object_set_new(entry, "listed", json_integer((json_int_t)json_array_size(rows)));
        json_array_foreach(rows, i, row)
        {
            json_t *f = json_deep_copy(row);
            if (f != NULL) {
                json_object_set_new(f, "run_in_ledger", json_true());
                json_object_set_new(f, "id", json_incref(json_object_get(f, "subject_id")));
                json_object_del(f, "subject_id");
            }
            add_finding(v, ci, f);
        }
        json_decref(res);
    }

    /* the effects to ask the tools about, in the same snapshot */
    if (db_ok && o->tools) {
        const char *names[1024];
        size_t n = 0;
        for (size_t i = 0; i < tally_registry_count(v->reg) && n < 1024; i++) {
            const tally_tool_t *t = tally_registry_at(v->reg, i);
            if (t->status.path != NULL)
                names[n++] = t->name;
        }
        char *tools = tally_pg_text_array(names, n);
        char limit[32];
        snprintf(limit, sizeof limit, "%lld", o->limit + 1);
        const char *p[7] = {o->run,
                            params[1],
                            tools,
                            tally_effect_state_name(TALLY_EFFECT_CONFIRMED),
                            tally_effect_state_name(TALLY_EFFECT_FAILED),
                            tally_effect_state_name(TALLY_EFFECT_CANCELLED),
                            limit};
        *to_ask = tools != NULL ? cli_query_json(v->pg, SQL_TOOL_EFFECTS, 7, p, &err) : NULL;
        free(tools);
        if (*to_ask == NULL) {
            incomplete_err(v, "the effects to ask the tools about", &err);
            db_ok = false;
        }
    }
    tally_pg_rollback(v->pg);
    free(refs_text);
    free(o_open);
    return db_ok;
}

/* ---------------------------------------------------------------------------------------- */
/* Filing                                                                                   */

/* The finding as the findings table keeps it. A ledger finding has no record of its own: its
 * check and subject stand in its external_ref, which makes it unique there. */
static json_t *finding_row(const json_t *f, size_t n)
{
    char id[37];
    tally_uuid(id);
    const check_t *c = &CHECKS[json_integer_value(json_object_get(f, "check_index"))];
    bool ledger = strcmp(c->kind, "ledger") == 0;
    char key[800];
    tally_fmt(key, sizeof key, "%s:%s", c->name, cli_str(f, "id", "?"));
    const char *ref = ledger ? key : cli_str(f, "external_ref", NULL);
    const char *eid = cli_str(f, "effect_id", NULL);
    const char *oid = cli_str(f, "obligation_id", NULL);
    char summary[1600];
    const char *tool = cli_str(f, "tool", NULL);
    tally_fmt(summary, sizeof summary, "%s: %s %s%s%s: %s", c->name, c->subject,
              cli_str(f, "id", "?"), tool != NULL ? " of " : "", tool != NULL ? tool : "",
              cli_str(f, "detail", ""));
    json_t *evidence = json_object_get(f, "evidence");
    json_t *ev = json_is_object(evidence) ? json_deep_copy(evidence) : json_object();
    if (ev != NULL) {
        json_object_set_new(ev, "check", json_string(c->name));
        json_object_set_new(ev, "meaning", json_string(c->meaning));
        json_object_set_new(ev, "detail", json_string(cli_str(f, "detail", "")));
        json_object_set_new(
            ev, "subject",
            json_pack("{s:s, s:s}", "kind", c->subject, "id", cli_str(f, "id", "?")));
        json_object_set_new(ev, "found_by", json_string("tally verify"));
    }
    return json_pack("{s:i, s:s, s:s, s:s?, s:s?, s:s?, s:s?, s:s?, s:s, s:o?}", "n", (int)n,
                     "finding_id", id, "kind", c->kind, "tool", cli_str(f, "tool", NULL),
                     "external_ref", ref, "run_id", cli_str(f, "run_id", NULL), "effect_id",
                     eid != NULL && cli_is_uuid(eid) ? eid : NULL, "obligation_id",
                     oid != NULL && cli_is_uuid(oid) ? oid : NULL, "summary", summary, "evidence",
                     ev);
}

/* File every finding (one transaction: the rows and an audit event per new one). */
static bool file_findings(verify_t *v)
{
    size_t n = json_array_size(v->findings);
    json_t *rows = json_array();
    bool ok = rows != NULL;
    for (size_t i = 0; ok && i < n; i++)
        ok = json_array_append_new(rows, finding_row(json_array_get(v->findings, i), i)) == 0;
    tally_audit_batch_t *ab = tally_audit_batch_new();
    char *text = ok ? json_dumps(rows, JSON_COMPACT) : NULL;
    if (text == NULL || ab == NULL) {
        verify_incomplete(v, "file", NULL, NULL, "out of memory filing the findings");
        json_decref(rows);
        free(text);
        tally_audit_batch_free(ab);
        return false;
    }
    tally_error_t err;
    const char *params[2] = {text, v->o->actor};
    PGresult *res = NULL;
    ok = tally_pg_begin(v->pg, &err) &&
         (res = tally_pg_exec(v->pg, SQL_FILE, 2, params, &err)) != NULL;
    long long fresh = 0, on_file = 0;
    for (int r = 0; ok && r < PQntuples(res); r++) {
        size_t i = (size_t)strtoull(PQgetvalue(res, r, 0), NULL, 10);
        json_t *f = json_array_get(v->findings, i);
        if (f == NULL || PQgetisnull(res, r, 1))
            continue; /* filed by someone else meanwhile: their row shows on the next run */
        const char *id = PQgetvalue(res, r, 1);
        bool is_new = strcmp(PQgetvalue(res, r, 2), "t") == 0;
        json_object_set_new(f, "finding_id", json_string(id));
        json_object_set_new(f, "filed", json_string(is_new ? "new" : "on_file"));
        if (!is_new && !PQgetisnull(res, r, 3) && strcmp(PQgetvalue(res, r, 3), "f") == 0) {
            /* on file and resolved already: it came back */
            json_object_set_new(f, "filed", json_string("resolved_before"));
            json_object_set_new(f, "resolved_by", json_string(PQgetvalue(res, r, 4)));
        }
        if (!is_new) {
            on_file++;
            continue;
        }
        fresh++;
        const json_t *row = json_array_get(rows, i);
        json_t *data = json_pack("{s:s, s:s, s:s, s:s?, s:s?, s:s}", "finding_id", id, "kind",
                                 cli_str(row, "kind", "?"), "check", cli_str(f, "check", "?"),
                                 "tool", cli_str(row, "tool", NULL), "external_ref",
                                 cli_str(row, "external_ref", NULL), "found_by", "tally verify");
        tally_audit_event_t ev = {.run_id = cli_str(row, "run_id", NULL),
                                  .effect_id = cli_str(row, "effect_id", NULL),
                                  .obligation_id = cli_str(row, "obligation_id", NULL),
                                  .kind = "finding",
                                  .actor = v->o->actor,
                                  .reason = cli_str(row, "summary", ""),
                                  .data = data};
        tally_audit_batch_add(ab, &ev);
        json_decref(data);
    }
    PQclear(res);
    ok = ok && tally_audit_batch_flush(ab, v->pg, &err) && tally_pg_commit(v->pg, &err);
    if (!ok) {
        tally_pg_rollback(v->pg);
        char why[700];
        tally_fmt(
            why, sizeof why, "the findings could not be filed (nothing was): %s%s", err.message,
            strcmp(err.sqlstate, "42501") == 0 ? " (--file-findings needs the operator role)" : "");
        verify_incomplete(v, "file", NULL, NULL, why);
        for (size_t i = 0; i < n; i++) {
            json_object_del(json_array_get(v->findings, i), "finding_id");
            json_object_del(json_array_get(v->findings, i), "filed");
        }
    } else {
        v->filed =
            json_pack("{s:I, s:I}", "new", (json_int_t)fresh, "on_file", (json_int_t)on_file);
    }
    json_decref(rows);
    free(text);
    tally_audit_batch_free(ab);
    return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* The report                                                                               */

static int verdict_of(const verify_t *v)
{
    if (json_array_size(v->incomplete) > 0)
        return VERIFY_INCOMPLETE;
    return json_array_size(v->findings) > 0 ? VERIFY_FINDINGS : VERIFY_CLEAN;
}

static long long num(const json_t *obj, const char *key)
{
    return (long long)cli_num(obj, key, 0);
}

/* Text from the ledger or a tool, wrapped at @p col; control characters become spaces. */
static void print_wrapped(const char *text, size_t col, size_t indent)
{
    char *safe = cli_fit(text, 8000);
    cli_wrap(stdout, safe != NULL ? safe : text, col, indent);
    free(safe);
}

static void print_finding(const json_t *f)
{
    char head[1600], where[800] = "";
    const char *tool = cli_str(f, "tool", NULL);
    const char *run = cli_str(f, "run_id", NULL);
    if (run != NULL && tool != NULL)
        tally_fmt(where, sizeof where, " (run %s, %s)", run, tool);
    else if (run != NULL)
        tally_fmt(where, sizeof where, " (run %s)", run);
    else if (tool != NULL)
        tally_fmt(where, sizeof where, " (%s)", tool);
    tally_fmt(head, sizeof head, "%s %s%s: %s", cli_str(f, "subject", "?"), cli_str(f, "id", "?"),
              where, cli_str(f, "detail", ""));
    printf("    ");
    print_wrapped(head, 4, 6);
    const char *filed = cli_str(f, "filed", NULL);
    if (filed != NULL) {
        char line[200];
        snprintf(line, sizeof line, "finding %s (%s)", cli_str(f, "finding_id", "?"),
                 strcmp(filed, "new") == 0       ? "filed now"
                 : strcmp(filed, "on_file") == 0 ? "on file, open"
                                                 : "on file, resolved before: it came back");
        cli_field(stdout, 6, 7, "filed", line);
    }
    cli_print_command(stdout, cli_str(f, "command", "tally status"), 6);
}

/* The failing checks with their findings, then the clean ones in one line. */
static void print_checks(const json_t *doc)
{
    const json_t *findings = json_object_get(doc, "findings");
    size_t clean = 0, ran = 0, i;
    const json_t *c;
    json_array_foreach(json_object_get(doc, "checks"), i, c)
    {
        if (json_object_get(c, "skipped") != NULL)
            continue;
        ran++;
        long long total = num(c, "total");
        if (total == 0) {
            clean++;
            continue;
        }
        const char *name = cli_str(c, "name", "?");
        char line[600];
        snprintf(line, sizeof line, "%s %s: %lld — %s", CLI_SYM_FAIL, name, total,
                 cli_str(c, "meaning", ""));
        cli_wrap(stdout, line, 0, 4);
        size_t k;
        const json_t *f;
        json_array_foreach(findings, k, f)
        {
            if (strcmp(cli_str(f, "check", ""), name) == 0)
                print_finding(f);
        }
        if (num(c, "listed") < total)
            printf("    ... and %lld more (--json lists the first %d)\n", total - num(c, "listed"),
                   ROWS_PER_CHECK);
    }
    if (clean > 0)
        printf("%s %zu%s check%s found nothing%s\n", CLI_SYM_OK, clean, clean < ran ? " other" : "",
               clean == 1 ? "" : "s",
               json_array_size(json_object_get(doc, "incomplete")) > 0
                   ? " (but see COULD NOT CHECK below)"
                   : "");
    json_array_foreach(json_object_get(doc, "checks"), i, c)
    {
        if (json_object_get(c, "skipped") != NULL) {
            char line[400];
            snprintf(line, sizeof line, "%s %s not run: %s", CLI_SYM_SKIP, cli_str(c, "name", "?"),
                     cli_str(c, "skipped", ""));
            cli_wrap(stdout, line, 0, 4);
        }
    }
}

static void print_tools(const json_t *tools)
{
    if (json_array_size(tools) == 0)
        return;
    printf("\nTOOLS asked (each at its audit.rate_per_s, shared with the reconcilers)\n");
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t)
    {
        char line[600];
        tally_fmt(line, sizeof line,
                  "%s: %lld status check%s, %lld list page%s (%lld record%s, %lld not tally's, "
                  "%lld not settled yet)",
                  cli_str(t, "tool", "?"), num(t, "status_checks"),
                  num(t, "status_checks") == 1 ? "" : "s", num(t, "list_pages"),
                  num(t, "list_pages") == 1 ? "" : "s", num(t, "records_listed"),
                  num(t, "records_listed") == 1 ? "" : "s", num(t, "records_not_ours"),
                  num(t, "records_unsettled"));
        printf("  ");
        cli_wrap(stdout, line, 2, 4);
    }
}

static void print_incomplete(const json_t *incomplete)
{
    if (json_array_size(incomplete) == 0)
        return;
    printf("\nCOULD NOT CHECK\n");
    size_t i;
    const json_t *x;
    json_array_foreach(incomplete, i, x)
    {
        char line[1200];
        const char *tool = cli_str(x, "tool", NULL);
        const char *eid = cli_str(x, "effect_id", NULL);
        tally_fmt(line, sizeof line, "%s %s%s%s%s%s: %s", CLI_SYM_WARN, cli_str(x, "what", "?"),
                  tool != NULL ? " of " : "", tool != NULL ? tool : "",
                  eid != NULL ? ", effect " : "", eid != NULL ? eid : "", cli_str(x, "why", ""));
        printf("  ");
        print_wrapped(line, 2, 4);
    }
}

/* The human report: everything it says is in the --json document too. */
static bool print_human(const json_t *doc)
{
    printf("tally verify at %s: %s\n\n", cli_str(doc, "now", "?"), cli_str(doc, "range_text", ""));
    print_checks(doc);
    print_tools(json_object_get(doc, "tools"));
    print_incomplete(json_object_get(doc, "incomplete"));
    printf("\n");

    long long by_kind[3] = {0, 0, 0}, n_total = 0, ran = 0;
    static const char *const kinds[3] = {"ledger", "orphan", "duplicate"};
    size_t i;
    const json_t *c;
    json_array_foreach(json_object_get(doc, "checks"), i, c)
    {
        for (int k = 0; k < 3; k++)
            by_kind[k] += strcmp(cli_str(c, "kind", ""), kinds[k]) == 0 ? num(c, "total") : 0;
        n_total += num(c, "total");
        ran += json_object_get(c, "skipped") == NULL &&
               strcmp(cli_str(c, "source", ""), "ledger") == 0;
    }
    const json_t *filed = json_object_get(doc, "filed");
    if (json_is_object(filed))
        printf("Filed: %lld new finding%s, %lld already on file.\n", num(filed, "new"),
               num(filed, "new") == 1 ? "" : "s", num(filed, "on_file"));
    char counts[160];
    snprintf(counts, sizeof counts, "%lld finding%s (%lld ledger, %lld orphan, %lld duplicate)",
             n_total, n_total == 1 ? "" : "s", by_kind[0], by_kind[1], by_kind[2]);
    size_t n_incomplete = json_array_size(json_object_get(doc, "incomplete"));
    switch ((int)num(doc, "exit_code")) {
    case VERIFY_CLEAN:
        printf("%s clean: %lld ledger check%s%s found nothing (exit 0)\n", CLI_SYM_OK, ran,
               ran == 1 ? "" : "s",
               json_array_size(json_object_get(doc, "tools")) > 0 ? " and the tools" : "");
        break;
    case VERIFY_FINDINGS:
        printf("%s %s (exit 1)\n", CLI_SYM_FAIL, counts);
        break;
    default:
        printf("%s %s, and %zu thing%s could not be checked (exit 2)\n", CLI_SYM_WARN, counts,
               n_incomplete, n_incomplete == 1 ? "" : "s");
    }
    return fflush(stdout) == 0;
}

/* The report as one document: the --json output, and what the text is printed from. */
static json_t *report_doc(verify_t *v)
{
    char range[800];
    if (v->o->run != NULL)
        tally_fmt(range, sizeof range, "run %s", v->o->run);
    else if (v->since[0] != '\0')
        tally_fmt(range, sizeof range, "what changed since %s", v->since);
    else
        tally_fmt(range, sizeof range, "the whole ledger");
    int verdict = verdict_of(v);
    static const char *const words[] = {"clean", "findings", "incomplete"};
    json_t *checks = json_array();
    for (size_t ci = 0; ci < N_CHECKS; ci++) {
        json_t *e = check_entry(v, ci);
        if (json_is_true(json_object_get(e, "ran")))
            json_array_append(checks, e);
    }
    json_t *findings = json_deep_copy(v->findings);
    size_t i;
    json_t *f;
    json_array_foreach(findings, i, f)
    {
        const check_t *c = &CHECKS[json_integer_value(json_object_get(f, "check_index"))];
        char *cmd = finding_command(v, c, f);
        json_object_set_new(f, "command", cmd != NULL ? json_string(cmd) : json_null());
        free(cmd);
        json_object_del(f, "check_index");
        json_object_del(f, "run_in_ledger");
    }
    return json_pack("{s:s, s:i, s:s, s:s, s:{s:s?, s:s?, s:I, s:I, s:b}, s:o, s:o, s:O, s:O, "
                     "s:O?}",
                     "verdict", words[verdict], "exit_code", verdict, "now", v->now, "range_text",
                     range, "range", "run", v->o->run, "since", v->since[0] ? v->since : NULL,
                     "stale_after_s", (json_int_t)v->o->stale_s, "limit",
                     v->o->tools ? (json_int_t)v->o->limit : (json_int_t)0, "tools", v->o->tools,
                     "checks", checks, "findings", findings, "incomplete", v->incomplete, "tools",
                     v->tools, "filed", v->filed);
}

/* ---------------------------------------------------------------------------------------- */
/* The verb                                                                                 */

/* --since read by PostgreSQL into v->since; @returns -1 to go on, or the exit code. */
static int resolve_since(verify_t *v)
{
    const verify_opts_t *o = v->o;
    tally_error_t err;
    char secs[32];
    snprintf(secs, sizeof secs, "%lld", o->since_s);
    const char *params[2] = {o->since_s >= 0 ? NULL : o->since_text, secs};
    PGresult *res = o->since_text != NULL ? tally_pg_exec(v->pg, SQL_SINCE, 2, params, &err)
                                          : tally_pg_exec(v->pg, SQL_NOW, 0, NULL, &err);
    if (res == NULL && strncmp(err.sqlstate, "22", 2) == 0)
        return cli_usage_error(VERB,
                               "--since '%s' is not a time: give RFC 3339 such as "
                               "2026-01-31T12:00:00Z, or a duration such as 24h",
                               o->since_text);
    if (res == NULL) {
        fprintf(stderr, "tally verify: cannot read the database's clock: %s\n", err.message);
        return VERIFY_INCOMPLETE;
    }
    if (o->since_text != NULL) {
        tally_text_copy(v->since, sizeof v->since, PQgetvalue(res, 0, 0));
        tally_text_copy(v->now, sizeof v->now, PQgetvalue(res, 0, 2));
        bool future = strcmp(PQgetvalue(res, 0, 1), "t") == 0;
        PQclear(res);
        if (future)
            return cli_usage_error(VERB, "--since %s is in the future (%s)", o->since_text,
                                   v->since);
    } else {
        tally_text_copy(v->now, sizeof v->now, PQgetvalue(res, 0, 0));
        PQclear(res);
    }
    return -1;
}

/* The registry, when TALLY_TOOLS names one. @returns -1 to go on, or the exit code. */
static int load_registry(verify_t *v, const tally_config_t *cfg)
{
    if (cfg->tools_path == NULL || cfg->tools_path[0] == '\0') {
        if (v->o->tools)
            return cli_usage_error(VERB, "--tools needs the tool registry: set TALLY_TOOLS");
        return -1;
    }
    tally_problems_t problems = {0};
    v->reg = tally_registry_load_file(cfg->tools_path, &problems);
    if (v->reg == NULL) {
        fprintf(stderr, "tally verify: the tool registry %s (TALLY_TOOLS) does not load:\n",
                cfg->tools_path);
        for (size_t i = 0; i < problems.n; i++)
            fprintf(stderr, "  %s\n", problems.lines[i]);
    }
    tally_problems_clear(&problems);
    return v->reg != NULL ? -1 : VERIFY_INCOMPLETE;
}

int tally_cmd_verify(int argc, char **argv, tally_config_t *cfg)
{
    verify_opts_t o = {0};
    int rc = parse_options(&o, argc, argv);
    if (rc >= 0)
        return rc;
    verify_t v = {.o = &o,
                  .checks = json_array(),
                  .findings = json_array(),
                  .incomplete = json_array(),
                  .tools = json_array(),
                  .seen = json_object()};
    json_t *to_ask = NULL, *doc = NULL;
    bool oom = v.checks == NULL || v.findings == NULL || v.incomplete == NULL || v.tools == NULL ||
               v.seen == NULL;
    for (size_t ci = 0; !oom && ci < N_CHECKS; ci++)
        oom =
            json_array_append_new(
                v.checks,
                json_pack("{s:s, s:s, s:s, s:s, s:I, s:I, s:b}", "name", CHECKS[ci].name, "meaning",
                          CHECKS[ci].meaning, "source", CHECKS[ci].sql != NULL ? "ledger" : "tools",
                          "kind", CHECKS[ci].kind, "total", (json_int_t)0, "listed", (json_int_t)0,
                          "ran", CHECKS[ci].sql != NULL || o.tools)) != 0;
    if (oom) {
        fprintf(stderr, "tally verify: out of memory\n");
        rc = VERIFY_INCOMPLETE;
        goto out;
    }
    if ((rc = load_registry(&v, cfg)) >= 0)
        goto out;
    v.pg = cli_connect(VERB, cfg);
    if (v.pg == NULL) {
        rc = VERIFY_INCOMPLETE;
        goto out;
    }
    if ((rc = resolve_since(&v)) >= 0)
        goto out;

    bool db_ok = ledger_checks(&v, &to_ask);
    if (db_ok && o.tools)
        verify_tools(&v, to_ask);
    if (db_ok && o.file_findings && json_array_size(v.findings) > 0)
        (void)file_findings(&v);
    else if (db_ok && o.file_findings)
        v.filed = json_pack("{s:i, s:i}", "new", 0, "on_file", 0);

    doc = report_doc(&v);
    rc = cli_print_report(VERB, doc, o.as_json, print_human);
    rc = rc == CLI_EXIT_OK ? verdict_of(&v) : VERIFY_INCOMPLETE;
out:
    json_decref(doc);
    json_decref(to_ask);
    json_decref(v.checks);
    json_decref(v.findings);
    json_decref(v.incomplete);
    json_decref(v.tools);
    json_decref(v.seen);
    json_decref(v.filed);
    tally_registry_free(v.reg);
    tally_pg_free(v.pg);
    return rc;
}
