/* console_html.c — the HTML every console page shares: escaping, links, the head with its
 * style and the copy buttons' script (both under the response's CSP nonce), commands, error
 * pages. Nothing here reads the database. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "console.h"

void con_raw(con_req_t *rq, const char *s)
{
    tally_strbuf_puts(&rq->body, s);
}

void con_rawf(con_req_t *rq, const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof buf) {
        rq->body.failed = true; /* markup of this file never comes near; refuse rather than cut */
        return;
    }
    tally_strbuf_put(&rq->body, buf, (size_t)n);
}

void con_esc(con_req_t *rq, const char *s)
{
    if (s == NULL) {
        con_raw(rq, "–");
        return;
    }
    const char *run = s;
    for (const char *c = s; *c != '\0'; c++) {
        const char *rep = NULL;
        switch (*c) {
        case '&':
            rep = "&amp;";
            break;
        case '<':
            rep = "&lt;";
            break;
        case '>':
            rep = "&gt;";
            break;
        case '"':
            rep = "&quot;";
            break;
        case '\'':
            rep = "&#39;";
            break;
        default:
            continue;
        }
        tally_strbuf_put(&rq->body, run, (size_t)(c - run));
        tally_strbuf_puts(&rq->body, rep);
        run = c + 1;
    }
    tally_strbuf_puts(&rq->body, run);
}

void con_url(con_req_t *rq, const char *s)
{
    static const char hex[] = "0123456789ABCDEF";
    for (const unsigned char *c = (const unsigned char *)s; *c != '\0'; c++) {
        if ((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
            *c == '-' || *c == '.' || *c == '_' || *c == '~') {
            tally_strbuf_putc(&rq->body, (char)*c);
        } else {
            char enc[3] = {'%', hex[*c >> 4], hex[*c & 15]};
            tally_strbuf_put(&rq->body, enc, 3);
        }
    }
}

static const char STYLE[] =
    "body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}"
    "header{background:#1d2330;color:#fff;padding:8px 20px;display:flex;gap:20px;"
    "align-items:center}header a{color:#cfe0ff;text-decoration:none}"
    "header b{color:#fff;margin-right:10px}header form{margin-left:auto}"
    "main{padding:12px 20px;max-width:1400px}h1{font-size:20px;margin:8px 0}"
    "h2{font-size:16px;margin:18px 0 6px}"
    "table{border-collapse:collapse;background:#fff;width:100%}"
    "th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #e3e6ea;vertical-align:top}"
    "th{background:#eef0f3;font-weight:600}td.id,.mono,pre{font-family:ui-monospace,monospace;"
    "font-size:12.5px}"
    /* an id (UUID, operation key, external ref) never wraps inside: it copies whole; a table
     * too wide for the window scrolls in its wrapper, a long <pre> line in its box */
    "td.id,a.run,a.effect,.mono,code{white-space:nowrap;overflow-wrap:normal;"
    "word-break:keep-all}pre{white-space:pre-wrap;overflow-wrap:normal;word-break:keep-all;"
    "overflow-x:auto;margin:0}td pre{max-width:70ch}.wide{overflow-x:auto;max-width:100%}"
    ".settled{color:#6b7380;font-style:italic}"
    ".badge{display:inline-block;padding:0 6px;border-radius:3px;font-size:12px;"
    "font-weight:600;background:#e3e6ea}.s-STUCK,.s-FAILED,.s-REJECTED{background:#f8d0d0;"
    "color:#8a1010}.s-UNKNOWN,.s-AWAITING_APPROVAL,.s-PARTIALLY_COMPENSATED,.s-TRIGGERED{"
    "background:#fbe7b5;color:#6b4a00}.s-CONFIRMED,.s-COMPENSATED,.s-RESOLVED,.s-COMPLETED{"
    "background:#cfeccf;color:#1b5e20}.s-COMPENSATING,.s-RUNNING,.s-DISPATCHING,.s-PENDING{"
    "background:#d6e4fb;color:#143c8a}"
    ".cmd{display:flex;gap:8px;align-items:flex-start;background:#1d2330;color:#e8ecf3;"
    "padding:6px 8px;border-radius:4px;margin:4px 0}.cmd pre{flex:1;min-width:0}"
    ".cmd button{font-size:12px;cursor:pointer}"
    ".item{background:#fff;border:1px solid #e3e6ea;border-left:4px solid #c62828;"
    "padding:8px 10px;margin:8px 0}.item.warn{border-left-color:#e0a000}"
    ".item.info{border-left-color:#1565c0}.muted{color:#6b7380}"
    "form.filters{display:flex;gap:8px;flex-wrap:wrap;margin:8px 0}"
    "form.filters input,form.filters select{font-size:13px}"
    ".pager{margin:10px 0;display:flex;gap:16px}svg{background:#fff;border:1px solid #e3e6ea}"
    "dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:6px 0}"
    "dt{color:#6b7380}dd{margin:0}";

/* The copy buttons: hidden without JavaScript, shown by this script. */
static const char SCRIPT[] =
    "document.querySelectorAll('button.copy').forEach(function(b){b.hidden=false;"
    "b.addEventListener('click',function(){var t=document.getElementById(b.dataset.for);"
    "var s=t?t.textContent:'';function done(){b.textContent='copied';"
    "setTimeout(function(){b.textContent='copy'},1500)}"
    "if(navigator.clipboard&&window.isSecureContext){navigator.clipboard.writeText(s)"
    ".then(done)}else{var a=document.createElement('textarea');a.value=s;"
    "document.body.appendChild(a);a.select();document.execCommand('copy');a.remove();done()}"
    "})});document.body.dataset.ready='1';";

void con_head(con_req_t *rq, const char *title)
{
    con_raw(rq, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                "<meta name=\"viewport\" content=\"width=device-width\"><title>");
    con_esc(rq, title);
    con_raw(rq, " · tally console</title><style nonce=\"");
    con_raw(rq, rq->nonce);
    con_raw(rq, "\">");
    con_raw(rq, STYLE);
    con_raw(rq, "</style></head><body><header><b>tally console</b><a href=\"");
    con_href(rq, "runs");
    con_raw(rq, "\">Runs</a><a href=\"");
    con_href(rq, "queues");
    con_raw(rq, "\">Queues</a><span class=\"muted\">read-only</span>"
                "<form method=\"get\" action=\"");
    con_href(rq, "search");
    con_raw(rq, "\"><input name=\"q\" size=\"40\" "
                "placeholder=\"run id, effect id, operation key, external ref\" "
                "aria-label=\"search\"> <button>Search</button></form></header><main>\n<h1>");
    con_esc(rq, title);
    con_raw(rq, "</h1>\n");
}

void con_foot(con_req_t *rq)
{
    con_raw(rq, "\n</main><script nonce=\"");
    con_raw(rq, rq->nonce);
    con_raw(rq, "\">");
    con_raw(rq, SCRIPT);
    con_raw(rq, "</script></body></html>\n");
}

void con_badge(con_req_t *rq, const char *state)
{
    con_raw(rq, "<span class=\"badge s-");
    con_esc(rq, state != NULL ? state : "none");
    con_raw(rq, "\">");
    con_esc(rq, state);
    con_raw(rq, "</span>");
}

void con_command(con_req_t *rq, const char *commands)
{
    if (commands == NULL || commands[0] == '\0')
        return;
    int id = ++rq->next_id;
    con_rawf(rq, "<div class=\"cmd\"><pre class=\"command\" id=\"cmd-%d\">", id);
    con_esc(rq, commands);
    con_rawf(rq,
             "</pre><button type=\"button\" class=\"copy\" data-for=\"cmd-%d\" hidden>"
             "copy</button></div>",
             id);
}

void con_href(con_req_t *rq, const char *page)
{
    con_raw(rq, rq->root != NULL ? rq->root : "./");
    con_raw(rq, page);
}

void con_run_link(con_req_t *rq, const char *run_id)
{
    con_raw(rq, "<a class=\"run\" href=\"");
    con_href(rq, "runs/");
    con_url(rq, run_id);
    con_raw(rq, "\">");
    con_esc(rq, run_id);
    con_raw(rq, "</a>");
}

void con_effect_link(con_req_t *rq, const char *effect_id)
{
    con_raw(rq, "<a class=\"effect mono\" href=\"");
    con_href(rq, "effects/");
    con_url(rq, effect_id);
    con_raw(rq, "\">");
    con_esc(rq, effect_id);
    con_raw(rq, "</a>");
}

void con_time(con_req_t *rq, const char *ts)
{
    if (ts == NULL) {
        con_esc(rq, NULL);
        return;
    }
    /* "2026-11-27T02:31:05.123456+00:00" (json) → "2026-11-27 02:31:05.123" */
    char buf[32];
    size_t n = 0;
    for (const char *c = ts; *c != '\0' && n + 1 < sizeof buf && n < 23; c++) {
        if (*c == '+' || *c == 'Z')
            break;
        buf[n++] = *c == 'T' ? ' ' : *c;
    }
    buf[n] = '\0';
    con_raw(rq, "<time>");
    con_esc(rq, buf);
    con_raw(rq, "</time>");
}

void con_json(con_req_t *rq, const json_t *v)
{
    if (v == NULL || json_is_null(v)) {
        con_raw(rq, "<span class=\"muted\">none</span>");
        return;
    }
    char *text = json_dumps(v, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_ENCODE_ANY);
    if (text == NULL) {
        rq->body.failed = true;
        return;
    }
    con_raw(rq, "<pre class=\"json\">");
    con_esc(rq, text);
    con_raw(rq, "</pre>");
    free(text);
}

static const char *status_title(unsigned status)
{
    switch (status) {
    case 400:
        return "Bad request";
    case 404:
        return "Not found";
    case 405:
        return "Method not allowed";
    case 414:
        return "Request-URI too long";
    case 503:
        return "The ledger cannot be reached";
    default:
        return "Something went wrong";
    }
}

unsigned con_error(con_req_t *rq, unsigned status, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    tally_vfmt(msg, sizeof msg, fmt, ap);
    va_end(ap);
    free(tally_strbuf_take(&rq->body)); /* whatever a page had built so far goes */
    rq->status = status;
    char title[64];
    snprintf(title, sizeof title, "%u %s", status, status_title(status));
    con_head(rq, title);
    con_raw(rq, "<p class=\"error\">");
    con_esc(rq, msg);
    con_raw(rq, "</p><p><a href=\"");
    con_href(rq, "runs");
    con_raw(rq, "\">All runs</a> · <a href=\"");
    con_href(rq, "queues");
    con_raw(rq, "\">Queues</a></p>");
    con_foot(rq);
    return status;
}
