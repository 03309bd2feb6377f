"""`hf-diffspec bench`: speed of speculative decoding against plain `generate` and against what a user would use
instead, measured as ratios within one run.

- `methods`: what a benchmarked method runs (`Method`) and ours (`build_method_drafters`): one drafter run several
  ways through our loop, plus D²SD;
- `peers`: what a user would run instead (prompt lookup, transformers' DFlash path, z-lab's loop, a smaller sibling
  as assistant model), skipped with the reason where they cannot run;
- `oracle`: loop efficiency, an oracle drafter at a chosen tau through our loop;
- `runner`: `run_benchmark`, every method on the same batches, interleaved, into `MethodRun` totals;
- `report`: the rows (`summarize`), markdown tables, JSON and plot.

Every report starts with the machine record (`hf_diffspec.machine.machine_description`).
"""

from ..machine import machine_description, machine_markdown
from .methods import PROMPT_LOOKUP_TOKENS, SPECULATIVE_METHODS, Method, build_method_drafters
from .oracle import (
    OracleCandidateGenerator, OracleRunner, oracle_acceptance, oracle_drafts_for, oracle_efficiency,
    oracle_markdown_table, oracle_methods,
)
from .peers import ASSISTANT_SIBLINGS, PEER_METHODS, MaskVectorRow, ZLabRunner, peer_methods
from .report import markdown_table, plot, summarize, write_json
from .runner import MIN_TIMED_CALLS, MethodRun, StepCounts, TargetForwardCounter, run_benchmark
from .runner import _encode_batches, _generate  # noqa: F401  (the step-timing scripts in examples/ call them)

__all__ = [
    "ASSISTANT_SIBLINGS",
    "MIN_TIMED_CALLS",
    "MaskVectorRow",
    "Method",
    "MethodRun",
    "OracleCandidateGenerator",
    "OracleRunner",
    "PEER_METHODS",
    "PROMPT_LOOKUP_TOKENS",
    "SPECULATIVE_METHODS",
    "StepCounts",
    "TargetForwardCounter",
    "ZLabRunner",
    "build_method_drafters",
    "machine_description",
    "machine_markdown",
    "markdown_table",
    "oracle_acceptance",
    "oracle_drafts_for",
    "oracle_efficiency",
    "oracle_markdown_table",
    "oracle_methods",
    "peer_methods",
    "plot",
    "run_benchmark",
    "summarize",
    "write_json",
]
