-- The raw ceiling with a receipt row per job (bench/run.sh): what a team would build instead of
-- tally, at its barest. As pgbench_queue.sql — claim 100 due rows with FOR UPDATE SKIP LOCKED
-- and commit the claim — then complete them and store each job's receipt in one transaction:
-- the tool's answer as jsonb (about 245 bytes as JSON text, shaped like the fake tool's
-- record: id, collection, idempotency key, status, version, time, amount, currency) in
-- bench_receipt, keyed by the job. pgbench counts one run of this script as one transaction.
BEGIN;
UPDATE bench_queue SET state = 'claimed', owner = :client_id, lease_until = now() + interval '30 s'
 WHERE id IN (SELECT id FROM bench_queue WHERE state = 'ready' ORDER BY id LIMIT 100
              FOR UPDATE SKIP LOCKED);
COMMIT;
BEGIN;
WITH done AS (
    UPDATE bench_queue SET state = 'done', lease_until = NULL
     WHERE owner = :client_id AND state = 'claimed'
    RETURNING id)
INSERT INTO bench_receipt (job_id, receipt)
SELECT id, jsonb_build_object('id', 'bench_ledger_' || id, 'collection', 'bench_ledger',
                              'idempotency_key', 'bench_ledger:' || md5(id::text),
                              'status', 'active', 'version', 1, 'created_at', now(),
                              'amount', id % 9900, 'currency', 'EUR')
  FROM done;
COMMIT;
