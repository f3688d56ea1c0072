/* test_ledger.c — the generated state machines (schemas/machines.json) against DESIGN §3. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "tally/ledger.h"

#define E(s) TALLY_EFFECT_##s
#define O(s) TALLY_OBLIGATION_##s

static bool known_actor(const char *by)
{
    return strcmp(by, "dispatcher") == 0 || strcmp(by, "reconciler") == 0 ||
           strcmp(by, "compensator") == 0 || strcmp(by, "operator") == 0;
}

static void test_effect_names_round_trip(void **state)
{
    (void)state;
    for (int s = 0; s < TALLY_EFFECT__COUNT; s++) {
        const char *name = tally_effect_state_name((tally_effect_state_t)s);
        tally_effect_state_t back;
        assert_true(tally_effect_state_parse(name, &back));
        assert_int_equal(back, s);
    }
    assert_string_equal(tally_effect_state_name(E(AWAITING_APPROVAL)), "AWAITING_APPROVAL");
    assert_string_equal(tally_effect_state_name(E(UNKNOWN)), "UNKNOWN");
    assert_string_equal(tally_effect_state_name(TALLY_EFFECT__COUNT), "INVALID");

    tally_effect_state_t out = E(PLANNED);
    assert_false(tally_effect_state_parse("planned", &out)); /* the columns are upper case */
    assert_false(tally_effect_state_parse("", &out));
    assert_false(tally_effect_state_parse("PLANNED ", &out));
    assert_false(tally_effect_state_parse(NULL, &out));
    assert_false(tally_effect_state_parse("RUNNING", &out)); /* an obligation state */
}

static void test_obligation_names_round_trip(void **state)
{
    (void)state;
    for (int s = 0; s < TALLY_OBLIGATION__COUNT; s++) {
        const char *name = tally_obligation_state_name((tally_obligation_state_t)s);
        tally_obligation_state_t back;
        assert_true(tally_obligation_state_parse(name, &back));
        assert_int_equal(back, s);
    }
    assert_string_equal(tally_obligation_state_name(O(UNCOMPENSATABLE)), "UNCOMPENSATABLE");
    tally_obligation_state_t out;
    assert_false(tally_obligation_state_parse("DISPATCHING", &out));
    assert_false(tally_obligation_state_parse("resolved", &out));
}

/* Every row of a table names real states (from -1: a creation), a real actor, a reason, and
 * is allowed. */
static void check_table(const tally_transition_t *t, int count, const char *(*name)(int),
                        bool (*allowed)(int, int))
{
    size_t rows = 0;
    for (; t->by != NULL; t++, rows++) {
        if (t->from == -1) {
            assert_in_range(t->to, 0, count - 1);
            assert_true(known_actor(t->by));
            assert_true(allowed(-1, t->to));
            continue;
        }
        assert_in_range(t->from, 0, count - 1);
        assert_in_range(t->to, 0, count - 1);
        assert_true(known_actor(t->by));
        assert_non_null(t->why);
        assert_true(strlen(t->why) > 0);
        assert_string_not_equal(name(t->from), "INVALID");
        assert_true(allowed(t->from, t->to));
    }
    assert_int_equal(t->from, -1);
    assert_int_equal(t->to, -1);
    assert_null(t->why);
    assert_true(rows > 0);
}

static const char *effect_name(int s)
{
    return tally_effect_state_name((tally_effect_state_t)s);
}
static bool effect_allowed(int a, int b)
{
    if (a == -1)
        return tally_effect_creation_allowed((tally_effect_state_t)b);
    return tally_effect_transition_allowed((tally_effect_state_t)a, (tally_effect_state_t)b);
}
static const char *obligation_name(int s)
{
    return tally_obligation_state_name((tally_obligation_state_t)s);
}
static bool obligation_allowed(int a, int b)
{
    if (a == -1)
        return tally_obligation_creation_allowed((tally_obligation_state_t)b);
    return tally_obligation_transition_allowed((tally_obligation_state_t)a,
                                               (tally_obligation_state_t)b);
}

static void test_table_rows_are_well_formed(void **state)
{
    (void)state;
    check_table(tally_effect_transitions, TALLY_EFFECT__COUNT, effect_name, effect_allowed);
    check_table(tally_obligation_transitions, TALLY_OBLIGATION__COUNT, obligation_name,
                obligation_allowed);
}

/* The full matrix, written out independently of ledger.c from DESIGN §3: exactly these
 * moves exist, no more. */
static void test_effect_matrix_is_exactly_the_design(void **state)
{
    (void)state;
    static const int expected[][2] = {
        {E(AWAITING_APPROVAL), E(PLANNED)},
        {E(AWAITING_APPROVAL), E(REJECTED)},
        {E(AWAITING_APPROVAL), E(CANCELLED)},
        {E(PLANNED), E(DISPATCHING)},
        {E(PLANNED), E(CANCELLED)},
        {E(DISPATCHING), E(CONFIRMED)},
        {E(DISPATCHING), E(FAILED)},
        {E(DISPATCHING), E(PLANNED)},
        {E(DISPATCHING), E(UNKNOWN)},
        {E(DISPATCHING), E(CANCELLED)}, /* the run stopped meanwhile; not applied */
        {E(UNKNOWN), E(CONFIRMED)},
        {E(UNKNOWN), E(PLANNED)},
        {E(UNKNOWN), E(CANCELLED)}, /* found nothing, and its run stopped meanwhile */
        {E(UNKNOWN), E(STUCK)},
        {E(UNKNOWN), E(FAILED)},
        {E(STUCK), E(CONFIRMED)},
        {E(STUCK), E(FAILED)},
    };
    bool want[TALLY_EFFECT__COUNT][TALLY_EFFECT__COUNT] = {{false}};
    for (size_t i = 0; i < sizeof expected / sizeof expected[0]; i++)
        want[expected[i][0]][expected[i][1]] = true;
    for (int a = 0; a < TALLY_EFFECT__COUNT; a++) {
        for (int b = 0; b < TALLY_EFFECT__COUNT; b++) {
            if (effect_allowed(a, b) != want[a][b])
                fail_msg("effect %s -> %s: allowed=%d, DESIGN says %d", effect_name(a),
                         effect_name(b), effect_allowed(a, b), want[a][b]);
        }
    }
}

static void test_obligation_matrix_is_exactly_the_design(void **state)
{
    (void)state;
    static const int expected[][2] = {
        {O(PENDING), O(RUNNING)},
        {O(PENDING), O(AWAITING_APPROVAL)},
        {O(PENDING), O(STUCK)},
        {O(PENDING), O(CANCELLED)},
        {O(RUNNING), O(RUNNING)},
        {O(RUNNING), O(PENDING)},
        {O(RUNNING), O(RESOLVED)},
        {O(RUNNING), O(SKIPPED)},
        {O(RUNNING), O(UNCOMPENSATABLE)},
        {O(RUNNING), O(STUCK)},
        {O(AWAITING_APPROVAL), O(PENDING)},
        {O(AWAITING_APPROVAL), O(SKIPPED)},
        {O(STUCK), O(RESOLVED)},
        {O(STUCK), O(SKIPPED)},
    };
    bool want[TALLY_OBLIGATION__COUNT][TALLY_OBLIGATION__COUNT] = {{false}};
    for (size_t i = 0; i < sizeof expected / sizeof expected[0]; i++)
        want[expected[i][0]][expected[i][1]] = true;
    for (int a = 0; a < TALLY_OBLIGATION__COUNT; a++) {
        for (int b = 0; b < TALLY_OBLIGATION__COUNT; b++) {
            if (obligation_allowed(a, b) != want[a][b])
                fail_msg("obligation %s -> %s: allowed=%d, DESIGN says %d", obligation_name(a),
                         obligation_name(b), obligation_allowed(a, b), want[a][b]);
        }
    }
}

typedef struct move {
    int from, to;
    const char *by;
} move_t;

/* Each (from, to, actor) of @p want appears in @p table exactly once, and nothing else does. */
static void check_actors(const tally_transition_t *table, const move_t *want, size_t n,
                         const char *(*name)(int))
{
    size_t rows = 0;
    for (const tally_transition_t *t = table; t->by; t++, rows++) {
        size_t found = 0;
        for (size_t i = 0; i < n; i++)
            found +=
                want[i].from == t->from && want[i].to == t->to && strcmp(want[i].by, t->by) == 0;
        if (found != 1)
            fail_msg("row %s -> %s by %s is not in DESIGN §3", name(t->from), name(t->to), t->by);
    }
    for (size_t i = 0; i < n; i++) {
        size_t found = 0;
        for (const tally_transition_t *t = table; t->by; t++)
            found +=
                want[i].from == t->from && want[i].to == t->to && strcmp(want[i].by, t->by) == 0;
        if (found != 1)
            fail_msg("%s -> %s by %s appears %zu times, want once", name(want[i].from),
                     name(want[i].to), want[i].by, found);
    }
    assert_int_equal(rows, n);
}

static void test_effect_actors(void **state)
{
    (void)state;
    static const move_t want[] = {
        {-1, E(PLANNED), "dispatcher"},
        {-1, E(AWAITING_APPROVAL), "dispatcher"},
        {-1, E(DISPATCHING), "dispatcher"}, /* created and claimed in one statement */
        {-1, E(CANCELLED), "dispatcher"},   /* its run is compensating or cancelled */
        {E(DISPATCHING), E(CANCELLED), "dispatcher"},
        {E(AWAITING_APPROVAL), E(PLANNED), "operator"},
        {E(AWAITING_APPROVAL), E(REJECTED), "operator"},
        {E(PLANNED), E(DISPATCHING), "dispatcher"},
        {E(DISPATCHING), E(CONFIRMED), "dispatcher"},
        {E(DISPATCHING), E(FAILED), "dispatcher"},
        {E(DISPATCHING), E(PLANNED), "dispatcher"},
        {E(DISPATCHING), E(UNKNOWN), "dispatcher"},
        {E(DISPATCHING), E(UNKNOWN), "reconciler"}, /* lease expired */
        {E(UNKNOWN), E(CONFIRMED), "reconciler"},
        {E(UNKNOWN), E(PLANNED), "reconciler"},
        {E(UNKNOWN), E(CANCELLED), "reconciler"},
        {E(UNKNOWN), E(STUCK), "reconciler"},
        {E(PLANNED), E(CANCELLED), "dispatcher"},
        {E(PLANNED), E(CANCELLED), "operator"},
        {E(AWAITING_APPROVAL), E(CANCELLED), "dispatcher"},
        {E(AWAITING_APPROVAL), E(CANCELLED), "operator"},
        {E(UNKNOWN), E(CONFIRMED), "operator"},
        {E(UNKNOWN), E(FAILED), "operator"},
        {E(STUCK), E(CONFIRMED), "operator"},
        {E(STUCK), E(FAILED), "operator"},
    };
    check_actors(tally_effect_transitions, want, sizeof want / sizeof want[0], effect_name);
}

static void test_obligation_actors(void **state)
{
    (void)state;
    static const move_t want[] = {
        {-1, O(PENDING), "reconciler"}, /* a duplicate */
        {-1, O(PENDING), "dispatcher"}, /* compensate_run, cancel_run */
        {-1, O(PENDING), "operator"},
        {O(PENDING), O(RUNNING), "compensator"},
        {O(RUNNING), O(RUNNING), "compensator"},
        {O(RUNNING), O(PENDING), "compensator"},
        {O(RUNNING), O(RESOLVED), "compensator"},
        {O(RUNNING), O(SKIPPED), "compensator"},
        {O(RUNNING), O(UNCOMPENSATABLE), "compensator"},
        {O(RUNNING), O(STUCK), "compensator"},
        {O(PENDING), O(AWAITING_APPROVAL), "compensator"},
        {O(PENDING), O(STUCK), "compensator"},
        {O(PENDING), O(CANCELLED), "compensator"},
        {O(AWAITING_APPROVAL), O(PENDING), "operator"},
        {O(AWAITING_APPROVAL), O(SKIPPED), "operator"},
        {O(STUCK), O(RESOLVED), "operator"},
        {O(STUCK), O(SKIPPED), "operator"},
    };
    check_actors(tally_obligation_transitions, want, sizeof want / sizeof want[0], obligation_name);
}

static void test_forbidden_effect_moves(void **state)
{
    (void)state;
    assert_false(tally_effect_transition_allowed(E(CONFIRMED), E(PLANNED)));
    /* rule 2: UNKNOWN is never retried blindly */
    assert_false(tally_effect_transition_allowed(E(UNKNOWN), E(DISPATCHING)));
    assert_false(
        tally_effect_transition_allowed(E(PLANNED), E(CONFIRMED))); /* no call, no receipt */
    assert_false(tally_effect_transition_allowed(E(AWAITING_APPROVAL), E(DISPATCHING)));
    assert_false(tally_effect_transition_allowed(E(FAILED), E(PLANNED)));
    assert_false(tally_effect_transition_allowed(E(REJECTED), E(PLANNED)));
    assert_false(tally_effect_transition_allowed(E(CANCELLED), E(PLANNED)));
    assert_false(tally_effect_transition_allowed(E(STUCK), E(PLANNED)));
    assert_false(tally_effect_transition_allowed(E(DISPATCHING), E(DISPATCHING)));
    /* a row is never created past the point a call would have made */
    assert_false(tally_effect_creation_allowed(E(CONFIRMED)));
    assert_false(tally_effect_creation_allowed(E(UNKNOWN)));
    assert_false(tally_effect_creation_allowed(E(FAILED)));
    assert_false(tally_effect_transition_allowed(E(CONFIRMED), E(FAILED)));
}

static void test_forbidden_obligation_moves(void **state)
{
    (void)state;
    assert_false(tally_obligation_transition_allowed(O(RESOLVED), O(PENDING)));
    assert_false(tally_obligation_transition_allowed(O(PENDING), O(RESOLVED))); /* not run */
    assert_false(tally_obligation_transition_allowed(O(STUCK), O(PENDING)));
    assert_false(tally_obligation_transition_allowed(O(STUCK), O(RUNNING)));
    assert_false(tally_obligation_transition_allowed(O(AWAITING_APPROVAL), O(RUNNING)));
    assert_false(tally_obligation_transition_allowed(O(UNCOMPENSATABLE), O(RESOLVED)));
    assert_false(tally_obligation_transition_allowed(O(CANCELLED), O(PENDING)));
    assert_false(tally_obligation_creation_allowed(O(RUNNING)));
    assert_false(tally_obligation_creation_allowed(O(RESOLVED)));
}

static void test_terminal_sets(void **state)
{
    (void)state;
    bool eterm[TALLY_EFFECT__COUNT] = {false};
    eterm[E(CONFIRMED)] = eterm[E(FAILED)] = eterm[E(REJECTED)] = eterm[E(CANCELLED)] = true;
    for (int s = 0; s < TALLY_EFFECT__COUNT; s++)
        assert_int_equal(tally_effect_state_terminal((tally_effect_state_t)s), eterm[s]);

    bool oterm[TALLY_OBLIGATION__COUNT] = {false};
    oterm[O(RESOLVED)] = oterm[O(SKIPPED)] = oterm[O(UNCOMPENSATABLE)] = oterm[O(CANCELLED)] = true;
    for (int s = 0; s < TALLY_OBLIGATION__COUNT; s++)
        assert_int_equal(tally_obligation_state_terminal((tally_obligation_state_t)s), oterm[s]);
}

/* Nothing leaves a terminal state; STUCK is left only by an operator; UNKNOWN is moved only
 * from upstream evidence (reconciler) or by an operator, never by the dispatcher. */
static void test_who_may_move_what(void **state)
{
    (void)state;
    for (const tally_transition_t *t = tally_effect_transitions; t->by; t++) {
        if (t->from == -1)
            continue;
        assert_false(tally_effect_state_terminal((tally_effect_state_t)t->from));
        if (t->from == E(STUCK))
            assert_string_equal(t->by, "operator");
        if (t->from == E(UNKNOWN))
            assert_string_not_equal(t->by, "dispatcher");
        if (t->from == E(AWAITING_APPROVAL) && t->to != E(CANCELLED))
            assert_string_equal(t->by, "operator");
    }
    for (const tally_transition_t *t = tally_obligation_transitions; t->by; t++) {
        if (t->from == -1)
            continue;
        assert_false(tally_obligation_state_terminal((tally_obligation_state_t)t->from));
        if (t->from == O(STUCK) || t->from == O(AWAITING_APPROVAL))
            assert_string_equal(t->by, "operator");
    }
}

/* Every state can be reached from where rows start (PLANNED or AWAITING_APPROVAL for an
 * effect, PENDING for an obligation), and every non-terminal state has a way out. */
static void reachability(int count, const int *starts, size_t nstarts, bool (*allowed)(int, int),
                         bool (*terminal)(int), const char *(*name)(int))
{
    bool seen[16] = {false};
    for (size_t i = 0; i < nstarts; i++)
        seen[starts[i]] = true;
    for (bool grew = true; grew;) {
        grew = false;
        for (int a = 0; a < count; a++) {
            for (int b = 0; b < count; b++) {
                if (seen[a] && !seen[b] && allowed(a, b))
                    seen[b] = grew = true;
            }
        }
    }
    for (int s = 0; s < count; s++) {
        if (!seen[s])
            fail_msg("%s cannot be reached", name(s));
        bool way_out = false;
        for (int b = 0; b < count; b++)
            way_out = way_out || (b != s && allowed(s, b));
        if (!terminal(s) && !way_out)
            fail_msg("%s is not terminal but has no way out", name(s));
    }
}

static bool effect_terminal(int s)
{
    return tally_effect_state_terminal((tally_effect_state_t)s);
}
static bool obligation_terminal(int s)
{
    return tally_obligation_state_terminal((tally_obligation_state_t)s);
}

static const char *run_name(int s)
{
    return tally_run_state_name((tally_run_state_t)s);
}
static bool run_allowed(int a, int b)
{
    if (a == -1)
        return tally_run_creation_allowed((tally_run_state_t)b);
    return tally_run_transition_allowed((tally_run_state_t)a, (tally_run_state_t)b);
}
static bool run_terminal(int s)
{
    return tally_run_state_terminal((tally_run_state_t)s);
}
static const char *alert_name(int s)
{
    return tally_alert_state_name((tally_alert_state_t)s);
}
static bool alert_allowed(int a, int b)
{
    if (a == -1)
        return tally_alert_creation_allowed((tally_alert_state_t)b);
    return tally_alert_transition_allowed((tally_alert_state_t)a, (tally_alert_state_t)b);
}
static bool alert_terminal(int s)
{
    return tally_alert_state_terminal((tally_alert_state_t)s);
}

/* Where rows start: the targets of the table's creation rows. */
static size_t starts_of(const tally_transition_t *t, int *starts, size_t cap)
{
    size_t n = 0;
    for (; t->by != NULL; t++) {
        if (t->from == -1 && n < cap)
            starts[n++] = t->to;
    }
    assert_true(n > 0);
    return n;
}

static void test_reachability(void **state)
{
    (void)state;
    int starts[32];
    size_t n = starts_of(tally_effect_transitions, starts, 32);
    reachability(TALLY_EFFECT__COUNT, starts, n, effect_allowed, effect_terminal, effect_name);
    n = starts_of(tally_obligation_transitions, starts, 32);
    reachability(TALLY_OBLIGATION__COUNT, starts, n, obligation_allowed, obligation_terminal,
                 obligation_name);
    n = starts_of(tally_run_transitions, starts, 32);
    reachability(TALLY_RUN__COUNT, starts, n, run_allowed, run_terminal, run_name);
    n = starts_of(tally_alert_transitions, starts, 32);
    reachability(TALLY_ALERT__COUNT, starts, n, alert_allowed, alert_terminal, alert_name);
}

/* Runs (DESIGN §3 and §12): ACTIVE -> COMPLETING -> COMPLETED, the compensation states, and
 * CANCELLED; a run is created ACTIVE only, and nothing but compensation reopens a settled one. */
static void test_run_and_alert_machines(void **state)
{
    (void)state;
    check_table(tally_run_transitions, TALLY_RUN__COUNT, run_name, run_allowed);
    check_table(tally_alert_transitions, TALLY_ALERT__COUNT, alert_name, alert_allowed);
    assert_true(tally_run_creation_allowed(TALLY_RUN_ACTIVE));
    for (int s = 1; s < TALLY_RUN__COUNT; s++)
        assert_false(tally_run_creation_allowed((tally_run_state_t)s));
    assert_true(tally_run_transition_allowed(TALLY_RUN_ACTIVE, TALLY_RUN_COMPLETING));
    assert_true(tally_run_transition_allowed(TALLY_RUN_COMPLETING, TALLY_RUN_COMPLETED));
    assert_true(tally_run_transition_allowed(TALLY_RUN_ACTIVE, TALLY_RUN_COMPENSATING));
    assert_true(tally_run_transition_allowed(TALLY_RUN_COMPENSATING, TALLY_RUN_COMPENSATED));
    assert_false(tally_run_transition_allowed(TALLY_RUN_COMPLETED, TALLY_RUN_ACTIVE));
    assert_false(tally_run_transition_allowed(TALLY_RUN_CANCELLED, TALLY_RUN_ACTIVE));
    assert_false(tally_run_transition_allowed(TALLY_RUN_COMPENSATED, TALLY_RUN_ACTIVE));
    assert_false(tally_run_transition_allowed(TALLY_RUN_COMPLETED, TALLY_RUN_CANCELLED));
    for (int a = 0; a < TALLY_RUN__COUNT; a++) {
        if (a != TALLY_RUN_COMPENSATING && a != TALLY_RUN_STUCK) {
            assert_false(tally_run_transition_allowed((tally_run_state_t)a, TALLY_RUN_COMPENSATED));
            assert_false(tally_run_transition_allowed((tally_run_state_t)a,
                                                      TALLY_RUN_PARTIALLY_COMPENSATED));
        }
        /* no run goes back to taking intents */
        assert_false(tally_run_transition_allowed((tally_run_state_t)a, TALLY_RUN_ACTIVE));
    }
    assert_true(tally_alert_creation_allowed(TALLY_ALERT_TRIGGERED));
    assert_false(tally_alert_creation_allowed(TALLY_ALERT_RESOLVED));
    assert_true(tally_alert_transition_allowed(TALLY_ALERT_TRIGGERED, TALLY_ALERT_RESOLVED));
    assert_true(tally_alert_transition_allowed(TALLY_ALERT_RESOLVED, TALLY_ALERT_TRIGGERED));
    tally_run_state_t r;
    assert_true(tally_run_state_parse("PARTIALLY_COMPENSATED", &r));
    assert_int_equal(r, TALLY_RUN_PARTIALLY_COMPENSATED);
    assert_false(tally_run_state_parse("PLANNED", &r));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_effect_names_round_trip),
        cmocka_unit_test(test_obligation_names_round_trip),
        cmocka_unit_test(test_table_rows_are_well_formed),
        cmocka_unit_test(test_effect_matrix_is_exactly_the_design),
        cmocka_unit_test(test_obligation_matrix_is_exactly_the_design),
        cmocka_unit_test(test_effect_actors),
        cmocka_unit_test(test_obligation_actors),
        cmocka_unit_test(test_forbidden_effect_moves),
        cmocka_unit_test(test_forbidden_obligation_moves),
        cmocka_unit_test(test_terminal_sets),
        cmocka_unit_test(test_who_may_move_what),
        cmocka_unit_test(test_reachability),
        cmocka_unit_test(test_run_and_alert_machines),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
