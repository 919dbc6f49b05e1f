"""The one home of every setting a user may give a job: its name, default, type, meaning, CLI flag and environment
variable. Everything else takes its defaults from here or is held equal to it by
tests/unit/module_utils/job/test_pipeline_defaults.py. Controller and nodes alike (Python 3.8, standard library)."""

import copy
import os
from typing import Any, Dict, NamedTuple, Optional, Tuple

# Where each job's results, records and perf.csv go: $SLURM_MULTI_RESULTS_DIR, else ~/slurm-multi-results (home
# directories are on shared storage on a SLURM cluster).
RESULTS_DIR_ENV = "SLURM_MULTI_RESULTS_DIR"
RESULTS_DIR_IN_HOME = "slurm-multi-results"

# The shared image tar cache's default: inside the results dir, which every node must see anyway (a /tmp default is
# node-local on almost every real cluster). One per user (%u): a team may share a results dir, and the cache refuses
# a dir others can write. The lab, whose /tmp its nodes share, sets its own in its site config.
IMAGE_CACHE_IN_RESULTS = "image-cache-%u"

# How rank 0's image reaches the workers (docs/images.md: the tar cache, registry mode, and why the default is cache).
IMAGE_TRANSPORTS = ("cache", "registry")
# Transports that were retired, with what to use instead: named in the refusal before anything is queued.
RETIRED_IMAGE_TRANSPORTS = {
    "stream": "the tar cache (cache, the default) is faster at every node count measured; registry mode spares the "
    "shared filesystem's read load at large node counts",
}
IMAGE_TRANSPORT = "cache"

# A default computed when the job starts, not a literal (the table's default then reads as this text).
COMPUTED = object()


class Setting(NamedTuple):
    """One setting: ``kind`` is its Ansible argument-spec type (str, int, float, bool, list, dict, path, raw)."""

    name: str
    default: Any
    kind: str
    doc: str
    flag: Optional[str] = None
    env: Optional[str] = None
    # What the default is when it is computed (COMPUTED), in words.
    computed: str = ""


# In group_vars/all.yml's order, section by section (docs/settings.md keeps the sections).
SECTIONS: Tuple[Tuple[str, Tuple[Setting, ...]], ...] = (
    (
        "What runs, and where its results go",
        (
            Setting(
                "results_dir",
                COMPUTED,
                "path",
                "Where each job's results, records and perf.csv go. On storage every node and the controller see, "
                "and yours: a dir owned by another user, or writable by its group or everyone without the sticky "
                "bit, is refused (a team's dir: chmod 3775).",
                flag="--results-dir",
                env=RESULTS_DIR_ENV,
                computed="$SLURM_MULTI_RESULTS_DIR, else ~/slurm-multi-results",
            ),
            Setting(
                "models_file",
                COMPUTED,
                "path",
                "The model zoo: MAD's models.json, its cards' Dockerfiles and scripts beside it.",
                flag="--models-file",
                computed="the sample models shipped with slurm-multi (models/models.json)",
            ),
            Setting(
                "model_tags",
                ["dummy"],
                "list",
                "Which model cards to run: names or tags of the models file (MAD's --tags).",
                flag="--tags",
            ),
            Setting(
                "additional_context",
                {},
                # A mapping, or MAD's -c JSON text: the run context filter parses it and names what is wrong, in the
                # job's FAILURE record (a `dict` type would refuse it before the job has a record).
                "raw",
                "MAD's additional context, a mapping or MAD's JSON text (docker_build_arg, docker_env_vars, "
                "docker_mounts, docker_gpus, gpu_vendor, guest_os, slurm...), merged recursively over "
                "default_context: the manifest's deployment_config < --config < --additional-context-file < -c. "
                "No secrets in docker_build_arg (Docker records build "
                "args in the image): a Dockerfile reads a secret with `RUN --mount=type=secret,id=MAD_SECRETS_X`.",
                flag="-c, --additional-context, --additional-context-file, --config",
            ),
            Setting(
                "default_context",
                {"guest_os": "UBUNTU", "docker_build_arg": {}, "docker_env_vars": {}, "docker_mounts": {}},
                "dict",
                "The run context additional_context is merged over.",
            ),
            Setting(
                "manifest_path",
                "",
                "str",
                "A MAD-written build_manifest.json to run instead of building (empty: rank 0 builds and writes one).",
                flag="--manifest",
            ),
            Setting(
                "use_image",
                "",
                "str",
                "A prebuilt image to run instead of building (MAD's --use-image; empty: build). A local image must be "
                "on rank 0's daemon and goes to the workers like a built one; a registry image is pulled by digest "
                "on every node.",
                flag="--use-image",
            ),
            Setting(
                "mode",
                "push",
                "str",
                "How the pipeline reaches the nodes. push: one ansible-playbook on the batch host drives every node, "
                "each task an srun step per node. pull: one srun step starts an ansible-playbook on every node; the "
                "nodes coordinate through the barrier and the job's files.",
                flag="--mode",
                env="SLURM_MULTI_MODE",
            ),
            Setting(
                "container_runtime",
                "docker",
                "str",
                "What runs the model's containers on the nodes: docker (a Docker daemon on every node, the user in "
                "its group) or charliecloud (no daemon and no root: ch-run as the user's own processes, the image "
                "one squashfs file in the shared cache; docs/runtimes.md).",
            ),
        ),
    ),
    (
        "The image: how rank 0's reaches the workers",
        (
            Setting(
                "image_transport",
                IMAGE_TRANSPORT,
                "str",
                "cache: rank 0 saves the image to the shared tar cache, every worker loads it. "
                "registry: push and pull (a registry given implies it).",
                flag="--image-transport",
            ),
            Setting(
                "heartbeat_stale",
                30.0,
                "float",
                "Seconds rank 0's heartbeat may stand still before a worker waiting on it (its build, the barrier's "
                "GO, the model's run) gives it up, naming rank 0. Raise it where the shared "
                "filesystem shows another node's change late.",
            ),
            Setting(
                "image_cache_dir",
                COMPUTED,
                "str",
                "The shared image tar cache: on storage every node sees, never writable by others; %u is the user's "
                "name, as in SLURM's file name patterns. $MAD_DOCKER_BUILDS in the job's environment (it reaches "
                "every node) overrides it.",
                env="MAD_DOCKER_BUILDS",
                computed="<results_dir>/image-cache-%u (one per user, in a results dir a team may share)",
            ),
            Setting(
                "image_cache_teach_digests",
                True,
                "bool",
                "Teach rank 0's daemon, once per base, a registry digest for the layers of a base it got by `docker "
                "load` or `docker import`, so that later publishes over it push only their new layers instead of "
                "saving the whole image. The first job over such a base pays it (about two whole saves), after its "
                "publish and beside the workers' loads; false saves every image over such a base whole.",
            ),
            Setting("image_cache_keep", 5, "int", "Committed image cache entries a prune keeps, however old."),
            Setting(
                "image_cache_max_age_days",
                7,
                "float",
                "Days after its last use an image cache entry may be pruned.",
            ),
            Setting(
                "charliecloud_bases",
                {},
                "dict",
                "With container_runtime charliecloud: the base images a Dockerfile's FROM names (as BASE_DOCKER names "
                "them) that come from a root filesystem tar or a directory instead of a registry, name to path "
                "(`ch-image import`; air-gapped sites). A base whose file changes or moves is imported again and "
                "the image rebuilt.",
            ),
            Setting(
                "charliecloud_storage_dir",
                "/var/tmp/slurm-multi-%u/ch-image",
                "str",
                "With container_runtime charliecloud: rank 0's node-local storage for ch-image (its imported bases, "
                "kept while they are unchanged, and the tree being built); %u is the user's name.",
            ),
            Setting(
                "charliecloud_unpack_dir",
                "/var/tmp/slurm-multi-%u/images",
                "str",
                "With container_runtime charliecloud: where a node that cannot mount squashfs (no FUSE for the user) "
                "unpacks the image once, as a directory named by its digest and reused by later jobs; node-local, "
                "made 0700; %u is the user's name.",
            ),
            Setting(
                "rebuild_fallback",
                False,
                "bool",
                "On a worker with no tar in the cache, rebuild the image from the manifest (checked by its build "
                "fingerprint).",
            ),
            Setting(
                "buildkit_docker_cli",
                "docker",
                "str",
                "The docker CLI that builds Dockerfiles using `RUN --mount` (BuildKit): one with the buildx "
                "component, or Docker 20.10's.",
            ),
            Setting(
                "registry",
                "",
                "str",
                "Registry mode: push from rank 0 and pull on the workers (e.g. docker.io/myorg/bench); every node runs "
                "the image by the digest of rank 0's push.",
                flag="--registry",
            ),
            Setting(
                "credentials_file",
                "",
                "str",
                "Registry login: MAD's credential.json (0600; `submit --credentials FILE` copies the registry's entry "
                "into the job's private dir). Empty: no login (the nodes' own Docker config applies).",
                flag="--credentials",
            ),
        ),
    ),
    (
        "Preflight: every node checked before anything expensive",
        (
            Setting(
                "preflight_checks",
                ["docker", "disk", "shared_dir", "scratch", "gpus", "stale_gpu_containers", "clock"],
                "list",
                "The checks to run ([] skips the stage): docker (the daemon answers), disk (the image's size plus "
                "preflight_disk_headroom_gb free), shared_dir (results_dir and image_cache_dir are the same on every "
                "node), scratch (the node-local dir for the env file is private), gpus (cover SLURM's grant and the "
                "card's n_gpus), stale_gpu_containers, clock.",
            ),
            Setting(
                "preflight_disk_headroom_gb",
                5.0,
                "float",
                "Free GB Docker's data root must keep on top of the image.",
            ),
            Setting(
                "preflight_image_size_gb",
                None,
                "float",
                "The image's size in GB when known beforehand. null: a given manifest's images are measured; a new "
                "build has only its headroom checked.",
            ),
            Setting(
                "preflight_n_gpus",
                None,
                "int",
                "GPUs per node the run needs (null: the card's n_gpus when a manifest is given, else not checked).",
            ),
            Setting(
                "preflight_max_clock_skew",
                10.0,
                "float",
                "Seconds a node's clock may differ from the controller's (in pull mode, the shared filesystem's).",
            ),
            Setting(
                "preflight_exchange_wait",
                20.0,
                "float",
                "Pull mode: seconds a node waits for rank 0's nonce and for every other node's result.",
            ),
        ),
    ),
    (
        "The barrier and the model's run",
        (
            Setting("barrier_timeout", 600.0, "float", "Seconds the rank-0 image-ready barrier may take overall."),
            Setting(
                "barrier_port_range",
                [20000, 29999],
                "list",
                "The ports the barrier's port is derived into (from MASTER_PORT and the job ID).",
            ),
            Setting(
                "additional_docker_run_options",
                [],
                "raw",
                "Extra `docker run` options for the model container (an argv list or one string); mounts in it win "
                "over ours.",
            ),
            Setting(
                "secrets_file",
                "",
                "str",
                "The job's MAD_SECRETS_* file (written 0600 by `slurm-multi submit`); empty when there are none.",
            ),
            Setting(
                "hang_timeout",
                300.0,
                "float",
                "Seconds in which no rank of the job makes progress (writes output or uses CPU) before the run is "
                "called hung: every node dumps its ranks' Python stacks (py-spy, from the host) and the job ends "
                "FAILURE `hang`, naming the stuck rank. 0 turns the watchdog off. Below torch's own collective "
                "timeouts (NCCL 10 min, gloo 30 min), so the stacks are taken before torch kills the ranks.",
            ),
            Setting(
                "tools_file",
                "",
                "str",
                "MAD's tools.json, for the context's `tools` (empty: the model zoo's scripts/common/tools.json, "
                "beside its models.json, over slurm-multi's own tools).",
            ),
            Setting(
                "job_end_margin",
                240,
                "int",
                "Seconds kept before the job's end to stop the model, snapshot diagnostics and collect (more than the "
                "sbatch script's 180 s early warning, so a model reaching the time limit is recorded as timed out).",
            ),
        ),
    ),
    (
        "The collect job: the small job queued after each job",
        (
            Setting(
                "collect_job_partition",
                "",
                "str",
                "The partition of the one-node job `submit` queues with --dependency=afterany after each job: it "
                "writes the job's FAILURE record with SLURM's own state when the job could not (cancelled before "
                "it started, time limit, node failure) and regenerates perf.csv. It reads files only: a CPU or "
                "debug partition keeps it from queueing behind GPU jobs. Empty: the job's partition (and its "
                "reservation; another partition drops the job's reservation, exclude and constraint).",
            ),
            Setting("collect_job_account", "", "str", "The collect job's account (empty: the job's)."),
            Setting("collect_job_qos", "", "str", "The collect job's QOS (empty: the job's)."),
            Setting(
                "collect_job_time",
                "00:15:00",
                "str",
                "The collect job's time limit, in SLURM's forms (minutes, HH:MM:SS).",
            ),
            Setting(
                "collect_job_gpus",
                "",
                "str",
                "The collect job's GPU request (--gpus-per-node: a count or type:count), for sites that require one "
                "in every job. Empty: none; collecting uses no GPU.",
            ),
        ),
    ),
    (
        "The speed-up layer",
        (
            Setting(
                "speedup",
                True,
                "bool",
                "The speed-up layer (docs/speedup.md): a module server per node in push mode, the controller's "
                "plugins, payloads and templates kept between runs, ansible-core's routing file parsed once. false "
                "runs every part of the job on plain Ansible: the same results, more CPU. The layer also steps aside "
                "by itself, with one warning, on an ansible-core whose private names it uses changed.",
                env="SLURM_MULTI_SPEEDUP",
            ),
        ),
    ),
)

SETTINGS: Dict[str, Setting] = {setting.name: setting for _, settings in SECTIONS for setting in settings}

# The literal defaults, by name (a computed one is not here: `pipeline_default` gives it).
SETTING_DEFAULTS: Dict[str, Any] = {
    name: setting.default for name, setting in SETTINGS.items() if setting.default is not COMPUTED
}


def default_results_dir(environ=None) -> str:
    """``$SLURM_MULTI_RESULTS_DIR``, else ``$HOME/slurm-multi-results``, as an absolute path."""
    environ = os.environ if environ is None else environ
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.abspath(environ.get(RESULTS_DIR_ENV) or os.path.join(home, RESULTS_DIR_IN_HOME))


def default_image_cache_dir(results_dir: str) -> str:
    """The image cache inside ``results_dir``, which every node sees."""
    return os.path.join(results_dir, IMAGE_CACHE_IN_RESULTS)


def pipeline_default(name: str, environ=None) -> Any:
    """The default of setting ``name``; a computed one (results_dir, image_cache_dir) from ``environ``."""
    if name == "results_dir":
        return default_results_dir(environ)
    if name == "image_cache_dir":
        return default_image_cache_dir(default_results_dir(environ))
    if name not in SETTING_DEFAULTS:
        raise KeyError(f"no setting named {name!r}: {', '.join(SETTINGS)}")
    return copy.deepcopy(SETTING_DEFAULTS[name])  # a caller may change its list or dict
