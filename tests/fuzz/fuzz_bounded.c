/* fuzz_bounded.c — tally_ce_bounded, the cut of an event too large to publish (outbox.c).
 *
 * Input: byte 0 sets the limit as a fraction of the payload's length (0..2x: cut hard, cut a
 * little, or no cut needed), the rest is the payload, a CloudEvent as JSON text. Invariants:
 * NULL for a payload that is not a JSON object; otherwise, whenever the limit leaves room for
 * the envelope and the note (the 4096 bytes cloudevent.c reserves for data.truncated), an
 * event of at most the limit, valid UTF-8, with every envelope member as it was and
 * data.truncated saying how long the original was. */
#include "fuzz.h"

#include "tally/cloudevent.h"

#define NOTE_RESERVE 4096 /* `reserve` in tally_ce_bounded */

static size_t dumped(const json_t *v)
{
    return json_dumpb(v, NULL, 0, JSON_COMPACT | JSON_ENCODE_ANY);
}

static void check_bounded(const json_t *ev, size_t original, size_t limit, const char *out)
{
    size_t len = fuzz_check_str("bounded event", out);
    FUZZ_CHECK(len <= limit, "%zu bytes over a limit of %zu", len, limit);
    json_error_t jerr;
    json_t *got = json_loads(out, TALLY_JSON_LOAD_FLAGS, &jerr);
    FUZZ_CHECK(json_is_object(got), "the bounded event does not load: %s", jerr.text);
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)ev, key, v)
    {
        if (strcmp(key, "data") != 0)
            FUZZ_CHECK(json_equal(v, json_object_get(got, key)), "envelope member %s changed", key);
    }
    json_t *note = json_object_get(json_object_get(got, "data"), "truncated");
    FUZZ_CHECK(json_is_object(note), "no data.truncated in %s", out);
    FUZZ_CHECK(json_integer_value(json_object_get(note, "original_bytes")) == (json_int_t)original,
               "original_bytes is not %zu", original);
    json_t *cut = json_object_get(note, "cut");
    FUZZ_CHECK(json_is_array(cut) && json_array_size(cut) <= 20,
               "data.truncated.cut has %zu lines (the code keeps the first 20)",
               json_array_size(cut));
    json_decref(got);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    char *payload = fuzz_strndup(data + 1, size - 1);
    size_t original = strlen(payload);
    size_t limit = original * data[0] / 128;

    char *out = tally_ce_bounded(payload, limit);
    json_t *ev = json_loads(payload, TALLY_JSON_LOAD_FLAGS, NULL);
    if (!json_is_object(ev)) {
        FUZZ_CHECK(out == NULL, "a bounded event of a payload that is not a JSON object");
    } else {
        json_t *d = json_object_get(ev, "data");
        size_t envelope = dumped(ev) - (d ? dumped(d) : 0);
        if (out != NULL)
            check_bounded(ev, original, limit, out);
        else
            FUZZ_CHECK(!json_is_object(d) || limit < envelope + NOTE_RESERVE + 64,
                       "no bounded event, though the limit %zu leaves %zu bytes for data "
                       "beyond the envelope (%zu) and the note",
                       limit, limit - envelope - NOTE_RESERVE, envelope);
    }
    json_decref(ev);
    free(out);
    free(payload);
    return 0;
}
