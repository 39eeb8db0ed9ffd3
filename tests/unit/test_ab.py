"""Which venv `--ab REV` (and `--calls --ab REV`) runs REV's edge on
(`benchmarks.ab.shares_venv`): this tree's when each of REV's dependencies is one of
this tree's, pinned alike; otherwise REV gets a venv of its own."""

from __future__ import annotations

from benchmarks.ab import shares_venv


def _pyproject(*dependencies: str) -> str:
    listed = ", ".join(f'"{d}"' for d in dependencies)
    return f'[project]\nname = "iop-edge"\ndependencies = [{listed}]\n'


def test_a_revision_with_fewer_packages_runs_on_this_venv() -> None:
    """An older revision that needed fewer packages, the same pins: this venv has all."""
    ours = _pyproject("trio==0.32.0", "pyzmq==27.3.0", "grpclib==0.4.8")
    assert shares_venv(ours, _pyproject("grpclib==0.4.8", "trio==0.32.0"))
    assert shares_venv(ours, ours)


def test_a_revision_with_another_pin_or_package_gets_a_venv_of_its_own() -> None:
    ours = _pyproject("trio==0.32.0", "grpclib==0.4.8")
    assert not shares_venv(ours, _pyproject("trio==0.31.0", "grpclib==0.4.8"))
    assert not shares_venv(ours, _pyproject("trio==0.32.0", "redis==5.0.0"))
