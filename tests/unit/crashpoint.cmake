# The crash points of the crash tests (common/src/crashpoint.c), built as a test build has them.
tally_unit_test(test_crashpoint SOURCES crashpoint.c log.c id.c)
target_compile_definitions(test_crashpoint PRIVATE TALLY_CRASH_POINTS)
