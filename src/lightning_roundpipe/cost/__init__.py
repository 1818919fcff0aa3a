"""The cost model: hardware profiles, per-layer costs, transformer shapes and memory."""
