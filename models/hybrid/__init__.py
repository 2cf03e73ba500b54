"""Non-Mamba mixers of hybrid models: '*' Attention, '-' MLP (SwiGLU), 'E' MoE.

Each is built as Cls(args: ModelArgs, layer_id: int, n_layers: int) and called as forward(x_BSD, seq_idx=None).
"""

from models.hybrid.attention import Attention
from models.hybrid.mlp import MLP
from models.hybrid.moe import GroupedExperts, MoE

# Layer-pattern letter -> mixer class (the lead's model adds "M" -> Mamba2).
HYBRID_MIXERS = {"*": Attention, "-": MLP, "E": MoE}

__all__ = ["Attention", "MLP", "MoE", "GroupedExperts", "HYBRID_MIXERS"]
