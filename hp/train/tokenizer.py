"""Tokenizers for `hp train`: a byte-level one that needs no download, or a local HF tokenizer.

Training must start on a machine that reaches nothing outside it, so no
tokenizer is ever fetched. The embedded model `hp/tiny-llama` reads bytes:
ids 0-255 are the UTF-8 bytes themselves and the three special tokens come
after them (pad 256, bos 257, eos 258; vocab_size 259), so a byte's id is its
value and any text round-trips. An embedded model may name more special
tokens (`hp/tiny-qwen2.5-vl`: Qwen's chat and vision tokens, `<|im_start|>`,
...), which take the ids after those and are read as one token wherever the
text spells them, as an HF tokenizer reads its added special tokens. A local directory holding a HuggingFace
tokenizer is loaded with `local_files_only=True` and wrapped to the same
small interface (`Tokenizer`), which is all the data layer uses: `encode`
without special tokens (templates place eos themselves), `decode`, and the
special ids, with pad falling back to eos as most causal-LM tokenizers lack
a pad token. Both save themselves as HF tokenizer files
(`save_pretrained`), so a checkpoint or an exported model carries its
tokenizer: the byte tokenizer as the equivalent HF byte-level tokenizer
(the same ids for every text).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from hp.train.model import EMBEDDED, EMBEDDED_TOKENS, TINY_LLAMA

_BYTE_VOCAB = 259  # 256 bytes, pad, bos, eos
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


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then pad (256), bos (257), eos (258), then `specials` (259, ...).

    A special token spelled in the text is its own id, as in an HF tokenizer that holds it as an
    added special token; without `specials` every text is its bytes.

    >>> tok = ByteTokenizer()
    >>> tok.encode("hé")
    [104, 195, 169]
    >>> tok.decode(tok.encode("hé") + [tok.eos_token_id])
    'hé'
    >>> chat = ByteTokenizer(("<|im_start|>", "<|im_end|>"))
    >>> chat.encode("<|im_start|>hi<|im_end|>"), chat.vocab_size
    ([259, 104, 105, 260], 261)
    """

    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258

    def __init__(self, specials: Sequence[str] = ()) -> None:
        self.specials = tuple(specials)
        self.vocab_size = _BYTE_VOCAB + len(self.specials)
        self._special_ids = {token: _BYTE_VOCAB + i for i, token in enumerate(self.specials)}
        # longest first, so that a token containing another is read whole
        alternatives = "|".join(re.escape(t) for t in sorted(self.specials, key=len, reverse=True))
        self._splitter = re.compile(f"({alternatives})") if self.specials else None

    def encode(self, text: str) -> list[int]:
        if self._splitter is None:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for piece in self._splitter.split(text):  # texts and, at odd places, the special tokens between them
            special = self._special_ids.get(piece)
            ids += [special] if special is not None else list(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int]) -> str:
        # Specials, and ids past the bytes (a model may pad its vocabulary to
        # split evenly over tp), carry no text; a cut multi-byte character
        # becomes U+FFFD rather than an exception mid-generation.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save_pretrained(self, directory: str) -> None:
        """Write the HF byte-level tokenizer with the same ids into `directory` (`AutoTokenizer` loads it)."""
        self.as_hf().save_pretrained(directory)

    def as_hf(self):
        """This tokenizer as a HF fast tokenizer: byte-level pre-tokenization, one token per byte, no merges.

        >>> ByteTokenizer().as_hf().encode("hé", add_special_tokens=False)
        [104, 195, 169]
        >>> ByteTokenizer(("<|im_end|>",)).as_hf().encode("a<|im_end|>", add_special_tokens=False)
        [97, 259]
        """
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Raw
        from transformers import PreTrainedTokenizerFast

        vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
        specials = {"<pad>": self.pad_token_id, "<s>": self.bos_token_id, "</s>": self.eos_token_id,
                    **self._special_ids}
        raw = Raw(models.BPE(vocab={**vocab, **specials}, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        if self.specials:  # read whole wherever the text spells them, as encode does
            raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.specials])
        return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>")

    def __repr__(self) -> str:
        named = f", specials={self.specials!r}" if self.specials else ""
        return f"ByteTokenizer(vocab_size={self.vocab_size}{named})"


def _byte_level_chars() -> list[str]:
    """The character byte-level BPE shows for each byte: printable Latin-1 bytes as themselves, others from U+0100."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


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

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def save_pretrained(self, directory: str) -> None:
        self.hf.save_pretrained(directory)

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"


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
