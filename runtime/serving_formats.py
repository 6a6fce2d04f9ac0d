"""Which weight and KV formats each phase serves in, resolved and checked once at start.

A config names, per phase, a weight format (fp32|bf16|fp16|fp8|int4) and a KV format
(fp32|bf16|fp16|fp8|int8); "auto" means the engine's compute dtype (or the checkpoint's own format
when the checkpoint is already quantized). A colocated engine writes KV in the decode format,
runs prefill steps with the prefill weights and decode steps with the decode weights.
Combinations that spend memory or accuracy for nothing are refused with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import InvalidArgument
from runtime.formats import KVFormat, WeightFormat, canonical_name

# Higher = more precise; fp16 and bf16 rank together, and so do the 1-byte KV formats.
_PRECISION = {"fp32": 4, "bf16": 3, "fp16": 3, "fp8": 2, "int8": 2, "int4": 1}


@dataclass(frozen=True)
class PhaseFormat:
    weights: WeightFormat
    kv: KVFormat

    def describe(self) -> dict[str, str]:
        return {"weights": self.weights.label, "kv_cache_dtype": self.kv.name}


@dataclass(frozen=True)
class ServingFormats:
    prefill: PhaseFormat
    decode: PhaseFormat

    @property
    def kv(self) -> KVFormat:
        """The format a colocated engine stores KV in: the decode phase's."""
        return self.decode.kv

    @property
    def shares_weights(self) -> bool:
        return self.prefill.weights == self.decode.weights

    def describe(self) -> dict[str, dict[str, str]]:
        return {"prefill": self.prefill.describe(), "decode": self.decode.describe()}

    @classmethod
    def resolve(cls, compute_dtype: str, *, prefill_weights: str = "auto",
                decode_weights: str = "auto", kv_cache_dtype: str = "auto",
                prefill_kv_cache_dtype: str = "auto", group_size: int = 128,
                symmetric: bool = True,
                checkpoint_format: WeightFormat | None = None) -> ServingFormats:
        """Turn names (possibly "auto") into checked formats. `compute_dtype` is a torch dtype
        name such as "float32"; `checkpoint_format` is set for pre-quantized checkpoints."""
        dense = canonical_name(compute_dtype)

        def weights(name: str, phase: str) -> WeightFormat:
            if name == "auto":
                return checkpoint_format or WeightFormat(dense)
            fmt = WeightFormat.parse(name, group_size, symmetric)
            if fmt.name in ("fp32", "bf16", "fp16") and fmt.name != dense:
                raise InvalidArgument(
                    f"{phase} weights {fmt.name} differ from the compute dtype {dense}: "
                    f"unquantized weights are served in the compute dtype (set dtype to "
                    f"choose it); only fp8 and int4 weights are decoded on the fly",
                    field=f"{phase}_weights")
            if checkpoint_format is not None and fmt != checkpoint_format:
                raise InvalidArgument(
                    f"{phase} weights {fmt.label!r} cannot be served from a checkpoint stored "
                    f"as {checkpoint_format.label!r}: its weights are served as stored; convert "
                    f"from the original checkpoint instead", field=f"{phase}_weights")
            return fmt

        def kv(name: str) -> KVFormat:
            return KVFormat(dense) if name == "auto" else KVFormat.parse(name)

        decode_kv = kv(kv_cache_dtype)
        prefill_kv = decode_kv if prefill_kv_cache_dtype == "auto" else kv(prefill_kv_cache_dtype)
        out = cls(PhaseFormat(weights(prefill_weights, "prefill"), prefill_kv),
                  PhaseFormat(weights(decode_weights, "decode"), decode_kv))
        out.check()
        return out

    def check(self) -> None:
        p, d = self.prefill, self.decode
        if _PRECISION[p.weights.name] < _PRECISION[d.weights.name]:
            raise InvalidArgument(
                f"prefill weights {p.weights.label} are coarser than decode weights "
                f"{d.weights.label}: low-bit weights pay off only in memory-bound decode; "
                f"compute-bound prefill would be both slower and less accurate for nothing",
                field="prefill_weights")
        if _PRECISION[p.kv.name] < _PRECISION[d.kv.name]:
            raise InvalidArgument(
                f"prefill KV {p.kv.name} is coarser than decode KV {d.kv.name}: decode would "
                f"import already-rounded KV into pages that cost more and hold no more "
                f"information", field="prefill_kv_cache_dtype")
        if p.kv.quantized and d.kv.quantized and p.kv != d.kv:
            raise InvalidArgument(
                f"prefill KV {p.kv.name} and decode KV {d.kv.name} are different 1-byte formats: "
                f"decode would re-round already-rounded KV into pages of the same size; use one "
                f"of them for both phases, or a wider prefill format",
                field="prefill_kv_cache_dtype")

    @classmethod
    def from_file(cls, path: str | Path, compute_dtype: str) -> ServingFormats:
        """Read {"prefill": {"weights":..., "kv_cache_dtype":...}, "decode": {...},
        "group_size": 128, "symmetric": true} from a JSON file."""
        return cls.resolve(compute_dtype, **read_serving_config(path))


def read_serving_config(path: str | Path) -> dict[str, Any]:
    """The `resolve` keyword arguments named by a serving-config JSON file."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"cannot read serving config {path}: {e}",
                              field="serving_config") from e
    return serving_kwargs(raw)


def serving_kwargs(raw: Any) -> dict[str, Any]:
    """The `resolve` keyword arguments named by a serving-config mapping."""
    if not isinstance(raw, dict):
        raise InvalidArgument("serving config must be a JSON object", field="serving_config")
    unknown = set(raw) - {"prefill", "decode", "group_size", "symmetric"}
    if unknown:
        raise InvalidArgument(f"serving config has unknown keys {sorted(unknown)}",
                              field="serving_config")
    out: dict[str, Any] = {}
    for phase in ("prefill", "decode"):
        section = raw.get(phase, {})
        if not isinstance(section, dict) or set(section) - {"weights", "kv_cache_dtype"}:
            raise InvalidArgument(f"serving config {phase!r} takes only 'weights' and "
                                  f"'kv_cache_dtype'", field="serving_config")
        out[f"{phase}_weights"] = str(section.get("weights", "auto"))
        kv_key = "prefill_kv_cache_dtype" if phase == "prefill" else "kv_cache_dtype"
        out[kv_key] = str(section.get("kv_cache_dtype", "auto"))
    if "group_size" in raw:
        out["group_size"] = int(raw["group_size"])
    if "symmetric" in raw:
        out["symmetric"] = bool(raw["symmetric"])
    return out
