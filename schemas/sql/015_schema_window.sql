-- tally ledger, version 15: the window of binaries this schema serves.
-- From this version on, migrations come in two kinds. An expand step only adds (a table, a
-- nullable column, an index), so binaries that do not know it keep working; a contract step
-- removes or changes what older binaries use, comes in a later release than the expand step
-- that replaced it, and says so in its file with a line `-- tally:serves-from N`: once it is
-- applied, binaries whose newest schema is older than N are no longer served. `tally migrate`
-- keeps the single row below up to date; a worker reads it when its binary is older than the
-- schema, and starts only when the schema still serves it (docs/operations.md, "Upgrading and
-- rolling back"). Binaries before this version compare versions for equality, so this schema
-- serves binaries from version 15 (release 0.1.0) on.

CREATE TABLE tally_schema_window (
    id int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    -- the oldest binary schema (a release's newest migration) this ledger still serves
    serves_from int NOT NULL CHECK (serves_from > 0),
    -- that release's name, for the refusal an older binary prints
    serves_from_release text NOT NULL CHECK (length(serves_from_release) BETWEEN 1 AND 63),
    updated_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO tally_schema_window (serves_from, serves_from_release) VALUES (15, '0.1.0');
