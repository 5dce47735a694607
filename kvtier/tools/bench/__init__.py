"""Benchmarks run by ``kvtier bench NAME``.  Each prints its throughput beside the raw ceiling measured
in the same run on the same payloads, and the ratio; medians over repeats, since machines are noisy."""
