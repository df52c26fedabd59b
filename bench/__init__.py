"""turbospark benchmarks (never part of the test run's pass/fail); entry point: ``python -m bench.run``."""
