"""Which rank a hung run waits for: the analysis of every node's stacks (``nodes/<node>/stacks.json``).
The rules and the finding's fields: docs/hangs.md and docs/results.md. Pure logic, standard library only."""

from __future__ import annotations

import posixpath
import re
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.layout import NODES_DIR
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.hang.pyspy_ranks import is_launcher

STACKS_TEXT = "stacks.txt"
STACKS_JSON = "stacks.json"
COLLECTIVE = "collective"
RENDEZVOUS = "rendezvous"
UNKNOWN = "unknown"

# torch.distributed's calls that block until the other ranks make the same call (its collectives, DDP's start-up
# syncs). A frame counts only in torch.distributed's own files: threading's Event.wait is no collective.
COLLECTIVE_FUNCTIONS = frozenset(
    (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "_all_gather_base",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "_broadcast_coalesced",
        "reduce",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "barrier",
        "monitored_barrier",
        "send",
        "recv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
        "wait",
        "wait_tensor",
        "_sync_module_states",
        "_verify_param_shape_across_processes",
    )
)
# Joining the job: init_process_group and what it waits in (the store, the store-based barrier, the backend's
# exchange of addresses), and torchrun's agent waiting for the other nodes' agents.
RENDEZVOUS_FUNCTIONS = frozenset(
    (
        "init_process_group",
        "new_group",
        "init_device_mesh",
        "rendezvous",
        "_rendezvous",
        "next_rendezvous",
        "_env_rendezvous_handler",
        "_tcp_rendezvous_handler",
        "_create_c10d_store",
        "_create_tcp_store_server",
        "TCPStore",
        "_store_based_barrier",
        "_new_process_group_helper",
    )
)
_DISTRIBUTED_FILES = ("torch/distributed/", "torch/nn/parallel/distributed.py")
# The interpreter's and the installed packages' files: a stuck rank is named by the innermost frame of its own code.
_LIBRARY_FILE = re.compile(r"/(site|dist)-packages/|/lib/python\d[\d.]*/|^<")
# Ranks or groups named one by one in a summary before "and N more": a 512-rank hang stays one readable line.
NAMES_SHOWN = 8


class RankStack(NamedTuple):
    """One rank's main thread (frames innermost first), or None with why there is none."""

    rank: Optional[int]
    node: str
    frames: Optional[List[Mapping[str, Any]]]
    missing: str = ""


def _as_int(value: Any) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _main_frames(process: Mapping[str, Any]) -> Optional[List[Mapping[str, Any]]]:
    threads = [thread for thread in process.get("threads") or [] if isinstance(thread, Mapping)]
    main = [thread for thread in threads if thread.get("main")] or threads[:1]
    frames = main[0].get("frames") if main else None
    return [frame for frame in frames if isinstance(frame, Mapping)] if isinstance(frames, list) else None


def _ancestors(pid: int, parents: Mapping[int, Optional[int]]) -> List[int]:
    """The process's ancestors among the container's processes, nearest first (a snapshot may hold a loop)."""
    found = []  # type: List[int]
    while parents.get(pid) in parents and parents[pid] not in found and parents[pid] != pid:
        pid = parents[pid]
        found.append(pid)
    return found


def _node_ranks(node: str, stacks: Mapping[str, Any]) -> List[RankStack]:
    """The ranks one node's stacks show (see the module docstring)."""
    listed = [entry for entry in stacks.get("processes") or [] if isinstance(entry, Mapping)]
    entries = {_as_int(entry.get("pid")): entry for entry in listed if _as_int(entry.get("pid")) is not None}
    parents = {pid: _as_int(entry.get("ppid")) for pid, entry in entries.items()}
    candidates = {
        pid
        for pid, entry in entries.items()
        if entry.get("python")
        and _as_int(entry.get("rank")) is not None
        and not is_launcher(str(entry.get("command") or "").split())
    }
    # A data loader's worker or a multiprocessing child inherits its rank's RANK: it is part of that rank.
    ranks = {
        pid: _as_int(entries[pid].get("rank"))
        for pid in candidates
        if not candidates.intersection(_ancestors(pid, parents))
    }
    if not ranks:
        pythons = [pid for pid, entry in entries.items() if entry.get("python")]
        if not pythons:
            shown = posixpath.join(NODES_DIR, node, STACKS_TEXT)
            return [RankStack(_as_int(stacks.get("rank")), node, None, f"runs no Python process (see {shown})")]
        deepest = max(pythons, key=lambda pid: (len(_ancestors(pid, parents)), pid))
        ranks = {deepest: _as_int(stacks.get("rank"))}
    found = []
    for pid, rank in sorted(ranks.items(), key=lambda item: (item[1] is None, item[1] or 0, item[0])):
        frames = _main_frames(entries[pid])
        why = "" if frames else f"has no stacks: {entries[pid].get('error') or 'py-spy found no thread'}"
        found.append(RankStack(rank, node, frames or None, why))
    return found


def rank_stacks(
    stacks_by_node: Mapping[str, Optional[Mapping[str, Any]]], node_ranks: Optional[Mapping[str, int]] = None
) -> List[RankStack]:
    """Every rank's main thread from each node's stacks.json (None: the node wrote none), in rank order; a rank
    seen twice counts once."""
    ranks = {}  # type: Dict[Any, RankStack]
    for node, stacks in stacks_by_node.items():
        if not isinstance(stacks, Mapping):
            rank = (node_ranks or {}).get(node)
            found = [RankStack(rank, node, None, f"left no stacks ({node} wrote no {STACKS_JSON})")]
        else:
            found = _node_ranks(node, stacks)
        for entry in found:
            ranks.setdefault(entry.rank if entry.rank is not None else node, entry)
    return sorted(ranks.values(), key=lambda entry: (entry.rank is None, entry.rank or 0, entry.node))


def waits_in(frames: Sequence[Mapping[str, Any]]) -> Optional[Tuple[str, str]]:
    """(RENDEZVOUS or COLLECTIVE, the call it waits in) when the frames wait inside torch.distributed, else None.
    Rendezvous wins (init_process_group may run a barrier); the call named is the outermost one of its kind."""
    for kind, functions in ((RENDEZVOUS, RENDEZVOUS_FUNCTIONS), (COLLECTIVE, COLLECTIVE_FUNCTIONS)):
        calls = [
            str(frame.get("function"))
            for frame in frames
            if str(frame.get("function")).rsplit(".", 1)[-1] in functions
            and any(part in str(frame.get("file") or "") for part in _DISTRIBUTED_FILES)
        ]
        if calls:
            return kind, calls[-1]
    return None


def _signature(frames: Sequence[Mapping[str, Any]]) -> Tuple[Tuple[str, str], ...]:
    # Functions and files, not lines: two ranks in the same loop at different lines are in the same place.
    return tuple((str(frame.get("function")), str(frame.get("file"))) for frame in frames)


def where(frames: Sequence[Mapping[str, Any]]) -> str:
    """Where a thread is, as a person reads it: the innermost frame of the model's own code (not the interpreter's
    nor an installed package's), else the innermost frame: ``load_batch (train.py:12)``."""
    own = [frame for frame in frames if not _LIBRARY_FILE.search(str(frame.get("file") or ""))]
    frame = (own or list(frames) or [{}])[0]
    file = posixpath.basename(str(frame.get("file") or "?"))
    return f"{frame.get('function', '?')} ({file}:{frame.get('line', '?')})"


def _who(entry: RankStack) -> str:
    return f"rank {entry.rank} ({entry.node})" if entry.rank is not None else entry.node


def ranks_text(ranks: Sequence[Any]) -> str:
    """``rank 2``, ``ranks 0 and 1``, ``ranks 0-62 and 64``: runs of three or more as a range."""
    numbers = sorted(rank for rank in ranks if isinstance(rank, int))
    runs = []  # type: List[List[int]]
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    parts = []
    for run in runs:
        parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(number) for number in run]
    parts += [str(rank) for rank in ranks if not isinstance(rank, int)]
    return ("rank " if len(numbers) == 1 and len(parts) == 1 else "ranks ") + _joined(parts)


def _joined(parts: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``; past NAMES_SHOWN, ``... and N more``."""
    if len(parts) > NAMES_SHOWN:
        parts = list(parts[:NAMES_SHOWN]) + [f"{len(parts) - NAMES_SHOWN} more"]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _place(entry: RankStack) -> str:
    """The call a waiting rank waits in, else where it is."""
    waits = waits_in(entry.frames or [])
    return waits[1] if waits else where(entry.frames or [])


# The verbs of a summary, for one rank and for several: "rank 3 waits in", "ranks 0 and 1 wait in".
_WAIT = ("waits", "wait")
_BE = ("is", "are")


def _places_text(ranks: Sequence[RankStack], verb: Tuple[str, str]) -> str:
    """``ranks 0 and 1 wait in all_reduce and rank 3 in barrier``: the ranks grouped by the call they wait in, or
    by their place (functions and files)."""
    groups = {}  # type: Dict[Any, List[RankStack]]
    for entry in ranks:
        waits = waits_in(entry.frames or [])
        groups.setdefault(waits[1] if waits else _signature(entry.frames or []), []).append(entry)
    parts = []
    for group in groups.values():
        said = f" {verb[len(group) > 1]}" if not parts else ""
        parts.append(f"{ranks_text([entry.rank for entry in group])}{said} in {_place(group[0])}")
    return _joined(parts)


def _odd_ones_out(ranks: Sequence[RankStack]) -> Optional[List[RankStack]]:
    """The ranks alone in their place when all the others share one (at least two), else None."""
    groups = {}  # type: Dict[Tuple, List[RankStack]]
    for entry in ranks:
        groups.setdefault(_signature(entry.frames or []), []).append(entry)
    shared = [group for group in groups.values() if len(group) > 1]
    alone = [group[0] for group in groups.values() if len(group) == 1]
    return alone if len(shared) == 1 and alone else None


def _finding(kind: str, stuck: Sequence[RankStack], waiting: Sequence[RankStack], summary: str, stacks: Dict) -> Dict:
    return {
        "kind": kind,
        "stuck_ranks": [entry.rank for entry in stuck],
        "waiting_ranks": [entry.rank for entry in waiting],
        "never_joined": [entry.rank for entry in stuck] if kind == RENDEZVOUS else [],
        "summary": summary,
        "stacks": stacks,
    }


def _stuck_where(frames: Sequence[Mapping[str, Any]]) -> str:
    # A stuck rank inside a collective of its own (another one than the others') says which, and where it called it.
    waits = waits_in(frames)
    return f"{waits[1]} at {where(frames)}" if waits else where(frames)


def _stuck_text(entry: RankStack) -> str:
    """``rank 2 (node3) is stuck in load_batch (train.py:12)``; a rank without stacks says why it has none."""
    if entry.frames is None:
        return f"{_who(entry)} {entry.missing}"
    return f"{_who(entry)} is stuck in {_stuck_where(entry.frames)}"


def _never_joined_text(entry: RankStack) -> str:
    """``rank 2 (node3) never joined: it is in load_weights (train.py:30)``."""
    doing = entry.missing if entry.frames is None else f"is in {_stuck_where(entry.frames)}"
    return f"{_who(entry)} never joined: it {doing}"


def hang_finding(
    stacks_by_node: Mapping[str, Optional[Mapping[str, Any]]], node_ranks: Optional[Mapping[str, int]] = None
) -> Dict[str, Any]:
    """The finding on a hung run from its nodes' stacks.json (parsed; None for a node that wrote none, named by
    its rank in ``node_ranks`` when given). See the module docstring."""
    stacks = {
        node: posixpath.join(NODES_DIR, node, STACKS_TEXT)
        for node, content in stacks_by_node.items()
        if isinstance(content, Mapping)
    }
    ranks = rank_stacks(stacks_by_node, node_ranks)
    seen = [entry for entry in ranks if entry.frames is not None]
    unseen = [entry for entry in ranks if entry.frames is None]
    waiting = [entry for entry in seen if waits_in(entry.frames or [])]
    if not seen:
        shown = next(iter(stacks.values())) if len(stacks) == 1 else posixpath.join(NODES_DIR, "<node>", STACKS_TEXT)
        summary = f"no Python stacks: see docker top and the log in {shown}" if stacks else "no node left its stacks"
        return _finding(UNKNOWN, [], [], summary, stacks)

    apart = []  # type: List[RankStack]
    if len(waiting) == len(seen) and unseen:
        stuck = unseen  # every rank that shows its stacks waits: for the ones that show none
    elif waiting and len(waiting) < len(seen):
        # Beside a rank seen stuck, one that shows no stacks is named apart, not stuck: nothing says it is (a rank
        # dumped once its peer's collective broke, printing that traceback past its last frame, shows none).
        stuck = [entry for entry in seen if entry not in waiting]
        apart = unseen
    elif len(ranks) == 1:
        stuck, waiting = seen, []
    else:
        stuck = _odd_ones_out(seen) or []
        waiting = [entry for entry in seen if entry not in stuck]
    if not stuck:
        if len({_signature(entry.frames or []) for entry in seen}) == 1:
            summary = f"every rank is in the same place, {_place(seen[0])}: no odd one out"
        else:
            summary = f"the ranks' stacks differ with no odd one out: {_places_text(seen, _BE)}"
        return _finding(UNKNOWN, [], [], summary, stacks)

    kinds = {waits_in(entry.frames or [])[0] for entry in waiting if waits_in(entry.frames or [])}
    kind = RENDEZVOUS if RENDEZVOUS in kinds else COLLECTIVE if kinds else UNKNOWN
    if kind == RENDEZVOUS:
        summary = f"{_places_text(waiting, _WAIT)}; {_joined([_never_joined_text(entry) for entry in stuck])}"
    else:
        summary = _joined([_stuck_text(entry) for entry in stuck])
        if waiting:
            summary += f" while {_places_text(waiting, _WAIT if kinds else _BE)}"
    if apart:
        summary += f"; {_joined([_stuck_text(entry) for entry in apart])}"
    return _finding(kind, stuck, waiting, summary, stacks)
