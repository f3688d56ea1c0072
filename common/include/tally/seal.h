/* seal.h — sensitive fields (DESIGN §12): master keys, a data key per tenant, sealing with
 * AES-256-GCM, and redaction (a marker with a keyed hash) of the values the registry marks.
 *
 * The ledger never holds a sensitive value in clear. An effect of a tool that declares
 * sensitive fields keeps its args and receipt redacted where every reader sees them
 * (args_canonical, receipt, events, topics, logs, the CLI) and whole only sealed under its
 * tenant's data key (effects.args_sealed, receipt_sealed). The data key is random and is kept
 * in tenant_keys only wrapped under a master key given by the environment; destroying it
 * (`tally forget --tenant`) makes everything sealed under it unreadable. docs/security.md. */
#ifndef TALLY_SEAL_H
#define TALLY_SEAL_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "tally/config.h"
#include "tally/error.h"

#define TALLY_SEAL_KEY_BYTES 32
/** "[redacted hmac-sha256:" + 32 hex + "]" and a NUL */
#define TALLY_REDACTED_MAX    56
#define TALLY_REDACTED_PREFIX "[redacted hmac-sha256:"

/** @brief The arguments of pg_advisory_xact_lock(_shared) for tenant @p T (SQL text): the
 * dispatcher holds it shared while it seals under the tenant's key, `tally forget` exclusively
 * while it destroys it. Advisory: no runtime role needs UPDATE on tenant_keys to take it. */
#define TALLY_SQL_TENANT_LOCK(T) "1952804449, hashtext(" T ")"

/** @brief The master keys: the first seals new tenant keys, every one opens those it sealed. */
typedef struct tally_keyring tally_keyring_t;

/**
 * @brief The master keys of TALLY_MASTER_KEY_FILE (when set) or TALLY_MASTER_KEY:
 * "ID:BASE64[,ID:BASE64...]", each key 32 bytes. @returns an empty keyring when neither is set,
 * NULL with a sentence in @p err when malformed or unreadable (the value is never quoted).
 */
tally_keyring_t *tally_keyring_load(const tally_config_t *cfg, tally_error_t *err) TALLY_WUR;
void tally_keyring_free(tally_keyring_t *kr);
/** @brief Whether there is a master key to seal with. */
bool tally_keyring_ready(const tally_keyring_t *kr);

/** @brief A tenant's data key, opened: what seals and what keys the redaction hash. */
typedef struct tally_tenant_key {
    char key_id[37];
    unsigned char dek[TALLY_SEAL_KEY_BYTES];
    unsigned char hash_key[TALLY_SEAL_KEY_BYTES]; /**< HMAC-SHA256(dek, "tally redaction v1") */
} tally_tenant_key_t;

/**
 * @brief A new random data key for a tenant: @p key opened, @p wrapped (bytea text "\x...",
 * malloc'd) sealed under the keyring's first master key, whose id is @p master_id (borrowed).
 */
bool tally_tenant_key_new(const tally_keyring_t *kr, tally_tenant_key_t *key, char **wrapped,
                          const char **master_id, tally_error_t *err) TALLY_WUR;

/**
 * @brief Open a tenant key row: @p wrapped as PostgreSQL prints a bytea ("\x..."), sealed under
 * master key @p master_id. Fails with a sentence when the key was forgotten (@p wrapped NULL),
 * the master key is not in the keyring, or the row does not open (wrong key, tampered).
 */
bool tally_tenant_key_open(const tally_keyring_t *kr, const char *key_id, const char *master_id,
                           const char *wrapped, tally_tenant_key_t *key,
                           tally_error_t *err) TALLY_WUR;

/** @brief Wipe a key from memory. */
void tally_tenant_key_clear(tally_tenant_key_t *key);

/**
 * @brief Seal @p len bytes under @p key, bound to @p aad (e.g. "<effect_id>/args": a sealed
 * value moved to another row or field does not open). @returns bytea text "\x...", malloc'd.
 */
char *tally_seal(const tally_tenant_key_t *key, const char *aad, const void *data,
                 size_t len) TALLY_WUR;

/** @brief Open what tally_seal() made: @p out (malloc'd, NUL-terminated) and @p outlen. */
bool tally_unseal(const tally_tenant_key_t *key, const char *aad, const char *sealed, char **out,
                  size_t *outlen, tally_error_t *err) TALLY_WUR;

/** @brief The redaction marker of @p value under @p key: equal values, equal markers. */
bool tally_redaction_marker(const tally_tenant_key_t *key, const json_t *value,
                            char out[TALLY_REDACTED_MAX]);

/** @brief Redacts documents, and remembers each value it redacted so that text which echoes one
 * (a tool's error message, a response excerpt) can be scrubbed of it too. */
typedef struct tally_redactor {
    tally_tenant_key_t key;
    struct tally_redacted {
        char *plain; /**< the value as text: a string's characters, else its JSON */
        char marker[TALLY_REDACTED_MAX];
    } * items;
    size_t n, cap;
} tally_redactor_t;

void tally_redactor_init(tally_redactor_t *r, const tally_tenant_key_t *key);
void tally_redactor_clear(tally_redactor_t *r);

/**
 * @brief Replace the value at each of @p pointers (RFC 6901) in @p doc by its marker, in place,
 * and remember it. A pointer that names nothing is skipped. @returns how many were replaced, or
 * -1 when out of memory.
 */
int tally_redactor_apply(tally_redactor_t *r, json_t *doc, char *const *pointers, size_t n);

/** @brief Every string in @p doc with each remembered value replaced by its marker (in place).
 * @returns false when out of memory. */
bool tally_redactor_scrub_json(const tally_redactor_t *r, json_t *doc);

/** @brief @p text (@p len bytes) with each remembered value replaced by its marker; malloc'd,
 * NUL-terminated, NULL when out of memory. */
char *tally_redactor_scrub(const tally_redactor_t *r, const char *text, size_t len) TALLY_WUR;
/** @brief The same for bytes that may hold NULs: their count in *@p outlen. */
char *tally_redactor_scrub_bytes(const tally_redactor_t *r, const char *text, size_t len,
                                 size_t *outlen) TALLY_WUR;

/* ---------------------------------------------------------------------------------------- */
/* An effect's sensitive fields, as every worker handles them (sensitive.c)                 */

struct tally_tool;

/** @brief What an effect row holds for its sensitive fields (strings as libpq returns them). */
typedef struct tally_sealed_row {
    const char *effect_id;
    const char *key_id;      /**< effects.seal_key, or NULL */
    const char *master_id;   /**< tenant_keys.master_key_id */
    const char *wrapped;     /**< tenant_keys.wrapped, NULL once forgotten */
    const char *args_sealed; /**< effects.args_sealed, or NULL */
} tally_sealed_row_t;

/**
 * @brief Open an effect's tenant key into a new redactor (*@p red, malloc'd; free with
 * tally_redactor_free) that remembers its sensitive arg values; and, when @p args is not NULL
 * and the row has sealed args, open them into *@p args (malloc'd, NUL-terminated; NULL when
 * the row has none).
 */
bool tally_sensitive_open(const tally_keyring_t *kr, const struct tally_tool *tool,
                          const tally_sealed_row_t *row, tally_redactor_t **red, char **args,
                          size_t *args_len, tally_error_t *err) TALLY_WUR;

void tally_redactor_free(tally_redactor_t *r);

struct tally_conn_result;

/**
 * @brief A tool's answer about an effect as the ledger keeps it, from @p res (an execute
 * answer): the receipt as tally_conn_receipt_text() makes it, sealed whole into *@p sealed
 * ("\\x..."); and, in *@p receipt_text and *@p external_ref, the receipt made again from the
 * answer's bytes with every remembered value scrubbed out of them (whatever the encoding: a
 * body that is not JSON, or not UTF-8, is scrubbed too), its registry receipt pointers redacted
 * and its strings scrubbed once more after JSON unescaping.
 */
bool tally_sensitive_receipt(tally_redactor_t *red, const struct tally_tool *tool,
                             const char *effect_id, const struct tally_conn_result *res,
                             char **receipt_text, char **external_ref, char **sealed) TALLY_WUR;

/** @brief The receipt of a reverse or containment answer (tally_conn_receipt), redacted and
 * scrubbed the same way. NULL when out of memory. */
json_t *tally_sensitive_answer_json(tally_redactor_t *red, const struct tally_tool *tool,
                                    const struct tally_conn_result *res) TALLY_WUR;

/** @brief A tool's answer body as an excerpt may show it: scrubbed as bytes, then, when it is
 * JSON, redacted and scrubbed again. malloc'd (*@p outlen bytes); NULL when out of memory. */
char *tally_sensitive_scrub_body(tally_redactor_t *red, const struct tally_tool *tool,
                                 const char *body, size_t len, size_t *outlen) TALLY_WUR;

#endif
