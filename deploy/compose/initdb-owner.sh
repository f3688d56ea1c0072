#!/bin/sh
# Run once by the postgres image when it initialises an empty data directory
# (/docker-entrypoint-initdb.d): the role that owns the ledger and the database tally, owned
# by it. tally_owner is no superuser; CREATEROLE lets `tally migrate` create the role of each
# component (docs/operations.md, "Database roles"). The password comes from the environment
# and reaches the server as a psql variable, quoted there.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
    -v owner_password="$LEDGER_OWNER_PASSWORD" <<'SQL'
CREATE ROLE tally_owner LOGIN CREATEROLE PASSWORD :'owner_password';
CREATE DATABASE tally OWNER tally_owner;
SQL
