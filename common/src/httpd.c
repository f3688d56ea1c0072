/* httpd.c — /metrics, /healthz and /readyz over libmicrohttpd, served from its own thread. */
#include "tally/httpd.h"

#include <errno.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <microhttpd.h>

#include "tally/log.h"

/* Connections a listener takes in all, and from one client address; an idle connection is
 * closed after IDLE_S. A client holding all of its share starves only itself: the next
 * scraper or probe from elsewhere still gets in. The health listener is smaller still. */
#define METRICS_CONNECTIONS 64
#define METRICS_PER_CLIENT  8
#define HEALTH_CONNECTIONS  16
#define HEALTH_PER_CLIENT   4
#define IDLE_S              10

struct tally_httpd {
    struct MHD_Daemon *daemon;
    bool health_only; /* TALLY_HEALTH_ADDR: /healthz and /readyz only */
    tally_metrics_t *metrics;
    tally_health_fn health;
    tally_ready_fn ready;
    void *opaque;
    int port;
};

/* libmicrohttpd's own complaints go through the JSON log rather than raw stderr. */
static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) {
        msg[--n] = '\0';
    }
    TALLY_WARN("http server: %s", msg);
}

static enum MHD_Result respond(struct MHD_Connection *conn, unsigned int status, char *body,
                               enum MHD_ResponseMemoryMode mode, const char *content_type,
                               bool allow_header)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(body), body, mode);
    if (resp == NULL) {
        if (mode == MHD_RESPMEM_MUST_FREE) {
            free(body);
        }
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (allow_header) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    }
    enum MHD_Result r = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return r;
}

static enum MHD_Result respond_text(struct MHD_Connection *conn, unsigned int status,
                                    const char *text, bool allow_header)
{
    return respond(conn, status, (char *)text, MHD_RESPMEM_MUST_COPY, "text/plain; charset=utf-8",
                   allow_header);
}

/* A probe: 200 with @p ok_text, or 503 with the reason the callback gave. */
static enum MHD_Result probe(struct MHD_Connection *conn, bool (*fn)(void *, char *, size_t),
                             void *opaque, const char *ok_text)
{
    char why[256] = "";
    if (fn == NULL || fn(opaque, why, sizeof why)) {
        return respond_text(conn, MHD_HTTP_OK, ok_text, false);
    }
    return respond_text(conn, MHD_HTTP_SERVICE_UNAVAILABLE, why[0] != '\0' ? why : "not ok", false);
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *conn, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_data_size, void **con_cls)
{
    (void)version;
    (void)upload_data;
    (void)con_cls;
    tally_httpd_t *h = cls;
    /* HEAD is GET without the body (MHD drops it); anything else is refused before any
     * request body is read. */
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
        *upload_data_size = 0;
        return respond_text(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "method not allowed\n", true);
    }
    if (strcmp(url, "/metrics") == 0 && !h->health_only) {
        char *text = tally_metrics_render(h->metrics);
        if (text == NULL) {
            return respond_text(conn, MHD_HTTP_INTERNAL_SERVER_ERROR,
                                "out of memory rendering metrics\n", false);
        }
        return respond(conn, MHD_HTTP_OK, text, MHD_RESPMEM_MUST_FREE,
                       "text/plain; version=0.0.4; charset=utf-8", false);
    }
    if (strcmp(url, "/healthz") == 0) {
        return probe(conn, h->health, h->opaque, "ok");
    }
    if (strcmp(url, "/readyz") == 0) {
        return probe(conn, h->ready, h->opaque, "ready");
    }
    return respond_text(conn, MHD_HTTP_NOT_FOUND,
                        h->health_only ? "not found: try /healthz, /readyz\n"
                                       : "not found: try /metrics, /healthz, /readyz\n",
                        false);
}

/* "host:port", "[v6]:port" or ":port" (every interface) into host and port strings. */
static bool split_addr(const char *addr, char *host, size_t hostsz, char *port, size_t portsz,
                       char *errstr, size_t errsz)
{
    const char *colon;
    const char *hb = addr;
    const char *he;
    if (addr[0] == '[') {
        const char *close = strchr(addr, ']');
        if (close == NULL || close[1] != ':') {
            snprintf(errstr, errsz, "metrics address '%s': expected [ipv6]:port", addr);
            return false;
        }
        hb = addr + 1;
        he = close;
        colon = close + 1;
    } else {
        colon = strrchr(addr, ':');
        if (colon == NULL) {
            snprintf(errstr, errsz, "metrics address '%s': expected host:port", addr);
            return false;
        }
        he = colon;
    }
    const char *p = colon + 1;
    if (*p == '\0' || strspn(p, "0123456789") != strlen(p) || strlen(p) > 5 || atoi(p) > 65535) {
        snprintf(errstr, errsz, "metrics address '%s': '%s' is not a port number", addr, p);
        return false;
    }
    if ((size_t)(he - hb) >= hostsz) {
        snprintf(errstr, errsz, "metrics address '%s': host name too long", addr);
        return false;
    }
    memcpy(host, hb, (size_t)(he - hb));
    host[he - hb] = '\0';
    snprintf(port, portsz, "%s", p);
    return true;
}

static tally_httpd_t *start(const char *addr, tally_metrics_t *metrics, tally_health_fn health,
                            tally_ready_fn ready, void *opaque, char *errstr, size_t errsz)
{
    char host[256];
    char port[8];
    if (addr == NULL || !split_addr(addr, host, sizeof host, port, sizeof port, errstr, errsz)) {
        if (addr == NULL) {
            snprintf(errstr, errsz, "no metrics address given");
        }
        return NULL;
    }
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_ADDRCONFIG};
    struct addrinfo *ai = NULL;
    int gai = getaddrinfo(host[0] != '\0' ? host : NULL, port, &hints, &ai);
    if (gai != 0) {
        snprintf(errstr, errsz, "metrics address '%s': %s", addr, gai_strerror(gai));
        return NULL;
    }
    tally_httpd_t *h = calloc(1, sizeof *h);
    if (h == NULL) {
        freeaddrinfo(ai);
        snprintf(errstr, errsz, "out of memory");
        return NULL;
    }
    h->metrics = metrics;
    h->health_only = metrics == NULL;
    h->health = health;
    h->ready = ready;
    h->opaque = opaque;
    /* poll/epoll, not select(): a dispatcher holding thousands of connector sockets has
     * descriptors above FD_SETSIZE, and select() would refuse every probe exactly then */
    unsigned int flags = MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) {
        flags |= MHD_USE_IPv6;
    }
    errno = 0;
    /* The port argument is ignored when MHD_OPTION_SOCK_ADDR is given, which MHD copies
     * into the socket it binds before returning. */
    h->daemon = MHD_start_daemon(
        flags, 0, NULL, NULL, handle, h, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
        MHD_OPTION_SOCK_ADDR, ai->ai_addr, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)IDLE_S,
        MHD_OPTION_CONNECTION_LIMIT,
        (unsigned int)(h->health_only ? HEALTH_CONNECTIONS : METRICS_CONNECTIONS),
        MHD_OPTION_PER_IP_CONNECTION_LIMIT,
        (unsigned int)(h->health_only ? HEALTH_PER_CLIENT : METRICS_PER_CLIENT), MHD_OPTION_END);
    int saved = errno;
    freeaddrinfo(ai);
    if (h->daemon == NULL) {
        snprintf(errstr, errsz, "cannot serve metrics on '%s': %s", addr,
                 saved != 0 ? strerror(saved) : "libmicrohttpd could not start");
        free(h);
        return NULL;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info != NULL ? info->port : atoi(port);
    return h;
}

tally_httpd_t *tally_httpd_start(const char *addr, tally_metrics_t *metrics, tally_health_fn health,
                                 tally_ready_fn ready, void *opaque, char *errstr, size_t errsz)
{
    if (metrics == NULL) {
        snprintf(errstr, errsz, "no metrics to serve");
        return NULL;
    }
    return start(addr, metrics, health, ready, opaque, errstr, errsz);
}

tally_httpd_t *tally_httpd_start_health(const char *addr, tally_health_fn health,
                                        tally_ready_fn ready, void *opaque, char *errstr,
                                        size_t errsz)
{
    return start(addr, NULL, health, ready, opaque, errstr, errsz);
}

int tally_httpd_port(const tally_httpd_t *h)
{
    return h != NULL ? h->port : 0;
}

void tally_httpd_stop(tally_httpd_t *h)
{
    if (h == NULL) {
        return;
    }
    MHD_stop_daemon(h->daemon);
    free(h);
}
