"""`hf-diffspec demo` checks exactness in float32 before anything else, times warmed-up medians, and says what
bfloat16 changes without overclaiming."""

import copy
from types import SimpleNamespace

import pytest
import torch

from hf_diffspec.demo import DemoResult, ExactnessCheck, check_exactness, run_demo
from hf_diffspec.drafters import load_drafter


def said(result) -> str:
    return " ".join(result.report().split())


def result(speedup: float = 1.2, identical: bool = True, dtype=torch.bfloat16, exact: bool = True, **kw) -> DemoResult:
    check = ExactnessCheck(tokens=20, identical=exact, identical_prefix=20 if exact else 5, drafts_per_step=15,
                           target_forwards=9)
    fields = dict(prompt="p", answer="a", check=check, plain_tokens=20, speculative_tokens=20,
                  plain_runs=[(20, 1.0), (20, 1.1), (20, 0.9)],
                  speculative_runs=[(20, 1.0 / speedup)] * 3, tau=1.5, identical=identical,
                  identical_prefix=20 if identical else 7, varying=(), dtype=dtype, device_type="cpu")
    return DemoResult(**{**fields, **kw})


def test_speed_is_the_median_ratio_and_said_plainly():
    slow = result(0.8)
    assert slow.plain_rate == pytest.approx(20.0) and slow.speedup == pytest.approx(0.8)
    assert "0.80x: slower than plain generate on this CPU" in said(slow)
    assert "1.50x: faster than plain generate on this CPU" in said(result(1.5))
    assert "about as fast" in said(result(1.0))
    noisy = result(1.5, plain_runs=[(20, 1.0), (20, 3.0), (20, 1.0)])
    assert "busy" in said(noisy) and "busy" not in said(result(1.5))
    assert "did not all repeat" in said(result(1.5, varying=("speculative",)))


def test_the_first_words_about_exactness_are_the_float32_check():
    text = said(result())
    assert result().report().splitlines()[4].startswith("Exact (checked in float32): speculative generate's 20 "
                                                        "tokens are plain generate's")  # right after the answer
    assert text.index("Exact (checked in float32)") < text.index("Speed in bfloat16")
    assert "That is the guarantee" in text and "bug" not in text
    broken = said(result(exact=False))
    assert broken.startswith("prompt: p a DIFFERS (checked in float32)") and "after 5 identical tokens" in broken
    assert "This is a bug" in broken


def test_bfloat16_drift_is_explained_in_one_line():
    drift = [line for line in result(identical=False).report().splitlines() if line.startswith("In bfloat16")]
    assert len(drift) == 1 and "share 7 tokens, then part" in drift[0] and "bug" not in drift[0]
    assert "rounds differently from a one-token forward" in said(result(identical=False))
    assert "identical here too (not guaranteed in bfloat16" in said(result(identical=True))
    # in float32 the timed outputs are covered by the guarantee: silence when they agree, a bug when they do not
    assert "In float32" not in said(result(identical=True, dtype=torch.float32))
    assert "This is a bug" in said(result(identical=False, dtype=torch.float32))


class ScriptedTarget:
    """A float32 'target' whose plain and speculative outputs are given: what `check_exactness` compares."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, plain: list[int], speculative: list[int]):
        self.plain, self.speculative = plain, speculative
        self.calls = []

    def generate(self, input_ids, assistant_model=None, **kwargs):
        self.calls.append(dict(kwargs, assistant_model=assistant_model))
        if assistant_model is None:
            return torch.tensor([input_ids[0].tolist() + self.plain])
        sequences = torch.tensor([input_ids[0].tolist() + self.speculative])
        return SimpleNamespace(sequences=sequences, speculation_stats=SimpleNamespace(target_forwards=3))


class WordTokenizer:
    def apply_chat_template(self, messages, **kwargs):
        return messages[0]["content"]

    def __call__(self, text, **kwargs):
        return SimpleNamespace(to=lambda device: {"input_ids": torch.tensor([[5, 6]])})

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))


def test_check_exactness_reports_the_first_difference_and_refuses_other_dtypes():
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=4))
    target = ScriptedTarget(plain=[1, 2, 3, 4], speculative=[1, 2, 9, 4])
    check, answer = check_exactness(target, WordTokenizer(), drafter, "hi", max_new_tokens=4)
    assert not check.identical and check.identical_prefix == 2 and check.tokens == 4 and answer == "1 2 9 4"
    # every step speculates with the whole block, so the check covers as many drafts as it can
    assert target.calls[1]["num_assistant_tokens"] == 3 and target.calls[1]["do_sample"] is False
    same, _ = check_exactness(ScriptedTarget([1, 2], [1, 2]), WordTokenizer(), drafter, "hi", max_new_tokens=2)
    assert same.identical and same.identical_prefix == 2
    target.dtype = torch.bfloat16
    with pytest.raises(ValueError, match="runs in float32"):
        check_exactness(target, WordTokenizer(), drafter, "hi")


@pytest.mark.real_model
def test_run_demo_on_smollm2_checks_in_fp32_and_times_bf16(real_target):
    target, tok = real_target
    drafter = load_drafter("random", target, "smollm2-135m-instruct")
    timed_target = copy.deepcopy(target).to(torch.bfloat16)
    timed_drafter = load_drafter("random", timed_target, "smollm2-135m-instruct")
    demo = run_demo(timed_target, tok, timed_drafter, "What is 2 + 2?", max_new_tokens=8, runs=1,
                    float32_models=(target, drafter))
    assert demo.check.identical and demo.check.tokens == 8 and demo.check.drafts_per_step == 15
    assert demo.dtype == torch.bfloat16 and demo.plain_tokens == demo.speculative_tokens == 8
    assert len(demo.plain_runs) == len(demo.speculative_runs) == 1 and demo.tau >= 1.0
    text = said(demo)
    assert "Exact (checked in float32): speculative generate's 8 tokens are plain generate's" in text
    assert "Speed in bfloat16 on this CPU" in text
    with pytest.raises(ValueError, match="runs in float32"):
        run_demo(timed_target, tok, timed_drafter, "What is 2 + 2?", max_new_tokens=2, runs=1)
