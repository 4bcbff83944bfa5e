"""Stage plots: the figures notebooks 05, 06 and 09 draw, from the CSVs the earlier stages left in the run
book's folder, each titled with the GPU's name (the dry run's says it is one). A figure whose CSV is missing
or has no rows for it is recorded as failed, and the others are still drawn.

  decode_bandwidth.png  decode GB/s against context and batch, per implementation, with the copy ceiling (05)
  prefill.png           prefill time against the cached share of the context, per implementation (06)
  engine.png            generated tokens/s, TTFT and inter-token latency per system (09)"""

import matplotlib

matplotlib.use("Agg")  # no display on the device machine or in CI

import matplotlib.pyplot as plt
import pandas as pd

from kvlab.bench.gpu.report import ENGINE_PREFIX, PLOTS, device_slug


def read_rows(path, kernel=None):
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} is missing: its stage did not write it")
    frame = pd.read_csv(path)
    if kernel is not None:
        frame = frame[frame["kernel"] == kernel]
    if frame.empty:
        raise ValueError(f"{path.name} has no {kernel or ''} rows to plot")
    return frame


def plot_decode(frame):
    """As notebook 05: GB/s against context at the largest batch and against batch at the longest context."""
    copy_gbps = (frame["gbps"] / frame["frac_of_copy_bw"]).median()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, (x, fixed) in zip(axes, [("context", "batch"), ("batch", "context")]):
        value = frame[fixed].max()
        for (impl, dtype, heads), rows in frame[frame[fixed] == value].groupby(["impl", "dtype", "num_kv_heads"]):
            rows = rows.sort_values(x)
            ax.plot(rows[x], rows["gbps"], "o-", label=f"{impl} ({dtype}, {heads} kv heads)")
        ax.axhline(copy_gbps, color="0.5", ls="--", label="device copy bandwidth")
        ax.set(xscale="log", xlabel=x, ylabel="GB/s", title=f"decode, {fixed} = {value}")
        ax.legend(fontsize=6)
    return fig


def plot_prefill(frame):
    """As notebook 06: the new tokens' prefill time against the share of their context found cached; the
    kernel's work falls with the prefix it may skip recomputing (its attention still reads it)."""
    frame = frame.assign(cached_share=(frame["context"] - frame["query_len"]) / frame["context"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for (impl, dtype, batch, heads), rows in frame.groupby(["impl", "dtype", "batch", "num_kv_heads"]):
        rows = rows.sort_values("cached_share")
        ax.plot(rows["cached_share"], rows["median_us"], "o-", label=f"{impl} ({dtype}, batch {batch}, {heads} kv)")
    ax.set(xlabel="cached share of the context", ylabel="median µs", yscale="log",
           title=f"prefill of {frame['query_len'].max()} new tokens over a cached prefix")
    ax.legend(fontsize=6)
    return fig


def plot_engine(frame):
    """Throughput, then latencies, one bar per system."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (column, label) in zip(axes, [("generated_tok_s", "generated tokens/s"),
                                          ("ttft_ms_median", "median TTFT (ms)"),
                                          ("itl_ms_median", "median inter-token latency (ms)")]):
        values = frame[column] if column in frame else pd.Series([float("nan")] * len(frame))
        ax.bar(frame["system"], values.fillna(0), color=[f"C{i}" for i in range(len(frame))])
        for i, v in enumerate(values):  # a system without this figure (static generate has no TTFT) says so
            ax.annotate("n/a" if pd.isna(v) else f"{v:.3g}", (i, 0 if pd.isna(v) else v), ha="center",
                        va="bottom", fontsize=8)
        ax.set(ylabel=label)
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    return fig


def save(fig, path, gpu, what=""):
    fig.suptitle(f"{what}measured on {gpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(stage):
    slug = device_slug(stage.dry_run)
    kernels_csv, engine_csv = stage.out / f"{slug}.csv", stage.out / f"{ENGINE_PREFIX}{slug}.csv"
    decode_png, prefill_png, engine_png = (stage.out / name for name in PLOTS)
    with stage.check(decode_png.name) as detail:
        frame = read_rows(kernels_csv, "decode")
        save(plot_decode(frame), decode_png, frame["gpu"].iloc[0])
        detail["text"] = f"from {kernels_csv.name}"
    with stage.check(prefill_png.name) as detail:
        frame = read_rows(kernels_csv, "prefill")
        save(plot_prefill(frame), prefill_png, frame["gpu"].iloc[0])
        detail["text"] = f"from {kernels_csv.name}"
    with stage.check(engine_png.name) as detail:
        frame = read_rows(engine_csv)
        row = frame.iloc[0]
        save(plot_engine(frame), engine_png, read_gpu_name(kernels_csv, frame),
             f"{row['requests']} requests, {row['model']} ({row['dtype']}); ")
        detail["text"] = f"from {engine_csv.name}"


def read_gpu_name(kernels_csv, engine_frame):
    """The engine CSV keeps the device's slug; the kernel CSV has its full name when it was written."""
    if kernels_csv.is_file():
        names = pd.read_csv(kernels_csv)["gpu"]
        if len(names):
            return names.iloc[0]
    return engine_frame["device"].iloc[0]
