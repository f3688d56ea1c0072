/* test_runsummary.c — a run's compensation summary (common/src/runsummary.c, DESIGN §7): the
 * classification of each effect and obligation in both views, the entries the compensator
 * writes when a run settles and the ones `tally summary` computes while it is under way, and
 * the run's outcome. No services. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/runsummary.h"

static json_t *load(const char *text)
{
    json_error_t jerr;
    json_t *v = json_loads(text, 0, &jerr);
    if (v == NULL) {
        fail_msg("bad test JSON: %s (%s)", jerr.text, text);
    }
    return v;
}

/* ---------------------------------------------------------------- the classification */

static tally_runsum_kind_t kind_of(tally_runsum_view_t view, int ob, int effect)
{
    tally_obligation_state_t o = (tally_obligation_state_t)ob;
    tally_effect_state_t e = (tally_effect_state_t)effect;
    return tally_runsum_classify(view, ob >= 0 ? &o : NULL, effect >= 0 ? &e : NULL);
}

static void test_classify_obligations(void **state)
{
    (void)state;
    static const struct {
        tally_obligation_state_t ob;
        tally_runsum_kind_t settled, live;
        tally_runsum_list_t settled_list, live_list;
    } rows[] = {
        {TALLY_OBLIGATION_RESOLVED, TALLY_RUNSUM_REVERSED, TALLY_RUNSUM_REVERSED,
         TALLY_RUNSUM_COMPENSATED, TALLY_RUNSUM_COMPENSATED},
        {TALLY_OBLIGATION_UNCOMPENSATABLE, TALLY_RUNSUM_IRREVERSIBLE, TALLY_RUNSUM_IRREVERSIBLE,
         TALLY_RUNSUM_UNCOMPENSATABLE, TALLY_RUNSUM_UNCOMPENSATABLE},
        {TALLY_OBLIGATION_SKIPPED, TALLY_RUNSUM_NOTHING_TO_UNDO, TALLY_RUNSUM_NOTHING_TO_UNDO,
         TALLY_RUNSUM_SKIPPED, TALLY_RUNSUM_SKIPPED},
        {TALLY_OBLIGATION_CANCELLED, TALLY_RUNSUM_NOTHING_TO_UNDO, TALLY_RUNSUM_NOTHING_TO_UNDO,
         TALLY_RUNSUM_SKIPPED, TALLY_RUNSUM_SKIPPED},
        {TALLY_OBLIGATION_STUCK, TALLY_RUNSUM_OBLIGATION_STUCK, TALLY_RUNSUM_OBLIGATION_STUCK,
         TALLY_RUNSUM_FAILED, TALLY_RUNSUM_FAILED},
        {TALLY_OBLIGATION_PENDING, TALLY_RUNSUM_BLOCKED, TALLY_RUNSUM_UNDER_WAY,
         TALLY_RUNSUM_FAILED, TALLY_RUNSUM_PENDING},
        {TALLY_OBLIGATION_AWAITING_APPROVAL, TALLY_RUNSUM_BLOCKED, TALLY_RUNSUM_UNDER_WAY,
         TALLY_RUNSUM_FAILED, TALLY_RUNSUM_PENDING},
        {TALLY_OBLIGATION_RUNNING, TALLY_RUNSUM_BLOCKED, TALLY_RUNSUM_UNDER_WAY,
         TALLY_RUNSUM_FAILED, TALLY_RUNSUM_PENDING},
    };
    assert_int_equal(sizeof rows / sizeof rows[0], TALLY_OBLIGATION__COUNT);
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        /* an obligation decides, whatever its effect's state */
        for (int e = -1; e < TALLY_EFFECT__COUNT; e++) {
            tally_runsum_kind_t k = kind_of(TALLY_RUNSUM_SETTLED, (int)rows[i].ob, e);
            assert_int_equal(k, rows[i].settled);
            assert_int_equal(tally_runsum_kind_list(k), rows[i].settled_list);
            k = kind_of(TALLY_RUNSUM_LIVE, (int)rows[i].ob, e);
            assert_int_equal(k, rows[i].live);
            assert_int_equal(tally_runsum_kind_list(k), rows[i].live_list);
        }
    }
}

static void test_classify_effects_without_obligation(void **state)
{
    (void)state;
    for (int e = -1; e < TALLY_EFFECT__COUNT; e++) {
        tally_runsum_kind_t settled = kind_of(TALLY_RUNSUM_SETTLED, -1, e);
        tally_runsum_kind_t live = kind_of(TALLY_RUNSUM_LIVE, -1, e);
        switch (e) {
        case TALLY_EFFECT_STUCK:
            assert_int_equal(settled, TALLY_RUNSUM_EFFECT_STUCK);
            assert_int_equal(live, TALLY_RUNSUM_EFFECT_STUCK);
            assert_int_equal(tally_runsum_kind_list(live), TALLY_RUNSUM_FAILED);
            break;
        case TALLY_EFFECT_CONFIRMED:
        case TALLY_EFFECT_DISPATCHING:
        case TALLY_EFFECT_UNKNOWN:
            /* settled: no obligation will come; live: one comes once the run is compensated */
            assert_int_equal(settled, TALLY_RUNSUM_NO_OBLIGATION);
            assert_int_equal(tally_runsum_kind_list(settled), TALLY_RUNSUM_SKIPPED);
            assert_int_equal(live, TALLY_RUNSUM_NO_OBLIGATION_YET);
            assert_int_equal(tally_runsum_kind_list(live), TALLY_RUNSUM_PENDING);
            break;
        default: /* never applied, or never sent, or a state the ledger does not have */
            assert_int_equal(settled, TALLY_RUNSUM_NEVER_APPLIED);
            assert_int_equal(live, TALLY_RUNSUM_NEVER_APPLIED);
            assert_int_equal(tally_runsum_kind_list(live), TALLY_RUNSUM_SKIPPED);
            break;
        }
    }
}

static void test_list_names_and_outcome(void **state)
{
    (void)state;
    static const char *const names[] = {"compensated", "uncompensatable", "skipped", "failed",
                                        "pending"};
    for (int l = 0; l < TALLY_RUNSUM__COUNT; l++) {
        assert_string_equal(tally_runsum_list_name((tally_runsum_list_t)l), names[l]);
    }
    assert_int_equal(tally_runsum_outcome(0, 0), TALLY_RUN_COMPENSATED);
    assert_int_equal(tally_runsum_outcome(0, 2), TALLY_RUN_PARTIALLY_COMPENSATED);
    assert_int_equal(tally_runsum_outcome(1, 2), TALLY_RUN_STUCK);
}

/* ---------------------------------------------------------------- the settled summary */

/* The four-step run of issue 5, compensated: read skipped, two reversed, the email out. */
static const char RUN_ITEMS[] =
    "["
    "{\"effect_id\":\"00000000-0000-0000-0000-000000000004\",\"step\":\"4\",\"step_is_number\":"
    "true,\"tool\":\"create_hold\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":"
    "\"holds_4\"},\"external_ref\":\"holds_4\",\"obligation_id\":"
    "\"10000000-0000-0000-0000-000000000004\",\"obligation_status\":\"RESOLVED\","
    "\"status_reason\":\"http_201: HTTP 201\",\"reverse_receipt\":{\"id\":\"rev_5\"}},"
    "{\"effect_id\":\"00000000-0000-0000-0000-000000000003\",\"step\":\"3\",\"step_is_number\":"
    "true,\"tool\":\"send_email\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":"
    "\"emails_3\"},\"external_ref\":\"emails_3\",\"obligation_id\":"
    "\"10000000-0000-0000-0000-000000000003\",\"obligation_status\":\"UNCOMPENSATABLE\","
    "\"status_reason\":\"append_only: cannot be undone\",\"blast_radius\":{\"tool\":"
    "\"send_email\",\"target\":{\"field\":\"to\",\"value\":\"ann@example.com\"},\"time\":"
    "\"2026-11-22T00:00:01.000Z\"}},"
    "{\"effect_id\":\"00000000-0000-0000-0000-000000000002\",\"step\":\"2\",\"step_is_number\":"
    "true,\"tool\":\"charge_card\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":"
    "\"charges_2\"},\"external_ref\":\"charges_2\",\"obligation_id\":"
    "\"10000000-0000-0000-0000-000000000002\",\"obligation_status\":\"RESOLVED\","
    "\"status_reason\":\"http_201: HTTP 201\",\"reverse_receipt\":{\"id\":\"rev_6\"}},"
    "{\"effect_id\":\"00000000-0000-0000-0000-000000000001\",\"step\":\"1\",\"step_is_number\":"
    "true,\"tool\":\"check_balance\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":"
    "\"balance_checks_1\"},\"external_ref\":\"balance_checks_1\",\"obligation_id\":"
    "\"10000000-0000-0000-0000-000000000001\",\"obligation_status\":\"SKIPPED\","
    "\"status_reason\":\"read_only: a read changed nothing\"}"
    "]";

static json_t *counts_of(const json_t *summary)
{
    return json_object_get(summary, "counts");
}

static json_int_t count(const json_t *summary, const char *list)
{
    json_int_t n = json_integer_value(json_object_get(counts_of(summary), list));
    assert_int_equal((size_t)n, json_array_size(json_object_get(summary, list)));
    return n;
}

static void test_summary_partially_compensated(void **state)
{
    (void)state;
    json_t *items = load(RUN_ITEMS);
    tally_run_state_t status;
    json_t *s = tally_runsum_settled("run-1", "compensate_run: agent gave up", items, &status);
    assert_non_null(s);
    assert_int_equal(status, TALLY_RUN_PARTIALLY_COMPENSATED);
    assert_string_equal(json_string_value(json_object_get(s, "status")), "PARTIALLY_COMPENSATED");
    assert_string_equal(json_string_value(json_object_get(s, "reason")),
                        "compensate_run: agent gave up");
    assert_string_equal(json_string_value(json_object_get(s, "run_id")), "run-1");
    assert_int_equal(count(s, "compensated"), 2);
    assert_int_equal(count(s, "uncompensatable"), 1);
    assert_int_equal(count(s, "skipped"), 1);
    assert_int_equal(count(s, "failed"), 0);

    /* reversed last step first, each with its reverse receipt and an integer step */
    json_t *comp = json_object_get(s, "compensated");
    assert_string_equal(json_string_value(json_object_get(json_array_get(comp, 0), "tool")),
                        "create_hold");
    assert_int_equal(json_integer_value(json_object_get(json_array_get(comp, 0), "step")), 4);
    assert_string_equal(json_string_value(json_object_get(
                            json_object_get(json_array_get(comp, 1), "reverse_receipt"), "id")),
                        "rev_6");
    json_t *un = json_array_get(json_object_get(s, "uncompensatable"), 0);
    json_t *br = json_object_get(un, "blast_radius");
    assert_string_equal(json_string_value(json_object_get(json_object_get(br, "target"), "value")),
                        "ann@example.com");
    assert_non_null(json_string_value(json_object_get(br, "time")));
    json_t *sk = json_array_get(json_object_get(s, "skipped"), 0);
    assert_non_null(strstr(json_string_value(json_object_get(sk, "reason")), "read_only"));
    assert_string_equal(json_string_value(json_object_get(sk, "effect_id")),
                        "00000000-0000-0000-0000-000000000001");
    json_decref(s);
    json_decref(items);
}

static void test_summary_stuck(void **state)
{
    (void)state;
    json_t *items =
        load("[{\"effect_id\":\"e2\",\"step\":\"charge\",\"step_is_number\":false,\"tool\":"
             "\"charge_card\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":\"charges_2\","
             "\"version\":1},\"external_ref\":\"charges_2\",\"obligation_id\":\"o2\","
             "\"obligation_status\":\"STUCK\",\"error_code\":\"stale_state\",\"error_message\":"
             "\"HTTP 412\",\"attempts\":1,\"resolve_command\":\"tally resolve --obligation o2 --as "
             "resolved\",\"runbook\":\"https://wiki/refunds\"},"
             "{\"effect_id\":\"e1\",\"step\":\"hold\",\"step_is_number\":false,\"tool\":"
             "\"create_hold\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":\"holds_1\"},"
             "\"external_ref\":\"holds_1\",\"obligation_id\":\"o1\",\"obligation_status\":"
             "\"PENDING\",\"blocked\":true,\"attempts\":0},"
             "{\"effect_id\":\"e0\",\"step\":\"prep\",\"step_is_number\":false,\"tool\":"
             "\"charge_card\",\"effect_status\":\"FAILED\",\"effect_error\":{\"code\":\"http_422\","
             "\"message\":\"no\"}}]");
    tally_run_state_t status;
    json_t *s = tally_runsum_settled("run-2", NULL, items, &status);
    assert_int_equal(status, TALLY_RUN_STUCK);
    assert_true(json_is_null(json_object_get(s, "reason")));
    assert_int_equal(count(s, "failed"), 2);
    assert_int_equal(count(s, "skipped"), 1);
    json_t *f0 = json_array_get(json_object_get(s, "failed"), 0);
    assert_string_equal(json_string_value(json_object_get(f0, "step")), "charge");
    assert_string_equal(json_string_value(json_object_get(json_object_get(f0, "error"), "code")),
                        "stale_state");
    assert_string_equal(json_string_value(json_object_get(json_object_get(f0, "receipt"), "id")),
                        "charges_2");
    const char *action = json_string_value(json_object_get(f0, "action_required"));
    assert_non_null(strstr(action, "If-Match"));
    assert_non_null(strstr(action, "tally resolve --obligation o2"));
    assert_non_null(strstr(action, "https://wiki/refunds"));
    json_t *f1 = json_array_get(json_object_get(s, "failed"), 1);
    assert_string_equal(json_string_value(json_object_get(json_object_get(f1, "error"), "code")),
                        "blocked");
    json_t *sk = json_array_get(json_object_get(s, "skipped"), 0);
    assert_non_null(strstr(json_string_value(json_object_get(sk, "reason")), "FAILED"));
    json_decref(s);
    json_decref(items);
}

static void test_summary_compensated_and_stuck_effect(void **state)
{
    (void)state;
    json_t *items = load("[{\"effect_id\":\"e1\",\"step\":\"1\",\"step_is_number\":true,"
                         "\"tool\":\"charge_card\",\"effect_status\":\"CONFIRMED\","
                         "\"obligation_id\":\"o1\",\"obligation_status\":\"RESOLVED\","
                         "\"reverse_receipt\":{\"id\":\"rev_1\"}},"
                         "{\"effect_id\":\"e0\",\"step\":\"0\",\"step_is_number\":true,"
                         "\"tool\":\"update_ledger\",\"effect_status\":\"CONFIRMED\","
                         "\"obligation_id\":\"o0\",\"obligation_status\":\"SKIPPED\","
                         "\"status_reason\":\"idempotent\"}]");
    tally_run_state_t status;
    json_t *s = tally_runsum_settled("run-3", "compensate_run", items, &status);
    assert_int_equal(status, TALLY_RUN_COMPENSATED);
    assert_int_equal(count(s, "compensated"), 1);
    assert_int_equal(count(s, "skipped"), 1);
    json_decref(s);
    json_decref(items);

    /* an effect STUCK upstream-unknown: the run cannot be called compensated */
    items = load("[{\"effect_id\":\"e9\",\"step\":\"9\",\"step_is_number\":true,\"tool\":"
                 "\"charge_card\",\"effect_status\":\"STUCK\",\"effect_error\":{\"code\":"
                 "\"status_inconclusive\",\"message\":\"status checks failed\"}}]");
    s = tally_runsum_settled("run-4", NULL, items, &status);
    assert_int_equal(status, TALLY_RUN_STUCK);
    json_t *f = json_array_get(json_object_get(s, "failed"), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(f, "error"), "code")),
                        "status_inconclusive");
    assert_non_null(strstr(json_string_value(json_object_get(f, "action_required")),
                           "tally resolve --effect e9"));
    json_decref(s);
    json_decref(items);

    /* no effects at all: nothing to undo */
    items = json_array();
    s = tally_runsum_settled("run-5", NULL, items, &status);
    assert_int_equal(status, TALLY_RUN_COMPENSATED);
    assert_int_equal(count(s, "compensated") + count(s, "skipped"), 0);
    json_decref(s);
    json_decref(items);
}

/* ---------------------------------------------------------------- the live view */

/* The LIVE view of @p items into five fresh lists. */
static void sort_live(const json_t *items, json_t *lists[TALLY_RUNSUM__COUNT])
{
    for (int l = 0; l < TALLY_RUNSUM__COUNT; l++) {
        lists[l] = json_array();
    }
    assert_true(tally_runsum_sort(TALLY_RUNSUM_LIVE, items, lists));
}

static void free_lists(json_t *lists[TALLY_RUNSUM__COUNT])
{
    for (int l = 0; l < TALLY_RUNSUM__COUNT; l++) {
        json_decref(lists[l]);
    }
}

static const char *field(const json_t *list, size_t i, const char *key)
{
    return json_string_value(json_object_get(json_array_get(list, i), key));
}

static void test_live_view_of_a_run_under_way(void **state)
{
    (void)state;
    json_t *items =
        load("[{\"effect_id\":\"e4\",\"step\":\"4\",\"step_is_number\":true,\"tool\":"
             "\"create_hold\",\"effect_status\":\"CONFIRMED\",\"obligation_id\":\"o4\","
             "\"obligation_status\":\"RUNNING\",\"status_reason\":null,\"attempts\":1},"
             "{\"effect_id\":\"e3\",\"step\":\"3\",\"step_is_number\":true,\"tool\":"
             "\"charge_card\",\"effect_status\":\"CONFIRMED\",\"receipt\":{\"id\":\"ch_3\"},"
             "\"obligation_id\":\"o3\",\"obligation_status\":\"STUCK\",\"error_code\":"
             "\"stale_state\",\"error_message\":\"HTTP 412\",\"attempts\":1},"
             "{\"effect_id\":\"e2\",\"step\":\"2\",\"step_is_number\":true,\"tool\":"
             "\"charge_card\",\"effect_status\":\"UNKNOWN\"},"
             "{\"effect_id\":\"e1\",\"step\":\"1\",\"step_is_number\":true,\"tool\":"
             "\"charge_card\",\"effect_status\":\"STUCK\",\"effect_error\":null},"
             "{\"effect_id\":\"e0\",\"step\":\"0\",\"step_is_number\":true,\"tool\":"
             "\"charge_card\",\"effect_status\":\"PLANNED\"}]");
    json_t *lists[TALLY_RUNSUM__COUNT];
    sort_live(items, lists);
    json_t *pending = lists[TALLY_RUNSUM_PENDING], *failed = lists[TALLY_RUNSUM_FAILED];
    assert_int_equal(json_array_size(pending), 2);
    assert_int_equal(json_array_size(failed), 2);
    assert_int_equal(json_array_size(lists[TALLY_RUNSUM_SKIPPED]), 1);

    /* under way: its state and attempts, last step first */
    assert_string_equal(field(pending, 0, "obligation_id"), "o4");
    assert_string_equal(field(pending, 0, "status"), "RUNNING");
    assert_int_equal(json_integer_value(json_object_get(json_array_get(pending, 0), "attempts")),
                     1);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(pending, 0), "step")), 4);
    /* in flight without an obligation: one comes once it is confirmed */
    assert_string_equal(field(pending, 1, "status"), "UNKNOWN");
    assert_non_null(strstr(field(pending, 1, "reason"), "and the effect confirmed"));

    /* STUCK obligation: the error, the original receipt, the commands to copy */
    assert_string_equal(field(failed, 0, "status"), "STUCK");
    json_t *err = json_object_get(json_array_get(failed, 0), "error");
    assert_string_equal(json_string_value(json_object_get(err, "code")), "stale_state");
    assert_string_equal(json_string_value(json_object_get(
                            json_object_get(json_array_get(failed, 0), "receipt"), "id")),
                        "ch_3");
    const char *action = field(failed, 0, "action_required");
    assert_non_null(strstr(action, "\ntally resolve --obligation o3 --as resolved"));
    /* STUCK effect: settle it first from upstream evidence */
    err = json_object_get(json_array_get(failed, 1), "error");
    assert_string_equal(json_string_value(json_object_get(err, "code")), "effect_stuck");
    assert_non_null(strstr(field(failed, 1, "action_required"), "tally resolve --effect e1"));

    assert_string_equal(field(lists[TALLY_RUNSUM_SKIPPED], 0, "reason"),
                        "the effect has not been dispatched (PLANNED)");
    free_lists(lists);
    json_decref(items);
}

/* The same item reads differently once the run settled: what is not terminal is held. */
static void test_views_differ_only_where_the_run_is_unfinished(void **state)
{
    (void)state;
    json_t *items = load("[{\"effect_id\":\"e1\",\"step\":\"hold\",\"step_is_number\":false,"
                         "\"tool\":\"create_hold\",\"effect_status\":\"CONFIRMED\","
                         "\"obligation_id\":\"o1\",\"obligation_status\":\"PENDING\","
                         "\"attempts\":0},"
                         "{\"effect_id\":\"e0\",\"step\":\"0\",\"step_is_number\":true,"
                         "\"tool\":\"check_balance\",\"effect_status\":\"CONFIRMED\","
                         "\"obligation_id\":\"o0\",\"obligation_status\":\"SKIPPED\","
                         "\"status_reason\":\"read_only: nothing to undo\"}]");
    json_t *lists[TALLY_RUNSUM__COUNT];
    sort_live(items, lists);
    assert_string_equal(field(lists[TALLY_RUNSUM_PENDING], 0, "step"), "hold");
    tally_runsum_list_t list;
    json_t *settled = tally_runsum_entry(TALLY_RUNSUM_SETTLED, json_array_get(items, 0), &list);
    assert_int_equal(list, TALLY_RUNSUM_FAILED);
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(settled, "error"), "code")), "blocked");
    json_decref(settled);
    /* a settled item reads the same in both */
    json_t *a = tally_runsum_entry(TALLY_RUNSUM_SETTLED, json_array_get(items, 1), &list);
    assert_int_equal(list, TALLY_RUNSUM_SKIPPED);
    assert_true(json_equal(a, json_array_get(lists[TALLY_RUNSUM_SKIPPED], 0)));
    assert_string_equal(json_string_value(json_object_get(a, "reason")),
                        "read_only: nothing to undo");
    json_decref(a);
    free_lists(lists);
    json_decref(items);
}

/* A run no compensation was asked for, after a DUPLICATE: the extra copy was reversed on its
 * own obligation; the kept record stands, done and not compensated; nothing is in progress. */
static void test_uncompensated_run_after_a_duplicate(void **state)
{
    (void)state;
    json_t *items = load("[{\"effect_id\":\"e1\",\"step\":\"1\",\"step_is_number\":true,"
                         "\"tool\":\"charge_card\",\"effect_status\":\"CONFIRMED\","
                         "\"external_ref\":\"ch_1\",\"kept_ref\":\"ch_1\"},"
                         "{\"effect_id\":\"e1\",\"step\":\"1\",\"step_is_number\":true,"
                         "\"tool\":\"charge_card\",\"effect_status\":\"CONFIRMED\","
                         "\"external_ref\":\"ch_2\",\"kept_ref\":\"ch_1\","
                         "\"obligation_id\":\"o1\",\"obligation_status\":\"RESOLVED\","
                         "\"obligation_reason\":\"duplicate\",\"reverse_receipt\":{\"id\":"
                         "\"rev_1\"}}]");
    json_t *lists[TALLY_RUNSUM__ALL];
    for (int l = 0; l < TALLY_RUNSUM__ALL; l++) {
        lists[l] = json_array();
    }
    assert_true(tally_runsum_sort_all(TALLY_RUNSUM_UNCOMPENSATED, items, lists));
    assert_int_equal(json_array_size(lists[TALLY_RUNSUM_COMPENSATED]), 0);
    assert_int_equal(json_array_size(lists[TALLY_RUNSUM_PENDING]), 0);
    json_t *done = lists[TALLY_RUNSUM_DONE], *copies = lists[TALLY_RUNSUM_DUPLICATES];
    assert_int_equal(json_array_size(done), 1);
    assert_string_equal(field(done, 0, "external_ref"), "ch_1");
    assert_string_equal(field(done, 0, "status"), "CONFIRMED");
    assert_non_null(strstr(field(done, 0, "reason"), "not compensated"));
    assert_int_equal(json_array_size(copies), 1);
    assert_string_equal(field(copies, 0, "external_ref"), "ch_2");
    assert_true(json_is_true(json_object_get(json_array_get(copies, 0), "duplicate_copy")));
    assert_non_null(strstr(field(copies, 0, "reason"), "this extra copy was reversed; the kept "
                                                       "record ch_1 still stands"));
    for (int l = 0; l < TALLY_RUNSUM__ALL; l++) {
        json_decref(lists[l]);
    }
    assert_string_equal(tally_runsum_list_name(TALLY_RUNSUM_DONE), "done");
    assert_string_equal(tally_runsum_list_name(TALLY_RUNSUM_DUPLICATES), "duplicates");

    /* the compensator's summary keeps its four lists: the copy counts as compensated, marked */
    tally_run_state_t status;
    json_t *s = tally_runsum_settled("run-d", NULL, items, &status);
    json_t *c = json_object_get(s, "compensated");
    assert_int_equal(json_array_size(c), 1);
    assert_true(json_is_true(json_object_get(json_array_get(c, 0), "duplicate_copy")));
    assert_null(json_object_get(s, "duplicates"));
    json_decref(s);
    json_decref(items);
}

/* A read (or idempotent call) held behind a STUCK later step needs nobody: skipped, not failed;
 * a reversible step held the same way still waits for the human. */
static void test_blocked_read_is_skipped_not_failed(void **state)
{
    (void)state;
    json_t *items = load("[{\"effect_id\":\"e2\",\"step\":\"2\",\"step_is_number\":true,"
                         "\"tool\":\"charge_card\",\"effect_class\":\"reversible\","
                         "\"effect_status\":\"CONFIRMED\",\"obligation_id\":\"o2\","
                         "\"obligation_status\":\"STUCK\",\"error_code\":\"attempts_exhausted\"},"
                         "{\"effect_id\":\"e1\",\"step\":\"1\",\"step_is_number\":true,"
                         "\"tool\":\"check_balance\",\"effect_class\":\"read\","
                         "\"effect_status\":\"CONFIRMED\",\"obligation_id\":\"o1\","
                         "\"obligation_status\":\"PENDING\"},"
                         "{\"effect_id\":\"e0\",\"step\":\"0\",\"step_is_number\":true,"
                         "\"tool\":\"create_hold\",\"effect_class\":\"reversible\","
                         "\"effect_status\":\"CONFIRMED\",\"obligation_id\":\"o0\","
                         "\"obligation_status\":\"PENDING\"}]");
    tally_run_state_t status;
    json_t *s = tally_runsum_settled("run-b", NULL, items, &status);
    assert_int_equal(status, TALLY_RUN_STUCK);
    json_t *failed = json_object_get(s, "failed"), *skipped = json_object_get(s, "skipped");
    assert_int_equal(json_array_size(failed), 2);
    assert_string_equal(field(failed, 0, "effect_id"), "e2");
    assert_string_equal(field(failed, 1, "effect_id"), "e0"); /* reversible: still held */
    assert_int_equal(json_array_size(skipped), 1);
    assert_string_equal(field(skipped, 0, "effect_id"), "e1");
    assert_non_null(strstr(field(skipped, 0, "reason"), "nothing to undo (read)"));
    json_decref(s);
    json_decref(items);
}

/* An uncompensatable step's reason ends with its containment action's result, as recorded. */
static void test_uncompensatable_says_what_its_containment_did(void **state)
{
    (void)state;
    static const struct {
        const char *blast_radius, *ends_with;
    } cases[] = {
        {"{\"containment\":{\"status\":\"done\",\"http_status\":202}}",
         "; the containment action: done (HTTP 202)"},
        {"{\"containment\":{\"status\":\"failed\",\"code\":\"attempts_exhausted\","
         "\"message\":\"not confirmed\"}}",
         "; the containment action: failed: attempts_exhausted: not confirmed"},
        {"{}", "; the containment action: no result recorded"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[1024];
        snprintf(text, sizeof text,
                 "{\"effect_id\":\"e3\",\"step\":\"3\",\"tool\":\"send_email\","
                 "\"effect_status\":\"CONFIRMED\",\"obligation_id\":\"o3\","
                 "\"obligation_status\":\"UNCOMPENSATABLE\",\"status_reason\":\"append_only: "
                 "the blast radius is recorded and its containment action is POST /c\","
                 "\"blast_radius\":%s}",
                 cases[i].blast_radius);
        json_t *item = load(text);
        tally_runsum_list_t list;
        json_t *e = tally_runsum_entry(TALLY_RUNSUM_SETTLED, item, &list);
        assert_int_equal(list, TALLY_RUNSUM_UNCOMPENSATABLE);
        const char *reason = json_string_value(json_object_get(e, "reason"));
        assert_non_null(strstr(reason, "its containment action is POST /c"));
        size_t n = strlen(reason), m = strlen(cases[i].ends_with);
        assert_true(n >= m);
        assert_string_equal(reason + n - m, cases[i].ends_with);
        json_decref(e);
        json_decref(item);
    }
    /* no containment action declared: nothing to report */
    json_t *item = load("{\"effect_id\":\"e3\",\"obligation_id\":\"o3\","
                        "\"obligation_status\":\"UNCOMPENSATABLE\",\"status_reason\":"
                        "\"append_only: declares no containment action\",\"blast_radius\":{}}");
    tally_runsum_list_t list;
    json_t *e = tally_runsum_entry(TALLY_RUNSUM_SETTLED, item, &list);
    assert_string_equal(json_string_value(json_object_get(e, "reason")),
                        "append_only: declares no containment action");
    json_decref(e);
    json_decref(item);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_classify_obligations),
        cmocka_unit_test(test_classify_effects_without_obligation),
        cmocka_unit_test(test_list_names_and_outcome),
        cmocka_unit_test(test_summary_partially_compensated),
        cmocka_unit_test(test_summary_stuck),
        cmocka_unit_test(test_summary_compensated_and_stuck_effect),
        cmocka_unit_test(test_live_view_of_a_run_under_way),
        cmocka_unit_test(test_views_differ_only_where_the_run_is_unfinished),
        cmocka_unit_test(test_uncompensated_run_after_a_duplicate),
        cmocka_unit_test(test_blocked_read_is_skipped_not_failed),
        cmocka_unit_test(test_uncompensatable_says_what_its_containment_did),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
