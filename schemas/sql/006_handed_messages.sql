-- tally ledger, version 6: messages handed to a relay in memory do not wake the others.
-- A worker that records outcomes can write their message_outbox rows already leased to its own
-- relay (lease_owner, lease_until a few seconds ahead) and hand the relay their content after
-- COMMIT: the relay publishes them at once instead of waiting for a notification and reading
-- them back. No other relay may take such rows before the lease ends, so a notification for
-- them would only make every other relay run a round that finds nothing. Rows inserted without
-- a lease notify as before; leased rows that outlive their lease (their relay died) are found
-- by every relay's periodic round (TALLY_POLL_MS).
-- Applied by `tally migrate` inside one transaction.

CREATE FUNCTION tally_notify_unleased() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows WHERE lease_until IS NULL) THEN
        PERFORM pg_notify(TG_ARGV[0], '');
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER message_outbox_notify ON message_outbox;
CREATE TRIGGER message_outbox_notify AFTER INSERT ON message_outbox
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tally_notify_unleased('tally_message_outbox');
