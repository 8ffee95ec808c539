"""The agent's request and reply shapes (shared.agent_api) against the methods it serves."""

from __future__ import annotations

import ast
import types
import typing
from pathlib import Path

import pytest

from agent.server import build_dispatcher
from shared.agent_api.methods import REPLIES, REQUESTS
from shared.rpc import Method

ROOT = Path(__file__).resolve().parents[2]


def _method(name: str) -> Method:
    return build_dispatcher()._methods[name]


def _runtime_types(annotation: object) -> set[type]:
    """The classes a value of this annotation may have on the wire (a float may arrive as an int)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return set().union(*(_runtime_types(arg) for arg in typing.get_args(annotation)))
    if annotation is type(None) or annotation is None:
        return {type(None)}
    if annotation is float:
        return {int, float}
    if typing.is_typeddict(annotation):
        return {dict}
    origin = typing.get_origin(annotation)
    return {origin if origin is not None else annotation}


def test_every_method_imported_at_its_first_call_is_there():
    """The agent imports the modules only some sessions use at their first call: each one named exists,
    so a misspelt name is a failed test here, not a node's error at a user's first relay or drill."""
    import importlib

    from agent import server

    build_dispatcher()
    assert len(server.LATER) >= 10
    for module, name in server.LATER:
        assert callable(getattr(importlib.import_module(f"agent.{module}"), name)), (module, name)


def test_every_method_served_has_a_request_and_a_reply_shape():
    names = build_dispatcher().names()
    assert sorted(REQUESTS) == names
    assert sorted(REPLIES) == names


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_a_request_shape_has_the_arguments_the_method_checks(name):
    method, request = _method(name), REQUESTS[name]
    assert request.__required_keys__ == set(method.required)
    assert request.__optional_keys__ == set(method.optional)
    hints = typing.get_type_hints(request)
    for key, kind in {**method.required, **method.optional}.items():
        expected = set(kind) if isinstance(kind, tuple) else {kind}
        assert _runtime_types(hints[key]) == expected, key


#: typing names that Python 3.10 lacks (3.11 and later).
_NEWER_TYPING = {"NotRequired", "Required", "Self", "Never", "LiteralString", "Unpack", "TypeVarTuple",
                 "assert_never", "assert_type", "reveal_type", "dataclass_transform", "TypeIs", "ReadOnly"}


def _runtime_typing_imports(tree: ast.Module) -> set[str]:
    """Names imported from typing outside ``if TYPE_CHECKING:`` blocks."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module == "typing":
            names.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


@pytest.mark.parametrize("path", sorted(str(p) for root in ("agent", "shared", "coord_script")
                                        for p in (ROOT / root).rglob("*.py")))
def test_agent_and_shared_run_on_python_3_10(path):
    # The agent and everything it imports run with the node's Python, which may be 3.10.
    tree = ast.parse(Path(path).read_text(encoding="utf-8"), filename=path, feature_version=(3, 10))
    assert not _runtime_typing_imports(tree) & _NEWER_TYPING
