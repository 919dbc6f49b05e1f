"""slurm-multi: one containerized benchmark or training across several GPU nodes of a SLURM cluster.

What users call::

    import slurm_multi

    spec = slurm_multi.job_spec(["dummy"], results_dir="/shared/results")
    result = slurm_multi.run(spec)                                          # inside salloc / sbatch
    submission = slurm_multi.submit(spec, slurm_multi.slurm_options(3, partition="gpu"))
    result = slurm_multi.wait(submission)                                   # from the login node
    result = slurm_multi.collect(submission.job_id, spec.results_dir)      # postprocessing again

Each name is imported on first use, so that ``import slurm_multi`` (and ``slurm-multi --help``) stays cheap:
the API brings in ansible-core, ansible-runner and pandas.
"""

from importlib import import_module

__version__ = "0.1.0"

# Public name -> the module that defines it.
_PUBLIC = {
    "job_spec": "slurm_multi.spec",
    "slurm_options": "slurm_multi.spec",
    "JobSpec": "slurm_multi.spec",
    "SlurmOptions": "slurm_multi.submission.sbatch",
    "run": "slurm_multi.runner",
    "collect": "slurm_multi.runner",
    "plan_submission": "slurm_multi.submission.submit",
    "submit": "slurm_multi.submission.submit",
    "wait": "slurm_multi.submission.follow",
    "Submission": "slurm_multi.submission.submit",
    "SubmissionPlan": "slurm_multi.submission.submit",
    "RunResult": "slurm_multi.run_result",
    "SlurmMultiError": "slurm_multi.errors",
    "default_results_dir": "slurm_multi.paths",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'slurm_multi' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
