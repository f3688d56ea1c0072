-- tally ledger, version 9: answers routed to the agent that asked, and runs that complete
-- (docs/agent-protocol.md).
-- Applied by `tally migrate` inside one transaction. Only new tables, columns, constraints on
-- small tables and a partial index that is empty at first: nothing long is locked.

-- Runs: ACTIVE -> COMPLETING -> COMPLETED besides the compensation states. completed_at is
-- when a run became COMPLETED; the run's summary (runs.summary) then holds its short summary
-- until a compensation replaces it with the compensation summary.
ALTER TABLE runs DROP CONSTRAINT runs_status_check;
ALTER TABLE runs ADD CONSTRAINT runs_status_check
    CHECK (status IN ('ACTIVE', 'COMPLETING', 'COMPLETED', 'COMPENSATING', 'COMPENSATED',
                      'PARTIALLY_COMPENSATED', 'STUCK', 'CANCELLED'));
ALTER TABLE runs ADD COLUMN completed_at timestamptz;
-- The reconciler's sweep: COMPLETING runs to finish, and (with an idle timeout) ACTIVE ones.
CREATE INDEX runs_open_idx ON runs (status, created_at) WHERE status IN ('ACTIVE', 'COMPLETING');

-- Where the answers about an effect (effect_id) or about a run's own requests (effect_id NULL:
-- compensate_run, cancel_run, complete_run) go besides <prefix>outcomes. destination is
-- {"topic", "partition" (absent: by key), "correlation" (base64 of the bytes), and
-- "correlation_text" when those bytes are printable UTF-8}. The message outbox copies each
-- answer once per destination (the 8 most recent) when the answer is written.
CREATE TABLE replies (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id      text NOT NULL,
    effect_id   uuid,
    intent_id   text NOT NULL,
    destination jsonb NOT NULL CHECK (jsonb_typeof(destination -> 'topic') = 'string'),
    created_at  timestamptz NOT NULL DEFAULT now()
);
-- One row per message that named a destination (the same message delivered again by Kafka
-- adds nothing); the keys stay narrow, as a row is written for nearly every intent.
CREATE UNIQUE INDEX replies_effect_key ON replies (effect_id, intent_id)
    WHERE effect_id IS NOT NULL;
CREATE UNIQUE INDEX replies_run_key ON replies (run_id, intent_id) WHERE effect_id IS NULL;

-- A reply is a message_outbox row of topic 'replies' whose destination is in reply.
ALTER TABLE message_outbox DROP CONSTRAINT message_outbox_topic_check;
ALTER TABLE message_outbox ADD CONSTRAINT message_outbox_topic_check
    CHECK (topic IN ('outcomes', 'obligations', 'alerts', 'dlq', 'replies'));
ALTER TABLE message_outbox ADD COLUMN reply jsonb;
ALTER TABLE message_outbox ADD CONSTRAINT message_outbox_reply_check
    CHECK ((topic = 'replies') = (reply IS NOT NULL));

-- The copy of an event for one destination: the same CloudEvent with the correlation id as an
-- extension attribute (text as it came, other bytes in base64). Events are compact JSON
-- objects with members, so the attribute goes in after the opening brace.
CREATE FUNCTION tally_reply_payload(payload text, destination jsonb) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN destination ? 'correlation_text' THEN
            '{"correlationid":' || to_json(destination ->> 'correlation_text')::text || ','
            || substr(payload, 2)
        WHEN destination ? 'correlation' THEN
            '{"correlationidbase64":' || to_json(destination ->> 'correlation')::text || ','
            || substr(payload, 2)
        ELSE payload END
$$;
