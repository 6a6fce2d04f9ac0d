"""Float projections are stored column-major on the CPU: same values, shapes and tying."""

from __future__ import annotations

import torch
from torch import nn

from runtime.loader.weight_layout import is_column_major, use_column_major_weights


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 12)
        self.proj = nn.Linear(12, 7, bias=True)
        self.head = nn.Linear(12, 50, bias=False)
        self.head.weight = self.embed.weight


def test_column_major_keeps_values_parameters_and_tying() -> None:
    model = _Tied()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = {k: id(v) for k, v in model.named_parameters(remove_duplicate=False)}
    x = torch.randn(5, 12)
    with torch.no_grad():
        expected = model.proj(x)
    moved = use_column_major_weights(model)
    assert moved == (7 * 12 + 50 * 12) * 4  # the shared weight once, biases never
    assert is_column_major(model.proj.weight) and is_column_major(model.head.weight)
    assert model.head.weight is model.embed.weight
    assert {k: id(v) for k, v in model.named_parameters(remove_duplicate=False)} == params
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[key]), key
    ids = torch.tensor([3, 49, 0])
    with torch.no_grad():
        assert torch.equal(model.embed(ids), before["embed.weight"][ids])
        torch.testing.assert_close(model.proj(x), expected, rtol=1e-6, atol=1e-6)
    assert use_column_major_weights(model) == 0  # already laid out: nothing moves twice


def test_engine_serves_every_float_projection_column_major(engine) -> None:
    for model in (engine.prefill_model, engine.decode_model):
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        assert len(linears) == 4 * engine.model_config.num_hidden_layers + 1
        for name, module in linears:
            assert is_column_major(module.weight), name
    lm = engine.decode_model
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
