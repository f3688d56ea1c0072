# cli/format.c: the output every CLI verb shares — wrapping at word boundaries to cli_width()
# (COLUMNS, the terminal, 80), and JSON with reals in their shortest round-trip form. Linked with
# the common library (format.c reads results through pg.c); the test defines the one symbol of
# cli/main.c that format.c uses.
add_executable(test_cli_format ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_cli_format.c
                               ${CMAKE_SOURCE_DIR}/cli/format.c)
target_include_directories(test_cli_format PRIVATE ${CMAKE_SOURCE_DIR}/cli
                                                   ${CMAKE_CURRENT_SOURCE_DIR}/unit)
target_link_libraries(test_cli_format PRIVATE tally_common PkgConfig::CMOCKA)
add_test(NAME unit.test_cli_format COMMAND test_cli_format)
set_tests_properties(unit.test_cli_format PROPERTIES LABELS unit TIMEOUT 120)
