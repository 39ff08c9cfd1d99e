"""Bench configs: every bundled file parses; `bench:` sections must agree; command-line flags
win; errors name the field; a dummy EAGLE head loads into a target of its shape."""

from __future__ import annotations

import pytest
import torch

from tandem.bench.command import BenchCommand
from tandem.bench.config import (BENCH_DIR, DEFAULTS, build_settings, load_bench_file,
                                 merge_settings)
from tandem.engine.config import ConfigError


def test_every_bundled_bench_config_parses():
    names = sorted(p.stem for p in BENCH_DIR.glob("*.yaml"))
    assert {"cpu-colocated", "cpu-disagg", "gpu-8b-colocated", "gpu-8b-disagg-nixl",
            "gpu-smollm2-colocated", "gpu-smollm2-disagg-nixl"} <= set(names)
    for name in names:
        run, section = load_bench_file(name)
        assert run.name == name and run.deployment is not None
        settings = build_settings(merge_settings({}, [(name, section)]), vocab_size=32000)
        assert settings.levels and settings.workload.kind in ("random", "fixed", "chat")


@pytest.mark.parametrize("model", ["8b", "smollm2"])
def test_gpu_comparison_configs_share_one_workload(model):
    files = [f"gpu-{model}-colocated-plain", f"gpu-{model}-colocated", f"gpu-{model}-disagg-nixl"]
    loaded = [load_bench_file(f) for f in files]
    values = merge_settings({}, [(f, s) for f, (_, s) in zip(files, loaded)])  # no conflict
    settings = build_settings(values, vocab_size=32000)
    assert [lv.concurrency for lv in settings.levels] == [1, 16, 64]
    assert (settings.workload.input_len.lo, settings.workload.input_len.hi) == (2048, 4096)
    modes = [(r.deployment.mode, r.deployment.speculative) for r, _ in loaded]
    assert modes == [("colocated", False), ("colocated", True), ("disaggregated", True)]
    disagg = loaded[2][0].deployment.deploy
    assert disagg.transfer_backend == "nixl" and disagg.engine.load_format == "dummy"
    assert disagg.prefill.num_gpus == 1 and disagg.decode.num_gpus == 1


def test_sections_must_agree_and_flags_win():
    a, b = {"concurrency": [1, 2], "output_len": 16}, {"concurrency": "1,2", "output_len": 32}
    with pytest.raises(ConfigError, match="bench.output_len: a.yaml sets 16 but b.yaml sets 32"):
        merge_settings({}, [("a.yaml", a), ("b.yaml", b)])
    values = merge_settings({"output_len": "8", "concurrency": None}, [("a.yaml", a),
                                                                        ("b.yaml", b)])
    assert values["output_len"] == "8" and values["concurrency"] == "1,2"
    assert merge_settings({}, [])["num_warmup"] == DEFAULTS["num_warmup"]


def test_settings_errors_name_the_flag():
    base = merge_settings({}, [])
    with pytest.raises(ValueError, match="input-len"):
        build_settings({**base, "input_len": "9:1"}, 32000)
    with pytest.raises(ConfigError, match="num_requests: give one value or one per level"):
        build_settings({**base, "concurrency": "1,2", "num_requests": "1,2,3"}, 32000)
    with pytest.raises(ValueError, match="dataset"):
        build_settings({**base, "dataset": "sharegpt"}, 32000)
    s = build_settings({**base, "request_rate": "2", "num_requests": "5"}, 32000)
    assert s.levels[0].request_rate == 2.0 and s.requests_at(0) == 5


def test_bench_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: disaggregated\nspeculative: false\n")
    with pytest.raises(ConfigError, match="always speculate"):
        load_bench_file(str(bad))
    bad.write_text("bench: {concurency: 2}\n")
    with pytest.raises(ConfigError, match="bench.concurency: unknown key"):
        load_bench_file(str(bad))
    bad.write_text("mode: sideways\n")
    with pytest.raises(ConfigError, match="mode"):
        load_bench_file(str(bad))
    with pytest.raises(ConfigError, match="bundled bench configs: .*cpu-colocated"):
        load_bench_file("no-such-config")
    with pytest.raises(ConfigError, match="HOST:PORT"):
        BenchCommand(targets=("localhost",))
    with pytest.raises(ConfigError, match="--target HOST:PORT or --config"):
        BenchCommand()


def test_dummy_head_loads_into_its_target(tmp_path):
    from spec_helpers import MAX_LEN, tiny_target

    from tandem.bench.dummy_head import write_dummy_head
    from tandem.spec.head import load_head

    target = tiny_target()
    path = write_dummy_head(target.cfg, "float32", root=tmp_path)
    assert write_dummy_head(target.cfg, "float32", root=tmp_path) == path  # written once
    head = load_head(path, target, torch.float32, torch.device("cpu"), MAX_LEN)
    assert head.cfg.kind == "eagle" and head.cfg.hidden_size == target.cfg.hidden_size


def test_a_plain_deployment_config_is_a_disaggregated_run():
    run, section = load_bench_file("local")  # tandem serve's bundled config, as served
    assert run.name == "local" and section == {}
    assert run.deployment.mode == "disaggregated" and run.deployment.speculative


def test_bench_help_explains_every_flag():
    from tandem.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    bench = sub.choices["bench"]
    flags = [a for a in bench._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 20
    for action in flags:
        assert action.help and len(action.help) > 10, action.option_strings
    # Every measurement setting a bench config may set is a flag (same name).
    assert set(DEFAULTS) <= {a.dest for a in flags}


def test_out_may_name_a_folder_and_is_checked_before_any_run(tmp_path):
    """--out naming a folder writes bench-DATE.json inside it (the results of a long run were
    once lost when --out named a folder: the write failed after the runs); a place that cannot
    be written is refused up front, naming --out."""
    from tandem.bench.command import resolve_out

    inside = resolve_out(tmp_path)
    assert inside.parent == tmp_path and inside.name.startswith("bench-")
    assert inside.suffix == ".json" and not inside.exists()
    nested = resolve_out(tmp_path / "a" / "b.json")
    assert nested == tmp_path / "a" / "b.json" and nested.parent.is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="out: "):
        resolve_out(blocker / "b.json")  # its folder would be a file
