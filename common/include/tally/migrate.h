/* migrate.h — versioned SQL migrations compiled into the binaries, and the window of schema
 * versions each binary runs on (docs/operations.md, "Upgrading and rolling back"). */
#ifndef TALLY_MIGRATE_H
#define TALLY_MIGRATE_H

#include <stdbool.h>
#include <stddef.h>

#include "tally/error.h"
#include "tally/pg.h"
#include "tally/roles.h"

typedef struct tally_migration {
    int version;      /**< from the file name NNN_ */
    const char *name; /**< the rest of the file name */
    const char *sql;
    /**
     * 0 for an expand step (it only adds: binaries that do not know it keep working). A contract
     * step (a `-- tally:serves-from N` line in its file) removes or changes what older binaries
     * use: once it is applied, binaries whose newest schema is older than N are no longer served.
     */
    int serves_from;
} tally_migration_t;

/** A release of tally: its name and the newest schema version it knows. */
typedef struct tally_release {
    const char *name;
    int schema;
} tally_release_t;

/** Every release up to this binary's, oldest first, ended by {NULL, 0}. */
extern const tally_release_t tally_releases[];

/**
 * The oldest schema version this binary runs on. The newest is tally_migrate_latest(). Every
 * migration after it is an expand step this binary's code does without, so a new binary starts
 * before `tally migrate` has run.
 */
#define TALLY_SCHEMA_OLDEST 15

/* The first schema with message_refs (017): outcome messages that reference the ledger. */
#define TALLY_SCHEMA_MESSAGE_REFS 17

/* TALLY_SCHEMA_NEWEST, the number of the newest file in schemas/sql (the build defines it, so
 * that pg.c names sessions without the migrations table), is tally_migrate_latest(). */
#ifndef TALLY_SCHEMA_NEWEST
#error "TALLY_SCHEMA_NEWEST is defined by the build (CMakeLists.txt)"
#endif

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
 * @brief The version in the database (0 when none).
 */
bool tally_migrate_current(tally_pg_t *pg, int *version, tally_error_t *err) TALLY_WUR;

/** @brief The name of the first release whose newest schema is @p schema or later, or NULL. */
const char *tally_migrate_release_of(int schema);

/**
 * @brief Parse the application_name of a tally session (pg.c): "tally-dispatcher/0.2.0
 * (schema 15-16)", its release and the schemas it runs on. @returns false for any
 * other text (a process of a release before the window, or not tally's).
 */
bool tally_migrate_parse_app_name(const char *app, char *release, size_t releasesz, int *oldest,
                                  int *newest);

/** What the ledger says of its schema. */
typedef struct tally_schema_window {
    int version;                  /**< the newest migration applied (0: none) */
    int serves_from;              /**< the oldest binary schema it serves; 0 when it records none */
    char serves_from_release[64]; /**< the release of that schema, as recorded */
} tally_schema_window_t;

/** @brief Read the version and the window (tally_schema_window, from version 15). */
bool tally_migrate_window(tally_pg_t *pg, tally_schema_window_t *win, tally_error_t *err) TALLY_WUR;

/** Whether a binary runs on a ledger. */
typedef enum tally_schema_fit {
    TALLY_SCHEMA_FITS,       /**< the binary's own schema */
    TALLY_SCHEMA_FITS_OLDER, /**< older than the binary's, inside its window: migrate to finish */
    TALLY_SCHEMA_FITS_NEWER, /**< newer, written by a later release that still serves this one */
    TALLY_SCHEMA_TOO_OLD,    /**< older than the binary's oldest */
    TALLY_SCHEMA_TOO_NEW,    /**< newer, and no longer serving this binary's schema */
} tally_schema_fit_t;

/**
 * @brief Whether a binary of @p release, running on schemas @p oldest to @p newest, may run on
 * the ledger @p win. @p msg says what was found and, when it may not, which release to run.
 */
tally_schema_fit_t tally_schema_fit(const tally_schema_window_t *win, int oldest, int newest,
                                    const char *release, char *msg, size_t msgsz);

/**
 * @brief The oldest binary schema a ledger at @p version serving from @p serves_from will
 * serve once this binary's migrations after @p version are applied: raised by contract steps.
 */
int tally_migrate_serves_from_after(int version, int serves_from);

/** @brief tally_migrate_serves_from_after over the migrations @p list ({0, NULL...}-ended). */
int tally_migrations_serves_from_after(const tally_migration_t *list, int version, int serves_from);

/** A tally process connected to the ledger now, from pg_stat_activity. */
typedef struct tally_schema_session {
    int pid;            /**< its backend's */
    char app[64];       /**< its application_name */
    char release[32];   /**< "" when the name carries no window (a release before 0.1.0) */
    int oldest, newest; /**< the schemas it runs on; 0 when unknown */
    char user[64];      /**< the role it connects as */
} tally_schema_session_t;

/**
 * @brief The sessions of tally processes connected to this database, but this one and
 * `tally migrate`s, at most @p max of them (@p n counts them all).
 */
bool tally_migrate_sessions(tally_pg_t *pg, tally_schema_session_t *sessions, size_t max, size_t *n,
                            tally_error_t *err) TALLY_WUR;

/** @brief true when @p s runs on a ledger serving binaries from schema @p serves_from on. */
bool tally_schema_session_served(const tally_schema_session_t *s, int serves_from);

#endif
