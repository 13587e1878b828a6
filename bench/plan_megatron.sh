#!/usr/bin/env bash
# loom plan against Megatron-LM's published weak-scaling table (Narayanan
# et al. 2021, Table 1: 1.7B to 1008B parameters on 32 to 3072 A100s,
# sequence 2048, vocabulary 51200, full recomputation, fp16): per row the
# TFLOP/s per GPU predicted for the published layout (the planner choosing
# micro-batch, virtual stages and schedule among Megatron's) against the
# published figure, and where the published layout ranks when the planner
# searches tp, pp and dp too. The three free constants in
# configs/clusters/selene-a100.json were chosen on rows 1, 3, 5, 7 and 9
# (marked "fit"); the others are held out. `--fit` redoes that choice: a
# grid over the three (gemm_efficiency.max, gemm_efficiency.half_at_gflop,
# links.node.bandwidth_GBps), each point scored by the largest |error| on
# the fit rows (then the mean), the best five printed. `--sensitivity`
# asks whether any setting of the three constants meets both validation
# targets at once: over a wider grid (gemm_efficiency.max 0.60-0.90,
# half_at_gflop 0.01-128, the node link 200 GB/s to unlimited), every
# point's largest |error| over all ten rows and how far the planner's best
# layout is ahead of the published one in each row; the points where every
# row is within 10% and every published layout within 5% of the best are
# counted (about 2 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
LOOM=${LOOM:-build/apps/loom/loom}
CLUSTER=${CLUSTER:-configs/clusters/selene-a100.json}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 - "$LOOM" "$CLUSTER" "$work" "${1:-}" <<'PY'
import itertools, json, subprocess, sys
loom, cluster, work, mode = sys.argv[1:5]
# params (B), heads, hidden, layers, tp, pp, dp, GPUs, batch, TFLOP/s per GPU (Narayanan et al. 2021, Table 1)
rows = [
    (1.7, 24, 2304, 24, 1, 1, 32, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 32, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 32, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 32, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 32, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 32, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 24, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 15, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 9, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 6, 3072, 3072, 163),
]
def plan(model, gpus, batch, layout, top):
    out = subprocess.run([loom, "plan", "--model", model, "--cluster", cluster, "--gpus", str(gpus),
                          "--global-batch", str(batch), "--layout", layout, "--engine", "megatron-2021",
                          "--json", "--top", str(top)], capture_output=True, text=True, check=True)
    return [json.loads(l) for l in out.stdout.splitlines()]
def model_file(i, a, h, l):
    m = f"{work}/m{i}.json"
    json.dump({"model": {"n_layer": l, "n_embd": h, "n_head": a, "vocab_size": 51200, "seq_len": 2048}}, open(m, "w"))
    return m
fixed = "recompute=full,zero=0,precision=fp16"
if mode == "--fit":
    base = json.load(open(cluster))
    scored = []
    grid = itertools.product([0.70, 0.72, 0.74, 0.76, 0.78, 0.80, 0.82, 0.84], [16, 32, 48, 64, 96, 128],
                             [200, 225, 250, 275, 300])
    for mx, half, node in grid:
        c = json.loads(json.dumps(base))
        c["gpu"]["gemm_efficiency"] = {"max": mx, "half_at_gflop": half}
        c["links"]["node"]["bandwidth_GBps"] = node
        cluster = f"{work}/c.json"
        json.dump(c, open(cluster, "w"))
        errs = []
        for i, (P, a, h, l, tp, pp, dp, g, B, tf) in enumerate(rows):
            if i % 2:
                continue
            r = plan(model_file(i, a, h, l), g, B, f"tp={tp},pp={pp},dp={dp}," + fixed, 1)[0]
            errs.append(abs(r["hw_tflops_per_gpu"] / tf - 1))
        scored.append((max(errs), sum(errs) / len(errs), mx, half, node))
    scored.sort()
    print("%-5s %-14s %-11s %10s %10s" % ("max", "half_at_gflop", "node GB/s", "max |err|", "mean |err|"))
    for worst, mean, mx, half, node in scored[:5]:
        print("%-5.2f %-14d %-11d %9.1f%% %9.1f%%" % (mx, half, node, 100 * worst, 100 * mean))
    sys.exit(0)
if mode == "--sensitivity":
    base = json.load(open(cluster))
    hits, near = [], []
    print("%-5s %-14s %-11s %10s %16s %16s %17s" % ("max", "half_at_gflop", "node GB/s", "max |err|",
                                                  "39.1B error", "39.1B best +%", "other rows best +%"))
    for mx, half, node in itertools.product([0.60, 0.66, 0.72, 0.78, 0.84, 0.90],
                                            [0.01, 1, 4, 16, 64, 128], [200, 300, 600, 1200, 100000]):
        c = json.loads(json.dumps(base))
        c["gpu"]["gemm_efficiency"] = {"max": mx, "half_at_gflop": half}
        c["links"]["node"]["bandwidth_GBps"] = node
        cluster = f"{work}/c.json"
        json.dump(c, open(cluster, "w"))
        errs, gaps = [], []
        for i, (P, a, h, l, tp, pp, dp, g, B, tf) in enumerate(rows):
            m = model_file(i, a, h, l)
            r = plan(m, g, B, f"tp={tp},pp={pp},dp={dp}," + fixed, 1)[0]
            best = plan(m, g, B, fixed, 1)[0]
            errs.append(r["hw_tflops_per_gpu"] / tf - 1)
            gaps.append(best["tokens_per_s"] / r["tokens_per_s"] - 1)
        worst = max(abs(e) for e in errs)
        other = max(gaps[:4] + gaps[5:])
        print("%-5.2f %-14g %-11d %9.1f%% %+15.1f%% %15.1f%% %16.1f%%" % (
            mx, half, node, 100 * worst, 100 * errs[4], 100 * gaps[4], 100 * other), flush=True)
        if worst <= 0.10 and max(gaps) <= 0.05:
            hits.append((mx, half, node))
        if max(gaps) <= 0.05:
            near.append((worst, mx, half, node))
    print("points with every row within 10%% and every published layout within 5%% of the best: %d"
          % len(hits))
    if near:
        worst, mx, half, node = min(near)
        print("every published layout within 5%%: %d points, the closest to 10%% off at %.1f%% "
              "(max %.2f, half_at_gflop %g, node %d GB/s)" % (len(near), 100 * worst, mx, half, node))
    sys.exit(0)
print("%-7s %-4s %-14s %-26s %9s %9s %7s %5s %8s" % ("params", "", "tp pp dp", "chosen", "predicted", "published",
                                                    "error", "rank", "best +%"))
errs = {"fit": [], "held out": []}
for i, (P, a, h, l, tp, pp, dp, g, B, tf) in enumerate(rows):
    m = model_file(i, a, h, l)
    r = plan(m, g, B, f"tp={tp},pp={pp},dp={dp}," + fixed, 1)[0]
    everything = plan(m, g, B, fixed, 100000)
    rank = next(k for k, x in enumerate(everything)
                if (x["layout"]["tp"], x["layout"]["pp"], x["layout"]["dp"]) == (tp, pp, dp)) + 1
    gap = everything[0]["tokens_per_s"] / r["tokens_per_s"] - 1
    err = r["hw_tflops_per_gpu"] / tf - 1
    split = "fit" if i % 2 == 0 else "held out"
    errs[split].append(abs(err))
    L = r["layout"]
    print("%-7s %-4s %-14s %-26s %9.1f %9d %+6.1f%% %5d %7.1f%%" % (
        P, "fit" if split == "fit" else "", f"{tp} {pp} {dp}",
        f"micro {L['micro']} {L['schedule']} v {L['v']}", r["hw_tflops_per_gpu"], tf, 100 * err, rank, 100 * gap))
for k, v in errs.items():
    print("%-8s rows: mean |error| %.1f%%, max %.1f%%" % (k, 100 * sum(v) / len(v), 100 * max(v)))
PY
