"""The Lightning glue: the strategy and what only it needs."""
