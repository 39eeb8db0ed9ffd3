"""Legacy completions, Anthropic's token count and the model catalog, over the one
request core: parsing, rendering and the estimate. Pure and synchronous; the wire end
to end is in tests/integration/test_endpoints_e2e.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.api.catalog import anthropic_model, model_list, openai_model
from edge.api.completions import DEFAULT_MAX_TOKENS, parse_completions_request
from edge.api.completions_out import CompletionsFolder, CompletionsStreamer
from edge.api.fingerprint import render
from edge.api.messages import parse_messages_request
from edge.api.surfaces import APIS, COMPLETIONS, Heading
from edge.api.tokencount import estimate_input_tokens, parse_count_request
from edge.errors import RequestError
from edge.stream.events import Usage
from edge.stream.logprobs import TokenLogprob, TopLogprob
from edge.stream.output import (
    ContentOut,
    ErrorOut,
    FinishOut,
    LogprobContentOut,
    ReasoningOut,
    RoleOut,
)


def parse(body: dict[str, Any]) -> Any:
    return parse_completions_request(json.dumps(body).encode())


def frames(data: bytes) -> list[Any]:
    text = data.decode()
    return [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]


def test_prompt_is_one_user_message_with_chats_fields() -> None:
    """The prompt (a string, or a list of one) is the one user message; chat's fields
    pass; max_tokens is 16 when absent; reasoning is not asked for; logprobs N is
    chat's logprobs with N alternatives."""
    for prompt in ("Once upon", ["Once upon"]):
        request = parse({"model": "m", "prompt": prompt, "stop": "\n", "temperature": 0.5}).chat
        assert [(m.role, m.content) for m in request.messages] == [("user", "Once upon")]
        assert (request.max_tokens, request.stop, request.temperature) == (
            DEFAULT_MAX_TOKENS, ("\n",), 0.5,
        )  # fmt: skip
        assert request.include_reasoning is False
    scored = parse({"model": "m", "prompt": "x", "max_tokens": 3, "logprobs": 2}).chat
    assert (scored.max_tokens, scored.logprobs, scored.extra["top_logprobs"]) == (3, True, 2)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": [[1, 2]]}, "prompt"),
        ({"model": "m", "prompt": {"text": "x"}}, "prompt"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
        ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": "m", "prompt": "x", "echo": True, "logprobs": 0}, "echo"),
        ({"model": "m", "prompt": "x", "n": 3}, "n"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x"}, "model"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    """Each thing the edge cannot do is a RequestError naming its field."""
    with pytest.raises(RequestError) as refused:
        parse(body)
    assert refused.value.param == param


def test_fourth_api_by_its_path() -> None:
    """/v1/completions is one of the APIs (its scope, metrics label, error shape)."""
    assert APIS["/v1/completions"] is COMPLETIONS
    assert COMPLETIONS.name == "completions"
    status, body = COMPLETIONS.error(400, "invalid_request_error", "no", "c")
    assert (status, body["error"]["code"]) == (400, "c")


LOGPROBS = (TokenLogprob("ab", -0.5, top=(TopLogprob("ab", -0.5), TopLogprob("a", -1.5))),)
USAGE = Usage(input_tokens=3, output_tokens=2)


def test_stream_chunks_echo_logprobs_usage_and_done() -> None:
    """Chunks are text_completion objects: the echoed prompt first, each text piece with
    its legacy logprobs (offsets past the echo), nothing for the role or reasoning, the
    finish chunk, the usage chunk and [DONE], every chunk `usage: null` but the last."""
    request = COMPLETIONS.parse(b'{"model":"m","prompt":"Hi","echo":true,"stream":true,'
                                b'"stream_options":{"include_usage":true}}')  # fmt: skip
    streamer = COMPLETIONS.streamer(request, Heading("r1", 7, "m"))
    data = streamer.encode([RoleOut(), ReasoningOut("hmm"), ContentOut("x")])
    data += streamer.encode([LogprobContentOut("ab", LOGPROBS), FinishOut("length", USAGE)])
    assert data.endswith(b"data: [DONE]\n\n")
    out = frames(data)
    assert {(f["id"], f["object"], f["created"]) for f in out} == {
        ("cmpl-r1", "text_completion", 7)
    }
    choices = [f["choices"][0] for f in out if f["choices"]]
    assert [c["text"] for c in choices] == ["Hi", "x", "ab", ""]
    assert choices[2]["logprobs"] == {
        "tokens": ["ab"], "token_logprobs": [-0.5],
        "top_logprobs": [{"ab": -0.5, "a": -1.5}], "text_offset": [3],
    }  # fmt: skip
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
    assert [f["usage"] for f in out[:-1]] == [None] * 4
    assert out[-1]["usage"]["total_tokens"] == 5


def test_stream_error_is_openais_frame() -> None:
    """A mid-stream error is the OpenAI error object, as chat's; no usage: no usage key."""
    streamer = CompletionsStreamer("cmpl-x", 1, "m", include_usage=False)
    out = frames(streamer.encode([ContentOut("a"), ErrorOut("node_error", "broke")]))
    assert "usage" not in out[0]
    assert out[1] == {
        "error": {"message": "broke", "type": "node_error", "param": None, "code": None}
    }


def test_folder_is_one_text_completion() -> None:
    """The whole answer: the echo and the text joined, legacy logprobs, the finish
    reason (a tool call, which this shape cannot ask for, is `stop`) and usage."""
    folder = CompletionsFolder("cmpl-x", 1, "m", logprobs=True, echo="Q:")
    folder.add([RoleOut(), LogprobContentOut("ab", LOGPROBS), FinishOut("tool_calls", USAGE)])
    body = folder.body()
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Q:ab", "stop")
    assert choice["logprobs"]["text_offset"] == [2]
    assert body["usage"]["prompt_tokens"] == 3


def test_count_request_is_a_messages_request_without_max_tokens() -> None:
    """count_tokens parses what /v1/messages parses, max_tokens not needed, and refuses
    what it refuses."""
    body = {"model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}]}
    counted = parse_count_request(json.dumps(body).encode()).chat
    full = parse_messages_request(json.dumps({**body, "max_tokens": 9}).encode()).chat
    assert counted.messages == full.messages
    with pytest.raises(RequestError, match="messages: Input should be an array"):
        parse_count_request(b'{"model": "m", "messages": "hi"}')


def test_estimate_is_the_renderings_characters_per_token() -> None:
    """The estimate: the canonical rendering's characters // chars_per_token (tools and
    system prompt included, at least 1), the rule the simulated node counts by."""
    tools = [{"name": "t", "description": "d" * 400, "input_schema": {"type": "object"}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}
    plain = parse_count_request(json.dumps(body).encode()).chat
    with_tools = parse_count_request(json.dumps({**body, "tools": tools}).encode()).chat
    chars = sum(map(len, render(plain, "m")))
    assert estimate_input_tokens(plain, chars_per_token=4) == chars // 4
    assert estimate_input_tokens(with_tools, chars_per_token=4) >= chars // 4 + 100
    tiny = parse_count_request(b'{"model":"m","messages":[{"role":"user","content":""}]}')
    assert estimate_input_tokens(tiny.chat, chars_per_token=1000) == 1


def test_catalog_shapes() -> None:
    """OpenAI's model and list; Anthropic's model and its one page (empty: null ids)."""
    assert openai_model("a/b") == {"id": "a/b", "object": "model", "created": 0, "owned_by": "iop"}
    assert anthropic_model("a")["type"] == "model"
    assert model_list(["a", "b"], anthropic=False)["object"] == "list"
    page = model_list(["a", "b"], anthropic=True)
    assert (page["has_more"], page["first_id"], page["last_id"]) == (False, "a", "b")
    assert model_list([], anthropic=True)["first_id"] is None
