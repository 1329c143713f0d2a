#!/usr/bin/env python3
"""make bench's figures, drawn from the JSON its sections wrote: OUTDIR/figures/*.svg.

    bench/figures.py OUTDIR [svg|png]      (svg by default)

  wires.svg      section 8: the compressed wires' step time against the link's bandwidth, the measured
                 medians and the fitted step = a + b / bandwidth, with where each wire starts to pay
  overlap.svg    section 3: one overlapped iteration, the buckets in flight against the backward (the
                 grads marked ready), and the step of each run against compute + the last reduce
  worldsize.svg  section 10: one iteration's cost against the world size, libddp over MPI and over Gloo
                 against the MPI_Allreduce floor, tiny grads and 16 MB
  hook.svg, bucketing.svg, peers.svg, memory.svg, sharded.svg, compressed.svg, conversions.svg:
                 sections 1, 2, 4, 5, 6, 7 and 9, each the numbers of its table as bars

A figure whose section left no JSON (section 8 needs root) is skipped with a line saying so. Needs
matplotlib (Debian: python3-matplotlib); without it, says so and exits 0.
"""
import glob
import json
import os
import re
import statistics
import sys
import textwrap

EXT = "svg"  # the figures' format: main's second argument

def load(path):
    with open(path) as f:
        return json.load(f)


def load_trace(path):
    """A Chrome trace in array form, which a running writer leaves without its closing bracket."""
    text = open(path).read().strip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def rate_bits(rate):
    """tc's rate syntax (1gbit, 500mbit, 10gbit) in bits per second."""
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.strip().lower())
    if not m:
        raise ValueError(f"unknown rate '{rate}'")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def fit_wires(runs):
    """{wire: {gbit: median step ms}} -> {wire: (a, b)} with step = a + b / gbit through the two
    lowest rates, as section 8's table estimates them; and each wire's break-even bandwidth (Gbit/s)
    below which it beats fp32 (None: never; 'all': at every bandwidth)."""
    fits, even = {}, {}
    for wire, by_rate in runs.items():
        rates = sorted(by_rate)
        if len(rates) < 2:
            continue
        x1, x2 = 1 / rates[0], 1 / rates[1]
        y1, y2 = by_rate[rates[0]], by_rate[rates[1]]
        b = (y1 - y2) / (x1 - x2)
        fits[wire] = (y1 - b * x1, b)
    if "none" in fits:
        a0, b0 = fits["none"]
        for wire, (a, b) in fits.items():
            if wire == "none":
                continue
            da, db = a - a0, b0 - b
            even[wire] = None if db <= 0 and da >= 0 else "all" if da <= 0 else db / da
    return fits, even


def save(fig, figdir, name):
    """No date in the file: the same JSON draws the same bytes."""
    fig.savefig(os.path.join(figdir, f"{name}.{EXT}"), metadata={"Date": None} if EXT == "svg" else {})


def figure_wires(plt, out, figdir):
    path = os.path.join(out, "network.json")
    if not os.path.exists(path):
        return "wires.svg: skipped: no network.json (section 8 runs as root only)"
    data = load(path)
    samples = {}
    for r in data["runs"]:
        gbit = (float(r["rate_bits"]) if r.get("rate_bits") else rate_bits(r["rate"])) / 1e9
        samples.setdefault(r["wire"], {}).setdefault(gbit, []).append(float(r["step_ms"]))
    medians = {w: {g: statistics.median(v) for g, v in by.items()} for w, by in samples.items()}
    fits, even = fit_wires(medians)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {"none": "black", "bf16": "tab:blue", "fp16": "tab:green", "int8": "tab:red"}
    all_rates = sorted({g for by in medians.values() for g in by})
    lo, hi = min(all_rates) / 4, max(all_rates) * 4
    xs = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    for wire, by in medians.items():
        c = colors.get(wire, None)
        be = even.get(wire)
        pays = "" if wire == "none" else (" (beats fp32 at every bandwidth)" if be == "all" else " (never beats fp32)"
                                          if be is None and wire in fits else f" (beats fp32 below {be:.1f} Gbit/s)"
                                          if isinstance(be, float) else "")
        label = ("fp32 (none)" if wire == "none" else wire) + pays
        ax.plot(sorted(by), [by[g] for g in sorted(by)], "o", color=c, label=label)
        if wire in fits:
            a, b = fits[wire]
            ax.plot(xs, [a + b / x for x in xs], "-", color=c, alpha=0.5, linewidth=1)
        if isinstance(be, float) and lo <= be <= hi:
            a, b = fits[wire]
            ax.plot([be], [a + b / be], "x", color=c, markersize=8)  # where its line crosses fp32's
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth, Gbit/s (tc tbf between two network namespaces)")
    ax.set_ylabel("median step, ms")
    ax.set_title(f"compressed wires: example trainer, 2 ranks over Gloo, {data.get('steps', '?')} steps a run;\n"
                 "dots measured, lines step = a + b / bandwidth, x where a wire's line crosses fp32's", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, figdir, "wires")
    plt.close(fig)
    said = ", ".join(f"{w}: {'every bandwidth' if v == 'all' else 'never' if v is None else f'below {v:.1f} Gbit/s'}"
                     for w, v in sorted(even.items()))
    return f"wires.svg: {len(medians)} wires at {len(all_rates)} rates; where each pays: {said or 'no fit'}"


def figure_overlap(plt, out, figdir):
    traces = sorted(glob.glob(os.path.join(out, "overlap_timeline.rank0.json")))
    summary_path = os.path.join(out, "overlap.json")
    if not traces or not os.path.exists(summary_path):
        return "overlap.svg: skipped: no overlap_timeline.rank0.json or overlap.json (section 3)"
    events = load_trace(traces[0])
    iterations = [e for e in events if e.get("cat") == "iteration"]
    if not iterations:
        return "overlap.svg: skipped: the timeline holds no iteration"
    last = max(iterations, key=lambda e: e["ts"])
    number = int(last["name"].split()[-1])
    t0, t1 = last["ts"], last["ts"] + last["dur"]
    ready = sorted(e["ts"] for e in events if e.get("cat") == "grad" and t0 <= e["ts"] <= t1)
    buckets = [e for e in events if e.get("cat") == "bucket" and e["args"]["iteration"] == number]
    summary = load(summary_path)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6.5), gridspec_kw={"height_ratios": [3, 2]})
    ms = lambda t: (t - t0) / 1000.0
    ax.vlines([ms(t) for t in ready], -0.4, 0.4, color="tab:gray", linewidth=1)
    for b in sorted(buckets, key=lambda e: e["args"]["ready_us"]):
        row = 1 + int(b["name"].split()[-1])
        a = b["args"]
        ax.barh(row, ms(a["start_us"]) - ms(a["ready_us"]), left=ms(a["ready_us"]), height=0.6, color="tab:orange",
                label="ready, waiting for its turn" if row == 1 else None)
        ax.barh(row, ms(a["done_us"]) - ms(a["start_us"]), left=ms(a["start_us"]), height=0.6, color="tab:blue",
                label="reducing" if row == 1 else None)
    ax.axvline(ms(t1), color="black", linestyle="--", linewidth=1, label="ddp_finish_backward returns")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.18), ncol=3, frameon=False)
    ax.set_yticks(range(0, 1 + len(buckets)))
    ax.set_yticklabels(["grads ready"] + [f"bucket {i}" for i in range(len(buckets))], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from ddp_begin_backward, rank 0; grey ticks: grads marked ready", fontsize=8)
    ax.set_title(f"overlap: {summary['grads']} grads, {summary['compute_ns_per_grad'] / 1e6:.0f} ms of compute "
                 f"before each, {len(buckets)} buckets, {summary['world']} ranks (arena, overlapped)", fontsize=10)
    compute = statistics.median(summary["compute_ms"])
    last_reduce = statistics.median(summary["last_bucket_reduce_ms"])
    names = [r["run"] for r in summary["runs"]]
    steps = [statistics.median(r["step_ms"]) for r in summary["runs"]]
    exposed = [r["exposed_ms"] for r in summary["runs"]]
    ys = range(len(names))
    bx.barh(ys, [s - e for s, e in zip(steps, exposed)], color="tab:gray", label="backward loop")
    bx.barh(ys, exposed, left=[s - e for s, e in zip(steps, exposed)], color="tab:red",
            label="exposed (waiting in ddp_finish_backward)")
    bx.axvline(compute + last_reduce, color="black", linestyle="--", linewidth=1, label="compute + last reduce")
    bx.set_yticks(list(ys))
    bx.set_yticklabels(names, fontsize=8)
    bx.invert_yaxis()
    bx.set_xlabel("median step, ms", fontsize=8)
    bx.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save(fig, figdir, "overlap")
    plt.close(fig)
    in_flight = sum(1 for b in buckets if b["args"]["done_us"] <= ready[-1]) if ready else 0
    return (f"overlap.svg: iteration {number}, {len(buckets)} buckets, {in_flight} of them done before the last "
            f"grad was ready; overlapped arena step {steps[0]:.1f} ms, {steps[0] / (compute + last_reduce):.3f}x "
            f"compute + last reduce")


def figure_worldsize(plt, out, figdir):
    rows = []
    for path in glob.glob(os.path.join(out, "worldsize_*np*.json")):
        d = load(path)
        for c in d["cases"]:
            rows.append((d.get("comm", "mpi"), d["world"], c["case"], statistics.median(c["libddp_ms"]),
                         statistics.median(c["floor_ms"])))
    if not rows:
        return "worldsize.svg: skipped: no worldsize_*np*.json (section 10)"
    cases = sorted({r[2] for r in rows}, key=lambda c: c != "tiny")
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        for comm, style in (("mpi", "o-"), ("gloo", "s-")):
            pts = sorted((w, lib) for c, w, k, lib, _ in rows if c == comm and k == case)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"libddp over {comm.upper()}")
        floor = sorted({(w, fl) for c, w, k, _, fl in rows if c == "mpi" and k == case and w > 1})
        if floor:
            ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="MPI_Allreduce by hand (floor)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r[1] for r in rows}))
        ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.set_yscale("log")
        ax.set_xlabel("ranks (on one host; more ranks than cores: read the growth)", fontsize=8)
        ax.set_ylabel("median iteration, ms (slowest rank)")
        ax.set_title(f"{case} gradients", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, figdir, "worldsize")
    plt.close(fig)
    worlds = sorted({r[1] for r in rows})
    return f"worldsize.svg: {len(cases)} gradient sets at {', '.join(map(str, worlds))} ranks"


def bars(plt, figdir, name, title, labels, series, xlabel, ref=None, ref_label=None):
    """One horizontal bar chart: `series` is [(legend, values)], a value per label; `ref` an x drawn as
    a dashed line (a floor or a target)."""
    labels = [textwrap.fill(label, 40) for label in labels]  # long labels wrap rather than squeeze the bars
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(labels) * max(1, len(series)) + 1.6))
    height = 0.8 / len(series)
    for k, (legend, values) in enumerate(series):
        ys = [i + k * height for i in range(len(labels))]
        ax.barh(ys, values, height=height, label=legend)
    ax.set_yticks([i + height * (len(series) - 1) / 2 for i in range(len(labels))])
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    if ref is not None:
        ax.axvline(ref, color="black", linestyle="--", linewidth=1, label=ref_label)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_title(title, fontsize=10)
    if len(series) > 1 or ref is not None:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, figdir, name)
    plt.close(fig)


def need(out, name, section):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"skipped: no {name} ({section})")
    return load(path)


def figure_hook(plt, out, figdir):
    d = need(out, "hook.json", "section 1")
    fills = d["fill_ns_per_iteration"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist(fills, bins=40, color="tab:blue")
    ax.axvline(100, color="black", linestyle="--", linewidth=1, label="target: 100 ns")
    ax.axvline(statistics.median(fills), color="tab:red", linewidth=1, label=f"median {statistics.median(fills):.1f} ns")
    ax.set_xlabel("ns per ddp_grad_ready that only fills its slot (mean of each iteration's calls)", fontsize=8)
    ax.set_ylabel("iterations")
    ax.set_title("hook: the cost of marking a grad ready", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, figdir, "hook")
    plt.close(fig)
    return f"hook.svg: {len(fills)} iterations, median {statistics.median(fills):.1f} ns"


def figure_bucketing(plt, out, figdir):
    d = need(out, "bucketing.json", "section 2")
    floor = statistics.median(d["flat_pieces_4mb_ms"])
    labels = ["MPI_Allreduce, whole (by hand)", "MPI_Allreduce in 4 MB pieces (the floor)"]
    values = [statistics.median(d["flat_allreduce_ms"]), floor]
    for r in d["runs"]:
        labels.append(f"libddp {r['layout']}, message_size {r['message_size'] / 1e6:g}M ({r['buckets']} buckets)")
        values.append(statistics.median(r["ms"]))
    bars(plt, figdir, "bucketing", f"bucketing: {d['grads']} grads, {d['numel'] * 4 / 1e6:.0f} MB of f32, "
         f"{d['world']} ranks", labels, [("median ms", values)], "median ms per iteration (slowest rank)", floor,
         "the floor")
    return f"bucketing.svg: {len(d['runs'])} libddp runs against the floor ({floor:.1f} ms)"


def figure_peers(plt, out, figdir):
    d = need(out, "pytorch.json", "section 4")
    labels, tails, wholes = [], [], []
    for row in d["table"]:
        labels.append(f"libddp {row['libddp']}")
        tails.append(row["ours_tail_ms"])
        wholes.append(row["ours_whole_ms"])
    for name in ("torch DDP", "torch DDP gradient_as_bucket_view"):
        run = d["torch"]["runs"][name]
        labels.append(name)
        tails.append(statistics.median(run["tail_ms"]))
        wholes.append(statistics.median(run["step_ms"]))
    if d.get("horovod"):
        labels.append(f"Horovod {d['horovod']['horovod']['horovod']}")
        tails.append(d["horovod"]["tail_ms"])
        wholes.append(d["horovod"]["whole_ms"])
    bars(plt, figdir, "peers", "against PyTorch DDP and Horovod: the same 292 grads, 2 ranks, 25 MB buckets", labels,
         [("tail: last grad ready to all reduced", tails), ("whole backward", wholes)], "median ms (slowest rank)")
    return f"peers.svg: {len(labels)} runs" + (", Horovod included" if d.get("horovod") else ", no Horovod")


def figure_memory(plt, out, figdir):
    d = need(out, "memory.json", "section 5")
    rows = d["runs"]
    g = rows[0]["grad_bytes"]
    labels = [r["layout"] for r in rows]
    bars(plt, figdir, "memory", f"memory beyond the grads ({g / 1e6:.0f} MB of f32 grads), over the grads' bytes",
         labels, [("library_bytes beyond the grads", [r["library_beyond_grads"] / g for r in rows]),
                  ("peak RSS beyond the grads", [r["peak_rss_beyond_grads"] / g for r in rows])],
         "x the grads' bytes")
    return "memory.svg: " + ", ".join(r["layout"] for r in rows)


def figure_sharded(plt, out, figdir):
    d = need(out, "sharded.json", "section 6")
    med = statistics.median
    labels = ["allreduce path", "reduce-scatter", "all-gather", "reduce-scatter + all-gather"]
    values = [med(d["allreduce_ms"]), med(d["reduce_scatter_ms"]), med(d["all_gather_ms"]),
              med(d["reduce_scatter_ms"]) + med(d["all_gather_ms"])]
    bars(plt, figdir, "sharded", f"sharded: {d['numel'] * 4 / 1e6:.0f} MB of grads, {d['world']} ranks", labels,
         [("median ms", values)], "median ms (slowest rank)", values[0], "the allreduce path")
    return f"sharded.svg: reduce-scatter + all-gather {values[3] / values[0]:.3f}x the allreduce path"


def figure_compressed(plt, out, figdir):
    d = need(out, "compressed.json", "section 7")
    base = {r["layout"]: statistics.median(r["ms"]) for r in d["runs"] if r["wire"].startswith("fp32")}
    labels = [f"{r['layout']}, {r['wire']}" for r in d["runs"]]
    values = [statistics.median(r["ms"]) / base[r["layout"]] for r in d["runs"]]
    bars(plt, figdir, "compressed", f"compressed wires on one host: {d['numel'] * 4 / 1e6:.0f} MB of grads, "
         f"{d['world']} ranks, over the fp32 path", labels, [("step over fp32's", values)], "x the fp32 path", 1.0,
         "fp32")
    return f"compressed.svg: {len(labels)} runs"


def figure_conversions(plt, out, figdir):
    d = need(out, "host_loops.json", "section 9")
    labels = [r["pass"] for r in d["runs"]]
    bars(plt, figdir, "conversions", f"host conversions: {d['elements'] / 2**20:.0f}M elements a pass, over a memcpy "
         "of the same bytes", labels, [("default path (SIMD)", [r["default_ms"] / r["memcpy_ms"] for r in d["runs"]]),
                                       ("portable path", [r["portable_ms"] / r["memcpy_ms"] for r in d["runs"]])],
         "x memcpy", 1.3, "target: 1.3x")
    return f"conversions.svg: {len(labels)} passes"


def main(argv):
    if len(argv) not in (2, 3) or (len(argv) == 3 and argv[2] not in ("svg", "png")):
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = argv[1]
    global EXT
    EXT = argv[2] if len(argv) == 3 else "svg"
    try:
        import matplotlib
        matplotlib.use("svg" if EXT == "svg" else "agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("figures: skipped: no matplotlib for this python (Debian: apt-get install python3-matplotlib)")
        return 0
    plt.rcParams["svg.hashsalt"] = "libddp"  # the same data draws the same file
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: smaller files, searchable
    figdir = os.path.join(out, "figures")
    os.makedirs(figdir, exist_ok=True)
    failed = 0
    for draw in (figure_hook, figure_bucketing, figure_overlap, figure_peers, figure_memory, figure_sharded,
                 figure_compressed, figure_wires, figure_conversions, figure_worldsize):
        try:
            print(draw(plt, out, figdir).replace(".svg:", f".{EXT}:", 1))
        except FileNotFoundError as e:
            print(f"{draw.__name__[len('figure_'):]}.svg: {e}")
        except (KeyError, ValueError, IndexError, ZeroDivisionError, json.JSONDecodeError) as e:
            print(f"{draw.__name__}: failed on the JSON in {out}: {type(e).__name__}: {e}")
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv))
