#!/usr/bin/env bash
# Install coordd as a per-user LaunchAgent on the head Mac (runs as you, not root).
#
#   deploy/launchd/install.sh [--coordd PATH] [--dry-run] CONFIG
#   deploy/launchd/install.sh --uninstall
#
# Fills the placeholders of com.coord.coordd.plist (next to this script), writes
# ~/Library/LaunchAgents/com.coord.coordd.plist, checks it with plutil -lint and
# (re)loads it with launchctl bootstrap gui/UID. --dry-run prints the filled plist
# and touches nothing (it works on any OS).
set -euo pipefail

LABEL="com.coord.coordd"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TEMPLATE="${HERE}/${LABEL}.plist"
PROG="$(basename "$0")"

usage() {
    cat <<EOF
usage: ${PROG} [--coordd PATH] [--dry-run] CONFIG
       ${PROG} --uninstall

Install coordd as a LaunchAgent of the current user, running: coordd --config CONFIG

  CONFIG         the cluster file (made absolute; see: coord init)
  --coordd PATH  the coordd executable (default: command -v coordd)
  --dry-run      print the filled plist instead of installing it (any OS)
  --uninstall    unload the agent and remove its plist
  -h, --help     show this help

Logs: ~/Library/Logs/coord/coordd.log   Stop: launchctl bootout gui/\$(id -u)/${LABEL}
EOF
}

die() {
    printf '%s: %s\n' "${PROG}" "$1" >&2
    exit "${2:-1}"
}

# Absolute form of a path (the file need not exist); launchd starts jobs in /.
absolute() {
    case "$1" in
        /*) printf '%s' "$1" ;;
        *) printf '%s/%s' "${PWD}" "${1#./}" ;;
    esac
}

# The value as plist text (XML-escaped), then as a sed replacement for the | delimiter.
substitution() {
    case "$1" in
        *$'\n'*) die "newlines in paths are not supported: $1" 2 ;;
    esac
    printf '%s' "$1" | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/[\\&|]/\\&/g'
}

render() {
    local coordd config log_dir
    coordd="$(substitution "$1")"
    config="$(substitution "$2")"
    log_dir="$(substitution "$3")"
    sed -e "s|__COORDD__|${coordd}|g" -e "s|__CONFIG__|${config}|g" -e "s|__LOG_DIR__|${log_dir}|g" "${TEMPLATE}"
}

loaded() {
    launchctl print "gui/$(id -u)/${LABEL}" >/dev/null 2>&1
}

unload() {
    local tries=0
    if loaded; then
        launchctl bootout "gui/$(id -u)/${LABEL}" || true
        # bootout returns before the job is gone; bootstrapping too early fails with EIO.
        while loaded && [ "${tries}" -lt 50 ]; do
            sleep 0.2
            tries=$((tries + 1))
        done
        if loaded; then
            die "launchctl bootout did not unload ${LABEL}"
        fi
    fi
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
        --coordd)
            [ "$#" -ge 2 ] || die "--coordd needs a path" 2
            coordd="$2"
            shift
            ;;
        --coordd=*) coordd="${1#--coordd=}" ;;
        --) shift; break ;;
        -*) usage >&2; die "unknown option: $1" 2 ;;
        *)
            [ -z "${config}" ] || die "only one CONFIG, got: ${config} and $1" 2
            config="$1"
            ;;
    esac
    shift
done
if [ "$#" -gt 0 ]; then
    if [ -n "${config}" ] || [ "$#" -gt 1 ]; then
        die "only one CONFIG" 2
    fi
    config="$1"
fi

if [ "$(uname -s)" != "Darwin" ] && [ "${dry_run}" -eq 0 ]; then
    die "launchd is macOS only (this is $(uname -s)); on Linux use deploy/systemd/install.sh, or pass --dry-run to see the plist" 2
fi

target_dir="${HOME}/Library/LaunchAgents"
target="${target_dir}/${LABEL}.plist"

if [ "${uninstall}" -eq 1 ]; then
    [ "${dry_run}" -eq 0 ] || die "--uninstall and --dry-run do not go together" 2
    unload
    rm -f "${target}"
    printf 'removed %s (logs stay in %s)\n' "${target}" "${HOME}/Library/Logs/coord"
    exit 0
fi

if [ -z "${config}" ]; then
    usage >&2
    die "the cluster file (CONFIG) is required" 2
fi
config="$(absolute "${config}")"
if [ ! -f "${config}" ]; then
    [ "${dry_run}" -eq 1 ] || die "no cluster file at ${config} (write one with: coord init ${config})" 2
    printf '%s: warning: no cluster file at %s yet\n' "${PROG}" "${config}" >&2
fi

if [ -z "${coordd}" ]; then
    coordd="$(command -v coordd || true)"
    [ -n "${coordd}" ] || die "coordd is not on PATH; install coord (pip install coord) or pass --coordd PATH" 2
fi
case "${coordd}" in
    */*) coordd="$(absolute "${coordd}")" ;;
    *) coordd="$(command -v "${coordd}" || true)"; [ -n "${coordd}" ] || die "--coordd: no such command on PATH" 2 ;;
esac
if [ ! -x "${coordd}" ]; then
    [ "${dry_run}" -eq 1 ] || die "${coordd} is not an executable file" 2
    printf '%s: warning: %s is not an executable file\n' "${PROG}" "${coordd}" >&2
fi

log_dir="${HOME}/Library/Logs/coord"
[ -f "${TEMPLATE}" ] || die "template missing: ${TEMPLATE}"

if [ "${dry_run}" -eq 1 ]; then
    if command -v plutil >/dev/null 2>&1; then
        tmp="$(mktemp "${TMPDIR:-/tmp}/coordd-plist.XXXXXX")"
        trap 'rm -f "${tmp}"' EXIT
        render "${coordd}" "${config}" "${log_dir}" >"${tmp}"
        plutil -lint "${tmp}" >&2 || die "the filled plist does not pass plutil -lint"
    fi
    render "${coordd}" "${config}" "${log_dir}"
    exit 0
fi

mkdir -p "${target_dir}" "${log_dir}"
tmp="$(mktemp "${target_dir}/.${LABEL}.XXXXXX")"
trap 'rm -f "${tmp}"' EXIT
render "${coordd}" "${config}" "${log_dir}" >"${tmp}"
chmod 644 "${tmp}"
if command -v plutil >/dev/null 2>&1; then
    plutil -lint "${tmp}" >/dev/null || die "the filled plist does not pass plutil -lint: ${tmp}"
fi

unload
mv -f "${tmp}" "${target}"
trap - EXIT
# A job disabled earlier (launchctl disable) would refuse to bootstrap.
launchctl enable "gui/$(id -u)/${LABEL}" 2>/dev/null || true
launchctl bootstrap "gui/$(id -u)" "${target}" || die "launchctl bootstrap gui/$(id -u) ${target} failed"

cat <<EOF
installed ${target}
  runs:   ${coordd} --config ${config}
  logs:   ${log_dir}/coordd.log
  status: launchctl print gui/$(id -u)/${LABEL}   (or: coord status --config ${config})
  stop:   launchctl bootout gui/$(id -u)/${LABEL}   (remove: ${PROG} --uninstall)
EOF
