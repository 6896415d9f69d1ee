#!/bin/sh
# Install the fedfleet agent of device @device (fleet @fleet) under @prefix.
#   sudo sh install.sh    venv, torch @torch_version (a @kind device), the agent wheel, config and secrets, the
#                         @user user, @state_dir and the systemd unit. Safe to run again.
# torch: a Jetson (/etc/nv_tegra_release) takes NVIDIA's wheel from wheels/; a Pi (aarch64) or another CPU
# device takes a CPU build (wheels/, else each index of TORCH_CPU_INDEX), never PyPI's Linux torch, which
# is a CUDA build (NVIDIA packages + triton, ~5 GiB, and it does not import without them).
# A wheels/ folder holding more than torch installs everything offline (--no-index --find-links wheels/).
# Environment: PYTHON (python3), TORCH_SPEC (torch==@torch_version), TORCH_CPU_INDEX (index URLs, tried in
# order), TORCH_INDEX_URL (the one index for torch), NO_SERVICE=1 (no user, no unit), FEDFLEET_OFFLINE=0|1,
# PIP_* (pip's own options). For tests: FEDFLEET_ROOT (prefix of every system path), FEDFLEET_MACHINE
# (for uname -m), FEDFLEET_JETSON_MARKER, FEDFLEET_PIP (the pip command).
set -eu
KIT=$(cd "$(dirname "$0")" && pwd)
ROOT=${FEDFLEET_ROOT:-}
PREFIX=$ROOT@prefix
VENV=$PREFIX/venv
STATE_DIR=$ROOT@state_dir
UNIT_DIR=$ROOT/etc/systemd/system
MARKER=${FEDFLEET_JETSON_MARKER:-$ROOT/etc/nv_tegra_release}
MACHINE=${FEDFLEET_MACHINE:-$(uname -m)}
KIND=@kind
PYTHON=${PYTHON:-python3}
TORCH_VERSION=@torch_version
# A torch wheel in wheels/ is taken whatever its version (provision --wheels puts 2.10.0 in an arm64 kit: the
# newest CPU-only aarch64 torch on PyPI), unless TORCH_SPEC is given.
WHEEL_TORCH_SPEC=${TORCH_SPEC:-torch}
TORCH_SPEC=${TORCH_SPEC:-torch==$TORCH_VERSION}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-@torch_cpu_index}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
NVIDIA_INDEX=@jetson_index

run_pip() {
    if [ -n "${FEDFLEET_PIP:-}" ]; then $FEDFLEET_PIP "$@@"; else "$VENV/bin/python" -m pip "$@@"; fi
}
# Everything but torch: from wheels/ when the kit is offline, else from pip's index (PyPI).
pip_install() {
    if [ "$OFFLINE" = 1 ]; then run_pip install --no-index --find-links "$KIT/wheels" "$@@"
    else run_pip install "$@@"; fi
}
# Where pip's own settings send it besides the command line (PIP_* variables, pip.conf): printed beside the
# source the script asked for, since pip may take torch from any of them.
pip_settings() {
    found=""
    for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS; do
        eval "value=\${$var:-}"
        if [ -n "$value" ]; then found="$found $var=$value"; fi
    done
    for conf in "${PIP_CONFIG_FILE:-}" /etc/pip.conf /etc/xdg/pip/pip.conf "${HOME:-/nonexistent}/.config/pip/pip.conf" \
        "${HOME:-/nonexistent}/.pip/pip.conf" "$VENV/pip.conf"; do
        if [ -n "$conf" ] && [ -f "$conf" ] && grep -Eq '^[[:space:]]*(index-url|extra-index-url|find-links)' "$conf"; then
            found="$found $conf"
        fi
    done
    if [ -n "$found" ]; then echo "; pip's own settings may have supplied it instead:$found"; fi
}
# torch's own dependencies, without the CUDA ones (torch itself goes in with --no-deps).
torch_deps() {
    pip_install @torch_deps
}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "fedfleet agent needs Python >= 3.10 ($PYTHON is $("$PYTHON" -V 2>&1))." >&2
    echo "Jetson Nano (JetPack 4, Python 3.6) cannot run it; Orin boards on JetPack 6 can." >&2
    exit 1
fi
if [ -x "$VENV/bin/python" ]; then echo "venv: $VENV (already there)"; else "$PYTHON" -m venv "$VENV"; fi

TORCH_WHEEL=""
OTHER_WHEELS=0
for wheel in "$KIT"/wheels/*.whl; do
    [ -f "$wheel" ] || continue
    case ${wheel##*/} in
    torch-*) TORCH_WHEEL=$wheel ;;
    *) OTHER_WHEELS=1 ;;
    esac
done
OFFLINE=${FEDFLEET_OFFLINE:-$OTHER_WHEELS}

JETSON=0
if [ -e "$MARKER" ]; then
    JETSON=1
elif [ "$KIND" = jetson ]; then
    echo "warning: this kit is for a Jetson but $MARKER does not exist; installing as for a Jetson" >&2
    JETSON=1
fi

if "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    echo "torch: already installed in $VENV" \
        "($("$VENV/bin/python" -c 'import torch; print(torch.__version__)'); the kit pins $TORCH_VERSION)"
elif [ "$JETSON" = 1 ]; then
    # NVIDIA's wheel links JetPack's CUDA; its version (e.g. 2.5.0a0+...nv24.08) is not the fleet's pin.
    if [ -n "$TORCH_WHEEL" ]; then
        echo "torch: Jetson, NVIDIA's wheel from $KIT/wheels"
        run_pip install --no-index --find-links "$KIT/wheels" --no-deps torch
    elif [ -n "$TORCH_INDEX_URL" ]; then
        echo "torch: Jetson, from $TORCH_INDEX_URL"
        run_pip install --no-deps --index-url "$TORCH_INDEX_URL" torch
    else
        echo "Jetson: PyPI's torch is not built for JetPack; this kit needs NVIDIA's torch wheel. Either put it" >&2
        echo "into $KIT/wheels/ (from $NVIDIA_INDEX for JetPack 6, or" >&2
        echo "https://developer.nvidia.com/embedded/downloads for your JetPack) and run this script again, or run" >&2
        echo "  sudo TORCH_INDEX_URL=$NVIDIA_INDEX sh $KIT/install.sh" >&2
        exit 2
    fi
    torch_deps
elif [ "$KIND" = cpu ] || [ "$MACHINE" = aarch64 ]; then
    ROUTE=""
    if [ -n "$TORCH_WHEEL" ]; then
        run_pip install --no-index --find-links "$KIT/wheels" --no-deps "$WHEEL_TORCH_SPEC"
        ROUTE="the kit's wheels/ (${TORCH_WHEEL##*/})"
    else
        for index in ${TORCH_INDEX_URL:-$TORCH_CPU_INDEX}; do
            echo "torch: trying the CPU build of $TORCH_SPEC from $index"
            if run_pip install --no-deps --retries 1 --timeout 30 --index-url "$index" "$TORCH_SPEC"; then
                ROUTE=$index
                break
            fi
            echo "torch: $index failed (unreachable, or no $TORCH_SPEC for this Python and machine)" >&2
        done
    fi
    if [ -z "$ROUTE" ]; then
        PY=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        echo "torch: no CPU build of $TORCH_SPEC could be installed (tried ${TORCH_INDEX_URL:-$TORCH_CPU_INDEX})." >&2
        echo "PyPI's Linux torch is a CUDA build (NVIDIA packages + triton, ~5 GiB) and is not used. Either" >&2
        echo "  - on a machine that reaches the index, download the CPU wheel into this kit's wheels/:" >&2
        echo "      pip download --no-deps --only-binary=:all: --platform manylinux_2_28_$MACHINE \\" >&2
        echo "        --python-version $PY --index-url @torch_cpu_index -d wheels $TORCH_SPEC" >&2
        echo "    copy wheels/ to $KIT/ and run this script again, or" >&2
        echo "  - run it again with TORCH_CPU_INDEX=<a mirror of @torch_cpu_index>." >&2
        exit 3
    fi
    case $ROUTE in
    http*) ALSO=$(pip_settings) ;;
    *) ALSO="" ;;
    esac
    echo "torch: CPU build from $ROUTE (no NVIDIA packages)$ALSO"
    torch_deps
else
    # An x86 machine with an NVIDIA GPU, or a Mac: PyPI's torch is the build they need.
    if [ -n "$TORCH_INDEX_URL" ]; then
        echo "torch: from $TORCH_INDEX_URL$(pip_settings)"
        run_pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
    elif [ -n "$TORCH_WHEEL" ]; then
        echo "torch: from the kit's wheels/"
        run_pip install --no-index --find-links "$KIT/wheels" --no-deps "$WHEEL_TORCH_SPEC"
        torch_deps
    else
        echo "torch: from pip's index, PyPI unless configured otherwise ($KIND)$(pip_settings)"
        pip_install "$TORCH_SPEC"
    fi
fi
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    echo "torch was installed but does not import: $("$VENV/bin/python" -c 'import torch' 2>&1 | tail -n 1)" >&2
    exit 1
fi
pip_install "$KIT/@wheel@extra"

install -d -m 0755 "$PREFIX/etc"
install -m 0644 "$KIT/agent.yaml" "$PREFIX/etc/"
for public in @ca_cert @client_cert @doctor_cert; do
    if [ -f "$KIT/$public" ]; then install -m 0644 "$KIT/$public" "$PREFIX/etc/"; fi
done
for secret in @password @client_key @signing_key @doctor_password @doctor_key; do
    if [ -f "$KIT/$secret" ]; then install -m 0600 "$KIT/$secret" "$PREFIX/etc/"; fi
done

if [ "${NO_SERVICE:-0}" = 1 ] || [ "$(id -u)" != 0 ]; then
    install -d -m 0750 "$STATE_DIR" 2>/dev/null || echo "note: make $STATE_DIR writable by whoever runs the agent"
    echo "installed (no service user, no unit); run: @command"
    exit 0
fi
id @user >/dev/null 2>&1 || \
    useradd --system --home-dir @state_dir --shell /usr/sbin/nologin @user
# The unit's StateDirectory= makes it too, but doctor and a hand-started agent run before that.
install -d -m 0750 "$STATE_DIR"
chown @{user}:@user "$STATE_DIR"
for secret in @password @client_key @signing_key @doctor_password @doctor_key; do
    if [ -f "$PREFIX/etc/$secret" ]; then chown @{user}:@user "$PREFIX/etc/$secret"; fi
done
if [ -d "$UNIT_DIR" ]; then install -m 0644 "$KIT/@unit" "$UNIT_DIR/@unit"; fi
echo "installed; check:  $PREFIX/venv/bin/device-agent doctor --config $PREFIX/etc/agent.yaml"
if [ -d "$ROOT/run/systemd/system" ] && command -v systemctl >/dev/null 2>&1; then
    systemctl daemon-reload
    echo "then start:        systemctl enable --now @service"
else
    if [ -f "$UNIT_DIR/@unit" ]; then where="copied to $UNIT_DIR for a boot with systemd"; else where="not copied"; fi
    echo "systemd is not running here: the unit was not enabled ($where)."
    echo "start the agent by hand: su -s /bin/sh @user -c '@command'"
    if [ "$JETSON" = 1 ]; then echo "(for the GPU, first: usermod -aG video @user)"; fi
fi
