# metrics.c: exposition format and thread safety; needs no other module.
tally_unit_test(test_metrics SOURCES metrics.c)
tally_unit_test(test_httpd SOURCES httpd.c metrics.c log.c error.c)
