/* migrate.h — versioned SQL migrations compiled into the binaries. */
#ifndef TALLY_MIGRATE_H
#define TALLY_MIGRATE_H

#include <stdbool.h>

#include "tally/error.h"
#include "tally/pg.h"
#include "tally/roles.h"

typedef struct tally_migration {
    int version;      /**< from the file name NNN_ */
    const char *name; /**< the rest of the file name */
    const char *sql;
} tally_migration_t;

/** The embedded migrations in version order, ended by {0, NULL, NULL} (generated). */
extern const tally_migration_t tally_migrations[];

/** @brief The newest version this binary knows. */
int tally_migrate_latest(void);

/**
 * @brief Apply every migration newer than the database's, then the state machines, then the
 * runtime roles and their grants (roles.h), in one transaction, holding an advisory lock so
 * concurrent `tally migrate` runs serialise. Idempotent. The connection's role becomes the
 * owner of what it creates, and needs CREATEROLE only while a role is missing.
 * @param cfg the role names and passwords (TALLY_ROLE_*).
 * @param before set to the version found (0 for an empty database); may be NULL.
 * @param after set to the version now in force; may be NULL.
 * @param roles what was done for each role; may be NULL.
 */
bool tally_migrate_apply(tally_pg_t *pg, const tally_config_t *cfg, int *before, int *after,
                         tally_roles_report_t *roles, tally_error_t *err) TALLY_WUR;

/**
 * @brief The version in the database (0 when none), for workers that refuse to run
 * against a schema older than tally_migrate_latest().
 */
bool tally_migrate_current(tally_pg_t *pg, int *version, tally_error_t *err) TALLY_WUR;

#endif
