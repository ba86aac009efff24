"""kvoffload benchmarks that need more than the daemon: vLLM's real engine-side path."""
