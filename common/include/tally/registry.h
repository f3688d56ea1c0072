/* registry.h — the tool registry (TALLY_TOOLS): load, enforce DESIGN §4, look up tools. */
#ifndef TALLY_REGISTRY_H
#define TALLY_REGISTRY_H

#include <stdbool.h>
#include <stddef.h>
#include <jansson.h>

#include "tally/error.h"

typedef enum {
    TALLY_CLASS_READ = 0,
    TALLY_CLASS_IDEMPOTENT,
    TALLY_CLASS_REVERSIBLE,
    TALLY_CLASS_APPEND_ONLY,
    TALLY_CLASS_DESTRUCTIVE,
} tally_effect_class_t;

typedef enum {
    TALLY_COMP_AUTOMATIC = 0,
    TALLY_COMP_APPROVAL_REQUIRED,
    TALLY_COMP_MANUAL_RUNBOOK,
    TALLY_COMP_NOT_SUPPORTED,
} tally_comp_mode_t;

/** @brief One connector endpoint; path is NULL when the tool does not declare it. */
typedef struct tally_endpoint {
    char *method; /**< "GET", "POST", ... */
    char *path;   /**< appended to base_url */
} tally_endpoint_t;

/** @brief How requests to a tool are signed (connector.signing). */
typedef enum {
    TALLY_SIGNING_NONE = 0, /**< no connector.signing (connector.secret_env may still be set) */
    TALLY_SIGNING_RFC9421,  /**< RFC 9421 HMAC-SHA256 with a key id, plus RFC 9530 digest */
} tally_signing_scheme_t;

/** @brief connector.signing: {"scheme": "rfc9421", "key_id", "secret_env", "window_s"}. */
typedef struct tally_signing {
    tally_signing_scheme_t scheme;
    char *key_id;     /**< the key id sent (the receiver may accept two during a rotation) */
    char *secret_env; /**< env var holding the HMAC key */
    int window_s;     /**< expires = created + window_s; default 300 */
} tally_signing_t;

/** @brief The tool's "audit" object (DESIGN §12): how the reconciler checks the tool's own
 * records against the ledger after the fact. Rates bound every call that is not the
 * resolution of an UNKNOWN: audits, orphan sweeps and `tally verify --tools`. */
typedef struct tally_audit_policy {
    bool enabled;       /**< re-check CONFIRMED effects (needs connector.status) */
    int delay_ms;       /**< first check this long after CONFIRMED; default 60000 */
    int again_ms;       /**< a second check this long after the first; 0 (default) for none */
    double sample_rate; /**< share of CONFIRMED effects checked, (0, 1]; default 1.0 */
    double rate_per_s;  /**< calls per second toward the tool, all workers together; default 5 */
    int sweep_ms;       /**< orphan sweep period (needs connector.list); 0 for none; default
                           300000 when connector.list is declared */
    int lookback_ms;    /**< the first sweep looks back this far; default 86400000 */
} tally_audit_policy_t;

/** @brief A validated tool contract. All strings are owned by the registry. */
typedef struct tally_tool {
    char *name;
    char *owner;
    tally_effect_class_t effect_class;
    char **operation_key; /**< argument names the key is built from; may be empty */
    size_t n_operation_key;
    char *base_url; /**< no trailing slash */
    tally_endpoint_t execute;
    tally_endpoint_t status;
    tally_endpoint_t compensate;
    tally_endpoint_t contain; /**< append_only containment action (connector.contain), optional */
    tally_endpoint_t list;    /**< the records held for a run or since a time (connector.list) */
    int timeout_ms;           /**< default 5000 */
    char *receipt_ref;        /**< JSON pointer into the receipt, default "/id" */
    char *secret_env;         /**< legacy Tally-Signature secret's env var, or NULL */
    tally_signing_t signing;  /**< RFC 9421 signing; scheme NONE when not declared */
    tally_comp_mode_t comp_mode;
    char *runbook;   /**< may be NULL */
    int deadline_ms; /**< compensation.deadline_ms: an obligation open longer pages; 0 for none */
    tally_audit_policy_t audit; /**< "audit": re-checks and orphan sweeps */
    int max_attempts;           /**< default 5 */
    int backoff_ms;             /**< default 200 */
    int max_backoff_ms;         /**< default 60000 */
    int settle_ms;              /**< default 2000 */
    bool requires_approval;     /**< forced true for destructive */
    int max_concurrency;        /**< default 64 */
    char **sensitive_args;      /**< sensitive.args: JSON pointers into args (seal.h) */
    size_t n_sensitive_args;
    char **sensitive_receipt; /**< sensitive.receipt: JSON pointers into the tool's answers */
    size_t n_sensitive_receipt;
} tally_tool_t;

/** @brief Whether the tool declares sensitive fields: its values are sealed and redacted. */
static inline bool tally_tool_sensitive(const tally_tool_t *t)
{
    return t->n_sensitive_args > 0 || t->n_sensitive_receipt > 0;
}

typedef struct tally_registry tally_registry_t;

/** @brief Problems found while validating: one sentence each, naming the tool and the rule,
 * e.g. "tool 'refund': rule reversible-needs-compensate: a reversible tool must declare
 * connector.compensate". */
typedef struct tally_problems {
    char **lines;
    size_t n;
} tally_problems_t;

/**
 * @brief Load and validate a registry file. Every problem found is appended to @p problems
 * (not just the first). @returns the registry, or NULL when there was any problem.
 */
tally_registry_t *tally_registry_load_file(const char *path, tally_problems_t *problems) TALLY_WUR;

/** @brief The same for a parsed document (borrowed). */
tally_registry_t *tally_registry_load_json(const json_t *doc, tally_problems_t *problems) TALLY_WUR;

/**
 * @brief Warnings about a valid registry (weaker but accepted contracts, e.g. rule
 * legacy-signature: connector.secret_env without connector.signing), in the problems' form.
 * Borrowed; lives as long as the registry.
 */
const tally_problems_t *tally_registry_warnings(const tally_registry_t *reg);

/** @brief The tool named @p name, or NULL. Borrowed; lives as long as the registry. */
const tally_tool_t *tally_registry_find(const tally_registry_t *reg, const char *name);

size_t tally_registry_count(const tally_registry_t *reg);
const tally_tool_t *tally_registry_at(const tally_registry_t *reg, size_t i);

/**
 * @brief The operation key of an intent for @p tool: @p explicit_key when given (non-empty),
 * else "<tool>:<v1>:<v2>..." from the args named in tool->operation_key (each must be
 * present and a string, integer or boolean). Never from time or randomness.
 * @returns malloc'd key, or NULL with the reason in @p err: code "missing_operation_key" when
 * it cannot be built, "invalid_field" when a value holds control characters or the key is
 * longer than TALLY_LIMIT_OPERATION_KEY (text.h).
 */
char *tally_registry_operation_key(const tally_tool_t *tool, const json_t *args,
                                   const char *explicit_key, tally_error_t *err) TALLY_WUR;

const char *tally_effect_class_name(tally_effect_class_t c);
bool tally_effect_class_parse(const char *s, tally_effect_class_t *out);
const char *tally_comp_mode_name(tally_comp_mode_t m);

void tally_problems_add(tally_problems_t *p, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void tally_problems_clear(tally_problems_t *p);

/** @brief Frees the registry. NULL is allowed. */
void tally_registry_free(tally_registry_t *reg);

#endif
