"""Every exception (and warning) class the package raises, in one leaf module that imports nothing of the package.

``PipelineError`` is the root of the errors a pipelined step raises; the others derive from it or from the
builtin a caller would catch instead (``ValueError`` for bad input, ``RuntimeError``, ``OSError``, ...).
The modules that raise them re-export them, so ``from lightning_roundpipe.options import OptionError``
keeps working. ``WorkerOutOfMemoryError`` stays in ``workers/device_memory.py``: its message is built
from that module's memory-cap advice.
"""

from __future__ import annotations

import errno


class PipelineError(RuntimeError):
    """Base class of the errors the pipeline raises to the caller."""


class WorkerError(PipelineError):
    """A task failed on a worker. ``__cause__`` is the original exception; the message holds its traceback."""

    # ``label`` is a workers.completions.TaskLabel, named only in the annotation: this module imports nothing of the package.
    def __init__(self, label: TaskLabel, original: BaseException, tb_text: str):
        self.label = label
        self.original = original
        self.worker_traceback = tb_text
        super().__init__(
            f"{type(original).__name__} in task [{label}]: {original}\n"
            f"--- original traceback on the worker ---\n{tb_text.rstrip()}"
        )


class PipelineTimeout(PipelineError, TimeoutError):
    """A wait ran past its timeout. The message names the task waited on and what it was waiting for."""


class StepFailed(PipelineError):
    """An optimizer step failed; every layer it had stepped was put back (weights and optimizer state)."""


class LayerStepSkipped(StepFailed):
    """A layer's update did not run because its step had already failed elsewhere (``join`` reports
    the failure itself before these)."""


class EarlyStopUnsupported(PipelineError):
    """A layer cannot be back-propagated through ``recompute_early_stop``'s compiled vjp exactly."""


class NodeSyncError(PipelineError):
    """A gradient all-reduce across nodes failed (a peer died, or the network did)."""


class OptionError(ValueError):
    """An option has a value RoundPipe cannot run with; the message names it and says what to use."""


class SplitInvarianceError(OptionError):
    """A pipelined layer computes something else on microbatches than on the whole batch; nothing ran."""


class PlanError(ValueError):
    """A plan that cannot be run; the message says which stage is wrong and why."""


class MicrobatchError(ValueError):
    """The batch cannot be split as asked; the message says why and what to change."""


class ForwardHookError(RuntimeError):
    """A forward hook on a pipelined layer keeps the layer's output in a training call; nothing was updated."""


class UnseededDraw(RuntimeError):
    """A layer call saw torch's CPU generator change where only a seeded draw may change it."""


class RecompileLimitError(RuntimeError):
    """A compiled layer function reached dynamo's recompile limit: the step fails instead of running the
    layer eagerly behind compiled calls. The message names the function, its graphs and what to change."""


class LayerCompileError(RuntimeError):
    """``torch.compile`` failed on a worker's layers (``compile_layers``); the message says how to run
    them eagerly. ``__cause__`` is the compiler's exception."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read, saved or resumed from; the message says why and what to do."""


class CheckpointSpaceError(CheckpointError, OSError):
    """The disk has no room for the checkpoint; the previous file of that name is intact."""

    def __init__(self, message: str):
        OSError.__init__(self, errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


class CheckpointIntegrityError(CheckpointError):
    """A checkpoint entry's bytes do not match the CRC-32 stored with them: the file changed after it was written."""


class PipelineTargetError(ValueError):
    """No module (or several) could be chosen for pipelining; the message says what to do."""


class UnsupportedModelError(ValueError):
    """The model does not have the structure this adapter understands."""


class UnsupportedInputError(ValueError):
    """A pipelined call got inputs the pipeline does not take (``inputs_embeds``, an unknown keyword,
    labels of another shape, ...); the message says what to pass instead. A ``ValueError``, as the
    builtin it replaces, so existing ``except ValueError`` code still catches it."""


class HiddenStatesNotReturnedError(LookupError):
    """A hidden state other than the last one was read from a pipelined output (not an ``IndexError``, which
    would end an iteration over the hidden states silently instead of failing it)."""


class LogitsNotComputedError(AttributeError):
    """``.logits`` was read from a pipelined output that has none; the message says how to get them."""


class StackSetupError(ValueError):
    """The stack or declared chain cannot be pipelined as given; the message says what to change."""


class BlockChainError(ValueError):
    """The blocks were not used as a chain; the message says what was seen and what to do."""


class UnpipelinedCallWarning(UserWarning):
    """A training call ran the model's own forward on the host, not the pipeline (see the module doc)."""


class FineTuneInputError(ValueError):
    """An input of the fine-tuning job that cannot work; the message says what to change."""


class SimulationError(RuntimeError):
    """The schedule cannot finish (a dependency cycle or an out-of-order queue)."""


class UnsupportedWeightError(TypeError):
    """A layer tensor the stage upload cannot move as it is (unknown subclass, or a packed tensor that
    requires grad): refused when the pipeline is built, before any weight is touched."""


class HostTensorOnWorkerError(RuntimeError):
    """A worker's compute read a tensor that no upload moved to it (on CUDA: a device mismatch)."""
