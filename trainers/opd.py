"""AdaFlash on-policy distillation (OPD): rounds of "decode with the live speculative system, then train on what it
produced" with a reverse-KL objective.

A round generates trajectories with `target.generate(..., assistant_model=current_drafter)` (our own loop, so the
data is exactly what the deployed system produces), writes them as data shards, and trains the drafter on them with
`ReverseKLTrainer`; the next round decodes with the updated drafter. Every round's data and drafter are kept under
`out/round-N/`, so an interrupted run resumes at the first unfinished round.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from hf_diffspec.modeling import DiffusionDrafter

from .block_diffusion import BlockDiffusionTrainer
from .data import ShardWriter, classify_domain


class ReverseKLTrainer(BlockDiffusionTrainer):
    """AdaFlash's loss per block slot (anchor excluded, weights w_k = exp(-(k-1)/decay), N = sum of weights):

        alpha * sum_i w_i CE_i / N  +  (1 - alpha) * sum_i w_i min(KL_i(p_S || p_T) / N, clip)

    with the reverse KL computed exactly over the vocabulary at temperature T (times T^2), p_T the target's own
    next-token distribution at that position of the trajectory.
    """

    def __init__(self, *args, alpha: float = 0.8, kl_clip: float = 0.01, temperature: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha, self.kl_clip, self.temperature = alpha, kl_clip, temperature

    def block_loss(self, logits, labels, weights, target_logits_fn):
        ce = super().block_loss(logits, labels, weights, target_logits_fn)
        kl = reverse_kl(logits, target_logits_fn(), self.temperature)
        total = weights.sum().clamp(min=1e-6)
        self._metrics["reverse_kl"].append(float((weights * kl).sum().detach() / total))
        # the clip applies per position, to that position's share of the mean (AdaFlash's reference code)
        return self.alpha * ce + (1 - self.alpha) * (weights * torch.clamp(kl / total, max=self.kl_clip)).sum()


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_S || p_T) per row, exact over the vocabulary, scaled by T^2."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1) * temperature**2


@torch.no_grad()
def write_trajectories(target, tokenizer, drafter, prompts: list[dict], out_dir, target_name: str,
                       max_new_tokens: int, do_sample: bool = False) -> dict:
    """Decode `prompts` with the speculative system and store prompt + response as shards; returns tau per domain."""
    writer = ShardWriter(out_dir, target_name, tokenizer, source="on-policy")
    committed, steps = {}, {}
    for record in tqdm(prompts, desc="on-policy trajectories"):
        if record["id"] in writer.done_ids:
            continue
        ids = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"].to(target.device)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=do_sample)
        domain = record.get("domain") or classify_domain(record["prompt"])
        writer.add(record["id"], out[0].tolist(), ids.shape[1], domain)
        stats = drafter.last_generation_stats
        committed[domain] = committed.get(domain, 0) + sum(stats.committed_per_step)
        steps[domain] = steps.get(domain, 0) + len(stats.committed_per_step)
    writer.flush()
    return {d: committed[d] / steps[d] for d in committed if steps[d]}


def run_opd(target, tokenizer, target_name: str, init: str, prompts: list[dict], out, rounds: int,
            samples_per_round: int, max_new_tokens: int, train_config, command: str | None = None) -> Path:
    """`rounds` OPD rounds starting from the drafter at `init`; returns the folder of the final drafter."""
    from .pipeline import TrainConfig, train_drafter

    out = Path(out)
    current = Path(init)
    if len(prompts) < rounds * samples_per_round:
        raise ValueError(f"{rounds} rounds x {samples_per_round} samples need {rounds * samples_per_round} prompts, "
                         f"got {len(prompts)}")
    history = []
    for r in range(rounds):
        round_dir = out / f"round-{r}"
        drafter_dir = round_dir / "drafter"
        if (drafter_dir / "config.json").is_file():  # finished earlier: resume after it
            current = drafter_dir
            history.append(json.loads((round_dir / "round.json").read_text()))
            continue
        drafter = DiffusionDrafter.from_pretrained(current, target=target)
        batch = prompts[r * samples_per_round : (r + 1) * samples_per_round]
        tau = write_trajectories(target, tokenizer, drafter, batch, round_dir / "data", target_name, max_new_tokens)
        cfg = TrainConfig(**{**train_config.__dict__, "data": [str(round_dir / "data")], "out": str(drafter_dir),
                             "init": str(current), "kind": "opd", "resume": False})
        train_drafter(target, tokenizer, target_name, cfg, command=command)
        info = {"round": r, "tau_while_generating": tau, "init": str(current)}
        (round_dir / "round.json").write_text(json.dumps(info, indent=2))
        history.append(info)
        current = drafter_dir
    (out / "opd_history.json").write_text(json.dumps(history, indent=2))
    return current
