"""The linear recurrences of the hybrid models (megatron/hybrid): the gated delta rule (Gated DeltaNet) and Mamba-2's
scan (SSD). Each chunked form equals its token-by-token definition (fp64, to round-off) for chunk sizes that do and do
not divide the sequence, from a given state, with documents starting anywhere (at a chunk's first position, twice in
a row, at the sequence's start); its gradients equal the definition's; and in fp32 it equals transformers' own PyTorch
paths (Qwen3-Next's ``torch_chunk_gated_delta_rule``, Nemotron-H's ``mamba2_chunk_scan``). A sequence cut into pieces
(as context parallelism cuts it) gives the whole sequence's outputs once each piece starts from the state composed from
the earlier pieces' maps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.hybrid import delta_rule, ssd

B_, S_, H_ = 2, 37, 3


def _delta_inputs(dtype=torch.float64, seed=0, s=S_):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B_, s, H_, 8, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B_, s, H_, 8, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B_, s, H_, 6, generator=gen, dtype=dtype)
    g = -torch.rand(B_, s, H_, generator=gen, dtype=dtype) * 0.7
    beta = torch.rand(B_, s, H_, generator=gen, dtype=dtype)
    state = torch.randn(B_, H_, 8, 6, generator=gen, dtype=dtype)
    return q, k, v, g, beta, state


def _ssd_inputs(dtype=torch.float64, seed=0, s=S_):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B_, s, 4, 6, generator=gen, dtype=dtype)
    dt = torch.rand(B_, s, 4, generator=gen, dtype=dtype) * 0.5 + 0.01
    A = -torch.rand(4, generator=gen, dtype=dtype) * 2
    Bm = torch.randn(B_, s, 2, 5, generator=gen, dtype=dtype)
    Cm = torch.randn(B_, s, 2, 5, generator=gen, dtype=dtype)
    D = torch.randn(4, generator=gen, dtype=dtype)
    state = torch.randn(B_, 4, 5, 6, generator=gen, dtype=dtype)
    return x, dt, A, Bm, Cm, D, state


def _resets(s=S_):
    resets = torch.rand(B_, s, generator=torch.Generator().manual_seed(3)) < 0.12
    resets[0, 0] = True  # the sequence's start: the given state is dropped
    resets[1, 8] = resets[1, 9] = True  # a chunk's first position (chunk size 8), and a one-token document
    return resets


def _close(a, b, tol=1e-12):
    assert (a - b).abs().max().item() < tol, (a - b).abs().max().item()


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
@pytest.mark.parametrize("with_resets", [False, True])
def test_chunked_forms_equal_their_definitions(chunk_size, with_resets):
    resets = _resets() if with_resets else None
    q, k, v, g, beta, state = _delta_inputs()
    (o1, s1), (o2, s2) = (delta_rule.naive(q, k, v, g, beta, state, resets),
                          delta_rule.chunked(q, k, v, g, beta, state, resets, chunk_size))
    _close(o1, o2)
    _close(s1, s2)
    x, dt, A, Bm, Cm, D, state = _ssd_inputs()
    (y1, t1), (y2, t2) = (ssd.naive(x, dt, A, Bm, Cm, D, state, resets),
                          ssd.chunked(x, dt, A, Bm, Cm, D, state, resets, chunk_size))
    _close(y1, y2)
    _close(t1, t2)


def test_a_document_start_drops_the_state():
    q, k, v, g, beta, state = _delta_inputs()
    resets = torch.zeros(B_, S_, dtype=torch.bool)
    resets[:, 20] = True
    whole, _ = delta_rule.chunked(q, k, v, g, beta, state, resets, 8)
    tail, _ = delta_rule.chunked(*(x[:, 20:] for x in (q, k, v, g, beta)), None, None, 8)  # from no state
    _close(whole[:, 20:], tail)


def test_gradients_equal_the_definitions():
    inputs = [x.requires_grad_() for x in _delta_inputs(s=19)]
    resets = _resets(19)
    grads = []
    for form in (delta_rule.naive, lambda *a: delta_rule.chunked(*a, chunk_size=8)):
        out, final = form(*inputs, resets)
        grads.append(torch.autograd.grad((out * out.detach().cos()).sum() + final.sum(), inputs))
    for a, b in zip(*grads):
        _close(a, b, 1e-10)
    inputs = [x.requires_grad_() for x in _ssd_inputs(s=19)]
    grads = []
    for form in (ssd.naive, lambda *a: ssd.chunked(*a, chunk_size=8)):
        out, final = form(*inputs, resets)
        grads.append(torch.autograd.grad((out * out.detach().cos()).sum() + final.sum(), inputs))
    for a, b in zip(*grads):
        _close(a, b, 1e-10)


def test_equal_to_transformers_pytorch_paths():
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    q, k, v, g, beta, state = _delta_inputs(torch.float32)
    theirs, their_state = qwen3_next.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16,
                                                                 initial_state=state, output_final_state=True)
    ours, our_state = delta_rule.chunked(q * 8 ** -0.5, k, v, g, beta, state, chunk_size=16)  # they scale q inside
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_state, their_state, rtol=1e-5, atol=1e-5)
    x, dt, A, Bm, Cm, D, state = _ssd_inputs(torch.float32)
    theirs, their_state = nemotron_h.mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk_size=16, D=D,
                                                       initial_states=state.transpose(-1, -2),
                                                       return_final_states=True)
    ours, our_state = ssd.chunked(x, dt, A, Bm, Cm, D, state, chunk_size=16)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(our_state.transpose(-1, -2), their_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_resets", [False, True])
def test_pieces_composed_equal_the_whole_sequence(with_resets):
    """Four pieces (context parallelism's cut): each piece's map and its final state from zero, composed in order,
    give each piece's entering state; from it, the piece's outputs are the whole run's."""
    q, k, v, g, beta, state = _delta_inputs()
    resets = _resets() if with_resets else None
    whole, final = delta_rule.chunked(q, k, v, g, beta, state, resets, 8)
    cuts = [(0, 9), (9, 20), (20, 30), (30, S_)]
    piece = [tuple(x[:, a:e] for x in (q, k, v, g, beta)) + (None if resets is None else resets[:, a:e],)
             for a, e in cuts]
    maps = [delta_rule.transition(p[1], p[3], p[4], p[5], 8) for p in piece]
    finals = [delta_rule.chunked(*p[:5], None, p[5], 8)[1] for p in piece]
    entering, last = delta_rule.compose(maps, finals, state)
    _close(last, final)
    for (a, e), p, start in zip(cuts, piece, entering):
        _close(delta_rule.chunked(*p[:5], start, p[5], 8)[0], whole[:, a:e])


@pytest.mark.parametrize("with_resets", [False, True])
def test_scan_pieces_composed_equal_the_whole_sequence(with_resets):
    """Mamba-2's scan cut into four pieces: each piece's decay per head (``ssd.transition``) and its final state from
    zero, composed in order, give each piece's entering state; from it, the piece's outputs are the whole run's."""
    x, dt, A, Bm, Cm, D, state = _ssd_inputs()
    resets = _resets() if with_resets else None
    whole, final = ssd.chunked(x, dt, A, Bm, Cm, D, state, resets, 8)
    cuts = [(0, 9), (9, 20), (20, 30), (30, S_)]
    entering = state
    for a, e in cuts:
        piece = tuple(t[:, a:e] for t in (x, dt)) + (A,) + tuple(t[:, a:e] for t in (Bm, Cm)) + (D,)
        piece_resets = None if resets is None else resets[:, a:e]
        _close(ssd.chunked(*piece, entering, piece_resets, 8)[0], whole[:, a:e])
        decay = ssd.transition(piece[1], A, piece_resets)
        entering = decay[..., None, None] * entering + ssd.chunked(*piece, None, piece_resets, 8)[1]
    _close(entering, final)
