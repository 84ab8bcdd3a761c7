"""A `transformers` model's own tensor-parallel plan (`config.base_model_tp_plan`: module pattern -> style
name) as DTensor parallel styles, which Parallel3DStrategy applies over its "tp" mesh.

Each of transformers' style names is one of DTensor's layouts: a column split (weight rows Shard(0), output
sharded on its last dim, or gathered back: "_gather_output", "_rep"), a row split (weight columns Shard(1),
input sharded or split here from a replicated one: "_split_input", "_rep"; the partial sums all-reduced),
a vocabulary- or width-split embedding, a packed projection split per packed part (its gate and up halves
each split, as transformers' packed_colwise), and a replicated norm over rows of which each rank holds its
own heads (its weight's gradient summed over the ranks). Styles that route MoE experts or keep a partial
output for another module to sum have no such equivalent here: they are refused in one line.

Embeddings and the output head stay whole on every rank (no sequence or loss parallelism) unless the plan
splits the embedding itself (GPT-NeoX), and not when it is tied to the head, which stays whole.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

# what a refused style does, which no DTensor layout of one module reproduces
_REFUSED = {
    "sequence_parallel": "activations sharded over the sequence between layers, which this plan keeps whole",
    "unit_colwise": "whole heads replicated over a sub-mesh of the tp ranks",
    "unit_rowwise": "whole heads replicated over a sub-mesh of the tp ranks",
    "mla_kv_a_proj": "an output split in two whose rotary part needs its gradient summed apart",
    "moe_tp_experts": "MoE experts run on local shards with their output summed",
    "local_params": "a bare parameter sharded by heads, used by its owner on local tensors",
    "local_rowwise": "a partial output that another module sums (MoE experts)",
    "local_packed_rowwise": "a partial output that another module sums (MoE experts)",
    "local": "a module run on local tensors, its sums left to another module",
    "gather": "the sum of partial outputs of the modules inside it (MoE experts)",
    "all_reduce": "the sum of partial outputs of the modules inside it (MoE experts)",
    "packed_rowwise": "a weight packed along its input (MoE experts' down projections)",
    "grouped_gemm": "expert parallelism (an ep plan), not tensor parallelism",
    "ep_dispatch_experts": "expert parallelism (an ep plan), not tensor parallelism",
}


def _styles() -> dict[str, Any]:
    """Style name -> a factory of its DTensor style (None: nothing to do, the module stays whole as in one
    process). DTensor is imported here: only a tp run needs it."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    gathered = lambda: ColwiseParallel(output_layouts=Replicate())  # noqa: E731
    split_here = lambda: RowwiseParallel(input_layouts=Replicate())  # noqa: E731
    return {
        "colwise": ColwiseParallel,
        "local_colwise": ColwiseParallel,  # transformers 4.x: colwise run on local tensors, as ours returns
        "rowwise": RowwiseParallel,
        "colwise_gather_output": gathered,
        "colwise_rep": gathered,
        "rowwise_split_input": split_here,
        "rowwise_rep": split_here,
        "embedding_rowwise": split_here,  # the vocabulary split: each rank looks up its ids, the sums reduced
        "embedding_colwise": gathered,  # the width split: each rank looks up a slice of every vector
        "packed_colwise": lambda: _packed_colwise(parts=2),  # transformers' split_factor: gate and up
        # rows of a per-head norm's input: each rank holds its heads' (any dim but the normalised last can
        # say so); the weight is replicated and DTensor sums its partial gradients over the ranks
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=-2, use_local_output=True),
        "replicate": None,
    }


def tensor_parallel_plan(model: nn.Module, prefix: str) -> dict[str, ParallelStyle]:
    """`parallelize_module`'s plan for the transformers `model` that sits at `prefix` in the module being
    parallelised: its `base_model_tp_plan` with each style mapped (module patterns keep their "*"), or a
    one-line ValueError naming the style, the module and the model type that cannot be mapped."""
    config = model.config
    kind = f"{type(model).__name__} ({getattr(config, 'model_type', '?')!r})"
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"{kind}: transformers gives this model type no tensor-parallel plan (config.base_model_tp_plan is "
            "empty); allowed: tp=1"
        )
    styles = _styles()
    base = model.get_submodule(model.base_model_prefix) if model.base_model_prefix else model
    modules, parameters = dict(base.named_modules()), dict(base.named_parameters())
    tied = _tied_to_the_head(model)
    out: dict[str, ParallelStyle] = {}
    for pattern, name in plan.items():
        matched = [m for path, m in modules.items() if _matches(pattern, path)]
        if styles.get(name, False) is None or (
            not matched and not any(_matches(pattern, path) for path in parameters)
        ):
            continue  # nothing to split: a replicated parameter, or a module this config does not have
        refusal = _refusal(name, matched, styles)
        if refusal:
            raise ValueError(
                f"{kind}: tensor-parallel style {name!r} on {pattern!r}: {refusal}; allowed: tp=1"
            )
        if any(id(getattr(m, "weight", None)) in tied for m in matched):
            continue  # an embedding tied to the head stays whole with it, as in one process
        out[".".join(p for p in (prefix, model.base_model_prefix, pattern) if p)] = styles[name]()
    return out


def _refusal(name: str, matched: list[nn.Module], styles: dict[str, Any]) -> str | None:
    """Why style `name` cannot split the modules its pattern matched (None: it can)."""
    if name not in styles:
        why = _REFUSED.get(name, "a style name this mapping does not know")
        mapped = ", ".join(s for s, style in styles.items() if style is not None)
        return f"{why}: no DTensor style here does that (mapped: {mapped})"
    if not matched:
        return "it names a parameter, not a module, and DTensor's styles split modules"
    layer = _LAYER_TYPES.get(name, nn.Module)
    wrong = next((m for m in matched if not isinstance(m, layer)), None)
    if wrong is not None:
        found = f"{type(wrong).__module__}.{type(wrong).__qualname__}"
        return f"it splits torch.nn.{layer.__name__} layers, but matches a {found}"
    return None


# the layers each style splits (the others take any module: a norm)
_LINEAR = ("colwise", "local_colwise", "rowwise", "colwise_gather_output", "colwise_rep", "packed_colwise")
_LAYER_TYPES: dict[str, type[nn.Module]] = {
    **dict.fromkeys([*_LINEAR, "rowwise_split_input", "rowwise_rep"], nn.Linear),
    **dict.fromkeys(["embedding_rowwise", "embedding_colwise"], nn.Embedding),
}


def _tied_to_the_head(model: nn.Module) -> set[int]:
    """The ids of the weights the output head shares (tied embeddings): they stay whole with the head."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    weight = getattr(head, "weight", None)
    return {id(weight)} if weight is not None else set()


def _matches(pattern: str, path: str) -> bool:
    """Whether the module `path` matches the plan's `pattern`, whose "*" stands for one name (a layer's
    number), as `parallelize_module` reads it."""
    regex = r"\.".join("[^.]+" if atom == "*" else re.escape(atom) for atom in pattern.split("."))
    return re.fullmatch(regex, path) is not None


def _packed_colwise(parts: int) -> ParallelStyle:
    """A column split of a projection whose output packs `parts` projections one after another (gate and up
    of a fused MLP): each part's rows are split over the ranks, so a rank's output holds its slice of every
    part in order, which the model's `chunk(parts, -1)` then separates locally."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    # defined here, as DTensor is imported here: only a tp run pays for importing it
    class PackedColwiseParallel(ColwiseParallel):
        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            for param_name, param in module.named_parameters():
                # rank r holds rows [r*k:(r+1)*k] of each part (transformers' packed_colwise layout)
                layout = [_StridedShard(0, split_factor=parts)]
                shard = distribute_tensor(param, device_mesh, layout, src_data_rank=self.src_data_rank)
                module.register_parameter(param_name, nn.Parameter(shard, requires_grad=param.requires_grad))

        @staticmethod
        def _prepare_output_fn(
            output_layouts: Any, use_local_output: bool, mod: Any, outputs: Any, mesh: Any
        ):
            # the output is strided like the weight: kept as it is (this rank's slice of each part)
            return outputs.to_local() if use_local_output else outputs

    return PackedColwiseParallel()
