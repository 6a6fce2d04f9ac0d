"""GGUF checkpoints (llama.cpp's format): metadata, tokenizer, dequantized tensors."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import torch

from runtime.config import ModelConfig
from runtime.errors import ModelLoadError
from runtime.loader.checkpoint import Checkpoint
from runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from runtime.quant.blocks import BlockPlanes

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class GGUFCheckpoint(Checkpoint):
    reader: Any
    # NOTE: the file the reader maps, held open: its fstat names what was read even after the
    # path is replaced (runtime/loader/mapped.py keys the mapped copy by it).
    source: BinaryIO

    @classmethod
    def open(cls, path: Path) -> GGUFCheckpoint:
        try:
            source, reader = _open_stable(path)
            fields = {k: _field_value(f) for k, f in reader.fields.items()}
        except ModelLoadError:
            raise
        except Exception as e:  # gguf raises ValueError/struct errors/numpy errors on bad bytes
            raise ModelLoadError(f"{path.name} is not a readable GGUF file: {e}",
                                 path=path) from e
        arch = fields.get("general.architecture")
        if arch != "llama":
            raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (only llama)",
                                 field="general.architecture")
        config = _config_from_fields(fields, reader)
        ckpt = cls(config, Tokenizer.from_gguf_fields(fields), path,
                   f"{path.name}:{path.stat().st_size}")
        # NOTE: the reader's parsed fields (a numpy view per vocabulary string and merge, ~45
        # MB for the default model) are read once, above; the tensors need only `tensors`.
        reader.fields.clear()
        ckpt.reader, ckpt.source = reader, source
        return ckpt

    def populate_pages(self) -> None:
        mapped = getattr(self, "mapped", None)  # runtime/loader/mapped_gguf.py: its mapped copy
        if mapped is not None:
            mapped.populate()

    def source_stat(self) -> os.stat_result:
        """The stat of the file this checkpoint reads (not of what its path names now)."""
        return os.fstat(self.source.fileno())

    def release_file_pages(self) -> None:
        """Every tensor is copied out of the memory map (blocks and dequantized alike), so
        after the load the mapped pages (~90 MB for the default model) only double the
        weights' resident size: dropped here; the file is re-read if read again."""
        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is not None:
            mapping.madvise(mmap.MADV_DONTNEED)

    def tensors(self, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor dequantized to float32, by Hugging Face name, but those in `skip`."""
        from gguf import quants

        cfg = self.config
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            if name in skip:
                continue
            try:
                data = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            except Exception as e:
                raise ModelLoadError(f"cannot dequantize tensor {t.name}: {e}",
                                     tensor=t.name) from e
            tensor = torch.from_numpy(data.copy())
            # llama.cpp stores q/k rows permuted for its interleaved RoPE; undo it.
            if name.endswith("self_attn.q_proj.weight"):
                tensor = _unpermute(tensor, cfg.num_attention_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                tensor = _unpermute(tensor, cfg.num_key_value_heads)
            yield name, tensor


    def block_tensors(self) -> Iterator[tuple[str, BlockPlanes]]:
        """The Q4_0 / Q4_1 / Q8_0 tensors as block planes, bytes as stored (q/k rows put back
        in Hugging Face order, a row permutation), by Hugging Face name; others are skipped."""
        from runtime.quant.blocks import GGUF_BLOCK_TYPES, import_gguf_blocks

        cfg = self.config
        for t in self.reader.tensors:
            kind = t.tensor_type.name
            if kind not in GGUF_BLOCK_TYPES:
                continue
            name = _hf_name(t.name)
            planes = import_gguf_blocks(t.data, kind, name)
            if name.endswith("self_attn.q_proj.weight"):
                planes = planes.rows(lambda p: _unpermute(p, cfg.num_attention_heads))
            elif name.endswith("self_attn.k_proj.weight"):
                planes = planes.rows(lambda p: _unpermute(p, cfg.num_key_value_heads))
            yield name, planes


def _open_stable(path: Path, tries: int = 3) -> tuple[BinaryIO, Any]:
    """(the file, a GGUF reader of that same file): opened, then read, then checked to be one
    inode, so a rename over `path` in between never pairs one file's key with another's bytes.
    Raises ModelLoadError when `path` keeps being replaced."""
    for _ in range(tries):
        source = open(path, "rb")  # held by the checkpoint
        try:
            reader = _reader_class()(str(path))
            if os.fstat(source.fileno()).st_ino == path.stat().st_ino:
                return source, reader
        except BaseException:
            source.close()
            raise
        source.close()
    raise ModelLoadError(f"{path} was replaced {tries} times while it was opened", path=path)


def _reader_class() -> type:
    """gguf's reader, slicing a plain ndarray view of its memory map: the stock one slices the
    `np.memmap` itself, and numpy's per-slice memmap bookkeeping over the default model's
    ~100,000 vocabulary strings cost 2.6 s of CPU per open, against 0.7 s this way (same
    fields and tensors; `ops/bench/RESULTS-log.md#worker-start-up-phases`), and its array
    fields read in bulk (runtime/loader/gguf_fields.py; 0.1 s). The tensors it returns are
    read-only views of the same mapping, as before."""
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1,
                 override_order: Any = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _build_fields(self, offs: int, count: int) -> int:
            from runtime.loader.gguf_fields import build_fields

            return build_fields(self, offs, count)

    return PlainViewReader


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ModelLoadError(f"unknown GGUF tensor {gguf_name}", tensor=gguf_name)


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value


def _config_from_fields(fields: dict[str, Any], reader: Any) -> ModelConfig:
    def need(key: str) -> Any:
        if key not in fields:
            raise ModelLoadError(f"GGUF metadata is missing {key}", field=key)
        return fields[key]

    heads = int(need("llama.attention.head_count"))
    hidden = int(need("llama.embedding_length"))
    vocab = fields.get("llama.vocab_size") or len(need("tokenizer.ggml.tokens"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    eos = fields.get("tokenizer.ggml.eos_token_id")
    scaling = None
    if fields.get("llama.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(fields["llama.rope.scaling.factor"])}
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("llama.feed_forward_length")),
        num_hidden_layers=int(need("llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(fields.get("llama.attention.head_count_kv", heads)),
        head_dim=int(fields.get("llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(fields.get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(fields.get("llama.context_length", 2048)),
        tie_word_embeddings=not has_output,
        rope_scaling=scaling,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
