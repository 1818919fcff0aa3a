"""The fake CUDA driver: the library's stream protocol run on CPU threads, so CI exercises it.

``streams.py`` (streams and events), ``cudart.py`` (pinning calls), ``allocator.py`` (CUDA's caching
allocator on fake GPUs), ``residency.py`` (host tensors read by a worker's compute), ``pool.py`` (the
"fake_cuda" backend) and ``emulated.py`` (the "emulated" backend: fake streams with device time).
What it models and what it cannot: docs/fake_cuda.md.
"""
