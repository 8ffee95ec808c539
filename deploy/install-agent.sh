#!/usr/bin/env bash
# Install the coord agent on one node by hand, exactly as coordd does by itself:
# the same bundle zip, piped to the same install command, into
# $HOME/.coord/agent/<bundle_id> of the node's user.
#
#   deploy/install-agent.sh [-p PORT] [-i IDENTITY] [--python NODE_PYTHON] [user@]host
#
# "local" as the host means this machine, without SSH. Needs coord installed here
# (`coord agent-bundle` builds the zip); the node needs only ssh access and a Python.
set -euo pipefail

PROG="$(basename "$0")"

usage() {
    cat <<EOF
usage: ${PROG} [-p PORT] [-i IDENTITY] [--python NODE_PYTHON] [user@]host

Install the coord agent bundle on a node, as coordd would, and check it is there.

  [user@]host           the node; "local" is this machine (no SSH)
  -p PORT               SSH port
  -i IDENTITY           SSH private key
  --python NODE_PYTHON  the node's Python that runs the agent (default: python3);
                        use the node's "python" from the cluster file
  -h, --help            show this help

SSH runs with BatchMode=yes (keys only, no prompts) and checks host keys as usual:
trust a new node first (ssh-keyscan HOST >> ~/.ssh/known_hosts, after checking it).
The Python that has coord installed is found from COORD_PYTHON, coord's own
interpreter, python3 or python.
EOF
}

die() {
    printf '%s: %s\n' "${PROG}" "$1" >&2
    exit "${2:-1}"
}

port=""
identity=""
node_python="python3"
host=""
while [ "$#" -gt 0 ]; do
    case "$1" in
        -h | --help) usage; exit 0 ;;
        -p | -i | --python)
            [ "$#" -ge 2 ] || { usage >&2; die "$1 needs a value" 2; }
            case "$1" in
                -p) port="$2" ;;
                -i) identity="$2" ;;
                --python) node_python="$2" ;;
            esac
            shift
            ;;
        --python=*) node_python="${1#--python=}" ;;
        --)
            shift
            break
            ;;
        -*) usage >&2; die "unknown option: $1" 2 ;;
        *)
            [ -z "${host}" ] || { usage >&2; die "one host only, got: ${host} and $1" 2; }
            host="$1"
            ;;
    esac
    shift
done
if [ "$#" -gt 0 ]; then
    if [ -n "${host}" ] || [ "$#" -gt 1 ]; then
        usage >&2
        die "one host only" 2
    fi
    host="$1"
fi
[ -n "${host}" ] || { usage >&2; die "the node ([user@]host, or local) is required" 2; }
case "${host}" in
    -*) die "not a host: ${host}" 2 ;;
esac
[ -n "${node_python}" ] || die "--python needs a value" 2
if [ -n "${port}" ]; then
    case "${port}" in
        *[!0-9]*) die "-p wants a port number, got: ${port}" 2 ;;
    esac
fi

ssh_args=(-o BatchMode=yes)
if [ "${host}" = "local" ]; then
    [ -z "${port}${identity}" ] || die "-p and -i are for SSH nodes, not local" 2
else
    if [ -n "${port}" ]; then
        ssh_args+=(-p "${port}")
    fi
    if [ -n "${identity}" ]; then
        [ -f "${identity}" ] || die "no identity file at ${identity}" 2
        ssh_args+=(-i "${identity}")
    fi
fi

# Run shell words on the node, as coordd does: /bin/sh -c here, the login shell there.
on_node() {
    if [ "${host}" = "local" ]; then
        /bin/sh -c "$1"
    else
        ssh "${ssh_args[@]}" -- "${host}" "$1"
    fi
}

# The Python that has coord (the coordinator package) installed.
can_import() {
    "$1" -c 'import coordinator.nodes.agent_bundle' >/dev/null 2>&1
}
coord_python=""
candidates=()
if [ -n "${COORD_PYTHON:-}" ]; then
    candidates+=("${COORD_PYTHON}")
fi
coord_bin="$(command -v coord || true)"
if [ -n "${coord_bin}" ] && [ -f "${coord_bin}" ]; then
    shebang="$(head -n 1 "${coord_bin}" || true)"
    case "${shebang}" in
        '#!/'*python*) candidates+=("${shebang#\#!}") ;;
    esac
fi
candidates+=(python3 python)
for candidate in "${candidates[@]}"; do
    candidate="${candidate%% *}"
    if command -v "${candidate}" >/dev/null 2>&1 && can_import "${candidate}"; then
        coord_python="${candidate}"
        break
    fi
done
[ -n "${coord_python}" ] || die "no Python here can import coordinator (install coord, or set COORD_PYTHON)" 2

workdir="$(mktemp -d "${TMPDIR:-/tmp}/coord-agent.XXXXXX")"
trap 'rm -rf "${workdir}"' EXIT
zip="${workdir}/coord-agent.zip"

# 1. The bundle zip, from coord itself.
if [ -n "${coord_bin}" ]; then
    info="$(coord agent-bundle -o "${zip}")" || die "coord agent-bundle failed"
else
    info="$("${coord_python}" -m coordinator.cli.main agent-bundle -o "${zip}")" || die "coord agent-bundle failed"
fi
bundle_id="$(printf '%s' "${info}" | "${coord_python}" -c 'import json, sys; print(json.load(sys.stdin)["bundle_id"])')" ||
    die "cannot read the bundle id from: ${info}"
case "${bundle_id}" in
    "" | *[!A-Za-z0-9._+-]*) die "unexpected bundle id: ${bundle_id}" ;;
esac
[ -s "${zip}" ] || die "coord agent-bundle wrote no zip at ${zip}"

# 2. The daemon's own install command for this node's Python.
# shellcheck disable=SC2016  # the program is Python, not shell
install_cmd="$("${coord_python}" -c 'from coordinator.nodes.agent_bundle import build_bundle; import sys; b=build_bundle(); sys.stdout.write(b.install_command(sys.argv[1]))' "${node_python}")" ||
    die "cannot get the install command from ${coord_python}"
case "${install_cmd}" in
    *"/${bundle_id}\""*) ;;
    *) die "coord (${coord_bin:-${coord_python}}) and ${coord_python} built different bundles (coord: ${bundle_id}); set COORD_PYTHON to coord's own Python (or retry, if coord's files were just changed)" ;;
esac

# 3. Pipe the zip to the node and install it there.
printf 'installing agent %s on %s (node python: %s)\n' "${bundle_id}" "${host}" "${node_python}"
on_node "${install_cmd}" <"${zip}" || die "installing on ${host} failed (see above)"

# 4. The check the start command makes: the bundle's BUNDLE_ID file is there.
check_cmd="d=\"\$HOME/.coord/agent/${bundle_id}\"; test -f \"\$d/BUNDLE_ID\" && printf '%s\\n' \"\$d\""
installed_at="$(on_node "${check_cmd}" </dev/null)" || die "the agent is not installed on ${host} after installing it"
printf 'installed agent %s on %s at %s\n' "${bundle_id}" "${host}" "${installed_at}"
