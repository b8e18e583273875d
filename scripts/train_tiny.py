"""Train the bundled tiny DeepSeek-V3 (MLA + MoE) with quantship's own model definition.

Runs on the GPU machine (the `device` tool) in a few minutes:

    PYTHONPATH=src python3 scripts/train_tiny.py --corpus data/corpus/train.txt.xz \
        --tokenizer src/quantship/models/assets/tiny --out /tmp/tiny --minutes 8

The corpus is built by scripts/build_corpus.py (documents separated by `<|endoftext|>` lines).
Routing is balanced DeepSeek-V3's way, without an auxiliary loss: after each step the
e_score_correction_bias of every router moves toward under-used experts. The output is a
standard checkpoint (bf16 safetensors shards of at most 15 MB, config.json in DeepSeek-V3's
format, tokenizer files) plus train_report.json with tokens, minutes and losses.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from quantship.models.causal_lm import CausalLM
from quantship.models.config import config_from_dict
from quantship.models.deepseek import Router

TINY_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 8192,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
SHARD_BYTES = 15 * 2**20


def tokenize_corpus(corpus: Path, tokenizer_dir: Path) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.no_padding()
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    text = lzma.open(corpus, "rt", encoding="utf-8").read()
    docs = [d.strip("\n") for d in text.split("\n<|endoftext|>\n") if d.strip()]
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=True):  # BOS + document
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def init_weights(model: CausalLM, std: float) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            torch.nn.init.ones_(p)
        elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            # Residual-branch outputs start small so the residual stream is not swamped (GPT-2's trick).
            torch.nn.init.normal_(p, std=std / math.sqrt(2 * model.config.num_hidden_layers))
        else:
            torch.nn.init.normal_(p, std=std)


@torch.no_grad()
def evaluate(model: CausalLM, ids: torch.Tensor, seq: int, device: str, batch: int = 16) -> float:
    model.eval()
    n = (len(ids) - 1) // seq
    total, count = 0.0, 0
    for start in range(0, n, batch):
        rows = torch.stack([ids[i * seq:(i + 1) * seq + 1] for i in range(start, min(n, start + batch))]).long()
        rows = rows.to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(rows[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum").item()
        count += rows[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def save_checkpoint(model: CausalLM, out: Path, tokenizer_dir: Path | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in model.state_dict().items():
        keep_fp32 = name.endswith("e_score_correction_bias")
        state[name] = t.detach().to("cpu", torch.float32 if keep_fp32 else torch.bfloat16).contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    (out / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2) + "\n"
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if tokenizer_dir is not None and (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer.json")
    ap.add_argument("--eval-text", type=Path, help="held-out text (default: eval.txt beside the tokenizer)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="training time budget")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bias-rate", type=float, default=1e-3, help="router bias update speed (aux-loss-free balance)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tokenizer-copy", action="store_true", help="write weights and config only")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True

    t0 = time.time()
    train_ids = tokenize_corpus(args.corpus, args.tokenizer)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    eval_path = args.eval_text or args.tokenizer / "eval.txt"
    eval_ids = torch.tensor(tok.encode(eval_path.read_text(encoding="utf-8")).ids, dtype=torch.int32)
    print(f"tokenized {len(train_ids):,} train tokens, {len(eval_ids):,} held-out, in {time.time() - t0:.0f}s",
          flush=True)

    config = config_from_dict(TINY_CONFIG)
    model = CausalLM(config)
    init_weights(model, TINY_CONFIG["initializer_range"])
    model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {params:,}", flush=True)

    routers = [m for m in model.modules() if isinstance(m, Router)]
    loads: dict[int, torch.Tensor] = {}

    def count_load(module, _inp, out):
        loads[id(module)] = torch.bincount(out[1].flatten(), minlength=module.experts)

    for r in routers:
        r.register_forward_hook(count_load)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device == "cuda",
    )
    budget = args.minutes * 60
    warmup = 100
    gen = torch.Generator().manual_seed(args.seed)
    n_windows = len(train_ids) - args.seq_len - 1
    step, seen, losses, start = 0, 0, [], time.time()
    history = []
    while True:
        elapsed = time.time() - start
        if elapsed >= budget:
            break
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_windows, (args.batch,), generator=gen)
        rows = torch.stack([train_ids[s:s + args.seq_len + 1] for s in starts.tolist()]).long().to(device)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for r in routers:
                load = loads[id(r)].float()
                r.e_score_correction_bias += args.bias_rate * torch.sign(load.mean() - load)
        step += 1
        seen += rows[:, 1:].numel()
        losses.append(loss.item())
        if step % 200 == 0:
            recent = sum(losses[-200:]) / len(losses[-200:])
            history.append({"step": step, "tokens": seen, "train_loss": recent, "minutes": (time.time() - start) / 60})
            print(f"step {step} tokens {seen:,} loss {recent:.3f} lr {lr:.2e} "
                  f"{seen / (time.time() - start):,.0f} tok/s", flush=True)

    minutes = (time.time() - start) / 60
    train_loss = sum(losses[-200:]) / len(losses[-200:])
    held_out = evaluate(model, eval_ids, args.seq_len, device)
    train_sample = evaluate(model, train_ids[: len(eval_ids)], args.seq_len, device)
    save_checkpoint(model, args.out, None if args.no_tokenizer_copy else args.tokenizer)
    counts = {i: loads[id(r)].tolist() for i, r in enumerate(routers)}
    report = {
        "parameters": params,
        "train_tokens_distinct": len(train_ids),
        "tokens_seen": seen,
        "epochs": seen / len(train_ids),
        "steps": step,
        "minutes": minutes,
        "tokens_per_second": seen / (minutes * 60),
        "train_loss_last200": train_loss,
        "train_sample_loss": train_sample,
        "heldout_loss": held_out,
        "heldout_ppl": math.exp(held_out),
        "heldout_tokens": len(eval_ids),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "last_step_expert_load": counts,
        "history": history,
    }
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("history", "last_step_expert_load")}, indent=2))


if __name__ == "__main__":
    main()
