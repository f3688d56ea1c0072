/* console.h — `tally console`, the read-only web console (docs/operations.md "Web console"):
 * cmd_console.c serves it (libmicrohttpd, a pool of read-only PostgreSQL sessions, routing,
 * input checks), console_html.c builds the HTML every page shares, console_pages.c renders
 * the pages and console_timeline.c draws a run's timeline as inline SVG. */
#ifndef TALLY_CLI_CONSOLE_H
#define TALLY_CLI_CONSOLE_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/config.h"
#include "tally/pg.h"
#include "tally/text.h"

/** `tally console` (cmd_console.c). */
int tally_cmd_console(int argc, char **argv, tally_config_t *cfg);

/** Rows a list page shows at once; the next page is one link away. */
#define CON_PAGE_ROWS 50
/** The deepest page of a list: narrow with the filters beyond it. */
#define CON_MAX_PAGE 1000
/** Longest accepted request target (path and query), in bytes: longer is 414. */
#define CON_MAX_URL 4096
/** Longest accepted query parameter value, in bytes. */
#define CON_MAX_PARAM 400
/** At most this many query parameters. */
#define CON_MAX_PARAMS 12

/** One decoded query parameter. */
typedef struct con_param {
    const char *key;
    const char *value; /**< "" for "?key" */
} con_param_t;

/** One request being answered: its inputs, the open read-only transaction, the output. */
typedef struct con_req {
    tally_pg_t *pg;   /**< in a READ ONLY transaction for the whole request */
    const char *path; /**< decoded, starts with "/" */
    /** "./" or "../": every link is relative, from the page's place to the console's root,
     * so that a proxy may serve the console under a path of its own (/console/) */
    const char *root;
    con_param_t params[CON_MAX_PARAMS];
    size_t n_params;
    long unknown_age_s;  /**< TALLY_UNKNOWN_AGE_S */
    char nonce[40];      /**< the CSP nonce of this response's <style> and <script> */
    int next_id;         /**< ids of copy targets */
    unsigned status;     /**< HTTP status; 200 unless a page says otherwise */
    char *location;      /**< a redirect's target (malloc'd), with status 302 */
    tally_strbuf_t body; /**< the HTML */
} con_req_t;

/* --- console_html.c: HTML building; every value goes through con_esc ---------------------- */

/** Append trusted markup as is (literals of this code only). */
void con_raw(con_req_t *rq, const char *s);
/** Append printf-formatted trusted markup: numbers and literals, never outside text. */
void con_rawf(con_req_t *rq, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/** Append @p s HTML-escaped (& < > " '); NULL appends "–". Valid for text and attributes. */
void con_esc(con_req_t *rq, const char *s);
/** Append @p s percent-encoded as one URL path segment or query value (RFC 3986 unreserved
 * kept), which needs no HTML escaping after. */
void con_url(con_req_t *rq, const char *s);
/** The page's head (title escaped) and navigation; then the caller's body; then con_foot. */
void con_head(con_req_t *rq, const char *title);
void con_foot(con_req_t *rq);
/** A state as a coloured badge (class derived from the state's name, which is escaped). */
void con_badge(con_req_t *rq, const char *state);
/** A block of shell commands (one a line, as alert.h writes them) with a copy button. */
void con_command(con_req_t *rq, const char *commands);
/** Append the relative address of the console's page @p page ("runs", "queues", ...). */
void con_href(con_req_t *rq, const char *page);
/** A link to a run's page: runs/<run id, percent-encoded>, its text the run id. */
void con_run_link(con_req_t *rq, const char *run_id);
/** A link to an effect's page. */
void con_effect_link(con_req_t *rq, const char *effect_id);
/** A timestamp as the database gave it, shortened to "2026-11-27 02:31:05.123" (UTC). */
void con_time(con_req_t *rq, const char *ts);
/** JSON pretty-printed in a <pre>, escaped. */
void con_json(con_req_t *rq, const json_t *v);
/** Replace whatever was built with a whole error page: @p status (400, 404, 405, 414, 500,
 * 503) and a sentence. @returns @p status. */
unsigned con_error(con_req_t *rq, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* --- cmd_console.c: inputs --------------------------------------------------------------- */

/** The value of query parameter @p key, or NULL when absent (or ""). */
const char *con_param(const con_req_t *rq, const char *key);
/** 400 unless every parameter is one of @p allowed (NULL-terminated), at most once each.
 * @returns true when they are. */
bool con_check_params(con_req_t *rq, const char *const *allowed);
/** Run a query returning one json column in the request's transaction. NULL after setting a
 * 500/503 error page. */
json_t *con_query(con_req_t *rq, const char *sql, int nparams, const char *const *params);
/** A page number parameter (1..CON_MAX_PAGE), 1 when absent; false after a 400. */
bool con_page_number(con_req_t *rq, long *page);
/** An ISO 8601 time (2026-11-27, 2026-11-27T02:30, ...:05.5Z, ...+01:00) of a parameter. */
bool con_valid_time(const char *s);
/** Printable text: valid UTF-8, no control characters, at most CON_MAX_PARAM bytes. */
bool con_valid_text(const char *s);

/* --- console_pages.c ---------------------------------------------------------------------- */

unsigned con_page_runs(con_req_t *rq);
unsigned con_page_run(con_req_t *rq, const char *run_id);
unsigned con_page_effect(con_req_t *rq, const char *effect_id);
unsigned con_page_queues(con_req_t *rq);
unsigned con_page_search(con_req_t *rq);

/* --- console_timeline.c ------------------------------------------------------------------- */

/** What a mark on the timeline stands for. */
typedef enum {
    CON_MARK_INTAKE = 0, /**< the intent recorded, the effect created */
    CON_MARK_DISPATCH,   /**< a connector call of the execute endpoint */
    CON_MARK_STATUS,     /**< a status check */
    CON_MARK_ANSWER,     /**< the effect reached an outcome: CONFIRMED, FAILED, UNKNOWN, ... */
    CON_MARK_OBLIGATION, /**< an obligation created or moved */
    CON_MARK_REVERSE,    /**< a reverse or containment call */
    CON_MARK_ALERT,      /**< a page opened or closed */
    CON_MARK_OPERATOR,   /**< a human's decision: resolve, approve, deny, compensate, ... */
    CON_MARK_OTHER,      /**< leases, duplicates, findings, ... */
    CON_MARK__COUNT
} con_mark_t;

/** The mark of one event (kind, from_status, to_status and data.op as the events table has
 * them). Pure. */
con_mark_t con_mark_of(const char *kind, const char *from_status, const char *to_status,
                       const char *op);
/** The mark's name in the legend ("intake", "dispatch", ...). */
const char *con_mark_name(con_mark_t m);

/**
 * Draw the timeline of a run: one lane per effect of @p effects (in order; "effect_id",
 * "step", "tool"), and a first lane for the run's own events; every event of @p events
 * ("occurred_at_ms", "lane": its effect, "kind", "from_status", "to_status", "op", "actor",
 * "reason", "occurred_at", "run_id") is a mark at
 * its time on one axis, its details in a hover title.
 */
void con_timeline(con_req_t *rq, const json_t *effects, const json_t *events);

#endif
