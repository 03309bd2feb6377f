"""What a decoding call did, counted: `StepCounts` (from our loop's statistics, or from the target's forwards with
`TargetForwardCounter` for loops that report none) and the target's EOS ids (`eos_token_ids`). Used by the runner,
the peers and the oracle alike."""

from dataclasses import dataclass, fields


@dataclass
class StepCounts:
    """What decoding did, per row and step: tokens committed after the prefill's, loop steps (row-steps at batch > 1),
    tokens verified (real candidates, anchors included), slots the target computed (padding included), target
    forwards after the prefill, and the prefill's seconds; and our loop's steps by kind: with a drafter forward, with
    prompt-lookup drafts alone, plain (0 where unknown). Calls add up with `+`."""

    committed: int = 0
    steps: int = 0
    verified: int = 0
    slots: int = 0
    forwards: int = 0
    prefill_seconds: float = 0.0
    draft_steps: int = 0
    lookup_steps: int = 0
    plain_steps: int = 0

    @classmethod
    def of(cls, stats) -> "StepCounts":
        """From our loop's `SpeculationStats`."""
        return cls(committed=sum(stats.committed_per_step), steps=len(stats.committed_per_step),
                   verified=stats.verified_tokens, slots=stats.verified_slots, forwards=stats.target_forwards - 1,
                   prefill_seconds=stats.prefill_time_s, draft_steps=stats.draft_steps,
                   lookup_steps=stats.lookup_steps, plain_steps=stats.plain_steps)

    def __add__(self, other: "StepCounts") -> "StepCounts":
        return StepCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def tau(self) -> float:
        """Tokens committed per row per step (1.0 for plain decoding, which reports no steps)."""
        return self.committed / self.steps if self.steps else 1.0


class TargetForwardCounter:
    """Counts the target's forwards and the tokens each one reads, for loops that report no statistics of their own
    (transformers' assisted generation, z-lab's loop). Batch size 1: the first forward is the prefill."""

    def __init__(self, target):
        self.target = target
        self.lengths: list[int] = []

    def __enter__(self) -> "TargetForwardCounter":
        def count(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs.get("inputs_embeds")
            self.lengths.append(ids.shape[1])

        self.handle = self.target.register_forward_pre_hook(count, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def counts(self, new_tokens: int) -> StepCounts:
        """`new_tokens`: what the call generated; the prefill forward picks the first of them."""
        steps = self.lengths[1:]
        return StepCounts(committed=max(new_tokens - 1, 0), steps=len(steps), verified=sum(steps), slots=sum(steps),
                          forwards=len(steps))


def eos_token_ids(target) -> set[int]:
    eos = target.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
