-- tally ledger, version 12: the tools' own records checked against the ledger after the fact
-- (DESIGN §12, "Upstream audit and deadlines"; docs/operations.md "Upstream findings").
-- Applied by `tally migrate` inside one transaction. New tables, a widened CHECK and a trigger;
-- no table rewrite.

-- An obligation may now reverse an orphan: a record a tool holds for an effect the ledger has
-- as FAILED, CANCELLED or REJECTED (found by the orphan sweep or `tally verify --tools`).
ALTER TABLE obligations DROP CONSTRAINT obligations_reason_check;
ALTER TABLE obligations ADD CONSTRAINT obligations_reason_check
    CHECK (reason IN ('duplicate', 'compensate_run', 'cancel_run', 'orphan'));

-- The audit policy of each tool, as the reconcilers' registry declares it ("audit" in the
-- registry). Written by the reconciler when it starts; read by the trigger below, which is why
-- it lives in the database at all. A tool without a row is not audited.
CREATE TABLE audit_policies (
    tool        text PRIMARY KEY,
    delay_ms    integer NOT NULL CHECK (delay_ms >= 0),
    again_ms    integer NOT NULL CHECK (again_ms >= 0),
    sample_rate double precision NOT NULL CHECK (sample_rate > 0 AND sample_rate <= 1),
    updated_by  text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per CONFIRMED effect still to be checked again upstream: due_at is when, passes how
-- many checks were made. The reconciler leases rows like it leases UNKNOWN effects and deletes
-- each after its last check; a DUPLICATE found files obligations exactly as an UNKNOWN that
-- resolves to several records does.
CREATE TABLE audits (
    effect_id   uuid PRIMARY KEY REFERENCES effects (effect_id) ON DELETE CASCADE,
    tool        text NOT NULL,
    passes      smallint NOT NULL DEFAULT 0 CHECK (passes >= 0),
    failures    smallint NOT NULL DEFAULT 0 CHECK (failures >= 0), -- inconclusive checks in a row
    due_at      timestamptz NOT NULL,
    lease_owner text,
    lease_until timestamptz,
    lease_epoch bigint NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX audits_due_idx ON audits (tool, due_at);

-- Whoever confirms an effect (dispatcher, reconciler, operator) queues its audit in the same
-- transaction, so no confirmation is missed and none is queued twice. The sample is a
-- deterministic function of the effect id. One trigger call per statement, over its transition
-- tables: a row trigger cost about 8 µs per confirmed effect, this one nothing measurable when no
-- tool is audited (bench/audit_trigger.py; bench/README.md, "Issue 24"). SECURITY DEFINER: the
-- writers need no privilege on audits or audit_policies; search_path is pinned to the schema
-- migrated into.
CREATE FUNCTION tally_queue_audits() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT AS $$
BEGIN
    INSERT INTO audits (effect_id, tool, due_at)
    SELECT n.effect_id, p.tool, now() + p.delay_ms * interval '1 millisecond'
    FROM audit_policies p
    JOIN tally_confirmed_new n ON n.tool = p.tool
    JOIN tally_confirmed_old o ON o.effect_id = n.effect_id
    WHERE n.status = 'CONFIRMED' AND o.status IS DISTINCT FROM 'CONFIRMED'
      AND p.sample_rate >= ((hashtext(n.effect_id::text)::bigint + 2147483648) + 1)
                           / 4294967296.0
    ON CONFLICT (effect_id) DO NOTHING;
    RETURN NULL;
END;
$$;
REVOKE ALL ON FUNCTION tally_queue_audits() FROM PUBLIC;
CREATE TRIGGER effects_queue_audits AFTER UPDATE ON effects
    REFERENCING OLD TABLE AS tally_confirmed_old NEW TABLE AS tally_confirmed_new
    FOR EACH STATEMENT EXECUTE FUNCTION tally_queue_audits();

-- A token bucket per tool shared by every worker: audits, orphan sweeps and `tally verify
-- --tools` take a slot before each call, so together they never exceed the tool's
-- audit.rate_per_s (with a burst of one second's worth). UNKNOWN resolution does not pace here.
CREATE TABLE tool_pacing (
    tool    text PRIMARY KEY,
    next_at timestamptz NOT NULL DEFAULT '-infinity'
);

-- Where each tool's orphan sweep has got to: records created before `since` have been seen.
CREATE TABLE sweep_cursors (
    tool       text PRIMARY KEY,
    since      timestamptz NOT NULL,
    swept_at   timestamptz, -- when the latest sweep began
    swept_by   text,
    ended_at   timestamptz, -- when the latest sweep that ended did (last_error: why, if it failed)
    last_error text
);

-- What the tools hold that the ledger cannot place. An orphan whose effect the ledger knows
-- becomes an obligation (reason 'orphan'); one it cannot reverse — no such effect, or a tool
-- that cannot compensate — becomes a finding, paged with its evidence, until an operator
-- resolves it (`tally resolve --finding ID`). effect_id has no foreign key: an orphan may name
-- an effect the ledger never had.
CREATE TABLE findings (
    finding_id    uuid PRIMARY KEY,
    kind          text NOT NULL CHECK (kind IN ('orphan', 'duplicate', 'ledger')),
    status        text NOT NULL DEFAULT 'OPEN' CHECK (status IN ('OPEN', 'RESOLVED')),
    tool          text,
    external_ref  text,
    run_id        text,
    effect_id     uuid,
    obligation_id uuid,
    summary       text NOT NULL,
    evidence      jsonb NOT NULL,
    found_by      text NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    resolved_at   timestamptz,
    resolved_by   text,
    resolution    text,
    UNIQUE NULLS NOT DISTINCT (kind, tool, external_ref)
);
CREATE INDEX findings_open_idx ON findings (created_at) WHERE status = 'OPEN';
