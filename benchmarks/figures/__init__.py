"""The figures the docs quote about this project's own design choices, measured or simulated."""
