/* seal.c — master keys, tenant keys, AES-256-GCM sealing and redaction markers (seal.h). */
#include "tally/seal.h"

#include <ctype.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/core_names.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "tally/id.h"
#include "tally/json.h"

/* Sealed layout: version byte, 12-byte nonce, ciphertext, 16-byte GCM tag. */
#define SEAL_VERSION    0x01
#define NONCE_BYTES     12
#define TAG_BYTES       16
#define SEAL_OVERHEAD   (1 + NONCE_BYTES + TAG_BYTES)
#define MASTER_ID_MAX   64
#define MASTER_KEYS_MAX 16
/* Values shorter than this are redacted where the registry points, but not scrubbed out of
 * free text: "12" would otherwise be replaced inside every number of an error message. */
#define SCRUB_MIN_BYTES 4

typedef struct master_key {
    char id[MASTER_ID_MAX + 1];
    unsigned char key[TALLY_SEAL_KEY_BYTES];
} master_key_t;

struct tally_keyring {
    master_key_t keys[MASTER_KEYS_MAX];
    size_t n;
};

/* ---------------------------------------------------------------------------------------- */
/* Hex as PostgreSQL prints bytea                                                          */

static char *to_bytea_text(const unsigned char *b, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    char *s = malloc(2 * n + 3);
    if (s == NULL)
        return NULL;
    s[0] = '\\';
    s[1] = 'x';
    for (size_t i = 0; i < n; i++) {
        s[2 + 2 * i] = hex[b[i] >> 4];
        s[3 + 2 * i] = hex[b[i] & 15];
    }
    s[2 + 2 * n] = '\0';
    return s;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* "\x..." into malloc'd bytes; false when it is not that form. */
static bool from_bytea_text(const char *s, unsigned char **out, size_t *n)
{
    if (s == NULL || s[0] != '\\' || s[1] != 'x')
        return false;
    size_t len = strlen(s + 2);
    if (len % 2 != 0)
        return false;
    unsigned char *b = malloc(len / 2 + 1);
    if (b == NULL)
        return false;
    for (size_t i = 0; i < len / 2; i++) {
        int hi = hexval(s[2 + 2 * i]), lo = hexval(s[3 + 2 * i]);
        if (hi < 0 || lo < 0) {
            free(b);
            return false;
        }
        b[i] = (unsigned char)(hi << 4 | lo);
    }
    *out = b;
    *n = len / 2;
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* AES-256-GCM and HMAC-SHA256, fetched once                                               */

/* OpenSSL 3 looks an algorithm up by name on every use of EVP_aes_256_gcm() or HMAC() (a
 * provider query under a lock); fetched once, a seal costs the cipher alone. bench/sealcost.c */
static pthread_once_t g_algs_once = PTHREAD_ONCE_INIT;
static EVP_CIPHER *g_gcm;
static EVP_MAC *g_hmac;

static void fetch_algs(void)
{
    g_gcm = EVP_CIPHER_fetch(NULL, "AES-256-GCM", NULL);
    g_hmac = EVP_MAC_fetch(NULL, "HMAC", NULL);
}

static const EVP_CIPHER *gcm_cipher(void)
{
    pthread_once(&g_algs_once, fetch_algs);
    return g_gcm;
}

/* HMAC-SHA256 of @p len bytes under a 32-byte key into @p mac. */
static bool hmac_sha256(const unsigned char *key, const void *data, size_t len,
                        unsigned char mac[32])
{
    pthread_once(&g_algs_once, fetch_algs);
    if (g_hmac == NULL)
        return false;
    EVP_MAC_CTX *ctx = EVP_MAC_CTX_new(g_hmac);
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", (char *)"SHA256", 0),
                           OSSL_PARAM_construct_end()};
    size_t outl = 0;
    bool ok = ctx != NULL && EVP_MAC_init(ctx, key, TALLY_SEAL_KEY_BYTES, params) == 1 &&
              EVP_MAC_update(ctx, data, len) == 1 && EVP_MAC_final(ctx, mac, &outl, 32) == 1 &&
              outl == 32;
    EVP_MAC_CTX_free(ctx);
    return ok;
}

static bool gcm(bool enc, const unsigned char *key, const unsigned char *nonce, const char *aad,
                const unsigned char *in, size_t len, unsigned char *out, unsigned char *tag)
{
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    int outl = 0;
    bool ok =
        ctx != NULL && gcm_cipher() != NULL && len <= INT32_MAX &&
        EVP_CipherInit_ex(ctx, gcm_cipher(), NULL, NULL, NULL, enc ? 1 : 0) == 1 &&
        EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_IVLEN, NONCE_BYTES, NULL) == 1 &&
        EVP_CipherInit_ex(ctx, NULL, NULL, key, nonce, enc ? 1 : 0) == 1 &&
        (aad == NULL || aad[0] == '\0' ||
         EVP_CipherUpdate(ctx, NULL, &outl, (const unsigned char *)aad, (int)strlen(aad)) == 1) &&
        (len == 0 || EVP_CipherUpdate(ctx, out, &outl, in, (int)len) == 1);
    if (ok && !enc)
        ok = EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, TAG_BYTES, tag) == 1;
    if (ok)
        ok = EVP_CipherFinal_ex(ctx, out + (len > 0 ? outl : 0), &outl) == 1;
    if (ok && enc)
        ok = EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, TAG_BYTES, tag) == 1;
    EVP_CIPHER_CTX_free(ctx);
    return ok;
}

static unsigned char *seal_bytes(const unsigned char *key, const char *aad, const void *data,
                                 size_t len, size_t *outlen)
{
    unsigned char *b = malloc(len + SEAL_OVERHEAD);
    if (b == NULL)
        return NULL;
    b[0] = SEAL_VERSION;
    if (RAND_bytes(b + 1, NONCE_BYTES) != 1 ||
        !gcm(true, key, b + 1, aad, data, len, b + 1 + NONCE_BYTES, b + 1 + NONCE_BYTES + len)) {
        free(b);
        return NULL;
    }
    *outlen = len + SEAL_OVERHEAD;
    return b;
}

/* Open @p b (@p n bytes) into malloc'd @p out with a NUL after it. */
static bool open_bytes(const unsigned char *key, const char *aad, const unsigned char *b, size_t n,
                       unsigned char **out, size_t *outlen)
{
    if (n < SEAL_OVERHEAD || b[0] != SEAL_VERSION)
        return false;
    size_t len = n - SEAL_OVERHEAD;
    unsigned char *p = malloc(len + 1);
    if (p == NULL)
        return false;
    unsigned char tag[TAG_BYTES];
    memcpy(tag, b + 1 + NONCE_BYTES + len, TAG_BYTES);
    if (!gcm(false, key, b + 1, aad, b + 1 + NONCE_BYTES, len, p, tag)) {
        OPENSSL_cleanse(p, len);
        free(p);
        return false;
    }
    p[len] = '\0';
    *out = p;
    *outlen = len;
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Master keys                                                                             */

static bool read_key_file(const char *path, char **out, tally_error_t *err)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        tally_error_setc(err, TALLY_ERR_INVALID, "TALLY_MASTER_KEY_FILE: cannot open %s", path);
        return false;
    }
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    bool too_long = n == sizeof buf - 1 && fgetc(f) != EOF;
    fclose(f);
    buf[n] = '\0';
    if (too_long) {
        OPENSSL_cleanse(buf, sizeof buf);
        tally_error_setc(err, TALLY_ERR_INVALID,
                         "TALLY_MASTER_KEY_FILE: %s is larger than %zu "
                         "bytes; it should hold one line of ID:BASE64 keys",
                         path, sizeof buf - 1);
        return false;
    }
    while (n > 0 && isspace((unsigned char)buf[n - 1]))
        buf[--n] = '\0';
    *out = strdup(buf);
    OPENSSL_cleanse(buf, sizeof buf);
    if (*out == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory reading TALLY_MASTER_KEY_FILE");
        return false;
    }
    return true;
}

static bool id_char(char c)
{
    return isalnum((unsigned char)c) || c == '_' || c == '-' || c == '.';
}

/* One "ID:BASE64" entry of @p len bytes at @p s into @p k; the key is never quoted. */
static bool parse_entry(const char *what, const char *s, size_t len, size_t pos, master_key_t *k,
                        tally_error_t *err)
{
    const char *colon = memchr(s, ':', len);
    size_t idlen = colon ? (size_t)(colon - s) : 0;
    bool id_ok = colon != NULL && idlen > 0 && idlen <= MASTER_ID_MAX;
    for (size_t i = 0; id_ok && i < idlen; i++)
        id_ok = id_char(s[i]);
    if (!id_ok) {
        tally_error_setc(err, TALLY_ERR_INVALID,
                         "%s: key %zu is not ID:BASE64 (an id of 1 to %d letters, digits, '_', "
                         "'-' or '.', a colon, then 32 bytes in base64)",
                         what, pos, MASTER_ID_MAX);
        return false;
    }
    memcpy(k->id, s, idlen);
    k->id[idlen] = '\0';
    const char *b64 = colon + 1;
    size_t blen = len - idlen - 1;
    unsigned char raw[64];
    int n = -1;
    if (blen == 44) /* 32 bytes: 43 characters and one '=' */
        n = EVP_DecodeBlock(raw, (const unsigned char *)b64, (int)blen);
    if (n != 33 || b64[43] != '=' || b64[42] == '=') {
        OPENSSL_cleanse(raw, sizeof raw);
        tally_error_setc(err, TALLY_ERR_INVALID,
                         "%s: key '%s' is not 32 bytes in base64 (44 characters ending in '='; "
                         "make one with `openssl rand -base64 32`)",
                         what, k->id);
        return false;
    }
    memcpy(k->key, raw, TALLY_SEAL_KEY_BYTES);
    OPENSSL_cleanse(raw, sizeof raw);
    return true;
}

tally_keyring_t *tally_keyring_load(const tally_config_t *cfg, tally_error_t *err)
{
    tally_keyring_t *kr = calloc(1, sizeof *kr);
    if (kr == NULL) {
        tally_error_setc(err, TALLY_ERR_OOM, "out of memory loading the master keys");
        return NULL;
    }
    const char *what = "TALLY_MASTER_KEY";
    char *owned = NULL;
    const char *v = cfg->master_key;
    if (cfg->master_key_file != NULL && cfg->master_key_file[0] != '\0') {
        what = "TALLY_MASTER_KEY_FILE";
        if (!read_key_file(cfg->master_key_file, &owned, err)) {
            free(kr);
            return NULL;
        }
        v = owned;
    }
    bool ok = true;
    for (const char *p = v; ok && p != NULL && *p != '\0';) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        while (len > 0 && isspace((unsigned char)*p)) {
            p++;
            len--;
        }
        while (len > 0 && isspace((unsigned char)p[len - 1]))
            len--;
        if (kr->n == MASTER_KEYS_MAX) {
            tally_error_setc(err, TALLY_ERR_INVALID, "%s: more than %d keys", what,
                             MASTER_KEYS_MAX);
            ok = false;
        } else if (len > 0) {
            ok = parse_entry(what, p, len, kr->n + 1, &kr->keys[kr->n], err);
            for (size_t i = 0; ok && i < kr->n; i++)
                if (strcmp(kr->keys[i].id, kr->keys[kr->n].id) == 0) {
                    tally_error_setc(err, TALLY_ERR_INVALID, "%s: key id '%s' appears twice", what,
                                     kr->keys[i].id);
                    ok = false;
                }
            if (ok)
                kr->n++;
        }
        p = comma ? comma + 1 : NULL;
    }
    if (owned != NULL) {
        OPENSSL_cleanse(owned, strlen(owned));
        free(owned);
    }
    if (!ok) {
        tally_keyring_free(kr);
        return NULL;
    }
    return kr;
}

void tally_keyring_free(tally_keyring_t *kr)
{
    if (kr == NULL)
        return;
    OPENSSL_cleanse(kr, sizeof *kr);
    free(kr);
}

bool tally_keyring_ready(const tally_keyring_t *kr)
{
    return kr != NULL && kr->n > 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Tenant keys                                                                             */

static void derive_hash_key(tally_tenant_key_t *key)
{
    static const char label[] = "tally redaction v1";
    if (!hmac_sha256(key->dek, label, sizeof label - 1, key->hash_key))
        memset(key->hash_key, 0, sizeof key->hash_key); /* then no marker is made: below */
}

bool tally_tenant_key_new(const tally_keyring_t *kr, tally_tenant_key_t *key, char **wrapped,
                          const char **master_id, tally_error_t *err)
{
    *wrapped = NULL;
    if (!tally_keyring_ready(kr)) {
        tally_error_setc(err, TALLY_ERR_INVALID,
                         "no master key: set TALLY_MASTER_KEY or TALLY_MASTER_KEY_FILE to seal "
                         "the sensitive fields the registry declares");
        return false;
    }
    tally_uuid_v7(key->key_id);
    size_t n = 0;
    unsigned char *b = NULL;
    if (RAND_bytes(key->dek, TALLY_SEAL_KEY_BYTES) == 1)
        b = seal_bytes(kr->keys[0].key, key->key_id, key->dek, TALLY_SEAL_KEY_BYTES, &n);
    if (b != NULL)
        *wrapped = to_bytea_text(b, n);
    free(b);
    if (*wrapped == NULL) {
        tally_tenant_key_clear(key);
        tally_error_setc(err, TALLY_ERR_OOM, "could not make a tenant key (random or memory)");
        return false;
    }
    derive_hash_key(key);
    *master_id = kr->keys[0].id;
    return true;
}

bool tally_tenant_key_open(const tally_keyring_t *kr, const char *key_id, const char *master_id,
                           const char *wrapped, tally_tenant_key_t *key, tally_error_t *err)
{
    if (wrapped == NULL) {
        tally_error_setc(err, TALLY_ERR_SEALED, "tenant key %s was forgotten (tally forget)",
                         key_id);
        return false;
    }
    const master_key_t *mk = NULL;
    for (size_t i = 0; kr != NULL && i < kr->n && mk == NULL; i++)
        if (strcmp(kr->keys[i].id, master_id) == 0)
            mk = &kr->keys[i];
    if (mk == NULL) {
        tally_error_setc(err, TALLY_ERR_SEALED,
                         "tenant key %s is sealed under master key '%s', which is not in "
                         "TALLY_MASTER_KEY (keep a retired master key listed until no key uses "
                         "it)",
                         key_id, master_id);
        return false;
    }
    unsigned char *b = NULL, *dek = NULL;
    size_t n = 0, dn = 0;
    bool ok = from_bytea_text(wrapped, &b, &n) && open_bytes(mk->key, key_id, b, n, &dek, &dn) &&
              dn == TALLY_SEAL_KEY_BYTES;
    free(b);
    if (ok) {
        snprintf(key->key_id, sizeof key->key_id, "%s", key_id);
        memcpy(key->dek, dek, TALLY_SEAL_KEY_BYTES);
        derive_hash_key(key);
    } else {
        tally_error_setc(err, TALLY_ERR_SEALED,
                         "tenant key %s does not open under master key '%s' (a different key "
                         "with that id, or a damaged row)",
                         key_id, master_id);
    }
    if (dek != NULL) {
        OPENSSL_cleanse(dek, dn);
        free(dek);
    }
    return ok;
}

void tally_tenant_key_clear(tally_tenant_key_t *key)
{
    OPENSSL_cleanse(key, sizeof *key);
}

char *tally_seal(const tally_tenant_key_t *key, const char *aad, const void *data, size_t len)
{
    size_t n = 0;
    unsigned char *b = seal_bytes(key->dek, aad, data, len, &n);
    char *s = b ? to_bytea_text(b, n) : NULL;
    free(b);
    return s;
}

bool tally_unseal(const tally_tenant_key_t *key, const char *aad, const char *sealed, char **out,
                  size_t *outlen, tally_error_t *err)
{
    unsigned char *b = NULL, *p = NULL;
    size_t n = 0;
    bool ok = from_bytea_text(sealed, &b, &n) && open_bytes(key->dek, aad, b, n, &p, outlen);
    free(b);
    if (!ok) {
        tally_error_setc(err, TALLY_ERR_SEALED,
                         "a sealed value (%s) does not open under tenant key %s", aad, key->key_id);
        return false;
    }
    *out = (char *)p;
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Redaction                                                                               */

bool tally_redaction_marker(const tally_tenant_key_t *key, const json_t *value,
                            char out[TALLY_REDACTED_MAX])
{
    char *canon = tally_json_canonical(value);
    if (canon == NULL)
        return false;
    unsigned char mac[32];
    static const unsigned char zero[TALLY_SEAL_KEY_BYTES];
    bool ok = CRYPTO_memcmp(key->hash_key, zero, sizeof zero) != 0 &&
              hmac_sha256(key->hash_key, canon, strlen(canon), mac);
    OPENSSL_cleanse(canon, strlen(canon));
    free(canon);
    if (!ok)
        return false;
    static const char hex[] = "0123456789abcdef";
    char h[33];
    for (int i = 0; i < 16; i++) {
        h[2 * i] = hex[mac[i] >> 4];
        h[2 * i + 1] = hex[mac[i] & 15];
    }
    h[32] = '\0';
    snprintf(out, TALLY_REDACTED_MAX, TALLY_REDACTED_PREFIX "%s]", h);
    return true;
}

void tally_redactor_init(tally_redactor_t *r, const tally_tenant_key_t *key)
{
    memset(r, 0, sizeof *r);
    r->key = *key;
}

void tally_redactor_clear(tally_redactor_t *r)
{
    for (size_t i = 0; i < r->n; i++) {
        OPENSSL_cleanse(r->items[i].plain, strlen(r->items[i].plain));
        free(r->items[i].plain);
    }
    free(r->items);
    OPENSSL_cleanse(r, sizeof *r);
}

static bool pointer_valid(const char *ptr)
{
    if (ptr == NULL || ptr[0] != '/')
        return false;
    for (const char *p = ptr; *p; p++)
        if (*p == '~' && p[1] != '0' && p[1] != '1')
            return false;
    return true;
}

/* The last token of @p ptr, unescaped (malloc'd), and the document it is a member of. */
static json_t *pointer_parent(json_t *doc, const char *ptr, char **last)
{
    const char *slash = strrchr(ptr, '/');
    char *head = strndup(ptr, (size_t)(slash - ptr));
    char *tok = malloc(strlen(slash) + 1);
    json_t *parent = NULL;
    if (head != NULL && tok != NULL) {
        size_t n = 0;
        for (const char *p = slash + 1; *p; p++) {
            if (*p == '~') {
                tok[n++] = p[1] == '0' ? '~' : '/';
                p++;
            } else {
                tok[n++] = *p;
            }
        }
        tok[n] = '\0';
        parent = tally_json_pointer(doc, head);
    }
    free(head);
    if (parent == NULL) {
        free(tok);
        return NULL;
    }
    *last = tok;
    return parent;
}

/* An array index token: digits, no leading zero (RFC 6901). */
static bool index_of(const char *tok, size_t *idx)
{
    if (tok[0] == '\0' || (tok[0] == '0' && tok[1] != '\0'))
        return false;
    size_t v = 0;
    for (const char *p = tok; *p; p++) {
        if (!isdigit((unsigned char)*p) || v > SIZE_MAX / 10 - 10)
            return false;
        v = v * 10 + (size_t)(*p - '0');
    }
    *idx = v;
    return true;
}

static bool is_marker(const json_t *v)
{
    return json_is_string(v) && strncmp(json_string_value(v), TALLY_REDACTED_PREFIX,
                                        sizeof TALLY_REDACTED_PREFIX - 1) == 0;
}

static bool remember_scalar(tally_redactor_t *r, const json_t *value, const char *marker);

/* Remember what a redacted value holds, for scrubbing: a scalar as itself, an object or an
 * array by each scalar inside it (a tool echoes a card number, not the card's JSON), each with
 * its own marker; markers already in it are not values. */
static bool remember(tally_redactor_t *r, const json_t *value)
{
    if (is_marker(value))
        return true;
    if (json_is_object(value)) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)value, k, v)
        {
            if (!remember(r, v))
                return false;
        }
        return true;
    }
    if (json_is_array(value)) {
        for (size_t i = 0; i < json_array_size(value); i++)
            if (!remember(r, json_array_get(value, i)))
                return false;
        return true;
    }
    char marker[TALLY_REDACTED_MAX];
    return tally_redaction_marker(&r->key, value, marker) && remember_scalar(r, value, marker);
}

static bool remember_scalar(tally_redactor_t *r, const json_t *value, const char *marker)
{
    char *plain = json_is_string(value)
                      ? strndup(json_string_value(value), json_string_length(value))
                      : tally_json_canonical(value);
    if (plain == NULL)
        return false;
    size_t len = strlen(plain);
    bool known = len < SCRUB_MIN_BYTES;
    for (size_t i = 0; i < r->n && !known; i++)
        known = strcmp(r->items[i].plain, plain) == 0;
    if (known) {
        OPENSSL_cleanse(plain, len);
        free(plain);
        return true;
    }
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 4;
        void *p = realloc(r->items, cap * sizeof *r->items);
        if (p == NULL) {
            free(plain);
            return false;
        }
        r->items = p;
        r->cap = cap;
    }
    /* longest first: a value that holds another is scrubbed whole */
    size_t at = r->n;
    while (at > 0 && strlen(r->items[at - 1].plain) < len)
        at--;
    memmove(&r->items[at + 1], &r->items[at], (r->n - at) * sizeof *r->items);
    r->items[at].plain = plain;
    snprintf(r->items[at].marker, sizeof r->items[at].marker, "%s", marker);
    r->n++;
    return true;
}

int tally_redactor_apply(tally_redactor_t *r, json_t *doc, char *const *pointers, size_t n)
{
    int done = 0;
    for (size_t i = 0; i < n; i++) {
        char *tok = NULL;
        json_t *parent = pointer_valid(pointers[i]) ? pointer_parent(doc, pointers[i], &tok) : NULL;
        if (parent == NULL)
            continue;
        json_t *value = NULL;
        size_t idx = 0;
        if (json_is_object(parent))
            value = json_object_get(parent, tok);
        else if (json_is_array(parent) && index_of(tok, &idx))
            value = json_array_get(parent, idx);
        char marker[TALLY_REDACTED_MAX];
        bool ok = true;
        if (value != NULL &&
            !(json_is_string(value) && strncmp(json_string_value(value), TALLY_REDACTED_PREFIX,
                                               sizeof TALLY_REDACTED_PREFIX - 1) == 0)) {
            ok = remember(r, value) && tally_redaction_marker(&r->key, value, marker);
            json_t *m = ok ? json_string(marker) : NULL;
            ok = m != NULL && (json_is_object(parent) ? json_object_set_new(parent, tok, m)
                                                      : json_array_set_new(parent, idx, m)) == 0;
            done += ok;
        }
        free(tok);
        if (!ok)
            return -1;
    }
    return done;
}

char *tally_redactor_scrub(const tally_redactor_t *r, const char *text, size_t len)
{
    return tally_redactor_scrub_bytes(r, text, len, NULL);
}

char *tally_redactor_scrub_bytes(const tally_redactor_t *r, const char *text, size_t len,
                                 size_t *outlen)
{
    size_t cap = len + 1, n = 0;
    char *out = malloc(cap);
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < len;) {
        const struct tally_redacted *hit = NULL;
        for (size_t k = 0; k < r->n && hit == NULL; k++) {
            size_t pl = strlen(r->items[k].plain);
            if (pl <= len - i && memcmp(text + i, r->items[k].plain, pl) == 0)
                hit = &r->items[k];
        }
        const char *add = hit ? hit->marker : text + i;
        size_t addn = hit ? strlen(hit->marker) : 1;
        if (n + addn + 1 > cap) {
            cap = 2 * cap + addn;
            char *p = realloc(out, cap);
            if (p == NULL) {
                free(out);
                return NULL;
            }
            out = p;
        }
        memcpy(out + n, add, addn);
        n += addn;
        i += hit ? strlen(hit->plain) : 1;
    }
    out[n] = '\0';
    if (outlen != NULL)
        *outlen = n;
    return out;
}

/* A number that is one of the remembered values, whole (a tool echoing a sensitive amount as a
 * number in a field of its own): its marker, else NULL. */
static const char *number_marker(const tally_redactor_t *r, const json_t *v)
{
    if (!json_is_number(v))
        return NULL;
    char *text = tally_json_canonical(v);
    const char *marker = NULL;
    for (size_t i = 0; text != NULL && i < r->n && marker == NULL; i++)
        if (strcmp(r->items[i].plain, text) == 0)
            marker = r->items[i].marker;
    free(text);
    return marker;
}

bool tally_redactor_scrub_json(const tally_redactor_t *r, json_t *doc)
{
    if (r->n == 0)
        return true;
    if (json_is_string(doc)) {
        char *s = tally_redactor_scrub(r, json_string_value(doc), json_string_length(doc));
        bool ok = s != NULL && json_string_set(doc, s) == 0;
        free(s);
        return ok;
    }
    if (json_is_array(doc)) {
        for (size_t i = 0; i < json_array_size(doc); i++) {
            json_t *v = json_array_get(doc, i);
            const char *m = number_marker(r, v);
            if (m != NULL ? json_array_set_new(doc, i, json_string(m)) != 0
                          : !tally_redactor_scrub_json(r, v))
                return false;
        }
        return true;
    }
    if (json_is_object(doc)) {
        const char *k;
        json_t *v;
        void *tmp;
        json_object_foreach_safe(doc, tmp, k, v)
        {
            const char *m = number_marker(r, v);
            if (m != NULL ? json_object_set_new(doc, k, json_string(m)) != 0
                          : !tally_redactor_scrub_json(r, v))
                return false;
        }
    }
    return true;
}
