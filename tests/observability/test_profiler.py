"""Profiler, ThroughputMonitor and the MFU arithmetic: PaLM's FLOPs counted by hand, real traces read
back as JSON, and a 2-rank gloo run whose traces show the all-reduce."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    LLAMA,
    SCRIPTS,
    SEQ_LEN,
    Regression,
    quiet,
    read_metrics,
    regression_loader,
    run_ranks,
    token_loader,
)
from torch.autograd import DeviceType

import callbacks.profiler as profiler_module
from callbacks import Callback
from callbacks.mfu import mfu, model_flops_per_token, peak_flops, peak_flops_by_name
from callbacks.profiler import Profiler, is_communication, step_breakdown
from callbacks.throughput import ThroughputMonitor
from trainer import Trainer
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import Llama, LlamaConfig

SCRIPT = SCRIPTS / "profile_script.py"


def palm_by_hand(vocab: int, dim: int, layers: int, heads: int, kv_heads: int, ffn: int, seq_len: int) -> int:
    """6 x matmul weights + 12 L H d T, the weights counted from a Llama block's shapes."""
    head_dim = dim // heads
    attention = (
        dim * heads * head_dim + 2 * dim * kv_heads * head_dim + heads * head_dim * dim
    )  # wq, wk+wv, wo
    feed_forward = 3 * dim * ffn  # w1, w2, w3
    output = dim * vocab
    return 6 * (layers * (attention + feed_forward) + output) + 12 * layers * heads * head_dim * seq_len


def trace_names(path: Path) -> list[str]:
    return [e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]]


def tiny_llama_fit(root: Path, steps: int, callbacks: list[Callback], **overrides) -> CausalLM:
    module = CausalLM(LLAMA, lr=1e-2)
    trainer = Trainer(
        max_steps=steps,
        seed=0,
        default_root_dir=root,
        callbacks=callbacks,
        enable_checkpointing=False,
        **quiet(**overrides),
    )
    trainer.fit(module, token_loader(4))
    return module


# ---- the arithmetic --------------------------------------------------------------------------------
def test_model_flops_per_token_is_palms_count_of_the_llama_weights() -> None:
    config = LlamaConfig(
        vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=32
    )
    # per block: wq 64x64 + wk, wv 64x32 each + wo 64x64 = 12288; w1, w2, w3 64x96 each = 18432; output 64x101
    n_matmul = 2 * (12288 + 18432) + 6464
    expected = 6 * n_matmul + 12 * 2 * 4 * 16 * 32
    assert expected == 456_576 == palm_by_hand(101, 64, 2, 4, 2, 96, 32)
    module = CausalLM(config)
    module.configure_model()
    assert model_flops_per_token(module, 32) == expected
    assert model_flops_per_token(Llama(config), 32) == expected


def test_model_flops_per_token_of_the_tiny_preset_and_of_models_without_the_hook() -> None:
    tiny = LlamaConfig.preset(
        "tiny"
    )  # 512 vocab, dim 256, 4 layers, 8 heads, 4 kv heads, ffn 768 (Llama's rule)
    assert tiny.ffn_dim == 768
    assert model_flops_per_token(Llama(tiny), 256) == palm_by_hand(512, 256, 4, 8, 4, 768, 256)
    assert model_flops_per_token(Regression(), 16) is None
    assert model_flops_per_token(CausalLM(torch.nn.Embedding(8, 8)), 16) is None  # inner model lacks the hook


def test_mfu_of_a_made_up_h100_rate_equals_the_hand_value() -> None:
    peak = peak_flops_by_name("NVIDIA H100 80GB HBM3")
    assert peak == 989e12
    tokens_per_s, flops_per_token = 3_000.0, 456_576.0
    assert mfu(tokens_per_s, flops_per_token, peak) == pytest.approx(3_000 * 456_576 / 989e12, rel=1e-12)
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 1.0, 0.0)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-SXM2-16GB", None),
    ],
)
def test_peak_flops_by_device_name(name: str, peak: float | None) -> None:
    assert peak_flops_by_name(name) == peak


def test_the_cpu_has_no_peak() -> None:
    assert peak_flops("cpu") is None
    assert peak_flops(torch.device("cpu")) is None


# ---- reading a window's events -----------------------------------------------------------------------
def event(name: str, start: float, end: float, device: DeviceType = DeviceType.CPU) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device)


def test_step_breakdown_counts_nested_and_repeated_spans_once() -> None:
    events = [
        event("trainer.forward", 0, 100),
        event("trainer.forward", 300, 400),  # a second micro-batch
        event("aten::mm", 10, 50),
        event("trainer.backward", 100, 300),
        event("c10d::allreduce_", 150, 160),  # the launch, inside ...
        event("gloo:all_reduce", 150, 350),  # ... the backend's work on its own thread
        event("aten::broadcast_tensors", 0, 500),  # a shape op, not communication
        event("trainer.optimizer", 400, 460),
        event("trainer.data", 460, 480),
        event("trainer.forward", 0, 1000, DeviceType.CUDA),  # a device-side annotation: not host time
    ]
    got = step_breakdown(events, steps=2)  # microseconds in the window -> ms per step
    assert got == pytest.approx(
        {"forward": 0.1, "backward": 0.1, "optimizer": 0.03, "data": 0.01, "comm": 0.1}
    )


def test_step_breakdown_takes_device_kernels_for_communication_when_there_are_some() -> None:
    events = [
        event("nccl:all_reduce", 0, 500),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 100, 150, DeviceType.CUDA),
    ]
    assert step_breakdown(events, steps=1)["comm"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    "name, comm",
    [
        ("gloo:all_reduce", True),
        ("c10d::allreduce_", True),
        ("nccl:all_gather", True),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", True),
        ("_c10d_functional::all_gather_into_tensor", True),
        ("c10d::broadcast_", True),
        ("aten::broadcast_tensors", False),
        ("torch::distributed::reducer::mul_out", False),
        ("aten::mm", False),
    ],
)
def test_communication_names(name: str, comm: bool) -> None:
    assert is_communication(name) is comm


# ---- one process -------------------------------------------------------------------------------------
def test_profiled_fit_writes_a_chrome_trace_and_logs_the_breakdown(root: Path) -> None:
    profiler = Profiler()  # wait 1, warmup 1, active 3: steps 3-5
    tiny_llama_fit(root, 6, [profiler])
    trace = root / "profiler" / "rank-0" / "step-5.pt.trace.json"
    assert profiler.trace_paths == [trace]
    names = trace_names(trace)
    assert names.count("trainer.forward") == 3 and names.count("trainer.backward") == 3
    assert any(n.startswith("autograd::engine::evaluate_function: MmBackward") for n in names)
    for key in ("forward", "backward", "optimizer", "data", "step"):
        values = read_metrics(root, f"profiler/{key}_ms")
        assert list(values) == [5] and values[5] > 0, key
    assert read_metrics(root, "profiler/comm_ms") == {5: 0.0}  # one process: no collective
    tokens = read_metrics(root, "profiler/tokens_per_s_per_device")[5]
    flops = read_metrics(root, "profiler/flops_per_s_per_device")[5]
    assert flops == pytest.approx(tokens * palm_by_hand(64, 32, 2, 4, 2, LLAMA.ffn_dim, SEQ_LEN), rel=1e-9)
    assert read_metrics(root, "profiler/mfu") == {}  # the CPU has no peak


def test_a_run_that_ends_inside_a_window_still_writes_it(root: Path) -> None:
    profiler = Profiler(wait=0, warmup=1, active=5, dirpath=root / "traces")
    tiny_llama_fit(root, 3, [profiler])  # steps 2-3 of the window 2-6
    trace = root / "traces" / "rank-0" / "step-3.pt.trace.json"
    assert profiler.trace_paths == [trace]
    assert trace_names(trace).count("trainer.forward") == 2
    assert list(read_metrics(root, "profiler/forward_ms")) == [3]


def test_repeat_records_one_trace_per_window(root: Path) -> None:
    profiler = Profiler(wait=0, warmup=1, active=1, repeat=2)  # warm up 1, record 2, warm up 3, record 4
    Trainer(max_steps=6, default_root_dir=root, callbacks=[profiler], **quiet()).fit(
        Regression(), regression_loader()
    )
    assert [p.name for p in profiler.trace_paths] == ["step-2.pt.trace.json", "step-4.pt.trace.json"]
    assert list(read_metrics(root, "profiler/step_ms")) == [2, 4]


def test_a_run_shorter_than_wait_and_warmup_writes_nothing(root: Path) -> None:
    profiler = Profiler(wait=2, warmup=2)
    Trainer(max_steps=3, default_root_dir=root, callbacks=[profiler], **quiet()).fit(
        Regression(), regression_loader()
    )
    assert profiler.trace_paths == [] and not (root / "profiler").exists()


class Boom(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            raise RuntimeError("boom at step 3")


def test_a_failure_inside_a_window_keeps_its_error_and_the_trace(root: Path) -> None:
    profiler = Profiler(wait=0, warmup=1, active=5)  # records steps 2-6
    trainer = Trainer(max_steps=8, default_root_dir=root, callbacks=[profiler, Boom()], **quiet())
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.fit(Regression(), regression_loader())
    assert [p.name for p in profiler.trace_paths] == ["step-3.pt.trace.json"]  # written in teardown
    assert trace_names(profiler.trace_paths[0]).count("trainer.forward") == 2


def test_memory_snapshot_on_the_cpu_says_it_is_cuda_only(root: Path, monkeypatch) -> None:
    lines: list[str] = []
    monkeypatch.setattr(profiler_module, "rank_zero_info", lines.append)
    Trainer(max_steps=2, default_root_dir=root, callbacks=[Profiler(memory_snapshot=True)], **quiet()).fit(
        Regression(), regression_loader()
    )
    assert sum("CUDA-only" in line for line in lines) == 1
    assert not list(root.rglob("*.pickle"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"wait": -1}, "wait=-1"),
        ({"warmup": 1.5}, "warmup=1.5"),
        ({"active": 0}, "active=0"),
        ({"repeat": True}, "repeat=True"),
        ({"record_shapes": "yes"}, "record_shapes='yes'"),
        ({"dirpath": 3}, "dirpath=3"),
        ({"flops_per_token": -1.0}, "flops_per_token=-1.0"),
    ],
)
def test_bad_profiler_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Profiler(**kwargs)


# ---- throughput --------------------------------------------------------------------------------------
def test_throughput_monitor_logs_tokens_and_flops_per_device_and_no_mfu_on_the_cpu(root: Path) -> None:
    tiny_llama_fit(root, 4, [ThroughputMonitor(log_every_n_steps=2)])
    tokens = read_metrics(root, "throughput/tokens_per_s_per_device")
    samples = read_metrics(root, "throughput/samples_per_s_per_device")
    flops = read_metrics(root, "throughput/flops_per_s_per_device")
    assert list(tokens) == list(samples) == list(flops) == [2, 4]
    per_token = palm_by_hand(64, 32, 2, 4, 2, LLAMA.ffn_dim, SEQ_LEN)
    for step in (2, 4):
        assert tokens[step] > 0
        assert tokens[step] == pytest.approx(
            samples[step] * SEQ_LEN, rel=1e-9
        )  # every sample is SEQ_LEN tokens
        assert flops[step] == pytest.approx(tokens[step] * per_token, rel=1e-9)
    assert read_metrics(root, "throughput/mfu") == {}


def test_throughput_monitor_uses_given_flops_and_the_trainers_interval(root: Path) -> None:
    tiny_llama_fit(root, 3, [ThroughputMonitor(flops_per_token=1e6)], log_every_n_steps=2)
    tokens, flops = (read_metrics(root, f"throughput/{k}_per_s_per_device") for k in ("tokens", "flops"))
    assert list(tokens) == [2, 3]  # every 2 steps, and the last step
    assert flops[2] == pytest.approx(tokens[2] * 1e6, rel=1e-9)


def test_throughput_monitor_without_tokens_logs_samples_only(root: Path) -> None:
    Trainer(max_steps=2, default_root_dir=root, callbacks=[ThroughputMonitor()], **quiet()).fit(
        Regression(), regression_loader()
    )
    assert list(read_metrics(root, "throughput/samples_per_s_per_device")) == [1, 2]
    assert read_metrics(root, "throughput/tokens_per_s_per_device") == {}


@pytest.mark.parametrize(
    "kwargs", [{"log_every_n_steps": 0}, {"flops_per_token": 0}, {"flops_per_token": "1e9"}]
)
def test_bad_throughput_arguments_are_named(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ThroughputMonitor(**kwargs)


# ---- two processes -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ddp_ranks_each_write_a_trace_with_the_gloo_all_reduce(tmp_path: Path) -> None:
    root = tmp_path / "run"
    run_ranks(2, SCRIPT, "--steps", "6", "--root", str(root), timeout=300)
    for rank in (0, 1):
        trace = root / "profiler" / f"rank-{rank}" / "step-4.pt.trace.json"  # wait 1, warmup 1, active 2
        events = json.loads(trace.read_text())["traceEvents"]
        names = [e.get("name", "") for e in events]
        assert names.count("trainer.forward") == 2 and names.count("trainer.backward") == 2, f"rank {rank}"
        all_reduce_us = sum(e.get("dur", 0) for e in events if e.get("name") == "gloo:all_reduce")
        assert all_reduce_us > 0, f"rank {rank}: no gloo all-reduce in the trace"
    assert read_metrics(root, "profiler/comm_ms")[4] > 0
    assert read_metrics(root, "profiler/backward_ms")[4] > 0
    assert list(read_metrics(root, "throughput/tokens_per_s_per_device")) == [
        2,
        4,
        6,
    ]  # reduced over both ranks
