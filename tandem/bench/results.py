"""The benchmark's result file: one JSON document per `tandem bench` invocation, comparing every
benchmarked deployment ("run") at every load level. Built from typed values here; `validate`
checks a loaded document against the schema below (tests, and readers of old files).

Schema (`"schema": "tandem.bench/1"`; times in seconds, throughputs per second):

    {
      "schema": "tandem.bench/1",
      "date": "2026-11-05T07:10:00+00:00",        # UTC, ISO 8601, when the bench started
      "command": ["tandem", "bench", ...],        # argv
      "machine": {"hostname", "platform", "python", "torch", "cpu_count",
                  "gpus": [str], "ray_address": str | null},
      "config": {
        "workload": {"kind", "input_len": [lo, hi], "output_len": [lo, hi], "vocab_size",
                     "temperature", "seed"},
        "levels": [{"concurrency": int | null, "request_rate": float | "inf" | null,
                    "max_concurrency": int | null}],
        "num_requests": int | null,                # per level; null: each level's default
        "num_warmup": int,
        "slo": {"ttft_s": float, "tpot_s": float}
      },
      "runs": [{
        "name": str,
        "target": "host:port",                    # or http(s)://host:port (the OpenAI API)
        "api": "grpc" | "http",                    # absent in files written before HTTP runs
        "deployment": null | {"mode": "colocated" | "disaggregated", "speculative": bool,
                              "model": str, "load_format": str, "dtype": str, "device": str,
                              "transfer_backend": str | null, "num_prefill": int,
                              "num_decode": int, "num_draft_steps": int | null,
                              "draft_topk": int | null, "source": str},
        "floors": {"memory_bandwidth": {"gb_per_s": float | null, "method": str},
                   "link_bandwidth": {"gb_per_s": float | null, "method": str},
                   "dtype_bytes": int, "decode_tp": int (absent before TP floors),
                   "decode_dp": int (absent before DP floors),
                   "weight_bytes_batch1": float | null,
                   "kv_bytes_per_token": int | null},
        "error": str | null,                       # the run failed (levels hold what finished)
        "levels": [{
          "load": {"concurrency", "request_rate", "max_concurrency"},
          "num_requests", "num_completed", "num_failed", "duration_s",
          "request_throughput", "output_throughput", "total_token_throughput",
          "goodput", "slo_attainment", "mean_prompt_tokens", "mean_output_tokens",
          "effective_concurrency",
          "ttft_s" | "tpot_s" | "itl_s" | "latency_s": {"mean", "p50", "p90", "p99"},
          "acceptance": null | {"mean_length": float, "per_position": [float],
                                "num_rounds": int},   # null over HTTP (n/a)
          "floors": {"tpot_floor_s": float | null,        # non-speculative decode floor
                     "tpot_floor_spec_s": float | null,   # floor / tau (speculative runs)
                     "transfer_floor_s": float | null,    # mean prompt's KV over the link
                     "batch": int, "context_tokens": float},
          "errors": [str],                         # up to 5 distinct failure messages
          "status_counts": {str: int}              # requests per final gRPC status ("OK",
                                                   # "UNAVAILABLE", ...; "OTHER": no status;
                                                   # HTTP statuses by their gRPC names)
        }]
      }]
    }

NaN (an empty distribution) is written as null.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tandem.bench.floors import ModelFloors
from tandem.bench.load import LoadLevel
from tandem.bench.metrics import LevelMetrics, RequestRecord

SCHEMA = "tandem.bench/1"
DIST_KEYS = ("mean", "p50", "p90", "p99")
LEVEL_NUMBERS = ("num_requests", "num_completed", "num_failed", "duration_s",
                 "request_throughput", "output_throughput", "total_token_throughput", "goodput",
                 "slo_attainment", "mean_prompt_tokens", "mean_output_tokens",
                 "effective_concurrency")
DISTRIBUTIONS = ("ttft_s", "tpot_s", "itl_s", "latency_s")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def machine_info() -> dict[str, Any]:
    import torch

    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "gpus": gpus,
            "ray_address": os.environ.get("RAY_ADDRESS")}


def level_json(level: LoadLevel, m: LevelMetrics, floors: ModelFloors,
               records: list[RequestRecord]) -> dict[str, Any]:
    out: dict[str, Any] = {"load": level.to_json()}
    for key in LEVEL_NUMBERS:
        out[key] = getattr(m, key)
    for key in DISTRIBUTIONS:
        out[key] = asdict(getattr(m, key))
    acc = m.acceptance
    out["acceptance"] = None if acc is None else {
        "mean_length": acc.mean_length, "per_position": list(acc.per_position),
        "num_rounds": acc.num_rounds}
    batch = max(1, round(m.effective_concurrency))
    # Mid-answer context: the prompt plus half the answer, averaged over requests.
    context = m.mean_prompt_tokens + m.mean_output_tokens / 2
    floor = floors.tpot_floor(batch, context) if m.num_completed else None
    out["floors"] = {
        "tpot_floor_s": floor,
        "tpot_floor_spec_s": (floor / acc.mean_length if floor is not None and acc is not None
                              and acc.mean_length > 0 else None),
        "transfer_floor_s": floors.transfer_floor(m.mean_prompt_tokens) if m.num_completed
        else None,
        "batch": batch, "context_tokens": context,
    }
    errors = []
    for r in records:
        if r.error and r.error not in errors:
            errors.append(r.error)
    out["errors"] = errors[:5]
    out["status_counts"] = status_counts(records)
    return out


def status_of(record: RequestRecord) -> str:
    """The final status of one request as the client saw it: "OK", the gRPC code's name
    (driver errors read "CODE: details"), or "OTHER" (e.g. a stream without a final message)."""
    if record.ok:
        return "OK"
    code = (record.error or "").split(":", 1)[0]
    return code if code.isupper() and code.replace("_", "").isalpha() else "OTHER"


def status_counts(records) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        s = status_of(r)
        counts[s] = counts.get(s, 0) + 1
    return dict(sorted(counts.items()))


def _clean(x: Any) -> Any:
    """NaN/inf -> null (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(doc), indent=2) + "\n")
    return path


class SchemaError(ValueError):
    """A result document does not follow the schema; the message names the field."""


def _need(obj: Any, key: str, types: tuple[type, ...], where: str, nullable: bool = False) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise SchemaError(f"{where}.{key}: missing")
    v = obj[key]
    if v is None and nullable:
        return v
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise SchemaError(f"{where}.{key}: expected {'/'.join(t.__name__ for t in types)}, "
                          f"got {type(v).__name__}")
    return v


NUM = (int, float)


def validate(doc: Any) -> None:
    """Raise `SchemaError` unless `doc` follows the schema in this module's docstring."""
    if _need(doc, "schema", (str,), "$") != SCHEMA:
        raise SchemaError(f"$.schema: expected '{SCHEMA}', got '{doc['schema']}'")
    _dt.datetime.fromisoformat(_need(doc, "date", (str,), "$"))
    _need(doc, "command", (list,), "$")
    machine = _need(doc, "machine", (dict,), "$")
    for key in ("hostname", "platform", "python", "torch"):
        _need(machine, key, (str,), "$.machine")
    _need(machine, "gpus", (list,), "$.machine")
    cfg = _need(doc, "config", (dict,), "$")
    _need(cfg, "workload", (dict,), "$.config")
    levels = _need(cfg, "levels", (list,), "$.config")
    for i, lv in enumerate(levels):
        _check_load(lv, f"$.config.levels[{i}]")
    slo = _need(cfg, "slo", (dict,), "$.config")
    _need(slo, "ttft_s", NUM, "$.config.slo")
    _need(slo, "tpot_s", NUM, "$.config.slo")
    runs = _need(doc, "runs", (list,), "$")
    for i, run in enumerate(runs):
        _check_run(run, f"$.runs[{i}]")


def _check_load(lv: Any, where: str) -> None:
    c = _need(lv, "concurrency", (int,), where, nullable=True)
    r = _need(lv, "request_rate", (*NUM, str), where, nullable=True)
    if isinstance(r, str) and r != "inf":
        raise SchemaError(f"{where}.request_rate: a number or \"inf\", got '{r}'")
    _need(lv, "max_concurrency", (int,), where, nullable=True)
    if (c is None) == (r is None):
        raise SchemaError(f"{where}: exactly one of concurrency, request_rate")


def _check_run(run: Any, where: str) -> None:
    _need(run, "name", (str,), where)
    _need(run, "target", (str,), where)
    _need(run, "error", (str,), where, nullable=True)
    dep = _need(run, "deployment", (dict,), where, nullable=True)
    if dep is not None:
        if _need(dep, "mode", (str,), f"{where}.deployment") not in ("colocated",
                                                                      "disaggregated"):
            raise SchemaError(f"{where}.deployment.mode: colocated or disaggregated")
        _need(dep, "speculative", (bool,), f"{where}.deployment")
        _need(dep, "model", (str,), f"{where}.deployment")
    floors = _need(run, "floors", (dict,), where)
    for key in ("memory_bandwidth", "link_bandwidth"):
        bw = _need(floors, key, (dict,), f"{where}.floors")
        _need(bw, "gb_per_s", NUM, f"{where}.floors.{key}", nullable=True)
        _need(bw, "method", (str,), f"{where}.floors.{key}")
    for j, lv in enumerate(_need(run, "levels", (list,), where)):
        w = f"{where}.levels[{j}]"
        _check_load(_need(lv, "load", (dict,), w), f"{w}.load")
        for key in LEVEL_NUMBERS:
            _need(lv, key, NUM, w)
        for key in DISTRIBUTIONS:
            dist = _need(lv, key, (dict,), w)
            for k in DIST_KEYS:
                _need(dist, k, NUM, f"{w}.{key}", nullable=True)
        acc = _need(lv, "acceptance", (dict,), w, nullable=True)
        if acc is not None:
            _need(acc, "mean_length", NUM, f"{w}.acceptance")
            _need(acc, "per_position", (list,), f"{w}.acceptance")
            _need(acc, "num_rounds", (int,), f"{w}.acceptance")
        fl = _need(lv, "floors", (dict,), w)
        for key in ("tpot_floor_s", "tpot_floor_spec_s", "transfer_floor_s"):
            _need(fl, key, NUM, f"{w}.floors", nullable=True)
        _need(lv, "errors", (list,), w)
        counts = _need(lv, "status_counts", (dict,), w)
        if not all(isinstance(k, str) and isinstance(v, int) for k, v in counts.items()):
            raise SchemaError(f"{w}.status_counts: must map status names to counts")
