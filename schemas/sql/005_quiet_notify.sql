-- tally ledger, version 5: wake-ups only when there is work. A statement-level trigger fires
-- even when its INSERT wrote no row, and the dispatcher's statements insert into the dispatch
-- outbox only the effects that must wait (most are claimed as they are created, and most
-- results are final): without a row check, every intake batch and every recorded batch would
-- wake every dispatcher for a claim that finds nothing. The same holds for obligations.
-- Applied by `tally migrate` inside one transaction.

CREATE FUNCTION tally_notify_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_rows) THEN
        PERFORM pg_notify(TG_ARGV[0], '');
    END IF;
    RETURN NULL;
END;
$$;

DROP TRIGGER outbox_notify ON outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tally_notify_rows('tally_outbox');

DROP TRIGGER obligations_notify ON obligations;
CREATE TRIGGER obligations_notify AFTER INSERT ON obligations REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tally_notify_rows('tally_obligations');
