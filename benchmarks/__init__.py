"""Benchmarks of lightning-roundpipe: peers/, calibration/, validation/, figures/ (index: benchmarks/README.md)."""

from benchmarks import old_names

old_names.install()  # the documented old command names, deprecated (old_names.py)
