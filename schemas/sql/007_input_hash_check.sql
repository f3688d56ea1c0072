-- tally ledger, version 7: the input hash is checked without a regular expression.
-- PostgreSQL evaluates every CHECK constraint of a row on each INSERT and UPDATE of it, and the
-- regular expression '^[0-9a-f]{64}$' ran twice for every effect (its insert, its outcome):
-- pg_regexec was 8 % of the server's CPU in the dispatcher benchmark (bench/README.md). The same
-- rule without one: 64 bytes, and nothing left once every leading 0-9 and a-f is trimmed.
-- Applied by `tally migrate` inside one transaction. Adding the constraint reads the whole
-- effects table under the ALTER's lock to validate it: migrate in a quiet moment.

ALTER TABLE effects DROP CONSTRAINT effects_input_hash_check;
ALTER TABLE effects ADD CONSTRAINT effects_input_hash_check
    CHECK (octet_length(input_hash) = 64 AND ltrim(input_hash, '0123456789abcdef') = '');
