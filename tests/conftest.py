"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import os
import random
import zlib

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton fixes its mode when first imported: the CPU suite runs the kernels in its interpreter;
# ops/bench/gpu_check.sh sets TESSERA_TRITON_NATIVE=1 to run the same tests on CUDA.
if os.environ.get("TESSERA_TRITON_NATIVE") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The fast tier (`pytest -m "not slow"`: kernels, pages, scheduler, sampling, planner, property
# tests) must not load the real model into an engine: a test that asks for one is slow, marked
# or not. Modules that start workers or servers say so with a module-level `pytestmark`.
MODEL_FIXTURES = frozenset({"llm", "engine", "hf_model"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def seeded_rngs(request: pytest.FixtureRequest) -> None:
    """random, numpy and torch seeded per test from its node id: a test that draws without a
    generator gets the same inputs on every machine and in any order or subset of tests."""
    import numpy as np
    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture(scope="session")
def default_model_path():
    from runtime.loader import default_model_path as find

    return find()


@pytest.fixture(scope="session")
def llm():
    """The embedded default model in an engine with a 256 MiB fp32 KV pool (~5,800 tokens),
    its GGUF blocks dequantized to fp32 at load: the model transformers is compared with
    (tests/runtime/test_gguf_stored.py compares the blocks served as stored with it)."""
    from runtime import LLM

    return LLM(kv_cache_bytes=256 << 20, max_num_seqs=32, gguf_weights="dequantize")


@pytest.fixture
def engine(llm):
    """The session engine; after the test, no request may remain and no page may be held."""
    yield llm.engine
    for rid in list(llm.engine.requests):
        llm.engine.abort_request(rid)
    llm.engine.check_quiescent()


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """transformers' own reading of the same GGUF file, in float32: the correctness oracle."""
    pytest.importorskip("transformers")
    from tests.hf_greedy_reference import load_model

    return load_model(default_model_path)


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for the module: on a small shared CPU box, two threads spin-waiting
    on each other make every op ~10x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
