"""Benchmarks behind ``sara bench``: allocation efficiency in simulation, decision throughput."""
