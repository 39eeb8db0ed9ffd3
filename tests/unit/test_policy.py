"""The forwarding policy: caps are 400s naming the field, unsafe fields are dropped,
media URL schemes are allow-listed, and everything else passes unchanged."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.api.policy import ForwardPolicy, apply_policy
from edge.api.request import ChatRequest, parse_chat_request
from edge.errors import RequestError

DEFAULT = ForwardPolicy()
OPEN = ForwardPolicy(
    allow_chat_template=True, allow_ignore_eos=True, media_url_schemes=frozenset({"http", "https"})
)


def request(**fields: Any) -> ChatRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(json.dumps(body).encode())


def with_parts(*parts: dict[str, Any]) -> ChatRequest:
    return request(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}])


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def refused(req: ChatRequest, policy: ForwardPolicy = DEFAULT) -> RequestError:
    with pytest.raises(RequestError) as info:
        apply_policy(req, policy)
    assert info.value.status == 400
    return info.value


def test_a_plain_request_passes_as_the_same_object() -> None:
    """Nothing to drop and nothing over a cap: the request is forwarded untouched."""
    req = request(max_tokens=10, top_k=3, chat_template_kwargs={"enable_thinking": False})
    forwarded = apply_policy(req, DEFAULT)
    assert forwarded.request is req
    assert forwarded.dropped == ()


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_tokens_over_the_cap_name_the_limit(field: str) -> None:
    """Either spelling over the cap is a 400 naming the cap; at the cap it passes."""
    policy = ForwardPolicy(max_output_tokens=100)
    error = refused(request(**{field: 101}), policy)
    assert (error.param, error.code) == ("max_tokens", "invalid_value")
    assert "at most 100 completion tokens, whereas you provided 101" in error.message
    assert apply_policy(request(**{field: 100}), policy).request.max_tokens == 100


def test_no_max_tokens_invents_none() -> None:
    """Absent max_tokens stays absent: the node's own default applies."""
    assert apply_policy(request(), ForwardPolicy(max_output_tokens=5)).request.max_tokens is None


def test_min_tokens_is_bounded_by_the_cap_and_by_max_tokens() -> None:
    policy = ForwardPolicy(max_output_tokens=100)
    assert refused(request(min_tokens=101), policy).param == "min_tokens"
    assert refused(request(min_tokens=20, max_tokens=10), policy).param == "min_tokens"
    assert apply_policy(request(min_tokens=10, max_tokens=10), policy).dropped == ()


def test_chat_template_and_ignore_eos_are_dropped_unless_allowed() -> None:
    """Only the template key leaves chat_template_kwargs; an emptied table leaves too."""
    kwargs = {"chat_template": "{{ x }}", "enable_thinking": True}
    req = request(chat_template_kwargs=kwargs, ignore_eos=True, top_k=1)
    forwarded = apply_policy(req, DEFAULT)
    assert forwarded.request.extra == {
        "chat_template_kwargs": {"enable_thinking": True},
        "top_k": 1,
    }
    assert forwarded.dropped == ("chat_template_kwargs.chat_template", "ignore_eos")
    only = apply_policy(request(chat_template_kwargs={"chat_template": "x"}), DEFAULT)
    assert "chat_template_kwargs" not in only.request.extra
    allowed = apply_policy(req, OPEN)
    assert allowed.request is req


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,AAAA",
        "DATA:image/png;base64,AAAA",
    ],
)
def test_data_urls_always_pass(url: str) -> None:
    assert apply_policy(with_parts(image(url)), DEFAULT).dropped == ()


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/a.png",
        "http://10.0.0.1/",
        "file:///etc/passwd",
        "ftp://x/",
        "gopher://x/",
        "javascript:alert(1)",
        " file:///etc/passwd",
        "\tdata:,x",
        "fi\nle:///etc/passwd",
        "/etc/passwd",
        "",
    ],
)
def test_other_media_urls_are_refused_by_default(url: str) -> None:
    error = refused(with_parts(image(url)))
    assert error.param == "messages[0].content[1].image_url.url"


def test_allowed_schemes_pass_and_file_never_does() -> None:
    assert apply_policy(with_parts(image("HTTPS://example.com/a.png")), OPEN).dropped == ()
    assert refused(with_parts(image("file:///etc/passwd")), OPEN).param is not None


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "image_url", "image_url": "file:///x"}, "image_url"),
        ({"type": "video_url", "video_url": {"url": "file:///x"}}, "video_url.url"),
        ({"type": "audio_url", "audio_url": {"url": "smb://x"}}, "audio_url.url"),
        ({"type": "file", "file": {"file_data": "file:///x"}}, "file.file_data"),
        ({"type": "input_audio", "input_audio": {"data": "http://x/a.wav"}}, "input_audio.data"),
    ],
)
def test_every_media_part_shape_is_checked(part: dict[str, Any], param: str) -> None:
    assert refused(with_parts(part)).param == f"messages[0].content[1].{param}"


def test_inline_base64_data_passes() -> None:
    """Base64 never holds a colon: inline file and audio data are not URLs."""
    parts = (
        {"type": "file", "file": {"file_data": "JVBERi0xLjQK", "filename": "a.pdf"}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    )
    assert apply_policy(with_parts(*parts), DEFAULT).dropped == ()


@given(st.text(max_size=40))
def test_any_url_passes_only_with_an_allowed_scheme(url: str) -> None:
    """For any string, the policy passes it exactly when it starts with data:, or
    http(s): where allowed (case-insensitively); else the 400 names the part."""
    lowered = url.lower()
    for policy, prefixes in ((DEFAULT, ("data:",)), (OPEN, ("data:", "http:", "https:"))):
        req = with_parts(image(url))
        if lowered.startswith(prefixes):
            assert apply_policy(req, policy).dropped == ()
        else:
            assert refused(req, policy).param == "messages[0].content[1].image_url.url"
