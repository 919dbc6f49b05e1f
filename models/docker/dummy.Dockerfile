# CONTEXT {'guest_os': 'UBUNTU'}
# The sample models' image. MAD-style: the base comes from the run context's docker_build_arg BASE_DOCKER;
# the lab cluster provides slurm-multi-lab/busybox (busybox-static FROM scratch) on every node, so this builds
# offline. On a real cluster, pass e.g. -c '{"docker_build_arg": {"BASE_DOCKER": "rocm/pytorch:latest"}}'.
ARG BASE_DOCKER=slurm-multi-lab/busybox:latest
FROM $BASE_DOCKER
LABEL org.opencontainers.image.title="slurm-multi sample models"
WORKDIR /myworkspace
