"""The fleet benchmark's prompts: four workloads as chat bodies, deterministic from a seed.

A workload is a list of sequences, each a list of chat-completion bodies: the load
generator (`benchmarks.jobs.fleet`) runs the sequences concurrently and the bodies of
one sequence in order (an agent's turns). Every body streams and asks for usage
(`stream_options.include_usage`), so the answer says its prompt and cached tokens, and
uses `sim-echo`, which answers the last user message (kept short here) word by word.

- shared prefixes: G groups of requests sharing a long system prompt, each request
  with its own short question, in a shuffled order;
- agent sessions: each session a short shared system prompt and tool list, its own
  long context and a short task, then one turn per tool call, each re-sending the
  whole history plus the call and its result (the prompt grows every turn);
- hot prefix: half the requests share one system prompt, the other half each have a
  random one of the same length;
- random: every request a random system prompt of that length (the control);
- pressure: inference-perf's many-system-prompts shape (`pressure`): many groups of long
  system prompts, one group drawn at random for each request with its own short
  question, sent open-loop at arrival times that rise stage by stage (a Poisson
  process at each stage's rate), not at a fixed concurrency.

Random text starts at the first character of the first message, so two random prompts
share no whole block of the prompt's rendering. Sizes are in tokens of 4 characters
(the fleet's fingerprint counts the same way). Plain data, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
MODEL = "sim-echo"
# Words of 2 to 9 letters: text that looks like text to anything that splits it.
_WORDS = (
    "the of and to in is was for on are with as at be by this from or have an they which "
    "one you were all we when your can said there use each she do how their if will up "
    "other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people than first water been call who "
    "oil its now find long down day did get come made may part kernel buffer stream token "
    "prefix cache node edge route shard queue block window latency request response"
)
WORDS = tuple(_WORDS.split())
READ_FILE_TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository and return its text.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "offset": {"type": "integer"}},
            "required": ["path"],
        },
    },
}


@dataclass(frozen=True)
class Workload:
    """One workload: its name, its sequences of bodies, and what it is sized to."""

    name: str
    sequences: list[list[bytes]]
    # The distinct prompt tokens a cache would need to hold to serve every reuse.
    working_set_tokens: int
    # Open loop: when each sequence's one request is sent, in seconds from the start
    # (empty: the sequences are played at the run's concurrency), and the stages those
    # times were drawn at: (requests a second, seconds) each.
    arrivals: tuple[float, ...] = ()
    stages: tuple[tuple[float, float], ...] = ()

    @property
    def requests(self) -> int:
        return sum(len(s) for s in self.sequences)

    def ceiling(self) -> float:
        """The most of its prompts' text any cache could hold when asked: per request, the
        text of its leading messages equal to an earlier request's (sequences in order,
        their turns in order), over all its text. First uses and concurrency not counted."""
        seen: set[bytes] = set()
        held = total = 0
        for seq in self.sequences:
            for payload in seq:
                chain = hashlib.sha256()
                reusing = True
                for message in json.loads(payload)["messages"]:
                    chain.update(json.dumps(message, sort_keys=True).encode())
                    key = chain.copy().digest()
                    size = len(json.dumps(message))
                    total += size
                    reusing = reusing and key in seen
                    held += size if reusing else 0
                    seen.add(key)
        return held / total if total else 0.0


def text(rng: random.Random, tokens: int) -> str:
    """`tokens * 4` characters of words drawn from `rng`."""
    chars = tokens * CHARS_PER_TOKEN
    words = rng.choices(WORDS, k=chars // 3 + 1)
    return " ".join(words)[:chars]


def _rng(seed: int, *key: object) -> random.Random:
    return random.Random(":".join(map(str, (seed, *key))))


def _question(rng: random.Random, i: int) -> str:
    return f"Question {i}: " + " ".join(rng.choices(WORDS, k=8))


def body(messages: list[dict[str, Any]], **extra: Any) -> bytes:
    doc = {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _ask(system: str, question: str) -> bytes:
    return body([{"role": "system", "content": system}, {"role": "user", "content": question}])


def shared_prefixes(seed: int, groups: int, per_group: int, prefix_tokens: int) -> Workload:
    """`groups` system prompts of `prefix_tokens`, `per_group` questions each, shuffled."""
    prefixes = [text(_rng(seed, "group", g), prefix_tokens) for g in range(groups)]
    order = [(g, i) for g in range(groups) for i in range(per_group)]
    _rng(seed, "order").shuffle(order)
    sequences = [
        [_ask(prefixes[g], _question(_rng(seed, "q", g, i), i))] for g, i in order
    ]  # fmt: skip
    return Workload("shared prefixes", sequences, groups * prefix_tokens)


def agent_sessions(
    seed: int, sessions: int, turns: int, system_tokens: int, context_tokens: int,
    tool_tokens: int,
) -> Workload:  # fmt: skip
    """`sessions` agents of `turns` requests each; turn k re-sends turn k-1's prompt plus
    one tool call and its result of `tool_tokens`."""
    system = text(_rng(seed, "agent-system"), system_tokens)
    sequences = []
    for s in range(sessions):
        rng = _rng(seed, "session", s)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": text(rng, context_tokens)},
            {"role": "assistant", "content": "I have read the context."},
            {"role": "user", "content": f"Task {s}: " + " ".join(rng.choices(WORDS, k=8))},
        ]
        bodies = []
        for k in range(turns):
            if k:
                call_id = f"call_{s}_{k}"
                arguments = json.dumps({"path": f"src/module_{s}_{k}.py"})
                messages = [
                    *messages,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{
                            "id": call_id, "type": "function",
                            "function": {"name": "read_file", "arguments": arguments},
                        }],
                    },
                    {"role": "tool", "tool_call_id": call_id, "content": text(rng, tool_tokens)},
                ]  # fmt: skip
            bodies.append(body(messages, tools=[READ_FILE_TOOL], user=f"agent-{s}"))
        sequences.append(bodies)
    # A session's last prompt holds all of its earlier ones; the system prompt is shared.
    last = context_tokens + (turns - 1) * tool_tokens
    return Workload("agent sessions", sequences, system_tokens + sessions * last)


def hot_prefix(seed: int, requests: int, prefix_tokens: int) -> Workload:
    """Every other request (in a shuffled order) shares one system prompt; each of the
    rest has a random one of the same length."""
    hot = text(_rng(seed, "hot"), prefix_tokens)
    kinds = [i % 2 == 0 for i in range(requests)]
    _rng(seed, "hot-order").shuffle(kinds)
    sequences = []
    for i, is_hot in enumerate(kinds):
        system = hot if is_hot else text(_rng(seed, "cold", i), prefix_tokens)
        sequences.append([_ask(system, _question(_rng(seed, "hq", i), i))])
    return Workload("hot prefix", sequences, prefix_tokens)


def random_prompts(seed: int, requests: int, prefix_tokens: int) -> Workload:
    """Every request a random system prompt of `prefix_tokens`: nothing to reuse."""
    sequences = [
        [_ask(text(_rng(seed, "random", i), prefix_tokens), _question(_rng(seed, "rq", i), i))]
        for i in range(requests)
    ]
    return Workload("random", sequences, 0)


def arrivals(seed: int, stages: tuple[tuple[float, float], ...]) -> list[float]:
    """Send times of a Poisson process whose rate is each stage's in turn, `(rate, seconds)`
    one after the other, in seconds from the start; deterministic from `seed`."""
    rng = _rng(seed, "arrivals")
    times: list[float] = []
    start = 0.0
    for rate, seconds in stages:
        at = start
        while rate > 0:
            at += rng.expovariate(rate)
            if at >= start + seconds:
                break
            times.append(at)
        start += seconds
    return times


def pressure(
    seed: int, groups: int, prefix_tokens: int, question_words: int,
    stages: tuple[tuple[float, float], ...],
) -> Workload:  # fmt: skip
    """`groups` system prompts of `prefix_tokens`; one request per arrival (`arrivals`), its
    group drawn at random, with a question of its own of `question_words` words (which
    `sim-echo` answers word by word: the answer is as long as the question)."""
    prefixes = [text(_rng(seed, "pgroup", g), prefix_tokens) for g in range(groups)]
    times = arrivals(seed, stages)
    pick = _rng(seed, "pgroups")
    sequences = []
    for i in range(len(times)):
        words = " ".join(_rng(seed, "pq", i).choices(WORDS, k=max(1, question_words - 2)))
        sequences.append([_ask(prefixes[pick.randrange(groups)], f"Question {i}: {words}")])
    return Workload(
        "pressure", sequences, groups * prefix_tokens, arrivals=tuple(times), stages=stages
    )


def other_traffic(seed: int, rate: float, seconds: float, prefix_tokens: int) -> Workload:
    """Requests of random prompts of `prefix_tokens` (nothing to reuse, every one a whole
    prefill) at Poisson arrivals of `rate` a second for `seconds`: traffic that reaches
    nodes without passing the gateway measured (another gateway's, a batch job's)."""
    times = arrivals(_rng(seed, "other").randrange(2**32), ((rate, seconds),))
    sequences = [
        [_ask(text(_rng(seed, "other", i), prefix_tokens), _question(_rng(seed, "oq", i), i))]
        for i in range(len(times))
    ]
    return Workload("other traffic", sequences, 0, arrivals=tuple(times), stages=((rate, seconds),))
