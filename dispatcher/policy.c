/* policy.c — the dispatcher's decisions, without I/O: what an effect becomes after its
 * connector call, and the one override the record statement may make of it. DESIGN §3 is the
 * contract; tests/unit/test_dispatch_policy.c reads it back. */
#include "policy.h"

#include <stdio.h>

#include "tally/backoff.h"
#include "tally/text.h"

void tally_dispatch_set_error(tally_dispatch_decision_t *dec, const char *code, const char *fmt,
                              const char *msg)
{
    /* The message may quote a tool's answer: cut on a character boundary (text.h). */
    tally_text_copy(dec->error_code, sizeof dec->error_code, code);
    tally_fmt(dec->error_message, sizeof dec->error_message, fmt, msg);
}

/* Not applied (or, for read and idempotent tools, maybe applied: @p was_unknown): try again
 * with the same key, or stop at the attempt cap. */
static void retry_or_stop(const tally_dispatch_input_t *in, bool was_unknown,
                          tally_dispatch_decision_t *out)
{
    const tally_conn_verdict_t *v = in->v;
    bool idempotent = in->effect_class == TALLY_CLASS_IDEMPOTENT;
    if (in->attempts < in->max_attempts) {
        out->state = TALLY_EFFECT_PLANNED;
        /* An idempotent tool's attempt that may have happened: sent again with the same key
         * while its run is ACTIVE, asked about (UNKNOWN) once it is not (the override). */
        out->maybe_applied = was_unknown && idempotent;
        out->delay_ms = tally_backoff_ms(in->attempts, in->backoff_ms, in->max_backoff_ms,
                                         v->retry_after_ms, in->random);
        tally_dispatch_set_error(out, v->code, "%s", v->message);
        return;
    }
    if (was_unknown && idempotent) {
        /* The last try may have applied: only upstream evidence can say (the reconciler). */
        out->state = TALLY_EFFECT_UNKNOWN;
        tally_text_copy(out->error_code, sizeof out->error_code, v->code);
        tally_fmt(out->error_message, sizeof out->error_message, "attempt cap %d reached; last: %s",
                  in->max_attempts, v->message);
        return;
    }
    out->state = TALLY_EFFECT_FAILED;
    snprintf(out->error_code, sizeof out->error_code, "attempts_exhausted");
    tally_fmt(out->error_message, sizeof out->error_message, "gave up after %d attempts; last: %s",
              in->attempts, v->message);
}

void tally_dispatch_decide(const tally_dispatch_input_t *in, tally_dispatch_decision_t *out)
{
    const tally_conn_verdict_t *v = in->v;
    *out = (tally_dispatch_decision_t){.state = TALLY_EFFECT_UNKNOWN};
    switch (v->verdict) {
    case TALLY_VERDICT_CONFIRMED:
        out->state = TALLY_EFFECT_CONFIRMED;
        return;
    case TALLY_VERDICT_FAILED:
        out->state = TALLY_EFFECT_FAILED;
        out->page_owner = v->alert_owner;
        tally_dispatch_set_error(out, v->code, "%s", v->message);
        return;
    case TALLY_VERDICT_RETRY:
        retry_or_stop(in, false, out);
        return;
    case TALLY_VERDICT_UNKNOWN:
        /* Rule 2: a timeout of a read or idempotent tool is transient by definition. */
        if (in->effect_class == TALLY_CLASS_READ || in->effect_class == TALLY_CLASS_IDEMPOTENT) {
            retry_or_stop(in, true, out);
            return;
        }
        out->state = TALLY_EFFECT_UNKNOWN;
        tally_dispatch_set_error(out, v->code, "%s", v->message);
        return;
    case TALLY_VERDICT_NOT_FOUND:
    case TALLY_VERDICT_FOUND:
    case TALLY_VERDICT_DUPLICATE:
    case TALLY_VERDICT_INCONCLUSIVE:
    case TALLY_VERDICT_RESOLVED:
    case TALLY_VERDICT_STUCK:
        break;
    }
    out->state = TALLY_EFFECT_UNKNOWN;
    tally_dispatch_set_error(out, "unexpected_verdict", "%s", tally_verdict_name(v->verdict));
}

bool tally_dispatch_final(const tally_dispatch_decision_t *dec)
{
    switch (dec->state) {
    case TALLY_EFFECT_PLANNED:
        return false;
    case TALLY_EFFECT_FAILED:
        return !dec->page_owner;
    default:
        return true;
    }
}

bool tally_dispatch_overridden(tally_dispatch_decision_t *dec, tally_effect_state_t became,
                               const char *code, const char *message)
{
    if (became == dec->state)
        return true;
    if (dec->state != TALLY_EFFECT_PLANNED)
        return false; /* only a retry looks at its run */
    switch (became) {
    case TALLY_EFFECT_CANCELLED: /* not applied: as the run's other PLANNED effects were */
    case TALLY_EFFECT_UNKNOWN:   /* may have been applied: the reconciler asks the tool */
        dec->state = became;
        dec->maybe_applied = false;
        dec->delay_ms = 0;
        tally_text_copy(dec->error_code, sizeof dec->error_code, code ? code : "");
        tally_text_copy(dec->error_message, sizeof dec->error_message, message ? message : "");
        return true;
    default:
        return false;
    }
}
