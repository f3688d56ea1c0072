-- tally ledger, version 16 (an expand step): the history of the schema, one row per `tally
-- migrate` that applied something: from and to which version, by which release and role, and
-- the window it left. What an operator reads before a rollback: when the ledger moved, and
-- which release moved it. Binaries of 0.1.0 neither read nor write it, and run on this schema.

CREATE TABLE tally_schema_history (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    from_version int NOT NULL CHECK (from_version >= 0),
    to_version int NOT NULL CHECK (to_version > from_version),
    release text NOT NULL CHECK (length(release) BETWEEN 1 AND 63),
    serves_from int NOT NULL CHECK (serves_from > 0),
    migrated_by text NOT NULL DEFAULT current_user,
    migrated_at timestamptz NOT NULL DEFAULT now()
);
