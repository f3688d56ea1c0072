# cloudevent.c: CloudEvents building and the intents-topic parser (every DLQ reason).
tally_unit_test(test_cloudevent SOURCES cloudevent.c json.c id.c error.c)
