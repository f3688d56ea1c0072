/* test_config.c — configuration from the environment: defaults, overrides, errors naming the
 * variable, the Kafka passthrough, unknown names, and what `tally config` shows. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tally/config.h"

static tally_config_t *load(char *const *envp)
{
    tally_config_t *cfg = tally_config_new();
    assert_non_null(cfg);
    char err[256] = "";
    if (!tally_config_load_env(cfg, envp, err, sizeof err))
        fail_msg("load_env failed: %s", err);
    return cfg;
}

/* The error of loading a single variable, which must fail. */
static void load_fails(const char *entry, const char *want_err)
{
    char *envp[] = {(char *)entry, NULL};
    tally_config_t *cfg = tally_config_new();
    assert_non_null(cfg);
    char err[256] = "";
    bool ok = tally_config_load_env(cfg, envp, err, sizeof err);
    if (ok)
        fail_msg("%s was accepted", entry);
    if (strcmp(err, want_err) != 0)
        fail_msg("%s: error\n  got:  %s\n  want: %s", entry, err, want_err);
    tally_config_free(cfg);
}

static char *describe(const tally_config_t *cfg)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    tally_config_describe(cfg, f);
    fclose(f);
    return buf;
}

static void test_defaults(void **state)
{
    (void)state;
    tally_config_t *cfg = load((char *[]){NULL});
    assert_string_equal(cfg->pg, "");
    assert_string_equal(cfg->kafka_brokers, "127.0.0.1:9092");
    assert_string_equal(cfg->tools_path, "tools.json");
    assert_string_equal(cfg->topic_prefix, "tally.");
    assert_string_equal(cfg->metrics_addr, "127.0.0.1:9464");
    assert_string_equal(cfg->log_level, "info");
    assert_string_equal(cfg->consumer_group, "");
    assert_string_equal(cfg->pager_url, "");
    assert_string_equal(cfg->pager_routing_key, "");
    assert_int_equal(cfg->batch_size, 500);
    assert_int_equal(cfg->lease_ms, 30000);
    assert_int_equal(cfg->poll_ms, 1000);
    assert_int_equal(cfg->sweep_ms, 1000);
    assert_int_equal(cfg->max_message_bytes, 1048576);
    assert_int_equal(cfg->backlog_limit, 20000);
    assert_int_equal(cfg->max_inflight, 5000);
    assert_int_equal(cfg->relay_batch, 1000);
    assert_int_equal(cfg->shutdown_grace_ms, 20000);
    assert_int_equal(cfg->unknown_age_s, 300);
    assert_int_equal(cfg->session_timeout_ms, 45000);
    assert_true(cfg->deadline_warn_share == 0.8);
    assert_int_equal(cfg->n_kafka_props, 0);
    assert_int_equal(cfg->n_unknown_vars, 0);

    char host[256], want[300];
    assert_int_equal(gethostname(host, sizeof host), 0);
    snprintf(want, sizeof want, "%s:%ld", host, (long)getpid());
    assert_string_equal(cfg->worker_id, want);
    tally_config_free(cfg);

    /* tally_config_new alone already holds the defaults */
    cfg = tally_config_new();
    assert_int_equal(cfg->lease_ms, 30000);
    assert_string_equal(cfg->worker_id, want);
    tally_config_free(cfg);
    tally_config_free(NULL);
}

static void test_overrides(void **state)
{
    (void)state;
    char *envp[] = {
        "PATH=/usr/bin",
        "PGHOST=elsewhere", /* not ours: libpq reads it itself */
        "TALLY_PG=host=db dbname=ledger",
        "TALLY_KAFKA_BROKERS=k1:9092,k2:9092",
        "TALLY_TOOLS=/etc/tally/tools.json",
        "TALLY_TOPIC_PREFIX=staging.",
        "TALLY_METRICS_ADDR=",
        "TALLY_WORKER_ID=dispatcher-7",
        "TALLY_LOG_LEVEL=debug",
        "TALLY_CONSUMER_GROUP=grp",
        "TALLY_LEASE_MS=1500",
        "TALLY_BATCH_SIZE=1",
        "TALLY_SHUTDOWN_GRACE_MS=0",
        "TALLY_UNKNOWN_AGE_S=0",
        "TALLY_SESSION_TIMEOUT_MS=6000",
        "TALLY_MAX_MESSAGE_BYTES=2147483647",
        "TALLY_POLL_MS=10",
        "TALLY_POLL_MS=20", /* the later entry wins */
        "TALLY_DEADLINE_WARN_SHARE=.5",
        NULL,
    };
    tally_config_t *cfg = load(envp);
    assert_string_equal(cfg->pg, "host=db dbname=ledger");
    assert_string_equal(cfg->kafka_brokers, "k1:9092,k2:9092");
    assert_string_equal(cfg->tools_path, "/etc/tally/tools.json");
    assert_string_equal(cfg->topic_prefix, "staging.");
    assert_string_equal(cfg->metrics_addr, "");
    assert_string_equal(cfg->worker_id, "dispatcher-7");
    assert_string_equal(cfg->log_level, "debug");
    assert_string_equal(cfg->consumer_group, "grp");
    assert_int_equal(cfg->lease_ms, 1500);
    assert_int_equal(cfg->batch_size, 1);
    assert_int_equal(cfg->shutdown_grace_ms, 0);
    assert_int_equal(cfg->unknown_age_s, 0);
    assert_int_equal(cfg->session_timeout_ms, 6000);
    assert_int_equal(cfg->max_message_bytes, 2147483647);
    assert_int_equal(cfg->poll_ms, 20);
    assert_true(cfg->deadline_warn_share == 0.5);
    assert_int_equal(cfg->relay_batch, 1000); /* untouched */
    assert_int_equal(cfg->n_kafka_props, 0);  /* BROKERS is not a passthrough */
    assert_int_equal(cfg->n_unknown_vars, 0);

    char topic[64];
    assert_true(tally_config_topic(cfg, "intents", topic, sizeof topic));
    assert_string_equal(topic, "staging.intents");
    char small[10]; /* "staging.intents" needs 16 */
    assert_false(tally_config_topic(cfg, "intents", small, sizeof small));
    tally_config_free(cfg);
}

static void test_empty_worker_id_is_computed(void **state)
{
    (void)state;
    tally_config_t *cfg = load((char *[]){"TALLY_WORKER_ID=", NULL});
    char suffix[32];
    snprintf(suffix, sizeof suffix, ":%ld", (long)getpid());
    assert_true(strlen(cfg->worker_id) > strlen(suffix));
    assert_string_equal(cfg->worker_id + strlen(cfg->worker_id) - strlen(suffix), suffix);
    tally_config_free(cfg);
}

static void test_bad_values_name_the_variable(void **state)
{
    (void)state;
    load_fails("TALLY_LEASE_MS=abc", "TALLY_LEASE_MS: 'abc' is not a positive integer");
    load_fails("TALLY_LEASE_MS=30s", "TALLY_LEASE_MS: '30s' is not a positive integer");
    load_fails("TALLY_LEASE_MS=", "TALLY_LEASE_MS: '' is not a positive integer");
    load_fails("TALLY_LEASE_MS= 5", "TALLY_LEASE_MS: ' 5' is not a positive integer");
    load_fails("TALLY_LEASE_MS=5 ", "TALLY_LEASE_MS: '5 ' is not a positive integer");
    load_fails("TALLY_LEASE_MS=1.5", "TALLY_LEASE_MS: '1.5' is not a positive integer");
    load_fails("TALLY_LEASE_MS=0x10", "TALLY_LEASE_MS: '0x10' is not a positive integer");
    load_fails("TALLY_LEASE_MS=+5", "TALLY_LEASE_MS: '+5' is not a positive integer");
    load_fails("TALLY_LEASE_MS=0",
               "TALLY_LEASE_MS: '0' is not a positive integer (the least meaningful value is 1)");
    load_fails("TALLY_BATCH_SIZE=0",
               "TALLY_BATCH_SIZE: '0' is not a positive integer (the least meaningful value is 1)");
    load_fails("TALLY_POLL_MS=0",
               "TALLY_POLL_MS: '0' is not a positive integer (the least meaningful value is 1)");
    load_fails(
        "TALLY_RELAY_BATCH=-3",
        "TALLY_RELAY_BATCH: '-3' is not a positive integer (the least meaningful value is 1)");
    load_fails("TALLY_SHUTDOWN_GRACE_MS=-1", "TALLY_SHUTDOWN_GRACE_MS: '-1' is not a non-negative "
                                             "integer (the least meaningful value is 0)");
    load_fails("TALLY_MAX_INFLIGHT=2147483648",
               "TALLY_MAX_INFLIGHT: '2147483648' is not a positive integer of at most 2147483647");
    load_fails("TALLY_BACKLOG_LIMIT=99999999999999999999999",
               "TALLY_BACKLOG_LIMIT: '99999999999999999999999' is not a positive integer of at "
               "most 2147483647");
    /* a share: a number above 0 and at most 1; 1 is allowed (no warning page) */
    load_fails("TALLY_DEADLINE_WARN_SHARE=0",
               "TALLY_DEADLINE_WARN_SHARE: '0' is out of range: it must be a number above 0 and "
               "at most 1 (e.g. 0.8)");
    load_fails("TALLY_DEADLINE_WARN_SHARE=1.01",
               "TALLY_DEADLINE_WARN_SHARE: '1.01' is out of range: it must be a number above 0 "
               "and at most 1 (e.g. 0.8)");
    load_fails("TALLY_DEADLINE_WARN_SHARE=-0.5",
               "TALLY_DEADLINE_WARN_SHARE: '-0.5' is out of range: it must be a number above 0 "
               "and at most 1 (e.g. 0.8)");
    load_fails("TALLY_DEADLINE_WARN_SHARE=80%",
               "TALLY_DEADLINE_WARN_SHARE: '80%' is not a number above 0 and at most 1 (e.g. 0.8)");
    load_fails("TALLY_DEADLINE_WARN_SHARE=nan",
               "TALLY_DEADLINE_WARN_SHARE: 'nan' is not a number above 0 and at most 1 (e.g. 0.8)");
    load_fails("TALLY_DEADLINE_WARN_SHARE= 0.8",
               "TALLY_DEADLINE_WARN_SHARE: ' 0.8' is not a number above 0 and at most 1 (e.g. "
               "0.8)");
    load_fails("TALLY_DEADLINE_WARN_SHARE=",
               "TALLY_DEADLINE_WARN_SHARE: '' is not a number above 0 and at most 1 (e.g. 0.8)");
    tally_config_t *one = load((char *[]){"TALLY_DEADLINE_WARN_SHARE=1", NULL});
    assert_true(one->deadline_warn_share == 1.0);
    tally_config_free(one);
    load_fails("TALLY_LOG_LEVEL=verbose",
               "TALLY_LOG_LEVEL: 'verbose' is not one of debug|info|warn|error");
    load_fails("TALLY_LOG_LEVEL=INFO",
               "TALLY_LOG_LEVEL: 'INFO' is not one of debug|info|warn|error");
    load_fails("TALLY_KAFKA_BOOTSTRAP_SERVERS=x:1",
               "TALLY_KAFKA_BOOTSTRAP_SERVERS: Kafka property bootstrap.servers cannot be passed "
               "through: set TALLY_KAFKA_BROKERS instead");
    load_fails("TALLY_KAFKA_ENABLE_AUTO_OFFSET_STORE=true",
               "TALLY_KAFKA_ENABLE_AUTO_OFFSET_STORE: Kafka property enable.auto.offset.store "
               "cannot be passed through: tally stores offsets itself, only after the PostgreSQL "
               "commit");
}

static void test_kafka_passthrough(void **state)
{
    (void)state;
    char *envp[] = {
        "TALLY_KAFKA_SECURITY_PROTOCOL=SASL_SSL",
        "TALLY_KAFKA_HEARTBEAT_INTERVAL_MS=500",
        "TALLY_KAFKA_BROKERS=b:9092",
        "TALLY_KAFKA_SASL_MECHANISMS=PLAIN",
        "TALLY_KAFKA_HEARTBEAT_INTERVAL_MS=700", /* later value replaces, position kept */
        "TALLY_KAFKA_CLIENT_ID=",
        "TALLY_KAFKA_=nothing", /* no property name: unknown, not a passthrough */
        NULL,
    };
    tally_config_t *cfg = load(envp);
    assert_string_equal(cfg->kafka_brokers, "b:9092");
    assert_int_equal(cfg->n_kafka_props, 4);
    assert_string_equal(cfg->kafka_props[0].name, "security.protocol");
    assert_string_equal(cfg->kafka_props[0].value, "SASL_SSL");
    assert_string_equal(cfg->kafka_props[1].name, "heartbeat.interval.ms");
    assert_string_equal(cfg->kafka_props[1].value, "700");
    assert_string_equal(cfg->kafka_props[2].name, "sasl.mechanisms");
    assert_string_equal(cfg->kafka_props[2].value, "PLAIN");
    assert_string_equal(cfg->kafka_props[3].name, "client.id");
    assert_string_equal(cfg->kafka_props[3].value, "");
    assert_int_equal(cfg->n_unknown_vars, 1);
    assert_string_equal(cfg->unknown_vars[0], "TALLY_KAFKA_");
    tally_config_free(cfg);
}

static void test_unknown_variables_are_warnings(void **state)
{
    (void)state;
    char *envp[] = {"TALLY_LEASE_MX=5", "TALLY_FROBNICATE=1", "TALLY_LEASE_MX=6", NULL};
    tally_config_t *cfg = load(envp);
    assert_int_equal(cfg->lease_ms, 30000);
    assert_int_equal(cfg->n_unknown_vars, 2); /* listed once each */
    assert_string_equal(cfg->unknown_vars[0], "TALLY_LEASE_MX");
    assert_string_equal(cfg->unknown_vars[1], "TALLY_FROBNICATE");
    char *out = describe(cfg);
    assert_non_null(
        strstr(out, "warning: TALLY_LEASE_MX is not a tally setting and is ignored (did you mean "
                    "TALLY_LEASE_MS?)\n"));
    assert_non_null(
        strstr(out, "warning: TALLY_FROBNICATE is not a tally setting and is ignored\n"));
    free(out);
    tally_config_free(cfg);
}

/* The line of @p out that starts with @p var followed by a space. */
static const char *line_of(const char *out, const char *var)
{
    size_t n = strlen(var);
    for (const char *l = out; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
        if (strncmp(l, var, n) == 0 && l[n] == ' ')
            return l;
    }
    fail_msg("no line for %s in:\n%s", var, out);
    return NULL;
}

/* The value column of a table line: the text at @p col up to two spaces. */
static void column_at(const char *line, size_t col, char *buf, size_t bufsz)
{
    const char *p = line + col;
    const char *end = strstr(p, "  ");
    size_t n = end ? (size_t)(end - p) : strcspn(p, "\n");
    snprintf(buf, bufsz, "%.*s", (int)n, p);
}

static void test_describe_masks_secrets_and_aligns(void **state)
{
    (void)state;
    char *envp[] = {
        "TALLY_PG=postgresql://app:hunter2@db:5432/ledger?sslmode=require&password=hunter3",
        "TALLY_PAGER_ROUTING_KEY=R0UT1NGK3Y",
        "TALLY_PAGER_URL=https://ops:pagerpw@events.example.com/v2/enqueue?token=PAGERTOKEN&x=1",
        "TALLY_KAFKA_SASL_PASSWORD=kafkapw",
        "TALLY_KAFKA_SASL_USERNAME=svc-tally",
        "TALLY_KAFKA_SECURITY_PROTOCOL=SASL_SSL",
        "TALLY_LEASE_MS=1500",
        "TALLY_DEADLINE_WARN_SHARE=0.75",
        NULL,
    };
    tally_config_t *cfg = load(envp);
    char *out = describe(cfg);

    assert_null(strstr(out, "hunter"));
    assert_null(strstr(out, "R0UT1NG"));
    assert_null(strstr(out, "kafkapw"));

    const char *header = line_of(out, "VARIABLE");
    size_t vcol = (size_t)(strstr(header, "VALUE") - header);
    size_t dcol = (size_t)(strstr(header, "DEFAULT") - header);
    size_t hcol = (size_t)(strstr(header, "HELP") - header);
    char buf[256];

    column_at(line_of(out, "TALLY_PG"), vcol, buf, sizeof buf);
    assert_string_equal(buf, "postgresql://app:***@db:5432/ledger?sslmode=require&password=***");
    column_at(line_of(out, "TALLY_PAGER_ROUTING_KEY"), vcol, buf, sizeof buf);
    assert_string_equal(buf, "***");
    column_at(line_of(out, "TALLY_PAGER_URL"), vcol, buf, sizeof buf);
    assert_string_equal(buf, "https://ops:***@events.example.com/v2/enqueue?token=***&x=1");
    assert_null(strstr(out, "pagerpw"));
    assert_null(strstr(out, "PAGERTOKEN"));

    const char *lease = line_of(out, "TALLY_LEASE_MS");
    column_at(lease, vcol, buf, sizeof buf);
    assert_string_equal(buf, "1500");
    column_at(lease, dcol, buf, sizeof buf);
    assert_string_equal(buf, "30000");
    assert_non_null(strstr(lease, "how long a claim is held"));
    const char *share = line_of(out, "TALLY_DEADLINE_WARN_SHARE");
    column_at(share, vcol, buf, sizeof buf);
    assert_string_equal(buf, "0.75");
    column_at(share, dcol, buf, sizeof buf);
    assert_string_equal(buf, "0.8");

    column_at(line_of(out, "TALLY_WORKER_ID"), dcol, buf, sizeof buf);
    assert_string_equal(buf, "<hostname>:<pid>");
    column_at(line_of(out, "TALLY_CONSUMER_GROUP"), vcol, buf, sizeof buf);
    assert_string_equal(buf, "\"\"");

    /* every row of the table starts its columns where the header does */
    size_t rows = 0;
    for (const char *l = strchr(header, '\n') + 1; strncmp(l, "TALLY_", 6) == 0;
         l = strchr(l, '\n') + 1, rows++) {
        assert_true(l[vcol - 1] == ' ' && l[vcol] != ' ');
        assert_true(l[dcol - 1] == ' ' && l[dcol] != ' ');
        assert_true(l[hcol - 1] == ' ' && l[hcol] != ' ');
    }
    assert_int_equal(rows, 42);

    assert_non_null(strstr(out, "TALLY_KAFKA_SASL_PASSWORD"));
    assert_non_null(strstr(out, "sasl.password = ***\n"));
    assert_non_null(strstr(out, "sasl.username = svc-tally\n"));
    assert_non_null(strstr(out, "security.protocol = SASL_SSL\n"));
    assert_null(strstr(out, "warning:"));
    free(out);
    tally_config_free(cfg);
}

static void test_describe_masks_conninfo_password(void **state)
{
    (void)state;
    static const struct {
        const char *pg;
        const char *shown;
    } cases[] = {
        {"host=db password=s3cret user=app", "host=db password=*** user=app"},
        {"host=db password='s3 cr\\'et' user=app", "host=db password=*** user=app"},
        {"password = s3cret", "password = ***"},
        {"host=db dbname=ledger", "host=db dbname=ledger"},
        {"postgres://app:pw@db/ledger", "postgres://app:***@db/ledger"},
        {"postgresql://app@db/ledger", "postgresql://app@db/ledger"},
        {"postgresql:///ledger?host=/run/pg&password=pw",
         "postgresql:///ledger?host=/run/pg&password=***"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char entry[256];
        snprintf(entry, sizeof entry, "TALLY_PG=%s", cases[i].pg);
        tally_config_t *cfg = load((char *[]){entry, NULL});
        char *out = describe(cfg);
        const char *header = line_of(out, "VARIABLE");
        size_t vcol = (size_t)(strstr(header, "VALUE") - header);
        char buf[256];
        column_at(line_of(out, "TALLY_PG"), vcol, buf, sizeof buf);
        /* conninfo values contain single spaces; compare up to the column gap */
        if (strcmp(buf, cases[i].shown) != 0)
            fail_msg("TALLY_PG=%s shown as '%s', want '%s'", cases[i].pg, buf, cases[i].shown);
        free(out);
        tally_config_free(cfg);
    }
}

/* tally_config_mask: what logs and stored errors show of a URL-valued setting. */
static void test_mask_url_credentials(void **state)
{
    (void)state;
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"https://events.pagerduty.com/v2/enqueue", "https://events.pagerduty.com/v2/enqueue"},
        {"https://u:p@h/x", "https://u:***@h/x"},
        {"https://T0KEN@h/x", "https://***@h/x"},
        {"https://h/x?api_key=K&a=1&Token=T&sig=S&session_id=I", "https://h/x?api_key=***&a=1"
                                                                 "&Token=***&sig=***&"
                                                                 "session_id=***"},
        {"https://h/x?access_token=T#frag", "https://h/x?access_token=***#***"},
        {"https://h/p@th?q=1", "https://h/p@th?q=1"}, /* an @ in the path is no userinfo */
        {"127.0.0.1:9092", "127.0.0.1:9092"},
        {"", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *got = tally_config_mask(cases[i].in);
        assert_non_null(got);
        if (strcmp(got, cases[i].want) != 0)
            fail_msg("%s masked as '%s', want '%s'", cases[i].in, got, cases[i].want);
        free(got);
    }
    assert_null(tally_config_mask(NULL));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_overrides),
        cmocka_unit_test(test_empty_worker_id_is_computed),
        cmocka_unit_test(test_bad_values_name_the_variable),
        cmocka_unit_test(test_kafka_passthrough),
        cmocka_unit_test(test_unknown_variables_are_warnings),
        cmocka_unit_test(test_describe_masks_secrets_and_aligns),
        cmocka_unit_test(test_describe_masks_conninfo_password),
        cmocka_unit_test(test_mask_url_credentials),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
