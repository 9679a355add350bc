"""Greedy tokens of host-computed experts (hybrid) against no offload: equal up to a near-tie.

The hybrid path computes some experts on the host (fp32 accumulation, one rounding per row), where the
model's own kernel rounds in its own order. Both are right; their logits differ by about that rounding,
so a greedy choice may part where no offload's best two logprobs lie within ``TIE_NATS``. A wrong expert
or wrong bytes moves logits by far more, and at the first step it touches. Used by the GPU test
(tests/test_vllm_gpu.py) and the CPU one (tests/test_vllm_e2e.py); the children record the gaps with
``top2_gaps`` (SamplingParams(logprobs=2))."""

from __future__ import annotations

TIE_NATS = 0.05


def top2_gaps(outputs) -> list[list[float | None]]:
    """Per request, per generated position: best minus second-best logprob (nats), None if one only."""
    gaps = []
    for o in outputs:
        row = []
        for pos in o.outputs[0].logprobs or []:
            top = sorted((lp.logprob for lp in pos.values()), reverse=True)
            row.append(round(float(top[0] - top[1]), 5) if len(top) > 1 else None)
        gaps.append(row)
    return gaps


def assert_equal_up_to_a_near_tie(got, want, want_gaps, tol: float = TIE_NATS) -> None:
    """Each sequence of ``got`` equals ``want`` up to its first difference, and that difference lies
    where ``want``'s best two logprobs were within ``tol`` (after it, the sequences are free to part)."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        pos = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if pos is None:
            assert len(g) == len(w), f"sequence {i}: {len(g)} tokens, want {len(w)}"
            continue
        gap = want_gaps[i][pos]
        assert gap is not None and gap < tol, (
            f"sequence {i} parts at token {pos} ({g[pos]} for {w[pos]}) where no offload's best two "
            f"logprobs are {gap} nats apart (a near-tie is < {tol})")
