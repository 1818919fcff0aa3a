"""Every shell command in README.md and docs/*.md runs as documented, or says why it cannot here.

A command is a line of a ```bash / ```sh / ```console / ```shell block, or a line starting with
``$ `` or ``python -m`` in any other block. Each one is classified by :func:`classify`:

- ``run``: run it, in a temporary folder, with this checkout's sources; jobs that train get
  ``trainer.max_steps=2`` appended (the override each such page shows next to its commands);
- ``figure``: its output is a committed figure block, checked by test_doc_figures.py;
- ``help`` / ``quick``: a long benchmark; its ``--help`` or ``--quick`` runs instead;
- ``skip``: cannot run here (a GPU, a download, several machines), with the reason.

A command no rule knows fails ``test_every_documented_command_is_classified``: add a rule.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
SHELL_BLOCKS = {"bash", "sh", "console", "shell"}
SHRINK = "trainer.max_steps=2"  # what the pages show next to the job commands they document
COMMAND_TIMEOUT_S = 400
FIGURE_COMMANDS = {"python -m lightning_roundpipe.plan --model qwen3-8b --hardware rtx4090"}


@dataclass(frozen=True)
class DocCommand:
    page: str  # relative to the repository root
    line: str  # as documented, continuations joined, the comment removed


@dataclass(frozen=True)
class Decision:
    kind: str  # run, figure, help, quick or skip
    argv: tuple[str, ...] = ()  # what runs (empty for figure and skip)
    reason: str = ""


def documented_commands(pages=PAGES) -> list[DocCommand]:
    found = []
    for page in pages:
        lang, block = None, None
        for raw in page.read_text().splitlines():
            fence = re.match(r"^\s*```(\w*)", raw)
            if fence:
                lang, block = (fence.group(1), []) if block is None else (None, None)
                continue
            if block is None:
                continue
            line = raw.strip()
            if line.startswith("$ "):
                line = line[2:]
            elif lang not in SHELL_BLOCKS and not line.startswith("python -m"):
                continue
            block.append(line)
            if line.endswith("\\"):
                continue
            joined = " ".join(part.rstrip("\\").strip() for part in block)
            block.clear()
            joined = re.split(r"\s+#", joined)[0].strip()
            if joined and not joined.startswith("#"):
                found.append(DocCommand(str(page.relative_to(REPO) if page.is_relative_to(REPO) else page), joined))
    return found


def job(args: list[str]) -> Decision:
    """The fine-tuning job: the 8-GPU presets need a download, a printed config runs as is,
    anything that trains is shrunk to 2 steps."""
    script = str(REPO / "examples" / "finetune.py")
    needs_weights = any(a.startswith(("model.path=/", "model=qwen3_8b", "model=llama3_1_8b")) for a in args)
    if "--cfg" in args:
        return Decision("run", ("python", script, *args))
    if needs_weights or any("8gpu" in a for a in args):
        return Decision("skip", reason="an 8-GPU preset on downloaded weights; its config runs as --cfg job")
    if any(re.search(r"=(/data/|.*<\w+>)", a) for a in args):
        return Decision("skip", reason="the reader's own data file or checkpoint path (a placeholder)")
    return Decision("run", ("python", script, *args, SHRINK))


def classify(line: str) -> Decision:
    words = shlex.split(re.sub(r"\s\[[^\]]*\]", "", line))  # [optional arguments] left out
    if line in FIGURE_COMMANDS:
        return Decision("figure", reason="its output is a figure block (test_doc_figures.py)")
    if words[:2] == ["make", "test"]:
        return Decision("skip", reason="the whole test suite, of which this test is part")
    if words[:2] == ["make", "run"]:  # make run creates .venv (test_setup_commands.py), then runs the job
        args = shlex.split(words[2][len("ARGS="):]) if len(words) > 2 and words[2].startswith("ARGS=") else []
        return job(args)
    if words[0] == "hf":
        return Decision("skip", reason="downloads weights")
    if words[0] in ("torchrun", "srun") or "train.py" in words or any(w.startswith("MASTER_ADDR=") for w in words):
        return Decision("skip", reason="several machines and the user's own train.py (tests/distributed run it on localhost)")
    if words[:2] == ["python", "examples/finetune.py"]:
        return job(words[2:])
    if words[:2] == ["python", "-m"] and words[2] in ("lightning_roundpipe.plan", "lightning_roundpipe.sim", "roundpipe_lab.sim"):
        if any(w.startswith("/models/") for w in words):  # tests/planning/test_sim_plan_inputs.py runs it on a generated one
            return Decision("skip", reason="the reader's own downloaded model directory")
        return Decision("run", tuple(words))
    if "benchmarks.validation.gpu_session" in words and "fake_cuda" not in words:
        return Decision("skip", reason="the GPU machine's run (its fake-driver twin, documented beside it, runs here)")
    if words[:2] == ["python", "-m"] and words[2].startswith("benchmarks."):
        if words[2].endswith(("own_engine_reference", "dispatch_cost", "host_accumulate_cost")):
            return Decision("help", ("python", "-m", words[2], "--help"),
                            reason="a long or machine-timing benchmark (10 s to 25 min)")
        if "--quick" in words:
            return Decision("run", tuple(words))
        return Decision("quick", (*words, "--quick"), reason="the full benchmark takes 30-80 s; its --quick runs")
    return Decision("unknown")


def run_command(decision: Decision, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "120"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH")) if p)
    argv = [sys.executable if a == "python" else a for a in decision.argv]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


COMMANDS = documented_commands()
RUNNABLE = [c for c in COMMANDS if classify(c.line).kind in ("run", "help", "quick")]


def test_the_extractor_finds_commands_in_every_kind_of_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```bash\nmake run   # set up\n# a comment\npython a.py x=1 \\\n  y=2\n```\n"
                    "```console\n$ python -m foo --bar\n```\n```python\nx = 1\n```\n```text\n$ hf download m\n"
                    "python -m roundpipe_lab.sim paper\nnot a command\n```\n")
    found = [c.line for c in documented_commands((page,))]
    assert found == ["make run", "python a.py x=1 y=2", "python -m foo --bar", "hf download m",
                     "python -m roundpipe_lab.sim paper"]


def test_every_documented_command_is_classified():
    assert len(COMMANDS) >= 30  # the README and the guide together document this many today
    unknown = [f"{c.page}: {c.line}" for c in COMMANDS if classify(c.line).kind == "unknown"]
    assert not unknown, "add a rule to classify() in test_doc_commands.py for:\n" + "\n".join(unknown)


def test_pages_show_the_override_their_job_commands_run_with():
    shrunk = {c.page for c in COMMANDS if SHRINK in classify(c.line).argv}
    assert shrunk  # the README's job commands at least
    shown = re.compile(re.escape(SHRINK) + r"(?!\d)")
    missing = sorted(page for page in shrunk if not shown.search((REPO / page).read_text()))
    assert not missing, f"these pages run job commands with {SHRINK} but do not say so: {missing}"


def test_the_classifier_shrinks_jobs_and_refuses_downloads():
    script = str(REPO / "examples" / "finetune.py")
    assert classify('make run ARGS="experiment=tiny_lora lora.r=16"') == Decision(
        "run", ("python", script, "experiment=tiny_lora", "lora.r=16", SHRINK))
    assert classify("python examples/finetune.py --cfg job experiment=qwen3_8b_lora_8gpu") == Decision(
        "run", ("python", script, "--cfg", "job", "experiment=qwen3_8b_lora_8gpu"))
    assert classify("python examples/finetune.py experiment=qwen3_8b_lora_8gpu model.path=/m").kind == "skip"
    assert classify("python examples/finetune.py data=chat_tiny data.text_path=/data/sft.jsonl").kind == "skip"
    assert classify("python examples/finetune.py ckpt_path=outputs/<date>/<time>/last.ckpt").kind == "skip"
    assert classify("python -m lightning_roundpipe.plan --model /models/Qwen3-8B --gpus 2").kind == "skip"
    assert classify("python -m benchmarks.validation.sim_validation --json x.json").argv[-1] == "--quick"
    assert classify("timeout 590 python -m benchmarks.validation.gpu_session --budget 480 --out d").kind == "skip"
    assert classify("python -m benchmarks.validation.gpu_session --device fake_cuda --quick --out d").kind == "run"
    assert classify("python -m roundpipe_lab.sim compare --model m [--microbatches 32]").argv == (
        "python", "-m", "roundpipe_lab.sim", "compare", "--model", "m")


@pytest.mark.doc_commands  # about 38 commands, most of them a 2-step job: about 20 minutes on 2 cores
@pytest.mark.timeout(COMMAND_TIMEOUT_S + 30)
@pytest.mark.parametrize("command", RUNNABLE, ids=[f"{c.page}:{c.line[:60]}" for c in RUNNABLE])
def test_documented_command_runs(command, tmp_path):
    done = run_command(classify(command.line), tmp_path)
    assert done.returncode == 0, f"{command.page}: {command.line}\n{done.stderr[-3000:]}"
    assert done.stdout.strip() or done.stderr.strip()  # it said something
