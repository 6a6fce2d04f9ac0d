"""The device seam: model code never knows which device it runs on. Kernels are picked by the
`tessera` ops' dispatch (kernels/ops.py) and by the attention backend (runtime/attention/),
so no module under runtime/models/ names a device type or asks a tensor for one."""

from __future__ import annotations

import re
from pathlib import Path

MODELS = Path(__file__).resolve().parents[2] / "runtime" / "models"
DEVICE_WORDS = re.compile(r"""\.device\.type|\bis_cuda\b|\bis_cpu\b|["'](cpu|cuda|mps|xpu)["']"""
                          r"""|torch\.cuda|native\(\)""")


def test_no_model_module_mentions_a_device_type():
    hits = [f"{path.relative_to(MODELS)}:{n}: {line.strip()}"
            for path in sorted(MODELS.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if DEVICE_WORDS.search(line)]
    assert not hits, "device decisions in model code:\n" + "\n".join(hits)


def test_the_pattern_catches_what_it_is_for():
    for line in ('if x.device.type != "cpu":', "if w.is_cuda:", 'torch.device("cuda")',
                 "torch.cuda.synchronize()", "native() is None"):
        assert DEVICE_WORDS.search(line), line
    assert not DEVICE_WORDS.search("x = self.embed_tokens(input_ids)")


RUNTIME = MODELS.parent
# Where a device may be decided freely: attention backends, the checkpoint loaders (which
# layout a device's kernels read), and the platform classes themselves (counted as one).
FREE = ("attention", "loader")
PLATFORM = "platform.py"
MAX_DECISIONS = 3
DECISION = re.compile(r"""\bdevice\.type\b|\bis_cuda\b|\bis_cpu\b|torch\.cuda\.|native\(\)"""
                      r"""|[=!]=\s*["'](cpu|cuda|mps|xpu)["']|["'](nccl|gloo)["']""")


def device_decisions(root: Path = RUNTIME) -> list[str]:
    """Each line of `root` that decides something by device, as "path:line: text", outside
    FREE; the platform module's lines as one entry."""
    hits, platform = [], False
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in FREE:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not DECISION.search(line):
                continue
            if rel.as_posix() == PLATFORM:
                platform = True
            else:
                hits.append(f"{rel}:{n}: {line.strip()}")
    return ([f"{PLATFORM}: the platform classes (dtype, threads, KV zeros, distributed backend)"]
            if platform else []) + hits


def test_at_most_three_device_decisions_remain_in_runtime():
    # today: the platform classes alone (runtime/quant/ asks the op library instead)
    found = device_decisions()
    assert len(found) <= MAX_DECISIONS, (f"{len(found)} device decisions in runtime/ outside "
                                         f"{', '.join(FREE)}:\n" + "\n".join(found))
    assert found[0].startswith(PLATFORM), found


def test_the_decision_pattern_catches_planted_examples(tmp_path):
    planted = ['dtype = torch.bfloat16 if device.type == "cuda" else torch.float32',
               'if self.weight.device.type == "cpu":', "if w.is_cuda:", "if x.is_cpu:",
               'backend = "nccl" if torch.cuda.is_available() else "gloo"',
               'if device == "cuda":', "if native() is None:"]
    innocent = ['choices=("auto", "cpu", "torch")', "x = x.to(self.device)",
                'device: str = "auto"']
    (tmp_path / "platform.py").write_text('kind = "cpu"\nif x.device.type == "cuda": pass\n')
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "cpu.py").write_text(planted[1] + "\n")
    (tmp_path / "engine.py").write_text("\n".join(planted + innocent) + "\n")
    found = device_decisions(tmp_path)
    assert found[0].startswith(PLATFORM)
    assert [f.split(": ", 1)[1] for f in found[1:]] == planted


def test_no_quantized_linear_module_mentions_a_device_type():
    """runtime/quant/ asks the op library which kernels a device has (`has_device_kernel`) and
    calls the ops; the fp8 dequantize and torch's int4pack matmul are ops with CPU kernels."""
    quant = MODELS.parent / "quant"
    hits = [f"{path.name}:{n}: {line.strip()}"
            for path in sorted(quant.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if DEVICE_WORDS.search(line)]
    assert not hits, "device decisions in runtime/quant:\n" + "\n".join(hits)
