/* dev_kafka.c — librdkafka's mock cluster of `tally dev` (dev.h), served from this process,
 * with the tally topics. */
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "dev.h"

const char *const dev_topics[DEV_N_TOPICS] = {"intents", "outcomes", "obligations", "alerts",
                                              "dlq"};

/* TCP_NODELAY on the mock's listening sockets (found by port; Linux hands it to every accepted
 * one), as a real broker has. Best effort. Why: bench/README.md, "The mock broker". */
static void mock_nodelay(const char *bootstraps)
{
    const char *colon = strrchr(bootstraps, ':');
    int port = colon ? atoi(colon + 1) : 0;
    DIR *dir = port > 0 ? opendir("/proc/self/fd") : NULL;
    if (!dir)
        return;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        int fd = atoi(de->d_name);
        if (de->d_name[0] == '.' || fd == dirfd(dir))
            continue;
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int listening = 0;
        socklen_t olen = sizeof listening;
        if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 ||
            getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &olen) != 0 || !listening)
            continue;
        int bound = ss.ss_family == AF_INET    ? ntohs(((struct sockaddr_in *)&ss)->sin_port)
                    : ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                               : -1;
        int one = 1;
        if (bound == port)
            (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    closedir(dir);
}

bool dev_kafka_up(dev_stack_t *s, char *errstr, size_t errsz)
{
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    char rderr[512];
    /* this handle only hosts the cluster: it has no bootstrap.servers to complain about */
    if (rd_kafka_conf_set(conf, "client.id", "tally-dev-mock", rderr, sizeof(rderr)) !=
            RD_KAFKA_CONF_OK ||
        rd_kafka_conf_set(conf, "log_level", "4", rderr, sizeof(rderr)) != RD_KAFKA_CONF_OK) {
        rd_kafka_conf_destroy(conf);
        dev_err(errstr, errsz, "librdkafka configuration: %s", rderr);
        return false;
    }
    s->mock_rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, rderr, sizeof(rderr));
    if (s->mock_rk == NULL) {
        rd_kafka_conf_destroy(conf);
        dev_err(errstr, errsz, "cannot create the librdkafka handle for the mock cluster: %s",
                rderr);
        return false;
    }
    s->mcluster = rd_kafka_mock_cluster_new(s->mock_rk, DEV_MOCK_BROKERS);
    if (s->mcluster == NULL) {
        dev_err(errstr, errsz, "librdkafka could not create its mock cluster");
        return false;
    }
    snprintf(s->brokers, sizeof(s->brokers), "%s", rd_kafka_mock_cluster_bootstraps(s->mcluster));
    mock_nodelay(s->brokers);
    for (size_t i = 0; i < DEV_N_TOPICS; i++) {
        char topic[256];
        if (!tally_config_topic(s->cfg, dev_topics[i], topic, sizeof(topic))) {
            dev_err(errstr, errsz, "topic name '%s%s' is too long", s->cfg->topic_prefix,
                    dev_topics[i]);
            return false;
        }
        rd_kafka_resp_err_t e =
            rd_kafka_mock_topic_create(s->mcluster, topic, s->partitions, DEV_MOCK_BROKERS);
        if (e != RD_KAFKA_RESP_ERR_NO_ERROR) {
            dev_err(errstr, errsz, "cannot create topic %s: %s", topic, rd_kafka_err2str(e));
            return false;
        }
    }
    return true;
}

void dev_kafka_stop(dev_stack_t *s)
{
    if (s->mcluster != NULL)
        rd_kafka_mock_cluster_destroy(s->mcluster);
    s->mcluster = NULL;
    if (s->mock_rk != NULL)
        rd_kafka_destroy(s->mock_rk);
    s->mock_rk = NULL;
}
