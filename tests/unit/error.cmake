# error.c: the error codes' table (names, retriable, fatal), the typed setters and the SQLSTATE.
tally_unit_test(test_error SOURCES error.c)
