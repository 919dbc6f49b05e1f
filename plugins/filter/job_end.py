"""Filters: when the SLURM job ends, and how long before that the running stage stops the model."""

import datetime
import os
import time

from ansible.errors import AnsibleFilterError

from ansible_collections.slurm_multi.pipeline.plugins.module_utils.slurm.allocation import squeue_job_end

# squeue's %e: the job's end in the cluster's local time, as SLURM prints every timestamp.
SQUEUE_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"
# What squeue prints when the job has no known end (NONE: no time limit; N/A, Unknown: not started yet), or nothing
# when the job is not SLURM's or squeue failed.
NO_END_TIME = ("", "N/A", "Unknown", "NONE")
# Where the sbatch script hands on squeue's %e, read once for the whole job (pull mode: not once per node).
JOB_END_ENV = "SLURM_MULTI_JOB_END"


def slurm_job_end_epoch(job_id, environ=None):
    """When SLURM job ``job_id`` ends, as a UNIX epoch, or None (no job, no known end, or squeue failed): from
    ``$SLURM_MULTI_JOB_END`` when the sbatch script set it (pull mode: asked once, not by every node), else squeue."""
    environ = os.environ if environ is None else environ
    if not job_id:
        return None
    text = environ[JOB_END_ENV] if JOB_END_ENV in environ else squeue_job_end(str(job_id))
    return squeue_end_epoch(text)


def squeue_end_epoch(text):
    """The job's end as a UNIX epoch from ``squeue -h -j <job> -o %e``, or None when SLURM knows no end.

    A value that is neither a timestamp nor one of SLURM's "no end" words is an error: a run that silently lost
    its end would be killed at the time limit instead of stopped with its diagnostics.
    """
    lines = ("" if text is None else str(text)).strip().splitlines()
    # A heterogeneous job prints one line per component, all with the job's end.
    end_text = lines[0].strip() if lines else ""
    if end_text in NO_END_TIME:
        return None
    try:
        # Naive local time, as squeue prints it and as the node's clock reads it.
        return int(datetime.datetime.strptime(end_text, SQUEUE_TIME_FORMAT).timestamp())
    except ValueError:
        raise AnsibleFilterError(
            f"squeue printed {end_text[:80]!r} as the job's end time (-o %e): expected YYYY-MM-DDTHH:MM:SS, "
            f"NONE, N/A or Unknown. Check that `squeue` on the controller is SLURM's (not a site wrapper changing its "
            f"output)."
        ) from None


def model_stop_margin(end_epoch, margin, now=None):
    """Seconds before the job's end at which the model is stopped: ``margin``, or a quarter of the time left (as the
    sbatch script's early warning), so a short job still runs most of its time; None (no known end) keeps it."""
    try:
        margin_seconds = int(margin)
    except (TypeError, ValueError):
        raise AnsibleFilterError(
            f"job_end_margin must be a whole number of seconds, not {str(margin)[:80]!r}: set it in "
            f"group_vars/all.yml or with -e job_end_margin=240."
        ) from None
    if margin_seconds < 0:
        raise AnsibleFilterError(f"job_end_margin must not be negative ({margin_seconds}): set e.g. 240.")
    if end_epoch is None or end_epoch == "":
        return margin_seconds
    remaining = float(end_epoch) - (time.time() if now is None else float(now))
    return min(margin_seconds, int(remaining / 4))


class FilterModule:
    def filters(self):
        return {
            "slurm_job_end_epoch": slurm_job_end_epoch,
            "model_stop_margin": model_stop_margin,
        }
