/* id.c — identifiers: random (version 4) UUIDs from libuuid, and time-ordered (version 7)
 * ones built on them. */
#include "tally/id.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <uuid/uuid.h>

void tally_uuid(char out[37])
{
    uuid_t u;
    uuid_generate_random(u);
    uuid_unparse_lower(u, out);
}

void tally_uuid_v7(char out[37])
{
    tally_uuid(out);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long ms =
        (unsigned long long)ts.tv_sec * 1000ULL + (unsigned long long)ts.tv_nsec / 1000000ULL;
    char hex[13];
    snprintf(hex, sizeof hex, "%012llx", ms & 0xffffffffffffULL);
    memcpy(out, hex, 8);         /* "tttttttt-" */
    memcpy(out + 9, hex + 8, 4); /* "tttt-" */
    out[14] = '7';               /* the version nibble; the variant bits stay RFC 9562's */
}
