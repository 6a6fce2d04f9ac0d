"""Where 1-byte KV error comes from, per layer and per channel, on real activations.

    python3 -m ops.bench.fp8_kv_error --text FILE --windows 4

Runs windows of the default model (float32, fp32 KV) and, at every layer, compares causal
attention over the exact K/V with attention over K/V as a 1-byte page format gives them back
(per token and head, a bf16 scale), one layer at a time so errors do not compound:
- `fp8plain`: e4m3, unrotated and unsmoothed (the format before issue 17);
- `fp8`: e4m3 as served: smoothed (key shift, key and value channel scales calibrated as the
  engine calibrates them, `runtime/kv/smoothing.py`) and Hadamard-rotated;
- `int8`: symmetric int8 (`kernels/int8.py`) as served, the same smoothing and rotation;
- `int8plain`: int8, unrotated and unsmoothed (K and V together only).
Reports per layer the relative error of the attention output with K and V quantized (`_kv`), K
only (`_k`), V only (`_v`), and, for the served formats, the key channels (in the model's own
basis) that carry most of the score error sum over (q_i (k_i - k^_i))^2.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from kernels.hadamard import fwht
from kernels.int8 import dequantize_kv, quantize_kv

STORAGE = {"fp8": torch.uint8, "int8": torch.int8}


def fake_kv(x: torch.Tensor, fmt: str, rotated: bool, shift: torch.Tensor | None = None,
            divisor: torch.Tensor | None = None) -> torch.Tensor:
    """x: [tokens, heads, dim] -> what `fmt` pages give back, in the model's basis: stored as
    rotate((x - shift) / divisor), read back, rotated back and the smoothing undone. (A key's
    shift only moves every score of a query by q.shift, which softmax ignores, so adding it back
    gives attention exactly what the served kernels compute.)"""
    y = x if shift is None else x - shift
    y = y if divisor is None else y / divisor
    y = fwht(y) if rotated else y
    y = dequantize_kv(*quantize_kv(y, STORAGE[fmt]))
    y = fwht(y) if rotated else y
    y = y if divisor is None else y * divisor
    return y if shift is None else y + shift


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [T, heads, dim]; k, v: [T, kv_heads, dim] -> [heads, T, dim], causal
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _channel_energy(q: torch.Tensor, k: torch.Tensor, kq: torch.Tensor) -> torch.Tensor:
    """sum over query t, key s <= t, heads of (q_ti (k - k^)_si)^2, per channel i: [dim]."""
    group = q.shape[1] // k.shape[1]
    dk = (k - kq).repeat_interleave(group, dim=1)  # [T, heads, dim]
    causal = torch.ones(q.shape[0], q.shape[0]).tril()
    return torch.einsum("ts,thi,shi->i", causal, q.square(), dk.square())


def layer_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 smooth: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """One layer's window: relative attention-output errors per format and the served formats'
    per-channel score error energy [dim]. smooth: this layer's (shift, key scale, value scale),
    [kv_heads, dim] each."""
    exact = _attention(q, k, v)
    shift, k_div, v_div = smooth
    variants = {"fp8plain": ("fp8", False, None, None, None),
                "fp8": ("fp8", True, shift, k_div, v_div),
                "int8": ("int8", True, shift, k_div, v_div)}
    out: dict[str, Any] = {}
    for name, (fmt, rotated, sh, kd, vd) in variants.items():
        kq = fake_kv(k, fmt, rotated, sh, kd)
        vq = fake_kv(v, fmt, rotated, None, vd)
        out[f"{name}_kv"] = _rel(_attention(q, kq, vq), exact)
        out[f"{name}_k"] = _rel(_attention(q, kq, v), exact)
        out[f"{name}_v"] = _rel(_attention(q, k, vq), exact)
        if name != "fp8plain":
            out[f"{name}_energy"] = _channel_energy(q, k, kq)
    out["int8plain_kv"] = _rel(_attention(q, fake_kv(k, "int8", False),
                                          fake_kv(v, "int8", False)), exact)
    return out


def _top_channels(energy: torch.Tensor) -> str:
    share = energy / energy.sum()
    top = share.topk(3)
    pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
    return ", ".join(f"{i} ({s:.0%})" for s, i in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", required=True)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    args = ap.parse_args()
    from ops.eval.compare import tokenize
    from ops.eval.text import load_text, make_windows
    from runtime import LLM
    from runtime.kv import smoothing
    from runtime.models.layers import PagedAttention

    llm = LLM(enable_prefix_caching=False)
    engine, config = llm.engine, llm.engine.model_config
    # the smoothing an fp8 or int8 engine of this model calibrates at start (same windows)
    calibrated = smoothing.calibrate_key_smoothing(
        engine.prefill_model, config.num_hidden_layers, config.num_key_value_heads,
        config.head_dim, smoothing.calibration_windows(
            lambda text: engine.tokenizer.encode(text, add_special_tokens=False)),
        engine.device)
    text, _ = load_text(args.text)
    windows = make_windows(tokenize(llm, llm, text), args.window, args.windows)
    stats: dict[int, list[dict[str, Any]]] = {}
    forward = PagedAttention.forward

    def probe(self: PagedAttention, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> torch.Tensor:
        layer = self.layer_index
        smooth = tuple(t[layer].cpu() for t in calibrated)
        stats.setdefault(layer, []).append(layer_errors(q, k, v, smooth))  # type: ignore[arg-type]
        return forward(self, q, k, v)

    PagedAttention.forward = probe  # type: ignore[method-assign]
    try:
        with torch.inference_mode():
            for ids in windows:
                llm.prompt_logits(ids)
    finally:
        PagedAttention.forward = forward  # type: ignore[method-assign]
    keys = ("fp8plain_kv", "fp8_kv", "fp8_k", "fp8_v", "int8_kv", "int8_k", "int8_v",
            "int8plain_kv")
    print("| layer | " + " | ".join(keys) + " | fp8: top key channels (share of score error) "
          "| int8: top key channels |")
    print("|---" * (len(keys) + 3) + "|")
    totals = {key: 0.0 for key in keys}
    for layer in sorted(stats):
        rows = stats[layer]
        means = [sum(r[key] for r in rows) / len(rows) for key in keys]
        for key, m in zip(keys, means, strict=True):
            totals[key] += m / len(stats)
        channels = [_top_channels(sum(r[f"{f}_energy"] for r in rows)) for f in ("fp8", "int8")]
        print(f"| {layer} | " + " | ".join(f"{m:.4f}" for m in means)
              + f" | {channels[0]} | {channels[1]} |")
    print("| mean | " + " | ".join(f"{totals[k]:.4f}" for k in keys) + " | | |")


if __name__ == "__main__":
    main()
