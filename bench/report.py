"""report.py: turns the benchmark's results into bench.json, bench.md (the table) and bench.png
(TFLOP/s per shape and implementation, with the dense-GEMM ceiling), under the results folder."""
import json
from pathlib import Path

BASELINE_PREFIX = "torch "
FP8 = "fp8 "  # FP8 rows: "fp8 mok", "fp8 torch ..."; compared with FP8 baselines and ceiling


def _same_call(a, b):
    return a["shape"] == b["shape"] and a.get("fwd_ms") and a.get("tokens") == b.get(
        "tokens") and a.get("device") == b.get("device")


def add_ratios(results, ceiling):
    """vs_best_*: best baseline ms / this ms at the same shape (> 1: faster than every baseline);
    of_ceiling_*: TFLOP/s / the dense GEMM's (ceiling: run.py's dict, None off the GPU). FP8 rows
    are measured against the FP8 baselines ("fp8 torch ...") and the FP8 GEMM, and "fp8 mok"
    also against mok's BF16 row: vs_mok_bf16_* (fwd, bwd and step, fwd+bwd). CPU-fallback rows
    (other token count) get none."""
    for r in results:
        fp8 = r["impl"].startswith(FP8)
        prefix = FP8 + BASELINE_PREFIX if fp8 else BASELINE_PREFIX
        top = ((ceiling or {}).get("fp8") or {}) if fp8 else (ceiling or {})
        ok = [b for b in results if b["impl"].startswith(prefix) and _same_call(b, r)]
        for d in ("fwd", "bwd"):
            ms = r.get(f"{d}_ms")
            best = min((b[f"{d}_ms"] for b in ok), default=None)
            r[f"vs_best_{d}"] = best / ms if ms and best else None
            tf = r.get(f"{d}_tflops")
            r[f"of_ceiling_{d}"] = tf / top["tflops"] if tf and top.get("tflops") and \
                r.get("device") == "cuda" else None
        if r["impl"].startswith(FP8 + "mok") and r.get("fwd_ms"):
            bf = next((b for b in results if b["impl"] == r["impl"][len(FP8):] and
                       _same_call(b, r)), None)
            for d, key in (("fwd", ("fwd_ms",)), ("bwd", ("bwd_ms",)),
                           ("step", ("fwd_ms", "bwd_ms"))):
                r[f"vs_mok_bf16_{d}"] = sum(bf[k] for k in key) / sum(r[k] for k in key) \
                    if bf else None


def _f(v, fmt):
    return "–" if v is None else format(v, fmt)


def _pct(v):
    return "–" if v is None else f"{100 * v:.0f}%"


def _mhz_w(mhz, watts):
    return "–" if mhz is None else f"{mhz:.0f}, {watts:.0f}"


def _gpu(c):
    return "" if c.get("mhz") is None else f", {c['mhz']:.0f} MHz, {c['watts']:.0f} W"


def _sustained(c):
    s = c.get("sustained")
    if not s:
        return ""
    return f"; {s['reps']} in a row: {s['tflops']:.0f} TFLOP/s{_gpu(s)}"


def markdown(meta, ceiling, check, results):
    lines = [f"# mok benchmark: {meta['date']}, commit {meta['commit']}, {meta['device_name']}",
             "",
             f"torch {meta['torch']}, mok {meta['mok']}, python {meta['python']}. "
             f"Ceiling: dense bf16 GEMM {ceiling['n']}³ at {ceiling['tflops']:.0f} TFLOP/s "
             f"({ceiling['ms']:.3f} ms, {ceiling['reps']} in a row{_gpu(ceiling)}), measured in "
             f"this run{_sustained(ceiling)}. "
             f"Baseline check: {check['summary']}.",
             "",
             "Times are medians of the repeats (CUDA events after warm-up); bwd is autograd of y "
             "(dx, d_topk_weights and every weight gradient) after an untimed forward. FLOPs: fwd "
             "6·T·k·H·I + 6·T·H·I_s, bwd twice that. *vs best*: best torch baseline's ms / this "
             "ms (> 1 is faster). *ceil*: share of the dense GEMM rate. *peak*: "
             "max_memory_allocated growth over one forward+backward (mok: + its workspace). "
             "*bits*: two runs gave identical y and gradients. *MHz, W*: the GPU's mean SM "
             "clock and power during the timed forwards, and during the backward loop (which "
             "runs a forward before each timed backward), from nvidia-smi every 20 ms.",
             ""]
    for n in meta.get("notes", []):
        lines.append(f"- {n}")
    lines += ["", "| shape | impl | T | fwd ms | bwd ms | fwd TF/s | bwd TF/s | vs best fwd | "
              "vs best bwd | fwd ceil | bwd ceil | peak GiB | bits | fwd MHz, W | bwd MHz, W |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        if r.get("status", "ok") != "ok":
            lines.append(f"| {r['shape']} | {r['impl']} | {r['tokens']} | {r['status']} "
                         f"|  |  |  |  |  |  |  |  |  |  |  |")
            continue
        peak = None if r.get("peak_bytes") is None else r["peak_bytes"] / 2 ** 30
        lines.append(
            f"| {r['shape']} | {r['impl']} | {r['tokens']} | {r['fwd_ms']:.3f} | "
            f"{r['bwd_ms']:.3f} | {r['fwd_tflops']:.3g} | {r['bwd_tflops']:.3g} | "
            f"{_f(r['vs_best_fwd'], '.2f')} | {_f(r['vs_best_bwd'], '.2f')} | "
            f"{_pct(r['of_ceiling_fwd'])} | {_pct(r['of_ceiling_bwd'])} | "
            f"{_f(peak, '.2f')} | {'yes' if r['bits_equal'] else 'NO'} | "
            f"{_mhz_w(r.get('fwd_mhz'), r.get('fwd_watts'))} | "
            f"{_mhz_w(r.get('bwd_mhz'), r.get('bwd_watts'))} |")
    return "\n".join(lines + _fp8_table(ceiling, results)) + "\n"


def _fp8_table(ceiling, results):
    """The FP8 rows' ratios (issue 38's bar): fp8 mok against mok's BF16 layer and against the
    FP8 PyTorch layer, and its share of the FP8 GEMM ceiling."""
    rows = [r for r in results if r["impl"].startswith(FP8 + "mok") and r.get("fwd_ms")]
    if not rows:
        return []
    c = ceiling.get("fp8") or {}
    lines = ["", f"FP8 (DESIGN.md §8): fp8 mok against mok BF16 (its ms / fp8 mok's: > 1 is "
                 f"faster; step = fwd+bwd), against the best FP8 PyTorch layer, and of the dense "
                 f"FP8 GEMM ceiling"
             + (f" ({c['n']}³ at {c['tflops']:.0f} TFLOP/s, {c['reps']} in a row{_gpu(c)})"
                if c.get("tflops") else "") + ".", "",
             "| shape | impl | vs bf16 fwd | vs bf16 bwd | vs bf16 step | vs fp8 torch fwd | "
             "vs fp8 torch bwd | fp8 ceil fwd | fp8 ceil bwd |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['impl']} | {_f(r.get('vs_mok_bf16_fwd'), '.2f')} | "
                     f"{_f(r.get('vs_mok_bf16_bwd'), '.2f')} | "
                     f"{_f(r.get('vs_mok_bf16_step'), '.2f')} | "
                     f"{_f(r.get('vs_best_fwd'), '.2f')} | {_f(r.get('vs_best_bwd'), '.2f')} | "
                     f"{_pct(r.get('of_ceiling_fwd'))} | {_pct(r.get('of_ceiling_bwd'))} |")
    return lines


def chart(path, ceiling, results):
    """Bars of fwd+bwd TFLOP/s; returns None, or why no chart was drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    rows = [r for r in results if r.get("status", "ok") == "ok" and r.get("device") == "cuda"]
    if not rows:
        return "no GPU rows to draw"
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        vals = []
        for s in shapes:
            r = next((r for r in rows if r["shape"] == s and r["impl"] == impl), None)
            vals.append(0 if r is None else r["tflops"])
        ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=impl)
    ax.axhline(ceiling["tflops"], color="k", linestyle="--", linewidth=1,
               label=f"dense bf16 GEMM, {ceiling['reps']} in a row ({ceiling['tflops']:.0f})")
    kept = ceiling.get("sustained")
    if kept:  # the same GEMM kept up as long as a timed loop: the clock the layers run at
        ax.axhline(kept["tflops"], color="k", linestyle=":", linewidth=1,
                   label=f"the same kept up {kept['reps']} in a row ({kept['tflops']:.0f})")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=15)
    ax.set_ylabel("fwd+bwd TFLOP/s")
    ax.set_title("MoE layer, forward + backward, one GPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write(out_dir, meta, ceiling, check, results, draw=True):
    """Writes bench.json and bench.md (and with draw, bench.png, or a note of why not, an older
    bench.png removed); returns the markdown and the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if draw:
        why = chart(out / "bench.png", ceiling, results)
        if why:
            meta.setdefault("notes", []).append(f"no chart: {why}")
            (out / "bench.png").unlink(missing_ok=True)  # not this run's
        else:
            written.append(out / "bench.png")
    md = markdown(meta, ceiling, check, results)
    (out / "bench.md").write_text(md)
    (out / "bench.json").write_text(json.dumps(dict(meta=meta, ceiling=ceiling, check=check,
                                                    results=results), indent=1) + "\n")
    return md, [out / "bench.json", out / "bench.md"] + written
