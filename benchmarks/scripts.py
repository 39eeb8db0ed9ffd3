"""The simulated node's scripts and the chat bodies the workloads send.

A script is the JSON the simulated node plays back (`edge.nodes.sim`): what every
workload asks of the node, through the edge or directly. Plain data, no I/O: it must
not know the stack, the load generator or how a figure is measured.
"""

from __future__ import annotations

import json
from typing import Any


def script(*events: dict[str, Any]) -> str:
    return json.dumps({"events": list(events)}, separators=(",", ":"))


def long_script(n: int) -> str:
    return script(
        {"type": "delta", "delta": "tok", "repeat": n},
        {"type": "complete", "usage": {"output_tokens": n}, "metadata": {"finish_reason": "stop"}},
    )


SHORT_SCRIPT = script(
    {"type": "delta", "delta": "hello"},
    {"type": "complete", "usage": {"output_tokens": 1}, "metadata": {"finish_reason": "stop"}},
)
HANG_SCRIPT = script({"type": "delta", "delta": "hello"}, {"type": "hang"})


def chat_body(text: str, *, stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": "sim-script",
        "messages": [{"role": "user", "content": text}],
    }
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()
