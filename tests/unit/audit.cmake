# The audit batch (common/src/audit.c): its one INSERT's parameter, and the columns builder it uses.
tally_unit_test(test_audit SOURCES audit.c columns.c json.c error.c id.c pg.c log.c backoff.c ledger.c)
tally_unit_test(test_columns SOURCES columns.c json.c error.c)
