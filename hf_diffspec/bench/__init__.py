"""`hf-diffspec bench`: speed of speculative decoding against plain `generate` and against what a user would use
instead, measured as ratios within one run.

- `method`: what a benchmarked method runs (`Method`) and the methods' names (data only);
- `counting`: what a call did (`StepCounts`), counted from the target's forwards where a loop reports nothing
  (`TargetForwardCounter`);
- `peers`: what a user would run instead (prompt lookup, transformers' DFlash path, z-lab's loop, a smaller sibling
  as assistant model), skipped with the reason where they cannot run;
- `registry`: every method by name (`build_method_drafters`): ours, one drafter run several ways through our loop
  plus D²SD, and the peers;
- `oracle`: loop efficiency, an oracle drafter at a chosen tau through our loop;
- `runner`: `run_benchmark`, every method on the same batches, interleaved, into `MethodRun` totals;
- `report`: the rows (`summarize`), markdown tables, JSON and plot.

Every report starts with the machine record (`hf_diffspec.machine.machine_description`).
"""

from ..machine import machine_description, machine_markdown
from .counting import StepCounts, TargetForwardCounter, eos_token_ids
from .method import PEER_METHODS, PROMPT_LOOKUP_TOKENS, SPECULATIVE_METHODS, Method
from .oracle import (
    OracleCandidateGenerator, OracleRunner, oracle_acceptance, oracle_drafts_for, oracle_efficiency,
    oracle_markdown_table, oracle_methods,
)
from .peers import ASSISTANT_SIBLINGS, MaskVectorRow, ZLabRunner, peer_methods
from .registry import build_method_drafters
from .report import markdown_table, plot, summarize, write_json
from .runner import MIN_TIMED_CALLS, MethodRun, encode_batches, run_benchmark, run_method

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
    "encode_batches",
    "eos_token_ids",
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
    "run_method",
    "summarize",
    "write_json",
]
