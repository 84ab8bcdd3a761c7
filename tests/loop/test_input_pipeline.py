"""The input pipeline, seen from the user's side: for a CUDA run the Trainer makes the project's own
TokenLoader build its batches in pinned memory, so that the strategy's non_blocking copy to the GPU does
not wait for the step in flight; a CPU run gets the loader's batches as before, and a user's own
DataLoader keeps the `pin_memory` it was given. The CUDA half runs where there is a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import LLAMA, Regression, fit, regression_data, token_loader
from torch.utils.data import DataLoader

from trainer.data import PackedDataset, TokenLoader
from trainer.data.loader import pin_for_device
from trainer.models.causal_lm import CausalLM

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="pinned memory needs CUDA")


def blocks(n: int = 40, seq_len: int = 8) -> PackedDataset:
    return PackedDataset(torch.arange(n * seq_len + 1, dtype=torch.int32) % 64, seq_len)


def test_a_token_loader_yields_unpinned_batches_unless_asked():
    loader = TokenLoader(blocks(), batch_size=4, seed=0)
    assert loader.pin_memory is False
    assert not any(value.is_pinned() for batch in loader for value in batch.values())


def test_the_trainer_s_rule_pins_a_token_loader_for_cuda_only():
    loader = TokenLoader(blocks(), batch_size=4, seed=0)
    pin_for_device(loader, torch.device("cpu"))
    assert loader.pin_memory is False
    pin_for_device(loader, torch.device("cuda", 0))
    assert loader.pin_memory is True


@pytest.mark.parametrize("pin_memory", [False, True])
def test_a_user_s_dataloader_keeps_its_own_pin_memory_on_any_device(pin_memory):
    loader = DataLoader(regression_data(32), batch_size=8, pin_memory=pin_memory)
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        pin_for_device(loader, device)
        assert loader.pin_memory is pin_memory


def test_a_cpu_fit_trains_on_the_token_loader_s_own_unpinned_batches(tmp_path):
    loader = token_loader(batch_size=4)
    expected = next(iter(token_loader(batch_size=4)))
    trainer = fit(CausalLM(LLAMA), loader, tmp_path, steps=3, accelerator="cpu")
    assert loader.pin_memory is False
    first = trainer.first_train_batch
    assert first.keys() == expected.keys()
    assert all(torch.equal(first[key], expected[key]) and not first[key].is_pinned() for key in first)


def test_a_cpu_fit_on_a_user_s_dataloader_leaves_it_alone(tmp_path):
    loader = DataLoader(regression_data(64), batch_size=8)
    fit(Regression(), loader, tmp_path, steps=2, accelerator="cpu")
    assert loader.pin_memory is False


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_asking_to_pin_without_cuda_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"pin_memory=True needs CUDA.*allowed: False"):
        TokenLoader(blocks(), batch_size=4, pin_memory=True)


@needs_cuda
def test_pinned_batches_hold_the_same_tokens_in_page_locked_memory():
    plain = TokenLoader(blocks(), batch_size=4, seed=3)
    pinned = TokenLoader(blocks(), batch_size=4, seed=3, pin_memory=True)
    for a, b in zip(plain, pinned, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key].is_pinned() and torch.equal(a[key], b[key])


@needs_cuda
def test_a_cuda_fit_pins_the_token_loader_and_trains_on_the_gpu(tmp_path):
    loader = token_loader(batch_size=4)
    trainer = fit(CausalLM(LLAMA), loader, tmp_path, steps=3, accelerator="cuda", devices=1)
    assert loader.pin_memory is True
    assert all(value.is_pinned() for value in trainer.first_train_batch.values())
    assert next(trainer.module.parameters()).device.type == "cuda"
