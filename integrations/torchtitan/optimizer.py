"""torchtitan's build_optimizers_fn for Mamba-2: torchtitan's optimizers, plus, for models with MoE layers, mambatitan's
after-step MoE balancing (components/moe_balance.py: expert loads summed over the data-parallel ranks, the
auxiliary-loss-free expert-bias update, counts reset), which train.py runs after every optimizer step and
torchtitan's loop knows nothing of.

The flavors' auxiliary / z-loss coefficients are 0 (torchtitan cannot override a model size), so the aux-loss scale
per microbatch that train.py sets (MoEBalancer.set_microbatches) has nothing to scale here.
"""

from __future__ import annotations

from torch import nn
from torchtitan.components.optimizer import OptimizersContainer, build_optimizers

from components.moe_balance import MoEBalancer


def build_mamba2_optimizers(
    model_parts: list[nn.Module], optimizer_config, parallel_dims, ft_manager=None
) -> OptimizersContainer:
    optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    # Of the whole model: a pipeline stage without MoE layers still joins the balancer's pp reduction.
    if "E" in model_parts[0].args.layer_types:
        loss_mesh, pp_mesh = parallel_dims.get_optional_mesh("loss"), parallel_dims.get_optional_mesh("pp")
        balancer = MoEBalancer(
            model_parts,
            True,
            loss_mesh.get_group() if loss_mesh is not None else None,
            pp_mesh.get_group() if pp_mesh is not None else None,
        )
        optimizers.register_step_post_hook(lambda *args, **kwargs: balancer.after_step())
    return optimizers
