"""The host's loss phase: the merged output assembled while the forward runs."""

import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_roundpipe import CpuWorkerPool, EngineOptions, PipelineEngine, simple_plan
from lightning_roundpipe.engine import merge_microbatches
from lightning_roundpipe.engine.microbatch import HostCarry
from lightning_roundpipe.engine.microbatch import OutputAssembly

from _models import mlp


def _assemble(trees, sizes):
    assembly = OutputAssembly(sizes)
    carries = [HostCarry.of(t) for t in trees]
    for m, c in enumerate(carries):
        assembly.add(m, c)
    return assembly, carries, assembly.merged([c.tree() for c in carries])


@pytest.mark.timeout(20)
def test_microbatch_outputs_land_in_the_rows_of_one_tensor():
    torch.manual_seed(0)
    trees = [{"logits": torch.randn(n, 3, 5), "ids": torch.arange(n * 2).view(n, 2)} for n in (2, 2, 1)]
    expected = merge_microbatches(trees)
    assembly, carries, merged = _assemble([{k: v.clone() for k, v in t.items()} for t in trees], [2, 2, 1])
    for key in ("logits", "ids"):
        assert torch.equal(merged[key], expected[key]) and merged[key].dtype == expected[key].dtype
        # no copy after the last microbatch: the merged tensor is the one the rows were copied into
        assert merged[key].data_ptr() == assembly.buffers[list(expected).index(key)].data_ptr()
        # and each microbatch's carry now holds views of its rows (its own tensor is freed)
        starts = [c.tree()[key].data_ptr() for c in carries]
        assert starts[1] == merged[key][2:].data_ptr() and starts[2] == merged[key][4:].data_ptr()


@pytest.mark.timeout(20)
def test_outputs_that_do_not_stack_row_by_row_are_concatenated_as_before():
    torch.manual_seed(0)
    # a later microbatch of another dtype, a transposed (non-contiguous) leaf, dim 0 not the microbatch's size
    cases = [[torch.randn(2, 4), torch.randn(2, 4).double()],
             [torch.randn(4, 2).t(), torch.randn(4, 2).t()],
             [torch.randn(3, 4), torch.randn(3, 4)]]
    for leaves in cases:
        expected = torch.cat(leaves)
        _, _, merged = _assemble([t.clone() for t in leaves], [2, 2])
        assert torch.equal(merged, expected) and merged.dtype == expected.dtype and merged.stride() == expected.stride()


@pytest.mark.timeout(60)
def test_pipelined_output_is_one_tensor_filled_in_place_and_exact():
    torch.manual_seed(0)
    layers = mlp()
    x = torch.randn(8, 16)
    with torch.no_grad():
        expected = nn.Sequential(*layers)(x)
    eng = PipelineEngine(layers, CpuWorkerPool(2), simple_plan(len(layers), 2), EngineOptions(microbatches=4))
    try:
        out = eng(x)
        run = eng.last_run
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
        assert [t.data_ptr() for t in run.output_sizes] == [out[2 * m:].data_ptr() for m in range(4)]
        out.sum().backward()
        assert all(p.grad is not None for l in layers for p in l.parameters())
        # the call is freed once its output is: the rows it holds are not views of the output
        # (a cycle through autograd's C++ graph would keep every call's memory)
        gone = weakref.ref(run)
        del out, run
        eng(x).sum().backward()
        gc.collect()
        assert gone() is None
    finally:
        eng.close()
