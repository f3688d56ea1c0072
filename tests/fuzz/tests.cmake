# fuzz.<target>: each libFuzzer target replays its regressions and fuzzes for
# TALLY_FUZZ_SECONDS (tests/fuzz/run.sh). The fuzzers are clang builds: from this tree when it
# is one (TALLY_FUZZ), else from the tree TALLY_FUZZ_DIR names (scripts/test.sh: build-fuzz/).
include(${CMAKE_CURRENT_LIST_DIR}/targets.cmake)
if(TALLY_FUZZ)
  set(TALLY_FUZZ_BIN ${CMAKE_BINARY_DIR}/tests/fuzz)
elseif(TALLY_FUZZ_DIR)
  set(TALLY_FUZZ_BIN ${TALLY_FUZZ_DIR}/tests/fuzz)
else()
  set(TALLY_FUZZ_BIN "")
endif()
if(TALLY_FUZZ_BIN)
  foreach(name ${TALLY_FUZZ_TARGETS})
    add_test(NAME fuzz.${name} COMMAND ${CMAKE_CURRENT_LIST_DIR}/run.sh
             ${TALLY_FUZZ_BIN}/fuzz_${name} ${name} ${TALLY_FUZZ_SECONDS})
    math(EXPR timeout "${TALLY_FUZZ_SECONDS} + 120")
    set_tests_properties(fuzz.${name} PROPERTIES LABELS fuzz TIMEOUT ${timeout})
  endforeach()
endif()
