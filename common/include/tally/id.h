/* id.h — identifiers: random and time-ordered UUIDs (RFC 9562), thread- and fork-safe. */
#ifndef TALLY_ID_H
#define TALLY_ID_H

/** @brief A fresh random (version 4) UUID in canonical lowercase form ("xxxxxxxx-xxxx-...") in
 * @p out: 122 bits from the kernel's random source (getrandom), read in blocks per thread. */
void tally_uuid(char out[37]);

/**
 * @brief A time-ordered UUID (the version 7 layout: 48 bits of Unix milliseconds, then the
 * random bits of tally_uuid, 74 of them, which keep it unique). Rows keyed by it land on the
 * last pages of their indexes instead of a random page each, which keeps inserts cheap as the
 * ledger and the audit trail grow.
 */
void tally_uuid_v7(char out[37]);

#endif
