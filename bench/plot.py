"""Draws the benchmark ratios as horizontal bars: one panel per case, one bar per method.

    python bench/plot.py bench/results/*.json -o bench/results/ratios.png

Reads the JSON that bench/collectives.py and bench/training.py write (through
_common.report: {case title: {baseline, ranks, median_ms, ratio, targets}}). Each bar is a
method's median divided by its case's baseline (the baseline is the dashed line at 1.0); a
method with a target gets a black tick at the target and is green or red by whether it meets
it; each bar is labelled with its ratio and its median time.

Needs matplotlib, a dependency of the benchmarks only (not of hvdlite, not in setup.py):
``pip install matplotlib``.
"""

import argparse
import json
import os
import sys

MEETS, MISSES, PLAIN, BASE, TARGET = "#2e7d32", "#c62828", "#90a4ae", "#546e7a", "#111111"


def load(paths):
    """{case title: case dict}, from every file in order; a title seen in an earlier file gets
    the later file's name appended (the two-host runs repeat the training titles)."""
    cases = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise SystemExit(f"{path}: expected a JSON object of cases, got {type(data).__name__}")
        for title, case in data.items():
            missing = {"baseline", "ratio", "median_ms"} - set(case)
            if missing:
                raise SystemExit(f"{path}: case '{title}' lacks {', '.join(sorted(missing))}")
            if title in cases:
                named = f"{title} [{os.path.splitext(os.path.basename(path))[0]}]"
                title, n = named, 2
                while title in cases:  # the same file twice, or two files of one name
                    title, n = f"{named} ({n})", n + 1
            cases[title] = case
    if not cases:
        raise SystemExit("no cases in " + ", ".join(paths))
    return cases


def bar_color(name, case):
    target = case.get("targets", {}).get(name)
    if name == case["baseline"]:
        return BASE
    if target is None:
        return PLAIN
    return MEETS if case["ratio"][name] <= target else MISSES


def format_ms(ms):
    if ms >= 100:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.3f} ms"


def draw(cases, out, title=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    heights = [len(case["ratio"]) * 0.42 + 0.9 for case in cases.values()]
    fig, axes = plt.subplots(len(cases), 1, figsize=(10, sum(heights) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (case_title, case) in zip(axes[:, 0], cases.items()):
        names = list(case["ratio"])[::-1]  # first method on top
        ratios = [case["ratio"][n] for n in names]
        ys = range(len(names))
        ax.barh(ys, ratios, color=[bar_color(n, case) for n in names], height=0.6)
        ax.set_yticks(list(ys), names, fontsize=9)
        ax.axvline(1.0, color=BASE, linestyle="--", linewidth=1)
        top = max(ratios + [t for t in case.get("targets", {}).values()] + [1.0])
        ax.set_xlim(0, top * 1.28)
        for y, name, ratio in zip(ys, names, ratios):
            ms = case["median_ms"][name]
            ax.text(ratio + top * 0.01, y, f"{ratio:.2f}x  ({format_ms(ms)})", va="center",
                    fontsize=8)
            target = case.get("targets", {}).get(name)
            if target is not None:
                ax.plot([target, target], [y - 0.4, y + 0.4], color=TARGET, linewidth=2.5)
        ranks = case.get("ranks")
        ax.set_title(f"{case_title}" + (f"  ({ranks} ranks)" if ranks else ""), fontsize=10,
                     loc="left")
        ax.set_xlabel(f"median / median of {case['baseline']}", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    legend = [Patch(color=MEETS, label="meets its target"),
              Patch(color=MISSES, label="misses its target"),
              Patch(color=PLAIN, label="no target (context)"),
              Patch(color=BASE, label="baseline (1.0, dashed)"),
              Line2D([], [], color=TARGET, linewidth=2.5, label="target")]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="+", help="result files written with --json")
    parser.add_argument("-o", "--output", default="ratios.png", help="PNG to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("bench/plot.py needs matplotlib (a benchmark-only dependency): "
                 "pip install matplotlib")
    draw(load(args.json), args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
