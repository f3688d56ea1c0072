# pg.c: the keywords added to TALLY_PG (timeouts, keepalives, statement_timeout merged into the
# user's options) and the client-side deadline against a server that never answers.
tally_unit_test(test_pg SOURCES pg.c error.c log.c id.c backoff.c)
