"""Value types for tools: what the caller declared, and what the model called.

Shared by request validation (`edge.api`), the stream core and the node
adapter. Plain frozen data; parsing, synthesis and validation live in
`edge.stream.tools`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

# How calls are held to the declared tools and tool_choice (`edge.stream.toolcheck`):
# "strict" ends the answer at the first violation, "report" returns readable calls
# as written and reports what they break, "off" checks nothing against the tools.
ToolValidation = Literal["strict", "report", "off"]
TOOL_VALIDATION_MODES: Final[tuple[ToolValidation, ...]] = get_args(ToolValidation)

# What a call may break, a closed set (the `rule` label of the violations metric).
ViolationRule = Literal["unknown_tool", "schema", "tool_choice", "parallel_tool_calls"]
VIOLATION_RULES: Final[tuple[ViolationRule, ...]] = get_args(ViolationRule)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One declared function tool (`{"type": "function", "function": {...}}`)."""

    name: str
    description: str = ""
    # The JSON Schema of the arguments; None when the tool declared none.
    parameters: Mapping[str, Any] | None = None
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """The caller's `tool_choice`: `mode` is none/auto/required, or `function` with `name`."""

    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """Everything the core needs to know about the request's tools."""

    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    # Resolved per request by the HTTP layer (`edge.stream.toolcheck.tool_validation_mode`).
    validation: ToolValidation = "strict"
    # A tool declared `"strict": true` is held to its schema whatever the mode, unless
    # the request chose its `tool_validation` itself.
    strict_tools: bool = True

    def spec(self, name: str) -> ToolSpec | None:
        for tool in self.tools:
            if tool.name == name:
                return tool
        return None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call in OpenAI's response shape; `arguments` is a JSON string."""

    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass(frozen=True, slots=True)
class Violation:
    """One way a returned call breaks the declared tools or `tool_choice` (report mode).

    `tool` is the called name ("" for a rule broken by making no call);
    `message` may quote argument values: it is for the caller, never for logs.
    """

    rule: ViolationRule
    tool: str
    message: str
