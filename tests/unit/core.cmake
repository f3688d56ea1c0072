# The core library modules: canonical JSON and hashing, configuration, the ledger state machines.
tally_unit_test(test_json SOURCES json.c error.c)
tally_unit_test(test_json_scan SOURCES json_scan.c json.c error.c)
tally_unit_test(test_config SOURCES config.c error.c)
tally_unit_test(test_ledger SOURCES ledger.c)
tally_unit_test(test_log SOURCES log.c id.c)
tally_unit_test(test_backoff SOURCES backoff.c)
