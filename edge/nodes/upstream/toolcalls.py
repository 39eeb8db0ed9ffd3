"""Streamed tool-call fragments folded into whole calls, bounded.

`ToolCallAssembler` takes the `tool_calls` fragments of an upstream's
chunks in any of the dialects (by `index`, by `id`, whole calls without
either, Ollama's object arguments) and gives the calls as the contract
types them, for the run's complete event. What it holds is bounded
(MAX_TOOL_CALLS, MAX_TOOL_CALL_CHARS): the calls travel in one gRPC message.

Pure: it must not know sockets, httpx, grpclib or asyncio, nor the rest of a chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Final

from edge.contract._proto.iop.node import v1 as pb
from edge.contract.routes import MAX_MESSAGE_BYTES

__all__ = ["MAX_TOOL_CALLS", "MAX_TOOL_CALL_CHARS", "ToolCallAssembler", "ToolCallLimitError"]

# What one run's streamed tool calls may add up to: their names and argument
# fragments in characters, and their number. The calls travel in the complete
# event's typed `tool_calls`, one gRPC message: at most 4 bytes a character in
# UTF-8, they take at most half of it (512 Ki characters of the 4 MiB).
MAX_TOOL_CALL_CHARS: Final = MAX_MESSAGE_BYTES // 8
MAX_TOOL_CALLS: Final = 256


@dataclass(slots=True)
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


def _arguments(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # Ollama-native objects


class ToolCallLimitError(ValueError):
    """The upstream's tool calls passed MAX_TOOL_CALL_CHARS or MAX_TOOL_CALLS."""


class ToolCallAssembler:
    """Streamed tool-call fragments folded into whole calls, in the order they began.

    A fragment joins the call with its `index` unless it names a different
    `id`; without an index it joins the call with its id, starts a new call if
    it has an id or a name, and otherwise extends the last call.

    What it holds is bounded: past MAX_TOOL_CALLS calls or MAX_TOOL_CALL_CHARS
    characters of ids, names and arguments, `feed` raises ToolCallLimitError.
    """

    __slots__ = ("_by_index", "_chars", "calls")

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self._by_index: dict[int, _Call] = {}
        self._chars = 0

    def feed(self, fragments: object) -> None:
        if isinstance(fragments, dict):
            fragments = [fragments]
        if not isinstance(fragments, list):
            return
        for fragment in fragments:
            if isinstance(fragment, dict):
                self._fragment(fragment)

    def _fragment(self, fragment: dict[str, Any]) -> None:
        function = fragment.get("function")
        fn: dict[str, Any] = function if isinstance(function, dict) else {}
        call_id = fragment.get("id") if isinstance(fragment.get("id"), str) else ""
        name = fn.get("name") or fragment.get("name")
        name = name if isinstance(name, str) else ""
        index = fragment.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            index = None
        call: _Call | None = None
        if index is not None:
            call = self._by_index.get(index)
            if call is not None and call_id and call.id and call_id != call.id:
                call = None
        elif call_id:
            call = next((c for c in self.calls if c.id == call_id), None)
        elif not name and self.calls:
            call = self.calls[-1]
        if call is None:
            if len(self.calls) >= MAX_TOOL_CALLS:
                raise ToolCallLimitError(f"upstream sent more than {MAX_TOOL_CALLS} tool calls")
            call = _Call()
            self.calls.append(call)
            if index is not None:
                self._by_index[index] = call
        arguments = _arguments(fn.get("arguments", fragment.get("arguments")))
        kept = len(arguments)
        if call_id and not call.id:
            call.id = call_id
            kept += len(call.id)
        if name and not call.name:
            call.name = name
            kept += len(name)
        self._chars += kept
        if self._chars > MAX_TOOL_CALL_CHARS:
            raise ToolCallLimitError(
                f"upstream tool calls exceed {MAX_TOOL_CALL_CHARS} characters"
                " of ids, names and arguments"
            )
        if arguments:
            call.arguments.append(arguments)

    def typed(self, id_prefix: str) -> list[pb.ToolCall]:
        """The named calls, as the contract types them; a missing id becomes `call_{prefix}_{n}`."""
        out: list[pb.ToolCall] = []
        for call in self.calls:
            if not call.name:
                continue
            out.append(
                pb.ToolCall(
                    id=call.id or f"call_{id_prefix}_{len(out)}",
                    type="function",
                    name=call.name,
                    arguments="".join(call.arguments) or "{}",
                )
            )
        return out
