"""What to run: the user's input checked and made a `JobSpec` (the group_vars a job overrides) and its SLURM request.

Bad input raises `SlurmMultiError` with a message that says what to fix; nothing has been submitted or run then.
"""

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_manifest import (
    load_manifest,
    load_model_cards,
    select_model_cards,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.build_secrets import check_build_args
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.dockerfile_selection import (
    select_dockerfiles,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.image.names import (
    is_registry_reference,
    normalize_registry,
    prebuilt_image_reference,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.context import (
    parse_additional_context,
    read_additional_context_file,
    secret_literals,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import (
    IMAGE_TRANSPORTS,
    RETIRED_IMAGE_TRANSPORTS,
    SETTINGS,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.deployment_config import (
    SLURM_REQUEST_KEYS,
    check_config,
    merge_config,
    read_config_file,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.pipeline_mode import DEFAULT_MODE, MODES
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import (
    check_settings,
    parse_extra_vars,
    read_settings,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.results.model_sweep import cards_of_manifest
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.launchers import model_distributed
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_data import (
    DATA_FILE,
    card_data,
    data_config,
)
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.run.model_scripts import scripts_source
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import default_results_dir, project_root
from slurm_multi.submission.credentials import checked_credentials_file
from slurm_multi.submission.sbatch import COLLECT_JOB_SETTINGS, SbatchError, SlurmOptions

# The keys of MAD's `slurm` section (deployment config, additional context) that map onto submit options; the
# environment modules are loaded by the job's script.
MAD_SLURM_KEYS = SLURM_REQUEST_KEYS + ("modules",)


def content_root(root: Path | None) -> Path:
    """The Ansible content to run: ``root`` when given (tests give a stand-in), else this installation's."""
    try:
        return Path(root).absolute() if root else project_root()
    except RuntimeError as exc:
        raise SlurmMultiError(str(exc)) from None


# The settings given as paths: -e and a flag agree when they name the same file.
PATH_SETTINGS = ("results_dir", "models_file", "manifest_path", "credentials_file")


@dataclass(frozen=True)
class JobSpec:
    """What the pipeline runs and where its results go: the group_vars the user overrides."""

    tags: tuple
    results_dir: Path
    models_file: Path | None = None
    additional_context: dict[str, Any] = field(default_factory=dict)
    registry: str | None = None
    manifest_path: Path | None = None
    extra_vars: dict[str, Any] = field(default_factory=dict)
    # The user's credential.json (registry mode's login); the job reads a 0600 copy of its entry, never this file.
    credentials_file: Path | None = None
    # push: one ansible-playbook drives every node; pull: one per node, started by one srun step (docs/cluster.md).
    mode: str = DEFAULT_MODE
    # A prebuilt image run instead of building (MAD's --use-image); the tags still select its model card.
    use_image: str | None = None
    # A sweep: the card of each image the tags select (a card with several Dockerfile variants once per variant), in
    # the order they run, one run each in the allocation (slurm_multi/submission/sweep.py); empty for a one-image job.
    sweep: tuple = ()
    # A sweep stops at its first failing model (else every model runs and the verdict covers all).
    stop_on_failure: bool = False
    # cache or registry (IMAGE_TRANSPORTS); None: group_vars' image_transport (registry when one is given).
    image_transport: str | None = None
    # Each model's launcher ((card name, launcher) by madengine's names), checked against the node count before
    # sbatch (`check_node_count`).
    launchers: tuple = ()
    # The afterany collect job's request: the collect_job_* settings given (-e, the settings files), by name.
    collect_job: dict[str, Any] = field(default_factory=dict)

    def check_node_count(self, nnodes: int) -> None:
        """Refuse a node count too small for a model's launcher (sglang-disagg needs 3), naming the model."""
        for name, launcher in self.launchers:
            try:
                model_distributed({"distributed": {"launcher": launcher}}, {}, nnodes)
            except UserError as exc:
                raise SlurmMultiError(f"model {name}: {exc}") from None

    @property
    def login_registry(self) -> str | None:
        """The registry the job's credentials log in to: registry mode's, or a prebuilt registry image's."""
        if self.registry:
            return self.registry
        return self.use_image if self.use_image and is_registry_reference(self.use_image) else None

    def job_vars(self, secrets_file: Path | None = None, credentials_copy: Path | None = None) -> dict[str, Any]:
        """The extra vars (group_vars names) of this job; unset options keep group_vars' defaults.

        ``credentials_copy``: the job's private copy of `credentials_file`'s entry
        (slurm_multi.submission.credentials)."""
        job_vars = dict(self.extra_vars)
        job_vars.update(
            results_dir=str(self.results_dir),
            model_tags=list(self.tags),
            additional_context=self.additional_context,
            mode=self.mode,
            # Always: the settings files' registry, which the inventory gives every node, must not override the
            # job's choice of none.
            registry=self.registry or "",
        )
        optional = {
            "models_file": self.models_file,
            "manifest_path": self.manifest_path,
            "secrets_file": secrets_file,
            "credentials_file": credentials_copy,
            "use_image": self.use_image,
            "image_transport": self.image_transport,
        }
        job_vars.update({name: str(value) for name, value in optional.items() if value})
        if self.sweep:
            job_vars.update(sweep_models=[dict(card) for card in self.sweep], stop_on_failure=self.stop_on_failure)
        return job_vars


def _tag_list(tags: str | Sequence[str]) -> tuple:
    items = [tags] if isinstance(tags, str) else list(tags or [])
    split = tuple(tag.strip() for item in items for tag in str(item).split(",") if tag.strip())
    if not split:
        raise SlurmMultiError("no model tags given: name the model to run, e.g. --tags dummy")
    return split


def _existing_file(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser().absolute()
    if not path.is_file():
        raise SlurmMultiError(f"{what} {path} does not exist or is not a file")
    return path


def _check_one_model(models_file: Path, tags: Sequence[str], why: str) -> None:
    cards = select_model_cards(load_model_cards(models_file), list(tags))
    if len(cards) != 1:
        names = ", ".join(card["name"] for card in cards)
        raise SlurmMultiError(
            f"--tags {','.join(tags)} selects {len(cards)} models ({names}) but {why}: narrow the tags to one model "
            "name"
        )


def _planned_images(models_file: Path, tags: Sequence[str], context: Mapping[str, Any]) -> tuple:
    """The card of each image the tags select, as the build will choose them: every selected card once per
    Dockerfile its `# CONTEXT` filter keeps (MAD builds them all). Checked here, before anything is built: a card
    with a bad field or no fitting Dockerfile is refused now. The nodes may narrow the Dockerfiles further (their
    detected gpu_vendor), never widen them: the sweep then runs what the build made."""
    cards = select_model_cards(load_model_cards(models_file), list(tags))
    zoo_root = models_file.parent
    # group_vars' default_context lies under the job's (restore_run_context): its guest_os filters too.
    run_context = dict({"guest_os": "UBUNTU"}, **context)
    planned = []
    for card in cards:
        # A card whose Dockerfile prefix matches no file, or none of whose Dockerfiles fits, would fail the build
        # only once the job has its nodes: refused now.
        dockerfiles = select_dockerfiles(str(zoo_root), card, run_context)
        # The Dockerfile itself, as the build manifest names it: a variant's perf rows say which one ran.
        planned.extend(dict(card, dockerfile=path) for path in dockerfiles)
    # Every model's scripts, likewise (a sweep's later model must not fail for want of them after the first ones ran).
    for card in cards:
        scripts_source(str(zoo_root / str(card.get("scripts", ""))))
    return tuple(planned)


def job_spec(
    tags: str | Sequence[str],
    *,
    results_dir: str | Path | None = None,
    models_file: str | Path | None = None,
    additional_context: str | Mapping[str, Any] | None = None,
    additional_context_file: str | Path | None = None,
    registry: str | None = None,
    manifest_path: str | Path | None = None,
    extra_vars: Mapping[str, Any] | Sequence[str] | None = None,
    root: Path | None = None,
    credentials_file: str | Path | None = None,
    config: str | Path | Mapping[str, Any] | None = None,
    slurm_overrides: Mapping[str, Any] | None = None,
    mode: str | None = None,
    use_image: str | None = None,
    stop_on_failure: bool = False,
    image_transport: str | None = None,
) -> JobSpec:
    """Check the user's input and make it a JobSpec; bad input raises SlurmMultiError saying what to fix.

    The job's config (``JobSpec.additional_context``) merges recursively, lowest first: the settings files'
    additional_context < the manifest's ``deployment_config`` < ``config`` (a file, or a dict) <
    ``additional_context_file`` < ``additional_context`` (MAD's ``-c``: JSON, MAD's dict text, or a dict) <
    ``slurm_overrides`` (the command line's SLURM options; None: not given); unknown keys are refused. Tags that
    select several images make a sweep (``JobSpec.sweep``); ``use_image`` (MAD's --use-image) runs a prebuilt image
    instead of building (not with ``manifest_path`` or ``registry``). ``image_transport`` is cache or registry (a
    ``registry`` given means registry). Results go to ``results_dir``, else the context's ``slurm.results_dir``,
    else `default_results_dir`. ``extra_vars`` (settings by name, or ``-e`` texts) win over everything and must
    agree with an argument giving the same setting; the settings files (module_utils/job/settings_files.py) lie
    below the arguments. Relative paths are made absolute.
    """
    try:
        if isinstance(extra_vars, Mapping):
            given = check_settings(extra_vars, "extra_vars")
        else:
            given = parse_extra_vars(extra_vars)
        settings = read_settings().values
        tags = _argument_or_extra_var("model_tags", tags, given)
        results_dir = _argument_or_extra_var("results_dir", results_dir, given)
        models_file = _argument_or_extra_var("models_file", models_file, given) or settings.get("models_file")
        additional_context = _argument_or_extra_var("additional_context", additional_context, given)
        manifest_path = _argument_or_extra_var("manifest_path", manifest_path, given)
        use_image = _argument_or_extra_var("use_image", use_image, given)
        credentials_file = _argument_or_extra_var("credentials_file", credentials_file, given)
        mode = _argument_or_extra_var("mode", mode, given) or settings.get("mode") or DEFAULT_MODE
        registry = _argument_or_extra_var("registry", registry, given)
        image_transport = _argument_or_extra_var("image_transport", image_transport, given)
        _refuse_cache_dir_the_environment_overrides(given)
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    if registry is None and image_transport is None and not use_image:
        # How the image travels is one choice: the settings files' stands only when the job makes none.
        registry, image_transport = settings.get("registry") or None, settings.get("image_transport") or None
    _check_image_transport(image_transport, registry)
    _check_speedup(given["speedup"] if "speedup" in given else settings.get("speedup"))
    runtime = given["container_runtime"] if "container_runtime" in given else settings.get("container_runtime")
    _check_runtime_handoff(runtime, registry, image_transport, use_image)
    if mode not in MODES:
        raise SlurmMultiError(
            f"mode {mode!r} is neither push (one ansible-playbook drives every node) nor pull (one per node)"
        )
    try:
        manifest = _existing_file(manifest_path, "the build manifest") if manifest_path else None
        context = _job_config(manifest, config, additional_context_file, additional_context, slurm_overrides, settings)
        _refuse_secret_literals(context)
        if isinstance(context.get("docker_build_arg"), dict):
            check_build_args(context["docker_build_arg"])  # Docker records build args in the image: no secrets
        normalized_registry = normalize_registry(registry) if registry is not None else None
        tag_list = _tag_list(tags)
        models = _existing_file(models_file, "the models file") if models_file else None
        prebuilt = _checked_prebuilt_image(use_image, manifest, normalized_registry) if use_image else None
        # A prebuilt registry image is pulled from its own registry: its login is that registry's entry.
        login_registry = normalized_registry or (prebuilt if prebuilt and is_registry_reference(prebuilt) else None)
        credentials = checked_credentials_file(credentials_file, login_registry) if credentials_file else None
        planned = ()
        default_models = content_root(root) / "models" / "models.json"
        zoo = models or (default_models if default_models.is_file() else None)
        if manifest is None and zoo:
            if prebuilt:
                _check_one_model(zoo, tag_list, f"--use-image {prebuilt} is one model's image")
            else:
                planned = _planned_images(zoo, tag_list, context)
        elif manifest is not None:
            # MAD runs every image of a manifest: several are a sweep that builds nothing.
            planned = tuple(cards_of_manifest(load_manifest(manifest)))
        cards = planned or (select_model_cards(load_model_cards(zoo), tag_list) if zoo and manifest is None else ())
        launchers = tuple((card.get("name", "?"), _launcher(card, context)) for card in cards)
        if zoo and cards:
            # Each card's data resolved as the nodes will: a provider this tool lacks is refused now, not skipped.
            entries = data_config(str(zoo.parent), context)
            for card in cards:
                card_data(card, entries, str(zoo.parent / DATA_FILE))
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    mad_slurm = context.get("slurm") if isinstance(context.get("slurm"), dict) else {}
    # madengine's output_dir holds its job's logs and each node's results, which the results dir holds here.
    chosen_results_dir = (
        results_dir or mad_slurm.get("results_dir") or mad_slurm.get("output_dir") or default_results_dir()
    )
    if mad_slurm.get("shared_workspace"):
        # The nodes read it from another working directory: made absolute here, where the user wrote it.
        mad_slurm["shared_workspace"] = str(Path(mad_slurm["shared_workspace"]).expanduser().absolute())
    collect_job = {
        name: given[name] if name in given else settings[name]
        for name in COLLECT_JOB_SETTINGS
        if name in given or name in settings
    }
    return JobSpec(
        tags=tag_list,
        results_dir=Path(chosen_results_dir).expanduser().absolute(),
        models_file=models,
        additional_context=context,
        registry=normalized_registry,
        manifest_path=manifest,
        extra_vars=given,
        credentials_file=credentials,
        mode=mode,
        use_image=prebuilt,
        sweep=planned if len(planned) > 1 else (),
        stop_on_failure=bool(stop_on_failure),
        image_transport=image_transport,
        launchers=launchers,
        collect_job=collect_job,
    )


def _argument_or_extra_var(name: str, argument: Any, extra_vars: dict) -> Any:
    """Setting ``name``: its argument (a flag), else -e's (taken out of ``extra_vars``); both given must agree."""
    if name not in extra_vars:
        return argument
    value = extra_vars.pop(name)
    if argument is not None and _comparable(name, argument) != _comparable(name, value):
        flag = SETTINGS[name].flag.split(",")[0]
        shown = " ".join(map(str, argument)) if isinstance(argument, (list, tuple)) else argument
        raise SlurmMultiError(f"{flag} {shown} and -e {name}={value} disagree: give one of them")
    return None if value == "" else value  # group_vars' empty value: none given


def _comparable(name: str, value: Any) -> Any:
    if name == "model_tags":
        return _tag_list(value)
    if name == "additional_context":
        return parse_additional_context(value)
    if name in PATH_SETTINGS:
        return Path(str(value)).expanduser().absolute()
    return value


def _refuse_cache_dir_the_environment_overrides(extra_vars: Mapping[str, Any]) -> None:
    """The nodes take $MAD_DOCKER_BUILDS (the job's environment reaches them) over any image_cache_dir."""
    env = SETTINGS["image_cache_dir"].env
    given, from_env = extra_vars.get("image_cache_dir"), os.environ.get(env)
    if "image_cache_dir" in extra_vars and from_env and str(given) != from_env:
        raise SlurmMultiError(
            f"-e image_cache_dir={given} and {env}={from_env} disagree, and the nodes would take {env}: "
            f"unset {env} or give one directory"
        )


def _launcher(card: Mapping[str, Any], context: Mapping[str, Any]) -> str:
    try:
        return model_distributed(card, context).launcher
    except UserError as exc:
        raise SlurmMultiError(f"model {card.get('name', '?')}: {exc}") from None


def _check_speedup(value: Any) -> None:
    """The speed-up layer's switch must be a boolean as Ansible reads one: a job would otherwise run with it off."""
    from ansible.module_utils.parsing.convert_bool import boolean

    try:
        boolean(value, strict=True) if value is not None else None
    except TypeError:
        raise SlurmMultiError(
            f"speedup is {value!r}, which is neither true nor false: give speedup=true or false"
        ) from None


def _check_runtime_handoff(runtime: Any, registry: str | None, image_transport: str | None, use_image: str | None):
    """Under charliecloud the image is one squashfs built from the model's Dockerfile and handed through the shared
    cache: a Docker registry or a prebuilt Docker image has no meaning there, and the build stage would refuse it."""
    if runtime != "charliecloud":
        return
    if registry or image_transport == "registry":
        raise SlurmMultiError(
            "container_runtime charliecloud hands one squashfs through the shared image cache, not a Docker "
            "registry: drop --registry / image_transport=registry, or use container_runtime docker"
        )
    if use_image:
        raise SlurmMultiError(
            "--use-image names a Docker image; container_runtime charliecloud builds its squashfs from the model's "
            "Dockerfile: drop --use-image, or use container_runtime docker"
        )


def _check_image_transport(image_transport: str | None, registry: str | None) -> None:
    if image_transport is None:
        return
    if image_transport in RETIRED_IMAGE_TRANSPORTS:
        raise SlurmMultiError(
            f"image transport {image_transport!r} is retired: use cache or registry instead "
            f"({RETIRED_IMAGE_TRANSPORTS[image_transport]}); remove image_transport: {image_transport} from the job, "
            "-e or the site and user settings files"
        )
    if image_transport not in IMAGE_TRANSPORTS:
        raise SlurmMultiError(
            f"image transport {image_transport!r} is none of {', '.join(IMAGE_TRANSPORTS)}: cache (the shared tar "
            "cache) or registry (push and pull)"
        )
    if image_transport == "registry" and not registry:
        raise SlurmMultiError("image transport registry pushes and pulls through a registry: give --registry too")
    if image_transport != "registry" and registry:
        raise SlurmMultiError(
            f"--registry {registry} pushes and pulls through that registry, but the image transport is "
            f"{image_transport}: drop one of them"
        )


def _checked_prebuilt_image(use_image: str, manifest: Path | None, registry: str | None) -> str:
    """``use_image`` checked to be a Docker reference that can run alone (no manifest, no registry mode)."""
    if manifest is not None:
        raise SlurmMultiError(
            f"--use-image {use_image} and --manifest {manifest} both name the image to run: give one of them"
        )
    if registry:
        raise SlurmMultiError(
            f"--use-image {use_image} is run as given (a registry image is pulled by digest from its own registry, "
            f"a local one goes through the image cache): drop --registry {registry}"
        )
    return prebuilt_image_reference(use_image)


def _job_config(
    manifest: Path | None,
    config: str | Path | Mapping[str, Any] | None,
    additional_context_file: str | Path | None,
    additional_context: str | Mapping[str, Any] | None,
    slurm_overrides: Mapping[str, Any] | None,
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """The job's config: each source checked, then all merged, lowest first (module_utils/job/deployment_config); the
    settings files' additional_context lowest of all."""
    layers = []
    if settings.get("additional_context"):
        layers.append(check_config(settings["additional_context"], "additional_context of the settings files"))
    if manifest is not None:
        deployment_config = load_manifest(manifest).get("deployment_config") or {}
        layers.append(check_config(deployment_config, f"the build manifest {manifest}'s deployment_config"))
    if isinstance(config, Mapping):
        layers.append(check_config(dict(config), "config", strict=True))
    elif config:
        layers.append(read_config_file(Path(config).expanduser().absolute()))
    if additional_context_file:
        layers.append(check_config(read_additional_context_file(additional_context_file), str(additional_context_file)))
    if additional_context:
        layers.append(check_config(parse_additional_context(additional_context), "--additional-context"))
    overrides = {key: value for key, value in (slurm_overrides or {}).items() if value is not None}
    if overrides:
        layers.append(check_config({"slurm": overrides}, "the SLURM options"))
    return merge_config(*layers)


def _refuse_secret_literals(context: Mapping[str, Any]) -> None:
    """A secret written into the context would sit in argv, the job's vars file and the dry-run output."""
    literals = secret_literals(context)
    if literals:
        names = sorted({path.rsplit(".", 1)[-1] for path in literals})
        raise SlurmMultiError(
            f"the additional context gives {', '.join(literals)} a literal value: a secret there would sit in argv, "
            "the job's vars and the dry-run output. Export it instead (export "
            f"{names[0]}=...; slurm-multi passes MAD_SECRETS_* of your environment to the containers alone) and "
            f'drop it from the context, or refer to it as "${{{names[0]}}}"'
        )


def slurm_options(
    nodes: int | None = None, *, context: Mapping[str, Any] | None = None, **options: Any
) -> SlurmOptions:
    """The job's SLURM request: the options given (None: not given) over MAD's ``slurm`` section of ``context``."""
    context = dict(context or {})
    try:
        section = check_config({"slurm": context["slurm"]}, "the context")["slurm"] if "slurm" in context else {}
    except UserError as exc:
        raise SlurmMultiError(str(exc)) from None
    given = {key: value for key, value in dict(options, nodes=nodes).items() if value is not None}
    merged = merge_config({key: section[key] for key in MAD_SLURM_KEYS if key in section}, given)
    if "nodes" not in merged:
        raise SlurmMultiError("the node count is missing: give --nodes N (or slurm.nodes in --config or -c)")
    if isinstance(merged["nodes"], str) and merged["nodes"].strip().isdigit():
        merged["nodes"] = int(merged["nodes"])
    for key in ("gpus_per_node", "time", "mem"):  # a config may give 8 GPUs or 90 minutes as a number
        if isinstance(merged.get(key), int) and not isinstance(merged[key], bool):
            merged[key] = str(merged[key])
    if isinstance(merged.get("modules"), list):
        merged["modules"] = tuple(merged["modules"])
    try:
        return SlurmOptions(**merged).validated()
    except (SbatchError, TypeError) as exc:
        raise SlurmMultiError(str(exc)) from None
