# The audit batch (common/src/audit.c): the text of its one INSERT's parameter.
tally_unit_test(test_audit SOURCES audit.c recordset.c json.c error.c id.c pg.c log.c)
