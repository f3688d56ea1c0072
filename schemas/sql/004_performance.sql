-- tally ledger, version 4: fewer index writes on the hot path. Every effect is updated twice
-- (claim, outcome) and none of those updates can be HOT (status is indexed), so each index
-- of effects costs one insertion per row version; message_outbox rows are now taken by the
-- relay with one DELETE in id order (relay.c) and never leased on the way.
-- Applied by `tally migrate` inside one transaction. On a large existing ledger the CREATE
-- INDEX holds a write lock on effects while it builds: migrate in a quiet moment.

-- The status index covered every version of every effect, terminal ones included, although
-- every query that uses it asks for a live state: the dispatcher's and the reconciler's due
-- work and gauges (PLANNED, DISPATCHING, UNKNOWN, STUCK), `tally status` (UNKNOWN, STUCK,
-- AWAITING_APPROVAL). Partial, it is written only while an effect is live and stays as small
-- as the live set. Queries over terminal states go through a run (the run indexes below) or
-- scan the table (counts by state) as before.
CREATE INDEX effects_live_idx ON effects (status, next_attempt_at)
    WHERE status IN ('PLANNED', 'AWAITING_APPROVAL', 'DISPATCHING', 'UNKNOWN', 'STUCK');
DROP INDEX effects_status_idx;

-- seq orders the effects of one run (ORDER BY step_num, seq after a lookup by run_id); no
-- query looks an effect up by seq, and GENERATED ALWAYS already makes every value new.
ALTER TABLE effects DROP CONSTRAINT effects_seq_key;

-- Every query that used (run_id, step_num, seq) looks a run up by run_id and sorts its few
-- effects; the unique (run_id, step) index serves the same lookups.
DROP INDEX effects_run_idx;

-- The relay takes rows in primary-key order; lease_until is set only on the rare row that
-- waits out a delivery backoff, which the same scan filters out.
DROP INDEX message_outbox_lease_idx;

-- Both queues are taken from the front of an index (outbox_due_idx, the primary key) and
-- every row is deleted soon after it arrives: vacuum them after a fixed number of dead rows
-- instead of a fraction of a table that is usually almost empty, so the scans that find the
-- next batch do not wade through dead entries.
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 2000);
ALTER TABLE message_outbox SET (autovacuum_vacuum_scale_factor = 0,
                                autovacuum_vacuum_threshold = 2000);
