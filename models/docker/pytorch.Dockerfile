# CONTEXT {'guest_os': 'UBUNTU'}
# pyt_ddp_tiny's image: one thin layer over a PyTorch base, as MAD's models build over rocm/pytorch. The lab provides
# slurm-multi-lab/pytorch:2.13.0 (Debian bookworm, Python 3.11, the torch 2.13.0 CPU wheel; slurm_multi/lab/pytorch.py)
# on node1; on a real cluster, pass e.g. -c '{"docker_build_arg": {"BASE_DOCKER": "rocm/pytorch:latest"}}'.
ARG BASE_DOCKER=slurm-multi-lab/pytorch:2.13.0
FROM $BASE_DOCKER
LABEL org.opencontainers.image.title="slurm-multi PyTorch sample (DDP over gloo)"
# The model's own layer: a few bytes, and proof at build time that torch imports.
RUN python3 -c "import torch; print(torch.__version__)" > /opt/torch-version
WORKDIR /myworkspace
