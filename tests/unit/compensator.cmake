# The compensator's pure logic (compensator/summary.c, compensator/pager.c and the decision
# table in common/src/runops.c): decisions per effect class and compensation mode, blast
# radius, reverse body and If-Match, backoff, run summaries, PagerDuty bodies. No services.
set(TALLY_COMPENSATE_COMMON runops.c backoff.c registry.c json.c error.c log.c pg.c metrics.c audit.c columns.c
    outbox.c cloudevent.c id.c ledger.c)
tally_unit_test(test_compensate SOURCES ${TALLY_COMPENSATE_COMMON})
target_sources(test_compensate PRIVATE ${CMAKE_SOURCE_DIR}/compensator/summary.c
                                       ${CMAKE_SOURCE_DIR}/compensator/pager.c)
target_include_directories(test_compensate PRIVATE ${CMAKE_SOURCE_DIR}/compensator)

# Not a unit test: drives common/src/runops.c against a real PostgreSQL for the integration
# tests (test_compensate_*.py) until `tally compensate|cancel|approve` exist.
add_executable(test_compensate_driver ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_compensate_driver.c)
target_link_libraries(test_compensate_driver PRIVATE tally_common)
