/* registry.c — the tool registry: load the JSON file, enforce DESIGN §4, build operation keys.
 *
 * Validation never stops at the first problem: an operator fixing a registry wants the whole
 * list at once. Each problem is one sentence "tool 'x': rule <id>: <what is wrong>", so a
 * worker's refusal to start and `tally tools check` read the same.
 */
#include "tally/registry.h"
#include "tally/json.h"
#include "tally/text.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

struct tally_registry {
    tally_tool_t *tools;
    size_t n;
    tally_problems_t warnings; /* accepted but weaker contracts (tally_registry_warnings) */
};

/* Upper bound of the millisecond settings the brief leaves open-ended: one day keeps every
 * sum and doubling of them inside an int. */
#define MS_MAX 86400000LL
/* compensation.deadline_ms: up to 24 days (it is an int) */
#define DEADLINE_MS_MAX 2073600000LL

#define NAME_MAX_LEN 63

static const char *const class_names[] = {
    [TALLY_CLASS_READ] = "read",
    [TALLY_CLASS_IDEMPOTENT] = "idempotent",
    [TALLY_CLASS_REVERSIBLE] = "reversible",
    [TALLY_CLASS_APPEND_ONLY] = "append_only",
    [TALLY_CLASS_DESTRUCTIVE] = "destructive",
};

static const char *const comp_mode_names[] = {
    [TALLY_COMP_AUTOMATIC] = "automatic",
    [TALLY_COMP_APPROVAL_REQUIRED] = "approval_required",
    [TALLY_COMP_MANUAL_RUNBOOK] = "manual_runbook",
    [TALLY_COMP_NOT_SUPPORTED] = "not_supported",
};

static const char *const http_methods[] = {"GET", "POST", "PUT", "PATCH", "DELETE"};

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

const char *tally_effect_class_name(tally_effect_class_t c)
{
    if ((size_t)c < N_ELEMS(class_names))
        return class_names[c];
    return "unknown";
}

bool tally_effect_class_parse(const char *s, tally_effect_class_t *out)
{
    if (s == NULL)
        return false;
    for (size_t i = 0; i < N_ELEMS(class_names); i++) {
        if (strcmp(s, class_names[i]) == 0) {
            if (out != NULL)
                *out = (tally_effect_class_t)i;
            return true;
        }
    }
    return false;
}

const char *tally_comp_mode_name(tally_comp_mode_t m)
{
    if ((size_t)m < N_ELEMS(comp_mode_names))
        return comp_mode_names[m];
    return "unknown";
}

static bool comp_mode_parse(const char *s, tally_comp_mode_t *out)
{
    for (size_t i = 0; i < N_ELEMS(comp_mode_names); i++) {
        if (strcmp(s, comp_mode_names[i]) == 0) {
            *out = (tally_comp_mode_t)i;
            return true;
        }
    }
    return false;
}

/* ---------------------------------------------------------------- problems */

void tally_problems_add(tally_problems_t *p, const char *fmt, ...)
{
    if (p == NULL)
        return;
    char **lines = realloc(p->lines, (p->n + 1) * sizeof *lines);
    if (lines == NULL)
        return;
    p->lines = lines;
    va_list ap;
    va_start(ap, fmt);
    char *line = NULL;
    int rc = vasprintf(&line, fmt, ap);
    va_end(ap);
    if (rc < 0) {
        /* Still say that something was wrong, even if we cannot say what. */
        line = strdup("out of memory while recording a registry problem");
        if (line == NULL)
            return;
    }
    p->lines[p->n++] = line;
}

void tally_problems_clear(tally_problems_t *p)
{
    if (p == NULL)
        return;
    for (size_t i = 0; i < p->n; i++)
        free(p->lines[i]);
    free(p->lines);
    p->lines = NULL;
    p->n = 0;
}

/* ---------------------------------------------------------------- small helpers */

/* A copy of @p s fit for one line of a message: at most @p bufsz - 4 bytes, control
 * characters and quotes replaced by '?', "..." when cut. Returns @p buf (bufsz >= 8). */
static const char *shown(const char *s, char *buf, size_t bufsz)
{
    /* cut on a character boundary: the text may quote a name from the file */
    size_t limit = tally_utf8_prefix(s, strlen(s), bufsz - 4);
    size_t i = 0;
    for (; s[i] != '\0' && i < limit; i++) {
        unsigned char c = (unsigned char)s[i];
        buf[i] = (c < 0x20 || c == 0x7f || c == '\'') ? '?' : (char)c;
    }
    if (s[i] != '\0') {
        memcpy(buf + i, "...", 3);
        i += 3;
    }
    buf[i] = '\0';
    return buf;
}

/* A JSON value as short text for "(got ...)". */
static const char *shown_json(const json_t *v, char *buf, size_t bufsz)
{
    char *text = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (text == NULL) {
        snprintf(buf, bufsz, "?");
        return buf;
    }
    shown(text, buf, bufsz);
    free(text);
    return buf;
}

static bool has_space_or_control(const char *s)
{
    for (; *s != '\0'; s++) {
        unsigned char c = (unsigned char)*s;
        if (c <= 0x20 || c == 0x7f)
            return true;
    }
    return false;
}

static bool env_name_valid(const char *s, size_t len)
{
    if (len == 0 || !((s[0] >= 'A' && s[0] <= 'Z') || (s[0] >= 'a' && s[0] <= 'z') || s[0] == '_'))
        return false;
    for (size_t i = 1; i < len; i++) {
        char c = s[i];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
              c == '_'))
            return false;
    }
    return true;
}

/* ^[a-z][a-z0-9_.-]{0,62}$ */
static bool tool_name_valid(const char *s)
{
    size_t len = strlen(s);
    if (len == 0 || len > NAME_MAX_LEN || !(s[0] >= 'a' && s[0] <= 'z'))
        return false;
    for (size_t i = 1; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-'))
            return false;
    }
    return true;
}

/* RFC 6901: "" or '/'-separated tokens where '~' is only followed by '0' or '1'. */
static bool json_pointer_valid(const char *s)
{
    if (s[0] == '\0')
        return true;
    if (s[0] != '/')
        return false;
    for (const char *p = s; *p != '\0'; p++) {
        if (*p == '~' && p[1] != '0' && p[1] != '1')
            return false;
    }
    return true;
}

/* ---------------------------------------------------------------- validation context */

typedef struct vctx {
    tally_problems_t *problems;
    tally_problems_t *warnings; /* the registry's own list; NULL until it exists */
    size_t found;    /* problems found; counted even when recording one ran out of memory */
    char label[128]; /* "tool 'charge_card'", "tool #3" or "registry" */
} vctx_t;

static void problem(vctx_t *v, const char *rule, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void problem(vctx_t *v, const char *rule, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    v->found++;
    tally_problems_add(v->problems, "%s: rule %s: %s", v->label, rule, msg);
}

/* A warning: the contract is accepted, but weaker than it should be. */
static void warning(vctx_t *v, const char *rule, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void warning(vctx_t *v, const char *rule, const char *fmt, ...)
{
    if (v->warnings == NULL)
        return;
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    tally_problems_add(v->warnings, "%s: rule %s: %s", v->label, rule, msg);
}

/* strdup that records running out of memory as a problem. */
static char *vdup(vctx_t *v, const char *s)
{
    if (s == NULL)
        return NULL;
    char *d = strdup(s);
    if (d == NULL)
        problem(v, "internal", "out of memory");
    return d;
}

static void endpoint_free(tally_endpoint_t *e)
{
    free(e->method);
    free(e->path);
    e->method = NULL;
    e->path = NULL;
}

static void tool_free(tally_tool_t *t)
{
    free(t->name);
    free(t->owner);
    for (size_t i = 0; i < t->n_operation_key; i++)
        free(t->operation_key[i]);
    free(t->operation_key);
    free(t->base_url);
    endpoint_free(&t->execute);
    endpoint_free(&t->status);
    endpoint_free(&t->compensate);
    endpoint_free(&t->contain);
    endpoint_free(&t->list);
    free(t->receipt_ref);
    free(t->secret_env);
    free(t->signing.key_id);
    free(t->signing.secret_env);
    free(t->runbook);
    for (size_t i = 0; i < t->n_sensitive_args; i++)
        free(t->sensitive_args[i]);
    free(t->sensitive_args);
    for (size_t i = 0; i < t->n_sensitive_receipt; i++)
        free(t->sensitive_receipt[i]);
    free(t->sensitive_receipt);
    memset(t, 0, sizeof *t);
}

/* An optional integer setting: @p def when absent, else it must lie in [lo, hi].
 * Sets *@p given when the field was present and valid. */
static int int_field(vctx_t *v, const json_t *obj, const char *key, const char *where, int def,
                     long long lo, long long hi, bool *given)
{
    if (given != NULL)
        *given = false;
    const json_t *x = obj != NULL ? json_object_get(obj, key) : NULL;
    if (x == NULL)
        return def;
    char got[80];
    if (!json_is_integer(x) || json_integer_value(x) < lo || json_integer_value(x) > hi) {
        problem(v, "numeric-range", "%s must be an integer from %lld to %lld (got %s)", where, lo,
                hi, shown_json(x, got, sizeof got));
        return def;
    }
    if (given != NULL)
        *given = true;
    return (int)json_integer_value(x);
}

/* Optional object member: NULL when absent; a problem when present but not an object. */
static const json_t *object_field(vctx_t *v, const json_t *obj, const char *key, const char *rule)
{
    const json_t *x = json_object_get(obj, key);
    if (x != NULL && !json_is_object(x)) {
        problem(v, rule, "%s must be an object", key);
        return NULL;
    }
    return x;
}

typedef enum { EP_ABSENT, EP_INVALID, EP_OK } ep_state_t;

/* connector.<key>: {"method": ..., "path": ...}. Problems go under @p rule. */
static ep_state_t endpoint_field(vctx_t *v, const json_t *conn, const char *key, const char *rule,
                                 bool required, bool is_status, tally_endpoint_t *out)
{
    const json_t *ep = json_object_get(conn, key);
    if (ep == NULL) {
        if (required)
            problem(v, rule,
                    "connector.%s is required (an object with \"method\" and \"path\", e.g. "
                    "{\"method\": \"POST\", \"path\": \"/charges\"})",
                    key);
        return EP_ABSENT;
    }
    if (!json_is_object(ep)) {
        problem(v, rule, "connector.%s must be an object with \"method\" and \"path\"", key);
        return EP_INVALID;
    }
    bool ok = true;
    char got[80];
    const json_t *method = json_object_get(ep, "method");
    const char *m = json_string_value(method);
    bool method_ok = false;
    if (m != NULL) {
        for (size_t i = 0; i < N_ELEMS(http_methods); i++)
            method_ok = method_ok || strcmp(m, http_methods[i]) == 0;
    }
    if (method == NULL) {
        problem(v, rule, "connector.%s.method is required (GET, POST, PUT, PATCH or DELETE)", key);
        ok = false;
    } else if (!method_ok) {
        problem(v, rule,
                "connector.%s.method must be one of GET, POST, PUT, PATCH, DELETE (got %s)", key,
                shown_json(method, got, sizeof got));
        ok = false;
    }
    const json_t *path = json_object_get(ep, "path");
    const char *p = json_string_value(path);
    if (path == NULL) {
        problem(v, rule, "connector.%s.path is required (a path starting with '/')", key);
        ok = false;
    } else if (p == NULL || p[0] != '/') {
        problem(v, rule, "connector.%s.path must be a string starting with '/' (got %s)", key,
                shown_json(path, got, sizeof got));
        ok = false;
    } else if (has_space_or_control(p) || strchr(p, '#') != NULL) {
        problem(v, rule, "connector.%s.path must not contain spaces, control characters or '#'",
                key);
        ok = false;
    } else if (is_status && strchr(p, '?') != NULL) {
        problem(v, rule,
                "connector.%s.path must not carry a query string: tally appends "
                "?idempotency_key=<operation key> itself",
                key);
        ok = false;
    }
    if (!ok)
        return EP_INVALID;
    out->method = vdup(v, m);
    out->path = vdup(v, p);
    return EP_OK;
}

/*
 * Expand ${VAR} and ${VAR:-default} from the environment. ${VAR:-d} uses d when VAR is unset
 * or empty, as the shell does. Returns the malloc'd result, or NULL after recording a problem.
 */
static char *expand_env(vctx_t *v, const char *raw)
{
    tally_strbuf_t b = {0};
    const char *p = raw;
    char shown1[80];
    while (*p != '\0') {
        const char *open = strstr(p, "${");
        if (open == NULL) {
            tally_strbuf_puts(&b, p);
            break;
        }
        tally_strbuf_put(&b, p, (size_t)(open - p));
        const char *name = open + 2;
        const char *close = strchr(name, '}');
        if (close == NULL) {
            problem(v, "base-url-env", "connector.base_url '%s' has a '${' without its closing '}'",
                    shown(raw, shown1, sizeof shown1));
            free(b.s);
            return NULL;
        }
        const char *sep = strstr(name, ":-");
        bool has_default = sep != NULL && sep < close;
        size_t name_len = (size_t)((has_default ? sep : close) - name);
        char var[128];
        if (!env_name_valid(name, name_len) || name_len >= sizeof var) {
            problem(v, "base-url-env",
                    "connector.base_url '%s': '${...}' must name an environment variable "
                    "([A-Za-z_][A-Za-z0-9_]*), optionally with ':-default'",
                    shown(raw, shown1, sizeof shown1));
            free(b.s);
            return NULL;
        }
        memcpy(var, name, name_len);
        var[name_len] = '\0';
        const char *value = getenv(var);
        if (has_default && (value == NULL || value[0] == '\0')) {
            tally_strbuf_put(&b, sep + 2, (size_t)(close - (sep + 2)));
        } else if (value == NULL) {
            problem(v, "base-url-env",
                    "connector.base_url uses ${%s}, which is not set in the environment and has no "
                    "default (write ${%s:-http://host:port} to give one)",
                    var, var);
            free(b.s);
            return NULL;
        } else {
            tally_strbuf_puts(&b, value);
        }
        p = close + 1;
    }
    char *out = tally_strbuf_take(&b);
    if (out == NULL)
        problem(v, "internal", "out of memory");
    return out;
}

static void base_url_field(vctx_t *v, const json_t *conn, tally_tool_t *t)
{
    const json_t *x = json_object_get(conn, "base_url");
    char got[80], raw_shown[80];
    if (x == NULL) {
        problem(v, "connector-base-url",
                "connector.base_url is required (e.g. \"https://billing.internal\" or "
                "\"${BILLING_URL:-http://127.0.0.1:9000}\")");
        return;
    }
    const char *raw = json_string_value(x);
    if (raw == NULL || raw[0] == '\0') {
        problem(v, "connector-base-url",
                "connector.base_url must be a non-empty string starting with http:// or https:// "
                "(got %s)",
                shown_json(x, got, sizeof got));
        return;
    }
    char *url = expand_env(v, raw);
    if (url == NULL)
        return;
    bool expanded = strcmp(url, raw) != 0;
    size_t scheme = 0;
    if (strncasecmp(url, "http://", 7) == 0)
        scheme = 7;
    else if (strncasecmp(url, "https://", 8) == 0)
        scheme = 8;
    /* Paths are appended to base_url and start with '/': drop its trailing ones. */
    size_t len = strlen(url);
    while (len > scheme && url[len - 1] == '/')
        url[--len] = '\0';
    /* Name the expanded value, and the raw one when ${...} changed it. */
    char desc[200], u[80];
    if (expanded)
        snprintf(desc, sizeof desc, "'%s' (from '%s')", shown(url, u, sizeof u),
                 shown(raw, raw_shown, sizeof raw_shown));
    else
        snprintf(desc, sizeof desc, "'%s'", shown(url, u, sizeof u));
    if (scheme == 0) {
        problem(v, "connector-base-url",
                "connector.base_url %s must start with http:// or https://", desc);
    } else if (url[scheme] == '\0' || url[scheme] == '/') {
        problem(v, "connector-base-url", "connector.base_url %s has no host", desc);
    } else if (has_space_or_control(url) || strpbrk(url, "?#") != NULL) {
        problem(v, "connector-base-url",
                "connector.base_url %s must not contain spaces, control characters, '?' or '#'",
                desc);
    } else {
        t->base_url = url;
        return;
    }
    free(url);
}

/* A key id is sent as a structured-field string: printable ASCII without '"' or '\\'; kept
 * to a token-like alphabet so it reads the same in logs and configuration. */
static bool key_id_valid(const char *s)
{
    size_t n = strlen(s);
    return n > 0 && n <= 64 &&
           strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-") == n;
}

/* connector.signing: {"scheme": "rfc9421", "key_id", "secret_env", "window_s"}. */
static void signing_field(vctx_t *v, const json_t *conn, tally_tool_t *t)
{
    char got[80];
    const json_t *sig = json_object_get(conn, "signing");
    if (sig == NULL)
        return;
    if (!json_is_object(sig)) {
        problem(v, "signing",
                "connector.signing must be an object {\"scheme\": \"rfc9421\", \"key_id\", "
                "\"secret_env\"}");
        return;
    }
    bool ok = true;
    const char *scheme = json_string_value(json_object_get(sig, "scheme"));
    if (scheme == NULL || strcmp(scheme, "rfc9421") != 0) {
        problem(v, "signing", "connector.signing.scheme must be \"rfc9421\" (got %s)",
                shown_json(json_object_get(sig, "scheme"), got, sizeof got));
        ok = false;
    }
    const json_t *kid = json_object_get(sig, "key_id");
    if (!json_is_string(kid) || !key_id_valid(json_string_value(kid))) {
        problem(v, "signing",
                "connector.signing.key_id must be 1 to 64 characters of [A-Za-z0-9._:-] (got %s)",
                shown_json(kid, got, sizeof got));
        ok = false;
    }
    const json_t *env = json_object_get(sig, "secret_env");
    const char *es = json_string_value(env);
    if (es == NULL || !env_name_valid(es, strlen(es))) {
        problem(v, "signing",
                "connector.signing.secret_env must be an environment variable name "
                "([A-Za-z_][A-Za-z0-9_]*) (got %s)",
                shown_json(env, got, sizeof got));
        ok = false;
    }
    int window = int_field(v, sig, "window_s", "connector.signing.window_s", 300, 1, 3600, NULL);
    if (!ok)
        return;
    t->signing.scheme = TALLY_SIGNING_RFC9421;
    t->signing.key_id = vdup(v, json_string_value(kid));
    t->signing.secret_env = vdup(v, es);
    t->signing.window_s = window;
}

static void connector_fields(vctx_t *v, const json_t *conn, tally_tool_t *t, ep_state_t *status,
                             ep_state_t *compensate)
{
    char got[80];
    const json_t *type = json_object_get(conn, "type");
    const char *ts = json_string_value(type);
    if (type == NULL)
        problem(v, "connector-type", "connector.type is required and must be \"http\"");
    else if (ts == NULL || strcmp(ts, "http") != 0)
        problem(v, "connector-type", "connector.type must be \"http\" (got %s)",
                shown_json(type, got, sizeof got));

    base_url_field(v, conn, t);

    endpoint_field(v, conn, "execute", "execute-endpoint", true, false, &t->execute);
    *status = endpoint_field(v, conn, "status", "endpoint", false, true, &t->status);
    *compensate = endpoint_field(v, conn, "compensate", "endpoint", false, false, &t->compensate);
    /* append_only's containment action; optional for every class. */
    (void)endpoint_field(v, conn, "contain", "endpoint", false, false, &t->contain);
    /* the orphan sweep's question: tally appends ?run_id= or ?since= itself */
    (void)endpoint_field(v, conn, "list", "endpoint", false, true, &t->list);

    t->timeout_ms = int_field(v, conn, "timeout_ms", "connector.timeout_ms", 5000, 1, 600000, NULL);

    const json_t *ref = json_object_get(conn, "receipt_ref");
    if (ref == NULL) {
        t->receipt_ref = vdup(v, "/id");
    } else if (!json_is_string(ref) || !json_pointer_valid(json_string_value(ref))) {
        problem(v, "receipt-ref",
                "connector.receipt_ref must be a JSON pointer into the receipt: \"\" or a string "
                "starting with '/', '~' only as ~0 or ~1 (got %s)",
                shown_json(ref, got, sizeof got));
    } else {
        t->receipt_ref = vdup(v, json_string_value(ref));
    }

    const json_t *sec = json_object_get(conn, "secret_env");
    if (sec != NULL) {
        const char *s = json_string_value(sec);
        if (s == NULL || !env_name_valid(s, strlen(s)))
            problem(v, "secret-env",
                    "connector.secret_env must be an environment variable name "
                    "([A-Za-z_][A-Za-z0-9_]*) (got %s)",
                    shown_json(sec, got, sizeof got));
        else
            t->secret_env = vdup(v, s);
    }
    signing_field(v, conn, t);
    if (t->secret_env != NULL && t->signing.scheme == TALLY_SIGNING_NONE)
        warning(v, "legacy-signature",
                "connector.secret_env alone signs with the legacy Tally-Signature, which covers "
                "only the timestamp and the body (not the method, URL or idempotency key); add "
                "connector.signing {\"scheme\": \"rfc9421\", ...} (docs/connectors.md)");
}

static void operation_key_field(vctx_t *v, const json_t *obj, tally_tool_t *t)
{
    const json_t *ok = json_object_get(obj, "operation_key");
    if (ok == NULL)
        return;
    if (!json_is_array(ok) || json_array_size(ok) == 0) {
        problem(v, "operation-key",
                "operation_key must be a non-empty array of argument names (omit it when every "
                "intent carries its own operation_key)");
        return;
    }
    size_t n = json_array_size(ok);
    bool valid = true;
    for (size_t i = 0; i < n; i++) {
        const char *s = json_string_value(json_array_get(ok, i));
        char got[80];
        if (s == NULL || s[0] == '\0') {
            problem(v, "operation-key",
                    "operation_key[%zu] must be a non-empty string naming an argument (got %s)", i,
                    shown_json(json_array_get(ok, i), got, sizeof got));
            valid = false;
            continue;
        }
        for (size_t j = 0; j < i; j++) {
            const char *prev = json_string_value(json_array_get(ok, j));
            if (prev != NULL && strcmp(prev, s) == 0) {
                problem(v, "operation-key", "operation_key names '%s' more than once",
                        shown(s, got, sizeof got));
                valid = false;
                break;
            }
        }
    }
    if (!valid)
        return;
    t->operation_key = calloc(n, sizeof *t->operation_key);
    if (t->operation_key == NULL) {
        problem(v, "internal", "out of memory");
        return;
    }
    t->n_operation_key = n;
    for (size_t i = 0; i < n; i++)
        t->operation_key[i] = vdup(v, json_string_value(json_array_get(ok, i)));
}

/* Whether pointer @p ptr names @p within or something inside it ("/card" covers "/card/number"). */
static bool pointer_covers(const char *ptr, const char *within)
{
    size_t n = strlen(ptr);
    return strncmp(ptr, within, n) == 0 && (within[n] == '\0' || within[n] == '/');
}

/* Whether two pointers name overlapping values: one is the other or inside it. */
static bool pointers_overlap(const char *a, const char *b)
{
    return pointer_covers(a, b) || pointer_covers(b, a);
}

/* sensitive.args or sensitive.receipt: an array of distinct JSON pointers naming members. */
static void sensitive_list(vctx_t *v, const json_t *sens, const char *key, char ***out,
                           size_t *nout)
{
    const json_t *list = json_object_get(sens, key);
    if (list == NULL)
        return;
    char got[80];
    if (!json_is_array(list)) {
        problem(v, "sensitive",
                "sensitive.%s must be an array of JSON pointers such as \"/card/number\" (got %s)",
                key, shown_json(list, got, sizeof got));
        return;
    }
    size_t n = json_array_size(list);
    char **ptrs = calloc(n ? n : 1, sizeof *ptrs);
    if (ptrs == NULL) {
        problem(v, "internal", "out of memory");
        return;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const char *s = json_string_value(json_array_get(list, i));
        if (s == NULL || s[0] != '/' || !json_pointer_valid(s)) {
            problem(v, "sensitive",
                    "sensitive.%s[%zu] must be a JSON pointer naming a member, like \"/ssn\" or "
                    "\"/card/number\" (got %s)",
                    key, i, shown_json(json_array_get(list, i), got, sizeof got));
            continue;
        }
        ptrs[k] = vdup(v, s);
        if (ptrs[k] != NULL)
            k++;
    }
    *out = ptrs;
    *nout = k;
}

/* The registry's "sensitive" object, and what it may not cover: the args an operation key is
 * built from (the key is stored and sent in clear) and the receipt's ref (the ledger indexes it).
 */
static void sensitive_fields(vctx_t *v, const json_t *obj, tally_tool_t *t)
{
    const json_t *sens = object_field(v, obj, "sensitive", "sensitive");
    if (sens == NULL)
        return;
    const char *k;
    const json_t *val;
    json_object_foreach((json_t *)sens, k, val)
    {
        if (strcmp(k, "args") != 0 && strcmp(k, "receipt") != 0) {
            char got[80];
            problem(v, "sensitive", "sensitive has \"%s\"; it takes \"args\" and \"receipt\" only",
                    shown(k, got, sizeof got));
        }
    }
    sensitive_list(v, sens, "args", &t->sensitive_args, &t->n_sensitive_args);
    sensitive_list(v, sens, "receipt", &t->sensitive_receipt, &t->n_sensitive_receipt);
    for (size_t i = 0; i < t->n_sensitive_args; i++)
        for (size_t j = 0; j < t->n_operation_key; j++) {
            char arg[300]; /* args.<name> as a pointer: '~' and '/' escaped (RFC 6901) */
            size_t n = 0;
            arg[n++] = '/';
            for (const char *c = t->operation_key[j]; *c && n + 3 < sizeof arg; c++) {
                if (*c == '~' || *c == '/') {
                    arg[n++] = '~';
                    arg[n++] = *c == '~' ? '0' : '1';
                } else {
                    arg[n++] = *c;
                }
            }
            arg[n] = '\0';
            if (pointers_overlap(t->sensitive_args[i], arg))
                problem(v, "sensitive-operation-key",
                        "sensitive.args %s covers args.%s, which operation_key is built from: "
                        "the operation key is stored and sent in clear; build it from other args",
                        t->sensitive_args[i], t->operation_key[j]);
        }
    const char *ref = t->receipt_ref != NULL ? t->receipt_ref : "/id";
    for (size_t i = 0; i < t->n_sensitive_receipt; i++)
        if (ref[0] == '\0' || pointers_overlap(t->sensitive_receipt[i], ref))
            problem(v, "sensitive-receipt-ref",
                    "sensitive.receipt %s covers connector.receipt_ref %s: the external ref is "
                    "stored in clear and indexed",
                    t->sensitive_receipt[i], ref[0] ? ref : "\"\"");
}

static void compensation_fields(vctx_t *v, const json_t *obj, tally_tool_t *t)
{
    t->comp_mode = TALLY_COMP_AUTOMATIC;
    const json_t *comp = object_field(v, obj, "compensation", "compensation-mode");
    if (comp == NULL)
        return;
    char got[80];
    const json_t *mode = json_object_get(comp, "mode");
    const char *ms = json_string_value(mode);
    if (mode != NULL && (ms == NULL || !comp_mode_parse(ms, &t->comp_mode)))
        problem(v, "compensation-mode",
                "compensation.mode must be one of automatic, approval_required, manual_runbook, "
                "not_supported (got %s)",
                shown_json(mode, got, sizeof got));
    const json_t *rb = json_object_get(comp, "runbook");
    if (rb != NULL) {
        const char *s = json_string_value(rb);
        if (s == NULL)
            problem(v, "field-type", "compensation.runbook must be a string (a URL or a path)");
        else if (s[0] != '\0')
            t->runbook = vdup(v, s);
    }
    if (t->comp_mode == TALLY_COMP_MANUAL_RUNBOOK && t->runbook == NULL &&
        (rb == NULL || json_is_string(rb)))
        problem(v, "runbook-required",
                "compensation.mode manual_runbook needs compensation.runbook: the link the "
                "on-call engineer is paged with");
    t->deadline_ms = int_field(v, comp, "deadline_ms", "compensation.deadline_ms", 0, 1000,
                               DEADLINE_MS_MAX, NULL);
}

/* A number in [lo, hi], or (lo, hi] with @p lo_open (an integer is a number too). */
static double number_field(vctx_t *v, const json_t *obj, const char *key, const char *where,
                           double def, double lo, bool lo_open, double hi)
{
    const json_t *x = obj != NULL ? json_object_get(obj, key) : NULL;
    if (x == NULL)
        return def;
    char got[80];
    double d = json_number_value(x);
    if (!json_is_number(x) || d > hi || d < lo || (lo_open && d == lo)) {
        problem(v, "numeric-range", "%s must be a number %s %g and at most %g (got %s)", where,
                lo_open ? "above" : "from", lo, hi, shown_json(x, got, sizeof got));
        return def;
    }
    return d;
}

/* "audit": {"enabled", "delay_ms", "again_ms", "sample_rate", "rate_per_s", "sweep_ms",
 * "lookback_ms"}. Present means enabled unless "enabled": false. */
static void audit_fields(vctx_t *v, const json_t *obj, tally_tool_t *t, ep_state_t status)
{
    static const char *const known[] = {"enabled",    "delay_ms", "again_ms",   "sample_rate",
                                        "rate_per_s", "sweep_ms", "lookback_ms"};
    tally_audit_policy_t *a = &t->audit;
    const json_t *audit = object_field(v, obj, "audit", "audit");
    char got[80];
    const char *key;
    const json_t *val;
    if (audit != NULL) {
        json_object_foreach((json_t *)audit, key, val)
        {
            bool ok = false;
            for (size_t i = 0; i < N_ELEMS(known); i++)
                ok = ok || strcmp(key, known[i]) == 0;
            if (!ok)
                problem(v, "audit",
                        "audit has \"%s\"; it takes enabled, delay_ms, again_ms, sample_rate, "
                        "rate_per_s, sweep_ms and lookback_ms",
                        shown(key, got, sizeof got));
        }
    }
    const json_t *en = audit != NULL ? json_object_get(audit, "enabled") : NULL;
    if (en != NULL && !json_is_boolean(en))
        problem(v, "field-type", "audit.enabled must be true or false (got %s)",
                shown_json(en, got, sizeof got));
    a->enabled = audit != NULL && !json_is_false(en);
    a->delay_ms = int_field(v, audit, "delay_ms", "audit.delay_ms", 60000, 0, MS_MAX, NULL);
    a->again_ms = int_field(v, audit, "again_ms", "audit.again_ms", 0, 0, MS_MAX, NULL);
    a->sample_rate = number_field(v, audit, "sample_rate", "audit.sample_rate", 1.0, 0, true, 1);
    a->rate_per_s = number_field(v, audit, "rate_per_s", "audit.rate_per_s", 5, 0, true, 10000);
    bool sweep_given = false;
    a->sweep_ms = int_field(v, audit, "sweep_ms", "audit.sweep_ms",
                            t->list.path != NULL ? 300000 : 0, 0, MS_MAX, &sweep_given);
    a->lookback_ms =
        int_field(v, audit, "lookback_ms", "audit.lookback_ms", 86400000, 1000, MS_MAX, NULL);
    if (a->enabled && status == EP_ABSENT && t->base_url != NULL)
        problem(v, "audit-needs-status",
                "audit re-checks CONFIRMED effects with the tool's status check: declare "
                "connector.status, or set \"audit\": {\"enabled\": false}");
    if (sweep_given && a->sweep_ms > 0 && t->list.path == NULL && t->base_url != NULL)
        problem(v, "sweep-needs-list",
                "audit.sweep_ms sweeps the tool's records for orphans with connector.list: "
                "declare it, or remove audit.sweep_ms");
}

static void retry_fields(vctx_t *v, const json_t *obj, tally_tool_t *t)
{
    const json_t *retry = object_field(v, obj, "retry", "field-type");
    bool backoff_given = false, max_given = false;
    t->max_attempts = int_field(v, retry, "max_attempts", "retry.max_attempts", 5, 1, 100, NULL);
    t->backoff_ms =
        int_field(v, retry, "backoff_ms", "retry.backoff_ms", 200, 1, MS_MAX, &backoff_given);
    t->max_backoff_ms =
        int_field(v, retry, "max_backoff_ms", "retry.max_backoff_ms", 60000, 1, MS_MAX, &max_given);
    if (t->max_backoff_ms < t->backoff_ms)
        problem(v, "numeric-range",
                "retry.max_backoff_ms (%d%s) must be at least retry.backoff_ms (%d%s)",
                t->max_backoff_ms, max_given ? "" : ", the default", t->backoff_ms,
                backoff_given ? "" : ", the default");
}

/* Validate tools[index] into @p t; @p prev are the tools before it (for unique names). */
static void tool_load(vctx_t *v, const json_t *obj, size_t index, const tally_tool_t *prev,
                      tally_tool_t *t)
{
    char got[80];
    snprintf(v->label, sizeof v->label, "tool #%zu", index + 1);
    if (!json_is_object(obj)) {
        problem(v, "tool-shape", "each entry of \"tools\" must be an object (got %s)",
                shown_json(obj, got, sizeof got));
        return;
    }

    const json_t *name = json_object_get(obj, "name");
    const char *ns = json_string_value(name);
    if (ns != NULL && ns[0] != '\0')
        snprintf(v->label, sizeof v->label, "tool '%s'", shown(ns, got, sizeof got));
    if (name == NULL) {
        problem(v, "tool-name", "name is required (a string matching ^[a-z][a-z0-9_.-]{0,62}$)");
    } else if (ns == NULL || ns[0] == '\0') {
        problem(v, "tool-name",
                "name must be a non-empty string matching ^[a-z][a-z0-9_.-]{0,62}$ (got %s)",
                shown_json(name, got, sizeof got));
    } else {
        if (!tool_name_valid(ns))
            problem(v, "tool-name", "name must match ^[a-z][a-z0-9_.-]{0,62}$");
        for (size_t j = 0; j < index; j++) {
            if (prev[j].name != NULL && strcmp(prev[j].name, ns) == 0) {
                problem(v, "unique-name",
                        "tool #%zu repeats the name of tool #%zu; names must be unique", index + 1,
                        j + 1);
                break;
            }
        }
        t->name = vdup(v, ns);
    }

    const json_t *owner = json_object_get(obj, "owner");
    if (owner != NULL) {
        if (!json_is_string(owner))
            problem(v, "field-type", "owner must be a string (a team or a person)");
        else
            t->owner = vdup(v, json_string_value(owner));
    }

    bool have_class = false;
    const json_t *cls = json_object_get(obj, "effect_class");
    if (cls == NULL)
        problem(v, "effect-class",
                "effect_class is required: one of read, idempotent, reversible, append_only, "
                "destructive");
    else if (!json_is_string(cls) ||
             !tally_effect_class_parse(json_string_value(cls), &t->effect_class))
        problem(v, "effect-class",
                "effect_class %s is not one of read, idempotent, reversible, append_only, "
                "destructive",
                shown_json(cls, got, sizeof got));
    else
        have_class = true;

    operation_key_field(v, obj, t);

    ep_state_t status = EP_ABSENT, compensate = EP_ABSENT;
    const json_t *conn = json_object_get(obj, "connector");
    bool have_conn = false;
    if (conn == NULL) {
        problem(v, "connector-type",
                "connector is required: an object with type \"http\", base_url and execute");
    } else if (!json_is_object(conn)) {
        problem(v, "connector-type",
                "connector must be an object with type \"http\", base_url and execute");
    } else {
        have_conn = true;
        connector_fields(v, conn, t, &status, &compensate);
    }

    compensation_fields(v, obj, t);
    retry_fields(v, obj, t);
    sensitive_fields(v, obj, t);
    audit_fields(v, obj, t, status);
    t->settle_ms = int_field(v, obj, "settle_ms", "settle_ms", 2000, 0, MS_MAX, NULL);
    t->max_concurrency =
        int_field(v, obj, "max_concurrency", "max_concurrency", 64, 1, 10000, NULL);

    const json_t *approval = json_object_get(obj, "requires_approval");
    if (approval != NULL && !json_is_boolean(approval))
        problem(v, "field-type", "requires_approval must be true or false (got %s)",
                shown_json(approval, got, sizeof got));
    t->requires_approval = approval != NULL && json_is_true(approval);

    if (!have_class)
        return;
    switch (t->effect_class) {
    case TALLY_CLASS_REVERSIBLE:
        /* An endpoint declared but malformed was reported already under rule endpoint. */
        if (have_conn && compensate == EP_ABSENT)
            problem(v, "reversible-needs-compensate",
                    "a reversible tool must declare connector.compensate (the reverse call)");
        if (have_conn && status == EP_ABSENT)
            problem(v, "reversible-needs-status",
                    "a reversible tool must declare connector.status (the status check that "
                    "resolves UNKNOWN)");
        break;
    case TALLY_CLASS_DESTRUCTIVE:
        if (approval != NULL && json_is_false(approval))
            problem(v, "destructive-requires-approval",
                    "a destructive tool always requires approval; remove \"requires_approval\": "
                    "false");
        t->requires_approval = true;
        break;
    case TALLY_CLASS_READ:
    case TALLY_CLASS_IDEMPOTENT:
    case TALLY_CLASS_APPEND_ONLY:
        /* append_only without status is allowed: an UNKNOWN outcome goes STUCK. */
        break;
    }
}

/* ---------------------------------------------------------------- the registry */

void tally_registry_free(tally_registry_t *reg)
{
    if (reg == NULL)
        return;
    for (size_t i = 0; i < reg->n; i++)
        tool_free(&reg->tools[i]);
    free(reg->tools);
    tally_problems_clear(&reg->warnings);
    free(reg);
}

tally_registry_t *tally_registry_load_json(const json_t *doc, tally_problems_t *problems)
{
    vctx_t v = {.problems = problems};
    snprintf(v.label, sizeof v.label, "registry");
    const json_t *tools = json_is_object(doc) ? json_object_get(doc, "tools") : NULL;
    if (!json_is_array(tools)) {
        problem(&v, "registry-shape",
                "the top level must be a JSON object with a \"tools\" array (got %s)",
                json_is_object(doc) ? (tools == NULL ? "an object without \"tools\""
                                                     : "\"tools\" that is not an array")
                                    : "something other than an object");
        return NULL;
    }
    tally_registry_t *reg = calloc(1, sizeof *reg);
    size_t n = json_array_size(tools);
    if (reg == NULL || (n > 0 && (reg->tools = calloc(n, sizeof *reg->tools)) == NULL)) {
        problem(&v, "internal", "out of memory");
        free(reg);
        return NULL;
    }
    reg->n = n;
    v.warnings = &reg->warnings;
    for (size_t i = 0; i < n; i++)
        tool_load(&v, json_array_get(tools, i), i, reg->tools, &reg->tools[i]);
    if (v.found > 0) {
        tally_registry_free(reg);
        return NULL;
    }
    return reg;
}

tally_registry_t *tally_registry_load_file(const char *path, tally_problems_t *problems)
{
    json_error_t jerr;
    json_t *doc = json_load_file(path, TALLY_JSON_LOAD_FLAGS, &jerr);
    if (doc == NULL) {
        /* jansson quotes the text near the error byte by byte, so it can end inside a
         * character ("invalid escape near '"a \<first byte of é>'"): a problem line is printed
         * and logged as JSON, and must stay valid UTF-8 (tests/fuzz/regressions/registry). */
        char why[sizeof jerr.text];
        tally_text_copy(why, sizeof why, jerr.text);
        if (json_error_code(&jerr) == json_error_cannot_open_file)
            tally_problems_add(problems, "registry: rule file: cannot read the registry: %s", why);
        else
            tally_problems_add(problems,
                               "registry: rule json: not valid JSON at line %d, column %d: %s",
                               jerr.line, jerr.column, why);
        return NULL;
    }
    tally_registry_t *reg = tally_registry_load_json(doc, problems);
    json_decref(doc);
    return reg;
}

const tally_problems_t *tally_registry_warnings(const tally_registry_t *reg)
{
    static const tally_problems_t none = {0};
    return reg != NULL ? &reg->warnings : &none;
}

const tally_tool_t *tally_registry_find(const tally_registry_t *reg, const char *name)
{
    if (reg == NULL || name == NULL)
        return NULL;
    for (size_t i = 0; i < reg->n; i++) {
        if (strcmp(reg->tools[i].name, name) == 0)
            return &reg->tools[i];
    }
    return NULL;
}

size_t tally_registry_count(const tally_registry_t *reg)
{
    return reg != NULL ? reg->n : 0;
}

const tally_tool_t *tally_registry_at(const tally_registry_t *reg, size_t i)
{
    if (reg == NULL || i >= reg->n)
        return NULL;
    return &reg->tools[i];
}

/* ---------------------------------------------------------------- operation keys */

/* Keys travel as the Idempotency-Key header: no control characters may reach it. */
static bool key_text_ok(const char *s)
{
    for (; *s != '\0'; s++) {
        unsigned char c = (unsigned char)*s;
        if (c < 0x20 || c == 0x7f)
            return false;
    }
    return true;
}

static const char *json_kind(const json_t *x)
{
    switch (json_typeof(x)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_REAL:
        return "a real number";
    case JSON_NULL:
        return "null";
    default:
        return "a scalar";
    }
}

char *tally_registry_operation_key(const tally_tool_t *tool, const json_t *args,
                                   const char *explicit_key, tally_error_t *err)
{
    const tally_errc_t code = TALLY_ERR_MISSING_OPERATION_KEY;
    if (explicit_key != NULL && explicit_key[0] != '\0') {
        if (!key_text_ok(explicit_key)) {
            tally_error_setc(err, TALLY_ERR_INVALID_FIELD,
                             "the intent's operation_key contains control characters; it is sent "
                             "as the Idempotency-Key header");
            return NULL;
        }
        char *k = strdup(explicit_key);
        if (k == NULL)
            tally_error_setc(err, TALLY_ERR_OOM, "out of memory building an operation key");
        return k;
    }
    if (tool->n_operation_key == 0) {
        tally_error_setc(err, code,
                         "tool %s declares no operation_key fields; the intent must carry "
                         "operation_key",
                         tool->name);
        return NULL;
    }
    if (!json_is_object(args)) {
        tally_error_setc(err, code,
                         "tool %s builds its operation key from args, but args is not an object",
                         tool->name);
        return NULL;
    }
    tally_strbuf_t b = {0};
    tally_strbuf_puts(&b, tool->name);
    for (size_t i = 0; i < tool->n_operation_key; i++) {
        const char *field = tool->operation_key[i];
        const json_t *x = json_object_get(args, field);
        char num[32];
        const char *text = NULL;
        if (x == NULL) {
            tally_error_setc(err, code,
                             "tool %s builds its operation key from args.%s, which is missing",
                             tool->name, field);
        } else if (json_is_string(x)) {
            text = json_string_value(x);
            if (text[0] == '\0' || !key_text_ok(text)) {
                /* Empty: the key is missing. Control characters: the value is invalid (the key
                 * is sent as the Idempotency-Key header, where CR/LF would inject headers). */
                tally_error_setc(
                    err, text[0] == '\0' ? code : TALLY_ERR_INVALID_FIELD,
                    "tool %s builds its operation key from args.%s, which is %s", tool->name, field,
                    text[0] == '\0' ? "an empty string" : "a string with control characters");
                text = NULL;
            }
        } else if (json_is_integer(x)) {
            snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(x));
            text = num;
        } else if (json_is_boolean(x)) {
            text = json_is_true(x) ? "true" : "false";
        } else {
            tally_error_setc(err, code,
                             "tool %s builds its operation key from args.%s, which is %s; it must "
                             "be a string, an integer or a boolean",
                             tool->name, field, json_kind(x));
        }
        if (text == NULL) {
            free(b.s);
            return NULL;
        }
        tally_strbuf_puts(&b, ":");
        tally_strbuf_puts(&b, text);
    }
    char *key = tally_strbuf_take(&b);
    if (key == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory building an operation key");
    } else if (strlen(key) > TALLY_LIMIT_OPERATION_KEY) {
        /* The limit of an explicit key holds for a derived one too: the key is a UNIQUE index
         * entry and an HTTP header. */
        tally_error_setc(err, TALLY_ERR_INVALID_FIELD,
                         "tool %s builds its operation key from args; the key is %zu bytes, above "
                         "the limit of %d bytes",
                         tool->name, strlen(key), TALLY_LIMIT_OPERATION_KEY);
        free(key);
        key = NULL;
    }
    return key;
}
