/* format.c — the PostgreSQL session, JSON results and terminal-width output the
 * operator verbs share. Widths are counted in UTF-8 code points: tally's own
 * symbols (✓ ⚠ ○ ✗ … →) are one column each, and text from the ledger is cut or
 * wrapped, never split inside a sequence; wrapping breaks only between words, so an
 * id, a key, a ref or a URL can always be copied whole. */
#include "format.h"

#include <ctype.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "cli.h"
#include "tally/json.h"
#include "tally/pg.h"
#include "tally/text.h"

/* ---------------------------------------------------------------------------------------- */
/* PostgreSQL                                                                               */

tally_pg_t *cli_connect(const char *verb, const tally_config_t *cfg)
{
    char app[64];
    snprintf(app, sizeof app, "tally-%s", verb);
    tally_pg_t *pg = tally_pg_new(cfg->pg != NULL ? cfg->pg : "", app);
    if (pg == NULL) {
        fprintf(stderr, "tally %s: out of memory\n", verb);
        return NULL;
    }
    tally_pg_set_deadline(pg, cfg->pg_deadline_ms);
    tally_error_t err;
    if (!tally_pg_connect(pg, 0, NULL, &err)) {
        fprintf(stderr, "tally %s: %s\n", verb, err.message);
        tally_pg_free(pg);
        return NULL;
    }
    /* Timestamps in UTC for every reader; ages are computed by the database's own
     * clock. */
    if (!tally_pg_run(pg, "SET TIME ZONE 'UTC'", 0, NULL, &err)) {
        fprintf(stderr, "tally %s: %s\n", verb, err.message);
        tally_pg_free(pg);
        return NULL;
    }
    return pg;
}

bool cli_begin_snapshot(tally_pg_t *pg, tally_error_t *err)
{
    return tally_pg_run(pg, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY", 0, NULL, err);
}

int cli_pg_rc(const tally_error_t *err)
{
    if (err->errc == TALLY_ERR_PG_CONNECTION)
        return CLI_EXIT_INFRA;
    return CLI_EXIT_REFUSED;
}

int cli_pg_fail(const char *verb, const char *what, const tally_error_t *err)
{
    fprintf(stderr, "tally %s: %s: %s", verb, what, err->message);
    size_t len = strlen(err->message);
    if (len == 0 || err->message[len - 1] != '\n')
        fputc('\n', stderr);
    if (strcmp(err->sqlstate, "42P01") == 0 || strcmp(err->sqlstate, "42703") == 0)
        fprintf(stderr,
                "The ledger's schema is missing or older than this tally: run 'tally migrate'.\n");
    return cli_pg_rc(err);
}

bool cli_has_message_refs(tally_pg_t *pg)
{
    tally_error_t err;
    PGresult *res =
        tally_pg_exec(pg, "SELECT to_regclass('message_refs') IS NOT NULL", 0, NULL, &err);
    bool has = res != NULL && PQntuples(res) == 1 && PQgetvalue(res, 0, 0)[0] == 't';
    PQclear(res);
    return has;
}

json_t *cli_query_json(tally_pg_t *pg, const char *sql, int nparams, const char *const *params,
                       tally_error_t *err)
{
    PGresult *res = tally_pg_exec(pg, sql, nparams, params, err);
    if (res == NULL)
        return NULL;
    if (PQntuples(res) != 1 || PQnfields(res) < 1) {
        tally_error_setc(err, TALLY_ERR_NO_ROW, "the query returned %d rows, expected one",
                         PQntuples(res));
        PQclear(res);
        return NULL;
    }
    if (PQgetisnull(res, 0, 0)) {
        PQclear(res);
        return json_null();
    }
    json_error_t jerr;
    json_t *doc = json_loads(PQgetvalue(res, 0, 0), JSON_DECODE_ANY, &jerr);
    PQclear(res);
    if (doc == NULL)
        tally_error_setc(err, TALLY_ERR_JSON, "the database returned JSON that does not parse: %s",
                         jerr.text);
    return doc;
}

/* ---------------------------------------------------------------------------------------- */
/* Arguments                                                                                */

bool cli_is_uuid(const char *s)
{
    static const char shape[] = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx";
    if (s == NULL || strlen(s) != sizeof shape - 1)
        return false;
    for (size_t i = 0; shape[i] != '\0'; i++) {
        if (shape[i] == '-' ? s[i] != '-' : !isxdigit((unsigned char)s[i]))
            return false;
    }
    return true;
}

/* The flags whose values have a limit (text.h), and whether they are words for the audit
 * trail (a tab allowed) or an identifier. */
static const struct {
    const char *flag;
    size_t limit;
    bool words;
} TEXT_FLAGS[] = {
    {"--reason", TALLY_LIMIT_REASON, true},      {"--actor", TALLY_LIMIT_ACTOR, true},
    {"--run", TALLY_LIMIT_RUN_ID, false},        {"--ref", TALLY_LIMIT_EXTERNAL_REF, false},
    {"--key", TALLY_LIMIT_OPERATION_KEY, false},
};

bool cli_check_text(const char *verb, const char *flag, const char *value)
{
    if (value == NULL) {
        fprintf(stderr, "tally %s: %s is required\nTry 'tally %s --help'.\n", verb, flag, verb);
        return false;
    }
    size_t limit = 0;
    bool words = true;
    for (size_t i = 0; i < sizeof TEXT_FLAGS / sizeof TEXT_FLAGS[0]; i++) {
        if (strcmp(TEXT_FLAGS[i].flag, flag) == 0) {
            limit = TEXT_FLAGS[i].limit;
            words = TEXT_FLAGS[i].words;
        }
    }
    bool blank = true;
    for (const char *p = value; *p != '\0'; p++) {
        unsigned char c = (unsigned char)*p;
        if ((c < 0x20 && !(words && c == '\t')) || c == 0x7f) {
            fprintf(stderr, "tally %s: %s contains a control character\n", verb, flag);
            return false;
        }
        if (!isspace(c))
            blank = false;
    }
    if (blank && words) {
        fprintf(stderr, "tally %s: %s is empty; say it in words, it goes into the audit trail\n",
                verb, flag);
        return false;
    }
    if (blank) {
        fprintf(stderr, "tally %s: %s is empty; give the %s\n", verb, flag,
                strcmp(flag, "--run") == 0 ? "run id" : "value");
        return false;
    }
    if (!tally_utf8_valid(value, strlen(value))) {
        fprintf(stderr, "tally %s: %s is not valid UTF-8\n", verb, flag);
        return false;
    }
    if (limit > 0 && strlen(value) > limit) {
        fprintf(stderr, "tally %s: %s is %zu bytes, above its limit of %zu bytes\n", verb, flag,
                strlen(value), limit);
        return false;
    }
    return true;
}

int cli_usage_error(const char *verb, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tally %s: ", verb);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\nTry 'tally %s --help'.\n", verb);
    va_end(ap);
    return CLI_EXIT_USAGE;
}

int cli_bad_option(const char *verb, int c, char *const *argv)
{
    const char *arg = optind > 0 ? argv[optind - 1] : "?";
    if (c == ':')
        return cli_usage_error(verb, "option '%s' needs a value", arg);
    if (optopt != 0 && arg[0] == '-' && arg[1] != '-')
        return cli_usage_error(verb, "unknown option '-%c'", optopt);
    return cli_usage_error(verb, "unknown option '%s'", arg);
}

void cli_options_begin(void)
{
    optind = 1;
    opterr = 0; /* cli_bad_option says it, naming the verb */
}

int cli_next_option(const char *verb, const char *usage, int argc, char **argv,
                    const struct option *opts, int *rc)
{
    *rc = -1;
    int c = getopt_long(argc, argv, ":h", opts, NULL);
    if (c == 'h') {
        fputs(usage, stdout);
        *rc = CLI_EXIT_OK;
    } else if (c == '?' || c == ':') {
        *rc = cli_bad_option(verb, c, argv);
    } else if (c == -1 && optind < argc) {
        *rc = cli_usage_error(verb, "unexpected argument '%s'", argv[optind]);
    } else {
        return c;
    }
    return -1;
}

bool cli_check_decision(const char *verb, const char *reason, bool reason_required,
                        const char **actor, char *source, size_t sourcesz)
{
    if ((reason_required || reason != NULL) && !cli_check_text(verb, "--reason", reason))
        return false;
    if (*actor == NULL)
        *actor = tally_cli_default_actor();
    if (!cli_check_text(verb, "--actor", *actor))
        return false;
    snprintf(source, sourcesz, "/tally/cli/%s", tally_cli_default_actor());
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Output                                                                                   */

bool cli_print_json(const json_t *doc)
{
    char *text = cli_json_dumps(doc, CLI_JSON_INDENT2, false);
    bool ok = text != NULL && fputs(text, stdout) >= 0 && fputc('\n', stdout) != EOF;
    free(text);
    return fflush(stdout) == 0 && ok;
}

int cli_print_report(const char *verb, const json_t *doc, bool as_json,
                     bool (*print_human)(const json_t *doc))
{
    if (doc == NULL) {
        fprintf(stderr, "tally %s: out of memory\n", verb);
        return CLI_EXIT_REFUSED;
    }
    if (!(as_json ? cli_print_json(doc) : print_human(doc))) {
        fprintf(stderr, "tally %s: cannot write the report to stdout\n", verb);
        return CLI_EXIT_REFUSED;
    }
    return CLI_EXIT_OK;
}

size_t cli_width_of(const char *columns, size_t tty_cols)
{
    if (columns != NULL && *columns != '\0') {
        char *end;
        long n = strtol(columns, &end, 10);
        if (*end == '\0' && n > 0)
            return n < 20 ? 20 : n > 1000 ? 1000 : (size_t)n;
    }
    if (tty_cols > 0)
        return tty_cols < 20 ? 20 : tty_cols > 1000 ? 1000 : tty_cols;
    return 80;
}

size_t cli_width(void)
{
    struct winsize ws;
    size_t tty_cols = 0;
    if (isatty(STDOUT_FILENO) && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0)
        tty_cols = ws.ws_col;
    return cli_width_of(getenv("COLUMNS"), tty_cols);
}

bool cli_format_real(double d, char *out, size_t outsz)
{
    /* the canonical JSON's text of a real (json.c), so the CLI and the bodies sent agree */
    json_t *real = json_real(d); /* NULL for NaN and infinities */
    char *text = real != NULL ? tally_json_scalar_text(real) : NULL;
    json_decref(real);
    bool ok = text != NULL && strlen(text) < outsz;
    if (ok)
        memcpy(out, text, strlen(text) + 1);
    free(text);
    return ok;
}

void cli_age(double seconds, char *out, size_t outsz)
{
    if (seconds < 0) {
        snprintf(out, outsz, "-");
        return;
    }
    long long s = (long long)seconds;
    if (s < 60)
        snprintf(out, outsz, "%llds", s);
    else if (s < 3600)
        snprintf(out, outsz, "%lldm%02llds", s / 60, s % 60);
    else if (s < 86400)
        snprintf(out, outsz, "%lldh%02lldm", s / 3600, (s % 3600) / 60);
    else
        snprintf(out, outsz, "%lldd%02lldh", s / 86400, (s % 86400) / 3600);
}

static bool is_continuation(unsigned char c)
{
    return (c & 0xC0) == 0x80;
}

/* Bytes of the UTF-8 sequence starting at @p s (1 for a stray byte; never past
 * the NUL). */
static size_t seq_len(const char *s)
{
    size_t n = 1;
    while (s[n] != '\0' && is_continuation((unsigned char)s[n]))
        n++;
    return n;
}

/* Columns of the first @p n bytes of @p s. */
static size_t width_n(const char *s, size_t n)
{
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        if (!is_continuation((unsigned char)s[i]))
            w++;
    }
    return w;
}

size_t cli_text_width(const char *s)
{
    size_t w = 0;
    for (; s != NULL && *s != '\0'; s++) {
        if (!is_continuation((unsigned char)*s))
            w++;
    }
    return w;
}

char *cli_fit(const char *s, size_t width)
{
    if (s == NULL)
        s = "-";
    size_t total = cli_text_width(s);
    size_t keep = total <= width ? total : (width > 0 ? width - 1 : 0);
    size_t len = strlen(s);
    char *out = malloc(len + sizeof "…");
    if (out == NULL)
        return NULL;
    size_t o = 0, i = 0;
    for (size_t cp = 0; cp < keep && s[i] != '\0'; cp++) {
        size_t n = seq_len(s + i);
        if (n == 1 && ((unsigned char)s[i] < 0x20 || s[i] == 0x7f))
            out[o++] = ' ';
        else {
            memcpy(out + o, s + i, n);
            o += n;
        }
        i += n;
    }
    if (total > width && width > 0) {
        memcpy(out + o, "…", sizeof "…" - 1);
        o += sizeof "…" - 1;
    }
    out[o] = '\0';
    return out;
}

static void spaces(FILE *out, size_t n)
{
    for (size_t i = 0; i < n; i++)
        fputc(' ', out);
}

/* Write @p n bytes of a word, each CLI_NBSP as a plain space. */
static void put_word(FILE *out, const char *s, size_t n)
{
    static const char nbsp[] = CLI_NBSP;
    size_t start = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        if (s[i] == nbsp[0] && s[i + 1] == nbsp[1]) {
            fwrite(s + start, 1, i - start, out);
            fputc(' ', out);
            start = i + 2;
            i++;
        }
    }
    fwrite(s + start, 1, n - start, out);
}

/* One line of text (no newlines) wrapped at its spaces only; @p col is the cursor's column on
 * entry. Runs of spaces inside a line are kept (they align columns); at a break they are
 * dropped. A word is never cut: one that does not fit goes to the next line, whole, at the
 * indent, or further left when it is too wide for the indented line (a runbook URL after a
 * label), at the first column when it is wider than the line. */
static void wrap_line(FILE *out, const char *s, size_t len, size_t *col, size_t indent,
                      size_t width)
{
    bool content = false; /* the current output line has text of this paragraph */
    size_t i = 0;
    while (i < len) {
        size_t gap = 0;
        while (i < len && s[i] == ' ') {
            i++;
            gap++;
        }
        if (i >= len)
            break;
        size_t start = i, w = 0;
        while (i < len && s[i] != ' ') {
            i += seq_len(s + i);
            w++;
        }
        if (i > len) /* a sequence cut by the end of the line: keep its bytes, never more */
            i = len;
        size_t need = w + (content ? gap : 0);
        size_t start_col = indent + w <= width ? indent : w <= width ? width - w : 0;
        if (*col + need > width && (content || *col > start_col)) {
            fputc('\n', out);
            spaces(out, start_col);
            *col = start_col;
            need = w;
        } else if (content) {
            spaces(out, gap);
        }
        put_word(out, s + start, i - start);
        *col += need;
        content = true;
    }
}

void cli_wrap(FILE *out, const char *text, size_t first_col, size_t indent)
{
    size_t width = cli_width();
    if (indent + 20 > width) /* a deeply indented block still gets 20 columns */
        width = indent + 20;
    size_t col = first_col;
    const char *p = text != NULL ? text : "-";
    /* Control characters other than newline print as spaces. */
    char *clean = strdup(p);
    if (clean == NULL) {
        fputs(p, out);
        fputc('\n', out);
        return;
    }
    for (char *c = clean; *c != '\0'; c++) {
        if (((unsigned char)*c < 0x20 && *c != '\n') || *c == 0x7f)
            *c = ' ';
    }
    const char *line = clean;
    for (;;) {
        const char *nl = strchr(line, '\n');
        size_t len = nl != NULL ? (size_t)(nl - line) : strlen(line);
        wrap_line(out, line, len, &col, indent, width);
        if (nl == NULL)
            break;
        fputc('\n', out);
        spaces(out, indent);
        col = indent;
        line = nl + 1;
    }
    fputc('\n', out);
    free(clean);
}

void cli_field(FILE *out, size_t indent, size_t label_width, const char *label, const char *text)
{
    spaces(out, indent);
    fputs(label, out);
    size_t lw = cli_text_width(label);
    size_t pad = lw < label_width ? label_width - lw : 0;
    spaces(out, pad + 2);
    size_t col = indent + lw + pad + 2;
    cli_wrap(out, text, col, col);
}

/* Split a command into groups that stay on one line: "--flag value" pairs and
 * quoted arguments are never broken. Returns the number of groups stored in @p
 * starts/@p ends. */
static size_t command_groups(const char *cmd, size_t len, size_t *starts, size_t *ends, size_t max)
{
    size_t n = 0, i = 0;
    size_t tok_s[64], tok_e[64], nt = 0;
    while (i < len && nt < 64) {
        while (i < len && cmd[i] == ' ')
            i++;
        if (i >= len)
            break;
        size_t s = i;
        bool quoted = false;
        while (i < len && (quoted || cmd[i] != ' ')) {
            if (cmd[i] == '"')
                quoted = !quoted;
            else if (cmd[i] == '\\' && i + 1 < len)
                i++;
            i++;
        }
        tok_s[nt] = s;
        tok_e[nt] = i;
        nt++;
    }
    for (size_t t = 0; t < nt && n < max; t++) {
        starts[n] = tok_s[t];
        ends[n] = tok_e[t];
        if (cmd[tok_s[t]] == '-' && t + 1 < nt && cmd[tok_s[t + 1]] != '-') {
            ends[n] = tok_e[t + 1];
            t++;
        }
        n++;
    }
    return n;
}

/* Where a trailing "  # comment" starts (outside quotes), or @p len when there
 * is none. */
static size_t comment_start(const char *cmd, size_t len)
{
    bool quoted = false;
    for (size_t i = 0; i < len; i++) {
        if (cmd[i] == '"')
            quoted = !quoted;
        else if (!quoted && cmd[i] == '#' && i > 0 && cmd[i - 1] == ' ')
            return i;
    }
    return len;
}

void cli_print_command(FILE *out, const char *commands, size_t indent)
{
    const char *line = commands != NULL ? commands : "";
    while (*line != '\0') {
        const char *nl = strchr(line, '\n');
        size_t len = nl != NULL ? (size_t)(nl - line) : strlen(line);
        size_t cs = comment_start(line, len);
        if (cs < len) {
            spaces(out, indent);
            fwrite(line + cs, 1, len - cs, out);
            fputc('\n', out);
        }
        size_t cmd_len = cs;
        while (cmd_len > 0 && line[cmd_len - 1] == ' ')
            cmd_len--;
        size_t starts[64], ends[64];
        size_t n = command_groups(line, cmd_len, starts, ends, 64);
        size_t col = indent, width = cli_width();
        spaces(out, indent);
        for (size_t g = 0; g < n; g++) {
            size_t glen = width_n(line + starts[g], ends[g] - starts[g]);
            if (g > 0 && col + 1 + glen + 2 > width) {
                fputs(" \\\n", out);
                spaces(out, indent + 4);
                col = indent + 4;
            } else if (g > 0) {
                fputc(' ', out);
                col++;
            }
            fwrite(line + starts[g], 1, ends[g] - starts[g], out);
            col += glen;
        }
        if (n > 0)
            fputc('\n', out);
        if (nl == NULL)
            break;
        line = nl + 1;
    }
}

void cli_json_block(FILE *out, const json_t *v, size_t indent)
{
    char *text = cli_json_dumps(v, CLI_JSON_INDENT2, true);
    if (text == NULL) {
        spaces(out, indent);
        fputs("(out of memory)\n", out);
        return;
    }
    for (char *line = text; line != NULL && *line != '\0';) {
        char *nl = strchr(line, '\n');
        if (nl != NULL)
            *nl = '\0';
        size_t lead = strspn(line, " ");
        spaces(out, indent + lead);
        cli_wrap(out, line + lead, indent + lead, indent + lead + 2);
        line = nl != NULL ? nl + 1 : NULL;
    }
    free(text);
}

static void json_newline(tally_strbuf_t *b, cli_json_style_t style, size_t depth)
{
    if (style != CLI_JSON_INDENT2)
        return;
    tally_strbuf_putc(b, '\n');
    for (size_t d = 0; d < depth; d++)
        tally_strbuf_put(b, "  ", 2);
}

static int key_order(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void json_put(tally_strbuf_t *b, const json_t *v, cli_json_style_t style, bool sort,
                     size_t depth)
{
    const char *sep = style == CLI_JSON_COMPACT ? "," : style == CLI_JSON_LINE ? ", " : ",";
    const char *colon = style == CLI_JSON_COMPACT ? ":" : ": ";
    if (depth > 2048) { /* deeper than jansson parses: a built value gone wrong */
        b->failed = true;
        return;
    }
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        size_t n = json_object_size(v), k = 0;
        if (n == 0) {
            tally_strbuf_puts(b, "{}");
            return;
        }
        const char **keys = malloc(n * sizeof *keys);
        if (keys == NULL) {
            b->failed = true;
            return;
        }
        const char *key;
        const json_t *member;
        json_object_foreach((json_t *)v, key, member)
        {
            keys[k++] = key;
        }
        if (sort)
            qsort(keys, k, sizeof *keys, key_order);
        tally_strbuf_putc(b, '{');
        for (size_t i = 0; i < k; i++) {
            if (i > 0)
                tally_strbuf_puts(b, sep);
            json_newline(b, style, depth + 1);
            tally_json_put_string(b, keys[i], strlen(keys[i]));
            tally_strbuf_puts(b, colon);
            json_put(b, json_object_get(v, keys[i]), style, sort, depth + 1);
        }
        free(keys);
        json_newline(b, style, depth);
        tally_strbuf_putc(b, '}');
        return;
    }
    case JSON_ARRAY:
        if (json_array_size(v) == 0) {
            tally_strbuf_puts(b, "[]");
            return;
        }
        tally_strbuf_putc(b, '[');
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i > 0)
                tally_strbuf_puts(b, sep);
            json_newline(b, style, depth + 1);
            json_put(b, json_array_get(v, i), style, sort, depth + 1);
        }
        json_newline(b, style, depth);
        tally_strbuf_putc(b, ']');
        return;
    default:
        tally_json_put_scalar(b, v);
        return;
    }
}

char *cli_json_dumps(const json_t *v, cli_json_style_t style, bool sort_keys)
{
    tally_strbuf_t b = {0};
    if (v == NULL)
        tally_strbuf_puts(&b, "null");
    else
        json_put(&b, v, style, sort_keys, 0);
    return tally_strbuf_take(&b);
}

char *cli_json_text(const json_t *v)
{
    return cli_json_dumps(v, CLI_JSON_COMPACT, true);
}

char *cli_json_line(const json_t *v)
{
    return cli_json_dumps(v, CLI_JSON_LINE, true);
}

const char *cli_str(const json_t *obj, const char *key, const char *dflt)
{
    const char *s = json_string_value(json_object_get(obj, key));
    return s != NULL ? s : dflt;
}

double cli_num(const json_t *obj, const char *key, double dflt)
{
    const json_t *v = json_object_get(obj, key);
    return json_is_number(v) ? json_number_value(v) : dflt;
}

/* ---------------------------------------------------------------------------------------- */
/* Tables                                                                                   */

struct cli_table {
    size_t ncols;
    char **headers;
    bool *keep;
    bool *right;
    char ***rows;
    size_t nrows, cap;
    bool failed;
};

cli_table_t *cli_table_new(size_t ncols, const char *const *headers)
{
    cli_table_t *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    t->ncols = ncols;
    t->headers = calloc(ncols, sizeof *t->headers);
    t->keep = calloc(ncols, sizeof *t->keep);
    t->right = calloc(ncols, sizeof *t->right);
    if (t->headers == NULL || t->keep == NULL || t->right == NULL) {
        cli_table_free(t);
        return NULL;
    }
    for (size_t c = 0; c < ncols; c++) {
        t->headers[c] = strdup(headers[c]);
        if (t->headers[c] == NULL) {
            cli_table_free(t);
            return NULL;
        }
    }
    return t;
}

void cli_table_keep(cli_table_t *t, size_t col)
{
    if (col < t->ncols)
        t->keep[col] = true;
}

void cli_table_right(cli_table_t *t, size_t col)
{
    if (col < t->ncols)
        t->right[col] = true;
}

void cli_table_add(cli_table_t *t, const char *const *cells)
{
    if (t->failed)
        return;
    if (t->nrows == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        char ***rows = realloc(t->rows, cap * sizeof *rows);
        if (rows == NULL) {
            t->failed = true;
            return;
        }
        t->rows = rows;
        t->cap = cap;
    }
    char **row = calloc(t->ncols, sizeof *row);
    if (row == NULL) {
        t->failed = true;
        return;
    }
    for (size_t c = 0; c < t->ncols; c++) {
        row[c] = strdup(cells[c] != NULL ? cells[c] : "-");
        if (row[c] == NULL) {
            for (size_t k = 0; k < c; k++)
                free(row[k]);
            free(row);
            t->failed = true;
            return;
        }
    }
    t->rows[t->nrows++] = row;
}

size_t cli_table_rows(const cli_table_t *t)
{
    return t->nrows;
}

static bool print_row(const cli_table_t *t, FILE *out, size_t indent, char *const *cells,
                      const size_t *widths)
{
    spaces(out, indent);
    for (size_t c = 0; c < t->ncols; c++) {
        char *cell = cli_fit(cells[c], widths[c]);
        if (cell == NULL)
            return false;
        size_t w = cli_text_width(cell);
        size_t pad = w < widths[c] ? widths[c] - w : 0;
        if (t->right[c])
            spaces(out, pad);
        fputs(cell, out);
        if (c + 1 < t->ncols)
            spaces(out, (t->right[c] ? 0 : pad) + 2);
        free(cell);
    }
    fputc('\n', out);
    return true;
}

bool cli_table_print(const cli_table_t *t, FILE *out, size_t indent)
{
    if (t->failed)
        return false;
    size_t *widths = calloc(t->ncols, sizeof *widths);
    if (widths == NULL)
        return false;
    size_t total = indent + (t->ncols > 0 ? 2 * (t->ncols - 1) : 0);
    for (size_t c = 0; c < t->ncols; c++) {
        widths[c] = cli_text_width(t->headers[c]);
        for (size_t r = 0; r < t->nrows; r++) {
            size_t w = cli_text_width(t->rows[r][c]);
            if (w > widths[c])
                widths[c] = w;
        }
        total += widths[c];
    }
    /* Cut the widest cuttable column one column at a time: the table keeps its
     * shape and the narrow columns (states, counts) stay whole. */
    size_t width = cli_width();
    while (total > width) {
        size_t best = t->ncols;
        for (size_t c = 0; c < t->ncols; c++) {
            if (!t->keep[c] && widths[c] > 6 && (best == t->ncols || widths[c] > widths[best]))
                best = c;
        }
        if (best == t->ncols)
            break;
        widths[best]--;
        total--;
    }
    bool ok = print_row(t, out, indent, t->headers, widths);
    for (size_t r = 0; ok && r < t->nrows; r++)
        ok = print_row(t, out, indent, t->rows[r], widths);
    free(widths);
    return ok;
}

void cli_table_free(cli_table_t *t)
{
    if (t == NULL)
        return;
    for (size_t r = 0; r < t->nrows; r++) {
        for (size_t c = 0; c < t->ncols; c++)
            free(t->rows[r][c]);
        free(t->rows[r]);
    }
    free(t->rows);
    if (t->headers != NULL) {
        for (size_t c = 0; c < t->ncols; c++)
            free(t->headers[c]);
    }
    free(t->headers);
    free(t->keep);
    free(t->right);
    free(t);
}

static bool state_terminal(tally_machine_t m, int s)
{
    switch (m) {
    case TALLY_MACHINE_EFFECT:
        return tally_effect_state_terminal((tally_effect_state_t)s);
    case TALLY_MACHINE_OBLIGATION:
        return tally_obligation_state_terminal((tally_obligation_state_t)s);
    case TALLY_MACHINE_RUN:
        return tally_run_state_terminal((tally_run_state_t)s);
    case TALLY_MACHINE_ALERT:
        return tally_alert_state_terminal((tally_alert_state_t)s);
    }
    return true;
}

char *cli_open_states(tally_machine_t m)
{
    const char *names[64];
    size_t n = 0;
    for (int s = 0; n < sizeof names / sizeof names[0] && tally_machine_state_name(m, s) != NULL;
         s++)
        if (!state_terminal(m, s))
            names[n++] = tally_machine_state_name(m, s);
    return tally_pg_text_array(names, n);
}

char *cli_member_text(const json_t *obj, const char *key)
{
    const json_t *v = json_object_get(obj, key);
    if (v == NULL || json_is_null(v))
        return NULL;
    if (json_is_string(v))
        return strdup(json_string_value(v));
    return cli_json_text(v);
}

void cli_field_member(const json_t *obj, const char *key, const char *label, size_t indent)
{
    char *text = cli_member_text(obj, key);
    if (text == NULL)
        return;
    const json_t *v = json_object_get(obj, key);
    if ((json_is_object(v) || json_is_array(v)) && indent + 15 + cli_text_width(text) > CLI_WIDTH) {
        printf("%*s%s\n", (int)indent, "", label);
        cli_json_block(stdout, v, indent + 2);
    } else {
        cli_field(stdout, indent, 13, label, text);
    }
    free(text);
}

void cli_date(const char *iso, char *out, size_t outsz)
{
    if (iso == NULL || strlen(iso) < 19)
        snprintf(out, outsz, "%s", iso != NULL ? iso : "-");
    else
        /* lint: slice (the date and time of an ISO timestamp, ASCII) */
        snprintf(out, outsz, "%.*s %.*s UTC", 10, iso, 8, iso + 11);
}

bool cli_is_completion_summary(const json_t *summary)
{
    return json_is_object(json_object_get(summary, "effects")) &&
           json_object_get(summary, "compensated") == NULL;
}
