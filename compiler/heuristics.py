"""Inductor heuristics the compiler changes (one: which row reductions run in a single pass).

Contract: `set_persistent_rows(n)` makes every later Inductor compile in this process generate
single-pass ("persistent": the whole row in registers, read once) code for inner reductions over at
most `n` static elements; `n = 0` restores Inductor's own rule (a handler someone else installed
is left alone). `compile_pipe` calls it with the flags' `persistent_rows` (`max-optimize`: 2048),
or 0. Process-wide, like the other backend switches
(`torch.backends...`): Inductor keeps its heuristics in one handler per thread (`V.choices`), set
here for the calling thread and, through `config.inductor_choices_class`, for threads that compile
later. Only codegen changes; results are the same up to reduction order.

Why: Inductor's rule stops at 1024 elements, and a DiT with hidden size 1152 (PixArt, Latte) has all
its LayerNorm / residual + FP8-quantisation rows just above it. Looped, such a kernel reads its row
two or three times (statistics, then amax of the modulated value, then the quantised write) and
writes and re-reads the modulated row. Single-pass on an H100 (PixArt-α 1024², 8192 rows x 1152,
`triton.multi_kernel` timing both forms): residual + LayerNorm + modulation + quantisation 49.4 ->
33.7 us, LayerNorm + modulation + quantisation 37.9 -> 29.2 us, residual + quantisation 26.4 ->
23.7 us; about 3 % of a step (BENCHMARKS.md, "sixth round"). `triton.multi_kernel` itself cannot be
used: torch 2.11 fails to load its kernels from the FX-graph cache (a warm start crashes).
"""

from __future__ import annotations

import functools

# Imported by `compile_pipe` when it first compiles, not by `import compiler`: importing Inductor
# takes seconds (`compiler.prewarm` does it in the background).
from torch._inductor import config
from torch._inductor.choices import InductorChoices
from torch._inductor.runtime.hints import ReductionHint
from torch._inductor.virtualized import V


class PersistentRowChoices(InductorChoices):
    """Inductor's default heuristics, except: inner reductions over <= `max_row` static elements
    are persistent."""

    def __init__(self, max_row: int):
        super().__init__()
        self.max_row = max_row

    def uuid(self) -> str:   # part of the FX-graph cache key where torch takes custom choices
        return f"diffcompiler.persistent_rows={self.max_row}"

    def should_use_persistent_reduction(self, features, cooperative_reduction) -> bool:
        if (config.triton.persistent_reductions and not cooperative_reduction
                and features.get_reduction_hint() == ReductionHint.INNER):
            try:
                n = int(features.reduction_numel)
            except TypeError:   # symbolic (dynamic shapes): Inductor's own rule
                n = None
            if n is not None and n <= self.max_row:
                return True
        return super().should_use_persistent_reduction(features, cooperative_reduction)


def set_persistent_rows(max_row: int) -> None:
    """`max_row = 0` undoes only this module's handler: one the user installed stays."""
    if max_row:
        V.set_choices_handler(PersistentRowChoices(max_row))
        if hasattr(config, "inductor_choices_class"):
            config.inductor_choices_class = functools.partial(PersistentRowChoices, max_row)
        return
    if isinstance(V.choices, PersistentRowChoices):
        V.set_choices_handler(InductorChoices())
    if getattr(getattr(config, "inductor_choices_class", None), "func", None) is PersistentRowChoices:
        config.inductor_choices_class = None


def persistent_rows() -> int:
    """The calling thread's limit (0: Inductor's own rule)."""
    return getattr(V.choices, "max_row", 0)
