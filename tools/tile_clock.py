"""tile_clock.py: the table of tools/tile-clock.sh from a `mok bench` log of a tile-clock build:
per GEMM product of one forward and one backward, the medians over the calls of the bench of
what src/cuda/tile_clock.cuh prints (cycles per tile, per consumer warpgroup; the SM clock;
the producer's waiting share).
Usage: python3 tools/tile_clock.py SHAPE FILE"""
import re
import statistics
import sys

LINE = re.compile(r"tile clock \| (?P<what>[^|]+?) \| product (?P<p>\d) \| tiles (?P<tiles>\d+) \| "
                  r"k-blocks/tile (?P<kb>[\d.]+) \| cycles/tile: k-loop (?P<kloop>[\d.]+), "
                  r"epilogue (?P<epi>[\d.]+), before (?P<gap>[\d.]+) \| "
                  r"k-loop cycles/k-block (?P<per>[\d.]+) \| SM MHz (?P<mhz>[\d.]+) \| "
                  r"producer waiting (?P<pwait>[\d.]+)")
FORWARD = ["gate/up", "shared gate/up", "down", "shared down"]
FIELDS = ("kb", "kloop", "epi", "gap", "per", "mhz", "pwait")


def table(shape, text):
    """The markdown table of one log's text (raises SystemExit if it has no tile-clock lines)."""
    runs = {}  # (what, product, tiles) -> list of field dicts, in order of first appearance
    for m in LINE.finditer(text):
        key = (m["what"], int(m["p"]), int(m["tiles"]))
        runs.setdefault(key, []).append({k: float(m[k]) for k in FIELDS})
    if not runs:
        raise SystemExit("no tile-clock lines (not a tile-clock build?)")
    calls = max(map(len, runs.values()))
    out = [f"{shape}: cycles a tile, per consumer warpgroup (medians over {calls} calls)",
           "| product | tiles | k-blocks | k-loop | a k-block | epilogue | before | k-loop share "
           "| SM MHz | producer waiting |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (what, p, tiles), rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        name = f"forward {FORWARD[p]}" if what == "forward" else what
        total = med["kloop"] + med["epi"] + med["gap"]
        out.append(f"| {name} | {tiles} | {med['kb']:.1f} | {med['kloop']:.0f} | "
                   f"{med['per']:.0f} | {med['epi']:.0f} | {med['gap']:.0f} | "
                   f"{med['kloop'] / total:.2f} | {med['mhz']:.0f} | {med['pwait']:.2f} |")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(table(sys.argv[1], open(sys.argv[2]).read()))
