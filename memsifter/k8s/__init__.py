"""Kubernetes platform: the pipeline driver that runs a plan's stage RayJobs in its order, and what it
needs at run time; the chart generation is repository tooling in :mod:`memsifter_dev.k8s` (not installed
in the images).

Run time (the stage and driver images):

* :mod:`.registry` — what the Kubernetes layer knows about each stage, read from ``memsifter.stage``.
* :mod:`.plan` — ``memsifter k8s plan``: a pipeline config's plan (:func:`memsifter.pipeline.plan`) as the
  chart's ``pipeline`` value.
* :mod:`.driver` — ``memsifter k8s drive``: creates the plan's RayJobs in the plan's order, waits,
  resumes, writes the run manifest.
* :mod:`.capacity` — ``memsifter k8s await-capacity``: asks the Ray autoscaler for GPU nodes and waits.
* :mod:`.published` — ``memsifter k8s await-published``: waits for a stage output's ``_SUCCESS`` (the
  RayService's init container waits for the index it serves).
* :mod:`.validate` — ``memsifter k8s validate``: KubeRay manifests checked offline against the packaged
  KubeRay CRDs (``crds/``): a user checks what they will apply.
* :mod:`.cli` — ``memsifter k8s ...`` (``gen-chart``/``gen-jobs`` import :mod:`memsifter_dev.k8s` only
  when called).
"""
