-- The raw PostgreSQL ceiling tally is compared with (bench/run.sh): one client claims 100 due
-- rows of a one-table queue with FOR UPDATE SKIP LOCKED and commits the claim, then completes
-- them in a second transaction — the same two commits per batch tally's dispatcher makes,
-- without the effects, events, outbox and HTTP around them. pgbench counts one run of this
-- script as one transaction, so rows/s = 100 x the tps it reports.
BEGIN;
UPDATE bench_queue SET state = 'claimed', owner = :client_id, lease_until = now() + interval '30 s'
 WHERE id IN (SELECT id FROM bench_queue WHERE state = 'ready' ORDER BY id LIMIT 100
              FOR UPDATE SKIP LOCKED);
COMMIT;
BEGIN;
UPDATE bench_queue SET state = 'done', lease_until = NULL
 WHERE owner = :client_id AND state = 'claimed';
COMMIT;
