"""Benchmarks of lightning-roundpipe against real peers (see benchmarks/README.md)."""
