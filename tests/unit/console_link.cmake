# The console link of alerts and pages (common/src/alert.c: a run id as one RFC 3986 path
# segment, pages without a run) and TALLY_CONSOLE_URL's check (common/src/config.c). No services.
tally_unit_test(test_console_link SOURCES alert.c metrics.c config.c audit.c columns.c backoff.c outbox.c pg.c
                cloudevent.c id.c json.c ledger.c log.c error.c)
