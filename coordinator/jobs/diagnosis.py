"""Known ways an MLX training run on Macs fails, each with how it is recognised and its fix.

Pure functions over plain data: a rank's log text, the job's command and environment, and
the nodes' facts and topologies (``agent.facts.collect_facts``,
``agent.topology.collect_topology``). Every diagnosis is a ``Diagnosis``
(``{"id", "title", "detail", "fix"}``); one found in a log adds the first matching line
(``"line"``) and its 1-based number (``"line_number"``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from coordinator.launch.mlx_lm_command import MLX_LM_FORMS, option_value
from coordinator.launch.topology import BRIDGE_INSTRUCTION
from coordinator.nodes import versions
from shared.text import clean_excerpt

#: mlx-lm's default --num-layers: without the flag it trains only the top 16 blocks.
MLX_LM_DEFAULT_LAYERS = 16
#: The first mlx-lm that no longer builds up the validation graph.
MLX_LM_FIXED_VALIDATION = "0.30.2"
#: Above this many steps between checkpoints a crash costs too much work.
MAX_SAVE_EVERY = 1000
FAST_SYNCH_VARIABLE = "MLX_METAL_FAST_SYNCH"
# coord runs mlx-lm's trainer through its own module; its options are mlx_lm lora's.
_COORD_TRAINER_FORM = ["-m", "agent.mlx_lm_train"]


class Diagnosis(TypedDict):
    """A known failure found, with its fix."""

    id: str
    title: str
    detail: str  # what showed it
    fix: str
    line: NotRequired[str]  # found in a log: the first line that shows it
    line_number: NotRequired[int]  # and its number, from 1


class RunDiagnosis(TypedDict):
    """A diagnosis as a run keeps it (``JobRecord.diagnoses``) and coord status shows it."""

    id: str
    title: str
    detail: str  # where it was found: what showed it
    fix: str
    line: str | None  # the log line, when found in a log


@dataclass(frozen=True)
class FailureMode:
    id: str
    title: str
    detection: str
    fix: str
    log_pattern: re.Pattern[str] | None = None


METAL_TIMEOUT = FailureMode(
    id="metal_command_buffer_timeout",
    title="Metal command buffer timed out (kIOGPUCommandBufferCallbackErrorTimeout)",
    detection="log: [METAL] Command buffer execution failed: Caused GPU Timeout Error",
    fix=("make each GPU command shorter: a smaller --batch-size (keep the effective batch with "
         "--grad-accumulation-steps), a shorter --max-seq-length, --grad-checkpoint, or LoRA instead of a full "
         "fine-tune; a lower MLX_MAX_OPS_PER_BUFFER in the job's environment commits smaller command buffers"),
    log_pattern=re.compile(r"kIOGPUCommandBufferCallbackErrorTimeout|Caused GPU Timeout Error"),
)
METAL_OUT_OF_MEMORY = FailureMode(
    id="metal_out_of_memory",
    title="Metal ran out of memory (kIOGPUCommandBufferCallbackErrorOutOfMemory)",
    detection="log: [METAL] Command buffer execution failed: Insufficient Memory",
    fix=("size the job with coord plan, then lower --batch-size or --max-seq-length, add --grad-checkpoint, or "
         "use LoRA"),
    log_pattern=re.compile(r"kIOGPUCommandBufferCallbackErrorOutOfMemory"),
)
GPU_WEDGED = FailureMode(
    id="gpu_submissions_ignored",
    title="the GPU ignores this process's work after earlier GPU errors",
    detection="log: kIOGPUCommandBufferCallbackErrorSubmissionsIgnored",
    fix=(f"reboot the Mac; unset {FAST_SYNCH_VARIABLE} if it was set, and fix the error that came first "
         "(often a command buffer timeout)"),
    log_pattern=re.compile(r"kIOGPUCommandBufferCallbackErrorSubmissionsIgnored|"
                           r"Ignored \(for causing prior/excessive GPU errors\)"),
)
TOP_LAYERS_ONLY = FailureMode(
    id="mlx_lm_top_layers_only",
    title=f"mlx-lm trains only the top {MLX_LM_DEFAULT_LAYERS} blocks by default",
    detection="command: mlx_lm lora without --num-layers",
    fix="pass --num-layers -1 to train every block (or the number you mean)",
)
OLD_MLX_LM = FailureMode(
    id="mlx_lm_validation_graph",
    title="mlx-lm before 0.30.2 builds up the validation graph (memory grows during validation)",
    detection="the nodes' mlx-lm version",
    fix="pip install -U 'mlx-lm>=0.30.2' in every node's Python",
)
SAVE_EVERY_TOO_LARGE = FailureMode(
    id="save_every_too_large",
    title=f"checkpoints more than {MAX_SAVE_EVERY} steps apart",
    detection="command: --save-every",
    fix=f"--save-every {MAX_SAVE_EVERY} or less (coord run --save-every N): a crash costs up to one interval",
)
FAST_SYNCH = FailureMode(
    id="metal_fast_synch",
    title=f"{FAST_SYNCH_VARIABLE}=1 can wedge the GPU until a reboot",
    detection=f"environment: {FAST_SYNCH_VARIABLE}",
    fix=f"unset {FAST_SYNCH_VARIABLE} in the job's environment (and in the hostfile's envs)",
)
MACOS_BUILDS_DIFFER = FailureMode(
    id="macos_builds_differ",
    title="the Macs run different macOS builds",
    detection="node facts: os_build",
    fix="update every Mac to the same macOS version and build (System Settings > General > Software Update)",
)
BRIDGE_WITH_RDMA = FailureMode(
    id="thunderbolt_bridge_with_rdma",
    title="Thunderbolt Bridge is enabled on a node that uses RDMA",
    detection="node topology: thunderbolt_bridge.enabled with rdma.state enabled",
    fix=BRIDGE_INSTRUCTION.format(interface="bridge0"),
)

KNOWN_FAILURES = (METAL_TIMEOUT, METAL_OUT_OF_MEMORY, GPU_WEDGED, TOP_LAYERS_ONLY, OLD_MLX_LM,
                  SAVE_EVERY_TOO_LARGE, FAST_SYNCH, MACOS_BUILDS_DIFFER, BRIDGE_WITH_RDMA)
LOG_FAILURES = tuple((mode, mode.log_pattern) for mode in KNOWN_FAILURES if mode.log_pattern is not None)


def diagnosis(mode: FailureMode, detail: str, fix: str | None = None) -> Diagnosis:
    return {"id": mode.id, "title": mode.title, "detail": detail, "fix": fix or mode.fix}


# --- logs -------------------------------------------------------------------------------------


def diagnose_log(text: str) -> list[Diagnosis]:
    """Each known failure the log shows, once, with the first line that shows it (as an excerpt:
    without the terminal's colours and control characters, which would also hide a match)."""
    found: dict[str, Diagnosis] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = clean_excerpt(raw)
        for mode, pattern in LOG_FAILURES:
            if mode.id not in found and pattern.search(line):
                found[mode.id] = {**diagnosis(mode, f"line {number} of the log"), "line": line,
                                  "line_number": number}
        if len(found) == len(LOG_FAILURES):
            break
    return sorted(found.values(), key=lambda d: d["line_number"])


# --- the job ----------------------------------------------------------------------------------


def diagnose_job(command: Sequence[str], env: Mapping[str, str] | None = None,
                 mlx_lm_version: str | None = None) -> list[Diagnosis]:
    """Known failures the job's command line, environment and mlx-lm version set up.

    Only options given on the command line are seen: a ``--config`` YAML file may set
    others. ``mlx_lm_version`` is the oldest on the nodes (None: unknown, not checked).
    """
    out = []
    args = mlx_lm_lora_args(command)
    if args is not None:
        out.extend(_mlx_lm_options(args))
        old = _old_mlx_lm(mlx_lm_version)
        if old is not None:
            out.append(old)
    value = {**(env or {}), **_env_words(command)}.get(FAST_SYNCH_VARIABLE)
    if _switched_on(value):
        out.append(diagnosis(FAST_SYNCH, f"the job's environment sets {FAST_SYNCH_VARIABLE}={value}"))
    return out


def _env_words(command: Sequence[str]) -> dict[str, str]:
    """``env NAME=VALUE ... program``: the variables such a command sets for the program."""
    words = list(command)
    if not words or words[0].split("/")[-1] != "env":
        return {}
    found = {}
    for word in words[1:]:
        if "=" not in word or word.startswith("-"):
            break
        name, value = word.split("=", 1)
        found[name] = value
    return found


def _switched_on(value: str | None) -> bool:
    return value is not None and value.strip() not in ("", "0")


def mlx_lm_lora_args(command: Sequence[str]) -> list[str] | None:
    """mlx_lm lora's own options in ``command`` (as given or as coord rewrote it), or None."""
    words = list(command)
    if words[:1] == ["mlx_lm.lora"]:
        return words[1:]
    if words and words[0].split("/")[-1].startswith("python"):
        for form in (*MLX_LM_FORMS, _COORD_TRAINER_FORM):
            if words[1:1 + len(form)] == form:
                return words[1 + len(form):]
    return None


def _mlx_lm_options(args: list[str]) -> list[Diagnosis]:
    out = []
    given_config = option_value(args, "--config") or option_value(args, "-c")
    config_note = " (its --config file may set it)" if given_config else ""
    if option_value(args, "--num-layers") is None:
        kind = option_value(args, "--fine-tune-type") or "lora"
        out.append(diagnosis(TOP_LAYERS_ONLY, f"mlx_lm lora --fine-tune-type {kind} without --num-layers"
                                              f"{config_note}: only the top {MLX_LM_DEFAULT_LAYERS} blocks train"))
    save_every = option_value(args, "--save-every")
    if save_every is not None and save_every.isdigit() and int(save_every) > MAX_SAVE_EVERY:
        out.append(diagnosis(SAVE_EVERY_TOO_LARGE, f"--save-every {save_every}: a crash loses up to "
                                                   f"{save_every} steps"))
    return out


def _old_mlx_lm(version: str | None) -> Diagnosis | None:
    """Flagged only when known to be older (an unparseable version is not checked)."""
    if versions.at_least(version, MLX_LM_FIXED_VALIDATION) is not False:
        return None
    return diagnosis(OLD_MLX_LM, f"mlx-lm {version} is older than {MLX_LM_FIXED_VALIDATION}")


# --- the cluster ------------------------------------------------------------------------------


def diagnose_cluster(node_facts: Mapping[str, Mapping[str, Any] | None],
                     topologies: Mapping[str, Mapping[str, Any] | None] | None = None) -> list[Diagnosis]:
    """Known failures the nodes set up: {node: agent facts} and {node: agent topology}, each as the
    node reported it (read key by key)."""
    out = []
    builds = _macos_builds(node_facts)
    if builds is not None:
        out.append(builds)
    old = {name: facts.get("mlx_lm_version") for name, facts in sorted(node_facts.items())
           if facts and _old_mlx_lm(facts.get("mlx_lm_version")) is not None}
    if old:
        out.append(diagnosis(OLD_MLX_LM, f"older than {MLX_LM_FIXED_VALIDATION}: "
                             + ", ".join(f"{n} has mlx-lm {v}" for n, v in old.items()),
                             f"pip install -U 'mlx-lm>={MLX_LM_FIXED_VALIDATION}' in the Python of {', '.join(old)}"))
    fast = {name: (facts.get("mlx_env") or {}).get(FAST_SYNCH_VARIABLE) for name, facts in sorted(node_facts.items())
            if facts and _switched_on((facts.get("mlx_env") or {}).get(FAST_SYNCH_VARIABLE))}
    if fast:
        out.append(diagnosis(FAST_SYNCH, "set in the environment ranks get on " + ", ".join(
            f"{n} ({FAST_SYNCH_VARIABLE}={v})" for n, v in fast.items()),
            f"remove {FAST_SYNCH_VARIABLE} from the shell start-up files of {', '.join(fast)} "
            "(the environment of an SSH login)"))
    for name, topology in sorted((topologies or {}).items()):
        bridge = _bridge_with_rdma(name, topology)
        if bridge is not None:
            out.append(bridge)
    return out


def _macos_builds(node_facts: Mapping[str, Mapping[str, Any] | None]) -> Diagnosis | None:
    builds = {name: (facts.get("os_version"), facts.get("os_build")) for name, facts in node_facts.items()
              if facts and facts.get("os") == "macOS" and facts.get("os_build")}
    if len(set(builds.values())) < 2:
        return None
    (version, build), _ = Counter(builds.values()).most_common(1)[0]
    odd = sorted(name for name, value in builds.items() if value != (version, build))
    detail = (f"most Macs run macOS {version} ({build}); "
              + ", ".join(f"{name} runs {builds[name][0]} ({builds[name][1]})" for name in odd)
              + "; Metal and MLX behave differently across macOS builds")
    return diagnosis(MACOS_BUILDS_DIFFER, detail, f"update {', '.join(odd)} to macOS {version} ({build})")


def _bridge_with_rdma(name: str, topology: Mapping[str, Any] | None) -> Diagnosis | None:
    if not topology:
        return None
    bridge = topology.get("thunderbolt_bridge") or {}
    if not (bridge.get("enabled") and (topology.get("rdma") or {}).get("state") == "enabled"):
        return None
    interface = bridge.get("interface") or "bridge0"
    members = ", ".join(bridge.get("members") or []) or "no members listed"
    return diagnosis(BRIDGE_WITH_RDMA, f"{name}: {interface} is up ({members}) and RDMA is enabled",
                     f"{name}: " + BRIDGE_INSTRUCTION.format(interface=interface))
