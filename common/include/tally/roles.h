/* roles.h — one database role per component: their names, what each may do to each ledger
 * table, how `tally migrate` makes it so, and the check that keeps a worker off the owner. */
#ifndef TALLY_ROLES_H
#define TALLY_ROLES_H

#include <stdbool.h>
#include <stddef.h>

#include "tally/config.h"
#include "tally/error.h"
#include "tally/pg.h"

/** @brief The runtime roles, in the order of the grants table's columns. The owner (whoever
 * runs `tally migrate`) is none of them: it owns the tables and grants the rest. */
typedef enum tally_role {
    TALLY_ROLE_DISPATCHER,
    TALLY_ROLE_RECONCILER,
    TALLY_ROLE_COMPENSATOR,
    TALLY_ROLE_OPERATOR, /**< the CLI verbs that change the ledger */
    TALLY_ROLE_READER,   /**< read-only: status, doctor, summary, dashboards */
    TALLY_ROLE_COUNT
} tally_role_t;

/** @brief "dispatcher", "reconciler", "compensator", "operator", "reader". */
const char *tally_role_component(tally_role_t role);

/** @brief The role's name: TALLY_ROLE_<COMPONENT> (tally_dispatcher, ... by default). */
const char *tally_role_name(const tally_config_t *cfg, tally_role_t role);

/** @brief The number of ledger tables in the grants table. */
size_t tally_roles_n_tables(void);

/** @brief The @p i th ledger table's name. */
const char *tally_roles_table(size_t i);

/** @brief What @p role may do to table @p i: "SELECT, INSERT", or "" for nothing. */
const char *tally_roles_privileges(tally_role_t role, size_t i);

/** @brief What `tally migrate` did for one role. */
typedef struct tally_role_outcome {
    char name[64];     /**< the role (NAMEDATALEN) */
    bool created;      /**< by this run; false: it existed */
    bool password_set; /**< TALLY_ROLE_PASSWORD_<COMPONENT> was given and set */
    int tables;        /**< tables it was granted something on */
} tally_role_outcome_t;

typedef struct tally_roles_report {
    tally_role_outcome_t role[TALLY_ROLE_COUNT];
    char schema[64];   /**< the schema the ledger is in */
    char warning[512]; /**< "" or a sentence: a runtime role can still create in the schema */
} tally_roles_report_t;

/**
 * @brief Ensure every runtime role exists and holds exactly the grants table's privileges on
 * the ledger, inside the caller's transaction (tally_migrate_apply calls it after the
 * migrations and the machines). A missing role is created (LOGIN, nothing else) when the
 * current user may (CREATEROLE); when it may not, fails naming the role and what to do. A role
 * created meanwhile by another `tally migrate` (another database on the cluster) is taken as
 * existing. The names and passwords go to the server as parameters, quoted there.
 * @param report filled when not NULL.
 */
bool tally_roles_ensure(tally_pg_t *pg, const tally_config_t *cfg, tally_roles_report_t *report,
                        tally_error_t *err) TALLY_WUR;

/** @brief Who a connection runs as, for the workers' start-up check. */
typedef struct tally_session_role {
    char user[64];     /**< current_user */
    char owner[64];    /**< the role owning the ledger (its events table) */
    bool superuser;    /**< current_user is a superuser */
    bool owner_member; /**< current_user is the owner, or a member of it */
} tally_session_role_t;

/** @brief Read tally_session_role_t for @p pg's connection. */
bool tally_roles_session(tally_pg_t *pg, tally_session_role_t *who, tally_error_t *err) TALLY_WUR;

/** @brief Whether a worker connected as @p who runs with more privilege than it needs: as a
 * superuser or as (a member of) the owner. Fills @p why with a sentence saying which. */
bool tally_roles_privileged(const tally_session_role_t *who, char *why, size_t whysz);

#endif
