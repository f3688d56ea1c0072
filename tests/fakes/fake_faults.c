/* Fault rules: matched in order, each consumed by the requests it matches until its `times`
 * run out (-1: never). Guarded by their own mutex, taken only for the match, never while a
 * request sleeps. */
#include "fake_faults.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *name;
    fake_fault_kind_t kind;
    unsigned default_delay_ms;
    unsigned default_status;
    unsigned min_status, max_status; /* 0: `status` is not used by this fault */
    size_t default_size;             /* 0: `size` is not used by this fault */
} FAULTS[] = {
    {"slow", FAKE_FAULT_SLOW, 1000, 0, 0, 0, 0},
    {"refuse_503", FAKE_FAULT_REFUSE_503, 0, 503, 0, 0, 0},
    {"refuse_429", FAKE_FAULT_REFUSE_429, 0, 429, 0, 0, 0},
    {"error_4xx", FAKE_FAULT_ERROR_4XX, 0, 400, 400, 499, 0},
    {"fail_after_apply", FAKE_FAULT_FAIL_AFTER_APPLY, 0, 500, 400, 599, 0},
    {"apply_then_hang", FAKE_FAULT_APPLY_THEN_HANG, 30000, 0, 0, 0, 0},
    {"hang_before_apply", FAKE_FAULT_HANG_BEFORE_APPLY, 30000, 503, 0, 0, 0},
    {"apply_twice", FAKE_FAULT_APPLY_TWICE, 0, 201, 200, 599, 0}, /* no 3xx: see fake_faults_add */
    {"reverse_412", FAKE_FAULT_REVERSE_412, 0, 412, 0, 0, 0},
    {"reverse_500", FAKE_FAULT_REVERSE_500, 0, 500, 0, 0, 0},
    {"reverse_409", FAKE_FAULT_REVERSE_409, 0, 409, 0, 0, 0},
    {"status_500", FAKE_FAULT_STATUS_500, 0, 500, 0, 0, 0},
    {"status_garbage", FAKE_FAULT_STATUS_GARBAGE, 0, 200, 0, 0, 0},
    {"drop_connection", FAKE_FAULT_DROP_CONNECTION, 0, 0, 0, 0, 0},
    {"huge_id", FAKE_FAULT_HUGE_ID, 0, 0, 0, 0, 10240},
    {"etag_version", FAKE_FAULT_ETAG_VERSION, 0, 0, 0, 0, 64},
    {"receipt_not_utf8", FAKE_FAULT_RECEIPT_NOT_UTF8, 0, 201, 200, 299, 0},
    {"receipt_not_json", FAKE_FAULT_RECEIPT_NOT_JSON, 0, 201, 200, 299, 0},
};

#define NFAULTS      (sizeof FAULTS / sizeof FAULTS[0])
#define MAX_DELAY_MS 3600000
#define MAX_SIZE     (16LL << 20)

static const char *const OPS[] = {"*", "execute", "status", "reverse", "contain", "list"};

typedef struct rule {
    unsigned id;
    char *collection, *op, *key;
    fake_fault_t fault;
    long long times; /* remaining; -1 forever */
} rule_t;

struct fake_faults {
    pthread_mutex_t mu;
    rule_t *rules;
    size_t n, cap;
    unsigned next_id;
};

const char *fake_fault_name(fake_fault_kind_t kind)
{
    for (size_t i = 0; i < NFAULTS; i++)
        if (FAULTS[i].kind == kind)
            return FAULTS[i].name;
    return NULL;
}

fake_faults_t *fake_faults_new(void)
{
    fake_faults_t *ff = calloc(1, sizeof *ff);
    if (!ff)
        return NULL;
    pthread_mutex_init(&ff->mu, NULL);
    ff->next_id = 1;
    return ff;
}

static void rule_clear(rule_t *r)
{
    free(r->collection);
    free(r->op);
    free(r->key);
}

static void clear_locked(fake_faults_t *ff)
{
    for (size_t i = 0; i < ff->n; i++)
        rule_clear(&ff->rules[i]);
    ff->n = 0;
}

void fake_faults_free(fake_faults_t *ff)
{
    if (!ff)
        return;
    clear_locked(ff);
    free(ff->rules);
    pthread_mutex_destroy(&ff->mu);
    free(ff);
}

void fake_faults_clear(fake_faults_t *ff)
{
    pthread_mutex_lock(&ff->mu);
    clear_locked(ff);
    pthread_mutex_unlock(&ff->mu);
}

static json_t *rule_json(const rule_t *r)
{
    return json_pack("{s:I, s:s, s:s, s:s, s:s, s:I, s:I, s:I, s:I}", "id", (json_int_t)r->id,
                     "collection", r->collection, "op", r->op, "key", r->key, "fault",
                     fake_fault_name(r->fault.kind), "times", (json_int_t)r->times, "delay_ms",
                     (json_int_t)r->fault.delay_ms, "status", (json_int_t)r->fault.status, "size",
                     (json_int_t)r->fault.size);
}

static bool valid_collection(const char *c)
{
    if (strcmp(c, "*") == 0)
        return true;
    if (!*c)
        return false;
    for (; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || *c == '_'))
            return false;
    return true;
}

/* A string member, `dflt` when absent; NULL (with errstr set) when present but not a string. */
static const char *string_member(const json_t *rule, const char *name, const char *dflt,
                                 char *errstr, size_t errsz)
{
    json_t *v = json_object_get(rule, name);
    if (!v)
        return dflt;
    if (!json_is_string(v)) {
        snprintf(errstr, errsz, "\"%s\" must be a string", name);
        return NULL;
    }
    return json_string_value(v);
}

/* An integer member in [lo, hi], `dflt` when absent; false (errstr set) when invalid. */
static bool int_member(const json_t *rule, const char *name, long long dflt, long long lo,
                       long long hi, long long *out, char *errstr, size_t errsz)
{
    json_t *v = json_object_get(rule, name);
    *out = dflt;
    if (!v)
        return true;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(errstr, errsz, "\"%s\" must be an integer in [%lld, %lld]", name, lo, hi);
        return false;
    }
    *out = json_integer_value(v);
    return true;
}

json_t *fake_faults_add(fake_faults_t *ff, const json_t *rule, char *errstr, size_t errsz)
{
    if (!json_is_object(rule)) {
        snprintf(errstr, errsz, "a rule is a JSON object");
        return NULL;
    }
    const char *fault = string_member(rule, "fault", NULL, errstr, errsz);
    if (!fault) {
        if (!json_object_get(rule, "fault"))
            snprintf(errstr, errsz, "\"fault\" is required");
        return NULL;
    }
    size_t fi = 0;
    while (fi < NFAULTS && strcmp(FAULTS[fi].name, fault) != 0)
        fi++;
    if (fi == NFAULTS) {
        snprintf(errstr, errsz, "unknown fault \"%.64s\"", fault);
        return NULL;
    }
    const char *collection = string_member(rule, "collection", "*", errstr, errsz);
    const char *op = string_member(rule, "op", "*", errstr, errsz);
    const char *key = string_member(rule, "key", "*", errstr, errsz);
    if (!collection || !op || !key)
        return NULL;
    if (!valid_collection(collection)) {
        snprintf(errstr, errsz, "\"collection\" must be \"*\" or match [a-z_]+");
        return NULL;
    }
    size_t oi = 0;
    while (oi < sizeof OPS / sizeof OPS[0] && strcmp(OPS[oi], op) != 0)
        oi++;
    if (oi == sizeof OPS / sizeof OPS[0]) {
        snprintf(errstr, errsz, "\"op\" must be execute, status, reverse, contain, list or *");
        return NULL;
    }
    long long times, delay, status, size = 0;
    if (!int_member(rule, "times", 1, -1, 1LL << 40, &times, errstr, errsz) ||
        !int_member(rule, "delay_ms", FAULTS[fi].default_delay_ms, 0, MAX_DELAY_MS, &delay, errstr,
                    errsz))
        return NULL;
    if (times == 0) {
        snprintf(errstr, errsz, "\"times\" must be positive, or -1 for forever");
        return NULL;
    }
    if (FAULTS[fi].max_status) {
        if (!int_member(rule, "status", FAULTS[fi].default_status, FAULTS[fi].min_status,
                        FAULTS[fi].max_status, &status, errstr, errsz))
            return NULL;
        /* no fault answers a redirect (apply_twice's range is the one that spans them) */
        if (status >= 300 && status <= 399) {
            snprintf(errstr, errsz, "\"status\" must be 2xx, 4xx or 5xx");
            return NULL;
        }
    } else {
        status = FAULTS[fi].default_status;
    }
    if (FAULTS[fi].default_size && !int_member(rule, "size", (long long)FAULTS[fi].default_size, 1,
                                               MAX_SIZE, &size, errstr, errsz))
        return NULL;

    rule_t r = {
        .collection = strdup(collection),
        .op = strdup(op),
        .key = strdup(key),
        .fault = {FAULTS[fi].kind, (unsigned)delay, (unsigned)status, (size_t)size},
        .times = times,
    };
    json_t *out = NULL;
    pthread_mutex_lock(&ff->mu);
    if (ff->n == ff->cap) {
        size_t cap = ff->cap ? ff->cap * 2 : 16;
        rule_t *grown = realloc(ff->rules, cap * sizeof *grown);
        if (grown) {
            ff->rules = grown;
            ff->cap = cap;
        }
    }
    if (r.collection && r.op && r.key && ff->n < ff->cap) {
        r.id = ff->next_id++;
        out = rule_json(&r);
        ff->rules[ff->n++] = r;
    } else {
        rule_clear(&r);
        snprintf(errstr, errsz, "out of memory");
    }
    pthread_mutex_unlock(&ff->mu);
    return out;
}

json_t *fake_faults_list(fake_faults_t *ff)
{
    json_t *arr = json_array();
    pthread_mutex_lock(&ff->mu);
    for (size_t i = 0; arr && i < ff->n; i++)
        json_array_append_new(arr, rule_json(&ff->rules[i]));
    pthread_mutex_unlock(&ff->mu);
    return arr;
}

static bool field_matches(const char *pattern, const char *value)
{
    return strcmp(pattern, "*") == 0 || (value && strcmp(pattern, value) == 0);
}

fake_fault_t fake_faults_take(fake_faults_t *ff, const char *collection, const char *op,
                              const char *key)
{
    fake_fault_t got = {FAKE_FAULT_NONE, 0, 0, 0};
    pthread_mutex_lock(&ff->mu);
    for (size_t i = 0; i < ff->n; i++) {
        rule_t *r = &ff->rules[i];
        if (!field_matches(r->collection, collection) || !field_matches(r->op, op) ||
            !field_matches(r->key, key))
            continue;
        got = r->fault;
        if (r->times > 0 && --r->times == 0) {
            rule_clear(r);
            memmove(r, r + 1, (ff->n - i - 1) * sizeof *r);
            ff->n--;
        }
        break;
    }
    pthread_mutex_unlock(&ff->mu);
    return got;
}
