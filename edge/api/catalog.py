"""The models the edge serves, as each API lists them: `GET /v1/models` and `/v1/models/{id}`.

OpenAI's shape is a model object (`{"id", "object": "model", "created",
"owned_by"}`) and a list of them; Anthropic's (for a request that looks like
an Anthropic client's: `anthropic-version` or `x-api-key` sent) is
`{"type": "model", "id", "display_name", "created_at"}` and a page of them
(`data`, `has_more`, `first_id`, `last_id`), always the whole list in one
page. The nodes do not say when a model was made: `created` is 0 and
`created_at` the epoch; `display_name` is the id.

Pure: ids in, JSON values out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

_EPOCH: Final = "1970-01-01T00:00:00Z"


def openai_model(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "iop"}


def anthropic_model(model: str) -> dict[str, Any]:
    return {"type": "model", "id": model, "display_name": model, "created_at": _EPOCH}


def model_list(models: Sequence[str], *, anthropic: bool) -> dict[str, Any]:
    """`models` as OpenAI's list object, or as Anthropic's one page of them."""
    if not anthropic:
        return {"object": "list", "data": [openai_model(m) for m in models]}
    return {
        "data": [anthropic_model(m) for m in models],
        "has_more": False,
        "first_id": models[0] if models else None,
        "last_id": models[-1] if models else None,
    }
