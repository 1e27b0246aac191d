"""GPU check of the sampler (`services.verifier.sampling.posterior_tokens`): Gumbel-max draws with
noise keyed by seed, token index and token id. On the GPU: the same tokens as the CPU at the same
keys (the hash's wrapping products and the float math on both; a near tie may round apart), the
draws' distribution against the softmax, how many draws a bf16-sized jitter of the logits moves,
and the time of one request's draw at K2 / DeepSeek-V3 vocabularies (the sampled rows of a step,
per request).

    python -m bench.sampling_check --commit <sha> --out <dir>/sampling-check.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import write_result
from services.verifier.sampling import Sampling, _filter_top_k, _filter_top_p, gumbel_noise, posterior_tokens, token_keys

SHAPES = [(163840, 129), (163840, 17), (129280, 33), (512, 4096)]   # (vocabulary, rows)


def _ms(fn) -> float:
    """Milliseconds a call, the mean of 20 after one, synchronised."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) / 20 * 1e3, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    sampling = Sampling(temperature=0.9, top_p=0.95)
    rows = []
    for vocab, n in SHAPES:
        logits = (torch.randn(n, vocab, generator=g) * 3).to("cuda", torch.bfloat16)
        keys = torch.from_numpy(token_keys(7, np.arange(n))).cuda()
        gpu = posterior_tokens(logits, sampling, keys).cpu()
        cpu = posterior_tokens(logits.cpu(), sampling, keys.cpu())
        jitter = (logits.float() * (1 + 2.0 ** -8 * torch.randn(logits.shape, device="cuda"))).to(torch.bfloat16)
        moved = int((posterior_tokens(jitter, sampling, keys).cpu() != gpu).sum())
        parts = {"ms": lambda: posterior_tokens(logits, sampling, keys),   # the whole draw, and two of its parts:
                 "filters_ms": lambda: _filter_top_p(_filter_top_k(logits.float() / sampling.temperature,
                                                                   sampling.top_k), sampling.top_p),
                 "noise_ms": lambda: gumbel_noise(keys, vocab)}
        rows.append(dict(check="draw", vocab=vocab, rows=n, equal_to_cpu=int((gpu == cpu).sum()), moved_by_jitter=moved,
                         **{name: _ms(fn) for name, fn in parts.items()}))
        print(rows[-1], flush=True)
    vocab, draws = 6, 200_000
    logits = torch.randn(vocab, generator=g)
    keys = torch.from_numpy(token_keys(3, np.arange(draws))).cuda()
    out = posterior_tokens(logits.cuda().expand(draws, -1), Sampling(temperature=1.0), keys)
    empirical = torch.bincount(out, minlength=vocab).double().cpu() / draws
    tv = 0.5 * (empirical - torch.softmax(logits.double(), -1)).abs().sum().item()
    rows.append(dict(check="distribution", vocab=vocab, rows=draws, total_variation=round(tv, 5),
                     passed=tv < 0.005))   # the null's TV at 200k draws of 6 tokens is ~0.002
    print(rows[-1], flush=True)
    write_result(args.out, args.commit, dict(temperature=0.9, top_p=0.95, shapes=SHAPES), rows)
    return 0 if rows[-1]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
