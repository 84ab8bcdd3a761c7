"""The architectures people fine-tune, each as a tiny random `transformers` config (fp32, no dropout, so a
run depends on its batches only), and the batches of each task: what tests/hf/test_hf_matrix.py trains under
every strategy and tests/scripts/hf_matrix_script.py trains on two processes."""

from __future__ import annotations

from typing import Any

import torch
from hf_script import VOCAB, lm_loader
from torch.utils.data import DataLoader

# two blocks of 4 query heads (2 key-value heads where the family has them) over 32 features: every
# tensor-parallel split over 2 ranks is even, and a step takes milliseconds
_LLAMA_LIKE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
_HEAD_DIM = {"head_dim": 8}
_SLIDING = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}  # seq 16: both kinds
_ENCODER = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}

# family -> (model type, its tiny config's fields, its tasks)
CAUSAL, SEQ_CLS, TOKEN_CLS, SEQ2SEQ = "causal-lm", "seq-classification", "token-classification", "seq2seq"
FAMILIES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "Llama": ("llama", _LLAMA_LIKE, (CAUSAL,)),
    "Mistral": ("mistral", {**_LLAMA_LIKE, "sliding_window": 8}, (CAUSAL,)),
    "Qwen2": ("qwen2", _LLAMA_LIKE, (CAUSAL,)),
    "Qwen3": ("qwen3", {**_LLAMA_LIKE, **_HEAD_DIM}, (CAUSAL,)),
    "Gemma": ("gemma", {**_LLAMA_LIKE, **_HEAD_DIM}, (CAUSAL,)),
    "Gemma 2": ("gemma2", {**_LLAMA_LIKE, **_HEAD_DIM, **_SLIDING, "query_pre_attn_scalar": 8}, (CAUSAL,)),
    "Gemma 3": (
        "gemma3_text",
        {**_LLAMA_LIKE, **_HEAD_DIM, **_SLIDING, "query_pre_attn_scalar": 8},
        (CAUSAL,),
    ),
    "Phi-3": ("phi3", {**_LLAMA_LIKE, "pad_token_id": 0}, (CAUSAL,)),
    "GPT-2": (
        "gpt2",
        {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
        | dict.fromkeys(["resid_pdrop", "embd_pdrop", "attn_pdrop"], 0.0),
        (CAUSAL,),
    ),
    "GPT-NeoX": (
        "gpt_neox",
        {k: _LLAMA_LIKE[k] for k in _LLAMA_LIKE if k != "num_key_value_heads"},
        (CAUSAL,),
    ),
    "OPT": (
        "opt",
        {
            "hidden_size": 32,
            "ffn_dim": 64,
            "word_embed_proj_dim": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 64,
            "dropout": 0.0,
        },
        (CAUSAL,),
    ),
    "Falcon": ("falcon", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}, (CAUSAL,)),
    "StarCoder2": ("starcoder2", _LLAMA_LIKE, (CAUSAL,)),
    "OLMo 2": ("olmo2", _LLAMA_LIKE, (CAUSAL,)),
    "BERT": ("bert", _ENCODER, (SEQ_CLS, TOKEN_CLS)),
    "RoBERTa": ("roberta", {**_ENCODER, "pad_token_id": 1}, (SEQ_CLS, TOKEN_CLS)),
    "DeBERTa-v2": ("deberta-v2", _ENCODER, (SEQ_CLS, TOKEN_CLS)),
    "T5": (
        "t5",
        {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "dropout_rate": 0.0}
        # T5's unit-variance init (1.0) makes this tiny model's gradient norms ~100 and its SGD steps chaotic
        # (float noise grows to 1e-4 in 3 steps); 0.3 gives the others' ~0.2
        | {"decoder_start_token_id": 0, "pad_token_id": 0, "initializer_factor": 0.3},
        (SEQ2SEQ,),
    ),
}
# plans of our own over a family's modules, for styles transformers registers but these families' plans do
# not use: name -> (family, its base_model_tp_plan instead)
VARIANTS = {
    "Phi-3 packed gate_up": (
        "Phi-3",
        {
            "layers.*.self_attn.qkv_proj": "colwise_gather_output",
            "layers.*.self_attn.o_proj": "rowwise_split_input",
            "layers.*.mlp.gate_up_proj": "packed_colwise",  # gate and up each split over the ranks
            "layers.*.mlp.down_proj": "rowwise",
        },
    ),
    "GPT-NeoX colwise embedding": (
        "GPT-NeoX",
        {
            "embed_in": "embedding_colwise",  # each rank looks up half of every vector
            "layers.*.attention.query_key_value": "colwise",
            "layers.*.attention.dense": "rowwise",
            "layers.*.mlp.dense_h_to_4h": "colwise",
            "layers.*.mlp.dense_4h_to_h": "rowwise",
        },
    ),
}
DECODERS = [name for name, (_, _, tasks) in FAMILIES.items() if CAUSAL in tasks]
CLASSES = 3  # of a classification head
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}  # every family's own projections


def lora_options(family: str) -> dict[str, Any]:
    """LoRA's options for a family: GPT-2's projections are Conv1D, whose weight is stored transposed."""
    return {**LORA, "fan_in_fan_out": True} if family == "GPT-2" else LORA


GLOBAL_BATCH, STEPS, LR = 8, 3, 0.5  # LR: plain SGD's (hf_matrix_script.SGDModule)


def tiny_config(family: str) -> Any:
    """The tiny config of a family or a plan variant (the vocabulary of hf_script's data)."""
    from transformers import AutoConfig

    base, plan = VARIANTS.get(family, (family, None))
    model_type, fields, tasks = FAMILIES[base]
    ids = {"bos_token_id": 1, "eos_token_id": 2} if CAUSAL in tasks else {}  # inside the vocabulary
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, **ids, **fields)
    if plan is not None:
        config.base_model_tp_plan = plan
    return config


def loader(task: str, batch_size: int) -> Any:
    """The task's batches, `batch_size` a rank: a data-parallel rank's are every other example of one
    process's (a DistributedSampler's, or TokenLoader's own split), so each step sees the same global batch."""
    if task == CAUSAL:
        return lm_loader(batch_size)
    g = torch.Generator().manual_seed(0)
    n, length = GLOBAL_BATCH * STEPS, 12
    ids = torch.randint(2, VOCAB, (n, length), generator=g)
    if task == SEQ_CLS:  # the class is the third of the vocabulary the first token falls in
        labels = (ids[:, 0] * CLASSES) // VOCAB
    elif task == TOKEN_CLS:  # a tag per token, the padding ignored
        labels = (ids * CLASSES) // VOCAB
        labels[:, 9:] = -100
    else:  # seq2seq: the targets are the first tokens in reverse, of uneven lengths
        labels = ids[:, :6].flip(-1)
        labels[::3, 4:] = -100
    rows = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels, strict=True)]
    return DataLoader(rows, batch_size=batch_size)
