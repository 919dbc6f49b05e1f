"""The Python API in one module: run the pipeline in this allocation, submit it as a SLURM job and follow it,
collect a job. What users call is also exported by the package itself (``from slurm_multi import run``).

    from slurm_multi import api

    spec = api.job_spec(["dummy"], results_dir="/shared/results", additional_context='{"gpu_vendor": "AMD"}')
    result = api.run(spec, on_event=print)                         # inside salloc / sbatch
    submission = api.submit(spec, api.SlurmOptions(nodes=3, partition="gpu"))
    result = api.wait(submission, on_progress=print)               # from the login node
    result.status, result.per_node, result.perf                    # perf: a pandas DataFrame of the record's rows

Each idea lives in its own module, re-exported here: what to run (`slurm_multi.spec`), the job's vars file
(`slurm_multi.submission.job_vars`), running it here through ansible-runner (`slurm_multi.runner`), submitting it
(`slurm_multi.submission.submit`), following it (`slurm_multi.submission.follow`), recording its end
(`slurm_multi.submission.job_end`), its outcome (`slurm_multi.run_result`). Bad input raises `SlurmMultiError` with a
message that says what to fix; nothing has been submitted then.
"""

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.job.defaults import RESULTS_DIR_ENV
from slurm_multi.errors import SlurmMultiError
from slurm_multi.paths import STATE_DIR_NAME, default_results_dir, private_jobs_dir
from slurm_multi.run_result import RunResult, job_result
from slurm_multi.runner import collect, run, run_playbook
from slurm_multi.spec import MAD_SLURM_KEYS, JobSpec, job_spec, slurm_options
from slurm_multi.submission.follow import wait
from slurm_multi.submission.job_end import record_job_end
from slurm_multi.submission.job_vars import (
    UNSAFE_MARKER,
    VARS_FILE_NAME,
    mark_unsafe,
    read_job_vars,
    unmark_unsafe,
    write_job_vars,
)
from slurm_multi.submission.sbatch import (
    ACTIVE_JOB_STATES,
    COLLECT_SCRIPT_NAME,
    JOB_SCRIPT_NAME,
    SlurmOptions,
    find_ansible_playbook,
)
from slurm_multi.submission.submit import (
    JOB_ID_PLACEHOLDER,
    SUBMISSION_FILE_NAME,
    Submission,
    SubmissionPlan,
    plan_submission,
    submit,
)

__all__ = [
    "ACTIVE_JOB_STATES",
    "COLLECT_SCRIPT_NAME",
    "JOB_ID_PLACEHOLDER",
    "JOB_SCRIPT_NAME",
    "MAD_SLURM_KEYS",
    "RESULTS_DIR_ENV",
    "STATE_DIR_NAME",
    "SUBMISSION_FILE_NAME",
    "UNSAFE_MARKER",
    "VARS_FILE_NAME",
    "JobSpec",
    "RunResult",
    "SlurmMultiError",
    "SlurmOptions",
    "Submission",
    "SubmissionPlan",
    "collect",
    "default_results_dir",
    "find_ansible_playbook",
    "job_result",
    "job_spec",
    "mark_unsafe",
    "plan_submission",
    "private_jobs_dir",
    "read_job_vars",
    "record_job_end",
    "run",
    "run_playbook",
    "slurm_options",
    "submit",
    "unmark_unsafe",
    "wait",
    "write_job_vars",
]
