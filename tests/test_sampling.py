"""Sampling transforms and keyed draws, shared by draft and target. The transforms run in specdec's CPU kernel
where it builds and in torch elsewhere; each property is checked on both, and the kernel against torch."""

import numpy as np
import pytest
import torch

from conftest import built_kernels
from specdec import sampling
from specdec.sampling import (
    Purpose,
    argmax_rows,
    logits_to_probs,
    logits_to_probs_torch,
    min_p_floor,
    sample_dense,
    sample_sparse,
    support,
    uniform,
)


@pytest.fixture(params=["torch", "kernel"])
def to_probs(request):
    """logits_to_probs as torch computes it, and as specdec's CPU kernel does (skipped where it cannot be built)."""
    if request.param == "torch":
        return logits_to_probs_torch
    kernels = built_kernels()
    return lambda logits, t, k, p, min_p=0.0: kernels.sampling_probs(logits, t, k, p, min_p_floor(min_p))


def test_top_k_keeps_exactly_the_k_most_likely(to_probs):
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = to_probs(logits, 1.0, 2, 1.0)[0]
    assert torch.nonzero(probs).flatten().tolist() == [1, 2]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    tied = to_probs(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), 1.0, 2, 1.0)[0]  # ties with the k-th stay
    assert torch.nonzero(tied).flatten().tolist() == [1, 2, 4]


def test_top_p_keeps_smallest_set_reaching_the_mass(to_probs):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = to_probs(probs.log(), 1.0, 0, 0.8)[0]
    assert torch.nonzero(out).flatten().tolist() == [0, 1]  # 0.5 + 0.3 reaches 0.8
    out = to_probs(probs.log(), 1.0, 0, 0.81)[0]
    assert torch.nonzero(out).flatten().tolist() == [0, 1, 2]
    assert torch.allclose(out[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_best(to_probs):
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = to_probs(probs.log(), 1.0, 0, 1.0, 0.25)[0]  # keeps p >= 0.125
    assert torch.nonzero(out).flatten().tolist() == [0, 1, 2]
    assert torch.allclose(out[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    sharp = to_probs(probs.log(), 0.5, 0, 1.0, 0.3)[0]  # at T = 0.5 the ratios square: 1, 0.36, 0.09, 0.01
    assert torch.nonzero(sharp).flatten().tolist() == [0, 1]
    nucleus = to_probs(probs.log(), 1.0, 0, 0.8, 0.25)[0]  # top-p among those kept: 0.53 + 0.32 reaches 0.8
    assert torch.nonzero(nucleus).flatten().tolist() == [0, 1]
    assert torch.nonzero(to_probs(probs.log(), 1.0, 0, 1.0, 1.0)[0]).flatten().tolist() == [0]  # the best alone


def test_temperature_sharpens(to_probs):
    logits = torch.tensor([[1.0, 2.0]])
    assert to_probs(logits, 0.5, 0, 1.0)[0, 1] > to_probs(logits, 1.0, 0, 1.0)[0, 1]


def test_tokens_a_draft_does_not_score_get_exactly_zero(to_probs):
    """A restricted-vocabulary draft's logits are -inf outside its kept tokens: q must be 0 there, not tiny."""
    logits = torch.randn(2, 1000) * 30  # scores 100 or more below the best: e^-100 underflows
    logits[:, 1::2] = float("-inf")
    probs = to_probs(logits, 1.0, 0, 1.0)
    assert (probs[:, 1::2] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(2))


def test_the_sampling_kernel_is_the_torch_transform():
    kernels = built_kernels()
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 13146, 1000, 37):  # 13146, 37: a tail past the last 16
        for scale in (0.1, 2.0, 8.0):  # flat to peaky rows
            logits = torch.randn(3, vocab, generator=g) * scale
            logits[0, ::3] = float("-inf")
            for temperature, top_k, top_p, min_p in [
                (0.7, 0, 0.9, 0.0),
                (1.0, 0, 1.0, 0.0),
                (0.3, 0, 0.99, 0.0),
                (1.5, 50, 0.9, 0.0),
                (0.7, 5, 1.0, 0.0),
                (0.7, 100_000, 0.5, 0.0),
                (0.7, 0, 0.9, 0.05),
                (1.0, 0, 1.0, 0.01),
                (1.5, 20, 0.95, 0.1),
                (0.7, 0, 1.0, 1.0),
            ]:
                fast = kernels.sampling_probs(logits, temperature, top_k, top_p, min_p_floor(min_p))
                slow = logits_to_probs_torch(logits, temperature, top_k, top_p, min_p)
                assert torch.equal(fast > 0, slow > 0), (vocab, scale, temperature, top_k, top_p, min_p)
                torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="temperature > 0"):
        kernels.sampling_probs(logits, 0.0, 0, 1.0, min_p_floor(0.0))


def test_the_argmax_kernel_is_torch_argmax_with_the_first_of_ties():
    kernels = built_kernels()
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 37, 1):
        logits = torch.randn(5, vocab, generator=g)
        assert kernels.argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
    tied = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    assert kernels.argmax_rows(tied).tolist() == tied.argmax(-1).tolist() == [1, 0]
    assert argmax_rows(tied) == [1, 0]


def test_the_support_kernel_gives_each_rows_nonzero_entries_as_torch_finds_them():
    kernels = built_kernels()
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 37, 1):
        probs = logits_to_probs(torch.randn(4, vocab, generator=g) * 4, 0.7, top_p=0.9)
        probs[1] = 0.0  # a row with nothing: empty ids
        if vocab > 20:
            probs[2, [0, 15, 16, vocab - 1]] = torch.tensor([1e-38, 0.5, 1e-45, 0.25])  # block edges, denormals
        for row, (ids, p) in zip(probs, kernels.support_rows(probs)):
            expected = torch.nonzero(row, as_tuple=True)[0]
            assert ids.dtype == torch.int64 and p.dtype == torch.float64
            assert torch.equal(ids, expected) and torch.equal(p, row[expected].double())


def _numpy_inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(probs, dtype=np.float64)
    return np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), np.flatnonzero(probs)[-1])


def test_the_inverse_cdf_kernel_draws_the_tokens_numpys_float64_sums_draw():
    """A whole row's draws (the target's bonus and run tokens, a wide row's candidates) skip its empty blocks, and
    must land where numpy's sequential float64 cumsum puts them: the orchestrator draws from the support the same
    way, and a seeded request replays."""
    kernels = built_kernels()
    rng = np.random.default_rng(0)
    edges = np.array([0.0, np.nextafter(1.0, 0.0)])
    for case in range(60):
        vocab = [49152, 49155, 13146, 33, 16, 1][case % 6]
        logits = torch.from_numpy((rng.standard_normal((1, vocab)) * rng.uniform(0.5, 6)).astype(np.float32))
        top_p, top_k = [1.0, 0.9, 0.5][case % 3], [0, 0, 1, 50][case % 4]
        probs = logits_to_probs(logits, [0.3, 0.7, 1.5][case % 3], top_k, top_p)[0].numpy().copy()
        if case % 5 == 0 and vocab > 20:  # unnormalized, at block edges, denormal
            probs[:] = 0.0
            probs[[0, 15, 16, vocab - 1]] = [1e-38, 0.5, 1e-45, 0.25]
        u = np.concatenate([rng.random(64), edges])
        expected = _numpy_inverse_cdf(probs, u)
        assert kernels.inverse_cdf(torch.from_numpy(probs), u.tolist()) == expected.tolist()
        assert [sample_sparse(None, probs, float(x)) for x in u] == expected.tolist()
        ids, p = support(torch.from_numpy(probs))
        assert [sample_sparse(ids, p, float(x)) for x in u] == expected.tolist()
    exact = np.array([0.25, 0.0, 0.25, 0.5] + [0.0] * 30, np.float32)  # u * total on a sum: the next token (right)
    assert kernels.inverse_cdf(torch.from_numpy(exact), [0.25, 0.5]) == [2, 3]
    assert _numpy_inverse_cdf(exact, np.array([0.25, 0.5])).tolist() == [2, 3]
    for refused in ([0.1, np.nan, 0.2], [0.1, -0.1, 0.5], [1.0, np.inf], [0.0, 0.0]):  # numpy answers these
        assert kernels.inverse_cdf(torch.tensor(refused), [0.5]) == []
    assert sample_sparse(None, np.array([0.1, -0.1, 0.5], np.float32), 0.9) == 2  # numpy's draw, the same function


def test_uniform_is_a_pure_function_and_differs_by_position_and_purpose():
    assert uniform(7, 100, Purpose.ACCEPT) == uniform(7, 100, Purpose.ACCEPT)
    draws = {uniform(7, 100, p) for p in Purpose} | {uniform(7, 101, Purpose.ACCEPT), uniform(8, 100, Purpose.ACCEPT)}
    assert len(draws) == len(Purpose) + 2


def test_uniform_is_uniform():
    u = np.array([uniform(s, 5, Purpose.ACCEPT) for s in range(50_000)])
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    # each decile: 5000 +- 6 sigma, sigma = sqrt(50000 * 0.1 * 0.9) = 67
    assert np.all(np.abs(counts - 5000) <= 6 * 67), counts


def test_a_purposes_trials_are_its_hash_with_the_trial_mixed_in_wrapping_at_64_bits():
    """uniforms runs uniform's splitmix64 in numpy's uint64; it must wrap exactly as the masked Python integers do,
    for every bit of seeds and positions, so the target and the orchestrator draw the same candidates."""
    from specdec.sampling import _MASK64, _splitmix64, uniforms

    def reference(seed, position, purpose, trial):
        h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) ^ int(purpose))
        return (_splitmix64(h ^ trial) >> 11) * (1.0 / (1 << 53))

    for seed, position in [(0, 0), (7, 100), (2**64 - 1, 2**40 + 3), (123456789, 5)]:
        got = uniforms(seed, position, Purpose.CANDIDATE, 16)
        assert got.tolist() == [reference(seed, position, Purpose.CANDIDATE, j) for j in range(16)]
        assert len(set(got.tolist())) == 16 and np.all((got >= 0) & (got < 1))
    assert not np.array_equal(uniforms(7, 100, Purpose.CANDIDATE, 4), uniforms(7, 100, Purpose.CANDIDATE_TEST, 4))
    u = uniforms(11, 5, Purpose.CANDIDATE, 50_000)
    assert np.all(np.abs(np.histogram(u, bins=10, range=(0, 1))[0] - 5000) <= 6 * 67)


def test_candidates_are_drawn_from_the_support_as_sample_sparse_draws():
    """A candidate is sample_sparse's inverse-CDF draw, so tokens off the support or of probability 0 never come out,
    and over many seeds the candidates follow the distribution."""
    from specdec.sampling import candidates

    ids = np.array([2, 5, 9, 11], dtype=np.int64)
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    draws = np.concatenate([candidates(ids, probs, seed, 40)[0] for seed in range(4000)])  # 64,000 draws
    assert set(draws.tolist()) <= {2, 9, 11}
    counts = np.array([(draws == t).sum() for t in (2, 9, 11)])
    sigma = np.sqrt(len(draws) * probs[[0, 2, 3]] * (1 - probs[[0, 2, 3]]))
    assert np.all(np.abs(counts - len(draws) * probs[[0, 2, 3]]) <= 6 * sigma), counts
    got_ids, got_p = candidates(ids, probs, 3, 40)
    assert got_p.tolist() == [float(probs[list(ids).index(t)]) for t in got_ids]


def test_a_whole_rows_candidates_are_its_supports_candidates():
    """The target draws a wide row's candidates and bonus token without its support; the orchestrator draws from a
    row that traveled, by its support. Rows with zeros, top-p cut or not, many seeds: the same tokens."""
    from specdec.sampling import candidates

    g = torch.Generator().manual_seed(4)
    rows = logits_to_probs(torch.randn(6, 49152, generator=g) * 3, 0.8, 0, 1.0)
    rows = torch.cat([rows, logits_to_probs(torch.randn(6, 49152, generator=g) * 3, 0.8, 0, 0.9)])
    for i, row in enumerate(rows):
        ids, p = support(row)
        for seed in range(20):
            dense_ids, dense_p = candidates(None, row.numpy(), seed, 100 + i)
            sparse_ids, sparse_p = candidates(ids, p, seed, 100 + i)
            assert dense_ids.tolist() == sparse_ids.tolist() and dense_p.tolist() == sparse_p.tolist()
            u = uniform(seed, 100 + i, Purpose.RESAMPLE)
            assert sample_sparse(None, row.numpy(), u) == sample_sparse(ids, p, u)


@pytest.mark.parametrize("columns,ties", [(13146, False), (49152, True), (40, False)])
def test_a_rows_head_is_its_most_likely_columns_and_its_floor_bounds_every_other(columns, ties):
    """sampling.head: the n most likely columns ascending with their probabilities, and the largest probability of any
    column left out (0 where the row has n columns or fewer): a rejection's q bound (rejection_sampler)."""
    g = torch.Generator().manual_seed(columns)
    for _ in range(20):
        logits = torch.randn(1, columns, generator=g) * 3
        if ties:  # many equal values at the head's edge
            logits = logits.round()
        row = sampling.logits_to_probs(logits, 0.7, 0, 1.0, 0.0)[0]
        ids, p, floor = sampling.head(row)
        values = row.numpy()
        assert (np.diff(ids) > 0).all() and len(ids) == min(sampling.HEAD_TOKENS, np.count_nonzero(values))
        assert np.array_equal(p, values[ids].astype(np.float64))
        rest = np.delete(values, ids)
        assert floor == (rest.max() if len(ids) < columns else 0.0)
        assert p.min() >= floor and np.sort(values)[::-1][len(ids) - 1] == p.min()


def test_dense_and_sparse_sampling_agree_and_skip_zero_probability():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    ids, p = support(probs)
    for u in np.linspace(0, 0.999999, 101):
        t = sample_dense(probs, float(u))
        assert t in (1, 3) and t == sample_sparse(ids, p, float(u))
    g = torch.Generator().manual_seed(2)
    for _ in range(20):  # the servers draw from the support: the same token as from the whole row
        probs = logits_to_probs(torch.randn(1, 5000, generator=g) * 3, 0.8, top_p=0.95)[0]
        for u in torch.rand(50, generator=g, dtype=torch.float64).tolist():
            assert sample_sparse(*support(probs), u) == sample_dense(probs, u)


def test_a_support_over_the_limit_stays_off_the_wire():
    """A server sends a distribution in sparse form only up to --max-sparse-support tokens (ModelServer.sparse), a
    verdict's rows each by its own support (ModelServer.sparse_rows)."""
    from types import SimpleNamespace

    from specdec.model_server import ModelServer

    server = SimpleNamespace(cfg=SimpleNamespace(max_sparse_support=9))
    assert not ModelServer.sparse(server, support(torch.full((10,), 0.1))).complete
    server.cfg.max_sparse_support = 10
    sent = ModelServer.sparse(server, support(torch.full((10,), 0.1)))
    assert sent.complete and list(sent.token_ids) == list(range(10))
    rows = torch.zeros(3, 40)  # several rows at once, each judged by its own nonzero count: 10, 11 and 1
    rows[0, 5:15], rows[1, 20:31], rows[2, 39] = 0.1, 1 / 11, 1.0
    server.sparse = lambda found: ModelServer.sparse(server, found)
    sent = ModelServer.sparse_rows(server, rows)
    assert [r.complete for r in sent] == [True, False, True]
    assert list(sent[0].token_ids) == list(range(5, 15)) and list(sent[2].token_ids) == [39]


def test_nucleus_matches_a_full_sort_for_peaky_and_flat_rows(to_probs):
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(3, 5000, generator=g) * 8, torch.randn(3, 5000, generator=g) * 0.1])  # peaky, flat
    for top_p in (0.5, 0.9, 0.99):
        fast = to_probs(logits, 0.7, 0, top_p)
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
        u = uniform(seed, 77, Purpose.RESAMPLE)
        assert sample_sparse(*support(probs), u) == rs.bonus(rs.Dist.from_dense(probs.numpy()), seed, 77)


def test_likeliest_is_the_fewest_most_likely_tokens_reaching_the_mass():
    """sampling.likeliest: the shortest prefix of the support sorted by probability (ties by id) whose mass reaches
    1 - leave, likeliest first. Against a sum over every prefix."""
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(1, 40))
        p = rng.dirichlet(np.full(n, float(rng.choice([0.05, 0.5, 5.0]))))
        ids = np.sort(rng.choice(1000, n, replace=False))
        leave = float(rng.choice([0.02, 0.05, 0.3, 1.0]))
        order = sorted(range(n), key=lambda i: (-p[i], i))
        want = next((k for k in range(1, n + 1) if p[order[:k]].sum() >= 1 - leave), n)
        assert list(sampling.likeliest(ids, p, leave)) == [ids[i] for i in order[:want]], trial
