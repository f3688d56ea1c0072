-- tally ledger, version 8: two index entries for each audit event on the hot path instead of
-- four, and a run's timeline read through indexes instead of a scan of every event.
-- Every effect writes four events (its creation, its claim, the connector call, its outcome),
-- and index insertion was a third of the server's CPU in the dispatcher benchmark
-- (bench/README.md); these four indexes were half of those insertions.
-- Applied by `tally migrate` inside one transaction. The new primary key and the new indexes
-- are built under a write lock on events, reading the whole table: migrate in a quiet moment.

-- seq orders events (ORDER BY seq after a lookup by run, effect or obligation); no query looks
-- an event up by seq, and GENERATED ALWAYS already makes every value new. event_id, unique
-- before, is the key instead: one index where there were two.
ALTER TABLE events DROP CONSTRAINT events_pkey, DROP CONSTRAINT events_event_id_key,
    ADD CONSTRAINT events_pkey PRIMARY KEY (event_id);

-- A "transition" or "connector_call" event that names an effect always names the effect's own
-- run too (every writer takes both from the effect; the test suite's invariant checker asserts
-- it after every scenario), so the run index finds it. The effect index is kept for the other
-- kinds alone, which may name another run's effect (a conflict, a replayed intent answered for
-- another run) and are rare. To read one effect's whole trail, go through its run:
--   SELECT * FROM events WHERE run_id = (SELECT run_id FROM effects WHERE effect_id = $1)
--     AND effect_id = $1 ORDER BY seq
DROP INDEX events_effect_idx;
CREATE INDEX events_effect_idx ON events (effect_id, seq)
    WHERE kind NOT IN ('transition', 'connector_call');

-- `tally doctor` also reads the events of the run's obligations; without an index it had to
-- scan the whole table for them (and, through its OR, for everything else).
CREATE INDEX events_obligation_idx ON events (obligation_id, seq) WHERE obligation_id IS NOT NULL;
