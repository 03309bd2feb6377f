"""What a benchmarked method runs (`Method`) and the names of the methods: data only, imported by every other
module of the benchmark."""

from dataclasses import dataclass, field
from typing import Callable

SPECULATIVE_METHODS = ("dflash", "dflash-fixed", "dflash-block", "adaflash", "tree", "tree-lookup", "d2sd",
                       "d2sd-reuse", "d2sd-resample")
PEER_METHODS = ("pld", "hf-dflash", "zlab", "ar-assistant", "vllm", "vllm-dflash")
#: candidate tokens per prompt-lookup step: the value transformers' documentation uses
PROMPT_LOOKUP_TOKENS = 10


@dataclass
class Method:
    """What one benchmarked method runs.

    - `drafter`: our drafter, run through our loop (None and no `runner`: `target.generate` with `generate_kwargs`);
    - `generate_kwargs`: extra `generate` arguments (a peer's `assistant_model`, `prompt_lookup_num_tokens`, ...);
    - `runner`: a loop that is not `target.generate`: `runner(target, inputs, max_new_tokens)` returns
      (sequences, `StepCounts` or None); a `runner.prepare(target, batches, max_new_tokens)`, when present, is called
      once before the warm-up, untimed; a runner with `samples = True` also takes the sampling settings
      (`runner(target, inputs, max_new_tokens, sampling)`), the others decode greedily only;
    - `skip_reason`: the method cannot run here, and why (reported instead of results);
    - `single_row`: why the method cannot decode several rows at once (None: it can); skipped at batch size > 1;
    - `peer`: someone else's loop: its tau is counted from target forwards, and an error in its warm-up is reported
      as a skip (with the error) instead of stopping the benchmark;
    - `target_patch`: a context manager factory, `target_patch(target)`, entered around each of the method's calls
      (`MaskVectorRow.applied`).
    """

    drafter: object | None = None
    generate_kwargs: dict = field(default_factory=dict)
    runner: Callable | None = None
    skip_reason: str | None = None
    single_row: str | None = None
    peer: bool = False
    target_patch: Callable | None = None
