"""benchmarks/trace_summary.py on synthetic profiler traces: compute, NCCL and idle time per step, exposed NCCL by
collective, the op that launched each kernel, kernel groups, host self times, idle gaps and FSDP hook times."""

from __future__ import annotations

import json


def _summarize_step(tmp_path, kernels: list[tuple[str, int, int]]) -> dict:
    """trace_summary.summarize of a synthetic trace: one profiler step over 0-100 us and the (name, ts, dur) kernels."""
    from benchmarks.trace_summary import summarize

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#8", "ts": 0, "dur": 100}]
    events += [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return summarize(str(path))


def test_trace_summary_splits_compute_nccl_and_idle(tmp_path):
    """A synthetic step of 100 us: compute 0-40 and 50-70, NCCL 30-60 (10 us hidden by neither), idle 70-100."""
    from benchmarks.trace_summary import union_length

    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    kernels = [("gemm", 0, 40), ("ssd_fwd", 50, 20), ("ncclDevKernel_AllGather", 30, 30), ("gemm", 120, 10)]
    s = _summarize_step(tmp_path, kernels)  # the last gemm lies outside the step: ignored
    assert (s["wall_ms"], s["compute_ms"], s["nccl_ms"]) == (0.1, 0.06, 0.03)
    assert abs(s["nccl_exposed_ms"] - 0.01) < 1e-12 and abs(s["idle_ms"] - 0.03) < 1e-12
    assert s["kernels"] == 3 and s["top"][0][:2] == ("gemm", 1)
    assert s["launched_by"]["gemm"] == [("?", 1)]  # no op with its External id in this trace
    assert [(k, n) for k, n, _, _ in s["nccl_by_kind"]] == [("AllGather", 1)]
    assert abs(s["nccl_by_kind"][0][3] - 0.01) < 1e-12


def test_trace_summary_exposed_nccl_by_collective(tmp_path):
    """Each collective kind's exposed time: the all-to-all (SendRecv) 20-40 under no compute, the all-gather 0-10
    under compute 0-10 and 50-60 free, a reduce-scatter fully hidden; the list most exposed first."""
    kernels = [
        ("gemm", 0, 15),
        ("ssd", 70, 30),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, 20),
        ("ncclDevKernel_AllGather_RING_LL", 0, 10),
        ("ncclDevKernel_AllGather_RING_LL", 50, 10),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 75, 20),
    ]
    got = [(k, n, round(t * 1e3), round(x * 1e3)) for k, n, t, x in _summarize_step(tmp_path, kernels)["nccl_by_kind"]]
    assert got == [("SendRecv", 1, 20, 20), ("AllGather", 2, 20, 10), ("ReduceScatter", 1, 20, 0)]


def test_trace_summary_names_the_op_that_launched_each_kernel(tmp_path):
    """Kernels are matched to the aten op that dispatched them through their shared External id."""
    from benchmarks.trace_summary import summarize

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "args": {"External id": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 6, "dur": 5, "args": {"External id": 8}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 12, "dur": 5, "args": {"External id": 9}},
    ] + [
        {"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": 5, "args": {"External id": i}}
        for n, ts, i in (("gemm", 10, 7), ("copy", 20, 8), ("copy", 30, 9), ("copy", 40, 99))
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarize(str(path))
    assert s["launched_by"] == {"gemm": [("aten::mm", 1)], "copy": [("aten::copy_", 2), ("?", 1)]}


def test_trace_summary_kernel_groups(tmp_path):
    """Kernel names fall into their families (ours before mamba_ssm's, NCCL first), and the side-by-side table
    puts each family's GPU time in its trace's column."""
    from benchmarks.trace_summary import groups_table, kernel_group, summarize

    cases = {
        "chunk_scan_bwd_dx_kernel": "ssd (ours)",
        "chained_states_fwd_kernel": "ssd (ours)",
        "chained_dstates_bwd_kernel": "ssd (ours)",
        "_chunk_scan_bwd_dx_kernel": "ssd (mamba_ssm)",
        "_state_passing_fwd_kernel": "ssd (mamba_ssm)",
        "causal_conv1d_fwd_kernel<128, 4>": "conv1d",
        "conv_bwd_kernel": "conv1d",
        "_add_rmsnorm_fwd_kernel": "norms",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32": "matmul",
        "ncclDevKernel_ReduceScatter_Sum_f32": "nccl",
        "void at::native::vectorized_elementwise_kernel<4>": "elementwise / reductions",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward": "loss",
        "multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "Memcpy HtoD (Pinned -> Device)": "memcpy / memset",
        "some_new_kernel": "other",
    }
    assert {n: kernel_group(n) for n in cases} == cases
    kernel = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    paths = []
    for i, ssd in enumerate(("chunk_scan_fwd_kernel", "_chunk_scan_fwd_kernel")):
        events = [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 1000},
            kernel("nvjet_gemm", 0, 400),
            kernel(ssd, 400, 300 + 100 * i),
        ]
        (tmp_path / f"run{i}").mkdir()
        paths.append(tmp_path / f"run{i}" / "trace.json")
        paths[-1].write_text(json.dumps({"traceEvents": events}))
    table = groups_table([summarize(str(p)) for p in paths]).splitlines()
    assert table[0] == "| kernels | run0 | run1 |"
    assert "| ssd (ours) | 0.3 ms (30%) | - |" in table and "| ssd (mamba_ssm) | - | 0.4 ms (40%) |" in table
    assert "| matmul | 0.4 ms (40%) | 0.4 ms (40%) |" in table
    assert table[-2:] == ["| GPU idle | 0.3 ms (30%) | 0.2 ms (20%) |", "| step | 1.0 ms | 1.0 ms |"]


def test_trace_summary_host_self_times():
    """Nested host ops: each name's self time excludes the ops inside it; the busiest thread is chosen."""
    from benchmarks.trace_summary import host_self_times

    op = lambda name, ts, dur, tid=1: {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}  # noqa: E731
    events = [
        op("step", 0, 10),
        op("a", 1, 2),
        op("b", 4, 4),
        op("launch", 5, 1),
        op("other", 0, 3, tid=2),
        op("late", 50, 5),
    ]  # outside the window
    h = host_self_times(events, (0, 20))
    assert h["thread"] == 1 and h["traced_ms"] == 0.01
    assert dict(h["self_ms"]) == {"step": 0.004, "b": 0.003, "a": 0.002, "launch": 0.001}


def test_trace_summary_idle_gaps():
    """GPU idle gaps, longest first, with the kernels around each and the host ops around the launch of the kernel
    that ended it (matched by correlation id); overlapping kernels leave no gap; the step's tail counts as a gap."""
    from benchmarks.trace_summary import idle_gaps

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def host(cat, name, ts, dur, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1}
        return dict(e, args={"correlation": corr}) if corr is not None else e

    kernels = [kernel("a", 0, 10, 1), kernel("b", 5, 10, 2), kernel("c", 40, 10, 3), kernel("d", 55, 40, 4)]
    events = kernels + [
        host("user_annotation", "optimizer step", 20, 30),
        host("cpu_op", "aten::_fused_adamw_", 30, 15),
        host("cuda_runtime", "cudaLaunchKernel", 35, 2, corr=3),
        host("cuda_runtime", "cudaLaunchKernel", 50, 2, corr=4),
    ]
    gaps = idle_gaps(events, kernels, (0, 100), top=5)
    assert [round(g["ms"] * 1e3) for g in gaps] == [25, 5, 5]  # 15-40, 50-55, 95-100 (a and b overlap)
    assert gaps[0] == {
        "ms": 0.025,
        "before": "b",
        "after": "c",
        "launched_by": "aten::_fused_adamw_",
        "inside": "optimizer step",
    }
    assert gaps[1]["after"] == "d" and gaps[1]["launched_by"] == "optimizer step"
    assert gaps[2]["after"] is None and gaps[2]["before"] == "d"
    assert len(idle_gaps(events, kernels, (0, 100), top=1)) == 1


def test_trace_summary_fsdp_hook_times():
    """FSDP2's host annotations summed per hook, the unit's name left out; GPU-side copies of them not counted."""
    from benchmarks.trace_summary import hook_times

    ann = lambda name, ts, dur, cat="user_annotation": {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        ann("FSDP::pre_forward (layers.0)", 0, 3000),
        ann("FSDP::pre_forward (layers.1)", 5000, 1000),
        ann("FSDP::pre_forward (layers.1)", 5000, 1000, cat="gpu_user_annotation"),
        ann("FSDP::backward_prefetch for layers.0", 7000, 500),
        ann("aten::mm", 0, 9000, cat="cpu_op"),
        ann("FSDP::pre_backward (layers.0)", 90_000, 1000),
    ]  # outside the window
    assert hook_times(events, (0, 10_000)) == [("FSDP::pre_forward", 2, 4.0), ("FSDP::backward_prefetch", 1, 0.5)]


def test_trace_summary_gaps_by_the_kinds_of_kernel_around_them(tmp_path):
    """Idle stretches counted by what ran before and after: Triton -> Triton 2 us, Triton -> cuBLAS 3 us, cuBLAS ->
    PyTorch 1 us (overlapping kernels leave no gap); none after the last kernel."""
    from benchmarks.trace_summary import launch_kind

    assert [launch_kind(n) for n in ("chunk_scan_fwd_kernel", "nvjet_sm90_tst_256x128", "Memset (Device)")] == [
        "triton",
        "cublas",
        "torch",
    ]
    kernels = [
        ("conv_fwd_kernel", 0, 10),
        ("dt_fwd_kernel", 12, 5),
        ("cb_fwd_kernel", 14, 2),  # overlaps dt: no gap
        ("nvjet_sm90_tst_192x192", 20, 30),
        ("void at::native::reduce_kernel<128, 4>", 51, 4),
    ]
    s = _summarize_step(tmp_path, kernels)
    got = {(b, a): (n, round(ms * 1e3, 6)) for b, a, n, ms in s["gap_kinds"]}
    assert got == {("triton", "cublas"): (1, 3.0), ("triton", "triton"): (1, 2.0), ("cublas", "torch"): (1, 1.0)}, got
