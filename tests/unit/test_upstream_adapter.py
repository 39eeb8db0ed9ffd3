"""Tests of the upstream adapter: RunRequest -> request body, SSE chunks -> RunEvents.

The recorded dialect streams (tests/integration/upstream_fixtures) are fed
whole, character by character and split at random points: every split gives
the same events, and every stream ends in exactly one terminal event.
Also: `openai+http(s)://` node addresses and `iop-node`'s settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.cli import build_parser as edge_parser
from edge.config import ConfigError, parse_config, upstream_url
from edge.contract._proto.iop.node import v1 as pb
from edge.nodes.upstream.adapter import (
    MAX_DELTA_CHARS,
    MAX_TOOL_CALL_CHARS,
    MAX_TOOL_CALLS,
    ChunkMapper,
    ToolCallAssembler,
    chat_request_body,
    error_message,
    models_from_body,
)
from edge.nodes.upstream.cli import SettingsError, resolve
from edge.nodes.upstream.cli import build_parser as node_parser
from edge.nodes.upstream.sse import SSEDecoder, SSEMessage

FIXTURES = Path(__file__).parent.parent / "integration" / "upstream_fixtures"
STREAMS = (
    "vllm", "llamacpp", "ollama", "sglang", "stream-error", "truncated",
    "vllm-logprobs", "llamacpp-logprobs",
)  # fmt: skip
TERMINAL = {"complete", "error", "cancelled"}

Event = tuple[str, str, str, dict[str, str], tuple[int, int, int, int] | None]


def _event(ev: Any) -> Event:
    usage = ev.usage
    counts = None
    if usage is not None:
        counts = (
            usage.input_tokens,
            usage.output_tokens,
            usage.reasoning_tokens,
            usage.cached_input_tokens,
        )
    view = dict(ev.metadata)
    assert "tool_calls" not in view, "native calls travel in the typed field only"
    if ev.tool_calls:  # compared in OpenAI's shape, as the edge renders them
        view["tool_calls"] = json.dumps(_openai(ev.tool_calls))
    return (ev.type, ev.delta, ev.error, view, counts)


def _openai(typed: list[pb.ToolCall]) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": c.type, "function": {"name": c.name, "arguments": c.arguments}}
        for c in typed
    ]


def replay(pieces: list[str]) -> list[Event]:
    """The events of a body that arrives in `pieces`, as the server maps them."""
    decoder = SSEDecoder()
    mapper = ChunkMapper(id_prefix="run1")
    out: list[Any] = []
    for piece in pieces:
        for message in decoder.feed(piece):
            out.extend(mapper.feed(message))
    for message in decoder.close():
        out.extend(mapper.feed(message))
    out.extend(mapper.end())
    return [_event(e) for e in out]


def body(name: str) -> str:
    return (FIXTURES / f"{name}.sse").read_text()


def calls(event: Event) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = json.loads(event[3]["tool_calls"])
    return result


# --- the dialects ------------------------------------------------------------------


def test_vllm_reasoning_fragmented_tool_calls_and_usage_chunk() -> None:
    """vLLM: reasoning_content deltas, two calls streamed by index, usage in its own chunk."""
    events = replay([body("vllm")])
    assert [e[:2] for e in events[:-1]] == [
        ("reasoning_delta", "The user wants the weather"),
        ("reasoning_delta", " in Paris and Tokyo."),
    ]
    kind, _, _, metadata, usage = events[-1]
    assert kind == "complete"
    assert metadata["finish_reason"] == "tool_calls"
    assert calls(events[-1]) == [
        {
            "id": "chatcmpl-tool-7c1e2a9b",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "chatcmpl-tool-3f8d6b10",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
        },
    ]
    assert usage == (181, 55, 0, 160)


def test_llamacpp_null_first_delta_timings_and_usage_on_finish_chunk() -> None:
    """llama.cpp: `content: null` first, extra fields ignored, cache_n counted as cached input."""
    events = replay([body("llamacpp")])
    assert [e[:2] for e in events[:-1]] == [
        ("reasoning_delta", "A greeting."),
        ("reasoning_delta", " Answer briefly."),
        ("delta", "Hello"),
        ("delta", "!"),
        ("delta", " How can I help?"),
    ]
    assert events[-1] == ("complete", "", "", {"finish_reason": "stop"}, (24, 12, 0, 16))


def test_ollama_whole_tool_call_without_index_and_no_usage() -> None:
    """Ollama: `reasoning`, one chunk with the whole call, finish "stop", no usage chunk."""
    events = replay([body("ollama")])
    assert events[0][:2] == ("reasoning_delta", "I should call the weather tool.")
    kind, _, _, metadata, usage = events[-1]
    assert (kind, usage, len(events)) == ("complete", None, 2)
    assert metadata["finish_reason"] == "tool_calls"
    assert calls(events[-1]) == [
        {
            "id": "call_k3v9x2mq",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
        }
    ]


def test_sglang_nulls_and_flat_reasoning_tokens() -> None:
    """SGLang: null fields and null ids on later fragments; reasoning_tokens outside details."""
    events = replay([body("sglang")])
    assert [e[:2] for e in events[:-1]] == [
        ("reasoning_delta", "Celsius is expected."),
        ("delta", "Checking "),
        ("delta", "Paris."),
    ]
    assert events[-1][4] == (210, 52, 9, 0)
    (call,) = calls(events[-1])
    assert call["id"] == "call_0b7d1c2e"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_error_object_inside_the_stream_is_the_terminal() -> None:
    """An error chunk mid-stream ends the run with its message; the [DONE] after it is ignored."""
    events = replay([body("stream-error")])
    assert events == [
        ("delta", "Partial", "", {}, None),
        ("error", "", "upstream error: The engine died unexpectedly. (code 500)", {}, None),
    ]


def test_stream_without_done_or_finish_reason_is_an_error() -> None:
    """A body that just stops is not a completion."""
    events = replay([body("truncated")])
    assert [e[1] for e in events[:2]] == ["Once upon", " a time"]
    assert events[-1][0] == "error"
    assert "ended early" in events[-1][2]


def test_finish_reason_without_done_is_complete() -> None:
    """A server that sends finish_reason but forgets [DONE] still completes."""
    text = body("llamacpp").replace("data: [DONE]\n\n", "")
    assert replay([text])[-1][:4] == ("complete", "", "", {"finish_reason": "stop"})


@pytest.mark.parametrize("name", STREAMS)
def test_exactly_one_terminal_last(name: str) -> None:
    """Every stream maps to events with exactly one terminal, and it is the last."""
    events = replay([body(name)])
    assert [e[0] in TERMINAL for e in events].count(True) == 1
    assert events[-1][0] in TERMINAL


@pytest.mark.parametrize("name", STREAMS)
def test_char_by_char_and_crlf_equal_whole(name: str) -> None:
    """Split into single characters, or with CRLF line breaks: the same events."""
    whole = replay([body(name)])
    assert replay(list(body(name))) == whole
    crlf = body(name).replace("\n", "\r\n")
    assert replay(list(crlf)) == whole
    assert replay([crlf]) == whole


@given(
    name=st.sampled_from(STREAMS),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12),
    crlf=st.booleans(),
)
def test_split_invariance(name: str, cuts: list[int], crlf: bool) -> None:
    """Any split of the body (CR and LF halves included) gives the events of the whole."""
    text = body(name).replace("\n", "\r\n") if crlf else body(name)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert replay(pieces) == replay([text])


# --- SSE framing ---------------------------------------------------------------------


def test_sse_comments_events_multiline_data_and_missing_blank_lines() -> None:
    """Comments are skipped, `event:` names the next event, data lines join, EOF flushes."""
    decoder = SSEDecoder()
    messages = decoder.feed(
        ": keep-alive\n\n"
        'data: {"a":1}\n'  # no blank line: dispatched at once
        'data: {"b":2}\n\n'
        "event: error\ndata: boom\n\n"
        "data: line one\ndata: line two\n\n"
        "data:[DONE]"
    )
    messages += decoder.close()
    assert messages == [
        SSEMessage('{"a":1}'),
        SSEMessage('{"b":2}'),
        SSEMessage("boom", "error"),
        SSEMessage("line one\nline two"),
        SSEMessage("[DONE]"),
    ]


def test_event_error_with_plain_text_data() -> None:
    """`event: error` with text data (not JSON) is an error terminal quoting it."""
    mapper = ChunkMapper("r")
    (event,) = mapper.feed(SSEMessage("overloaded", "error"))
    assert (event.type, event.error) == ("error", "upstream error: overloaded")
    assert mapper.feed(SSEMessage("[DONE]")) == []
    assert mapper.end() == []


def test_malformed_chunk_is_an_error() -> None:
    """A data payload that is not JSON ends the run with a clear error."""
    (event,) = ChunkMapper("r").feed(SSEMessage("{not json"))
    assert event.type == "error"
    assert "malformed" in event.error


# --- tool-call assembly --------------------------------------------------------------


def test_tool_calls_sharing_an_index_but_not_an_id_are_separate() -> None:
    """Ollama has sent parallel calls all with index 0: distinct ids keep them apart."""
    tools = ToolCallAssembler()
    tools.feed(
        [
            {"id": "a", "index": 0, "function": {"name": "f", "arguments": '{"x":1}'}},
            {"id": "b", "index": 0, "function": {"name": "g", "arguments": {"y": 2}}},
        ]
    )
    out = tools.typed("run")
    assert [(c.id, c.name, c.arguments) for c in out] == [
        ("a", "f", '{"x":1}'),
        ("b", "g", '{"y":2}'),
    ]


def test_tool_fragments_without_index_or_id() -> None:
    """No index: a named fragment starts a call, an anonymous one extends the last;
    missing ids are generated and empty arguments become {}."""
    tools = ToolCallAssembler()
    tools.feed({"function": {"name": "f", "arguments": '{"q": '}})
    tools.feed([{"function": {"arguments": '"x"}'}}])
    tools.feed([{"function": {"name": "g"}}])
    tools.feed([{"index": 5}, "junk"])  # nameless call: dropped
    out = _openai(tools.typed("run"))
    assert out == [
        {
            "id": "call_run_0",
            "type": "function",
            "function": {"name": "f", "arguments": '{"q": "x"}'},
        },
        {"id": "call_run_1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]


# --- whole completions, errors, model lists ----------------------------------------


def test_non_streaming_completion_is_mapped() -> None:
    """A server that ignored `stream: true` answers one chat.completion: same events."""
    payload = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "reasoning_content": "think",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    events = [_event(e) for e in ChunkMapper("r").feed_completion(payload)]
    assert [e[:2] for e in events[:2]] == [("reasoning_delta", "think"), ("delta", "Hi")]
    assert events[-1][0] == "complete"
    assert events[-1][3]["finish_reason"] == "tool_calls"
    assert events[-1][4] == (3, 2, 0, 0)


@pytest.mark.parametrize(
    ("status", "raw", "expected"),
    [
        (
            400,
            (FIXTURES / "vllm-too-long.400.json").read_bytes(),
            "upstream returned 400: This model's maximum context length is 32768 tokens.",
        ),
        (
            503,
            (FIXTURES / "llamacpp-loading.503.json").read_bytes(),
            "upstream returned 503: Loading model",
        ),
        (
            404,
            (FIXTURES / "ollama-missing.404.json").read_bytes(),
            'upstream returned 404: model "llama3.2" not found',
        ),
        (401, b'{"error": "unauthorized"}', "upstream returned 401: unauthorized"),
        (422, b'{"detail": [{"loc": ["body"]}]}', 'upstream returned 422: [{"loc": ["body"]}]'),
        (502, b"Bad Gateway\n", "upstream returned 502: Bad Gateway"),
        (500, b"", "upstream returned 500: Internal Server Error"),
    ],
)
def test_error_bodies(status: int, raw: bytes, expected: str) -> None:
    """Each server's error body gives `upstream returned STATUS: message`."""
    assert error_message(status, raw, "Internal Server Error").startswith(expected)


def test_error_message_is_bounded() -> None:
    """A huge error body is quoted, not copied."""
    assert len(error_message(500, b"x" * 100_000)) < 600


def test_models_from_body_shapes() -> None:
    """OpenAI's data list and llama.cpp/Ollama's models list both give ids."""
    assert models_from_body(b'{"object":"list","data":[{"id":"a","owned_by":"vllm"}]}') == [
        ("a", "vllm")
    ]
    assert models_from_body(b'{"models":[{"name":"qwen3:8b","model":"qwen3:8b"}]}') == [
        ("qwen3:8b", "")
    ]
    with pytest.raises(ValueError, match="no model list"):
        models_from_body(b'{"object":"list"}')


# --- the request body ------------------------------------------------------------------


def test_request_body_carries_every_field() -> None:
    """Messages (parts, tool calls, tool results), tools, choice, sampling and extras go up."""
    request = pb.RunRequest(
        run_id="r1",
        model="Qwen/Qwen3-8B",
        messages=[
            pb.Message(role="system", content="Be brief."),
            pb.Message(
                role="user",
                parts=[
                    pb.ContentPart(type="text", text="What is this?"),
                    pb.ContentPart(
                        type="image_url",
                        json='{"type":"image_url","image_url":{"url":"data:image/png;base64,AA"}}',
                    ),
                ],
                name="ann",
            ),
            pb.Message(
                role="assistant",
                tool_calls=[pb.ToolCall(id="c1", type="function", name="f", arguments='{"a":1}')],
                reasoning_content="hidden",
            ),
            pb.Message(role="tool", content="42", tool_call_id="c1"),
        ],
        tools=[
            pb.Tool(
                type="function",
                name="f",
                description="does f",
                parameters_json='{"type":"object"}',
                strict=True,
            )
        ],
        tool_choice="f",
        parallel_tool_calls=False,
        temperature=0.2,
        top_p=0.9,
        max_tokens=64,
        stop=["END"],
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=0.3,
        response_format_json='{"type":"json_object"}',
        metadata={"user_tag": "x"},
        deadline_unix_ms=123,
        extra_json='{"top_k": 20, "stream": false, "model": "other"}',
    )
    assert chat_request_body(request) == {
        "model": "Qwen/Qwen3-8B",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                ],
                "name": "ann",
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a":1}'},
                    }
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": "does f",
                    "parameters": {"type": "object"},
                    "strict": True,
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
        "temperature": 0.2,
        "top_p": 0.9,
        "max_tokens": 64,
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.3,
        "stop": ["END"],
        "response_format": {"type": "json_object"},
        "metadata": {"user_tag": "x"},
        "top_k": 20,
    }


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_tool_choice_modes_pass_as_strings(choice: str) -> None:
    request = pb.RunRequest(model="m", tools=[pb.Tool(name="f")], tool_choice=choice)
    assert chat_request_body(request)["tool_choice"] == choice


def test_minimal_request_leaves_defaults_to_the_server() -> None:
    """Absent sampling fields stay absent, so the upstream's defaults apply."""
    request = pb.RunRequest(model="m", messages=[pb.Message(role="user", content="hi")])
    assert chat_request_body(request) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# --- node addresses and iop-node settings ------------------------------------------------


@pytest.mark.parametrize(
    ("address", "url"),
    [
        ("openai+http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
        ("openai+https://models.internal/v1", "https://models.internal/v1"),
        ("127.0.0.1:50051", None),
        ("embedded", None),
    ],
)
def test_upstream_addresses(address: str, url: str | None) -> None:
    """`openai+http(s)://` node addresses name a model server; others are not upstreams."""
    assert upstream_url(address) == url


@pytest.mark.parametrize(
    "address", ["openai+http://", "openai+http://host:99999/v1", "openai+http://h:x"]
)
def test_bad_upstream_addresses_are_config_errors(address: str) -> None:
    """A malformed upstream address is one config error naming the key."""
    doc = {"nodes": [{"name": "n", "address": address}]}
    with pytest.raises(ConfigError, match=r"nodes\[0\]\.address: expected openai\+http://"):
        parse_config(doc, "edge.toml")


def test_config_and_cli_accept_upstream_addresses() -> None:
    """`[[nodes]]` and `iop-edge --node` both take the scheme."""
    doc = {"nodes": [{"name": "local", "address": "openai+http://127.0.0.1:8000/v1"}]}
    assert parse_config(doc, "edge.toml").nodes[0].address == "openai+http://127.0.0.1:8000/v1"
    args = edge_parser().parse_args(["--node", "openai+http://127.0.0.1:8000/v1"])
    assert args.node == ["openai+http://127.0.0.1:8000/v1"]


def test_node_settings_from_file_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The [node] table is read, flags win, `/v1` is added, the key comes from the env."""
    path = tmp_path / "node.toml"
    path.write_text(
        '[node]\nupstream = "http://gpu:8000"\nlisten = "0.0.0.0:7000"\n'
        'models = ["a"]\napi_key_env = "UPSTREAM_KEY"\n'
    )
    monkeypatch.setenv("UPSTREAM_KEY", "sk-test")
    args = node_parser().parse_args(["--config", str(path), "--models", "b,c", "--models", "d"])
    settings = resolve(args)
    assert (settings.host, settings.port, settings.upstream) == (
        "0.0.0.0",
        7000,
        "http://gpu:8000/v1",
    )
    assert settings.models == ("b", "c", "d")
    assert settings.api_key == "sk-test"


def test_node_settings_logprobs(tmp_path: Path) -> None:
    """Logprobs are on by default; `logprobs = false` in [node] or `--no-logprobs` turn
    them off; a value that is not a boolean is an error naming the key."""
    path = tmp_path / "node.toml"
    path.write_text('[node]\nupstream = "http://h/v1"\n')
    assert resolve(node_parser().parse_args(["--config", str(path)])).logprobs is True
    flag = node_parser().parse_args(["--config", str(path), "--no-logprobs"])
    assert resolve(flag).logprobs is False
    path.write_text('[node]\nupstream = "http://h/v1"\nlogprobs = false\n')
    assert resolve(node_parser().parse_args(["--config", str(path)])).logprobs is False
    path.write_text('[node]\nupstream = "http://h/v1"\nlogprobs = "no"\n')
    with pytest.raises(SettingsError, match=r"node\.logprobs"):
        resolve(node_parser().parse_args(["--config", str(path)]))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[node]\nupstream = "http://h/v1"\nport = 1\n', "unknown key node.port"),
        ('[node]\nupstream = "http://h/v1"\nmodels = [1]\n', "node.models: expected a list"),
        ('[node]\nupstream = "http://h/v1"\nread_timeout_s = 0\n', "node.read_timeout_s"),
        ("[node]\nupstream = 5\n", "node.upstream: expected a string"),
        ('[node]\nupstream = "ftp://h"\n', "expected an http:// or https:// URL"),
        (
            '[node]\nupstream = "http://h/v1"\napi_key_env = "IOP_UNSET_KEY_VAR"\n',
            "IOP_UNSET_KEY_VAR is not set",
        ),
        ("[node]\n", "--upstream URL is required"),
    ],
)
def test_node_settings_errors(tmp_path: Path, text: str, message: str) -> None:
    """Each mistake is one line naming what is wrong."""
    path = tmp_path / "node.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=message):
        resolve(node_parser().parse_args(["--config", str(path)]))


# --- bounded reading: what one run may hold of an upstream's answer ---------------------


def _chunk(delta: dict[str, Any]) -> SSEMessage:
    return SSEMessage(json.dumps({"choices": [{"index": 0, "delta": delta}]}))


def test_endless_tool_call_arguments_end_in_an_error_naming_the_limit() -> None:
    """Tool-call argument fragments are held up to MAX_TOOL_CALL_CHARS: past it the run's
    terminal is an error event naming the limit, and later chunks are ignored."""
    mapper = ChunkMapper(id_prefix="r1")
    fragment = {"index": 0, "function": {"name": "f", "arguments": "a" * 65536}}
    events: list[pb.RunEvent] = []
    for _ in range(MAX_TOOL_CALL_CHARS // 65536 + 2):
        events += mapper.feed(_chunk({"tool_calls": [fragment]}))
    events += mapper.feed(SSEMessage("[DONE]"))
    assert [e.type for e in events] == ["error"]
    assert str(MAX_TOOL_CALL_CHARS) in events[0].error


def test_too_many_tool_calls_end_in_an_error() -> None:
    """Each new index starts a call: past MAX_TOOL_CALLS calls the run ends in an error."""
    mapper = ChunkMapper(id_prefix="r1")
    events: list[pb.RunEvent] = []
    for i in range(MAX_TOOL_CALLS + 1):
        events += mapper.feed(_chunk({"tool_calls": [{"index": i, "function": {"name": "f"}}]}))
    assert [e.type for e in events] == ["error"]
    assert str(MAX_TOOL_CALLS) in events[0].error


def test_long_text_is_split_into_deltas_under_the_message_limit() -> None:
    """A long content or reasoning text becomes several deltas of at most MAX_DELTA_CHARS
    characters (each RunEvent stays under gRPC's 4 MiB), together the same text."""
    text = "é" * (2 * MAX_DELTA_CHARS + 7)
    mapper = ChunkMapper(id_prefix="r1")
    events = mapper.feed(_chunk({"content": text, "reasoning_content": text}))
    for kind in ("delta", "reasoning_delta"):
        pieces = [e.delta for e in events if e.type == kind]
        assert len(pieces) == 3
        assert "".join(pieces) == text
        assert all(len(bytes(pb.RunEvent(type=kind, delta=p))) < 4 * 1024 * 1024 for p in pieces)


# --- logprobs ---------------------------------------------------------------------------


def _lp_events(name: str) -> list[pb.RunEvent]:
    decoder = SSEDecoder()
    mapper = ChunkMapper(id_prefix="r1")
    out: list[pb.RunEvent] = []
    for message in [*decoder.feed(body(name)), *decoder.close()]:
        out.extend(mapper.feed(message))
    return out + mapper.end()


def _tokens(events: list[pb.RunEvent]) -> list[tuple[str, float, bytes | None, list[str]]]:
    return [
        (t.token, t.logprob, t.bytes, [a.token for a in t.top_logprobs])
        for e in events
        for t in e.logprobs
    ]


@pytest.mark.parametrize("name", ["vllm-logprobs", "llamacpp-logprobs"])
def test_logprobs_go_on_the_content_deltas(name: str) -> None:
    """Each server's `logprobs.content` arrives on the content delta of its chunk, typed,
    with bytes and alternatives (extra fields such as llama.cpp's `id` ignored); logprobs
    of a reasoning chunk are dropped, as OpenAI gives none for reasoning."""
    events = _lp_events(name)
    assert all(not e.logprobs for e in events if e.type != "delta")
    expected = {
        "vllm-logprobs": [
            ("Hello", -0.0123, b"Hello", ["Hello", "Hi"]),
            (" there", -0.25, b" there", [" there", " world"]),
            ("!", -9999.0, b"!", ["!", "."]),
        ],
        "llamacpp-logprobs": [("Hel", -0.1, b"Hel", ["Hel"]), ("lo", -0.3, b"lo", ["lo"])],
    }
    assert _tokens(events) == expected[name]
    assert events[-1].type == "complete"


def test_logprobs_of_a_chunk_without_content_wait_for_the_next_content() -> None:
    """A chunk carrying only logprobs (a server that held the text back) hands them to the
    next content delta; malformed entries are skipped; alternatives past 20 are not kept."""
    mapper = ChunkMapper(id_prefix="r1")
    tops = [{"token": str(i), "logprob": -i} for i in range(25)]

    def chunk(delta: dict[str, Any], content: list[Any]) -> SSEMessage:
        choice = {"index": 0, "delta": delta, "logprobs": {"content": content}}
        return SSEMessage(json.dumps({"choices": [choice]}))

    events = mapper.feed(chunk({}, [{"token": "a", "logprob": -1, "top_logprobs": tops}, 7]))
    events += mapper.feed(chunk({"content": "ab"}, [{"token": "b", "logprob": None}]))
    assert [e.type for e in events] == ["delta"]
    assert [(t.token, t.logprob, t.bytes) for t in events[0].logprobs] == [
        ("a", -1.0, None),
        ("b", -9999.0, None),
    ]
    assert len(events[0].logprobs[0].top_logprobs) == 20


def test_large_logprobs_are_cut_into_several_events_at_token_ends() -> None:
    """A non-streamed answer's logprobs are cut into delta events that each stay far under
    gRPC's message limit, at token ends, together the same text and tokens."""
    tops = [{"token": "x" * 8, "logprob": -1.0} for _ in range(20)]
    content = [{"token": "word ", "logprob": -0.5, "top_logprobs": tops} for _ in range(5000)]
    mapper = ChunkMapper(id_prefix="r1")
    completion = {
        "choices": [
            {
                "index": 0,
                "message": {"content": "word " * 5000},
                "logprobs": {"content": content},
                "finish_reason": "stop",
            }
        ]
    }
    events = [e for e in mapper.feed_completion(completion) if e.type == "delta"]
    assert len(events) > 1
    assert "".join(e.delta for e in events) == "word " * 5000
    assert sum(len(e.logprobs) for e in events) == 5000
    assert all(len(e.delta) == 5 * len(e.logprobs) for e in events)
    assert all(len(bytes(e)) < 2 * 1024 * 1024 for e in events)


def test_request_caps_top_logprobs_at_twenty() -> None:
    """logprobs and top_logprobs reach the upstream as sent, top_logprobs at most 20."""
    request = pb.RunRequest(model="m", extra_json='{"logprobs": true, "top_logprobs": 50}')
    sent = chat_request_body(request)
    assert (sent["logprobs"], sent["top_logprobs"]) == (True, 20)
