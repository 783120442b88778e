"""Tokenizers for `hp train`: the embedded models' byte-level one, or a local HF tokenizer.

Training must start on a machine that reaches nothing outside it, so no
tokenizer is ever fetched. An embedded model (`hp/tiny-llama`, ...) reads
bytes (`hp.train.data.byte_tokenizer.ByteTokenizer`, with the special
tokens the model names). A local directory holding a HuggingFace tokenizer
is loaded with `local_files_only=True` and wrapped to the same small
interface (`Tokenizer`), which is all the data layer uses: `encode` without
special tokens (templates place eos themselves), `decode`, and the special
ids, with pad falling back to eos as most causal-LM tokenizers lack a pad
token. Both save themselves as HF tokenizer files (`save_pretrained`), so a
checkpoint or an exported model carries its tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from hp.train.data.byte_tokenizer import ByteTokenizer
from hp.train.data.embedded import EMBEDDED, EMBEDDED_TOKENS, TINY_LLAMA

# Files whose presence marks a directory as holding a HF tokenizer.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    pad_token_id: int
    bos_token_id: int | None
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save_pretrained(self, directory: str) -> None: ...


class HFTokenizer:
    """A local HF tokenizer seen through `Tokenizer`; the original is `.hf`.

    >>> from tokenizers import Tokenizer as Raw, models
    >>> from transformers import PreTrainedTokenizerFast
    >>> raw = Raw(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    >>> tok = HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>"))
    >>> (tok.eos_token_id, tok.pad_token_id, tok.vocab_size)
    (1, 1, 2)
    """

    def __init__(self, hf: Any, source: str = "<in memory>"):
        if hf.eos_token_id is None:
            # Every supervised response ends with eos; without one the model
            # would never learn to stop.
            raise ValueError(
                f"tokenizer in {source!r} defines no eos token; set eos_token in its tokenizer_config.json"
            )
        self.hf = hf
        self.eos_token_id = int(hf.eos_token_id)
        self.pad_token_id = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_token_id
        self.bos_token_id = int(hf.bos_token_id) if hf.bos_token_id is not None else None
        self.vocab_size = len(hf)  # counts added tokens, unlike hf.vocab_size
        self._rust = _rust_tokenizer(hf)

    def encode(self, text: str) -> list[int]:
        if self._rust is None:
            return list(self.hf.encode(text, add_special_tokens=False))
        return self._rust.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def __getstate__(self) -> dict:  # for worker processes that tokenize: a pickled Rust tokenizer loses a setting
        return {k: v for k, v in self.__dict__.items() if k != "_rust"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._rust = _rust_tokenizer(self.hf)

    def save_pretrained(self, directory: str) -> None:
        self.hf.save_pretrained(directory)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"


def _rust_tokenizer(hf: Any) -> Any:
    """A copy of the Rust tokenizer a fast HF tokenizer wraps, set as its `encode` sets it; None for a slow one.

    A dataset's every turn is tokenized part by part, tens of thousands of calls, and a fast tokenizer's own
    `encode` spends four fifths of each in Python around the one call of its Rust tokenizer (`encode_batch`
    of one text, with the truncation and padding it holds turned off, and its own `split_special_tokens`).
    `HFTokenizer.encode` makes that call on this copy, so the ids are the same.
    """
    backend = getattr(hf, "backend_tokenizer", None) if getattr(hf, "is_fast", False) else None
    if backend is None:
        return None
    from tokenizers import Tokenizer as Rust

    rust = Rust.from_str(backend.to_str())
    rust.no_truncation()
    rust.no_padding()
    rust.encode_special_tokens = bool(getattr(hf, "split_special_tokens", False))
    return rust


def load_tokenizer(model_name_or_path: str) -> Tokenizer:
    """The tokenizer of `model_name_or_path`: the byte tokenizer for an embedded model, else a local HF one.

    >>> load_tokenizer("hp/tiny-llama").vocab_size, load_tokenizer("hp/tiny-qwen2.5-vl").vocab_size
    (259, 265)
    >>> load_tokenizer("meta-llama/Llama-3-8B")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: model_name_or_path 'meta-llama/Llama-3-8B' is neither 'hp/tiny-llama' nor a local directory; ...
    """
    if model_name_or_path in EMBEDDED:
        return ByteTokenizer(EMBEDDED_TOKENS.get(model_name_or_path, ()))
    path = Path(model_name_or_path)
    if not path.is_dir():
        raise ValueError(
            f"model_name_or_path {model_name_or_path!r} is neither {TINY_LLAMA!r} nor a local directory; "
            f"the embedded models are {', '.join(map(repr, EMBEDDED))}; "
            "hp never downloads from a hub: download the model yourself and point to its local directory"
        )
    if not any((path / name).is_file() for name in _HF_TOKENIZER_FILES):
        raise ValueError(
            f"directory {model_name_or_path!r} holds no HF tokenizer (none of {', '.join(_HF_TOKENIZER_FILES)}); "
            f"save one there with tokenizer.save_pretrained(), or use {TINY_LLAMA!r}"
        )
    from transformers import AutoTokenizer  # heavy import, only for this branch

    return HFTokenizer(AutoTokenizer.from_pretrained(str(path), local_files_only=True), source=str(path))
