/* fuzz_intent.c — tally_intent_parse, the gate of the intents topic, on any bytes.
 *
 * Whatever arrives, the parser answers with a parsed intent whose fields are within the
 * limits of text.h, or with one DLQ reason and a detail sentence that is valid UTF-8 and ends
 * inside its buffer. The detail buffer is the dispatcher's (intake_msg_t.detail, 256 bytes),
 * allocated to its exact size so that AddressSanitizer sees a write past it; a refused message
 * is parsed again into a buffer of a size taken from the input, to cut the sentence elsewhere. */
#include "fuzz.h"

#include "tally/cloudevent.h"
#include "tally/text.h"

#define DETAIL_BYTES    256     /* dispatcher/dispatcher.h intake_msg_t.detail */
#define MAX_MESSAGE     1048576 /* TALLY_MAX_MESSAGE_BYTES default */
#define SMALL_MAX_BYTES 4096    /* a second, smaller limit: the too_large path on fuzzed sizes */

/* A string field of a parsed intent: present or not as @p required says, at most @p max bytes
 * (0: no limit), non-empty when @p nonempty, and without control characters when
 * @p no_control. Strings point into the document, which jansson holds as UTF-8. */
static void check_field(const char *name, const char *s, bool required, size_t max, bool nonempty,
                        bool no_control)
{
    if (s == NULL) {
        FUZZ_CHECK(!required, "a parsed intent has no %s", name);
        return;
    }
    size_t len = fuzz_check_str(name, s);
    FUZZ_CHECK(max == 0 || len <= max, "%s is %zu bytes, over its limit of %zu", name, len, max);
    FUZZ_CHECK(!nonempty || len > 0, "%s is empty", name);
    FUZZ_CHECK(!no_control || !fuzz_has_control(s, len), "%s holds a control character", name);
}

static void check_parsed(const tally_intent_t *in)
{
    FUZZ_CHECK(in->doc != NULL && json_is_object(in->doc), "a parsed intent has no document");
    FUZZ_CHECK(in->type == TALLY_MSG_INTENT || in->type == TALLY_MSG_COMPENSATE_RUN ||
                   in->type == TALLY_MSG_CANCEL_RUN || in->type == TALLY_MSG_COMPLETE_RUN,
               "type %d", (int)in->type);
    check_field("id", in->id, true, TALLY_LIMIT_EVENT_ID, true, false);
    check_field("run_id", in->run_id, true, TALLY_LIMIT_RUN_ID, true, true);
    check_field("traceparent", in->traceparent, false, 55, true, true);
    if (in->traceparent != NULL)
        FUZZ_CHECK(strlen(in->traceparent) == 55, "traceparent \"%s\"", in->traceparent);
    if (in->type == TALLY_MSG_INTENT) {
        size_t step_len = fuzz_check_text("step", in->step, sizeof in->step);
        FUZZ_CHECK(step_len > 0 && step_len <= TALLY_LIMIT_STEP, "step is %zu bytes", step_len);
        FUZZ_CHECK(!fuzz_has_control(in->step, step_len), "step holds a control character");
        check_field("tool", in->tool, true, TALLY_LIMIT_TOOL, true, true);
        check_field("operation_key", in->operation_key, false, TALLY_LIMIT_OPERATION_KEY, true,
                    true);
        check_field("tenant", in->tenant, false, TALLY_LIMIT_TENANT, false, true);
        FUZZ_CHECK(in->args != NULL && json_is_object(in->args), "args is not an object");
        FUZZ_CHECK(in->reason == NULL, "an intent carries a reason");
    } else {
        /* a run is completed with or without a reason; compensated and cancelled with one */
        check_field("reason", in->reason, in->type != TALLY_MSG_COMPLETE_RUN, TALLY_LIMIT_REASON,
                    false, false);
        FUZZ_CHECK(in->tool == NULL && in->args == NULL, "a run message carries a tool");
    }
}

/* Parse into a detail buffer of exactly @p detailsz bytes; check the answer either way. */
static tally_dlq_reason_t parse(const uint8_t *data, size_t size, size_t max_bytes, size_t detailsz)
{
    char *detail = malloc(detailsz);
    FUZZ_CHECK(detail != NULL, "out of memory");
    tally_intent_t in;
    tally_dlq_reason_t r = tally_intent_parse(data, size, max_bytes, &in, detail, detailsz);
    FUZZ_CHECK(r <= TALLY_DLQ_MISSING_OPERATION_KEY, "reason %d", (int)r);
    /* what the dispatcher reads of a refused message to answer it (tally_intent_peek) */
    tally_intent_peek_t pk;
    if (tally_intent_peek(data, size, &pk)) {
        check_field("peeked id", pk.id, true, TALLY_LIMIT_EVENT_ID, true, true);
        check_field("peeked run_id", pk.run_id, true, TALLY_LIMIT_RUN_ID, true, true);
        check_field("peeked type", pk.type, false, TALLY_LIMIT_EVENT_ID, true, true);
        check_field("peeked tool", pk.tool, false, TALLY_LIMIT_TOOL, true, true);
        FUZZ_CHECK(pk.step == NULL || json_is_integer(pk.step) || json_is_string(pk.step),
                   "a peeked step that is neither an integer nor a string");
        tally_intent_peek_clear(&pk);
    } else {
        FUZZ_CHECK(pk.doc == NULL && pk.id == NULL, "a failed peek keeps its fields");
    }
    FUZZ_CHECK(strcmp(tally_dlq_reason_name(r), "unknown") != 0, "reason %d has no name", (int)r);
    if (r == TALLY_DLQ_NONE) {
        check_parsed(&in);
        tally_intent_clear(&in);
    } else {
        size_t len = fuzz_check_text("detail", detail, detailsz);
        FUZZ_CHECK(len > 0 || detailsz <= 4, "reason %s without a detail",
                   tally_dlq_reason_name(r));
        FUZZ_CHECK(in.doc == NULL && in.run_id == NULL, "a refused intent keeps its fields");
        FUZZ_CHECK(r != TALLY_DLQ_UNKNOWN_TOOL && r != TALLY_DLQ_MISSING_OPERATION_KEY,
                   "the parser does not look at the registry, yet answered %s",
                   tally_dlq_reason_name(r));
    }
    free(detail);
    return r;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    tally_dlq_reason_t r = parse(data, size, MAX_MESSAGE, DETAIL_BYTES);
    if (r != TALLY_DLQ_NONE) {
        /* 1..64 bytes: cuts the sentence at every place an excerpt or a name could straddle */
        size_t small = size > 0 ? (size_t)data[size - 1] % 64 + 1 : 1;
        tally_dlq_reason_t again = parse(data, size, MAX_MESSAGE, small);
        FUZZ_CHECK(again == r, "the reason depends on the detail size: %s, then %s",
                   tally_dlq_reason_name(r), tally_dlq_reason_name(again));
    }
    if (size > SMALL_MAX_BYTES) {
        r = parse(data, size, SMALL_MAX_BYTES, DETAIL_BYTES);
        FUZZ_CHECK(r == TALLY_DLQ_TOO_LARGE, "%zu bytes over a limit of %d: %s", size,
                   SMALL_MAX_BYTES, tally_dlq_reason_name(r));
    }
    return 0;
}
