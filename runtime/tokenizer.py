"""Tokenizer and chat template read from the checkpoint (GGUF metadata or tokenizer.json).

Control tokens come only from the template: a chat message's content, and a raw prompt with
`split_special_tokens`, are always tokenized as plain text.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Encoding, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from runtime.chat_roles import role_error
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
        specials = {tid: tok.content for tid, tok in backend.get_added_tokens_decoder().items()
                    if tok.special}
        self.special_ids = set(specials)
        self._special_texts = sorted(set(specials.values()), key=len, reverse=True)
        # Longest first: at one position the longest literal wins, as the backend matches.
        self._special_pattern = re.compile(
            "(" + "|".join(map(re.escape, self._special_texts)) + ")") if specials else None
        # NOTE: a second backend that reads special-token literals as text, made on first use
        # or by prepare() (~0.15 s: no first request without a chat or split_special_tokens
        # waits for it). Neither is mutated once made, so both may encode from any thread.
        self._text: HFTokenizer | None = None
        self._text_lock = threading.Lock()
        # NOTE: the chat template's jinja2 environment, made on first use or by prepare() too
        # (importing jinja2 is ~40 ms of CPU no first request without a chat waits for)
        self._template: Any = None

    @property
    def _text_backend(self) -> HFTokenizer:
        if self._text is None:
            with self._text_lock:
                if self._text is None:
                    text = HFTokenizer.from_str(self.backend.to_str())
                    text.encode_special_tokens = True
                    self._text = text
        return self._text

    def prepare(self) -> None:
        """Make now what is otherwise made on first use (the plain-text backend, the chat
        template): an engine's warm-up and a worker template, once idle, call it."""
        self._text_backend  # noqa: B018
        if self.chat_template:
            from jinja2 import TemplateError

            try:
                self._chat_template()
            except TemplateError:  # NOTE: said to the request that renders it, as before
                pass

    def _chat_template(self) -> Any:
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        return self._template

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        """With `split_special_tokens`, special-token literals in `text` (e.g. "<|im_end|>")
        are plain text, as in Hugging Face's tokenizers; else they are control tokens."""
        backend = self._text_backend if split_special_tokens else self.backend
        # NOTE: encode_batch releases the GIL while it works (encode does not): a long prompt
        # tokenized in a pool thread must not stall the engine thread's step.
        ids = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._with_bos(ids) if add_special_tokens else ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_token is not None:
            bos = self.backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                return [bos, *ids]
        return ids

    def encode_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        """The rendered conversation's ids, where control tokens come only from the template.

        For messages without special-token literals, the same ids as encoding the rendered
        text whole: the backend also splits at special tokens first and encodes the text
        between them on its own, so splitting at the template's special tokens changes nothing.
        """
        pieces, contents = self._render_pieces(messages, add_generation_prompt)
        segments: list[tuple[str, bool]] = []  # (text, is a control token)
        for i, piece in enumerate(pieces):
            parts = self._special_pattern.split(piece) if self._special_pattern else [piece]
            for j, part in enumerate(parts):
                segments.append((part, j % 2 == 1))
            if i < len(contents):
                segments.append((contents[i], False))
        runs: list[tuple[str, bool]] = []  # adjacent text segments joined
        for part, special in segments:
            if not special and runs and not runs[-1][1]:
                runs[-1] = (runs[-1][0] + part, False)
            elif special or part:
                runs.append((part, special))
        texts = iter(self._text_backend.encode_batch(  # batch: it releases the GIL
            [part for part, special in runs if not special], add_special_tokens=False))
        encodings: list[Encoding] = [
            self.backend.encode(part, add_special_tokens=False) if special else next(texts)
            for part, special in runs]
        if not encodings:
            return self._with_bos([])
        merged = Encoding.merge(encodings, growing_offsets=True)
        return self._with_bos(self.backend.post_process(merged).ids)

    def _render_pieces(self, messages: list[dict[str, Any]],
                       add_generation_prompt: bool) -> tuple[list[str], list[str]]:
        """The template's own text, split where message contents go: pieces[i] comes before
        contents[i] (a content appears as often, and in the order, the template puts it)."""
        rendered = self.apply_chat_template(messages, add_generation_prompt)
        nonce = secrets.token_hex(16)
        while any(nonce in m["content"] or nonce in m["role"] for m in messages):
            nonce = secrets.token_hex(16)  # NOTE: never in practice (128 random bits)
        marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
        template = self._render(marked, add_generation_prompt)
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", template)
        pieces, order = parts[0::2], [int(i) for i in parts[1::2]]
        # The template may change a content (Llama 3's `| trim`): the split stands only if it
        # puts back exactly the text the template renders.
        for transform in (str, str.strip):
            contents = [transform(messages[i]["content"]) for i in order]
            if _interleave(pieces, contents) == rendered:
                return pieces, contents
        raise InvalidArgument("this model's chat template changes message contents in a way "
                              "that cannot be tokenized safely", field="messages")

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
            # A role is rendered among the template's own text: it may not bring a control token.
            if any(t in m["role"] for t in self._special_texts):
                raise InvalidArgument(f"messages[{i}] has a special token in its role",
                                      field="messages")
            why = role_error(m["role"])
            if why is not None:
                raise InvalidArgument(f"messages[{i}]: {why}", field=f"messages[{i}].role")
        return self._render(messages, add_generation_prompt)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        template = self._chat_template()
        try:
            return template.render(messages=messages, bos_token=self.bos_token or "",
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


def _interleave(pieces: list[str], contents: list[str]) -> str:
    return "".join(p + c for p, c in zip(pieces, [*contents, ""], strict=True))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
