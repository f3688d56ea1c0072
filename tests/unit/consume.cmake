# The consumer side every worker shares (common/src/consume.c): wake-up pipe, reading, offsets
# stored after the round. Against librdkafka's in-process mock cluster: no services.
tally_unit_test(test_consume SOURCES consume.c log.c id.c error.c metrics.c)
