# The tool registry (common/src/registry.c): every DESIGN §4 rule, defaults, ${VAR} expansion
# in base_url, operation keys, and examples/tools/ (demo.json valid, invalid/* refused).
tally_unit_test(test_registry SOURCES registry.c error.c json.c)
