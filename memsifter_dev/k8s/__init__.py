"""Repository tooling for the Kubernetes layer (``memsifter_dev``: not installed in the images).

A stage image runs ``memsifter run <stage>`` (and the driver image ``memsifter k8s drive`` /
``await-capacity``): :mod:`memsifter.k8s.driver`, :mod:`memsifter.k8s.capacity`,
:mod:`memsifter.k8s.registry`. What lives here only builds and checks what ships:

* :mod:`.chart` — ``memsifter k8s gen-chart`` / ``gen-jobs``: the chart's generated files from the stage
  registry (:mod:`.values`: values.yaml, README and stage facts from one table; :mod:`.schema`:
  values.schema.json; :mod:`.scenarios`: ci/ and jobs/ example values; :mod:`.serve`: the memory service's
  RayService values, facts and examples), ``helm template`` rendering, size targets;
* :mod:`.policy` — checkov over every rendered scenario (``python -m memsifter_dev.k8s.policy``);
* :mod:`.tools` — the ``helm`` binary (``scripts/helm``) and ``checkov``.

What a user needs stays in the runtime package: ``memsifter k8s plan`` (:mod:`memsifter.k8s.plan`) and
``memsifter k8s validate`` (:mod:`memsifter.k8s.validate`, with the KubeRay CRDs it reads).
``tests/test_k8s_runtime.py`` checks that no runtime path imports this package.
"""
