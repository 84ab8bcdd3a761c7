"""`trainer plan` answers every input in seconds or refuses it in one line: the world's divisors come from
its prime factors (not by trying every number up to it), a world past any cluster is refused, and so is a
search whose world and global batch share so many divisors that weighing every layout would take minutes."""

from __future__ import annotations

import pytest
from helpers import REPO, TINY

from strategies.plan.search import MAX_WORLD, divisors
from trainer.cli import main

RECIPE = str(REPO / "recipes" / "llama_8b.yaml")


def test_divisors_are_those_of_trial_division_and_of_the_prime_factors():
    for n in range(1, 1500):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    # 2^6 3^2 5 7^2 11 13 = 144144 x 7: (6+1)(2+1)(1+1)(2+1)(1+1)(1+1) divisors
    n = 2**6 * 3**2 * 5 * 7**2 * 11 * 13
    found = divisors(n)
    assert len(found) == 7 * 3 * 2 * 3 * 2 * 2 and all(n % d == 0 for d in found) and found == sorted(found)
    big_prime = 2**31 - 1  # a prime: its only divisors, from a search up to its square root
    assert divisors(big_prime) == [1, big_prime] and divisors(2 * big_prime) == [
        1,
        2,
        big_prime,
        2 * big_prime,
    ]


@pytest.mark.timeout(120)  # the old planner looped to n for each tp: > 180 s, printing nothing
def test_a_billion_gpus_is_refused_in_one_line(capsys):
    assert main(["plan", RECIPE, "--gpus", "1000000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"trainer: error: plan: a world of 1,000,000,000 GPUs is not planned; allowed: 1 to {MAX_WORLD:,} GPUs"
    )


@pytest.mark.timeout(120)
def test_a_search_of_too_many_layouts_is_refused_in_one_line(capsys):
    # 720720 has 240 divisors, and a global batch of the same size lets nearly every split of it through
    argv = ["--gpus", "720720", "data.global_batch_size=720720", "model.n_layers=5040"]
    assert main(["plan", RECIPE, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer: error: plan: ") and "layouts of 720,720 GPUs to weigh" in err, err
    assert "allowed: up to 50,000" in err and "\n" not in err, err


@pytest.mark.timeout(120)
def test_a_large_world_under_the_bound_answers(capsys):
    assert main(["plan", str(TINY), "--gpus", "983040", "data.global_batch_size=983040"]) == 0
    out = capsys.readouterr().out
    assert "983040 x H100" in out and "layouts tried" in out and "\noverrides: " in out, out
