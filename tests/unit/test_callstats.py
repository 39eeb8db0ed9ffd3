"""The call-count benchmark's pure parts (`benchmarks.callstats`, `benchmarks.calls`):
the same file compares across trees, calls per request are the difference of two runs,
and two trees' differences name the functions found in only one of them."""

from __future__ import annotations

import cProfile
from pathlib import Path

import pytest

from benchmarks.calls import Workload, render_calls, workloads
from benchmarks.callstats import (
    area,
    areas,
    counts,
    differences,
    load,
    moves,
    normal_name,
    normal_path,
    per_request,
    total,
)

TREE = "/srv/checkout"
CHECKOUT = "/tmp/iop-bench-calls-x/rev"


@pytest.mark.parametrize(
    ("path", "normal"),
    [
        (f"{TREE}/edge/fleet/run.py", "edge/fleet/run.py"),
        (f"{CHECKOUT}/edge/fleet/run.py", "edge/fleet/run.py"),
        ("/srv/.venv/lib/python3.11/site-packages/trio/_core/_run.py", "trio/_core/_run.py"),
        # A venv inside the tree's folder is a venv, not the tree's code.
        (f"{TREE}/.venv/lib/python3.11/site-packages/h11/_util.py", "h11/_util.py"),
        # A revision with a venv of its own: its edge is installed there.
        ("/tmp/x/rev-venv/lib/python3.12/site-packages/edge/cli.py", "edge/cli.py"),
        ("/usr/lib/python3.11/asyncio/events.py", "<stdlib>/asyncio/events.py"),
        ("/usr/lib/python3/dist-packages/six.py", "six.py"),
        ("~", "~"),
        ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap>"),
        ("<string>", "<string>"),
    ],
)
def test_a_file_reads_the_same_in_any_tree(path: str, normal: str) -> None:
    """Paths lose whatever differs between the trees: the checkout's folder, the venv's
    site-packages, the standard library's folder (marked, so it stays apart)."""
    assert normal_path(path, (TREE, CHECKOUT)) == normal


def test_counts_fold_line_numbers_and_trees_into_one_key() -> None:
    """The same function at another line, or in another tree, is one key; calls are
    pstats' second column (recursive calls included)."""
    raw = {
        (f"{TREE}/edge/http/chat.py", 10, "handle"): (3, 5, 0.0, 0.0, {}),
        (f"{CHECKOUT}/edge/http/chat.py", 12, "handle"): (1, 2, 0.0, 0.0, {}),
        ("~", 0, "<built-in method builtins.len>"): (7, 7, 0.0, 0.0, {}),
    }
    assert counts(raw, (TREE, CHECKOUT)) == {
        ("edge/http/chat.py", "handle"): 7,
        ("~", "<built-in method builtins.len>"): 7,
    }


def test_a_c_method_named_by_its_type_s_address_is_one_function_in_every_process() -> None:
    """cProfile names some C methods with their type's address, which each process has
    elsewhere: the name without it compares across runs and trees."""
    name = "<built-in method __new__ of type object at 0x7fe9a885ea00>"
    assert normal_name(name) == "<built-in method __new__ of type object>"
    assert normal_name("<built-in method builtins.len>") == "<built-in method builtins.len>"
    raw = {
        ("~", 0, name): (3, 3, 0.0, 0.0, {}),
        ("~", 0, name.replace("7fe9a885", "7f5a6d25")): (4, 4, 0.0, 0.0, {}),
    }
    assert counts(raw) == {("~", "<built-in method __new__ of type object>"): 7}


def test_calls_per_request_are_the_difference_of_two_runs() -> None:
    """What both runs did once (start-up, shutdown) cancels; a function seen in one run
    only is there, at its share."""
    small = {("a.py", "start"): 1, ("a.py", "serve"): 200}
    large = {("a.py", "start"): 1, ("a.py", "serve"): 1200, ("a.py", "rare"): 10}
    per = per_request(small, large, 1000)
    assert per == {("a.py", "start"): 0.0, ("a.py", "serve"): 1.0, ("a.py", "rare"): 0.01}
    assert total(per) == pytest.approx(1.01)
    with pytest.raises(ValueError, match="more requests"):
        per_request(small, large, 0)


def test_differences_are_largest_first_and_mark_functions_of_one_tree() -> None:
    """Sorted by the size of the difference either way; a function in A's profiles
    only is new (even at 0 calls per request), in B's only gone; a difference under the
    floor is left out; `top` bounds the list."""
    a = {("x.py", "same"): 5.0, ("x.py", "more"): 9.0, ("x.py", "new"): 2.0, ("x.py", "boot"): 0.0}
    b = {("x.py", "same"): 5.0, ("x.py", "more"): 4.0, ("x.py", "gone"): 3.0}
    rows = differences(a, b, top=10)
    assert [(r.name, r.delta, r.only) for r in rows] == [
        ("more", 5.0, None),
        ("gone", -3.0, "B"),
        ("new", 2.0, "A"),
    ]
    assert rows[0].where == "x.py:more"
    assert [r.name for r in differences(a, b, top=1)] == ["more"]


def test_a_function_that_moved_to_another_file_is_compared_with_itself() -> None:
    """A name found once in A's functions alone and once in B's alone is one function
    that changed files: one row, its difference, B's file beside it. A name found in
    several files of one tree only stays apart (which of them moved is not known)."""
    a = {
        ("edge/fleet/turns.py", "after_io_wait"): 22.1,
        ("edge/a.py", "f"): 1.0,
        ("edge/b.py", "f"): 1.0,
    }
    b = {("edge/turns.py", "after_io_wait"): 21.4, ("edge/c.py", "f"): 3.0}  # fmt: skip
    assert moves(a, b) == {
        ("edge/fleet/turns.py", "after_io_wait"): ("edge/turns.py", "after_io_wait")
    }
    rows = {r.where: r for r in differences(a, b, top=10)}
    moved = rows["edge/fleet/turns.py:after_io_wait"]
    assert (moved.a, moved.b, moved.only, moved.moved_from) == (22.1, 21.4, None, "edge/turns.py")
    assert "edge/turns.py:after_io_wait" not in rows
    assert {rows["edge/c.py:f"].only, rows["edge/a.py:f"].only} == {"B", "A"}


def test_areas_group_calls_by_package_and_edge_layer() -> None:
    assert area("edge/fleet/run.py") == "edge/fleet"
    assert area("edge/cli.py") == "edge"
    assert area("trio/_core/_run.py") == "trio"
    assert area("six.py") == "six"
    assert area("<stdlib>/asyncio/events.py") == "stdlib"
    assert area("<frozen importlib._bootstrap>") == "stdlib"
    assert area("~") == "C (builtins)"
    assert area("<string>") == "generated"
    calls = {("edge/http/a.py", "f"): 1.0, ("edge/http/b.py", "g"): 2.0, ("~", "len"): 4.0}
    assert list(areas(calls).items()) == [("C (builtins)", 4.0), ("edge/http", 3.0)]


def test_a_profile_file_loads_by_normalised_key(tmp_path: Path) -> None:
    """A file cProfile wrote reads back as calls per (file, function)."""

    def twice() -> None:
        for _ in range(2):
            len("x")

    profile = cProfile.Profile()
    profile.runcall(twice)
    out = tmp_path / "run.prof"
    profile.dump_stats(out)
    calls = load(out, (str(Path(__file__).resolve().parents[2]),))
    assert calls[("tests/unit/test_callstats.py", "twice")] == 1
    assert calls[("~", "<built-in method builtins.len>")] == 2


def test_workloads_are_named_on_the_command_line() -> None:
    assert workloads("nonstream, stream20,stream200") == (Workload(), Workload(20), Workload(200))
    assert Workload(20).name == "stream20"
    for bad in ("stream", "stream0", "streams", ""):
        with pytest.raises(ValueError, match="workload"):
            workloads(bad)


def test_the_ab_table_gives_each_side_the_ratio_and_the_per_chunk_figures() -> None:
    """Per request for every workload, per chunk of the longest stream, and per chunk
    between the shortest and the longest stream; new and gone functions are marked."""

    def side(n: float) -> dict[str, object]:
        run = {"requests": 1200, "seconds": 9.0, "content_frames_per_request": 20.0}
        return {"per_request": n, "runs": [run, run], "areas": {"trio": n / 10}}

    result = {
        "settings": {"small": 200, "large": 1200, "warmup": 100},
        "labels": {"A": "this tree", "B": "b7c8902"},
        "edge_code": {"A": "/a/edge/__init__.py", "B": "/b/edge/__init__.py"},
        "workloads": [
            {"name": "nonstream", "label": "non-stream request", "chunks": 0,
             "sides": {"A": side(6300.0), "B": side(6000.0)},
             "differences": [{"file": "edge/x.py", "name": "f", "a": 3.0, "b": 0.0,
                              "only": "A", "delta": 3.0}]},
            {"name": "stream20", "label": "stream of 20 chunks", "chunks": 20,
             "sides": {"A": side(10000.0), "B": side(10000.0)}, "differences": []},
            {"name": "stream200", "label": "stream of 200 chunks", "chunks": 200,
             "sides": {"A": side(46000.0), "B": side(44200.0)}, "differences": []},
        ],
    }  # fmt: skip
    text = render_calls(result)
    assert "| non-stream request " in text
    assert "+5.0%" in text
    assert "| stream of 200 chunks: per chunk " in text
    assert "| 230 " in text  # 46,000 / 200
    assert "| per chunk, 200 - 20 chunks " in text
    assert "| 200 " in text  # (46,000 - 10,000) / 180
    assert "edge/x.py:f (new)" in text
    assert "a proxy for CPU" in text
