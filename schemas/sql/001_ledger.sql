-- tally ledger, version 1: runs, effects, the dispatch outbox, obligations, alerts,
-- the append-only audit trail and the message outbox that the relay publishes to Kafka.
-- Applied by `tally migrate` inside one transaction; see common/src/migrate.c.

CREATE TABLE runs (
    run_id       text PRIMARY KEY,
    tenant       text,
    status       text NOT NULL DEFAULT 'ACTIVE'
                 CHECK (status IN ('ACTIVE', 'COMPENSATING', 'COMPENSATED',
                                   'PARTIALLY_COMPENSATED', 'STUCK', 'CANCELLED')),
    status_reason text,
    summary      jsonb,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE effects (
    effect_id      uuid PRIMARY KEY,
    seq            bigint GENERATED ALWAYS AS IDENTITY UNIQUE,
    run_id         text NOT NULL REFERENCES runs (run_id),
    step           text NOT NULL,
    -- numeric value of the step when it is a number: orders a run's steps for the saga
    step_num       numeric,
    tool           text NOT NULL,
    effect_class   text NOT NULL
                   CHECK (effect_class IN ('read', 'idempotent', 'reversible',
                                           'append_only', 'destructive')),
    operation_key  text NOT NULL,
    input_hash     text NOT NULL CHECK (input_hash ~ '^[0-9a-f]{64}$'),
    -- the canonical JSON of the args, byte for byte what the connector sends
    args_canonical text NOT NULL,
    tenant         text,
    traceparent    text,
    intent_id      text NOT NULL,
    status         text NOT NULL
                   CHECK (status IN ('PLANNED', 'AWAITING_APPROVAL', 'DISPATCHING', 'CONFIRMED',
                                     'FAILED', 'UNKNOWN', 'STUCK', 'REJECTED', 'CANCELLED')),
    status_reason  text,
    attempts       integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    unknown_since  timestamptz,
    receipt        jsonb,
    external_ref   text,
    error_code     text,
    error_message  text,
    lease_owner    text,
    lease_until    timestamptz,
    lease_epoch    bigint NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tool, operation_key),
    UNIQUE (run_id, step),
    CONSTRAINT confirmed_has_receipt CHECK (status <> 'CONFIRMED' OR receipt IS NOT NULL),
    CONSTRAINT dispatching_is_leased
        CHECK (status <> 'DISPATCHING' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL))
);
CREATE INDEX effects_status_idx ON effects (status, next_attempt_at);
CREATE INDEX effects_run_idx ON effects (run_id, step_num, seq);
CREATE INDEX effects_lease_idx ON effects (lease_until) WHERE status IN ('DISPATCHING', 'UNKNOWN');

-- The transactional dispatch outbox: one row per effect that is due for a connector call.
-- Written in the same transaction as the effect; claimed with FOR UPDATE SKIP LOCKED.
CREATE TABLE outbox (
    effect_id  uuid PRIMARY KEY REFERENCES effects (effect_id),
    tool       text NOT NULL,
    due_at     timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_due_idx ON outbox (tool, due_at);

CREATE TABLE obligations (
    obligation_id  uuid PRIMARY KEY,
    run_id         text NOT NULL REFERENCES runs (run_id),
    effect_id      uuid NOT NULL REFERENCES effects (effect_id),
    reason         text NOT NULL CHECK (reason IN ('duplicate', 'compensate_run', 'cancel_run')),
    -- the upstream record to reverse: the effect's own ref, or an extra duplicate's
    external_ref   text,
    receipt        jsonb,
    status         text NOT NULL DEFAULT 'PENDING'
                   CHECK (status IN ('PENDING', 'AWAITING_APPROVAL', 'RUNNING', 'RESOLVED',
                                     'SKIPPED', 'UNCOMPENSATABLE', 'STUCK', 'CANCELLED')),
    status_reason  text,
    attempts       integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    reverse_receipt jsonb,
    blast_radius   jsonb,
    error_code     text,
    error_message  text,
    lease_owner    text,
    lease_until    timestamptz,
    lease_epoch    bigint NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- asking twice (or detecting the same extra record twice) creates nothing new
    UNIQUE NULLS NOT DISTINCT (effect_id, external_ref)
);
CREATE INDEX obligations_due_idx ON obligations (status, next_attempt_at);
CREATE INDEX obligations_run_idx ON obligations (run_id);

-- One row per page: opened when something goes STUCK, resolved when its last item is.
CREATE TABLE alerts (
    dedup_key     text PRIMARY KEY,
    status        text NOT NULL DEFAULT 'TRIGGERED' CHECK (status IN ('TRIGGERED', 'RESOLVED')),
    severity      text NOT NULL,
    summary       text NOT NULL,
    run_id        text,
    effect_id     uuid,
    obligation_id uuid,
    reason        text NOT NULL,
    runbook       text,
    resolve_command text,
    pager_state   text NOT NULL DEFAULT 'pending'
                  CHECK (pager_state IN ('pending', 'sent', 'not_configured', 'failed')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    resolved_at   timestamptz
);

-- The audit trail: every transition, intent, connector exchange, lease and operator action.
CREATE TABLE events (
    seq           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id      uuid NOT NULL UNIQUE,
    occurred_at   timestamptz NOT NULL DEFAULT now(),
    run_id        text,
    effect_id     uuid,
    obligation_id uuid,
    kind          text NOT NULL,
    from_status   text,
    to_status     text,
    actor         text NOT NULL,
    reason        text,
    data          jsonb
);
CREATE INDEX events_run_idx ON events (run_id, seq);
CREATE INDEX events_effect_idx ON events (effect_id, seq);

CREATE FUNCTION tally_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'tally audit events are append-only: % is not allowed', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER events_no_update BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION tally_events_append_only();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION tally_events_append_only();

-- Messages waiting for the relay: a row is deleted only after Kafka acknowledged it.
CREATE TABLE message_outbox (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    topic       text NOT NULL CHECK (topic IN ('outcomes', 'obligations', 'alerts', 'dlq')),
    msg_key     text,
    event_id    text NOT NULL,
    payload     text NOT NULL,
    attempts    integer NOT NULL DEFAULT 0,
    last_error  text,
    lease_owner text,
    lease_until timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX message_outbox_lease_idx ON message_outbox (lease_until NULLS FIRST, id);

-- Wake idle workers: one NOTIFY per statement, not per row.
CREATE FUNCTION tally_notify_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END;
$$;
CREATE TRIGGER message_outbox_notify AFTER INSERT ON message_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION tally_notify_outbox('tally_message_outbox');
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION tally_notify_outbox('tally_outbox');
CREATE TRIGGER obligations_notify AFTER INSERT ON obligations
    FOR EACH STATEMENT EXECUTE FUNCTION tally_notify_outbox('tally_obligations');
