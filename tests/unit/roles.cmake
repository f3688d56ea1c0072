# The grants table of the runtime roles (common/src/roles.c) and the start-up check's rule.
tally_unit_test(test_roles SOURCES roles.c config.c error.c pg.c log.c backoff.c json.c)
