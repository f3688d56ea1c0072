# The reconciler's decisions (reconciler/policy.c: DESIGN §3 for UNKNOWN effects, backoff with
# jitter bounds, the earliest of duplicate records, RFC 3339 times) and the alert helpers
# (common/src/alert.c: dedup keys and resolve commands). No services.
tally_unit_test(test_reconcile SOURCES alert.c metrics.c audit.c columns.c backoff.c outbox.c pg.c cloudevent.c id.c json.c
                ledger.c log.c error.c)
target_sources(test_reconcile PRIVATE ${CMAKE_SOURCE_DIR}/reconciler/policy.c)
target_include_directories(test_reconcile PRIVATE ${CMAKE_SOURCE_DIR}/reconciler)
