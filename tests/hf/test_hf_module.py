"""HFModule, used as a Hugging Face user would: a tiny Llama saved with `save_pretrained` and fine-tuned
from its folder (whole, frozen in part, with LoRA), on one process and on two (DDP, FSDP with activation
checkpointing), exported back with `save_pretrained` and reloaded with `AutoModelForCausalLM`; BERT heads
for classification; one-line errors for bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import SCRIPTS, read_metrics, run_ranks
from hf_script import GLOBAL_BATCH, LR, VOCAB, lm_loader, trainer_kwargs
from torch.utils.data import DataLoader
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    T5Config,
)

from strategies.techniques.activation_checkpointing import checkpoint_blocks
from trainer import Trainer
from trainer.models.hf import HFModule

SCRIPT = SCRIPTS / "hf_script.py"
TINY_LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
}
TINY_BERT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
    "hidden_dropout_prob": 0.0,  # a step's loss is then the same number in and out of training mode
    "attention_probs_dropout_prob": 0.0,
}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A folder as `save_pretrained` writes it: a tiny random Llama and a word-level tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def fit(module, loader, root: Path, steps: int, val_loader=None) -> Trainer:
    trainer = Trainer(**trainer_kwargs(root, steps))
    trainer.fit(module, loader, val_loader)
    return trainer


def hand_loss(model, batch) -> torch.Tensor:
    """Mean negative log-likelihood of the (already shifted) labels that are not -100, written out."""
    logits = model(batch["input_ids"]).logits
    logp = logits.log_softmax(-1)
    valid = batch["labels"] != -100
    picked = logp.gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
    return -(picked * valid).sum() / valid.sum()


def first_batch() -> dict[str, torch.Tensor]:
    return next(iter(lm_loader(GLOBAL_BATCH)))


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ---- causal LM -----------------------------------------------------------------------------------
def test_causal_lm_loss_is_the_shifted_label_cross_entropy_and_falls_in_training(llama_dir, tmp_path):
    module = HFModule(llama_dir, lr=LR)
    assert module.tokenizer is not None and module.tokenizer("w1 w5")["input_ids"] == [3, 7]
    assert [type(b).__name__ for b in module.transformer_blocks()] == ["LlamaDecoderLayer"] * 2

    batch = first_batch()
    batch["labels"][0, 3:7] = -100  # ignored targets count neither in the mean nor in num_tokens
    reference = AutoModelForCausalLM.from_pretrained(llama_dir)
    out = module.training_step(batch, 0)
    assert out["num_tokens"].item() == batch["labels"].numel() - 4
    assert abs(out["loss"].item() - hand_loss(reference, batch).item()) < 1e-5
    # our labels are already shifted: with the last target ignored, HF's own (shifting) loss on
    # labels=input_ids is the same number, so nothing is shifted twice
    batch["labels"][0, 3:7] = batch["input_ids"][0, 4:8]
    batch["labels"][:, -1] = -100
    hf_loss = reference(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    assert abs(module.training_step(batch, 0)["loss"].item() - hf_loss.item()) < 1e-5

    fit(module, lm_loader(GLOBAL_BATCH), tmp_path, steps=20)
    losses = read_metrics(tmp_path)
    assert sorted(losses) == list(range(1, 21))
    assert abs(losses[1] - hand_loss(reference, first_batch()).item()) < 1e-5  # step 1 ran on that batch
    assert losses[20] < 0.75 * losses[1], losses


def test_save_pretrained_reloads_with_transformers_to_the_trained_logits(llama_dir, tmp_path):
    module = HFModule(llama_dir, lr=LR)
    fit(module, lm_loader(GLOBAL_BATCH), tmp_path / "run", steps=5)
    out = module.save_pretrained(tmp_path / "export", max_shard_size="40KB")
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded above max_shard_size
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = first_batch()["input_ids"]
    module.eval()
    trained = logits(module.model, ids)
    assert (trained - logits(reloaded, ids)).abs().max().item() <= 1e-5
    # the fine-tuning changed the model, so the comparison above is not with the initial weights
    assert (trained - logits(AutoModelForCausalLM.from_pretrained(llama_dir), ids)).abs().max() > 1e-2
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("w1 w5 nope")["input_ids"] == [3, 7, 0]

    one_file = module.save_pretrained(tmp_path / "whole")  # 2GB default: a single file, no index
    assert (one_file / "model.safetensors").is_file()
    assert not (one_file / "model.safetensors.index.json").exists()

    # a model built from a config (no tokenizer) whose head shares the embedding's weight
    tied = HFModule(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=True), lr=LR)
    assert tied.tokenizer is None
    fit(tied, lm_loader(GLOBAL_BATCH), tmp_path / "tied-run", steps=3)
    reloaded = AutoModelForCausalLM.from_pretrained(tied.save_pretrained(tmp_path / "tied"))
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    tied.eval()
    assert (logits(tied.model, ids) - logits(reloaded, ids)).abs().max().item() <= 1e-5
    assert not (tmp_path / "tied" / "tokenizer.json").exists()


def test_activation_checkpointing_of_the_hf_layers_recomputes_them_and_keeps_the_gradients(llama_dir):
    batch = first_batch()

    def grads_and_layer_calls(module):
        calls = []
        layer = module.hf_model().model.layers[0]
        layer = getattr(layer, "_checkpoint_wrapped_module", layer)
        # the layer's MLP: HF checkpoints the layer's `forward` (inside its hooks), and the recomputation stops
        # as soon as it has what the backward needs (before post-hooks), but it reaches the MLP's start
        handle = layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        module.training_step(batch, 0)["loss"].backward()
        handle.remove()
        return {
            n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in module.named_parameters()
        }, len(calls)

    plain, plain_calls = grads_and_layer_calls(HFModule(llama_dir))
    assert plain_calls == 1
    wrapped = HFModule(llama_dir)  # what FSDPStrategy(activation_checkpointing=...) does to the blocks
    checkpoint_blocks(wrapped, wrapped.transformer_blocks(), "full")
    native = HFModule(llama_dir)  # Hugging Face's own, for runs without FSDP
    native.enable_activation_checkpointing()
    for module in (wrapped, native):
        grads, calls = grads_and_layer_calls(module)
        assert calls == 2, "the layer's forward runs again in the backward"
        assert grads.keys() == plain.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, plain[name], atol=1e-6), name


# ---- two processes -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_process_runs(llama_dir, tmp_path_factory):
    """One run per strategy (DDP; FSDP ZeRO-3 with activation checkpointing; tensor parallel from
    transformers' tp_plan), one after another in one 2-process torchrun world (one launch's start-up); each
    trains 8 steps on a global batch of 16 and exports with save_pretrained."""
    tmp = tmp_path_factory.mktemp("hf-dist")
    runs = [
        [
            "--strategy",
            strategy,
            "--root",
            str(tmp / strategy),
            "--export",
            str(tmp / f"{strategy}-export"),
            *extra,
        ]
        for strategy, extra in (("ddp", []), ("fsdp", ["--ac", "full"]), ("tp", []))
    ]
    run_ranks(
        2, SCRIPT, "--runs", json.dumps(runs), "--model-dir", str(llama_dir), torchrun=True, timeout=400
    )
    torch.manual_seed(0)
    single = HFModule(llama_dir, lr=LR)
    fit(single, lm_loader(GLOBAL_BATCH), tmp / "single", steps=8)
    return tmp, single


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp"])
def test_two_processes_train_and_export_like_one(two_process_runs, strategy):
    tmp, single = two_process_runs
    expected, got = read_metrics(tmp / "single"), read_metrics(tmp / strategy)
    assert sorted(got) == list(range(1, 9))
    for step, loss in expected.items():
        assert abs(got[step] - loss) <= 1e-5, f"step {step}: {strategy} {got[step]} vs one process {loss}"
    report = json.loads((tmp / strategy / "report.json").read_text())
    assert report["world_size"] == 2
    if strategy == "fsdp":  # each decoder layer its own unit, checkpointed, the rest in the root's
        assert report["fsdp_units"] == ["FSDPCheckpointWrapper", "FSDPCheckpointWrapper", "FSDPHFModule"]
        assert report["checkpointed"] == ["LlamaDecoderLayer", "LlamaDecoderLayer"]
    if strategy == "tp":  # every attention and MLP matrix of both layers split over the two ranks
        projections = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        assert report["tp_split"] == sorted(projections * 2)

    exported = AutoModelForCausalLM.from_pretrained(tmp / f"{strategy}-export")
    reference = single.hf_model().state_dict()
    for name, tensor in exported.state_dict().items():
        assert (tensor - reference[name]).abs().max().item() <= 1e-5, name
    ids = first_batch()["input_ids"]
    single.eval()
    assert (logits(exported, ids) - logits(single.model, ids)).abs().max().item() <= 1e-4


# ---- LoRA and freezing ---------------------------------------------------------------------------
@pytest.mark.filterwarnings(
    "error:.*is_gradient_checkpointing.*:FutureWarning"
)  # peft reads it: kept out of sight
def test_lora_trains_only_the_adapters_and_exports_them_merged(llama_dir, tmp_path):
    module = HFModule(llama_dir, lr=LR, lora=LORA)
    config = LlamaConfig(**TINY_LLAMA)
    head_dim = config.hidden_size // config.num_attention_heads
    q_out, kv_out, r = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, LORA["r"]
    per_layer = r * (config.hidden_size + q_out) + r * (config.hidden_size + kv_out)  # A and B of q and v
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == per_layer * config.num_hidden_layers == 896
    assert all("lora_A" in n or "lora_B" in n for n in trainable)
    assert [type(b).__name__ for b in module.transformer_blocks()] == ["LlamaDecoderLayer"] * 2

    before = weights(module)
    fit(module, lm_loader(GLOBAL_BATCH), tmp_path / "run", steps=10)
    losses = read_metrics(tmp_path / "run")
    assert losses[10] < losses[1]
    after = weights(module)
    for name, value in before.items():
        if name in trainable:
            assert not torch.equal(after[name], value), f"{name} did not train"
        else:
            assert torch.equal(after[name], value), f"{name} is frozen but changed"

    out = module.save_pretrained(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n in merged.state_dict())
    ids = first_batch()["input_ids"]
    module.eval()
    adapted = logits(module.model, ids)
    assert (logits(merged, ids) - adapted).abs().max().item() <= 1e-5
    assert (adapted - logits(AutoModelForCausalLM.from_pretrained(llama_dir), ids)).abs().max() > 1e-3
    assert all(torch.equal(p, after[n]) for n, p in module.named_parameters()), "export merged a copy"
    assert (logits(module.model, ids) - adapted).abs().max().item() == 0.0, "the module keeps its adapters"

    # freeze patterns use the model's own names, also through PEFT's wrapper
    half = HFModule(llama_dir, lora=LORA, freeze=["model.layers.1.*"])
    assert sum(p.numel() for p in half.parameters() if p.requires_grad) == per_layer


def test_freeze_patterns_keep_their_parameters_and_the_optimizer_skips_them(llama_dir, tmp_path):
    module = HFModule(llama_dir, lr=LR, freeze=["model.embed_tokens.*", "model.layers.0.*"])
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    names = [n for n, _ in module.hf_model().named_parameters()]
    expected = {f"model.{n}" for n in names if n.startswith(("model.embed_tokens.", "model.layers.0."))}
    assert frozen == expected and len(frozen) == 10  # the embedding and the 9 tensors of layer 0
    before = weights(module)
    trainer = fit(module, lm_loader(GLOBAL_BATCH), tmp_path, steps=5)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in module.parameters() if p.requires_grad}
    for name, value in weights(module).items():
        assert torch.equal(value, before[name]) == (name in frozen), name


# ---- other heads ---------------------------------------------------------------------------------
def class_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of 8 tokens whose class is the third of the vocabulary their first token falls in."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, 8), generator=g)
    labels = (ids[:, 0] * 3) // VOCAB
    return [
        {"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y}
        for i, y in zip(ids, labels, strict=True)
    ]


def test_bert_sequence_classification_trains_and_logs_its_accuracy(tmp_path):
    config = BertConfig(**TINY_BERT)
    torch.manual_seed(0)
    module = HFModule(config, task="seq-classification", num_labels=3, lr=3e-3)
    assert module.tokenizer is None and module.model.config.num_labels == 3
    assert [type(b).__name__ for b in module.transformer_blocks()] == [
        "BertEmbeddings",
        "BertLayer",
        "BertLayer",
    ]
    train = DataLoader(class_data(512, 0), batch_size=32, shuffle=True)
    val = DataLoader(class_data(96, 1), batch_size=32)
    trainer = fit(module, train, tmp_path, steps=60, val_loader=val)
    losses = read_metrics(tmp_path)
    assert losses[60] < 0.5 * losses[1], losses

    module.eval()
    with torch.no_grad():
        predicted = torch.cat([module(input_ids=b["input_ids"]).logits.argmax(-1) for b in val])
    accuracy = (predicted == torch.cat([b["labels"] for b in val])).float().mean().item()
    assert abs(trainer.callback_metrics["val_acc"] - accuracy) < 1e-6
    assert read_metrics(tmp_path, "val_acc")[60] == pytest.approx(accuracy, abs=1e-6)
    assert accuracy > 0.8  # chance is 1/3
    assert trainer.validate(module, val)["val_acc"] == pytest.approx(accuracy, abs=1e-6)


def test_token_classification_and_seq2seq_use_the_models_own_loss_and_count_tokens(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (4, 10), generator=g)
    tags = torch.randint(0, 5, (4, 10), generator=g)
    tags[:, 7:] = -100
    tokens = HFModule(BertConfig(**TINY_BERT), task="token-classification", num_labels=5)
    batch = {"input_ids": ids, "labels": tags}
    out = tokens.training_step(batch, 0)
    hand = F.cross_entropy(tokens(input_ids=ids).logits.flatten(0, 1), tags.flatten(), ignore_index=-100)
    assert out["num_tokens"].item() == 28 and abs(out["loss"].item() - hand.item()) < 1e-6
    metrics = Trainer(**trainer_kwargs(tmp_path, 1)).validate(tokens, [batch])
    with torch.no_grad():
        correct = (tokens(input_ids=ids).logits.argmax(-1) == tags)[tags != -100].float().mean().item()
    assert metrics["val_acc"] == pytest.approx(correct, abs=1e-6)

    t5 = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    seq2seq = HFModule(t5, task="seq2seq")
    targets = torch.randint(2, VOCAB, (4, 6), generator=g)
    targets[0, 4:] = -100
    out = seq2seq.training_step({"input_ids": ids, "labels": targets}, 0)
    assert out["num_tokens"].item() == 22
    assert abs(out["loss"].item() - seq2seq(input_ids=ids, labels=targets).loss.item()) < 1e-6
    assert seq2seq.predict_step({"input_ids": ids, "labels": targets}, 0).shape == (4, 6, VOCAB)


# ---- bad input -----------------------------------------------------------------------------------
def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_bad_input_is_refused_in_one_line(llama_dir, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError) as err:
        HFModule(tmp_path / "no-such-model")
    assert "no-such-model" in one_line(err)

    with pytest.raises(ValueError) as err:
        HFModule(llama_dir, task="seq2seq")
    message = one_line(err)
    assert "'llama'" in message and "'seq2seq'" in message and "'causal-lm'" in message
    with pytest.raises(ValueError) as err:  # BERT attends both ways: as a causal LM it would see its targets
        HFModule(BertConfig(**TINY_BERT), task="causal-lm")
    message = one_line(err)
    assert "'bert'" in message and "'causal-lm'" in message and "is_decoder" in message
    assert "'seq-classification', 'token-classification'" in message
    assert HFModule(BertConfig(**TINY_BERT, is_decoder=True)).task == "causal-lm"  # its causal mask on
    with pytest.raises(ValueError) as err:
        HFModule(BertConfig(**TINY_BERT), task="seq2seq")
    assert "'bert'" in one_line(err) and "'seq-classification'" in str(err.value)
    with pytest.raises(ValueError) as err:
        HFModule(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), task="token-classification")
    assert "LlamaForCausalLM" in one_line(err) and "'causal-lm'" in str(err.value)
    with pytest.raises(ValueError) as err:
        HFModule(llama_dir, task="translation")
    assert "'causal-lm'" in one_line(err)

    with pytest.raises(ValueError) as err:
        HFModule(llama_dir, freeze=["model.layers.0.*", "decoder.*"])
    assert "'decoder.*'" in one_line(err) and "model.embed_tokens.weight" in str(err.value)

    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(ImportError) as err:
        HFModule(llama_dir, lora=LORA)
    assert "pip install .[peft]" in one_line(err)
