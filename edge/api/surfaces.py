"""The four APIs over one run: how each parses its request and renders the answer.

An `Api` is what differs between `/v1/chat/completions`, `/v1/responses`,
`/v1/messages` and `/v1/completions` (legacy completions): the parser that
turns its body into the one run request (`ChatRequest`), the renderer that
turns the one session's output events into its stream (`Streamer`) or its
whole answer (`Folder`), and the shape of its errors. Everything else
(sentinels, reasoning policy, tool calls, validation, strict output, the
terminal, cancel, admission, failover, metrics) is the run's and the
session's, the same for all four.

Pure: no I/O, no HTTP framework.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from edge.api.completions import parse_completions_request
from edge.api.completions_out import CompletionsFolder, CompletionsStreamer
from edge.api.messages import parse_messages_request
from edge.api.messages_out import MessagesRenderer, anthropic_error
from edge.api.render import KEEPALIVE, ResponseBuilder, SSEEncoder
from edge.api.request import ChatRequest, parse_chat_request
from edge.api.responses import parse_responses_request
from edge.api.responses_out import ResponsesRenderer
from edge.api.responses_state import References, Resolved, scan_references
from edge.errors import EdgeError, error_object, status_of
from edge.stream.output import ErrorOut, OutEvent

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
COMPLETIONS_PATH = "/v1/completions"


class Streamer(Protocol):
    """Renders one stream's output events as bytes, batch by batch."""

    @property
    def keepalive(self) -> bytes: ...

    def encode(self, events: Iterable[OutEvent]) -> bytes: ...


class Folder(Protocol):
    """Folds one answer's output events into one JSON body."""

    @property
    def error(self) -> ErrorOut | None: ...

    def add(self, events: Iterable[OutEvent]) -> None: ...

    def body(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A request of any API, as the run sees it, and what its renderer needs."""

    chat: ChatRequest
    # Accepted but not used (hosted or server tools), for a log line.
    dropped: tuple[str, ...] = ()
    echo: dict[str, Any] = field(default_factory=dict)
    thinking: bool = False
    # Responses: the context its answer is stored with (JSON); None: not stored.
    store_context: bytes | None = None


@dataclass(frozen=True, slots=True)
class Heading:
    """What an answer is about, as its API heads it: its run, when it began, the model it
    names, and the service tier it ran on (None: not said)."""

    run_id: str
    created: int
    model: str
    service_tier: str | None = None
    # The prompt's tokens as the edge estimates them (`edge.api.tokencount`); 0: not
    # counted. What a stream says of its input before the node reports its usage.
    prompt_tokens: int = 0


class Api:
    """One API's parser, renderers and error shape (chat completions: the base)."""

    name: ClassVar[str] = "chat"
    # Whether its streamer keeps the answer's text to the end (see SessionSettings).
    stream_holds_text: ClassVar[bool] = False
    path: ClassVar[str] = CHAT_PATH

    # Whether its requests may refer to stored responses (`references`, `parse`'s
    # `resolved`) and leave theirs in the store.
    stateful: ClassVar[bool] = False

    def references(self, body: bytes) -> References:
        """What `body` refers to in the response store (stateful APIs only)."""
        return References()

    def parse(self, body: bytes, resolved: Resolved | None = None) -> ApiRequest:
        return ApiRequest(parse_chat_request(body))

    def streamer(self, request: ApiRequest, answer: Heading) -> Streamer:
        return _ChatStreamer(
            f"chatcmpl-{answer.run_id}", answer.created, answer.model,
            include_usage=request.chat.include_usage, service_tier=answer.service_tier,
        )  # fmt: skip

    def folder(self, request: ApiRequest, answer: Heading) -> Folder:
        return _ChatFolder(answer, logprobs=request.chat.logprobs)

    def error(
        self, status: int, error_type: str, message: str, code: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """An error as this API's (status, body)."""
        return status, error_object(error_type, message, code=code)

    def edge_error(self, error: EdgeError) -> tuple[int, dict[str, Any]]:
        """The edge's own error (a bad request, overload, a limit) as this API's (status,
        body): OpenAI's error object, its `param` and `code` included."""
        return error.status, error.to_dict()

    def run_error(self, error: ErrorOut) -> tuple[int, dict[str, Any]]:
        """A run's error as the whole answer: its status (a node's refusal: the node's)
        and this API's body."""
        status = error.status or status_of(error.type)
        return self.error(status, error.type, error.message, error.code)


class _ChatStreamer(SSEEncoder):
    __slots__ = ()
    keepalive = KEEPALIVE


class _ChatFolder(ResponseBuilder):
    __slots__ = ("_answer",)

    def __init__(self, answer: Heading, *, logprobs: bool) -> None:
        super().__init__(logprobs=logprobs)
        self._answer = answer

    def body(self) -> dict[str, Any]:
        a = self._answer
        return self.response(f"chatcmpl-{a.run_id}", a.created, a.model, a.service_tier)


class ResponsesApi(Api):
    name = "responses"
    path = RESPONSES_PATH
    stream_holds_text = True  # its done events repeat each item's whole text
    stateful = True

    def references(self, body: bytes) -> References:
        return scan_references(body)

    def parse(self, body: bytes, resolved: Resolved | None = None) -> ApiRequest:
        parsed = parse_responses_request(body, resolved)
        return ApiRequest(parsed.chat, parsed.dropped, parsed.echo,
                          store_context=parsed.store_context)  # fmt: skip

    def streamer(self, request: ApiRequest, answer: Heading) -> Streamer:
        return _ResponsesOut(answer.run_id, answer.created, answer.model, _echo(request, answer))

    def folder(self, request: ApiRequest, answer: Heading) -> Folder:
        return _ResponsesOut(answer.run_id, answer.created, answer.model, _echo(request, answer))


def _echo(request: ApiRequest, answer: Heading) -> dict[str, Any]:
    """What a Response repeats of its request, and the service tier it ran on."""
    if answer.service_tier is None:
        return request.echo
    return {**request.echo, "service_tier": answer.service_tier}


class _ResponsesOut(ResponsesRenderer):
    def body(self) -> dict[str, Any]:
        return self.response()


class MessagesApi(Api):
    name = "messages"
    path = MESSAGES_PATH

    def parse(self, body: bytes, resolved: Resolved | None = None) -> ApiRequest:
        parsed = parse_messages_request(body)
        return ApiRequest(parsed.chat, dropped=parsed.dropped, thinking=parsed.thinking)

    def streamer(self, request: ApiRequest, answer: Heading) -> Streamer:
        return _MessagesOut(answer.run_id, answer.model, status_of=status_of,
                            stop_sequences=request.chat.stop,
                            prompt_tokens=answer.prompt_tokens,
                            service_tier=_anthropic_tier(answer))  # fmt: skip

    def folder(self, request: ApiRequest, answer: Heading) -> Folder:
        return _MessagesOut(answer.run_id, answer.model, status_of=status_of,
                            stop_sequences=request.chat.stop,
                            service_tier=_anthropic_tier(answer))  # fmt: skip

    def error(
        self, status: int, error_type: str, message: str, code: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        return anthropic_error(status, error_type, message)  # Anthropic's errors have no code

    def edge_error(self, error: EdgeError) -> tuple[int, dict[str, Any]]:
        return anthropic_error(error.status, error.type, error.message)


def _anthropic_tier(answer: Heading) -> str | None:
    """The tier as Anthropic's usage names it: "priority", else "standard"."""
    if answer.service_tier is None:
        return None
    return "priority" if answer.service_tier == "priority" else "standard"


class _MessagesOut(MessagesRenderer):
    def body(self) -> dict[str, Any]:
        return self.response()


class CompletionsApi(Api):
    """Legacy completions: the prompt as one user message (`edge.api.completions`),
    the answer as `text_completion` objects; errors are OpenAI's."""

    name = "completions"
    path = COMPLETIONS_PATH

    def parse(self, body: bytes, resolved: Resolved | None = None) -> ApiRequest:
        parsed = parse_completions_request(body)
        echo = {} if parsed.echo_json is None else {"prompt_json": parsed.echo_json}
        return ApiRequest(parsed.chat, echo=echo)

    def streamer(self, request: ApiRequest, answer: Heading) -> Streamer:
        echo: bytes | None = request.echo.get("prompt_json")
        return CompletionsStreamer(
            f"cmpl-{answer.run_id}", answer.created, answer.model,
            include_usage=request.chat.include_usage, echo_json=echo,
            echo_chars=len(request.chat.messages[0].text()) if echo is not None else 0,
        )  # fmt: skip

    def folder(self, request: ApiRequest, answer: Heading) -> Folder:
        echo = request.chat.messages[0].text() if request.echo else None
        return CompletionsFolder(
            f"cmpl-{answer.run_id}", answer.created, answer.model,
            logprobs=request.chat.logprobs, echo=echo,
        )  # fmt: skip


CHAT = Api()
RESPONSES = ResponsesApi()
MESSAGES = MessagesApi()
COMPLETIONS = CompletionsApi()
APIS: dict[str, Api] = {api.path: api for api in (CHAT, RESPONSES, MESSAGES, COMPLETIONS)}
