"""The `ray up` YAMLs in deploy/ are ones Ray accepts and whose commands exist: each validates
against the cluster-config schema Ray ships (as written, and after Ray fills its defaults, as
`ray up` does), and every command they run parses: `ray start` / `ray stop` with their flags
(through Ray's own command-line parser, without running it), `python3 -m MODULE` for a module
that exists, and plain programs found on PATH."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
jsonschema = pytest.importorskip("jsonschema")

DEPLOY = Path(__file__).parents[2] / "deploy"
YAMLS = sorted(p.name for p in DEPLOY.glob("cluster-*.yaml"))
COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands",
                "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_there_are_cluster_yamls():
    assert YAMLS == ["cluster-gpu.yaml", "cluster-local.yaml"]


@pytest.mark.parametrize("name", YAMLS)
def test_the_yaml_validates_against_ray_s_schema(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    doc = load(name)
    jsonschema.validate(doc, schema)  # as written: no unknown or mistyped key
    validate_config(prepare_config(copy.deepcopy(doc)))  # as `ray up` reads it


def simple_commands(line: str) -> list[list[str]]:
    """A shell line split at `&&` / `;`, each part without its leading VAR=value words."""
    out = []
    for part in re.split(r"&&|;", line):
        words = shlex.split(part)
        while words and _ASSIGNMENT.match(words[0]):
            words.pop(0)
        if words:
            out.append(words)
    return out


def check_ray(args: list[str]) -> None:
    """Parse `ray ARGS` with Ray's click command-line, without running the command."""
    from ray.scripts.scripts import cli

    sub = cli.get_command(None, args[0])
    assert sub is not None, f"ray has no command {args[0]!r}"
    sub.make_context(args[0], args[1:])  # raises click.UsageError on an unknown flag


@pytest.mark.parametrize("name", YAMLS)
def test_every_command_the_yaml_runs_exists(name):
    doc = load(name)
    lines = [c for key in COMMAND_KEYS for c in doc.get(key) or []]
    assert lines, "a cluster YAML starts Ray somewhere"
    seen = set()
    for line in lines:
        for words in simple_commands(line):
            prog, args = words[0], words[1:]
            seen.add(prog)
            if prog == "ray":
                check_ray(args)
            elif prog in ("python3", "python") and args[:1] == ["-m"]:
                module = args[1]
                assert importlib.util.find_spec(module) is not None, f"{line}: no {module}"
            else:
                assert shutil.which(prog), f"{line}: {prog} is not a program here"
    assert "ray" in seen


def test_the_command_checker_catches_a_wrong_flag_and_a_missing_module():
    import click

    with pytest.raises(click.UsageError):
        check_ray(["start", "--head", "--no-such-flag"])
    assert importlib.util.find_spec("tandem.no_such_module") is None
    assert simple_commands("chmod 600 f && A=1 B=2 ray start --head") == [
        ["chmod", "600", "f"], ["ray", "start", "--head"]]
