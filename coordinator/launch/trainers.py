"""The trainers an mlx_lm fine-tune runs with (``coord run --trainer NAME``), with what each declares
about itself.

Everything that differs by trainer (where checkpoints are written, what they hold, what a resume
copies, which commands and launchers a trainer goes with) reads these declarations; nothing asks for
a trainer by its name, so a trainer is one line here and its program."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypedDict

#: What a plan says about a trainer (``async`` is a keyword, hence the functional form).
TrainerFacts = TypedDict("TrainerFacts", {"name": str, "gradient_sync": str, "async": bool, "saving": str,
                                          "contents": str, "sharding": str})


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
    #: what ``coord plan`` says of it, from its code (``{ranks}`` in ``sharding``: the attempt's ranks)
    plan: TrainerFacts


_MLX_LM_PLAN: TrainerFacts = {
    "name": "mlx-lm's trainer (mlx_lm/tuner/trainer.py)",
    "gradient_sync": "all-reduce mean of the gradients once per optimizer step (mlx.nn.average_gradients, "
                     "after the accumulation steps)",
    "async": False,
    "saving": "rank 0 saves inside the training loop (mx.save_safetensors); the other ranks wait for it at "
              "the next gradient all-reduce",
    "contents": "trainable parameters only (the adapters, or every weight of a full fine-tune): no optimizer "
                "state, so the optimizer's moments, the LR schedule and the data order start again at a resume",
    "sharding": "every micro-batch is split over the {ranks} ranks: rank r takes examples r, r + {ranks}, … of "
                "it",
}

_COORD_PLAN: TrainerFacts = {
    "name": "coord's trainer (python -m agent.train, agent/trainer)",
    "gradient_sync": "all_sum over the ranks of the token-loss gradients and token counts, divided by the global "
                     "token count, once per optimizer step",
    "async": True,
    "saving": "the training thread copies the arrays to host memory; one background thread writes the file",
    "contents": "trainable parameters, the optimizer state, and the LR schedule position, RNG key and data "
                "position: a resume continues exactly where the run stopped",
    "sharding": "each optimizer step's global batch is a fixed slice of a seeded shuffle; every micro-batch "
                "is split over the {ranks} ranks in contiguous slices",
}

DEFAULT_TRAINER = "mlx_lm"

#: name -> what it declares
TRAINERS: dict[str, Trainer] = {
    "mlx_lm": Trainer(program="agent.mlx_lm_train", every_rank_saves=False, exact_resume=False, plan=_MLX_LM_PLAN),
    "coord": Trainer(program="agent.train", every_rank_saves=True, exact_resume=True, plan=_COORD_PLAN),
}


def trainer_declared(name: str) -> Trainer:
    """What the trainer a job names declares (KeyError names the ones there are)."""
    if name not in TRAINERS:
        raise KeyError(f"unknown trainer {name!r} (one of {', '.join(TRAINERS)})")
    return TRAINERS[name]


def trainer_named_in(command: Sequence[str]) -> str | None:
    """The trainer whose program a command runs itself (``python -m agent.train ...``), or None."""
    return next((name for name, t in TRAINERS.items() if t.program in command[:3]), None)


__all__ = ["DEFAULT_TRAINER", "TRAINERS", "Trainer", "TrainerFacts", "trainer_declared", "trainer_named_in"]
