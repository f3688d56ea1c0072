/* config.c — configuration from the environment, driven by one declarative table.
 *
 * params[] below is the only place a setting is described: its field, environment variable,
 * type, default, lower bound or allowed values, and help. Parsing, defaults and
 * tally_config_describe() (for --help and `tally config`) all read it, as pgbouncer's
 * bouncer_params[] does. Variables named TALLY_KAFKA_<PROPERTY> (other than
 * TALLY_KAFKA_BROKERS) are librdkafka properties passed through; any other TALLY_* name is
 * kept in unknown_vars and reported as a warning, so a typo is visible without making a
 * deploy that sets an extra variable fail. */
#include "tally/config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

typedef enum { PARAM_STRING, PARAM_INT, PARAM_SHARE } param_type_t;

typedef struct param {
    const char *env;      /**< the environment variable */
    param_type_t type;    /**< char *, int, or double field (a share: a number in (0, 1]) */
    size_t offset;        /**< of the field in tally_config_t */
    const char *def;      /**< default as text, for both types */
    int min;              /**< ints: smallest meaningful value (0 or 1) */
    const char *choices;  /**< strings: "a|b|c" of allowed values, or NULL for any */
    const char *def_note; /**< shown instead of an empty default when one is computed */
    const char *help;
    /** strings: refuses a bad value with the reason in @p why (a sentence without the
     * variable's name), or NULL for any */
    bool (*check)(const char *v, char *why, size_t whysz);
} param_t;

#define STR(field, env, def, choices, note, help)                                                  \
    {                                                                                              \
        env, PARAM_STRING, offsetof(tally_config_t, field), def, 0, choices, note, help, NULL      \
    }
/* A string that must pass check() (a URL, ...); empty is always allowed. */
#define CHECKED(field, env, check, help)                                                           \
    {                                                                                              \
        env, PARAM_STRING, offsetof(tally_config_t, field), "", 0, NULL, NULL, help, check         \
    }
#define INT(field, env, def, min, help)                                                            \
    {                                                                                              \
        env, PARAM_INT, offsetof(tally_config_t, field), def, min, NULL, NULL, help, NULL          \
    }
#define SHARE(field, env, def, help)                                                               \
    {                                                                                              \
        env, PARAM_SHARE, offsetof(tally_config_t, field), def, 0, NULL, NULL, help, NULL          \
    }

static bool check_console_url(const char *v, char *why, size_t whysz);

static const param_t params[] = {
    STR(pg, "TALLY_PG", "", NULL, NULL,
        "PostgreSQL conninfo or URI; empty lets the PG* variables decide"),
    STR(kafka_brokers, "TALLY_KAFKA_BROKERS", "127.0.0.1:9092", NULL, NULL,
        "Kafka bootstrap servers (host:port,...)"),
    STR(tools_path, "TALLY_TOOLS", "tools.json", NULL, NULL, "tool registry JSON file"),
    STR(topic_prefix, "TALLY_TOPIC_PREFIX", "tally.", NULL, NULL,
        "prefix of every topic name (tally.intents, ...)"),
    STR(metrics_addr, "TALLY_METRICS_ADDR", "127.0.0.1:9464", NULL, NULL,
        "host:port for /metrics, /healthz, /readyz; empty disables, port 0 picks one"),
    STR(health_addr, "TALLY_HEALTH_ADDR", "", NULL, NULL,
        "host:port for /healthz and /readyz alone, a listener scrapers cannot starve; empty: none"),
    STR(worker_id, "TALLY_WORKER_ID", "", NULL, "<hostname>:<pid>",
        "this process's name in leases, events and logs"),
    STR(log_level, "TALLY_LOG_LEVEL", "info", "debug|info|warn|error", NULL,
        "least severe log level written"),
    STR(consumer_group, "TALLY_CONSUMER_GROUP", "", NULL, "tally-<worker>", "Kafka consumer group"),
    STR(pager_url, "TALLY_PAGER_URL", "", NULL, NULL,
        "PagerDuty Events API v2 endpoint; empty: alerts only go to the alerts topic"),
    STR(pager_routing_key, "TALLY_PAGER_ROUTING_KEY", "", NULL, NULL, "PagerDuty routing key"),
    CHECKED(console_url, "TALLY_CONSOLE_URL", check_console_url,
            "where operators reach `tally console` (https://host/console, behind its proxy): "
            "every alert and page links to <it>/runs/<run id>; empty: no link"),
    STR(console_addr, "TALLY_CONSOLE_ADDR", "127.0.0.1:8089", NULL, NULL,
        "host:port `tally console` listens on unless --listen says; a loopback one only"),
    STR(reply_prefix, "TALLY_REPLY_TOPIC_PREFIX", "", NULL, "<TALLY_TOPIC_PREFIX>replies.",
        "reply topics named by intents must start with this (docs/agent-protocol.md)"),
    STR(master_key, "TALLY_MASTER_KEY", "", NULL, NULL,
        "master keys sealing tenant keys: ID:BASE64-32-BYTES[,ID:...], first seals "
        "(docs/security.md)"),
    STR(master_key_file, "TALLY_MASTER_KEY_FILE", "", NULL, NULL,
        "a file holding TALLY_MASTER_KEY's value instead (one line); wins over the variable"),
    STR(role_dispatcher, "TALLY_ROLE_DISPATCHER", "tally_dispatcher", NULL, NULL,
        "the dispatcher's database role: `tally migrate` creates it and grants it (roles.h)"),
    STR(role_reconciler, "TALLY_ROLE_RECONCILER", "tally_reconciler", NULL, NULL,
        "the reconciler's database role"),
    STR(role_compensator, "TALLY_ROLE_COMPENSATOR", "tally_compensator", NULL, NULL,
        "the compensator's database role"),
    STR(role_operator, "TALLY_ROLE_OPERATOR", "tally_operator", NULL, NULL,
        "the database role of the tally verbs that change the ledger (resolve, approve, ...)"),
    STR(role_reader, "TALLY_ROLE_READER", "tally_reader", NULL, NULL,
        "the read-only database role (status, doctor, dashboards)"),
    STR(role_password[0], "TALLY_ROLE_PASSWORD_DISPATCHER", "", NULL, NULL,
        "`tally migrate` sets it as the dispatcher role's password; empty: left as it is"),
    STR(role_password[1], "TALLY_ROLE_PASSWORD_RECONCILER", "", NULL, NULL,
        "the same for the reconciler's role"),
    STR(role_password[2], "TALLY_ROLE_PASSWORD_COMPENSATOR", "", NULL, NULL,
        "the same for the compensator's role"),
    STR(role_password[3], "TALLY_ROLE_PASSWORD_OPERATOR", "", NULL, NULL,
        "the same for the operator's role"),
    STR(role_password[4], "TALLY_ROLE_PASSWORD_READER", "", NULL, NULL,
        "the same for the reader's role"),
    STR(allow_owner_role, "TALLY_ALLOW_OWNER_ROLE", "0", "0|1", NULL,
        "1: a worker may run as a superuser or the ledger's owner, warned at every start"),
    INT(pg_deadline_ms, "TALLY_PG_DEADLINE_MS", "30000", 1,
        "a PostgreSQL statement not answered within this is given up and its connection closed; "
        "the server's statement_timeout is set to 5/6 of it unless TALLY_PG sets one"),
    INT(pg_stall_ms, "TALLY_PG_STALL_MS", "5000", 1,
        "a statement PostgreSQL has not answered for this long makes a worker not ready "
        "(/readyz 503, tally_db_up 0) while it waits"),
    INT(batch_size, "TALLY_BATCH_SIZE", "500", 1, "messages / rows per poll batch"),
    INT(lease_ms, "TALLY_LEASE_MS", "30000", 1, "how long a claim is held (database clock)"),
    INT(poll_ms, "TALLY_POLL_MS", "1000", 1, "longest idle wait before looking for work again"),
    INT(sweep_ms, "TALLY_SWEEP_MS", "1000", 1, "interval of the PostgreSQL sweep for due work"),
    INT(max_message_bytes, "TALLY_MAX_MESSAGE_BYTES", "1048576", 1, "larger intents go to the DLQ"),
    INT(backlog_limit, "TALLY_BACKLOG_LIMIT", "20000", 1,
        "stop fetching intents while the outbox holds more than this"),
    INT(max_inflight, "TALLY_MAX_INFLIGHT", "5000", 1, "connector calls in flight per dispatcher"),
    INT(relay_batch, "TALLY_RELAY_BATCH", "1000", 1, "message outbox rows per relay round"),
    INT(shutdown_grace_ms, "TALLY_SHUTDOWN_GRACE_MS", "20000", 0,
        "how long SIGTERM waits for in-flight work"),
    INT(unknown_age_s, "TALLY_UNKNOWN_AGE_S", "300", 0,
        "an UNKNOWN effect older than this is aging (tally status exits 1)"),
    INT(session_timeout_ms, "TALLY_SESSION_TIMEOUT_MS", "45000", 1,
        "Kafka consumer session timeout"),
    INT(run_idle_timeout_ms, "TALLY_RUN_IDLE_TIMEOUT_MS", "0", 0,
        "the reconciler completes ACTIVE runs whose effects have not changed this long; 0: off"),
    SHARE(deadline_warn_share, "TALLY_DEADLINE_WARN_SHARE", "0.8",
          "share of an obligation's time to its compensation deadline after which a warning "
          "page goes out (critical at the deadline); 1: no warning"),
};

#undef STR
#undef CHECKED
#undef INT
#undef SHARE

#define N_PARAMS (sizeof params / sizeof params[0])

#define KAFKA_PREFIX "TALLY_KAFKA_"

/* Kafka properties tally sets itself: letting the environment override them would either be
 * ambiguous or break the ledger's guarantees. */
static const struct {
    const char *property;
    const char *why;
} kafka_reserved[] = {
    {"bootstrap.servers", "set TALLY_KAFKA_BROKERS instead"},
    {"group.id", "set TALLY_CONSUMER_GROUP instead"},
    {"enable.auto.offset.store", "tally stores offsets itself, only after the PostgreSQL commit"},
};

/* Not settings: connections `tally dev --env-file` exports for scripts and tests beside
 * TALLY_PG (each role's), read by no tally process; a shell that sourced the file is no typo. */
static const char *const dev_exports[] = {
    "TALLY_PG_ADMIN",      "TALLY_PG_OWNER",      "TALLY_PG_READER",
    "TALLY_PG_DISPATCHER", "TALLY_PG_RECONCILER", "TALLY_PG_COMPENSATOR",
};

static bool is_dev_export(const char *env, size_t namelen)
{
    for (size_t i = 0; i < sizeof dev_exports / sizeof dev_exports[0]; i++) {
        if (strlen(dev_exports[i]) == namelen && strncmp(dev_exports[i], env, namelen) == 0)
            return true;
    }
    return false;
}

static char **str_field(tally_config_t *cfg, const param_t *p)
{
    return (char **)((char *)cfg + p->offset);
}

static const char *str_value(const tally_config_t *cfg, const param_t *p)
{
    return *(char *const *)((const char *)cfg + p->offset);
}

static int *int_field(tally_config_t *cfg, const param_t *p)
{
    return (int *)((char *)cfg + p->offset);
}

static int int_value(const tally_config_t *cfg, const param_t *p)
{
    return *(const int *)((const char *)cfg + p->offset);
}

static double *share_field(tally_config_t *cfg, const param_t *p)
{
    return (double *)((char *)cfg + p->offset);
}

static double share_value(const tally_config_t *cfg, const param_t *p)
{
    return *(const double *)((const char *)cfg + p->offset);
}

/* Digits only, with an optional '-' so that "-5" is named as negative rather than junk. */
static bool parse_int(const param_t *p, const char *v, int *out, char *errstr, size_t errsz)
{
    const char *what = p->min >= 1 ? "a positive integer" : "a non-negative integer";
    if (v[0] == '\0' || !(isdigit((unsigned char)v[0]) || v[0] == '-')) {
        snprintf(errstr, errsz, "%s: '%s' is not %s", p->env, v, what);
        return false;
    }
    errno = 0;
    char *end = NULL;
    long long n = strtoll(v, &end, 10);
    if (end == v || *end != '\0') {
        snprintf(errstr, errsz, "%s: '%s' is not %s", p->env, v, what);
        return false;
    }
    if (errno == ERANGE || n > INT_MAX) {
        snprintf(errstr, errsz, "%s: '%s' is not %s of at most %d", p->env, v, what, INT_MAX);
        return false;
    }
    if (n < p->min) {
        snprintf(errstr, errsz, "%s: '%s' is not %s (the least meaningful value is %d)", p->env, v,
                 what, p->min);
        return false;
    }
    *out = (int)n;
    return true;
}

/* A share of something: a decimal number above 0 and at most 1 ("0.8", "1"), nothing else. */
static bool parse_share(const param_t *p, const char *v, double *out, char *errstr, size_t errsz)
{
    static const char what[] = "a number above 0 and at most 1 (e.g. 0.8)";
    if (!(isdigit((unsigned char)v[0]) || (v[0] == '.' && isdigit((unsigned char)v[1])) ||
          v[0] == '-')) {
        snprintf(errstr, errsz, "%s: '%s' is not %s", p->env, v, what);
        return false;
    }
    errno = 0;
    char *end = NULL;
    double x = strtod(v, &end);
    if (end == v || *end != '\0' || errno == ERANGE || !isfinite(x)) {
        snprintf(errstr, errsz, "%s: '%s' is not %s", p->env, v, what);
        return false;
    }
    if (!(x > 0.0 && x <= 1.0)) {
        snprintf(errstr, errsz, "%s: '%s' is out of range: it must be %s", p->env, v, what);
        return false;
    }
    *out = x;
    return true;
}

/* A character RFC 3986 allows in a URI as it is: unreserved, reserved, or '%' of an escape. */
static bool uri_char(unsigned char c)
{
    return isalnum(c) || (c != '\0' && strchr("-._~:/?#[]@!$&'()*+,;=%", c) != NULL);
}

/* TALLY_CONSOLE_URL starts the link in every alert and page (alert.h), so it must be a URL a
 * browser opens as written: http(s), a host, printable ASCII that RFC 3986 allows (anything
 * else percent-encoded), no credentials (the link reaches every pager and chat the page goes
 * to; sign-on belongs to the proxy in front of the console), and no query or fragment, since
 * the run's path is appended to it. The value is quoted back only once it is known to be
 * printable. */
static bool check_console_url(const char *v, char *why, size_t whysz)
{
    size_t n = strlen(v);
    if (n > TALLY_CONSOLE_URL_MAX) {
        snprintf(why, whysz, "the URL is %zu bytes, more than the %d a console URL may have", n,
                 TALLY_CONSOLE_URL_MAX);
        return false;
    }
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)v[i];
        if (c <= 0x20 || c == 0x7f) {
            snprintf(why, whysz,
                     "byte %zu is %s (0x%02x): a URL has no whitespace or control characters",
                     i + 1, c == ' ' ? "a space" : "a control character", c);
            return false;
        }
        if (c >= 0x80) {
            snprintf(why, whysz, "byte %zu is not ASCII (0x%02x): percent-encode it (RFC 3986)",
                     i + 1, c);
            return false;
        }
        if (!uri_char(c)) {
            snprintf(why, whysz,
                     "'%c' (byte %zu) may not stand as it is in a URL: percent-encode it "
                     "(RFC 3986)",
                     c, i + 1);
            return false;
        }
        if (c == '%' && !(isxdigit((unsigned char)v[i + 1]) && isxdigit((unsigned char)v[i + 2]))) {
            snprintf(why, whysz,
                     "the '%%' at byte %zu does not start a percent-encoded byte (%%XX)", i + 1);
            return false;
        }
    }
    const char *rest = NULL;
    if (strncasecmp(v, "https://", 8) == 0)
        rest = v + 8;
    else if (strncasecmp(v, "http://", 7) == 0)
        rest = v + 7;
    if (rest == NULL) {
        snprintf(why, whysz, "not an http:// or https:// URL: '%s'", v);
        return false;
    }
    size_t authority = strcspn(rest, "/?#");
    if (authority == 0) {
        snprintf(why, whysz, "the URL names no host: '%s'", v);
        return false;
    }
    if (memchr(rest, '@', authority) != NULL) {
        snprintf(why, whysz,
                 "the URL carries credentials (user@host), which every page would pass on to its "
                 "readers: leave sign-on to the proxy in front of the console");
        return false;
    }
    if (strpbrk(v, "?#") != NULL) {
        snprintf(why, whysz,
                 "the URL has a query or a fragment, but a run's path (/runs/<id>) is appended "
                 "to it: end it with the console's path: '%s'",
                 v);
        return false;
    }
    return true;
}

static bool in_choices(const char *choices, const char *v)
{
    size_t n = strlen(v);
    for (const char *c = choices; *c;) {
        const char *bar = strchr(c, '|');
        size_t len = bar ? (size_t)(bar - c) : strlen(c);
        if (len == n && strncmp(c, v, n) == 0)
            return true;
        c += len + (bar ? 1 : 0);
    }
    return false;
}

static bool set_param(tally_config_t *cfg, const param_t *p, const char *v, char *errstr,
                      size_t errsz)
{
    if (p->type == PARAM_INT)
        return parse_int(p, v, int_field(cfg, p), errstr, errsz);
    if (p->type == PARAM_SHARE)
        return parse_share(p, v, share_field(cfg, p), errstr, errsz);
    if (p->choices != NULL && !in_choices(p->choices, v)) {
        snprintf(errstr, errsz, "%s: '%s' is not one of %s", p->env, v, p->choices);
        return false;
    }
    char why[600];
    if (p->check != NULL && v[0] != '\0' && !p->check(v, why, sizeof why)) {
        snprintf(errstr, errsz, "%s: %s", p->env, why);
        return false;
    }
    char *copy = strdup(v);
    if (copy == NULL) {
        snprintf(errstr, errsz, "%s: out of memory", p->env);
        return false;
    }
    char **field = str_field(cfg, p);
    free(*field);
    *field = copy;
    return true;
}

/* Values computed when left empty. */
static bool fill_computed(tally_config_t *cfg)
{
    if (cfg->worker_id != NULL && cfg->worker_id[0] != '\0')
        return true;
    char host[256];
    if (gethostname(host, sizeof host) != 0 || host[0] == '\0')
        snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = '\0';
    char *id = NULL;
    if (asprintf(&id, "%s:%ld", host, (long)getpid()) < 0)
        return false;
    free(cfg->worker_id);
    cfg->worker_id = id;
    return true;
}

tally_config_t *tally_config_new(void)
{
    tally_config_t *cfg = calloc(1, sizeof *cfg);
    if (cfg == NULL)
        return NULL;
    char err[256];
    for (size_t i = 0; i < N_PARAMS; i++) {
        /* The defaults go through the same checks as the environment; a bad default here
         * is a programming error and makes every process fail to start. */
        if (!set_param(cfg, &params[i], params[i].def, err, sizeof err)) {
            tally_config_free(cfg);
            return NULL;
        }
    }
    if (!fill_computed(cfg)) {
        tally_config_free(cfg);
        return NULL;
    }
    return cfg;
}

/* TALLY_KAFKA_SECURITY_PROTOCOL -> "security.protocol". */
static char *kafka_property(const char *rest, size_t len)
{
    char *prop = malloc(len + 1);
    if (prop == NULL)
        return NULL;
    for (size_t i = 0; i < len; i++)
        prop[i] = rest[i] == '_' ? '.' : (char)tolower((unsigned char)rest[i]);
    prop[len] = '\0';
    return prop;
}

static bool set_kafka_prop(tally_config_t *cfg, const char *env, size_t envlen, const char *value,
                           char *errstr, size_t errsz)
{
    const char *rest = env + strlen(KAFKA_PREFIX);
    char *prop = kafka_property(rest, envlen - strlen(KAFKA_PREFIX));
    char *val = strdup(value);
    if (prop == NULL || val == NULL) {
        free(prop);
        free(val);
        snprintf(errstr, errsz, "%.*s: out of memory", (int)envlen, env); /* lint: slice */
        return false;
    }
    for (size_t i = 0; i < sizeof kafka_reserved / sizeof kafka_reserved[0]; i++) {
        if (strcmp(prop, kafka_reserved[i].property) == 0) {
            /* lint: slice (the variable's name, up to '=') */
            snprintf(errstr, errsz, "%.*s: Kafka property %s cannot be passed through: %s",
                     (int)envlen, env, prop, kafka_reserved[i].why);
            free(prop);
            free(val);
            return false;
        }
    }
    /* A property given twice (a second load) takes the later value. */
    for (size_t i = 0; i < cfg->n_kafka_props; i++) {
        if (strcmp(cfg->kafka_props[i].name, prop) == 0) {
            free(cfg->kafka_props[i].value);
            cfg->kafka_props[i].value = val;
            free(prop);
            return true;
        }
    }
    tally_kv_t *kv = realloc(cfg->kafka_props, (cfg->n_kafka_props + 1) * sizeof *kv);
    if (kv == NULL) {
        free(prop);
        free(val);
        snprintf(errstr, errsz, "%.*s: out of memory", (int)envlen, env); /* lint: slice */
        return false;
    }
    cfg->kafka_props = kv;
    kv[cfg->n_kafka_props].name = prop;
    kv[cfg->n_kafka_props].value = val;
    cfg->n_kafka_props++;
    return true;
}

static bool add_unknown(tally_config_t *cfg, const char *env, size_t envlen)
{
    for (size_t i = 0; i < cfg->n_unknown_vars; i++) {
        if (strlen(cfg->unknown_vars[i]) == envlen &&
            strncmp(cfg->unknown_vars[i], env, envlen) == 0)
            return true;
    }
    char **v = realloc(cfg->unknown_vars, (cfg->n_unknown_vars + 1) * sizeof *v);
    if (v == NULL)
        return false;
    cfg->unknown_vars = v;
    v[cfg->n_unknown_vars] = strndup(env, envlen);
    if (v[cfg->n_unknown_vars] == NULL)
        return false;
    cfg->n_unknown_vars++;
    return true;
}

bool tally_config_load_env(tally_config_t *cfg, char *const *envp, char *errstr, size_t errsz)
{
    for (char *const *e = envp; e != NULL && *e != NULL; e++) {
        const char *entry = *e;
        if (strncmp(entry, "TALLY_", 6) != 0)
            continue;
        const char *eq = strchr(entry, '=');
        if (eq == NULL)
            continue;
        size_t namelen = (size_t)(eq - entry);
        const char *value = eq + 1;

        const param_t *p = NULL;
        for (size_t i = 0; i < N_PARAMS; i++) {
            if (strlen(params[i].env) == namelen && strncmp(params[i].env, entry, namelen) == 0) {
                p = &params[i];
                break;
            }
        }
        bool ok;
        if (p != NULL)
            ok = set_param(cfg, p, value, errstr, errsz);
        else if (namelen > strlen(KAFKA_PREFIX) &&
                 strncmp(entry, KAFKA_PREFIX, strlen(KAFKA_PREFIX)) == 0)
            ok = set_kafka_prop(cfg, entry, namelen, value, errstr, errsz);
        else if (is_dev_export(entry, namelen))
            ok = true;
        else if (!(ok = add_unknown(cfg, entry, namelen)))
            snprintf(errstr, errsz, "%.*s: out of memory", (int)namelen, entry); /* lint: slice */
        if (!ok)
            return false;
    }
    if (!fill_computed(cfg)) {
        snprintf(errstr, errsz, "TALLY_WORKER_ID: out of memory computing the default");
        return false;
    }
    return true;
}

/* Names that suggest a credential; their values are printed as "***". */
static bool name_is_secret(const char *name)
{
    static const char *const words[] = {"PASSWORD", "SECRET", "KEY", "TOKEN", "CREDENTIAL"};
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        if (strcasestr(name, words[i]) != NULL)
            return true;
    }
    return false;
}

static void buf_add(char **out, size_t *o, const char *s, size_t n)
{
    memcpy(*out + *o, s, n);
    *o += n;
}

/* Conninfo "k=v k2='v 2'" form: replace the value of password=. Quoting follows libpq: a
 * single-quoted value with backslash escapes, else up to the next space. */
static void mask_conninfo(const char *s, char **out, size_t *o)
{
    const char *p = s;
    while (*p) {
        if (isspace((unsigned char)*p)) {
            buf_add(out, o, p++, 1);
            continue;
        }
        const char *kw = p;
        while (*p && *p != '=' && !isspace((unsigned char)*p))
            p++;
        size_t kwlen = (size_t)(p - kw);
        while (*p && (isspace((unsigned char)*p) || *p == '=')) /* " = " around the '=' */
            p++;
        const char *val = p;
        if (*p == '\'') {
            p++;
            while (*p && *p != '\'') {
                if (*p == '\\' && p[1])
                    p++;
                p++;
            }
            if (*p == '\'')
                p++;
        } else {
            while (*p && !isspace((unsigned char)*p))
                p++;
        }
        buf_add(out, o, kw, (size_t)(val - kw));
        if (kwlen == 8 && strncmp(kw, "password", 8) == 0)
            buf_add(out, o, "***", 3);
        else
            buf_add(out, o, val, (size_t)(p - val));
    }
}

/* Whether a URL's query parameter named @p name (@p n bytes) is likely a credential: a
 * password, a token, an API key, a signature, a session. */
static bool param_is_secret(const char *name, size_t n)
{
    static const char *const words[] = {"pass", "pwd", "secret",     "token",  "key",
                                        "auth", "sig", "credential", "session"};
    char lower[64];
    if (n >= sizeof lower)
        n = sizeof lower - 1;
    for (size_t i = 0; i < n; i++)
        lower[i] = (char)tolower((unsigned char)name[i]);
    lower[n] = '\0';
    for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
        if (strstr(lower, words[i]) != NULL)
            return true;
    }
    return false;
}

/* URI form: scheme://user:PASSWORD@host/path?password=PASSWORD&token=TOKEN&...: the userinfo's
 * password (a userinfo without one: all of it), every credential-looking query parameter
 * (param_is_secret) and a fragment become "***". */
static void mask_uri(const char *s, char **out, size_t *o)
{
    const char *auth = strstr(s, "://") + 3;
    const char *auth_end = auth + strcspn(auth, "/?#");
    const char *at = NULL;
    for (const char *q = auth; q < auth_end; q++) {
        if (*q == '@')
            at = q;
    }
    const char *p = s;
    if (at != NULL) {
        const char *colon = memchr(auth, ':', (size_t)(at - auth));
        /* user:PASSWORD@ keeps the user; a userinfo of one part is a token (TOKEN@host), but
         * for PostgreSQL a role name (postgresql://app@db) */
        bool pg = strncmp(s, "postgres", 8) == 0;
        if (colon != NULL || !pg) {
            buf_add(out, o, s, (size_t)((colon != NULL ? colon + 1 : auth) - s));
            buf_add(out, o, "***", 3);
            p = at;
        }
    }
    const char *query = strchr(p, '?');
    if (query == NULL) {
        buf_add(out, o, p, strlen(p));
        return;
    }
    buf_add(out, o, p, (size_t)(query + 1 - p));
    p = query + 1;
    while (*p) {
        size_t n = strcspn(p, "&#");
        const char *eq = memchr(p, '=', n);
        if (eq != NULL && param_is_secret(p, (size_t)(eq - p))) {
            buf_add(out, o, p, (size_t)(eq + 1 - p));
            buf_add(out, o, "***", 3);
        } else {
            buf_add(out, o, p, n);
        }
        p += n;
        if (*p == '#') { /* a fragment is not sent, and may hold anything: dropped */
            buf_add(out, o, "#***", 4);
            return;
        }
        if (*p)
            buf_add(out, o, p++, 1);
    }
}

/* A copy of @p s with its credentials replaced by "***": a URL's (mask_uri), or a libpq
 * conninfo's password when @p conninfo. The caller frees. A replacement adds at most 4 bytes,
 * and each needs at least 2 bytes of input ("k=", ":" before "@", "#"), so three times the
 * input length is always enough. */
static char *mask_value(const char *s, bool conninfo)
{
    size_t cap = strlen(s) * 3 + 8;
    char *out = malloc(cap);
    if (out == NULL)
        return NULL;
    size_t o = 0;
    if (strstr(s, "://") != NULL)
        mask_uri(s, &out, &o);
    else if (conninfo)
        mask_conninfo(s, &out, &o);
    else
        buf_add(&out, &o, s, strlen(s));
    out[o] = '\0';
    return out;
}

char *tally_config_mask(const char *value)
{
    return value != NULL ? mask_value(value, false) : NULL;
}

/* Text of a value for the table: quoted when empty, "***" when secret. Caller frees. */
static char *shown(const char *name, const char *value)
{
    if (value == NULL || value[0] == '\0')
        return strdup("\"\"");
    if (name_is_secret(name))
        return strdup("***");
    return mask_value(value, strcmp(name, "TALLY_PG") == 0);
}

static size_t edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (lb > 63)
        return SIZE_MAX;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
            size_t best = diag + cost;
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

static const char *closest_param(const char *name)
{
    const char *best = NULL;
    size_t best_d = 4; /* further than 3 edits is not a typo */
    for (size_t i = 0; i < N_PARAMS; i++) {
        size_t d = edit_distance(name, params[i].env);
        if (d < best_d) {
            best_d = d;
            best = params[i].env;
        }
    }
    return best;
}

/* Whether @p name is set in @p envp (to anything, even ""). */
static bool env_has(char *const *envp, const char *name)
{
    size_t n = strlen(name);
    for (char *const *e = envp; e != NULL && *e != NULL; e++) {
        if (strncmp(*e, name, n) == 0 && (*e)[n] == '=')
            return true;
    }
    return false;
}

/* The table, then the Kafka passthrough and the warnings; with @p envp a FROM column says
 * where each value came from. */
static void describe(const tally_config_t *cfg, char *const *envp, FILE *out);

void tally_config_describe(const tally_config_t *cfg, FILE *out)
{
    describe(cfg, NULL, out);
}

void tally_config_describe_env(const tally_config_t *cfg, char *const *envp, FILE *out)
{
    fprintf(out, "The settings of THIS shell: what a command or worker started from here reads\n"
                 "from its environment (FROM: \"env\" when this shell sets the variable, else\n"
                 "\"default\"). Workers already running read their own environment, which may\n"
                 "differ; for `tally dev`, first `source` the env file it writes (tally dev\n"
                 "--env-file PATH) to see what its workers run with.\n\n");
    describe(cfg, envp, out);
}

static void describe(const tally_config_t *cfg, char *const *envp, FILE *out)
{
    char *values[N_PARAMS];
    char *defaults[N_PARAMS];
    size_t w_name = strlen("VARIABLE"), w_val = strlen("VALUE"), w_def = strlen("DEFAULT");
    for (size_t i = 0; i < N_PARAMS; i++) {
        const param_t *p = &params[i];
        char num[16];
        if (p->type == PARAM_INT) {
            snprintf(num, sizeof num, "%d", int_value(cfg, p));
            values[i] = strdup(num);
        } else if (p->type == PARAM_SHARE) {
            snprintf(num, sizeof num, "%g", share_value(cfg, p));
            values[i] = strdup(num);
        } else {
            values[i] = shown(p->env, str_value(cfg, p));
        }
        if (p->def_note != NULL)
            defaults[i] = strdup(p->def_note);
        else if (p->def[0] == '\0')
            defaults[i] = strdup("\"\"");
        else
            defaults[i] = strdup(p->def);
        size_t n = strlen(p->env);
        w_name = n > w_name ? n : w_name;
        n = values[i] ? strlen(values[i]) : 0;
        w_val = n > w_val ? n : w_val;
        n = defaults[i] ? strlen(defaults[i]) : 0;
        w_def = n > w_def ? n : w_def;
    }

    fprintf(out, "%-*s  %-*s  %s%-*s  %s\n", (int)w_name, "VARIABLE", (int)w_val, "VALUE",
            envp != NULL ? "FROM     " : "", (int)w_def, "DEFAULT", "HELP");
    for (size_t i = 0; i < N_PARAMS; i++) {
        const char *from = envp == NULL                   ? ""
                           : env_has(envp, params[i].env) ? "env      "
                                                          : "default  ";
        fprintf(out, "%-*s  %-*s  %s%-*s  %s\n", (int)w_name, params[i].env, (int)w_val,
                values[i] ? values[i] : "(out of memory)", from, (int)w_def,
                defaults[i] ? defaults[i] : "(out of memory)", params[i].help);
        free(values[i]);
        free(defaults[i]);
    }

    fprintf(out, "\nKafka properties passed through (TALLY_KAFKA_<PROPERTY>, '_' -> '.'):\n");
    if (cfg->n_kafka_props == 0)
        fprintf(out, "  (none)\n");
    int w_env = 0;
    for (size_t i = 0; i < cfg->n_kafka_props; i++) {
        int n = (int)(strlen(KAFKA_PREFIX) + strlen(cfg->kafka_props[i].name));
        w_env = n > w_env ? n : w_env;
    }
    for (size_t i = 0; i < cfg->n_kafka_props; i++) {
        const tally_kv_t *kv = &cfg->kafka_props[i];
        fprintf(out, "  %s", KAFKA_PREFIX);
        for (const char *c = kv->name; *c; c++)
            fputc(*c == '.' ? '_' : toupper((unsigned char)*c), out);
        char *v = shown(kv->name, kv->value);
        fprintf(out, "%*s  %s = %s\n", w_env - (int)(strlen(KAFKA_PREFIX) + strlen(kv->name)), "",
                kv->name, v ? v : "(out of memory)");
        free(v);
    }

    for (size_t i = 0; i < cfg->n_unknown_vars; i++) {
        const char *near = closest_param(cfg->unknown_vars[i]);
        fprintf(out, "warning: %s is not a tally setting and is ignored", cfg->unknown_vars[i]);
        if (near != NULL)
            fprintf(out, " (did you mean %s?)", near);
        fprintf(out, "\n");
    }
}

bool tally_config_topic(const tally_config_t *cfg, const char *logical, char *out, size_t outsz)
{
    if (outsz == 0)
        return false;
    int n = snprintf(out, outsz, "%s%s", cfg->topic_prefix, logical);
    return n >= 0 && (size_t)n < outsz;
}

void tally_config_free(tally_config_t *cfg)
{
    if (cfg == NULL)
        return;
    for (size_t i = 0; i < N_PARAMS; i++) {
        if (params[i].type == PARAM_STRING)
            free(*str_field(cfg, &params[i]));
    }
    for (size_t i = 0; i < cfg->n_kafka_props; i++) {
        free(cfg->kafka_props[i].name);
        free(cfg->kafka_props[i].value);
    }
    free(cfg->kafka_props);
    for (size_t i = 0; i < cfg->n_unknown_vars; i++)
        free(cfg->unknown_vars[i]);
    free(cfg->unknown_vars);
    free(cfg);
}

const char *tally_config_reply_prefix(const tally_config_t *cfg, char *out, size_t outsz)
{
    if (cfg->reply_prefix != NULL && cfg->reply_prefix[0] != '\0')
        snprintf(out, outsz, "%s", cfg->reply_prefix);
    else
        snprintf(out, outsz, "%sreplies.", cfg->topic_prefix ? cfg->topic_prefix : "");
    return out;
}
