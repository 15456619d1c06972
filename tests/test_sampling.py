"""Sampling transforms and keyed draws, shared by draft and target."""

import numpy as np
import torch

from specdec.sampling import Purpose, logits_to_probs, sample_dense, sample_sparse, to_sparse, uniform


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, 1.0, top_k=2)[0]
    assert torch.nonzero(probs).flatten().tolist() == [1, 2]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = logits_to_probs(probs.log(), 1.0, top_p=0.8)[0]
    assert torch.nonzero(out).flatten().tolist() == [0, 1]  # 0.5 + 0.3 reaches 0.8
    out = logits_to_probs(probs.log(), 1.0, top_p=0.81)[0]
    assert torch.nonzero(out).flatten().tolist() == [0, 1, 2]
    assert torch.allclose(out[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    assert logits_to_probs(logits, 0.5)[0, 1] > logits_to_probs(logits, 1.0)[0, 1]


def test_uniform_is_a_pure_function_and_differs_by_position_and_purpose():
    assert uniform(7, 100, Purpose.ACCEPT) == uniform(7, 100, Purpose.ACCEPT)
    draws = {uniform(7, 100, p) for p in Purpose} | {uniform(7, 101, Purpose.ACCEPT), uniform(8, 100, Purpose.ACCEPT)}
    assert len(draws) == len(Purpose) + 2


def test_uniform_is_uniform():
    u = np.array([uniform(s, 5, Purpose.ACCEPT) for s in range(50_000)])
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    # each decile: 5000 +- 6 sigma, sigma = sqrt(50000 * 0.1 * 0.9) = 67
    assert np.all(np.abs(counts - 5000) <= 6 * 67), counts


def test_dense_and_sparse_sampling_agree_and_skip_zero_probability():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    ids, p = to_sparse(probs, 10)
    for u in np.linspace(0, 0.999999, 101):
        t = sample_dense(probs, float(u))
        assert t in (1, 3) and t == sample_sparse(ids, p, float(u))


def test_to_sparse_refuses_support_over_the_limit():
    assert to_sparse(torch.full((10,), 0.1), 9) is None
    ids, _ = to_sparse(torch.full((10,), 0.1), 10)
    assert ids.tolist() == list(range(10))


def test_nucleus_matches_a_full_sort_for_peaky_and_flat_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(3, 5000, generator=g) * 8, torch.randn(3, 5000, generator=g) * 0.1])  # peaky, flat
    for top_p in (0.5, 0.9, 0.99):
        fast = logits_to_probs(logits, 0.7, top_p=top_p)
        x = logits / 0.7
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sp = torch.softmax(sorted_x, dim=-1)
        drop = torch.zeros_like(sp, dtype=torch.bool).scatter(-1, order, (torch.cumsum(sp, -1) - sp) >= top_p)
        slow = torch.softmax(x.masked_fill(drop, float("-inf")), dim=-1)
        assert torch.equal(fast > 0, slow > 0)
        torch.testing.assert_close(fast, slow)


def test_target_drawn_bonus_equals_the_orchestrators_draw_from_the_dense_fetch():
    """Verify may return the bonus token itself; it must be the token the orchestrator would draw."""
    from orchestrator import rejection_sampler as rs

    g = torch.Generator().manual_seed(1)
    for seed in range(300):
        probs = logits_to_probs(torch.randn(1, 3000, generator=g) * 2, 0.9)[0]  # [vocab], full support
        assert sample_dense(probs, uniform(seed, 77, Purpose.RESAMPLE)) == rs.bonus(rs.Dist.from_dense(probs.numpy()), seed, 77)
