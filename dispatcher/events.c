/* events.c — the effect events the dispatcher publishes on tally.outcomes (DESIGN §5). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatcher.h"
#include "tally/cloudevent.h"

bool dispatch_flush_messages(dispatcher_t *d, tally_pg_t *pg, tally_outbox_batch_t *ob,
                             PGresult **handed, tally_error_t *err)
{
    tally_relay_t *relay = tally_worker_relay(d->w);
    return tally_outbox_batch_flush_handed(ob, pg, relay ? tally_relay_owner(relay) : NULL,
                                           TALLY_RELAY_HAND_LEASE_MS, handed, err);
}

void dispatch_hand_messages(dispatcher_t *d, PGresult *handed)
{
    (void)tally_relay_hand_result(tally_worker_relay(d->w), handed, -1, 0);
    PQclear(handed);
}

char *dispatch_dump(json_t *v)
{
    if (!v)
        return NULL;
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    json_decref(v);
    return s;
}

bool dispatch_publish_effect(dispatcher_t *d, tally_outbox_batch_t *ob, const effect_view_t *v,
                             const json_t *extra)
{
    char type[96];
    char lower[40];
    size_t i = 0;
    for (; v->status[i] && i < sizeof lower - 1; i++)
        lower[i] = (char)tolower((unsigned char)v->status[i]);
    lower[i] = '\0';
    snprintf(type, sizeof type, "tally.effect.%s.v1", lower);

    /* Written as text: one of these goes out for every effect (tally_jtext_t) */
    char id[37];
    tally_jtext_t j = {0};
    tally_jtext_begin(&j, NULL);
    tally_ce_envelope_text(&j, type, d->source, v->effect_id, id);
    tally_jtext_begin(&j, "data");
    tally_jtext_str(&j, "effect_id", v->effect_id);
    tally_jtext_str(&j, "run_id", v->run_id);
    tally_step_jtext(&j, "step", v->step, v->step_is_number);
    tally_jtext_str(&j, "tool", v->tool);
    tally_jtext_str(&j, "operation_key", v->operation_key);
    tally_jtext_str(&j, "status", v->status);
    if (v->receipt_text)
        tally_jtext_raw(&j, "receipt", v->receipt_text);
    else
        tally_jtext_value(&j, "receipt", v->receipt);
    tally_jtext_str(&j, "external_ref", v->external_ref);
    if (v->error_code) {
        tally_jtext_begin(&j, "error");
        tally_jtext_str(&j, "code", v->error_code);
        tally_jtext_str(&j, "message", v->error_message ? v->error_message : "");
        tally_jtext_end(&j);
    } else {
        tally_jtext_raw(&j, "error", NULL);
    }
    tally_jtext_int(&j, "attempts", v->attempts);
    tally_jtext_str(&j, "intent_id", v->intent_id);
    const char *key;
    json_t *value;
    json_object_foreach((json_t *)extra, key, value)
    {
        tally_jtext_value(&j, key, value);
    }
    tally_jtext_end(&j); /* data */
    tally_jtext_end(&j); /* the event */
    char *payload = tally_jtext_take(&j);
    if (!payload)
        return false;
    tally_outbox_batch_add_answer(ob, "outcomes", v->run_id, id, v->effect_id, payload,
                                  v->own ? TALLY_REPLY_NONE : TALLY_REPLY_AUTO, v->reply_to);
    free(payload);
    return true;
}
