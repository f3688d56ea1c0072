/* id.c — identifiers: random (version 4) and time-ordered (version 7) UUIDs, their random bits
 * read from the kernel (getrandom) a block at a time into a per-thread pool. */
#include "tally/id.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <uuid/uuid.h>

/* libuuid's uuid_generate_random makes a getrandom call per id and re-seeds random(3) (with
 * getpid) every time; the dispatcher makes two or three ids per intent. The same kernel source
 * read 1 KiB at a time is one system call per 64 ids. */
static __thread struct {
    unsigned char bytes[1024];
    size_t left; /* unused bytes, at the start of bytes[]; 0 until the first refill */
} pool;

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static bool atfork_ok;

/* A forked child would otherwise hand out the rest of its parent's pool, the same ids as the
 * parent. It runs in the child's only thread, the one that forked: the other threads' pools
 * are gone with their threads. */
static void forget_pool_in_child(void)
{
    pool.left = 0;
}

static void register_atfork(void)
{
    atfork_ok = pthread_atfork(NULL, NULL, forget_pool_in_child) == 0;
}

static bool refill(void)
{
    /* registered before any pool holds bytes, so no fork can copy one unnoticed */
    pthread_once(&atfork_once, register_atfork);
    if (!atfork_ok)
        return false;
    int saved = errno;
    size_t got = 0;
    while (got < sizeof pool.bytes) {
        ssize_t n = getrandom(pool.bytes + got, sizeof pool.bytes - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            errno = saved;
            return false;
        }
        got += (size_t)n;
    }
    errno = saved;
    pool.left = sizeof pool.bytes;
    return true;
}

static void random16(unsigned char u[16])
{
    if (pool.left < 16 && !refill()) {
        uuid_generate_random(u); /* no getrandom(2) here: libuuid's own sources */
        return;
    }
    pool.left -= 16;
    memcpy(u, pool.bytes + pool.left, 16);
}

/* RFC 9562: the version in the high nibble of octet 6, the variant (10) in the top bits of
 * octet 8; then the canonical lowercase text. */
static void finish(unsigned char u[16], unsigned version, char out[37])
{
    static const char hex[] = "0123456789abcdef";
    u[6] = (unsigned char)((u[6] & 0x0f) | (version << 4));
    u[8] = (unsigned char)((u[8] & 0x3f) | 0x80);
    char *p = out;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10)
            *p++ = '-';
        *p++ = hex[u[i] >> 4];
        *p++ = hex[u[i] & 0x0f];
    }
    *p = '\0';
}

void tally_uuid(char out[37])
{
    unsigned char u[16];
    random16(u);
    finish(u, 4, out);
}

void tally_uuid_v7(char out[37])
{
    unsigned char u[16];
    random16(u);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long ms =
        (unsigned long long)ts.tv_sec * 1000ULL + (unsigned long long)ts.tv_nsec / 1000000ULL;
    for (int i = 5; i >= 0; i--) { /* the low 48 bits, big-endian */
        u[i] = (unsigned char)(ms & 0xff);
        ms >>= 8;
    }
    finish(u, 7, out);
}
