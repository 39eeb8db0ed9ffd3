"""A tiny llama model for a real llama.cpp server, made on the spot (no weights to download).

It carries a real tokenizer, Qwen2's, copied from the vocabulary file llama.cpp ships
(`models/ggml-vocab-qwen2.gguf`), and Qwen2.5-Instruct's chat template (ChatML, tools
as `<tool_call>`), also from llama.cpp's source: what the server parses, renders and
counts is a real model's.

Its weights make it a chain of words, seeded: its next token depends on its last one
only, and is always a lowercase word with its leading space (" harbor"), each word
followed by the next on one long cycle through the ~22,000 such words, with a margin
of several logits over any other token. So its answer is the same for the same
prompt on any machine and whatever the server's batching (random weights let a
near-tie flip between a prefill and a decode), and a text it wrote tokenizes back
into the same tokens (each word is one pre-tokenizer piece): an answer cut and
continued from its text goes on exactly as it would have. The attention and
feed-forward weights are zero (two layers of them, which the server still runs).

    python -m tests.real.tinymodel VOCAB TEMPLATE OUT
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gguf
import numpy as np

# The shape: the server runs two layers of 64 wide (their weights zero).
LAYERS = 2
EMBEDDING = 64
HEADS = 4
FEED_FORWARD = 128
CONTEXT = 2048
SEED = 1234
# The words the model writes: a space and 3-10 lowercase letters, one token each.
WORD = re.compile(r"\u0120[a-z]{3,10}")
# The logit of the next word: the RMS-normed hidden state is 8 (the square root of the
# width) times a unit vector, so the next word's logit is 8 x SCALE, and any other's
# at most about 0.6 of it (random unit vectors in 64 dimensions).
SCALE = 2.0
# Tokenizer fields copied from the vocabulary file as they are.
_TOKENIZER = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.bos_token_id",
)


def _field(reader: gguf.GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def make(vocab: Path, template: Path, out: Path) -> Path:
    """Write the model to `out` (atomically: a half-written file is never found)."""
    reader = gguf.GGUFReader(vocab)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list)
    n_vocab = len(tokens)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_name("iop-tiny")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBEDDING // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(str(_field(reader, "tokenizer.ggml.model")))
    writer.add_tokenizer_pre(str(_field(reader, "tokenizer.ggml.pre")))
    writer.add_token_list(tokens)
    token_types = _field(reader, "tokenizer.ggml.token_type")
    assert isinstance(token_types, list)
    writer.add_token_types(token_types)
    merges = _field(reader, "tokenizer.ggml.merges")
    assert isinstance(merges, list)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(int(str(_field(reader, "tokenizer.ggml.eos_token_id"))))
    writer.add_pad_token_id(int(str(_field(reader, "tokenizer.ggml.padding_token_id"))))
    writer.add_bos_token_id(int(str(_field(reader, "tokenizer.ggml.bos_token_id"))))
    writer.add_add_bos_token(False)
    writer.add_chat_template(template.read_text())

    rng = np.random.default_rng(SEED)
    words = [i for i, t in enumerate(tokens) if WORD.fullmatch(str(t)) and token_types[i] == 1]
    cycle = rng.permutation(np.array(words))
    embedding = rng.standard_normal((n_vocab, EMBEDDING)).astype(np.float32)
    # Any other token (a prompt's last one) reads as a word: its next token is that word's.
    others = np.setdiff1d(np.arange(n_vocab), cycle)
    embedding[others] = embedding[rng.choice(cycle, size=len(others))]
    embedding /= np.linalg.norm(embedding, axis=1, keepdims=True)
    output = np.zeros((n_vocab, EMBEDDING), dtype=np.float32)
    output[np.roll(cycle, -1)] = SCALE * embedding[cycle]  # word -> the next on the cycle

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    writer.add_tensor("token_embd.weight", embedding)
    writer.add_tensor("output_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", zeros(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", zeros(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_up.weight", zeros(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_down.weight", zeros(EMBEDDING, FEED_FORWARD))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


if __name__ == "__main__":
    make(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
