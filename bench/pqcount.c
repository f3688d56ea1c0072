/* pqcount.c — libtally-bench-pqcount.so: counts the statements a process sends to PostgreSQL.
 *
 * bench/run.sh preloads it (LD_PRELOAD) into the dispatchers and into pgbench, because the
 * server cannot count statements here: pg_stat_statements needs shared_preload_libraries,
 * which `tally dev` does not set, and logging every statement slows the run down. It wraps
 * libpq's calls that send a statement and adds one to a counter in a file every process maps
 * shared (TALLY_BENCH_PQCOUNT names it), so the harness reads the total of every process at
 * any moment without stopping them. The counters are 64-bit, updated atomically:
 *
 *   [0] statements: PQsendQuery, PQsendQueryParams, PQsendQueryPrepared, PQexec,
 *       PQexecParams, PQexecPrepared (a PQexec* counts once, not again for the PQsend* it
 *       calls inside libpq)
 *   [1] prepares: PQsendPrepare, PQprepare (a statement parsed and planned for later)
 *
 * One call is one statement, except a simple-protocol string holding several (tally sends
 * such strings only for migrations and LISTEN; pgbench sends one command per call). Without
 * TALLY_BENCH_PQCOUNT, or when the file cannot be mapped, it only passes the calls on. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <fcntl.h>
#include <libpq-fe.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

enum { PQC_STATEMENTS, PQC_PREPARES, PQC_SLOTS = 8 };

static uint64_t *counters;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static __thread int depth; /* inside a wrapped call: the inner PQsend* is not counted again */

static void map_counters(void)
{
    const char *path = getenv("TALLY_BENCH_PQCOUNT");
    if (path == NULL || *path == '\0')
        return;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return;
    struct stat st;
    size_t size = PQC_SLOTS * sizeof(uint64_t);
    if (fstat(fd, &st) == 0 && (size_t)st.st_size < size && ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p != MAP_FAILED)
        counters = p;
}

static void count(int slot)
{
    if (depth > 0)
        return;
    pthread_once(&once, map_counters);
    if (counters != NULL)
        __atomic_fetch_add(&counters[slot], 1, __ATOMIC_RELAXED);
}

/* The next definition of @p name (libpq's), looked up once. */
#define NEXT(type, name)                                                                           \
    static type next_;                                                                             \
    type fn_ = __atomic_load_n(&next_, __ATOMIC_ACQUIRE);                                          \
    if (fn_ == NULL) {                                                                             \
        fn_ = (type)dlsym(RTLD_NEXT, name);                                                        \
        if (fn_ == NULL)                                                                           \
            abort();                                                                               \
        __atomic_store_n(&next_, fn_, __ATOMIC_RELEASE);                                           \
    }

typedef int (*send_query_fn)(PGconn *, const char *);
typedef int (*send_params_fn)(PGconn *, const char *, int, const Oid *, const char *const *,
                              const int *, const int *, int);
typedef int (*send_prepared_fn)(PGconn *, const char *, int, const char *const *, const int *,
                                const int *, int);
typedef int (*send_prepare_fn)(PGconn *, const char *, const char *, int, const Oid *);
typedef PGresult *(*exec_fn)(PGconn *, const char *);
typedef PGresult *(*exec_params_fn)(PGconn *, const char *, int, const Oid *, const char *const *,
                                    const int *, const int *, int);
typedef PGresult *(*exec_prepared_fn)(PGconn *, const char *, int, const char *const *, const int *,
                                      const int *, int);
typedef PGresult *(*prepare_fn)(PGconn *, const char *, const char *, int, const Oid *);

int PQsendQuery(PGconn *conn, const char *query)
{
    NEXT(send_query_fn, "PQsendQuery");
    count(PQC_STATEMENTS);
    depth++;
    int rc = fn_(conn, query);
    depth--;
    return rc;
}

int PQsendQueryParams(PGconn *conn, const char *command, int nParams, const Oid *paramTypes,
                      const char *const *paramValues, const int *paramLengths,
                      const int *paramFormats, int resultFormat)
{
    NEXT(send_params_fn, "PQsendQueryParams");
    count(PQC_STATEMENTS);
    depth++;
    int rc = fn_(conn, command, nParams, paramTypes, paramValues, paramLengths, paramFormats,
                 resultFormat);
    depth--;
    return rc;
}

int PQsendQueryPrepared(PGconn *conn, const char *stmtName, int nParams,
                        const char *const *paramValues, const int *paramLengths,
                        const int *paramFormats, int resultFormat)
{
    NEXT(send_prepared_fn, "PQsendQueryPrepared");
    count(PQC_STATEMENTS);
    depth++;
    int rc = fn_(conn, stmtName, nParams, paramValues, paramLengths, paramFormats, resultFormat);
    depth--;
    return rc;
}

int PQsendPrepare(PGconn *conn, const char *stmtName, const char *query, int nParams,
                  const Oid *paramTypes)
{
    NEXT(send_prepare_fn, "PQsendPrepare");
    count(PQC_PREPARES);
    depth++;
    int rc = fn_(conn, stmtName, query, nParams, paramTypes);
    depth--;
    return rc;
}

PGresult *PQexec(PGconn *conn, const char *query)
{
    NEXT(exec_fn, "PQexec");
    count(PQC_STATEMENTS);
    depth++;
    PGresult *res = fn_(conn, query);
    depth--;
    return res;
}

PGresult *PQexecParams(PGconn *conn, const char *command, int nParams, const Oid *paramTypes,
                       const char *const *paramValues, const int *paramLengths,
                       const int *paramFormats, int resultFormat)
{
    NEXT(exec_params_fn, "PQexecParams");
    count(PQC_STATEMENTS);
    depth++;
    PGresult *res = fn_(conn, command, nParams, paramTypes, paramValues, paramLengths, paramFormats,
                        resultFormat);
    depth--;
    return res;
}

PGresult *PQexecPrepared(PGconn *conn, const char *stmtName, int nParams,
                         const char *const *paramValues, const int *paramLengths,
                         const int *paramFormats, int resultFormat)
{
    NEXT(exec_prepared_fn, "PQexecPrepared");
    count(PQC_STATEMENTS);
    depth++;
    PGresult *res =
        fn_(conn, stmtName, nParams, paramValues, paramLengths, paramFormats, resultFormat);
    depth--;
    return res;
}

PGresult *PQprepare(PGconn *conn, const char *stmtName, const char *query, int nParams,
                    const Oid *paramTypes)
{
    NEXT(prepare_fn, "PQprepare");
    count(PQC_PREPARES);
    depth++;
    PGresult *res = fn_(conn, stmtName, query, nParams, paramTypes);
    depth--;
    return res;
}
