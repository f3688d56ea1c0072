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

json_t *dispatch_step_json(const char *step, bool is_number)
{
    if (is_number && step) {
        char *end = NULL;
        long long n = strtoll(step, &end, 10);
        if (end && *end == '\0' && end != step)
            return json_integer((json_int_t)n);
    }
    return json_string(step ? step : "");
}

char *dispatch_dump(json_t *v)
{
    if (!v)
        return NULL;
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    json_decref(v);
    return s;
}

static json_t *str_or_null(const char *s)
{
    return s ? json_string(s) : json_null();
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

    json_t *data = json_object();
    if (!data)
        return false;
    json_t *error = json_null();
    if (v->error_code) {
        error = json_pack("{s:s, s:s}", "code", v->error_code, "message",
                          v->error_message ? v->error_message : "");
    }
    int rc = json_object_set_new(data, "effect_id", str_or_null(v->effect_id));
    rc |= json_object_set_new(data, "run_id", str_or_null(v->run_id));
    rc |= json_object_set_new(data, "step", dispatch_step_json(v->step, v->step_is_number));
    rc |= json_object_set_new(data, "tool", str_or_null(v->tool));
    rc |= json_object_set_new(data, "operation_key", str_or_null(v->operation_key));
    rc |= json_object_set_new(data, "status", json_string(v->status));
    /* shared, not copied: data lives only until the event is serialised below */
    rc |= json_object_set_new(data, "receipt",
                              v->receipt ? json_incref((json_t *)v->receipt) : json_null());
    rc |= json_object_set_new(data, "external_ref", str_or_null(v->external_ref));
    rc |= json_object_set_new(data, "error", error ? error : json_null());
    rc |= json_object_set_new(data, "attempts", json_integer((json_int_t)v->attempts));
    rc |= json_object_set_new(data, "intent_id", str_or_null(v->intent_id));
    if (extra)
        rc |= json_object_update(data, (json_t *)extra);
    if (rc != 0) {
        json_decref(data);
        return false;
    }
    json_t *ce = tally_ce_new(type, d->source, v->effect_id, data, NULL);
    if (!ce)
        return false;
    tally_outbox_batch_add(ob, "outcomes", v->run_id, ce);
    json_decref(ce);
    return true;
}
