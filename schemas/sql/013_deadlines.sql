-- tally ledger, version 13: compensation deadlines (DESIGN §12, "Upstream audit and deadlines";
-- docs/operations.md "Compensation deadlines"). Applied by `tally migrate` inside one
-- transaction. A nullable column and a small partial index; no table rewrite.

-- When the run's compensation must be finished: set by a compensation request that carries
-- deadline_ms (tally.compensate_run.v1 data.deadline_ms, `tally compensate --deadline`) to
-- now() + deadline_ms, or kept when an earlier one is still running. NULL: the run has none.
-- An obligation's deadline is the earlier of this and its created_at + its tool's
-- compensation.deadline_ms; the compensator's deadline sweep pages the open ones past it.
ALTER TABLE runs ADD COLUMN compensation_deadline_at timestamptz;

-- The deadline sweep resolves the open deadline pages of obligations that have closed: only
-- those rows, never the whole history of alerts.
CREATE INDEX alerts_deadline_open_idx ON alerts (obligation_id)
    WHERE status = 'TRIGGERED' AND reason IN ('deadline_near', 'deadline_passed');
