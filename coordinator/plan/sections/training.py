"""The plan's training sections: the strategy, the batch and learning rate, the expected performance, the
hardware calibration, and the steps that verify a launch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict

from agent.qos import qos_for_platform
from coordinator.jobs import robust
from coordinator.plan.inputs import (
    CALIBRATION_MODEL,
    PlanInputs,
    calibration_source,
    rank_order,
    usable_calibrations,
    usable_rate,
    utc,
)
from coordinator.plan.options import ResolvedOptions, positive_int
from coordinator.plan.provenance import Section, SectionFields
from coordinator.readiness.calibration import workload_shares

if TYPE_CHECKING:
    from coordinator.store.state import StoredCalibration


class StrategySection(SectionFields, total=False):
    approach: str
    total_gpus: int  # an MLX rank is the format's "gpu"
    nodes: int
    gpus_per_node: int
    rank_order: list[str]
    fine_tune_type: str


class BatchSection(SectionFields, total=False):
    per_gpu_batch_size: int
    total_batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    warmup_epochs: float
    base_learning_rate: float
    base_batch_size: int
    lr_scaling: str
    optimizer: str
    mlx_lm_batch_size: int
    warmup_steps: int


class PerformanceSection(SectionFields, total=False):
    throughput: str
    gpu_utilization: str
    checkpoint_overhead: str
    throughput_samples_per_s: float
    throughput_if_split_by_rate: float


class Measurement(TypedDict):
    """What the plan shows of one node's stored calibration."""

    measured_at: str
    device: str | None
    train_samples_per_s: float | None
    matmul_gflops_float32: float | None
    matmul_gflops_bfloat16: float | None
    memory_bandwidth_gbps: float | None
    peak_memory_bytes: int | None


class HardwareSection(SectionFields, total=False):
    measured_performance: dict[str, float]  # node -> training-step rate, samples/s
    workload_distribution: dict[str, float]  # node -> its share of the work
    macos_qos_api: str
    calibration_notes: str
    measurements: dict[str, Measurement]
    batch_split: dict[str, int]  # node -> its samples of a step
    rate_outliers: list[str]


def strategy_section(inputs: PlanInputs, options: ResolvedOptions) -> StrategySection:
    section: Section[StrategySection] = Section()
    if not inputs.nodes:
        return section.disabled("no nodes in the cluster file")
    order, order_source = rank_order(inputs)
    fine_tune, fine_tune_source = options["fine_tune_type"]
    section.put("approach", f"MLX data parallel, {fine_tune} fine-tune: one rank per node, every rank holds the "
                f"whole model; {_transport_text(inputs)}",
                f"{fine_tune_source}; backend: {_backend_source(inputs)}")
    section.put("total_gpus", len(order), f"rule: one MLX rank per node × {len(order)} nodes (a 'gpu' of the "
                "format is an MLX rank here)")
    section.put("nodes", len(order), "cluster file: " + ", ".join(order))
    section.put("gpus_per_node", 1, "rule: coord's hostfile lists each node once, so mlx.launch starts one rank "
                "per node, which uses all of the node's GPU (or CPU)")
    section.put("rank_order", order, order_source)
    section.put("fine_tune_type", fine_tune, fine_tune_source)
    return section.done()


def batch_section(inputs: PlanInputs, options: ResolvedOptions) -> BatchSection:
    section: Section[BatchSection] = Section()
    per_rank, per_rank_source = options["per_rank_batch_size"]
    if per_rank is None:
        return section.disabled("no per-rank batch size: give one (per_rank_batch_size) or a model to size "
                                "(coord plan --model DIR)")
    ranks = len(rank_order(inputs)[0])
    accumulation, accumulation_source = options["gradient_accumulation_steps"]
    step_batch = per_rank * ranks
    total = step_batch * accumulation
    base_rate, base_rate_source = options["learning_rate"]
    base_batch, base_batch_source = options["base_batch_size"]
    base_batch = base_batch or per_rank
    rule, rule_source = options["lr_scaling"]
    optimizer, optimizer_source = options["optimizer"]
    section.put("per_gpu_batch_size", per_rank, per_rank_source)
    section.put("total_batch_size", total,
                f"rule: total = per-rank × ranks × accumulation = {per_rank} × {ranks} × {accumulation}")
    section.put("gradient_accumulation_steps", accumulation, accumulation_source)
    formula = (f"{base_rate:g} × {total} / {base_batch}" if rule == "linear"
               else f"{base_rate:g} × √({total} / {base_batch})")
    section.put("learning_rate", scale_learning_rate(base_rate, total, base_batch, rule),
                f"rule: {rule} scaling of the base rate to the total batch: {formula}")
    section.put("base_learning_rate", base_rate, base_rate_source)
    section.put("base_batch_size", base_batch, base_batch_source)
    section.put("lr_scaling", rule, rule_source)
    section.put("optimizer", optimizer, optimizer_source)
    section.put("mlx_lm_batch_size", step_batch,
                f"rule: mlx-lm splits its --batch-size over the ranks (rank r takes examples r, r + {ranks}, "
                f"r + {2 * ranks}, … of each batch, so it must be divisible by {ranks}): per-rank × ranks = "
                f"{per_rank} × {ranks}")
    warmup, warmup_source = options["warmup_steps"]
    section.put("warmup_steps", warmup, warmup_source + "; mlx-lm takes it as lr_schedule.warmup in its --config file")
    dataset = inputs.dataset
    examples = dataset.get("examples") if dataset else None
    if dataset and positive_int(examples):
        section.put("warmup_epochs", round(warmup * total / examples, 4),
                    f"rule: warmup steps × total batch / examples = {warmup} × {total} / {examples} "
                    f"({dataset.get('source') or 'data set'})")
    else:
        section.lack("warmup_epochs", "the number of training examples is unknown (coord plan --data DIR)")
    return section.done()


def scale_learning_rate(base_rate: float, total_batch: int, base_batch: int, rule: str) -> float:
    """``linear``: base × total / base batch (Goyal et al., 2017); ``sqrt``: base × √(total /
    base batch), the rule for Adam-family optimizers (Malladi et al., 2022)."""
    factor = total_batch / base_batch
    scaled = base_rate * (math.sqrt(factor) if rule == "sqrt" else factor)
    return float(f"{scaled:.6g}")


def performance_section(inputs: PlanInputs, options: ResolvedOptions) -> PerformanceSection:
    order, _ = rank_order(inputs)
    usable, lacking = usable_calibrations(inputs, order)
    section: Section[PerformanceSection] = Section()
    if lacking:
        section.lack("throughput", "no current calibration (coord calibrate): "
                     + "; ".join(f"{name}: {why}" for name, why in lacking.items()))
    else:
        rates = {name: usable_rate(usable[name]) for name in order}
        slowest = min(rates, key=rates.__getitem__)
        equal = len(order) * rates[slowest]
        measured = "; ".join(calibration_source(name, usable[name]) for name in order)
        section.put("throughput", f"{equal:,.0f} samples/s of {CALIBRATION_MODEL}; a larger model is slower in "
                    "proportion to its compute per sample",
                    f"rule: equal split (mlx-lm) paces every step at the slowest rank: ranks × slowest rate = "
                    f"{len(order)} × {rates[slowest]:.4g} ({slowest}); gradient sync not included; {measured}")
        section.put("throughput_samples_per_s", round(equal, 2), "rule: ranks × slowest rate, as for throughput")
        section.put("throughput_if_split_by_rate", round(sum(rates.values()), 2),
                    "rule: sum of the measured rates, if each rank's batch were proportional to its rate")
    section.lack("gpu_utilization", "not measured: coord does not sample GPU utilization")
    save_every = options["save_every"][0]
    timings = inputs.timings
    if timings.checkpoint_save_s is not None and timings.step_s:
        overhead = timings.checkpoint_save_s / (save_every * timings.step_s + timings.checkpoint_save_s)
        section.put("checkpoint_overhead", f"{overhead:.1%}",
                    f"rule: save time / (save_every × step time + save time) = {timings.checkpoint_save_s:.2f} / "
                    f"({save_every} × {timings.step_s:.3f} + {timings.checkpoint_save_s:.2f}), measured")
    else:
        section.lack("checkpoint_overhead", "needs a measured checkpoint write time and step time from a run of "
                     "this job")
    return section.done()


def hardware_section(inputs: PlanInputs, options: ResolvedOptions) -> HardwareSection:
    order, _ = rank_order(inputs)
    usable, lacking = usable_calibrations(inputs, order)
    section: Section[HardwareSection] = Section()
    if not usable:
        return section.disabled("no current calibration: coord calibrate ("
                                + "; ".join(f"{name}: {why}" for name, why in lacking.items()) + ")")
    rates = {name: usable_rate(usable[name]) for name in order if name in usable}
    shares = workload_shares({name: rates.get(name) for name in order})
    measured = "; ".join(calibration_source(name, usable[name]) for name in rates)
    section.put("measured_performance", rates, f"training-step rate in samples/s of {CALIBRATION_MODEL}: {measured}")
    section.put("workload_distribution", {name: round(share, 4) for name, share in shares["shares"].items()},
                f"rule ({shares['policy']}): {shares['reason']}")
    section.put("measurements", {name: _measurement(usable[name]) for name in rates},
                "coord calibrate: each node's stored result (matmul, memory bandwidth, training step)")
    per_rank = options["per_rank_batch_size"][0]
    if per_rank is not None:
        step_batch = per_rank * len(order)
        section.put("batch_split", split_batch(step_batch, shares["shares"]),
                    f"rule: the step's {step_batch} samples split by the shares in whole samples; mlx-lm splits "
                    "equally whatever the rates, so this split needs a script that feeds each rank its own batch")
    if len(rates) >= robust.MIN_ITEMS:
        section.put("rate_outliers", robust.outliers(rates), "robust: Krum score of the rates (coordinator/plan/"
                    "robust.py: > 3 robust deviations above the median and more than 10% apart)")
    section.put("calibration_notes", shares["reason"] + (
        "; not calibrated: " + "; ".join(f"{name}: {why}" for name, why in lacking.items()) if lacking else ""),
        "coord calibrate's share policy")
    systems = {name: (inputs.facts.get(name) or {}).get("os") for name in order}
    qos = {name: qos_for_platform(system or "") for name, system in systems.items()}
    groups: dict[str, list[str]] = {}
    for name, q in qos.items():
        groups.setdefault(q["qos"] or q["reason"], []).append(name)
    section.put("macos_qos_api", "; ".join(f"{', '.join(names)}: {what}" for what, names in groups.items()),
                "coord's trainers (mlx_lm lora run by coord, and --trainer coord) set it on each rank's training "
                "thread; a script of your own gets it by calling agent.qos.set_user_interactive_qos() on its "
                "training thread: "
                + "; ".join(sorted({q["reason"] for q in qos.values()})))
    return section.done()


def split_batch(batch: int, shares: Mapping[str, float]) -> dict[str, int]:
    """``batch`` samples split by ``shares`` in whole samples (largest remainders first)."""
    exact = {name: batch * share for name, share in shares.items()}
    split = {name: math.floor(value) for name, value in exact.items()}
    left = batch - sum(split.values())
    for name in sorted(exact, key=lambda n: exact[n] - split[n], reverse=True)[:left]:
        split[name] += 1
    return split


def verification_steps(inputs: PlanInputs, options: ResolvedOptions) -> list[str]:
    """What to check before and after the launch, with the commands that do it."""
    order, _ = rank_order(inputs)
    steps = [f"coord status --check: all {len(order)} nodes up ({', '.join(order)})",
             "coord sync: every node holds the same code, data and model files (SHA256; data line counts)"]
    preflight = inputs.preflight
    if preflight is None:
        steps.append("coord preflight: not run yet")
    else:
        checks = preflight.get("checks") or []
        steps.append(f"coord preflight: {len(checks)} checks over {len(preflight.get('layers') or {})} layers, "
                     f"now {preflight.get('status')}")
        steps += [f"fix {check['name']}: {check['fix_command']}" for check in checks
                  if check.get("status") == "fail" and check.get("fix_command")]
    _, lacking = usable_calibrations(inputs, order)
    if lacking:
        steps.append(f"coord calibrate: no current calibration for {', '.join(lacking)}")
    save_every = options["save_every"][0]
    steps.append(f"after step {save_every}: coord status shows the first checkpoint validated")
    steps.append("after the launch: coord logs --rank 0 JOB shows the loss falling on every attempt")
    return steps


def _transport_text(inputs: PlanInputs) -> str:
    choice = inputs.backend
    if not choice or not choice.get("ok"):
        return f"backend not chosen yet ({inputs.backend_error or 'no topology measured'})"
    transport = {"rdma": "RDMA over Thunderbolt", "tcp": "TCP"}.get(choice.get("transport") or "", "no network")
    return f"gradients averaged by all-reduce over {choice['backend']} ({transport})"


def _backend_source(inputs: PlanInputs) -> str:
    choice = inputs.backend
    if not choice:
        return inputs.backend_error or "not chosen"
    return "; ".join(choice.get("reasons") or []) or str(choice.get("backend"))


def _measurement(record: StoredCalibration) -> Measurement:
    result = record.get("result") or {}
    gflops = result.get("matmul_gflops") or {}
    return {"measured_at": utc(record.get("measured_at")), "device": result.get("device"),
            "train_samples_per_s": result.get("train_samples_per_s"),
            "matmul_gflops_float32": gflops.get("float32"), "matmul_gflops_bfloat16": gflops.get("bfloat16"),
            "memory_bandwidth_gbps": result.get("memory_bandwidth_gbps"),
            "peak_memory_bytes": result.get("peak_memory_bytes")}
