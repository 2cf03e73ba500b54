"""The fused lm_head + cross-entropy (models/kernels/cross_entropy_triton.py) on the CPU, through Triton's interpreter.

Loss, dh and dweight against F.linear + F.cross_entropy in float64 with autograd (an upstream gradient that is not 1,
as the trainer's 1 / tokens): a vocabulary that is not a multiple of the row kernel's block (BLOCK_V is lowered to 64
in the child, so rows take several blocks and a masked tail), ignored labels (and a chunk of only ignored rows),
logits large enough that exp would overflow without the running max, chunks of rows (several, uneven, and one larger
than the input), no rows at all (a zero loss and zero gradients), gradients wanted for h only, the weight only, or
neither (no_grad: the loss alone), and through ops.linear_cross_entropy_sum with backend "triton" against backend
"reference", and under FSDP2 on two gloo ranks with the head's weight tied to the embedding (the unfused path's
gradients). float32: the interpreter computes in float32 numpy, tolerance 1e-5. The GPU test
(tests/gpu/test_cross_entropy_gpu.py) holds the compiled kernel in bfloat16 to the unfused path's errors.

As in test_ssd_triton.py, Triton reads TRITON_INTERPRET when first imported, so the cases run in one child process
with the variable set; each test reads its case's result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")

IGNORE = -100

# name -> (N, D, V, chunk_rows, logit scale, rows ignored (indices), grads wanted: "both" / "h" / "w" / "none")
CASES = {
    "one_pass": (20, 16, 300, 0, 1.0, (3, 11), "both"),
    "chunks_uneven": (20, 16, 300, 7, 1.0, (3, 11), "both"),
    "chunk_larger_than_input": (9, 16, 130, 64, 1.0, (), "both"),
    "chunk_all_ignored": (12, 8, 70, 4, 1.0, (4, 5, 6, 7), "both"),
    "large_logits": (10, 16, 200, 0, 60.0, (2,), "both"),
    "vocab_one_block": (10, 16, 64, 0, 1.0, (), "both"),
    "vocab_under_one_block": (10, 16, 40, 0, 30.0, (), "both"),  # lanes 40-63 see only the masked tail
    "h_grad_only": (16, 16, 150, 5, 1.0, (0,), "h"),
    "weight_grad_only": (16, 16, 150, 5, 1.0, (0,), "w"),
    "no_grad": (16, 16, 150, 0, 1.0, (0,), "none"),
    "no_rows": (0, 8, 70, 4, 1.0, (), "both"),
}


def _inputs(N, D, V, scale, ignored, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * (scale / D**0.5)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[list(ignored)] = IGNORE
    return h, w, labels


def _rel(a, b) -> float:
    b = b.double()
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_case(N, D, V, chunk, scale, ignored, wanted) -> dict:
    """One case in the child (TRITON_INTERPRET=1): relative errors against float64 autograd; raises on a violation."""
    from models.kernels import cross_entropy_triton as ce

    ce.BLOCK_V = 64  # several blocks per row, and a masked tail, at these small vocabularies
    h, w, labels = _inputs(N, D, V, scale, ignored)
    upstream = 0.37
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(h64 @ w64.t(), labels, ignore_index=IGNORE, reduction="sum")
    (ref * upstream).backward()
    h_in, w_in = h.clone().requires_grad_(wanted in ("both", "h")), w.clone().requires_grad_(wanted in ("both", "w"))
    if wanted == "none":
        with torch.no_grad():
            loss = ce.linear_cross_entropy_triton(h_in, w_in, labels, chunk, IGNORE)
        assert loss.grad_fn is None
    else:
        loss = ce.linear_cross_entropy_triton(h_in, w_in, labels, chunk, IGNORE)
        (loss * upstream).backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    errors = {"loss": abs(loss.item() - ref.item()) / max(abs(ref.item()), 1e-30)}  # no rows: both 0
    if wanted in ("both", "h"):
        assert h_in.grad.dtype == h.dtype
        errors["dh"] = _rel(h_in.grad, h64.grad)
        assert all(h_in.grad[i].abs().max() == 0 for i in ignored), "an ignored row got a gradient"
    else:
        assert h_in.grad is None
    if wanted in ("both", "w"):
        errors["dw"] = _rel(w_in.grad, w64.grad)
    else:
        assert w_in.grad is None
    bad = {k: e for k, e in errors.items() if not e <= 1e-5}
    assert not bad, f"over tolerance: {bad}"
    return errors


def check_ops_dispatch() -> dict:
    """ops.linear_cross_entropy_sum, [B, S, D] in: backend "triton" (the fused Function under the interpreter) against
    "reference" (lm_head's logits + cross_entropy_sum), loss and both gradients."""
    from models.kernels import ops

    h, w, labels = _inputs(24, 16, 100, 1.0, (1, 2, 17))
    out = {}
    for backend in ("triton", "reference"):
        h_in, w_in = h.view(4, 6, 16).clone().requires_grad_(), w.clone().requires_grad_()
        loss = ops.linear_cross_entropy_sum(h_in, w_in, labels.view(4, 6), 0, backend=backend)
        (loss * 0.5).backward()
        out[backend] = (loss.detach(), h_in.grad, w_in.grad)
    errors = {name: _rel(a, b) for name, a, b in zip(("loss", "dh", "dw"), out["triton"], out["reference"])}
    bad = {k: e for k, e in errors.items() if not e <= 1e-5}
    assert not bad, f"over tolerance: {bad}"
    return errors


def child() -> None:
    """The child process: every case under the interpreter (tests/interpreter_child.py)."""
    checks = {name: (lambda args=args: check_case(*args)) for name, args in CASES.items()}
    checks["ops_dispatch"] = check_ops_dispatch
    run_checks(checks)


@pytest.fixture(scope="module")
def results():
    return child_results("tests.test_cross_entropy_triton")


@pytest.mark.parametrize("case", list(CASES))
def test_fused_loss_against_float64_autograd(results, case):
    r = results[case]
    assert r["ok"], r["out"]


def test_ops_dispatch_triton_equals_reference(results):
    r = results["ops_dispatch"]
    assert r["ok"], r["out"]


def test_rejects_mismatched_shapes():
    """Checked on the host before any launch (no interpreter needed)."""
    from models.kernels.cross_entropy_triton import linear_cross_entropy_triton

    h, w = torch.randn(6, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"weight \[V, D\]"):
        linear_cross_entropy_triton(h, torch.randn(10, 9), torch.zeros(6, dtype=torch.long), 0, IGNORE)
    with pytest.raises(ValueError, match="labels must be"):
        linear_cross_entropy_triton(h, w, torch.zeros(5, dtype=torch.long), 0, IGNORE)


class _TiedLM(torch.nn.Module):
    """An embedding tied to its head, a layer between them, and the loss through ops.linear_cross_entropy_sum; with
    backend "triton" the model's TokenEmbedding takes the loss's weight gradient (models/kernels/tied_embedding.py)."""

    def __init__(self, V: int, D: int, backend: str):
        super().__init__()
        from models.mamba2.model import TokenEmbedding

        self.tok_embeddings = TokenEmbedding(V, D)
        self.proj = torch.nn.Linear(D, D, bias=False)
        self.lm_head = torch.nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.tok_embeddings.weight
        self.backend = backend

    def forward(self, ids, labels):
        from models.kernels import ops
        from models.kernels.tied_embedding import GradHandoff

        handoff = GradHandoff() if self.backend == "triton" else None
        h = torch.tanh(self.proj(self.tok_embeddings(ids, grad_handoff=handoff)))
        return ops.linear_cross_entropy_sum(h, self.lm_head.weight, labels, 5, backend=self.backend,
                                            grad_handoff=handoff)  # fmt: skip


def _fsdp_grads(rank: int, world: int, backend: str) -> dict:
    """FSDP2 over `world` gloo ranks (the layer its own unit, the tied embedding / head in the root's): each rank's
    batch, one backward; the full gradients and this rank's loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _TiedLM(90, 12, backend)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.proj, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 90, (2, 7), generator=g)
    labels = torch.randint(0, 90, (2, 7), generator=g)
    labels[0, 3] = IGNORE
    loss = model(ids, labels)
    (loss * 0.25).backward()
    return {"loss": loss.detach(), **{n: p.grad.full_tensor() for n, p in model.named_parameters()}}


def test_fused_loss_under_fsdp2_with_tied_weights(monkeypatch):
    """The fused Function under FSDP2 on 2 gloo ranks (the interpreter's kernel), the head's weight tied to the
    embedding and gathered by the root unit, the embedding's gradient added into the loss's (the handoff): losses and
    every reduced gradient equal the unfused path's."""
    from tests.dist_utils import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import triton fresh, in interpreter mode
    fused = run_distributed(_fsdp_grads, 2, "triton")
    plain = run_distributed(_fsdp_grads, 2, "reference")
    for rank in range(2):
        assert set(fused[rank]) == set(plain[rank]) == {"loss", "tok_embeddings.weight", "proj.weight"}
        for name, want in plain[rank].items():
            assert _rel(fused[rank][name], want) <= 1e-5, (rank, name)
