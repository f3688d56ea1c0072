/* compensate.c — the compensator's loop (DESIGN §2): obligations arrive as wake-ups on
 * <prefix>obligations and as NOTIFY tally_obligations, and a sweep every TALLY_SWEEP_MS finds
 * due retries, expired leases, late confirmations, settled runs and obligations near or past
 * their compensation deadline (deadline.c). Each turn leases what may
 * run now (store.c), carries out what policy.c decides for each — starting the reverse and
 * containment calls (libcurl multi, many at once) or queueing the outcome — waits on curl,
 * PostgreSQL and Kafka together, and records what finished (store.c) and the runs that
 * settled (settle.c). Kafka offsets are stored only after the round the wake-ups caused. The
 * pager runs beside it on its own thread (pager.c). */
#include "compensator.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "tally/alert.h"
#include "tally/crashpoint.h"
#include "tally/ledger.h"
#include "tally/log.h"

double comp_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void declare_metrics(compensator_t *c, tally_metrics_t *m)
{
    c->m_obligations =
        tally_metrics_gauge(m, "tally_obligations",
                            "Obligations in the ledger by state (the terminal states are "
                            "counted again 10-60 s apart, the live ones on every sweep)",
                            "state");
    c->m_stuck = tally_metrics_gauge(m, "tally_stuck_obligations",
                                     "Obligations that are STUCK: a human must decide", NULL);
    c->m_stuck_oldest = tally_metrics_gauge(
        m, "tally_stuck_obligations_oldest_age_seconds",
        "How long the oldest STUCK obligation has been STUCK (0 for none)", NULL);
    c->m_drain = tally_metrics_histogram(
        m, "tally_obligation_drain_seconds",
        "From an obligation's creation to its terminal state (RESOLVED, SKIPPED, "
        "UNCOMPENSATABLE)",
        NULL, tally_latency_buckets, tally_n_latency_buckets);
    c->m_reverse = tally_metrics_histogram(m, "tally_reverse_call_seconds",
                                           "Latency of reverse and containment calls", "tool",
                                           tally_latency_buckets, tally_n_latency_buckets);
    c->m_alerts = tally_metrics_counter(
        m, "tally_alerts_sent_total",
        "Pages raised by this worker (kafka: alert events written) and delivered (pagerduty)",
        "channel");
    c->m_alert_fail = tally_alert_failures_counter(m, "compensator");
    c->m_outcomes =
        tally_metrics_counter(m, "tally_compensations_total",
                              "Obligation outcomes recorded, by tool and state", "tool,outcome");
    c->m_lease_lost = tally_metrics_counter(
        m, "tally_obligation_lease_lost_total",
        "Outcomes not written because another worker had taken the lease over", NULL);
    c->m_inflight = tally_metrics_gauge(m, "tally_compensator_inflight",
                                        "Reverse and containment calls in flight", NULL);
    c->m_tool_inflight =
        tally_metrics_gauge(m, "tally_reverse_calls_inflight",
                            "Reverse and containment calls in flight, by tool", "tool");
    c->m_db_errors = tally_metrics_counter(m, "tally_compensator_db_errors_total",
                                           "PostgreSQL errors by step", "step");
    c->m_runs = tally_metrics_counter(m, "tally_runs_settled_total",
                                      "Run compensations settled, by outcome", "status");
    c->m_past_deadline = tally_metrics_gauge(
        m, "tally_obligations_past_deadline",
        "Open obligations past their compensation deadline (paged critical), whatever their "
        "state",
        NULL);
    c->m_near_deadline = tally_metrics_gauge(
        m, "tally_obligations_near_deadline",
        "Open obligations past TALLY_DEADLINE_WARN_SHARE of their time to their compensation "
        "deadline (paged as a warning), not yet past it",
        NULL);
    tally_metric_set(c->m_stuck, 0);
    tally_metric_set(c->m_stuck_oldest, 0);
    tally_metric_set(c->m_past_deadline, 0);
    tally_metric_set(c->m_near_deadline, 0);
    tally_metric_add(c->m_alerts, 0, "kafka");
    tally_metric_add(c->m_alerts, 0, "pagerduty");
    /* The series a dashboard rates exist at 0 from the start: rate() and increase() cannot see
     * the event that creates a series, such as a tool's first compensation since the start. */
    for (size_t t = 0; t < tally_registry_count(c->reg); t++) {
        const char *tool = tally_registry_at(c->reg, t)->name;
        for (int s = 0; s < TALLY_OBLIGATION__COUNT; s++) {
            tally_obligation_state_t to = (tally_obligation_state_t)s;
            if (tally_obligation_transition_allowed(TALLY_OBLIGATION_RUNNING, to)) {
                tally_metric_add(c->m_outcomes, 0, tool, tally_obligation_state_name(to));
            }
        }
        tally_metric_set(c->m_tool_inflight, 0, tool);
    }
    static const tally_run_state_t settled[] = {TALLY_RUN_COMPENSATED,
                                                TALLY_RUN_PARTIALLY_COMPENSATED, TALLY_RUN_STUCK};
    for (size_t i = 0; i < sizeof settled / sizeof settled[0]; i++) {
        tally_metric_add(c->m_runs, 0, tally_run_state_name(settled[i]));
    }
}

/* Tools whose compensation waits for approval (the decision table says so before approval). */
static char *approval_tools(const tally_registry_t *reg)
{
    json_t *list = json_array();
    for (size_t i = 0; list != NULL && i < tally_registry_count(reg); i++) {
        const tally_tool_t *t = tally_registry_at(reg, i);
        if (comp_needs_approval(t)) {
            json_array_append_new(list, json_string(t->name));
        }
    }
    char *text = list != NULL ? json_dumps(list, JSON_COMPACT) : NULL;
    json_decref(list);
    return text;
}

static void raise_fd_limit(int want)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) {
        return;
    }
    rlim_t need = (rlim_t)want + 256;
    if (rl.rlim_cur >= need) {
        return;
    }
    rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > need ? need : rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur < need) {
        TALLY_WARN("open-file limit %llu is below the %d calls TALLY_MAX_INFLIGHT allows",
                   (unsigned long long)rl.rlim_cur, want);
    }
}

static void compensator_fini(tally_worker_t *w, void *state);

static bool setup(compensator_t *c, tally_worker_t *w);

static bool compensator_init(tally_worker_t *w, void **state)
{
    compensator_t *c = calloc(1, sizeof *c);
    if (c == NULL) {
        TALLY_ERROR("out of memory");
        return false;
    }
    if (!setup(c, w)) {
        /* the worker calls fini only after a successful init */
        compensator_fini(w, c);
        return false;
    }
    *state = c;
    return true;
}

static bool setup(compensator_t *c, tally_worker_t *w)
{
    c->w = w;
    c->cfg = tally_worker_config(w);
    c->reg = tally_worker_registry(w);
    c->keys = tally_worker_keyring(w);
    c->pg = tally_worker_pg(w);
    c->worker_id = tally_worker_id(w);
    c->rand_state = (unsigned)time(NULL) ^ (unsigned)getpid();
    snprintf(c->source, sizeof c->source, "/tally/compensator/%s", c->worker_id);
    declare_metrics(c, tally_worker_metrics(w));
    c->approval_tools = approval_tools(c->reg);
    c->deadline_tools = comp_deadline_tools(c->reg);
    c->settle_runs = json_array();
    if (c->approval_tools == NULL || c->deadline_tools == NULL || c->settle_runs == NULL) {
        TALLY_ERROR("out of memory");
        return false;
    }
    raise_fd_limit(c->cfg->max_inflight);
    char errstr[256];
    c->conn = tally_connector_new(c->cfg->max_inflight, 0, errstr, sizeof errstr);
    if (c->conn == NULL) {
        TALLY_ERROR("connector engine: %s", errstr);
        return false;
    }
    tally_error_t err;
    tally_error_clear(&err);
    if (!tally_pg_listen(c->pg, "tally_obligations", &err)) {
        TALLY_ERROR("LISTEN tally_obligations: %s", err.message);
        return false;
    }
    /* the consumer's wake-up pipe joins curl's and PostgreSQL's sockets in one wait */
    if (tally_worker_consumer(w) != NULL && (c->cs = tally_worker_consume(w)) == NULL) {
        return false;
    }
    c->pager = comp_pager_start(c->cfg, c->worker_id, tally_worker_metrics(w), c->m_alerts,
                                tally_worker_stop_flag(w), errstr, sizeof errstr);
    if (c->pager == NULL) {
        TALLY_ERROR("pager: %s", errstr);
        return false;
    }
    c->lease_wanted = true;
    TALLY_INFO("compensator ready: %zu tools (%s need approval to compensate; compensation "
               "deadlines %s, warning at %g of them), %d calls in flight at most, sweep every "
               "%d ms",
               tally_registry_count(c->reg), c->approval_tools, c->deadline_tools,
               c->cfg->deadline_warn_share, c->cfg->max_inflight, c->cfg->sweep_ms);
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Acting on leased obligations: policy.c decides, this carries it out                      */

void comp_ob_free(void *p)
{
    comp_ob_t *ob = p;
    if (ob == NULL) {
        return;
    }
    free(ob->run_id);
    free(ob->step);
    free(ob->tool_name);
    free(ob->operation_key);
    free(ob->args_canonical);
    free(ob->traceparent);
    free(ob->external_ref);
    free(ob->reason);
    free(ob->confirmed_at);
    free(ob->intent_id);
    json_decref(ob->receipt);
    json_decref(ob->blast_radius);
    tally_redactor_free(ob->red);
    if (ob->args_plain != NULL) {
        OPENSSL_cleanse(ob->args_plain, strlen(ob->args_plain));
        free(ob->args_plain);
    }
    json_decref(ob->receipt_plain);
    free(ob);
}

void comp_outcome_clear(comp_outcome_t *o)
{
    comp_ob_free(o->ob);
    json_decref(o->reverse_receipt);
    json_decref(o->call);
    memset(o, 0, sizeof *o);
}

/* What a decision about @p ob reads. */
static comp_policy_in_t policy_in(compensator_t *c, const comp_ob_t *ob)
{
    char if_match[COMP_IF_MATCH_SIZE];
    return (comp_policy_in_t){.tool = ob->tool,
                              .tool_name = ob->tool_name,
                              .cls_known = ob->cls_known,
                              .cls = ob->cls,
                              .approved = ob->approved,
                              .attempts = ob->attempts,
                              .version = comp_if_match(ob->receipt, if_match),
                              .hold_ms = c->cfg->sweep_ms,
                              .random = (uint32_t)rand_r(&c->rand_state)};
}

/* Queue the outcome @p mv decided; when even that fails (out of memory), forget the
 * obligation: its lease expires and it runs again with the same idempotency key. */
static comp_outcome_t *queue(compensator_t *c, comp_ob_t *ob, const comp_move_t *mv)
{
    if (c->n_done == c->cap_done) {
        size_t cap = c->cap_done ? 2 * c->cap_done : 64;
        comp_outcome_t *d = realloc(c->done, cap * sizeof *d);
        if (d == NULL) {
            TALLY_ERROR("out of memory queueing the outcome of obligation %s; its lease will "
                        "expire",
                        ob->obligation_id);
            comp_ob_free(ob);
            return NULL;
        }
        c->done = d;
        c->cap_done = cap;
    }
    comp_outcome_t *o = &c->done[c->n_done++];
    memset(o, 0, sizeof *o);
    o->ob = ob;
    o->to = mv->to;
    tally_text_copy(o->code, sizeof o->code, mv->code);
    tally_text_copy(o->message, sizeof o->message, mv->message);
    o->is_error = mv->is_error;
    o->refund_attempt = mv->refund_attempt;
    o->delay_ms = mv->delay_ms;
    tally_text_copy(o->page, sizeof o->page, mv->page);
    return o;
}

static const char *containment_status(comp_contain_t how)
{
    return how == COMP_CONTAIN_DONE ? "done" : "failed";
}

/* A decision that was not a call: the containment it records, then the outcome. */
static void record_move(compensator_t *c, comp_ob_t *ob, const comp_move_t *mv)
{
    if (mv->containment != COMP_CONTAIN_NONE && ob->blast_radius != NULL) {
        json_object_set_new(ob->blast_radius, "containment",
                            json_pack("{s:s, s:s, s:s}", "status",
                                      containment_status(mv->containment), "code",
                                      mv->containment_code, "message", mv->containment_message));
    }
    queue(c, ob, mv);
}

/* Start the compensate or containment call. */
static void submit(compensator_t *c, comp_ob_t *ob, tally_conn_op_t op)
{
    comp_move_t mv;
    if (strcmp(ob->args_canonical, TALLY_PRUNED_MARKER) == 0 && ob->sealed_err.errc == 0)
        tally_error_setc(&ob->sealed_err, TALLY_ERR_PRUNED,
                         "the run's payloads were pruned (tally prune): the args and receipt the "
                         "reverse call is built from are gone; reverse it by hand");
    if (ob->sealed_err.errc != TALLY_ERR_NONE) {
        /* its sensitive fields do not open: the tool cannot be sent what it needs */
        comp_policy_in_t in = policy_in(c, ob);
        comp_policy_unsent(&in, &ob->dec, op, false, &ob->sealed_err, &mv);
        record_move(c, ob, &mv);
        return;
    }
    /* the tool gets the real values: a sensitive tool's args and receipt opened */
    json_t *args = json_loads(ob->args_plain ? ob->args_plain : ob->args_canonical, 0, NULL);
    json_t *body = comp_reverse_body(
        ob->external_ref, ob->receipt_plain ? ob->receipt_plain : ob->receipt, args, ob->reason);
    if (body != NULL && op == TALLY_CONN_CONTAIN && ob->blast_radius != NULL) {
        json_object_set(body, "blast_radius", ob->blast_radius);
    }
    char *text = body != NULL ? json_dumps(body, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    json_decref(body);
    json_decref(args);
    if (text == NULL) {
        comp_policy_no_body(&mv);
        record_move(c, ob, &mv);
        return;
    }
    char key[64];
    snprintf(key, sizeof key, "%s:%s", op == TALLY_CONN_CONTAIN ? "contain" : "reverse",
             ob->obligation_id);
    /* an unusable version never gets here (comp_policy_lease) */
    char if_match[COMP_IF_MATCH_SIZE];
    bool has_version =
        op == TALLY_CONN_COMPENSATE && comp_if_match(ob->receipt, if_match) == COMP_VERSION_OK;
    tally_conn_request_t req = {
        .tool = ob->tool,
        .op = op,
        .idempotency_key = key,
        .run_id = ob->run_id,
        .effect_id = ob->effect_id,
        .traceparent = ob->traceparent,
        .if_match = has_version ? if_match : NULL,
        .body = text,
        .body_len = strlen(text),
        .opaque = ob,
    };
    tally_error_t err;
    tally_error_clear(&err);
    ob->started = comp_now();
    bool ok = tally_connector_submit(c->conn, &req, &err);
    free(text);
    if (ok) {
        TALLY_LOG(TALLY_LOG_DEBUG,
                  (&(tally_log_ctx_t){.run_id = ob->run_id,
                                      .effect_id = ob->effect_id,
                                      .obligation_id = ob->obligation_id,
                                      .tool = ob->tool_name}),
                  "%s call started (attempt %d, key %s)", tally_conn_op_name(op), ob->attempts,
                  key);
        return;
    }
    /* Nothing was sent. */
    bool capacity = err.errc == TALLY_ERR_CAPACITY;
    comp_policy_in_t in = policy_in(c, ob);
    comp_policy_unsent(&in, &ob->dec, op, capacity, &err, &mv);
    record_move(c, ob, &mv); /* copies what it borrows from err */
}

static void act(compensator_t *c, comp_ob_t *ob)
{
    comp_policy_in_t in = policy_in(c, ob);
    comp_policy_decide(&in, &ob->dec);
    if (comp_policy_wants_blast_radius(ob->dec.action)) {
        json_t *args = json_loads(ob->args_canonical, 0, NULL);
        ob->blast_radius = comp_blast_radius(ob->tool_name, ob->operation_key, args, ob->receipt,
                                             ob->external_ref, ob->confirmed_at);
        json_decref(args);
    }
    comp_move_t mv;
    comp_policy_lease(&in, &ob->dec, ob->blast_radius != NULL, &mv);
    if (mv.kind == COMP_MOVE_CALL) {
        submit(c, ob, mv.op);
    } else {
        record_move(c, ob, &mv);
    }
}

/* Lease what may run now, as far as there is room for calls, and act on each. @returns
 * obligations leased, -1 on a database error. */
static int lease_and_act(compensator_t *c)
{
    int room = c->cfg->max_inflight - tally_connector_inflight(c->conn);
    int limit = c->cfg->batch_size < room ? c->cfg->batch_size : room;
    if (limit <= 0) {
        return 0;
    }
    comp_ob_t **obs = NULL;
    int n = comp_store_lease(c, limit, &obs);
    for (int i = 0; i < n; i++) {
        TALLY_CRASHPOINT("compensate.after_lease_commit");
        comp_ob_t *ob = obs[i];
        if (ob == NULL) {
            continue; /* could not be read: its lease expires */
        }
        if (ob->from == TALLY_OBLIGATION_RUNNING) {
            TALLY_LOG(TALLY_LOG_WARN,
                      (&(tally_log_ctx_t){.run_id = ob->run_id,
                                          .effect_id = ob->effect_id,
                                          .obligation_id = ob->obligation_id,
                                          .tool = ob->tool_name}),
                      "took over an expired lease (attempt %d); repeating the call with the "
                      "same idempotency key",
                      ob->attempts);
        }
        act(c, ob);
    }
    free(obs);
    return n;
}

/* The connector exchange as the audit trail keeps it (kind "connector_call"). */
static json_t *call_record(const comp_ob_t *ob, const tally_conn_result_t *res,
                           const tally_conn_verdict_t *v, const char *key, const char *if_match)
{
    json_t *excerpt = NULL;
    if (ob->red != NULL) {
        size_t n = 0;
        char *scrubbed =
            tally_sensitive_scrub_body(ob->red, ob->tool, res->body, res->body_len, &n);
        excerpt = tally_conn_excerpt(scrubbed ? scrubbed : "(redacted)", scrubbed ? n : 10, 2048);
        free(scrubbed);
    } else {
        excerpt = tally_conn_excerpt(res->body, res->body_len, 2048);
    }
    return json_pack(
        "{s:s, s:s, s:s, s:s, s:s?, s:i, s:b, s:s, s:s, s:s, s:f, s:i, s:o}", "op",
        tally_conn_op_name(res->op), "method", res->method, "url", res->url, "idempotency_key", key,
        "if_match", if_match, "http_status", (int)res->http_status, "sent", res->sent, "verdict",
        tally_verdict_name(v->verdict), "code", v->code, "message", v->message, "seconds",
        res->seconds, "attempt", ob->attempts, "response", excerpt != NULL ? excerpt : json_null());
}

/* The tool's answer as a receipt the ledger keeps: a sensitive tool's redacted and scrubbed. */
static json_t *answer_receipt(const comp_ob_t *ob, const tally_conn_result_t *res)
{
    if (ob->red == NULL)
        return tally_conn_receipt(res);
    json_t *receipt = tally_sensitive_answer_json(ob->red, ob->tool, res);
    return receipt != NULL
               ? receipt
               : json_pack("{s:s}", "redacted", "the answer could not be redacted (out of memory)");
}

/* The connector's completion callback: classify the answer, decide, queue the outcome. */
static void on_done(const tally_conn_result_t *res, void *opaque)
{
    compensator_t *c = opaque;
    comp_ob_t *ob = res->opaque;
    TALLY_CRASHPOINT("compensate.after_reverse_answer");
    tally_conn_verdict_t v;
    tally_conn_classify_compensate(res, &v);
    if (ob->red != NULL) {
        char *msg = tally_redactor_scrub(ob->red, v.message, strlen(v.message));
        tally_text_copy(v.message, sizeof v.message, msg ? msg : "(redacted)");
        free(msg);
    }
    tally_metric_observe(c->m_reverse, res->seconds, ob->tool_name);
    bool contain = res->op == TALLY_CONN_CONTAIN;
    char key[64], if_match[COMP_IF_MATCH_SIZE];
    snprintf(key, sizeof key, "%s:%s", contain ? "contain" : "reverse", ob->obligation_id);
    bool has_version = !contain && comp_if_match(ob->receipt, if_match) == COMP_VERSION_OK;
    json_t *call = call_record(ob, res, &v, key, has_version ? if_match : NULL);
    TALLY_LOG(v.verdict == TALLY_VERDICT_RESOLVED ? TALLY_LOG_INFO : TALLY_LOG_WARN,
              (&(tally_log_ctx_t){.run_id = ob->run_id,
                                  .effect_id = ob->effect_id,
                                  .obligation_id = ob->obligation_id,
                                  .tool = ob->tool_name}),
              "%s call answered: %s (%s) in %.3f s", tally_conn_op_name(res->op),
              tally_verdict_name(v.verdict), v.message, res->seconds);

    comp_policy_in_t in = policy_in(c, ob);
    comp_move_t mv;
    comp_policy_answer(&in, &ob->dec, res->op, &v, &mv);
    if (mv.containment != COMP_CONTAIN_NONE && ob->blast_radius != NULL) {
        json_t *receipt = mv.containment == COMP_CONTAIN_DONE ? answer_receipt(ob, res) : NULL;
        json_object_set_new(ob->blast_radius, "containment",
                            json_pack("{s:s, s:s, s:s, s:i, s:s, s:s, s:o}", "status",
                                      containment_status(mv.containment), "method", res->method,
                                      "url", res->url, "http_status", (int)res->http_status, "code",
                                      mv.containment_code, "message", mv.containment_message,
                                      "receipt", receipt != NULL ? receipt : json_null()));
    }
    comp_outcome_t *o = queue(c, ob, &mv);
    if (o != NULL && mv.to == TALLY_OBLIGATION_RESOLVED) {
        o->reverse_receipt = answer_receipt(ob, res);
    }
    if (o != NULL) {
        o->call = call;
    } else {
        json_decref(call);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* The sweep                                                                                */

/* Set tally_obligations for the live or terminal states from c->gauge_counts. @returns
 * whether one of them changed since @p before. */
static bool publish_counts(compensator_t *c, bool terminal,
                           const double before[TALLY_OBLIGATION__COUNT])
{
    bool moved = false;
    for (int s = 0; s < TALLY_OBLIGATION__COUNT; s++) {
        tally_obligation_state_t st = (tally_obligation_state_t)s;
        if (tally_obligation_state_terminal(st) != terminal) {
            continue;
        }
        moved = moved || c->gauge_counts[s] != before[s];
        tally_metric_set(c->m_obligations, c->gauge_counts[s], tally_obligation_state_name(st));
    }
    return moved;
}

/* The live counts on every sweep; the terminal ones when comp_policy_count_terminal says. */
static void refresh_gauges(compensator_t *c)
{
    double before[TALLY_OBLIGATION__COUNT];
    memcpy(before, c->gauge_counts, sizeof before);
    double stuck_oldest = 0;
    if (!comp_store_count(c, false, c->gauge_counts, &stuck_oldest)) {
        return;
    }
    bool moved = publish_counts(c, false, before);
    tally_metric_set(c->m_stuck, c->gauge_counts[TALLY_OBLIGATION_STUCK]);
    tally_metric_set(c->m_stuck_oldest, stuck_oldest);
    c->live_moved = c->live_moved || moved;
    double now = comp_now();
    if (!comp_policy_count_terminal(now, c->terminal_counted_at, c->live_moved)) {
        return;
    }
    memcpy(before, c->gauge_counts, sizeof before);
    if (comp_store_count(c, true, c->gauge_counts, NULL)) {
        (void)publish_counts(c, true, before);
        c->terminal_counted_at = now;
        c->live_moved = false;
    }
}

/* Obligations for late confirmations, approvals, settlement, deadline pages, gauges. */
static int sweep(compensator_t *c)
{
    int work = 0;
    int n = comp_sweep_confirmed(c);
    work += n > 0 ? n : 0;
    n = comp_store_hold_for_approval(c);
    work += n > 0 ? n : 0;
    n = comp_settle(c, NULL);
    work += n > 0 ? n : 0;
    n = comp_deadline_sweep(c);
    work += n > 0 ? n : 0;
    refresh_gauges(c);
    return work;
}

/* ---------------------------------------------------------------------------------------- */
/* The loop                                                                                 */

/* Wake-ups from <prefix>obligations: PostgreSQL holds the obligations, so a message only says
 * "look now". Their offsets are stored after the round that looked (tally_consume_store). */
static int read_wakeups(compensator_t *c)
{
    if (c->cs == NULL) {
        return 0;
    }
    int n =
        tally_consume_wakeups(c->cs, c->cfg->batch_size > 0 ? c->cfg->batch_size : 1, NULL, NULL);
    if (n > 0) {
        c->lease_wanted = true;
    }
    return n;
}

/* Wait for curl, a NOTIFY or Kafka, up to @p timeout_ms, and collect finished calls. */
static int wait_and_collect(compensator_t *c, int timeout_ms)
{
    struct curl_waitfd fds[2];
    unsigned n = 0;
    PGconn *conn = tally_pg_conn(c->pg);
    int pgfd = conn != NULL ? PQsocket(conn) : -1;
    if (pgfd >= 0) {
        fds[n++] = (struct curl_waitfd){.fd = pgfd, .events = CURL_WAIT_POLLIN};
    }
    if (c->cs != NULL) {
        fds[n++] = (struct curl_waitfd){.fd = tally_consume_fd(c->cs), .events = CURL_WAIT_POLLIN};
    }
    tally_error_t err;
    tally_error_clear(&err);
    int done = tally_connector_poll(c->conn, fds, n, timeout_ms, on_done, c, &err);
    if (done < 0) {
        TALLY_ERROR("connector: %s", err.message);
    }
    if (tally_pg_wait_notify(c->pg, 0) > 0) {
        c->lease_wanted = true;
    }
    tally_metric_set(c->m_inflight, tally_connector_inflight(c->conn));
    tally_connector_publish_inflight(c->conn, c->m_tool_inflight);
    return done > 0 ? done : 0;
}

static int next_timeout_ms(compensator_t *c, double now, int work)
{
    if (work > 0) {
        return 0;
    }
    if (c->cs != NULL && tally_consume_ready(c->cs)) {
        return 0;
    }
    double until = now + c->cfg->poll_ms / 1000.0;
    if (!c->draining && c->next_sweep < until) {
        until = c->next_sweep;
    }
    if (c->n_done > 0 && c->record_retry_at < until) {
        until = c->record_retry_at;
    }
    double ms = (until - now) * 1000.0;
    return ms <= 0 ? 0 : (int)ms + 1;
}

/* Record finished calls (and resolve the deadline pages of obligations they closed), then
 * settle the runs whose obligations moved. */
static int record_and_settle(compensator_t *c)
{
    int work = 0;
    if (c->n_done > 0 && comp_now() >= c->record_retry_at) {
        int n = comp_store_record(c);
        if (n > 0) {
            work += n;
            c->lease_wanted = true; /* a settled step may free an earlier one */
            if (c->deadline_pages_open > 0) {
                int r = comp_deadline_resolve(c); /* on an error, the sweep resolves them */
                work += r > 0 ? r : 0;
            }
        }
    }
    if (json_array_size(c->settle_runs) > 0) {
        int n = comp_settle(c, c->settle_runs);
        if (n >= 0) {
            json_array_clear(c->settle_runs);
            work += n;
        }
        /* on an error the runs stay listed; the sweep settles them too */
    }
    return work;
}

static int compensator_tick(tally_worker_t *w, void *state)
{
    compensator_t *c = state;
    int work = 0;
    int n = read_wakeups(c);
    work += n;
    double now = comp_now();
    if (now >= c->next_sweep) {
        c->next_sweep = now + c->cfg->sweep_ms / 1000.0;
        work += sweep(c);
        c->lease_wanted = true;
    }
    work += record_and_settle(c);
    if (c->lease_wanted) {
        c->lease_wanted = false;
        n = lease_and_act(c);
        if (n >= 0) {
            if (c->cs != NULL) {
                tally_consume_store(c->cs);
            }
            work += n;
            /* a full batch: more may be waiting */
            c->lease_wanted = n >= c->cfg->batch_size;
        }
    }
    work += wait_and_collect(c, next_timeout_ms(c, comp_now(), work + (int)c->n_done));
    work += record_and_settle(c);
    tally_worker_heartbeat(w);
    return work;
}

/* SIGTERM: lease nothing more, let the calls in flight finish and record them. Calls still
 * running when the grace period ends are abandoned: their leases expire and another worker
 * repeats them with the same idempotency key. */
static bool compensator_drain(tally_worker_t *w, void *state)
{
    compensator_t *c = state;
    if (!c->draining) {
        c->draining = true;
        TALLY_INFO("draining: %d reverse calls in flight, %zu outcomes to record",
                   tally_connector_inflight(c->conn), c->n_done);
    }
    if (c->cs != NULL) {
        tally_consume_serve(c->cs);
    }
    wait_and_collect(c, c->n_done > 0 ? 0 : 100);
    (void)record_and_settle(c);
    tally_worker_heartbeat(w);
    bool done = tally_connector_inflight(c->conn) == 0 && c->n_done == 0;
    if (done) {
        TALLY_INFO("drained: every reverse call finished and was recorded");
    }
    return done;
}

static void compensator_fini(tally_worker_t *w, void *state)
{
    (void)w;
    compensator_t *c = state;
    if (c == NULL) {
        return;
    }
    comp_pager_stop(c->pager);
    int left = c->conn != NULL ? tally_connector_inflight(c->conn) : 0;
    if (left > 0 || c->n_done > 0) {
        TALLY_WARN("exiting with %d reverse calls in flight and %zu unrecorded outcomes: their "
                   "leases will expire and another compensator repeats them with the same "
                   "idempotency keys",
                   left, c->n_done);
    }
    tally_connector_free(c->conn, comp_ob_free);
    for (size_t i = 0; i < c->n_done; i++) {
        comp_outcome_clear(&c->done[i]);
    }
    free(c->done);
    json_decref(c->settle_runs);
    free(c->approval_tools);
    free(c->deadline_tools);
    free(c);
}

static const char *const compensator_topics[] = {"obligations", NULL};

const tally_worker_ops_t tally_compensator_ops = {
    .name = "compensator",
    .summary = "Runs compensations (reverse actions) for obligations, last step first.",
    .topics = compensator_topics,
    .init = compensator_init,
    .tick = compensator_tick,
    .drain = compensator_drain,
    .fini = compensator_fini,
};
