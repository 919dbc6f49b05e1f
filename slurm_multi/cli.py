"""The `slurm-multi` command line.

`--help` and `--version` have no side effects: subcommands import what they need only when they run.

Exit codes: 0 the job's verdict is SUCCESS (or SKIPPED: the card's skip_gpu_arch), 1 it is FAILURE, 2 bad usage or
an infrastructure problem (nothing recorded).
"""

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import slurm_multi
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import IMAGE_TRANSPORT, IMAGE_TRANSPORTS
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.pipeline_mode import MODES
from ansible_collections.slurm_multi.pipeline.plugins.module_utils.user_error import UserError
from slurm_multi import __version__

EXIT_SUCCESS, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
RESULTS_DIR_HELP = (
    "results directory on storage every node sees (default: $SLURM_MULTI_RESULTS_DIR, else results_dir of your "
    "settings file or the site's, else ~/slurm-multi-results)"
)


def _lab(args) -> int:
    from slurm_multi.lab import cluster as lab

    try:
        if args.lab_command == "up":
            lab.up(args.nodes)
            return 0 if lab.status() else 1
        if args.lab_command == "down":
            lab.down()
            return 0
        if args.lab_command == "pytorch-base":
            from slurm_multi.lab.pytorch import build_base_tar

            _say(f"the PyTorch base: {build_base_tar(progress=_say)}")
            return 0
        return 0 if lab.status() else 1
    except lab.LabError as exc:
        print(f"slurm-multi lab {args.lab_command}: {exc}", file=sys.stderr)
        return 2


def _say(message: str) -> None:
    for line in message.splitlines() or [""]:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


def _job_spec(args):
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import parse_extra_vars
    from slurm_multi.spec import MAD_SLURM_KEYS
    from slurm_multi.submission.credentials import default_credentials_file

    extra_vars = parse_extra_vars(args.extra_vars)
    if args.credentials or "credentials_file" in extra_vars:
        credentials = args.credentials
    else:  # MAD's ./credential.json, when it has an entry for the registry
        credentials = default_credentials_file(args.registry or extra_vars.get("registry"))
    return slurm_multi.job_spec(
        args.tags,
        results_dir=args.results_dir,
        models_file=args.models_file,
        additional_context=args.additional_context,
        additional_context_file=args.additional_context_file,
        registry=args.registry,
        manifest_path=args.manifest,
        use_image=args.use_image,
        stop_on_failure=args.stop_on_failure,
        credentials_file=credentials,
        extra_vars=extra_vars,
        config=args.config,
        mode=args.mode,
        image_transport=args.image_transport,
        # `submit`'s SLURM options (`run` has none): the top layer of the job's config.
        slurm_overrides={name: getattr(args, name, None) for name in MAD_SLURM_KEYS},
    )


def _print_result(result) -> int:
    from slurm_multi.reports import text as report

    print(f"job {result.job_id}: {result.status}" + (f" - {result.reason}" if result.reason else ""))
    for node, verdict in result.per_node.items():
        why = f" - {verdict.get('reason')}" if verdict.get("reason") else ""
        print(f"  {node} (rank {verdict.get('rank')}): {verdict.get('status')}{why}")
    for model in result.sweep:
        why = f" - {model.get('reason')}" if model.get("reason") else ""
        print(
            f"  model {model.get('index')} of {len(result.sweep)} {model.get('model')} (job {model.get('job_id')}): "
            f"{model.get('status')}{why}"
        )
    if result.recorded:
        print(report.perf_table(result.perf))
        if result.metric_source:
            print(f"metric from: {result.metric_source}")
        print(f"record: {result.record_json}")
        for node in result.node_selection.get("left_out") or []:
            problems = (result.node_selection.get("checked") or {}).get(node) or []
            print(f"left out by the preflight: {node}: " + "; ".join(str(p.get("problem")) for p in problems))
        for entry in result.retries:
            retried = f"; retried as job {entry['retried_as']['job_id']}" if entry.get("retried_as") else ""
            print(
                f"attempt: job {entry.get('job_id')} on {','.join(entry.get('nodes') or []) or '?'}: "
                f"{entry.get('status')} ({entry.get('cause')}{retried})"
            )
        if len(result.attempts) > 1:
            print(
                "attempts (SLURM requeued the job; the record is the last's): "
                + ", ".join(f"{entry.get('attempt')} {entry.get('status')}" for entry in result.attempts)
            )
    print(f"job dir: {result.attempt_dir}")
    if not result.recorded:
        return EXIT_USAGE
    return EXIT_SUCCESS if result.status in ("SUCCESS", "SKIPPED") else EXIT_FAILURE


def _settings(args) -> int:
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import (
        effective_settings,
        parse_extra_vars,
    )

    shown = effective_settings(parse_extra_vars(args.extra_vars))
    width = max(len(name) for name, _, _ in shown)
    for name, value, source in shown:
        print(f"{name:<{width}}  {json.dumps(value, default=str)}  ({source})")
    return EXIT_SUCCESS


def _submit(args) -> int:
    from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.settings_files import (
        read_settings,
        site_config_path,
        user_settings_path,
    )
    from slurm_multi.submission.job_vars import VARS_FILE_NAME
    from slurm_multi.submission.sbatch import COLLECT_SCRIPT_NAME, JOB_SCRIPT_NAME

    if args.follow and not args.wait:
        raise slurm_multi.SlurmMultiError("--follow shows the logs while --wait follows the job: give both")
    spec = _job_spec(args)
    slurm = slurm_multi.slurm_options(context=spec.additional_context)  # the command line's are in its slurm section
    if args.dry_run:
        plan = slurm_multi.plan_submission(spec, slurm)
        print(f"# Dry run: nothing written, nothing submitted. The job's private dir would be {plan.private_dir}.")
        print(f"# ---- {JOB_SCRIPT_NAME} ----")
        print(plan.job_script, end="")
        print(f"# ---- {COLLECT_SCRIPT_NAME} (queued after the job: sbatch assigns the job ID) ----")
        print(plan.collect_script, end="")
        print(f"# ---- {VARS_FILE_NAME} (every string marked unsafe for Ansible when written) ----")
        print(json.dumps(plan.job_vars, indent=2, sort_keys=True))
        print(
            "# ---- the job's config, saved as additional_context in its vars.json (lowest first: the manifest's "
            "deployment_config < --config < --additional-context-file < -c < SLURM options) ----"
        )
        print(json.dumps(spec.additional_context, indent=2, sort_keys=True))
        settings = read_settings().values
        if settings:
            print(
                f"# ---- the settings of {site_config_path()}, {user_settings_path()} and the environment (the "
                "inventory gives every node these; the job's vars above win) ----"
            )
            print(json.dumps(settings, indent=2, sort_keys=True, default=str))
        _print_container_commands(spec, slurm)
        if plan.secret_names:
            print(f"# secrets.env (0600) would hold {', '.join(plan.secret_names)}; they leave sbatch's environment")
        if args.preflight:
            print("# --preflight: the candidate nodes would be checked first (one srun), the job sent to healthy ones")
        if args.retries:
            print(f"# --retries {args.retries}: its collect job would resubmit it without nodes it failed because of")
        return EXIT_SUCCESS
    submission = slurm_multi.submit(spec, slurm, retries=args.retries, preflight=args.preflight, on_progress=_say)
    print(f"Submitted job {submission.job_id} (its collect job: {submission.collect_job_id})")
    print(f"  results: {submission.job_dir}")
    print(f"  output:  {submission.output}")
    if not args.wait:
        return EXIT_SUCCESS
    follow = {}
    if args.follow:
        from slurm_multi.reports.job_view import use_colour

        follow = dict(on_log_line=lambda line: print(line, flush=True), colour=use_colour(sys.stdout))
    try:
        return _print_result(slurm_multi.wait(submission, on_progress=_say, **follow))
    except KeyboardInterrupt:
        print(
            f"\nStopped following job {submission.job_id}; it keeps running (scancel {submission.job_id} stops it). "
            f"Its results: slurm-multi report --results-dir {submission.results_dir} --job {submission.job_id}"
        )
        return EXIT_USAGE


def _print_container_commands(spec, slurm) -> None:
    from slurm_multi.submission.container_plan import container_commands

    commands = container_commands(spec, slurm)
    print(
        f"# ---- the container's command on each node, as its run.log will record it (secrets masked; <...>: what "
        f"only the node knows when the job runs; the job's first model, {len(commands)} node(s)) ----"
    )
    for rank, (node, lines) in enumerate(commands):
        print(f"# {node} (rank {rank}):")
        for line in lines:
            print(line)


def _run(args) -> int:
    from slurm_multi.progress import PipelineProgress

    spec = _job_spec(args)
    if not os.environ.get("SLURM_JOB_ID") and not args.local:
        raise slurm_multi.SlurmMultiError(
            "no SLURM_JOB_ID: this is no allocation (a login node?), and `run` would run the whole pipeline, the "
            "image build included, on this host. Queue it with `slurm-multi submit -N N ...`, run it inside an "
            "allocation (`salloc -N N`, an sbatch script), or give --local to run it here as a one-node job"
        )
    stop_requested = []

    def request_stop(signum, _frame):
        _say(f"slurm-multi: {signal.Signals(signum).name} received: stopping the pipeline, then collecting")
        stop_requested.append(signum)

    # scancel and the time limit send TERM; sbatch --signal=B:USR1@<s> warns ahead of the limit.
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, request_stop)
    progress = PipelineProgress(_say)
    result = slurm_multi.run(
        spec, job_id=args.job_id, on_event=progress.feed_runner_event, cancel=lambda: bool(stop_requested)
    )
    progress.task_finished()
    return _print_result(result)


def _collect(args) -> int:
    from slurm_multi.submission.job_end import record_job_end

    if args.after_job:
        if not args.vars_file:
            raise slurm_multi.SlurmMultiError("--after-job needs --vars-file, the job's vars.json in its private dir")
        # As a SLURM job it succeeded when the job is recorded, whatever the job's own verdict.
        recorded = _print_result(record_job_end(args.job, args.vars_file)) != EXIT_USAGE
        return EXIT_SUCCESS if recorded else EXIT_USAGE
    target = Path(args.job)
    if target.is_dir():
        results_dir, job_id = target.absolute().parent, target.name
    else:
        results_dir, job_id = args.results_dir, args.job
    return _print_result(slurm_multi.collect(job_id, results_dir, attempt=args.attempt))


def _report(args) -> int:
    from slurm_multi.reports import job_view
    from slurm_multi.reports import text as report

    results_dir = Path(args.results_dir or slurm_multi.default_results_dir())
    jobs = args.job or []
    try:
        tolerance = report.parse_tolerance(args.tolerance)
        report.validate_job_ids(jobs)
        baseline = _baseline(args, results_dir)
        if args.html:
            from slurm_multi.reports import html as html_report

            written = html_report.write_report(args.html, results_dir, jobs, args.model, baseline, tolerance)
            print(f"HTML report: {written.path} ({written.summary})")
        else:
            perf = _perf_rows(report, results_dir, jobs, args.model)
            print(report.perf_table(perf))
            for job in jobs:
                print()
                print("\n".join(job_view.hang_lines(results_dir, job) + job_view.timeline_lines(results_dir, job)))
        if baseline is None:
            return EXIT_SUCCESS
        if baseline.kind == "file":
            perf = _perf_rows(report, results_dir, jobs, args.model)
            reference = report.read_perf_csv(baseline.value)
            if args.model is not None:
                reference = reference[reference["model"] == args.model]
            comparison = report.compare_with_reference(perf, reference, tolerance)
        else:
            records, skipped = report.read_records(results_dir)
            for line in skipped:
                print(f"skipped an unreadable record: {line}", file=sys.stderr)
            comparison = report.compare_runs(report.history_frame(records), baseline, tolerance, jobs, args.model)
    except report.ReportError as exc:
        raise slurm_multi.SlurmMultiError(str(exc)) from None
    print()
    print(f"Compared with {baseline.describe()} (tolerance {tolerance:.2%}):")
    print(report.comparison_table(comparison))
    return EXIT_FAILURE if report.any_failed(comparison) else EXIT_SUCCESS


def _baseline(args, results_dir):
    """The comparison's baseline: --compare FILE, --baseline JOB|last:N|FILE, --compare alone the default one."""
    from slurm_multi.reports import text as report

    if args.compare and args.baseline:
        raise report.ReportError(
            f"--compare {args.compare} and --baseline {args.baseline} both name a baseline: give one "
            "(--compare --baseline X, or --compare REF.csv)"
        )
    if args.compare:
        return report.Baseline("file", args.compare)
    if args.baseline:
        return report.parse_baseline(args.baseline, results_dir)
    if args.compare is not None:  # --compare alone
        return report.parse_baseline(report.DEFAULT_BASELINE, results_dir)
    return None


def _perf_rows(report, results_dir, jobs, model):
    """The perf rows shown and compared with a file: the jobs' (records/<job>.csv) or perf.csv's; one model's."""
    import pandas as pd

    if jobs:
        perf = pd.concat([report.read_perf_csv(results_dir / "records" / f"{job}.csv") for job in jobs])
    else:
        perf = report.read_perf_csv(results_dir / "perf.csv")
    return perf if model is None else perf[perf["model"] == model]


def _stacks(args) -> int:
    from slurm_multi.job_stacks import job_stacks

    texts, problems = job_stacks(
        args.job, args.results_dir or slurm_multi.default_results_dir(), say=lambda line: print(line, file=sys.stderr)
    )
    print("\n".join(texts), end="")
    for problem in problems:
        print(f"slurm-multi stacks: {problem}", file=sys.stderr)
    return EXIT_USAGE if problems else EXIT_SUCCESS


def _logs(args) -> int:
    from slurm_multi.reports import job_view
    from slurm_multi.submission import sbatch

    with contextlib.suppress(KeyboardInterrupt):
        job_view.follow_logs(
            args.results_dir or slurm_multi.default_results_dir(),
            args.job,
            follow=args.follow,
            node=args.node,
            rank=args.rank,
            emit=lambda line: print(line, flush=True),
            colour=job_view.use_colour(sys.stdout),
            job_info=sbatch.job_info,
        )
    return EXIT_SUCCESS


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tags",
        nargs="+",
        required=True,
        metavar="TAG",
        help="the models to run: model names or tags of the models file (MAD's --tags); several images run one "
        "after another in the one allocation, each with its own record (a sweep: docs/sweeps.md)",
    )
    parser.add_argument(
        "--stop-on-failure",
        action="store_true",
        help="a sweep of several models stops at the first one that fails (default: every model runs)",
    )
    parser.add_argument(
        "--models-file",
        metavar="FILE",
        help="the model zoo's models.json (default: the sample models shipped with slurm-multi)",
    )
    parser.add_argument("--results-dir", metavar="DIR", help=RESULTS_DIR_HELP)
    parser.add_argument(
        "--registry",
        metavar="REGISTRY",
        help="push/pull through this registry instead of the shared image cache (e.g. "
        "docker.io/myorg/bench, ghcr.io/org/repo, localhost:5000/repo; ns/repo means Docker Hub)",
    )
    parser.add_argument(
        "--image-transport",
        metavar="{" + ",".join(IMAGE_TRANSPORTS) + "}",
        help="how rank 0's image reaches the workers: cache (the shared tar cache) or registry (needs --registry); "
        f"default: the image_transport setting ({IMAGE_TRANSPORT}), registry when --registry is given",
    )
    parser.add_argument(
        "--credentials",
        metavar="FILE",
        help="registry mode's login: MAD's credential.json, whose entry for the registry's host the nodes use for "
        "docker login (default: ./credential.json when it has an entry for the registry)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="MAD's deployment config (JSON): a 'slurm' section (nodes, partition, time...) and context keys, "
        "unknown keys refused; over the manifest's, under --additional-context-file, -c and the SLURM options",
    )
    parser.add_argument(
        "-c",
        "--additional-context",
        metavar="JSON",
        help="MAD's additional context: a JSON object merged recursively over the defaults "
        "(its 'slurm' section gives defaults for the SLURM options); secrets only as "
        'references, e.g. {"docker_env_vars": {"HF_TOKEN": "${MAD_SECRETS_HFTOKEN}"}}',
    )
    parser.add_argument(
        "--additional-context-file", metavar="FILE", help="MAD's additional context from a file; -c is merged over it"
    )
    parser.add_argument(
        "--manifest", metavar="FILE", help="run the images of this build_manifest.json instead of building"
    )
    parser.add_argument(
        "--use-image",
        metavar="IMAGE",
        help="run this prebuilt image instead of building (MAD's --use-image; --tags names its model card): a local "
        "image of rank 0 goes to the workers like a built one, a registry image is pulled by digest on every node",
    )
    parser.add_argument(
        "-e",
        "--extra-vars",
        action="append",
        metavar="VARS",
        help="set any setting (docs/settings.md) as ansible-playbook's -e does: KEY=VALUE (VALUE read as YAML), a "
        "JSON or YAML mapping, or @FILE. Repeatable, later wins; wins over the settings files and environment; a "
        "flag giving the same setting must agree. Secrets go through MAD_SECRETS_* instead",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        help="push: one ansible-playbook drives every node; pull: one srun step starts an ansible-playbook on every "
        "node, each against itself (default: push; docs/cluster.md, 'Push or pull')",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurm-multi",
        description="Run one containerized benchmark or training across several GPU nodes of a SLURM cluster.",
        epilog="Exit codes: 0 SUCCESS, 1 FAILURE, 2 bad usage or infrastructure problem.",
    )
    parser.add_argument("--version", action="version", version=f"slurm-multi {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    submit = commands.add_parser(
        "submit",
        help="submit the pipeline as a SLURM job (and a collect job after it)",
        description="Render the job's sbatch script and submit it, with a one-node collect job queued "
        "--dependency=afterany on it that records the job whatever its end. MAD_SECRETS_* of your "
        "environment (at least 8 characters each) go to a 0600 file in the job's private dir "
        "(~/.slurm-multi/jobs/), not to the job; export them, never give them values in -c.",
    )
    submit.add_argument(
        "--nodes", "-N", type=int, metavar="N", help="number of nodes (required unless -c gives slurm.nodes)"
    )
    _add_model_options(submit)
    slurm = submit.add_argument_group("SLURM options (an #SBATCH line only for those given)")
    slurm.add_argument("--partition", "-p", metavar="P")
    slurm.add_argument("--reservation", metavar="R")
    slurm.add_argument("--nodelist", "-w", metavar="NODES", help="hostlist, e.g. gpu[001-004]")
    slurm.add_argument("--exclude", "-x", metavar="NODES")
    slurm.add_argument("--time", "-t", metavar="TIME", help="time limit: minutes, HH:MM:SS or D-HH:MM:SS")
    slurm.add_argument("--gpus-per-node", metavar="G", help="count or type:count")
    slurm.add_argument("--account", "-A", metavar="A")
    slurm.add_argument("--qos", metavar="Q")
    slurm.add_argument(
        "--exclusive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whole nodes (default: yes; Docker bypasses SLURM's cgroups)",
    )
    submit.add_argument(
        "--wait",
        action="store_true",
        help="follow the job (per-node, per-stage progress), print its perf rows, exit with its verdict",
    )
    submit.add_argument(
        "--follow",
        action="store_true",
        help="with --wait: also show every rank's log lines as the nodes write them (node3 r2 | ...)",
    )
    submit.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="N",
        help="resubmit a failed job up to N times without the nodes its failure is attributable to (preflight "
        "problem, Docker down, node lost, barrier timeout); a model failure is never retried (default: 0)",
    )
    submit.add_argument(
        "--preflight",
        action="store_true",
        help="first run the preflight checks on the candidate nodes of the partition/reservation (one short srun), "
        "then submit on healthy ones (--nodelist) with the others in --exclude; says which were left out and why",
    )
    submit.add_argument("--dry-run", action="store_true", help="print the scripts and vars; write and submit nothing")
    submit.set_defaults(handler=_submit)

    run = commands.add_parser(
        "run",
        help="run the pipeline inside this allocation (salloc or an sbatch script)",
        description="Run run_multi.yml then collect.yml in the current allocation, one fork per node.",
    )
    _add_model_options(run)
    run.add_argument(
        "--local",
        action="store_true",
        help="outside an allocation (no SLURM_JOB_ID): run the pipeline on this host as a one-node job (without it, "
        "`run` refuses there: on a login node it would build the image there)",
    )
    run.add_argument(
        "--job-id",
        metavar="ID",
        help="the run's ID (default: $SLURM_JOB_ID); give another one for a second run in the same allocation",
    )
    run.set_defaults(handler=_run)

    collect = commands.add_parser("collect", help="collect a job's results again (its record, once written, stays)")
    collect.add_argument("job", metavar="JOB", help="the job's directory, or its job ID (with --results-dir)")
    collect.add_argument("--results-dir", metavar="DIR", help=RESULTS_DIR_HELP)
    collect.add_argument(
        "--attempt",
        metavar="N",
        type=int,
        help="the attempt of a requeued job (SLURM_RESTART_COUNT: 0, 1...; default: its last)",
    )
    collect.add_argument(
        "--after-job",
        action="store_true",
        help="as the afterany collect job: if the ended job left no record, write a FAILURE record "
        "with SLURM's job state; then regenerate perf.csv (exit 0 once the job is recorded)",
    )
    collect.add_argument("--vars-file", metavar="FILE", help="the job's vars.json (with --after-job)")
    collect.set_defaults(handler=_collect)

    report = commands.add_parser(
        "report", help="print the perf table, compare it with a baseline (exit 1 on a regression), write an HTML report"
    )
    report.add_argument("--results-dir", metavar="DIR", help=RESULTS_DIR_HELP)
    report.add_argument(
        "--job",
        metavar="ID",
        nargs="+",
        help="only these jobs' rows (and each one's stage timeline); with --html, these jobs' pages",
    )
    report.add_argument("--model", metavar="M", help="only this model's rows, runs and history")
    report.add_argument(
        "--compare",
        metavar="REF.csv",
        nargs="?",
        const="",
        help="compare each model's latest figure with a baseline and exit 1 when one got worse beyond the "
        "tolerance: this reference CSV, --baseline's, or alone the median of the model's last 5 successful runs",
    )
    report.add_argument(
        "--baseline",
        metavar="B",
        help="what --compare compares with (and implies it): a job ID (its rows), last:N (per model, the median of "
        "its last N successful runs recorded before the run compared) or a reference perf CSV",
    )
    report.add_argument(
        "--html",
        metavar="FILE",
        help="write one self-contained HTML report (no network needed): each job's verdict, per-node table and "
        "stage timeline chart, and each model's perf history with the baseline and tolerance band",
    )
    report.add_argument(
        "--tolerance",
        metavar="T",
        default="5%",
        help="allowed degradation, a fraction or a percentage (default: 5%%); lower is worse for "
        "rates, higher is worse for times (ms, s, latency)",
    )
    report.set_defaults(handler=_report)

    logs = commands.add_parser(
        "logs",
        help="every rank's log, interleaved as the nodes write them (node3 r2 | ...)",
        description="Show the run.log of every node of the job's last attempt, each line prefixed with its node "
        "and rank; colours on a terminal, none in a pipe (or with NO_COLOR). --follow keeps showing new lines "
        "until the job ends (SLURM's state; a run outside SLURM: until it is recorded).",
    )
    logs.add_argument("job", metavar="JOB", help="the job's ID")
    logs.add_argument("--results-dir", metavar="DIR", help=RESULTS_DIR_HELP)
    logs.add_argument("--follow", "-f", action="store_true", help="keep following until the job has ended")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--node", metavar="N", help="only this node's lines")
    which.add_argument("--rank", metavar="R", type=int, help="only this rank's lines")
    logs.set_defaults(handler=_logs)

    stacks = commands.add_parser(
        "stacks",
        help="every rank's Python stacks of a running job, the job going on (what is it doing now?)",
        description="Take the Python stacks of every process of the job's container on each of its nodes (py-spy, "
        "from the host: each process pauses for the instant of its dump), write them beside each node's log as "
        "nodes/<node>/stacks-<UTC time>.txt and print them, node by node. The job goes on.",
    )
    stacks.add_argument("job", metavar="JOB", help="the running job's ID")
    stacks.add_argument("--results-dir", metavar="DIR", help=RESULTS_DIR_HELP)
    stacks.set_defaults(handler=_stacks)

    settings = commands.add_parser(
        "settings",
        help="every setting as a job submitted from here would get it, and where its value comes from",
        description="List every setting (docs/settings.md) with the value a job submitted from here gets and its "
        "source: default, the site's or your settings file, an environment variable, or -e. An inventory of your "
        "own (group_vars beside it) can still change it for some nodes: Ansible decides there.",
    )
    settings.add_argument(
        "-e", "--extra-vars", action="append", metavar="VARS", help="as submit's -e: show what they would change"
    )
    settings.set_defaults(handler=_settings)

    lab_parser = commands.add_parser("lab", help="the built-in lab cluster: real SLURM + Docker nodes on this machine")
    lab_commands = lab_parser.add_subparsers(dest="lab_command", metavar="ACTION", required=True)
    up = lab_commands.add_parser("up", help="start (or repair) the lab; idempotent")
    up.add_argument(
        "--nodes",
        type=int,
        default=3,
        help="number of nodes, 1-8 (default: 3); a running lab with fewer grows, one with more stays as it is",
    )
    lab_commands.add_parser("status", help="show sinfo and each lab daemon's state")
    lab_commands.add_parser("down", help="stop every lab daemon and undo what `up` added to /etc")
    lab_commands.add_parser(
        "pytorch-base",
        help="make the PyTorch sample's base (Debian bookworm and the torch CPU wheel, a 1 GB tar) once per machine: "
        "a few minutes the first time, nothing after (the torch samples and their tests import it on their nodes)",
    )
    lab_parser.set_defaults(handler=_lab)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    if args.command == "lab":
        return args.handler(args)
    try:
        return args.handler(args)
    except UserError as exc:  # an error the user can fix is reported by its message; a bug keeps its traceback
        print(f"slurm-multi {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
