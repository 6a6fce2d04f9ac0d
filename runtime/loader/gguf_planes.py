"""Which block planes each module of a Llama-family model serves from a GGUF file's Q4_0 /
Q4_1 / Q8_0 tensors: q/k/v and gate/up fused, embedding and head as stored."""

from __future__ import annotations

from runtime.loader.gguf_loader import GGUFCheckpoint
from runtime.quant.blocks import BlockPlanes, cat_planes

# fused module -> its checkpoint shards, in order
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
          "mlp.down_proj": ("mlp.down_proj",)}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def stored_planes(config: object, checkpoint: GGUFCheckpoint
                  ) -> tuple[dict[str, BlockPlanes], frozenset[str]]:
    """Module name -> the block planes it serves (fused q/k/v and gate/up stacked; no
    `lm_head` entry when it is tied to the embedding), and the checkpoint tensors they cover."""
    blocks = dict(checkpoint.block_tensors())
    planes: dict[str, BlockPlanes] = {}
    used: set[str] = set()
    for i in range(config.num_hidden_layers):  # type: ignore[attr-defined]
        layer = f"model.layers.{i}"
        for fused, shards in _FUSED.items():
            names = [f"{layer}.{s}.weight" for s in shards]
            parts = [blocks.get(n) for n in names]
            if any(p is None for p in parts) or len({(p.kind, p.in_features)
                                                     for p in parts if p}) != 1:
                continue  # loads dequantized (nn.Linear) like any other tensor
            planes[f"{layer}.{fused}"] = cat_planes([p for p in parts if p is not None])
            used.update(names)
    if EMBED in blocks:
        planes["model.embed_tokens"] = blocks[EMBED]
        used.add(EMBED)
    if HEAD in blocks and not config.tie_word_embeddings:  # type: ignore[attr-defined]
        planes["lm_head"] = blocks[HEAD]
        used.add(HEAD)
    return planes, frozenset(used)
