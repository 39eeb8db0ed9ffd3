"""`iop-node` applies the edge's forwarding policy to every run, whoever calls it.

Invariants: a run's upstream body with a token count over the cap (or not an integer),
or a media URL whose scheme is not allowed (a scheme hidden behind blanks included), is
refused with a 400 naming the field, and the relay ends such a run with an error event
of `http_status` 400 and sends nothing; a caller's chat template and `ignore_eos` are
dropped unless allowed; everything else is sent unchanged. The node's flags and its
`[node]` table set the policy, with the edge's defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from edge.contract._proto.iop.node import v1 as pb
from edge.errors import RequestError
from edge.forwarding import DEFAULT_MAX_OUTPUT_TOKENS, ForwardPolicy
from edge.nodes.upstream.admit import admit
from edge.nodes.upstream.cli import SettingsError, resolve
from edge.nodes.upstream.cli import build_parser as node_parser
from edge.nodes.upstream.relay import Refused, Relay
from edge.nodes.upstream.request import chat_request_body

DEFAULT = ForwardPolicy()
OPEN = ForwardPolicy(
    allow_chat_template=True, allow_ignore_eos=True, media_url_schemes=frozenset({"http", "https"})
)


def image(url: str) -> pb.ContentPart:
    return pb.ContentPart(
        type="image_url", json=json.dumps({"type": "image_url", "image_url": {"url": url}})
    )


def run(
    *parts: pb.ContentPart, extra: dict[str, Any] | None = None, **fields: Any
) -> pb.RunRequest:
    message = (
        pb.Message(role="user", parts=[pb.ContentPart(type="text", text="hi"), *parts])
        if parts
        else pb.Message(role="user", content="hi")
    )
    return pb.RunRequest(
        run_id="r1",
        model="m",
        messages=[message],
        extra_json=json.dumps(extra) if extra is not None else "",
        **fields,
    )


def refused(request: pb.RunRequest, policy: ForwardPolicy = DEFAULT) -> RequestError:
    with pytest.raises(RequestError) as info:
        admit(chat_request_body(request), policy)
    assert info.value.status == 400
    return info.value


def test_a_plain_run_is_sent_as_made() -> None:
    """Nothing to drop and nothing over a cap: the body itself, nothing dropped."""
    body = chat_request_body(
        run(image("data:image/png;base64,AAAA"), max_tokens=10,
            extra={"top_k": 3, "min_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    )  # fmt: skip
    admitted = admit(body, DEFAULT)
    assert admitted.body is body
    assert admitted.dropped == ()


@pytest.mark.parametrize(
    ("fields", "extra", "param"),
    [
        ({"max_tokens": 4_000_000_000}, None, "max_tokens"),
        ({}, {"max_completion_tokens": 4_000_000_000}, "max_completion_tokens"),
        ({}, {"min_tokens": 200_000}, "min_tokens"),
        ({"max_tokens": 5}, {"min_tokens": 6}, "min_tokens"),
    ],
)
def test_token_counts_past_the_cap_are_refused(
    fields: dict[str, Any], extra: dict[str, Any] | None, param: str
) -> None:
    """Each spelling of the output cap, and min_tokens, is checked as the edge checks it."""
    error = refused(run(extra=extra, **fields))
    assert (error.param, error.code) == (param, "invalid_value")
    assert param in error.message


def test_the_cap_is_the_policys() -> None:
    """At the cap a run passes; one past it is refused, naming the cap."""
    policy = ForwardPolicy(max_output_tokens=100)
    assert admit(chat_request_body(run(max_tokens=100)), policy).body["max_tokens"] == 100
    error = refused(run(max_tokens=101), policy)
    assert "at most 100 completion tokens, whereas you provided 101" in error.message
    assert DEFAULT.max_output_tokens == DEFAULT_MAX_OUTPUT_TOKENS


@pytest.mark.parametrize("value", [4e9, "4000000000", True, [1]])
def test_token_counts_that_are_not_integers_are_refused(value: object) -> None:
    """A server would read 4e9 or "4000000000" as a count the cap never saw."""
    error = refused(run(extra={"max_completion_tokens": value}))
    assert (error.param, error.code) == ("max_completion_tokens", "invalid_type")


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",
        "https://example.com/cat.png",
        "file:///etc/passwd",
        " http://169.254.169.254/",
        "\thttp://169.254.169.254/",
        "//169.254.169.254/x.png",
    ],
)
def test_media_urls_of_other_schemes_are_refused(url: str) -> None:
    """Only data: by default; a scheme behind blanks, or none, is refused as well."""
    error = refused(run(image(url)))
    assert error.param == "messages[0].content[1].image_url.url"
    assert "data:" in error.message


def test_allowed_schemes_pass() -> None:
    """With http(s) allowed, such URLs are sent; file: never is."""
    body = chat_request_body(run(image("http://169.254.169.254/x.png")))
    assert admit(body, OPEN).body is body
    with pytest.raises(RequestError):
        admit(chat_request_body(run(image("file:///etc/passwd"))), OPEN)


def test_every_part_is_checked_whatever_its_type() -> None:
    """The node sends a part's JSON as the run has it: a "text" part carrying a URL too."""
    part = pb.ContentPart(
        type="text",
        json=json.dumps({"type": "text", "text": "x", "image_url": {"url": "http://10.0.0.1/"}}),
    )
    assert refused(run(part)).param == "messages[0].content[1].image_url.url"


def test_inline_data_with_a_scheme_is_checked() -> None:
    """Inline data (base64) holds no colon; data that does is a URL, and must be allowed."""
    audio = {
        "type": "input_audio",
        "input_audio": {"data": "http://10.0.0.1/a.wav", "format": "wav"},
    }
    part = pb.ContentPart(type="input_audio", json=json.dumps(audio))
    assert refused(run(part)).param == "messages[0].content[1].input_audio.data"
    audio["input_audio"]["data"] = "UklGRg=="
    part = pb.ContentPart(type="input_audio", json=json.dumps(audio))
    assert admit(chat_request_body(run(part)), DEFAULT).dropped == ()


def test_templates_and_ignore_eos_are_dropped_unless_allowed() -> None:
    """Dropped, not refused: the rest of the body, other template kwargs included, stays."""
    extra = {
        "chat_template_kwargs": {"chat_template": "{{ evil }}", "enable_thinking": True},
        "chat_template": "{{ evil }}",
        "ignore_eos": True,
        "top_k": 5,
    }
    body = chat_request_body(run(extra=extra))
    admitted = admit(body, DEFAULT)
    assert set(admitted.dropped) == {
        "chat_template_kwargs.chat_template", "chat_template", "ignore_eos",
    }  # fmt: skip
    assert admitted.body["chat_template_kwargs"] == {"enable_thinking": True}
    assert "chat_template" not in admitted.body
    assert "ignore_eos" not in admitted.body
    assert admitted.body["top_k"] == 5
    assert body["ignore_eos"] is True  # the body given is not changed
    only = admit(
        chat_request_body(run(extra={"chat_template_kwargs": {"chat_template": "x"}})), DEFAULT
    )
    assert "chat_template_kwargs" not in only.body
    allowed = admit(body, OPEN)
    assert allowed.body is body
    assert allowed.dropped == ()


def _relay(policy: ForwardPolicy | None) -> Relay:
    # Port 9 (discard) on loopback: nothing is ever sent there by these tests.
    return Relay(
        "http://127.0.0.1:9/v1", name="t", continuation_mode=lambda m: "none", policy=policy
    )


async def test_the_relay_refuses_with_a_400_event_and_sends_nothing() -> None:
    """A refused run's one event is its terminal: an error of http_status 400 whose
    words name the field; the body is never made into bytes to send."""
    relay = _relay(DEFAULT)
    request = run(image("http://169.254.169.254/"), max_tokens=10)
    body = relay.body(request)
    assert isinstance(body, Refused)
    events: list[pb.RunEvent] = []

    async def emit(event: pb.RunEvent) -> None:
        events.append(event)

    await relay.run(request, emit, body=body)
    await relay.aclose()
    assert len(events) == 1
    (event,) = events
    assert (event.type, event.http_status, event.error) == ("error", 400, "invalid_value")
    assert "messages[0].content[1].image_url.url" in event.message


def test_a_relay_without_a_policy_sends_runs_as_they_come() -> None:
    """The edge's own `openai+http://` nodes: the edge applied the model's policy."""
    request = run(image("http://169.254.169.254/"), extra={"ignore_eos": True})
    body = _relay(None).body(request)
    assert isinstance(body, bytes)
    assert json.loads(body)["ignore_eos"] is True
    dropped = _relay(DEFAULT).body(run(extra={"ignore_eos": True}))
    assert isinstance(dropped, bytes)
    assert "ignore_eos" not in json.loads(dropped)


def test_node_policy_defaults_are_the_edges() -> None:
    """No flag, no table: the edge's `[models.NAME]` defaults."""
    settings = resolve(node_parser().parse_args(["--upstream", "http://gpu:8000"]))
    assert settings.policy == ForwardPolicy()
    assert settings.policy.schemes == frozenset({"data"})


def test_node_policy_from_flags_and_table(tmp_path: Path) -> None:
    """The `[node]` table sets the policy; flags win over it."""
    path = tmp_path / "node.toml"
    path.write_text(
        '[node]\nupstream = "http://gpu:8000"\nmax_output_tokens = 4096\n'
        'allow_chat_template = true\nmedia_url_schemes = ["HTTPS:"]\n'
    )
    from_file = resolve(node_parser().parse_args(["--config", str(path)]))
    assert from_file.policy == ForwardPolicy(
        max_output_tokens=4096, allow_chat_template=True,
        media_url_schemes=frozenset({"data", "https"}),
    )  # fmt: skip
    args = ["--config", str(path), "--max-output-tokens", "100", "--allow-ignore-eos",
            "--media-url-schemes", "data,http"]  # fmt: skip
    flagged = resolve(node_parser().parse_args(args))
    assert flagged.policy == ForwardPolicy(
        max_output_tokens=100, allow_chat_template=True, allow_ignore_eos=True,
        media_url_schemes=frozenset({"data", "http"}),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "table", "words"),
    [
        (["--max-output-tokens", "0"], "", "max_output_tokens"),
        (["--max-output-tokens", str(2**32)], "", "max_output_tokens"),
        (["--media-url-schemes", "file"], "", "unsupported scheme 'file'"),
        ([], "max_output_tokens = 0\n", "max_output_tokens"),
        ([], 'media_url_schemes = ["ftp"]\n', "unsupported scheme 'ftp'"),
        ([], "allow_ignore_eos = 1\n", "allow_ignore_eos"),
    ],
)
def test_bad_policy_settings_are_one_line(
    tmp_path: Path, args: list[str], table: str, words: str
) -> None:
    """A bad cap or scheme, from a flag or the file, is a settings error naming it."""
    path = tmp_path / "node.toml"
    path.write_text('[node]\nupstream = "http://gpu:8000"\n' + table)
    with pytest.raises(SettingsError, match=words):
        resolve(node_parser().parse_args(["--config", str(path), *args]))
