# metrics.c: exposition format and thread safety; needs no other module.
tally_unit_test(test_metrics SOURCES metrics.c)
