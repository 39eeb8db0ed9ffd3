"""sim-script documents for the client suite: what the simulated model says, turn by turn.

A client sends the script as its first user message (or a system message);
`turns(...)` makes a multi-turn script, one list of events per answer the
model gives in an agent loop (see `edge.nodes.sim.script`).
"""

from __future__ import annotations

import json
from typing import Any

Event = dict[str, Any]

USAGE = {"input_tokens": 11, "output_tokens": 7, "reasoning_tokens": 3, "cached_input_tokens": 0}

# The tool every agent loop here declares: one required string.
WEATHER_ARGS = {"city": "Paris"}
BAD_WEATHER_ARGS = {"city": 123}
WEATHER_ANSWER = "It is sunny in Paris."


def say(text: str, *, reasoning: str = "", finish: str = "stop") -> list[Event]:
    """A text answer, word by word, after optional reasoning, with usage."""
    events: list[Event] = []
    if reasoning:
        events.append({"type": "reasoning_delta", "delta": reasoning})
    words = text.split(" ")
    events += [{"type": "delta", "delta": w if i == 0 else " " + w} for i, w in enumerate(words)]
    events.append({"type": "complete", "usage": USAGE, "metadata": {"finish_reason": finish}})
    return events


def call(name: str, arguments: dict[str, Any], call_id: str = "call_1") -> list[Event]:
    """A native tool call (the typed field), with usage."""
    return [
        {
            "type": "complete",
            "usage": USAGE,
            "tool_calls": [{"id": call_id, "name": name, "arguments": arguments}],
        }
    ]


def fail_midway(text: str, error: str) -> list[Event]:
    """Some text, then a node error: the stream must end in an error the client raises."""
    return [{"type": "delta", "delta": text}, {"type": "error", "error": error}]


def script(events: list[Event]) -> str:
    return json.dumps({"events": events})


def turns(*answers: list[Event]) -> str:
    return json.dumps({"turns": [{"events": events} for events in answers]})
