"""Train the demo target: a small DeepSeek-V3 (MLA, 1 dense + 5 MoE layers, INT4 routed experts).

    python -m train.train_target --out models/demo          # after python -m train.corpus

Phases: (1) bf16-autocast pre-training with AdamW on the train split; (2) quantisation-aware
fine-tuning of the routed experts (straight-through fake INT4, group 32, symmetric, exactly the
values ``pack_int4`` stores); (3) held-out perplexity of the bf16 and INT4 weights before and
after QAT; (4) save config.json + model.safetensors (compressed-tensors pack-quantized experts)
and check that ``TargetModel`` and ``ReferenceModel`` loaded from disk give the training
forward's logits. Loss curves go to <out>/logs/target_train.csv, numbers to
<out>/logs/target_metrics.json.

Sizes: hidden 256, 8 heads, 16 experts (top-4 of 4 groups, 2 groups kept), so TP up to 8 splits
heads and experts evenly; about 20 MB on disk (bf16 dense weights + INT4 experts).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.tree_mla import TreeAttentionMetadata, chain_mask
from services.common.checkpoint import save_tensors
from services.verifier.config import TargetConfig
from services.verifier.make_target import TINY_TARGET_CONFIG, int4_quantization_config
from services.verifier.model import ForwardBatch, TargetModel, load_checkpoint
from services.verifier.reference import ReferenceModel
from train.common import CsvLog, Schedule, device_name, load_tokens, pick_device, progress_bar, seed_everything, write_json
from train.corpus import DEFAULT_DATA_DIR
from train.modeling import TrainTarget

__all__ = ["demo_target_config", "heldout_nll", "main"]


def demo_target_config(vocab_size: int, eos_token_id: int = 0) -> dict:
    """The demo target's HF config.json (without quantization_config)."""
    cfg = copy.deepcopy(TINY_TARGET_CONFIG)
    cfg.update({
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 128,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 2048,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
    })
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=4.0, original_max_position_embeddings=512)
    return cfg


def _batch(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs and next-token targets, each [batch, seq]."""
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen).to(data.device)  # [batch]
    idx = starts[:, None] + torch.arange(seq + 1, device=data.device)  # [batch, seq+1]
    w = data[idx]
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def heldout_nll(model: TrainTarget, held: torch.Tensor, seq: int, batch: int, max_windows: int | None = None,
                autocast: bool = False) -> float:
    """Mean next-token NLL (nats) over non-overlapping ``seq`` windows of the held-out stream."""
    was_training = model.training
    model.eval()
    n = (held.numel() - 1) // seq
    if max_windows is not None:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for s in range(0, n, batch):
        rows = torch.arange(s, min(n, s + batch), device=held.device)
        idx = rows[:, None] * seq + torch.arange(seq + 1, device=held.device)  # [b, seq+1]
        w = held[idx]
        with torch.autocast(device_type=held.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits, _ = model(w[:, :-1])
        total += float(F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
        count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


def _train_phase(model: TrainTarget, opt: torch.optim.Optimizer, data: torch.Tensor, held: torch.Tensor,
                 args: argparse.Namespace, phase: str, sched: Schedule, log: CsvLog, gen: torch.Generator,
                 step0: int) -> int:
    use_amp = data.device.type == "cuda"
    bar = progress_bar(sched.steps, f"target {phase}")
    step = 0
    while not sched.done(step):
        lr = sched.lr_at(step)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = _batch(data, args.batch, args.seq, gen)
        with torch.autocast(device_type=data.device.type, dtype=torch.bfloat16, enabled=use_amp):
            logits, _ = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_router_bias(args.bias_rate)
        step += 1
        bar.update(1)
        if step % args.log_every == 0 or sched.done(step):
            row = dict(phase=phase, step=step0 + step, tokens=(step0 + step) * args.batch * args.seq,
                       loss=loss.item(), lr=lr, grad_norm=gnorm.item(), elapsed_s=sched.elapsed(), heldout_loss="")
            if step % args.eval_every == 0 or sched.done(step):
                row["heldout_loss"] = heldout_nll(model, held, args.seq, args.batch, max_windows=128, autocast=use_amp)
            log.write(**row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{lr:.2e}")
    bar.close()
    return step


def _perplexities(model: TrainTarget, config: TargetConfig, held: torch.Tensor, seq: int, batch: int) -> dict:
    """Held-out NLL/perplexity of the weights as they would be saved: bf16 experts and INT4 experts."""
    out = {}
    for name, int4 in (("bf16", False), ("int4", True)):
        m = TrainTarget.from_hf(config, model.hf_weights(int4=int4)).to(held.device).float()
        nll = heldout_nll(m, held, seq, batch)
        out[name] = {"nll": nll, "perplexity": math.exp(nll)}
        del m
    return out


def _validate(out: Path, held: torch.Tensor, n: int = 48) -> dict:
    """Reload from disk: TargetModel (fp32, absorbed MLA, paged) and ReferenceModel (fp64) vs the
    training forward, on the first ``n`` held-out tokens (CPU)."""
    config, weights = load_checkpoint(out)
    ids = held[:n].cpu()
    train = TrainTarget.from_hf(config, weights).float().eval()
    with torch.no_grad():
        t_logits = train(ids[None])[0][0].double()  # [n, V]
    ref_logits = ReferenceModel(config, weights).forward(ids)[0]  # [n, V] float64
    res: dict = {
        "tokens": n,
        "max_abs_diff_train_vs_reference": float((t_logits - ref_logits).abs().max()),
        "argmax_agree_train_vs_reference": float((t_logits.argmax(-1) == ref_logits.argmax(-1)).double().mean()),
    }
    try:
        model = TargetModel(config, weights)
        cache = model.new_cache(num_pages=8, page_size=16)
        cache.reserve("v", n)
        meta = TreeAttentionMetadata(query_starts=torch.tensor([0, n]), prefix_lens=torch.tensor([0]),
                                     page_tables=[cache.page_table("v")], tree_masks=[chain_mask(n)])
        m_logits = model(ForwardBatch(ids, torch.arange(n), meta), cache).logits.double()  # [n, V]
        res["max_abs_diff_targetmodel_vs_reference"] = float((m_logits - ref_logits).abs().max())
        res["argmax_agree_targetmodel_vs_reference"] = float((m_logits.argmax(-1) == ref_logits.argmax(-1)).double().mean())
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the weights are already saved
        res["targetmodel_error"] = f"{type(exc).__name__}: {exc}"
    if res["max_abs_diff_train_vs_reference"] > 1e-2 or res.get("max_abs_diff_targetmodel_vs_reference", 0) > 1e-2:
        print(f"target: WARNING reload check failed: {res}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/demo"))
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--max-minutes", type=float, default=2.6, help="time cap of pre-training (0: none)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--qat-steps", type=int, default=300)
    p.add_argument("--qat-max-minutes", type=float, default=0.6)
    p.add_argument("--qat-lr", type=float, default=3e-4)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="aux-loss-free router bias step")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--overrides", type=json.loads, default={}, help="JSON config overrides (tests: tiny sizes)")
    args = p.parse_args(argv)

    t_start = time.time()
    seed_everything(args.seed)
    device = pick_device(args.device)
    corpus = json.loads((args.out / "corpus.json").read_text())
    data = load_tokens(args.data / "train.npy", device)
    held = load_tokens(args.data / "heldout.npy", device)
    hf = demo_target_config(corpus["vocab_size"], corpus["eos_token_id"])
    hf.update(args.overrides)
    config = TargetConfig.from_hf(hf)
    model = TrainTarget(config, seed=args.seed).to(device).float().train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"target: {n_params / 1e6:.1f}M parameters on {device_name(device)}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed)
    log = CsvLog(args.out / "logs" / "target_train.csv",
                 ["phase", "step", "tokens", "loss", "lr", "grad_norm", "elapsed_s", "heldout_loss"])

    sched = Schedule(args.lr, args.steps, args.max_minutes * 60 or None, args.warmup)
    steps = _train_phase(model, opt, data, held, args, "pretrain", sched, log, gen, 0)
    pre_time = sched.elapsed()
    before_qat = _perplexities(model, config, held, args.seq, args.batch)
    print(f"target: pre-training {steps} steps in {pre_time:.0f}s; held-out ppl bf16 "
          f"{before_qat['bf16']['perplexity']:.3f}, INT4 (no QAT) {before_qat['int4']['perplexity']:.3f}", flush=True)

    model.qat = True
    qsched = Schedule(args.qat_lr, args.qat_steps, args.qat_max_minutes * 60 or None, warmup=20)
    qat_steps = _train_phase(model, opt, data, held, args, "qat", qsched, log, gen, steps)
    qat_time = qsched.elapsed()
    log.close()
    model.qat = False
    after_qat = _perplexities(model, config, held, args.seq, args.batch)
    print(f"target: QAT {qat_steps} steps in {qat_time:.0f}s; held-out ppl bf16 "
          f"{after_qat['bf16']['perplexity']:.3f}, INT4 {after_qat['int4']['perplexity']:.3f}", flush=True)

    hf["quantization_config"] = int4_quantization_config(config)
    hf["torch_dtype"] = "bfloat16"
    save_tensors(args.out, model.hf_weights(int4=True))
    (args.out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    validation = _validate(args.out, held)
    print(f"target: saved to {args.out}; reload check {validation}", flush=True)
    write_json(args.out / "logs" / "target_metrics.json", {
        "device": device_name(device),
        "torch": torch.__version__,
        "seed": args.seed,
        "parameters": n_params,
        "batch": args.batch,
        "seq": args.seq,
        "pretrain_steps": steps,
        "pretrain_seconds": round(pre_time, 1),
        "qat_steps": qat_steps,
        "qat_seconds": round(qat_time, 1),
        "train_tokens_seen": (steps + qat_steps) * args.batch * args.seq,
        "heldout_tokens": int(held.numel()),
        "heldout_before_qat": before_qat,
        "heldout_after_qat": after_qat,
        "reload_check": validation,
        "checkpoint_bytes": sum(f.stat().st_size for f in args.out.glob("model*.safetensors")),
        "total_seconds": round(time.time() - t_start, 1),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
