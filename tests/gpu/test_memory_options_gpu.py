"""The model's memory-for-time options on the GPU: model.recompute_in_proj_input (the block norm's output rewritten by
its backward, models/kernels/norm_linear.py) and model.ssd_keep_conv_layers (the conv's output kept for the
backward, split_conv1d_scan.py). Each changes what is held between forward and backward, never a value: under bf16
autocast with float32 weights and packed documents, the loss and every gradient equal the model's without them, and
the storages saved for the backward move by exactly what the options say (the normed rows' bytes down, the conv
outputs' up)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from models import build_model_args  # noqa: E402
from models.init import init_weights  # noqa: E402
from models.mamba2.model import Mamba2LM  # noqa: E402

pytestmark = pytest.mark.gpu
B, L = 2, 1024


def _run(overrides: dict):
    """(loss, {name: grad}, bytes of the storages the forward saved for the backward beyond the parameters, args) of
    one bf16-autocast forward + backward. The saved storages, counted once each through saved-tensor hooks, are what
    the options move; torch.cuda.memory_allocated at these small shapes also moves with the allocator's block reuse
    (0.9 of the 10.5 MB of kept conv outputs went missing from it here: session 56), at the 1.3B it matched them
    (docs/performance.md)."""
    args = build_model_args("debug", {"d_model": 256, "n_layers": 4, "d_state": 64, "headdim": 32,
                                      "chunk_size": 128, **overrides})  # fmt: skip
    torch.manual_seed(0)
    model = Mamba2LM(args).cuda()
    init_weights(model, seed=0, init_std=0.02)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (B, L), generator=gen).cuda()
    seq = torch.zeros(B, L, dtype=torch.int32)
    seq[:, L // 3 :] += 1
    seq[:, 2 * L // 3 :] += 1
    seq = seq.cuda()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and t.device.type == "cuda":
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autocast("cuda", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, seq_idx=seq, labels=ids)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, sum(saved.values()), args


def test_memory_options_change_no_value_and_move_what_is_held():
    loss0, grads0, held0, args = _run({})
    loss1, grads1, held1, _ = _run({"recompute_in_proj_input": True})
    loss2, grads2, held2, _ = _run({"ssd_keep_conv_layers": -1})
    for loss, grads in ((loss1, grads1), (loss2, grads2)):
        assert torch.equal(loss, loss0)
        differ = [n for n, g in grads.items() if not torch.equal(g, grads0[n])]
        assert not differ, differ
    normed = args.n_layers * B * L * args.d_model * 2  # bf16 rows no longer held
    conv = args.n_layers * B * L * (args.d_inner + 2 * args.ngroups * args.d_state) * 2  # bf16 conv outputs held
    assert held0 - held1 == normed, (held0, held1, normed)
    assert held2 - held0 == conv, (held0, held2, conv)
