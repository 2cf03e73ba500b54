"""Our Triton SSD kernels (models/kernels/ssd_triton) on the CPU, through Triton's interpreter.

Forward and every gradient (x, dt, A, B, C, D, dt_bias, z, initial states; final states as an
output with its own cotangent) against the float64 PyTorch reference, with documents (seq_idx,
including a boundary exactly at a chunk start and a one-token document), initial states, lengths
that are not a multiple of the chunk, ngroups 1 and 2, D of shape [H] and [H, P], and chunk sizes
that are not powers of two. The interpreter runs the kernels in float32 numpy, so errors sit near
1e-7; the tolerance (2e-5) leaves room for long reductions and fails on any real indexing error.

Triton reads TRITON_INTERPRET when it is first imported (its own helpers such as tl.zeros are
defined then), so the cases run in separate Python processes with the variable set (workers that take them one
after another, restoring the tile shapes a case overrides: one per core, at most two, so that a test's independent
cases run side by side through interpret_all); nothing leaks into other tests (mamba_ssm's kernels on a GPU machine).
"""

import ast
import atexit
import contextlib
import json
import math
import os
import select
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("triton")

from models.kernels.ssd_reference import ssd_chunk_scan_ref  # noqa: E402

TOL = 2e-5
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _patch_interpreter_scalar_index():
    """Triton 3.6's interpreter turns scalar kernel arguments into 1-element arrays and calls int() on them
    for Python ``range`` bounds; numpy >= 2.4 refuses int() of a 1-d array. Index the single element."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_scalar_index_patched", False):  # once per process (the worker runs many cases)
        return
    interp._scalar_index_patched = True

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def run_case_in_child(**case):
    """Entry point of the child process: kernels under the interpreter, checked against the reference."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _patch_interpreter_scalar_index()
    from models.kernels.ssd_triton import autograd
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    overrides = case.pop("config", {})
    if overrides:  # other tile shapes / backward modes than the defaults
        import dataclasses

        default = autograd.block_config
        autograd.block_config = lambda q, p, n: dataclasses.replace(default(q, p, n), **overrides)
    call = case.pop("call", {})
    if case.pop("poison_empty", False):
        # Every float buffer from torch.empty / empty_like starts as NaN: a kernel that reads what no kernel wrote
        # (CB's unstored tiles, chunk_cb.py) then fails the comparison.
        for name in ("empty", "empty_like"):
            original = getattr(torch, name)

            def poisoned(*args, _original=original, **kwargs):
                t = _original(*args, **kwargs)
                return t.fill_(float("nan")) if t.is_floating_point() else t

            setattr(torch, name, poisoned)
    if case.pop("split_path", False):
        with kernel_halves_from_references() if case.pop("halves", False) else contextlib.nullcontext():
            print(json.dumps(check_split_path(**case, kept_states=overrides.get("keep_states", False))))
        return
    # A case flag names its check (the rest of the case are the check's arguments); without one, the SSD itself.
    checks = {
        "final_only_halves": check_final_state_only_halves,
        "fp16_gate": check_fp16_gate_dD,
        "carried_decay": check_decay_through_initial_states,
        "fp16_decay": check_fp16_decay_gradient,
        "kept_vs_recomputed": check_kept_matches_recomputed,
        "states_scale_same": check_states_scale_same,
    }
    for flag, check in checks.items():
        if case.pop(flag, False):
            print(json.dumps(check(**case)))
            return
    inp = make_inputs(**case)
    errors = check_against_reference(ssd_chunk_scan_triton, inp, **call)
    print(json.dumps(errors))


class _InterpreterWorker:
    """One long-lived Python process with TRITON_INTERPRET=1 that runs the cases one after another (serve()), so
    that each case does not pay the ~4 s of importing torch and triton again. A case that kills the process fails
    alone: the next case starts a fresh worker."""

    def __init__(self):
        self.proc = None
        self.log = None

    def _start(self):
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr (warnings) to a file: a full pipe would block it
        code = "import tests.test_ssd_triton as t; t.serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        )  # fmt: skip
        atexit.register(self.proc.kill)

    def submit(self, case: dict) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(repr(case) + "\n")
        self.proc.stdin.flush()

    def finish(self, case: dict, ready: bool) -> str:
        """The submitted case's output (its result line is ready, else it timed out); fails with its output."""
        line = self.proc.stdout.readline() if ready else ""
        if not line:  # timed out or died: report its stderr, start afresh next time
            self.proc.kill()
            self.log.seek(0)
            raise AssertionError(f"case {case}: the interpreter worker died or timed out:\n{self.log.read()[-6000:]}")
        result = json.loads(line)
        assert result["ok"], f"case {case} failed:\n{result['out'][-6000:]}"
        return result["out"]

    def run(self, case: dict, timeout: float = 600) -> str:
        self.submit(case)
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.finish(case, bool(ready))


# One worker per core, at most two: a test's independent cases (interpret_all) run side by side, and the pytest
# process only waits (CI has two cores: the interpreter cases are most of this file's time).
_WORKERS = [_InterpreterWorker() for _ in range(max(1, min(2, os.cpu_count() or 1)))]


def serve():
    """The worker's loop: one case (a dict's repr) per stdin line -> one JSON line {ok, out} on stdout."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import contextlib
    import io
    import traceback

    from models.kernels.ssd_triton import autograd

    default_config = autograd.block_config
    allocators = {name: getattr(torch, name) for name in ("empty", "empty_like")}  # poison_empty replaces them
    for line in sys.stdin:
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                run_case_in_child(**ast.literal_eval(line))
            ok, out = True, buf.getvalue()
        except BaseException:  # a failed assertion, or any error: reported, and the worker goes on
            ok, out = False, buf.getvalue() + traceback.format_exc()
        finally:
            autograd.block_config = default_config  # cases may override the tile shapes
            for name, allocator in allocators.items():
                setattr(torch, name, allocator)
        sys.stdout.write(json.dumps({"ok": ok, "out": out}) + "\n")
        sys.stdout.flush()


def interpret(**case):
    """Run one case in the interpreter worker; fail with its output if it fails. Returns what the case printed."""
    return _WORKERS[0].run(case)


def interpret_all(*cases: dict, timeout: float = 600) -> list[str]:
    """Independent cases spread over the workers (each case resets what it changes, serve()); fails with the first
    failed case's output once all have finished. Returns what each case printed, in order."""
    outs, failures = [None] * len(cases), []
    queue, busy = list(enumerate(cases)), {}  # busy: worker -> (index, case)
    while queue or busy:
        for worker in _WORKERS:
            if worker not in busy and queue:
                busy[worker] = queue.pop(0)
                worker.submit(busy[worker][1])
        ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], timeout)
        for worker in list(busy):
            if ready and worker.proc.stdout not in ready:
                continue
            i, case = busy.pop(worker)
            try:
                outs[i] = worker.finish(case, bool(ready))
            except AssertionError as e:
                failures.append(e)
    if failures:
        raise failures[0]
    return outs


def make_inputs(b, L, H, P, G, N, seed, D_shape="H", with_z=False, with_init=True, seq_cuts=None, A_scale=1.0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    inp = dict(
        x_BLHP=r(b, L, H, P),
        dt_BLH=r(b, L, H, scale=0.5),
        A_H=-(torch.rand(H, generator=g, dtype=torch.float64) * 2 + 0.3) * A_scale,
        B_BLGN=r(b, L, G, N),
        C_BLGN=r(b, L, G, N),
        D={"H": r(H), "HP": r(H, P), None: None}[D_shape],
        z=r(b, L, H, P) if with_z else None,
        dt_bias=r(H, scale=0.3),
        initial_states=r(b, H, P, N) if with_init else None,
        seq_idx=None,
    )
    if seq_cuts is not None:
        seq = torch.zeros(b, L, dtype=torch.int32)
        for row, cuts in enumerate(seq_cuts[:b]):
            for cut in cuts:
                seq[row, cut:] += 1
        inp["seq_idx"] = seq
    return inp


def check_against_reference(fn, inp, chunk_size, dt_softplus=True, dt_limit=(0.0, float("inf")), tol=TOL):
    """Run fn in float32 and the reference in float64 on the same inputs; compare outputs and all gradients."""
    g = torch.Generator().manual_seed(123)
    results = {}
    for name, f, dtype in (("kernel", fn, torch.float32), ("ref", ssd_chunk_scan_ref, torch.float64)):
        leaves = {
            k: (v.detach().clone().to(dtype).requires_grad_() if v is not None and v.is_floating_point() else v)
            for k, v in inp.items()
        }
        y, final = f(
            **leaves, chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True
        )
        results[name] = (y, final, leaves)
    gy = torch.randn(results["ref"][0].shape, generator=g, dtype=torch.float64)
    gf = torch.randn(results["ref"][1].shape, generator=g, dtype=torch.float64)
    for y, final, _ in results.values():
        ((y.double() * gy).sum() + (final.double() * gf).sum()).backward()

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    (yk, fk, lk), (yr, fr, lr) = results["kernel"], results["ref"]
    assert yk.dtype == torch.float32 and fk.dtype == torch.float32
    errors = {"y": rel(yk, yr), "final_states": rel(fk, fr)}
    for k, v in lr.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            assert lk[k].grad is not None, f"no gradient for {k}"
            errors["d" + k] = rel(lk[k].grad, v.grad)
    bad = {k: e for k, e in errors.items() if not e <= tol}
    assert not bad, f"over {tol}: {bad}; all: {errors}"
    return errors


def check_final_state_only_halves(b, L, H, P, G, N, seed, chunk_size):
    """The mixer's kernel-halves backward when only the final state is used (out's gradient None, as in a chunked
    prefill's carried state): every gradient equals the autograd path's (the same function, float32)."""
    from models.kernels import ops

    g = torch.Generator().manual_seed(seed)
    dim, conv_dim = H * P, H * P + 2 * G * N
    tensors = dict(
        zxbcdt=torch.randn(b, L, 2 * dim + 2 * G * N + H, generator=g),
        conv1d_weight=torch.randn(conv_dim, 4, generator=g) * 0.3,
        conv1d_bias=torch.randn(conv_dim, generator=g) * 0.1,
        dt_bias=torch.randn(H, generator=g) * 0.3 - 1,
        A=-(torch.rand(H, generator=g) + 0.5),
        D=torch.randn(H, generator=g),
        rmsnorm_weight=1 + 0.1 * torch.randn(dim, generator=g),
        outproj_weight=torch.randn(24, dim, generator=g) * dim**-0.5,
        initial_states=torch.randn(b, H, P, N, generator=g) * 0.5,
    )
    cot = torch.randn(b, H, P, N, generator=g)
    grads = {}
    for name, ctx in (("halves", kernel_halves_from_references()), ("autograd", contextlib.nullcontext())):
        leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
        with ctx:
            _, final = ops.mamba_split_conv1d_scan(
                **leaves, chunk_size=chunk_size, headdim=P, ngroups=G, rmsnorm_eps=1e-5, return_final_states=True,
                backend="triton",
            )  # fmt: skip
            (final * cot).sum().backward()
        grads[name] = {k: v.grad for k, v in leaves.items()}
    errors = {}
    for k, ref in grads["autograd"].items():
        got = grads["halves"][k]
        if ref is None or got is None:  # no path from the final state (out_proj) on both sides, or a zero one
            assert (got is None or not got.any()) and (ref is None or not ref.any()), k
            continue
        errors[k] = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    bad = {k: e for k, e in errors.items() if not e <= 1e-5}
    assert not bad, f"over 1e-5: {bad}; all: {errors}"
    return errors


@contextlib.contextmanager
def kernel_halves_from_references():
    """The fused mixer's kernel-halves path (split_conv1d_scan._backward_with_kernel_halves, CUDA only) on the CPU:
    the conv's and the gated norm's GPU halves are replaced by the references (forward) and autograd through them
    (backward), with the halves' contracts (dx / dz written into the given buffers, the normed output recomputed on
    request), so the interpreter checks how the path wires them against the float64 reference."""
    from models.kernels import cuda
    from models.kernels import split_conv1d_scan as scs
    from models.kernels.reference import causal_conv1d_ref, rmsnorm_gated_ref

    def conv_forward(x, w, bias, seq, silu):
        return causal_conv1d_ref(x, w, bias, seq, "silu" if silu else None)

    def conv_backward(x, w, bias, dout, seq, silu, dx):
        x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
        b_ = None if bias is None else bias.detach().requires_grad_()
        with torch.enable_grad():  # called inside a backward
            out = conv_forward(x_, w_, b_, seq, silu)
        grads = torch.autograd.grad(out, [t for t in (x_, w_, b_) if t is not None], dout)
        dx.copy_(grads[0])
        return grads[1], None if bias is None else grads[2]

    def norm_forward(y, w, z, eps, group_size, norm_before_gate):
        rstd = torch.empty(y.shape[0] * y.shape[1] // group_size)  # the kernel's [groups * M]; unused here
        return rmsnorm_gated_ref(y, w, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate), rstd

    def norm_backward(dout, y, w, z, rstd, eps, group_size, norm_before_gate, dz, recompute):
        y_, w_, z_ = (t.detach().requires_grad_() for t in (y, w, z))
        with torch.enable_grad():
            out, _ = norm_forward(y_, w_, z_, eps, group_size, norm_before_gate)
        dy, dw, gz = torch.autograd.grad(out, (y_, w_, z_), dout)
        dz.copy_(gz)
        return dy, dw, out.detach() if recompute else None

    stand_ins = dict(
        conv_forward=conv_forward, conv_backward=conv_backward,
        gated_rmsnorm_forward=norm_forward, gated_rmsnorm_backward=norm_backward,
    )  # fmt: skip
    saved = {k: getattr(cuda, k) for k in stand_ins} | {"on": scs._kernel_halves_on}
    try:
        for k, f in stand_ins.items():
            setattr(cuda, k, f)
        scs._kernel_halves_on = lambda zxbcdt, s: True
        yield
    finally:
        scs._kernel_halves_on = saved.pop("on")
        for k, f in saved.items():
            setattr(cuda, k, f)


def check_split_path(
    b, L, H, P, G, N, seed, chunk_size, d_nonssm=0, norm=True, outproj=True, init_final=False, kept_states=False,
    a_log=False,
):  # fmt: skip
    """ops.mamba_split_conv1d_scan(backend="triton") (conv + our SSD + gated norm + out_proj in one Function that
    recomputes the conv and the norm in its backward; conv and norm run their references on the CPU) against
    mamba_split_conv1d_scan_ref in float64, output (and final states) and all gradients. Also what its backward keeps:
    the bytes saved for backward must be those of zxbcdt and the SSD output plus [B, H, L]-sized extras, not the
    conv output or out_proj's input (each as large as the SSD output); with kept_states (config keep_states) also
    the float32 entering states [B, NC, H, P, N], which must then be there. a_log: ours takes the model's A_log
    (A=None, A_log=log(-A)) and its gradient, compared as dA = dA_log / A (the dt kernels take the exponential)."""
    from models.kernels import ops
    from models.kernels.reference import mamba_split_conv1d_scan_ref

    g = torch.Generator().manual_seed(seed)
    dim, conv_dim = H * P, H * P + 2 * G * N

    def r(*s, scale=1.0):
        return torch.randn(*s, generator=g, dtype=torch.float64) * scale

    tensors = dict(
        zxbcdt=r(b, L, 2 * d_nonssm + 2 * dim + 2 * G * N + H),
        conv1d_weight=r(conv_dim, 4, scale=0.3),
        conv1d_bias=r(conv_dim, scale=0.1),
        dt_bias=r(H, scale=0.3) - 1,
        A=-(torch.rand(H, generator=g) + 0.5).double(),
        D=r(H),
    )
    if norm:
        tensors["rmsnorm_weight"] = 1 + r(dim, scale=0.1)
    if outproj:
        tensors["outproj_weight"] = r(24, d_nonssm + dim, scale=dim**-0.5)
        tensors["outproj_bias"] = r(24, scale=0.1)
    if init_final:
        tensors["initial_states"] = r(b, H, P, N, scale=0.5)
    seq = torch.zeros(b, L, dtype=torch.int32)
    seq[:, L // 3 :] = 1
    cot = r(b, L, 24 if outproj else d_nonssm + dim)
    cot_final = r(b, H, P, N)
    res, saved_bytes = {}, {}
    for name, fn, dtype, kw in (
        ("ours", ops.mamba_split_conv1d_scan, torch.float32, dict(backend="triton")),
        ("ref", mamba_split_conv1d_scan_ref, torch.float64, {}),
    ):
        leaves = {k: v.detach().clone().to(dtype).requires_grad_() for k, v in tensors.items()}
        if a_log and name == "ours":
            leaves["A_log"] = torch.log(-leaves.pop("A").detach()).requires_grad_()
            kw = dict(kw, A=None)
        sizes = []

        def pack(t):
            sizes.append((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(
                **leaves,
                chunk_size=chunk_size,
                seq_idx=seq,
                headdim=P,
                ngroups=G,
                rmsnorm_eps=1e-5,
                return_final_states=init_final,
                **kw,
            )
        saved_bytes[name] = sum(dict(sizes).values()) // dtype.itemsize  # distinct storages, in elements
        out, final = out if init_final else (out, None)
        loss = (out.double() * cot).sum() + (0 if final is None else (final.double() * cot_final).sum())
        loss.backward()
        res[name] = {"out": out.double(), **{"d" + k: v.grad.double() for k, v in leaves.items()}}
        if "A_log" in leaves:  # d/dA_log = d/dA * A, with A = -exp(A_log) in float64 here
            res[name]["dA"] = res[name].pop("dA_log") / -torch.exp(leaves["A_log"].detach().double())
        if final is not None:
            res[name]["final"] = final.double()
    errors = {k: ((res["ours"][k] - v).norm() / v.norm()).item() for k, v in res["ref"].items()}
    bad = {k: e for k, e in errors.items() if not e <= TOL}
    assert not bad, f"over {TOL}: {bad}; all: {errors}"
    params = sum(v.numel() for k, v in tensors.items() if k != "zxbcdt")
    # + the norm's 1 / rms per row and group when the kernel halves run (G * b * L float32)
    allowed = tensors["zxbcdt"].numel() + b * L * dim * (1 if norm else 2) + params + 4 * b * H * L + b * L + G * b * L
    states = b * -(-L // chunk_size) * H * P * N if kept_states else 0
    assert saved_bytes["ours"] <= allowed + states, (saved_bytes, allowed, states)
    assert saved_bytes["ours"] > allowed or not kept_states, (saved_bytes, allowed, "the states are not kept")
    errors["saved_elements"] = saved_bytes["ours"]
    return errors


def check_fp16_gate_dD(b, L, H, P, G, N, seed, chunk_size):
    """float16 inputs with z and D of [H, P]: dD must be the float32 sum of the gated dy times x, not of dy rounded
    to float16 first (the kernels' operand dtype). Against the float64 reference given the same (float16-rounded)
    output cotangent, so the only error left is float32 arithmetic (< 1e-5); rounding dy first gave 2.1e-4 here."""
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    inp = make_inputs(b, L, H, P, G, N, seed, D_shape="HP", with_z=True, with_init=False)
    gy = torch.randn(b, L, H, P, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gy16 = gy.to(torch.float16)
    grads = {}
    for name, fn, dtype in (("ours", ssd_chunk_scan_triton, torch.float16), ("ref", ssd_chunk_scan_ref, torch.float64)):
        leaves = {}
        for k, v in inp.items():
            if v is not None and v.is_floating_point():
                # D stays float32 (a float32 parameter in the model; a float16 leaf would round its own gradient).
                v = v.detach().to(torch.float16).to(torch.float32 if k == "D" and name == "ours" else dtype)
                v.requires_grad_()
            leaves[k] = v
        y = fn(**leaves, chunk_size=chunk_size, dt_softplus=True)
        y.backward(gy16.to(y.dtype))
        grads[name] = leaves["D"].grad.double()
    err = ((grads["ours"] - grads["ref"]).norm() / grads["ref"].norm()).item()
    assert err < 1e-5, f"dD relative error {err:.2e} (float32 sums of the float32 gated dy give ~1e-7)"
    return {"dD": err}


def fp16_model_inputs(b, L, H, P, N, seq: bool, seed: int, dtype=torch.float16, init: bool = False):
    """Inputs as the model draws them (dt around softplus^-1 of [1e-3, 0.1], A in [-16, -1]), rounded to ``dtype``,
    with documents (seq) and a float64 output cotangent gy. Also benchmarks/ssd_numerics_cpu.py's inputs."""
    gen = torch.Generator().manual_seed(seed)
    dt0 = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    inp = dict(
        x=torch.randn(b, L, H, P, generator=gen),
        dt=torch.randn(b, L, H, generator=gen) * 0.5,
        A=-torch.empty(H).uniform_(1, 16, generator=gen),
        B=torch.randn(b, L, 1, N, generator=gen),
        C=torch.randn(b, L, 1, N, generator=gen),
        D=torch.randn(H, generator=gen),
        dt_bias=dt0 + torch.log(-torch.expm1(-dt0)),
    )
    inp = {k: v.to(dtype) for k, v in inp.items()}
    if init:  # initial states (float32 in the model: CP's carried states), drawn after everything else
        inp["initial_states"] = torch.randn(b, H, P, N, generator=gen)
    seq_idx = None
    if seq:
        seq_idx = torch.zeros(b, L, dtype=torch.int32)
        for row, cuts in enumerate([[17, 64, 65, 150], [40, 90]]):
            for cut in cuts:
                if cut < L:
                    seq_idx[row, cut:] += 1
    gy = torch.randn(b, L, H, P, generator=gen, dtype=torch.float64)
    return inp, seq_idx, gy


def gradients(fn, inp, seq_idx, gy, chunk: int, dtype, device="cpu", gf=None):
    """Gradients of sum(y * gy) (+ sum(final_states * gf) when gf is given); x, dt, B, C in ``dtype``, the
    parameters in float32 (float64 for the reference)."""
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {
        k: v.detach().clone().to(device, dtype if k in ("x", "dt", "B", "C") else param_dtype).requires_grad_()
        for k, v in inp.items()
    }  # fresh leaves per run: .to() of a tensor already in dtype would hand back the shared input itself
    seq_idx, gy = (None if seq_idx is None else seq_idx.to(device)), gy.to(device)
    y = fn(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
        D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True, seq_idx=seq_idx,
        initial_states=leaves.get("initial_states"), return_final_states=gf is not None,
    )  # fmt: skip
    y, final = y if gf is not None else (y, None)
    loss = (y.double() * gy).sum()
    if gf is not None:
        loss = loss + (final.double() * gf.to(device)).sum()
    loss.backward()
    missing = [k for k, v in leaves.items() if v.grad is None]
    assert not missing, f"no gradient for {missing}"
    return {k: v.grad.double().cpu() for k, v in leaves.items()}


def check_fp16_decay_gradient(L, chunk_size, bound):
    """float16, whole chunks, documents, dt / A as the model draws them: dA's error against float64 on the same
    (float16-rounded) inputs. The chunk states must scale B, not x, before rounding the operand to float16: rounding
    the scaled x left an error in the states that dA picks up coherently (9.7e-4 here; 7.3e-4 with B scaled, as
    mamba_ssm does, whose kernels give 7.2e-4 on these inputs in the same interpreter)."""
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    inp, seq_idx, gy = fp16_model_inputs(2, L, 4, 16, 32, seq=True, seed=0)
    ours = gradients(ssd_chunk_scan_triton, inp, seq_idx, gy, chunk_size, torch.float16)["A"]
    ref = gradients(ssd_chunk_scan_ref, inp, seq_idx, gy, chunk_size, torch.float64)["A"]
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < bound, f"dA relative error {err:.2e} >= {bound:.1e} (float16, whole chunks)"
    return {"dA": err}


def check_kept_matches_recomputed(L, chunk_size):
    """float16 with documents, initial and final states: keep_states (the states kept as high + low parts, the
    chains handing them on) against the default path's recompute, every gradient. They differ only by the chains'
    ~16-bit hand-offs (~1e-7 here); the backward handed the wrong chunk's kept states gives ~1 (by mutation)."""
    import functools

    from models.kernels.ssd_triton import autograd

    inp, seq_idx, gy = fp16_model_inputs(2, L, 4, 16, 32, seq=True, seed=3, init=True)
    gf = torch.randn(2, 4, 16, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = {}
    for keep in (False, True):
        fn = functools.partial(autograd.ssd_chunk_scan_triton, keep_states=keep)
        grads[keep] = gradients(fn, inp, seq_idx, gy, chunk_size, torch.float16, gf=gf)
    diffs = {k: ((grads[True][k] - v).norm() / v.norm()).item() for k, v in grads[False].items()}
    assert all(d < 1e-5 for d in diffs.values()), diffs
    return diffs


def check_states_scale_same(b, L, H, P, G, N, seed, chunk_size, seq_cuts=None, with_init=True, dt_softplus=True):
    """config states_scale (the dt kernel writes the chunk states' whole scale, documents masked; the forward's
    chained or staged states read it) against the same config without it (the states' kernels take a2dt): y, the
    final states and every gradient bit for bit equal (one formula, the same float32 values), and the scale read by
    the states' kernel (a spy on states_scale_input), so that equal results do not come from an unused option."""
    from models.kernels.ssd_triton import autograd, chained_states, forward

    inp = make_inputs(b, L, H, P, G, N, seed, seq_cuts=seq_cuts, with_init=with_init)
    g = torch.Generator().manual_seed(7)
    read = []
    spied = forward.states_scale_input

    def spy(dt_p, a2dt, scale):
        read.append(scale is not None)
        return spied(dt_p, a2dt, scale)

    forward.states_scale_input = chained_states.states_scale_input = spy
    configured = autograd.block_config
    try:
        results = _states_scale_runs(inp, chunk_size, dt_softplus, configured, g)
    finally:
        forward.states_scale_input = chained_states.states_scale_input = spied
        autograd.block_config = configured
    assert read and read[0] is False and any(read), f"the states' kernels never read the scale: {read}"
    differ = [k for k, v in results[False].items() if not torch.equal(v, results[True][k])]
    assert not differ, f"states_scale changed {differ}"
    return {"reads": read}


def _states_scale_runs(inp, chunk_size, dt_softplus, configured, g):
    """check_states_scale_same's two runs (states_scale off, on): y, final states and every gradient of each."""
    import dataclasses

    from models.kernels.ssd_triton import autograd

    results, gy, gf = {}, None, None
    for flag in (False, True):
        autograd.block_config = lambda q, p, n, f=flag: dataclasses.replace(configured(q, p, n), states_scale=f)
        leaves = {k: (v.detach().clone().float().requires_grad_() if v is not None and v.is_floating_point() else v)
                  for k, v in inp.items()}  # fmt: skip
        y, final = autograd.ssd_chunk_scan_triton(
            **leaves, chunk_size=chunk_size, dt_softplus=dt_softplus, return_final_states=True
        )
        if gy is None:
            gy, gf = torch.randn(y.shape, generator=g), torch.randn(final.shape, generator=g)
        ((y * gy).sum() + (final * gf).sum()).backward()
        results[flag] = {"y": y, "final": final, **{"d" + k: v.grad for k, v in leaves.items() if v is not None
                                                    and v.is_floating_point()}}  # fmt: skip
    return results


def check_decay_through_initial_states(bound):
    """float16, the state carried across chunks dominating dA: large initial states, small x, slow decay, and only
    a final-state cotangent. dA is then the chunk-end terms exp(a_last) * sum(dS * S_in), sums over P * N products
    of both signs that keep their terms' relative error: S_in must be float32 there (the backward's recompute), not
    rounded to the operand dtype (float16 rounding gave ~1e-4 here; bf16 on the GPU gave 30x mamba_ssm's dA error)."""
    from models.kernels.ssd_triton.autograd import ssd_chunk_scan_triton

    inp, _, gy = fp16_model_inputs(2, 64, 2, 16, 16, seq=False, seed=1, init=True)
    inp["x"] = (inp["x"].float() * 0.01).half()
    inp["A"] = -torch.ones(2)
    inp["dt_bias"] = torch.full((2,), math.log(math.expm1(1e-3)))
    gf = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    zero = torch.zeros_like(gy)
    ours = gradients(ssd_chunk_scan_triton, inp, None, zero, 16, torch.float16, gf=gf)["A"]
    ref = gradients(ssd_chunk_scan_ref, inp, None, zero, 16, torch.float64, gf=gf)["A"]
    err = ((ours - ref).norm() / ref.norm()).item()
    assert err < bound, f"dA relative error {err:.2e} >= {bound:.1e} (decay through the carried states)"
    return {"dA": err}


# Row 0: a boundary exactly at a chunk start (16), a one-token document (at 30), a short one; row 1: one cut.
CUTS = [[5, 16, 30, 31], [21]]


def test_documents_initial_states_two_groups_remainder():
    """seq_idx + initial states + final states, ngroups 2, D [H], L = 2 chunks + a remainder."""
    interpret(b=2, L=40, H=4, P=16, G=2, N=16, seed=0, seq_cuts=CUTS, call=dict(chunk_size=16))


def test_odd_heads_per_group_one_head_per_dx_program():
    """3 heads per group (H 6, ngroups 2): dx, the chunk scan and the chunk states (asked for pairs here) cannot pair
    heads within a group and run one head per program; every other case here has an even count and pairs them in
    the chunk scan (config scan_heads 2; dx pairs them in test_dx_term_order_heads_and_chunk_major_grids). Pairing
    across groups here fails this test (checked by forcing it)."""
    interpret(
        b=1,
        L=40,
        H=6,
        P=16,
        G=2,
        N=16,
        seed=6,
        seq_cuts=[[9, 30]],
        call=dict(chunk_size=16),
        config=dict(state_heads=2, chained_heads=2, dx_heads=2),
    )


def test_chunk_states_one_and_two_heads_per_program():
    """The chunk states and dS_in, chained (the default, chained_states.py) and staged (chunk_state.py, then
    state_passing.py), with one head per program (config state_heads / chained_heads 1; also the fallback for odd
    heads per group) and two: documents, initial and final states, two groups, several position blocks per chunk, a
    remainder; and whole tiles without documents (the kernels' EVEN path)."""
    cases = []
    for chained in (True, False):
        for heads in (1, 2):
            cfg = dict(state_heads=heads, chained_heads=heads, chained=chained)
            cases += [
                dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=7, seq_cuts=CUTS, call=dict(chunk_size=16),
                     config=dict(cfg, state_k=8)),
                dict(b=1, L=64, H=4, P=16, G=1, N=16, seed=8, call=dict(chunk_size=32), config=cfg),
            ]  # fmt: skip
    interpret_all(*cases)


def test_entering_states_kept_for_the_backward():
    """config keep_states: the forward's entering states go to the backward, which recomputes only CB (float32 x
    here: one slab, S_in itself; the test below takes the two parts of 16-bit x), chained and staged, with documents
    across chunk ends, initial and final states, two groups, a remainder; the default recomputes them (every other
    test). Also through
    the mixer's two backward paths (autograd inside, and the kernel halves), which carry them in their own saved
    tensors. Handing the backward the states one chunk off fails it (checked by mutation)."""
    kept = dict(keep_states=True)
    interpret_all(
        *(dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=7, seq_cuts=CUTS, call=dict(chunk_size=16),
               config=dict(keep_states=True, chained=chained)) for chained in (True, False)),
        dict(b=2, L=40, H=4, P=16, G=1, N=16, seed=4, chunk_size=16, split_path=True, config=kept),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=7, chunk_size=16, split_path=True, halves=True, init_final=True,
             config=kept),
    )  # fmt: skip


def test_chained_states_several_tiles_per_head():
    """The chained kernels with four [P, N] tiles per head (P 32, N 32 in 16 x 16 tiles): one chain per tile, and
    dtot summed from one partial per tile; documents that cross chunk ends (so the hand-offs carry state), initial
    and final states, five chunks. bc_finish runs in two blocks of N here (bcf_n 16)."""
    interpret(
        b=2, L=80, H=2, P=32, G=1, N=32, seed=11, seq_cuts=[[20, 50], [70]], call=dict(chunk_size=16),
        config=dict(state_p=16, chained_fwd_n=16, chained_bwd_n=16, chained_heads=2, bcf_n=16),
    )  # fmt: skip


# 16-wide tiles over chunk positions: several blocks per chunk, so every kernel's loops over blocks below the
# diagonal run (with the default tiles a chunk of 32 or less is one block, and only the diagonal one would).
SMALL_TILES = dict(cb_m=16, cb_s=16, state_k=16, scan_m=16, scan_k=16, dx_k=16, dx_m=16, dc_m=16, db_k=16)


def test_one_group_D_per_channel_z_odd_chunk():
    """No documents, ngroups 1, D [H, P], z gating, dt limits, chunk 24 (not a power of two; two position blocks,
    the second partial), remainder 2."""
    interpret(
        b=2,
        L=50,
        H=4,
        P=16,
        G=1,
        N=16,
        seed=1,
        D_shape="HP",
        with_z=True,
        with_init=False,
        call=dict(chunk_size=24, dt_limit=(0.01, 1.5)),
        config=SMALL_TILES,
    )


def test_whole_tiles_documents_initial_states():
    """L a multiple of the chunk and P filling its block: the kernels' EVEN (mask-free) loads, with documents and
    two position blocks per chunk; two heads per dC / dB program, so their partial sums over head blocks are
    reduced (the default sums all 4 at once)."""
    interpret(
        b=2,
        L=64,
        H=4,
        P=16,
        G=1,
        N=16,
        seed=5,
        seq_cuts=CUTS,
        call=dict(chunk_size=32),
        config=dict(SMALL_TILES, heads_per_prog=2),
    )


def test_dx_term_order_heads_and_chunk_major_grids():
    """dx's non-default forms: its chunk-state term after the intra-chunk loop (config dx_state_first False: the
    state term in accumulators of its own, q from them) and two heads per program (dx_heads 2: the group's CBᵀ and B
    tiles shared), each way round (the default, state term first, takes q from that term alone: a wrong q fails,
    checked by mutation); and the chunk scan / dx / dCB / dB grids with the chunk index first (inner_first False;
    the default decodes one axis, launch.program_ids); dx's row sums (q, ddt) as 1-D tensors (dx_row_sums_2d False,
    the form before session 25), with each term order. All with documents, initial states and four position blocks
    per chunk."""
    configs = (
        dict(dx_state_first=False),
        dict(dx_heads=2),
        dict(dx_heads=2, dx_state_first=False),
        dict(inner_first=False),
        dict(dx_row_sums_2d=False),
        dict(dx_row_sums_2d=False, dx_state_first=False, dx_heads=2),
    )
    interpret_all(*(
        dict(b=2, L=100, H=4, P=16, G=1, N=16, seed=12, seq_cuts=[[30, 70], [50]], call=dict(chunk_size=64),
             config=dict(SMALL_TILES, **config))
        for config in configs
    ))  # fmt: skip


def test_steep_decay():
    """Decay so steep (dt |A| ~ 30 per step) that exp(a_l - a_s) spans more than float32's range inside one tile: the
    clamped per-element exponents stay finite and every output matches the reference; documents, initial states,
    four position blocks per chunk, a remainder. dA's error is 4.4e-4 here (tol 1e-3): the float32 cumsum a_l ~ -1e3
    keeps ~1e-4 of a_l - a_s. (A split of the decay into row and column factors, bounded by 1 on either side of a
    tile's edge, passed this too but ran slower on the GPU: docs/performance.md, session 13.)"""
    interpret(
        b=1, L=100, H=2, P=16, G=1, N=16, seed=13, seq_cuts=[[45]], A_scale=30.0,
        call=dict(chunk_size=64, tol=1e-3), config=SMALL_TILES,
    )  # fmt: skip


def test_dt_folded_into_the_decay_exponent():
    """config fold_dt (the default since session 42; the other tests run it too): the chunk scan and dCB take
    exp(a_l - a_s) dt_s as 2^(a_l log2(e) - a2dt_s), with a2dt from the dt kernel (dt.py). Every output and gradient
    against the reference: with documents, initial states and a remainder (the masked loads' +inf padding) at four
    position blocks per chunk; whole tiles
    (dCB's unclamped tiles below the diagonal); decay steep enough to overflow an unclamped exponent; dt = 0 at valid
    positions (no softplus, dt's lower limit 0: a2dt = +inf, never log2(0)); kept states; and the fused mixer (its
    backward passes a2dt on). A kernel that still multiplies by dt, or an a2dt without log2(dt), fails (checked by
    mutation). With config fold_dt_states (the default since session 43) the chunk states' scale (chained and staged
    states, forward and the backward's recompute) and dB's take it too. The unfolded path (fold_dt false, still
    selectable; fold_dt_states then has nothing to read) with documents and in the fused mixer."""
    fold = dict(SMALL_TILES, fold_dt=True, fold_dt_states=True)
    docs = dict(b=2, L=100, H=4, P=16, G=1, N=16, seed=21, seq_cuts=[[30, 70], [50]])
    steep = dict(b=1, L=100, H=2, P=16, G=1, N=16, seed=13, seq_cuts=[[45]], A_scale=30.0)
    interpret_all(
        dict(**docs, call=dict(chunk_size=64), config=fold),
        dict(b=1, L=128, H=2, P=16, G=1, N=16, seed=22, with_init=False, call=dict(chunk_size=64), config=fold),
        dict(**steep, call=dict(chunk_size=64, tol=1e-3), config=fold),
        dict(**docs, call=dict(chunk_size=64, dt_softplus=False), config=fold),
        dict(**docs, call=dict(chunk_size=64), config=dict(fold, keep_states=True)),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=23, chunk_size=16, init_final=True, split_path=True,
             config=dict(fold_dt=True, fold_dt_states=True)),
        dict(**docs, call=dict(chunk_size=64), config=dict(fold, chained=False)),
        dict(**docs, call=dict(chunk_size=64), config=dict(fold, fold_dt=False)),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=23, chunk_size=16, init_final=True, split_path=True,
             config=dict(fold_dt=False)),
    )  # fmt: skip


def test_states_scale_from_the_dt_kernel():
    """config states_scale (on top of fold_dt_states): the dt kernel writes the chunk states' per-position scale
    with the documents' mask, and the forward's chained or staged states read it. Bit for bit the path without it,
    the scale read (check_states_scale_same): documents (several per chunk, one across a chunk edge), a remainder
    past the last chunk (the scale 0 there), initial states, chained and staged states, kept states, four position
    blocks per chunk, dt = 0 at valid positions (no softplus: a2dt = +inf, scale 0), no documents; and every output
    against the float64 reference with it on. A scale that keeps positions of an earlier document, or drops the
    chunk's last cumsum, fails (checked by mutation)."""
    on = dict(SMALL_TILES, fold_dt=True, fold_dt_states=True, states_scale=True)
    docs = dict(b=2, L=100, H=4, P=16, G=1, N=16, seed=31, seq_cuts=[[30, 64, 70], [50]])
    same = dict(states_scale_same=True, chunk_size=64)
    interpret_all(
        dict(**docs, **same, config=dict(on, states_scale=False)),
        dict(**docs, **same, config=dict(on, states_scale=False, chained=False)),
        dict(**docs, **same, config=dict(on, states_scale=False, keep_states=True)),
        dict(**docs, **same, dt_softplus=False, config=dict(on, states_scale=False)),
        dict(b=1, L=128, H=2, P=16, G=2, N=16, seed=32, with_init=False, **same, config=dict(on, states_scale=False)),
        dict(**docs, call=dict(chunk_size=64), config=on),
        dict(**docs, call=dict(chunk_size=64), config=dict(on, chained=False, keep_states=True)),
    )  # fmt: skip


def test_dcb_tiles_and_column_sums_in_parts():
    """dCB's grid of one program per tile of [l, s] (and one per head block for the state term), with four blocks
    per chunk, so that tiles off the diagonal have several columns to choose from (a wrong column block fails:
    checked by mutation), documents and whole tiles, at 1 and at 2 heads per program. Per-head column sums below the
    diagonal as one sum reduced across the warps (dcb_col_parts 1) and as 2 or 4 partial sums over row groups (the
    default is 4: a part written to another block's extra slot, or dt_bwd adding an extra slot at the positions of
    its own block or later, fails: checked by mutation); on the diagonal too (dcb_diag_col_parts: r alone, the parts
    in slots of their own), also at one block per chunk (chunk 16: no tiles below the diagonal, only the diagonal's
    slots)."""
    base = dict(b=1, L=128, H=2, P=16, G=1, N=16, seed=9, seq_cuts=[[40, 100]])
    cases = [
        dict(**base, call=dict(chunk_size=chunk),
             config=dict(SMALL_TILES, dcb_col_parts=parts, dcb_diag_col_parts=diag, heads_per_prog=heads))
        for parts, diag, chunk, heads in ((1, False, 64, 64), (2, False, 64, 1), (4, True, 64, 64), (4, True, 16, 1))
    ]  # fmt: skip
    # The heads loop pipelined as Triton decides (dcb_heads_stages None; the default is 3): the same code to the
    # interpreter, which ignores num_stages; on the GPU the compiled loop differs (kernel_resources.py --loops).
    interpret_all(*cases, dict(**base, call=dict(chunk_size=64), config=dict(SMALL_TILES, dcb_heads_stages=None)))


def test_dcb_col_parts_refused_unless_a_power_of_two_dividing_the_rows():
    """BlockConfig.dcb_col_parts splits dc_m rows into equal groups: 3, 0 or more parts than rows are refused where
    the config is made, naming the field and what to set; 1 and 4 are taken."""
    import dataclasses

    from models.kernels.ssd_triton.config import block_config

    cfg = block_config(256, 64, 128)
    for bad in (3, 0, 2 * cfg.dc_m):
        with pytest.raises(ValueError, match="dcb_col_parts .* must be a power of two dividing dc_m"):
            dataclasses.replace(cfg, dcb_col_parts=bad)
    assert dataclasses.replace(cfg, dcb_col_parts=1).dcb_col_parts == 1 and cfg.dcb_col_parts == 4


def test_no_kernel_reads_unwritten_memory():
    """Every float buffer allocated empty starts as NaN (poison_empty): CB's tiles past its consumers' diagonal
    blocks are not stored (chunk_cb.py), so a consumer reading one, or any kernel reading what no kernel wrote,
    fails. Default tiles, small tiles (four row blocks per chunk), kept states, and the staged states at 2 heads per
    dCB program (a CB read block one step too small fails it: checked by mutation)."""
    configs = (
        {},
        SMALL_TILES,
        dict(SMALL_TILES, keep_states=True),
        dict(SMALL_TILES, scan_m=32, dx_k=32, dc_m=32),
        dict(heads_per_prog=2, chained=False),
        dict(keep_states=True),
    )
    interpret_all(*(
        dict(b=1, L=128, H=4, P=16, G=1, N=16, seed=3, seq_cuts=[[40, 100]], call=dict(chunk_size=64),
             config=config, poison_empty=True)
        for config in configs
    ))  # fmt: skip


def test_staged_states_two_heads_per_program():
    """The staged forward / state recurrence (config chained False; the default chains them: chained_states.py)
    with 2 heads per dCB / dB program (2 head blocks whose partial sums bc_finish adds)."""
    interpret(
        b=2,
        L=40,
        H=4,
        P=16,
        G=1,
        N=16,
        seed=5,
        seq_cuts=CUTS,
        call=dict(chunk_size=16),
        config=dict(heads_per_prog=2, chained=False),
    )


def test_headdim_and_state_size_not_powers_of_two():
    """P = 24 and N = 20, padded to blocks of 32 in the backward (config.py), with 16-wide P tiles in the forward's
    states and chunk scan (a full block of 16 and a partial one of 8): the chained and the staged states, with
    documents, initial states, 2 groups and a remainder chunk. (This case once ran the removed fused_scan, and caught
    Triton 3.9's removal of the block pointers it used.)"""
    case = dict(b=2, L=40, H=4, P=24, G=2, N=20, seed=6, seq_cuts=CUTS, call=dict(chunk_size=16))
    interpret_all(dict(case, config=dict(state_p=16, scan_p=16)), dict(case, config=dict(chained=False, state_p=16)))


def test_fused_path_contract_under_triton_backend():
    """ops.mamba_split_conv1d_scan(backend='triton'): the model's fused-path call, with our SSD; also given A_log (the
    model's parameter, A = -exp(A_log) inside the dt kernels) through the autograd and the kernel-halves backward:
    A_log's gradient must be dA times A (dA alone, or A not negated, fails: checked by mutation)."""
    interpret_all(
        dict(b=2, L=40, H=4, P=16, G=1, N=16, seed=4, chunk_size=16, split_path=True),
        dict(b=2, L=40, H=4, P=16, G=1, N=16, seed=9, chunk_size=16, split_path=True, a_log=True),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=10, chunk_size=16, split_path=True, halves=True, a_log=True),
    )


def test_fused_path_kernel_halves_wiring():
    """The GPU path that calls the conv's and the norm's forward / backward halves directly (no autograd inside the
    mixer's backward; dz and dxBC written into dzxbcdt in place), with reference stand-ins for the halves (but the
    conv's forward with documents, which is our Triton kernel there): documents, initial / final states, two groups,
    against the float64 reference."""
    interpret_all(
        dict(b=2, L=40, H=4, P=16, G=1, N=16, seed=6, chunk_size=16, split_path=True, halves=True),
        dict(b=2, L=40, H=4, P=16, G=2, N=16, seed=7, chunk_size=16, split_path=True, halves=True, init_final=True),
    )


def test_fused_path_kernel_halves_final_state_only():
    """The kernel-halves backward with no gradient for the output, only for the final state."""
    interpret(final_only_halves=True, b=2, L=40, H=4, P=16, G=1, N=16, seed=8, chunk_size=16)


def test_fused_path_contract_states_nonssm_no_norm():
    """The same with initial / final states (the CP path), a non-SSM part (d_nonssm), the plain z gate instead of
    the norm, no out_proj, two groups, and the staged states."""
    interpret(
        b=2, L=40, H=4, P=16, G=2, N=16, seed=5, chunk_size=16, split_path=True,
        d_nonssm=8, norm=False, outproj=False, init_final=True, config=dict(chained=False),
    )  # fmt: skip


def test_fp16_z_gate_dD_from_float32_dy():
    """With z, dD comes from the float32 gated dy (the bf16 GPU case noseq_Dhdim_z's suspect; docs/performance.md)."""
    interpret(b=2, L=40, H=4, P=16, G=1, N=16, seed=3, chunk_size=16, fp16_gate=True)


def test_fp16_decay_gradient_whole_chunks():
    interpret(L=256, chunk_size=64, bound=8.5e-4, fp16_decay=True)


def test_decay_gradient_through_carried_states():
    """(check_decay_through_initial_states.) With float16 dy the backward's chain hands dH on as high + low parts
    (chained_states._dh_chain_step): handing on the high part alone fails this (dA 9.6e-5; checked by mutation)."""
    interpret(bound=1e-5, carried_decay=True)


def test_kept_states_carry_the_decay_gradient_in_two_parts():
    """config keep_states with float16 x: the forward keeps S_in as a high part (S_in rounded, what the chunk scan and
    dC read) and the low part it left out; the chunk-end terms of dA need both (the case above), chained and staged.
    Keeping only the high part fails this (dA error ~1e-4; checked by mutation); and the kept path against the
    recomputing one, every gradient (check_kept_matches_recomputed)."""
    cases = []
    for chained in (True, False):
        cases += [
            dict(bound=1e-5, carried_decay=True, config=dict(keep_states=True, chained=chained)),
            dict(L=256, chunk_size=64, bound=8.5e-4, fp16_decay=True, config=dict(keep_states=True, chained=chained)),
            dict(L=200, chunk_size=32, kept_vs_recomputed=True, config=dict(SMALL_TILES, chained=chained)),
        ]
    # Two heads per chained program: both heads' high / low parts, forward and backward.
    interpret_all(*cases, dict(bound=1e-5, carried_decay=True, config=dict(keep_states=True, chained_heads=2)))


def test_bad_input_raises_before_compute():
    # Checked before any kernel runs, so no interpreter is needed.
    from models.kernels.ssd_triton import ssd_chunk_scan_triton

    inp = make_inputs(b=1, L=8, H=4, P=16, G=3, N=16, seed=2, with_init=False)
    with pytest.raises(ValueError, match="ngroups=3 must divide nheads=4"):
        ssd_chunk_scan_triton(**inp, chunk_size=16)
    inp = make_inputs(b=1, L=8, H=4, P=16, G=1, N=16, seed=2, with_init=False, seq_cuts=[[3]])
    inp["seq_idx"][0, 5:] = 0  # a document id that goes back down
    with pytest.raises(ValueError, match="non-decreasing"):
        ssd_chunk_scan_triton(**inp, chunk_size=16)
    # A negative dt (no softplus, a lower limit below 0): every decay is clamped at 1 in the kernels, as in
    # mamba_ssm's, so they would differ from the reference (they did, by 60% of y, before this check).
    with pytest.raises(ValueError, match=r"dt_limit's lower bound -0.2 lets dt be negative"):
        ssd_chunk_scan_triton(**inp, chunk_size=16, dt_softplus=False, dt_limit=(-0.2, 0.4))
    # The mixer (backend "triton") names a bad seq_idx or initial state before its conv runs.
    from models.kernels.split_conv1d_scan import mamba_split_conv1d_scan_triton

    H, P, N = 4, 16, 16
    args = dict(
        zxbcdt=torch.randn(2, 8, 2 * H * P + 2 * N + H),
        conv1d_weight=torch.randn(H * P + 2 * N, 4),
        conv1d_bias=None,
        dt_bias=torch.zeros(H),
        A=-torch.ones(H),
        D=torch.ones(H),
        chunk_size=4,
        headdim=P,
    )
    with pytest.raises(ValueError, match=r"seq_idx must be an integer \[batch, seqlen\] = \(2, 8\)"):
        mamba_split_conv1d_scan_triton(**args, seq_idx=torch.zeros(2, 7, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"initial_states must be \[batch, nheads, headdim, dstate\]"):
        mamba_split_conv1d_scan_triton(**args, initial_states=torch.zeros(2, H, P, N + 1))


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [16, 32, 20])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("variant", ["seq_init", "seq_noinit_noD", "noseq_init_z", "exact_multiple_no_softplus"])
@pytest.mark.parametrize("states", ["chained", "staged"])
def test_sweep(chunk_size, G, variant, states):
    L = 64 if variant == "exact_multiple_no_softplus" else 45
    interpret(
        b=2,
        L=L,
        H=4,
        P=16,
        G=G,
        N=32,
        seed=chunk_size * 10 + G,
        D_shape=None if variant == "seq_noinit_noD" else "H",
        with_z=variant == "noseq_init_z",
        with_init=variant in ("seq_init", "noseq_init_z"),
        seq_cuts=CUTS if variant.startswith("seq") else None,
        call=dict(chunk_size=chunk_size, dt_softplus=variant != "exact_multiple_no_softplus"),
        # Both forward / recurrence paths in every variant, at 2 head blocks and at 1.
        config=dict(heads_per_prog=2 if states == "chained" else 8, chained=states == "chained"),
    )


def test_model_option_keeps_states_in_the_kernels_config(monkeypatch):
    """model.ssd_keep_states reaches our kernels' config (config.py's keep_states) through the mixer and ops, for the
    unfused and the fused mixer; off by default. (What keeping does is tested above under the interpreter.)"""
    from models.args import ModelArgs
    from models.kernels import ops
    from models.kernels.ssd_triton import autograd
    from models.mamba2 import mixer as mixer_module

    inp = make_inputs(b=1, L=8, H=4, P=16, G=1, N=16, seed=2, with_init=False)
    args = [inp[k] for k in ("x_BLHP", "dt_BLH", "A_H", "B_BLGN", "C_BLGN")]
    for keep in (False, True):
        assert autograd.prepare_inputs(*args, 16, inp["D"], None, None, None, None, keep)[-1].keep_states is keep
    assert autograd.prepare_inputs(*args, 16, inp["D"], None, None, None, None)[-1].keep_states is False

    class Seen(Exception):
        pass

    def stand_in(*a, **kw):
        raise Seen(kw["keep_states"])

    seen = []
    for keep in (False, True):
        margs = ModelArgs(d_model=32, n_layers=1, vocab_size=16, d_state=16, headdim=16, ssd_keep_states=keep)
        mixer = mixer_module.Mamba2Mixer(margs, 0, 1)
        zxbcdt = torch.randn(1, 8, mixer.in_proj.out_features)
        with monkeypatch.context() as m:  # the mixer -> ops, unfused and fused
            m.setattr(ops, "ssd_chunk_scan", stand_in)
            m.setattr(ops, "mamba_split_conv1d_scan", stand_in)
            for call in (lambda: mixer._forward(zxbcdt, None), lambda: mixer._fused_forward(zxbcdt, None, False)):
                with pytest.raises(Seen) as e:
                    call()
                seen.append(e.value.args[0])
        with monkeypatch.context() as m:  # ops -> our kernels
            m.setattr(ops, "use_triton_ssd", lambda backend, t: True)
            m.setattr(ops._ssd_triton, "ssd_chunk_scan_triton", stand_in)
            m.setattr(ops, "mamba_split_conv1d_scan_triton", stand_in)
            for call in (
                lambda: ops.ssd_chunk_scan(*args, 16, keep_states=keep),
                lambda: ops.mamba_split_conv1d_scan(
                    zxbcdt, None, None, None, -torch.ones(2), None, 16, keep_states=keep
                ),
            ):
                with pytest.raises(Seen) as e:
                    call()
                seen.append(e.value.args[0])
    assert seen == [False] * 4 + [True] * 4
