"""Where an engine's time goes, counted as it runs (issue 32's served-step account).

Each step's wall time by kind ("decode": every scheduled sequence fed one token; "mixed": at
least one prefill chunk), the part of it spent in the model and the sampler (the arithmetic),
and the rows it fed; around the steps, what the asyncio front's loop spends running commands,
handing outputs to their streams and waiting for work, and the engine thread's CPU time.
Totals since the engine started: a reader takes two snapshots and subtracts. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

STEP_KINDS = ("decode", "mixed")


@dataclass
class StepTotals:
    """Totals over the steps of one kind."""

    steps: int = 0
    wall_s: float = 0.0  # schedule to outputs: the whole step on the engine thread
    compute_s: float = 0.0  # of wall_s, the model's forward pass and sampling
    decode_rows: int = 0  # sequences fed one token
    prefill_tokens: int = 0  # tokens of prefill chunks

    @property
    def host_s(self) -> float:
        """Of wall_s, what is not compute: scheduling, the integrity check, bookkeeping,
        detokenizing and building the step's outputs."""
        return max(0.0, self.wall_s - self.compute_s)


@dataclass
class EngineTimes:
    """An engine's time totals; `record_step` is called by the engine after each step, the
    loop fields by the asyncio front (runtime/async_engine.py), zero for an engine driven
    directly."""

    decode: StepTotals = field(default_factory=StepTotals)
    mixed: StepTotals = field(default_factory=StepTotals)
    commands_s: float = 0.0  # admissions, aborts, releases run between steps
    publish_s: float = 0.0  # handing each step's outputs to the streams' event loops
    idle_s: float = 0.0  # waiting for work, nothing in flight
    loop_cpu_s: float = 0.0  # the engine thread's own CPU time (its share of the compute too)

    def record_step(self, decode_rows: int, prefill_tokens: int, wall_s: float,
                    compute_s: float) -> None:
        """One step that fed `decode_rows` single tokens and `prefill_tokens` chunk tokens,
        took `wall_s` seconds, `compute_s` of them in the model and sampler."""
        totals = self.mixed if prefill_tokens else self.decode
        totals.steps += 1
        totals.wall_s += wall_s
        totals.compute_s += compute_s
        totals.decode_rows += decode_rows
        totals.prefill_tokens += prefill_tokens

    def kind(self, name: str) -> StepTotals:
        """The totals of one of STEP_KINDS; KeyError for another name."""
        if name not in STEP_KINDS:
            raise KeyError(name)
        return getattr(self, name)

    def copy(self) -> EngineTimes:
        """A snapshot that later steps do not change (for another thread to read)."""
        return dataclasses.replace(self, decode=dataclasses.replace(self.decode),
                                   mixed=dataclasses.replace(self.mixed))
