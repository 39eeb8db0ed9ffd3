"""The RunRequest bytes sent to a node read back as the RunRequest built from the request."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from edge.api.fingerprint import fingerprint
from edge.api.request import ChatRequest, parse_chat_request
from edge.contract._proto.iop.node import v1 as pb
from edge.contract.prefix import MAX_PREFIX_BLOCKS, PREFIX_BLOCK_CHARS
from edge.node.convert import run_request_from_chat
from edge.node.grpc import BoundedCodec
from edge.node.wire import DEADLINE_ROOM, EncodedRunRequest, deadline_field, prepare_run_request
from edge.nodes.kit import NodeCodec

_TEXT = st.text(max_size=12)
_OPT_FLOAT = st.none() | st.floats(0, 1, allow_nan=False)


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any]:
    message = st.one_of(
        st.builds(lambda c: {"role": "user", "content": c}, _TEXT),
        st.builds(
            lambda t: {"role": "user", "content": [{"type": "text", "text": t},
                                                   {"type": "image_url",
                                                    "image_url": {"url": "u"}}]},
            _TEXT,
        ),
        st.builds(lambda n, a: {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": n, "arguments": a}}]},
            st.sampled_from(["f", "g"]), _TEXT),
        st.builds(lambda c: {"role": "tool", "tool_call_id": "c1", "content": c}, _TEXT),
        st.builds(lambda r: {"role": "assistant", "content": "", "reasoning_content": r}, _TEXT),
    )  # fmt: skip
    body: dict[str, Any] = {
        "model": "m",
        "messages": draw(st.lists(message, min_size=1, max_size=4)),
        "temperature": draw(_OPT_FLOAT),
        "top_p": draw(st.none() | st.floats(0.01, 1, allow_nan=False)),
        "max_tokens": draw(st.none() | st.integers(1, 2**32 - 1)),
        "seed": draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        "stop": draw(st.lists(_TEXT, max_size=3)),
        "metadata": draw(st.dictionaries(st.text(max_size=4), _TEXT, max_size=3)),
        "include_reasoning": draw(st.booleans()),
        "user": draw(st.none() | _TEXT),
    }
    if draw(st.booleans()):
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": draw(_TEXT),
                    "strict": draw(st.none() | st.booleans()),
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                },
            }
        ]
        body["tool_choice"] = draw(st.sampled_from(["auto", "none", "required"]))
        body["parallel_tool_calls"] = draw(st.booleans())
    if draw(st.booleans()):
        body["response_format"] = {"type": "json_object"}
    return {k: v for k, v in body.items() if v is not None}


def _expected(request: ChatRequest, deadline: int) -> pb.RunRequest:
    """The RunRequest the edge builds, with its prefix fingerprint."""
    expected = run_request_from_chat(request, run_id="r1", model="m", deadline_unix_ms=deadline)
    prefix = fingerprint(request, "m", block_chars=PREFIX_BLOCK_CHARS, max_blocks=MAX_PREFIX_BLOCKS)
    expected.prefix_blocks = prefix.blocks.tolist()
    expected.prompt_chars = prefix.chars
    return expected


@given(_bodies(), st.integers(0, 2**62))
def test_encoded_request_reads_back_whole(body: dict[str, Any], deadline: int) -> None:
    """For any request, the bytes a node receives parse to the RunRequest the edge built.

    Sent and received through the codecs the edge and the nodes use: the edge's
    sends the encoded bytes as they are, the node's parses them.
    """
    request = parse_chat_request(json.dumps(body).encode())
    expected = _expected(request, deadline)
    encoded = prepare_run_request(request, run_id="r1", model="m").attempt(deadline)
    assert encoded.run_id == "r1"
    sent = BoundedCodec().encode(encoded, EncodedRunRequest)
    assert sent == bytes(encoded)
    decoded = NodeCodec().decode(sent, pb.RunRequest)
    assert decoded.to_dict() == expected.to_dict()
    # Field presence too (`optional` fields set to their default are kept).
    assert bytes(decoded) == bytes(expected)


@given(_bodies(), st.integers(0, 2**62))
def test_a_kept_message_is_what_the_bytes_say_but_the_routing_blocks(
    body: dict[str, Any], deadline: int
) -> None:
    """A request that keeps its RunRequest's message (for a node whose runs the edge relays
    itself) sends the same bytes; the message, which every attempt shares with its own
    deadline beside it, is the RunRequest those bytes hold less its deadline and its
    prefix blocks (the routing's)."""
    request = parse_chat_request(json.dumps(body).encode())
    kept = prepare_run_request(request, run_id="r1", model="m", keep_message=True)
    plain = prepare_run_request(request, run_id="r1", model="m")
    assert plain.message is None
    assert kept.body == plain.body
    encoded = kept.attempt(deadline)
    assert (encoded.message, encoded.deadline_unix_ms) == (kept.message, deadline)
    assert kept.message is not None
    expected = _expected(request, 0)
    expected.prefix_blocks = []
    assert bytes(kept.message) == bytes(expected)


@given(_bodies(), st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=3))
def test_one_serialization_serves_every_attempt_with_its_own_deadline(
    body: dict[str, Any], deadlines: list[int]
) -> None:
    """A request's RunRequest is serialized once, without a deadline; each attempt's bytes
    (the same request bytes, that attempt's deadline appended) read back, through the
    node's codec, as the whole RunRequest with that attempt's deadline."""
    request = parse_chat_request(json.dumps(body).encode())
    prepared = prepare_run_request(request, run_id="r1", model="m")
    assert pb.RunRequest.FromString(prepared.body).deadline_unix_ms == 0
    for deadline in deadlines:
        encoded = prepared.attempt(deadline)
        assert encoded.run_id == "r1"
        assert len(encoded) == len(bytes(encoded))
        assert bytes(encoded).startswith(prepared.body)
        decoded = NodeCodec().decode(BoundedCodec().encode(encoded, EncodedRunRequest),
                                     pb.RunRequest)  # fmt: skip
        expected = _expected(request, deadline)
        assert bytes(decoded) == bytes(expected)


@given(st.integers(-(2**63), 2**63 - 1))
def test_an_attempts_deadline_is_written_as_the_generated_code_writes_it(deadline: int) -> None:
    """The deadline field written by hand (on the loop, per attempt) is byte for byte the
    generated code's, and fits the room the size check keeps for it."""
    written = deadline_field(deadline)
    assert written == bytes(pb.RunRequest(deadline_unix_ms=deadline))
    assert len(written) <= DEADLINE_ROOM
    assert len(deadline_field(-1)) == DEADLINE_ROOM
