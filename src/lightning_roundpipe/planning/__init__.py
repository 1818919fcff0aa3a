"""Choosing the plan: partition policies, the search and its timing model, the memory budget."""
