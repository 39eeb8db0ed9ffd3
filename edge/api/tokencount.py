"""`POST /v1/messages/count_tokens`: a Messages request's prompt, counted as an estimate.

The edge does not tokenize for the nodes' models and asks no node (no
Describe field or run gives a count), so the count is an estimate, by the
one rule the edge and the simulated node already share for a prompt's size
(`edge.contract.prefix.CHARS_PER_TOKEN`, passed in by the caller): the
characters of the prompt's canonical rendering (`edge.api.fingerprint.render`:
the model, the tools, then the messages, as a node is given them) divided by
that many characters a token. A simulated node with its cache model reports
the same number as the run's input tokens; a real model's tokenizer differs,
by a margin that depends on the text (English prose is near 4 characters a
token; code, other scripts and JSON schemas differ).

The same estimate is what a Messages stream's `message_start` says of the
prompt (`tokens_of`, from the length of the request's prefix fingerprint):
a node reports its count only when the run ends.

The body is a Messages request without `max_tokens`, parsed by the Messages
parser (`edge.api.messages`): what /v1/messages would refuse, this refuses,
with the same 400.

Pure: bytes in, values out (or a `RequestError`).
"""

from __future__ import annotations

from edge.api.fingerprint import render
from edge.api.messages import MessagesRequest, messages_request_from
from edge.api.request import ChatRequest, decode_object, deep_is_refused


@deep_is_refused
def parse_count_request(body: bytes) -> MessagesRequest:
    """Decode and validate a count_tokens body (a Messages request; `max_tokens` not needed).

    Raises:
        RequestError: the body breaks a rule of the Messages API.
    """
    return messages_request_from(decode_object(body), counting=True)


def estimate_input_tokens(request: ChatRequest, *, chars_per_token: int) -> int:
    """The prompt's tokens, estimated: its rendering's characters per `chars_per_token`,
    at least 1. Linear in the request's size: run it off the event loop."""
    return tokens_of(sum(map(len, render(request, request.model))), chars_per_token=chars_per_token)


def tokens_of(chars: int, *, chars_per_token: int) -> int:
    """The tokens of a prompt whose rendering is `chars` characters long, estimated (at
    least 1): a request's prefix fingerprint has its length (`Fingerprint.chars`), so a
    run's prompt is counted without rendering it again."""
    return max(1, chars // chars_per_token)
