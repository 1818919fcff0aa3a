"""Benchmarks of lightning-roundpipe: peers/, calibration/, validation/, figures/ (index: benchmarks/README.md)."""
