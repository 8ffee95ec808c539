"""The example cluster file ``coord init`` without --hosts writes (``deploy/cluster.example.toml`` is a copy)."""

EXAMPLE_CLUSTER = '''\
# coord cluster file. Check it with: coord daemon --config THIS_FILE
# Each node may have its own user, home, Python and workdir.

[cluster]
name = "lab"
# state_dir = "..."    # default: ~/Library/Application Support/coord on macOS, ~/.local/state/coord elsewhere
# socket = "..."       # default: <state_dir>/coord.sock
# checkpoint_store = "s3://bucket/coord" # every checkpoint uploaded there too (docs/checkpoint-storage.md)

[ssh]                  # defaults for every node, all optional
# known_hosts = "~/.ssh/known_hosts"     # host keys are always verified against this file
# identity_file = "~/.ssh/id_ed25519"    # key authentication only, never passwords
# config = "~/.ssh/config"               # honoured by default: Host aliases, HostName, User, Port
# keepalive_s = 2                        # a lost node is noticed within about 3 keepalives

[sync]                 # what `coord sync` sends, and what pre-flight compares; all optional
# source = "~/project"                   # the project directory on this machine (default: --source)
# hook = "scripts/pre-sync.sh"           # run before each sync, relative to the source; non-zero blocks
# ignore = ["*.log", "outputs/"]         # on top of .coordignore and the defaults (.git, venvs, checkpoints...)
# threshold = 0.95                       # agreement ratio below which a launch is blocked
# script = "train.py"                    # relative to each node's workdir; a node may override these
# data = ["data/train.jsonl", "data/valid.jsonl"]
# model = "models/tiny"

[dashboard]            # the daemon's HTTP server: Prometheus /metrics (and the dashboard)
# listen = "127.0.0.1:8470"              # the default; any other address needs a token
# token = "..."                          # sent as Authorization: Bearer ... or ?token=...
# enabled = true

[[nodes]]
name = "n1"
host = "local"                           # "local" = this machine, no SSH
workdir = "/Users/alice/coord-work"      # where code, data and checkpoints live on that node
# python = "/Users/alice/venv/bin/python"  # default for "local": the Python running coord

[[nodes]]
name = "n2"
host = "10.0.0.2"                        # an address, or a Host alias from the ssh config
user = "bob"                             # optional
# port = 22                              # optional
python = "/opt/mlx/bin/python"           # the node's training Python (has mlx and mlx-lm)
workdir = "/Users/bob/work"
# ips = ["192.168.2.2"]                  # optional: addresses ranks should talk over

# [[alerts]]           # where to hear about a job; as many as you like, each one destination
# name = "phone"
# webhook = "https://ntfy.sh/my-secret-topic"   # or: command = ["/usr/local/bin/notify", "--urgent"]
# format = "ntfy"                        # generic (JSON, the default), slack or ntfy
# on = ["job_failed", "job_stalled", "node_down"]   # default: job_failed, diverged, loss_spike,
#                                                   # durability_lag; also job_succeeded, job_restarted, straggler
# stalled_minutes = 30                   # job_stalled: no progress for this long
# node_down_minutes = 5                  # node_down: down for longer than this
'''
