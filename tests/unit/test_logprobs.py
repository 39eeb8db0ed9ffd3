"""Logprobs through the stream session: carried to the chunk that shows their text, in order,
dropped with the text the session removes (the rule in `edge.stream.logprobs`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from edge.api.render import ResponseBuilder, SSEEncoder
from edge.stream.events import Complete, Delta, LogprobDelta, NodeEvent, ReasoningDelta
from edge.stream.logprobs import (
    MAX_LOGPROB_ENTRIES,
    TokenLogprob,
    TopLogprob,
    _align_from_end,
    think_content_spans,
)
from edge.stream.output import ContentOut, ErrorOut, FinishOut, LogprobContentOut, OutEvent
from edge.stream.session import SessionSettings, StreamSession
from edge.stream.think import ThinkSplitter
from edge.stream.toolcall import ToolPolicy, ToolSpec

TOOLS = ToolPolicy(tools=(ToolSpec("get_weather"),))


def conf(**kwargs: Any) -> SessionSettings:
    return SessionSettings(run_id="r1", logprobs=True, **kwargs)


def tok(text: str, n: int = 0) -> TokenLogprob:
    return TokenLogprob(text, -float(n))


def deltas(tokens: Sequence[str], groups: Sequence[int] = ()) -> list[LogprobDelta]:
    """One delta per token, or tokens grouped `groups[i]` at a time; logprob -i for token i."""
    out: list[LogprobDelta] = []
    i = 0
    sizes = list(groups) or [1] * len(tokens)
    while i < len(tokens):
        size = max(1, sizes[len(out) % len(sizes)])
        chunk = [tok(t, i + k) for k, t in enumerate(tokens[i : i + size])]
        out.append(LogprobDelta("".join(t.token for t in chunk), tuple(chunk)))
        i += size
    return out


def play(events: Sequence[NodeEvent], cfg: SessionSettings) -> list[OutEvent]:
    session = StreamSession(cfg)
    out = session.drain()
    for event in events:
        session.feed(event)
        out += session.drain()
    return out


def chunks(out: Sequence[OutEvent]) -> list[tuple[str, list[str]]]:
    """Each content chunk's text and the tokens it carries."""
    return [(e.text, [t.token for t in e.logprobs or ()]) for e in out if isinstance(e, ContentOut)]


def kept(out: Sequence[OutEvent]) -> list[TokenLogprob]:
    return [t for e in out if isinstance(e, LogprobContentOut) for t in e.logprobs]


END = Complete(metadata={"finish_reason": "stop"})


def test_without_logprobs_content_carries_none() -> None:
    """A session not asked for logprobs writes plain content chunks, even for a node that
    sent logprobs anyway; one asked writes them with logprobs for plain deltas too."""
    events = [Delta("hi"), LogprobDelta(" x", (tok(" x"),)), END]
    out = play(events, SessionSettings(run_id="r1"))
    assert [type(e) for e in out if isinstance(e, ContentOut)] == [ContentOut, ContentOut]
    out = play(events, conf())
    assert [(type(e), e.logprobs) for e in out if isinstance(e, LogprobContentOut)] == [
        (LogprobContentOut, ()),
        (LogprobContentOut, (tok(" x"),)),
    ]


def test_each_chunk_carries_its_own_tokens_in_order() -> None:
    """Plain text: every token goes out with the chunk of its delta, in order, as sent."""
    top = (TopLogprob("Hi", -0.1), TopLogprob("Hey", -2.5, b"Hey"))
    first = TokenLogprob("Hi", -0.1, b"Hi", top)
    out = play([LogprobDelta("Hi", (first,)), *deltas([" there", "!"]), END], conf())
    assert chunks(out) == [("Hi", ["Hi"]), (" there", [" there"]), ("!", ["!"])]
    assert kept(out)[0] == first


def test_leaked_special_token_is_dropped_with_its_logprob() -> None:
    """A sentinel removed from the content takes its token's logprob with it."""
    out = play([*deltas(["Hello", "<|im_end|>"]), END], conf())
    assert [t.token for t in kept(out)] == ["Hello"]


def test_sentinel_split_over_tokens_is_dropped_and_text_after_it_kept() -> None:
    """A sentinel written in several tokens is held, then removed; the tokens after it stay."""
    out = play([*deltas(["A", "<|im", "_end|>", "B"]), END], conf())
    assert chunks(out) == [("A", ["A"]), ("B", ["B"])]


def test_think_block_tokens_are_dropped() -> None:
    """With the think parser, the tags and the reasoning inside carry no logprobs out."""
    tokens = ["<think>", "let me", " see", "</think>", "\n\nYes", "."]
    out = play([*deltas(tokens), END], conf(reasoning_parser="think"))
    assert [t.token for t in kept(out)] == ["\n\nYes", "."]


def test_reasoning_deltas_carry_no_logprobs() -> None:
    """Reasoning from reasoning_delta events is never given logprobs (as OpenAI)."""
    out = play([ReasoningDelta("hmm"), *deltas(["ok"]), END], conf())
    assert [t.token for t in kept(out)] == ["ok"]


def test_tool_call_markup_tokens_are_dropped() -> None:
    """Text before a call written as text keeps its logprobs; the markup's are dropped."""
    tokens = ["Let", " me", " check.", "\n", "<tool_call>", '{"name": "get_weather",',
              ' "arguments": {}}', "</tool_call>"]  # fmt: skip
    out = play([*deltas(tokens), END], conf(tools=TOOLS))
    assert [t.token for t in kept(out)] == ["Let", " me", " check."]


def test_text_after_a_call_keeps_its_logprobs() -> None:
    """Text the answer releases after the calls are cut out is matched to its own tokens."""
    tokens = ["A", "\n", "<tool_call>", '{"name": "get_weather", "arguments": {"city": "D"}}',
              "</tool_call>", "\n", "Done", "."]  # fmt: skip
    out = play([*deltas(tokens), END], conf(tools=TOOLS))
    assert "".join(text for text, _ in chunks(out)) == "A\nDone."
    assert [t.token for t in kept(out)] == ["A", "\n", "Done", "."]


def test_held_text_released_later_keeps_its_logprobs_in_order() -> None:
    """A line-start JSON value is held until it is known not to be a call, then released
    with every token it held, in order, on the chunk that releases it."""
    tokens = ["Temp:", "\n", "{", '"t": 21', "}", "\n", "ok"]
    out = play([*deltas(tokens), END], conf(tools=TOOLS))
    assert "".join(t.token for t in kept(out)) == "".join(tokens)
    assert [t.logprob for t in kept(out)] == [-float(i) for i in range(len(tokens))]


def test_native_calls_drop_the_held_candidate_logprobs() -> None:
    """When native calls win, held markup is dropped, and so are its tokens."""
    native = Complete(metadata={"tool_calls": '[{"name": "get_weather", "arguments": "{}"}]'})
    tokens = ["Sure", ".", "\n", "<tool_call>", '{"name": "x"}']
    out = play([*deltas(tokens), native], conf(tools=TOOLS))
    assert [t.token for t in kept(out)] == ["Sure", "."]


def test_stream_buffer_and_non_stream_keep_logprobs() -> None:
    """Content held until the end (stream_buffer, a non-streaming answer) keeps its tokens."""
    for cfg in (conf(stream_buffer=True), conf(whole_output=True)):
        out = play([*deltas(["a", "b"]), END], cfg)
        assert [t.token for t in kept(out)] == ["a", "b"]


def test_placeholder_has_no_logprobs() -> None:
    """The reasoning-only placeholder is no node's text: an empty logprobs list."""
    out = play([ReasoningDelta("thinking"), END], conf())
    assert [e.logprobs for e in out if isinstance(e, LogprobContentOut)] == [()]


def test_tokens_longer_than_the_delta_sit_on_its_last_character() -> None:
    """Tokens whose texts overrun the delta still go out with it; an empty delta's tokens
    go out with the next character."""
    events = [LogprobDelta("ab", (tok("abc"), tok("d"))), LogprobDelta("", (tok("x"),)), Delta("c")]
    out = play([*events, END], conf())
    assert chunks(out) == [("ab", ["abc", "d"]), ("c", ["x"])]


def test_too_many_held_entries_end_the_answer() -> None:
    """Logprobs held past MAX_LOGPROB_ENTRIES end the answer with output_too_large."""
    top = tuple(TopLogprob("t", -1.0) for _ in range(20))
    many = tuple(TokenLogprob("a", -1.0, None, top) for _ in range(MAX_LOGPROB_ENTRIES // 21 + 1))
    out = play([LogprobDelta("a" * len(many), many), END], conf(whole_output=True))
    assert isinstance(out[-1], ErrorOut)
    assert out[-1].type == "output_too_large"


# --- properties ------------------------------------------------------------------

WORDS = ["Hi", " there", "\n", " x", "{", "}", ":", '"a"', " "]
SPECIAL = ["<|im_end|>", "<think>", "</think>", "<|im", "_end|>"]


def expected_think(tokens: Sequence[str]) -> list[int]:
    """Indices of tokens kept with the think parser, for tokens where sentinel and tags are
    whole tokens and no word holds a `<` (the oracle)."""
    keep: list[int] = []
    inside = False
    for i, t in enumerate(tokens):
        if t == "<|im_end|>":
            continue
        if t == "<think>" and not inside:
            inside = True
        elif t == "</think>" and inside:
            inside = False
        elif not inside:
            keep.append(i)
    return keep


@given(
    tokens=st.lists(st.sampled_from(WORDS + SPECIAL[:3]), max_size=30),
    groups=st.lists(st.integers(1, 5), max_size=6),
)
def test_property_think_and_sentinel_oracle(tokens: list[str], groups: list[int]) -> None:
    """Whole-token sentinels and think tags: exactly the tokens outside think blocks that are
    not sentinels are kept, in order, whatever the grouping of tokens into deltas."""
    out = play([*deltas(tokens, groups), END], conf(reasoning_parser="think"))
    assert [int(-t.logprob) for t in kept(out)] == expected_think(tokens)


@given(
    tokens=st.lists(
        st.sampled_from(
            [*WORDS, *SPECIAL, "<tool_call>", '{"name": "get_weather"}', "</tool_call>", "```"]
        ),
        max_size=30,
    ),
    groups=st.lists(st.integers(1, 6), max_size=6),
    parser=st.sampled_from(["none", "think", "think_start"]),
    tools=st.booleans(),
    buffered=st.booleans(),
)
def test_property_split_invariance_and_same_text(
    tokens: list[str], groups: list[int], parser: str, tools: bool, buffered: bool
) -> None:
    """Grouping tokens into deltas differently never changes which logprobs come out, nor
    their order; the content text is that of a session without logprobs; every chunk's
    tokens come in order."""
    cfg: dict[str, Any] = {
        "reasoning_parser": parser,
        "tools": TOOLS if tools else ToolPolicy(),
        "stream_buffer": buffered,
    }
    one = play([*deltas(tokens), END], conf(**cfg))
    grouped = play([*deltas(tokens, groups), END], conf(**cfg))
    plain = play([*deltas(tokens, groups), END], SessionSettings(run_id="r1", **cfg))
    order = [int(-t.logprob) for t in kept(one)]
    assert order == sorted(order)
    assert order == [int(-t.logprob) for t in kept(grouped)]
    text = "".join(e.text for e in grouped if isinstance(e, ContentOut))
    assert text == "".join(e.text for e in plain if isinstance(e, ContentOut))


@given(tokens=st.lists(st.sampled_from(WORDS), max_size=30), groups=st.lists(st.integers(1, 5)))
def test_property_nothing_removed_means_every_token_kept(
    tokens: list[str], groups: list[int]
) -> None:
    """Text no filter touches keeps every token, each on the chunk holding its last character."""
    out = play([*deltas(tokens, groups), END], conf(tools=TOOLS))
    assert "".join(t.token for t in kept(out)) == "".join(tokens)


@given(text=st.text(alphabet="ab<>/thinkx \n", max_size=40), cut_at=st.integers(0, 40),
       start=st.booleans())  # fmt: skip
def test_property_think_spans_agree_with_the_splitter(text: str, cut_at: int, start: bool) -> None:
    """The content spans computed for what the splitter settled give exactly its content."""
    splitter = ThinkSplitter(start_in_think=start)
    for piece in (text[:cut_at], text[cut_at:]):
        before, inside, lead = splitter.held, splitter.in_think, splitter.leading
        content, _ = splitter.feed(piece)
        buf = before + piece
        settled = buf[: len(buf) - len(splitter.held)]
        spans = think_content_spans(settled, inside=inside, lead=lead)
        assert "".join(settled[a:b] for a, b in spans) == content


def test_alignment_from_the_end() -> None:
    """Cut text is matched to the held text from its end; joining newlines match nothing new."""
    held = '\n<tool_call>{"city": "Dallas"}</tool_call>\nDone.'
    assert _align_from_end("\nDone.", held) == [(len(held) - 6, len(held))]


# --- rendering --------------------------------------------------------------------


def test_sse_chunk_shape_with_and_without_logprobs() -> None:
    """A content chunk with logprobs carries OpenAI's `{"content": [...], "refusal": null}`
    (bytes as a list, unset bytes the token's UTF-8, infinite logprobs as -9999.0); one
    without carries `"logprobs": null`, byte for byte as before."""
    encoder = SSEEncoder("chatcmpl-1", 7, "m", include_usage=False)
    token = TokenLogprob("é", float("-inf"), None, (TopLogprob("é", -0.5, b"\xc3"),))
    frames = encoder.encode([LogprobContentOut("é", (token,)), ContentOut("x")]).split(b"\n\n")
    first = json.loads(frames[0].removeprefix(b"data: "))
    assert first["choices"][0] == {
        "index": 0,
        "delta": {"content": "é"},
        "logprobs": {
            "content": [
                {
                    "token": "é",
                    "logprob": -9999.0,
                    "bytes": [0xC3, 0xA9],
                    "top_logprobs": [{"token": "é", "logprob": -0.5, "bytes": [0xC3]}],
                }
            ],
            "refusal": None,
        },
        "finish_reason": None,
    }
    second = json.loads(frames[1].removeprefix(b"data: "))
    assert second["choices"][0]["logprobs"] is None
    assert frames[1].endswith(b',"logprobs":null,"finish_reason":null}]}')


def test_response_shape_with_and_without_logprobs() -> None:
    """The non-streaming answer: every content token in `choices[0].logprobs.content` when
    asked (an empty list for an answer without content tokens), else null."""
    events: list[OutEvent] = [
        LogprobContentOut("a", (tok("a"),)),
        LogprobContentOut("b", ()),
        LogprobContentOut("c", (tok("c", 2),)),
        FinishOut("stop", None),
    ]
    asked = ResponseBuilder(logprobs=True)
    asked.add(events)
    logprobs = asked.response("id", 1, "m")["choices"][0]["logprobs"]
    assert [t["token"] for t in logprobs["content"]] == ["a", "c"]
    assert logprobs["refusal"] is None
    empty = ResponseBuilder(logprobs=True)
    empty.add([FinishOut("stop", None)])
    assert empty.response("id", 1, "m")["choices"][0]["logprobs"] == {
        "content": [],
        "refusal": None,
    }
    plain = ResponseBuilder()
    plain.add([ContentOut("a"), FinishOut("stop", None)])
    assert plain.response("id", 1, "m")["choices"][0]["logprobs"] is None
