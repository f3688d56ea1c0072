# The compensator's pure logic (compensator/policy.c, compensator/body.c, compensator/pager.c
# and the decision table in common/src/runops.c): decisions per effect class and compensation
# mode, per unsent call and per answer, blast radius, reverse body and If-Match, backoff, what a
# settled run publishes, PagerDuty bodies, the text of deadline pages. No services.
set(TALLY_COMPENSATE_COMMON runops.c backoff.c registry.c json.c error.c log.c pg.c metrics.c audit.c columns.c
    outbox.c cloudevent.c id.c ledger.c config.c)
tally_unit_test(test_compensate SOURCES ${TALLY_COMPENSATE_COMMON} alert.c)
target_sources(test_compensate PRIVATE ${CMAKE_SOURCE_DIR}/compensator/policy.c
                                       ${CMAKE_SOURCE_DIR}/compensator/body.c
                                       ${CMAKE_SOURCE_DIR}/compensator/pager.c)
target_include_directories(test_compensate PRIVATE ${CMAKE_SOURCE_DIR}/compensator)

# A run's compensation summary (common/src/runsummary.c): the classification the compensator
# and `tally summary` share, in both views. No services.
tally_unit_test(test_runsummary SOURCES runsummary.c registry.c alert.c metrics.c audit.c columns.c backoff.c
                outbox.c pg.c cloudevent.c id.c json.c ledger.c log.c error.c)

# Not a unit test: drives common/src/runops.c against a real PostgreSQL for the integration
# tests (test_compensate_*.py) until `tally compensate|cancel|approve` exist.
add_executable(test_compensate_driver ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_compensate_driver.c)
target_link_libraries(test_compensate_driver PRIVATE tally_common)
