/* ledger.c — the state machines of ledger.h. The tables and functions are generated from
 * schemas/machines.json (machines.inc, by scripts/gen_machines.py at configure time): the
 * declaration is the whole truth about which moves exist, and the database's triggers are
 * generated from the same file. */
#include "tally/ledger.h"

#include <stddef.h>
#include <string.h>

static bool name_lookup(const char *const *names, int n, const char *s, int *out)
{
    if (s == NULL)
        return false;
    for (int i = 0; i < n; i++) {
        if (strcmp(names[i], s) == 0) {
            *out = i;
            return true;
        }
    }
    return false;
}

#include "machines.inc"
