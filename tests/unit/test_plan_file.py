"""`coord run --plan DIR` (coordinator/cli/plan_file.py): the directory `coord plan --launcher` wrote, read
back as the job's fields, with the launcher's file as the user left it; each way a directory can be wrong
refused with exit 2 and what to do."""

from __future__ import annotations

import json

import pytest

from coordinator.cli.client import EXIT_USAGE, CliError
from coordinator.cli.plan_file import plan_fields
from coordinator.jobs.spec import JobSpec, validate


def _section(launcher: str, processes=(1, 1), strategy: str | None = "DDP") -> dict:
    return {"launcher": launcher, "strategy": strategy, "reason": "DDP fits: 1.2 GiB of 9 GiB (a reason kept)",
            "nodes": [{"node": f"n{i + 1}", "processes": p, "device": "CPU", "usable_bytes": 1, "memory_bytes": 1}
                      for i, p in enumerate(processes)],
            "batch": {"micro_batch": 4, "gradient_accumulation_steps": 3, "world": sum(processes),
                      "global_batch": 4 * 3 * sum(processes), "target_global_batch": 24}}


def _write(directory, section: dict, files: dict[str, str]) -> str:
    directory.mkdir(exist_ok=True)
    (directory / "plan.json").write_text(json.dumps(section))
    for name, text in files.items():
        (directory / name).write_text(text)
    return str(directory)


def test_an_accelerate_plan_gives_the_jobs_launcher_nodes_batch_and_its_edited_config(tmp_path):
    yaml_text = "distributed_type: MULTI_CPU\nmixed_precision: 'no'\nnum_machines: 2\nmachine_rank: 0\n"
    given = _write(tmp_path / "coord-accelerate", _section("accelerate"),
                   {"accelerate-n1.yaml": yaml_text.replace("'no'", "bf16"), "accelerate-n2.yaml": yaml_text})
    fields = plan_fields(given)
    assert fields == {"launcher": "accelerate", "nodes": ["n1", "n2"], "procs_per_node": 1, "global_batch": 24,
                      "micro_batch": 4, "launcher_config": {"distributed_type": "MULTI_CPU", "mixed_precision": "bf16",
                                                            "num_machines": 2, "machine_rank": 0}}
    spec = validate(JobSpec(name="j", command=["python", "train.py"], **fields))  # a job coord takes as it is
    assert spec.launcher == "accelerate" and spec.launcher_config["mixed_precision"] == "bf16"


def test_a_deepspeed_plan_reads_its_ds_config(tmp_path):
    ds = {"train_batch_size": 24, "zero_optimization": {"stage": 2}}
    fields = plan_fields(_write(tmp_path / "p", _section("deepspeed"), {"ds_config.json": json.dumps(ds)}))
    assert fields["launcher"] == "deepspeed" and fields["launcher_config"] == ds


@pytest.mark.parametrize(("section", "files", "words"), [
    (None, {}, "no plan.json there"),
    ("not json", {}, "is not JSON"),
    ({"launcher": "mlx"}, {}, "is not a PyTorch plan"),
    (_section("deepspeed", strategy=None), {}, "found no strategy that fits, so there is nothing to run: DDP fits"),
    (_section("deepspeed", processes=(1, 2)), {}, "run 1, 2 processes each"),
    (_section("deepspeed"), {}, "cannot read the plan's ds_config.json"),
    (_section("deepspeed"), {"ds_config.json": "[1]"}, "not a mapping of settings"),
    (_section("accelerate"), {"accelerate-n1.yaml": "a: [unclosed"}, "not valid YAML"),
    ({**_section("accelerate"), "batch": {"micro_batch": "four"}}, {}, "is not a PyTorch plan"),
])
def test_a_directory_that_is_not_a_usable_plan_is_refused_saying_why(tmp_path, section, files, words):
    directory = tmp_path / "p"
    directory.mkdir()
    if section is not None:
        (directory / "plan.json").write_text(section if isinstance(section, str) else json.dumps(section))
    for name, text in files.items():
        (directory / name).write_text(text)
    with pytest.raises(CliError, match=words) as caught:
        plan_fields(str(directory))
    assert caught.value.status == EXIT_USAGE
