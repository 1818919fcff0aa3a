"""QLoRA through the pipeline (issue 44, item 1): 4-bit base weights uploaded packed, on the CPU
backend and on the fake CUDA driver with its residency check (a tensor the upload forgot fails
there as on a GPU), against Lightning's default strategy.

Bounds are multiples of each model's own summation-order floor (``python -m tests._qlora_models``,
the default strategy against itself, one batch of 6 against 3 accumulated batches of 2, 3 steps;
2-core AMD EPYC, torch 2.13, bitsandbytes 0.50.2, torchao 0.18.0):

    bitsandbytes llama  SGD 2.68e-05  AdamW 4.93e-06
    bitsandbytes qwen3  SGD 1.47e-05  AdamW 9.41e-06
    torchao NF4         SGD 1.25e-06  AdamW 9.66e-06
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _models import weight_error
from _qlora_models import QLoraLM, bnb_qlora_model, fit, floor, nf4_model, trainable
from lightning_roundpipe import RoundPipeStrategy
from roundpipe_lab.fake_cuda import pool as cuda_backend

FLOORS = {("llama", "sgd"): 2.68e-5, ("llama", "adamw"): 4.93e-6, ("qwen3", "sgd"): 1.47e-5,
          ("qwen3", "adamw"): 9.41e-6, ("nf4", "sgd"): 1.25e-6, ("nf4", "adamw"): 9.66e-6}
FLOOR_MULTIPLE = 10  # as tests/_noise_floor.py: two independent fp32 orders differ by up to ~6 floors
GRAINS = {"stage": "always", "layer": "layer"}  # recompute="layer": backward one layer at a time
TWO_STAGES = {"policy": "uniform", "forward_stages": 2, "backward_stages": 2}


@pytest.fixture
def fake_cuda(monkeypatch):
    """Lightning's run on the ``fake_cuda`` backend with the residency check; yields the pools made."""
    pools = []
    real_options, real_create = cuda_backend.FakeCudaWorkerPool.options_from, cuda_backend.FakeCudaWorkerPool.create

    def create(cls, *args, **kwargs):
        pools.append(real_create.__func__(cls, *args, **kwargs))
        return pools[-1]

    monkeypatch.setattr(RoundPipeStrategy, "_backend", lambda self: ("fake_cuda", None))
    monkeypatch.setattr(cuda_backend.FakeCudaWorkerPool, "options_from",
                        classmethod(lambda cls, o: dict(real_options.__func__(cls, o), check_residency=True)))
    monkeypatch.setattr(cuda_backend.FakeCudaWorkerPool, "create", classmethod(create))
    real_pin = cuda_backend.FakeCudaWorkerPool.pin_uploads

    def pin_uploads(self, policy, tensors):  # what the runtime pinned (unpinned again at shutdown)
        self.pinned_for_uploads = real_pin(self, policy, tensors)
        return self.pinned_for_uploads

    monkeypatch.setattr(cuda_backend.FakeCudaWorkerPool, "pin_uploads", pin_uploads)
    return pools


def packed_state(model) -> dict[str, torch.Tensor]:
    """Copies of every packed base tensor: bitsandbytes' bytes and each quant_state tensor (nested too),
    torchao's inner tensors."""
    from lightning_roundpipe.params.packed import packed_weight, is_plain

    out = {}
    for name, p in model.named_parameters():
        if not is_plain(p):
            for i, part in enumerate(packed_weight(p, name).host_parts()):
                out[f"{name}#{i}"] = part.clone()
    assert out, "the model has no packed weight"
    return out


_REFERENCES: dict = {}


def reference(key, make, opt):
    """The default strategy's trained adapters (and initial ones), once per model and optimizer."""
    if (key, opt) not in _REFERENCES:
        module = QLoraLM(make(), opt)
        w0 = trainable(module.model)
        fit(module)
        _REFERENCES[(key, opt)] = (w0, trainable(module.model))
    return _REFERENCES[(key, opt)]


def pipelined(make, opt, grain, pools=None):
    """The adapters after a RoundPipe fit (2 workers, 3 microbatches, two stages each way); checks that the
    packed base is bit-unchanged and, on the fake driver, that the residency check looked at operators."""
    module = QLoraLM(make(), opt)
    base = packed_state(module.model)
    fit(module, RoundPipeStrategy(microbatches=3, recompute=GRAINS[grain], partition=TWO_STAGES), devices=2)
    after = packed_state(module.model)
    assert all(torch.equal(base[k], after[k]) for k in base)
    if pools is not None:  # the check looked at every operator, and every weight upload read pinned memory
        assert pools and all(p.residency is not None and p.residency.checked_ops > 0 for p in pools)
        assert all(p.pageable_upload_bytes == 0 and p.pinned_for_uploads > 0 for p in pools)
    return trainable(module.model)


def check_parity(key, make, opt, grain, pools=None):
    w0, ref = reference(key, make, opt)
    got = pipelined(make, opt, grain, pools)
    assert got.keys() == ref.keys() and len(got) > 0
    err = weight_error(got, ref, w0)
    print(f"parity {key} {opt} {grain} {'fake_cuda' if pools is not None else 'cpu'}: {err:.3g} "
          f"= {err / FLOORS[(key, opt)]:.2f} floors")
    assert err <= FLOOR_MULTIPLE * FLOORS[(key, opt)], (err, FLOORS[(key, opt)])


ALL_BNB = [(a, o, g) for a in ("llama", "qwen3") for o in ("sgd", "adamw") for g in GRAINS]


def cases(fast: list[tuple], every: list[tuple]) -> list:
    """``every`` case, those not in ``fast`` marked slow (the default run shares one reference fit)."""
    return [c if c in fast else pytest.param(*c, marks=pytest.mark.slow) for c in every]


@pytest.mark.timeout(120)
# The fake driver's cases (below, with the residency check) run by default; these CPU-backend ones are slow, for CI's time.
@pytest.mark.parametrize("arch,opt,grain", cases([], ALL_BNB))
def test_bitsandbytes_qlora_matches_default_strategy_on_cpu_workers(arch, opt, grain, tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / f"qlora-{arch}"
    check_parity(arch, lambda: bnb_qlora_model(arch, path), opt, grain)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch,opt,grain", cases([("llama", "adamw", "layer")], ALL_BNB))
def test_bitsandbytes_qlora_matches_default_strategy_on_fake_cuda(arch, opt, grain, tmp_path_factory, fake_cuda):
    path = tmp_path_factory.getbasetemp() / f"qlora-{arch}"
    check_parity(arch, lambda: bnb_qlora_model(arch, path), opt, grain, fake_cuda)


@pytest.mark.slow  # a floor and two fits with the HF stack: ~15-30 s
@pytest.mark.timeout(180)
def test_dora_on_a_4bit_base_matches_default_strategy_on_fake_cuda(tmp_path_factory, fake_cuda):
    """DoRA over bitsandbytes' 4-bit base (peft dequantizes the weight for its norm inside forward): the
    rebuilt ``Params4bit`` and its uploaded ``quant_state`` serve that path too; the floor is measured here."""
    path = tmp_path_factory.getbasetemp() / "qlora-llama"
    make = lambda: bnb_qlora_model("llama", path, dora=True)  # noqa: E731
    noise = floor(make, "sgd")
    w0, ref = reference("llama-dora", make, "sgd")
    got = pipelined(make, "sgd", "stage", fake_cuda)
    assert got.keys() == ref.keys() and any("magnitude" in k for k in got)
    err = weight_error(got, ref, w0)
    print(f"parity llama DoRA sgd stage fake_cuda: {err:.3g} = {err / noise:.2f} floors (floor {noise:.3g})")
    assert err <= FLOOR_MULTIPLE * noise, (err, noise)


ALL_NF4 = [(o, g) for o in ("sgd", "adamw") for g in GRAINS]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt,grain", cases([], ALL_NF4))
def test_torchao_nf4_matches_default_strategy_on_cpu_workers(opt, grain):
    check_parity("nf4", nf4_model, opt, grain)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt,grain", cases([("sgd", "layer")], ALL_NF4))
def test_torchao_nf4_matches_default_strategy_on_fake_cuda(opt, grain, fake_cuda):
    check_parity("nf4", nf4_model, opt, grain, fake_cuda)


@pytest.mark.slow  # three fits in bf16: ~20 s
@pytest.mark.timeout(180)
def test_bf16_compute_under_bf16_mixed_matches_default_strategy(tmp_path):
    """bitsandbytes computing in bf16 under ``bf16-mixed``: the floor is bf16's (measured here, as the CPU's
    bf16 kernels vary: 0.246 on the 2-core AMD EPYC, llama AdamW), and the pipeline, which sums its 3
    microbatches as the split run does, measured 1.0002 floors; bound 2 floors."""
    from _qlora_models import floor

    make = lambda: bnb_qlora_model("llama", tmp_path, compute_dtype=torch.bfloat16)  # noqa: E731
    bf16_floor = floor(make, "adamw", precision="bf16-mixed")
    ref = QLoraLM(make(), "adamw")
    w0 = trainable(ref.model)
    fit(ref, precision="bf16-mixed")
    module = QLoraLM(make(), "adamw")
    base = packed_state(module.model)
    fit(module, RoundPipeStrategy(microbatches=3, partition=TWO_STAGES), devices=2, precision="bf16-mixed")
    assert all(torch.equal(base[k], v) for k, v in packed_state(module.model).items())
    assert weight_error(trainable(module.model), trainable(ref.model), w0) <= 2 * bf16_floor


# ------------------------------------------------------------------ what travels, and what is refused
def attached(model, backend="fake_cuda", **options):
    """``model`` pipelined on 2 workers of ``backend`` (3 microbatches, two stages each way)."""
    from lightning_roundpipe import RoundPipeRuntime, RuntimeOptions

    return RoundPipeRuntime.attach(model, backend, 2, RuntimeOptions(microbatches=3, partition=TWO_STAGES, **options))


def one_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


@pytest.mark.timeout(120)
def test_a_forgotten_quant_state_fails_on_fake_cuda_with_the_residency_check(tmp_path, fake_cuda, monkeypatch):
    """The upload as it was before packed weights: the 4-bit bytes only, the rebuilt weight reading the
    host's quant_state. CPU workers read it in place; the fake driver's check fails it as CUDA would."""
    from lightning_roundpipe.params.packed import Params4bitWeight
    from lightning_roundpipe.workers.completions import WorkerError

    monkeypatch.setattr(Params4bitWeight, "host_parts", lambda self: [self.tensor.detach().as_subclass(torch.Tensor)])
    monkeypatch.setattr(Params4bitWeight, "rebuild", lambda self, parts: type(self.tensor)(
        data=parts[0], quant_state=self.tensor.quant_state, blocksize=self.tensor.blocksize,
        compress_statistics=True, quant_type="nf4", bnb_quantized=True))
    ids = torch.randint(0, 96, (6, 10), generator=torch.Generator().manual_seed(3))
    model = bnb_qlora_model("llama", tmp_path)
    rt = attached(model, "cpu")
    try:
        one_step(model, ids)  # the defect hides on CPU workers
    finally:
        rt.detach()
    model = bnb_qlora_model("llama", tmp_path)
    rt = attached(model)  # fake_cuda, the check on (the fixture)
    try:
        with pytest.raises(WorkerError, match=r"residency check: bitsandbytes\.\w+\.default read a host tensor .* "
                                              r"beside worker tensors"):
            one_step(model, ids)
    finally:
        rt.detach()


@pytest.mark.timeout(60)
def test_unknown_tensor_subclass_and_trainable_packed_weight_are_refused_before_any_weight_moves():
    from lightning_roundpipe.params.packed import UnsupportedWeightError

    class Tagged(torch.Tensor):  # a subclass with state beside its data, which a plain copy would drop
        pass

    model = nf4_model(width=128, depth=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" in n}
    model[1].up.weight.requires_grad_(True)
    with pytest.raises(UnsupportedWeightError, match=r"up\.weight is a packed NF4Tensor weight that requires grad: "
                                                     r".*Freeze it \(weight\.requires_grad_\(False\)"):
        attached(model, "cpu")
    model[1].up.weight.requires_grad_(False)
    model[2].norm.weight = nn.Parameter(model[2].norm.weight.detach().as_subclass(Tagged))
    with pytest.raises(UnsupportedWeightError, match=r"norm\.weight is a .*Tagged, a tensor subclass the stage upload "
                                                     r"does not know: .*Convert it to a plain tensor"):
        attached(model, "cpu")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora" in n)
    assert "forward" not in vars(model)  # not pipelined: the module is as it was
    model[2].norm.weight = nn.Parameter(model[2].norm.weight.detach().as_subclass(torch.Tensor))
    attached(model, "cpu").detach()  # with the tensors put right it is accepted


def four_bit_parts(t) -> list[torch.Tensor]:
    """A bitsandbytes 4-bit weight's tensors, named here from bitsandbytes' own objects: the 4-bit bytes,
    the block scales (themselves quantized: double quantization), the code, the offset, the nested state's
    scales and code."""
    state = t.quant_state
    return [t, state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]


def upload_bytes(layer) -> int:
    """Bytes of ``layer``'s unique parameters and buffers as the upload should move them."""
    unique = {id(t): t for t in [*layer.parameters(), *layer.buffers()]}.values()
    return sum(p.numel() * p.element_size() for t in unique
               for p in (four_bit_parts(t) if hasattr(t, "quant_state") else [t]))


@pytest.mark.timeout(120)
def test_only_packed_bytes_are_uploaded(tmp_path, fake_cuda):
    """Each stage's weight uploads move exactly its 4-bit bytes, their quantization state and the plain
    tensors (adapters, norms, embedding, head); the 4-bit weights' bytes are >= 3.5x less than in bf16."""
    from lightning_roundpipe.params.weights import StageWeights

    model = bnb_qlora_model("llama", tmp_path, hidden=256)
    moved: dict[int, list] = {}  # per StageWeights: [its layers, bytes that landed on the worker]
    real_store = StageWeights.store_chunk

    def store_chunk(self, chunk, device_tensors):
        entry = moved.setdefault(id(self), [self.layer_ids, 0])
        entry[1] += sum(t.numel() * t.element_size() for t in device_tensors)
        return real_store(self, chunk, device_tensors)

    rt = attached(model)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(StageWeights, "store_chunk", store_chunk)
            one_step(model, torch.randint(0, 96, (6, 10), generator=torch.Generator().manual_seed(3)))
        layers, plan = rt.engine.layers, rt.engine.plan
    finally:
        rt.detach()
    forward = [s.layers for s in plan.forward_stages()]
    # F0, F1, B0: the last forward stage is fused (its layers' backward runs there, with the loss)
    stages = forward + [s.layers for s in plan.backward_stages() if s.layers != forward[-1]]
    expected = sorted((ids.start, ids.stop, sum(upload_bytes(layers[l]) for l in ids)) for ids in stages)
    assert sorted((ids.start, ids.stop, n) for ids, n in moved.values()) == expected
    assert fake_cuda[0].driver.to_device_bytes > sum(n for *_, n in expected)  # the activations besides
    # pinned: exactly the parameters' upload bytes (4-bit parts included), once each; no upload was pageable
    params = {id(p): p for layer in layers for p in layer.parameters()}.values()
    assert fake_cuda[0].pinned_for_uploads == sum(x.numel() * x.element_size() for p in params
                                            for x in (four_bit_parts(p) if hasattr(p, "quant_state") else [p]))
    assert fake_cuda[0].pageable_upload_bytes == 0
    four_bit = [p for p in model.parameters() if hasattr(p, "quant_state")]
    packed = sum(x.numel() * x.element_size() for p in four_bit for x in four_bit_parts(p))
    bf16 = sum(p.quant_state.shape.numel() * 2 for p in four_bit)
    assert len(four_bit) == 2 * 7 and bf16 / packed >= 3.5, (bf16, packed)


@pytest.mark.timeout(120)
def test_adapter_saved_after_a_pipelined_qlora_fit_reloads_into_a_plain_peft_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    module = QLoraLM(bnb_qlora_model("qwen3", tmp_path / "base"), "adamw")
    fit(module, RoundPipeStrategy(microbatches=3, partition=TWO_STAGES), devices=2)
    module.model.save_pretrained(tmp_path / "adapter")

    def plain(adapter=None):
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant, dtype=torch.float32)
        return PeftModel.from_pretrained(base, tmp_path / "adapter").eval() if adapter else base.eval()

    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        trained = module.model.eval()(input_ids=ids).logits
        assert torch.equal(plain(adapter=True)(input_ids=ids).logits, trained)
        assert not torch.allclose(plain()(input_ids=ids).logits, trained, atol=1e-3)  # the adapters moved it


@pytest.mark.timeout(60)
def test_eval_mode_4bit_layers_are_refused_for_training_on_cpu_workers(tmp_path):
    """bitsandbytes repacks an eval-mode Linear4bit called without grad on CPU for its bf16 inference kernel
    (AVX512-BF16 CPUs): forward stages would compute what Lightning's run (with grad) does not (measured:
    weight error 2.58 of the update after 3 SGD steps, llama). Refused before any weight moves."""
    from lightning_roundpipe.options import OptionError

    model = bnb_qlora_model("llama", tmp_path).eval()
    for m in model.modules():  # as on an AVX512-BF16 CPU, whatever this machine has
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = True
    before = packed_state(model)
    lora = trainable(model)
    ids = torch.randint(0, 96, (6, 10), generator=torch.Generator().manual_seed(3))
    rt = attached(model, "cpu")
    try:
        with pytest.raises(OptionError, match=r"bitsandbytes 4-bit layers in eval mode \(layer 1: .*q_proj.*\).* "
                                              r"Call model\.train\(\) before training"):
            one_step(model, ids)
        model.train()
        one_step(model, ids)
    finally:
        rt.detach()
    assert all(torch.equal(before[k], v) for k, v in packed_state(model).items())
    assert all(torch.equal(lora[k], p) for k, p in trainable(model).items())  # no optimizer step ran


def test_no_module_of_the_library_imports_bitsandbytes_or_torchao():
    """The fast form of the check below: no import statement of the package names either library."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src" / "lightning_roundpipe"
    found = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(src)}: {n}" for n in names if n.split(".")[0] in ("bitsandbytes", "torchao")]
    assert found == []


@pytest.mark.slow  # a fresh interpreter importing Lightning and transformers: ~20 s on the 2-core machine
@pytest.mark.timeout(120)
def test_the_library_imports_without_bitsandbytes_and_torchao():
    """Neither library is imported unless a model holds its tensors (packed.py knows them by class):
    the package and the modules that handle packed weights import where importing them fails."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    code = """
import sys
class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("bitsandbytes", "torchao"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, NotInstalled())
import lightning_roundpipe, lightning_roundpipe.runtime, lightning_roundpipe.params.packed
import roundpipe_lab.fake_cuda.residency, lightning_roundpipe.workers.cuda
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(repo / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"


def test_stage_weights_count_packed_parts_in_upload_device_and_chunk_bytes():
    """Under a bf16 compute dtype: plain tensors upload in bf16 (trainable ones held as fp32 leaves), a packed
    NF4 weight as its five inner tensors in their own dtypes, read-only, whatever the compute dtype."""
    from lightning_roundpipe.params.weights import LayerTable, StageWeights

    block = nf4_model(width=128, depth=1)[1]
    nf4 = [block.up.weight, block.down.weight]
    inner = [getattr(w, n) for w in nf4 for n in ("quantized_data", "scaler_mean", "quantization_factor",
                                                  "quantized_scalers", "nf4")]
    packed_bytes = sum(t.numel() * t.element_size() for t in inner)
    lora = [p for n, p in block.named_parameters() if "lora_" in n]
    norm = block.norm.weight
    w = StageWeights([LayerTable(block)], range(0, 1), torch.bfloat16, chunk_bytes=1, need_grads=True)
    assert w.nbytes == packed_bytes + 2 * (sum(p.numel() for p in lora) + norm.numel())
    assert w.device_nbytes == packed_bytes + 4 * sum(p.numel() for p in lora) + 2 * norm.numel()
    assert len(w.chunks) == len(w.host) == 2 + len(lora) + 1  # each tensor a chunk of its own at 1 byte
    up = next(c for c in w.chunks if w.host[c[0]] is block.up.weight)
    tensors, dtypes, read_only = w.upload_tensors(up)
    assert [t.dtype for t in tensors] == [t.dtype for t in inner[:5]] and tensors[0].dtype == torch.uint8
    assert dtypes == [None] * 5 and read_only == [True] * 5 and w.chunk_bytes(up) == packed_bytes // 2
    w.store_chunk(up, [t.clone() for t in tensors])
    x = torch.randn(3, 128)
    assert torch.equal(torch.nn.functional.linear(x, w.device[up[0]].to(torch.float32)),
                       torch.nn.functional.linear(x, block.up.weight.to(torch.float32)))
