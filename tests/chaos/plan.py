"""Chaos scenarios drawn from a seed: what each stream asks for and how its client behaves.

Everything random in a chaos run is drawn here, from one `random.Random(seed)`:
the kind of every stream, its request (a `sim-echo` text or a `sim-script`),
where its client disconnects, how slowly it reads, and when which node is
killed. The same seed and sizes give the same plans, so a failure can be
replayed; the timing of a replay (who races whom) is the machine's.

This module knows the simulated node's script format and the edge's timeouts
(to stay clear of them, or to hit them on purpose), nothing of sockets. From
a plan's script it also knows the answer an uncut run gives (`answer`): the
text, reasoning, tool calls and finish reason a stream a node kill cut
mid-answer must still end with, once the edge moved it to another node.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

# The edge's [timeouts] in a chaos run; scripts are built around them.
FIRST_EVENT_S = 1.5
IDLE_S = 1.5
TOTAL_S = 5.0
KEEPALIVE_S = 0.25

_WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
)

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@dataclass(frozen=True, slots=True)
class Cut:
    """Where the client disconnects. The first condition that holds wins.

    Attributes:
        after_s: seconds after the request was sent (before the first byte,
            or a non-streaming request that is still waiting).
        after_content: after this many content frames were read...
        then_s: ...and this long without reading any more.
        on_finish: right after the finish chunk, before reading `[DONE]`.
        reset: close with a TCP RST (SO_LINGER 0) instead of a FIN.
    """

    after_s: float | None = None
    after_content: int | None = None
    then_s: float = 0.0
    on_finish: bool = False
    reset: bool = False


@dataclass(frozen=True, slots=True)
class Expect:
    """How the stream ends when no node kill gets in the way.

    Attributes:
        terminal: what a client that reads to the end sees: `finish:<reason>`,
            `error:<type>` (an SSE error frame), `http:<status>` (a non-streaming
            answer), or `cut` (the client leaves first).
        node_outcome: the run's outcome in the node's runs log; `cancelled?`
            means cancelled, or no run at all when the client left before the
            edge started one.
        edge_status: the `status` the edge records for the request.
    """

    terminal: str
    node_outcome: str
    edge_status: str


@dataclass(frozen=True, slots=True)
class Answer:
    """The answer an uncut run of a plan gives (the simulated node is deterministic).

    Attributes:
        text: the content, all of it.
        reasoning: the reasoning content, all of it.
        tool_calls: (name, arguments) of each call, in order; arguments parsed JSON.
        finish: the finish reason.
        usage: whether the answer carries usage (asked for on a stream; always on a
            non-streaming answer).
    """

    text: str
    reasoning: str = ""
    tool_calls: tuple[tuple[str, Any], ...] = ()
    finish: str = "stop"
    usage: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    index: int
    kind: str
    request: dict[str, Any]
    expect: Expect
    cut: Cut | None = None
    # Slow reader: bytes per read and the pause after each read.
    read_size: int = 65536
    read_pause_s: float = 0.0
    # A stalled reader: after `stall_after_bytes` it stops reading for `stall_s`, once.
    stall_after_bytes: int | None = None
    stall_s: float = 0.0
    # A keep-alive client: no "Connection: close"; after reading the answer it
    # stays idle this long, then closes its end.
    idle_close_s: float | None = None

    @property
    def stream(self) -> bool:
        return bool(self.request.get("stream"))

    @property
    def body(self) -> bytes:
        return json.dumps(self.request, separators=(",", ":")).encode()

    @property
    def answer(self) -> Answer | None:
        """What an uncut run answers; None when the plan has no whole answer (its run
        hangs, fails or breaks before its end)."""
        return expected_answer(self.request)

    def request_id(self, seed: int) -> str:
        """The X-Request-Id the client sends; the edge logs it with the run id and node."""
        tag = str(self.index) if self.index >= 0 else f"w{-self.index}"
        return f"chaos-{seed}-{tag}"


@dataclass(frozen=True, slots=True)
class Kill:
    """kill -9 `node` once `after_done` streams have ended, plus `delay_s`; restart it
    on the same port `down_s` later. (Counting ended streams spreads the kills over
    the whole load, however many streams run at once.)"""

    node: int
    after_done: int
    delay_s: float
    down_s: float


@dataclass(frozen=True, slots=True)
class Scenario:
    seed: int
    plans: list[Plan]
    kills: list[Kill] = field(default_factory=list)


# Kind -> weight. Every kind appears at least once when there are enough streams.
KINDS: dict[str, int] = {
    "echo": 8,
    "script": 10,
    "long_stream": 30,
    "tool_call": 5,
    "slow_reader": 4,
    "stalled_reader": 2,
    "node_error": 5,
    "node_abort": 5,
    "cut_before_first": 10,
    "cut_mid_stream": 10,
    "cut_tool_holdback": 6,
    "cut_after_finish": 6,
    "timeout_first": 3,
    "timeout_idle": 3,
    "timeout_total": 2,
    "nonstream": 6,
    "nonstream_cut": 6,
    "nonstream_timeout": 2,
}

# Streams a node kill is meant to meet mid-answer: long, with reasoning first and, for
# some, a native tool call at the end. Drawn from a generator of their own (one for
# every MID_ANSWER_EVERY streams), so adding them left the other plans as they were.
MID_ANSWER_EVERY = 10

# Kinds whose client disconnects while the node is still running the run.
CUT_KINDS = frozenset({"cut_before_first", "cut_mid_stream", "cut_tool_holdback", "nonstream_cut"})


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _chat(model: str, content: str, *, stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        **extra,
    }


def _script(*events: dict[str, Any]) -> str:
    return json.dumps({"events": list(events)}, separators=(",", ":"))


def _deltas(rng: random.Random, n: int, max_sleep_ms: int) -> list[dict[str, Any]]:
    """`n` word deltas with short sleeps (well under idle_s) between some of them."""
    items: list[dict[str, Any]] = []
    for i in range(n):
        word = rng.choice(_WORDS)
        items.append({"type": "delta", "delta": word if i == 0 else " " + word})
        if max_sleep_ms and rng.random() < 0.6:
            items.append({"sleep_ms": rng.randint(1, max_sleep_ms)})
    return items


def _complete(finish: str = "stop") -> dict[str, Any]:
    return {
        "type": "complete",
        "usage": {"input_tokens": 3, "output_tokens": 5},
        "metadata": {"finish_reason": finish},
    }


HANG = {"type": "hang"}
OK = Expect("finish:stop", "complete", "success")
CUT = Expect("cut", "cancelled", "cancelled")
TIMEOUT = Expect("error:timeout", "cancelled", "timeout")


def _plan(rng: random.Random, index: int, kind: str) -> Plan:
    reset = rng.random() < 0.3
    if kind == "echo":
        return Plan(index, kind, _chat("sim-echo", _text(rng, rng.randint(1, 40)), stream=True), OK)
    if kind == "script":
        extra = {"stream_options": {"include_usage": True}} if rng.random() < 0.5 else {}
        events = [*_deltas(rng, rng.randint(3, 30), 150), _complete()]
        return Plan(index, kind, _chat("sim-script", _script(*events), stream=True, **extra), OK)
    if kind == "long_stream":
        # A model-like stream: a token every 50-300 ms for 1.5-3 s, 2 s under total_s
        # (on a loaded machine the sim node's sleeps end late; 1 s was too little margin).
        items: list[dict[str, Any]] = []
        elapsed, budget = 0, rng.randint(1500, int(TOTAL_S * 1000) - 2000)
        while elapsed < budget:
            items.append({"type": "delta", "delta": " " + rng.choice(_WORDS)})
            pause = rng.randint(50, 300)
            items.append({"sleep_ms": pause})
            elapsed += pause
        extra = {"stream_options": {"include_usage": True}} if rng.random() < 0.5 else {}
        request = _chat("sim-script", _script(*items, _complete()), stream=True, **extra)
        return Plan(index, kind, request, OK)
    if kind == "tool_call":
        city = rng.choice(["Paris", "Oslo", "Lima"])
        events = [
            {"type": "delta", "delta": "Let me check."},
            {"sleep_ms": rng.randint(1, 30)},
            {"type": "delta", "delta": "\n<tool_call>\n"},
            {"type": "delta", "delta": '{"name": "get_weather", '},
            {"sleep_ms": rng.randint(1, 30)},
            {"type": "delta", "delta": f'"arguments": {{"city": "{city}"}}}}\n</tool_call>'},
            _complete(),
        ]
        request = _chat("sim-script", _script(*events), stream=True, tools=[WEATHER_TOOL])
        return Plan(index, kind, request, Expect("finish:tool_calls", "complete", "success"))
    if kind == "slow_reader":
        # Large deltas, few events: bytes for backpressure without an event flood.
        chunk = _text(rng, rng.randint(150, 300)) + " "
        events = [{"type": "delta", "delta": chunk, "repeat": rng.randint(20, 120)}, _complete()]
        request = _chat("sim-script", _script(*events), stream=True)
        return Plan(
            index,
            kind,
            request,
            OK,
            read_size=rng.choice([1024, 2048, 4096]),
            read_pause_s=rng.uniform(0.001, 0.004),
        )
    if kind == "stalled_reader":
        # The client stops reading for longer than idle_s while the answer (more
        # than the socket buffers hold) waits in the edge: no timeout may follow.
        chunk = _text(rng, rng.randint(500, 700)) + " "
        events = [{"type": "delta", "delta": chunk, "repeat": rng.randint(150, 250)}, _complete()]
        request = _chat("sim-script", _script(*events), stream=True)
        return Plan(
            index,
            kind,
            request,
            OK,
            stall_after_bytes=65536,
            stall_s=rng.uniform(IDLE_S + 0.2, IDLE_S + 0.7),
        )
    # At least one delta first: a node failure before any output is failed over (and,
    # on every node, answered with a real 502), not the error frame these plans expect.
    if kind == "node_error":
        events = [*_deltas(rng, rng.randint(1, 5), 30), {"type": "error", "error": "GPU on fire"}]
        request = _chat("sim-script", _script(*events), stream=True)
        return Plan(index, kind, request, Expect("error:run_error", "error", "error"))
    if kind == "node_abort":
        events = [*_deltas(rng, rng.randint(1, 5), 30), {"type": "abort"}]
        request = _chat("sim-script", _script(*events), stream=True)
        return Plan(index, kind, request, Expect("error:run_error", "aborted", "error"))
    if kind == "cut_before_first":
        # The first event comes late (or never); the client leaves before it.
        events = [HANG] if rng.random() < 0.5 else [{"sleep_ms": 600}, *_deltas(rng, 3, 0), HANG]
        early = rng.random() < 0.3
        after = rng.uniform(0.0, 0.005) if early else rng.uniform(0.02, 0.4)
        request = _chat("sim-script", _script(*events), stream=True)
        return Plan(
            index,
            kind,
            request,
            Expect("cut", "cancelled?", "cancelled"),
            cut=Cut(after_s=after, reset=reset),
        )
    if kind == "cut_mid_stream":
        n = rng.randint(2, 20)
        events = [*_deltas(rng, n, 150), HANG]
        request = _chat("sim-script", _script(*events), stream=True)
        cut = Cut(after_content=rng.randint(1, n), then_s=rng.uniform(0, 0.2), reset=reset)
        return Plan(index, kind, request, CUT, cut=cut)
    if kind == "cut_tool_holdback":
        # Tool-call markup streams slowly and is held back; the client leaves meanwhile.
        events = [
            {"type": "delta", "delta": "Let me look that up."},
            {"sleep_ms": 20},
            {"type": "delta", "delta": "\n<tool_call>\n"},
            {"sleep_ms": rng.randint(20, 80)},
            {"type": "delta", "delta": '{"name": "get_weather", '},
            {"sleep_ms": rng.randint(20, 80)},
            {"type": "delta", "delta": '"arguments": {"city": "Pa'},
            HANG,
        ]
        request = _chat("sim-script", _script(*events), stream=True, tools=[WEATHER_TOOL])
        cut = Cut(after_content=1, then_s=rng.uniform(0.05, 0.4), reset=reset)
        return Plan(index, kind, request, CUT, cut=cut)
    if kind == "cut_after_finish":
        if rng.random() < 0.5:
            request = _chat("sim-echo", _text(rng, rng.randint(1, 20)), stream=True)
        else:
            events = [*_deltas(rng, rng.randint(1, 10), 60), _complete()]
            request = _chat("sim-script", _script(*events), stream=True)
        return Plan(
            index,
            kind,
            request,
            Expect("cut", "complete", "success"),
            cut=Cut(on_finish=True, reset=reset),
        )
    if kind == "timeout_first":
        events = [HANG] if rng.random() < 0.5 else [{"sleep_ms": 3000}, _complete()]
        return Plan(index, kind, _chat("sim-script", _script(*events), stream=True), TIMEOUT)
    if kind == "timeout_idle":
        events = [*_deltas(rng, rng.randint(1, 5), 30), HANG]
        return Plan(index, kind, _chat("sim-script", _script(*events), stream=True), TIMEOUT)
    if kind == "timeout_total":
        # Events keep coming (never idle) but the run outlasts total_s.
        steps = int(TOTAL_S / 0.3) + 6
        events = [x for _ in range(steps) for x in (*_deltas(rng, 1, 0), {"sleep_ms": 300})]
        request = _chat("sim-script", _script(*events, _complete()), stream=True)
        return Plan(index, kind, request, TIMEOUT)
    if kind == "nonstream":
        if rng.random() < 0.5:
            request = _chat("sim-echo", _text(rng, rng.randint(1, 30)), stream=False)
        else:
            events = [*_deltas(rng, rng.randint(1, 20), 60), _complete()]
            request = _chat("sim-script", _script(*events), stream=False)
        return Plan(index, kind, request, Expect("http:200", "complete", "success"))
    if kind == "nonstream_cut":
        events = [*_deltas(rng, rng.randint(0, 5), 30), HANG]
        request = _chat("sim-script", _script(*events), stream=False)
        cut = Cut(after_s=rng.uniform(0.01, 0.4), reset=reset)
        return Plan(index, kind, request, Expect("cut", "cancelled?", "cancelled"), cut=cut)
    if kind == "nonstream_timeout":
        events = [*_deltas(rng, rng.randint(0, 3), 30), HANG]
        request = _chat("sim-script", _script(*events), stream=False)
        return Plan(index, kind, request, Expect("http:504", "cancelled", "timeout"))
    raise ValueError(f"unknown kind {kind!r}")


def _long_answer(rng: random.Random, index: int) -> Plan:
    """A model-like answer of 2-3 s (2 s under total_s): reasoning, then text, a token
    every 50-250 ms; half of them end with a native tool call. Usage asked for."""
    items: list[dict[str, Any]] = []
    elapsed, budget = 0, rng.randint(2000, int(TOTAL_S * 1000) - 2000)
    thinking = rng.randint(budget // 4, budget // 2)
    while elapsed < budget:
        kind = "reasoning_delta" if elapsed < thinking else "delta"
        items.append({"type": kind, "delta": " " + rng.choice(_WORDS)})
        pause = rng.randint(50, 250)
        items.append({"sleep_ms": pause})
        elapsed += pause
    end = _complete()
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        city = rng.choice(["Paris", "Oslo", "Lima"])
        call = {"id": f"call_{index}", "name": "get_weather", "arguments": {"city": city}}
        end = {**_complete("tool_calls"), "tool_calls": [call]}
        extra["tools"] = [WEATHER_TOOL]
    request = _chat("sim-script", _script(*items, end), stream=True, **extra)
    expect = Expect(f"finish:{end['metadata']['finish_reason']}", "complete", "success")
    return Plan(index, "long_answer", request, expect)


def _repeat(item: dict[str, Any]) -> int:
    return int(item.get("repeat", 1))


def expected_answer(request: dict[str, Any]) -> Answer | None:
    """The answer an uncut run of `request` gives, from its model and script (see
    docs/simulated-node.md); None when the run does not end with a whole answer."""
    content = request["messages"][-1]["content"]
    usage = not request.get("stream") or bool(
        (request.get("stream_options") or {}).get("include_usage")
    )
    if request["model"] == "sim-echo":
        return Answer(content, usage=usage)
    events = json.loads(content)["events"]
    text = "".join(str(e["delta"]) * _repeat(e) for e in events if e.get("type") == "delta")
    reasoning = "".join(
        str(e["delta"]) * _repeat(e) for e in events if e.get("type") == "reasoning_delta"
    )
    end = events[-1] if events else {}
    if end.get("type") != "complete":
        return None  # a hang, an error, an abort: no whole answer
    finish = str((end.get("metadata") or {}).get("finish_reason", "stop"))
    calls = tuple((str(c["name"]), c["arguments"]) for c in end.get("tool_calls") or ())
    if request.get("tools") and "<tool_call>" in text:
        # Tool-call markup in the text: the edge parses it into a call (`tool_call`).
        text, _, markup = text.partition("<tool_call>")
        call = json.loads(markup.partition("</tool_call>")[0])
        calls = ((str(call["name"]), call["arguments"]),)
        text, finish = text.rstrip("\n"), "tool_calls"
    return Answer(text, reasoning, calls, finish, usage)


def _kinds(rng: random.Random, n: int) -> list[str]:
    names = list(KINDS)
    kinds = names[:n] if n < len(names) else list(names)
    weights = [KINDS[k] for k in names]
    kinds += rng.choices(names, weights, k=max(0, n - len(names)))
    rng.shuffle(kinds)
    return kinds


def _idle_close(rng: random.Random, index: int) -> Plan:
    stream = rng.random() < 0.5
    request = _chat("sim-echo", _text(rng, rng.randint(1, 10)), stream=stream)
    expect = OK if stream else Expect("http:200", "complete", "success")
    return Plan(index, "idle_close", request, expect, idle_close_s=rng.uniform(0.05, 0.3))


def make_scenario(
    seed: int, streams: int, nodes: int, node_kills: int, idle_close: int = 0
) -> Scenario:
    """The plans of `streams` streams and the node kills, all drawn from `seed`.

    `idle_close` keep-alive clients, and one `long_answer` stream for every
    MID_ANSWER_EVERY streams, are drawn from generators of their own and spread
    among the streams, so adding them leaves the other plans as they were.
    """
    rng = random.Random(seed)
    plans = [_plan(rng, i, kind) for i, kind in enumerate(_kinds(rng, streams))]
    extra = random.Random(f"idle-close-{seed}")
    for i in range(idle_close):
        plans.insert(extra.randint(0, len(plans)), _idle_close(extra, streams + i))
    mid = random.Random(f"mid-answer-{seed}")
    for i in range(streams // MID_ANSWER_EVERY):
        index = streams + idle_close + i
        plans.insert(mid.randint(0, len(plans)), _long_answer(mid, index))
    kills: list[Kill] = []
    if nodes > 0 and streams > 0:
        lo, hi = max(1, streams // 6), max(1, streams * 5 // 6)
        for _ in range(node_kills):
            kills.append(
                Kill(
                    node=rng.randrange(nodes),
                    after_done=rng.randint(lo, hi),
                    delay_s=rng.uniform(0.0, 0.3),
                    down_s=rng.uniform(0.2, 0.8),
                )
            )
    kills.sort(key=lambda k: (k.after_done, k.delay_s))
    return Scenario(seed, plans, kills)


def warmup_plans(seed: int) -> list[Plan]:
    """A few short streams of each quick kind, run before the baseline is taken."""
    rng = random.Random(f"warmup-{seed}")
    kinds = [
        "echo",
        "script",
        "tool_call",
        "node_error",
        "node_abort",
        "cut_mid_stream",
        "cut_after_finish",
        "nonstream",
        "nonstream_cut",
    ] * 2
    return [_plan(rng, -1 - i, kind) for i, kind in enumerate(kinds)]
