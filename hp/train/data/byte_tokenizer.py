"""The byte-level tokenizer of the embedded models: UTF-8 bytes as ids, so it needs no vocabulary file.

Training must start on a machine that reaches nothing outside it, so the
embedded models (`hp.train.data.embedded`) read bytes: ids 0-255 are the
UTF-8 bytes themselves and the three special tokens come after them (pad
256, bos 257, eos 258; vocab_size 259), so a byte's id is its value and any
text round-trips. An embedded model may name more special tokens
(`hp/tiny-qwen2.5-vl`: Qwen's chat and vision tokens, `<|im_start|>`, ...),
which take the ids after those and are read as one token wherever the text
spells them, as an HF tokenizer reads its added special tokens. It saves
itself as the equivalent HF byte-level tokenizer (the same ids for every
text), so a checkpoint or an exported model carries its tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_BYTE_VOCAB = 259  # 256 bytes, pad, bos, eos


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
