"""Tree acceptance walks and posterior sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from services.verifier.acceptance import Acceptance, accept
from services.verifier.sampling import Sampling, gumbel_noise, posterior_tokens, token_keys

#  Hand-built tree used below (index: token):
#          0:100
#         /      \
#      1:11      2:12
#      /  \         \
#   3:21  4:22      5:23
#    |
#   6:31
TOKENS = torch.tensor([100, 11, 12, 21, 22, 23, 31])
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])


def test_no_child_matches_gives_only_the_bonus() -> None:
    posterior = torch.tensor([99, 0, 0, 0, 0, 0, 0])
    result = accept(TOKENS, PARENTS, posterior)
    assert result == Acceptance(path=[0], tokens=[99])
    assert result.num_accepted == 0


def test_whole_deepest_path_accepted() -> None:
    posterior = torch.tensor([11, 21, 0, 31, 0, 0, 77])
    result = accept(TOKENS, PARENTS, posterior)
    assert result.path == [0, 1, 3, 6]
    assert result.tokens == [11, 21, 31, 77]
    assert result.num_accepted == 3


def test_second_child_matches() -> None:
    posterior = torch.tensor([12, 21, 23, 0, 0, 5, 0])  # node 1's posterior is irrelevant
    result = accept(TOKENS, PARENTS, posterior)
    assert result.path == [0, 2, 5]
    assert result.tokens == [12, 23, 5]


def test_branch_second_grandchild_matches() -> None:
    posterior = torch.tensor([11, 22, 0, 0, 8, 0, 0])
    assert accept(TOKENS, PARENTS, posterior) == Acceptance(path=[0, 1, 4], tokens=[11, 22, 8])


def test_single_node_tree() -> None:
    result = accept(torch.tensor([5]), torch.tensor([-1]), torch.tensor([42]))
    assert result == Acceptance(path=[0], tokens=[42])


def test_padding_nodes_are_ignored() -> None:
    tokens = torch.tensor([100, 11, 0, 0])
    parents = torch.tensor([-1, 0, -1, -1])  # nodes 2, 3 are padding (token 0)
    posterior = torch.tensor([0, 3, 0, 0])  # root's choice 0 must not match padding
    assert accept(tokens, parents, posterior) == Acceptance(path=[0], tokens=[0])


def _walk_by_scanning(tokens: list[int], parents: list[int], posterior: list[int]) -> Acceptance:
    """The definition, slowly: from the current node, the first child (lowest index) whose token
    is the posterior there; stop when none is."""
    path, out, cur = [0], [], 0
    while True:
        kids = [c for c in range(len(tokens)) if parents[c] == cur and c > cur and tokens[c] == posterior[cur]]
        if not kids:
            return Acceptance(path=path, tokens=out + [posterior[cur]])
        cur = kids[0]
        path.append(cur)
        out.append(tokens[cur])


def test_random_trees_match_the_definition() -> None:
    """Small vocabularies make duplicate siblings common; the posterior mostly picks one of a
    node's children, so walks go deep. Malformed parents (-1 padding, or a node itself or after
    it) must never be followed: they are planted where following them would change the walk (a
    node of the path's posterior token under a path node, and padding under the last node, which
    a Python index of -1 reads). Each case must occur (with a random posterior, five of six trees
    of the first version accepted only their root)."""
    seen = {"deep": 0, "duplicate on path": 0, "forward parent planted": 0, "padding planted": 0}
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        n = int(torch.randint(2, 60, (1,), generator=g))
        vocab = 2 + seed % 5
        parents = [-1] + [int(torch.randint(0, c, (1,), generator=g)) for c in range(1, n)]
        tokens = torch.randint(0, vocab, (n,), generator=g).tolist()
        posterior = torch.randint(0, vocab, (n,), generator=g).tolist()
        for p in range(n):
            kids = [c for c in range(1, n) if parents[c] == p]
            if kids and float(torch.rand((), generator=g)) < 0.8:
                posterior[p] = tokens[kids[int(torch.randint(0, len(kids), (1,), generator=g))]]
        path = _walk_by_scanning(tokens, parents, posterior).path
        off_path = [c for c in range(1, n) if c not in path]
        if off_path and seed % 2:      # a node at or before a path node, pointing at it
            p = path[int(torch.randint(0, len(path), (1,), generator=g))]
            before = [c for c in off_path if c <= p]
            if before:
                parents[before[0]], tokens[before[0]] = p, posterior[p]
                seen["forward parent planted"] += 1
        off_path = [c for c in range(1, n) if c not in path and parents[c] >= 0]
        if off_path and path[-1] == n - 1:
            parents[off_path[0]], tokens[off_path[0]] = -1, posterior[n - 1]
            seen["padding planted"] += 1
        want = _walk_by_scanning(tokens, parents, posterior)
        assert accept(torch.tensor(tokens), torch.tensor(parents), torch.tensor(posterior)) == want, seed
        assert accept(tokens, parents, posterior) == want, seed   # host lists, as the engine passes
        seen["deep"] += len(want.path) >= 4
        seen["duplicate on path"] += any(
            sum(1 for c in range(n) if parents[c] == node and c > node and tokens[c] == posterior[node]) > 1
            for node in want.path)
    assert all(v >= 3 for v in seen.values()), seen


def test_sampling_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        Sampling(temperature=1.0, top_k=-1)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    out = posterior_tokens(logits, Sampling(), None)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))


def _keys(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(token_keys(seed, np.arange(n)))


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(1))
    sampling = Sampling(temperature=0.8, top_p=0.9, top_k=40, seed=123)
    first = posterior_tokens(logits, sampling, _keys(32, 123))
    assert torch.equal(first, posterior_tokens(logits, sampling, _keys(32, 123)))
    assert not torch.equal(first, posterior_tokens(logits, sampling, _keys(32, 124)))
    with pytest.raises(ValueError, match="one key a row"):
        posterior_tokens(logits, sampling, _keys(31, 123))


def test_token_keys_are_keyed_by_all_64_bits_of_the_seed_and_by_index() -> None:
    """Seeds that differ only above bit 32 (a CPU generator kept the low 32 bits) draw apart; an
    index keys the same wherever it is asked for."""
    for low, high in ((7, 2**32 + 7), (1, 2**63 + 1), (5, 2**62 + 5), (0, 2**64 - 2**32)):
        assert not np.array_equal(token_keys(low, range(16)), token_keys(high, range(16))), (low, high)
    keys = token_keys(11, np.arange(1000))
    assert token_keys(11, [700, 3]).tolist() == [keys[700], keys[3]]
    assert token_keys([11, 11, 12], [700, 3, 3]).tolist()[:2] == [keys[700], keys[3]]
    assert len(set(keys.tolist())) == 1000
    assert np.array_equal(token_keys(-1, [5]), token_keys(2**64 - 1, [5]))


def test_token_keys_are_splitmix64_of_the_mixed_seed_advanced_by_index_plus_one() -> None:
    """The key schedule in plain Python integers: a seeded request's tokens are a function of it,
    so any change (an index offset, a constant) silently re-draws every seeded output a user kept."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        return z ^ (z >> 31)

    for seed in (0, 11, 2**63 + 5, 2**64 - 1):
        for index in (0, 1, 700, 2**20):
            want = mix((mix(seed) + (index + 1) * 0x9E3779B97F4A7C15) & (2**64 - 1))
            assert int(token_keys(seed, [index])[0]) & (2**64 - 1) == want, (seed, index)


def test_the_inverse_temperature_is_the_float32_every_path_scales_by() -> None:
    """The reference, the torch path and the GPU kernel multiply by the same float32 of 1 / T, so
    their draws agree bit for bit; a double 1 / T here parted from the kernel's float32."""
    from services.verifier.sampling import inverse_temperature
    for t in (0.7, 1.3, 0.01, 1.0):
        inv = inverse_temperature(t)
        assert inv == float(np.float32(1.0 / t)) and float(np.float32(inv)) == inv
    assert inverse_temperature(0.7) != 1.0 / 0.7   # (not representable in float32: it was rounded)


def _noise_reference(key: int, vocab: int) -> np.ndarray:
    """`gumbel_noise` for one key in plain Python integers (no wrapping arithmetic to trust)."""
    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    key &= 2**64 - 1
    low, high = key & 0xFFFFFFFF, key >> 32
    h = [mix(mix((t * 0x9E3779B9 + low) & 0xFFFFFFFF) ^ high) for t in range(vocab)]
    u = (np.array(h, dtype=np.float64) + 0.5) * 2.0 ** -32
    return -np.log(-np.log(u))


def test_the_noise_is_the_reference_hash_and_looks_gumbel() -> None:
    """The torch hash multiplies int64 words past 2**63 (wrapping); the reference does it in exact
    integers. The noise of many keys has Gumbel's mean (Euler's constant) and variance (pi^2 / 6),
    and neighbouring tokens' noise is uncorrelated."""
    keys = torch.from_numpy(token_keys([3, 2**63 + 5, 2**64 - 1], [0, 9, 123456]))
    noise = gumbel_noise(keys, 300)
    for row, key in enumerate(keys.tolist()):
        assert np.allclose(noise[row].numpy(), _noise_reference(key, 300), rtol=0, atol=1e-9)   # logs' ulps apart
    g = gumbel_noise(_keys(200, 4), 1000).flatten().numpy()   # 200k draws
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - math.pi ** 2 / 6) < 0.03
    assert abs(np.corrcoef(g[:-1], g[1:])[0, 1]) < 0.01


def test_a_draw_moves_only_where_two_tokens_nearly_tie() -> None:
    """Rounding noise on every logit (bf16-sized, 1e-2) changes few draws: a token's noise is its
    own. An inverse CDF in vocabulary order moved with every earlier token's rounding."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 4096, generator=g) * 2
    jitter = logits + 1e-2 * torch.randn(logits.shape, generator=g)
    keys, s = _keys(2000, 8), Sampling(temperature=1.0)
    moved = (posterior_tokens(logits, s, keys) != posterior_tokens(jitter, s, keys)).float().mean().item()
    assert moved < 0.05, moved


def test_a_row_of_nan_or_inf_logits_is_refused_not_drawn_past_the_vocabulary() -> None:
    """The CDF's total was NaN and the search returned V, one past the vocabulary: a token id the
    client got and the drafter indexed its embedding with (multinomial had refused such rows)."""
    for bad in (float("nan"), float("inf")):
        logits = torch.randn(2, 10)
        logits[1, 3] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            posterior_tokens(logits, Sampling(temperature=1.0), _keys(2, 0))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_and_tiny_top_p_are_greedy(temperature: float) -> None:
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(2))
    greedy = logits.argmax(dim=-1)
    u = _keys(64, 9)
    assert torch.equal(posterior_tokens(logits, Sampling(temperature=temperature, top_k=1), u), greedy)
    assert torch.equal(posterior_tokens(logits, Sampling(temperature=temperature, top_p=1e-6), u), greedy)


def test_filters_restrict_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)  # [n, 4]
    u = _keys(4000, 4)
    top_k = posterior_tokens(logits, Sampling(temperature=1.0, top_k=2), u)
    assert set(top_k.tolist()) == {0, 1}
    # top_p=0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it -> {0, 1}.
    top_p = posterior_tokens(logits, Sampling(temperature=1.0, top_p=0.7), u)
    assert set(top_p.tolist()) == {0, 1}


def test_samples_follow_softmax() -> None:
    logits = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 1.5  # [V]
    draws = 20000
    out = posterior_tokens(logits.expand(draws, -1), Sampling(temperature=1.0), _keys(draws, 6))
    empirical = torch.bincount(out, minlength=8).double() / draws  # [V]
    expected = torch.softmax(logits.double(), dim=-1)  # [V]
    total_variation = 0.5 * (empirical - expected).abs().sum().item()
    assert total_variation < 0.02


def test_sampling_at_the_ends_of_the_temperature_range_draws_valid_tokens() -> None:
    """Logits of either sign and large size, divided by the smallest and largest temperature a
    request may ask for, still give a softmax to draw from (the bounds the scheduler enforces)."""
    from services.common.settings import TEMPERATURE_RANGE

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 512, generator=g) * 300
    logits[:, :8] = float("-inf")   # filtered entries stay out at any temperature
    for t in TEMPERATURE_RANGE:
        tokens = posterior_tokens(logits.to(torch.bfloat16), Sampling(temperature=t, top_p=0.9, top_k=50),
                                  _keys(64, 0))
        assert tokens.shape == (64,) and bool(((tokens >= 8) & (tokens < 512)).all())
    assert torch.equal(posterior_tokens(logits, Sampling(temperature=TEMPERATURE_RANGE[0]), _keys(64, 1)),
                       logits.argmax(-1))
    with pytest.raises(ValueError):
        Sampling(temperature=TEMPERATURE_RANGE[0] / 2)


def test_a_tiny_temperature_still_samples_between_exactly_tied_tokens() -> None:
    """Only T = 0 is greedy: at T = 1e-4 two tied logits (common in bf16) are each drawn by the
    seed's noise, not the lower id every time, as a cut-off that served small T greedily would."""
    logits = torch.zeros(2000, 8)
    logits[:, 3] = logits[:, 5] = 1.0
    keys = torch.from_numpy(token_keys(7, np.arange(2000)))
    for t in (1e-4, 5e-4):
        counts = torch.bincount(posterior_tokens(logits, Sampling(temperature=t), keys), minlength=8)
        assert counts[3] > 800 and counts[5] > 800 and counts[3] + counts[5] == 2000, (t, counts)


def test_the_noise_is_added_in_float64_so_near_ties_follow_the_exact_sum() -> None:
    """The documented rule is argmax(logits / T + noise) with the sum in float64; in float32 a
    token winning by less than a float32 ulp of the noise would lose on the CPU and not on the GPU."""
    n = 4000
    keys = torch.from_numpy(token_keys(3, np.arange(n)))
    noise = gumbel_noise(keys, 2)
    gap = (noise[:, 0] - noise[:, 1]).float()   # token 1's logit: just past what it needs to win
    gap = torch.where(gap.double() <= noise[:, 0] - noise[:, 1], torch.nextafter(gap, torch.tensor(float("inf"))), gap)
    logits = torch.stack([torch.zeros(n), gap], dim=1)
    want = (logits.double() + noise).argmax(-1)
    assert bool((want == 1).all())
    assert torch.equal(posterior_tokens(logits, Sampling(temperature=1.0), keys), want)
