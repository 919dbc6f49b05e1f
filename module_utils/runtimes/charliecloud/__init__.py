"""Charliecloud, an unprivileged runtime with no daemon: ch-image builds, one squashfs file in the shared cache is the
image, ch-run runs it in place (SquashFUSE) or from a directory unpacked once per node; the ranks are the user's own
processes."""

NAME = "charliecloud"
