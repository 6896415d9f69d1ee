#!/bin/sh
# Remove the fedfleet agent of device @device (fleet @fleet) that install.sh put under @prefix.
#   sudo sh uninstall.sh          stop and disable the unit (with systemd), remove it and the venv; keep
#                                 @prefix/etc (config, secrets) and @state_dir (outbox, logs)
#   sudo sh uninstall.sh --purge  also remove those and the @user user
# For tests: FEDFLEET_ROOT (prefix of every system path).
set -eu
ROOT=${FEDFLEET_ROOT:-}
PREFIX=$ROOT@prefix
STATE_DIR=$ROOT@state_dir
UNIT_FILE=$ROOT/etc/systemd/system/@unit
PURGE=0
for arg; do
    case $arg in
    --purge) PURGE=1 ;;
    *) echo "usage: sh uninstall.sh [--purge]" >&2; exit 2 ;;
    esac
done
SYSTEMD=0
if [ -d "$ROOT/run/systemd/system" ] && command -v systemctl >/dev/null 2>&1; then SYSTEMD=1; fi
if [ "$SYSTEMD" = 1 ]; then
    systemctl disable --now @service 2>/dev/null || echo "@service: was not enabled or running"
fi
if [ -f "$UNIT_FILE" ]; then
    rm -f "$UNIT_FILE"
    if [ "$SYSTEMD" = 1 ]; then systemctl daemon-reload; fi
    echo "removed the unit $UNIT_FILE"
fi
rm -rf "${PREFIX:?}/venv"
echo "removed $PREFIX/venv"
if [ "$PURGE" = 1 ]; then
    rm -rf "${PREFIX:?}/etc" "${STATE_DIR:?}"
    rmdir "$PREFIX" 2>/dev/null || true
    if id @user >/dev/null 2>&1; then userdel @user; fi
    echo "purged $PREFIX/etc (config and secrets), $STATE_DIR and the @user user"
else
    echo "kept $PREFIX/etc (config and secrets) and $STATE_DIR (outbox, logs); --purge removes them"
fi
