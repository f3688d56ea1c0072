# Identifiers (common/src/id.c): random and time-ordered UUIDs, across threads and a fork.
tally_unit_test(test_id SOURCES id.c)
