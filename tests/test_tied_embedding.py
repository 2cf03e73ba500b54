"""The tied embedding's weight gradient added into the fused loss's (models/kernels/tied_embedding.py,
embedding_triton.py) on the CPU, through Triton's interpreter.

- embedding_grad_add_ against a float64 index_add: token runs inside one chunk of sorted positions, runs that cross
  one and several chunk boundaries (one fills whole chunks), a run that begins at a chunk's first row and one that
  ends at its last, a token count and a width that are not multiples of the chunk / the column block, a bfloat16
  target, one token only; bit-for-bit the same on a second call (no atomics).
- Mamba2LM's handoff decision (no kernels run): a GradHandoff only with tied weights, labels, gradients, the embedding
  on this stage, and the fused loss.
- A tied embedding + layer + fused loss with the handoff against the reference path: the loss, the tied weight's
  gradient (one backward, and two microbatches accumulating into .grad), and the head's weight needing no gradient.
- Mamba2LM itself with the fused loss and its layers on the references against the all-reference model: the handoff
  taken, the loss and every parameter's gradient over two microbatches.
(tests/test_cross_entropy_triton.py runs the handoff under FSDP2 on two gloo ranks.)
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _ids_with_runs(N: int, V: int, gen: torch.Generator) -> torch.Tensor:
    """N ids in [0, V), shuffled, where token 0 takes ~45% (runs over several chunks of 32 once sorted)."""
    ids = torch.randint(1, V, (N,), generator=gen)
    ids[torch.rand(N, generator=gen) < 0.45] = 0
    return ids


def _shuffled(ids: list[int], gen: torch.Generator) -> torch.Tensor:
    return torch.tensor(ids)[torch.randperm(len(ids), generator=gen)]


def check_grad_add() -> dict:
    from models.kernels import embedding_triton as et

    assert et._CHUNK == 32
    gen = torch.Generator().manual_seed(0)
    errors = {}
    cases = {
        "short_runs": (torch.randint(0, 40, (90,), generator=gen), 40, 50),
        "long_runs": (_ids_with_runs(300, 9, gen), 9, 130),
        # sorted: token 1 at 0..31 (exactly one chunk), token 2 at 32..95 (begins at a chunk's first row, fills two
        # chunks, ends at a chunk's last row), token 3 at 96 alone, token 4 at 97..136 (across the 128 boundary),
        # token 5 at 137..206 (begins mid-chunk, fills the next, ends in a third: the last, partial chunk).
        "boundaries": (_shuffled([1] * 32 + [2] * 64 + [3] + [4] * 40 + [5] * 70, gen), 6, 20),
        "one_token": (torch.full((70,), 3), 5, 16),
    }
    for name, (ids, V, D) in cases.items():
        grad = torch.randn(ids.numel(), D, generator=gen)
        start = torch.randn(V, D, generator=gen)
        got = et.embedding_grad_add_(start.clone(), ids, grad)
        want = start.double().index_add(0, ids, grad.double())
        errors[name] = _rel(got, want)
        again = et.embedding_grad_add_(start.clone(), ids, grad)
        assert torch.equal(got, again), f"{name}: not deterministic"
    ids = _ids_with_runs(100, 7, gen).view(4, 25)  # [B, S] ids and [B, S, D] gradients, a bf16 target
    grad = torch.randn(4, 25, 24, generator=gen)
    start = torch.randn(7, 24, generator=gen).bfloat16()
    got = et.embedding_grad_add_(start.clone(), ids, grad)
    assert got.dtype == torch.bfloat16
    want = start.double().index_add(0, ids.reshape(-1), grad.reshape(-1, 24).double())
    errors["bf16_target"] = _rel(got, want)
    assert errors["bf16_target"] < 1e-2, errors
    assert all(e < 1e-6 for k, e in errors.items() if k != "bf16_target"), errors
    with pytest.raises(ValueError, match="contiguous rows"):
        et.embedding_grad_add_(torch.zeros(8, 6)[:, ::2], torch.zeros(2, dtype=torch.long), torch.zeros(2, 3))
    return errors


class _TiedLM(torch.nn.Module):
    """Mamba2LM's ends: its TokenEmbedding tied to a head, a layer, ops.linear_cross_entropy_sum, and the handoff
    when `handoff` (the model's rule, checked apart below)."""

    def __init__(self, V: int, D: int, backend: str, handoff: bool):
        super().__init__()
        from models.mamba2.model import TokenEmbedding

        self.tok_embeddings = TokenEmbedding(V, D)
        self.proj = torch.nn.Linear(D, D, bias=False)
        self.lm_head = torch.nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.tok_embeddings.weight
        self.backend, self.handoff = backend, handoff

    def forward(self, ids, labels):
        from models.kernels import ops
        from models.kernels.tied_embedding import GradHandoff

        handoff = GradHandoff() if self.handoff else None
        h = torch.tanh(self.proj(self.tok_embeddings(ids, grad_handoff=handoff)))
        return ops.linear_cross_entropy_sum(h, self.lm_head.weight, labels, 0, backend=self.backend,
                                            grad_handoff=handoff)  # fmt: skip


def check_handoff_model() -> dict:
    """Loss and gradients with the handoff equal the reference path's, over one and two microbatches."""
    errors = {}
    gen = torch.Generator().manual_seed(1)
    batches = [(_ids_with_runs(80, 30, gen).view(2, 40), torch.randint(0, 30, (2, 40), generator=gen)) for _ in "ab"]
    runs = {}
    for name, backend, handoff in (("handoff", "triton", True), ("fused_alone", "triton", False),
                                   ("reference", "reference", False)):  # fmt: skip
        torch.manual_seed(0)
        model = _TiedLM(30, 16, backend, handoff)
        losses, grads = [], []
        for ids, labels in batches:
            loss = model(ids, labels)
            (loss * 0.3).backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        runs[name] = (losses, grads)
    for name in ("handoff", "fused_alone"):
        for i in range(2):
            errors[f"{name} loss {i}"] = _rel(runs[name][0][i], runs["reference"][0][i])
            for p in ("tok_embeddings.weight", "proj.weight"):
                errors[f"{name} {p} {i}"] = _rel(runs[name][1][i][p], runs["reference"][1][i][p])
    assert all(e <= 1e-5 for e in errors.values()), errors
    # The head's weight frozen: the loss gives nothing; the embedding must not either (no gradient at all).
    model = _TiedLM(30, 16, "triton", True)
    model.tok_embeddings.weight.requires_grad_(False)
    model(*batches[0]).backward()
    assert model.tok_embeddings.weight.grad is None and model.proj.weight.grad is not None
    return errors


def check_mamba2lm_wiring() -> dict:
    """Mamba2LM itself with the fused loss (interpreter) and its layers on the references: the embedding takes the
    handoff (counted) and the loss and every gradient equal the all-reference model's, over two microbatches."""
    import models.mamba2.model as model_module
    from models.args import ModelArgs
    from models.init import init_weights
    from models.mamba2.model import Mamba2LM

    calls = []
    original = model_module.embedding_with_handoff

    def counted(*args):
        calls.append(1)
        return original(*args)

    model_module.embedding_with_handoff = counted
    try:
        args = ModelArgs(d_model=16, n_layers=2, vocab_size=40, d_state=8, headdim=8, chunk_size=8)
        fused = Mamba2LM(args)
        init_weights(fused, seed=0)  # (the mixers' parameters start uninitialised)
        plain = Mamba2LM(args)
        plain.load_state_dict(fused.state_dict())
        fused.set_kernel_backend("reference")
        plain.set_kernel_backend("reference")
        fused.loss_backend = "triton"  # the loss (and so the handoff) through the interpreter's kernels
        gen = torch.Generator().manual_seed(2)
        errors = {}
        for step in range(2):
            ids = _ids_with_runs(2 * 24, 48, gen).view(2, 24)
            labels = torch.randint(0, 48, (2, 24), generator=gen)
            losses = [m(ids, labels=labels) for m in (fused, plain)]
            for loss in losses:
                (loss * 0.1).backward()
            errors[f"loss {step}"] = _rel(losses[0].detach(), losses[1].detach())
            grads = dict(plain.named_parameters())
            for name, p in fused.named_parameters():
                errors[f"{name} {step}"] = _rel(p.grad, grads[name].grad)
        assert len(calls) == 2, calls
        assert all(e <= 1e-5 for e in errors.values()), {k: e for k, e in errors.items() if not e <= 1e-5}
        return max(errors.values())
    finally:
        model_module.embedding_with_handoff = original


def child() -> None:
    run_checks({"grad_add": check_grad_add, "handoff_model": check_handoff_model, "mamba2lm": check_mamba2lm_wiring})


@pytest.fixture(scope="module")
def results():
    return child_results("tests.test_tied_embedding")


def test_embedding_grad_add_against_float64(results):
    r = results["grad_add"]
    assert r["ok"], r["out"]


def test_tied_weight_handoff_equals_the_reference_path(results):
    r = results["handoff_model"]
    assert r["ok"], r["out"]


def test_mamba2lm_takes_the_handoff_and_equals_the_reference_model(results):
    r = results["mamba2lm"]
    assert r["ok"], r["out"]


def test_model_makes_a_handoff_only_for_the_tied_fused_loss(monkeypatch):
    """Mamba2LM._tied_grad_handoff (no kernel runs): the fused loss's backend on, tied weights, labels, gradients
    and the embedding on this stage; None whenever one is missing."""
    from models.args import ModelArgs
    from models.kernels.tied_embedding import GradHandoff
    from models.mamba2.model import Mamba2LM

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # backend "triton" on CPU tensors (use_triton_ssd's rule)
    model = Mamba2LM(ModelArgs(d_model=16, n_layers=1, vocab_size=40, d_state=8, headdim=8, chunk_size=8))
    model.loss_backend = "triton"
    ids = labels = torch.zeros(1, 4, dtype=torch.long)
    assert isinstance(model._tied_grad_handoff(ids, labels), GradHandoff)
    assert model._tied_grad_handoff(ids, None) is None
    with torch.no_grad():
        assert model._tied_grad_handoff(ids, labels) is None
    model.loss_backend = "reference"
    assert model._tied_grad_handoff(ids, labels) is None
    model.loss_backend = "triton"
    model.embeds_tokens = False  # a last pipeline stage holding the tied weight only
    assert model._tied_grad_handoff(ids, labels) is None
    untied = Mamba2LM(ModelArgs(d_model=16, n_layers=1, vocab_size=40, d_state=8, headdim=8, chunk_size=8,
                                tie_embeddings=False))  # fmt: skip
    untied.loss_backend = "triton"
    assert untied._tied_grad_handoff(ids, labels) is None
