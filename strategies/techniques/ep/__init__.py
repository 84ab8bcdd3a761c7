"""Expert parallelism: experts.py is what strategies know of a model's MoE layers (its `expert_modules()`),
all_to_all.py exchanges tokens with the ranks holding their experts and shards the experts, apply.py applies
both."""
