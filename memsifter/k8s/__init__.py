"""Kubernetes platform: the pipeline driver that runs stage RayJobs in dependency order, and what it
needs at run time; the chart generation and checks are repository tooling in :mod:`.dev`.

Run time (the stage and driver images):

* :mod:`.registry` — what the Kubernetes layer knows about each stage, read from ``memsifter.stage``.
* :mod:`.driver` — ``memsifter k8s drive``: creates the stage RayJobs in dependency order, waits,
  resumes, writes the run manifest.
* :mod:`.capacity` — ``memsifter k8s await-capacity``: asks the Ray autoscaler for GPU nodes and waits.
* :mod:`.published` — ``memsifter k8s await-published``: waits for a stage output's ``_SUCCESS`` (the
  RayService's init container waits for the index it serves).
* :mod:`.cli` — ``memsifter k8s ...`` (the tooling commands import :mod:`.dev` only when called).

Tooling (never imported at run time): :mod:`.dev` — ``gen-chart``/``gen-jobs`` (:mod:`.dev.chart`),
RayJob validation (:mod:`.dev.validate`), the checkov policy scan (:mod:`.dev.policy`), the helm and
checkov binaries (:mod:`.dev.tools`).
"""
