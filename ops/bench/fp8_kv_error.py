"""Where FP8 KV error comes from, per layer and per channel, on real activations.

    python3 -m ops.bench.fp8_kv_error --text FILE --windows 4

Runs windows of the default model (float32, fp32 KV) and, at every layer, compares causal
attention over the exact K/V with attention over K/V quantized as the fp8 page format stores
them (per token and head e4m3 with a bf16 scale; `plain` or Hadamard-`rotated`), one layer at a
time so errors do not compound. Reports per layer the relative error of the attention output
(K and V quantized, K only, V only) and, for plain fp8, the key channels that carry most of the
score error sum (q_i (k_i - k^_i))^2.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from kernels.fp8 import dequantize_fp8_kv, quantize_fp8_kv
from kernels.hadamard import fwht


def fake_fp8(x: torch.Tensor, rotated: bool) -> torch.Tensor:
    """x: [tokens, heads, dim] -> what fp8 pages give back (in the unrotated basis)."""
    if not rotated:
        return dequantize_fp8_kv(*quantize_fp8_kv(x))
    return fwht(dequantize_fp8_kv(*quantize_fp8_kv(fwht(x))))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q: [T, heads, dim]; k, v: [T, kv_heads, dim] -> [heads, T, dim], causal
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def layer_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """One layer's window: relative attention-output errors and plain fp8's per-channel score
    error energy [dim]."""
    exact = _attention(q, k, v)
    out: dict[str, Any] = {}
    for rotated in (False, True):
        kq, vq = fake_fp8(k, rotated), fake_fp8(v, rotated)
        name = "rotated" if rotated else "plain"
        out[f"{name}_kv"] = _rel(_attention(q, kq, vq), exact)
        out[f"{name}_k"] = _rel(_attention(q, kq, v), exact)
        out[f"{name}_v"] = _rel(_attention(q, k, vq), exact)
    group = q.shape[1] // k.shape[1]
    dk = (k - fake_fp8(k, False)).repeat_interleave(group, dim=1)  # [T, heads, dim]
    # sum over query t, key s <= t, heads of (q_ti dk_si)^2, per channel i
    causal = torch.ones(q.shape[0], q.shape[0]).tril()
    out["channel_energy"] = torch.einsum("ts,thi,shi->i", causal, q.square(), dk.square())
    return out


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
    from runtime.models.layers import PagedAttention

    llm = LLM(enable_prefix_caching=False)
    text, _ = load_text(args.text)
    windows = make_windows(tokenize(llm, llm, text), args.window, args.windows)
    stats: dict[int, list[dict[str, Any]]] = {}
    forward = PagedAttention.forward

    def probe(self: PagedAttention, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> torch.Tensor:
        stats.setdefault(self.layer_index, []).append(layer_errors(q, k, v))
        return forward(self, q, k, v)

    PagedAttention.forward = probe  # type: ignore[method-assign]
    try:
        with torch.inference_mode():
            for ids in windows:
                llm.prompt_logits(ids)
    finally:
        PagedAttention.forward = forward  # type: ignore[method-assign]
    keys = ("plain_kv", "plain_k", "plain_v", "rotated_kv", "rotated_k", "rotated_v")
    print("| layer | " + " | ".join(keys) + " | plain: top key channels (share of score error) |")
    print("|---" * (len(keys) + 2) + "|")
    for layer in sorted(stats):
        rows = stats[layer]
        means = [sum(r[key] for r in rows) / len(rows) for key in keys]
        energy = sum(r["channel_energy"] for r in rows)
        share = energy / energy.sum()
        top = share.topk(3)
        pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
        channels = ", ".join(f"{i} ({s:.0%})" for s, i in pairs)
        print(f"| {layer} | " + " | ".join(f"{m:.4f}" for m in means) + f" | {channels} |")


if __name__ == "__main__":
    main()
