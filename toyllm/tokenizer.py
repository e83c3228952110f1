"""Tokenizers: text <-> token ids, and chat messages -> one prompt string.

Two tokenizers share one small interface (``encode``, ``decode``,
``apply_chat_template``, ``encode_chat``, ``vocab_size``, ``bos_id``,
``eos_id``), so generation code never needs to know which one it holds:

- ``ByteTokenizer``: every UTF-8 byte is a token (vocab 256). It goes with the
  randomly initialised toy presets; nothing to download, nothing to learn.
- ``GGUFTokenizer``: the byte-level BPE tokenizer of a real model, rebuilt
  with the ``tokenizers`` package from the vocabulary, merges and chat
  template stored in the model's GGUF file (see ``toyllm.weights``).

Three details decide whether a rebuilt BPE tokenizer agrees with the one the
model was trained with:

1. Control tokens such as ``<|im_start|>`` must be registered as special
   tokens. Otherwise the text "<|im_start|>" is split into pieces like
   "<", "|", "im", ... and every chat prompt reaches the model mangled.
2. The pre-tokenizer named ``smollm`` puts every digit in a piece of its
   own *before* the GPT-2 byte-level regex runs, so "12345" is five tokens.
3. The BOS/EOS ids come from the metadata, as does whether BOS is prepended.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

TOKEN_TYPE_CONTROL = 3   # tokenizer.ggml.token_type value of control tokens (<|im_start|>, ...)


def _check_messages(messages) -> list[dict]:
    """Validate a chat: a list of {"role": str, "content": str} dicts."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
    return list(messages)


class Tokenizer:
    """What every tokenizer offers. Subclasses fill in the four methods that raise."""

    bos_id: int | None = None
    eos_id: int | None = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        raise NotImplementedError

    def encode_chat(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat prompt; a plain string is taken as one user message."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte: "é" is two tokens, 195 and 169."""

    bos_id = None
    eos_id = None

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"byte token ids must lie in [0, 256), got {bad[:5]}")
        # A cut in the middle of a multi-byte character decodes to U+FFFD instead of failing.
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A plain-text chat: one "role: content" line per message, then "assistant: "."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in _check_messages(messages))
        return text + ("assistant: " if add_generation_prompt else "")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class GGUFTokenizer(Tokenizer):
    """A GPT-2 style byte-level BPE tokenizer rebuilt from GGUF metadata.

    tokens: the vocabulary, index = token id. merges: "left right" strings in
    priority order. token_types: the GGUF type of each token (3 = control).
    """

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int] | None = None,
                 bos_id: int | None = None, eos_id: int | None = None, add_bos: bool = False,
                 chat_template: str | None = None, pre: str = "smollm"):
        from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        if pre not in ("smollm", "gpt2", "default"):
            raise ValueError(f"unsupported pre-tokenizer {pre!r}; this tokenizer knows 'smollm', 'gpt2', 'default'")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        # Byte-level tokens never hold a real space (a space is shown as "Ġ"), so a space separates the pair.
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre == "smollm":
            # Digits first, one per piece, then the GPT-2 regex on what is left.
            bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            bpe.pre_tokenizer = byte_level
        bpe.decoder = decoders.ByteLevel()
        types = list(token_types) if token_types is not None else [1] * len(tokens)
        self.control_ids = [i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
        # Special tokens are matched in the raw text before any splitting, and keep their own ids.
        bpe.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in self.control_ids])
        self._tok = bpe
        self._n_vocab = len(tokens)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, bool(add_bos)
        self.chat_template = chat_template
        self._template = None   # compiled on first use

    @staticmethod
    def fields_from_gguf(reader) -> dict:
        """The keyword arguments of ``GGUFTokenizer`` read from an open ``gguf.GGUFReader``'s metadata."""
        from .gguf_file import gguf_value

        model = gguf_value(reader, "tokenizer.ggml.model", "gpt2")
        if model != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') tokenizers are supported, this file has {model!r}")
        return dict(tokens=gguf_value(reader, "tokenizer.ggml.tokens"),
                    merges=gguf_value(reader, "tokenizer.ggml.merges"),
                    token_types=gguf_value(reader, "tokenizer.ggml.token_type", None),
                    bos_id=gguf_value(reader, "tokenizer.ggml.bos_token_id", None),
                    eos_id=gguf_value(reader, "tokenizer.ggml.eos_token_id", None),
                    add_bos=gguf_value(reader, "tokenizer.ggml.add_bos_token", False),
                    chat_template=gguf_value(reader, "tokenizer.chat_template", None),
                    pre=gguf_value(reader, "tokenizer.ggml.pre", "default"))

    @classmethod
    def from_gguf(cls, source) -> "GGUFTokenizer":
        """Build from a GGUF file path or an open ``gguf.GGUFReader``."""
        from gguf import GGUFReader

        reader = source if isinstance(source, GGUFReader) else GGUFReader(Path(source))
        return cls(**cls.fields_from_gguf(reader))

    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    def encode(self, text: str) -> list[int]:
        """Token ids of text; BOS goes in front only if the model's metadata asks for it."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids if text else []
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._n_vocab]
        if bad:
            raise ValueError(f"token ids must lie in [0, {self._n_vocab}), got {bad[:5]}")
        if not ids:
            return ""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The vocabulary entry of id i, as stored (a space shows as "Ġ", a newline as "Ċ")."""
        tok = self._tok.id_to_token(int(i))
        if tok is None:
            raise ValueError(f"token id must lie in [0, {self._n_vocab}), got {i}")
        return tok

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the model's own Jinja chat template (a sandbox runs it: it came from a file)."""
        messages = _check_messages(messages)
        if self.chat_template is None:
            raise ValueError("this GGUF file has no tokenizer.chat_template; encode plain text instead")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            # The same environment settings as Hugging Face's apply_chat_template.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        bos = self._tok.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self._tok.id_to_token(self.eos_id) if self.eos_id is not None else ""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos, eos_token=eos)

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(vocab_size={self._n_vocab}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"control_tokens={len(self.control_ids)})")
