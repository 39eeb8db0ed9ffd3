"""A model server's prompt as the tests' fake vLLM makes it: a ChatML chat template
(Qwen's shape: `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per message, then the
generation prompt) and a small byte-level BPE-like tokenizer, whose token strings are
GPT-2's byte-to-character table (`bytes_to_unicode`, written out here as GPT-2's
encoder defines it, apart from iop-node's own inverse)."""

from __future__ import annotations

import re
from typing import Any

_PIECES = re.compile(r"<\|im_(?:start|end)\|>|\s?[^\s<]+|\s+|<")


def _bytes_to_unicode() -> dict[int, str]:
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


BYTE_TO_CHAR = _bytes_to_unicode()


def text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if p.get("type") == "text")
    return content or ""


def template(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    text = "".join(
        f"<|im_start|>{m['role']}\n{text_of(m.get('content'))}<|im_end|>\n" for m in messages
    )
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def tokenize(text: str, vocab: dict[bytes, int], max_bytes: int = 4) -> tuple[list[int], list[str]]:
    """Token ids (from `vocab`, grown as needed) and their byte-level strings: each piece
    of the text cut into chunks of at most `max_bytes` bytes (a character may be cut)."""
    ids: list[int] = []
    strs: list[str] = []
    for piece in _PIECES.findall(text):
        data = piece.encode()
        step = len(data) if piece.startswith("<|") else max_bytes
        for at in range(0, len(data), step):
            chunk = data[at : at + step]
            ids.append(vocab.setdefault(chunk, len(vocab)))
            strs.append("".join(BYTE_TO_CHAR[b] for b in chunk))
    return ids, strs
