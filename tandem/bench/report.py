"""Console tables of a result document: one row per load level, measured TPOT next to its
hardware floor; then, when a colocated and a disaggregated run are compared, the TTFT the
transfer adds next to the link floor."""

from __future__ import annotations

from typing import Any, TextIO


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _load(lv: dict[str, Any]) -> str:
    load = lv["load"]
    if load["concurrency"] is not None:
        return f"c={load['concurrency']}"
    rate = load["request_rate"]
    return f"{rate}/s" if isinstance(rate, str) else f"{rate:g}/s"


HEADER = ("{:<9} {:>5} {:>7} {:>9} {:>16} {:>16} {:>32} {:>8} {:>8} {:>5}".format(
    "load", "done", "req/s", "out tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms",
    "TPOT p50/p99 (floor) ms", "goodput", "tau", "fail"))


def run_table(run: dict[str, Any], out: TextIO) -> None:
    dep = run["deployment"]
    http = run.get("api") == "http"  # files from before the HTTP driver have no "api"
    running = "a running OpenAI-compatible HTTP front" if http else "a running router"
    what = running if dep is None else (
        f"{dep['mode']}, {'speculative' if dep['speculative'] else 'target only'}, "
        f"{dep['model']} ({dep['load_format']}, {dep['dtype']}, {dep['device']})"
        + (f", KV over {dep['transfer_backend']}" if dep["mode"] == "disaggregated" else ""))
    fl = run["floors"]
    out.write(f"\n== {run['name']}: {what}\n")
    mem, link = fl["memory_bandwidth"], fl["link_bandwidth"]
    out.write(f"   memory bandwidth: {_bw(mem)}; link: {_bw(link)}\n")
    if fl["weight_bytes_batch1"] is not None:
        tp = fl.get("decode_tp", 1)  # absent in files written before TP floors
        dp = fl.get("decode_dp", 1)  # absent in files written before DP floors
        spread = (f", on DP {dp} x TP {tp} GPUs (per GPU: 1/{tp} of the attention and KV of its "
                  f"DP rank, 1/{dp * tp} of the MLP)" if dp > 1
                  else f", 1/{tp} of it on each of {tp} GPUs" if tp > 1 else "")
        out.write(f"   decode reads {fl['weight_bytes_batch1'] / 1e9:.3f} GB of weights per step "
                  f"(batch 1) + {fl['kv_bytes_per_token'] / 1e3:.1f} kB of KV per context token "
                  f"per sequence{spread}\n")
    out.write(HEADER + "\n")
    for lv in run["levels"]:
        f = lv["floors"]
        floor = _ms(f["tpot_floor_s"])
        if f["tpot_floor_spec_s"] is not None:
            floor += f", /tau {_ms(f['tpot_floor_spec_s'])}"
        acc = lv["acceptance"]
        out.write("{:<9} {:>5} {:>7} {:>9} {:>16} {:>16} {:>32} {:>8} {:>8} {:>5}\n".format(
            _load(lv), lv["num_completed"], _num(lv["request_throughput"]),
            _num(lv["output_throughput"], ".1f"),
            f"{_ms(lv['ttft_s']['p50'])}/{_ms(lv['ttft_s']['p99'])}",
            f"{_ms(lv['itl_s']['p50'])}/{_ms(lv['itl_s']['p99'])}",
            f"{_ms(lv['tpot_s']['p50'])}/{_ms(lv['tpot_s']['p99'])} ({floor})",
            _num(lv["goodput"]), _num(acc["mean_length"]) if acc else ("n/a" if http else "-"),
            lv["num_failed"]))
        counts = lv.get("status_counts") or {}
        if set(counts) - {"OK"}:
            out.write("   by status: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + "\n")
        if lv["errors"]:
            out.write(f"   errors: {'; '.join(lv['errors'][:2])}\n")
    if http:
        out.write("   tau n/a: the OpenAI API reports no acceptance\n")
    if run["error"]:
        out.write(f"   run failed: {run['error']}\n")


def _bw(bw: dict[str, Any]) -> str:
    if bw["gb_per_s"] is None:
        return f"n/a ({bw['method']})"
    return f"{bw['gb_per_s']:.1f} GB/s ({bw['method']})"


def transfer_table(doc: dict[str, Any], out: TextIO) -> None:
    """TTFT(disaggregated) - TTFT(colocated) at each common level: what moving the KV (and the
    extra hop) costs, next to the link floor for the mean prompt. Runs pair up by model."""
    runs = [r for r in doc["runs"] if r["deployment"] is not None]
    colo = {r["deployment"]["model"]: r for r in runs if r["deployment"]["mode"] == "colocated"
            and r["deployment"]["speculative"]}
    rows = []
    for r in runs:
        dep = r["deployment"]
        base = colo.get(dep["model"])
        if dep["mode"] != "disaggregated" or base is None:
            continue
        by_load = {_load(lv): lv for lv in base["levels"]}
        for lv in r["levels"]:
            b = by_load.get(_load(lv))
            if b is None or lv["ttft_s"]["p50"] is None or b["ttft_s"]["p50"] is None:
                continue
            delta = lv["ttft_s"]["p50"] - b["ttft_s"]["p50"]
            rows.append(f"{r['name']:<24} vs {base['name']:<24} {_load(lv):<9} "
                        f"{delta * 1e3:>10.1f} {_ms(lv['floors']['transfer_floor_s']):>14}")
    if rows:
        out.write("\nTTFT added by disaggregation (p50, ms) next to the link floor (mean prompt's "
                  "KV over the measured link; '-' = n/a):\n")
        out.write(f"{'run':<24}    {'colocated':<24} {'load':<9} {'delta TTFT':>10} "
                  f"{'link floor':>14}\n")
        for row in rows:
            out.write(row + "\n")


def print_report(doc: dict[str, Any], out: TextIO) -> None:
    for run in doc["runs"]:
        run_table(run, out)
    transfer_table(doc, out)
    out.write("\nfloor = (weights + KV read per decode step) / measured memory bandwidth, at the "
              "level's mean batch and context; a speculative step commits tau tokens (/tau).\n")
