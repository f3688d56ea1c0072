/* test_roles.c — the grants table's invariants (the audit trail append-only for every role,
 * the reader read-only, each table named once, only the four privileges), the role names from
 * the configuration, and which sessions a worker refuses. The grants applied to a real database
 * are tests/integration/test_roles.py's. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "tally/roles.h"

static bool has(const char *privileges, const char *word)
{
    size_t n = strlen(word);
    for (const char *p = privileges; (p = strstr(p, word)) != NULL; p += n) {
        bool starts = p == privileges || p[-1] == ' ';
        bool ends = p[n] == '\0' || p[n] == ',';
        if (starts && ends)
            return true;
    }
    return false;
}

static void test_every_entry_is_a_list_of_the_four_privileges(void **state)
{
    (void)state;
    assert_true(tally_roles_n_tables() > 0);
    for (size_t t = 0; t < tally_roles_n_tables(); t++) {
        for (size_t u = t + 1; u < tally_roles_n_tables(); u++)
            assert_string_not_equal(tally_roles_table(t), tally_roles_table(u));
        for (int r = 0; r < TALLY_ROLE_COUNT; r++) {
            const char *p = tally_roles_privileges((tally_role_t)r, t);
            assert_non_null(p);
            /* what is left once the four words and their separators are taken out: nothing */
            char rest[64];
            size_t o = 0;
            for (const char *c = p; *c != '\0';) {
                const char *words[] = {"SELECT", "INSERT", "UPDATE", "DELETE"};
                bool matched = false;
                for (size_t w = 0; w < 4 && !matched; w++) {
                    size_t n = strlen(words[w]);
                    if (strncmp(c, words[w], n) == 0) {
                        c += n;
                        matched = true;
                        if (strncmp(c, ", ", 2) == 0 && c[2] != '\0')
                            c += 2;
                    }
                }
                if (!matched && o + 1 < sizeof rest)
                    rest[o++] = *c++;
                else if (!matched)
                    c++;
            }
            rest[o] = '\0';
            assert_string_equal(rest, "");
        }
    }
    assert_null(tally_roles_table(tally_roles_n_tables()));
}

static void test_the_audit_trail_is_append_only_and_the_reader_reads(void **state)
{
    (void)state;
    bool events = false;
    for (size_t t = 0; t < tally_roles_n_tables(); t++) {
        const char *table = tally_roles_table(t);
        for (int r = 0; r < TALLY_ROLE_COUNT; r++) {
            const char *p = tally_roles_privileges((tally_role_t)r, t);
            if (strcmp(table, "events") == 0) {
                events = true;
                assert_false(has(p, "UPDATE"));
                assert_false(has(p, "DELETE"));
                assert_true(has(p, "SELECT"));
            }
            if (r == TALLY_ROLE_READER) {
                assert_false(has(p, "INSERT"));
                assert_false(has(p, "UPDATE"));
                assert_false(has(p, "DELETE"));
            }
            /* writing a row of a table means reading it in the same statement */
            if (has(p, "INSERT") || has(p, "UPDATE") || has(p, "DELETE"))
                assert_true(has(p, "SELECT"));
        }
        if (strcmp(table, "tenant_keys") == 0) {
            assert_string_equal(tally_roles_privileges(TALLY_ROLE_READER, t), "");
            assert_false(has(tally_roles_privileges(TALLY_ROLE_DISPATCHER, t), "UPDATE"));
        }
    }
    assert_true(events);
}

static void test_names_come_from_the_configuration(void **state)
{
    (void)state;
    tally_config_t *cfg = tally_config_new();
    assert_non_null(cfg);
    assert_string_equal(tally_role_name(cfg, TALLY_ROLE_DISPATCHER), "tally_dispatcher");
    assert_string_equal(tally_role_name(cfg, TALLY_ROLE_READER), "tally_reader");
    char *env[] = {"TALLY_ROLE_OPERATOR=oncall", "TALLY_ROLE_PASSWORD_READER=pw", NULL};
    char err[256];
    assert_true(tally_config_load_env(cfg, env, err, sizeof err));
    assert_string_equal(tally_role_name(cfg, TALLY_ROLE_OPERATOR), "oncall");
    assert_string_equal(cfg->role_password[TALLY_ROLE_READER], "pw");
    assert_string_equal(cfg->role_password[TALLY_ROLE_DISPATCHER], "");
    assert_string_equal(tally_role_component(TALLY_ROLE_COMPENSATOR), "compensator");
    char *bad[] = {"TALLY_ALLOW_OWNER_ROLE=yes", NULL};
    assert_false(tally_config_load_env(cfg, bad, err, sizeof err));
    assert_non_null(strstr(err, "TALLY_ALLOW_OWNER_ROLE"));
    tally_config_free(cfg);
}

static void test_a_worker_refuses_a_superuser_and_the_owner(void **state)
{
    (void)state;
    char why[300];
    tally_session_role_t who = {.user = "tally_dispatcher", .owner = "tally_owner"};
    assert_false(tally_roles_privileged(&who, why, sizeof why));
    assert_string_equal(why, "");

    tally_session_role_t su = {.user = "postgres", .owner = "tally_owner", .superuser = true};
    assert_true(tally_roles_privileged(&su, why, sizeof why));
    assert_non_null(strstr(why, "\"postgres\" is a superuser"));

    tally_session_role_t owner = {
        .user = "tally_owner", .owner = "tally_owner", .owner_member = true};
    assert_true(tally_roles_privileged(&owner, why, sizeof why));
    assert_non_null(strstr(why, "\"tally_owner\" owns the ledger's tables"));

    tally_session_role_t member = {.user = "alice", .owner = "tally_owner", .owner_member = true};
    assert_true(tally_roles_privileged(&member, why, sizeof why));
    assert_non_null(strstr(why, "\"alice\" is a member of \"tally_owner\""));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_entry_is_a_list_of_the_four_privileges),
        cmocka_unit_test(test_the_audit_trail_is_append_only_and_the_reader_reads),
        cmocka_unit_test(test_names_come_from_the_configuration),
        cmocka_unit_test(test_a_worker_refuses_a_superuser_and_the_owner),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
