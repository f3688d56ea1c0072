-- tally ledger, version 3: what the compensator keeps. Approval of obligations, when an
-- obligation finished (drain latency), the run summary published once per outcome, and the
-- pager's delivery state of every alert. Applied by `tally migrate` inside one transaction.

-- approved_at/approved_by: set by `tally approve --obligation` (AWAITING_APPROVAL -> PENDING);
-- the compensator leases an obligation of an approval_required tool only once approved.
-- finished_at: when the obligation became RESOLVED, SKIPPED, UNCOMPENSATABLE, CANCELLED or STUCK.
ALTER TABLE obligations
    ADD COLUMN approved_at timestamptz,
    ADD COLUMN approved_by text,
    ADD COLUMN finished_at timestamptz;
-- Expired leases are found by lease_until; due work by obligations_due_idx (version 1).
CREATE INDEX obligations_lease_idx ON obligations (lease_until) WHERE status = 'RUNNING';
CREATE INDEX obligations_effect_idx ON obligations (effect_id);

-- summary_status: the run status the current summary was published for. A run's
-- tally.run.{compensated,stuck}.v1 goes out once per outcome: only when the outcome differs
-- from summary_status (a STUCK run that an operator later settles publishes its new outcome).
ALTER TABLE runs
    ADD COLUMN summary_status text,
    ADD COLUMN summary_at timestamptz;
CREATE INDEX runs_compensation_idx ON runs (status)
    WHERE status IN ('COMPENSATING', 'COMPENSATED', 'PARTIALLY_COMPENSATED', 'STUCK');

-- The pager (PagerDuty Events API v2, in the compensator) sends the action that matches the
-- alert's status (TRIGGERED: trigger, RESOLVED: resolve) while pager_state is 'pending';
-- alert.c sets it back to 'pending' when a page is resolved or re-opened. Deliveries are
-- leased (pager_lease_*) so two compensators never post the same action twice, and retried
-- with backoff (pager_attempts, pager_next_at) until sent or 'failed'.
ALTER TABLE alerts
    ADD COLUMN pager_attempts    integer NOT NULL DEFAULT 0,
    ADD COLUMN pager_next_at     timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN pager_lease_owner text,
    ADD COLUMN pager_lease_until timestamptz,
    ADD COLUMN pager_last_error  text,
    ADD COLUMN pager_last_action text CHECK (pager_last_action IN ('trigger', 'resolve')),
    ADD COLUMN pager_sent_at     timestamptz;
CREATE INDEX alerts_pager_idx ON alerts (pager_next_at) WHERE pager_state = 'pending';

-- A new action to deliver starts with a clean retry budget.
CREATE FUNCTION tally_alerts_pager_reset() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.pager_attempts := 0;
    NEW.pager_next_at := now();
    NEW.pager_last_error := NULL;
    NEW.pager_lease_owner := NULL;
    NEW.pager_lease_until := NULL;
    RETURN NEW;
END;
$$;
CREATE TRIGGER alerts_pager_reset BEFORE UPDATE ON alerts
    FOR EACH ROW WHEN (NEW.pager_state = 'pending'
                       AND (OLD.pager_state IS DISTINCT FROM 'pending'
                            OR OLD.status IS DISTINCT FROM NEW.status))
    EXECUTE FUNCTION tally_alerts_pager_reset();

-- Wake the pager the moment there is something to send (identical notifications of one
-- transaction fold into one).
CREATE TRIGGER alerts_pager_notify AFTER INSERT OR UPDATE OF pager_state, status ON alerts
    FOR EACH ROW WHEN (NEW.pager_state = 'pending')
    EXECUTE FUNCTION tally_notify_outbox('tally_alerts');
