"""Fixtures of the real-server tests (`make real`): llama.cpp's own `llama-server`, built
once into the cache by `tests/real/build-llama-server`, serving a tiny model made at the
start of the session (`tinymodel`), with `iop-node` and the edge in front of it.

Without the binary the tests skip and say how to build it (`make real` does, first);
under CI=true they fail instead. `make test` does not collect this folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import SimProcess, start_upstream_node, stop_process
from tests.real import llamacpp

# The edge and iop-node's flags the tests run with: iop-node reads the load every 0.2 s.
NODE_ARGS = ("--load-interval-s", "0.2")


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    path = llamacpp.binary_path()
    if not os.access(path, os.X_OK):
        message = (
            f"llama-server is not built at {path}: `make real` builds it "
            "(tests/real/build-llama-server: 5-35 min on 2 cores, once)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def tiny_model(llama_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        from tests.real.tinymodel import make  # gguf and numpy: `make real` installs them
    except ImportError as exc:
        pytest.fail(f"{exc}: `make real` installs what the model is made with (.[real])")

    models = llama_binary.parent / "models"
    out = tmp_path_factory.mktemp("model") / "tiny.gguf"
    return make(models / "ggml-vocab-qwen2.gguf", models / "Qwen-Qwen2.5-7B-Instruct.jinja", out)


@pytest.fixture(scope="module")
def llama(
    llama_binary: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[llamacpp.LlamaServer]:
    """One llama-server for a module: two slots of 2,048 tokens."""
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    server = llamacpp.start(llama_binary, tiny_model, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def iop_node(
    llama: llamacpp.LlamaServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SimProcess]:
    """iop-node (a process) in front of the module's llama-server."""
    runs = tmp_path_factory.mktemp("iop-node") / "runs.jsonl"
    node = start_upstream_node(runs, llama.url, *NODE_ARGS)
    yield node
    stop_process(node.process)
