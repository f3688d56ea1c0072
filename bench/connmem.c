/* tally-bench-connmem — what one connector call in flight costs in memory, on its own.
 *
 * The dispatcher's memory target is about calls held open by a slow tool. Most of that memory
 * is libcurl's: an easy handle and a connection per call (a connection carries one call at a
 * time, so a held call holds one). This program measures it without the rest of
 * the dispatcher: a local server accepts every connection and never answers, so each call
 * stays in flight with its request sent, as at a slow tool. It prints
 *
 *   bench: connmem_easy_handle = B bytes    (curl_easy_init alone, per handle)
 *   bench: connmem_call = B bytes           (one call in flight through tally's connector)
 *   bench: connmem_calls_mb = M MB          (N such calls, the part of the dispatcher's RSS
 *                                            they account for)
 *
 * from the process's resident anonymous memory (RssAnon) before and after, with the
 * dispatcher's malloc settings (dispatcher/main.c). */
#include <errno.h>
#include <malloc.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <curl/curl.h>

#include "tally/connector.h"

static atomic_int accepted;
static int listen_fd = -1;

static long rss_anon_kb(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "RssAnon:", 8) == 0)
            kb = atol(line + 8);
    fclose(f);
    return kb;
}

/* Accept every connection and keep it open without reading: a tool that never answers. */
static void *hold_connections(void *arg)
{
    (void)arg;
    for (;;) {
        int fd = accept(listen_fd, NULL, NULL);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            return NULL;
        }
        atomic_fetch_add(&accepted, 1);
    }
}

static void usage(FILE *out)
{
    fprintf(out, "usage: tally-bench-connmem [--calls N]   (default 5000)\n"
                 "Measures the memory of N connector calls held open by a tool that never "
                 "answers.\n");
}

int main(int argc, char **argv)
{
    int calls = 5000;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--calls") == 0 && i + 1 < argc) {
            calls = atoi(argv[++i]);
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (calls < 1 || calls > 100000) {
        fprintf(stderr, "tally-bench-connmem: --calls must be 1..100000\n");
        return 2;
    }
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    mallopt(M_TRIM_THRESHOLD, 256 * 1024);
    mallopt(M_ARENA_MAX, 2);

    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
        rlim_t need = (rlim_t)calls * 2 + 64;
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > need ? need : rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur < need) {
            fprintf(stderr, "tally-bench-connmem: %d calls need %llu open files\n", calls,
                    (unsigned long long)need);
            return 1;
        }
    }
    listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof sa;
    if (listen_fd < 0 || bind(listen_fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
        listen(listen_fd, 4096) != 0 || getsockname(listen_fd, (struct sockaddr *)&sa, &len) != 0) {
        fprintf(stderr, "tally-bench-connmem: cannot listen: %s\n", strerror(errno));
        return 1;
    }
    pthread_t th;
    if (pthread_create(&th, NULL, hold_connections, NULL) != 0) {
        fprintf(stderr, "tally-bench-connmem: cannot start the server thread\n");
        return 1;
    }
    curl_global_init(CURL_GLOBAL_DEFAULT);

    /* 1. Bare easy handles. */
    CURL **easy = calloc((size_t)calls, sizeof *easy);
    if (!easy)
        return 1;
    malloc_trim(0);
    long before = rss_anon_kb();
    for (int i = 0; i < calls; i++)
        easy[i] = curl_easy_init();
    long after = rss_anon_kb();
    double per_easy = (double)(after - before) * 1024.0 / calls;
    for (int i = 0; i < calls; i++)
        curl_easy_cleanup(easy[i]);
    free(easy);

    /* 2. Calls in flight through the connector, as the dispatcher makes them (a reversible
     * tool; each held call has a connection of its own). */
    char errstr[256], base_url[64];
    tally_connector_t *c = tally_connector_new(calls, 0, errstr, sizeof errstr);
    if (!c) {
        fprintf(stderr, "tally-bench-connmem: %s\n", errstr);
        return 1;
    }
    snprintf(base_url, sizeof base_url, "http://127.0.0.1:%d", ntohs(sa.sin_port));
    tally_tool_t tool = {
        .name = (char *)"bench_slow",
        .effect_class = TALLY_CLASS_REVERSIBLE,
        .base_url = base_url,
        .execute = {.method = (char *)"POST", .path = (char *)"/bench_slow"},
        .timeout_ms = 300000,
        .max_concurrency = calls,
    };
    malloc_trim(0);
    before = rss_anon_kb();
    for (int i = 0; i < calls; i++) {
        char key[64], body[96];
        snprintf(key, sizeof key, "bench-job-%08d", i);
        int n = snprintf(body, sizeof body, "{\"job_id\":\"bench-job-%08d\",\"seconds\":300}", i);
        tally_conn_request_t req = {.tool = &tool,
                                    .op = TALLY_CONN_EXECUTE,
                                    .idempotency_key = key,
                                    .run_id = "bench-run-0001",
                                    .effect_id = "0193a3c2-5e1f-7000-8000-000000000000",
                                    .body = body,
                                    .body_len = (size_t)n};
        tally_error_t err;
        if (!tally_connector_submit(c, &req, &err)) {
            fprintf(stderr, "tally-bench-connmem: call %d not started: %s\n", i, err.message);
            return 1;
        }
    }
    /* Drive them until every connection is accepted and curl has nothing left to send. */
    for (int round = 0; round < 600 && atomic_load(&accepted) < calls; round++) {
        tally_error_t err;
        if (tally_connector_poll(c, NULL, 0, 50, NULL, NULL, &err) < 0) {
            fprintf(stderr, "tally-bench-connmem: %s\n", err.message);
            return 1;
        }
    }
    for (int round = 0; round < 20; round++) {
        tally_error_t err;
        (void)tally_connector_poll(c, NULL, 0, 10, NULL, NULL, &err);
    }
    after = rss_anon_kb();
    int held = tally_connector_inflight(c);
    double per_call = (double)(after - before) * 1024.0 / calls;
    printf("bench: connmem_easy_handle = %.0f bytes (curl_easy_init alone, per handle)\n",
           per_easy);
    printf("bench: connmem_call = %.0f bytes (one call in flight: easy handle, connection, "
           "request; %d of %d held, %d connections accepted)\n",
           per_call, held, calls, atomic_load(&accepted));
    printf("bench: connmem_calls_mb = %.1f MB (%d calls in flight)\n",
           (double)(after - before) / 1024.0, calls);
    tally_connector_free(c, NULL);
    curl_global_cleanup();
    return held == calls ? 0 : 1;
}
