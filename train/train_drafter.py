"""Train the demo DFlash drafter against the frozen INT4 demo target.

    python -m train.train_drafter --out models/demo          # after python -m train.train_target

As DFlash is trained: the drafter learns to predict the *target's own* greedy continuation.
(1) Data: prompts are random windows of the train split (a quarter of them file starts) of
16..96 tokens; the frozen target (INT4 experts dequantised, float32) continues each greedily to
``--seq-len`` tokens, and one teacher-forced pass records its features at ``target_layer_ids``.
A second, long set does the same from prompts of 768..1152 tokens continued to ``--long-seq-len``
(1664: a 1024-token prompt plus 512 new tokens and a block), so the drafter has seen the positions
and features of long contexts; a drafter trained on short sequences alone accepted ~1.2 tokens a
step at context 1024. Every step trains on a batch of each set.
In such a sequence the token at any position L past the prompt is the target's greedy choice
given 0..L-1, exactly the bonus token the verifier hands the drafter, and the 15 tokens after it
are the target's greedy continuation, the block the drafter should propose.
(2) Training: per sequence ``--anchors`` random positions L; each block ``[token L, mask x 15]``
at positions L..L+15 attends to the features of tokens 0..L-1 and to its own block; the loss is
cross-entropy on block positions 1..15, weighted exp(-(k-1)/gamma) toward early positions (an
early miss ends the accepted path). (3) Save <out>/drafter (DFlash format) and check that
``DFlashDrafter.load`` proposes what the training forward computes. Logs go to
<out>/logs/drafter_train.csv and <out>/logs/drafter_metrics.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from services.common.checkpoint import load_tensors, save_tensors
from services.draft.dflash import DFlashDrafter
from services.draft.make_drafter import write_random_drafter
from services.verifier.model import load_checkpoint
from train.common import CsvLog, Schedule, device_name, load_tokens, pick_device, progress_bar, seed_everything, write_json
from train.corpus import DEFAULT_DATA_DIR
from train.modeling import TrainDrafter, TrainTarget

__all__ = ["GreedyData", "generate_data", "main"]


class GreedyData:
    """Target-generated sequences with their features.

    tokens:   [N, S] int64 prompt followed by the target's greedy continuation
    features: [N, S, F] target features (bf16 to save memory)
    prompt:   [N] int64 prompt length of each row (anchors start there)
    """

    def __init__(self, tokens: torch.Tensor, features: torch.Tensor, prompt: torch.Tensor) -> None:
        self.tokens, self.features, self.prompt = tokens, features, prompt


@torch.no_grad()
def generate_data(target: TrainTarget, stream: torch.Tensor, n: int, seq_len: int, min_prompt: int, max_prompt: int,
                  layer_ids: list[int], chunk: int, gen: torch.Generator, eos: int, desc: str,
                  feature_chunk: int = 256) -> GreedyData:
    """``n`` greedy rollouts of ``target`` from prompts drawn from ``stream`` (chunks share a prompt
    length); the teacher-forced feature pass takes ``feature_chunk`` rows at a time, since the
    target's dense expert compute holds rows x tokens x experts x intermediate floats."""
    dev = stream.device
    file_starts = torch.nonzero(stream[:-max_prompt - 1] == eos).flatten() + 1  # [files]
    toks, feats, prompts = [], [], []
    bar = progress_bar(n, desc)
    done = 0
    while done < n:
        b = min(chunk, n - done)
        P = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=gen))
        starts = torch.randint(0, stream.numel() - P - 1, (b,), generator=gen).to(dev)  # [b]
        use_file = (torch.rand(b, generator=gen) < 0.25).to(dev)
        pick = torch.randint(0, file_starts.numel(), (b,), generator=gen).to(dev)
        starts = torch.where(use_file, file_starts[pick], starts)
        prompt = stream[starts[:, None] + torch.arange(P, device=dev)]  # [b, P]
        cont = target.greedy(prompt, seq_len - P)  # [b, S-P]
        seq = torch.cat([prompt, cont], dim=1)  # [b, S]
        for s in range(0, b, feature_chunk):
            _, f = target(seq[s:s + feature_chunk], feature_layers=layer_ids)
            feats.append(f.to(torch.bfloat16))  # [<=feature_chunk, S, F]
        toks.append(seq)
        prompts.append(torch.full((b,), P, dtype=torch.int64, device=dev))
        done += b
        bar.update(b)
    bar.close()
    return GreedyData(torch.cat(toks), torch.cat(feats), torch.cat(prompts))


def _sample(data: GreedyData, batch: int, anchors: int, block: int, gen: torch.Generator) -> tuple:
    """Rows [b], anchors [b, K] in [prompt, S-block], labels [b, K, block-1]."""
    dev = data.tokens.device
    N, S = data.tokens.shape
    rows = torch.randint(0, N, (batch,), generator=gen).to(dev)  # [b]
    lo = data.prompt[rows]  # [b]
    span = (S - block - lo + 1).clamp_min(1)  # [b]
    u = torch.rand(batch, anchors, generator=gen).to(dev)
    L = lo[:, None] + (u * span[:, None]).long()  # [b, K]
    tokens = data.tokens[rows]  # [b, S]
    idx = L[:, :, None] + torch.arange(1, block, device=dev)  # [b, K, block-1]
    labels = tokens.gather(1, idx.flatten(1)).view_as(idx)
    return rows, L, labels


def _block_loss(drafter: TrainDrafter, data: GreedyData, batch: int, anchors: int, block: int,
                gen: torch.Generator, use_amp: bool, pos_w: torch.Tensor) -> tuple:
    """Position-weighted cross-entropy [b, K] of a random batch, with its logits and labels."""
    rows, L, labels = _sample(data, batch, anchors, block, gen)
    feats = data.features[rows]
    if not use_amp:
        feats = feats.float()
    with torch.autocast(device_type=feats.device.type, dtype=torch.bfloat16, enabled=use_amp):
        logits = drafter(feats, data.tokens[rows], L)  # [b, K, block-1, V]
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    return (ce * pos_w).sum(-1), logits, labels


def _chain_accept(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per anchor: 1 + leading block positions whose argmax is right (a budget-15 chain's acceptance)."""
    ok = (logits.argmax(-1) == labels).long()  # [b, K, block-1]
    return 1 + ok.cumprod(dim=-1).sum(dim=-1).float()  # [b, K]


@torch.no_grad()
def _evaluate(drafter: TrainDrafter, data: GreedyData, block: int, gen: torch.Generator, use_amp: bool,
              rounds: int = 8) -> dict:
    drafter.eval()
    acc, first = [], []
    for _ in range(rounds):
        rows, L, labels = _sample(data, min(64, data.tokens.shape[0]), 16, block, gen)
        feats = data.features[rows].float()
        with torch.autocast(device_type=feats.device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits = drafter(feats, data.tokens[rows], L)
        acc.append(_chain_accept(logits.float(), labels).mean())
        first.append((logits[:, :, 0].argmax(-1) == labels[:, :, 0]).float().mean())
    drafter.train()
    return {"chain_acceptance": float(torch.stack(acc).mean()), "top1_first": float(torch.stack(first).mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/demo"))
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--target-layer-ids", default="1,3,4")
    p.add_argument("--sequences", type=int, default=49152)
    p.add_argument("--heldout-sequences", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=224)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=96)
    p.add_argument("--gen-chunk", type=int, default=4096)
    p.add_argument("--long-sequences", type=int, default=4096, help="long-context rollouts (0: short set only)")
    p.add_argument("--long-heldout-sequences", type=int, default=256)
    p.add_argument("--long-seq-len", type=int, default=1664)
    p.add_argument("--long-min-prompt", type=int, default=768)
    p.add_argument("--long-max-prompt", type=int, default=1152)
    p.add_argument("--long-gen-chunk", type=int, default=512)
    p.add_argument("--long-batch", type=int, default=32, help="long sequences in each step's batch")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--max-minutes", type=float, default=3.0)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--anchors", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) at block position k")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=500)
    args = p.parse_args(argv)

    t_start = time.time()
    seed_everything(args.seed)
    device = pick_device(args.device)
    use_amp = device.type == "cuda"
    layer_ids = [int(i) for i in args.target_layer_ids.split(",")]
    target_cfg = json.loads((args.out / "config.json").read_text())
    corpus = json.loads((args.out / "corpus.json").read_text())
    config, weights = load_checkpoint(args.out)
    target = TrainTarget.from_hf(config, weights).to(device).float().eval().requires_grad_(False)
    embed, lm_head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    del weights

    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    train_stream = load_tokens(args.data / "train.npy", device)
    held_stream = load_tokens(args.data / "heldout.npy", device)
    eos = corpus["eos_token_id"]
    data = generate_data(target, train_stream, args.sequences, args.seq_len, args.min_prompt, args.max_prompt,
                         layer_ids, args.gen_chunk, gen, eos, "drafter data (train prompts)")
    held = generate_data(target, held_stream, args.heldout_sequences, args.seq_len, args.min_prompt,
                         args.max_prompt, layer_ids, args.gen_chunk, gen, eos, "drafter data (held-out prompts)")
    long_data = long_held = None
    if args.long_sequences > 0:
        long_rollouts = partial(generate_data, target, seq_len=args.long_seq_len, min_prompt=args.long_min_prompt,
                                max_prompt=args.long_max_prompt, layer_ids=layer_ids, chunk=args.long_gen_chunk,
                                gen=gen, eos=eos, feature_chunk=64)
        long_data = long_rollouts(train_stream, args.long_sequences, desc="long data (train prompts)")
        long_held = long_rollouts(held_stream, args.long_heldout_sequences, desc="long data (held-out prompts)")
        del long_rollouts   # it holds the target
    gen_seconds = time.time() - t0
    del train_stream, held_stream, target
    print(f"drafter: {data.tokens.shape[0]} + {held.tokens.shape[0]} greedy sequences of {args.seq_len} tokens, "
          f"{0 if long_data is None else long_data.tokens.shape[0]} + "
          f"{0 if long_held is None else long_held.tokens.shape[0]} of {args.long_seq_len} in {gen_seconds:.0f}s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        dcfg = write_random_drafter(Path(tmp), target_cfg, block_size=args.block, num_layers=args.layers,
                                    seed=args.seed, target_layer_ids=layer_ids,
                                    mask_token_id=corpus["mask_token_id"], num_attention_heads=args.heads,
                                    num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                                    intermediate_size=args.intermediate, dtype=torch.bfloat16)
    drafter = TrainDrafter(dcfg, embed, lm_head, seed=args.seed).to(device).train()
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {n_params / 1e6:.2f}M parameters, block {args.block}, target layers {layer_ids}", flush=True)
    decay = [p for p in drafter.parameters() if p.dim() >= 2]
    no_decay = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    k = torch.arange(1, args.block, device=device, dtype=torch.float32)
    pos_w = torch.exp(-(k - 1) / args.gamma)
    pos_w = pos_w / pos_w.sum()  # [block-1]
    log = CsvLog(args.out / "logs" / "drafter_train.csv",
                 ["step", "loss", "chain_acceptance", "lr", "elapsed_s", "heldout_chain_acceptance", "heldout_top1_first",
                  "long_heldout_chain_acceptance"])
    sched = Schedule(args.lr, args.steps, args.max_minutes * 60 or None, args.warmup)
    bar = progress_bar(args.steps, "drafter")
    step = 0
    while not sched.done(step):
        lr = sched.lr_at(step)
        for g in opt.param_groups:
            g["lr"] = lr
        ce, logits, labels = _block_loss(drafter, data, args.batch, args.anchors, args.block, gen, use_amp, pos_w)
        if long_data is not None:  # one loss over both batches' anchors
            ce_long, _, _ = _block_loss(drafter, long_data, args.long_batch, args.anchors, args.block, gen, use_amp, pos_w)
            ce = torch.cat([ce.flatten(), ce_long.flatten()])
        loss = ce.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update(1)
        if step % args.log_every == 0 or sched.done(step):
            row = dict(step=step, loss=loss.item(), chain_acceptance=float(_chain_accept(logits.detach(), labels).mean()),
                       lr=lr, elapsed_s=sched.elapsed(), heldout_chain_acceptance="", heldout_top1_first="",
                       long_heldout_chain_acceptance="")
            if step % args.eval_every == 0 or sched.done(step):
                ev = _evaluate(drafter, held, args.block, gen, use_amp)
                row.update(heldout_chain_acceptance=ev["chain_acceptance"], heldout_top1_first=ev["top1_first"])
                if long_held is not None:
                    row.update(long_heldout_chain_acceptance=_evaluate(drafter, long_held, args.block, gen,
                                                                       use_amp)["chain_acceptance"])
            log.write(**row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['chain_acceptance']:.2f}")
    bar.close()
    log.close()
    train_seconds = sched.elapsed()
    final_train = _evaluate(drafter, data, args.block, gen, use_amp)
    final_held = _evaluate(drafter, held, args.block, gen, use_amp, rounds=16)
    final_long = None if long_held is None else _evaluate(drafter, long_held, args.block, gen, use_amp, rounds=16)
    print(f"drafter: {step} steps in {train_seconds:.0f}s; chain acceptance (greedy, budget-15 chain) "
          f"train {final_train['chain_acceptance']:.2f}, held-out {final_held['chain_acceptance']:.2f}"
          + ("" if final_long is None else f", long held-out {final_long['chain_acceptance']:.2f}"), flush=True)

    out = args.out / "drafter"
    write_random_drafter(out, target_cfg, block_size=args.block, num_layers=args.layers, seed=args.seed,
                         target_layer_ids=layer_ids, mask_token_id=corpus["mask_token_id"],
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         intermediate_size=args.intermediate, dtype=torch.bfloat16)
    save_tensors(out, drafter.hf_weights(torch.bfloat16))  # the trained weights replace the random ones
    check = _validate(out, args.out, dcfg, held)
    print(f"drafter: saved to {out}; reload check {check}", flush=True)
    write_json(args.out / "logs" / "drafter_metrics.json", {
        "device": device_name(device),
        "torch": torch.__version__,
        "seed": args.seed,
        "parameters": n_params,
        "target_layer_ids": layer_ids,
        "sequences": int(data.tokens.shape[0]),
        "seq_len": args.seq_len,
        "generation_seconds": round(gen_seconds, 1),
        "steps": step,
        "train_seconds": round(train_seconds, 1),
        "chain_acceptance_train": final_train,
        "chain_acceptance_heldout": final_held,
        "long_sequences": 0 if long_data is None else int(long_data.tokens.shape[0]),
        "long_seq_len": args.long_seq_len,
        "chain_acceptance_long_heldout": final_long,
        "reload_check": check,
        "checkpoint_bytes": sum(f.stat().st_size for f in out.glob("model*.safetensors")),
        "total_seconds": round(time.time() - t_start, 1),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    })
    return 0


def _validate(drafter_dir: Path, target_dir: Path, dcfg: dict, held: GreedyData) -> dict:
    """DFlashDrafter loaded from disk (CPU, fp32) vs the training forward on the saved weights."""
    served = DFlashDrafter.load(drafter_dir, target_dir)
    tw = load_tensors(target_dir, names=["model.embed_tokens.weight", "lm_head.weight"])
    train = TrainDrafter.from_hf(dcfg, load_tensors(drafter_dir), tw["model.embed_tokens.weight"],
                                 tw["lm_head.weight"]).eval()
    feats = held.features[:1].float().cpu()  # [1, S, F]
    tokens = held.tokens[:1].cpu()
    P, S, B = int(held.prompt[0]), tokens.shape[1], served.block_size
    anchors = torch.tensor([[P, (P + S - B) // 2, S - B]])
    with torch.no_grad():
        got = torch.log_softmax(train(feats, tokens, anchors), dim=-1)[0]  # [3, B-1, V]
    diff = 0.0
    for k, L in enumerate(anchors[0].tolist()):
        ctx = served.new_context()
        served.extend_context(ctx, feats[0, :L])
        want = torch.log_softmax(served.propose([ctx], tokens[0, L:L + 1])[0].float(), dim=-1)  # [B-1, V]
        diff = max(diff, float((got[k] - want).abs().max()))
    if diff > 1e-2:
        print(f"drafter: WARNING DFlashDrafter disagrees with the training forward: max |dlogp| = {diff}", flush=True)
    return {"max_abs_logprob_diff": diff}


if __name__ == "__main__":
    raise SystemExit(main())
