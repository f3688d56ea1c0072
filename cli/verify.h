/* verify.h — what the two halves of `tally verify` share: cmd_verify.c (the verb, the ledger
 * checks, filing, the report) and verify_tools.c (--tools: the tools' own records, asked with
 * the connector engine at each tool's paced rate). */
#ifndef TALLY_CLI_VERIFY_H
#define TALLY_CLI_VERIFY_H

#include <jansson.h>
#include <stdbool.h>

#include "tally/pg.h"
#include "tally/registry.h"

/** The options, checked (cmd_verify.c). */
typedef struct verify_opts {
    const char *run;        /**< --run, or NULL */
    const char *since_text; /**< --since as given, or NULL */
    long long since_s;      /**< --since as a duration, or -1 when it is a time */
    bool tools;             /**< --tools */
    long long limit;        /**< effects asked about, and records listed per tool */
    long long stale_s;      /**< --stale-after */
    bool file_findings;
    const char *actor; /**< who files them */
    bool as_json;
} verify_opts_t;

/** One verification: what it reads with, and everything it found so far. */
typedef struct verify {
    const verify_opts_t *o;
    tally_pg_t *pg;
    tally_registry_t *reg; /**< NULL without TALLY_TOOLS (--tools needs it) */
    char now[40];          /**< the database's clock when it began, RFC 3339 */
    char since[48];        /**< the --since time in RFC 3339, "" when none */
    json_t *checks;        /**< per check: {name, meaning, source, kind, total, listed, ran} */
    json_t *findings;      /**< every finding (verify_tool_finding says what one holds) */
    json_t *incomplete;    /**< what could not be checked: {what, tool, effect_id, why} */
    json_t *tools;         /**< per tool asked: {tool, status_checks, list_pages, ...} */
    json_t *seen;          /**< keys of the tool findings made, so each is reported once */
    json_t *filed;         /**< --file-findings: {"new", "on_file"}, or NULL */
} verify_t;

/** The checks --tools makes, in the order of cmd_verify.c's table. */
typedef enum {
    VERIFY_UPSTREAM_MISSING = 0, /**< no record for a CONFIRMED effect */
    VERIFY_UPSTREAM_MISMATCH,    /**< records, none of them the ledger's receipt */
    VERIFY_UPSTREAM_DUPLICATE,   /**< an extra record no obligation reverses */
    VERIFY_UPSTREAM_ORPHAN,      /**< a record the ledger cannot place */
    VERIFY_UPSTREAM__COUNT
} verify_tool_check_t;

/** @brief Note what could not be checked: the verdict becomes 2 (strings copied). */
void verify_incomplete(verify_t *v, const char *what, const char *tool, const char *effect_id,
                       const char *why);

/**
 * @brief A finding of tool check @p c about @p tool, reported once per (check, tool, @p key)
 * however often it is seen (a record found by the status check and by the list). @p f (stolen)
 * holds "id" (the effect, or the record's ref), "detail" (one sentence), and as known "run_id",
 * "effect_id", "external_ref", "evidence" (an object) and "run_in_ledger" (true when the
 * ledger has the run, so `tally doctor` can show it).
 */
void verify_tool_finding(verify_t *v, verify_tool_check_t c, const tally_tool_t *tool,
                         const char *key, json_t *f);

/**
 * @brief --tools (verify_tools.c): ask each tool with a status endpoint about the effects in
 * @p effects (rows {effect_id, run_id, tool, status, operation_key, external_ref, traceparent,
 * obligation_refs}, at most --limit of them asked), and list what each tool with a `list`
 * endpoint holds for the run or since the time; every call paid for from the tool's budget in
 * tool_pacing first. Findings and what could not be checked go to @p v.
 */
void verify_tools(verify_t *v, const json_t *effects);

#endif
