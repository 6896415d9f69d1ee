#!/bin/sh
# Install the fedfleet agent of device @device (fleet @fleet) under @prefix.
#   sudo sh install.sh           venv, torch (@kind), the agent wheel, config and secrets, systemd unit
# Environment: PYTHON (default python3), TORCH_SPEC (default torch), TORCH_INDEX_URL, NO_SERVICE=1 (skip the
# user and unit), PIP_* (pip's own options). With a wheels/ folder in the kit, everything installs offline.
set -eu
KIT=$(cd "$(dirname "$0")" && pwd)
PREFIX=@prefix
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "fedfleet agent needs Python >= 3.10 ($PYTHON is $("$PYTHON" -V 2>&1))." >&2
    echo "Jetson Nano (JetPack 4, Python 3.6) cannot run it; Orin boards on JetPack 6 can." >&2
    exit 1
fi
[ -x "$PREFIX/venv/bin/python" ] || "$PYTHON" -m venv "$PREFIX/venv"
PIP="$PREFIX/venv/bin/python -m pip"
OFFLINE=""
[ -d "$KIT/wheels" ] && OFFLINE="--no-index --find-links $KIT/wheels"
if "$PREFIX/venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "torch: already installed in $PREFIX/venv"
else
    case @kind in
    jetson)
        echo "Jetson: PyPI's aarch64 torch has no CUDA. Install NVIDIA's JetPack wheel into the venv, e.g." >&2
        echo "  $PIP install torch --index-url https://pypi.jetson-ai-lab.io/jp6/cu126   (JetPack 6)" >&2
        echo "  or the wheel from https://developer.nvidia.com/embedded/downloads for your JetPack," >&2
        echo "then run this script again. (TORCH_INDEX_URL=$TORCH_CPU_INDEX runs CPU-only.)" >&2
        [ -n "${TORCH_INDEX_URL:-}" ] || exit 2
        $PIP install $OFFLINE "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL" ;;
    cpu)
        # The CPU index: no CUDA wheels (gigabytes) on a Raspberry Pi or an x86 box without a GPU.
        if [ -n "$OFFLINE" ]; then $PIP install $OFFLINE "$TORCH_SPEC"
        else $PIP install "$TORCH_SPEC" --index-url "${TORCH_INDEX_URL:-@torch_cpu_index}"; fi ;;
    *)
        $PIP install $OFFLINE "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} ;;
    esac
fi
$PIP install $OFFLINE "$KIT/@wheel@extra"
install -d -m 0755 "$PREFIX/etc"
install -m 0644 "$KIT/agent.yaml" "$PREFIX/etc/"
for public in @ca_cert @client_cert; do
    if [ -f "$KIT/$public" ]; then install -m 0644 "$KIT/$public" "$PREFIX/etc/"; fi
done
for secret in @password @client_key @signing_key; do
    if [ -f "$KIT/$secret" ]; then install -m 0600 "$KIT/$secret" "$PREFIX/etc/"; fi
done
if [ "${NO_SERVICE:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v systemctl >/dev/null 2>&1; then
    id @user >/dev/null 2>&1 || \
        useradd --system --home-dir @state_dir --shell /usr/sbin/nologin @user
    for secret in @password @client_key @signing_key; do
        if [ -f "$PREFIX/etc/$secret" ]; then chown @{user}:@user "$PREFIX/etc/$secret"; fi
    done
    install -m 0644 "$KIT/@unit" /etc/systemd/system/@unit
    systemctl daemon-reload
    echo "installed; check:  $PREFIX/venv/bin/device-agent doctor --config $PREFIX/etc/agent.yaml"
    echo "then start:        systemctl enable --now @service"
else
    echo "installed (no service); run: @command"
fi
