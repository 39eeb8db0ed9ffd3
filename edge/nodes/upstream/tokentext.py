"""A prompt's tokens as the bytes of text each stands for, from their vocabulary strings.

vLLM's `/tokenize` answers each token's string in the tokenizer's vocabulary
(`return_token_strs`: Hugging Face's `convert_ids_to_tokens`), not its text.
Two families cover the models servers run:

- byte-level BPE (GPT-2's scheme: Llama 3, Qwen, Mistral's newer, GPT-OSS, ...):
  each byte of the text is one printable character of a fixed table
  (`bytes_to_unicode`: the printable Latin-1 bytes stand for themselves, the
  others for U+0100 onwards; a space is `Ġ`, a newline `Ċ`), so a token's text
  is its characters mapped back to bytes;
- SentencePiece (Llama 2, Gemma, Mistral's older): `▁` is a space, `<0xNN>` a
  raw byte, other characters their UTF-8.

`token_bytes` tells the family by the strings (any `▁` or `<0xNN>` piece:
SentencePiece) and maps each token; a token with a character outside the
byte-level table (an added special token such as DeepSeek's) is its string's
UTF-8. Joined, the bytes are the prompt's text as the server tokenized it
(a token may end inside a UTF-8 character); where a mapping is off, the
alignment that reads them (`edge.nodes.upstream.kvalign`) finds less of the
messages there, and claims less.

Pure: strings in, bytes out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

__all__ = ["token_bytes"]


def _byte_level_table() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: character -> the byte it stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL: Final = _byte_level_table()
_SP_SPACE: Final = "\u2581"
_SP_BYTE: Final = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level(piece: str) -> bytes:
    table = _BYTE_LEVEL
    try:
        return bytes(table[char] for char in piece)
    except KeyError:
        return piece.encode("utf-8", "surrogatepass")


def _sentencepiece(piece: str) -> bytes:
    if (byte := _SP_BYTE.fullmatch(piece)) is not None:
        return bytes([int(byte.group(1), 16)])
    return piece.replace(_SP_SPACE, " ").encode("utf-8", "surrogatepass")


def token_bytes(pieces: Sequence[str]) -> list[bytes]:
    """Each token's text as bytes (the module doc), in order."""
    sentencepiece = any(_SP_SPACE in p or _SP_BYTE.fullmatch(p) for p in pieces)
    decode = _sentencepiece if sentencepiece else _byte_level
    return [decode(p) for p in pieces]
