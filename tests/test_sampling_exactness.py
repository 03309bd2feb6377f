"""Sampling is lossless, tested with the power to see a wrong rejection rule.

Two levels, both against EXACT laws (not against a second sample):
- the rule itself (`choose_token_among_drafts`) on fixed (p, q) over 6 tokens, 100,000 calls per form: a chain's one
  child, and siblings drawn without replacement as the runtime draws them (`drafting_prefix_tree.py`: a D²SD node's main
  draft, then the alternative from the VP law without it; `drafting_best_first.py`: child j from q without its earlier
  siblings). The committed token must follow p, and (accepted sibling or none, token) its exact law;
- whole `generate` calls of tiny real targets over 6 tokens (Llama, Qwen3, Qwen3.5 Gated DeltaNet), drafts drawn
  from fixed laws that are not the target's (the drafter's `_distributions` replaced, so trees carry the very laws
  their drafts came from as `draft_probs`), a fixed number of drafts at every step: the joint law of the 4 new tokens
  must be plain sampling's, every continuation's probability enumerated from the target's own softmax.

Then each deliberate break of the rule fails both levels. A chain shows two of them (residual left at p, acceptance
min(1, q/p)); the other two need siblings (an un-normalised residual only changes later siblings' acceptances, the
final multinomial normalising by itself; comparing every sibling against the original p changes nothing for one).

The statistic is Pearson's chi-square over the cells expected >= 5 times (the rest pooled). Seeds are fixed, so the
p-values are deterministic; the measured ones are in the comments. The real rule must pass at p > 1e-4 (the generate
cases measured 0.017-0.94 with two other seeds too), a break must fall below 1e-6.
"""

import itertools

import pytest
import torch

import hf_diffspec.runtime.batch as batch_module
import hf_diffspec.runtime.verification as verification
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator
from hf_diffspec.runtime.verification import choose_token_among_drafts

from helpers import tiny_drafter, tiny_dual_drafter, tiny_hybrid_target, tiny_target

PASS = 1e-4  # the real rule's p-values must stay above this
CAUGHT = 1e-6  # a broken rule's must fall below this


def chi_square_p_value(counts: torch.Tensor, law: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against the exact `law` (same shape): cells expected fewer than
    `min_expected` times are pooled into one (merged with the smallest other cell if still below)."""
    counts, law = counts.flatten().double(), law.flatten().double()
    expected = law / law.sum() * counts.sum()
    big = expected >= min_expected
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    if expected[-1] < min_expected and len(expected) > 1:
        smallest = int(expected[:-1].argmin())
        observed[smallest] += observed[-1]
        expected[smallest] += expected[-1]
        observed, expected = observed[:-1], expected[:-1]
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


# ----- the deliberate breaks (same signature as the real rule) --------------------------------------------------------
def residual_left_at_p(scores, children):
    """After a rejection, p is kept instead of norm(max(0, p - q))."""
    p = scores.softmax(dim=-1)[0]
    for token, q in children:
        q = q.to(p.device, p.dtype)
        if float(torch.rand(())) * float(q[token]) < float(p[token]):
            return torch.tensor([token], device=scores.device)
    return torch.multinomial(p, num_samples=1)


def residual_not_renormalised(scores, children):
    """max(0, p - q) without dividing by its sum: later siblings' acceptances are too low (the final multinomial
    normalises by itself, so a chain, one child, cannot show it). A floor keeps the final draw possible when the
    shrunken residual is covered by the next q entirely (the real rule's residual sums to 1 and cannot vanish)."""
    p = scores.softmax(dim=-1)[0]
    for token, q in children:
        q = q.to(p.device, p.dtype)
        if float(torch.rand(())) * float(q[token]) < float(p[token]):
            return torch.tensor([token], device=scores.device)
        p = (p - q).clamp(min=0)
    return torch.multinomial(p.clamp(min=1e-30), num_samples=1)


def acceptance_q_over_p(scores, children):
    """Accept with probability min(1, q/p) instead of min(1, p/q)."""
    p = scores.softmax(dim=-1)[0]
    for token, q in children:
        q = q.to(p.device, p.dtype)
        if float(torch.rand(())) * float(p[token]) < float(q[token]):
            return torch.tensor([token], device=scores.device)
        p = (p - q).clamp(min=0)
        p = p / p.sum()
    return torch.multinomial(p, num_samples=1)


def sibling_mass_not_removed(scores, children):
    """Every sibling is compared against the original p (a rejected sibling's mass is not removed before the next is
    tried); the final draw is from the residual. One child (a chain) is unaffected."""
    original = p = scores.softmax(dim=-1)[0]
    for token, q in children:
        q = q.to(p.device, p.dtype)
        if float(torch.rand(())) * float(q[token]) < float(original[token]):
            return torch.tensor([token], device=scores.device)
        p = (p - q).clamp(min=0)
        p = p / p.sum()
    return torch.multinomial(p, num_samples=1)


# each break and the form it is shown failing on (the chain breaks fail on trees too; the others need siblings)
BREAKS = {
    "residual_left_at_p": (residual_left_at_p, "chain"),
    "acceptance_q_over_p": (acceptance_q_over_p, "chain"),
    "residual_not_renormalised": (residual_not_renormalised, "tree"),
    "sibling_mass_not_removed": (sibling_mass_not_removed, "tree"),
}


def use_rule(monkeypatch, rule) -> None:
    """Route the runtime's rejection sampling to `rule` (batch.py imported the function by name)."""
    monkeypatch.setattr(verification, "choose_token_among_drafts", rule)
    monkeypatch.setattr(batch_module, "choose_token_among_drafts", rule)


# ----- the rule alone -------------------------------------------------------------------------------------------------
P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
# the laws siblings are drawn from (without the earlier siblings' tokens), far from P: the first child is accepted
# with probability sum_x min(p, q) = 0.45
Q = [torch.tensor([0.05, 0.05, 0.10, 0.20, 0.25, 0.35]),
     torch.tensor([0.10, 0.40, 0.05, 0.05, 0.30, 0.10]),
     torch.tensor([0.35, 0.05, 0.30, 0.10, 0.05, 0.15])]
FORMS = {  # the laws of a node's children: a chain's one child, a D²SD node (the main draft, then the alternative from
    "chain": [Q[0]],  # the VP law), a best-first node (three children from one law, without replacement)
    "tree": [Q[0], Q[1]],
    "best_first": [Q[0], Q[0], Q[0]],
}
UNIT_DRAWS = 100_000


def without(law: torch.Tensor, taken) -> torch.Tensor:
    """`law` with the tokens `taken` removed, renormalised: the law the next sibling is drawn from."""
    law = law.double().clone()
    law[list(taken)] = 0
    return law / law.sum()


def draw_siblings(laws, n: int) -> torch.Tensor:
    """(n, len(laws)) sibling tokens: sibling k drawn from laws[k] without the earlier siblings' tokens."""
    tokens = torch.empty(n, len(laws), dtype=torch.long)
    for k, law in enumerate(laws):
        if k == 0:
            tokens[:, 0] = torch.multinomial(law, n, replacement=True)
            continue
        earlier, group = torch.unique(tokens[:, :k], dim=0, return_inverse=True)
        for g, taken in enumerate(earlier.tolist()):
            rows = (group == g).nonzero().flatten()
            tokens[rows, k] = torch.multinomial(without(law, taken).float(), len(rows), replacement=True)
    return tokens


def exact_outcome_law(p: torch.Tensor, laws) -> torch.Tensor:
    """The real rule's exact law of (which sibling is accepted, K = none; the committed token): (K + 1, vocab)."""
    siblings = len(laws)
    law = torch.zeros(siblings + 1, len(p), dtype=torch.float64)

    def tried(k: int, drawn: tuple, weight: float, residual: torch.Tensor) -> None:
        """Sibling k is tried with probability `weight`, the target's law then being `residual`."""
        if k == siblings:
            law[k] += weight * residual
            return
        q = without(laws[k], drawn)
        after = (residual - q).clamp(min=0)
        after = after / after.sum() if after.sum() > 0 else after
        for token in q.nonzero().flatten().tolist():
            accept = min(1.0, float(residual[token] / q[token]))
            law[k, token] += weight * float(q[token]) * accept
            if accept < 1:
                tried(k + 1, drawn + (token,), weight * float(q[token]) * (1 - accept), after)

    tried(0, (), 1.0, p.double())
    return law


def run_rule(rule, laws, n: int) -> torch.Tensor:
    """Counts (K + 1, vocab) of (accepted sibling or none, committed token) over `n` calls of `rule`, each on fresh
    siblings drawn from `laws`."""
    scores = P.log()[None]
    children_of = {}  # the [(token, its law given the earlier siblings)] of each distinct draw, built once
    outcomes = []
    for drawn in map(tuple, draw_siblings(laws, n).tolist()):
        if drawn not in children_of:
            children_of[drawn] = [(token, without(laws[k], drawn[:k]).float()) for k, token in enumerate(drawn)]
        token = int(rule(scores, children_of[drawn]))
        outcomes.append((drawn.index(token) if token in drawn else len(drawn)) * len(P) + token)
    return torch.bincount(torch.tensor(outcomes), minlength=(len(laws) + 1) * len(P)).view(len(laws) + 1, len(P))


def test_the_exact_laws_these_tests_use_are_lossless():
    """The arithmetic the statistical tests rest on: under the real rule the committed token's law is p exactly,
    and the first child is accepted with probability sum_x min(p(x), q(x))."""
    for laws in FORMS.values():
        law = exact_outcome_law(P, laws)
        torch.testing.assert_close(law.sum(0), P.double())
        torch.testing.assert_close(law[0].sum(), torch.minimum(P, laws[0]).sum().double())


@pytest.mark.parametrize("form", FORMS)
def test_rejection_rule_commits_exactly_p(one_torch_thread, form):
    """100,000 calls of the real rule, siblings drawn afresh each time: the committed token follows p, the first
    child is accepted with probability sum_x min(p, q), and (accepted sibling, token) follows its exact law."""
    torch.manual_seed(0)
    laws = FORMS[form]
    counts = run_rule(choose_token_among_drafts, laws, UNIT_DRAWS)
    law = exact_outcome_law(P, laws)
    accepted_first = counts[0].sum()
    first = torch.stack([accepted_first, UNIT_DRAWS - accepted_first])
    expected_first = law[0].sum()
    # measured p-values (token law / first acceptance / joint): chain 0.44 / 0.78 / 0.70, tree 0.48 / 0.91 / 0.78,
    # best_first 0.31 / 0.14 / 0.38
    assert chi_square_p_value(counts.sum(0), P) > PASS
    assert chi_square_p_value(first, torch.stack([expected_first, 1 - expected_first])) > PASS
    assert chi_square_p_value(counts, law) > PASS


@pytest.mark.parametrize("name", BREAKS)
def test_a_broken_rejection_rule_is_caught(one_torch_thread, name):
    """Each break, on the form that shows it, commits tokens whose law is measurably not p (5,000 calls)."""
    rule, form = BREAKS[name]
    torch.manual_seed(1)
    counts = run_rule(rule, FORMS[form], 5_000)
    # measured p-values: residual_left_at_p 3e-118, acceptance_q_over_p 0 (underflow), residual_not_renormalised
    # 2e-52, sibling_mass_not_removed 6e-36; seeds 2-5: at most 7e-123, 0, 5e-47, 1e-33
    assert chi_square_p_value(counts.sum(0), P) < CAUGHT


# ----- whole generate calls -------------------------------------------------------------------------------------------
VOCAB = 6
NEW_TOKENS = 4
# the drafter's laws, far enough from the targets' that about half of the first children are rejected: per block slot
# (a chain's drafts, a best-first tree's children, a D²SD tree's main drafts), and the law of D²SD branches (their
# alternatives and continuations)
SLOT_LAWS = torch.tensor([[0.20, 0.20, 0.10, 0.10, 0.20, 0.20],
                          [0.10, 0.20, 0.20, 0.10, 0.20, 0.20],
                          [0.20, 0.10, 0.10, 0.20, 0.20, 0.20]])
BRANCH_LAW = torch.tensor([0.10, 0.10, 0.30, 0.10, 0.30, 0.10])


@pytest.fixture
def drafts_from_known_laws(monkeypatch):
    """Every drafter of the test draws from `SLOT_LAWS` / `BRANCH_LAW` whatever its network says: trees then carry
    exactly these laws as `draft_probs`, which is all rejection sampling needs to be exact."""

    def distributions(self, logits):
        if logits.dim() == 3:  # (rows, slots, vocab): a block's slots
            slots = SLOT_LAWS[torch.arange(logits.shape[1]).clamp(max=len(SLOT_LAWS) - 1)]
            return slots.expand(logits.shape[0], -1, -1).clone()
        return BRANCH_LAW.expand(logits.shape[0], -1).clone()  # (slots, vocab): D²SD branch spans

    monkeypatch.setattr(DiffusionCandidateGenerator, "_distributions", distributions)


class RuleRecorder:
    """Wraps the runtime's rejection rule: per call, how many children it got and which was accepted (len = none)."""

    def __init__(self, monkeypatch, rule=choose_token_among_drafts):
        self.outcomes: list[tuple[int, int]] = []

        def recording(scores, children):
            token = rule(scores, children)
            tokens = [t for t, _ in children]
            chosen = int(token)
            self.outcomes.append((len(children), tokens.index(chosen) if chosen in tokens else len(children)))
            return token

        use_rule(monkeypatch, recording)

    def accepted_at(self, index: int) -> int:
        return sum(1 for _, i in self.outcomes if i == index)

    @property
    def all_rejected(self) -> int:
        return sum(1 for n, i in self.outcomes if i == n)


def exact_continuation_law(target, prompt: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                           top_k: int = 0) -> torch.Tensor:
    """The exact law of plain sampling's `new_tokens` tokens after `prompt` (1, length): (vocab ** new_tokens,),
    continuation (t_1 ... t_n) at index sum t_j vocab^(n - j), from the target's own fp32 softmax of
    logits / temperature (top-k: the rest at -inf), every continuation enumerated."""
    vocab = target.get_output_embeddings().weight.shape[0]
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=new_tokens - 1)), dtype=torch.long)
    ids = torch.cat([prompt.expand(len(prefixes), -1), prefixes.view(len(prefixes), -1)], dim=1)
    with torch.no_grad():
        logits = target(ids).logits[:, prompt.shape[1] - 1 :].float() / temperature  # (prefixes, new_tokens, vocab)
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    log_probs = logits.log_softmax(-1).double()
    prefix = log_probs[:, :-1].gather(2, prefixes.view(len(prefixes), -1, 1)).squeeze(2).sum(1)
    return (prefix[:, None] + log_probs[:, -1]).exp().flatten()


def continuation_counts(target, drafter, prompt: torch.Tensor, rows: int, calls: int, **kwargs) -> torch.Tensor:
    """Counts of every continuation over `calls` calls of `rows` copies of `prompt` (independent draws)."""
    vocab = target.get_output_embeddings().weight.shape[0]
    weights = vocab ** torch.arange(NEW_TOKENS - 1, -1, -1)
    ids = prompt.expand(rows, -1)
    counts = torch.zeros(vocab**NEW_TOKENS)
    for _ in range(calls):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=True,
                              max_new_tokens=NEW_TOKENS, **kwargs)
        counts += torch.bincount((out[:, prompt.shape[1] :] * weights).sum(-1), minlength=len(counts))
    return counts


def prompt_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(seed))


def chain_case():
    target = tiny_target("llama", seed=0, vocab_size=VOCAB, sharpen=10)
    return target, tiny_drafter(target, block_size=4), dict(temperature=0.8, top_k=0, num_assistant_tokens=2)


def d2sd_case():
    target = tiny_target("llama", seed=1, vocab_size=VOCAB, sharpen=10)
    dual = tiny_dual_drafter(target, block_size=4, num_branches=2, tree_budget=8)
    return target, dual, dict(temperature=0.8, top_k=0, num_assistant_tokens=2)


def best_first_case():
    target = tiny_target("qwen3", seed=2, vocab_size=VOCAB, sharpen=10)
    drafter = tiny_drafter(target, block_size=4)
    drafter.config.draft_tree_budget, drafter.config.draft_tree_width = 10, 5  # up to 5 siblings
    return target, drafter, dict(temperature=1.0, top_k=0, num_assistant_tokens=2)


def hybrid_case():
    target = tiny_hybrid_target("qwen3_5", seed=0, vocab_size=VOCAB, layers=2, sharpen=10)
    return target, tiny_drafter(target, block_size=4), dict(temperature=1.0, top_k=4, num_assistant_tokens=2)


# name: (case, rows per call, calls, siblings expected). The rows of a call are independent draws: 256 rows make
# 10,240 draws cheap. One row pays generate's fixed cost (~8 ms) per draw: 600 draws there, the code path's check.
CASES = {
    "chain_1_row": (chain_case, 1, 600, False),
    "chain_256_rows": (chain_case, 256, 40, False),
    "d2sd_tree_256_rows": (d2sd_case, 256, 40, True),
    "best_first_tree_256_rows": (best_first_case, 256, 40, True),
    "hybrid_chain_256_rows": (hybrid_case, 256, 40, False),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.every_step_speculates("asserts drafts were verified, accepted and rejected")
def test_speculative_sampling_is_exactly_plain_sampling(monkeypatch, one_torch_thread, drafts_from_known_laws, name):
    """The joint law of the new tokens, speculating every step with drafts far from the target, is plain sampling's
    exact law (chi-square over every continuation)."""
    case, rows, calls, siblings = CASES[name]
    target, drafter, kwargs = case()
    prompt = prompt_ids()
    recorder = RuleRecorder(monkeypatch)
    torch.manual_seed(0)
    counts = continuation_counts(target, drafter, prompt, rows, calls, **kwargs)
    law = exact_continuation_law(target, prompt, NEW_TOKENS, kwargs["temperature"], kwargs["top_k"])
    # the drafts were verified, accepted and rejected, often enough to matter (measured: the first child accepted at
    # 45-58% of the rule's calls, every child rejected at 13-55%; a second sibling accepted at 11% (D²SD) and 13%)
    verified = len(recorder.outcomes)
    assert verified >= rows * calls  # at least one call per row
    assert recorder.accepted_at(0) > 0.1 * verified and recorder.all_rejected > 0.1 * verified
    if siblings:  # second siblings were tried and accepted: what the sibling breaks get wrong
        assert recorder.accepted_at(1) > 0.02 * verified
    # measured p-values (degrees of freedom): chain_1_row 0.53 (30), chain_256_rows 0.20 (158), d2sd_tree 0.037 (187),
    # best_first_tree 0.34 (290), hybrid_chain 0.81 (178); seeds 1 and 2 gave 0.30 / 0.46, 0.89 / 0.60,
    # 0.94 / 0.89, 0.69 / 0.29, 0.017 / 0.34
    assert chi_square_p_value(counts, law) > PASS


@pytest.mark.parametrize("name", BREAKS)
@pytest.mark.every_step_speculates("the broken rule must be exercised at every step")
def test_a_broken_rejection_rule_is_caught_in_generate(monkeypatch, one_torch_thread, drafts_from_known_laws, name):
    """Each break, in a generate case of its form (chains for the chain breaks; best-first trees of up to 5 siblings,
    where later siblings are tried often, for the others), makes the new tokens' joint law measurably not plain
    sampling's (1,536 draws)."""
    rule, form = BREAKS[name]
    target, drafter, kwargs = chain_case() if form == "chain" else best_first_case()
    prompt = prompt_ids()
    recorder = RuleRecorder(monkeypatch, rule)
    torch.manual_seed(1)
    counts = continuation_counts(target, drafter, prompt, 256, 6, **kwargs)
    law = exact_continuation_law(target, prompt, NEW_TOKENS, kwargs["temperature"], kwargs["top_k"])
    assert len(recorder.outcomes) >= 256 * 6
    if form == "tree":
        assert max(children for children, _ in recorder.outcomes) >= 3
    # measured p-values: residual_left_at_p 3e-15, acceptance_q_over_p 0 (underflow), residual_not_renormalised
    # 5e-34, sibling_mass_not_removed 2e-20; seeds 2-5: at most 5e-13, 0, 3e-23, 7e-22
    assert chi_square_p_value(counts, law) < CAUGHT
