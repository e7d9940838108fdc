"""Repository tooling for the Kubernetes layer: not needed, and never imported, at run time.

A stage image runs ``memsifter run <stage>`` (and the driver image ``memsifter k8s drive`` /
``await-capacity``): :mod:`memsifter.k8s.driver`, :mod:`memsifter.k8s.capacity`,
:mod:`memsifter.k8s.registry`. What lives here only builds and checks what ships:

* :mod:`.chart` — ``memsifter k8s gen-chart`` / ``gen-jobs``: the chart's generated files from the stage
  registry (:mod:`.values`: values.yaml, README and stage facts from one table; :mod:`.schema`:
  values.schema.json; :mod:`.scenarios`: ci/ and jobs/ example values; :mod:`.serve`: the memory service's
  RayService values, facts and examples), ``helm template`` rendering, size targets;
* :mod:`.validate` — ``memsifter k8s validate``: RayJob checks (CRD schema strict, CEL, KubeRay admission), and
  the same for the RayService;
* :mod:`.policy` — checkov over every rendered scenario (``python -m memsifter.k8s.dev.policy``);
* :mod:`.tools` — the ``helm`` binary (``scripts/helm``) and ``checkov``.

``tests/test_k8s_runtime.py`` checks that no runtime path imports this package.
"""
