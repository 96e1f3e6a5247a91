"""Reference networks used by the demo, the tests and the benchmarks."""
