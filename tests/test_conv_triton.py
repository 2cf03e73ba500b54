"""Our depthwise causal conv1d (models/kernels/conv_triton.py) on the CPU, through Triton's interpreter.

Forward and backward (dx, dweight, dbias) against causal_conv1d_ref in float64 with autograd: silu and none, bias
and none, widths 2 to 4, documents (seq_idx: one starting at 0, one-token documents, cuts inside a tile, at a tile's
edge and at the edges of the windows the one-document branch tests), x as a strided channel-last view (the mixer's
slice of zxbcdt), channels not a multiple of the block, several backward programs and streams along L, the stream
loop rolled and unrolled, float32 and float16 x, sequences shorter than the window. float32 runs to 1e-5.

As in test_ssd_triton.py, Triton reads TRITON_INTERPRET when first imported, so the cases run in one child process
with the variable set (all of them, once per session); each test reads its cases' results. A case sets every module
setting it depends on (the child runs the cases one after another in one process).
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import finish_child, run_checks, start_child

pytest.importorskip("triton")

_ONE_DOC_DEFAULTS = {}  # conv_triton's own one-document branch settings, read before any case changes them
_STREAM_DEFAULTS = {}  # and its backward's streams (rows, positions per row)


def check_conv(
    b, L, D, W, seed, seq_cuts, silu, bias, token_stride, streams=None, x_dtype="float32", fwd_channels_fastest=True,
    unroll=None, one_doc_branch=None, prefetch=None, wide=False,
):  # fmt: skip
    """conv_triton's forward and backward against causal_conv1d_ref in float64 (autograd for the gradients): x a
    channel-last view with token_stride >= D (the mixer's slice of zxbcdt), documents cut at seq_cuts (a list per
    row), streams = (rows, positions per row) of a backward program (several streams and programs: the windows
    carried across stream edges, the weight-gradient partial sums); fwd_channels_fastest: the forward's grid order;
    one_doc_branch: both kernels' branch that skips the document tests in a program within one document; unroll:
    steps per iteration of a backward stream's loop; prefetch: positions its loop loads ahead into registers (0: at
    their step, pipelined on the GPU). None: the module's defaults. wide: both kernels with int64 row offsets (WIDE,
    what a batch row whose offsets reach 2^31 takes) instead of int32."""
    from models.kernels import conv_triton
    from models.kernels.conv_reference import causal_conv1d_ref

    conv_triton._OFFSET_LIMIT = 1 if wide else 2**31
    assert conv_triton._wide_offsets(L, D, token_stride) == wide, "the case does not take the offsets it names"

    if not _STREAM_DEFAULTS:
        _STREAM_DEFAULTS.update(streams=(conv_triton._BWD_ROWS, conv_triton._BWD_SEG), unroll=conv_triton._BWD_UNROLL,
                                prefetch=conv_triton._BWD_PREFETCH)  # fmt: skip
    conv_triton._BWD_ROWS, conv_triton._BWD_SEG = streams if streams is not None else _STREAM_DEFAULTS["streams"]
    conv_triton._FWD_CHANNELS_FASTEST = fwd_channels_fastest
    conv_triton._BWD_UNROLL = _STREAM_DEFAULTS["unroll"] if unroll is None else unroll
    conv_triton._BWD_PREFETCH = _STREAM_DEFAULTS["prefetch"] if prefetch is None else prefetch
    if not _ONE_DOC_DEFAULTS:
        _ONE_DOC_DEFAULTS.update(fwd=conv_triton._FWD_ONE_DOC_BRANCH, bwd=conv_triton._BWD_ONE_DOC_BRANCH)
    conv_triton._FWD_ONE_DOC_BRANCH = _ONE_DOC_DEFAULTS["fwd"] if one_doc_branch is None else one_doc_branch
    conv_triton._BWD_ONE_DOC_BRANCH = _ONE_DOC_DEFAULTS["bwd"] if one_doc_branch is None else one_doc_branch
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, x_dtype)
    buf = torch.randn(b, L, token_stride, generator=g).to(dt)
    x = buf[:, :, 1 : D + 1].transpose(1, 2)  # [B, D, L], channels contiguous, token stride token_stride
    w = 0.5 * torch.randn(D, W, generator=g)
    bvec = 0.1 * torch.randn(D, generator=g) if bias else None
    seq = None
    if seq_cuts is not None:
        seq = torch.zeros(b, L, dtype=torch.int32)
        for row, cuts in enumerate(seq_cuts):
            for c in cuts:
                seq[row, c:] += 1
    dout = torch.randn(b, D, L, generator=g, dtype=torch.float64)
    act = "silu" if silu else None
    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, w, bvec)]
    ref = causal_conv1d_ref(leaves[0], leaves[1], leaves[2], seq, act)
    (ref * dout).sum().backward()
    out = conv_triton.conv_forward_triton(x, w, bvec, seq, silu)
    assert out.shape == x.shape and out.dtype == dt and out.stride(1) == 1
    dx, dw, db = conv_triton.conv_backward_triton(x, w, bvec, dout.to(dt), seq, silu)
    got = dict(out=out, dx=dx, dw=dw, **({"db": db} if bias else {}))
    want = dict(out=ref, dx=leaves[0].grad, dw=leaves[1].grad, **({"db": leaves[2].grad} if bias else {}))
    errors = {k: ((got[k].double() - v).norm() / v.norm()).item() for k, v in want.items()}
    tol = 1e-5 if dt == torch.float32 else 4e-3
    bad = {k: e for k, e in errors.items() if not e <= tol}
    assert not bad, f"over {tol}: {bad}; all: {errors}"
    # dx written into a given channel-last buffer (the mixer's view of dzxbcdt), the same values.
    dbuf = torch.zeros(b, L, token_stride, dtype=dt)
    conv_triton.conv_backward_triton(x, w, bvec, dout.to(dt), seq, silu, dbuf[:, :, 1 : D + 1].transpose(1, 2))
    assert torch.equal(dbuf[:, :, 1 : D + 1].transpose(1, 2), dx) and not dbuf[:, :, 0].any()
    return errors


def _case(**kw):
    return dict(dict(silu=True, bias=True, W=4, seq_cuts=None), **kw)


CASES = {
    # silu, bias, documents (one starting at 0, one-token ones, cuts inside a tile and at a tile edge), a strided
    # channel-last x, channels not a multiple of the block, several backward programs along L
    "documents_strided": _case(b=2, L=100, D=40, seed=1, seq_cuts=[[1, 2, 30, 64, 65], [33]], token_stride=48,
                               streams=(2, 8)),
    # the stream loop rolled (one step per iteration) and at 3 steps per iteration (segments of 8: 11 steps, so one
    # step past the end whose weight terms must not count; they, or a stale window, fail dw or dx)
    "stream_rolled": _case(b=1, L=50, D=24, seed=7, seq_cuts=[[5, 17]], token_stride=32, streams=(2, 8), unroll=1),
    "stream_three_steps": _case(b=1, L=50, D=24, seed=7, seq_cuts=[[5, 17]], token_stride=32, streams=(2, 8),
                                unroll=3),
    # the default (4 steps an iteration, loaded at their step) leaves one step past the end at segments of 8, as
    # above; before session 58 the loop loaded two positions ahead into registers at 2 steps, or one ahead
    "stream_four_steps": _case(b=1, L=50, D=24, seed=7, seq_cuts=[[5, 17]], token_stride=32, streams=(2, 8),
                               unroll=4, prefetch=0),
    "stream_two_ahead": _case(b=1, L=50, D=24, seed=7, seq_cuts=[[5, 17]], token_stride=32, streams=(2, 8),
                              unroll=2, prefetch=2),
    "stream_one_ahead": _case(b=1, L=50, D=24, seed=7, seq_cuts=[[5, 17]], token_stride=32, streams=(2, 8),
                              unroll=3, prefetch=1),
    # the one-document branch (test_one_document_branch's docstring says which cut tests which window edge)
    "one_doc_branch_on": _case(b=5, L=100, D=40, seed=11, seq_cuts=[[29, 96], [63], [32, 83], [30], [82]],
                               token_stride=48, streams=(2, 8), one_doc_branch=True),
    "one_doc_branch_off": _case(b=5, L=100, D=40, seed=11, seq_cuts=[[29, 96], [63], [32, 83], [30], [82]],
                                token_stride=48, streams=(2, 8), one_doc_branch=False),
    # the documents case with int64 row offsets (WIDE), as rows whose offsets reach 2^31 take them
    "documents_wide_offsets": _case(b=2, L=100, D=40, seed=1, seq_cuts=[[1, 2, 30, 64, 65], [33]], token_stride=48,
                                    streams=(2, 8), wide=True),
    # widths 2 and 3, no bias, no activation, the forward's other grid order; float16 x at width 4
    "width2_plain": _case(b=1, L=70, D=16, W=2, seed=2, silu=False, bias=False, token_stride=17),
    "width3_plain": _case(b=1, L=70, D=16, W=3, seed=2, silu=False, bias=False, token_stride=17, streams=(2, 16)),
    "width3_other_grid_order": _case(b=2, L=45, D=24, W=3, seed=3, bias=False, token_stride=32,
                                     fwd_channels_fastest=False),
    "float16_x": _case(b=1, L=40, D=8, seed=4, seq_cuts=[[10]], token_stride=16, x_dtype="float16"),
    # sequences shorter than the conv's window, one with a document starting at its second position
    "two_tokens": _case(b=2, L=2, D=8, seed=5, seq_cuts=[[1], []], token_stride=16),
    "three_tokens": _case(b=1, L=3, D=8, seed=6, token_stride=16),
}  # fmt: skip


def child(part: int = 0, parts: int = 1):
    """Every parts-th case from the part-th on (the fixture runs two children side by side)."""
    names = list(CASES)[part::parts]
    run_checks({name: (lambda kw=CASES[name]: check_conv(**kw)) for name in names})


@pytest.fixture(scope="module")
def results():
    children = [start_child("tests.test_conv_triton", f"child({part}, 2)") for part in range(2)]
    return {name: r for proc in children for name, r in finish_child(proc).items()}


def _passed(results, *names):
    for name in names:
        assert results[name]["ok"], f"case {name} ({CASES[name]}) failed:\n{results[name]['out']}"


def test_documents_strided_channel_last(results):
    """Documents, a strided channel-last x, several backward programs, the stream loop rolled and at three steps."""
    _passed(results, "documents_strided", "stream_rolled", "stream_three_steps")


def test_stream_loop_loads_at_their_step_or_ahead(results):
    """The backward's stream loop at four steps an iteration with each position loaded at its step (the default:
    pipelined by Triton on the GPU), and with one or two positions loaded ahead into registers (session 55's loop)."""
    _passed(results, "stream_four_steps", "stream_two_ahead", "stream_one_ahead")


def test_one_document_branch(results):
    """Both kernels' branch for a program whose window lies in one document (its two end ids equal: no per-tap
    document tests), with documents cut at the windows' edges. Forward programs of 32 positions read 32p - 3 ...
    32p + 31: cuts at 29 (the window's first position in the new document: one document), 30 (its first position
    alone in the old one) and 63 (its last alone in the new one), and at 32; backward programs of 2 streams x 8
    positions read 16p - 3 ... 16p + 18: cuts at 29, 30, 82 (the last position, whose g the last dx needs) and 83
    (just past the window). A window end read one position short fails dx or out (checked by mutation)."""
    _passed(results, "one_doc_branch_on", "one_doc_branch_off")


def test_widths_without_documents(results):
    """Widths 2 and 3, no documents, no bias, no activation (and the forward's other grid order); float16 x with
    width 4; sequences of 2 and 3 tokens."""
    _passed(results, "width2_plain", "width3_plain", "width3_other_grid_order", "float16_x", "two_tokens",
            "three_tokens")  # fmt: skip


def test_wide_offsets(results):
    """Row offsets in int64 (WIDE) give what int32 ones do; the host asks for them exactly where positions -3 ...
    L + 3 of a row, times its largest row stride, plus the channels, can reach 2^31 (before session 60 the forward
    took int32 offsets at any length: at the 1.3B's row stride of 8512 they would have wrapped from L ~252k on)."""
    from models.kernels.conv_triton import _wide_offsets

    _passed(results, "documents_wide_offsets")
    assert not _wide_offsets(4096, 4352, 8512)
    assert _wide_offsets(262144, 4352, 8512)
    limit = (2**31 - 4352) // 8512 - 4  # the longest L whose offsets stay below 2^31 at that stride
    assert not _wide_offsets(limit, 4352, 8512) and _wide_offsets(limit + 1, 4352, 8512)
    assert _wide_offsets(limit, 4352, 8512, 8513), "the largest of the row strides counts"


def test_forward_refuses_a_tile_that_is_not_groups_of_four(monkeypatch):
    """The conv forward computes its tile as groups of four positions: a tuned _FWD_BLOCK_L that is no multiple of 4
    is refused before any launch, by name."""
    from models.kernels import conv_triton

    monkeypatch.setattr(conv_triton, "_FWD_BLOCK_L", 30)
    x = torch.zeros(1, 8, 16).transpose(1, 2)  # [B, D, L] = [1, 16, 8], channels contiguous
    with pytest.raises(ValueError, match="_FWD_BLOCK_L must be a multiple of 4"):
        conv_triton.conv_forward_triton(x, torch.zeros(16, 4), None, None, True)
