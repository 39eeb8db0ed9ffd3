"""`make agents`: the real command-line agents against a real edge and sim node.

Starts an `iop-sim-node` and an `iop-edge` in front of it (the client suite's
helpers), puts a recording pass-through (`tests.agents.proxy`) between the
agents and the edge, and runs each agent installed in `tests/agents`
(pinned in `package.json`, installed by `npm ci`) once, non-interactively,
in a temporary home with the edge as its only server:

- Codex CLI: `codex exec --skip-git-repo-check PROMPT` with a CODEX_HOME
  whose config.toml declares the edge as a provider (`wire_api =
  "responses"`), so it speaks `POST /v1/responses`;
- Claude Code: `claude -p PROMPT --model sim-script` with
  ANTHROPIC_BASE_URL at the edge, so it speaks `POST /v1/messages`.

The prompt is a two-turn sim-script: turn 0 calls one of the agent's own
tools with a harmless argument (Codex's `exec_command` runs `echo` of a
random marker; Claude Code's `Read` reads a file holding one), turn 1
answers with a final text. An agent passes when it exits 0 and prints the
final text, its first request declared the tool, its second request carried
the call back with the tool's result (the marker), the edge answered both
with 200 and logged both runs as successes, and the node's runs log has
both runs complete. Exits 0 when every agent passed; prints what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.agents.proxy import Exchange, RecordingProxy
from tests.clients.conftest import EdgeServer, start_edge_process, stop_edge_process
from tests.integration.conftest import SimProcess, start_sim, stop_process

AGENTS_DIR = Path(__file__).parent
BIN = AGENTS_DIR / "node_modules" / ".bin"
AGENT_TIMEOUT_S = 180
LOG_TIMEOUT_S = 10.0
API_KEY = "sk-agents-check"
USAGE = {"input_tokens": 11, "output_tokens": 7, "reasoning_tokens": 0, "cached_input_tokens": 0}


def two_turns(tool: str, arguments: dict[str, Any], call_id: str, final: str) -> str:
    """The prompt: a sim-script whose turn 0 calls `tool` and turn 1 says `final`."""
    call = {"id": call_id, "name": tool, "arguments": arguments}
    turn_0 = [{"type": "complete", "usage": USAGE, "tool_calls": [call]}]
    turn_1 = [
        {"type": "delta", "delta": final},
        {"type": "complete", "usage": USAGE, "metadata": {"finish_reason": "stop"}},
    ]
    return json.dumps({"turns": [{"events": turn_0}, {"events": turn_1}]})


@dataclass
class Agent:
    name: str
    path: str  # the API path the agent posts to
    tool: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    final: str
    marker: str
    call_id: str
    # The second request's evidence that the call and its result came back.
    came_back: Callable[[dict[str, Any], str, str], list[str]]


def codex(tmp: Path, proxy_url: str, marker: str) -> Agent:
    home = tmp / "codex-home"
    work = tmp / "codex-work"
    home.mkdir()
    work.mkdir()
    (home / "config.toml").write_text(
        'model = "sim-script"\n'
        'model_provider = "iop-edge"\n'
        "[model_providers.iop-edge]\n"
        'name = "iop-edge"\n'
        f'base_url = "{proxy_url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "IOP_EDGE_API_KEY"\n'
    )
    final = f"Codex saw the marker {marker}."
    # The command's text does not hold the marker, only what it prints does.
    prefix, suffix = marker.split("-", 1)
    command = f"printf '%s-%s\\n' {prefix} {suffix}"
    prompt = two_turns("exec_command", {"cmd": command}, "call_codex_1", final)
    env = {"CODEX_HOME": str(home), "HOME": str(tmp / "codex-user"), "IOP_EDGE_API_KEY": API_KEY}
    argv = [str(BIN / "codex"), "exec", "--skip-git-repo-check", prompt]
    return Agent("Codex CLI", "/v1/responses", "exec_command", argv, env, work, final, marker,
                 "call_codex_1", _responses_came_back)  # fmt: skip


def claude(tmp: Path, proxy_url: str, marker: str) -> Agent:
    home = tmp / "claude-home"
    work = tmp / "claude-work"
    home.mkdir()
    work.mkdir()
    note = work / "note.txt"
    note.write_text(f"{marker}\n")
    final = f"Claude Code saw the marker {marker}."
    prompt = two_turns("Read", {"file_path": str(note)}, "toolu_claude_1", final)
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": proxy_url,
        "ANTHROPIC_API_KEY": API_KEY,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    argv = [str(BIN / "claude"), "-p", prompt, "--model", "sim-script"]
    return Agent("Claude Code", "/v1/messages", "Read", argv, env, work, final, marker,
                 "toolu_claude_1", _messages_came_back)  # fmt: skip


def _responses_came_back(body: dict[str, Any], call_id: str, marker: str) -> list[str]:
    items = [i for i in body.get("input") or [] if isinstance(i, dict)]
    calls = [i for i in items if i.get("type") == "function_call" and i.get("call_id") == call_id]
    outputs = [
        i for i in items if i.get("type") == "function_call_output" and i.get("call_id") == call_id
    ]
    problems = []
    if not calls:
        problems.append(f"no function_call item with call_id {call_id!r}")
    if not any(marker in json.dumps(o.get("output")) for o in outputs):
        problems.append(f"no function_call_output for {call_id!r} holding the marker")
    return problems


def _messages_came_back(body: dict[str, Any], call_id: str, marker: str) -> list[str]:
    blocks = [
        (m.get("role"), b)
        for m in body.get("messages") or []
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict)
    ]
    uses = [b for role, b in blocks if role == "assistant" and b.get("type") == "tool_use"
            and b.get("id") == call_id]  # fmt: skip
    results = [b for role, b in blocks if role == "user" and b.get("type") == "tool_result"
               and b.get("tool_use_id") == call_id]  # fmt: skip
    problems = []
    if not uses:
        problems.append(f"no assistant tool_use block with id {call_id!r}")
    if not any(marker in json.dumps(r.get("content")) for r in results):
        problems.append(f"no tool_result for {call_id!r} holding the marker")
    return problems


def _declared_tools(body: dict[str, Any]) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        if isinstance(tool, dict):
            names.append(str(tool.get("name") or tool.get("type")))
            names += [str(t.get("name")) for t in tool.get("tools") or [] if isinstance(t, dict)]
    return names


def _scripted(exchange: Exchange) -> bool:
    """A request of the agent's main loop (model sim-script), not a side request."""
    return exchange.json().get("model") == "sim-script"


def _wait(condition: Callable[[], bool], within_s: float) -> bool:
    """Another process's log file or pipe: poll it, bounded."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _edge_successes(edge: EdgeServer, path: str) -> list[str]:
    return [
        line
        for line in list(edge.lines)
        if "chat completion success" in line and f"'path': '{path}'" in line
        and "'status': 'success'" in line
    ]  # fmt: skip


def check(agent: Agent, proxy: RecordingProxy, edge: EdgeServer, sim: SimProcess) -> list[str]:
    """Run one agent; the list of what went wrong (empty: it passed)."""
    before_edge = len(_edge_successes(edge, agent.path))
    before_runs = len(sim.runs())
    before_posts = len(proxy.posts(agent.path))
    before_exchanges = len(proxy.exchanges)
    # No key, server or setting of the caller's own agents leaks in: the edge is the only server.
    own = ("OPENAI_", "ANTHROPIC_", "CODEX_", "CLAUDE_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    try:
        done = subprocess.run(
            agent.argv,
            cwd=agent.cwd,
            env={**env, **agent.env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=AGENT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        return [f"did not finish in {AGENT_TIMEOUT_S}s (stderr: {exc.stderr!r})"]
    problems: list[str] = []
    if done.returncode != 0:
        problems.append(f"exit code {done.returncode}")
    if agent.final not in done.stdout:
        problems.append(f"its output lacks the final text {agent.final!r}")

    sent = proxy.exchanges[before_exchanges:]
    posts = [e for e in proxy.posts(agent.path)[before_posts:] if _scripted(e)]
    others = [f"{e.method} {e.path} {e.json().get('model')} -> {e.status}" for e in sent
              if not (e.path.startswith(agent.path) and _scripted(e))]  # fmt: skip
    if others:
        print(f"  {agent.name} also sent: {'; '.join(others)}")
    print(f"  {agent.name}: {len(posts)} request(s) to {agent.path}: "
          f"{[e.status for e in posts]}")  # fmt: skip
    if len(posts) != 2:
        problems.append(f"{len(posts)} sim-script request(s) to {agent.path}, expected 2")
    if posts:
        declared = _declared_tools(posts[0].json())
        print(f"  {agent.name} declared tools: {', '.join(declared)}")
        if agent.tool not in declared:
            problems.append(f"its first request does not declare {agent.tool!r}")
    if len(posts) >= 2:
        problems += agent.came_back(posts[1].json(), agent.call_id, agent.marker)
    problems += [f"the edge answered {e.path} with {e.status}" for e in posts if e.status != 200]

    if not _wait(lambda: len(_edge_successes(edge, agent.path)) - before_edge >= 2, LOG_TIMEOUT_S):
        problems.append(f"the edge logged fewer than 2 successful runs on {agent.path}")

    def complete() -> list[dict[str, Any]]:
        return [r for r in sim.runs()[before_runs:] if r.get("outcome") == "complete"]

    if not _wait(lambda: len(complete()) >= 2, LOG_TIMEOUT_S):
        problems.append(f"the node's runs log has {len(complete())} complete run(s), expected 2")
    if problems:
        print(f"--- {agent.name} stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}")
    return problems


def passes(agent: Agent, proxy: RecordingProxy, edge: EdgeServer, sim: SimProcess) -> bool:
    print(f"{agent.name}: {Path(agent.argv[0]).name} {agent.argv[1]} ... against {agent.path}")
    problems = check(agent, proxy, edge, sim)
    for problem in problems:
        print(f"  FAIL {agent.name}: {problem}")
    if not problems:
        print(f"  ok {agent.name}: a tool call ({agent.tool}), its result back, a final answer")
    return not problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", choices=["codex", "claude"], help="run one agent")
    args = parser.parse_args(argv)
    for name in ("codex", "claude"):
        if not (BIN / name).exists():
            print(f"{BIN / name} is missing: run `make agents` (npm ci in tests/agents)")
            return 2
    failed = 0
    with tempfile.TemporaryDirectory(prefix="agents-") as tmp_name:
        tmp = Path(tmp_name)
        sim = start_sim(tmp)
        try:
            edge = start_edge_process(tmp, sim)
            try:
                with RecordingProxy(edge.url) as proxy:
                    agents = [codex(tmp, proxy.url, "marker-" + secrets.token_hex(6)),
                              claude(tmp, proxy.url, "marker-" + secrets.token_hex(6))]  # fmt: skip
                    for agent in agents:
                        if not args.only or agent.argv[0].endswith(args.only):
                            failed += not passes(agent, proxy, edge, sim)
            finally:
                stop_edge_process(edge)
                if failed:
                    print("--- edge log ---\n" + "".join(edge.lines))
        finally:
            stop_process(sim.process)
    print("agents: all passed" if not failed else f"agents: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
