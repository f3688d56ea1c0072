# cli/console_*.c and cli/cmd_console.c, the pure parts of `tally console`: its input checks,
# HTML and URL escaping, the timeline's marks and drawing. Linked with the common library; the
# test defines the one symbol of cli/main.c that format.c uses.
add_executable(test_console ${CMAKE_CURRENT_SOURCE_DIR}/unit/test_console.c
                            ${CMAKE_SOURCE_DIR}/cli/cmd_console.c
                            ${CMAKE_SOURCE_DIR}/cli/console_html.c
                            ${CMAKE_SOURCE_DIR}/cli/console_pages.c
                            ${CMAKE_SOURCE_DIR}/cli/console_timeline.c
                            ${CMAKE_SOURCE_DIR}/cli/format.c)
target_include_directories(test_console PRIVATE ${CMAKE_SOURCE_DIR}/cli
                                                ${CMAKE_CURRENT_SOURCE_DIR}/unit)
target_link_libraries(test_console PRIVATE tally_common PkgConfig::CMOCKA)
add_test(NAME unit.test_console COMMAND test_console)
set_tests_properties(unit.test_console PROPERTIES LABELS unit TIMEOUT 120)
