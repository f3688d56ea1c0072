-- tally ledger, version 10: the ledger enforces its state machines (DESIGN §12 rule 7), and
-- answers echo the intent's step exactly.
-- Applied by `tally migrate` inside one transaction. Only a new one-row table and a column with
-- a constant default (no table rewrite).

-- The state machines themselves are not in a numbered migration: they are generated from
-- schemas/machines.json (scripts/gen_machines.py) and installed by `tally migrate` after the
-- numbered ones, in the same transaction, whenever the generated SQL differs from the one
-- recorded here (its SHA-256). A machine that changes needs no new migration.
CREATE TABLE schema_machines (
    id           int PRIMARY KEY DEFAULT 1 CHECK (id = 1),
    sha256       text NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now()
);

-- step_quoted: the intent's step was a JSON string. A step of digits alone orders numerically
-- (step_num) whether it came as a number or a string, and answers echo it as it came: 3 as 3,
-- "03" as "03" (DESIGN §5). Rows written before this version have false: they were echoed as
-- numbers then, and keep being so.
ALTER TABLE effects ADD COLUMN step_quoted boolean NOT NULL DEFAULT false;
