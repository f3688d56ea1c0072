-- tally ledger, version 11: sensitive fields encrypted at rest with a key per tenant, erasure by
-- destroying that key, and retention that keeps a settled run's skeleton (DESIGN §12).
-- Applied by `tally migrate` inside one transaction. A new table and nullable columns only (no
-- table rewrite).

-- One data key per tenant ('' for effects that name none). The key itself is random; it is kept
-- only wrapped (AES-256-GCM) under a master key that never reaches the database, named by
-- master_key_id so master keys can rotate. `tally forget --tenant` destroys it: wrapped becomes
-- NULL and forgotten_at is set, and every value sealed under it is unreadable from then on. A
-- tenant that comes back after that gets a new key.
CREATE TABLE tenant_keys (
    key_id        uuid PRIMARY KEY,
    tenant        text NOT NULL,
    master_key_id text NOT NULL,
    wrapped       bytea,
    created_at    timestamptz NOT NULL DEFAULT now(),
    forgotten_at  timestamptz,
    forgotten_by  text,
    CONSTRAINT tenant_keys_forgotten CHECK ((wrapped IS NULL) = (forgotten_at IS NOT NULL))
);
CREATE UNIQUE INDEX tenant_keys_live_idx ON tenant_keys (tenant) WHERE forgotten_at IS NULL;

-- An effect of a tool with sensitive fields keeps them redacted in args_canonical and receipt
-- (a marker and a keyed hash) and whole only here, sealed under seal_key: the exact bytes the
-- connector sends, and the receipt the tool answered.
ALTER TABLE effects
    ADD COLUMN seal_key uuid REFERENCES tenant_keys (key_id),
    ADD COLUMN args_sealed bytea,
    ADD COLUMN receipt_sealed bytea,
    ADD CONSTRAINT effects_sealed_has_key
        CHECK ((args_sealed IS NULL AND receipt_sealed IS NULL) OR seal_key IS NOT NULL);
CREATE INDEX effects_seal_key_idx ON effects (seal_key) WHERE seal_key IS NOT NULL;

-- `tally prune --settled-before`: when a settled run's payloads were removed.
ALTER TABLE runs ADD COLUMN pruned_at timestamptz;
