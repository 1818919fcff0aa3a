"""roundpipe_lab: the lab beside the lightning_roundpipe library.

Simulator studies and reproductions of published runs (``analysis/``, ``python -m roundpipe_lab.sim``),
and the fake drivers the tests and benchmarks run the library's CUDA protocol on (``fake_cuda/``:
fake streams, pinning and allocator, emulated GPUs). The lab imports the library; the library imports
nothing of the lab. Importing the lab registers its worker backends ("fake_cuda", "emulated"), which
an installed checkout also finds through the ``lightning_roundpipe.backends`` entry points.
"""

from .backends import register_lab_backends

register_lab_backends()
