#!/usr/bin/env python3
"""PyTorch peer of `examples/bench_gpu.rs`: the same two models on the same GPU, the f32 step
against the mixed step PyTorch users write (`torch.autocast` in float16 + `torch.amp.GradScaler`).

Models (as in bench_gpu.rs):
  - MLP 512-1024-1024-10, Adam (lr 1e-4), batch 256, soft cross-entropy on one-hot labels;
  - transformer classifier: embedding 1024x512, 4 post-norm encoder blocks (8 heads, ff 2048,
    ReLU, no dropout, as dfdx's TransformerEncoderBlock), mean over the sequence, linear head;
    batch 32 x seq 128, Adam (lr 1e-4).

Steps are timed to completion (torch.cuda.synchronize), interleaved (one step of each
configuration per round), median over the rounds. The last lines are JSON, one per model.

Usage: python3 examples/gpu_peer.py [--rounds 21]
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


def mlp():
    return nn.Sequential(
        nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


class Classifier(nn.Module):
    def __init__(self, vocab=1024, dim=512, heads=8, ff=2048, layers=4, classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(
            dim, heads, ff, dropout=0.0, activation="relu", batch_first=True, norm_first=False
        )
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def f32_step(model, opt, x, y):
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def amp_step(model, opt, scaler, x, y):
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def measure(rounds, ops):
    for op in ops:  # warm-up
        op()
    torch.cuda.synchronize()
    times = [[] for _ in ops]
    for _ in range(rounds):
        for i, op in enumerate(ops):
            t = time.perf_counter()
            op()
            torch.cuda.synchronize()
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) * 1e3 for t in times]


def bench(name, build, x, y, rounds, gpu):
    torch.manual_seed(0)
    m32 = build().cuda()
    mamp = build().cuda()
    mamp.load_state_dict(m32.state_dict())
    o32 = torch.optim.Adam(m32.parameters(), lr=1e-4)
    oamp = torch.optim.Adam(mamp.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    f32_ms, amp_ms = measure(
        rounds, [lambda: f32_step(m32, o32, x, y), lambda: amp_step(mamp, oamp, scaler, x, y)]
    )
    print(f"{name}, PyTorch {torch.__version__}, {rounds} rounds, {gpu}")
    print(f"  f32       {f32_ms:8.3f} ms")
    print(f"  amp f16   {amp_ms:8.3f} ms  x{amp_ms / f32_ms:.2f} of f32")
    return {"model": name, "gpu": gpu, "rounds": rounds, "f32_ms": f32_ms, "amp_f16_ms": amp_ms}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    rounds = max(args.rounds, 21)
    gpu = torch.cuda.get_device_name(0)
    dev = torch.device("cuda")
    # the MLP's batch: normal inputs, one-hot labels (row r -> class 7r mod 10)
    x = torch.randn(256, 512, device=dev)
    y = torch.zeros(256, 10, device=dev)
    y[torch.arange(256), (torch.arange(256) * 7) % 10] = 1.0
    out = [bench("mlp", mlp, x, y, rounds, gpu)]
    tokens = torch.randint(0, 1024, (32, 128), device=dev)
    labels = torch.zeros(32, 10, device=dev)
    labels[torch.arange(32), torch.arange(32) % 10] = 1.0
    out.append(bench("transformer", Classifier, tokens, labels, rounds, gpu))
    for o in out:
        print(json.dumps(o))


if __name__ == "__main__":
    main()
