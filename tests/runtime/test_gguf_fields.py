"""GGUF metadata arrays read in bulk (runtime/loader/gguf_fields.py) give exactly what gguf's
own reader gives: same keys in order, same values and types, same tensors after them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from runtime.loader.gguf_loader import _field_value, _reader_class


def _write(path: Path, endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_uint32("some.count", 7)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "é", "", "日本", "Ġthe"])
    writer.add_array("tokenizer.ggml.merges", ["a b", "Ġ t"])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 1, 1, 6])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25, 0.0, 2.0, 3.5])
    writer.add_array("some.flags", [True, False, True])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("some.bool", True)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_reads_as_gguf(path: Path) -> None:
    fast, stock = _reader_class()(str(path)), gguf.GGUFReader(str(path))
    assert list(fast.fields) == list(stock.fields)
    for name, field in stock.fields.items():
        ours, theirs = _field_value(fast.fields[name]), _field_value(field)
        assert ours == theirs and type(ours) is type(theirs), name
        assert fast.fields[name].types == field.types, name
    assert fast.alignment == stock.alignment and fast.data_offset == stock.data_offset
    assert [(t.name, t.data.tolist()) for t in fast.tensors] == \
        [(t.name, t.data.tolist()) for t in stock.tensors]


def test_arrays_of_strings_numbers_and_bools_read_as_gguf_reads_them(tmp_path: Path) -> None:
    assert_reads_as_gguf(_write(tmp_path / "m.gguf"))


def test_a_file_of_the_other_byte_order_reads_as_gguf_reads_it(tmp_path: Path) -> None:
    assert_reads_as_gguf(_write(tmp_path / "m.gguf", gguf.GGUFEndian.BIG))


def test_the_default_models_metadata_reads_as_gguf_reads_it() -> None:
    from runtime.loader import default_model_path

    assert_reads_as_gguf(default_model_path())


def test_a_string_running_past_the_end_of_the_file_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.gguf")
    data = path.read_bytes()
    at = data.index(b"tokenizer.ggml.tokens") + len("tokenizer.ggml.tokens") + 4 + 4 + 8
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:at] + (1 << 40).to_bytes(8, "little") + data[at + 8:])
    with pytest.raises(ValueError, match="past the end"):
        _reader_class()(str(bad))
