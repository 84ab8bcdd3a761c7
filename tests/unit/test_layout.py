"""The layout's own rules (issue 51): the loop's internals are read in trainer/loop/ alone, and no file of the
packages outgrows one idea."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).parents[2]
PACKAGES = ("trainer", "strategies", "callbacks")
MAX_LINES = 500


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def reaches_into_trainer(node: ast.Attribute) -> bool:
    """`trainer._x`, `self.trainer._x`, `self._trainer._x`: a private attribute of a Trainer."""
    owner = node.value
    name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
    return name in ("trainer", "_trainer") and node.attr.startswith("_") and not node.attr.startswith("__")


def test_only_the_loop_reads_the_trainer_s_private_attributes():
    loop = REPO / "trainer" / "loop"
    found = [
        f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}"
        for path in sources()
        if loop not in path.parents
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and reaches_into_trainer(node)
    ]
    assert found == []


def test_the_rule_sees_a_reach_into_the_trainer():
    tree = ast.parse(
        "trainer._fit_loop.x; self.trainer._dispatch; self._trainer._schedule; trainer.__class__"
    )
    reached = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and reaches_into_trainer(n)]
    assert sorted(reached) == ["_dispatch", "_fit_loop", "_schedule"]


def test_no_file_outgrows_one_idea():
    long = {
        str(p.relative_to(REPO)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
