"""The TypedDicts that name the plan's sections, the orchestration document and the data set report
hold what their builders write (every key declared, each value of its declared type), and name every
field the plan format's schema gives a section, so the types and the JSON cannot drift apart."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path

import pytest

from coordinator.plan import datasets
from coordinator.plan.document import PlanDocument, build_plan, load_schema
from coordinator.plan.inputs import PlanInputs
from coordinator.plan.options import JobOptions
from coordinator.plan.orchestration import OrchestrationDocument, build_orchestration, parse_orchestration_input
from tests.unit.test_plan_document import REQUEST, mesh_inputs, node


def conforms(value: object, hint: object, where: str = "") -> list[str]:
    """Where ``value`` is not what ``hint`` says: an undeclared or missing key, a value of another type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any or hint is object:
        return []
    if origin is typing.Literal:
        return [] if value in args else [f"{where}: {value!r} is not one of {args}"]
    if origin is typing.Union or isinstance(hint, types.UnionType):
        findings = [conforms(value, arg, where) for arg in args]
        return [] if any(not found for found in findings) else min(findings, key=len)
    if hint is type(None) or hint is None:
        return [] if value is None else [f"{where}: {value!r} is not None"]
    if typing.is_typeddict(hint):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not {hint.__name__}"]
        hints = typing.get_type_hints(hint)
        # (__required_keys__ counts a NotRequired key written as a string, under `from __future__ import
        # annotations`, as required: the annotation itself says.)
        marked = typing.get_type_hints(hint, include_extras=True)
        required = {key for key in hint.__required_keys__ if typing.get_origin(marked[key]) is not typing.NotRequired}
        problems = [f"{where}.{key}: not a key of {hint.__name__}" for key in value if key not in hints]
        problems += [f"{where}.{key}: missing from {hint.__name__}" for key in required if key not in value]
        for key, item in value.items():
            if key in hints:
                problems += conforms(item, hints[key], f"{where}.{key}")
        return problems
    if origin in (list, typing.get_origin(typing.Sequence[int])):
        if not isinstance(value, list):
            return [f"{where}: {type(value).__name__}, not a list"]
        return [problem for i, item in enumerate(value) for problem in conforms(item, args[0], f"{where}[{i}]")]
    if origin in (dict, typing.get_origin(typing.Mapping[str, int])):
        if not isinstance(value, dict):
            return [f"{where}: {type(value).__name__}, not a dict"]
        return [problem for key, item in value.items() for problem in conforms(item, args[1], f"{where}[{key}]")]
    kinds = {float: (int, float), int: (int,), str: (str,), bool: (bool,)}.get(hint)
    if kinds is None:
        raise AssertionError(f"{where}: no check for {hint!r}")
    if isinstance(value, bool) and hint is not bool:
        return [f"{where}: {value!r} is a boolean, not {hint.__name__}"]
    return [] if isinstance(value, kinds) else [f"{where}: {value!r} is not {hint.__name__}"]


def loopback_inputs() -> PlanInputs:
    nodes = (node("n1", "alice"), node("n2", "bob"))
    choice = {"ok": True, "backend": "ring", "transport": "tcp", "order": ["n1", "n2"], "hosts": [],
              "reasons": ["every node is this machine: ring over loopback"], "warnings": [], "fixes": []}
    return PlanInputs(nodes=nodes, backend=choice, launch_argv=["mlx.launch", "--", "true"])


PLANS = {
    "measured": lambda: build_plan(mesh_inputs()),
    "coord's trainer": lambda: build_plan(mesh_inputs(training_command=["python", "-m", "agent.train"],
                                                      options=JobOptions(per_rank_batch_size=4, trainer="coord"))),
    "a script of its own": lambda: build_plan(mesh_inputs(training_command=["python", "train.py"])),
    "loopback": lambda: build_plan(loopback_inputs()),
    "nothing measured": lambda: build_plan(PlanInputs(nodes=(node("studio-a", "alice"),))),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_section_of_a_plan_is_what_its_type_says(name):
    plan = json.loads(json.dumps(PLANS[name]()))  # as the CLI reads it
    assert conforms(plan, PlanDocument) == []


@pytest.mark.parametrize("request_given", [False, True])
def test_the_orchestration_document_is_what_its_type_says(request_given):
    request = parse_orchestration_input(REQUEST) if request_given else None
    inputs = mesh_inputs(options=JobOptions(min_nodes=2))
    for document in (build_orchestration(inputs, request),
                     build_orchestration(PlanInputs(nodes=(node("studio-a", "alice"),)), request)):
        assert conforms(json.loads(json.dumps(document)), OrchestrationDocument) == []


def test_each_section_type_names_every_field_the_format_gives_the_section():
    schema = load_schema()
    hints = typing.get_type_hints(PlanDocument)
    for name, section in schema["$defs"].items():
        if name not in hints:
            continue
        declared = typing.get_type_hints(hints[name])
        assert set(section["properties"]) <= set(declared), name


def test_the_data_set_report_is_what_its_type_says(tmp_path: Path):
    (tmp_path / "train.jsonl").write_text('{"text": "a"}\n\n{"prompt": "p", "completion": 3}\n')
    (tmp_path / "valid.jsonl").write_text('{"text": "b"}\n')
    report = datasets.validate_data_dir(tmp_path)
    assert conforms(report, datasets.DatasetReport) == []
    assert list(report) == list(datasets.DatasetReport.__annotations__)
    assert list(report["splits"]["train"]) == list(datasets.SplitReport.__annotations__)
    empty = dataclasses.replace(mesh_inputs(), dataset=report)
    assert conforms(json.loads(json.dumps(build_plan(empty))), PlanDocument) == []


def test_the_check_finds_an_undeclared_key_a_missing_one_and_a_value_of_another_type():
    plan = json.loads(json.dumps(PLANS["measured"]()))
    plan["strategy"]["total_gpus"] = "3"
    plan["strategy"]["gpus"] = 3
    del plan["version"]
    assert sorted(conforms(plan, PlanDocument)) == [".strategy.gpus: not a key of StrategySection",
                                                    ".strategy.total_gpus: '3' is not int",
                                                    ".version: missing from PlanDocument"]
