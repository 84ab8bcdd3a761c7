"""SFT packing (hf_dataloaders(sft_packing=True)): whole prompt/response examples several to a row, position
ids restarting at each, and a tiny Hugging Face Llama (fp32) giving every packed example the very loss it
has alone, through transformers' own packed-sequence masks and through our explicit 4-D mask."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.data.hf_data import hf_dataloaders
from trainer.data.sft_packing import PackedExamples
from trainer.models.hf import HFModule
from trainer.models.hf_create import byte_tokenizer
from trainer.models.hf_packing import builds_packed_masks, packed_inputs

SEQ_LEN = 64
RECORDS = [
    {"prompt": "2+3=", "response": "5"},
    {"prompt": "Say hi to the cat.", "response": "Hi, cat!"},
    {"prompt": "Capital of France?", "response": "Paris, of course."},
    {"prompt": "abc", "response": "def ghi"},
    {"prompt": "Spell dog backwards:", "response": "god"},
    {"prompt": "Count to five.", "response": "1 2 3 4 5"},
    {"prompt": "x", "response": "a long answer that fills most of a row by itself, nearly"},
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = None  # prompt tokens, response tokens, EOS: the encoding is then plain to check
    return tok


def tiny_llama(tokenizer, attn_implementation: str) -> HFModule:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
        attn_implementation=attn_implementation, initializer_range=0.2,  # attention far from uniform
    )  # fmt: skip
    return HFModule(LlamaForCausalLM(config).float())


def loaders(tokenizer, sft_packing: bool):
    data = datasets.Dataset.from_list(RECORDS)
    train, _ = hf_dataloaders(
        data, tokenizer, prompt_field="prompt", response_field="response", seq_len=SEQ_LEN, batch_size=1,
        val_fraction=0, sft_packing=sft_packing,
    )  # fmt: skip
    return train


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of the labels (0 where the label is -100), written out; in float64
    from the model's float32 logits, so what is compared is the model's arithmetic, not this function's."""
    logp = logits.double().log_softmax(-1)
    return -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)


def alone(module: HFModule, example) -> torch.Tensor:
    """The example's mean response loss with the example alone in its batch (no padding, no packing)."""
    ids = torch.tensor([example["input_ids"]])
    labels = torch.tensor([example["labels"]])
    with torch.no_grad():
        logits = module.model(input_ids=ids).logits
    return token_losses(logits, labels).sum() / (labels != -100).sum()


def test_packed_rows_hold_whole_examples_with_restarting_positions_and_no_label_across(tokenizer):
    unpacked, packed = loaders(tokenizer, False).dataset, loaders(tokenizer, True).dataset
    assert isinstance(packed, PackedExamples) and len(unpacked) == len(RECORDS)
    assert len(packed) < len(unpacked)  # several examples share rows
    eos = tokenizer.eos_token_id
    for i, example in enumerate(unpacked):
        n, row, start = len(example["input_ids"]), packed.rows[i], packed.starts[i]
        assert packed.input_ids[row, start : start + n].tolist() == example["input_ids"]
        assert packed.labels[row, start : start + n].tolist() == example["labels"]
        assert packed.position_ids[row, start : start + n].tolist() == list(range(n))
        prompt = tokenizer(RECORDS[i]["prompt"], add_special_tokens=False)["input_ids"]
        response = tokenizer(RECORDS[i]["response"], add_special_tokens=False)["input_ids"]
        # the loss is on the response and EOS only: labels are -100 up to the prompt's last position
        assert example["labels"] == [-100] * (len(prompt) - 1) + response + [eos]
    for row in range(len(packed)):  # what the examples leave of a row is padding, never a target
        used = sum(len(unpacked[i]["input_ids"]) for i in range(len(unpacked)) if packed.rows[i] == row)
        assert (packed.labels[row, used:] == -100).all()
        assert (packed.input_ids[row, used:] == tokenizer.pad_token_id).all()
    # next-fit by hand: 3 + 4 fill a row of 8, 2 opens the next; padding restarts its positions
    rows = PackedExamples([[1, 2, 3], [4, 5, 6, 7], [8, 9]], [[1, 1, 1], [1, 1, 1, 1], [1, 1]], 8, pad_id=0)
    assert rows.rows == [0, 0, 1] and rows.starts == [0, 3, 0]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5]]
    assert rows.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="an example of 9 tokens and 9 labels cannot be packed"):
        PackedExamples([[1] * 9], [[1] * 9], 8, pad_id=0)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("explicit_mask", [False, True], ids=["position-ids", "4d-mask"])
def test_a_packed_batch_gives_every_example_its_unpacked_loss(tokenizer, attn_implementation, explicit_mask):
    module = tiny_llama(tokenizer, attn_implementation)
    unpacked, packed = loaders(tokenizer, False).dataset, loaders(tokenizer, True).dataset
    batch = {"input_ids": packed.input_ids, "labels": packed.labels, "position_ids": packed.position_ids}
    inputs = packed_inputs(
        module.hf_model(), {k: v for k, v in batch.items() if k != "labels"}, explicit_mask
    )
    assert ("attention_mask" in inputs) == explicit_mask
    assert builds_packed_masks(module.hf_model())  # so HFModule's default for a Llama is the position ids
    with torch.no_grad():
        per_token = token_losses(module.model(**inputs, use_cache=False).logits, packed.labels)
    worst, expected_sum = 0.0, 0.0
    for i, example in enumerate(unpacked):
        n, row, start = len(example["input_ids"]), packed.rows[i], packed.starts[i]
        count = sum(label != -100 for label in example["labels"])
        got = per_token[row, start : start + n].sum() / count
        expected = alone(module, example)
        worst = max(worst, (got - expected).abs().item())
        expected_sum += expected.item() * count
    print(f"packed vs unpacked ({attn_implementation}, explicit_mask={explicit_mask}): max {worst:.2e}")
    assert worst <= 1e-6, f"packed vs unpacked per-example loss differs by {worst:.2e}"
    # HFModule's own step on the packed batch: the token mean of the examples' losses
    out = module.training_step(batch, 0)
    total = int((packed.labels != -100).sum())
    assert out["num_tokens"].item() == total
    assert abs(out["loss"].item() - expected_sum / total) <= 1e-6

    # the control: the same rows as one sequence each (attention across examples) give other losses
    with torch.no_grad():
        across = token_losses(module.model(input_ids=packed.input_ids).logits, packed.labels)
    assert (across - per_token).abs().max().item() > 1e-3


def test_a_packed_batch_for_an_attention_without_4d_masks_is_refused_in_one_line(tokenizer):
    module = tiny_llama(tokenizer, "sdpa")
    module.hf_model().config._attn_implementation = "flash_attention_2"
    position_ids = torch.tensor([[0, 1, 0, 1]])
    with pytest.raises(ValueError, match="attention 'flash_attention_2' does not take") as err:
        packed_inputs(module.hf_model(), {"input_ids": position_ids, "position_ids": position_ids}, True)
    assert "\n" not in str(err.value)
    # an unpacked batch (an attention mask given) passes through untouched
    inputs = {"input_ids": position_ids, "position_ids": position_ids, "attention_mask": torch.ones(1, 4)}
    assert packed_inputs(module.hf_model(), inputs, True) is inputs
