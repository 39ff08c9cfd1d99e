"""`tandem bench` behind the argument parser: turn flags and bench config files into settings
and runs, measure the floors of `--target` runs, and hand over to the runner."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tandem.bench.config import RunSpec, build_settings, load_bench_file, merge_settings
from tandem.bench.floors import DTYPE_BYTES, Bandwidth, ModelFloors, measure_memory_bandwidth
from tandem.bench.runner import RunnerOptions, run_bench
from tandem.bench.target import Target
from tandem.engine.config import ConfigError

log = logging.getLogger(__name__)
FALLBACK_VOCAB = 32000  # random ids for a --target run stay below this unless --vocab-size


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchCommand:
    targets: tuple[str, ...] = ()
    configs: tuple[str, ...] = ()
    flags: dict[str, Any] = field(default_factory=dict)  # measurement flags; None = not given
    out: Path | None = None  # the JSON file; None: bench-results/bench-DATE.json
    plot: bool = True
    ray_address: str | None = None
    auth_token: str | None = None
    model: str = ""
    floor_model: str | None = None
    floor_dtype: str = "bfloat16"
    floor_device: str | None = None  # None: cuda when available, else cpu
    progress: bool = True
    trace: bool = False  # request stage marks of --config deployments (tandem/trace.py)
    argv: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.targets and not self.configs:
            raise ConfigError("target/config: give --target HOST:PORT or --config FILE "
                              "(--target http://HOST:PORT for an OpenAI-compatible HTTP front)")
        for t in self.targets:
            Target.parse(t)  # a ConfigError naming the target's form


def _target_floors(cmd: BenchCommand) -> ModelFloors | None:
    """Floors for --target runs: the model's shape from --floor-model, bandwidth measured on
    this machine (the server's machine is not reachable from here)."""
    if not cmd.floor_model:
        return None
    import torch

    from tandem.engine.config import EngineConfig
    from tandem.engine.loader import resolve_model
    from tandem.engine.presets import PRESETS

    fmt = "dummy" if cmd.floor_model in PRESETS else "auto"
    model, _ = resolve_model(EngineConfig(model=cmd.floor_model, load_format=fmt))
    device = cmd.floor_device or ("cuda" if torch.cuda.is_available() else "cpu")
    memory = measure_memory_bandwidth(device)
    link = Bandwidth(bytes_per_s=None, method="--target: the server's link is not measured")
    return ModelFloors(model=model, dtype_bytes=DTYPE_BYTES[cmd.floor_dtype], memory=memory,
                       link=link)


def _vocab_size(runs: list[RunSpec]) -> int:
    """Random prompt ids stay below every compared model's vocabulary."""
    from tandem.engine.loader import resolve_model

    sizes = []
    for run in runs:
        if run.deployment is None:
            return FALLBACK_VOCAB
        try:
            sizes.append(resolve_model(run.deployment.deploy.engine)[0].vocab_size)
        except (ValueError, OSError):
            return FALLBACK_VOCAB
    return min(sizes) if sizes else FALLBACK_VOCAB


def default_out(folder: Path = Path("bench-results")) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return folder / f"bench-{stamp}.json"


def resolve_out(out: Path | None) -> Path:
    """The result file `--out` names: None -> bench-results/bench-DATE.json; an existing folder
    -> a bench-DATE.json inside it. Checked before any run starts (a run takes minutes, and
    its results were once lost to an --out that named a folder): the folder is made, and a
    file that cannot be written is a ConfigError naming --out."""
    path = default_out() if out is None else (default_out(out) if out.is_dir() else out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"out: cannot make the folder of {path}: {e}") from e
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise ConfigError(f"out: {path} is not writable")
    return path


def execute(cmd: BenchCommand, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    runs: list[RunSpec] = [RunSpec(name=t, target=t) for t in cmd.targets]
    sections = []
    for path in cmd.configs:
        run, section = load_bench_file(path)
        runs.append(run)
        sections.append((run.deployment.source, section))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"name: two runs are called the same ({', '.join(names)}); set `name:` "
                          "in the bench configs")
    values = merge_settings(cmd.flags, sections)
    settings = build_settings(values, vocab_size=_vocab_size(runs))
    if settings.workload.kind == "chat" and any(
            r.deployment is not None and r.deployment.deploy.engine.load_format == "dummy"
            for r in runs):
        raise ConfigError("dataset: chat prompts need a tokenizer; dummy models have none "
                          "(use --dataset random)")
    out_json = resolve_out(cmd.out)
    out_png = out_json.with_suffix(".png") if cmd.plot else None
    levels = ", ".join(lv.label for lv in settings.levels)
    w = settings.workload
    inputs = "chat questions" if w.kind == "chat" else f"input {w.input_len} tokens"
    out.write(f"tandem bench: {len(runs)} run(s) ({', '.join(names)}); {w.kind} workload, "
              f"{inputs}, output {w.output_len} tokens; levels: {levels}; "
              f"{settings.num_warmup} warm-up requests per level\n")
    opts = RunnerOptions(out_json=out_json, out_png=out_png, ray_address=cmd.ray_address,
                         auth_token=cmd.auth_token, model=cmd.model,
                         target_floors=_target_floors(cmd) if cmd.targets else None,
                         progress=cmd.progress,
                         trace=out_json.with_suffix(".trace.jsonl") if cmd.trace else None)
    doc = run_bench(settings, runs, opts, cmd.argv, out)
    failed = [r["name"] for r in doc["runs"] if r["error"]]
    if failed:
        out.write(f"tandem bench: failed runs: {', '.join(failed)}\n")
        return 1
    # The benchmark cancels nothing and sets generous deadlines: every request must end OK.
    lost = {f"{r['name']} {lv_label(lv)}": lv["status_counts"] for r in doc["runs"]
            for lv in r["levels"] if set(lv.get("status_counts", {})) - {"OK"}}
    if lost:
        out.write("tandem bench: requests failed: " + "; ".join(
            f"{where}: " + ", ".join(f"{k} {v}" for k, v in c.items() if k != "OK")
            for where, c in lost.items()) + "\n")
        return 1
    return 0


def lv_label(lv: dict[str, Any]) -> str:
    load = lv["load"]
    if load.get("concurrency") is not None:
        return f"c={load['concurrency']}"
    return f"rate={load.get('request_rate')}"
