/* test_cloudevent.c — CloudEvents building and the intents-topic gate: every refusal an agent
 * can provoke, with the reason and the sentence it gets back, and no crash on any input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "tally/cloudevent.h"
#include "tally/json.h"
#include "tally/text.h"

#include "test_rng.h"

#define MAX_BYTES (1024 * 1024)

static char detail[512];

static tally_dlq_reason_t parse_buf(const void *buf, size_t len, tally_intent_t *in)
{
    return tally_intent_parse(buf, len, MAX_BYTES, in, detail, sizeof detail);
}

static tally_dlq_reason_t parse_str(const char *s, tally_intent_t *in)
{
    return parse_buf(s, strlen(s), in);
}

static const char BASE_INTENT_DATA[] =
    "{\"run_id\":\"run-1\",\"step\":\"charge\",\"tool\":\"charge_card\","
    "\"args\":{\"tenant_id\":\"t1\",\"payment_id\":\"pay_42\",\"amount\":1200}}";
static const char BASE_COMPENSATE_DATA[] = "{\"run_id\":\"run-1\",\"reason\":\"agent gave up\"}";
static const char BASE_CANCEL_DATA[] = "{\"run_id\":\"run-1\",\"reason\":\"user cancelled\"}";

/* A whole CloudEvent of @p type around @p data_json, as text (caller frees). */
static char *envelope(const char *type, const char *data_json)
{
    json_error_t jerr;
    json_t *data = json_loads(data_json, 0, &jerr);
    assert_non_null(data);
    json_t *ev = json_pack("{s:s, s:s, s:s, s:s, s:o}", "specversion", "1.0", "id",
                           "7d7b4f0e-1111-4222-8333-444455556666", "source", "/test/agent", "type",
                           type, "data", data);
    assert_non_null(ev);
    char *s = json_dumps(ev, JSON_COMPACT);
    json_decref(ev);
    assert_non_null(s);
    return s;
}

/* Parse an event of @p type whose data is @p base_data with @p field set to the JSON
 * @p value_json (NULL: the field removed). */
static tally_dlq_reason_t parse_with_field(const char *type, const char *base_data,
                                           const char *field, const char *value_json,
                                           tally_intent_t *in)
{
    json_error_t jerr;
    json_t *data = json_loads(base_data, 0, &jerr);
    assert_non_null(data);
    if (value_json == NULL) {
        json_object_del(data, field);
    } else {
        json_t *v = json_loads(value_json, JSON_DECODE_ANY, &jerr);
        if (v == NULL)
            fail_msg("bad test value %s: %s", value_json, jerr.text);
        assert_int_equal(json_object_set_new(data, field, v), 0);
    }
    char *data_json = json_dumps(data, JSON_COMPACT);
    json_decref(data);
    char *msg = envelope(type, data_json);
    free(data_json);
    tally_dlq_reason_t r = parse_str(msg, in);
    free(msg);
    return r;
}

static void assert_refused(tally_dlq_reason_t got, tally_dlq_reason_t want, const char *needle)
{
    if (got != want)
        fail_msg("expected %s, got %s (%s)", tally_dlq_reason_name(want),
                 tally_dlq_reason_name(got), detail);
    if (needle != NULL && strstr(detail, needle) == NULL)
        fail_msg("detail \"%s\" does not mention \"%s\"", detail, needle);
    assert_true(tally_utf8_valid(detail, strlen(detail)));
}

/* Expect a refusal of field data.<field> set to @p value_json with @p want. */
static void expect_field(const char *type, const char *base, const char *field,
                         const char *value_json, tally_dlq_reason_t want)
{
    tally_intent_t in;
    char needle[64];
    snprintf(needle, sizeof needle, "data.%s", field);
    tally_dlq_reason_t r = parse_with_field(type, base, field, value_json, &in);
    assert_refused(r, want, needle);
    assert_null(in.doc);
}

/* A JSON string of @p n copies of @p ch, quotes included (caller frees). */
static char *quoted_run(char ch, size_t n)
{
    char *s = malloc(n + 3);
    assert_non_null(s);
    s[0] = '"';
    memset(s + 1, ch, n);
    s[n + 1] = '"';
    s[n + 2] = '\0';
    return s;
}

/* ---------------------------------------------------------------------------------------- */

static void test_ce_new_has_every_attribute(void **state)
{
    (void)state;
    char id[37] = {0};
    json_t *ev = tally_ce_new("tally.effect.confirmed.v1", "/tally/dispatcher/w1", "run-9",
                              json_pack("{s:s}", "run_id", "run-9"), id);
    assert_non_null(ev);
    assert_int_equal(strlen(id), 36);
    for (int i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23)
            assert_int_equal(id[i], '-');
        else
            assert_non_null(strchr("0123456789abcdef", id[i]));
    }
    assert_string_equal(json_string_value(json_object_get(ev, "specversion")), "1.0");
    assert_string_equal(json_string_value(json_object_get(ev, "id")), id);
    assert_string_equal(json_string_value(json_object_get(ev, "source")), "/tally/dispatcher/w1");
    assert_string_equal(json_string_value(json_object_get(ev, "type")),
                        "tally.effect.confirmed.v1");
    assert_string_equal(json_string_value(json_object_get(ev, "datacontenttype")),
                        "application/json");
    assert_string_equal(json_string_value(json_object_get(ev, "subject")), "run-9");
    assert_string_equal(json_string_value(json_object_get(json_object_get(ev, "data"), "run_id")),
                        "run-9");

    /* RFC 3339 UTC with milliseconds: 2024-05-01T12:34:56.789Z */
    const char *t = json_string_value(json_object_get(ev, "time"));
    assert_non_null(t);
    assert_int_equal(strlen(t), 24);
    assert_int_equal(t[4], '-');
    assert_int_equal(t[10], 'T');
    assert_int_equal(t[19], '.');
    assert_int_equal(t[23], 'Z');
    json_decref(ev);
}

static void test_ce_new_without_subject_and_failures(void **state)
{
    (void)state;
    json_t *ev =
        tally_ce_new("tally.obligation.v1", "/tally/reconciler", NULL, json_object(), NULL);
    assert_non_null(ev);
    assert_null(json_object_get(ev, "subject"));
    assert_true(json_is_object(json_object_get(ev, "data")));
    json_decref(ev);

    /* NULL data (a failed json_pack upstream) and strings jansson refuses give NULL; data
     * is released either way (LeakSanitizer would see it). */
    assert_null(tally_ce_new("t", "/s", NULL, NULL, NULL));
    assert_null(tally_ce_new("t", "/bad\xff", NULL, json_object(), NULL));
    assert_null(tally_ce_new(NULL, "/s", NULL, json_object(), NULL));

    /* Two events never share an id. */
    char a[37], b[37];
    json_t *e1 = tally_ce_new("t", "/s", NULL, json_object(), a);
    json_t *e2 = tally_ce_new("t", "/s", NULL, json_object(), b);
    assert_non_null(e1);
    assert_non_null(e2);
    assert_string_not_equal(a, b);
    json_decref(e1);
    json_decref(e2);
}

static void test_ce_new_round_trips_through_the_parser(void **state)
{
    (void)state;
    char id[37];
    json_t *data = json_pack("{s:s, s:i, s:s, s:{s:s}}", "run_id", "r-rt", "step", 4, "tool",
                             "send_email", "args", "to", "a@example.com");
    json_t *ev = tally_ce_new("tally.intent.v1", "/test", "r-rt", data, id);
    assert_non_null(ev);
    char *text = json_dumps(ev, JSON_COMPACT);
    json_decref(ev);
    assert_non_null(text);

    tally_intent_t in;
    assert_int_equal(parse_str(text, &in), TALLY_DLQ_NONE);
    assert_string_equal(in.id, id);
    assert_string_equal(in.run_id, "r-rt");
    assert_string_equal(in.step, "4");
    assert_true(in.step_is_number);
    assert_string_equal(in.tool, "send_email");
    tally_intent_clear(&in);
    free(text);
}

static void test_intent_with_every_field(void **state)
{
    (void)state;
    const char *msg =
        "{\"specversion\":\"1.0\",\"id\":\"ev-1\",\"source\":\"/agents/a1\","
        "\"type\":\"tally.intent.v1\",\"time\":\"2024-05-01T12:00:00.000Z\","
        "\"datacontenttype\":\"application/json\",\"subject\":\"run-1\",\"data\":{"
        "\"run_id\":\"run-1\",\"step\":\"charge\",\"tool\":\"charge_card\","
        "\"args\":{\"tenant_id\":\"t1\",\"payment_id\":\"pay_42\"},"
        "\"operation_key\":\"refund:t1:pay_42:dup\",\"tenant\":\"t1\","
        "\"traceparent\":\"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}}";
    tally_intent_t in;
    assert_int_equal(parse_str(msg, &in), TALLY_DLQ_NONE);
    assert_non_null(in.doc);
    assert_int_equal(in.type, TALLY_MSG_INTENT);
    assert_string_equal(in.id, "ev-1");
    assert_string_equal(in.run_id, "run-1");
    assert_string_equal(in.step, "charge");
    assert_false(in.step_is_number);
    assert_string_equal(in.tool, "charge_card");
    assert_true(json_is_object(in.args));
    assert_string_equal(json_string_value(json_object_get(in.args, "payment_id")), "pay_42");
    assert_string_equal(in.operation_key, "refund:t1:pay_42:dup");
    assert_string_equal(in.tenant, "t1");
    assert_string_equal(in.traceparent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    assert_null(in.reason);
    assert_false(in.compensate);
    tally_intent_clear(&in);
    assert_null(in.doc);
    tally_intent_clear(&in); /* twice is harmless */
    tally_intent_clear(NULL);
}

static void test_intent_optional_fields_absent_or_null(void **state)
{
    (void)state;
    tally_intent_t in;
    char *msg = envelope("tally.intent.v1", BASE_INTENT_DATA);
    assert_int_equal(parse_str(msg, &in), TALLY_DLQ_NONE);
    assert_null(in.operation_key);
    assert_null(in.tenant);
    assert_null(in.traceparent);
    tally_intent_clear(&in);
    free(msg);

    /* null is "not given" for optional fields (agents in Python send None). */
    assert_int_equal(
        parse_with_field("tally.intent.v1", BASE_INTENT_DATA, "operation_key", "null", &in),
        TALLY_DLQ_NONE);
    assert_null(in.operation_key);
    tally_intent_clear(&in);

    /* Unknown extra fields are welcome (more fields may come). */
    assert_int_equal(
        parse_with_field("tally.intent.v1", BASE_INTENT_DATA, "x_note", "{\"a\":[1,2]}", &in),
        TALLY_DLQ_NONE);
    tally_intent_clear(&in);
}

static void test_step_integer_and_string(void **state)
{
    (void)state;
    /* is_number: echoed as a number; is_digits: orders numerically (DESIGN §5: an answer
     * carries the step exactly as the intent had it, so "12" stays a string) */
    struct {
        const char *json;
        const char *text;
        bool is_number, is_digits;
    } ok[] = {
        {"3", "3", true, true},
        {"0", "0", true, true},
        {"9223372036854775807", "9223372036854775807", true, true},
        {"\"12\"", "12", false, true},
        {"\"007\"", "007", false, true},
        {"\"03\"", "03", false, true},
        {"\"charge\"", "charge", false, false},
        {"\"3a\"", "3a", false, false},
        {"\"étape-2\"", "étape-2", false, false},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        tally_intent_t in;
        tally_dlq_reason_t r =
            parse_with_field("tally.intent.v1", BASE_INTENT_DATA, "step", ok[i].json, &in);
        if (r != TALLY_DLQ_NONE)
            fail_msg("step %s refused: %s", ok[i].json, detail);
        assert_string_equal(in.step, ok[i].text);
        assert_int_equal(in.step_is_number, ok[i].is_number);
        assert_int_equal(in.step_is_digits, ok[i].is_digits);
        /* and the answer's step is the intent's own */
        json_t *echo = tally_step_json(in.step, in.step_is_number);
        json_t *want = json_loads(ok[i].json, JSON_DECODE_ANY, NULL);
        assert_non_null(echo);
        assert_non_null(want);
        if (!json_equal(echo, want))
            fail_msg("step %s echoed as %s", ok[i].json, json_dumps(echo, JSON_ENCODE_ANY));
        json_decref(echo);
        json_decref(want);
        tally_intent_clear(&in);
    }

    /* 100 bytes accepted, 101 refused. */
    char *step100 = quoted_run('s', 100), *step101 = quoted_run('s', 101);
    tally_intent_t in;
    assert_int_equal(parse_with_field("tally.intent.v1", BASE_INTENT_DATA, "step", step100, &in),
                     TALLY_DLQ_NONE);
    assert_int_equal(strlen(in.step), 100);
    tally_intent_clear(&in);
    expect_field("tally.intent.v1", BASE_INTENT_DATA, "step", step101, TALLY_DLQ_INVALID_FIELD);
    free(step100);
    free(step101);

    const char *bad[] = {"-1", "1.5", "1e3", "true", "null", "[]", "{}", "\"\"", "\"a\\nb\""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tally_dlq_reason_t r =
            parse_with_field("tally.intent.v1", BASE_INTENT_DATA, "step", bad[i], &in);
        assert_refused(r, TALLY_DLQ_INVALID_FIELD,
                       "data.step must be a string or a non-negative integer");
    }
    expect_field("tally.intent.v1", BASE_INTENT_DATA, "step", NULL, TALLY_DLQ_MISSING_FIELD);
}

static void test_intent_required_fields(void **state)
{
    (void)state;
    const char *t = "tally.intent.v1";
    expect_field(t, BASE_INTENT_DATA, "run_id", NULL, TALLY_DLQ_MISSING_FIELD);
    expect_field(t, BASE_INTENT_DATA, "tool", NULL, TALLY_DLQ_MISSING_FIELD);
    expect_field(t, BASE_INTENT_DATA, "args", NULL, TALLY_DLQ_MISSING_FIELD);

    expect_field(t, BASE_INTENT_DATA, "run_id", "42", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "run_id", "\"\"", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "run_id", "\"run\\u0007bell\"", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "run_id", "\"run\\ttab\"", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "tool", "\"\"", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "tool", "[\"charge_card\"]", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "args", "[1,2]", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "args", "\"{}\"", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "args", "null", TALLY_DLQ_INVALID_FIELD);

    /* run_id: 200 bytes accepted, 201 refused. */
    char *v200 = quoted_run('r', 200), *v201 = quoted_run('r', 201);
    tally_intent_t in;
    assert_int_equal(parse_with_field(t, BASE_INTENT_DATA, "run_id", v200, &in), TALLY_DLQ_NONE);
    assert_int_equal(strlen(in.run_id), 200);
    tally_intent_clear(&in);
    expect_field(t, BASE_INTENT_DATA, "run_id", v201, TALLY_DLQ_INVALID_FIELD);
    free(v200);
    free(v201);
    assert_non_null(strstr(detail, "200 bytes"));
}

static void test_operation_key_and_tenant(void **state)
{
    (void)state;
    const char *t = "tally.intent.v1";
    tally_intent_t in;
    char *k500 = quoted_run('k', 500), *k501 = quoted_run('k', 501);
    assert_int_equal(parse_with_field(t, BASE_INTENT_DATA, "operation_key", k500, &in),
                     TALLY_DLQ_NONE);
    assert_int_equal(strlen(in.operation_key), 500);
    tally_intent_clear(&in);
    expect_field(t, BASE_INTENT_DATA, "operation_key", k501, TALLY_DLQ_INVALID_FIELD);
    free(k500);
    free(k501);
    expect_field(t, BASE_INTENT_DATA, "operation_key", "\"\"", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "operation_key", "17", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "tenant", "17", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_INTENT_DATA, "tenant", "{}", TALLY_DLQ_INVALID_FIELD);
}

static void test_traceparent(void **state)
{
    (void)state;
    const char *t = "tally.intent.v1";
    const char *good[] = {
        "\"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"",
        "\"00-00000000000000000000000000000001-0000000000000001-00\"",
        "\"00-ffffffffffffffffffffffffffffffff-ffffffffffffffff-ff\"",
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        tally_intent_t in;
        tally_dlq_reason_t r = parse_with_field(t, BASE_INTENT_DATA, "traceparent", good[i], &in);
        if (r != TALLY_DLQ_NONE)
            fail_msg("traceparent %s refused: %s", good[i], detail);
        assert_int_equal(strlen(in.traceparent), 55);
        tally_intent_clear(&in);
    }
    const char *bad[] = {
        "\"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"",  /* version */
        "\"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01\"",  /* uppercase */
        "\"00-00000000000000000000000000000000-00f067aa0ba902b7-01\"",  /* zero trace id */
        "\"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01\"",  /* zero parent id */
        "\"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1\"",   /* short flags */
        "\"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-\"", /* trailing */
        "\"00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01\"",  /* separators */
        "\"00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01\"",  /* not hex */
        "\"\"",
        "\"junk\"",
        "12",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_field(t, BASE_INTENT_DATA, "traceparent", bad[i], TALLY_DLQ_INVALID_FIELD);
    /* Validated on the run-level messages too. */
    expect_field("tally.cancel_run.v1", BASE_CANCEL_DATA, "traceparent", "\"00-zz\"",
                 TALLY_DLQ_INVALID_FIELD);
}

static void test_compensate_run(void **state)
{
    (void)state;
    const char *t = "tally.compensate_run.v1";
    tally_intent_t in;
    char *msg = envelope(t, BASE_COMPENSATE_DATA);
    assert_int_equal(parse_str(msg, &in), TALLY_DLQ_NONE);
    free(msg);
    assert_int_equal(in.type, TALLY_MSG_COMPENSATE_RUN);
    assert_string_equal(in.run_id, "run-1");
    assert_string_equal(in.reason, "agent gave up");
    assert_string_equal(in.step, "");
    assert_null(in.tool);
    assert_null(in.args);
    assert_false(in.compensate);
    assert_int_equal(in.deadline_ms, 0); /* none asked */
    tally_intent_clear(&in);

    expect_field(t, BASE_COMPENSATE_DATA, "run_id", NULL, TALLY_DLQ_MISSING_FIELD);
    expect_field(t, BASE_COMPENSATE_DATA, "reason", NULL, TALLY_DLQ_MISSING_FIELD);
    expect_field(t, BASE_COMPENSATE_DATA, "reason", "false", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_COMPENSATE_DATA, "run_id", "[]", TALLY_DLQ_INVALID_FIELD);

    /* data.deadline_ms: optional, an integer of milliseconds from 1 s to 24 days */
    assert_int_equal(parse_with_field(t, BASE_COMPENSATE_DATA, "deadline_ms", "86400000", &in),
                     TALLY_DLQ_NONE);
    assert_int_equal(in.deadline_ms, 86400000);
    tally_intent_clear(&in);
    assert_int_equal(parse_with_field(t, BASE_COMPENSATE_DATA, "deadline_ms", "1000", &in),
                     TALLY_DLQ_NONE);
    assert_int_equal(in.deadline_ms, 1000);
    tally_intent_clear(&in);
    assert_int_equal(parse_with_field(t, BASE_COMPENSATE_DATA, "deadline_ms", "2073600000", &in),
                     TALLY_DLQ_NONE);
    assert_int_equal(in.deadline_ms, 2073600000);
    tally_intent_clear(&in);
    assert_int_equal(parse_with_field(t, BASE_COMPENSATE_DATA, "deadline_ms", "null", &in),
                     TALLY_DLQ_NONE);
    assert_int_equal(in.deadline_ms, 0);
    tally_intent_clear(&in);
    const char *bad[] = {"999",    "0",           "-5000", "2073600001", "99999999999999",
                         "1500.5", "\"3600000\"", "true",  "{}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        expect_field(t, BASE_COMPENSATE_DATA, "deadline_ms", bad[i], TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_COMPENSATE_DATA, "deadline_ms", "999", TALLY_DLQ_INVALID_FIELD);
    assert_non_null(strstr(detail, "data.deadline_ms must be an integer from 1000 to 2073600000"));
    assert_non_null(strstr(detail, "not 999"));
}

static void test_cancel_run(void **state)
{
    (void)state;
    const char *t = "tally.cancel_run.v1";
    tally_intent_t in;
    char *msg = envelope(t, BASE_CANCEL_DATA);
    assert_int_equal(parse_str(msg, &in), TALLY_DLQ_NONE);
    free(msg);
    assert_int_equal(in.type, TALLY_MSG_CANCEL_RUN);
    assert_string_equal(in.reason, "user cancelled");
    assert_false(in.compensate); /* default */
    tally_intent_clear(&in);

    assert_int_equal(parse_with_field(t, BASE_CANCEL_DATA, "compensate", "true", &in),
                     TALLY_DLQ_NONE);
    assert_true(in.compensate);
    tally_intent_clear(&in);
    assert_int_equal(parse_with_field(t, BASE_CANCEL_DATA, "compensate", "false", &in),
                     TALLY_DLQ_NONE);
    assert_false(in.compensate);
    tally_intent_clear(&in);

    expect_field(t, BASE_CANCEL_DATA, "compensate", "\"yes\"", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_CANCEL_DATA, "compensate", "1", TALLY_DLQ_INVALID_FIELD);
    expect_field(t, BASE_CANCEL_DATA, "reason", NULL, TALLY_DLQ_MISSING_FIELD);
    expect_field(t, BASE_CANCEL_DATA, "run_id", NULL, TALLY_DLQ_MISSING_FIELD);
}

static void test_too_large_is_refused_before_parsing(void **state)
{
    (void)state;
    tally_intent_t in;
    char *msg = envelope("tally.intent.v1", BASE_INTENT_DATA);
    size_t len = strlen(msg);
    /* Exactly at the limit is fine; one byte over is not. */
    assert_int_equal(tally_intent_parse(msg, len, len, &in, detail, sizeof detail), TALLY_DLQ_NONE);
    tally_intent_clear(&in);
    assert_refused(tally_intent_parse(msg, len, len - 1, &in, detail, sizeof detail),
                   TALLY_DLQ_TOO_LARGE, "above the limit");
    free(msg);

    /* 4 MiB of bytes that are neither UTF-8 nor JSON: the size decides, nothing else runs. */
    size_t big = 4u * 1024 * 1024;
    unsigned char *junk = malloc(big);
    assert_non_null(junk);
    memset(junk, 0xFF, big);
    assert_refused(parse_buf(junk, big, &in), TALLY_DLQ_TOO_LARGE, "4194304 bytes");
    assert_null(in.doc);
    free(junk);
}

static void test_invalid_utf8(void **state)
{
    (void)state;
    struct {
        const char *bytes;
        const char *what;
    } cases[] = {
        {"\xC0\xAF", "overlong '/'"},
        {"\xE0\x80\xAF", "overlong 3-byte"},
        {"\xED\xA0\x80", "UTF-16 lone surrogate U+D800 encoded in UTF-8"},
        {"\xED\xBF\xBF", "surrogate U+DFFF"},
        {"\xE2\x82", "truncated 3-byte sequence"},
        {"\xF4\x90\x80\x80", "above U+10FFFF"},
        {"\x80", "lone continuation byte"},
        {"\xFF", "0xFF"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        static const char prefix[] = "{\"specversion\":\"1.0\",\"id\":\"e\",\"source\":\"/s\","
                                     "\"type\":\"tally.intent.v1\",\"data\":{\"run_id\":\"r";
        char msg[512], where[32];
        /* Inside a string value, where a lax parser would carry it into the ledger. */
        int n = snprintf(msg, sizeof msg, "%s%s\",\"step\":1,\"tool\":\"x\",\"args\":{}}}", prefix,
                         cases[i].bytes);
        snprintf(where, sizeof where, "offset %zu", sizeof prefix - 1);
        tally_intent_t in;
        tally_dlq_reason_t r = parse_buf(msg, (size_t)n, &in);
        if (r != TALLY_DLQ_INVALID_UTF8)
            fail_msg("%s: got %s (%s)", cases[i].what, tally_dlq_reason_name(r), detail);
        assert_non_null(strstr(detail, where));
        assert_true(tally_utf8_valid(detail, strlen(detail)));
    }
    /* Truncated at the very end of the message. */
    tally_intent_t in;
    assert_refused(parse_buf("{\"a\":\"\xF0\x9F\x98", 9, &in), TALLY_DLQ_INVALID_UTF8,
                   "not valid UTF-8");
}

static void test_not_json(void **state)
{
    (void)state;
    const char *cases[] = {
        "",
        "not json",
        "{\"specversion\":\"1.0\",",
        "{\"specversion\":\"1.0\"} trailing",
        "{'single':'quotes'}",
        "{\"a\":1,}",
        "[1,2,3]",
        "\"just a string\"",
        "42",
        "null",
        "{\"s\":\"nul \\u0000 inside\"}",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tally_intent_t in;
        tally_dlq_reason_t r = parse_str(cases[i], &in);
        if (r != TALLY_DLQ_NOT_JSON)
            fail_msg("input %s: got %s (%s)", cases[i], tally_dlq_reason_name(r), detail);
        assert_true(detail[0] != '\0');
        assert_null(in.doc);
    }
    tally_intent_t in;
    assert_refused(parse_str("{\n  \"a\": tru\n}", &in), TALLY_DLQ_NOT_JSON, "line 2");
    assert_refused(parse_str("[]", &in), TALLY_DLQ_NOT_JSON, "an array, not a JSON object");
    /* A raw NUL byte inside the buffer. */
    assert_refused(parse_buf("{\"a\":\0\"b\"}", 10, &in), TALLY_DLQ_NOT_JSON, "not JSON");
}

static void test_duplicate_keys_refused(void **state)
{
    (void)state;
    tally_intent_t in;
    /* Two ids: which one would a consumer deduplicate on? */
    assert_refused(parse_str("{\"specversion\":\"1.0\",\"id\":\"a\",\"id\":\"b\",\"source\":\"/s\","
                             "\"type\":\"tally.intent.v1\",\"data\":{}}",
                             &in),
                   TALLY_DLQ_NOT_JSON, "duplicate");
    /* Two amounts inside args: the tool and the ledger could read different ones. */
    assert_refused(parse_str("{\"specversion\":\"1.0\",\"id\":\"a\",\"source\":\"/s\","
                             "\"type\":\"tally.intent.v1\",\"data\":{\"run_id\":\"r\",\"step\":1,"
                             "\"tool\":\"t\",\"args\":{\"amount\":1,\"amount\":1000}}}",
                             &in),
                   TALLY_DLQ_NOT_JSON, "duplicate");
}

static void test_not_cloudevent(void **state)
{
    (void)state;
    const char *cases[][2] = {
        {"{\"id\":\"e\",\"source\":\"/s\",\"type\":\"tally.intent.v1\",\"data\":{}}",
         "specversion"},
        {"{\"specversion\":\"0.3\",\"id\":\"e\",\"source\":\"/s\",\"type\":\"tally.intent.v1\"}",
         "\"0.3\""},
        {"{\"specversion\":1.0,\"id\":\"e\",\"source\":\"/s\",\"type\":\"tally.intent.v1\"}",
         "specversion must be a string"},
        {"{\"specversion\":\"1.0\",\"source\":\"/s\",\"type\":\"tally.intent.v1\"}", "id"},
        {"{\"specversion\":\"1.0\",\"id\":\"\",\"source\":\"/s\",\"type\":\"tally.intent.v1\"}",
         "id must be a non-empty string"},
        {"{\"specversion\":\"1.0\",\"id\":7,\"source\":\"/s\",\"type\":\"tally.intent.v1\"}",
         "id must be a string"},
        {"{\"specversion\":\"1.0\",\"id\":\"e\",\"type\":\"tally.intent.v1\"}", "source"},
        {"{\"specversion\":\"1.0\",\"id\":\"e\",\"source\":null,\"type\":\"tally.intent.v1\"}",
         "source must be a string"},
        {"{\"specversion\":\"1.0\",\"id\":\"e\",\"source\":\"/s\"}", "type"},
        {"{\"specversion\":\"1.0\",\"id\":\"e\",\"source\":\"/s\",\"type\":[]}",
         "type must be a string"},
        {"{}", "specversion"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        tally_intent_t in;
        assert_refused(parse_str(cases[i][0], &in), TALLY_DLQ_NOT_CLOUDEVENT, cases[i][1]);
    }
}

static void test_unknown_type(void **state)
{
    (void)state;
    tally_intent_t in;
    char *msg = envelope("tally.intent.v2", BASE_INTENT_DATA);
    assert_refused(parse_str(msg, &in), TALLY_DLQ_UNKNOWN_TYPE, "\"tally.intent.v2\"");
    free(msg);
    msg = envelope("tally.effect.confirmed.v1", "{}");
    assert_refused(parse_str(msg, &in), TALLY_DLQ_UNKNOWN_TYPE, "tally.intent.v1");
    free(msg);
}

static void test_data_missing_or_not_object(void **state)
{
    (void)state;
    tally_intent_t in;
    assert_refused(parse_str("{\"specversion\":\"1.0\",\"id\":\"e\",\"source\":\"/s\","
                             "\"type\":\"tally.intent.v1\"}",
                             &in),
                   TALLY_DLQ_MISSING_FIELD, "data is missing");
    assert_refused(parse_str("{\"specversion\":\"1.0\",\"id\":\"e\",\"source\":\"/s\","
                             "\"type\":\"tally.intent.v1\",\"data_base64\":\"e30=\"}",
                             &in),
                   TALLY_DLQ_MISSING_FIELD, "data_base64");
    const char *bad[] = {"[]", "\"{}\"", "null", "1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char msg[256];
        snprintf(msg, sizeof msg,
                 "{\"specversion\":\"1.0\",\"id\":\"e\",\"source\":\"/s\","
                 "\"type\":\"tally.cancel_run.v1\",\"data\":%s}",
                 bad[i]);
        assert_refused(parse_str(msg, &in), TALLY_DLQ_INVALID_FIELD, "data must be a JSON object");
    }
    assert_refused(parse_str("{\"specversion\":\"1.0\",\"id\":\"e\",\"source\":\"/s\","
                             "\"type\":\"tally.intent.v1\",\"datacontenttype\":\"text/plain\","
                             "\"data\":{}}",
                             &in),
                   TALLY_DLQ_INVALID_FIELD, "datacontenttype");
    /* application/json with parameters and +json types are JSON. */
    char *base = envelope("tally.intent.v1", BASE_INTENT_DATA);
    json_error_t jerr;
    json_t *doc = json_loads(base, 0, &jerr);
    free(base);
    json_object_set_new(doc, "datacontenttype", json_string("application/json; charset=utf-8"));
    char *msg = json_dumps(doc, JSON_COMPACT);
    assert_int_equal(parse_str(msg, &in), TALLY_DLQ_NONE);
    tally_intent_clear(&in);
    free(msg);
    json_decref(doc);
}

static void test_reason_names(void **state)
{
    (void)state;
    const struct {
        tally_dlq_reason_t r;
        const char *name;
    } names[] = {
        {TALLY_DLQ_NONE, "none"},
        {TALLY_DLQ_TOO_LARGE, "too_large"},
        {TALLY_DLQ_INVALID_UTF8, "invalid_utf8"},
        {TALLY_DLQ_NOT_JSON, "not_json"},
        {TALLY_DLQ_NOT_CLOUDEVENT, "not_cloudevent"},
        {TALLY_DLQ_UNKNOWN_TYPE, "unknown_type"},
        {TALLY_DLQ_MISSING_FIELD, "missing_field"},
        {TALLY_DLQ_INVALID_FIELD, "invalid_field"},
        {TALLY_DLQ_UNKNOWN_TOOL, "unknown_tool"},
        {TALLY_DLQ_MISSING_OPERATION_KEY, "missing_operation_key"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        assert_string_equal(tally_dlq_reason_name(names[i].r), names[i].name);
}

static void test_detail_stays_utf8_and_bounded(void **state)
{
    (void)state;
    /* A long type of 3-byte characters, quoted into a small buffer: the cut must not split
     * a character (the DLQ writes the detail as a JSON string). */
    char type[3 * 400 + 1];
    for (int i = 0; i < 400; i++)
        memcpy(type + 3 * i, "\xE2\x82\xAC", 3); /* € */
    type[3 * 400] = '\0';
    char *msg = envelope(type, "{}");
    for (size_t sz = 1; sz < 120; sz++) {
        char small[120];
        tally_intent_t in;
        tally_dlq_reason_t r = tally_intent_parse(msg, strlen(msg), MAX_BYTES, &in, small, sz);
        assert_int_equal(r, TALLY_DLQ_UNKNOWN_TYPE);
        assert_true(strlen(small) < sz);
        assert_true(tally_utf8_valid(small, strlen(small)));
    }
    /* A NULL detail is allowed. */
    tally_intent_t in;
    assert_int_equal(tally_intent_parse(msg, strlen(msg), MAX_BYTES, &in, NULL, 0),
                     TALLY_DLQ_UNKNOWN_TYPE);
    free(msg);
    /* Control characters quoted from the input are not copied into the sentence. */
    msg = envelope("evil\r\ntype", "{}");
    assert_refused(parse_str(msg, &in), TALLY_DLQ_UNKNOWN_TYPE, "evil??type");
    free(msg);
}

static void test_deep_nesting(void **state)
{
    (void)state;
    /* Far beyond jansson's depth limit: refused as not JSON, no stack overflow. */
    size_t depth = 200000;
    char *deep = malloc(2 * depth + 1);
    assert_non_null(deep);
    memset(deep, '[', depth);
    memset(deep + depth, ']', depth);
    deep[2 * depth] = '\0';
    tally_intent_t in;
    assert_refused(parse_str(deep, &in), TALLY_DLQ_NOT_JSON, NULL);
    for (size_t i = 0; i < depth; i++)
        deep[i] = (i % 2) ? '[' : '{';
    assert_int_equal(parse_buf(deep, depth, &in), TALLY_DLQ_NOT_JSON);
    free(deep);

    /* Moderately deep args are just args. */
    char args[2100];
    size_t n = 0, levels = 500;
    for (size_t i = 0; i < levels; i++)
        args[n++] = '[';
    for (size_t i = 0; i < levels; i++)
        args[n++] = ']';
    args[n] = '\0';
    char data[2300];
    snprintf(data, sizeof data,
             "{\"run_id\":\"r\",\"step\":1,\"tool\":\"t\",\"args\":{\"deep\":%s}}", args);
    char *msg = envelope("tally.intent.v1", data);
    assert_int_equal(parse_str(msg, &in), TALLY_DLQ_NONE);
    tally_intent_clear(&in);
    free(msg);
}

static void check_any_input(const unsigned char *buf, size_t len)
{
    tally_intent_t in;
    char d[256];
    tally_dlq_reason_t r = tally_intent_parse(buf, len, 4096, &in, d, sizeof d);
    if (r == TALLY_DLQ_NONE) {
        assert_non_null(in.doc);
        assert_non_null(in.id);
        assert_non_null(in.run_id);
        if (in.type == TALLY_MSG_INTENT) {
            assert_non_null(in.tool);
            assert_true(json_is_object(in.args));
            assert_true(in.step[0] != '\0');
        } else {
            assert_non_null(in.reason);
        }
        tally_intent_clear(&in);
    } else {
        assert_null(in.doc);
        assert_true(d[0] != '\0');
        assert_true(tally_utf8_valid(d, strlen(d)));
        assert_true(r == TALLY_DLQ_TOO_LARGE || r == TALLY_DLQ_INVALID_UTF8 ||
                    r == TALLY_DLQ_NOT_JSON || r == TALLY_DLQ_NOT_CLOUDEVENT ||
                    r == TALLY_DLQ_UNKNOWN_TYPE || r == TALLY_DLQ_MISSING_FIELD ||
                    r == TALLY_DLQ_INVALID_FIELD);
    }
}

/* A JSON string of @p n bytes: 'a's ending in the @p tail bytes (a multi-byte character, so
 * that it sits right at the limit), as a quoted JSON value. */
static char *string_of(size_t n, const char *tail)
{
    size_t t = strlen(tail);
    char *s = malloc(n + 3);
    assert_non_null(s);
    s[0] = '"';
    memset(s + 1, 'a', n - t);
    memcpy(s + 1 + n - t, tail, t);
    s[n + 1] = '"';
    s[n + 2] = '\0';
    return s;
}

/* Every field with a limit (text.h): at the limit it is accepted, one byte over it refused
 * with invalid_field and a sentence naming the field; a multi-byte character at the very end
 * counts in bytes. */
static void test_every_field_at_and_over_its_limit(void **state)
{
    (void)state;
    struct {
        const char *type, *base, *field;
        size_t limit;
    } cases[] = {
        {"tally.intent.v1", BASE_INTENT_DATA, "run_id", TALLY_LIMIT_RUN_ID},
        {"tally.intent.v1", BASE_INTENT_DATA, "step", TALLY_LIMIT_STEP},
        {"tally.intent.v1", BASE_INTENT_DATA, "tool", TALLY_LIMIT_TOOL},
        {"tally.intent.v1", BASE_INTENT_DATA, "operation_key", TALLY_LIMIT_OPERATION_KEY},
        {"tally.intent.v1", BASE_INTENT_DATA, "tenant", TALLY_LIMIT_TENANT},
        {"tally.compensate_run.v1", BASE_COMPENSATE_DATA, "run_id", TALLY_LIMIT_RUN_ID},
        {"tally.compensate_run.v1", BASE_COMPENSATE_DATA, "reason", TALLY_LIMIT_REASON},
        {"tally.cancel_run.v1", BASE_CANCEL_DATA, "reason", TALLY_LIMIT_REASON},
    };
    const char *tails[] = {"\xc3\xbc", "\xe2\x82\xac", "\xf0\x9f\x98\x80"};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (size_t t = 0; t < 3; t++) {
            for (size_t over = 0; over <= 1; over++) {
                tally_intent_t in;
                char *v = string_of(cases[i].limit + over, tails[t]);
                tally_dlq_reason_t r =
                    parse_with_field(cases[i].type, cases[i].base, cases[i].field, v, &in);
                if (!over) {
                    if (r != TALLY_DLQ_NONE)
                        fail_msg("%s of %zu bytes refused: %s", cases[i].field, cases[i].limit,
                                 detail);
                    tally_intent_clear(&in);
                } else {
                    assert_int_equal(r, TALLY_DLQ_INVALID_FIELD);
                    char want[64];
                    snprintf(want, sizeof want, "data.%s", cases[i].field);
                    if (strstr(detail, want) == NULL)
                        fail_msg("detail does not name %s: %s", want, detail);
                    assert_true(tally_utf8_valid(detail, strlen(detail)));
                }
                free(v);
            }
        }
    }
}

/* The CloudEvents id names the intent in every answer: at most 200 bytes. */
static void test_event_id_limit(void **state)
{
    (void)state;
    for (size_t over = 0; over <= 1; over++) {
        char *id = string_of(TALLY_LIMIT_EVENT_ID + over, "\xc3\xbc");
        char *msg = NULL;
        assert_true(asprintf(&msg,
                             "{\"specversion\":\"1.0\",\"id\":%s,\"source\":\"/a\",\"type\":"
                             "\"tally.intent.v1\",\"data\":%s}",
                             id, BASE_INTENT_DATA) > 0);
        tally_intent_t in;
        tally_dlq_reason_t r = parse_str(msg, &in);
        if (!over) {
            assert_int_equal(r, TALLY_DLQ_NONE);
            tally_intent_clear(&in);
        } else {
            assert_int_equal(r, TALLY_DLQ_INVALID_FIELD);
            assert_non_null(strstr(detail, "CloudEvents id must be at most 200 bytes"));
        }
        free(id);
        free(msg);
    }
}

/* An operation key with CR/LF would inject headers: invalid, not missing. */
static void test_operation_key_with_control_characters_is_invalid(void **state)
{
    (void)state;
    tally_intent_t in;
    assert_int_equal(parse_with_field("tally.intent.v1", BASE_INTENT_DATA, "operation_key",
                                      "\"k\\r\\nX-Injected: 1\"", &in),
                     TALLY_DLQ_INVALID_FIELD);
    assert_non_null(strstr(detail, "data.operation_key"));
    assert_non_null(strstr(detail, "control character"));
}

/* The intent with args.amount written as @p number, byte for byte (not through jansson,
 * which would read it first). */
static tally_dlq_reason_t parse_amount(const char *number, tally_intent_t *in)
{
    char msg[1024];
    snprintf(msg, sizeof msg,
             "{\"specversion\":\"1.0\",\"id\":\"i-1\",\"source\":\"/a\",\"type\":"
             "\"tally.intent.v1\",\"data\":{\"run_id\":\"r\",\"step\":1,\"tool\":\"t\","
             "\"args\":{\"note\":\"1e-400 in a string\",\"amount\":%s}}}",
             number);
    return parse_str(msg, in);
}

/* 1e-400 is not 0 as written, but a double reads it as 0: refused, never silently changed.
 * Small numbers that a double holds, and zeros however written, pass. */
static void test_numbers_that_would_read_as_zero_are_refused(void **state)
{
    (void)state;
    const char *refused[] = {"1e-400", "-2.5E-999", "0.0001e-330", "1.0000000000e-400",
                             "[1, 1e-400]"};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        tally_intent_t in;
        assert_int_equal(parse_amount(refused[i], &in), TALLY_DLQ_INVALID_FIELD);
        if (strstr(detail, "would be read as 0") == NULL)
            fail_msg("%s: %s", refused[i], detail);
    }
    /* plain decimals too: 0.<400 zeros>1 reads as 0; 0.<299 zeros>1 is 1e-300 */
    char plain[420], small[320];
    snprintf(plain, sizeof plain, "-0.%0400d", 1);
    snprintf(small, sizeof small, "0.%0300d", 1);
    tally_intent_t pin;
    assert_int_equal(parse_amount(plain, &pin), TALLY_DLQ_INVALID_FIELD);
    const char *kept[] = {"0e-400",   "0.0E+5", "-0.0",       "1e-300",
                          "4.9e-324", "12",     "\"1e-400\"", small};
    for (size_t i = 0; i < sizeof kept / sizeof kept[0]; i++) {
        tally_intent_t in;
        tally_dlq_reason_t r = parse_amount(kept[i], &in);
        if (r != TALLY_DLQ_NONE)
            fail_msg("%s refused: %s", kept[i], detail);
        tally_intent_clear(&in);
    }
}

/* An event over the broker's limit is published cut: within the limit, valid JSON and UTF-8,
 * its small fields whole, and data.truncated saying what was cut and where the whole is. */
static void test_an_oversized_event_is_bounded(void **state)
{
    (void)state;
    /* a run summary of 5,000 entries and a 1 MB reason with multi-byte characters */
    json_t *items = json_array();
    for (int i = 0; i < 5000; i++)
        json_array_append_new(items, json_pack("{s:s, s:i, s:s}", "effect_id",
                                               "0199a0b1-2c3d-7e4f-8a5b-6c7d8e9f0a1b", "step", i,
                                               "tool", "charge_card"));
    char *reason = malloc(1000001);
    assert_non_null(reason);
    for (size_t i = 0; i < 1000000; i += 2)
        memcpy(reason + i, "\xc3\xbc", 2);
    reason[1000000] = '\0';
    json_t *data = json_pack("{s:s, s:s, s:s, s:{s:{s:i}, s:o}}", "run_id", "run-\xc3\xbc",
                             "status", "COMPENSATED", "reason", reason, "summary", "counts",
                             "compensated", 5000, "compensated", items);
    json_t *ev =
        tally_ce_new("tally.run.compensated.v1", "/tally/compensator", "run-\xc3\xbc", data, NULL);
    char *payload = json_dumps(ev, JSON_COMPACT);
    assert_true(strlen(payload) > TALLY_LIMIT_EVENT_BYTES);
    char *out = tally_ce_bounded(payload, TALLY_LIMIT_EVENT_BYTES);
    assert_non_null(out);
    assert_true(strlen(out) <= TALLY_LIMIT_EVENT_BYTES);
    assert_true(tally_utf8_valid(out, strlen(out)));
    json_t *got = json_loads(out, 0, NULL);
    assert_non_null(got);
    assert_string_equal(json_string_value(json_object_get(got, "id")),
                        json_string_value(json_object_get(ev, "id")));
    json_t *d = json_object_get(got, "data");
    assert_string_equal(json_string_value(json_object_get(d, "run_id")), "run-\xc3\xbc");
    assert_string_equal(json_string_value(json_object_get(d, "status")), "COMPENSATED");
    assert_int_equal(json_integer_value(json_object_get(
                         json_object_get(json_object_get(d, "summary"), "counts"), "compensated")),
                     5000);
    json_t *tr = json_object_get(d, "truncated");
    assert_int_equal(json_integer_value(json_object_get(tr, "original_bytes")),
                     (json_int_t)strlen(payload));
    assert_string_equal(json_string_value(json_object_get(tr, "full")),
                        "tally summary --run 'run-\xc3\xbc'");
    assert_true(json_array_size(json_object_get(tr, "cut")) >= 1);
    /* the reason, the largest value, was cut first, on a character boundary */
    const char *r = json_string_value(json_object_get(d, "reason"));
    assert_non_null(r);
    assert_true(strlen(r) < 1000000);
    json_decref(got);
    /* cut again for a smaller producer limit (the relay does): the note keeps the first size */
    char *again = tally_ce_bounded(out, 300000);
    assert_non_null(again);
    assert_true(strlen(again) <= 300000);
    got = json_loads(again, 0, NULL);
    assert_non_null(got);
    tr = json_object_get(json_object_get(got, "data"), "truncated");
    assert_int_equal(json_integer_value(json_object_get(tr, "original_bytes")),
                     (json_int_t)strlen(payload));
    json_decref(got);
    free(again);
    free(out);
    /* a limit too small for even the envelope: NULL, never an event over it */
    assert_null(tally_ce_bounded(payload, 100));
    assert_null(tally_ce_bounded("not json", TALLY_LIMIT_EVENT_BYTES));
    free(payload);
    free(reason);
    json_decref(ev);
}

static void test_random_and_truncated_inputs_never_crash(void **state)
{
    (void)state;
    const char *seeds[] = {
        "{\"specversion\":\"1.0\",\"id\":\"e1\",\"source\":\"/a\",\"type\":\"tally.intent.v1\","
        "\"data\":{\"run_id\":\"r\",\"step\":\"s1\",\"tool\":\"t\",\"args\":{\"k\":[1,2.5,null,"
        "true,\"\xC3\xA9\"]},\"operation_key\":\"k1\",\"tenant\":\"t\",\"traceparent\":"
        "\"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}}",
        "{\"specversion\":\"1.0\",\"id\":\"e2\",\"source\":\"/a\",\"type\":\"tally.cancel_run.v1\","
        "\"data\":{\"run_id\":\"r\",\"reason\":\"x\",\"compensate\":true}}",
        "{\"specversion\":\"1.0\",\"id\":\"e3\",\"source\":\"/a\","
        "\"type\":\"tally.compensate_run.v1\",\"data\":{\"run_id\":\"r\",\"reason\":\"x\"}}",
    };
    static const char alphabet[] = "{}[]\",:0-9e.\\ntfu\x80\xC3\xFF";
    unsigned char buf[4200];
    for (size_t s = 0; s < sizeof seeds / sizeof seeds[0]; s++) {
        size_t len = strlen(seeds[s]);
        /* Every truncation. */
        for (size_t cut = 0; cut <= len; cut++) {
            memcpy(buf, seeds[s], cut);
            check_any_input(buf, cut);
        }
        /* Random mutations: flip, replace or insert bytes. */
        for (int round = 0; round < 4000; round++) {
            size_t n = len;
            memcpy(buf, seeds[s], len);
            int edits = 1 + (int)(rng() % 4);
            for (int e = 0; e < edits; e++) {
                size_t at = (size_t)(rng() % n);
                switch (rng() % 3) {
                case 0:
                    buf[at] ^= (unsigned char)(1u << (rng() % 8));
                    break;
                case 1:
                    buf[at] = (unsigned char)alphabet[rng() % (sizeof alphabet - 1)];
                    break;
                default:
                    if (n + 1 < sizeof buf) {
                        memmove(buf + at + 1, buf + at, n - at);
                        buf[at] = (unsigned char)rng();
                        n++;
                    }
                }
            }
            check_any_input(buf, n);
        }
    }
    /* Pure noise, including lengths above the 4096-byte limit given to the parser. */
    for (int round = 0; round < 3000; round++) {
        size_t n = (size_t)(rng() % sizeof buf);
        for (size_t i = 0; i < n; i++)
            buf[i] = (unsigned char)rng();
        check_any_input(buf, n);
    }
}

/* An effect event with its id and time given (a reference the relay builds from the ledger)
 * is a pure function of its inputs: these exact bytes, every time; without them, a fresh id
 * and the clock, the rest the same. */
static void test_effect_event_with_given_id_and_time_is_exact(void **state)
{
    (void)state;
    tally_effect_event_t e = {.source = TALLY_CE_DISPATCHER_SOURCE "d-1",
                              .id = "0199a0b1-2c3d-7e4f-8a5b-6c7d8e9f0a1b",
                              .time = "2026-11-27T08:00:00.123Z",
                              .effect_id = "4b0c7a1e-52f3-4d7e-9a51-0c5e8f3b2a10",
                              .run_id = "run-\xc3\xbc",
                              .step = "3",
                              .step_is_number = true,
                              .tool = "charge_card",
                              .operation_key = "charge_card:p-1",
                              .status = "CONFIRMED",
                              .receipt_text = "{\"id\":\"ch_1\",\"amount\":5}",
                              .external_ref = "ch_1",
                              .attempts = 1,
                              .intent_id = "i-1"};
    const char *want =
        "{\"specversion\":\"1.0\",\"id\":\"0199a0b1-2c3d-7e4f-8a5b-6c7d8e9f0a1b\","
        "\"source\":\"/tally/dispatcher/d-1\",\"type\":\"tally.effect.confirmed.v1\","
        "\"time\":\"2026-11-27T08:00:00.123Z\",\"datacontenttype\":\"application/json\","
        "\"subject\":\"4b0c7a1e-52f3-4d7e-9a51-0c5e8f3b2a10\",\"data\":{"
        "\"effect_id\":\"4b0c7a1e-52f3-4d7e-9a51-0c5e8f3b2a10\",\"run_id\":\"run-\xc3\xbc\","
        "\"step\":3,\"tool\":\"charge_card\",\"operation_key\":\"charge_card:p-1\","
        "\"status\":\"CONFIRMED\",\"receipt\":{\"id\":\"ch_1\",\"amount\":5},"
        "\"external_ref\":\"ch_1\",\"error\":null,\"attempts\":1,\"intent_id\":\"i-1\"}}";
    char id[37], again_id[37];
    char *text = tally_ce_effect_text(&e, id);
    char *again = tally_ce_effect_text(&e, again_id);
    assert_non_null(text);
    assert_string_equal(text, want);
    assert_string_equal(again, text);
    assert_string_equal(id, e.id);

    /* an error, no receipt, a string step */
    e.status = "FAILED";
    e.receipt_text = NULL;
    e.external_ref = NULL;
    e.step = "03";
    e.step_is_number = false;
    e.error_code = "http_422";
    e.error_message = "bad \"card\"";
    char *failed = tally_ce_effect_text(&e, id);
    assert_non_null(failed);
    assert_non_null(strstr(failed, "\"type\":\"tally.effect.failed.v1\""));
    assert_non_null(strstr(failed, "\"step\":\"03\""));
    assert_non_null(strstr(failed, "\"receipt\":null,\"external_ref\":null,\"error\":{\"code\":"
                                   "\"http_422\",\"message\":\"bad \\\"card\\\"\"}"));

    /* without an id and a time: fresh ones, the same data */
    e.id = NULL;
    e.time = NULL;
    char *fresh = tally_ce_effect_text(&e, id);
    assert_non_null(fresh);
    assert_string_not_equal(id, "0199a0b1-2c3d-7e4f-8a5b-6c7d8e9f0a1b");
    assert_string_equal(strstr(fresh, "\"data\":"), strstr(failed, "\"data\":"));
    free(text);
    free(again);
    free(failed);
    free(fresh);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ce_new_has_every_attribute),
        cmocka_unit_test(test_ce_new_without_subject_and_failures),
        cmocka_unit_test(test_ce_new_round_trips_through_the_parser),
        cmocka_unit_test(test_intent_with_every_field),
        cmocka_unit_test(test_intent_optional_fields_absent_or_null),
        cmocka_unit_test(test_step_integer_and_string),
        cmocka_unit_test(test_intent_required_fields),
        cmocka_unit_test(test_operation_key_and_tenant),
        cmocka_unit_test(test_traceparent),
        cmocka_unit_test(test_compensate_run),
        cmocka_unit_test(test_cancel_run),
        cmocka_unit_test(test_too_large_is_refused_before_parsing),
        cmocka_unit_test(test_invalid_utf8),
        cmocka_unit_test(test_not_json),
        cmocka_unit_test(test_duplicate_keys_refused),
        cmocka_unit_test(test_not_cloudevent),
        cmocka_unit_test(test_unknown_type),
        cmocka_unit_test(test_data_missing_or_not_object),
        cmocka_unit_test(test_reason_names),
        cmocka_unit_test(test_detail_stays_utf8_and_bounded),
        cmocka_unit_test(test_deep_nesting),
        cmocka_unit_test(test_random_and_truncated_inputs_never_crash),
        cmocka_unit_test(test_every_field_at_and_over_its_limit),
        cmocka_unit_test(test_event_id_limit),
        cmocka_unit_test(test_operation_key_with_control_characters_is_invalid),
        cmocka_unit_test(test_numbers_that_would_read_as_zero_are_refused),
        cmocka_unit_test(test_an_oversized_event_is_bounded),
        cmocka_unit_test(test_effect_event_with_given_id_and_time_is_exact),
    };
    return cmocka_run_group_tests_name("cloudevent", tests, NULL, NULL);
}
