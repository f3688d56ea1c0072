# The libFuzzer targets: tests/fuzz/fuzz_<name>.c, each linked with only the common/src files
# listed (text.c, under error.c, always), so one target builds while another module changes.
# Read by tests/fuzz/CMakeLists.txt (building them) and tests/fuzz/tests.cmake (running them).
set(TALLY_FUZZ_TARGETS intent intake registry json_scan canonical text bounded redact)

set(TALLY_FUZZ_SOURCES_intent cloudevent.c json.c id.c error.c)
set(TALLY_FUZZ_SOURCES_intake cloudevent.c registry.c json.c id.c error.c)
set(TALLY_FUZZ_SOURCES_registry registry.c json.c error.c)
set(TALLY_FUZZ_SOURCES_json_scan json_scan.c json.c error.c)
set(TALLY_FUZZ_SOURCES_canonical json.c error.c)
set(TALLY_FUZZ_SOURCES_text cloudevent.c json.c id.c error.c alert.c metrics.c audit.c columns.c outbox.c
    pg.c log.c backoff.c ledger.c)
set(TALLY_FUZZ_SOURCES_bounded cloudevent.c json.c id.c error.c)
set(TALLY_FUZZ_SOURCES_redact seal.c json.c id.c error.c config.c)
