"""Models for a node's run: tiny shell scripts in a temp model dir, run in a 2 MB busybox image; file helpers.

The fixtures that run them are in tests/support/lab/model_run_fixtures.py.
"""

import json
from pathlib import Path

MODELS = {
    "perf.sh": (
        'echo "NODE_RANK=$NODE_RANK NNODES=$NNODES MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"\n'
        'for arg in "$@"; do echo "arg<$arg>"; done\n'
        "echo 'performance: 42 samples_per_second'\n"
    ),
    "crash.sh": "echo 'starting'\necho 'RuntimeError: NCCL communicator broke'\nexit 3\n",
    "pattern_only.sh": "echo 'Traceback (most recent call last)'\necho 'performance: 1 x'\nexit 0\n",
    "hang.sh": "echo 'waiting in allreduce'\nsleep 1000\n",
    "fail_later.sh": "sleep 1\necho 'rank lost its GPU'\nexit 1\n",
    "csv.sh": (
        "printf 'model,performance,metric\\ndummy,42,samples_per_second\\n' > perf_dummy.csv\n"
        "echo 'performance: 42 samples_per_second'\n"
    ),
    "csv_ranks.sh": (
        "for rank in 0 1; do printf 'model,performance,metric\\nr%s,4%s,samples_per_second\\n' $rank $rank "
        "> perf_dummy_rank$rank.csv; done\n"
    ),
    "list_data.sh": "ls /data\n",
}


def read_json(path):
    """A file's JSON."""
    return json.loads(Path(path).read_text())


def secrets_file(tmp_path, text):
    """A secrets file holding ``text``, mode 0600 as the run requires."""
    path = tmp_path / "secrets.env"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)
