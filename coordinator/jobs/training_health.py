"""Whether the training is sound, from the values its ranks report: non-finite values and loss spikes.

coord watches the processes (do they live, do they step) and, here, what they compute. A loss or a
gradient norm that is NaN or infinite means the weights or the batch went bad: the run must not be
called succeeded, and by default it rolls back to the checkpoint before it (docs/recovery.md). A
loss far above its recent values (a spike: PaLM and OPT restarted from before each one) is said,
and rolled back from only when the job asks. Pure, tested without processes.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from shared.json_values import value_text

#: The values a train record may carry that say whether the training is sound: any of them NaN or
#: infinite is a divergence.
HEALTH_VALUES = ("loss", "grad_norm")

#: The loss spike rule: over the last SPIKE_WINDOW finite losses of the attempt (at least
#: SPIKE_MIN_POINTS of them), a loss is a spike when it is more than SPIKE_RATIO times their median
#: and higher than every one of them. The ratio keeps the noise of a flat, quiet curve from
#: counting; the window's highest keeps a noisy curve's ordinary swings out (a loss that went as
#: high within the last 50 is no news).
SPIKE_WINDOW = 50
SPIKE_MIN_POINTS = 10
SPIKE_RATIO = 1.5

ON_DIVERGENCE = ("rollback", "stop")
ON_SPIKE = ("warn", "rollback")


@dataclass(frozen=True)
class Unsound:
    """A step whose values say the training went wrong."""

    kind: str  # "non_finite" or "loss_spike" (policy.NON_FINITE, policy.LOSS_SPIKE)
    step: int
    metric: str  # "loss", "grad_norm", "val_loss"
    value: float
    detail: str


def non_finite(step: int, values: dict[str, float], metrics: tuple[str, ...] = HEALTH_VALUES) -> Unsound | None:
    """The first of ``metrics`` in ``values`` that is NaN or infinite, as an Unsound step; None when all are finite."""
    for metric in metrics:
        value = values.get(metric)
        if value is not None and not math.isfinite(value):
            return Unsound("non_finite", step, metric, value, f"{metric} is {value_text(value)} at step {step}")
    return None


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    median: float
    threshold: float

    def describe(self) -> str:
        return (f"loss spike at step {self.step}: {value_text(self.loss)} against a median of "
                f"{value_text(self.median)} over the last {SPIKE_WINDOW} losses (a spike is above "
                f"{value_text(self.threshold)}: {SPIKE_RATIO:g}x the median, and above the highest of them)")


class LossWindow:
    """The attempt's recent finite losses, and whether a new one spikes above them.

    One spike is said once: the losses that follow it count as the same spike until one is below
    the threshold again. A spike's loss does not enter the window (it would raise the bar for the
    next)."""

    def __init__(self) -> None:
        self.losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.in_spike = False

    def add(self, step: int, loss: float) -> Spike | None:
        """Take the loss of ``step``; a Spike when it is the first loss of a new spike."""
        if not math.isfinite(loss):
            return None
        threshold = spike_threshold(list(self.losses))
        if threshold is not None and loss > threshold:
            first = not self.in_spike
            self.in_spike = True
            return Spike(step, loss, statistics.median(self.losses), threshold) if first else None
        self.in_spike = False
        self.losses.append(loss)
        return None


def spike_threshold(losses: list[float]) -> float | None:
    """The loss above which the next one is a spike (None: too few losses to tell)."""
    if len(losses) < SPIKE_MIN_POINTS:
        return None
    median = statistics.median(losses)
    # The ratio taken of the median's size, so that a loss that is negative (some objectives) works too.
    return max(median + abs(median) * (SPIKE_RATIO - 1), max(losses))
