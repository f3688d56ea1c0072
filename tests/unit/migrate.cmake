# The schema window (common/src/migrate.c): which binaries run on which ledger, the releases
# table, and the application_name every session carries. Linked with the whole library, for
# the generated table of migrations.
add_executable(test_migrate ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_migrate.c)
target_include_directories(test_migrate PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/unit)
target_link_libraries(test_migrate PRIVATE tally_common PkgConfig::CMOCKA)
add_test(NAME unit.test_migrate COMMAND test_migrate)
set_tests_properties(unit.test_migrate PROPERTIES LABELS unit TIMEOUT 120)
