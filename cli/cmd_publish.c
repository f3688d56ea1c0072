/* cmd_publish.c — `tally publish`: an intent (or a compensate/cancel/complete request) from
 * the shell.
 *
 * The event is checked with the dispatcher's own gate (tally_intent_parse) before anything is
 * sent, so the shell gets the refusal the dispatcher would give, naming the field. Then it is
 * produced to <prefix>intents with the run id as key, and the command waits for the broker's
 * delivery report: an event id printed means the cluster has the message.
 *
 * With --wait-outcome it then reads <prefix>outcomes (every partition, from its end as it was
 * before publishing) for the answers, and its exit status says what the answer was: the table
 * of PUB_EXIT_* below, which USAGE and docs/operations.md repeat. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <librdkafka/rdkafka.h>

#include "cli.h"
#include "format.h"
#include "tally/ledger.h"
#include "tally/cloudevent.h"
#include "tally/config.h"
#include "tally/json.h"
#include "tally/kafka.h"
#include "tally/text.h"

/* The exit status of `tally publish`. 0 and 3-8 say what the answer was (--wait-outcome);
 * with several events (--stdin) the command exits with the highest of their codes. */
enum {
    PUB_EXIT_OK = 0,        /* published; waited: CONFIRMED, or the run COMPLETED, COMPENSATED or
                             * CANCELLED */
    PUB_EXIT_ERROR = 1,     /* the command failed: Kafka, standard input, memory */
    PUB_EXIT_USAGE = 2,     /* usage error */
    PUB_EXIT_FAILED = 3,    /* FAILED */
    PUB_EXIT_CONFLICT = 4,  /* CONFLICT */
    PUB_EXIT_REJECTED = 5,  /* REJECTED (approval denied) or CANCELLED */
    PUB_EXIT_REFUSED = 6,   /* refused: by the local check (nothing sent) or by tally
                             * (tally.intent.rejected.v1) */
    PUB_EXIT_OPEN = 7,      /* not final at the timeout (UNKNOWN, AWAITING_APPROVAL, STUCK), or
                             * the first answer with --first; a run PARTIALLY_COMPENSATED or
                             * STUCK */
    PUB_EXIT_NO_ANSWER = 8, /* no answer at all before the timeout */
};

static const char USAGE[] =
    "usage: tally publish --run R --step S --tool T --args JSON [options]\n"
    "       tally publish --type compensate_run|cancel_run --run R --reason TEXT [--compensate]\n"
    "       tally publish --type complete_run --run R [--reason TEXT]\n"
    "       tally publish --stdin [--dry-run] [--wait-outcome SECONDS [--first]]\n"
    "\n"
    "Publish one CloudEvent to <prefix>intents (key = the run id), after checking it exactly\n"
    "as the dispatcher will. Prints the event id once the broker has acknowledged it.\n"
    "\n"
    "Building the event from options:\n"
    "  --type TYPE            intent (default), compensate_run, cancel_run or complete_run\n"
    "                         (tally.intent.v1, tally.compensate_run.v1, tally.cancel_run.v1,\n"
    "                         tally.complete_run.v1)\n"
    "  --run R                data.run_id: the run (1-200 bytes, no control characters)\n"
    "  --step S               data.step: unique in the run; digits without a leading zero\n"
    "                         are sent as a JSON integer (\"3\" -> 3), anything else as a string\n"
    "  --tool T               data.tool: a tool name from the registry (intent)\n"
    "  --args JSON            data.args: the tool's arguments, a JSON object (intent)\n"
    "  --operation-key K      data.operation_key: the idempotency key, when the registry does\n"
    "                         not build it from the args (intent; optional)\n"
    "  --tenant T             data.tenant (intent; optional)\n"
    "  --traceparent TP       data.traceparent: W3C 00-<32 hex>-<16 hex>-<2 hex> (optional)\n"
    "  --reason TEXT          data.reason: why (compensate_run and cancel_run: required;\n"
    "                         complete_run: optional)\n"
    "  --compensate           data.compensate=true: also undo confirmed effects (cancel_run)\n"
    "  --source SRC           CloudEvents source (default /tally/cli/<user>)\n"
    "\n"
    "Reading events instead:\n"
    "  --stdin                read one CloudEvent (a JSON document, may span lines) or one\n"
    "                         event per line (JSON Lines) from standard input; every event is\n"
    "                         checked before any is sent, and sent byte for byte as given\n"
    "\n"
    "Both:\n"
    "  --dry-run              print the event JSON (one per line) and exit; no Kafka connection\n"
    "  --wait-outcome SECONDS after publishing, wait up to SECONDS for the final answer on\n"
    "                         <prefix>outcomes and print every answer as it comes, one JSON\n"
    "                         event a line on stdout (the event id goes to stderr). An intent\n"
    "                         is answered by tally.effect.*.v1 (data.intent_id = the event id,\n"
    "                         then data.effect_id): UNKNOWN, AWAITING_APPROVAL and STUCK are\n"
    "                         printed and waited through until CONFIRMED, FAILED, CONFLICT,\n"
    "                         REJECTED or CANCELLED. A run message is answered by its run:\n"
    "                         tally.run.compensated.v1 or .stuck.v1 (compensate_run, cancel_run\n"
    "                         --compensate), .cancelled.v1 (cancel_run), .completed.v1\n"
    "                         (complete_run). Any message may be refused with\n"
    "                         tally.intent.rejected.v1.\n"
    "  --first                with --wait-outcome: stop at the first answer, final or not\n"
    "  -h, --help             this text\n"
    "\n"
    "Environment: TALLY_KAFKA_BROKERS, TALLY_TOPIC_PREFIX, TALLY_MAX_MESSAGE_BYTES and any\n"
    "TALLY_KAFKA_<property> for librdkafka (`tally config` lists them).\n"
    "\n"
    "Exit status (with several events, the highest of theirs):\n"
    "  0  published; with --wait-outcome: CONFIRMED, or the run COMPLETED, COMPENSATED or\n"
    "     CANCELLED\n"
    "  1  the command failed: Kafka could not be reached or did not accept the message (the\n"
    "     broker's error is printed), standard input could not be read\n"
    "  2  usage error\n"
    "  3  FAILED\n"
    "  4  CONFLICT\n"
    "  5  REJECTED (approval denied) or CANCELLED\n"
    "  6  refused: by the check before publishing (the reason and the field are on stderr,\n"
    "     nothing was sent), or by tally with tally.intent.rejected.v1 (printed on stdout)\n"
    "  7  not final: UNKNOWN, AWAITING_APPROVAL or STUCK at the timeout, or as the first\n"
    "     answer with --first; a run PARTIALLY_COMPENSATED or STUCK\n"
    "  8  no answer at all before the timeout\n";

/* What a message is answered with (--wait-outcome). */
typedef enum {
    PUB_MSG_INTENT,         /* tally.effect.*.v1 about its effect */
    PUB_MSG_COMPENSATE_RUN, /* tally.run.compensated.v1 / tally.run.stuck.v1; also
                             * tally.cancel_run.v1 with compensate */
    PUB_MSG_CANCEL_RUN,     /* tally.run.cancelled.v1 */
    PUB_MSG_COMPLETE_RUN,   /* tally.run.completed.v1 */
} pub_msg_t;

/* One event to publish: the exact bytes checked, and what the check found. */
typedef struct pub_event {
    char *value; /* malloc'd, NUL-terminated */
    size_t len;
    tally_intent_t in;
    /* delivery report */
    bool delivered;
    rd_kafka_resp_err_t err;
    int32_t partition;
    int64_t offset;
    /* --wait-outcome */
    pub_msg_t kind;
    int answer;         /* the PUB_EXIT_* of its latest answer; PUB_EXIT_NO_ANSWER before one */
    bool settled;       /* the wait for it is over */
    char effect_id[48]; /* an intent's effect, from its first answer: later answers name it */
    char last_id[256];  /* the answer seen last, to skip a redelivered copy */
} pub_event_t;

typedef struct pub_opts {
    const char *type;
    const char *run;
    const char *step;
    const char *tool;
    const char *args;
    const char *operation_key;
    const char *tenant;
    const char *traceparent;
    const char *reason;
    const char *source;
    bool compensate;
    bool from_stdin;
    bool dry_run;
    double wait_s; /* 0: do not wait */
    bool first;    /* --first: stop at the first answer */
} pub_opts_t;

static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tally publish: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputs("\nTry 'tally publish --help'.\n", stderr);
    va_end(ap);
    return PUB_EXIT_USAGE;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---------------------------------------------------------------------------------------- */
/* Building events                                                                           */

static const char *full_type(const char *t)
{
    if (strcmp(t, "intent") == 0 || strcmp(t, "tally.intent.v1") == 0)
        return "tally.intent.v1";
    if (strcmp(t, "compensate_run") == 0 || strcmp(t, "tally.compensate_run.v1") == 0)
        return "tally.compensate_run.v1";
    if (strcmp(t, "cancel_run") == 0 || strcmp(t, "tally.cancel_run.v1") == 0)
        return "tally.cancel_run.v1";
    if (strcmp(t, "complete_run") == 0 || strcmp(t, "tally.complete_run.v1") == 0)
        return "tally.complete_run.v1";
    return NULL;
}

/* Set data[name] to the option's text; false (with the message printed) when it is not
 * valid UTF-8, which jansson refuses. */
static bool set_text(json_t *data, const char *name, const char *flag, const char *value)
{
    if (value == NULL)
        return true;
    if (!tally_utf8_valid(value, strlen(value))) {
        fprintf(stderr, "tally publish: %s is not valid UTF-8\n", flag);
        return false;
    }
    if (json_object_set_new(data, name, json_string(value)) != 0) {
        fprintf(stderr, "tally publish: out of memory\n");
        return false;
    }
    return true;
}

/* "3" -> 3; "03", "3a", "" and numbers beyond int64 stay strings (a leading zero would be
 * lost, and the step is the agent's identifier). */
static json_t *step_value(const char *s)
{
    bool digits = s[0] != '\0' && strspn(s, "0123456789") == strlen(s);
    if (digits && (s[0] != '0' || s[1] == '\0')) {
        errno = 0;
        char *end;
        long long n = strtoll(s, &end, 10);
        if (errno == 0 && *end == '\0')
            return json_integer((json_int_t)n);
    }
    return json_string(s);
}

/* Which data field an option fills, for pointing at the flag in a refusal. */
static const char *flag_of_field(const char *detail)
{
    static const char *const map[][2] = {
        {"data.run_id", "--run"},
        {"data.step", "--step"},
        {"data.tool", "--tool"},
        {"data.args", "--args"},
        {"data.operation_key", "--operation-key"},
        {"data.tenant", "--tenant"},
        {"data.traceparent", "--traceparent"},
        {"data.reason", "--reason"},
        {"data.compensate", "--compensate"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        size_t n = strlen(map[i][0]);
        if (strncmp(detail, map[i][0], n) == 0 && (detail[n] == ' ' || detail[n] == ';'))
            return map[i][1];
    }
    return NULL;
}

/* The event from the options, as compact JSON in ev->value. Returns an exit code. */
static int build_from_options(const pub_opts_t *o, pub_event_t *ev)
{
    const char *type = full_type(o->type);
    bool intent = strcmp(type, "tally.intent.v1") == 0;
    bool cancel = strcmp(type, "tally.cancel_run.v1") == 0;

    /* Options that belong to another type would be silently dropped: say so instead. */
    const char *stray = NULL;
    if (!intent && o->step)
        stray = "--step";
    else if (!intent && o->tool)
        stray = "--tool";
    else if (!intent && o->args)
        stray = "--args";
    else if (!intent && o->operation_key)
        stray = "--operation-key";
    else if (!intent && o->tenant)
        stray = "--tenant";
    else if (intent && o->reason)
        stray = "--reason";
    if (stray != NULL)
        return usage_error("%s does not apply to --type %s", stray, o->type);
    if (o->compensate && !cancel)
        return usage_error("--compensate applies only to --type cancel_run");

    json_t *data = json_object();
    if (data == NULL) {
        fprintf(stderr, "tally publish: out of memory\n");
        return PUB_EXIT_ERROR;
    }
    bool ok = set_text(data, "run_id", "--run", o->run);
    if (ok && intent) {
        if (o->step != NULL) {
            if (!tally_utf8_valid(o->step, strlen(o->step))) {
                fprintf(stderr, "tally publish: --step is not valid UTF-8\n");
                ok = false;
            } else {
                ok = json_object_set_new(data, "step", step_value(o->step)) == 0;
            }
        }
        ok = ok && set_text(data, "tool", "--tool", o->tool);
        if (ok && o->args != NULL) {
            json_error_t jerr;
            json_t *args = json_loads(o->args, TALLY_JSON_LOAD_FLAGS | JSON_DECODE_ANY, &jerr);
            if (args == NULL) {
                json_decref(data);
                return usage_error("--args is not JSON: %s (column %d)", jerr.text, jerr.column);
            }
            ok = json_object_set_new(data, "args", args) == 0;
        }
        ok = ok && set_text(data, "operation_key", "--operation-key", o->operation_key);
        ok = ok && set_text(data, "tenant", "--tenant", o->tenant);
    }
    if (ok && !intent) {
        ok = set_text(data, "reason", "--reason", o->reason);
        if (ok && cancel)
            ok = json_object_set_new(data, "compensate", json_boolean(o->compensate)) == 0;
    }
    ok = ok && set_text(data, "traceparent", "--traceparent", o->traceparent);
    if (!ok) {
        json_decref(data);
        return PUB_EXIT_USAGE;
    }

    char source[256];
    if (o->source != NULL)
        snprintf(source, sizeof source, "%s", o->source);
    else
        snprintf(source, sizeof source, "/tally/cli/%s", tally_cli_default_actor());
    if (!tally_utf8_valid(source, strlen(source))) {
        json_decref(data);
        return usage_error("--source is not valid UTF-8");
    }
    const char *subject =
        o->run != NULL && tally_utf8_valid(o->run, strlen(o->run)) ? o->run : NULL;

    json_t *doc = tally_ce_new(type, source, subject, data, NULL); /* takes data */
    if (doc == NULL) {
        fprintf(stderr, "tally publish: out of memory building the event\n");
        return PUB_EXIT_ERROR;
    }
    ev->value = json_dumps(doc, JSON_COMPACT);
    json_decref(doc);
    if (ev->value == NULL) {
        fprintf(stderr, "tally publish: out of memory serialising the event\n");
        return PUB_EXIT_ERROR;
    }
    ev->len = strlen(ev->value);
    return PUB_EXIT_OK;
}

/* ---------------------------------------------------------------------------------------- */
/* Reading events from standard input                                                        */

static char *read_all(FILE *f, size_t *len_out)
{
    size_t cap = 64 * 1024, len = 0;
    char *buf = malloc(cap + 1);
    if (buf == NULL)
        return NULL;
    for (;;) {
        if (len == cap) {
            char *nb = realloc(buf, cap * 2 + 1);
            if (nb == NULL) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
        size_t n = fread(buf + len, 1, cap - len, f);
        len += n;
        if (n == 0) {
            if (ferror(f)) {
                free(buf);
                return NULL;
            }
            break;
        }
    }
    buf[len] = '\0';
    *len_out = len;
    return buf;
}

static bool is_blank(const char *s, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r' && s[i] != '\n')
            return false;
    return true;
}

/* Trim surrounding whitespace of s[0..len) into a new string. */
static char *dup_trimmed(const char *s, size_t len, size_t *len_out)
{
    while (len > 0 && (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n'))
        s++, len--;
    while (len > 0 &&
           (s[len - 1] == ' ' || s[len - 1] == '\t' || s[len - 1] == '\r' || s[len - 1] == '\n'))
        len--;
    char *d = malloc(len + 1);
    if (d == NULL)
        return NULL;
    memcpy(d, s, len);
    d[len] = '\0';
    *len_out = len;
    return d;
}

static bool push_event(pub_event_t **evs, size_t *n, size_t *cap, const char *s, size_t len)
{
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 8;
        pub_event_t *ne = realloc(*evs, nc * sizeof *ne);
        if (ne == NULL)
            return false;
        *evs = ne;
        *cap = nc;
    }
    pub_event_t *ev = &(*evs)[*n];
    memset(ev, 0, sizeof *ev);
    ev->value = dup_trimmed(s, len, &ev->len);
    if (ev->value == NULL)
        return false;
    ev->partition = RD_KAFKA_PARTITION_UA;
    ev->offset = RD_KAFKA_OFFSET_INVALID;
    (*n)++;
    return true;
}

/* One whole JSON document (pretty-printed is fine), or else one event per non-blank line.
 * Returns an exit code; on success *evs holds *n events (n ≥ 1). line_of[i] is the input
 * line of event i, for messages (0 when the input was one document). */
static int read_stdin_events(pub_event_t **evs, size_t *n, size_t **line_of)
{
    size_t len;
    char *all = read_all(stdin, &len);
    if (all == NULL) {
        fprintf(stderr, "tally publish: cannot read standard input: %s\n", strerror(errno));
        return PUB_EXIT_ERROR;
    }
    size_t cap = 0;
    *evs = NULL;
    *n = 0;
    *line_of = NULL;
    int rc = PUB_EXIT_OK;
    if (is_blank(all, len)) {
        fprintf(stderr, "tally publish: no event on standard input\n");
        rc = PUB_EXIT_ERROR;
        goto out;
    }

    json_error_t jerr;
    json_t *whole = json_loadb(all, len, TALLY_JSON_LOAD_FLAGS, &jerr);
    size_t lines = 0;
    for (size_t i = 0; i < len; i++)
        lines += all[i] == '\n';
    if (whole != NULL || lines <= 1) {
        /* One document: also when it does not parse and is on one line, so the check below
         * reports jansson's own complaint about it. */
        json_decref(whole);
        if (!push_event(evs, n, &cap, all, len)) {
            rc = PUB_EXIT_ERROR;
            goto oom;
        }
        *line_of = calloc(1, sizeof **line_of);
        if (*line_of == NULL)
            goto oom;
        goto out;
    }

    size_t line = 0, lcap = 0;
    const char *p = all, *end = all + len;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        line++;
        if (!is_blank(p, (size_t)(le - p))) {
            if (!push_event(evs, n, &cap, p, (size_t)(le - p)))
                goto oom;
            if (*n > lcap) {
                size_t nc = cap;
                size_t *nl2 = realloc(*line_of, nc * sizeof **line_of);
                if (nl2 == NULL)
                    goto oom;
                *line_of = nl2;
                lcap = nc;
            }
            (*line_of)[*n - 1] = line;
        }
        p = le + 1;
    }
    goto out;
oom:
    fprintf(stderr, "tally publish: out of memory reading standard input\n");
    rc = PUB_EXIT_ERROR;
out:
    free(all);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Kafka                                                                                     */

static void on_delivery(rd_kafka_t *rk, const rd_kafka_message_t *m, void *opaque)
{
    (void)rk;
    (void)opaque;
    pub_event_t *ev = m->_private;
    ev->delivered = true;
    ev->err = m->err;
    ev->partition = m->partition;
    ev->offset = m->offset;
}

static bool brokers_configured(const tally_config_t *cfg)
{
    if (cfg->kafka_brokers != NULL && cfg->kafka_brokers[0] != '\0')
        return true;
    for (size_t i = 0; i < cfg->n_kafka_props; i++)
        if (strcmp(cfg->kafka_props[i].name, "bootstrap.servers") == 0 ||
            strcmp(cfg->kafka_props[i].name, "metadata.broker.list") == 0)
            return true;
    return false;
}

/* A consumer of every partition of @p topic from its current end (the high watermark, read
 * now, so nothing produced after this call is missed). */
static rd_kafka_t *outcomes_consumer_new(const tally_config_t *cfg, const char *topic, char *errstr,
                                         size_t errsz)
{
    rd_kafka_conf_t *conf = tally_kafka_conf_new(cfg, errstr, errsz);
    if (conf == NULL)
        return NULL;
    char group[64], why[512];
    snprintf(group, sizeof group, "tally-publish-%ld", (long)getpid());
    const char *props[][2] = {
        {"group.id", group}, /* never joined: partitions are assigned, nothing committed */
        {"enable.auto.commit", "false"},
        {"enable.auto.offset.store", "false"},
        {"enable.partition.eof", "false"},
    };
    for (size_t i = 0; i < sizeof props / sizeof props[0]; i++) {
        if (rd_kafka_conf_set(conf, props[i][0], props[i][1], why, sizeof why) !=
            RD_KAFKA_CONF_OK) {
            tally_fmt(errstr, errsz, "Kafka property %s: %s", props[i][0], why);
            rd_kafka_conf_destroy(conf);
            return NULL;
        }
    }
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_CONSUMER, conf, why, sizeof why);
    if (rk == NULL) {
        tally_fmt(errstr, errsz, "cannot create the Kafka consumer: %s", why);
        rd_kafka_conf_destroy(conf);
        return NULL;
    }
    rd_kafka_poll_set_consumer(rk);

    const char *topics[] = {topic};
    if (!tally_kafka_ensure_topics(rk, topics, 1, 10000, errstr, errsz))
        goto fail;
    rd_kafka_topic_t *rkt = rd_kafka_topic_new(rk, topic, NULL);
    const struct rd_kafka_metadata *md = NULL;
    rd_kafka_resp_err_t err =
        rkt ? rd_kafka_metadata(rk, 0, rkt, &md, 10000) : RD_KAFKA_RESP_ERR__INVALID_ARG;
    if (rkt)
        rd_kafka_topic_destroy(rkt);
    if (err != RD_KAFKA_RESP_ERR_NO_ERROR || md->topic_cnt != 1 || md->topics[0].err) {
        snprintf(errstr, errsz, "cannot read the partitions of %s: %s", topic,
                 rd_kafka_err2str(err ? err : md->topics[0].err));
        if (md)
            rd_kafka_metadata_destroy(md);
        goto fail;
    }
    int cnt = md->topics[0].partition_cnt;
    rd_kafka_topic_partition_list_t *parts = rd_kafka_topic_partition_list_new(cnt);
    for (int i = 0; i < cnt; i++) {
        int32_t p = md->topics[0].partitions[i].id;
        int64_t lo, hi;
        err = rd_kafka_query_watermark_offsets(rk, topic, p, &lo, &hi, 10000);
        if (err) {
            snprintf(errstr, errsz, "cannot read the end offset of %s [%" PRId32 "]: %s", topic, p,
                     rd_kafka_err2str(err));
            rd_kafka_topic_partition_list_destroy(parts);
            rd_kafka_metadata_destroy(md);
            goto fail;
        }
        rd_kafka_topic_partition_list_add(parts, topic, p)->offset = hi;
    }
    rd_kafka_metadata_destroy(md);
    err = rd_kafka_assign(rk, parts);
    rd_kafka_topic_partition_list_destroy(parts);
    if (err) {
        snprintf(errstr, errsz, "cannot assign the partitions of %s: %s", topic,
                 rd_kafka_err2str(err));
        goto fail;
    }
    return rk;
fail:
    rd_kafka_destroy(rk);
    return NULL;
}

static void outcomes_consumer_close(rd_kafka_t *rk)
{
    if (rk == NULL)
        return;
    rd_kafka_consumer_close(rk);
    rd_kafka_destroy(rk);
}

/* Produce every event and wait for each delivery report. Returns an exit code. */
static int produce_all(const tally_config_t *cfg, const char *topic, pub_event_t *evs, size_t n)
{
    char errstr[512];
    rd_kafka_t *rk = tally_kafka_producer_new(cfg, true, on_delivery, NULL, errstr, sizeof errstr);
    if (rk == NULL) {
        fprintf(stderr, "tally publish: %s\n", errstr);
        return PUB_EXIT_ERROR;
    }
    int rc = PUB_EXIT_OK;
    size_t queued = 0;
    for (size_t i = 0; i < n; i++) {
        const char *key = evs[i].in.run_id;
        rd_kafka_resp_err_t err = rd_kafka_producev(
            rk, RD_KAFKA_V_TOPIC(topic), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
            RD_KAFKA_V_VALUE(evs[i].value, evs[i].len), RD_KAFKA_V_KEY(key, strlen(key)),
            /* CloudEvents Kafka binding, structured content mode */
            RD_KAFKA_V_HEADER("content-type", "application/cloudevents+json; charset=UTF-8", -1),
            RD_KAFKA_V_OPAQUE(&evs[i]), RD_KAFKA_V_END);
        if (err) {
            fprintf(stderr, "tally publish: cannot queue event %s for %s: %s\n", evs[i].in.id,
                    topic, rd_kafka_err2str(err));
            rc = PUB_EXIT_ERROR;
            break;
        }
        queued++;
    }
    /* Delivery reports come within message.timeout.ms (30 s unless configured), success or
     * not; flush serves them. */
    for (;;) {
        size_t done = 0;
        for (size_t i = 0; i < queued; i++)
            done += evs[i].delivered;
        if (done == queued)
            break;
        rd_kafka_flush(rk, 500);
    }
    for (size_t i = 0; i < queued; i++) {
        if (evs[i].err) {
            bool timed_out = evs[i].err == RD_KAFKA_RESP_ERR__MSG_TIMED_OUT;
            fprintf(stderr, "tally publish: Kafka did not accept event %s on %s: %s%s%s%s\n",
                    evs[i].in.id, topic, rd_kafka_err2str(evs[i].err),
                    timed_out ? " (is the cluster at TALLY_KAFKA_BROKERS=" : "",
                    timed_out ? cfg->kafka_brokers : "", timed_out ? " reachable?)" : "");
            rc = PUB_EXIT_ERROR;
        }
    }
    char fatal[256];
    if (rd_kafka_fatal_error(rk, fatal, sizeof fatal) != RD_KAFKA_RESP_ERR_NO_ERROR) {
        fprintf(stderr, "tally publish: the Kafka producer failed: %s\n", fatal);
        rc = PUB_EXIT_ERROR;
    }
    tally_kafka_producer_close(rk, 1000);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Waiting for the answers (--wait-outcome)                                                  */

/* The exit code an effect's state says, and whether the wait ends there. UNKNOWN,
 * AWAITING_APPROVAL and STUCK are answers a later event changes (the reconciler, an operator),
 * as are PLANNED and DISPATCHING (the replayed state of an effect on its way); so is a state
 * this command does not know yet. */
static int effect_answer(const char *type, const char *status, bool *final)
{
    *final = true;
    if (type != NULL && strcmp(type, "tally.effect.conflict.v1") == 0)
        return PUB_EXIT_CONFLICT;
    tally_effect_state_t state;
    if (status != NULL && tally_effect_state_parse(status, &state)) {
        switch (state) {
        case TALLY_EFFECT_CONFIRMED:
            return PUB_EXIT_OK;
        case TALLY_EFFECT_FAILED:
            return PUB_EXIT_FAILED;
        case TALLY_EFFECT_REJECTED:
        case TALLY_EFFECT_CANCELLED:
            return PUB_EXIT_REJECTED;
        case TALLY_EFFECT_PLANNED:
        case TALLY_EFFECT_AWAITING_APPROVAL:
        case TALLY_EFFECT_DISPATCHING:
        case TALLY_EFFECT_UNKNOWN:
        case TALLY_EFFECT_STUCK:
        case TALLY_EFFECT__COUNT:
            break;
        }
    }
    *final = false;
    return PUB_EXIT_OPEN;
}

/* Is @p type (tally.run.*.v1) the answer to a run message of @p kind? */
static bool run_answer_expected(pub_msg_t kind, const char *type)
{
    switch (kind) {
    case PUB_MSG_COMPENSATE_RUN:
        return strcmp(type, "tally.run.compensated.v1") == 0 ||
               strcmp(type, "tally.run.stuck.v1") == 0;
    case PUB_MSG_CANCEL_RUN:
        return strcmp(type, "tally.run.cancelled.v1") == 0;
    case PUB_MSG_COMPLETE_RUN:
        return strcmp(type, "tally.run.completed.v1") == 0;
    case PUB_MSG_INTENT:
        break;
    }
    return false;
}

/* The exit code of a run's answer (it always ends the wait): data.status, else the type. */
static int run_answer(const char *type, const char *status)
{
    tally_run_state_t state = TALLY_RUN_COMPLETED;
    if (status == NULL)
        state = strcmp(type, "tally.run.stuck.v1") == 0 ? TALLY_RUN_STUCK : TALLY_RUN_COMPLETED;
    else if (!tally_run_state_parse(status, &state))
        return PUB_EXIT_OK; /* a state this command does not know ends the wait, as before */
    switch (state) {
    case TALLY_RUN_PARTIALLY_COMPENSATED:
    case TALLY_RUN_STUCK:
        return PUB_EXIT_OPEN; /* a human still has something to do */
    case TALLY_RUN_ACTIVE:
    case TALLY_RUN_COMPLETING:
    case TALLY_RUN_COMPLETED:
    case TALLY_RUN_COMPENSATING:
    case TALLY_RUN_COMPENSATED:
    case TALLY_RUN_CANCELLED:
    case TALLY_RUN__COUNT:
        break;
    }
    return PUB_EXIT_OK;
}

static pub_msg_t msg_kind(const tally_intent_t *in)
{
    const char *type = json_string_value(json_object_get(in->doc, "type"));
    if (type == NULL || strcmp(type, "tally.intent.v1") == 0)
        return PUB_MSG_INTENT;
    if (strcmp(type, "tally.complete_run.v1") == 0)
        return PUB_MSG_COMPLETE_RUN;
    if (strcmp(type, "tally.cancel_run.v1") == 0 && !in->compensate)
        return PUB_MSG_CANCEL_RUN;
    return PUB_MSG_COMPENSATE_RUN; /* compensate_run, cancel_run with compensate */
}

/* "event ID (run R, step S)" for messages about @p ev. */
static void describe(const pub_event_t *ev, char *out, size_t outsz)
{
    if (ev->kind == PUB_MSG_INTENT)
        tally_fmt(out, outsz, "event %s (run %s, step %s)", ev->in.id, ev->in.run_id, ev->in.step);
    else
        tally_fmt(out, outsz, "event %s (run %s)", ev->in.id, ev->in.run_id);
}

/* Does the outcome @p doc answer @p ev? Sets *code and *final when it does. */
static bool answers(const pub_event_t *ev, const json_t *doc, const char *type, int *code,
                    bool *final)
{
    const json_t *data = json_object_get(doc, "data");
    const char *intent_id = json_string_value(json_object_get(data, "intent_id"));
    const char *status = json_string_value(json_object_get(data, "status"));
    bool ours = intent_id != NULL && strcmp(intent_id, ev->in.id) == 0;

    if (strcmp(type, "tally.intent.rejected.v1") == 0) {
        *code = PUB_EXIT_REFUSED;
        *final = true;
        return ours;
    }
    if (ev->kind == PUB_MSG_INTENT) {
        if (strncmp(type, "tally.effect.", 13) != 0)
            return false;
        if (!ours) {
            /* A later event of the effect names the intent that created it, which is another
             * one when ours was answered with an existing effect; a conflict naming our effect
             * answers someone else's intent. */
            const char *effect_id = json_string_value(json_object_get(data, "effect_id"));
            if (ev->effect_id[0] == '\0' || effect_id == NULL ||
                strcmp(effect_id, ev->effect_id) != 0 ||
                strcmp(type, "tally.effect.conflict.v1") == 0)
                return false;
        }
        *code = effect_answer(type, status, final);
        return true;
    }
    const char *run_id = json_string_value(json_object_get(data, "run_id"));
    if (strncmp(type, "tally.run.", 10) != 0 || run_id == NULL ||
        strcmp(run_id, ev->in.run_id) != 0 || !run_answer_expected(ev->kind, type))
        return false;
    *code = run_answer(type, status);
    *final = true;
    return true;
}

/* Say on stderr what an answer was. */
static void note_answer(const pub_event_t *ev, const json_t *doc, const char *type, bool waiting)
{
    const json_t *data = json_object_get(doc, "data");
    char who[600], line[1200];
    describe(ev, who, sizeof who);
    if (strcmp(type, "tally.intent.rejected.v1") == 0) {
        tally_fmt(line, sizeof line, "%s was refused by tally (%s%s%s): %s", who,
                  cli_str(data, "reason", "?"), cli_str(data, "field", NULL) ? ", " : "",
                  cli_str(data, "field", ""), cli_str(data, "detail", "no detail"));
    } else {
        const json_t *err = json_object_get(data, "error");
        tally_fmt(line, sizeof line, "%s: %s (%s)%s%s%s%s", who, cli_str(data, "status", "?"), type,
                  json_is_object(err) ? ": " : "", cli_str(err, "code", ""),
                  json_is_object(err) ? " " : "", cli_str(err, "message", ""));
    }
    fprintf(stderr, "tally publish: %s%s\n", line, waiting ? "; waiting for the final answer" : "");
}

/* Print a matched outcome on stdout, one line. */
static void print_answer(const rd_kafka_message_t *m, const json_t *doc)
{
    if (memchr(m->payload, '\n', m->len) == NULL) {
        fwrite(m->payload, 1, m->len, stdout);
    } else {
        char *line = cli_json_dumps(doc, CLI_JSON_COMPACT, false); /* reals shortest */
        fputs(line != NULL ? line : "{}", stdout);
        free(line);
    }
    fputc('\n', stdout);
    fflush(stdout);
}

/* Is this outcome message an answer to some of ours? Prints it once, notes it for each event
 * it answers; returns how many of them it settled. */
static size_t match_outcome(const rd_kafka_message_t *m, pub_event_t *evs, size_t n, bool first)
{
    json_error_t jerr;
    json_t *doc = json_loadb(m->payload, m->len, 0, &jerr);
    if (doc == NULL)
        return 0;
    const char *type = json_string_value(json_object_get(doc, "type"));
    const char *id = json_string_value(json_object_get(doc, "id"));
    size_t settled = 0;
    bool printed = false;
    for (size_t i = 0; type != NULL && i < n; i++) {
        pub_event_t *ev = &evs[i];
        int code;
        bool final;
        if (ev->settled || !answers(ev, doc, type, &code, &final))
            continue;
        if (id != NULL && strcmp(id, ev->last_id) == 0)
            continue; /* the same answer again (delivery is at least once) */
        tally_text_copy(ev->last_id, sizeof ev->last_id, id != NULL ? id : "");
        const char *effect_id =
            json_string_value(json_object_get(json_object_get(doc, "data"), "effect_id"));
        if (ev->kind == PUB_MSG_INTENT && ev->effect_id[0] == '\0' && effect_id != NULL &&
            strcmp(type, "tally.effect.conflict.v1") != 0)
            tally_text_copy(ev->effect_id, sizeof ev->effect_id, effect_id);
        ev->answer = code;
        ev->settled = final || first;
        settled += ev->settled;
        if (!printed) {
            print_answer(m, doc);
            printed = true;
        }
        note_answer(ev, doc, type, !ev->settled);
    }
    json_decref(doc);
    return settled;
}

/* Read the answers until every event has its final one (its first with --first) or the time is
 * up. Returns the highest exit code of the events. */
static int wait_outcomes(rd_kafka_t *rk, const char *topic, pub_event_t *evs, size_t n,
                         double wait_s, bool first)
{
    for (size_t i = 0; i < n; i++) {
        evs[i].kind = msg_kind(&evs[i].in);
        evs[i].answer = PUB_EXIT_NO_ANSWER;
    }
    size_t pending = n;
    double deadline = mono_s() + wait_s;
    while (pending > 0) {
        double left = deadline - mono_s();
        if (left <= 0)
            break;
        int ms = left > 0.5 ? 500 : (int)(left * 1000) + 1;
        rd_kafka_message_t *m = rd_kafka_consumer_poll(rk, ms);
        if (m == NULL)
            continue;
        if (m->err) {
            /* Transient (a broker restarting) until the deadline says otherwise. */
            if (m->err != RD_KAFKA_RESP_ERR__PARTITION_EOF)
                fprintf(stderr, "tally publish: reading %s: %s\n", topic,
                        rd_kafka_message_errstr(m));
        } else {
            pending -= match_outcome(m, evs, n, first);
        }
        rd_kafka_message_destroy(m);
    }
    int rc = PUB_EXIT_OK;
    for (size_t i = 0; i < n; i++) {
        char who[600];
        describe(&evs[i], who, sizeof who);
        if (evs[i].answer == PUB_EXIT_NO_ANSWER)
            fprintf(stderr, "tally publish: no answer for %s on %s within %g s\n", who, topic,
                    wait_s);
        else if (!evs[i].settled)
            fprintf(stderr, "tally publish: %s has no final answer after %g s\n", who, wait_s);
        if (evs[i].answer > rc)
            rc = evs[i].answer;
    }
    return rc;
}

/* ---------------------------------------------------------------------------------------- */

static int parse_options(int argc, char **argv, pub_opts_t *o)
{
    enum {
        OPT_RUN = 256,
        OPT_STEP,
        OPT_TOOL,
        OPT_ARGS,
        OPT_OPKEY,
        OPT_TENANT,
        OPT_TRACEPARENT,
        OPT_SOURCE,
        OPT_TYPE,
        OPT_REASON,
        OPT_COMPENSATE,
        OPT_DRY_RUN,
        OPT_WAIT,
        OPT_FIRST,
        OPT_STDIN,
    };
    static const struct option longopts[] = {
        {"run", required_argument, NULL, OPT_RUN},
        {"step", required_argument, NULL, OPT_STEP},
        {"tool", required_argument, NULL, OPT_TOOL},
        {"args", required_argument, NULL, OPT_ARGS},
        {"operation-key", required_argument, NULL, OPT_OPKEY},
        {"tenant", required_argument, NULL, OPT_TENANT},
        {"traceparent", required_argument, NULL, OPT_TRACEPARENT},
        {"source", required_argument, NULL, OPT_SOURCE},
        {"type", required_argument, NULL, OPT_TYPE},
        {"reason", required_argument, NULL, OPT_REASON},
        {"compensate", no_argument, NULL, OPT_COMPENSATE},
        {"dry-run", no_argument, NULL, OPT_DRY_RUN},
        {"wait-outcome", required_argument, NULL, OPT_WAIT},
        {"first", no_argument, NULL, OPT_FIRST},
        {"stdin", no_argument, NULL, OPT_STDIN},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    memset(o, 0, sizeof *o);
    o->type = "intent";
    bool built = false; /* an option that builds the event was given */
    optind = 1;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, ":h", longopts, NULL)) != -1) {
        switch (c) {
        case OPT_RUN:
            o->run = optarg, built = true;
            break;
        case OPT_STEP:
            o->step = optarg, built = true;
            break;
        case OPT_TOOL:
            o->tool = optarg, built = true;
            break;
        case OPT_ARGS:
            o->args = optarg, built = true;
            break;
        case OPT_OPKEY:
            o->operation_key = optarg, built = true;
            break;
        case OPT_TENANT:
            o->tenant = optarg, built = true;
            break;
        case OPT_TRACEPARENT:
            o->traceparent = optarg, built = true;
            break;
        case OPT_SOURCE:
            o->source = optarg, built = true;
            break;
        case OPT_TYPE:
            if (full_type(optarg) == NULL)
                return usage_error("--type must be intent, compensate_run, cancel_run or "
                                   "complete_run, not '%s'",
                                   optarg);
            o->type = optarg, built = true;
            break;
        case OPT_REASON:
            o->reason = optarg, built = true;
            break;
        case OPT_COMPENSATE:
            o->compensate = true, built = true;
            break;
        case OPT_DRY_RUN:
            o->dry_run = true;
            break;
        case OPT_WAIT: {
            char *end;
            errno = 0;
            double s = strtod(optarg, &end);
            if (errno != 0 || end == optarg || *end != '\0' || !(s > 0) || s > 86400)
                return usage_error("--wait-outcome takes a number of seconds between 0 and 86400, "
                                   "not '%s'",
                                   optarg);
            o->wait_s = s;
            break;
        }
        case OPT_FIRST:
            o->first = true;
            break;
        case OPT_STDIN:
            o->from_stdin = true;
            break;
        case 'h':
            fputs(USAGE, stdout);
            return -1;
        case ':':
            return usage_error("%s needs a value", argv[optind - 1]);
        default:
            return usage_error("unknown option '%s'", argv[optind - 1]);
        }
    }
    if (optind < argc)
        return usage_error("unexpected argument '%s'", argv[optind]);
    if (o->from_stdin && built)
        return usage_error("--stdin reads whole events; it cannot be combined with options "
                           "that build one (--run, --step, --tool, --args, ...)");
    if (!o->from_stdin && !built)
        return usage_error("nothing to publish: give --run, --step, --tool and --args, or --stdin");
    if (o->first && !(o->wait_s > 0))
        return usage_error("--first applies to --wait-outcome");
    if (o->wait_s > 0 && o->dry_run)
        return usage_error("--wait-outcome and --dry-run exclude each other");
    return PUB_EXIT_OK;
}

int tally_cmd_publish(int argc, char **argv, tally_config_t *cfg)
{
    pub_opts_t o;
    int rc = parse_options(argc, argv, &o);
    if (rc < 0)
        return PUB_EXIT_OK; /* --help */
    if (rc != PUB_EXIT_OK)
        return rc;

    pub_event_t *evs = NULL;
    size_t n = 0;
    size_t *line_of = NULL;
    rd_kafka_t *consumer = NULL;

    if (o.from_stdin) {
        rc = read_stdin_events(&evs, &n, &line_of);
        if (rc != PUB_EXIT_OK)
            goto out;
    } else {
        evs = calloc(1, sizeof *evs);
        line_of = calloc(1, sizeof *line_of);
        if (evs == NULL || line_of == NULL) {
            fprintf(stderr, "tally publish: out of memory\n");
            rc = PUB_EXIT_ERROR;
            goto out;
        }
        evs[0].partition = RD_KAFKA_PARTITION_UA;
        n = 1;
        rc = build_from_options(&o, &evs[0]);
        if (rc != PUB_EXIT_OK)
            goto out;
    }

    /* The dispatcher's gate, on the exact bytes that would be sent. Every event is checked
     * before any is sent. */
    size_t max_bytes = cfg->max_message_bytes > 0 ? (size_t)cfg->max_message_bytes : SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        char detail[512];
        tally_dlq_reason_t r = tally_intent_parse(evs[i].value, evs[i].len, max_bytes, &evs[i].in,
                                                  detail, sizeof detail);
        if (r == TALLY_DLQ_NONE)
            continue;
        char where[48] = "";
        if (line_of[i] > 0)
            snprintf(where, sizeof where, "line %zu: ", line_of[i]);
        const char *flag = o.from_stdin ? NULL : flag_of_field(detail);
        fprintf(stderr, "tally publish: %srefused (%s): %s%s%s%s\n", where,
                tally_dlq_reason_name(r), detail, flag ? " (set it with " : "", flag ? flag : "",
                flag ? ")" : "");
        rc = PUB_EXIT_REFUSED;
    }
    if (rc != PUB_EXIT_OK && !o.dry_run)
        fprintf(stderr, "tally publish: nothing was published\n");
    if (rc != PUB_EXIT_OK)
        goto out;

    if (o.dry_run) {
        for (size_t i = 0; i < n; i++) {
            fwrite(evs[i].value, 1, evs[i].len, stdout);
            fputc('\n', stdout);
        }
        goto out;
    }

    if (!brokers_configured(cfg)) {
        fprintf(stderr, "tally publish: no Kafka cluster configured: set TALLY_KAFKA_BROKERS "
                        "(host:port,...), or use --dry-run\n");
        rc = PUB_EXIT_ERROR;
        goto out;
    }
    char intents[256], outcomes[256];
    if (!tally_config_topic(cfg, "intents", intents, sizeof intents) ||
        !tally_config_topic(cfg, "outcomes", outcomes, sizeof outcomes)) {
        fprintf(stderr, "tally publish: TALLY_TOPIC_PREFIX is too long\n");
        rc = PUB_EXIT_USAGE;
        goto out;
    }

    /* Start reading outcomes before producing: the answer may come back at once. */
    if (o.wait_s > 0) {
        char errstr[512];
        consumer = outcomes_consumer_new(cfg, outcomes, errstr, sizeof errstr);
        if (consumer == NULL) {
            fprintf(stderr, "tally publish: %s\n", errstr);
            rc = PUB_EXIT_ERROR;
            goto out;
        }
    }

    rc = produce_all(cfg, intents, evs, n);
    if (rc != PUB_EXIT_OK)
        goto out;
    for (size_t i = 0; i < n; i++) {
        if (o.wait_s > 0)
            fprintf(stderr,
                    "tally publish: published event %s to %s [%" PRId32 "] at offset %" PRId64
                    "; waiting up to %g s for its %s answer on %s\n",
                    evs[i].in.id, intents, evs[i].partition, evs[i].offset, o.wait_s,
                    o.first ? "first" : "final", outcomes);
        else
            printf("%s\n", evs[i].in.id);
    }
    fflush(stdout);
    if (o.wait_s > 0)
        rc = wait_outcomes(consumer, outcomes, evs, n, o.wait_s, o.first);

out:
    outcomes_consumer_close(consumer);
    for (size_t i = 0; i < n; i++) {
        tally_intent_clear(&evs[i].in);
        free(evs[i].value);
    }
    free(evs);
    free(line_of);
    return rc;
}
