/* fuzz_registry.c — the tool registry loader on any file contents.
 *
 * tally_registry_load_file takes a path: the input is written to a memfd, opened by its
 * /proc/self/fd name, so the fuzzer exercises what a worker reads at start (jansson's errors
 * included) without touching a disk. Invariants: a registry or problems, never both and never
 * neither; every problem line valid UTF-8 (it is printed by `tally tools check` and logged as
 * JSON); every tool loaded keeps the rules of registry.h; nothing leaks (LeakSanitizer). */
#include "fuzz.h"

#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tally/registry.h"

static int fd = -1;
static char path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    fd = memfd_create("tally-fuzz-registry", 0);
    FUZZ_CHECK(fd >= 0, "memfd_create failed");
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    /* ${TALLY_FUZZ_URL} and ${TALLY_FUZZ_EMPTY:-...} in base_url expand; anything else is unset */
    setenv("TALLY_FUZZ_URL", "http://tools.internal:9000/", 1);
    setenv("TALLY_FUZZ_EMPTY", "", 1);
    return 0;
}

static void check_endpoint(const char *what, const tally_endpoint_t *e)
{
    if (e->method == NULL) {
        FUZZ_CHECK(e->path == NULL, "%s has a path and no method", what);
        return;
    }
    FUZZ_CHECK(e->path != NULL && e->path[0] == '/', "%s path", what);
}

static void check_tool(const tally_tool_t *t)
{
    size_t len = fuzz_check_str("tool name", t->name);
    FUZZ_CHECK(len > 0 && len <= 63 && t->name[0] >= 'a' && t->name[0] <= 'z', "name \"%s\"",
               t->name);
    FUZZ_CHECK(t->base_url != NULL && (strncasecmp(t->base_url, "http://", 7) == 0 ||
                                       strncasecmp(t->base_url, "https://", 8) == 0),
               "tool %s: base_url \"%s\"", t->name, t->base_url ? t->base_url : "(null)");
    fuzz_check_str("base_url", t->base_url);
    FUZZ_CHECK(t->execute.method != NULL, "tool %s has no execute endpoint", t->name);
    check_endpoint("execute", &t->execute);
    check_endpoint("status", &t->status);
    check_endpoint("compensate", &t->compensate);
    check_endpoint("contain", &t->contain);
    FUZZ_CHECK(t->receipt_ref != NULL, "tool %s has no receipt_ref", t->name);
    for (size_t i = 0; i < t->n_operation_key; i++)
        FUZZ_CHECK(t->operation_key[i] != NULL && t->operation_key[i][0] != '\0',
                   "tool %s: operation_key[%zu]", t->name, i);
    FUZZ_CHECK(t->timeout_ms >= 1 && t->max_attempts >= 1 && t->backoff_ms >= 1 &&
                   t->max_backoff_ms >= t->backoff_ms && t->settle_ms >= 0 &&
                   t->max_concurrency >= 1,
               "tool %s: a number out of range", t->name);
    if (t->effect_class == TALLY_CLASS_DESTRUCTIVE)
        FUZZ_CHECK(t->requires_approval, "destructive tool %s without approval", t->name);
    if (t->effect_class == TALLY_CLASS_REVERSIBLE)
        FUZZ_CHECK(t->compensate.method != NULL && t->status.method != NULL,
                   "reversible tool %s without compensate or status", t->name);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    FUZZ_CHECK(ftruncate(fd, 0) == 0, "ftruncate failed");
    FUZZ_CHECK(pwrite(fd, data, size, 0) == (ssize_t)size, "pwrite failed");

    tally_problems_t problems = {0};
    tally_registry_t *reg = tally_registry_load_file(path, &problems);
    FUZZ_CHECK((reg == NULL) == (problems.n > 0), "registry %p with %zu problems", (void *)reg,
               problems.n);
    for (size_t i = 0; i < problems.n; i++) {
        size_t len = fuzz_check_str("problem", problems.lines[i]);
        FUZZ_CHECK(len > 0, "an empty problem line");
    }
    for (size_t i = 0; i < tally_registry_count(reg); i++) {
        const tally_tool_t *t = tally_registry_at(reg, i);
        check_tool(t);
        FUZZ_CHECK(tally_registry_find(reg, t->name) == t, "tool %s is not found by name", t->name);
    }
    tally_registry_free(reg);
    tally_problems_clear(&problems);
    return 0;
}
