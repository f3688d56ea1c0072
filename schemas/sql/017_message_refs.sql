-- tally ledger, version 17 (an expand step): outcome messages that reference the ledger
-- instead of carrying a copy of it. A dispatcher's outcome event (tally.effect.<state>.v1 on
-- the outcomes topic, for a result it recorded) was written twice: its content in events and
-- effects, and the whole serialised CloudEvent again in message_outbox.payload. A row of
-- message_refs names the "transition" audit event the outcome reports (its event_id, which is
-- also the CloudEvent's id); the relay reads that event and its effect when it takes the row
-- and builds the CloudEvent from them (docs/hacking.md, "Outcome messages by reference").
--
-- A table of its own, not a column of message_outbox: the relays of 0.2.0 and older take every
-- row of message_outbox and publish its payload, so they must never see a reference. They do
-- not know this table and leave it alone; relays of 0.3.0 drain both. Binaries of 0.2.0 run on
-- this schema unchanged; 0.3.0 writes references only once this schema is there.

-- Both tables draw their ids from message_outbox's sequence: one order for the relay, which
-- publishes the rows of both tables in id order, and delivery reports matched by id alone.
-- SECURITY DEFINER: the dispatcher's role inserts rows without a grant on the sequence.
CREATE FUNCTION tally_message_id() RETURNS bigint LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path FROM CURRENT AS $$
    SELECT nextval('message_outbox_id_seq')
$$;

CREATE TABLE message_refs (
    id          bigint PRIMARY KEY DEFAULT tally_message_id(),
    -- the "transition" event (events.event_id) the message reports; no foreign key: events
    -- are append-only and never deleted, and a key would cost a lookup per insert
    event_id    uuid NOT NULL,
    msg_key     text,
    attempts    integer NOT NULL DEFAULT 0,
    last_error  text,
    lease_owner text,
    lease_until timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TRIGGER message_refs_notify AFTER INSERT ON message_refs
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tally_notify_unleased('tally_message_outbox');

ALTER TABLE message_refs SET (autovacuum_vacuum_scale_factor = 0,
                              autovacuum_vacuum_threshold = 2000);
