"""gc_freeze: the objects tracked at attach stay out of Python's full collections until the last detach."""

import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions
from lightning_roundpipe.options import OptionError
from lightning_roundpipe.host import host_gc
from lightning_roundpipe.host.host_gc import OlderObjectsFrozen

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def nothing_frozen():
    assert host_gc.holders() == 0, "a runtime of an earlier test is still attached"
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_first_hold_freezes_and_the_last_release_unfreezes():
    a = OlderObjectsFrozen()
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # everything imported so far
    b = OlderObjectsFrozen()
    # (the count shrinks a little as frozen objects are freed by their references)
    assert gc.get_freeze_count() > frozen - 500 and host_gc.holders() == 2
    a.release()
    a.release()  # idempotent
    assert gc.get_freeze_count() > frozen - 500 and host_gc.holders() == 1
    b.release()
    assert gc.get_freeze_count() == 0 and host_gc.holders() == 0


def test_objects_frozen_by_someone_else_stay_frozen():
    gc.freeze()  # the user's own
    theirs = gc.get_freeze_count()  # it shrinks a little as frozen objects are freed by their references
    later = [[] for _ in range(20000)]  # tracked, and not frozen by the user
    hold = OlderObjectsFrozen()
    assert gc.get_freeze_count() < theirs + 10000  # the hold froze nothing more
    hold.release()
    assert gc.get_freeze_count() > theirs - 10000  # and did not unfreeze theirs
    del later


class Cycle:
    def __init__(self):
        self.me = self


def small_runtime(**options) -> RoundPipeRuntime:
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    return RoundPipeRuntime.attach(seq, "cpu", 2, RuntimeOptions(microbatches=2, **options))


def test_an_attached_runtime_keeps_set_up_objects_out_of_full_collections():
    gc.collect()
    oldest_before = len(gc.get_objects(generation=2))
    garbage = Cycle()
    ref = weakref.ref(garbage)
    del garbage  # cyclic garbage that exists at attach
    rt = small_runtime()
    try:
        assert host_gc.holders() == 1
        assert len(gc.get_objects(generation=2)) < oldest_before / 10  # a full collection scans few objects
        rt.module(torch.randn(4, 4)).sum().backward()
        gc.collect()
        assert ref() is not None  # frozen with the rest until detach
    finally:
        rt.detach()
    assert host_gc.holders() == 0 and gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_gc_freeze_false_leaves_the_collector_alone():
    rt = small_runtime(gc_freeze=False)
    try:
        assert host_gc.holders() == 0 and gc.get_freeze_count() == 0
    finally:
        rt.detach()


def test_gc_freeze_must_be_a_bool():
    with pytest.raises(OptionError, match="gc_freeze"):
        RuntimeOptions(gc_freeze="yes").validate()
