"""Every change to an object RoundPipe does not own is listed in ``user_patches.USER_PATCHES``, and a fit
leaves none behind.

The scan reads every module of the package with ``ast`` and finds the writes that can change another
object: an assignment to (or deletion of) one of the attribute names below on anything but ``self``,
``setattr`` / ``delattr`` / ``object.__setattr__`` on anything but ``self``, a change through ``vars(x)``,
an item written into a module's ``_parameters`` / ``_buffers`` / ``_forward_hooks``, and a forward hook
registered. Each must sit in a function that an entry of the list names, or in ``OURS`` below: writes
the scan cannot tell from a patch, to objects RoundPipe made itself (each with its reason).
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from _models import SeqModule, make_data
from lightning_roundpipe import RoundPipeRuntime, RoundPipeStrategy, RuntimeOptions
from lightning_roundpipe.user_patches import USER_PATCHES

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "lightning_roundpipe"
LISTING = "user_patches.py"  # the module that lists them (and applies the instance attributes)

# Attribute names whose assignment on another object is a patch of it (or, below, of one of ours).
PATCHABLE = {"forward", "__deepcopy__", "__class__", "__signature__", "__doc__", "step", "zero_grad", "parameters",
             "named_parameters", "state_dict", "load_state_dict", "_opt_called", "gradient_checkpointing", "training"}
MODULE_STORES = {"_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_modules"}
HOOK_CALLS = {"register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
              "register_full_backward_pre_hook"}

# Writes the scan finds on objects RoundPipe made itself: function (qualname) -> why it is not a patch.
OURS = {
    "PipelineEngine.__call__": "self.pool.trace.step: the trace recorder's current step (our TraceRecorder)",
    "Params4bitWeight.rebuild": "setattr on a copy of the QuantState (_copy_state), rebuilt for the worker",
    "_copy_state": "setattr on the QuantState copy it just made",
    "_host_call": "setattr on the exception a layer raised in the check, to name the layer",
    "estimate_costs": "setattr on the LayerCost the estimate just built",
    "_moved": "object.__setattr__ on the copy of a frozen lowered task it just made",
    "LayerView.__init__": "vars() of its own shallow copy of the optimizer (the view that steps one unit)",
    "with_option_keywords.wrap": "the names and docstring of the __init__ it has just generated from the options",
    "_describe_options": "the docstring of RoundPipeStrategy's own generated __init__ (the options' Args section)",
}


def _base_is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_vars_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"
            and bool(node.args) and not _base_is_self(node.args[0]))


class _Scan(ast.NodeVisitor):
    """Collects (qualname of the enclosing function, line, source) of every write that may patch another object."""

    def __init__(self, source: str):
        self.source, self.stack, self.found = source, [], []

    def _hit(self, node: ast.AST) -> None:
        where = ".".join(self.stack) or "<module>"
        self.found.append((where, node.lineno, ast.get_source_segment(self.source, node) or ""))

    def _scoped(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _targets(self, targets) -> None:
        for t in targets:  # what is written, not the expressions inside it (an index reads)
            if isinstance(t, (ast.Tuple, ast.List)):
                self._targets(t.elts)
            elif isinstance(t, ast.Starred):
                self._targets([t.value])
            elif isinstance(t, ast.Attribute) and t.attr in PATCHABLE and not _base_is_self(t.value):
                self._hit(t)
            elif isinstance(t, ast.Subscript) and (_is_vars_call(t.value) or (
                    isinstance(t.value, ast.Attribute) and t.value.attr in MODULE_STORES
                    and not _base_is_self(t.value.value))):
                self._hit(t)

    def visit_Assign(self, node):
        self._targets(node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._targets([node.target])
        self.generic_visit(node)

    def visit_Delete(self, node):
        self._targets(node.targets)
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("setattr", "delattr") and node.args and not _base_is_self(node.args[0]):
            self._hit(node)
        elif (isinstance(f, ast.Attribute) and f.attr in ("__setattr__", "__delattr__") and isinstance(f.value, ast.Name)
              and f.value.id == "object" and node.args and not _base_is_self(node.args[0])):
            self._hit(node)
        elif isinstance(f, ast.Attribute) and f.attr in ("pop", "update", "setdefault", "clear") and _is_vars_call(f.value):
            self._hit(node)
        elif isinstance(f, ast.Attribute) and f.attr in HOOK_CALLS:
            self._hit(node)
        self.generic_visit(node)


def writes_to_other_objects() -> list[tuple[str, str, int, str]]:
    """(module path, function, line, source) of every such write in the package, outside the listing module."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == LISTING:
            continue
        source = path.read_text()
        scan = _Scan(source)
        scan.visit(ast.parse(source, rel))
        out += [(rel, where, line, text) for where, line, text in scan.found]
    return out


def listed_functions() -> set[str]:
    return {site.split(":", 1)[1] for patch in USER_PATCHES for site in patch.sites}


def test_every_write_to_another_objects_attributes_is_listed():
    listed = listed_functions() | set(OURS)
    unlisted = [f"{path}:{line} in {where}: {text}" for path, where, line, text in writes_to_other_objects()
                if where not in listed]
    assert unlisted == [], "list each in user_patches.USER_PATCHES (what, where, what undoes it, why):\n" + "\n".join(unlisted)


def test_every_listed_site_makes_such_a_write_or_undoes_one():
    found = {where for _, where, _, _ in writes_to_other_objects()}
    by_function = {site.split(":", 1)[1]: site for patch in USER_PATCHES for site in patch.sites}
    # Sites whose change the scan cannot see: made through user_patches' functions, into a hooks dict,
    # or on process-wide settings.
    through_listing = {"StepRouting.install", "StepRouting.close", "join_before_reads", "restore", "gate_data_draws",
                       "ungate", "patch_forward", "unpatch", "PlainCopy.__call__", "BlockRelay.install", "BlockRelay.remove",
                       "install_grouped_experts", "GroupedExpertsForward.remove", "HookGuard.wrap_new",
                       "HookGuard.unwrap", "Fp16Accumulation.__init__", "Fp16Accumulation.release",
                       "_StrictLimit.__call__", "RoundPipeStrategy.set_world_ranks"}
    stale = [site for name, site in by_function.items() if name not in found and name not in through_listing]
    assert stale == [], f"listed sites that change nothing any more (remove or correct them): {stale}"
    assert set(OURS) <= found, f"OURS names functions that write nothing any more: {set(OURS) - found}"
    for path in {site.split(":", 1)[0] for site in by_function.values()}:
        assert (PACKAGE / path).is_file(), f"user_patches lists {path}, which does not exist"


def test_every_entry_says_what_undoes_it_and_why():
    for patch in USER_PATCHES:
        assert patch.what and patch.sites and patch.undone and len(patch.why) > 20, patch


class _Scheduled(SeqModule):
    """SGD with a StepLR: the scheduler wraps ``optimizer.step`` before the strategy routes it."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # sets its own step wrapper on opt
        self.before = {"optimizer": opt, "own": {k: vars(opt)[k] for k in ("step", "zero_grad") if k in vars(opt)}}
        return {"optimizer": opt, "lr_scheduler": sched}


class _SeenDuringFit(L.Callback):
    def __init__(self, loader):
        self.loader, self.seen = loader, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = vars(pl_module.before["optimizer"]).get("step")
        self.seen = {"forward": "forward" in vars(pl_module.net), "reads": "state_dict" in vars(pl_module),
                     "step": type(getattr(step, "__self__", None)).__name__, "loader": type(self.loader) is not DataLoader}


def _shadowed_methods(module: nn.Module) -> dict:
    """Instance attributes that shadow a method of their module's class (what a patch of a method adds)."""
    return {(name, k): v for name, m in module.named_modules() for k, v in vars(m).items()
            if callable(getattr(type(m), k, None))}


@pytest.mark.timeout(60)
def test_a_fit_leaves_no_patch_behind():
    module = _Scheduled()
    net_attrs = set(vars(module.net))
    assert _shadowed_methods(module) == {}
    loader = DataLoader(make_data(), batch_size=8)
    seen = _SeenDuringFit(loader)
    trainer = L.Trainer(strategy=RoundPipeStrategy(microbatches=2, overlap_optimizer=True), accelerator="cpu",
                        devices=2, max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[seen])
    trainer.fit(module, loader)
    # while fitting: the module's forward, its weight reads, the optimizer's step and the loader's class were patched
    assert seen.seen == {"forward": True, "reads": True, "step": "StepRouting", "loader": True}, seen.seen
    opt, own = module.before["optimizer"], module.before["own"]
    assert set(vars(module.net)) == net_attrs and _shadowed_methods(module) == {}
    assert {k: vars(opt).get(k) for k in ("step", "zero_grad") if k in vars(opt)} == own  # the scheduler's wrapper back
    assert getattr(vars(opt)["step"], "_wrapped_by_lr_sched", False)
    assert type(loader) is DataLoader


@pytest.mark.timeout(60)
def test_an_lr_scheduler_made_after_routing_keeps_the_routed_step():
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    runtime = RoundPipeRuntime.attach(net, "cpu", 2, RuntimeOptions(microbatches=2, step_metrics=False))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    try:
        ov = runtime.overlap_optimizer(opt)
        routed = vars(opt)["step"]
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        assert vars(opt)["step"] is routed  # the marker told the scheduler the step still sets _opt_called
        before = net[0].weight.detach().clone()
        net(torch.randn(4, 4)).sum().backward()
        opt.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step()
        assert not [w for w in caught if "optimizer.step()" in str(w.message)]  # _opt_called was set by the step
        runtime.join()
        assert not torch.equal(net[0].weight, before) and ov.skipped_steps == 0
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    finally:
        runtime.detach()
    assert "step" not in vars(opt) and "zero_grad" not in vars(opt) and "forward" not in vars(net)
