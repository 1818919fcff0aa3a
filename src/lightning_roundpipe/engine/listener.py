"""What the engine tells the code above it during a call: the way back up, as one typed interface.

The engine reports to exactly one listener (``PipelineEngine.listen``): the runtime, which passes
each report on by explicit calls (gradient sync, overlapped optimizers, plan keeper). Alone (plain
PyTorch, tests) the engine reports to ``NO_LISTENER``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..workers.completions import Completion
    from .step import StepRun


class EngineListener(Protocol):
    """The three reports of the way back, in the order a training step makes them."""

    def upload_waits_for(self, layer_ids: range) -> list[Completion]:
        """Before an upload of these layers' weights: the completions it must wait for (the layers'
        pending optimizer steps, so the upload reads the new weights)."""
        ...

    def on_grads_ready(self, layer_ids: range) -> None:
        """On the host thread: the ``.grad`` of these layers' parameters holds this call's gradients."""
        ...

    def on_backward_done(self, run: StepRun) -> None:
        """A training call's backward is done, its owed tail included (its measurements are final)."""
        ...


class _NoListener:
    """The engine alone: uploads wait for nothing, reports go nowhere."""

    def upload_waits_for(self, layer_ids: range) -> list:
        return []

    def on_grads_ready(self, layer_ids: range) -> None:
        pass

    def on_backward_done(self, run) -> None:
        pass


NO_LISTENER: EngineListener = _NoListener()
