"""Tokenizer and chat template read from the checkpoint (GGUF metadata or tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from runtime.errors import InvalidArgument, ModelLoadError

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined; both are matched whole.
_SPECIAL_TOKEN_TYPES = (3, 4)


class Tokenizer:
    def __init__(self, backend: HFTokenizer, chat_template: str | None,
                 bos_token: str | None, eos_token: str | None, add_bos: bool) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = {
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        }
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos = self.backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidArgument("this model has no chat template; send a plain prompt")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("messages must be a non-empty list", field="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise InvalidArgument(f"messages[{i}] needs string 'role' and 'content'",
                                      field="messages")
        if self._template is None:
            self._template = self._env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "",
                                         add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise InvalidArgument(f"chat template failed on these messages: {e}") from e

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (only gpt2 BPE)",
                                 field="tokenizer.ggml.model")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                         merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if fields.get("tokenizer.ggml.pre") == "smollm":
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t in _SPECIAL_TOKEN_TYPES])

        def token(key: str) -> str | None:
            idx = fields.get(key)
            return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

        return cls(backend, fields.get("tokenizer.chat_template"),
                   token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id"),
                   bool(fields.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json", field="tokenizer.json")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the library raises a bare Exception on bad JSON
            raise ModelLoadError(f"cannot read {tok_file}: {e}", field="tokenizer.json") from e
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except ValueError as e:
                raise ModelLoadError(f"cannot parse {cfg_file}: {e}") from e
        template = cfg.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(backend, template if isinstance(template, str) else None,
                   _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")),
                   bool(cfg.get("add_bos_token", False)))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
