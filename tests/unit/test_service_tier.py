"""`service_tier` in and out of each API: what a request may ask, and the tier echoed.

Chat completions and Responses take OpenAI's values ("auto" is the key's default);
Messages takes Anthropic's ("standard_only" is the default tier). The answer says
the tier it ran on: the chat completion and each of its stream chunks, the Response
(streamed: in its snapshots), the Message's usage (Anthropic's words).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.api.messages import parse_messages_request
from edge.api.request import parse_chat_request
from edge.api.responses import parse_responses_request
from edge.api.surfaces import CHAT, MESSAGES, RESPONSES, Api, Heading
from edge.errors import RequestError
from edge.stream.events import Usage
from edge.stream.output import ContentOut, FinishOut, RoleOut

USER = [{"role": "user", "content": "hi"}]
EVENTS = [RoleOut(), ContentOut("hello"), FinishOut("stop", Usage(3, 1))]


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": USER, **fields}).encode()


@pytest.mark.parametrize(("asked", "tier"), [("auto", None), ("priority", "priority"),
                                             ("default", "default"), ("flex", "flex")])  # fmt: skip
def test_openai_tiers_are_read_and_auto_is_the_keys(asked: str, tier: str | None) -> None:
    assert parse_chat_request(_chat(service_tier=asked)).service_tier == tier
    responses = json.dumps({"model": "m", "input": "hi", "service_tier": asked}).encode()
    assert parse_responses_request(responses).chat.service_tier == tier


def test_an_unknown_tier_is_a_400_naming_the_field() -> None:
    with pytest.raises(RequestError) as refused:
        parse_chat_request(_chat(service_tier="scale"))
    assert refused.value.param == "service_tier"
    assert "'flex'" in refused.value.message


@pytest.mark.parametrize(("asked", "tier"), [("auto", None), ("standard_only", "default")])
def test_anthropic_tiers_map_onto_the_edges(asked: str, tier: str | None) -> None:
    body = {"model": "m", "max_tokens": 5, "messages": USER, "service_tier": asked}
    assert parse_messages_request(json.dumps(body).encode()).chat.service_tier == tier
    with pytest.raises(RequestError, match="'auto', 'standard_only'"):
        parse_messages_request(json.dumps({**body, "service_tier": "priority"}).encode())


def _rendered(api: Api, body: bytes, tier: str | None) -> tuple[dict[str, Any], list[Any]]:
    parsed = api.parse(body)
    heading = Heading("run1", 1, "m", tier)
    folder = api.folder(parsed, heading)
    folder.add(EVENTS)
    frames = api.streamer(parsed, heading).encode(EVENTS).decode().split("\n\n")
    payloads = [
        json.loads(line[6:]) for frame in frames for line in frame.splitlines()
        if line.startswith("data: {")
    ]  # fmt: skip
    return folder.body(), payloads


def test_the_chat_completion_and_each_chunk_echo_the_tier() -> None:
    body, chunks = _rendered(CHAT, _chat(), "flex")
    assert body["service_tier"] == "flex"
    assert chunks
    assert all(chunk["service_tier"] == "flex" for chunk in chunks)
    body, chunks = _rendered(CHAT, _chat(), None)  # nothing said: nothing echoed
    assert "service_tier" not in body
    assert all("service_tier" not in chunk for chunk in chunks)


def test_the_response_echoes_the_tier_it_ran_on() -> None:
    request = json.dumps({"model": "m", "input": "hi", "service_tier": "auto"}).encode()
    body, events = _rendered(RESPONSES, request, "default")
    assert body["service_tier"] == "default"
    snapshots = [e["response"] for e in events if "response" in e]
    assert snapshots
    assert all(s["service_tier"] == "default" for s in snapshots)


@pytest.mark.parametrize(("tier", "said"), [("priority", "priority"), ("default", "standard"),
                                            ("flex", "standard")])  # fmt: skip
def test_the_message_usage_says_the_tier_in_anthropics_words(tier: str, said: str) -> None:
    request = json.dumps({"model": "m", "max_tokens": 5, "messages": USER}).encode()
    body, events = _rendered(MESSAGES, request, tier)
    assert body["usage"]["service_tier"] == said
    start = next(e for e in events if e["type"] == "message_start")
    assert start["message"]["usage"]["service_tier"] == said
