# text.c: UTF-8-safe cuts, and the limits table against schemas/README.md and the schemas.
tally_unit_test(test_text SOURCES text.c json.c error.c)
