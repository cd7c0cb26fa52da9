"""Shared test settings."""

import os

# Open MPI refuses to run as root without these; CI runs as root.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
