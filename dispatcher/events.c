/* events.c — the effect events the dispatcher publishes on tally.outcomes (DESIGN §5). */
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
    /* Written as text: one of these goes out for every effect (tally_jtext_t) */
    tally_effect_event_t e = v->ev;
    e.source = d->source;
    e.extra = extra;
    char id[37];
    char *payload = tally_ce_effect_text(&e, id);
    if (!payload)
        return false;
    if (v->ev.id != NULL)
        tally_outbox_batch_add_ref(ob, "outcomes", v->ev.run_id, id, v->ev.effect_id, payload);
    else
        tally_outbox_batch_add_answer(ob, "outcomes", v->ev.run_id, id, v->ev.effect_id, payload,
                                      v->own ? TALLY_REPLY_NONE : TALLY_REPLY_AUTO, v->reply_to);
    free(payload);
    return true;
}
