"""PyTorch reference for loom's GPT-2 trainer: CPU training throughput.

Builds a float32 GPT-2 (pre-LayerNorm blocks, fused qkv attention, tanh-GELU
MLP, LM head tied to a vocab-padded token embedding) from a loom JSON config,
then trains it with AdamW and gradient clipping at 1.0 on random token ids.
Each optimizer step (gradient_accumulation_steps micro-batches) is timed with
time.perf_counter(); the first --warmup steps are discarded and the median of
the rest is reported as one JSON line on stdout.

With --autocast bf16 the forward pass and the loss run under
torch.autocast("cpu", torch.bfloat16) (bf16 GEMMs with f32 accumulation,
f32 master weights and optimizer), PyTorch's mixed-precision recipe on CPU.

Run with Debian's interpreter, which has torch:
    /usr/bin/python3 bench/torch_gpt.py --config FILE.json --steps N --warmup W --threads T [--autocast bf16]
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, seq_len, dropout):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, seq_len, seq_len), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, seq_len, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, seq_len, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_embd, n_head, vocab_size, seq_len, dropout):
        super().__init__()
        self.vocab_size = vocab_size
        padded_vocab = (vocab_size + 127) // 128 * 128
        self.wte = nn.Embedding(padded_vocab, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(
            Block(n_embd, n_head, seq_len, dropout) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd)
        self.apply(init_weights)

    def forward(self, idx, targets):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        logits = logits[..., : self.vocab_size]
        return F.cross_entropy(logits.reshape(-1, self.vocab_size), targets.reshape(-1))


def init_weights(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="loom JSON config")
    p.add_argument("--steps", type=int, required=True, help="total optimizer steps")
    p.add_argument("--warmup", type=int, default=1, help="leading steps excluded from timing")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--autocast", choices=["none", "bf16"], default="none",
                   help="run forward and loss under torch.autocast with this dtype")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


def load_config(path):
    with open(path) as f:
        cfg = json.load(f)
    m = cfg["model"]
    opt = cfg.get("optimizer", {}).get("params", {})
    return {
        "batch": cfg["train_micro_batch_size_per_gpu"],
        "accum": cfg.get("gradient_accumulation_steps", 1),
        "seed": cfg.get("train", {}).get("seed", 1234),
        "model": {
            "n_layer": m["n_layer"],
            "n_embd": m["n_embd"],
            "n_head": m["n_head"],
            "vocab_size": m["vocab_size"],
            "seq_len": m["seq_len"],
            "dropout": m.get("dropout", 0.0),
        },
        "adamw": {
            "lr": opt.get("lr", 3e-4),
            "betas": tuple(opt.get("betas", (0.9, 0.95))),
            "eps": opt.get("eps", 1e-8),
            "weight_decay": opt.get("weight_decay", 0.1),
        },
    }


def train_step(model, optimizer, gen, cfg, autocast):
    vocab, T = cfg["model"]["vocab_size"], cfg["model"]["seq_len"]
    accum = cfg["accum"]
    total = 0.0
    for _ in range(accum):
        tokens = torch.randint(0, vocab, (cfg["batch"], T + 1), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens[:, :-1], tokens[:, 1:]) / accum
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    torch.manual_seed(cfg["seed"])
    gen = torch.Generator().manual_seed(cfg["seed"])

    model = GPT(**cfg["model"])
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), **cfg["adamw"])

    times, loss = [], float("nan")
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, gen, cfg, args.autocast == "bf16")
        times.append(time.perf_counter() - t0)

    step_time = statistics.median(times[args.warmup:])
    tokens_per_step = cfg["batch"] * cfg["model"]["seq_len"] * cfg["accum"]
    print(json.dumps({
        "impl": "pytorch",
        "torch_version": torch.__version__,
        "threads": args.threads,
        "autocast": args.autocast,
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_step / step_time,
        "final_loss": loss,
        "params": sum(p.numel() for p in model.parameters()),
    }))


if __name__ == "__main__":
    main()
