"""The one home of every setting a user may give a job: its name, default, type, meaning, CLI flag and environment
variable. Everything else takes its defaults from here or is held equal to it by
tests/unit/module_utils/job/test_pipeline_defaults.py. Controller and nodes alike (Python 3.8, standard library)."""

import copy
import json
import os
import shlex
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError

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

# The checks a node's preflight knows (module_utils/node/preflight.py runs them).
PREFLIGHT_CHECKS = ("docker", "disk", "shared_dir", "scratch", "gpus", "stale_gpu_containers", "clock")

# A default computed when the job starts, not a literal (the table's default then reads as this text).
COMPUTED = object()


class Setting(NamedTuple):
    """One setting: ``kind`` is its Ansible argument-spec type (str, int, float, bool, list, dict, path, raw); the
    rest says what values it takes (`setting_problems` checks them, on the login node and in the job alike)."""

    name: str
    default: Any
    kind: str
    doc: str
    flag: Optional[str] = None
    env: Optional[str] = None
    # What the default is when it is computed (COMPUTED), in words.
    computed: str = ""
    # The values it takes (a list's: each item's); None: any of its kind.
    choices: Optional[Tuple[str, ...]] = None
    # The smallest and largest number it takes (a list's: each item's); None: no bound.
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    # A list's items' kind.
    elements: Optional[str] = None
    # A rule of its own, from RULES: "range" (two numbers, LOW <= HIGH), "shell_words" (an argv list, or one string a
    # shell can split).
    rule: Optional[str] = None
    # Values it took once, with what to use instead (named in the refusal).
    retired: Optional[Dict[str, str]] = None


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
                choices=("push", "pull"),
            ),
            Setting(
                "container_runtime",
                "docker",
                "str",
                "What runs the model's containers on the nodes: docker (a Docker daemon on every node, the user in "
                "its group) or charliecloud (no daemon and no root: ch-run as the user's own processes, the image "
                "one squashfs file in the shared cache; docs/no-docker.md).",
                choices=("docker", "charliecloud"),
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
                choices=IMAGE_TRANSPORTS,
                retired=RETIRED_IMAGE_TRANSPORTS,
            ),
            Setting(
                "heartbeat_stale",
                30.0,
                "float",
                "Seconds rank 0's heartbeat may stand still before a worker waiting on it (its build, the barrier's "
                "GO, the model's run) gives it up, naming rank 0. Raise it where the shared "
                "filesystem shows another node's change late.",
                minimum=0,
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
            Setting(
                "image_cache_keep", 5, "int", "Committed image cache entries a prune keeps, however old.", minimum=0
            ),
            Setting(
                "image_cache_max_age_days",
                7,
                "float",
                "Days after its last use an image cache entry may be pruned.",
                minimum=0,
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
                list(PREFLIGHT_CHECKS),
                "list",
                "The checks to run ([] skips the stage): docker (the daemon answers), disk (the image's size plus "
                "preflight_disk_headroom_gb free), shared_dir (results_dir and image_cache_dir are the same on every "
                "node), scratch (the node-local dir for the env file is private), gpus (cover SLURM's grant and the "
                "card's n_gpus), stale_gpu_containers, clock.",
                elements="str",
                choices=PREFLIGHT_CHECKS,
            ),
            Setting(
                "preflight_disk_headroom_gb",
                5.0,
                "float",
                "Free GB Docker's data root must keep on top of the image.",
                minimum=0,
            ),
            Setting(
                "preflight_image_size_gb",
                None,
                "float",
                "The image's size in GB when known beforehand. null: a given manifest's images are measured; a new "
                "build has only its headroom checked.",
                minimum=0,
            ),
            Setting(
                "preflight_n_gpus",
                None,
                "int",
                "GPUs per node the run needs (null: the card's n_gpus when a manifest is given, else not checked).",
                minimum=0,
            ),
            Setting(
                "preflight_max_clock_skew",
                10.0,
                "float",
                "Seconds a node's clock may differ from the controller's (in pull mode, the shared filesystem's).",
                minimum=0,
            ),
            Setting(
                "preflight_exchange_wait",
                20.0,
                "float",
                "Pull mode: seconds a node waits for rank 0's nonce and for every other node's result.",
                minimum=0,
            ),
        ),
    ),
    (
        "The barrier and the model's run",
        (
            Setting(
                "barrier_timeout",
                600.0,
                "float",
                "Seconds the rank-0 image-ready barrier may take overall.",
                minimum=0,
            ),
            Setting(
                "barrier_port_range",
                [20000, 29999],
                "list",
                "The ports [LOW, HIGH] the barrier's port is derived into (from MASTER_PORT and the job ID); ports an "
                "unprivileged user may bind, 1024 to 65535.",
                elements="int",
                minimum=1024,
                maximum=65535,
                rule="range",
            ),
            Setting(
                "additional_docker_run_options",
                [],
                "raw",
                "Extra `docker run` options for the model container (an argv list or one string); mounts in it win "
                "over ours. One string is split as a shell splits it (`-e additional_docker_run_options='--ulimit "
                "memlock=-1'`).",
                rule="shell_words",
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
                minimum=0,
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
                minimum=0,
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


class SettingValueError(UserError):
    """A setting's value its row in the table does not take."""


def _kind_checks() -> Dict[str, Any]:
    """Ansible's own conversions, as the job's argument specs apply them (validate_argument_spec): a value the login
    node accepts is one the job accepts. Imported when a value is checked: the preflight runs this module's table on
    a bare Python without Ansible (node selection's srun)."""
    from ansible.module_utils.common.validation import (
        check_type_bool,
        check_type_dict,
        check_type_float,
        check_type_int,
        check_type_list,
        check_type_path,
        check_type_str,
    )

    return {
        "str": lambda value: check_type_str(value, allow_conversion=True),
        "path": check_type_path,
        "int": check_type_int,
        "float": check_type_float,
        "bool": check_type_bool,
        "list": check_type_list,
        "dict": check_type_dict,
    }


_KIND_WORDS = {
    "str": "a string",
    "path": "a path",
    "int": "a whole number",
    "float": "a number",
    "bool": "true or false",
    "list": "a list",
    "dict": "a mapping",
}


def checked_setting(name: str, value: Any) -> Any:
    """``value`` of setting ``name``, converted to its kind as the job's argument spec converts it; a value its row
    does not take (kind, choices, range, rule) raises SettingValueError naming the setting, the value and what it
    takes. A name that is no setting's is left as it is (settings_files names those)."""
    setting = SETTINGS.get(name)
    if setting is None or value is None:
        return value
    converted = _converted(setting, setting.kind, value, value)
    if setting.kind == "list":
        converted = [_converted(setting, setting.elements, item, value) for item in converted]
    for item in converted if setting.kind == "list" else [converted]:
        _check_item(setting, item, value)
    RULES[setting.rule](setting, converted) if setting.rule else None
    return converted


def setting_problems(values: Mapping, source: str = "") -> List[str]:
    """What `checked_setting` refuses among ``values`` (setting -> value), one sentence each, ``source: `` first."""
    problems = []
    for name, value in values.items():
        try:
            checked_setting(name, value)
        except SettingValueError as exc:
            problems.append(f"{source}: {exc}" if source else str(exc))
    return problems


def _converted(setting: Setting, kind: Optional[str], value: Any, whole: Any) -> Any:
    if kind is None or kind == "raw":
        return value
    try:
        return _kind_checks()[kind](value)
    except (TypeError, ValueError):
        raise SettingValueError(
            f"{_subject(setting, value, whole)} is not {_KIND_WORDS[kind]}: {_fix(setting)}"
        ) from None


def _check_item(setting: Setting, item: Any, whole: Any) -> None:
    subject = _subject(setting, item, whole)
    if setting.retired and item in setting.retired:
        raise SettingValueError(
            f"{subject} is retired: use {' or '.join(setting.choices or ())} instead ({setting.retired[item]}); "
            f"remove {setting.name}: {item} from the job, -e or the site and user settings files"
        )
    if setting.choices is not None and item not in setting.choices:
        raise SettingValueError(f"{subject} is none of {', '.join(setting.choices)}: {_fix(setting)}")
    number = isinstance(item, (int, float)) and not isinstance(item, bool)
    if number and setting.minimum is not None and item < setting.minimum:
        raise SettingValueError(f"{subject} is below {setting.minimum:g}: {_fix(setting)}")
    if number and setting.maximum is not None and item > setting.maximum:
        raise SettingValueError(f"{subject} is above {setting.maximum:g}: {_fix(setting)}")


def _subject(setting: Setting, item: Any, whole: Any) -> str:
    """``name 'value'``, or for one item of a list ``name [...]: its item 'value'``."""
    if setting.kind == "list" and item is not whole:
        return f"{setting.name} {whole!r}: its item {item!r}"
    return f"{setting.name} {item!r}"


def _range_rule(setting: Setting, pair: List[Any]) -> None:
    if len(pair) != 2 or pair[0] > pair[1]:
        raise SettingValueError(f"{setting.name} {pair!r} is no range [LOW, HIGH] with LOW <= HIGH: {_fix(setting)}")


def _shell_words_rule(setting: Setting, value: Any) -> None:
    if isinstance(value, str):
        try:
            shlex.split(value)
        except ValueError as exc:
            raise SettingValueError(
                f"{setting.name} {value!r} cannot be split into arguments as a shell would ({exc}): close the quote, "
                "or give a list of arguments"
            ) from None
    elif not isinstance(value, (list, tuple)) or not all(isinstance(word, (str, int, float)) for word in value):
        raise SettingValueError(
            f"{setting.name} {value!r} is neither one string of options nor a list of them: {_fix(setting)}"
        )


RULES = {"range": _range_rule, "shell_words": _shell_words_rule}


def _fix(setting: Setting) -> str:
    """What the setting takes, with an example (its default where it has a literal one)."""
    if setting.kind == "list" and setting.elements:
        takes = f"a list of {_KIND_WORDS[setting.elements].split(' ', 1)[-1]}s"
    else:
        takes = _KIND_WORDS.get(setting.kind, "a value")
    if setting.choices is not None:
        takes = ("a list of " if setting.kind == "list" else "one of ") + ", ".join(setting.choices)
    bounds = [f"{setting.minimum:g} or more" if setting.minimum is not None else ""]
    bounds.append(f"{setting.maximum:g} or less" if setting.maximum is not None else "")
    if any(bounds):
        takes += " (" + (", ".join(bound for bound in bounds if bound)) + ")"
    if setting.default is COMPUTED or setting.default in (None, "", [], {}):
        return f"{setting.name} takes {takes} (docs/settings.md)"
    example = (
        setting.default if isinstance(setting.default, str) else json.dumps(setting.default, separators=(",", ":"))
    )
    return f"{setting.name} takes {takes}, e.g. -e {setting.name}={example} (its default; docs/settings.md)"
