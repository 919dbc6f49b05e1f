# CONTEXT {'ctx_test': 1}
# dummy_ctxtest's variant for ctx_test 1: the CONTEXT filter leaves it out of a ctx_test 2 run.
ARG BASE_DOCKER=slurm-multi-lab/busybox:latest
FROM $BASE_DOCKER
LABEL org.opencontainers.image.title="slurm-multi sample models (dummy_ctxtest ctx_test 1)"
WORKDIR /myworkspace
