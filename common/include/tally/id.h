/* id.h — identifiers (libuuid). */
#ifndef TALLY_ID_H
#define TALLY_ID_H

/** @brief A fresh random UUID in canonical lowercase form ("xxxxxxxx-xxxx-...") in @p out. */
void tally_uuid(char out[37]);

#endif
