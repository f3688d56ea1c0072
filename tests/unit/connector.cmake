# The connector engine: DESIGN §6 classification tables, the signature vector, request
# building, and the engine against a local responder thread (no services).
tally_unit_test(test_connector SOURCES connector.c json.c json_scan.c error.c log.c)
