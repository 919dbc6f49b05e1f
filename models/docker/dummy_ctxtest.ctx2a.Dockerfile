# CONTEXT {'ctx_test': 2}
# dummy_ctxtest, variant a: one of two Dockerfiles whose CONTEXT fits ctx_test 2 (as madengine's fixture): with
# -c '{"ctx_test": 2}' the model is a sweep of both images, one run and one record each.
ARG BASE_DOCKER=slurm-multi-lab/busybox:latest
FROM $BASE_DOCKER
LABEL org.opencontainers.image.title="slurm-multi sample models (dummy_ctxtest variant a)"
WORKDIR /myworkspace
