"""Developer tools for kvstore (test fixtures, benchmarks helpers)."""
