"""The trainers an mlx_lm fine-tune runs with (``coord run --trainer NAME``), with what each declares
about itself.

Everything that differs by trainer (where checkpoints are written, what they hold, what a resume
copies, which commands and launchers a trainer goes with) reads these declarations; nothing asks for
a trainer by its name, so a trainer is one line here and its program."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Trainer(NamedTuple):
    """What a trainer declares."""

    #: the module coord runs on every rank in place of ``python -m mlx_lm lora`` (``python -m MODULE``,
    #: with the command's options)
    program: str
    #: every rank writes each checkpoint on its own node (data parallel ranks hold the same
    #: weights); otherwise rank 0 alone saves, and the other nodes get copies
    every_rank_saves: bool
    #: a checkpoint holds the optimizer state, the LR schedule, the RNG and the data position besides the
    #: weights, so a resume continues exactly (and the trainer, given the job's total, finds its own step)
    exact_resume: bool


DEFAULT_TRAINER = "mlx_lm"

#: name -> what it declares
TRAINERS: dict[str, Trainer] = {
    "mlx_lm": Trainer(program="agent.mlx_lm_train", every_rank_saves=False, exact_resume=False),
    "coord": Trainer(program="agent.train", every_rank_saves=True, exact_resume=True),
}


def trainer_declared(name: str) -> Trainer:
    """What the trainer a job names declares (KeyError names the ones there are)."""
    if name not in TRAINERS:
        raise KeyError(f"unknown trainer {name!r} (one of {', '.join(TRAINERS)})")
    return TRAINERS[name]


def trainer_named_in(command: Sequence[str]) -> str | None:
    """The trainer whose program a command runs itself (``python -m agent.train ...``), or None."""
    return next((name for name, t in TRAINERS.items() if t.program in command[:3]), None)


__all__ = ["DEFAULT_TRAINER", "TRAINERS", "Trainer", "trainer_declared", "trainer_named_in"]
