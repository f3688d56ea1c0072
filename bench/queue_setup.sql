-- The one-table queue of the raw PostgreSQL ceiling (bench/run.sh; the claim and complete
-- script is pgbench_queue.sql, and with a receipt row per job pgbench_queue_receipt.sql).
-- psql -v rows=N prefills N ready rows, more than 4 clients can drain in the run, so every
-- claim finds 100 rows. The partial indexes are what a real queue would have: the claim reads
-- the oldest ready rows, the completion finds a client's claims.
DROP TABLE IF EXISTS bench_receipt;
DROP TABLE IF EXISTS bench_queue;
CREATE TABLE bench_queue (
    id          bigserial PRIMARY KEY,
    state       text NOT NULL DEFAULT 'ready',
    owner       integer,
    lease_until timestamptz,
    payload     text NOT NULL
);
INSERT INTO bench_queue (payload)
SELECT '{"tool":"bench_ledger","args":{"entry_id":"' || g || '","amount":' || g % 9900
       || ',"currency":"EUR"}}'
  FROM generate_series(1, :rows) AS g;
-- the receipts of pgbench_queue_receipt.sql, one per completed job
CREATE TABLE bench_receipt (
    job_id     bigint PRIMARY KEY,
    receipt    jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX bench_queue_ready ON bench_queue (id) WHERE state = 'ready';
CREATE INDEX bench_queue_claimed ON bench_queue (owner) WHERE state = 'claimed';
VACUUM ANALYZE bench_queue;
