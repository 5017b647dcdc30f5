"""Support for running real megatron-core on CPU with gloo (tests, demo, benchmarks); never used by a real GPU job."""
