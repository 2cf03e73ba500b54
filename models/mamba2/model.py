"""The Mamba-2 (and hybrid) language model, pipeline-ready.

- `layers` is an nn.ModuleDict keyed "0".."n-1": pipeline stages delete the layers they do not own and the
  remaining ones keep their names, so state dicts (and checkpoints) are the same under every layout.
- `tok_embeddings`, `norm_f` and `lm_head` may be None; forward passes through whatever is missing:
  without tok_embeddings the input is the packed inter-stage tensor; without norm_f the output is.
- Tied embeddings under pipeline parallel: the last stage keeps `tok_embeddings` only as the owner of the head's
  shared weight (so it keeps the FQN "tok_embeddings.weight" and its initial values) and sets
  `embeds_tokens = False`: its input is the packed inter-stage tensor all the same.
- Between stages hidden and residual travel as ONE plain tensor (`pack_format`):
  "stack": [2, b, s, d] (hidden, residual); "sum": [b, s, d] = residual + hidden, exactly equivalent since the
  next block's first op is that same add (half the bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from models.args import ModelArgs
from models.inference import InferenceCache, left_padding_seq_idx
from models.kernels import ops
from models.kernels.row_scale import materialize
from models.kernels.tied_embedding import GradHandoff, embedding_with_handoff
from models.mamba2.block import Block
from models.mamba2.mixer import Mamba2Mixer
from models.norms import GatedRMSNorm, RMSNorm

PACK_FORMATS = ("stack", "sum")


def pack_hidden_residual(hidden_BSD: torch.Tensor, residual_BSD: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """(hidden [b,s,d], residual [b,s,d] or None) -> "stack": [2,b,s,d] | "sum": [b,s,d], in the residual's dtype."""
    if residual_BSD is None:
        residual_BSD = torch.zeros_like(hidden_BSD)
    dtype = torch.promote_types(hidden_BSD.dtype, residual_BSD.dtype)
    if fmt == "stack":
        return torch.stack([hidden_BSD.to(dtype), residual_BSD.to(dtype)])
    if fmt == "sum":
        return residual_BSD.to(dtype) + hidden_BSD.to(dtype)
    raise ValueError(f"parallelism.pipeline_parallel_pack={fmt!r}; choose one of {PACK_FORMATS}")


def unpack_hidden_residual(packed: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of pack_hidden_residual. "sum" comes back as (sum, None): the next add is then a no-op."""
    if fmt == "stack":
        return packed[0], packed[1]
    if fmt == "sum":
        return packed, None
    raise ValueError(f"parallelism.pipeline_parallel_pack={fmt!r}; choose one of {PACK_FORMATS}")


def _fill_tied_head(module, state_dict, prefix, *_):
    """Checkpoints hold a tied weight once, under `tok_embeddings.weight`: let a strict load_state_dict fill the
    head's name from it."""
    tied = module.args.tie_embeddings and module.lm_head is not None and module.tok_embeddings is not None
    if tied and prefix + "tok_embeddings.weight" in state_dict:
        state_dict.setdefault(prefix + "lm_head.weight", state_dict[prefix + "tok_embeddings.weight"])


class TokenEmbedding(nn.Embedding):
    """nn.Embedding whose forward may take a GradHandoff: its weight gradient is then added into the tied head's
    (models/kernels/tied_embedding.py), not made apart and added by autograd."""

    def forward(self, ids: torch.Tensor, grad_handoff: GradHandoff | None = None) -> torch.Tensor:
        if grad_handoff is None:
            return super().forward(ids)
        return embedding_with_handoff(ids, self.weight, grad_handoff)


class Mamba2LM(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.pack_format = "sum"
        self.embeds_tokens = True  # False: tok_embeddings only holds the tied head's weight (see the module doc)
        self.loss_backend = "auto"  # ops.linear_cross_entropy_sum's backend (model.kernels, set_kernel_backend)
        # Shape of the summed loss forward returns: () a scalar; a pipeline's last stage sets (1,), since the schedule
        # concatenates that stage's outputs over microbatches (parallelisms/pipeline.py).
        self.loss_shape: tuple[int, ...] = ()
        self.tok_embeddings = TokenEmbedding(args.padded_vocab_size, args.d_model)
        self.layers = nn.ModuleDict({str(i): Block(args, i, letter) for i, letter in enumerate(args.layer_types)})
        self.norm_f = RMSNorm(args.d_model, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.d_model, args.padded_vocab_size, bias=False)
        self.tie_weights()
        self.register_load_state_dict_pre_hook(_fill_tied_head)

    def tie_weights(self) -> None:
        """Share lm_head's weight with tok_embeddings (when tied and both ends are on this stage).

        Needed again after `to_empty()`, which materialises the two references as separate tensors.
        """
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.lm_head is not None:
            self.lm_head.weight = self.tok_embeddings.weight

    def forward(
        self,
        inputs: torch.Tensor,
        seq_idx: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_chunk_tokens: int = 0,
    ) -> torch.Tensor:
        """tokens [b, s] (or the packed inter-stage tensor) -> logits [b, s, V] (or the packed tensor).

        seq_idx: int32 [b, s], the document id of every position (whole-sequence length under CP).
        labels: if given (last stage only), return the summed token loss instead of logits
        (ops.linear_cross_entropy_sum: on CUDA with our kernels the fused loss, its logits buffer bounded to
        `loss_chunk_tokens` rows when > 0; elsewhere chunks of that many tokens recomputed in the backward, so the
        full logits never exist, or with 0 one pass).
        """
        handoff = self._tied_grad_handoff(inputs, labels)
        if self.tok_embeddings is not None and self.embeds_tokens:
            hidden, residual = self.tok_embeddings(inputs, grad_handoff=handoff), None
        else:
            hidden, residual = unpack_hidden_residual(inputs, self.pack_format)
        for layer in self.layers.values():
            hidden, residual = layer(hidden, residual, seq_idx)
        if self.norm_f is None:
            return pack_hidden_residual(materialize(hidden), residual, self.pack_format)  # (a RowScaled's rows scaled)
        h_BSD, _ = self.norm_f.add_and_norm(hidden, residual, self.args.residual_in_fp32)
        if self.lm_head is None:
            return h_BSD
        if labels is not None:
            loss = ops.linear_cross_entropy_sum(
                h_BSD, self.lm_head.weight, labels, loss_chunk_tokens, backend=self.loss_backend, grad_handoff=handoff
            )
            return loss.reshape(self.loss_shape)
        return self.lm_head(h_BSD)

    def _tied_grad_handoff(self, inputs: torch.Tensor, labels: torch.Tensor | None) -> GradHandoff | None:
        """A GradHandoff when this forward embeds tokens and takes the fused loss (our kernels) with the head's weight
        tied and needing a gradient: the loss's backward then gives its weight gradient to the embedding's, which adds
        its rows in place (models/kernels/tied_embedding.py). None otherwise."""
        if labels is None or not self.embeds_tokens or self.tok_embeddings is None or self.lm_head is None:
            return None
        weight = self.tok_embeddings.weight
        if self.lm_head.weight is not weight or not (torch.is_grad_enabled() and weight.requires_grad):
            return None
        return GradHandoff() if ops.use_triton_ssd(self.loss_backend, inputs) else None

    # ---- recurrent decoding (models.inference: the cache layout and the left-padding rule) ---------------
    def allocate_inference_cache(
        self,
        batch_size: int,
        max_seqlen: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> InferenceCache:
        """A zeroed cache for `batch_size` rows of up to `max_seqlen` tokens (prompt + generated).

        dtype / device default to the embedding's: the conv inputs and the KV cache are kept in `dtype`,
        the SSM states always in float32.
        """
        self._check_can_decode()
        if batch_size < 1 or max_seqlen < 1:
            raise ValueError(
                f"allocate_inference_cache: batch_size={batch_size} and max_seqlen={max_seqlen} must both be >= 1"
            )
        weight = self.tok_embeddings.weight
        dtype, device = dtype or weight.dtype, torch.device(device) if device is not None else weight.device
        cache = InferenceCache(batch_size=batch_size, max_seqlen=max_seqlen)
        for name, layer in self.layers.items():
            if layer.keeps_state:
                cache.layers[name] = layer.mixer.allocate_inference_cache(batch_size, max_seqlen, dtype, device)
        return cache

    @torch.no_grad()
    def prefill(
        self, input_ids_BS: torch.Tensor, cache: InferenceCache, prompt_lengths_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The parallel forward over left-padded prompts, filling the cache -> logits of the last column [B, V].

        Row b's prompt is its last prompt_lengths_B[b] tokens (None: no padding); see models.inference for
        the padding rule. Runs the training kernels (chunked SSD, fused path on CUDA).
        """
        self._check_can_decode()
        if input_ids_BS.dim() != 2 or input_ids_BS.dtype.is_floating_point:
            raise ValueError(
                f"prefill: input_ids must be integer token ids [batch, seqlen], got "
                f"{input_ids_BS.dtype} {list(input_ids_BS.shape)}"
            )
        b, s = input_ids_BS.shape
        if cache.batch_size != b:
            raise ValueError(
                f"prefill: the cache holds {cache.batch_size} rows but {b} prompts were given; "
                "allocate the cache for this batch size"
            )
        if cache.seqlen != 0:
            raise ValueError(
                f"prefill: the cache already holds {cache.seqlen} tokens; call cache.reset() "
                "(or allocate a new cache) before a new batch"
            )
        if s > cache.max_seqlen:
            raise ValueError(
                f"prefill: {s} prompt columns exceed the cache's max_seqlen={cache.max_seqlen}; allocate a longer cache"
            )
        seq_idx_BS = None
        if prompt_lengths_B is not None:
            lengths_B = torch.as_tensor(prompt_lengths_B, device=input_ids_BS.device).to(torch.int64)
            if lengths_B.shape != (b,) or bool(((lengths_B < 1) | (lengths_B > s)).any()):
                raise ValueError(
                    f"prefill: prompt_lengths must be [batch] = [{b}] values in [1, {s}] "
                    f"(every prompt needs a token), got {lengths_B.tolist()}"
                )
            seq_idx_BS = left_padding_seq_idx(lengths_B, s)
            if seq_idx_BS is not None:
                cache.first_real_B = s - lengths_B
        hidden_BSD, residual_BSD = self.tok_embeddings(input_ids_BS), None
        for layer in self.layers.values():
            hidden_BSD, residual_BSD = layer.prefill(hidden_BSD, residual_BSD, cache, seq_idx_BS)
        cache.seqlen = s
        return self._last_logits(hidden_BSD[:, -1:], residual_BSD[:, -1:])

    @torch.no_grad()
    def decode_step(self, token_ids_B: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """Feed one token per row (at column cache.seqlen), advancing every layer's state -> logits [B, V]."""
        self._check_can_decode()
        if token_ids_B.shape != (cache.batch_size,) or token_ids_B.dtype.is_floating_point:
            raise ValueError(
                f"decode_step: token_ids must be integer ids [batch] = [{cache.batch_size}], got "
                f"{token_ids_B.dtype} {list(token_ids_B.shape)}"
            )
        if cache.seqlen == 0:
            raise ValueError("decode_step: the cache is empty; call prefill with the prompts first")
        if cache.seqlen >= cache.max_seqlen:
            raise ValueError(
                f"decode_step: the cache is full (max_seqlen={cache.max_seqlen}); allocate it with "
                "room for the prompt plus every token to generate"
            )
        hidden_B1D, residual_B1D = self.tok_embeddings(token_ids_B[:, None]), None
        for layer in self.layers.values():
            hidden_B1D, residual_B1D = layer.step(hidden_B1D, residual_B1D, cache)
        cache.seqlen += 1
        return self._last_logits(hidden_B1D, residual_B1D)

    def _last_logits(self, hidden_B1D: torch.Tensor, residual_B1D: torch.Tensor) -> torch.Tensor:
        h_B1D, _ = self.norm_f.add_and_norm(hidden_B1D, residual_B1D, self.args.residual_in_fp32)
        return self.lm_head(h_B1D)[:, 0]

    def _check_can_decode(self) -> None:
        whole = (
            self.tok_embeddings is not None
            and self.embeds_tokens
            and self.norm_f is not None
            and self.lm_head is not None
            and len(self.layers) == self.args.n_layers
        )
        if not whole:
            raise ValueError(
                "recurrent decoding needs the whole model (embedding, every layer, norm_f and lm_head); "
                "this one is a pipeline stage: build the model without pipeline parallel"
            )
        if self.training:
            raise ValueError(
                "recurrent decoding runs in eval mode (MoE layers would count tokens and add "
                "auxiliary losses as in training); call model.eval() first"
            )

    def set_kernel_backend(self, backend: str) -> None:
        """'auto', 'triton', 'mamba_ssm' or 'reference' for the Mamba mixers, the norms and the loss (see
        model.kernels; the ops also take 'cuda', the older name of 'mamba_ssm').

        Attention and experts have their own backends (sdpa / flex / flash, grouped_mm / loop) and keep "auto".
        """
        for m in self.modules():
            if isinstance(m, (Mamba2Mixer, RMSNorm, GatedRMSNorm)):
                m.backend = backend
        self.loss_backend = backend
