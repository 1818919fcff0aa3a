"""The host process itself: its threads' torch settings, its compile clock, its heap, allocator and GC.

Leaf modules that import nothing of the package: the worker pool, the engine, the optimizer and the
runtime all set or read process-wide state through them.
"""
