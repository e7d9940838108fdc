"""Repository tooling of memsifter: builds and checks what ships, never runs in a stage or driver image.

The images copy and install ``memsifter/`` only (``images/base/Dockerfile``); this package is installed by
the development venv (``scripts/setup.sh``, an editable install of the repository). :mod:`.k8s`: the Helm
chart's and ``jobs/``'s generation, the checkov policy scan, the helm/checkov binaries.
"""
