-- tally ledger, version 14: what `tally console` (cli/console_pages.c) reads fast with a large
-- ledger: the runs newest first, alone or by state or tenant, and search by operation key or
-- external ref (the unique (tool, operation_key) index cannot serve a key without its tool).
-- Applied by `tally migrate` inside one transaction; on a large ledger the CREATE INDEXes hold
-- their tables' write lock while they build: migrate in a quiet moment.

CREATE INDEX runs_created_idx ON runs (created_at, run_id);
CREATE INDEX runs_status_created_idx ON runs (status, created_at, run_id);
CREATE INDEX runs_tenant_created_idx ON runs (tenant, created_at, run_id) WHERE tenant IS NOT NULL;
CREATE INDEX effects_operation_key_idx ON effects (operation_key);
CREATE INDEX effects_external_ref_idx ON effects (external_ref) WHERE external_ref IS NOT NULL;
CREATE INDEX obligations_external_ref_idx ON obligations (external_ref)
    WHERE external_ref IS NOT NULL;
