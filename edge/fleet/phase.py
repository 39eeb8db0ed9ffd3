"""A run's life as a state machine: its phases, the steps between them, as one table.

Everything that moves a run (`edge.fleet.run.Run`) from one phase to the next
is a `Step` taken through `Machine.go`, and `TRANSITIONS` says, for each
phase, which steps lead where. A step the table lists as `IGNORED` in a
phase is a legal no-op (a second `end`, an `abandon` after the node
accepted); any other step raises `IllegalTransition`: a bug, which the tests'
random event orders would find.

    OPENED --start--> STARTING --accept--> RUNNING --end--> ENDING --settle--> ENDED
      |                  |  |                 |  ^                                ^  |
      +--abandon---------|--|-----------------|--|--------------------------------+  retire
                         +--|--start_failed---|--|--------------------------------+  v
                            +--abandon--------|--|--------------------------------+  RETIRED
                                          break  keep
                                              v  |
                                             BROKEN --hand_over------------------> ENDED
                                                +--end--> ENDING

OPENED: its node slot taken, nothing sent. STARTING: the RunRequest is on its
way, the node's accept awaited. RUNNING: the node accepted; its events are
read. BROKEN: its stream broke after output where the answer may move; the
break is held, not fed. ENDING: the edge ends it, waiting for the node's
read task. ENDED: its outcome is fixed and its slot given back (once).
RETIRED: its request is over and it holds nothing.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):  # a str's hash: the table's lookups run in C
    OPENED = "opened"
    STARTING = "starting"
    RUNNING = "running"
    BROKEN = "broken"
    ENDING = "ending"
    ENDED = "ended"
    RETIRED = "retired"


class Step(StrEnum):
    START = "start"  # entered: the RunRequest goes to the node
    ACCEPT = "accept"  # the node accepted
    START_FAILED = "start_failed"  # the start raised an EdgeError: the outcome is fixed
    ABANDON = "abandon"  # the caller left (or a bug) before the node accepted
    BREAK = "break"  # its stream broke after output: the break is held
    KEEP = "keep"  # the answer does not move: the break is the session's terminal
    HAND_OVER = "hand_over"  # another run continues the answer: this one ends
    END = "end"  # the caller is done or gone: end it unless the node did
    SETTLE = "settle"  # its read task is over (or the wait was cut): the outcome is fixed
    RETIRE = "retire"  # its request is over


TRANSITIONS: dict[Phase, dict[Step, Phase]] = {
    Phase.OPENED: {Step.START: Phase.STARTING, Step.ABANDON: Phase.ENDED},
    Phase.STARTING: {
        Step.ACCEPT: Phase.RUNNING,
        Step.START_FAILED: Phase.ENDED,
        Step.ABANDON: Phase.ENDED,
    },
    Phase.RUNNING: {Step.BREAK: Phase.BROKEN, Step.END: Phase.ENDING},
    Phase.BROKEN: {Step.KEEP: Phase.RUNNING, Step.HAND_OVER: Phase.ENDED, Step.END: Phase.ENDING},
    Phase.ENDING: {Step.SETTLE: Phase.ENDED},
    Phase.ENDED: {Step.RETIRE: Phase.RETIRED},
    Phase.RETIRED: {},
}

# Steps that are no-ops in a phase: what has happened already, or cannot apply any more.
IGNORED: dict[Phase, frozenset[Step]] = {
    Phase.OPENED: frozenset({Step.END}),
    Phase.STARTING: frozenset(),
    Phase.RUNNING: frozenset({Step.ABANDON}),
    Phase.BROKEN: frozenset({Step.ABANDON}),
    Phase.ENDING: frozenset({Step.ABANDON, Step.END}),
    # KEEP: a run handed over whose continuation did not start; its break ends the answer.
    Phase.ENDED: frozenset({Step.ABANDON, Step.END, Step.HAND_OVER, Step.KEEP}),
    Phase.RETIRED: frozenset({Step.ABANDON, Step.END, Step.RETIRE}),
}


class IllegalTransition(RuntimeError):
    """A step its phase does not allow: a bug in whoever took it."""


class Machine:
    """One run's phase; `go` takes a step by the table."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase = Phase.OPENED

    def go(self, step: Step) -> bool:
        """Take `step`: True if the phase changed, False for a legal no-op; raises
        IllegalTransition for a step the phase does not allow."""
        phase = self.phase
        following = TRANSITIONS[phase].get(step)
        if following is not None:
            self.phase = following
            return True
        if step in IGNORED[phase]:
            return False
        raise IllegalTransition(f"{step.value} in phase {phase.value}")

    def may(self, step: Step) -> bool:
        """Whether `step` would change the phase now."""
        return step in TRANSITIONS[self.phase]
