/* id.c — identifiers: random (version 4) UUIDs from libuuid. */
#include "tally/id.h"

#include <uuid/uuid.h>

void tally_uuid(char out[37])
{
    uuid_t u;
    uuid_generate_random(u);
    uuid_unparse_lower(u, out);
}
