"""Which tasks HFModule trains a model type on, as transformers' Auto-class tables say: a decoder whose config
carries `is_decoder=False` (GPT-NeoX) is a causal LM; a bidirectional encoder (a masked-LM type) is one only
with `is_decoder=True`; a refusal names the tasks the type can do, in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from trainer.models.hf import HFModule

SIZES = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


def config(model_type: str, **fields):
    extra = {"intermediate_size": 64} if model_type != "bart" else {"d_model": 32}
    return AutoConfig.for_model(model_type, **SIZES, **extra, **fields)


@pytest.mark.parametrize(
    "model_type,fields,model_class",
    [
        ("gpt_neox", {}, "GPTNeoXForCausalLM"),  # its config says is_decoder=False: a field it never reads
        ("bart", {}, "BartForCausalLM"),  # a seq2seq type: its causal LM is the decoder half
        ("bert", {"is_decoder": True}, "BertLMHeadModel"),  # an encoder made causal
    ],
)
def test_what_trains_as_a_causal_lm_attends_causally(model_type, fields, model_class):
    torch.manual_seed(0)
    module = HFModule(config(model_type, **fields), task="causal-lm")
    assert type(module.hf_model()).__name__ == model_class
    module.eval()
    ids = torch.randint(3, 64, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 64
    with torch.no_grad():
        before, after = (module(input_ids=x, use_cache=False).logits for x in (ids, changed))
    assert torch.equal(before[0, :-1], after[0, :-1]), "an earlier position saw the last token"


@pytest.mark.parametrize(
    "model_type,task,able",
    [
        ("gpt_neox", "seq2seq", "'causal-lm', 'seq-classification', 'token-classification', 'dpo'"),
        ("t5", "causal-lm", "'seq-classification', 'token-classification', 'seq2seq'"),
        ("bert", "causal-lm", "'seq-classification', 'token-classification'"),
        ("llama", "seq2seq", "'causal-lm', 'seq-classification', 'token-classification', 'dpo'"),
    ],
)
def test_a_task_the_type_lacks_is_refused_naming_the_tasks_it_has(model_type, task, able):
    fields = {"d_model": 32, "num_layers": 2, "num_heads": 4} if model_type == "t5" else {}
    with pytest.raises(ValueError) as err:
        HFModule(config(model_type, **fields), task=task)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"a {model_type!r} model cannot do task {task!r}")
    assert message.endswith(f"allowed tasks for it: {able}")
    assert ("is_decoder=True" in message) == (model_type == "bert")  # an encoder could be made causal
