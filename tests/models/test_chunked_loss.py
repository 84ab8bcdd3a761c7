"""CausalLM's chunked (fused linear + cross-entropy) loss: the plain loss's values and gradients, less
memory."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import LLAMA, SCRIPTS, fit, launch_env, read_metrics, run_commands, run_ranks, token_loader

from trainer.config import ConfigError, build_run, load_recipe
from trainer.models import causal_lm
from trainer.models.causal_lm import CausalLM
from trainer.models.linear_cross_entropy import linear_cross_entropy
from trainer.models.llama import LlamaConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FP32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 2e-3, "rtol": 2e-2}


def head_inputs(tokens: int = 38, dim: int = 16, vocab: int = 50, dtype: torch.dtype = torch.float32):
    """Hidden states [2, tokens/2, dim], an output weight [vocab, dim] and labels with every third -100."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, tokens // 2, dim, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=g)
    labels.view(-1)[::3] = -100
    return hidden, weight, labels


def loss_and_grads(loss_fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def plain(hidden, weight, labels):
    """The loss CausalLM computes on a Llama's logits."""
    return F.cross_entropy(
        F.linear(hidden, weight).float().flatten(0, 1), labels.flatten(), ignore_index=-100
    )


def chunked(chunk_tokens: int):
    return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, chunk_tokens)


@pytest.mark.parametrize("chunk", [1, 5, 38, 1000])  # 5 leaves 3 tokens over; 1000 is one chunk
def test_loss_and_gradients_equal_the_plain_loss_in_fp32(chunk):
    inputs = head_inputs()
    expected = loss_and_grads(plain, *inputs)
    got = loss_and_grads(chunked(chunk), *inputs)
    for name, g, e in zip(("loss", "hidden grad", "weight grad"), got, expected, strict=True):
        torch.testing.assert_close(g, e, **FP32, msg=lambda m, name=name: f"{name}: {m}")


def test_under_bf16_autocast_it_matches_the_plain_loss_and_keeps_the_input_dtypes():
    inputs = head_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_and_grads(plain, *inputs)
        got = loss_and_grads(chunked(7), *inputs)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, **BF16)


def test_bf16_weights_without_autocast_get_bf16_gradients_like_the_plain_loss():
    """What FSDP's bf16 mixed precision hands the loss: bf16 hidden states and weight, no autocast."""
    inputs = head_inputs(dtype=torch.bfloat16)
    expected = loss_and_grads(plain, *inputs)
    got = loss_and_grads(chunked(7), *inputs)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.float(), e.float(), **BF16)


def test_ignored_tokens_give_what_the_plain_loss_gives():
    hidden, weight, labels = head_inputs()
    labels[0] = -100  # the first chunks hold no labelled token
    expected = loss_and_grads(plain, hidden, weight, labels)
    for g, e in zip(loss_and_grads(chunked(4), hidden, weight, labels), expected, strict=True):
        torch.testing.assert_close(g, e, **FP32)
    labels[:] = -100  # nothing to predict: NaN loss and zero gradients, as F.cross_entropy gives
    loss, hidden_grad, weight_grad = loss_and_grads(chunked(4), hidden, weight, labels)
    assert loss.isnan() and plain(hidden, weight, labels).isnan()
    assert not hidden_grad.any() and not weight_grad.any()


def test_without_gradients_it_builds_no_graph():
    hidden, weight, labels = head_inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, 5)
        torch.testing.assert_close(loss, plain(hidden, weight, labels), **FP32)
    assert loss.grad_fn is None


def tiny_lm_pair(chunk: int, preset: str = "tiny", **config) -> tuple[CausalLM, CausalLM]:
    """A built CausalLM with the plain loss and a copy with the chunked one (the same weights)."""
    plain_lm = CausalLM(LlamaConfig.preset(preset, vocab_size=300, **config))
    plain_lm.configure_model()
    chunked_lm = copy.deepcopy(plain_lm)
    chunked_lm.loss_chunk_tokens = chunk
    return plain_lm, chunked_lm


def lm_batch(vocab: int = 300) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, 24), generator=g)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[1, :5] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("preset, tied", [("tiny", True), ("tiny", False), ("moe-tiny", False)])
def test_causal_lm_gives_the_plain_loss_and_every_parameter_gradient(preset, tied):
    plain_lm, chunked_lm = tiny_lm_pair(chunk=10, preset=preset, tie_embeddings=tied)  # 48 tokens: 8 over
    batch = lm_batch()
    outs = []
    for lm in (plain_lm, chunked_lm):
        out = lm.training_step(batch, 0)
        out["loss"].backward()
        outs.append(out)
    assert outs[1]["num_tokens"] == outs[0]["num_tokens"] == 41
    torch.testing.assert_close(outs[1]["loss"], outs[0]["loss"], **FP32)
    for (name, p), q in zip(plain_lm.named_parameters(), chunked_lm.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **FP32, msg=lambda m, name=name: f"{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_lm.validation_step(batch, 0)["loss"], plain_lm.validation_step(batch, 0)["loss"], **FP32
        )


def test_the_plain_loss_serves_fp16_autocast_and_models_that_are_not_a_llama(monkeypatch):
    """The fused loss makes its gradients in the forward, before a GradScaler's scale exists, and needs a
    Llama's hidden states and output weight: elsewhere the plain loss runs."""

    def refuse(*args):
        raise AssertionError("the fused loss ran")

    monkeypatch.setattr(causal_lm, "linear_cross_entropy", refuse)
    _, lm = tiny_lm_pair(chunk=10)
    with torch.autocast("cpu", dtype=torch.float16):
        assert lm.training_step(lm_batch(), 0)["loss"].isfinite()
    other = CausalLM(
        torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Linear(8, 300)), loss_chunk_tokens=10
    )
    assert other.training_step(lm_batch(), 0)["loss"].isfinite()


def test_trained_by_the_trainer_it_gives_the_plain_losses(tmp_path):
    losses = {}
    for chunk in (None, 24):
        torch.manual_seed(0)
        module = CausalLM(LLAMA, lr=1e-2, loss_chunk_tokens=chunk)
        fit(module, token_loader(8), tmp_path / str(chunk), steps=5, gradient_clip_val=0.5)
        losses[chunk] = read_metrics(tmp_path / str(chunk))
    assert losses[24].keys() == losses[None].keys() and len(losses[None]) == 5
    for step, loss in losses[None].items():
        assert abs(losses[24][step] - loss) <= 1e-5, (
            f"step {step}: chunked {losses[24][step]} vs plain {loss}"
        )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_a_bad_chunk_size_is_named(bad):
    with pytest.raises(ValueError, match=r"^loss_chunk_tokens=.*allowed: None .* or an int >= 1"):
        CausalLM(LLAMA, loss_chunk_tokens=bad)


def test_the_recipe_key_reaches_causal_lm_and_bad_values_are_named():
    small = ["model.dim=64", "model.n_layers=1", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=32"]
    config = load_recipe(RECIPES / "llama_tiny.yaml", [*small, "model.loss_chunk_tokens=64"])
    module = build_run(config)[1]
    assert isinstance(module, CausalLM) and module.loss_chunk_tokens == 64
    for bad in ("0", "-3", "1.5", "true", "eight"):
        with pytest.raises(ConfigError, match=r"^model\.loss_chunk_tokens"):
            load_recipe(RECIPES / "llama_tiny.yaml", [f"model.loss_chunk_tokens={bad}"])
    with pytest.raises(
        ConfigError, match=r"^model\.loss_chunk_tokens=8: .*with a Llama preset or a class_path"
    ):
        load_recipe(RECIPES / "llama_tiny.yaml", ["model.hf=some/model", "model.loss_chunk_tokens=8"])
    own_loss = ["model.class_path=helpers.Regression", "model.loss_chunk_tokens=8"]
    with pytest.raises(ConfigError, match=r"^model\.loss_chunk_tokens is set but .* a TrainModule"):
        build_run(load_recipe(RECIPES / "llama_tiny.yaml", [*small, *own_loss]))
    for name in ("llama_1b", "llama_8b", "llama_70b"):
        assert load_recipe(RECIPES / f"{name}.yaml")["model"]["loss_chunk_tokens"] == 2048, name
    assert load_recipe(RECIPES / "llama_tiny.yaml")["model"]["loss_chunk_tokens"] is None


# One arm of the memory comparison, in a process of its own (a fork: tests/preloaded.py): how far its resident
# memory peaks above where it was, over one forward and backward of the loss of `tokens` hidden states through
# a [vocab, dim] head (Linux: writing 5 to clear_refs resets the peak VmHWM to the current VmRSS).
MEASURE = r"""
import re, sys, torch, torch.nn.functional as F
from trainer.models.linear_cross_entropy import linear_cross_entropy
def kib(field):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read())[1])
torch.set_num_threads(1)
arm, tokens, dim, vocab = sys.argv[1], *map(int, sys.argv[2:])
g = torch.Generator().manual_seed(0)
hidden = torch.randn(tokens, dim, generator=g).requires_grad_()
weight = torch.empty(vocab, dim).normal_(std=0.02, generator=g).requires_grad_()
labels = torch.randint(0, vocab, (tokens,), generator=g)
open("/proc/self/clear_refs", "w").write("5")
before = kib("VmRSS")
if arm == "plain":
    loss = F.cross_entropy(F.linear(hidden, weight).float(), labels)
else:
    loss = linear_cross_entropy(hidden, weight, labels, int(arm))
loss.backward()
print((kib("VmHWM") - before) * 1024)
"""


@pytest.mark.slow
def test_peak_memory_is_below_half_the_plain_loss():
    tokens, dim, vocab = 4096, 64, 32000  # fp32 logits: 0.5 GB, the head's weight 8 MB
    peaks = {}
    for arm in ("plain", "512"):
        cmd = [sys.executable, "-c", MEASURE, arm, str(tokens), str(dim), str(vocab)]
        done = run_commands([(cmd, launch_env())], ".", 120)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks[arm] = int(done.stdout.split()[-1])
    print(f"peak resident memory above the start: plain {peaks['plain'] / 2**20:.0f} MiB, chunks of 512 "
          f"{peaks['512'] / 2**20:.0f} MiB ({peaks['512'] / peaks['plain']:.2f}x)")  # fmt: skip
    assert peaks["512"] < peaks["plain"] / 2, peaks


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """The runs of chunked_loss_script.py under FSDP and DDP, one after the other in one 2-process launch."""
    tmp = tmp_path_factory.mktemp("chunked-2")
    run_ranks(
        2, SCRIPTS / "chunked_loss_script.py", "--strategies", "fsdp,ddp", "--root", str(tmp), timeout=300
    )
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_on_two_processes_it_gives_the_one_process_plain_losses(tmp_path, two_processes, strategy):
    root = two_processes / strategy
    for rank in (0, 1):
        calls = json.loads((root / f"rank{rank}.json").read_text())["fused_calls"]
        assert calls >= 6, f"rank {rank}: the fused loss ran {calls} times in 6 steps"
    torch.manual_seed(0)
    module = CausalLM(dataclasses.replace(LLAMA, tie_embeddings=True), lr=1e-2)
    single = tmp_path / "single"
    fit(module, token_loader(16), single, steps=6, gradient_clip_val=0.5, val_check_interval=6,
        limit_val_batches=2, val_loader=token_loader(16, seed=2), enable_checkpointing=False)  # fmt: skip
    for key in ("train/loss", "val/loss"):
        expected, got = read_metrics(single, key), read_metrics(root, key)
        assert got.keys() == expected.keys() and expected, key
        for step, loss in expected.items():
            assert abs(got[step] - loss) <= 1e-5, (
                f"{key} at step {step}: {strategy} chunked {got[step]} vs {loss}"
            )
