/* console_timeline.c — a run's timeline as inline SVG: one lane per effect (and one for the
 * run's own events), every event of the audit trail a mark on one time axis, shaped and
 * coloured by what it stands for, its details in a hover title. Pure drawing: the events come
 * from console_pages.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "console.h"
#include "format.h"
#include "tally/machines.h"

#define SVG_W     1240
#define LABEL_W   230
#define RIGHT_PAD 24
#define AXIS_H    34
#define LANE_H    44
#define ROW_GAP   12 /* the three rows of a lane: calls, moves, people and the rest */
#define LEGEND_H  34
#define TICKS     6

static const struct {
    const char *name;
    const char *fill;
} MARKS[CON_MARK__COUNT] = {
    [CON_MARK_INTAKE] = {"intake", "#6b7380"},
    [CON_MARK_DISPATCH] = {"dispatch attempt", "#1565c0"},
    [CON_MARK_STATUS] = {"status check", "#00838f"},
    [CON_MARK_ANSWER] = {"answer", "#2e7d32"},
    [CON_MARK_OBLIGATION] = {"obligation", "#6a1b9a"},
    [CON_MARK_REVERSE] = {"reverse / contain", "#ef6c00"},
    [CON_MARK_ALERT] = {"alert", "#c62828"},
    [CON_MARK_OPERATOR] = {"operator action", "#111111"},
    [CON_MARK_OTHER] = {"other", "#b0b6bf"},
};

const char *con_mark_name(con_mark_t m)
{
    return m < CON_MARK__COUNT ? MARKS[m].name : "other";
}

con_mark_t con_mark_of(const char *kind, const char *from_status, const char *to_status,
                       const char *op)
{
    if (kind == NULL)
        return CON_MARK_OTHER;
    if (strcmp(kind, "intent") == 0)
        return CON_MARK_INTAKE;
    if (strcmp(kind, "connector_call") == 0) {
        if (op == NULL)
            return CON_MARK_OTHER;
        if (strcmp(op, "execute") == 0)
            return CON_MARK_DISPATCH;
        if (strcmp(op, "status") == 0)
            return CON_MARK_STATUS;
        return CON_MARK_REVERSE; /* compensate, contain */
    }
    if (strcmp(kind, "obligation") == 0)
        return CON_MARK_OBLIGATION;
    if (strcmp(kind, "alert") == 0)
        return CON_MARK_ALERT;
    if (strcmp(kind, "operator") == 0)
        return CON_MARK_OPERATOR;
    if (strcmp(kind, "transition") == 0) {
        if (from_status == NULL)
            return CON_MARK_INTAKE; /* the effect's creation */
        tally_effect_state_t to;
        tally_run_state_t run_to;
        if (to_status != NULL && !tally_effect_state_parse(to_status, &to) &&
            tally_run_state_parse(to_status, &run_to))
            return CON_MARK_ANSWER; /* the run's own move: COMPENSATED, COMPLETED, ... */
        if (to_status == NULL || !tally_effect_state_parse(to_status, &to))
            return CON_MARK_OTHER;
        switch (to) {
        case TALLY_EFFECT_CONFIRMED:
        case TALLY_EFFECT_FAILED:
        case TALLY_EFFECT_UNKNOWN:
        case TALLY_EFFECT_STUCK:
        case TALLY_EFFECT_REJECTED:
        case TALLY_EFFECT_CANCELLED:
            return CON_MARK_ANSWER;
        default:
            return CON_MARK_OTHER;
        }
    }
    return CON_MARK_OTHER;
}

/* "+850 ms", "+12.5 s", "+3 min", "+2.0 h" from the start. */
static void rel_label(double ms, char *out, size_t outsz)
{
    if (ms < 1000)
        snprintf(out, outsz, "+%.0f ms", ms);
    else if (ms < 60000)
        snprintf(out, outsz, "+%.1f s", ms / 1000);
    else if (ms < 3600000)
        snprintf(out, outsz, "+%.1f min", ms / 60000);
    else
        snprintf(out, outsz, "+%.1f h", ms / 3600000);
}

static void mark_shape(con_req_t *rq, con_mark_t m, double x, double y)
{
    const char *fill = MARKS[m < CON_MARK__COUNT ? m : CON_MARK_OTHER].fill;
    switch (m) {
    case CON_MARK_ALERT:
        con_rawf(rq, "<polygon points=\"%.1f,%.1f %.1f,%.1f %.1f,%.1f\" fill=\"%s\"/>", x, y - 8,
                 x - 7, y + 6, x + 7, y + 6, fill);
        break;
    case CON_MARK_OPERATOR:
        con_rawf(rq, "<polygon points=\"%.1f,%.1f %.1f,%.1f %.1f,%.1f %.1f,%.1f\" fill=\"%s\"/>", x,
                 y - 8, x + 7, y, x, y + 8, x - 7, y, fill);
        break;
    case CON_MARK_DISPATCH:
    case CON_MARK_STATUS:
    case CON_MARK_REVERSE:
        con_rawf(rq, "<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>", x - 5,
                 y - 5, fill);
        break;
    default:
        con_rawf(rq, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"5.5\" fill=\"%s\"/>", x, y, fill);
        break;
    }
}

/* The row of a mark in its lane, so that a call and the move it caused, written in the same
 * millisecond, do not hide each other: calls above, state moves on the line, people below. */
static double row_offset(con_mark_t m)
{
    switch (m) {
    case CON_MARK_INTAKE:
    case CON_MARK_DISPATCH:
    case CON_MARK_STATUS:
    case CON_MARK_REVERSE:
        return -ROW_GAP;
    case CON_MARK_ANSWER:
    case CON_MARK_OBLIGATION:
        return 0;
    default:
        return ROW_GAP;
    }
}

/* The lane of an event: 0 for the run, 1 + the index of its effect. */
static size_t lane_of(const json_t *effects, const char *effect_id)
{
    if (effect_id == NULL)
        return 0;
    size_t i;
    const json_t *e;
    json_array_foreach(effects, i, e)
    {
        if (strcmp(cli_str(e, "effect_id", ""), effect_id) == 0)
            return i + 1;
    }
    return 0;
}

void con_timeline(con_req_t *rq, const json_t *effects, const json_t *events)
{
    size_t n_lanes = json_array_size(effects) + 1;
    size_t n_events = json_array_size(events);
    if (n_events == 0) {
        con_raw(rq, "<p class=\"muted\">No events recorded for this run.</p>");
        return;
    }
    double t0 = INFINITY, t1 = -INFINITY;
    size_t i;
    const json_t *ev;
    json_array_foreach(events, i, ev)
    {
        double t = cli_num(ev, "occurred_at_ms", 0);
        t0 = t < t0 ? t : t0;
        t1 = t > t1 ? t : t1;
    }
    double span = t1 - t0 < 1 ? 1 : t1 - t0;
    double x0 = LABEL_W, x1 = SVG_W - RIGHT_PAD;
    int height = AXIS_H + (int)n_lanes * LANE_H + LEGEND_H;

    con_rawf(rq,
             "<svg id=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" "
             "height=\"%d\" viewBox=\"0 0 %d %d\" role=\"img\" "
             "font-family=\"system-ui,sans-serif\" font-size=\"12\">",
             SVG_W, height, SVG_W, height);
    con_raw(rq, "<title>Timeline of run ");
    con_esc(rq, cli_str(json_array_get(events, 0), "run_id", ""));
    con_raw(rq, "</title>");
    /* the axis: ticks relative to the first event, whose time is written at its start */
    char start[32];
    size_t n = 0;
    for (const char *c = cli_str(json_array_get(events, 0), "occurred_at", "");
         *c != '\0' && *c != '+' && *c != 'Z' && n < 23; c++)
        start[n++] = *c == 'T' ? ' ' : *c;
    start[n] = '\0';
    con_rawf(rq, "<text x=\"8\" y=\"%d\" fill=\"#6b7380\">", AXIS_H - 12);
    con_esc(rq, start);
    con_raw(rq, " UTC</text>");
    for (int k = 0; k <= TICKS; k++) {
        double x = x0 + (x1 - x0) * k / TICKS;
        char label[32];
        rel_label(span * k / TICKS, label, sizeof label);
        con_rawf(rq,
                 "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#e3e6ea\"/>"
                 "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\" fill=\"#6b7380\">%s</text>",
                 x, AXIS_H - 6, x, AXIS_H + (int)n_lanes * LANE_H, x, AXIS_H - 12, label);
    }
    /* the lanes */
    for (size_t l = 0; l < n_lanes; l++) {
        int y = AXIS_H + (int)l * LANE_H + LANE_H / 2;
        char label[96];
        if (l == 0) {
            snprintf(label, sizeof label, "run");
        } else {
            const json_t *e = json_array_get(effects, l - 1);
            char tool[40];
            tally_text_copy(tool, sizeof tool, cli_str(e, "tool", "?"));
            char step[24];
            tally_text_copy(step, sizeof step, cli_str(e, "step", "?"));
            snprintf(label, sizeof label, "step %s · %s", step, tool);
        }
        con_rawf(rq,
                 "<g class=\"lane\"><rect x=\"0\" y=\"%d\" width=\"%d\" height=\"%d\" "
                 "fill=\"%s\"/><text x=\"8\" y=\"%d\">",
                 y - LANE_H / 2, SVG_W, LANE_H, l % 2 ? "#fafbfc" : "#ffffff", y + 4);
        con_esc(rq, label);
        con_rawf(rq,
                 "</text><line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" "
                 "stroke=\"#d5d9df\"/></g>",
                 x0, y, x1, y);
    }
    /* the marks, with their hover titles */
    json_array_foreach(events, i, ev)
    {
        const char *kind = cli_str(ev, "kind", NULL);
        const char *from = cli_str(ev, "from_status", NULL);
        const char *to = cli_str(ev, "to_status", NULL);
        const char *op = cli_str(ev, "op", NULL);
        con_mark_t m = con_mark_of(kind, from, to, op);
        size_t lane = lane_of(effects, cli_str(ev, "lane", NULL));
        double t = cli_num(ev, "occurred_at_ms", t0);
        double x = x0 + (x1 - x0) * (t - t0) / span;
        double y = AXIS_H + (double)lane * LANE_H + LANE_H / 2.0 + row_offset(m);
        char rel[32];
        rel_label(t - t0, rel, sizeof rel);
        con_rawf(rq, "<g class=\"mark\" data-mark=\"%s\"><title>", con_mark_name(m));
        con_esc(rq, rel);
        con_raw(rq, " · ");
        con_esc(rq, kind);
        if (op != NULL) {
            con_raw(rq, " ");
            con_esc(rq, op);
        }
        if (from != NULL || to != NULL) {
            con_raw(rq, " ");
            con_esc(rq, from != NULL ? from : "∅");
            con_raw(rq, " → ");
            con_esc(rq, to != NULL ? to : "∅");
        }
        con_raw(rq, " · ");
        con_esc(rq, cli_str(ev, "actor", ""));
        if (cli_str(ev, "reason", NULL) != NULL) {
            con_raw(rq, " · ");
            con_esc(rq, cli_str(ev, "reason", NULL));
        }
        con_raw(rq, "\n");
        con_esc(rq, cli_str(ev, "occurred_at", ""));
        con_raw(rq, "</title>");
        mark_shape(rq, m, x, y);
        con_raw(rq, "</g>");
    }
    /* the legend */
    double lx = 8;
    int ly = AXIS_H + (int)n_lanes * LANE_H + LEGEND_H / 2 + 2;
    for (int m = 0; m < CON_MARK__COUNT; m++) {
        mark_shape(rq, (con_mark_t)m, lx + 6, ly);
        con_rawf(rq, "<text x=\"%.1f\" y=\"%d\">%s</text>", lx + 16, ly + 4, MARKS[m].name);
        lx += 26 + 7.0 * (double)strlen(MARKS[m].name);
    }
    con_raw(rq, "</svg>");
}
