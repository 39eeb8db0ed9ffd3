"""Why no node can take a run of a model: the words of the 503 `node_unavailable`.

When the pool finds no node for a run (`edge.fleet.pool`), the caller is told
why, node by node as the pool sees them, in this order:

- down: the node does not answer (its Describe or Watch failed, or it refused
  a run), with the reason it gave (`upstream http://... unreachable`, `not
  contacted yet`); a node down may serve the model, the edge cannot know;
- its circuit breaker open, and for how long yet (or half-open with its one
  probe run under way), after how many failed runs in a row;
- already tried by this request (a failed attempt, before a retry);
- up, but serving the model without logprobs when the request asks for them;
- up, but not serving the model.

The words are bounded whatever the fleet: at most NAMED nodes named in each
group (the others counted), each name and reason clipped; a fleet of
hundreds of nodes gives a message of a few hundred characters per group.

Pure: reads the nodes' states at `now`, changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from edge.fleet.nodestate import NodeState
from edge.observe.logbound import clip

# The nodes named in each group of the message; the others are counted.
NAMED = 3
# The longest node name and down reason quoted, in characters.
NAME_CHARS = 64
REASON_CHARS = 160


def unavailable_words(
    model: str,
    nodes: Sequence[NodeState],
    *,
    now: float,
    cooldown_s: float,
    logprobs: bool = False,
    exclude: Collection[NodeState] = (),
) -> str:
    """The 503's message: no node is available for `model`, and why (see the module doc)."""
    down: list[str] = []
    blocked: list[str] = []
    tried: list[str] = []
    no_logprobs: list[str] = []
    elsewhere: list[str] = []
    for state in nodes:
        name = _name(state)
        serves = model in state.models
        if not state.health.up:
            down.append(f"{name} is down ({clip(state.error or 'no reason given', REASON_CHARS)})")
        elif not serves:
            elsewhere.append(name)
        elif logprobs and model not in state.logprobs_models:
            no_logprobs.append(name)
        elif state in exclude:
            tried.append(name)
        elif not state.health.admits(now):
            blocked.append(f"{name} {_breaker(state, now, cooldown_s)}")
    parts = [
        *_group(down, ""),
        *_group(blocked, ""),
        *_group(tried, "already tried by this request: "),
        *_group(no_logprobs, "serving it without logprobs: "),
        *_group(elsewhere, "up but not serving it: "),
    ]
    why = "; ".join(parts) if parts else "no node is configured"
    return f"no node is available for model {clip(model, NAME_CHARS)!r}: {why}; retry later"


def _name(state: NodeState) -> str:
    return f"node {clip(state.client.name, NAME_CHARS)!r}"


def _breaker(state: NodeState, now: float, cooldown_s: float) -> str:
    """A node up whose breaker lets no run through: open until when, or its probe out."""
    breaker = state.health.breaker
    failures = f"after {breaker.failures} failed run(s) in a row"
    left = max(0.0, breaker.wake_at(cooldown_s) - now)
    if breaker.at(now, cooldown_s) == "open":
        return f"has its circuit breaker open for {left:.1f}s more ({failures})"
    return (
        f"has its circuit breaker half-open, its one probe run under way"
        f" (another probe in {left:.1f}s at most; {failures})"
    )


def _group(items: list[str], lead: str) -> list[str]:
    """One group of the message: its first NAMED items, then how many more (none: [])."""
    if not items:
        return []
    shown = ", ".join(items[:NAMED])
    if len(items) > NAMED:
        shown = f"{shown} and {len(items) - NAMED} more"
    return [f"{lead}{shown}"]
