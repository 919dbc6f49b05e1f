"""The streamed image transport: rank 0's `docker save` reaches every worker's `docker load` over TCP, in one pass.

Rank 0 runs `docker save` once and tees the bytes into the shared cache entry (the same file and marker the
publish path writes, so a later job still finds the tar) and to its children; every worker pipes what it receives
into `docker load` as it arrives and forwards it to its own children: nodes form a tree of `fanout` children per
node (fanout 1: a chain 0 -> 1 -> 2 ...), so save, transfer and every load overlap and the shared filesystem serves
the image once, not once per node. When the cache already holds the entry, rank 0 streams that file instead.

Each hop is plain TCP from a child to its parent's address on a port derived from the job like the barrier's
(`derive_stream_ports`), authenticated with the run's barrier token as the barrier is (HMAC over the other side's
fresh nonce, the token never on the wire). A connection opens with lines of at most MAX_LINE_BYTES:

    child  -> parent  JOIN <rank> <hostname> <child-nonce> <mac>            the barrier's JOIN, and the child's
                                                                          proof of the token over its nonce
    parent -> child   HELLO <parent-nonce> <image-id> <size-estimate> <mac>  proves the parent holds the token
    child  -> parent  WANT <need|have> <mac>                               proves the child holds it; whether its
                                                                          subtree needs the image
then frames from parent to child, each a type byte, a 4-byte big-endian length and the payload:

    D  data, at most MAX_DATA_BYTES
    E  <size> <sha256> <mac>   the end: what the whole stream must have been
    A  <mac> <reason>          the sender gave up (the receivers fall back to the shared cache)
    S  <mac>                   skip: no node below needs the image

Every receiver holds the last bytes back from `docker load` (cache/load.py's HeldBackTail, the cache load's own
logic) until size and sha256 match the trailer, so a stream that breaks (a sender or a hop died) or carries a
wrong byte aborts every `docker load` downstream before the daemon can register anything; the nodes still missing
the image then load the shared tar cache, which rank 0 writes whatever happens to the stream (rank 0's heartbeat
file beside the entry tells them when rank 0 itself died, so they fail at once instead of waiting for an entry that
will never come). A node that already holds the image only forwards, and rank 0 skips the transfer when no node
needs it. Memory per hop is bounded: one frame plus the held-back tail. Standard library and the docker CLI only (py38).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Callable, Optional

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.docker_cli import DockerError, run_docker
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.announcement import HEARTBEAT_STALE_SECONDS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.entries import (
    CHUNK_BYTES,
    MARKER_POLL_INTERVAL,
    CacheDirectory,
    ImageCacheError,
    check_cache_dir,
    entry_key,
    remove_quietly,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.load import HeldBackLoad, load_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.cache.publish import publish_image
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.stream_protocol import (
    ABORT,
    DATA,
    SKIP,
    Channel,
    Fanout,
    StreamBroken,
    StreamError,
    StreamJob,
    admit_children,
    format_want,
    join_parent,
    listen,
    parse_control,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import SETTING_DEFAULTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.wire import (
    ProtocolViolation,
    Session,
)

DEFAULT_FALLBACK_WAIT = float(SETTING_DEFAULTS["image_stream_fallback_wait"])
PROGRESS_MIN_BYTES = 1 << 30  # images over 1 GB report bytes and rate as they go
PROGRESS_INTERVAL = 5.0
HEARTBEAT_INTERVAL = 2.0


# ------------------------------------------------------------------------------------------------------ progress


class Progress:
    """Bytes and rate so far, handed to `report` every PROGRESS_INTERVAL seconds for images over 1 GB."""

    def __init__(self, size_estimate: int, report: Optional[Callable[[dict], None]]):
        self.started = time.monotonic()
        self.bytes = 0
        self._report = report if report and size_estimate > PROGRESS_MIN_BYTES else None
        self._size = size_estimate
        self._next = self.started + PROGRESS_INTERVAL

    def add(self, count: int) -> None:
        self.bytes += count
        if self._report and time.monotonic() >= self._next:
            self._next = time.monotonic() + PROGRESS_INTERVAL
            self._report(self.figures())

    def figures(self) -> dict:
        seconds = max(1e-6, time.monotonic() - self.started)
        return {
            "bytes": self.bytes,
            "size_estimate": self._size,
            "seconds": round(seconds, 3),
            "rate_mb_s": round(self.bytes / seconds / 1e6, 1),
        }


# --------------------------------------------------------------------------------------------- rank 0's heartbeat


def heartbeat_path(cache: CacheDirectory, key: str) -> str:
    """Where rank 0 shows it is still writing entry `key`: a temporary file's name, so `prune` removes one left
    behind by a killed rank 0 after an hour."""
    return os.path.join(cache.root, f".{key}.publisher.json.tmp")


class PublisherHeartbeat:
    """Rank 0 rewrites its heartbeat file every `interval` seconds while it streams and writes the cache entry,
    and removes it when done: a worker whose stream broke then knows whether the entry will still come."""

    def __init__(self, cache: CacheDirectory, key: str, interval: float = HEARTBEAT_INTERVAL):
        self.path = heartbeat_path(cache, key)
        self._root = cache.root
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._beats = 0

    def __enter__(self) -> PublisherHeartbeat:
        if check_cache_dir(self._root, create=True):
            self._beat()
            self._thread.start()
        return self

    def _beat(self) -> None:
        self._beats += 1
        beat = {"host": socket.gethostname(), "pid": os.getpid(), "beat": self._beats}
        try:
            with open(self.path, "w") as handle:
                handle.write(json.dumps(beat))
        except OSError:
            pass  # a missed beat: the workers' patience covers several

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._beat()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        remove_quietly(self.path)


def wait_for_rank0_entry(
    cache: CacheDirectory, key: str, wait: float, rank0: str, stale_after: float = HEARTBEAT_STALE_SECONDS
) -> None:
    """Wait up to `wait` seconds for rank 0 to commit entry `key`, but raise StreamError as soon as its heartbeat
    says it died (stood still `stale_after` seconds) or ended without committing (gone, and no marker)."""
    path = heartbeat_path(cache, key)
    started = time.monotonic()
    last_beat, last_change, seen = None, started, False
    while time.monotonic() - started < wait:
        if cache.wait_for_marker(key, 0) is not None:
            return
        try:
            with open(path) as handle:
                beat = handle.read()
        except OSError:
            beat = None
        now = time.monotonic()
        # The marker is committed before the beat goes: no beat and no marker means rank 0 gave up.
        if beat is None and seen and cache.wait_for_marker(key, 0) is None:
            raise StreamError(
                f"{rank0} ended without committing the shared cache entry {cache.tar_path(key)}: its image_stream "
                "task failed (its error says why); nothing was loaded on this node"
            )
        if beat != last_beat:
            last_beat, last_change, seen = beat, now, seen or beat is not None
        elif beat is not None and now - last_change > stale_after:
            raise StreamError(
                f"{rank0} died while writing the shared cache entry: its heartbeat {path} stood still for "
                f"{stale_after:g} s (its image_stream module or its node is gone); nothing was loaded on this node. "
                "Run the job again, or exclude that node"
            )
        time.sleep(MARKER_POLL_INTERVAL)


# ------------------------------------------------------------------------------------------------------ rank 0


def send_image(
    cache: CacheDirectory,
    image: str,
    job: StreamJob,
    announce: Optional[Callable[[str], None]] = None,
    report: Optional[Callable[[dict], None]] = None,
) -> dict:
    """Rank 0: stream `image` to the tree below, writing the cache entry on the way; what was done.

    `announce(image_id)` is called once the listener is up (pull mode writes rank 0's announcement then). The
    cache entry is written whatever happens to the stream: it is every node's fallback.
    """
    started = time.monotonic()
    inspected = cache.inspect(image)
    if inspected is None:
        raise StreamError(f"image {image!r} is not on this node's Docker daemon: build or load it before streaming")
    image_id = inspected["Id"]
    with PublisherHeartbeat(cache, entry_key(image_id)):
        result = _send(cache, image, image_id, int(inspected.get("Size") or 0), job, announce, report)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def _send(cache, image, image_id, size_estimate, job, announce, report) -> dict:
    listener = listen(job.addresses[job.rank], job.ports) if job.children else None
    try:
        if announce:
            announce(image_id)
        children = (
            admit_children(listener, job, image_id, size_estimate, time.monotonic() + job.setup_timeout)
            if listener
            else {}
        )
    finally:
        if listener:
            listener.close()
    fanout = Fanout(job.token, children, job.io_timeout)
    missing = {rank: "never joined" for rank in job.children if rank not in children}
    result = {"image_id": image_id, "bytes": 0, "changed": False, "stream_error": None}
    try:
        fanout.release_unneeded()
        if not fanout.needed:
            result.update(action_taken="skipped")
            if missing:  # a child that never joined loads the cache instead: it must be there
                published = publish_image(cache, image)
                result.update(_rank0_result("saved", published, None, Progress(0, None)))
        else:
            result.update(_stream_from_rank0(cache, image, image_id, fanout, Progress(size_estimate, report)))
    finally:
        fanout.close()
    missing.update(fanout.dropped)
    result["children_lost"] = {job.name(rank): why for rank, why in sorted(missing.items())}
    return result


def _stream_from_rank0(cache: CacheDirectory, image: str, image_id: str, fanout: Fanout, progress: Progress) -> dict:
    key = entry_key(image_id)
    tar = cache.tar_path(key)
    marker = cache.read_marker(key) if check_cache_dir(cache.root, create=True) else None
    if marker is not None and os.path.exists(tar) and os.path.getsize(tar) == marker["size"]:
        return _stream_file(tar, marker, fanout, progress)

    def tee(chunk) -> None:
        fanout.data(chunk)
        progress.add(len(chunk))

    try:
        published = publish_image(cache, image, tee=tee)
    except (ImageCacheError, DockerError) as error:
        # The workers' loads are aborted; the cache entry, written the plain way, is what they load instead.
        fanout.abort(f"rank 0 could not stream {image}: {error}. Loading the shared tar cache instead")
        published = publish_image(cache, image)
        return _rank0_result("saved", published, str(error), progress)
    if published.streamed is None:  # another publisher committed the entry meanwhile: stream that file
        return _stream_file(tar, cache.read_marker(key), fanout, progress)
    fanout.end(*published.streamed)
    return _rank0_result("streamed", published, None, progress)


def _rank0_result(action: str, published, error: Optional[str], progress: Progress) -> dict:
    figures = progress.figures()
    return {
        "action_taken": action,
        "changed": True,
        "entry": published.entry,
        "bytes": published.bytes,
        "rate_mb_s": figures["rate_mb_s"],
        "stream_error": error,
    }


def _stream_file(tar: str, marker: dict, fanout: Fanout, progress: Progress) -> dict:
    """Stream a committed entry's tar (read once): a later job's image, already in the cache."""
    with open(tar, "rb") as source:
        for chunk in iter(lambda: source.read(CHUNK_BYTES), b""):
            fanout.data(chunk)
            progress.add(len(chunk))
    if progress.bytes != int(marker["size"]):
        fanout.abort(f"cache entry {tar} changed size while it was streamed")
        raise StreamError(f"cache entry {tar} has {progress.bytes} bytes, its marker says {marker['size']}")
    # The receivers check the marker's hash: a damaged entry aborts their loads, as the cache load would.
    fanout.end(int(marker["size"]), marker["sha256"])
    return {
        "action_taken": "streamed-from-cache",
        "changed": False,
        "entry": tar,
        "bytes": progress.bytes,
        "rate_mb_s": progress.figures()["rate_mb_s"],
        "stream_error": None,
    }


# ------------------------------------------------------------------------------------------------------ workers


def receive_image(
    cache: CacheDirectory,
    job: StreamJob,
    image: Optional[str] = None,
    image_id: Optional[str] = None,
    fallback_wait: float = DEFAULT_FALLBACK_WAIT,
    report: Optional[Callable[[dict], None]] = None,
    open_load: Optional[Callable[[], HeldBackLoad]] = None,
    heartbeat_stale: float = HEARTBEAT_STALE_SECONDS,
) -> dict:
    """A worker: receive the stream from its parent into `docker load`, forward it to its children, and fall back
    to the shared cache when the stream breaks; what was done. `image_id` (pull mode's announcement) is what
    the stream must carry; without it the parent's HELLO names it. `open_load` makes the held-back load (tests);
    `heartbeat_stale`: how long rank 0's heartbeat may stand still before the fallback wait gives up."""
    started = time.monotonic()
    deadline = started + job.setup_timeout
    open_load = open_load or (lambda: HeldBackLoad(cache.docker_timeout, cache.docker_host))
    listener = listen(job.addresses[job.rank], job.ports) if job.children else None
    fanout = Fanout(job.token, {}, job.io_timeout)
    result = {"bytes": 0, "changed": False, "stream_error": None}
    parent = None
    try:
        try:
            parent, session, announced, size_estimate = join_parent(job, deadline)
            if image_id and announced != image_id:
                raise StreamBroken(f"the stream carries image {announced}, rank 0 announced {image_id}")
            image_id = announced
            holds = cache.image_id_of(image_id) == image_id
            if listener:
                fanout.children.update(admit_children(listener, job, image_id, size_estimate, deadline))
                listener.close()
                listener = None
            parent.send(format_want(job.token, session, not holds or fanout.needed), job.io_timeout)
            fanout.release_unneeded()
            progress = Progress(size_estimate, report)
            action = _relay(parent, session, job, fanout, None if holds else open_load, progress)
            result.update(bytes=progress.bytes, rate_mb_s=progress.figures()["rate_mb_s"])
            if holds:
                action = "already-present"
        except (StreamBroken, ProtocolViolation, OSError, DockerError) as error:
            reason = str(error) or type(error).__name__
            fanout.abort(f"{job.name(job.rank)} lost the stream: {reason}")
            result["stream_error"] = f"{job.name(job.rank)}: {reason}"
            action = None
    finally:
        fanout.close()
        if listener:
            listener.close()
        if parent:
            parent.close()
    result["children_lost"] = {job.name(rank): why for rank, why in sorted(fanout.dropped.items())}
    if action is None:
        if not image_id:
            raise StreamError(
                f"{result['stream_error']}; and this node does not know rank 0's image ID to load it from the "
                "shared tar cache instead (give image_id)"
            )
        if cache.image_id_of(image_id) != image_id:
            wait_for_rank0_entry(cache, entry_key(image_id), fallback_wait, job.name(0), heartbeat_stale)
        loaded = load_image(cache, image_id, image=image, marker_wait=0)
        action = "already-present" if loaded.action_taken in ("already-present", "tagged") else "loaded-from-cache"
        result.update(entry=loaded.entry, bytes=loaded.bytes)
    elif action == "streamed" and cache.image_id_of(image_id) != image_id:
        raise StreamError(
            f"the stream was loaded, but this node's daemon has no image {image_id} afterwards: the stream held "
            "another image (or this daemon's image store names images differently from rank 0's)"
        )
    if image and action != "skipped" and cache.image_id_of(image) != image_id:
        run_docker(["tag", image_id, image], timeout=cache.docker_timeout, host=cache.docker_host)
        result["changed"] = True
    result.update(
        action_taken=action,
        image_id=image_id,
        changed=result["changed"] or action in ("streamed", "loaded-from-cache"),
        seconds=round(time.monotonic() - started, 3),
    )
    return result


def _relay(parent: Channel, session: Session, job: StreamJob, fanout: Fanout, open_load, progress: Progress) -> str:
    """Pass the parent's frames on to the children and into docker load until the trailer; the action taken."""
    load = None
    try:
        while True:
            kind, payload = parent.read_frame(job.io_timeout)
            if kind == DATA:
                fanout.data(payload)
                if open_load is not None:
                    if load is None:
                        load = open_load()
                    load.feed(payload)
                progress.add(len(payload))
                continue
            fields = parse_control(kind, payload, job.token, session)
            if kind == SKIP:
                fanout.control(SKIP)
                if open_load is not None:
                    raise StreamBroken("the sender skipped the transfer, but this node lacks the image")
                return "skipped"
            if kind == ABORT:
                fanout.abort(fields[0])
                raise StreamBroken(f"the sender gave up: {fields[0]}")
            size, sha256 = fields
            fanout.end(size, sha256)
            if open_load is None:
                return "forwarded"
            if load is None:
                load = open_load()
            found = load.mismatch(size, sha256)
            if found:
                raise StreamBroken(
                    f"the stream does not match its trailer: it has {found}, the trailer says {size} bytes with "
                    f"sha256 {sha256} (a byte changed on the way). Nothing was loaded"
                )
            load.finish()
            return "streamed"
    finally:
        if load is not None:
            load.__exit__(None, None, None)
