# The connector: DESIGN §6 classification tables, the signature vector, request building,
# receipts, and the engine against a local responder thread (no services).
tally_unit_test(test_connector SOURCES connector.c connector_classify.c connector_receipt.c
                connector_request.c json.c json_scan.c error.c log.c backoff.c metrics.c)
