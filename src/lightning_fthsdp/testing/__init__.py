"""Helpers to run real fault-tolerant jobs (lighthouse + replica groups) for tests and benchmarks."""
