"""Sampling is lossless, tested with the power to see a wrong rejection rule.

Two levels, both against EXACT laws (not against a second sample):
- the rule itself (`choose_token_among_drafts`) on fixed (p, q) over 6 tokens, 100,000 calls per form: a chain's one
  child, and siblings drawn without replacement as the runtime draws them (`drafting_prefix_tree.py`: a D²SD node's main
  draft, then the alternative from the VP law without it; `drafting_best_first.py`: child j from q without its earlier
  siblings). The committed token must follow p, and (accepted sibling or none, token) its exact law;
- whole `generate` calls of tiny real targets over 6 tokens (Llama, Qwen3, Qwen3.5 Gated DeltaNet), drafts drawn
  from fixed laws that are not the target's (the drafter's `_distributions` replaced, so trees carry the very laws
  their drafts came from as `draft_laws`), a fixed number of drafts at every step: the joint law of the 4 new tokens
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
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import hf_diffspec.runtime.batch as batch_module
import hf_diffspec.runtime.drafting_lookup as drafting_lookup
import hf_diffspec.runtime.verification as verification
from hf_diffspec.runtime.drafting import DiffusionCandidateGenerator
from hf_diffspec.runtime.sampling import CompactLaw

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


# ----- the deliberate breaks of the rule's one step (`verification.rejection_try`'s signature) -------------------------
def _token_mass(residual, support, token):
    if support is None:
        return residual.gather(-1, token.clamp(min=0)[..., None]).squeeze(-1)
    return ((support == token[..., None]) * residual).sum(-1)


def _law_on(residual, support, law):
    ids = support if support is not None else torch.arange(residual.shape[-1], device=residual.device)
    return law.on(ids)


def residual_left_at_p(residual, support, token, law, trying):
    """After a rejection, p is kept instead of norm(max(0, p - q))."""
    u = torch.rand(token.shape)
    return trying & (u * law.at(token.clamp(min=0)) < _token_mass(residual, support, token)), residual


def acceptance_q_over_p(residual, support, token, law, trying):
    """Accept with probability min(1, q/p) instead of min(1, p/q)."""
    u = torch.rand(token.shape)
    accepted = trying & (u * _token_mass(residual, support, token) < law.at(token.clamp(min=0)))
    after = (residual - _law_on(residual, support, law)).clamp(min=0)
    rejected = (trying & ~accepted)[..., None]
    return accepted, torch.where(rejected, after / after.sum(-1, keepdim=True).clamp(min=1e-30), residual)


def residual_not_renormalised(residual, support, token, law, trying):
    """max(0, p - q) without dividing by its sum: later siblings' acceptances are too low (the final draw normalises
    by itself, so a chain, one child, cannot show it). A floor keeps the final draw possible when the shrunken residual
    is covered by the next q entirely (the real rule's residual sums to 1 and cannot vanish)."""
    u = torch.rand(token.shape)
    accepted = trying & (u * law.at(token.clamp(min=0)) < _token_mass(residual, support, token))
    after = (residual - _law_on(residual, support, law)).clamp(min=1e-30)
    return accepted, torch.where((trying & ~accepted)[..., None], after, residual)


class SiblingMassNotRemoved:
    """Every sibling is compared against the original p (a rejected sibling's mass is not removed before the next is
    tried); the final draw is from the residual. One child (a chain) is unaffected. `start` marks a new call of the
    rule (its first try sees the original p)."""

    def __init__(self):
        self.original = None

    def start(self):
        self.original = None

    def __call__(self, residual, support, token, law, trying):
        if self.original is None:
            self.original = residual
        u = torch.rand(token.shape)
        accepted = trying & (u * law.at(token.clamp(min=0)) < _token_mass(self.original, support, token))
        after = (residual - _law_on(residual, support, law)).clamp(min=0)
        rejected = (trying & ~accepted)[..., None]
        return accepted, torch.where(rejected, after / after.sum(-1, keepdim=True).clamp(min=1e-30), residual)


# each break and the form it is shown failing on (the chain breaks fail on trees too; the others need siblings)
BREAKS = {
    "residual_left_at_p": (lambda: residual_left_at_p, "chain"),
    "acceptance_q_over_p": (lambda: acceptance_q_over_p, "chain"),
    "residual_not_renormalised": (lambda: residual_not_renormalised, "tree"),
    "sibling_mass_not_removed": (SiblingMassNotRemoved, "tree"),
}


def use_rule(monkeypatch, step) -> None:
    """Route every try of the runtime's rejection sampling, on the device path (`rejection_choices`) and the
    token-by-token one (`choose_token_among_drafts`), through `step`; a step with `start` hears each new call."""
    monkeypatch.setattr(verification, "rejection_try", step)
    start = getattr(step, "start", None)
    if start is None:
        return
    for name in ("rejection_choices", "choose_token_among_drafts"):
        real = getattr(verification, name)

        def started(*args, real=real):
            start()
            return real(*args)

        monkeypatch.setattr(verification, name, started)
        monkeypatch.setattr(batch_module, name, started)


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


def outcome_counts(drawn: torch.Tensor, chosen: torch.Tensor, siblings: int) -> torch.Tensor:
    """Counts (K + 1, vocab) of (accepted sibling or none, committed token) from the siblings `drawn` (n, K) and the
    tokens `chosen` (n,)."""
    hit = drawn == chosen[:, None]
    accepted = torch.where(hit.any(-1), hit.long().argmax(-1), siblings)
    return torch.bincount(accepted * len(P) + chosen, minlength=(siblings + 1) * len(P)).view(siblings + 1, len(P))


def run_rule(laws, n: int) -> torch.Tensor:
    """`outcome_counts` over `n` calls of the token-by-token rule (`choose_token_among_drafts`), each on fresh
    siblings drawn from `laws`."""
    scores = P.log()[None]
    children_of = {}  # the [(token, its law given the earlier siblings)] of each distinct draw, built once
    drawn = draw_siblings(laws, n)
    chosen = []
    for siblings in map(tuple, drawn.tolist()):
        if siblings not in children_of:
            children_of[siblings] = [(token, without(laws[k], siblings[:k]).float())
                                     for k, token in enumerate(siblings)]
        chosen.append(int(verification.choose_token_among_drafts(scores, children_of[siblings])))
    return outcome_counts(drawn, torch.tensor(chosen), len(laws))


def run_tensor_rule(laws, n: int) -> torch.Tensor:
    """`outcome_counts` of the device rule (`rejection_choices`) at `n` independent positions in one call: each a
    root with the siblings drawn from `laws` as its children, the target's law P over compact ids."""
    siblings = len(laws)
    drawn = draw_siblings(laws, n)
    vocab = len(P)
    ids = torch.arange(vocab).expand(n, siblings + 1, vocab)
    node_probs = torch.zeros(n, siblings + 1, vocab)
    for k, law in enumerate(laws):  # sibling k's law: laws[k] without the earlier siblings' tokens
        q = law.double().expand(n, -1).clone()
        q.scatter_(1, drawn[:, :k], 0.0)
        node_probs[:, k + 1] = (q / q.sum(-1, keepdim=True)).float()
    children = torch.full((n, siblings + 1, siblings), -1)
    children[:, 0] = torch.arange(1, siblings + 1)
    tokens = torch.cat([torch.zeros(n, 1, dtype=torch.long), drawn], dim=1)
    target = CompactLaw(ids, P.expand(n, siblings + 1, vocab))
    chosen = verification.rejection_choices(target, tokens, children, CompactLaw(ids, node_probs))[:, 0]
    return outcome_counts(drawn, chosen, siblings)


RULES = {"token_by_token": run_rule, "device": run_tensor_rule}


def test_the_exact_laws_these_tests_use_are_lossless():
    """The arithmetic the statistical tests rest on: under the real rule the committed token's law is p exactly,
    and the first child is accepted with probability sum_x min(p(x), q(x))."""
    for laws in FORMS.values():
        law = exact_outcome_law(P, laws)
        torch.testing.assert_close(law.sum(0), P.double())
        torch.testing.assert_close(law[0].sum(), torch.minimum(P, laws[0]).sum().double())


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("form", FORMS)
def test_rejection_rule_commits_exactly_p(one_torch_thread, form, rule):
    """100,000 calls of the real rule, on each path, siblings drawn afresh each time: the committed token follows p,
    the first child is accepted with probability sum_x min(p, q), and (accepted sibling, token) follows its exact
    law."""
    torch.manual_seed(0)
    laws = FORMS[form]
    counts = RULES[rule](laws, UNIT_DRAWS)
    law = exact_outcome_law(P, laws)
    accepted_first = counts[0].sum()
    first = torch.stack([accepted_first, UNIT_DRAWS - accepted_first])
    expected_first = law[0].sum()
    # measured p-values (token law / first acceptance / joint): chain 0.44 / 0.78 / 0.70, tree 0.48 / 0.91 / 0.78,
    # best_first 0.31 / 0.14 / 0.38
    assert chi_square_p_value(counts.sum(0), P) > PASS
    assert chi_square_p_value(first, torch.stack([expected_first, 1 - expected_first])) > PASS
    assert chi_square_p_value(counts, law) > PASS


def test_point_mass_siblings_are_accepted_exactly():
    """A deterministic draft (prompt lookup's copied token) is a point mass: grafted beside a drawn sibling (only
    where the drawn one is another token, as `graft` merges equal ones), the committed token still follows p, and
    the copied token is accepted as often as the rule's exact law says. Each path, 100,000 positions."""
    copied = 1
    laws = [Q[0]]
    point = torch.zeros(len(P))
    point[copied] = 1.0
    # exact: the copied token is tried after a rejected draw x != copied, against the residual norm(max(0, p - q))
    residual = (P.double() - Q[0].double()).clamp(min=0)
    residual /= residual.sum()
    tried = sum(float(Q[0][x]) * (1 - min(1.0, float(P[x] / Q[0][x]))) for x in range(len(P)) if x != copied)
    expected = tried * float(residual[copied])
    for rule in ("token_by_token", "device"):
        torch.manual_seed(3)
        drawn = torch.multinomial(Q[0], UNIT_DRAWS, replacement=True)
        if rule == "token_by_token":
            chosen = torch.tensor([int(verification.choose_token_among_drafts(
                P.log()[None], [(x, Q[0])] + ([(copied, point)] if x != copied else []))) for x in drawn.tolist()])
        else:
            n = UNIT_DRAWS
            ids = torch.arange(len(P)).expand(n, 3, -1)
            node_probs = torch.stack([torch.zeros(len(P)), Q[0], point]).expand(n, -1, -1)
            children = torch.tensor([[1, 2], [-1, -1], [-1, -1]]).repeat(n, 1, 1)
            children[drawn == copied, 0, 1] = -1  # merged: no second child
            tokens = torch.stack([torch.zeros(n, dtype=torch.long), drawn, torch.full((n,), copied)], dim=1)
            chosen = verification.rejection_choices(CompactLaw(ids, P.expand(n, 3, -1)), tokens, children,
                                                     CompactLaw(ids, node_probs))[:, 0]
        copied_accepted = int(((chosen == copied) & (drawn != copied)).sum())
        # the copied token committed without being the drawn sibling: accepted as the point mass, or drawn from the
        # residual after both were rejected (impossible: a rejected point mass leaves it no mass)
        assert chi_square_p_value(torch.bincount(chosen, minlength=len(P)), P) > PASS, rule
        assert abs(copied_accepted / UNIT_DRAWS - expected) < 5 * (expected / UNIT_DRAWS) ** 0.5, rule


def test_the_rule_runs_where_its_inputs_are_not_on_the_default_device():
    """Both paths make every tensor of their own on their inputs' device: with the default device elsewhere ("meta"
    here, a GPU's laws against a CPU default in use), a tensor made on the default device would meet the inputs in an
    op and fail. Same draws as on the default device."""
    n = 64
    ids = torch.arange(len(P)).expand(n, 3, -1)
    node_probs = torch.stack([torch.zeros(len(P)), Q[0], Q[1]]).expand(n, -1, -1)
    children = torch.tensor([[1, 2], [-1, -1], [-1, -1]]).repeat(n, 1, 1)
    tokens = torch.stack([torch.zeros(n, dtype=torch.long), torch.multinomial(Q[0], n, True),
                          torch.multinomial(Q[1], n, True)], dim=1)

    def both_paths():
        torch.manual_seed(5)
        device = verification.rejection_choices(CompactLaw(ids, P.expand(n, 3, -1)), tokens, children,
                                                CompactLaw(ids, node_probs))
        token_by_token = verification.choose_token_among_drafts(P.log()[None], [(int(tokens[0, 1]), Q[0])])
        return device, token_by_token

    expected = both_paths()
    with torch.device("meta"):
        got = both_paths()
    assert all(g.device.type == "cpu" and torch.equal(g, e) for g, e in zip(got, expected))


def test_a_rejection_that_leaves_no_mass_keeps_p(monkeypatch):
    """Where p equals the draft's law q, max(0, p - q) has no mass: a rejection (probability ~0, forced here) leaves
    p as it was, so the token is drawn from p, never from zeros."""
    law = torch.tensor([[0.25, 0.75]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape, **kw))  # every try rejected
    accepted, residual = verification.rejection_try(law, None, torch.tensor([1]), CompactLaw(None, law),
                                                    torch.tensor([True]))
    assert not accepted.any() and torch.equal(residual, law)


def test_lookup_drafts_that_repeat_drawn_drafts_are_merged_exactly(one_torch_thread):
    """A lookup chain [1, 2] after a drawn chain d0 -> d1 whose laws favour those very tokens, so the lookup nodes
    often repeat the drawn ones (`CandidateTree.lookup`): acceptance reads the merged tree, and the two tokens a
    step commits (the second drawn from p when the step stops after one) follow p x p, on both paths. Counting a
    repeat as a second try (an independent draw where it continues the drafter's path) would give the token 2 a
    second chance after a rejection, with the laws favouring it: measured p-value 4e-58 with it on the device path,
    0.19 on each path here."""
    from hf_diffspec.runtime.drafting_lookup import graft
    from hf_diffspec.runtime.tree import CandidateTree, TreeLayout

    rows, vocab, lookup = 40_000, len(P), [1, 2]
    first_law = torch.tensor([0.05, 0.60, 0.10, 0.10, 0.10, 0.05])
    second_law = torch.tensor([0.05, 0.10, 0.60, 0.10, 0.10, 0.05])
    laws = CompactLaw(None, torch.stack([torch.zeros(vocab), first_law, second_law]))
    torch.manual_seed(5)
    drawn = torch.stack([torch.multinomial(first_law, rows, True), torch.multinomial(second_law, rows, True)], 1)
    trees = [graft(CandidateTree(torch.tensor([0, a, b]), [-1, 0, 1], draft_laws=laws), lookup)
             for a, b in drawn.tolist()]
    assert sum(t.children[0].get(1) == 1 and t.children[1].get(2) == 2 for t in trees) > 0.3 * rows  # repeats
    fresh = torch.multinomial(P, rows, True)  # the next step's token where a step commits one
    for rule in ("token_by_token", "device"):
        torch.manual_seed(6)
        if rule == "device":  # the device path's laws are compact (the drafters' are compacted like the target's)
            compact = CompactLaw(torch.arange(vocab).expand(3, -1), laws.probs)
            for tree in trees:
                tree.draft_laws = compact
            layout = TreeLayout.of(trees, torch.device("cpu"))
            nodes = layout.tokens.shape[1]
            target = CompactLaw(torch.arange(vocab).expand(rows, nodes, -1), P.expand(rows, nodes, -1))
            choice = verification.rejection_choices(target, layout.tokens, batch_module._children(trees, layout),
                                                    batch_module._node_laws(trees, layout))
            reached, _, committed = batch_module._accepted_paths(layout, choice)
            pairs = torch.stack([committed[:, 0], torch.where(reached >= 2, committed[:, 1], fresh)], 1)
        else:
            pairs = []
            for tree, next_token in zip(trees, fresh.tolist()):
                node, tokens = 0, []
                while node is not None and len(tokens) < 2:
                    children = [(token, batch_module._law_of(laws, child, token, P[None]))
                                for token, child in tree.children[node].items()]
                    tokens.append(int(verification.choose_token_among_drafts(P.log()[None], children)))
                    node = tree.children[node].get(tokens[-1])
                pairs.append(tokens + [next_token] * (2 - len(tokens)))
            pairs = torch.tensor(pairs)
        counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab)
        assert chi_square_p_value(counts, torch.outer(P, P).flatten()) > PASS, rule


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("name", BREAKS)
def test_a_broken_rejection_rule_is_caught(monkeypatch, one_torch_thread, name, rule):
    """Each break, on the form that shows it, commits tokens whose law is measurably not p (5,000 calls), on each
    path."""
    make, form = BREAKS[name]
    use_rule(monkeypatch, make())
    torch.manual_seed(1)
    counts = RULES[rule](FORMS[form], 5_000)
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
    exactly these laws as `draft_laws`, which is all rejection sampling needs to be exact."""

    def draft_laws(self, logits):
        if logits.dim() == 3:  # (rows, slots, vocab): a block's slots
            probs = SLOT_LAWS[torch.arange(logits.shape[1]).clamp(max=len(SLOT_LAWS) - 1)]
            probs = probs.expand(logits.shape[0], -1, -1).clone()
        else:
            probs = BRANCH_LAW.expand(logits.shape[0], -1).clone()  # (slots, vocab): D²SD branch spans
        return CompactLaw(torch.arange(VOCAB).expand(probs.shape).clone(), probs)

    monkeypatch.setattr(DiffusionCandidateGenerator, "_draft_laws", draft_laws)


@pytest.fixture
def grafted(monkeypatch):
    """Counts the lookup nodes grafted onto trees (`graft`), as `.nodes`."""
    real = drafting_lookup.graft

    class Grafted:
        nodes = 0

    def counting(tree, drafts):
        out = real(tree, drafts)
        Grafted.nodes += len(out) - len(tree)
        return out

    monkeypatch.setattr(drafting_lookup, "graft", counting)
    return Grafted


class RuleRecorder:
    """Wraps the runtime's rejection rule on both paths (after `use_rule`, if a break is used): per position with
    children, how many it had and which was accepted (len = none). The device path decides every node of a step
    at once, reached or not: each is a draw of the rule all the same."""

    def __init__(self, monkeypatch):
        self.outcomes: list[tuple[int, int]] = []
        self.device_calls = 0
        by_token, on_device = verification.choose_token_among_drafts, verification.rejection_choices

        def token_by_token(scores, children):
            token = by_token(scores, children)
            tokens = [t for t, _ in children]
            chosen = int(token)
            self.outcomes.append((len(children), tokens.index(chosen) if chosen in tokens else len(children)))
            return token

        def device(target, tokens, children, node_laws):
            choice = on_device(target, tokens, children, node_laws)
            self.device_calls += 1
            child_tokens = torch.where(children >= 0, tokens.gather(1, children.clamp(min=0).flatten(1))
                                       .view(children.shape), -1)
            count = (children >= 0).sum(-1)
            hit = child_tokens == choice[..., None]
            accepted = torch.where(hit.any(-1), hit.long().argmax(-1), count)
            self.outcomes += [(n, i) for n, i in zip(count[count > 0].tolist(), accepted[count > 0].tolist())]
            return choice

        for module in (verification, batch_module):
            monkeypatch.setattr(module, "choose_token_among_drafts", token_by_token)
            monkeypatch.setattr(module, "rejection_choices", device)

    def accepted_at(self, index: int) -> int:
        return sum(1 for _, i in self.outcomes if i == index)

    @property
    def all_rejected(self) -> int:
        return sum(1 for n, i in self.outcomes if i == n)


def exact_continuation_law(target, prompt: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                           top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The exact law of plain sampling's `new_tokens` tokens after `prompt` (1, length): (vocab ** new_tokens,),
    continuation (t_1 ... t_n) at index sum t_j vocab^(n - j), from the target's own fp32 logits through
    transformers' warpers in generate's order (temperature, top-k, top-p), every continuation enumerated."""
    vocab = target.get_output_embeddings().weight.shape[0]
    prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=new_tokens - 1)), dtype=torch.long)
    ids = torch.cat([prompt.expand(len(prefixes), -1), prefixes.view(len(prefixes), -1)], dim=1)
    with torch.no_grad():
        logits = target(ids).logits[:, prompt.shape[1] - 1 :].float()  # (prefixes, new_tokens, vocab)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    flat = logits.reshape(-1, vocab)
    logits = warpers(torch.zeros(len(flat), 1, dtype=torch.long), flat).view(logits.shape)
    log_probs = logits.log_softmax(-1).double()
    prefix = log_probs[:, :-1].gather(2, prefixes.view(len(prefixes), -1, 1)).squeeze(2).sum(1)
    return (prefix[:, None] + log_probs[:, -1]).exp().flatten()


def continuation_counts(target, drafter, prompt: torch.Tensor, rows: int, calls: int, new_tokens: int = NEW_TOKENS,
                        **kwargs) -> torch.Tensor:
    """Counts of every continuation over `calls` calls of `rows` copies of `prompt` (independent draws)."""
    vocab = target.get_output_embeddings().weight.shape[0]
    weights = vocab ** torch.arange(new_tokens - 1, -1, -1)
    ids = prompt.expand(rows, -1)
    counts = torch.zeros(vocab**new_tokens)
    for _ in range(calls):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=True,
                              max_new_tokens=new_tokens, **kwargs)
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
def on_device(case):
    """`case` with a top-k warper that keeps every token: its laws are compact (`sampling.py`), so steps accept on
    the device (`rejection_choices`); without one (top_k=0) they accept token by token."""
    def with_top_k():
        target, drafter, kwargs = case()
        return target, drafter, {**kwargs, "top_k": VOCAB}
    return with_top_k


def lookup_case():
    """Prompt-lookup drafts (point masses) grafted on sampled best-first trees: a 6-token vocabulary repeats itself,
    so most steps find a match."""
    target, drafter, kwargs = best_first_case()
    return target, drafter, {**kwargs, "top_k": VOCAB, "prompt_lookup_num_tokens": 3}


def lookup_token_by_token_case():
    """`lookup_case` with dense laws (no top-k), accepted token by token, on drawn chains (one child a node), so the
    lookup drafts branch off beside them often: a grafted node past the drawn nodes' laws is tried with a point mass
    (`batch._law_of`)."""
    target, drafter, kwargs = best_first_case()
    drafter.config.draft_tree_budget, drafter.config.draft_tree_width = 2, 1
    return target, drafter, {**kwargs, "prompt_lookup_num_tokens": 3}


# name: (case, rows per call, calls, siblings expected, accepted on the device). The rows of a call are independent
# draws: 256 rows make 10,240 draws cheap. One row pays generate's fixed cost (~8 ms) per draw: 600 draws there, the
# code path's check.
CASES = {
    "chain_1_row": (chain_case, 1, 600, False, False),
    "chain_256_rows": (chain_case, 256, 40, False, False),
    "d2sd_tree_256_rows": (d2sd_case, 256, 40, True, False),
    "best_first_tree_256_rows": (best_first_case, 256, 40, True, False),
    "hybrid_chain_256_rows": (hybrid_case, 256, 40, False, True),
    "device_chain_1_row": (on_device(chain_case), 1, 600, False, True),
    "device_chain_256_rows": (on_device(chain_case), 256, 40, False, True),
    "device_d2sd_tree_256_rows": (on_device(d2sd_case), 256, 40, True, True),
    "device_best_first_tree_256_rows": (on_device(best_first_case), 256, 40, True, True),
    "lookup_on_sampled_tree_256_rows": (lookup_case, 256, 40, True, True),
    "lookup_on_sampled_tree_token_by_token_256_rows": (lookup_token_by_token_case, 256, 40, True, False),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.every_step_speculates("asserts drafts were verified, accepted and rejected")
def test_speculative_sampling_is_exactly_plain_sampling(monkeypatch, one_torch_thread, drafts_from_known_laws, name,
                                                       grafted):
    """The joint law of the new tokens, speculating every step with drafts far from the target, is plain sampling's
    exact law (chi-square over every continuation)."""
    case, rows, calls, siblings, device = CASES[name]
    target, drafter, kwargs = case()
    prompt = prompt_ids()
    recorder = RuleRecorder(monkeypatch)
    torch.manual_seed(0)
    counts = continuation_counts(target, drafter, prompt, rows, calls, **kwargs)
    law = exact_continuation_law(target, prompt, NEW_TOKENS, kwargs["temperature"], kwargs["top_k"])
    assert (recorder.device_calls > 0) == device  # the path the case is for
    if "prompt_lookup_num_tokens" in kwargs:  # copied tokens were grafted on as point masses (measured: 4,901 nodes
        assert grafted.nodes > 0.2 * rows * calls  # beside the drafter's, in 10,240 row calls)
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


@pytest.mark.parametrize("path", ["token_by_token", "device"])
@pytest.mark.parametrize("name", BREAKS)
@pytest.mark.every_step_speculates("the broken rule must be exercised at every step")
def test_a_broken_rejection_rule_is_caught_in_generate(monkeypatch, one_torch_thread, drafts_from_known_laws, name,
                                                       path):
    """Each break, in a generate case of its form (chains for the chain breaks; best-first trees of up to 5 siblings,
    where later siblings are tried often, for the others), makes the new tokens' joint law measurably not plain
    sampling's (1,536 draws)."""
    make, form = BREAKS[name]
    case = chain_case if form == "chain" else best_first_case
    target, drafter, kwargs = (on_device(case) if path == "device" else case)()
    prompt = prompt_ids()
    use_rule(monkeypatch, make())
    recorder = RuleRecorder(monkeypatch)
    torch.manual_seed(1)
    counts = continuation_counts(target, drafter, prompt, 256, 6, **kwargs)
    law = exact_continuation_law(target, prompt, NEW_TOKENS, kwargs["temperature"], kwargs["top_k"])
    assert len(recorder.outcomes) >= 256 * 6
    if form == "tree":
        assert max(children for children, _ in recorder.outcomes) >= 3
    # measured p-values: residual_left_at_p 3e-15, acceptance_q_over_p 0 (underflow), residual_not_renormalised
    # 5e-34, sibling_mass_not_removed 2e-20; seeds 2-5: at most 5e-13, 0, 3e-23, 7e-22
    assert chi_square_p_value(counts, law) < CAUGHT


@pytest.mark.every_step_speculates("asserts drafts were verified, accepted and rejected")
def test_drafts_drawn_from_the_warped_drafter_law_keep_plain_sampling(monkeypatch, one_torch_thread):
    """The drafter's own law through the user's warpers (temperature 0.7, top-k 4, top-p 0.9), chains and best-first
    trees on the device path: the joint law of the new tokens is plain sampling's through the same warpers."""
    kwargs = dict(temperature=0.7, top_k=4, top_p=0.9, num_assistant_tokens=2)
    prompt = prompt_ids()
    for tree in (False, True):
        target = tiny_target("llama", seed=3, vocab_size=VOCAB, sharpen=4)
        drafter = tiny_drafter(target, block_size=4, seed=5)
        if tree:
            drafter.config.draft_tree_budget, drafter.config.draft_tree_width = 10, 3
        recorder = RuleRecorder(monkeypatch)
        torch.manual_seed(0)
        counts = continuation_counts(target, drafter, prompt, 256, 40, **kwargs)
        law = exact_continuation_law(target, prompt, NEW_TOKENS, 0.7, 4, 0.9)
        assert recorder.device_calls > 0
        verified = len(recorder.outcomes)
        assert recorder.accepted_at(0) > 0.1 * verified and recorder.all_rejected > 0.05 * verified
        assert chi_square_p_value(counts, law) > PASS


# ----- shapes and lengths chosen by the cost model --------------------------------------------------------------------
# peaked laws (0.6 on one token per slot) make the cost model's choices depend on the confidences: with the verify
# costs below a chain verifies 3 drafts, a best-first tree of budget 10 keeps 4-6 nodes over 3 levels, a D²SD tree
# of budget 5 keeps fewer nodes than its candidates
PEAKED_LAWS = torch.full((3, VOCAB), 0.08)
PEAKED_LAWS[0, 2], PEAKED_LAWS[1, 4], PEAKED_LAWS[2, 3] = 0.6, 0.6, 0.6
PEAKED_BRANCH = torch.tensor([0.08, 0.08, 0.08, 0.6, 0.08, 0.08])
LIVE_COSTS = {1: {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 8: 1.9, 12: 2.7}}  # seconds: a drafter pass is free beside them
LIVE_NEW_TOKENS = 5  # room for 3 drafts after the first token: trees 3 levels deep


@pytest.fixture
def live_cost_model(monkeypatch):
    """Drafts from `PEAKED_LAWS` / `PEAKED_BRANCH`, every step speculating, and the cost model live (no fixed length):
    chain lengths and tree sizes come from `LIVE_COSTS` and the laws' maxima."""
    from hf_diffspec.runtime import control_policy
    from hf_diffspec.runtime.control_cost import VerifyCost

    def draft_laws(self, logits):
        if logits.dim() == 3:
            probs = PEAKED_LAWS[torch.arange(logits.shape[1]).clamp(max=2)].expand(logits.shape[0], -1, -1).clone()
        else:
            probs = PEAKED_BRANCH.expand(logits.shape[0], -1).clone()
        return CompactLaw(torch.arange(VOCAB).expand(probs.shape).clone(), probs)

    monkeypatch.setattr(DiffusionCandidateGenerator, "_draft_laws", draft_laws)
    monkeypatch.setattr(control_policy, "verify_cost_for", lambda target, graphs=False: VerifyCost(LIVE_COSTS))


def live_chain_case():
    target = tiny_target("llama", seed=0, vocab_size=VOCAB, sharpen=10)
    return target, tiny_drafter(target, block_size=4), dict(temperature=0.8, top_k=VOCAB)


def live_best_first_case():
    target = tiny_target("qwen3", seed=2, vocab_size=VOCAB, sharpen=10)
    drafter = tiny_drafter(target, block_size=4)
    drafter.config.draft_tree_budget, drafter.config.draft_tree_width = 10, 3
    return target, drafter, dict(temperature=1.0, top_k=VOCAB)


def live_d2sd_case():
    target = tiny_target("llama", seed=1, vocab_size=VOCAB, sharpen=10)
    return target, tiny_dual_drafter(target, block_size=4, num_branches=2, tree_budget=5), dict(temperature=0.8,
                                                                                                top_k=VOCAB)


class ShapeRecorder:
    """The drafted trees' sizes and depths (drafted nodes, deepest level) of every proposal."""

    def __init__(self, monkeypatch, generator_class):
        self.trees = []
        propose = generator_class.propose

        def recording(generator, *args, **kwargs):
            trees = propose(generator, *args, **kwargs)
            self.trees += [(len(t) - 1, t.max_depth) for t in trees]
            return trees

        monkeypatch.setattr(generator_class, "propose", recording)


LIVE_CASES = {  # name: (case, rows, calls, its generator class)
    "chain_1_row": (live_chain_case, 1, 600, "DiffusionCandidateGenerator"),
    "chain_256_rows": (live_chain_case, 256, 40, "DiffusionCandidateGenerator"),
    "best_first_tree_256_rows": (live_best_first_case, 256, 40, "BestFirstTreeCandidateGenerator"),
    "d2sd_tree_256_rows": (live_d2sd_case, 256, 40, "PrefixTreeCandidateGenerator"),
}


@pytest.mark.parametrize("name", LIVE_CASES)
@pytest.mark.every_step_speculates("the cost model sizes every step; the gates would send some plain")
def test_sampling_is_exact_where_the_cost_model_sizes_chains_and_trees(monkeypatch, one_torch_thread, live_cost_model,
                                                                        name):
    """Chain lengths and tree shapes chosen by the live cost model from the laws' maxima (never from what was drawn):
    budgets below the candidates, depth 3, on the device path. The joint law of the new tokens is plain sampling's."""
    from hf_diffspec.runtime import drafting

    case, rows, calls, generator = LIVE_CASES[name]
    target, drafter, kwargs = case()
    shapes = ShapeRecorder(monkeypatch, getattr(drafting, generator))
    recorder = RuleRecorder(monkeypatch)
    torch.manual_seed(0)
    counts = continuation_counts(target, drafter, prompt_ids(), rows, calls, LIVE_NEW_TOKENS, **kwargs)
    law = exact_continuation_law(target, prompt_ids(), LIVE_NEW_TOKENS, kwargs["temperature"], kwargs["top_k"])
    sizes = [size for size, _ in shapes.trees]
    assert recorder.device_calls > 0 and max(depth for _, depth in shapes.trees) >= 3
    if generator != "DiffusionCandidateGenerator":  # pruned below the budget, and not always to one size
        assert max(sizes) < (10 if "best_first" in name else 5) and len(set(sizes)) > 1
    # measured p-values: chain_1_row 0.78, chain_256_rows 0.34, best_first_tree 0.044, d2sd_tree 0.58
    assert chi_square_p_value(counts, law) > PASS


def lengths_from_the_drawn_tokens(generator, draft_hidden, logits, roots):
    """A broken `_pick`: the chain's confidences are the drawn tokens' own probabilities, so the cost model's length
    depends on the draws (a draft is verified more often where it drew a likely token)."""
    laws = generator._draft_laws(logits)
    drafts = laws.sample()
    return drafts, laws.at(drafts), laws


@pytest.mark.parametrize("broken", [False, True], ids=["real", "length_from_drawn_tokens"])
@pytest.mark.every_step_speculates("the cost model sizes every step; the gates would send some plain")
def test_a_chain_length_from_the_drawn_tokens_is_caught(monkeypatch, one_torch_thread, live_cost_model, broken):
    """The live chain case, one row a call (a batch's rows share one chain length), on the law of the first two new
    tokens (the first comes from the prompt's forward, the second is the first a draft can reach, with a third token
    to come): plain sampling's with the real `_pick`, measurably not with lengths chosen from the drawn tokens'
    probabilities (a draft is then verified only where it drew its slot's likely token, which is committed more
    often than the target says)."""
    if broken:
        monkeypatch.setattr(DiffusionCandidateGenerator, "_pick", lengths_from_the_drawn_tokens)
    target, drafter, kwargs = live_chain_case()
    torch.manual_seed(1)
    counts = continuation_counts(target, drafter, prompt_ids(), 1, 1000, 3, **kwargs)  # 3: room for a draft
    law = exact_continuation_law(target, prompt_ids(), 3, kwargs["temperature"], kwargs["top_k"])
    p_value = chi_square_p_value(counts.view(VOCAB**2, -1).sum(1), law.view(VOCAB**2, -1).sum(1))
    # measured p-values: real 0.75 (seed 2: 0.11); broken 2e-7 (seed 2: 1e-10)
    assert p_value < CAUGHT if broken else p_value > PASS


@pytest.mark.every_step_speculates("the broken scores must prune at every step")
def test_a_d2sd_tree_pruned_by_the_drawn_tokens_is_caught(monkeypatch, one_torch_thread, live_cost_model):
    """The D²SD case above with the main chain's nodes scored by the drawn tokens' own probabilities (not the laws'
    maxima): which nodes the budget keeps depends on the draws, and the joint law of the new tokens is measurably
    not plain sampling's."""
    from hf_diffspec.runtime import drafting_prefix_tree

    candidates = drafting_prefix_tree._candidate_nodes

    def scored_by_the_drawn_tokens(plan, branches):
        main, scores, sources = candidates(plan, branches)
        drawn = plan.laws.gather(-1, plan.drafts[:, None].long()).squeeze(-1).cumprod(0).tolist()
        for k in range(len(main)):
            scores[main[: k + 1]] = drawn[k]
        return main, scores, sources

    monkeypatch.setattr(drafting_prefix_tree, "_candidate_nodes", scored_by_the_drawn_tokens)
    target, drafter, kwargs = live_d2sd_case()
    torch.manual_seed(1)
    counts = continuation_counts(target, drafter, prompt_ids(), 256, 40, **kwargs)
    law = exact_continuation_law(target, prompt_ids(), NEW_TOKENS, kwargs["temperature"], kwargs["top_k"])
    assert chi_square_p_value(counts, law) < CAUGHT  # measured: 8e-62 (seed 2: 1e-57)


def test_a_node_past_the_drawn_laws_is_tried_as_a_point_mass_at_its_own_token():
    """On the token-by-token path, a tree's nodes past its drawn ones (grafted lookup drafts) are deterministic: their
    law is all mass on their own token; a drawn node keeps the law it was drawn from. (A point mass on another token
    shifts the joint law too little for the chi-square tests above to see at their sizes: p = 0.008 at 10,240 draws.)"""
    from hf_diffspec.runtime.batch import _law_of
    from hf_diffspec.runtime.sampling import CompactLaw

    laws = CompactLaw(None, torch.rand(2, VOCAB, generator=torch.Generator().manual_seed(0)).softmax(-1))
    logits = torch.zeros(1, VOCAB)
    assert torch.equal(_law_of(laws, 3, 4, logits), torch.nn.functional.one_hot(torch.tensor(4), VOCAB).float())
    assert torch.equal(_law_of(laws, 1, 4, logits), laws.probs[1])


def test_every_node_lists_all_its_children_lookup_branches_included():
    """`batch._children`, the table rejection sampling tries children from: a drawn tree whose root has two
    children, and a drawn chain 3 -> 4 with a lookup chain [1, 2] grafted at the root, as a new branch (the root has
    two children) and repeating the drawn chain's first token (merged: the lookup's 2 hangs below the drawn 1,
    beside the drawn 4). A child left out still samples exactly (the residual covers it) but accepts less: no
    distribution test sees it."""
    from hf_diffspec.runtime.drafting_lookup import graft
    from hf_diffspec.runtime.tree import CandidateTree, TreeLayout

    def children(drawn, parents=(-1, 0, 1), lookup=(1, 2)):
        tree = CandidateTree(torch.tensor([0, *drawn]), list(parents))
        tree = graft(tree, list(lookup)) if lookup else tree
        table = batch_module._children([tree], TreeLayout.of([tree], torch.device("cpu")))[0]
        return [sorted(c for c in row.tolist() if c >= 0) for row in table]

    assert children([3, 4]) == [[1, 3], [2], [], [4], []]
    assert children([1, 4]) == [[1], [2, 4], [], [], []]
    assert children([3, 5, 4], parents=(-1, 0, 0, 1), lookup=None) == [[1, 2], [3], [], []]  # a drawn tree


def test_a_copied_node_carries_all_its_mass_on_its_own_token():
    """`batch._node_laws`: nodes past a tree's drawn laws (prompt-lookup drafts, copied not drawn) are point masses
    at their own tokens; drawn nodes keep their laws, whatever the other rows carry. A point mass put anywhere else
    still samples exactly (the draft is then never accepted as a proposal, the residual covers it) but accepts less:
    no distribution test sees it."""
    from hf_diffspec.runtime.drafting_lookup import graft
    from hf_diffspec.runtime.tree import CandidateTree, TreeLayout

    first_law = torch.tensor([0.05, 0.60, 0.10, 0.10, 0.10, 0.05])
    laws = CompactLaw(torch.arange(6).expand(3, -1), torch.stack([torch.zeros(6), first_law, first_law]))
    tree = graft(CandidateTree(torch.tensor([0, 3, 4]), [-1, 0, 1], draft_laws=laws), [1, 2])
    layout = TreeLayout.of([tree], torch.device("cpu"))
    node_laws = batch_module._node_laws([tree], layout)
    at_own = node_laws.on(layout.tokens[..., None])[0, :, 0]  # each node's probability of its own token
    assert at_own[3:].tolist() == [1.0, 1.0]  # the lookup nodes 1 and 2: point masses
    assert at_own[1:3].tolist() == pytest.approx([0.10, 0.10])  # drawn 3 and 4 under their law
    assert node_laws.probs[0, 3:].sum(-1).tolist() == [1.0, 1.0]
    # rows without laws (a root alone, a lookup chain alone) before a drawn one leave its laws alone
    rows = [CandidateTree([0], [-1]), graft(CandidateTree([0], [-1]), [2]), tree]
    layout = TreeLayout.of(rows, torch.device("cpu"))
    at_own = batch_module._node_laws(rows, layout).on(layout.tokens[..., None])[..., 0]
    assert at_own[2, 1:3].tolist() == pytest.approx([0.10, 0.10]) and at_own[1, 1] == 1.0


@pytest.mark.every_step_speculates("counts which acceptance each drafter step takes")
@pytest.mark.parametrize("tied", [False, True], ids=["distinct-scores", "top-k-tied-past-its-candidates"])
def test_a_step_falls_back_to_token_by_token_acceptance_exactly_when_a_law_is_not_compacted_exactly(monkeypatch,
                                                                                                     tied):
    """Sampled steps are accepted on the device over compact laws; where top-k keeps tokens tied past the candidates
    (fewer finite scores than k: every -inf ties), compaction is not exact and that step is accepted token by token
    over the full vocabulary instead. Distinct scores: never a token-by-token step; ties: every drafter step is one,
    and only the tokens left unsuppressed are ever written."""
    vocab = 48
    target = tiny_target("llama", seed=3, vocab_size=vocab, sharpen=2.0)
    drafter = tiny_drafter(target, block_size=4, seed=3)
    fallbacks = []
    token_by_token = batch_module.BatchState._accept_token_by_token
    monkeypatch.setattr(batch_module.BatchState, "_accept_token_by_token", lambda self, trees, logits: (
        fallbacks.append(len(trees)), token_by_token(self, trees, logits))[1])
    allowed = [3, 7, 11]  # with top-k 5: the 5th score is -inf, tied with every suppressed token's
    suppress = [t for t in range(vocab) if t not in allowed] if tied else [5]
    ids = torch.tensor([[4, 9, 2, 30, 17, 8]])
    out = target.generate(ids, assistant_model=drafter, do_sample=True, temperature=0.9, top_k=5, top_p=1.0,
                          suppress_tokens=suppress, max_new_tokens=12, return_dict_in_generate=True)
    drafter_steps = out.speculation_stats.draft_steps
    assert drafter_steps >= 3
    if tied:
        # every drafter step, and the prompt's first token (accepted the same way)
        assert len(fallbacks) == drafter_steps + 1 and set(out.sequences[0, 6:].tolist()) <= set(allowed)
    else:
        assert fallbacks == []
