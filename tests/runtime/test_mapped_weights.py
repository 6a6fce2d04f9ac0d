"""The default model's GGUF blocks read in place from their mapped file (runtime/loader/mapped.py)
against the blocks imported into the process as before: the same bytes in every served tensor,
the same greedy tokens; the tensors are views of one shared read-only file mapping; a replaced
source gets a new file; a file is never seen torn, and a foreign or damaged one is remade."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine import LLMEngine
from runtime.errors import ModelLoadError
from runtime.loader import default_model_path, open_checkpoint
from runtime.loader.mapped import MappedWeights, cache_path, source_key, write_mapped
from runtime.loader.mapped_gguf import FORMAT, checkpoint_mapping
from runtime.sampling_params import SamplingParams
from tests.helpers import perturbed_model_copy

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def mapped_dir(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("mapped")
    old = os.environ.get("TESSERA_MAPPED_DIR")
    os.environ["TESSERA_MAPPED_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("TESSERA_MAPPED_DIR")
    else:
        os.environ["TESSERA_MAPPED_DIR"] = old


def _engine(mapped: bool, model: str | None = None) -> LLMEngine:
    return LLMEngine(open_checkpoint(model), EngineConfig(
        kv_cache_bytes=16 << 20, max_num_seqs=4, gguf_weights="stored",
        gguf_activations="float32", mapped_weights=mapped))


@pytest.fixture(scope="module")
def engines(mapped_dir: Path):
    return _engine(mapped=False), _engine(mapped=True)


def _served(engine: LLMEngine) -> dict[str, torch.Tensor]:
    out = {}
    for mname, module in engine.model.named_modules():
        for pname, t in list(module.named_parameters(recurse=False)) + \
                list(module.named_buffers(recurse=False)):
            if t is not None:
                out[f"{mname}.{pname}"] = t
    return out


def _greedy(engine: LLMEngine) -> list[int]:
    engine.add_request("g", PROMPT, SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens


def test_mapped_tensors_equal_the_imported_ones_bit_for_bit(engines) -> None:
    copied, mapped = (_served(e) for e in engines)
    assert copied.keys() == mapped.keys() and len(copied) > 90
    for name, t in copied.items():
        m = mapped[name]
        assert m.dtype == t.dtype and m.shape == t.shape, name
        assert torch.equal(m.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_mapped_engine_gives_the_same_greedy_tokens(engines) -> None:
    copied, mapped = engines
    assert _greedy(mapped) == _greedy(copied)


def test_served_tensors_are_views_of_a_shared_read_only_mapping(engines) -> None:
    mapped = engines[1]
    weights = mapped.checkpoint.mapped
    base = torch.frombuffer(weights.mapping, dtype=torch.uint8).data_ptr()
    end = base + len(weights.mapping)
    served = _served(mapped)
    inside = [n for n, t in served.items() if base <= t.data_ptr() < end]
    assert len(inside) == len(served), set(served) - set(inside)
    with open("/proc/self/maps") as f:
        lines = [ln for ln in f if ln.rstrip().endswith(str(weights.path))]
    assert lines and all(ln.split()[1] == "r--s" for ln in lines), lines


def test_a_replaced_source_gets_a_new_file_and_the_old_stays_whole(
        mapped_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), source)
    first = checkpoint_mapping(open_checkpoint(source))
    first_bytes = bytes(first.mapping[: 1 << 16])
    replacement = tmp_path / "model.gguf.new"
    shutil.copyfile(default_model_path(), replacement)
    os.utime(replacement, ns=(1, 1))  # another mtime: another source as far as the key goes
    os.replace(replacement, source)
    second = checkpoint_mapping(open_checkpoint(source))
    assert second.path != first.path and second.index["key"] == source_key(source, FORMAT)
    assert bytes(first.mapping[: 1 << 16]) == first_bytes  # a holder's mapping is untouched


def test_a_source_replaced_after_it_was_opened_is_mapped_as_opened(
        mapped_dir: Path, tmp_path: Path) -> None:
    """The mapped file is keyed by the file the checkpoint read, not by what the path names
    when the mapping is made: old weights never sit under the new file's key."""
    source = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), source)
    opened = open_checkpoint(source)
    replacement = tmp_path / "model.gguf.new"
    perturbed_model_copy(default_model_path(), replacement)
    os.replace(replacement, source)  # after the open, before the mapping
    old = checkpoint_mapping(opened)
    new = checkpoint_mapping(open_checkpoint(source))
    assert old.path != new.path
    norm_old, norm_new = old.tensor("model.norm.weight"), new.tensor("model.norm.weight")
    assert torch.equal(norm_new, norm_old.flip(0)) and not torch.equal(norm_new, norm_old)


def test_an_interrupted_write_leaves_no_file_at_the_path(tmp_path: Path) -> None:
    key = {"source": "x", "size": 1, "mtime_ns": 1, "format": "f", "version": 0}
    path = cache_path(key, tmp_path)
    write_mapped(path, key, [("a", torch.arange(10, dtype=torch.float32))])
    old = MappedWeights.open(path, key).tensor("a").clone()

    class Boom(Exception):
        pass

    def tensors():
        yield "a", torch.zeros(10)
        raise Boom

    with pytest.raises(Boom):
        write_mapped(path, key, tensors())
    assert torch.equal(MappedWeights.open(path, key).tensor("a"), old)
    assert os.listdir(tmp_path) == [path.name]  # no temporary left behind


def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    key = {"source": "x", "size": 1, "mtime_ns": 1, "format": "f", "version": 0}
    path = cache_path(key, tmp_path)
    write_mapped(path, key, [("a", torch.arange(5000, dtype=torch.float32))])
    with pytest.raises(ModelLoadError, match="another source"):
        MappedWeights.open(path, {**key, "size": 2})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(ModelLoadError, match="holds"):
        MappedWeights.open(path, key)
    path.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a tessera"):
        MappedWeights.open(path, key)


def test_a_damaged_file_is_remade(mapped_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), source)
    made = checkpoint_mapping(open_checkpoint(source))
    with open(made.path, "r+b") as f:
        f.truncate(4096)
    remade = checkpoint_mapping(open_checkpoint(source))
    assert remade.index["total"] == made.index["total"]
    assert os.path.getsize(remade.path) == made.index["total"]
