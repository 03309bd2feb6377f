"""The fast subset of the randomized differential suite (`tests/differential.py`): speculative `generate` against plain
`generate` on seeded random cases. Each case passes when the outputs are identical, or when the speculative call
refuses, with a clear ValueError, a feature that `differential.EXPECTED_REFUSALS` lists for batch > 1.

A failing case prints its description; rerun it alone with `python tests/differential.py --seed 1 --case N`.
The long run (`python tests/differential.py --cases 1000 --seed 0`) covers many more cases.
"""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

from differential import make_case, run_case

SEED = 1
GREEDY_CASES = 50
SAMPLING_CASES = 3


def _numbers(sampling: bool, count: int) -> list[int]:
    """The first `count` case numbers of the suite seeded SEED that are sampling (or greedy) cases. Sampling cases
    drawn from batches of copies (1 call draws 8 or 20 samples) keep CI fast; batch-1 sampling is tested against the
    exact distribution in the long run and against plain sampling in test_d2sd.py."""
    found, number = [], 0
    while len(found) < count:
        case = make_case(SEED, number)
        if case.sampling == sampling and (not sampling or case.rows > 1):
            found.append(number)
        number += 1
    return found


def _check(number: int):
    outcome = run_case(SEED, number)
    if outcome.status not in ("identical", "refused"):
        pytest.fail(f"{outcome.case.describe()}\n{outcome.status}: {outcome.reason}\n{outcome.detail}", pytrace=False)


@pytest.mark.parametrize("number", _numbers(sampling=False, count=GREEDY_CASES))
def test_greedy_case_is_identical_to_plain_generate(number):
    _check(number)


@pytest.mark.parametrize("number", _numbers(sampling=True, count=SAMPLING_CASES))
def test_sampling_case_follows_the_exact_distribution(number):
    _check(number)
