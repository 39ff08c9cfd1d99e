"""`tandem serve --config`: engine flags given on the command line replace the deployment
config's engine fields, and only those (the others keep the config's values, not the flags'
defaults). Without --config the flags and their defaults make the whole engine config."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from tandem.cli import add_engine_args, engine_config_from_args
from tandem.deploy.config import load_deploy
from tandem.engine import EngineConfig


class _Launched(Exception):
    """Stops `tandem serve` where it would start the workers."""


def _served_config(monkeypatch, *flags: str):
    """The DeployConfig `tandem serve --config local FLAGS` would launch (Ray untouched)."""
    from tandem.cli.app import main

    def launch(cfg, router_cfg=None):
        raise _Launched(cfg)

    monkeypatch.setattr("tandem.deploy.launcher.init_ray", lambda *a, **k: None)
    monkeypatch.setattr("tandem.deploy.serve.launch_and_build", launch)
    with pytest.raises(_Launched) as e:
        main(["serve", "--config", "local", *flags])
    return e.value.args[0]


def test_serve_config_takes_the_engine_flags_given(monkeypatch, capsys):
    local = load_deploy("local")
    assert local.engine.dtype == "bfloat16" and local.engine.num_pages == 1024
    assert _served_config(monkeypatch).engine == local.engine  # no flag: the config's engine
    cfg = _served_config(monkeypatch, "--dtype", "float32", "--max-num-seqs", "4",
                         "--enable-prefix-caching")
    assert cfg.engine == replace(local.engine, dtype="float32", max_num_seqs=4,
                                 enable_prefix_caching=True)
    assert cfg.spec == local.spec and cfg.decode == local.decode
    capsys.readouterr()


def test_kv_cache_mib_given_sizes_the_pool_over_the_configs_num_pages(monkeypatch, capsys):
    cfg = _served_config(monkeypatch, "--kv-cache-mib", "64")
    assert cfg.engine.num_pages is None and cfg.engine.kv_cache_bytes == 64 << 20
    cfg = _served_config(monkeypatch, "--kv-cache-mib", "64", "--num-pages", "300")
    assert cfg.engine.num_pages == 300
    capsys.readouterr()


def test_without_a_config_the_flags_and_their_defaults_make_the_engine_config():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])) == EngineConfig()
    args = p.parse_args(["--dtype", "float32", "--page-size", "8"])
    assert engine_config_from_args(args) == EngineConfig(dtype="float32", page_size=8)
    # A flag given with its default value still replaces the config's field.
    base = EngineConfig(dtype="float32", page_size=4)
    assert engine_config_from_args(p.parse_args(["--dtype", "bfloat16"]), base) == replace(
        base, dtype="bfloat16")


def test_serve_config_takes_the_spec_and_name_flags_given(monkeypatch, capsys):
    local = load_deploy("local")
    cfg = _served_config(monkeypatch)
    assert cfg.spec == local.spec and cfg.model_name == local.model_name
    cfg = _served_config(monkeypatch, "--num-draft-steps", "2", "--draft-topk", "3",
                         "--draft-model", "/heads/h", "--served-model-name", "mine")
    assert cfg.spec == replace(local.spec, num_steps=2, topk=3, draft_model="/heads/h")
    assert cfg.model_name == "mine"
    _served_config(monkeypatch, "--speculative")  # changes nothing, and says so
    assert "--speculative has no effect with --config" in capsys.readouterr().err
