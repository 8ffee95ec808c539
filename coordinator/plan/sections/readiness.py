"""The plan's readiness sections: the sync before a launch, the workers' consistency, the data set's
chunks and the pre-flight checklist."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

from coordinator.jobs import robust
from coordinator.plan.inputs import PlanInputs, rank_order, usable_calibrations, usable_rate
from coordinator.plan.options import ResolvedOptions, positive_int
from coordinator.plan.provenance import Section, SectionFields

#: The pre-flight layers under the names the plan format gives its checklist entries.
CHECKLIST_NAMES = {"health": "health_check", "hardware": "hardware_layer", "worker": "worker_layer",
                   "worker_consistency": "worker_consistency", "pre_rdma_sync": "pre_rdma_sync",
                   "checkpoint": "checkpoint_layer", "gradient": "gradient_layer",
                   "performance": "performance_layer"}


Status = Literal["pass", "warn", "fail"]


class PreRdmaSyncSection(SectionFields, total=False):
    sync_script: str
    validation_checks: list[str]
    block_on_failure: bool
    sync_status: Status
    sync_output: str


class TrainingFingerprints(TypedDict, total=False):
    """What a job's replica checks found while it trained, or why there are none."""

    enabled: bool
    reason: str  # not enabled
    job: str | None
    steps_compared: int
    last_step: int | None
    last_agreed_step: int | None
    divergences: list[str]


class ByzantineDetection(TypedDict):
    enabled: bool
    divergent_workers: list[str]  # nodes whose code differs from the majority's
    rate_outliers: list[str]
    krum_aggregation: str
    training_fingerprints: TrainingFingerprints


class ConsistencySection(SectionFields, total=False):
    validation_checks: list[str]
    script_hash: str
    hashes: dict[str, str]  # node -> its code's tree hash
    is_consistent: bool
    agreement_ratio: float
    consistency_threshold: float
    byzantine_detection: ByzantineDetection


class ChunkingSection(SectionFields, total=False):
    chunk_size: int
    num_chunks: int
    examples: int
    memory_management: dict[str, bool]
    progress_reporting: str


class ChecklistEntry(TypedDict):
    """One pre-flight layer, under the name the plan format gives it."""

    name: str
    status: Status  # the worst of its checks
    checks: list[str]
    detail: NotRequired[str]  # what is not passing
    fix_command: NotRequired[str]


class ChecklistSection(SectionFields, total=False):
    checks: list[ChecklistEntry]
    validation_layers: list[str]
    block_on_failure: bool
    overall_status: Status


def pre_rdma_sync_section(inputs: PlanInputs, options: ResolvedOptions) -> PreRdmaSyncSection:
    section: Section[PreRdmaSyncSection] = Section()
    if inputs.preflight is None:
        return section.disabled("pre-flight has not run: coord preflight")
    checks = [check for check in inputs.preflight.get("checks") or []
              if check.get("layer") in ("pre_rdma_sync", "worker_consistency")]
    if not checks:
        return section.disabled("pre-flight reported no sync or consistency checks")
    failing = [check for check in checks if check["status"] != "pass"]
    status = "fail" if any(c["status"] == "fail" for c in checks) else "warn" if failing else "pass"
    section.put("sync_script", inputs.sync_hook or "coord sync (built in: hash every node, send what differs, "
                "verify each file's SHA256)", "cluster file sync.hook" if inputs.sync_hook else
                "cluster file: no sync.hook, so coord's own sync is the only step")
    section.put("validation_checks", [check["name"] for check in checks], "coord preflight checks of these layers")
    section.put("block_on_failure", not options["force"][0], "coord run refuses a failed pre-flight unless --force; "
                + options["force"][1])
    section.put("sync_status", status, "worst status of those checks (coord preflight)")
    section.put("sync_output", "; ".join(f"{c['name']}: {c['detail']}" for c in failing or checks),
                "coord preflight check details")
    return section.done()


def consistency_section(inputs: PlanInputs) -> ConsistencySection:
    report = inputs.consistency
    section: Section[ConsistencySection] = Section()
    if report is None:
        return section.disabled("no consistency report: coord sync or coord preflight compares every node's code")
    hashes = dict(report.get("hashes") or {})
    majority, divergent = robust.majority_fingerprint(hashes)
    checks = [check["name"] for check in ((inputs.preflight.get("checks") or []) if inputs.preflight else [])
              if check.get("layer") == "worker_consistency"]
    section.put("validation_checks", ["code_tree_sha256", "agreement_ratio_threshold", *checks],
                "coord sync's manifest comparison" + (" and coord preflight" if checks else ""))
    if majority is None:
        section.lack("script_hash", f"no code tree is held by a majority of the {len(hashes)} nodes")
    else:
        section.put("script_hash", majority, f"SHA256 tree hash of the code held by {len(hashes) - len(divergent)}"
                    f"/{len(hashes)} nodes")
    section.put("hashes", hashes, "SHA256 tree hash of each node's code (coord sync manifests)")
    section.put("is_consistent", report.get("status") == "pass", f"coord consistency: {report.get('detail')}")
    section.put("agreement_ratio", report.get("ratio"), "share of nodes holding the majority tree")
    section.put("consistency_threshold", report.get("threshold"), "cluster file sync.threshold")
    order, _ = rank_order(inputs)
    usable, _ = usable_calibrations(inputs, order)
    rates = {name: usable_rate(record) for name, record in usable.items()}
    training = training_fingerprints(inputs.replica_check)
    detection: ByzantineDetection = {
        "enabled": True,
        "divergent_workers": divergent,
        "rate_outliers": robust.outliers(rates) if len(rates) >= robust.MIN_ITEMS else [],
        "krum_aggregation": "not used for training: ranks average gradients by all-reduce; Krum-style scores "
                            "only find replicas that differ (fingerprints by majority, rates by Krum score)",
        "training_fingerprints": training,
    }
    section.put("byzantine_detection", detection, "robust.majority_fingerprint over the code hashes; robust.outliers "
                "over the calibration rates"
       + ("; the weight fingerprints of job " + str(training["job"]) + "'s ranks, compared by majority as it trained"
          if training["enabled"] else ""))
    return section.done()


def training_fingerprints(check: Mapping[str, Any] | None) -> TrainingFingerprints:
    """What a job's replica checks found while it trained (coord's trainer, --fingerprint-every N)."""
    if not check or not check.get("steps_compared"):
        return {"enabled": False, "reason": "no job has compared its ranks' weights yet: coord's trainer does it "
                                            "with --fingerprint-every N (coord run --trainer coord)"}
    return {"enabled": True, "job": check.get("job"), "steps_compared": check["steps_compared"],
            "last_step": check.get("last_step"), "last_agreed_step": check.get("last_agreed"),
            "divergences": [f"attempt {d.get('attempt')}: {d.get('detail')} ({', '.join(d.get('nodes') or [])})"
                            for d in check.get("divergences") or []]}


def chunking_section(inputs: PlanInputs) -> ChunkingSection:
    dataset = inputs.dataset
    section: Section[ChunkingSection] = Section()
    if not dataset:
        return section.disabled("no data set given: coord plan --data DIR")
    source = f"data set report: {dataset.get('source') or 'the data directory'}"
    examples, size = dataset.get("examples"), dataset.get("chunk_size")
    if positive_int(examples) and positive_int(size) and examples < size and not dataset.get("chunks"):
        return section.disabled(f"{examples} examples: below the {size:,} at which coord validates and counts a "
                                f"data set in chunks, so it is read in one pass ({source})", examples=examples,
                                chunk_size=size)
    fields: Mapping[str, object] = dataset  # read by name
    for name, key in (("chunk_size", "chunk_size"), ("num_chunks", "chunks"), ("examples", "examples")):
        if positive_int(fields.get(key)):
            section.put(name, fields[key], source)
        else:
            section.lack(name, "the data set report does not give it")
    for name in ("memory_management", "progress_reporting"):
        if fields.get(name) is not None:
            section.put(name, fields[name], source)
        else:
            section.lack(name, "the data set report does not give it")
    return section.done(flagged=True)


def checklist_section(inputs: PlanInputs, options: ResolvedOptions) -> ChecklistSection:
    preflight = inputs.preflight
    section: Section[ChecklistSection] = Section()
    if preflight is None:
        return section.disabled("pre-flight has not run: coord preflight")
    checks = preflight.get("checks") or []
    layers = [layer for layer in CHECKLIST_NAMES if any(c.get("layer") == layer for c in checks)]
    entries: list[ChecklistEntry] = []
    for layer in layers:
        own = [c for c in checks if c.get("layer") == layer]
        bad = [c for c in own if c["status"] != "pass"]
        status: Status = "fail" if any(c["status"] == "fail" for c in own) else "warn" if bad else "pass"
        entry: ChecklistEntry = {"name": CHECKLIST_NAMES[layer], "status": status, "checks": [c["name"] for c in own]}
        if bad:
            entry["detail"] = "; ".join(f"{c['name']}: {c['detail']}" for c in bad)
            fixes = [fix for c in bad if (fix := c.get("fix_command"))]
            if fixes:
                entry["fix_command"] = "; ".join(fixes)
        entries.append(entry)
    section.put("checks", entries, "coord preflight, grouped by layer (worst status of each layer's checks)")
    section.put("validation_layers", layers, "the layers coord preflight checked")
    section.put("block_on_failure", not options["force"][0], "coord run refuses a failed pre-flight unless --force; "
                + options["force"][1])
    section.put("overall_status", preflight.get("status"), "coord preflight")
    return section.done()
