-- tally ledger, version 2: what the reconciler keeps about resolving UNKNOWN effects, and the
-- wake-up it listens for. Applied by `tally migrate` inside one transaction.

-- status_checks: every status check the reconciler recorded for the effect (for `tally doctor`).
-- inconclusive_checks: inconclusive checks (errors, answers that are not the protocol's) in the
-- current UNKNOWN episode; the reconciler pages (STUCK, status_inconclusive) when it reaches the
-- tool's max_attempts, and starts again from 0 when the effect leaves UNKNOWN.
-- last_status_check_at: when the last status check was recorded.
ALTER TABLE effects
    ADD COLUMN status_checks        integer NOT NULL DEFAULT 0,
    ADD COLUMN inconclusive_checks  integer NOT NULL DEFAULT 0,
    ADD COLUMN last_status_check_at timestamptz;

-- No new index: the due-work claim (status = 'UNKNOWN' AND next_attempt_at <= now()) is served
-- by effects_status_idx, the lease-expiry sweep by effects_lease_idx (both in version 1).

-- Wake idle reconcilers the moment an effect becomes UNKNOWN (the dispatcher's timeout, or an
-- expired lease), without waiting for the outcome to travel through Kafka. The WHEN clause
-- keeps every other update free of the call; PostgreSQL folds identical notifications of one
-- transaction into one.
CREATE FUNCTION tally_notify_unknown() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('tally_unknown', '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER effects_unknown_notify AFTER UPDATE OF status ON effects
    FOR EACH ROW WHEN (NEW.status = 'UNKNOWN' AND OLD.status IS DISTINCT FROM 'UNKNOWN')
    EXECUTE FUNCTION tally_notify_unknown();
