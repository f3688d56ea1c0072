# The dispatcher's decisions (dispatcher/policy.c: DESIGN §3 after a call, the backoff of a
# retry, and the record statement's one override mapped back). No services.
tally_unit_test(test_dispatch_policy SOURCES backoff.c ledger.c connector_classify.c json.c
                error.c)
target_sources(test_dispatch_policy PRIVATE ${CMAKE_SOURCE_DIR}/dispatcher/policy.c)
target_include_directories(test_dispatch_policy PRIVATE ${CMAKE_SOURCE_DIR}/dispatcher)
