/* test_compensate_driver.c — drives common/src/runops.c against a real PostgreSQL for the
 * integration tests (tests/integration/test_compensate_*.py), the way `tally compensate`,
 * `tally cancel` and `tally approve` will: one transaction per invocation, results as JSON on
 * stdout. Not a unit test; built beside them because it links the same sources.
 *
 *   test_compensate_driver compensate RUN [--reason R] [--intent ID]
 *   test_compensate_driver cancel RUN [--compensate] [--reason R]
 *   test_compensate_driver plan compensate|cancel RUN
 *   test_compensate_driver approve|deny OBLIGATION...
 *   test_compensate_driver batch FILE        (a JSON array of {kind, run_id, compensate, reason})
 *   test_compensate_driver resolve-alert KEY...   (an operator settled what the pages were for)
 *
 * Environment: TALLY_PG (libpq conninfo), TALLY_TOOLS (the registry, for plan). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tally/alert.h"
#include "tally/audit.h"
#include "tally/outbox.h"
#include "tally/pg.h"
#include "tally/registry.h"
#include "tally/runops.h"

#define ACTOR  "test-driver"
#define SOURCE "/tally/tests/compensate-driver"

static int usage(void)
{
    fprintf(stderr, "usage: test_compensate_driver compensate|cancel RUN [--compensate] "
                    "[--reason R] [--intent ID]\n"
                    "       test_compensate_driver plan compensate|cancel RUN\n"
                    "       test_compensate_driver approve|deny OBLIGATION...\n"
                    "       test_compensate_driver batch FILE\n"
                    "       test_compensate_driver resolve-alert KEY...\n");
    return 2;
}

static tally_pg_t *connect_pg(void)
{
    const char *conninfo = getenv("TALLY_PG");
    tally_pg_t *pg = tally_pg_new(conninfo != NULL ? conninfo : "", "tally-test-driver");
    tally_error_t err;
    tally_error_clear(&err);
    if (pg == NULL || !tally_pg_connect(pg, 10000, NULL, &err)) {
        fprintf(stderr, "cannot connect to PostgreSQL: %s\n", err.message);
        tally_pg_free(pg);
        return NULL;
    }
    return pg;
}

static json_t *result_json(const tally_runop_result_t *r)
{
    return json_pack(
        "{s:b, s:s, s:s, s:I, s:I, s:I, s:I}", "found", r->found, "status_before", r->status_before,
        "status_after", r->status_after, "obligations_created", (json_int_t)r->obligations_created,
        "obligations_existing", (json_int_t)r->obligations_existing, "effects_cancelled",
        (json_int_t)r->effects_cancelled, "effects_waiting", (json_int_t)r->effects_waiting);
}

static int apply(tally_pg_t *pg, const tally_runop_t *ops, size_t n)
{
    tally_runop_result_t *results = calloc(n, sizeof *results);
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_error_t err;
    tally_error_clear(&err);
    bool ok = results != NULL && ob != NULL && ab != NULL && tally_pg_begin(pg, &err) &&
              tally_runops_apply(pg, ops, n, ACTOR, SOURCE, ob, ab, results, &err) &&
              tally_audit_batch_flush(ab, pg, &err) && tally_outbox_batch_flush(ob, pg, &err) &&
              tally_pg_commit(pg, &err);
    if (!ok) {
        tally_pg_rollback(pg);
        fprintf(stderr, "runops: %s (%s)\n", err.message, err.code);
    } else {
        json_t *out = json_array();
        for (size_t i = 0; i < n; i++) {
            json_array_append_new(out, result_json(&results[i]));
        }
        char *text = json_dumps(out, JSON_COMPACT);
        printf("%s\n", text);
        free(text);
        json_decref(out);
    }
    free(results);
    tally_outbox_batch_free(ob);
    tally_audit_batch_free(ab);
    return ok ? 0 : 1;
}

static int plan(tally_pg_t *pg, const tally_runop_t *op)
{
    const char *path = getenv("TALLY_TOOLS");
    tally_problems_t problems = {NULL, 0};
    tally_registry_t *reg = tally_registry_load_file(path != NULL ? path : "", &problems);
    if (reg == NULL) {
        fprintf(stderr, "registry %s: %zu problems\n", path != NULL ? path : "(unset)", problems.n);
        tally_problems_clear(&problems);
        return 1;
    }
    tally_error_t err;
    tally_error_clear(&err);
    json_t *p = tally_runops_plan(pg, reg, op, &err);
    int rc = 0;
    if (p == NULL) {
        fprintf(stderr, "plan: %s (%s)\n", err.message, err.code);
        rc = err.errc == TALLY_ERR_NOT_FOUND ? 3 : 1;
    } else {
        char *text = json_dumps(p, JSON_COMPACT);
        printf("%s\n", text);
        free(text);
        json_decref(p);
    }
    tally_registry_free(reg);
    return rc;
}

static int approve(tally_pg_t *pg, bool yes, const char *const *ids, size_t n)
{
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_error_t err;
    tally_error_clear(&err);
    size_t changed = 0;
    bool ok =
        ab != NULL && tally_pg_begin(pg, &err) &&
        tally_runops_approve_obligations(pg, ids, n, yes, ACTOR, "test", ab, &changed, &err) &&
        tally_audit_batch_flush(ab, pg, &err) && tally_pg_commit(pg, &err);
    if (!ok) {
        tally_pg_rollback(pg);
        fprintf(stderr, "approve: %s\n", err.message);
    } else {
        printf("{\"changed\":%zu}\n", changed);
    }
    tally_audit_batch_free(ab);
    return ok ? 0 : 1;
}

static int resolve_alerts(tally_pg_t *pg, const char *const *keys, size_t n)
{
    tally_outbox_batch_t *ob = tally_outbox_batch_new();
    tally_audit_batch_t *ab = tally_audit_batch_new();
    tally_error_t err;
    tally_error_clear(&err);
    size_t resolved = 0;
    bool ok = ob != NULL && ab != NULL && tally_pg_begin(pg, &err) &&
              tally_alert_resolve(pg, keys, n, ACTOR, SOURCE, "settled by the test", ob, ab,
                                  &resolved, &err) &&
              tally_audit_batch_flush(ab, pg, &err) && tally_outbox_batch_flush(ob, pg, &err) &&
              tally_pg_commit(pg, &err);
    if (!ok) {
        tally_pg_rollback(pg);
        fprintf(stderr, "resolve-alert: %s\n", err.message);
    } else {
        printf("{\"resolved\":%zu}\n", resolved);
    }
    tally_outbox_batch_free(ob);
    tally_audit_batch_free(ab);
    return ok ? 0 : 1;
}

static int batch(tally_pg_t *pg, const char *file)
{
    json_error_t jerr;
    json_t *doc = json_load_file(file, 0, &jerr);
    if (!json_is_array(doc)) {
        fprintf(stderr, "%s: not a JSON array (%s)\n", file, jerr.text);
        json_decref(doc);
        return 2;
    }
    size_t n = json_array_size(doc);
    tally_runop_t *ops = calloc(n ? n : 1, sizeof *ops);
    for (size_t i = 0; ops != NULL && i < n; i++) {
        json_t *o = json_array_get(doc, i);
        const char *kind = json_string_value(json_object_get(o, "kind"));
        ops[i].kind = kind != NULL && strcmp(kind, "cancel") == 0 ? TALLY_RUNOP_CANCEL
                                                                  : TALLY_RUNOP_COMPENSATE;
        ops[i].run_id = json_string_value(json_object_get(o, "run_id"));
        ops[i].compensate = json_is_true(json_object_get(o, "compensate"));
        ops[i].reason = json_string_value(json_object_get(o, "reason"));
    }
    int rc = ops != NULL ? apply(pg, ops, n) : 1;
    free(ops);
    json_decref(doc);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        return usage();
    }
    tally_pg_t *pg = connect_pg();
    if (pg == NULL) {
        return 3;
    }
    int rc;
    const char *verb = argv[1];
    if (strcmp(verb, "approve") == 0 || strcmp(verb, "deny") == 0) {
        rc = approve(pg, strcmp(verb, "approve") == 0, (const char *const *)argv + 2,
                     (size_t)(argc - 2));
    } else if (strcmp(verb, "resolve-alert") == 0) {
        rc = resolve_alerts(pg, (const char *const *)argv + 2, (size_t)(argc - 2));
    } else if (strcmp(verb, "batch") == 0) {
        rc = batch(pg, argv[2]);
    } else {
        bool is_plan = strcmp(verb, "plan") == 0;
        const char *kind = is_plan ? argv[2] : verb;
        int i = is_plan ? 3 : 2;
        if (i >= argc || (strcmp(kind, "compensate") != 0 && strcmp(kind, "cancel") != 0)) {
            tally_pg_free(pg);
            return usage();
        }
        tally_runop_t op = {.kind = strcmp(kind, "cancel") == 0 ? TALLY_RUNOP_CANCEL
                                                                : TALLY_RUNOP_COMPENSATE,
                            .run_id = argv[i]};
        for (i++; i < argc; i++) {
            if (strcmp(argv[i], "--compensate") == 0) {
                op.compensate = true;
            } else if (strcmp(argv[i], "--reason") == 0 && i + 1 < argc) {
                op.reason = argv[++i];
            } else if (strcmp(argv[i], "--intent") == 0 && i + 1 < argc) {
                op.intent_id = argv[++i];
            } else {
                tally_pg_free(pg);
                return usage();
            }
        }
        rc = is_plan ? plan(pg, &op) : apply(pg, &op, 1);
    }
    tally_pg_free(pg);
    return rc;
}
