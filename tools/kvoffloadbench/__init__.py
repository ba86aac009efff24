"""kvoffload benchmarks, soak test, trace generator, and the harness that starts a daemon
or a redis-server for them and for the tests."""
