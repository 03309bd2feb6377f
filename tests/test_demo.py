"""`hf-diffspec demo` reports warmed-up medians and says what is exact without overclaiming."""

import pytest
import torch

from hf_diffspec.demo import DemoResult, run_demo
from hf_diffspec.drafters import load_drafter


def result(speedup: float, identical: bool, dtype=torch.bfloat16, **kw) -> DemoResult:
    fields = dict(prompt="p", answer="a", plain_tokens=20, speculative_tokens=20,
                  plain_runs=[(20, 1.0), (20, 1.1), (20, 0.9)],
                  speculative_runs=[(20, 1.0 / speedup)] * 3, tau=1.5, identical=identical,
                  identical_prefix=20 if identical else 7, varying=(), dtype=dtype, device_type="cpu")
    return DemoResult(**{**fields, **kw})


def test_speed_is_the_median_ratio_and_said_plainly():
    slow = result(0.8, identical=True)
    assert slow.plain_rate == pytest.approx(20.0) and slow.speedup == pytest.approx(0.8)
    assert "0.80x: slower than plain generate on this CPU" in " ".join(slow.report().split())
    assert "1.50x: faster than plain generate on this CPU" in " ".join(result(1.5, identical=True).report().split())
    assert "about as fast" in result(1.0, identical=True).report()
    noisy = result(1.5, identical=True, plain_runs=[(20, 1.0), (20, 3.0), (20, 1.0)])
    assert "busy" in noisy.report() and "busy" not in result(1.5, identical=True).report()
    assert "did not all repeat" in result(1.5, identical=True, varying=("speculative",)).report()


def test_exactness_wording_depends_on_dtype_and_outcome():
    def said(r):
        return " ".join(r.report().split())

    assert "token-for-token identical to plain generate. In float32 that is the guarantee" in said(
        result(1.2, identical=True, dtype=torch.float32))
    bf16_same = said(result(1.2, identical=True))
    assert "identical to plain generate on this prompt" in bf16_same and "--dtype fp32" in bf16_same
    bf16_diff = said(result(1.2, identical=False))
    assert "first 7 tokens, then differs" in bf16_diff and "--dtype fp32" in bf16_diff and "bug" not in bf16_diff
    assert "This is a bug" in said(result(1.2, identical=False, dtype=torch.float32))


@pytest.mark.real_model
def test_run_demo_on_smollm2_is_identical_in_fp32(real_target):
    target, tok = real_target
    drafter = load_drafter("random", target, "smollm2-135m-instruct")
    demo = run_demo(target, tok, drafter, "What is 2 + 2?", max_new_tokens=8, runs=2)
    assert demo.identical and not demo.varying and demo.plain_tokens == demo.speculative_tokens == 8
    assert len(demo.plain_runs) == len(demo.speculative_runs) == 2 and demo.tau >= 1.0
    assert "float32 that is the guarantee" in " ".join(demo.report().split())
