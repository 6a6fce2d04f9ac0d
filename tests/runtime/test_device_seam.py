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


def test_no_quantized_linear_module_mentions_a_device_type():
    """runtime/quant/ asks the op library which kernels a device has (`has_device_kernel`) and
    calls the ops; the fp8 dequantize and torch's int4pack matmul are ops with CPU kernels."""
    quant = MODELS.parent / "quant"
    hits = [f"{path.name}:{n}: {line.strip()}"
            for path in sorted(quant.rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if DEVICE_WORDS.search(line)]
    assert not hits, "device decisions in runtime/quant:\n" + "\n".join(hits)
