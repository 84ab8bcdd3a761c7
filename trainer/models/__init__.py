"""The models: Llama (its tensor-parallel plan beside it), mixture of experts, CausalLM over them, and HFModule for any transformers model."""
