#!/usr/bin/env bash
# Install coordd as a systemd *user* service (systemctl --user; runs as you, not root).
#
#   deploy/systemd/install.sh [--config PATH] [--coordd PATH] [--dry-run]
#   deploy/systemd/install.sh --uninstall
#
# Copies coordd.service (next to this script) to ~/.config/systemd/user/, with
# ExecStart rewritten when --config or --coordd is given, then runs
#   systemctl --user daemon-reload && systemctl --user enable --now coordd
# --dry-run prints the unit and touches nothing.
set -euo pipefail

UNIT="coordd.service"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TEMPLATE="${HERE}/${UNIT}"
PROG="$(basename "$0")"
DEFAULT_COORDD="%h/.local/bin/coordd"
DEFAULT_CONFIG="%h/.config/coord/cluster.toml"

usage() {
    cat <<EOF
usage: ${PROG} [--config PATH] [--coordd PATH] [--dry-run]
       ${PROG} --uninstall

Install coordd as a systemd user service running: coordd --config CONFIG

  --config PATH  the cluster file (default: ~/.config/coord/cluster.toml)
  --coordd PATH  the coordd executable (default: ~/.local/bin/coordd)
  --dry-run      print the unit instead of installing it
  --uninstall    stop and disable the service and remove its unit
  -h, --help     show this help

Logs: journalctl --user -u coordd   Keep it running while logged out: loginctl enable-linger "\$USER"
EOF
}

die() {
    printf '%s: %s\n' "${PROG}" "$1" >&2
    exit "${2:-1}"
}

absolute() {
    case "$1" in
        /*) printf '%s' "$1" ;;
        *) printf '%s/%s' "${PWD}" "${1#./}" ;;
    esac
}

# One path as a word of a systemd command line: specifiers (%) and variables ($)
# escaped, quoted when it holds anything beyond plain path characters.
unit_word() {
    local word="$1"
    case "${word}" in
        *$'\n'*) die "newlines in paths are not supported: $1" 2 ;;
    esac
    word="$(printf '%s' "${word}" | sed -e 's/[\\"]/\\&/g' -e 's/%/%%/g' -e 's/\$/$$/g')"
    case "${word}" in
        *[!A-Za-z0-9_./+:@,=-]*) printf '"%s"' "${word}" ;;
        *) printf '%s' "${word}" ;;
    esac
}

# The home-relative defaults, as this user's real paths (for the checks below).
expand_home() {
    case "$1" in
        %h/*) printf '%s%s' "${HOME}" "${1#%h}" ;;
        *) printf '%s' "$1" ;;
    esac
}

coordd=""
config=""
dry_run=0
uninstall=0
while [ "$#" -gt 0 ]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        --dry-run) dry_run=1 ;;
        --uninstall) uninstall=1 ;;
        --config | --coordd)
            [ "$#" -ge 2 ] || die "$1 needs a path" 2
            if [ "$1" = "--config" ]; then config="$2"; else coordd="$2"; fi
            shift
            ;;
        --config=*) config="${1#--config=}" ;;
        --coordd=*) coordd="${1#--coordd=}" ;;
        *) usage >&2; die "unknown argument: $1" 2 ;;
    esac
    shift
done

unit_dir="${XDG_CONFIG_HOME:-${HOME}/.config}/systemd/user"
target="${unit_dir}/${UNIT}"

if [ "${uninstall}" -eq 1 ]; then
    [ "${dry_run}" -eq 0 ] || die "--uninstall and --dry-run do not go together" 2
    systemctl --user disable --now coordd 2>/dev/null || true
    rm -f "${target}"
    systemctl --user daemon-reload
    printf 'removed %s\n' "${target}"
    exit 0
fi

[ -f "${TEMPLATE}" ] || die "template missing: ${TEMPLATE}"

coordd_word="${DEFAULT_COORDD}"
coordd_path="$(expand_home "${DEFAULT_COORDD}")"
if [ -n "${coordd}" ]; then
    case "${coordd}" in
        */*) coordd_path="$(absolute "${coordd}")" ;;
        *)
            coordd_path="$(command -v "${coordd}" || true)"
            [ -n "${coordd_path}" ] || die "--coordd: no command ${coordd} on PATH" 2
            ;;
    esac
    coordd_word="$(unit_word "${coordd_path}")"
fi

config_word="${DEFAULT_CONFIG}"
config_path="$(expand_home "${DEFAULT_CONFIG}")"
if [ -n "${config}" ]; then
    config_path="$(absolute "${config}")"
    config_word="$(unit_word "${config_path}")"
fi

problems=0
if [ ! -x "${coordd_path}" ]; then
    # shellcheck disable=SC2016  # the $(...) is for the user to run
    printf '%s: %s is not an executable file; pass --coordd "$(command -v coordd)"\n' "${PROG}" "${coordd_path}" >&2
    problems=1
fi
if [ ! -f "${config_path}" ]; then
    printf '%s: no cluster file at %s (write one with: coord init %s, or pass --config PATH)\n' \
        "${PROG}" "${config_path}" "${config_path}" >&2
    problems=1
fi

exec_start="ExecStart=${coordd_word} --config ${config_word}"
render() {
    EXEC_START="${exec_start}" awk '/^ExecStart=/ { print ENVIRON["EXEC_START"]; next } { print }' "${TEMPLATE}"
}

if [ "${dry_run}" -eq 1 ]; then
    render
    exit 0
fi
[ "${problems}" -eq 0 ] || die "not installed" 2

mkdir -p "${unit_dir}"
tmp="$(mktemp "${unit_dir}/.${UNIT}.XXXXXX")"
trap 'rm -f "${tmp}"' EXIT
render >"${tmp}"
chmod 644 "${tmp}"
mv -f "${tmp}" "${target}"
trap - EXIT

was_active=0
if systemctl --user is-active --quiet coordd 2>/dev/null; then
    was_active=1
fi
if ! { systemctl --user daemon-reload && systemctl --user enable --now coordd; }; then
    die "systemctl --user failed (no user session? try: loginctl enable-linger \"\$USER\", then log in again)"
fi
if [ "${was_active}" -eq 1 ]; then
    # enable --now leaves a running daemon alone; restart it on the new unit.
    systemctl --user restart coordd
fi

cat <<EOF
installed ${target}
  runs:   ${coordd_path} --config ${config_path}
  status: systemctl --user status coordd   (or: coord status --config ${config_path})
  logs:   journalctl --user -u coordd
  stop:   systemctl --user stop coordd   (remove: ${PROG} --uninstall)
  to keep it running while you are logged out: loginctl enable-linger "\$USER"
EOF
