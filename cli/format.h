/* format.h — what the operator verbs (status, doctor, summary, resolve,
 * approve, deny, compensate, cancel) share: the PostgreSQL session and the exit
 * codes it implies, reading query results as JSON, reading and checking their
 * options, and human output that fits an 80-column terminal (tables, ages such
 * as "3m12s", wrapped text, copy-pasteable commands and the ✓ ⚠ ○ ✗ symbols). */
#ifndef TALLY_CLI_FORMAT_H
#define TALLY_CLI_FORMAT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "tally/machines.h"

#include "tally/config.h"
#include "tally/error.h"
#include "tally/pg.h"

/* Exit codes of cli.h. */
#define CLI_EXIT_OK      0
#define CLI_EXIT_REFUSED 1
#define CLI_EXIT_USAGE   2
#define CLI_EXIT_INFRA   3

/** The terminal width human output is laid out for: cli_width(), read at each use. */
#define CLI_WIDTH (cli_width())

/** A space cli_wrap never breaks at ("pager" CLI_NBSP "pending" stays on one line); it is
 * printed as a plain space. U+00A0 in UTF-8, so a path that does not wrap still shows a space. */
#define CLI_NBSP "\xc2\xa0"

#define CLI_SYM_OK   "✓" /**< compensated, done */
#define CLI_SYM_WARN "⚠" /**< uncompensatable, aging, an open page */
#define CLI_SYM_SKIP "○" /**< skipped, nothing to do */
#define CLI_SYM_FAIL "✗" /**< failed, STUCK: a human must act */

/* ---------------------------------------------------------------------------------------- */
/* PostgreSQL                                                                               */

/**
 * @brief Connect to TALLY_PG (one attempt) for @p verb, with the session's time
 * zone set to UTC so every timestamp printed or emitted as JSON is UTC.
 * @returns the handle, or NULL after printing "tally <verb>: <libpq's message>"
 * to stderr (the caller exits CLI_EXIT_INFRA).
 */
tally_pg_t *cli_connect(const char *verb, const tally_config_t *cfg) TALLY_WUR;

/** @brief BEGIN a read-only transaction at REPEATABLE READ: every query after it reads one
 * snapshot, so lists and counts agree. */
bool cli_begin_snapshot(tally_pg_t *pg, tally_error_t *err) TALLY_WUR;

/** @brief CLI_EXIT_INFRA when @p err says PostgreSQL could not be reached or
 * was lost, CLI_EXIT_REFUSED otherwise. */
int cli_pg_rc(const tally_error_t *err);

/** @brief Print "tally <verb>: <what>: <err->message>" to stderr and return
 * cli_pg_rc(). */
int cli_pg_fail(const char *verb, const char *what, const tally_error_t *err);

/**
 * @brief Whether the ledger has message_refs (schema 17): the outcome messages that reference
 * it, waiting for the relay beside message_outbox's. False on an older ledger, and on error
 * (then the statement that counts them fails the same way, and says why).
 */
bool cli_has_message_refs(tally_pg_t *pg);

/**
 * @brief Run a statement that returns one row with one json/jsonb column, and
 * parse it.
 * @returns a new reference, or NULL with @p err filled (an SQL error, no row,
 * or JSON that does not parse). SQL NULL comes back as JSON null.
 */
json_t *cli_query_json(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                       tally_error_t *err) TALLY_WUR;

/* ---------------------------------------------------------------------------------------- */
/* Arguments                                                                                */

/** @brief true when @p s is a UUID in canonical form (any case). */
bool cli_is_uuid(const char *s);

/**
 * @brief Check a text option (--reason, --actor, --run, --ref, --alert): present,
 * not blank, valid UTF-8, no control characters (a tab is allowed in the words of
 * --reason and --actor), and within its limit (text.h: --reason 4096 bytes, --actor
 * and --run 200, --ref 512, --key 500). Prints "tally <verb>: <flag> ..." and returns false
 * when not.
 */
bool cli_check_text(const char *verb, const char *flag, const char *value);

/** @brief Print "tally <verb>: <message>\nTry 'tally <verb> --help'." and
 * return CLI_EXIT_USAGE. */
int cli_usage_error(const char *verb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/**
 * @brief After getopt_long (with opterr = 0 and an optstring starting with ':') returned @p c
 * ('?' or ':'): print "tally <verb>: unknown option '--x'" or "... '--x' needs a value" and
 * the --help hint, and return CLI_EXIT_USAGE.
 */
int cli_bad_option(const char *verb, int c, char *const *argv);

struct option;

/** @brief Start reading a verb's options with cli_next_option (getopt_long from argv[1], with
 * its own messages off). */
void cli_options_begin(void);

/**
 * @brief The next of the verb's own options (getopt_long over @p opts, optstring ":h"), or -1
 * when the loop ends; then *@p rc says how: -1 to go on, CLI_EXIT_OK after printing @p usage
 * for -h/--help, CLI_EXIT_USAGE after saying what is wrong (cli_bad_option, or an operand:
 * "unexpected argument 'x'").
 */
int cli_next_option(const char *verb, const char *usage, int argc, char **argv,
                    const struct option *opts, int *rc);

/**
 * @brief The checks a deciding verb (resolve, approve, deny, compensate, cancel) ends with:
 * --reason when @p reason_required or given, --actor (NULL becomes the OS user), and the
 * CloudEvents source of what it publishes, "/tally/cli/<OS user>", written to @p source.
 * @returns false after saying what is wrong (the verb exits CLI_EXIT_USAGE).
 */
bool cli_check_decision(const char *verb, const char *reason, bool reason_required,
                        const char **actor, char *source, size_t sourcesz);

/* ---------------------------------------------------------------------------------------- */
/* Output                                                                                   */

/** @brief Write @p doc to stdout as indented JSON with a final newline.
 * @returns false when stdout could not be written. */
bool cli_print_json(const json_t *doc);

/**
 * @brief The end of a verb that reports: @p doc (NULL: it could not be built, out of memory)
 * printed as JSON when @p as_json, else by @p print_human.
 * @returns CLI_EXIT_OK, or CLI_EXIT_REFUSED after "tally <verb>: out of memory" or
 * "tally <verb>: cannot write the report to stdout".
 */
int cli_print_report(const char *verb, const json_t *doc, bool as_json,
                     bool (*print_human)(const json_t *doc));

/**
 * @brief The width human output is laid out for: COLUMNS when it is set to a number (kept
 * within 20..1000), else the terminal's width (ioctl TIOCGWINSZ) when stdout is a terminal,
 * else 80. Read at each call, so a test can set COLUMNS.
 */
size_t cli_width(void);

/** @brief cli_width()'s rule on its inputs: @p columns (getenv("COLUMNS"), may be NULL) and
 * @p tty_cols (the terminal's width, 0 when stdout is not a terminal). */
size_t cli_width_of(const char *columns, size_t tty_cols);

/**
 * @brief @p d in its shortest round-trip form: the shortest of %.15g, %.16g and %.17g that reads
 * back as the same double (0.73, not 0.72999999999999998), with ".0" kept on an integral value
 * (the canonical JSON's rule, tally/json.h). false for NaN, an infinity or a small @p outsz.
 */
bool cli_format_real(double d, char *out, size_t outsz);

/** @brief @p seconds as a short age: "45s", "3m12s", "2h05m", "3d04h"; "0s"
 * below a second,
 * "-" for a negative value. */
void cli_age(double seconds, char *out, size_t outsz);

/** @brief Columns @p s takes on a terminal: one per UTF-8 code point (tally
 * prints no wide characters of its own). */
size_t cli_text_width(const char *s);

/**
 * @brief @p s cut to at most @p width columns, ending in "…" when cut, never
 * splitting a UTF-8 sequence; control characters become spaces. Malloc'd; NULL
 * when out of memory.
 */
char *cli_fit(const char *s, size_t width) TALLY_WUR;

/**
 * @brief Write @p text wrapped to cli_width(): the first line starts at the cursor, which is
 * assumed to be at column @p first_col; continuation lines are indented by @p indent. Breaks only
 * at spaces (never at CLI_NBSP), so a word (a UUID, a key, a ref, a URL) is never split: one
 * longer than the line is printed whole on a line of its own (the first line's, when nothing
 * precedes it there). Widths count characters, not bytes. Ends with a newline. Embedded
 * newlines start a new indented line.
 */
void cli_wrap(FILE *out, const char *text, size_t first_col, size_t indent);

/** @brief "  <label>  <text, wrapped>" with the label padded to @p label_width.
 */
void cli_field(FILE *out, size_t indent, size_t label_width, const char *label, const char *text);

/** @brief @p obj's member @p key as text: a string as it is, anything else as compact JSON;
 * NULL when it is missing or null (or out of memory). Malloc'd. */
char *cli_member_text(const json_t *obj, const char *key);

/** @brief cli_field of @p obj's member @p key under @p label (nothing when it is missing or
 * null); an object or array too wide for its line is printed as an indented JSON block. */
void cli_field_member(const json_t *obj, const char *key, const char *label, size_t indent);

/** @brief "2026-11-27 02:56:40 UTC" of an ISO timestamp (as it is when shorter; "-" for NULL). */
void cli_date(const char *iso, char *out, size_t outsz);

/** @brief Whether a run's stored summary is the one `tally.complete_run.v1` wrote (its effects'
 * counts), not a compensation summary (which has a "compensated" list). */
bool cli_is_completion_summary(const json_t *summary);

/**
 * @brief Print a shell command for the operator to copy: a trailing "  #
 * comment" goes on its own line above it, and a command longer than the width
 * is continued with " \" between options, never inside a quoted argument.
 * Several commands separated by newlines (as alert.h's resolve commands are)
 * are printed one after the other.
 */
void cli_print_command(FILE *out, const char *commands, size_t indent);

/**
 * @brief @p v as indented JSON (sorted keys, two spaces a level), every line indented by
 * @p indent and long strings wrapped at their spaces: for receipts and blast radii that do not
 * fit one line.
 */
void cli_json_block(FILE *out, const json_t *v, size_t indent);

/** @brief @p v as compact JSON (sorted keys). Malloc'd; "null" for NULL. NULL on OOM. */
char *cli_json_text(const json_t *v) TALLY_WUR;

/** @brief @p v as JSON on one line with a space after each ',' and ':' (sorted keys), so that
 * cli_wrap can break it between members. Malloc'd; "null" for NULL. NULL on OOM. */
char *cli_json_line(const json_t *v) TALLY_WUR;

/** How cli_json_dumps lays a document out. */
typedef enum {
    CLI_JSON_COMPACT, /**< no whitespace */
    CLI_JSON_LINE,    /**< one line, ", " and ": " */
    CLI_JSON_INDENT2, /**< two spaces a level, as JSON_INDENT(2) */
} cli_json_style_t;

/**
 * @brief @p v as JSON text, every real in its shortest round-trip form (cli_format_real; jansson
 * writes 17 digits: 0.72999999999999998), keys sorted or in their order, strings with '"', '\\'
 * and control characters escaped and UTF-8 kept. Every JSON the CLI prints goes through this.
 * @returns malloc'd text; NULL when out of memory or for a NaN (which jansson cannot hold).
 */
char *cli_json_dumps(const json_t *v, cli_json_style_t style, bool sort_keys) TALLY_WUR;

/** @brief The string member @p key of @p obj, or @p dflt when missing, null or
 * not a string. */
const char *cli_str(const json_t *obj, const char *key, const char *dflt);

/** @brief The number member @p key of @p obj (integer or real), or @p dflt. */
double cli_num(const json_t *obj, const char *key, double dflt);

/* A table laid out for CLI_WIDTH: columns as wide as their widest cell, then
 * the widest shrinkable columns cut (with "…") until the row fits. */
typedef struct cli_table cli_table_t;

/** @brief A table with @p ncols columns and these headers (copied). NULL on
 * OOM. */
cli_table_t *cli_table_new(size_t ncols, const char *const *headers) TALLY_WUR;

/** @brief Never cut column @p col (ids that are meant to be copied). */
void cli_table_keep(cli_table_t *t, size_t col);

/** @brief Right-align column @p col (counts). */
void cli_table_right(cli_table_t *t, size_t col);

/** @brief Add a row of ncols cells (copied; NULL prints as "-"). Sticky failure
 * on OOM. */
void cli_table_add(cli_table_t *t, const char *const *cells);

size_t cli_table_rows(const cli_table_t *t);

/** @brief Print the header and the rows, each line prefixed by @p indent
 * spaces.
 * @returns false when a row could not be stored earlier (out of memory). */
bool cli_table_print(const cli_table_t *t, FILE *out, size_t indent);

void cli_table_free(cli_table_t *t);

/** @brief The states of machine @p m that are not terminal, as a text[] parameter (malloc'd;
 * NULL when out of memory): built from tally/machines.h, so that no SQL spells a state. */
char *cli_open_states(tally_machine_t m);

#endif
