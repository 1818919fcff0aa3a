"""The plan as data: stages, dispatch order, lowering to the step's task graph."""
