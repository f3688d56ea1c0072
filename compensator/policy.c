/* policy.c — the compensator's decisions, without I/O: what a leased obligation becomes by its
 * tool's effect class and compensation mode (DESIGN §4, the table in runops.h), by a call that
 * could not be sent, and by a call's answer (DESIGN §6); how long a retry waits; what a settled
 * run publishes. compensate.c carries the decisions out, store.c writes them;
 * tests/unit/test_compensate.c reads them back. */
#include "compensator.h"
#include "tally/backoff.h"

#include <stdio.h>
#include <string.h>

int comp_max_attempts(const tally_tool_t *tool)
{
    return tool != NULL && tool->max_attempts > 0 ? tool->max_attempts : 5;
}

bool comp_needs_approval(const tally_tool_t *tool)
{
    if (tool == NULL) {
        return false;
    }
    tally_comp_decision_t dec;
    tally_comp_decide(tool, tool->name, tool->effect_class, false, &dec);
    return dec.action == TALLY_COMP_ACT_AWAIT_APPROVAL;
}

long long comp_backoff_ms(const tally_tool_t *tool, int attempts, long retry_after_ms,
                          uint32_t random)
{
    /* the registry guarantees both (200 and 60000 ms when the contract names neither) */
    if (tool == NULL) {
        return tally_backoff_ms(attempts, 200, 60000, retry_after_ms, random); /* never called */
    }
    return tally_backoff_ms(attempts, tool->backoff_ms, tool->max_backoff_ms, retry_after_ms,
                            random);
}

/* ---- moves -------------------------------------------------------------------------------- */

static void record(comp_move_t *mv, tally_obligation_state_t to, const char *code,
                   const char *message)
{
    mv->kind = COMP_MOVE_RECORD;
    mv->to = to;
    mv->code = code;
    tally_text_copy(mv->message, sizeof mv->message, message); /* may quote a tool's answer */
}

static void stuck(comp_move_t *mv, const char *code, const char *message, const char *page)
{
    record(mv, TALLY_OBLIGATION_STUCK, code, message);
    mv->is_error = true;
    mv->page = page;
}

static void call(comp_move_t *mv, tally_conn_op_t op)
{
    mv->kind = COMP_MOVE_CALL;
    mv->op = op;
    mv->to = TALLY_OBLIGATION_RUNNING;
}

/* What cannot be undone is recorded with its blast radius; a containment never makes the
 * obligation STUCK. */
static void uncompensatable(comp_move_t *mv, const tally_comp_decision_t *dec)
{
    record(mv, TALLY_OBLIGATION_UNCOMPENSATABLE, dec->code, dec->why);
}

static void contained(comp_move_t *mv, comp_contain_t how, const char *code, const char *message)
{
    mv->containment = how;
    mv->containment_code = code;
    mv->containment_message = message;
}

static void retry_later(comp_move_t *mv, const char *code, const char *message, long long delay)
{
    record(mv, TALLY_OBLIGATION_PENDING, code, message);
    mv->is_error = true;
    mv->delay_ms = delay;
}

/* ---- the decisions ------------------------------------------------------------------------ */

void comp_policy_decide(const comp_policy_in_t *in, tally_comp_decision_t *dec)
{
    if (!in->cls_known) {
        dec->action = TALLY_COMP_ACT_NO_TOOL;
        dec->to_status = "STUCK";
        dec->code = "unknown_class";
        snprintf(dec->why, sizeof dec->why,
                 "the effect's class is not one tally knows: a human decides");
        return;
    }
    bool approved = in->approved || !comp_needs_approval(in->tool);
    tally_comp_decide(in->tool, in->tool_name, in->cls, approved, dec);
}

bool comp_policy_wants_blast_radius(tally_comp_action_t action)
{
    switch (action) {
    case TALLY_COMP_ACT_RECORD:
    case TALLY_COMP_ACT_CONTAIN:
    case TALLY_COMP_ACT_ESCALATE:
    case TALLY_COMP_ACT_NOT_SUPPORTED:
        return true;
    case TALLY_COMP_ACT_SKIP:
    case TALLY_COMP_ACT_REVERSE:
    case TALLY_COMP_ACT_AWAIT_APPROVAL:
    case TALLY_COMP_ACT_RUNBOOK:
    case TALLY_COMP_ACT_NO_TOOL:
        break;
    }
    return false;
}

void comp_policy_lease(const comp_policy_in_t *in, const tally_comp_decision_t *dec,
                       bool can_contain, comp_move_t *mv)
{
    memset(mv, 0, sizeof *mv);
    int max = comp_max_attempts(in->tool);
    switch (dec->action) {
    case TALLY_COMP_ACT_SKIP:
        record(mv, TALLY_OBLIGATION_SKIPPED, dec->code, dec->why);
        return;
    case TALLY_COMP_ACT_CONTAIN:
        if (can_contain) {
            if (in->attempts <= max) {
                call(mv, TALLY_CONN_CONTAIN);
                return;
            }
            contained(mv, COMP_CONTAIN_FAILED, "attempts_exhausted",
                      "the containment action was not confirmed within the tool's max_attempts");
        }
        uncompensatable(mv, dec);
        return;
    case TALLY_COMP_ACT_RECORD:
    case TALLY_COMP_ACT_NOT_SUPPORTED:
        uncompensatable(mv, dec);
        return;
    case TALLY_COMP_ACT_ESCALATE:
        uncompensatable(mv, dec);
        mv->page = "destructive";
        return;
    case TALLY_COMP_ACT_RUNBOOK:
    case TALLY_COMP_ACT_NO_TOOL:
        stuck(mv, dec->code, dec->why, dec->code);
        return;
    case TALLY_COMP_ACT_AWAIT_APPROVAL:
        /* the lease excludes these; a registry changed under us: give it back untouched */
        record(mv, TALLY_OBLIGATION_PENDING, dec->code, dec->why);
        mv->refund_attempt = true;
        mv->delay_ms = in->hold_ms;
        return;
    case TALLY_COMP_ACT_REVERSE:
        if (in->attempts > max) {
            /* leases kept expiring mid-call (crashes): stop and page rather than loop */
            stuck(mv, "attempts_exhausted",
                  "the reverse call was started max_attempts times without a recorded answer "
                  "(the workers making it stopped or lost their leases)",
                  "attempts_exhausted");
            return;
        }
        if (in->version == COMP_VERSION_UNUSABLE) {
            /* without its If-Match the reverse call could overwrite a newer state */
            stuck(mv, "protocol_error",
                  "the receipt's version is longer than 256 bytes or holds control characters, "
                  "so it cannot be sent as If-Match; the reverse call is not made without that "
                  "guard",
                  "protocol_error");
            return;
        }
        call(mv, TALLY_CONN_COMPENSATE);
        return;
    }
    stuck(mv, "unknown_action", "the decision table gave no action: a human decides",
          "unknown_action");
}

void comp_policy_unsent(const comp_policy_in_t *in, const tally_comp_decision_t *dec,
                        tally_conn_op_t op, bool capacity, const tally_error_t *err,
                        comp_move_t *mv)
{
    memset(mv, 0, sizeof *mv);
    bool retry = capacity || err->retriable;
    if (retry && (capacity || in->attempts < comp_max_attempts(in->tool))) {
        retry_later(mv, err->code, err->message,
                    capacity ? 200 : comp_backoff_ms(in->tool, in->attempts, -1, in->random));
        mv->refund_attempt = capacity;
    } else if (op == TALLY_CONN_CONTAIN) {
        contained(mv, COMP_CONTAIN_FAILED, err->code, err->message);
        uncompensatable(mv, dec);
    } else {
        const char *code = retry ? "attempts_exhausted" : err->code;
        stuck(mv, code, err->message, code);
    }
}

void comp_policy_no_body(comp_move_t *mv)
{
    memset(mv, 0, sizeof *mv);
    record(mv, TALLY_OBLIGATION_PENDING, "oom", "out of memory building the request body");
    mv->refund_attempt = true;
    mv->delay_ms = 1000;
}

void comp_policy_answer(const comp_policy_in_t *in, const tally_comp_decision_t *dec,
                        tally_conn_op_t op, const tally_conn_verdict_t *v, comp_move_t *mv)
{
    memset(mv, 0, sizeof *mv);
    bool exhausted = in->attempts >= comp_max_attempts(in->tool);
    bool transient = v->verdict == TALLY_VERDICT_RETRY;
    if (transient && !exhausted) {
        retry_later(mv, v->code, v->message,
                    comp_backoff_ms(in->tool, in->attempts, v->retry_after_ms, in->random));
        return;
    }
    if (op == TALLY_CONN_CONTAIN) {
        /* append_only: UNCOMPENSATABLE whatever the containment did */
        contained(mv,
                  v->verdict == TALLY_VERDICT_RESOLVED ? COMP_CONTAIN_DONE : COMP_CONTAIN_FAILED,
                  transient ? "attempts_exhausted" : v->code, v->message);
        uncompensatable(mv, dec);
        return;
    }
    switch (v->verdict) {
    case TALLY_VERDICT_RESOLVED:
        record(mv, TALLY_OBLIGATION_RESOLVED, v->code, v->message);
        return;
    case TALLY_VERDICT_RETRY: {
        char msg[512];
        tally_fmt(msg, sizeof msg,
                  "the reverse call failed %d times (max_attempts of tool '%s'); last: %s",
                  in->attempts, in->tool_name, v->message);
        stuck(mv, "attempts_exhausted", msg, "attempts_exhausted");
        return;
    }
    default: /* STUCK: 412 stale_state (never retried) or another 4xx; the code is the
                connector's verdict text */
        stuck(mv, v->code, v->message,
              strcmp(v->code, "stale_state") == 0 ? "stale_state" : "reverse_failed");
        return;
    }
}

comp_settle_t comp_policy_settle(tally_run_state_t status, const tally_run_state_t *published,
                                 tally_run_state_t outcome)
{
    if (status == outcome && published != NULL && *published == outcome) {
        return COMP_SETTLE_NONE;
    }
    return status == outcome ? COMP_SETTLE_SUMMARY : COMP_SETTLE_TRANSITION;
}

const char *comp_policy_run_event(tally_run_state_t outcome)
{
    return outcome == TALLY_RUN_STUCK ? "tally.run.stuck.v1" : "tally.run.compensated.v1";
}

bool comp_policy_count_terminal(double now, double counted_at, bool live_moved)
{
    if (counted_at <= 0) {
        return true;
    }
    double since = now - counted_at;
    return since >= COMP_TERMINAL_COUNT_MAX_S || (live_moved && since >= COMP_TERMINAL_COUNT_MIN_S);
}
